"""A preset's first GRPO steps on one accelerator, with JAX held to the memory the preset names.

    python3 benchmarks/preset_steps.py --preset 1.5b_lora --tokenizer ../shared/qwen2-tokenizer \\
        --gsm8k ../shared/gsm8k
    python3 benchmarks/preset_steps.py --preset 1.5b_lora --smoke     # CPU, toy shape

The run is `train.run` on the preset of configs/gsm8k.py, changed only where a machine without
the hub needs it:
  - random weights at the checkpoint's real shape (benchmarks/shapes.py; the vocabulary is the
    tokenizer's 151,665 ids, 0.2% under the checkpoint's padded 151,936 rows);
  - GSM8K from a local directory (--gsm8k, its train.jsonl and test.jsonl), every prompt padded
    to the preset's largest prompt bucket: one compile, and the memory of its longest prompts;
  - --steps GRPO steps; the evaluations at the start and the end on one batch
    (train.eval_batch_size prompts); no TensorBoard;
  - no dynamic sampling: a random model earns no reward, so every group would be re-sampled.
Everything the memory depends on is the preset's: rows per step, new tokens, micro-batches,
LoRA rank and targets, β (the reference pass), dtypes, remat.

JAX's allocator is held to --memory_gb (default: 0.97 × the preset's
hardware.memory_gb_per_device, what a card of that size leaves a program beside the driver's
context) through XLA_PYTHON_CLIENT_MEM_FRACTION = memory / the device's total (nvidia-smi). A
step that does not fit then fails with XLA's out-of-memory error, not a figure.

Prints each step's time and phases (metrics.jsonl's time/*), the completions' mean length, and
the process's peak device memory (`memory_stats()['peak_bytes_in_use']`, which includes the
checkpoint's moment in fp32 before the base is cast). The last line is
`preset_steps[<preset>]=ok peak_gb=<peak> limit_gb=<limit>` or `=failed`.

--smoke: the same code on CPU at a toy shape (2 layers × 64, 2 prompts, 8 new tokens), 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
GB = 1e9
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


def build_config(args):
  """The preset's config with the changes the docstring lists."""
  import shapes  # pylint: disable=import-outside-toplevel
  from configs import gsm8k  # pylint: disable=import-outside-toplevel

  c = gsm8k.get_config(args.preset)
  name = Path(str(c.model.checkpoint)).name.removesuffix("-Instruct")
  if args.smoke:
    shape = SMOKE_SHAPE
  elif name in shapes.MODELS:
    shape = {k: v for k, v in shapes.MODELS[name].items() if k != "vocab_size"}
  else:
    sys.exit(f"preset_steps.py: preset {args.preset!r} loads {c.model.checkpoint!r}, whose shape "
             f"benchmarks/shapes.py does not know ({', '.join(shapes.MODELS)})")
  c.model.random_init = True
  c.model.tokenizer = args.tokenizer
  c.model.tiny.update(shape, rope_theta=1e6)
  c.data.source = args.gsm8k
  c.data.prompt_buckets = (max(c.data.prompt_buckets),)  # one compile, at the longest prompts
  c.train.steps = args.steps
  c.train.eval_every = 0
  c.train.dynamic_sampling = False
  c.train.tensorboard = False
  if args.smoke:
    c.train.prompts_per_step, c.sampling.max_new_tokens = 2, 8
    c.train.eval_batch_size = 2
    c.optim.grad_accum_steps = 1
    c.optim.compute_dtype = "float32"
  c.train.eval_examples = c.train.eval_batch_size
  return c


def worker(args) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from grpo_jax import logging_io, train  # pylint: disable=import-outside-toplevel

  config = build_config(args)
  t = time.perf_counter()
  train.run(config, args.workdir)
  wall = time.perf_counter() - t
  rows = [json.loads(x) for x in
          (Path(args.workdir) / logging_io.METRICS_FILE).read_text().splitlines()]
  steps = [r for r in rows if "time/step_s" in r]
  stats = jax.devices()[0].memory_stats() or {}
  print("PRESET_STEPS_RESULT " + json.dumps({
      "device": str(jax.devices()[0].device_kind), "wall_s": wall,
      "peak_gb": stats.get("peak_bytes_in_use", 0) / GB or None,
      "steps": [{k: r.get(k) for k in ("step", "time/step_s", "time/sample_s", "time/reward_s",
                                       "time/train_s", "completion/mean_length")}
                for r in steps]}), flush=True)


def device_total_gb() -> float | None:
  """The first GPU's memory as nvidia-smi reports it, or None without one."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                          "nounits"], capture_output=True, text=True, timeout=30, check=True)
    return float(out.stdout.split()[0]) * 2**20 / GB
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="1.5b_lora", help="a preset of configs/gsm8k.py")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--memory_gb", type=float, default=None,
                 help="hold JAX to this many GB (default: 0.97 x hardware.memory_gb_per_device)")
  p.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "qwen2-tokenizer"))
  p.add_argument("--gsm8k", default=str(ROOT.parent / "shared" / "gsm8k"))
  p.add_argument("--smoke", action="store_true", help="CPU, toy shape (see the docstring)")
  p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    args.steps = 2
  if args.worker:
    worker(args)
    return 0

  config = build_config(args)  # a bad preset fails here, before any process starts
  env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
             HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
  limit = args.memory_gb or 0.97 * config.hardware.memory_gb_per_device
  total = None if args.smoke else device_total_gb()
  if args.smoke:
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    limit = None
  elif total is None:
    print("preset_steps.py: no GPU seen by nvidia-smi: JAX is not held to a memory limit "
          "(on a TPU, pick the chip the preset names)", flush=True)
    limit = None
  else:
    if limit > total:
      sys.exit(f"preset_steps.py: the preset needs {limit:.1f} GB, the device has {total:.1f}")
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{limit / total:.4f}"
  print(f"preset_steps: {args.preset}, {args.steps} steps, "
        f"{config.train.prompts_per_step} prompts x G={config.sampling.num_generations}, up to "
        f"{config.sampling.max_new_tokens} new tokens, {config.optim.grad_accum_steps} "
        f"micro-batches, LoRA rank {config.model.lora.rank}, beta {config.loss.beta}; JAX held "
        f"to {'no limit' if limit is None else f'{limit:.2f} GB of {total:.1f} GB'}", flush=True)
  with tempfile.TemporaryDirectory(prefix="preset_steps_") as tmp:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--preset", args.preset,
           "--steps", str(args.steps), "--tokenizer", args.tokenizer, "--gsm8k", args.gsm8k,
           "--workdir", str(Path(tmp) / "run")] + ["--smoke"] * args.smoke
    # The run's own output passes through as it comes (a run stopped by a time limit still
    # shows how far it got); its last lines are parsed.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:
      print(line, end="", flush=True)
      lines.append(line.rstrip("\n"))
    proc.wait()
  found = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("PRESET_STEPS_RESULT ")]
  if proc.returncode or not found:
    oom = any("RESOURCE_EXHAUSTED" in x or "out of memory" in x.lower() for x in lines)
    print(f"preset_steps[{args.preset}]=failed ({'out of memory' if oom else 'error'}, exit "
          f"{proc.returncode})")
    return 1
  r = found[-1]
  print(f"device {r['device']}; train.run {r['wall_s']:.1f} s (the evaluations and export "
        f"included)")
  print(f"  {'step':>4s}{'step_s':>9s}{'sample':>9s}{'reward':>9s}{'train':>9s}{'length':>9s}")
  for s in r["steps"]:
    cells = [f"{s[k]:.2f}" if s.get(k) is not None else "n/a" for k in
             ("time/step_s", "time/sample_s", "time/reward_s", "time/train_s",
              "completion/mean_length")]
    print(f"  {s['step']:>4}" + "".join(f"{x:>9s}" for x in cells))
  peak = r["peak_gb"]
  print(f"preset_steps[{args.preset}]=ok peak_gb={'n/a' if peak is None else f'{peak:.2f}'} "
        f"limit_gb={'none' if limit is None else f'{limit:.2f}'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
