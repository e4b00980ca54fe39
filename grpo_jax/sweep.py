"""Ablation sweeps as data, and the command that runs them.

    python -m grpo_jax.sweep experiments/tiny_lr.py --workdir=runs/tiny_lr [--parallel=N]
    python -m grpo_jax.report runs/tiny_lr          # report.md + plots, mean ± std over seeds

A sweep file is plain Python whose get_sweep() returns a Sweep: the base config (path:preset,
as main's --config) and one dict of overrides per run, flat dotted keys as in --config.a.b=v,
built with the helpers below (big_vision's get_hyper style):

    from grpo_jax import sweep
    def get_sweep():
      return sweep.Sweep(config="configs/gsm8k.py:tiny", fixed={"train.steps": 200},
                         runs=sweep.product(sweep.sweep_axis("optim.lr", [1e-5, 3e-5]),
                                            sweep.seeds(2)))
    # runs: [{"optim.lr": 1e-05, "seed": 0}, {"optim.lr": 1e-05, "seed": 1}, ...]

Each run is `python -m grpo_jax.main` in its own process and directory, named after its
overrides (`optim.lr=1e-05,seed=0`); `fixed` applies to every run and is left out of names.
The run's overrides reach main as a JSON file (main's --overrides), so None stays None.
Numpy scalars (np.logspace's values) are taken as the Python numbers they hold.
Running the command again skips finished runs and resumes the others (sweep_runner.py).
With --vmap, runs that differ only in grpo_jax.members.VARIABLE run as one process, one vmapped
program (sweep_runner.Group); each still writes its own directory.

Shared warm start: runs that differ only in keys of POST_WARM_START (GRPO-phase settings) start
from the same policy, so a `prefix` run (under <workdir>/prefixes/) computes that warm start
once, with train.steps=0, and each member starts from a copy of its step-0 checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from grpo_jax.config import apply_overrides
from grpo_jax.errors import UserError
# The runner's names, here so that sweep files and tests find them in one place.
from grpo_jax.sweep_runner import (PREFIX_DIR, Runner, SweepError, cli_value,  # noqa: F401
                                   plain_value)


# Keys whose value cannot change anything up to and including a run's step-0 checkpoint and its
# step-0 eval (the warm start, the initial GRPO train state, the data position, the first line of
# metrics.jsonl). An allow-list: a key missing here only costs a separate warm start, a wrong one
# would silently give a run another run's start. Each was checked against the code:
#  - optim.lr, b1, b2, weight_decay, warmup_steps, schedule, total_steps: the warm start replaces
#    them (sft.sft_optim_config), and the optimizer state at step 0 is zeros and counts whatever
#    their values (tested in sweep_test). Not max_grad_norm: 0 removes the clipping stage, so
#    the checkpoint's optimizer state would not fit.
#  - loss.* except beta: the warm start validates them only; beta > 0 adds the reference params
#    to the checkpoint, sync_ref_model puts them in the train state instead.
#  - train.*: the GRPO loop's length and cadence; at step 0 the data position is the start of
#    epoch 0 whatever prompts_per_step is. Not eval_examples/eval_batch_size (the step-0 eval)
#    nor pad_multiple (the warm start's batches).
#  - sampling.num_generations and the cuts top_k/top_p/min_p (greedy eval normalises them away).
#    Not temperature: greedy eval takes the argmax of logits / temperature, where rounding can
#    tie; not max_new_tokens (the warm start's targets, the eval).
#  - rewards.names/weights: the eval uses math_accuracy alone (rollout.accuracy_reward); the
#    reward's options stay out, they score the eval.
POST_WARM_START = frozenset({
    "optim.lr", "optim.b1", "optim.b2", "optim.weight_decay", "optim.warmup_steps",
    "optim.schedule", "optim.total_steps",
    "loss.loss_type", "loss.kl_estimator", "loss.epsilon", "loss.epsilon_high", "loss.delta",
    "loss.importance_sampling_level", "loss.num_iterations", "loss.scale_rewards",
    "loss.reward_aggregation", "loss.mask_truncated_completions",
    "loss.sapo_temperature_pos", "loss.sapo_temperature_neg", "loss.vespo_k_pos",
    "loss.vespo_lambda_pos", "loss.vespo_k_neg", "loss.vespo_lambda_neg",
    "loss.rollout_is_correction", "loss.rollout_is_mode", "loss.rollout_is_clip_min",
    "loss.rollout_is_clip_max", "loss.off_policy_mask_threshold", "loss.use_bias_correction_kl",
    "loss.top_entropy_quantile", "loss.entropy_coef", "loss.steps_per_generation",
    "loss.ref_model_mixup_alpha", "loss.ref_model_sync_steps",
    "train.steps", "train.prompts_per_step", "train.eval_every", "train.checkpoint_every",
    "train.keep_checkpoints", "train.samples_per_step", "train.max_bad_steps",
    "train.dynamic_sampling", "train.max_sampling_rounds", "train.max_missing_reward_steps",
    "train.tensorboard", "train.wandb", "train.wandb_project", "train.wandb_entity",
    "train.wandb_name", "train.wandb_tags", "train.wandb_mode", "train.progress_every_s",
    "train.compilation_cache", "train.off_policy_steps",
    "sampling.num_generations", "sampling.top_k", "sampling.top_p", "sampling.min_p",
    "rewards.names", "rewards.weights",
})
# What may differ between the members of one vmapped program (grpo_jax.train.run_group; here so the
# runner groups runs without importing jax): the rest shapes the program or the host's loop.
VMAP_VARIABLE = ("seed", "optim.lr", "loss.beta", "loss.epsilon", "loss.epsilon_high",
                 "rewards.weights")
# What a prefix run adds: stop after the step-0 checkpoint. A constant schedule because cosine
# needs steps > 0 to validate; the schedule is post-warm-start, so the checkpoint is the same.
PREFIX_OVERRIDES = {"train.steps": 0, "optim.schedule": "constant"}


# --- sweeps as data -----------------------------------------------------------------------------

@dataclasses.dataclass
class Sweep:
  config: str                         # main's --config: 'configs/gsm8k.py:tiny'
  runs: list[dict[str, Any]]          # one override dict per run
  fixed: dict[str, Any] = dataclasses.field(default_factory=dict)  # every run; not in names


def sweep_axis(key: str, values: Iterable) -> list[dict]:
  """sweep_axis('optim.lr', [1e-5, 3e-5]) -> [{'optim.lr': 1e-05}, {'optim.lr': 3e-05}]."""
  return [{key: plain_value(v)} for v in values]


def fixed(key: str, value) -> list[dict]:
  """One setting for every run of a product: fixed('train.steps', 200)."""
  return [{key: plain_value(value)}]


def seeds(n: int, start: int = 0) -> list[dict]:
  """The seed as one more axis (config.seed: data, initial weights, warm start, GRPO draws)."""
  return sweep_axis("seed", range(start, start + n))


def _merge(dicts: Sequence[dict]) -> dict:
  out = {}
  for d in dicts:
    clash = out.keys() & d.keys()
    if clash:
      raise ValueError(f"key {sorted(clash)[0]!r} is set by two axes of one product/zip")
    out.update(_plain(d))
  return out


def product(*axes: Sequence[dict]) -> list[dict]:
  """Every combination, the first axis slowest: product(lrs, seeds(2)) -> lr0 s0, lr0 s1, ..."""
  return [_merge(combo) for combo in itertools.product(*axes)]


def zip_(*axes: Sequence[dict]) -> list[dict]:
  """Element-wise: zip_(sweep_axis('optim.lr', [a, b]), sweep_axis('optim.b2', [c, d]))."""
  lengths = {len(a) for a in axes}
  if len(lengths) > 1:
    raise ValueError(f"zip_ needs axes of one length, got {[len(a) for a in axes]}")
  return [_merge(combo) for combo in zip(*axes)]


# --- names --------------------------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]")


def format_value(value) -> str:
  """How a value appears in a run name: repr for numbers (3e-05), '+'-joined sequences."""
  value = plain_value(value)
  if isinstance(value, (list, tuple)):
    return "+".join(format_value(v) for v in value)
  return value if isinstance(value, str) else repr(value)


def run_name(overrides: dict, unique: bool = False) -> str:
  """'optim.lr=3e-05,seed=1': sorted keys, filesystem-safe; 'base' for no overrides.

  Characters outside [A-Za-z0-9._+=-] become '_'; with `unique`, a name that this changed ends
  in ',' and a hash of the overrides ('Be brief!' and 'Be brief?' would both give 'Be_brief_').
  A name past 200 characters is cut and ends in a hash of the whole, so it stays unique and
  under the 255-byte limit of file names.
  """
  if not overrides:
    return "base"
  items = sorted(overrides.items())
  raw = ",".join(f"{k}={format_value(v)}" for k, v in items)
  name = ",".join(f"{k}={_UNSAFE.sub('_', format_value(v))}" for k, v in items)
  if unique and name != raw:
    text = json.dumps(_plain(overrides), sort_keys=True, default=str)
    name += "," + hashlib.sha256(text.encode()).hexdigest()[:8]
  if len(name) > 200:
    name = name[:183] + "," + hashlib.sha256(name.encode()).hexdigest()[:16]
  return name


# --- the plan: prefixes and runs ----------------------------------------------------------------

@dataclasses.dataclass
class Run:
  name: str                 # directory under the sweep's workdir (prefixes/<name> for prefixes)
  overrides: dict           # the run's own overrides, what a report groups by
  args: dict                # every --config override passed: fixed + own (+ PREFIX_OVERRIDES)
  kind: str = "run"         # 'run' or 'prefix'
  prefix: str | None = None  # the prefix run whose step-0 checkpoint this run starts from

  @property
  def dir(self) -> str:
    return os.path.join(PREFIX_DIR, self.name) if self.kind == "prefix" else self.name


def warm_start_part(args: dict) -> dict:
  return {k: v for k, v in args.items() if k not in POST_WARM_START}


def _plain(overrides: dict) -> dict:
  return {k: plain_value(v) for k, v in overrides.items()}


def plan(sweep: Sweep, share_prefix: bool = True, min_shared: int = 2) -> list[Run]:
  """Prefix runs first, then the sweep's runs in order. Runs whose warm-start part (everything
  but POST_WARM_START keys) is equal share a prefix when there are at least min_shared of them.
  A prefix is named after its own warm-start part, with a hash where the name had characters
  that a file name cannot keep (run_name's `unique`): two prefixes never share a directory."""
  runs = [Run(run_name(o), _plain(o), {**_plain(sweep.fixed), **_plain(o)}) for o in sweep.runs]
  seen = {}
  for r in runs:
    if r.name in seen:
      raise SweepError(f"runs {seen[r.name]} and {r.overrides} have the same name {r.name!r}: "
                       "two runs of a sweep must differ in their overrides")
    seen[r.name] = r.overrides
  if not share_prefix:
    return runs
  groups: dict[str, list[Run]] = {}
  for r in runs:
    groups.setdefault(json.dumps(warm_start_part(r.args), sort_keys=True), []).append(r)
  prefixes = []
  for members in groups.values():
    if len(members) < min_shared:
      continue
    part = warm_start_part(members[0].args)
    own = warm_start_part(members[0].overrides)
    p = Run(run_name(own, unique=True), part, {**part, **PREFIX_OVERRIDES}, kind="prefix")
    clash = next((q for q in prefixes if q.name == p.name), None)
    if clash is not None:  # e.g. {'x': 1} and {'x': '1'}: one name, no character replaced
      raise SweepError(f"warm starts {clash.overrides} and {part} have the same prefix name "
                       f"{p.name!r}: give the values distinct text")
    prefixes.append(p)
    for r in members:
      r.prefix = p.name
  return prefixes + runs


def _value(r: Run, base, key: str):
  """The run's value of a dotted key: its args' or the base config's."""
  if key in r.args:
    return r.args[key]
  node = base
  for part in key.split("."):
    node = node.get(part) if node is not None else None  # a config without the block: None
  return node


def vmap_groups(runs: Sequence[Run], base) -> list[list[Run]]:
  """Runs (kind 'run') that may share one vmapped program: equal but for VMAP_VARIABLE keys,
  β zero or not alike (β > 0 adds a reference forward). Multi-turn runs stay alone. LoRA runs
  whose frozen base depends on the seed (a warm start, sft.steps > 0, or model.random_init:
  members.shared_base refuses members with different bases) are grouped within a seed only."""
  groups: dict[str, list[Run]] = {}
  for r in runs:
    key = {k: v for k, v in r.args.items() if k not in VMAP_VARIABLE}
    key["loss.beta != 0"] = _value(r, base, "loss.beta") != 0
    if _value(r, base, "model.lora.rank") and (_value(r, base, "sft.steps")
                                               or _value(r, base, "model.random_init")):
      key["seed (LoRA base)"] = _value(r, base, "seed")
    alone = _value(r, base, "agent.enabled")
    key = r.name if alone else json.dumps(key, sort_keys=True, default=str)
    groups.setdefault(key, []).append(r)
  return list(groups.values())


# --- loading and checking -----------------------------------------------------------------------

def load_sweep(path: str) -> Sweep:
  """Executes a sweep file and returns its get_sweep()."""
  if not os.path.isfile(path):
    raise SweepError(f"sweep file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location("grpo_jax_sweep_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise SweepError(f"{path} defines no get_sweep()")
  sweep = module.get_sweep()
  if not isinstance(sweep, Sweep) or not sweep.runs:
    raise SweepError(f"{path}: get_sweep() must return a grpo_jax.sweep.Sweep with runs")
  return sweep


def load_config(spec: str):
  """The base ConfigDict of 'path.py[:preset]', as main would build it."""
  path, _, preset = spec.partition(":")
  if not os.path.isfile(path):
    raise SweepError(f"config {path!r} does not exist (a path relative to the current "
                     f"directory, {os.getcwd()})")
  module_spec = importlib.util.spec_from_file_location("grpo_jax_sweep_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(preset) if preset else module.get_config()


def check_overrides(config, runs: Sequence[Run]) -> None:
  """Every run's overrides name a config field and fit its type: a typo stops the sweep before
  anything runs, not in each run's log."""
  for r in runs:
    for key, value in r.args.items():
      try:
        apply_overrides(config.copy_and_resolve_references(), {key: value})
      except (KeyError, TypeError, AttributeError) as e:
        kind = "names no config field" if isinstance(e, (KeyError, AttributeError)) else (
            f"does not fit the field's type ({e})")
        raise SweepError(f"run {r.name}: override {key}={value!r} {kind}") from None


# --- command line -------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m grpo_jax.sweep", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sweep_file", help="a sweep file, e.g. experiments/tiny_lr.py")
  parser.add_argument("--workdir", required=True, help="the sweep's directory; one subdir a run")
  parser.add_argument("--parallel", type=int, default=1,
                      help="runs at once (default 1; each run uses every core or accelerator)")
  parser.add_argument("--no_share_prefix", action="store_true",
                      help="every run computes its own warm start")
  parser.add_argument("--vmap", action="store_true",
                      help="run each group of runs that differ only in grpo_jax.members.VARIABLE "
                           "(seed, lr, beta, epsilon, reward weights) as one vmapped program")
  parser.add_argument("--dry_run", action="store_true", help="print the runs and commands only")
  parser.add_argument("--main_module", default="grpo_jax.main",
                      help="module each run executes with -m (a wrapper with main's flags)")
  args = parser.parse_args(argv)
  if args.parallel < 1:
    parser.error(f"--parallel {args.parallel} must be >= 1")

  try:
    sweep = load_sweep(args.sweep_file)
    if args.vmap and args.no_share_prefix:
      parser.error("--vmap starts every group from its members' prefixes; drop --no_share_prefix")
    if args.vmap and args.main_module != "grpo_jax.main":
      parser.error(f"--vmap runs each group as python -m grpo_jax.train --spec, without "
                   f"--main_module={args.main_module}: drop one of the two")
    # --vmap: every run gets a prefix, so a group's process runs GRPO phases only.
    runs = plan(sweep, share_prefix=not args.no_share_prefix, min_shared=1 if args.vmap else 2)
    base = load_config(sweep.config)
    check_overrides(base, runs)
    groups = vmap_groups([r for r in runs if r.kind == "run"], base) if args.vmap else None
    runner = Runner(sweep, runs, args.workdir, parallel=args.parallel,
                                 main_module=args.main_module, sweep_file=args.sweep_file,
                                 vmap_groups=groups)
    if args.dry_run:
      runner.print_plan()
      return 0
    return runner.run()
  except UserError as e:
    print(f"grpo_jax.sweep: error: {e}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
  # Sweep files import grpo_jax.sweep: run that module's main, not this __main__ copy, whose
  # Sweep class is another one.
  from grpo_jax import sweep as _module
  sys.exit(_module.main())
