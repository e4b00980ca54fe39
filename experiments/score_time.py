"""What scoring one sampling round costs the host: rollout.score_samples (decoding 128
completions and scoring them with the run's rewards) on a tiny-preset run's own completions, for
this checkout and, with --tree, another one, alternated in one process each. In a vmapped
group this runs once per member and round, one member after another, while the device waits.

    PYTHONPATH=$PWD python3 experiments/score_time.py RUN_WORKDIR [--tree=OTHER_CHECKOUT]

RUN_WORKDIR: a finished tiny-preset run with completions in samples.jsonl (for example one made
with --config.train.samples_per_step=128). Its completions fill 16 prompts x G = 8 rows (20
tokens at most, as the sweep's runs sample); prints the median of 20 rounds of 10 calls.
Measured in experiments/group_cuts.md ("The members' scoring").
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROUNDS, CALLS, ROWS, WIDTH = 20, 10, 128, 20


def _time_calls(workdir: str) -> None:
  """In the child: one median per round, printed as JSON lines."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from grpo_jax import rollout  # pylint: disable=import-outside-toplevel
  from grpo_jax.rewards import build_rewards  # pylint: disable=import-outside-toplevel
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  tok = transformers.AutoTokenizer.from_pretrained(os.path.join(workdir, "tokenizer"))
  with open(os.path.join(workdir, "samples.jsonl")) as f:
    ids = [tok(json.loads(line)["completion"])["input_ids"][:WIDTH] for line in f]
  with open(os.path.join(workdir, "data", "train.jsonl")) as f:
    rows = [json.loads(line) for _, line in zip(range(ROWS // 8), f)]
  out = type("Out", (), {})()
  out.tokens, out.lengths = np.zeros((ROWS, WIDTH), np.int32), np.zeros(ROWS, np.int32)
  out.truncated, out.metrics = np.zeros(ROWS, bool), {}
  for i in range(ROWS):
    row = ids[i % len(ids)]
    out.tokens[i, :len(row)], out.lengths[i] = row, len(row)
  prompts = rollout.encode(config, tok, rows)
  rewards = build_rewards(config.rewards)
  call = lambda: rollout.score_samples(config, tok, rows, prompts, out, rewards, 0.0)
  call()
  for _ in range(ROUNDS):
    t = time.perf_counter()
    for _ in range(CALLS):
      call()
    print(json.dumps((time.perf_counter() - t) / CALLS), flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("workdir")
  p.add_argument("--tree", default=None, help="another checkout, timed alternately")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return _time_calls(args.workdir)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  trees = {"this checkout": here, **({"--tree": os.path.abspath(args.tree)} if args.tree else {})}
  procs = {name: subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), args.workdir, "--child"],
      env=dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL, text=True) for name, tree in trees.items()}
  # The children run side by side (a core each on 2 cores): both see the same machine.
  times = {name: [] for name in procs}
  for _ in range(ROUNDS):
    for name, proc in procs.items():
      times[name].append(float(proc.stdout.readline()))
  for name, proc in procs.items():
    proc.wait()
    print(f"{name}: score_samples on {ROWS} completions, median {1e3 * statistics.median(times[name]):.2f} ms")


if __name__ == "__main__":
  main()
