"""The train step's compiled program on trl_step.py's first batch: trace + lower, compile, and
run times with the reference equal to the policy (a fresh run's first step: the reference
forward is skipped) and one ulp away (every later step, and a resumed run's first).

    python benchmarks/trl_step.py --worker prepare small --dir D --steps 1 --warmup 1
    python benchmarks/train_program.py --dir D [--size small] [--runs 2]

Runs trl_step.py's grpo_jax worker until its first train-step call, times that call's program
as below instead of running the step, and exits. Prints one line per measurement.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import trl_step  # noqa: E402  (puts the repository on sys.path)
from grpo_jax import hosts, train_step  # noqa: E402


def timed_program(runs):
  def call(self, state, batch, ref_params=None, hparams=None):
    batch = hosts.put(batch, train_step.batch_shardings(batch, self.mesh))
    fn = self.program(batch, self.needs_ref(batch))
    hp = self.hparams if hparams is None else hparams
    t0 = time.perf_counter()
    lowered = fn.lower(state, hp, ref_params, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    print(f"train program: trace + lower {t1 - t0:.2f} s, compile "
          f"{time.perf_counter() - t1:.2f} s", flush=True)
    refs = {"reference = policy": jax.tree.map(jnp.copy, state["params"]),
            "reference one ulp away": ref_params}
    for _ in range(runs):
      for name, ref in refs.items():
        st = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # the program donates it
        t = time.perf_counter()
        _, metrics, _ = jax.block_until_ready(compiled(st, hp, ref, batch))
        print(f"run, {name}: {time.perf_counter() - t:.2f} s (loss/kl "
              f"{float(metrics['loss/kl']):.3g})", flush=True)
    sys.stdout.flush()
    os._exit(0)  # the worker would report any exception (SystemExit too) as a failure
  return call


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dir", required=True, help="a directory trl_step.py's prepare worker filled")
  p.add_argument("--size", default="small", choices=list(trl_step.SIZES))
  p.add_argument("--runs", type=int, default=2, help="runs of each reference, alternated")
  args = p.parse_args()
  train_step.TrainStep.__call__ = timed_program(args.runs)
  # The worker's first step would compile this program in the background while it samples
  # (TrainStep.precompile); here it compiles on the call, alone, so that it can be timed.
  train_step.TrainStep.precompile = lambda *args, **kwargs: None
  trl_step.worker(trl_step.parse_args(["--worker", "grpo_jax", args.size, "--dir", args.dir,
                                       "--steps", "1"]))


if __name__ == "__main__":
  main()
