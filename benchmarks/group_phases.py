"""Where a vmapped group's wall time goes: benchmarks/sweep.py's group alone, with the time of
each phase.

    python3 benchmarks/group_phases.py [--steps=50] [--k=8] [--members=auto] [--workdir=DIR]
    python3 benchmarks/group_phases.py --tree=OTHER_CHECKOUT ...   # the same for another version

The group is sweep.py's (the tiny preset, an lr sweep of K members from one shared warm start),
run as `python -m grpo_jax.train --spec` with its own compilation cache, emptied first, so its
compiles count as they do in sweep.py. The warm start is computed once into --workdir and kept:
a second call (or one with --tree, for a before/after comparison on one machine) reuses it.
Prints the group's wall time, then the wall-clock totals of the loop's phases (setup, the first
step, the other steps, evals, the runs' finish with plots and exports, imports), timed by
wrapping the functions named in the table (calls nest: a row includes the rows it calls), and
the part of each spent in the first GRPO step (where the sampler compiles), then the XLA
compiles that took 0.2 s or more: when each started and ended (seconds from the start of the
first GRPO step), its length and its thread (compiles ahead run in `grpo_jax-compile` for the
train step, `grpo_jax-compile-sampler` for the sampler), from jax.monitoring's compile events:
which compile the first step waits on.
Nothing is compared with a peer: the end-to-end ratio is sweep.py's.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (module, attribute) pairs timed in the group process; "Class.method" names a method.
PHASES = (
    ("grpo_jax.loop", "run_group"), ("grpo_jax.prepare", "setup"),
    ("grpo_jax.inputs", "datasets"), ("grpo_jax.inputs", "tokenizer"),
    ("grpo_jax.trainer", "Trainer.__init__"), ("grpo_jax.start", "start"),
    ("grpo_jax.members", "group_step"), ("grpo_jax.members", "sample"),
    ("grpo_jax.members", "generate"), ("grpo_jax.rollout", "score_samples"),
    ("grpo_jax.members", "train"), ("grpo_jax.members", "evaluate"),
    ("grpo_jax.checkpoint", "Checkpointer.save"), ("grpo_jax.logging_io", "MetricsWriter.write"),
    ("grpo_jax.logging_io", "SamplesWriter.write"), ("grpo_jax.export", "_finish"),
    ("grpo_jax.plots", "plot_metrics"), ("grpo_jax.models.weights", "save_checkpoint"),
    ("grpo_jax.plots", "drawing"),  # a context manager: its block (the exports) and the wait
    # The rest of a step: what its first one spends besides the sampler's compile.
    ("grpo_jax.members", "compile_ahead"), ("grpo_jax.members", "policy"),
    ("grpo_jax.rollout", "encode"), ("grpo_jax.rollout", "Rollouts.train_batch"),
    ("grpo_jax.rollout", "Collection.result"),
    ("grpo_jax.members", "pad_batches"), ("grpo_jax.members", "_samples"),
    ("grpo_jax.members", "compile_evals_ahead"),
    # A group's own device work: stacking the members' states, taking one out (checkpoints).
    ("grpo_jax.members", "stack"), ("grpo_jax.members", "unstack"),
)


def _child(spec: str) -> int:
  """The group process, its phases timed; the table goes to stderr at exit."""
  import importlib  # pylint: disable=import-outside-toplevel
  totals, calls, steps = collections.defaultdict(float), collections.Counter(), []
  first = collections.defaultdict(float)  # the part of each total spent in the first step
  in_first = [False]
  first_span = []  # the first GRPO step's (start, end), time.time() as the compile events
  compiles = []  # (start, end, program, thread) of each XLA compile (or cache load)
  t0 = time.perf_counter()
  import jax  # pylint: disable=import-outside-toplevel

  def on_span(event, start, end, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append((start, end, kwargs.get("fun_name", "?"), threading.current_thread().name))
  if hasattr(jax.monitoring, "register_event_time_span_listener"):  # else: no timeline
    jax.monitoring.register_event_time_span_listener(on_span)
  jax.devices()
  totals["import jax, find the devices"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  from grpo_jax import train  # pylint: disable=import-outside-toplevel
  totals["import grpo_jax"] = time.perf_counter() - t0

  def timed(fn, label):
    if label == "drawing":  # from entering its block to its plots drawn
      @contextlib.contextmanager
      def block(*args, **kwargs):
        start = time.perf_counter()
        try:
          with fn(*args, **kwargs):
            yield
        finally:
          totals[label] += time.perf_counter() - start
          calls[label] += 1
      return block

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      start = time.perf_counter()
      if label == "group_step":
        in_first[0] = not steps
        if in_first[0]:
          first_span.append(time.time())
      try:
        out = fn(*args, **kwargs)
        # Dispatched programs: waited for, so that their device time counts in their own row
        # and not in whatever waits for their output next.
        if label in ("train", "stack", "unstack"):
          jax.block_until_ready(out)
        return out
      finally:
        seconds = time.perf_counter() - start
        totals[label] += seconds
        calls[label] += 1
        if in_first[0]:
          first[label] += seconds
        if label == "group_step":
          if not steps:
            first_span.append(time.time())
          steps.append(seconds)
          in_first[0] = False
    return wrapper

  for module_name, name in PHASES:
    try:
      owner = importlib.import_module(module_name)
    except ModuleNotFoundError:  # an older --tree, before the module was split out
      continue
    *cls, attr = name.split(".")
    if cls:
      owner = getattr(owner, cls[0])
    if hasattr(owner, attr):  # (an older --tree may lack a phase)
      setattr(owner, attr, timed(getattr(owner, attr), name))
  start = time.perf_counter()
  try:
    return train.main([f"--spec={spec}"])
  finally:
    print(f"group process: {time.perf_counter() - start:.1f} s in grpo_jax.train.main",
          file=sys.stderr)
    print(f"  {'phase':36s} {'total':>9s}  {'calls':>5}  {'in the first step':>17s}",
          file=sys.stderr)
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
      part = f"{first[label]:7.2f} s" if label in first else ""
      print(f"  {label:36s} {seconds:7.2f} s  {calls[label] or '':>5}  {part:>17s}",
            file=sys.stderr)
    if steps:
      print(f"  GRPO steps: the first {steps[0]:.2f} s, the other {len(steps) - 1} "
            f"{sum(steps[1:]):.2f} s", file=sys.stderr)
    _print_compiles(compiles, first_span)


def _print_compiles(compiles, first_span):
  """The compile timeline: every compile of 0.2 s or more, in start order, its times from the
  first GRPO step's start; then the totals (all compiles, those under 0.2 s included)."""
  if not compiles:
    return
  origin = first_span[0] if first_span else compiles[0][0]
  where = "the first GRPO step" if first_span else "the first compile"
  print(f"  XLA compiles of 0.2 s or more (seconds from the start of {where}"
        + (f", which ended at {first_span[1] - origin:.2f}" if len(first_span) > 1 else "")
        + "):", file=sys.stderr)
  print(f"    {'start':>8s} {'end':>8s} {'length':>7s}  {'thread':26s} program", file=sys.stderr)
  for start, end, name, thread in sorted(compiles):
    if end - start >= 0.2:
      print(f"    {start - origin:8.2f} {end - origin:8.2f} {end - start:7.2f}  {thread[:26]:26s} "
            f"{name}", file=sys.stderr)
  by_thread = collections.defaultdict(float)
  for start, end, _, thread in compiles:
    by_thread["main" if thread == "MainThread" else thread.rsplit("_", 1)[0]] += end - start
  print(f"    {len(compiles)} compiles (or loads from the cache), "
        f"{sum(by_thread.values()):.2f} s: "
        + ", ".join(f"{t} {s:.2f} s" for t, s in sorted(by_thread.items())), file=sys.stderr)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--k", type=int, default=8)
  parser.add_argument("--members", default="auto", choices=("auto", "vmap", "map"))
  parser.add_argument("--workdir", default="/tmp/grpo_jax_group_phases")
  parser.add_argument("--tree", default=os.path.dirname(HERE),
                      help="the checkout whose grpo_jax runs the group (default: this one)")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  a = parser.parse_args()
  if a.child:
    sys.exit(_child(a.child))
  tree = os.path.abspath(a.tree)
  sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]
  import sweep as sweep_bench  # pylint: disable=import-outside-toplevel  (benchmarks/sweep.py)
  from grpo_jax import sweep_runner  # pylint: disable=import-outside-toplevel
  workdir = os.path.abspath(a.workdir)
  runs = sweep_bench.plan("configs/gsm8k.py:tiny", workdir, a.k, a.steps, False, a.members)
  path = [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
  log = os.path.join(workdir, "log.txt")
  if not os.path.isdir(os.path.join(runs["prefix_dir"], "checkpoints")):
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(runs["caches"]["prefix"])
    t0 = time.perf_counter()
    with open(log, "a") as f:
      subprocess.run(runs["prefix"], cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT,
                     check=True)
    print(f"warm start (kept in {runs['prefix_dir']}): {time.perf_counter() - t0:.1f} s",
          flush=True)
  cache = runs["caches"]["vmapped"]
  shutil.rmtree(cache, ignore_errors=True)
  os.makedirs(cache)  # empty: the group compiles as it does in sweep.py
  for member in runs["group"]["members"]:
    shutil.rmtree(member["workdir"], ignore_errors=True)
    os.makedirs(member["workdir"])
    sweep_runner.start_from_prefix(runs["prefix_dir"], member["workdir"])
  spec = os.path.join(workdir, "spec.json")
  with open(spec, "w") as f:
    json.dump(runs["group"], f)
  load = os.getloadavg()[0]
  t0 = time.perf_counter()
  done = subprocess.run([sys.executable, os.path.abspath(__file__), f"--child={spec}"], cwd=tree,
                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  seconds = time.perf_counter() - t0
  with open(log, "a") as f:
    f.write(done.stderr)
  table = done.stderr[done.stderr.rfind("group process:"):]
  if done.returncode:
    sys.exit(f"the group failed (rc {done.returncode}); its output is in {log}")
  print(f"the group of {a.k} ({a.steps} steps, train.members={a.members}, grpo_jax from {tree}): "
        f"{seconds:.1f} s end to end; load average at start {load:.1f} on {os.cpu_count()} "
        f"cores")
  print(table, end="")


if __name__ == "__main__":
  main()
