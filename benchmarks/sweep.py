"""K = 8 tiny-preset GRPO runs: vmapped in one process against 8 separate runs, one after another.

    python3 benchmarks/sweep.py [--steps=4] [--k=8] [--workdir=/tmp/grpo_jax_sweep_bench]
    python3 benchmarks/sweep.py --lora    # the same on tiny_lora: K adapters on one shared base
    python3 benchmarks/sweep.py --members=vmap   # the group batched even on a CPU (train.members)

The runs are an lr sweep (8 rates, seed 0) sharing one warm start, as `python -m grpo_jax.sweep
--vmap` runs it: the warm start is computed once (a prefix run, not timed) and each run starts
from a copy of its step-0 checkpoint. Timed: the 8 separate `python -m grpo_jax.main` processes
one after another, then the one `python -m grpo_jax.train --spec` process running all 8; each arm
includes its process start, compiles, sampling, rewards, updates, evals, checkpoints and the
exported models. The group runs its members as train.members says (--members): by default each
member's programs in turn on a CPU (bit for bit its separate run), batched under jax.vmap
elsewhere, where a tiny model's small kernels are bound by launches.

Compiles: each arm has its own persistent compilation cache (`train.compilation_cache`), a
directory under --workdir that is empty when the arm starts, so no figure depends on what the
user's cache (~/.cache/grpo_jax/xla) or an earlier sweep already holds. The 8 separate runs share
theirs, as runs with the default settings share the user's: the members differ only in lr, which
reaches the programs as an hparam, so run 1 compiles the programs and runs 2..8 load them from
the cache (each run still pays its own process start, and the loads). The vmapped group compiles
its own programs once into its cache; the prefix (warm start) has a third. The caches used are
printed.

Prints `vmapped_sweep_speedup=<separate wall time / vmapped wall time>` (end to end),
`vmapped_step_speedup=<sum of the separate runs' median step times / the group's median step
time>` (steady state: time/step_s, rollouts and update, the first step left out), and the largest
difference between a member's metrics and the matching separate run's (timings aside; see
tests/vmapped_test.py for why they are not bitwise).

--lora runs the tiny_lora preset instead (rank-8 adapters on the warm-started base, β > 0): the
members share the prefix's base (its base_model/, linked into every run's directory by
sweep_runner.start_from_prefix) and the vmapped process holds it once. It then also prints
`lora_members_speedup=` (the end-to-end ratio above) and `lora_members_memory_ratio=`: the
compiled peak of the K-member LoRA train step against one run's at the 1.5b_lora preset's shape
(Qwen2.5-1.5B, one micro-batch of 8 rows per member), from benchmarks/lora_members_memory.py:
batched, as that preset's GPU runs its members by default, or in turn with --members=map.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from grpo_jax import sweep, sweep_runner  # noqa: E402  (no jax: the runs are subprocesses)

CACHES = ("prefix", "separate", "vmapped")  # one compilation cache each, under --workdir
TIMING = ("time/sample_s", "time/reward_s", "time/train_s", "time/step_s",
          "sampler/tokens_per_s", "sampler/seconds",
          "sampler/prefill_seconds")  # logging_io.TIMING_METRICS (not imported: no jax here)


def _main_cmd(config, workdir, args):
  return ([sys.executable, "-m", "grpo_jax.main", f"--config={config}",
           f"--workdir={workdir}"] + [f"--config.{k}={sweep.cli_value(v)}" for k, v in args.items()])


def _env() -> dict:
  """This environment with the repository first on PYTHONPATH (keeping what was there: packages
  installed with pip --target, say)."""
  path = [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _run(cmd, log):
  with open(log, "a") as f:
    subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True, env=_env())


def _metrics(d):
  with open(os.path.join(d, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def plan(config: str, workdir: str, k: int, steps: int, lora: bool,
         members: str = "auto") -> dict:
  """The sweep's runs, built but not run: the prefix (warm start) command, the K separate runs'
  (workdir, command) pairs and the vmapped group's spec, each arm with its own compilation cache
  under workdir (CACHES; main makes them empty): the separate runs share one, the group has
  one, the prefix one. members: the group's train.members."""
  caches = {arm: os.path.join(workdir, "compilation_cache", arm) for arm in CACHES}
  fixed = {"sft.steps": 20, "sft.target_accuracy": 0.0, "train.steps": steps,
           "train.eval_examples": 32, "train.tensorboard": False}
  # Around each preset's own rate (tiny 3e-4 with its cosine, tiny_lora 3e-3).
  lrs = [(3e-4 if lora else 1e-5) * 1.5 ** i for i in range(k)]
  runs = [{**fixed, "optim.lr": lr} for lr in lrs]
  cached = lambda args, arm: {**args, "train.compilation_cache": caches[arm]}
  prefix = os.path.join(workdir, "prefix")
  separate = [os.path.join(workdir, "separate", f"lr{i}") for i in range(k)]
  vmapped = [os.path.join(workdir, "vmapped", f"lr{i}") for i in range(k)]
  return {
      "caches": caches, "prefix_dir": prefix,
      "prefix": _main_cmd(config, prefix, cached({**fixed, **sweep.PREFIX_OVERRIDES}, "prefix")),
      "separate": [(d, _main_cmd(config, d, cached(args, "separate")))
                   for d, args in zip(separate, runs)],
      "group": {"config": config, "members": [
          {"workdir": d, "args": {**cached(args, "vmapped"), "train.members": members}}
          for d, args in zip(vmapped, runs)]},
  }


def _entries(directory) -> int:
  """Programs in a compilation cache directory (JAX writes <name>-<key>-cache for each, beside
  its -atime stamp)."""
  if not os.path.isdir(directory):
    return 0
  return sum(name.endswith("-cache") for name in os.listdir(directory))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run")
  parser.add_argument("--k", type=int, default=8, help="runs")
  parser.add_argument("--workdir", default="/tmp/grpo_jax_sweep_bench")
  parser.add_argument("--lora", action="store_true",
                      help="tiny_lora members on one shared base, and the memory ratio")
  parser.add_argument("--members", default="auto", choices=("auto", "vmap", "map"),
                      help="the group's train.members: auto (in turn on a CPU, else vmap), "
                           "vmap (batched) or map (each member's programs in turn)")
  a = parser.parse_args()
  config = "configs/gsm8k.py:tiny_lora" if a.lora else "configs/gsm8k.py:tiny"
  workdir = os.path.abspath(a.workdir)  # the runs start in the repository
  shutil.rmtree(workdir, ignore_errors=True)
  runs = plan(config, workdir, a.k, a.steps, a.lora, a.members)
  for d in runs["caches"].values():
    os.makedirs(d)  # empty: nothing compiled before this sweep is loaded
  log = os.path.join(workdir, "log.txt")
  load = os.getloadavg()[0]
  c = runs["caches"]
  print(f"compilation caches, each empty at the start: the {a.k} separate runs share "
        f"{c['separate']}; the vmapped group {c['vmapped']}; the prefix {c['prefix']}",
        flush=True)

  prefix = runs["prefix_dir"]
  t0 = time.perf_counter()
  _run(runs["prefix"], log)
  print(f"warm start (shared, not timed): {time.perf_counter() - t0:.1f} s", flush=True)

  def start(dirs):
    for d in dirs:
      os.makedirs(d)
      sweep_runner.start_from_prefix(prefix, d)  # with LoRA, the base_model/ too
    return dirs

  sep_dirs = start([d for d, _ in runs["separate"]])
  t0 = time.perf_counter()
  for _, cmd in runs["separate"]:
    _run(cmd, log)
  t_sep = time.perf_counter() - t0
  print(f"{a.k} separate runs: {t_sep:.1f} s (their cache now holds {_entries(c['separate'])} "
        f"programs)", flush=True)

  v_dirs = start([m["workdir"] for m in runs["group"]["members"]])
  spec = os.path.join(workdir, "spec.json")
  with open(spec, "w") as f:
    json.dump(runs["group"], f)
  t0 = time.perf_counter()
  _run([sys.executable, "-m", "grpo_jax.train", f"--spec={spec}"], log)
  t_v = time.perf_counter() - t0
  print(f"{a.k} runs vmapped in one process: {t_v:.1f} s (its cache now holds "
        f"{_entries(c['vmapped'])} programs)", flush=True)

  worst_abs, worst_rel, where = 0.0, 0.0, None
  for ds, dv in zip(sep_dirs, v_dirs):
    for ws, wv in zip(_metrics(ds), _metrics(dv)):
      for key, x in ws.items():
        if key in TIMING or not isinstance(x, (int, float)):
          continue
        diff = abs(x - wv[key])
        rel = diff / max(abs(x), 1e-12)
        if diff > worst_abs:
          worst_abs, where = diff, (os.path.basename(ds), ws["step"], key)
        worst_rel = max(worst_rel, rel if diff > 1e-6 else 0.0)
  print(f"load average at start {load:.1f} on {os.cpu_count()} cores; {a.steps} GRPO steps "
        f"each; the group's train.members={a.members}")
  print(f"largest member-vs-separate metric difference: {worst_abs:.3g} absolute (at {where}); "
        f"largest relative where the absolute exceeds 1e-6: {worst_rel:.3g}")
  step_sep = sum(_median_step(d) for d in sep_dirs)
  step_v = _median_step(v_dirs[0])
  print(f"steady step: {a.k} separate runs {step_sep:.2f} s (sum of medians), vmapped "
        f"{step_v:.2f} s (median)")
  print(f"vmapped_sweep_speedup={t_sep / t_v:.2f}")
  print(f"vmapped_step_speedup={step_sep / step_v:.2f}")
  if a.lora:
    print(f"lora_members_speedup={t_sep / t_v:.2f}")
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks",
                                                       "lora_members_memory.py"), f"--k={a.k}",
                          # the 1.5b_lora preset's GPU runs its members as 'auto' does there
                          f"--members={'map' if a.members == 'map' else 'vmap'}"],
                         cwd=REPO, capture_output=True, text=True, check=True,
                         env=_env()).stdout
    print(out, end="")


def _median_step(workdir) -> float:
  """The median time/step_s of a run's GRPO steps after its first (which compiles)."""
  steps = [r["time/step_s"] for r in _metrics(workdir) if "time/step_s" in r][1:]
  if not steps:
    raise SystemExit(f"{workdir}: fewer than 2 GRPO steps with time/step_s; use --steps >= 2")
  return statistics.median(steps)


if __name__ == "__main__":
  main()
