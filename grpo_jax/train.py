"""The GRPO program: one run, or the K runs of a vmapped sweep as one program.

    run(config, workdir)                  # one run: what `python -m grpo_jax.main` does
    run_group(configs, workdirs)          # K runs of a sweep as one program (`sweep --vmap`)
    python -m grpo_jax.train --spec=group.json   # run_group from a spec file:
    # {"config": "configs/gsm8k.py:tiny",
    #  "members": [{"workdir": "runs/x/optim.lr=1e-05", "args": {"optim.lr": 1e-05}}, ...]}

Where each part lives (docs/architecture.md): the loop (grpo_jax.loop), a run's inputs
(grpo_jax.prepare) and host side (grpo_jax.runs), its start and end (grpo_jax.start: resume,
warm start, export), its compiled pieces (grpo_jax.trainer), and the K members of a group
(grpo_jax.members, the one module that knows K).
"""

from __future__ import annotations

import argparse
import json
import sys

from grpo_jax import hosts, interrupts, preflight, sweep
from grpo_jax.errors import UserError
from grpo_jax.loop import run_group


def run(config, workdir: str) -> dict:
  """One run; returns its summary (on every process but the first: {})."""
  return run_group([config], [workdir])[0]


def load_spec(path):
  """The group's configs and workdirs from a spec file (see the module docstring)."""
  with open(path) as f:
    spec = json.load(f)
  configs = []
  for member in spec["members"]:
    c = sweep.load_config(spec["config"])
    sweep.apply_overrides(c, member["args"])
    configs.append(c)
  return configs, [m["workdir"] for m in spec["members"]]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m grpo_jax.train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--spec", required=True, help="the group's JSON spec")
  args = parser.parse_args(argv)
  try:
    configs, workdirs = load_spec(args.spec)
    with open(args.spec) as f:
      members = json.load(f)["members"]
    for c, w, m in zip(configs, workdirs, members):  # as main checks a run (grpo_jax.preflight)
      preflight.check_fields(c, {k: f"{k} (the args of {w} in {args.spec})" for k in m["args"]})
      preflight.check_workdir(w, "workdir")
      preflight.check_packages(c, w)
    with preflight.Start(workdirs, main=hosts.is_main()):  # a lock on each member's workdir
      run_group(configs, workdirs)
  except UserError as e:
    print(f"grpo_jax.train: error: {e}", file=sys.stderr, flush=True)
    return 2
  except interrupts.Stopped as e:
    interrupts.exit_with(e)
  return 0


if __name__ == "__main__":
  sys.exit(main())
