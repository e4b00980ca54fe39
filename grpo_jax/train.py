"""The GRPO program, one loop for K >= 1 runs.

    run(config, workdir)                  # one run: what `python -m grpo_jax.main` does
    run_group(configs, workdirs)          # K runs of a sweep as one program (`sweep --vmap`)
    python -m grpo_jax.train --spec=group.json   # run_group from a spec file:
    # {"config": "configs/gsm8k.py:tiny",
    #  "members": [{"workdir": "runs/x/optim.lr=1e-05", "args": {"optim.lr": 1e-05}}, ...]}

Each step: rollouts (host: sample, decode, reward; rollout.SingleTurn or the agent) → one
compiled train step (train_step.train_step: advantages, reference pass, μ updates) → metrics,
samples, eval and checkpoints at their cadence; plots, summary and the exported model at the end.

K runs share the device side: their states are stacked on a leading K axis and the sampler's
prefill and decode and the train step run as one program for all of them, each member's lr, β,
ε, ε_high and reward weights entering as arrays (train_step.hparams). The decode and the train
step batch the members under jax.vmap, or run each member's own program in turn inside it
(jax.lax.map; train.members: by default in turn on a CPU, where batching adds no arithmetic
rate, and batched elsewhere). A plain run (K = 1) keeps its state as it is, so it pays for no
stacking. The host side stays per run: data order, rewards and their health, dynamic-sampling
rounds (a round is sampled for every member when any needs one; each keeps only the rounds its
own run would take), metrics, samples, checkpoints and final model in its own workdir, exactly
as a separate run writes them. Members may differ only in VARIABLE (check_vmappable); a
member's numbers equal its separate run's, bit for bit in turn and within rounding batched
(tests/vmapped_test.py says how close). A member that fails alone (non-finite steps, a missing
reward) is recorded as failed (FAILURE_FILE) and the others go on (docs/faults.md).

Resuming is automatic: a workdir holding a checkpoint continues from it, with the stopping rules'
counts (Member.counters). Every source of randomness is a pure function of (seed, step) and the
data order of (seed, epoch), so on one machine a resumed run reproduces an uninterrupted one bit
for bit. A resume with other settings goes on with a warning naming each change
(config_changes); one with another seed or dataset size, other shapes, or a checkpoint past
train.steps stops with a RestoreError.

Files in the workdir: see README ("Outputs and resume").
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import json
import os
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

import numpy as np

from grpo_jax import (checkpoint, compile_cache, config as config_lib, data, grpo, hosts, inputs,
                      interrupts, logging_io, plots, preflight, progress, rollout,
                      sampler as sampler_lib, sft, sharding, storage, sweep, sweep_runner,
                      tokenizer as tokenizer_lib, train_step, validate)
from grpo_jax import members as members_lib
from grpo_jax.agent import rollout as agent_rollout
from grpo_jax.errors import UserError, warn
from grpo_jax.models import lora as lora_lib, qwen, weights
from grpo_jax.rewards import Interrupted, MissingRewardsError, RewardHealth, build_rewards, probe



class TooManyBadSteps(UserError):
  """Consecutive non-finite steps: a setting (usually optim.lr) to change, not a crash."""


# A vmapped group's member that failed (TooManyBadSteps, MissingRewardsError) while the others
# went on: {"error", "message", "step"} in its workdir (grpo_jax.sweep_runner reads it). A run
# that starts removes it.
FAILURE_FILE = "failed.json"
# A LoRA run's frozen base where its warm start made it (a Hugging Face checkpoint, written
# once): resuming reads it back. Without a warm start the base is the initial model.
BASE_DIR = sweep_runner.BASE_DIR


# --- the program -------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
  """A run's inputs, checked: data, tokenizer, rewards (probed), the model's config."""
  workdir: str
  train_rows: list
  eval_rows: list
  sft_eval_rows: list
  tokenizer: Any
  stop_ids: list
  rewards: list
  interrupt: threading.Event  # set on SIGINT/SIGTERM: a reward waiting on its scorer gives up
  cfg: qwen.QwenConfig
  generation_config: dict | None
  previous_config: dict | None = None  # the workdir's config.json from an earlier start


def setup(config, workdir: str, shared: dict | None = None) -> Setup:
  """Validates the config, reads an earlier config.json, loads data and tokenizer, builds and
  probes the rewards, reads the model config and checks its weight files (loads none): one
  member's host side. A first start writes config.json here once those checks pass
  (grpo_jax.preflight); a workdir that has one gets this run's once it has resumed
  (write_config), so a refused resume leaves the config the checkpoints were trained with.
  shared: as grpo_jax.inputs takes it (a group's members build their common data and tokenizer
  once).

  With several processes, process 0 writes the workdir's files (a synthetic dataset, the tiny
  tokenizer) and the others read them once it has."""
  root = storage.path(workdir)  # a local directory or a gs:// URL
  workdir = os.fspath(root)
  validate.validate(config, jax.device_count())
  validate.validate_processes(config, jax.device_count(), hosts.count())
  compile_cache.enable(config.train.compilation_cache)  # before anything compiles
  main = hosts.is_main()
  previous_config = None
  if main:
    root.mkdir(parents=True, exist_ok=True)
    previous_config = _read_config_json(root / CONFIG_FILE)
    train_rows, eval_rows = inputs.datasets(config, workdir, shared=shared)
    tokenizer, stop_ids = inputs.tokenizer(config, workdir, train_rows, shared=shared)
  hosts.barrier("setup: process 0 wrote the workdir's inputs")
  if not main:
    train_rows, eval_rows = inputs.datasets(config, workdir, build=False, shared=shared)
    tokenizer, stop_ids = inputs.tokenizer(config, workdir, train_rows, build=False,
                                           shared=shared)
  if config.train.eval_examples:
    eval_rows = eval_rows[:config.train.eval_examples]
  # The warm start's stopping rule reads accuracy on training problems that neither phase trains
  # on; the reported held-out accuracy stays on eval_rows, which no decision ever sees.
  sft_eval_rows = []
  if config.sft.steps and config.sft.target_accuracy:
    if config.sft.eval_examples >= len(train_rows):
      raise validate.ConfigError(
          f"config.sft.eval_examples: {config.sft.eval_examples} validation problems leave none "
          f"of the {len(train_rows)} training problems to train on")
    train_rows, sft_eval_rows = (train_rows[:-config.sft.eval_examples],
                                 train_rows[-config.sft.eval_examples:])
  interrupt = threading.Event()
  rewards = build_rewards(config.rewards, interrupt=interrupt)
  probe_rows = train_rows[:2]  # real questions and gold answers: a working judge grades them
  probe(rewards, rollout.prompt_texts(config, tokenizer, probe_rows),
        [r["answer"] for r in probe_rows], rollout.reward_columns(probe_rows, 1),
        allow_missing=config.rewards.allow_missing)
  cfg, generation_config = inputs.model_config(config, tokenizer)
  if main and previous_config is None and not config.model.random_init:
    # A first start loads these weights after compiling; a resume may need only its own.
    weights.check_weight_files(weights.resolve(config.model.checkpoint,
                                               "config.model.checkpoint"))
  if main and previous_config is None:
    # A first start, once its inputs are checked (preflight: a start that fails before here
    # leaves nothing); written now, so a run that fails later still shows its config.
    storage.write_text(root / CONFIG_FILE, config.to_json_best_effort(indent=2))
  preflight.passed(workdir)
  return Setup(workdir, train_rows, eval_rows, sft_eval_rows, tokenizer, stop_ids, rewards,
               interrupt, cfg, generation_config, previous_config)


CONFIG_FILE = plots.CONFIG_FILE  # the resolved config of the run


def write_config(m) -> None:
  """The member's config.json (process 0), once its start is settled: a resume that is refused
  leaves the config of the run that made the checkpoints there."""
  storage.write_text(storage.path(m.workdir) / CONFIG_FILE, m.config.to_json_best_effort(indent=2))


def _read_config_json(path) -> dict | None:
  """A workdir's config.json as a dict; None when there is none (or it is not JSON)."""
  try:
    return json.loads(storage.read_text(path))
  except (FileNotFoundError, ValueError):
    return None


# Settings that change how a run is run or recorded, not its numbers: a resume may change them.
RESUME_NEUTRAL = ("train.compilation_cache", "train.tensorboard", "train.wandb",
                  "train.progress_every_s", "hardware.")


def config_changes(previous: dict | None, config) -> list[str]:
  """'key: old -> new' for each setting of `config` that differs from `previous` (a config.json
  written by an earlier run in the workdir), RESUME_NEUTRAL left out; with a cosine schedule
  whose length follows train.steps (optim.total_steps=0), also that length when it changes."""
  if previous is None:
    return []
  old, new = _flat(previous), _flat(json.loads(config.to_json_best_effort()))
  keys = [k for k in sorted(set(old) | set(new))
          if old.get(k) != new.get(k) and not k.startswith(RESUME_NEUTRAL)]
  changes = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys]
  if keys and config.optim.schedule == "cosine" and not config.optim.total_steps:
    before = copy.deepcopy(config)
    try:
      config_lib.apply_overrides(before, {k: old[k] for k in keys if k in old})
      lengths = [config_lib.optim_settings(c).total_steps for c in (before, config)]
    except (KeyError, TypeError, ValueError, AttributeError):
      lengths = []  # a setting the old config had and this one cannot take: listed above
    if lengths and lengths[0] != lengths[1]:
      changes.append(f"the cosine schedule's length (optim.total_steps=0: the run's updates): "
                     f"{lengths[0]} -> {lengths[1]} updates")
  return changes


# --- which runs can share one program -----------------------------------------------------------

VARIABLE = sweep.VMAP_VARIABLE  # the settings members may differ in (flat, dotted config keys)
# Metrics that measure the machine, not the run: they differ between any two runs.
TIMING_METRICS = ("time/sample_s", "time/reward_s", "time/train_s", "time/step_s",
                  "sampler/tokens_per_s", "sampler/seconds", "sampler/prefill_seconds")


class VmapError(UserError):
  """Runs that cannot share one vmapped program."""


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
  return out


def check_vmappable(configs) -> None:
  """Raises VmapError naming the first setting that keeps these configs out of one program:
  anything but VARIABLE changes a shape or the host's control flow (G, prompts per step,
  max_new_tokens, the temperature, which is static in the sampler and the log-probs)."""
  flats = [_flat(c.to_dict()) for c in configs]
  for key in sorted(set().union(*flats)):
    values = [f.get(key) for f in flats]
    if key not in VARIABLE and any(v != values[0] for v in values):
      raise VmapError(
          f"config.{key} differs between the runs of a vmapped group ({values}): it changes a "
          f"shape or the control flow of the program, so they cannot share one; only "
          f"{', '.join(VARIABLE)} may differ (run them without --vmap)")
  if len({c.loss.beta != 0 for c in configs}) > 1:
    raise VmapError(f"config.loss.beta is 0 for some runs and > 0 for others "
                    f"({[c.loss.beta for c in configs]}): β > 0 adds a reference forward, so "
                    "they cannot share one program")
  if len({len(c.rewards.weights) for c in configs}) > 1:
    raise VmapError("config.rewards.weights: the runs weight different numbers of rewards")
  if len(configs) > 1 and configs[0].agent.enabled:
    raise VmapError("config.agent.enabled: multi-turn agent rollouts are not vmapped; run them "
                    "without --vmap")
  if len(configs) > 1 and hosts.count() > 1:  # the members' sampler gathers no process's rows
    raise VmapError(f"a vmapped group runs in one process, and this is one of "
                    f"{hosts.count()}: run its {len(configs)} runs without --vmap")


def _check_shared(members):
  """What the shared sampler and train step bake in must agree (the tokenizer follows the
  seed with the tiny preset)."""
  m0 = members[0]
  for m in members[1:]:
    for what, a, b in (("model config", m.cfg, m0.cfg), ("stop ids", m.stop_ids, m0.stop_ids),
                       ("pad id", m.tokenizer.pad_token_id, m0.tokenizer.pad_token_id),
                       ("tokenizer size", len(m.tokenizer), len(m0.tokenizer))):
      if a != b:
        raise VmapError(f"{m.workdir} and {m0.workdir} differ in their {what} ({a} vs {b}): "
                        "the shared sampler and train step cannot serve both")


def pad_batches(batches, pad_id):
  """Rollout-layout batches to one prompt width (left-padded) and completion width (right):
  the extra columns are masked out, so each member's numbers stay its own."""
  P_ = max(b["prompt_NP"].shape[1] for b in batches)
  C = max(b["completion_BC"].shape[1] for b in batches)
  out = []
  for b in batches:
    p, c = P_ - b["prompt_NP"].shape[1], C - b["completion_BC"].shape[1]
    b = dict(b, prompt_NP=np.pad(b["prompt_NP"], ((0, 0), (p, 0)), constant_values=pad_id),
             prompt_mask_NP=np.pad(b["prompt_mask_NP"], ((0, 0), (p, 0))),
             completion_BC=np.pad(b["completion_BC"], ((0, 0), (0, c)), constant_values=pad_id))
    for k in ("loss_mask_BC", "turn_ids_BC"):
      if k in b:
        b[k] = np.pad(b[k], ((0, 0), (0, c)))
    out.append(b)
  return out


# One program each, not one op per leaf run eagerly (each compiled on its first shape): a group
# stacks its members' states at its start and takes each member's out at every checkpoint.
def stack(trees):
  """The trees' leaves stacked on a new leading (members) axis, each placed as stacked_spec
  says (so a program compiled for that spec before the stack runs is the one its output
  calls)."""
  leaves_K = [jax.tree.leaves(t) for t in trees]
  shardings = [_stacked_sharding(x) for x in leaves_K[0]]
  placed = [i for i, s in enumerate(shardings) if s is not None]
  out = [None] * len(shardings)
  if placed:  # committed leaves: one program
    stacked = _stack_program(tuple(shardings[i] for i in placed))(
        [[leaves[i] for i in placed] for leaves in leaves_K])
    for i, x in zip(placed, stacked):
      out[i] = x
  for i, s in enumerate(shardings):  # host (or uncommitted) leaves: left for jit to place
    if s is None:  # (device_put: a copy, where jnp.asarray compiles a program per leaf)
      out[i] = jax.device_put(np.stack([np.asarray(leaves[i]) for leaves in leaves_K]))
  return jax.tree.unflatten(jax.tree.structure(trees[0]), out)


def stacked_spec(trees):
  """What stack(trees) gives, as jax.ShapeDtypeStructs (computed without running it): each
  leaf's shape with a leading len(trees), its dtype, and a committed leaf's sharding, not split
  on the new axis."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (len(trees),) + tuple(np.shape(x)), x.dtype, sharding=_stacked_sharding(x),
      weak_type=getattr(x, "weak_type", False)), trees[0])


def _stacked_sharding(x):
  """A committed array's sharding with a leading axis that is not split; None for the rest
  (host arrays, uncommitted ones: jit places those)."""
  if not getattr(x, "committed", False):
    return None
  s = x.sharding
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.spec),
                                      memory_kind=s.memory_kind)
  return s  # one device: the stack stays on it


@functools.cache
def _stack_program(shardings):
  """One program stacking K lists of leaves into one list, placed by `shardings`."""
  return jax.jit(lambda leaves_K: [jnp.stack(xs) for xs in zip(*leaves_K)],
                 out_shardings=list(shardings))


@jax.jit
def unstack(tree, k):
  """Member k's slice of a stacked tree (k traced: one program for every member)."""
  return jax.tree.map(lambda x: x[k], tree)


# --- the runs' host sides -----------------------------------------------------------------------

@dataclasses.dataclass(eq=False)  # members are told apart by identity (`m in live`)
class Member:
  """One run's host side: its Setup (data, tokenizer, rewards), data order, writers, checkpoints
  and reward health; the device state lives with the group (Group)."""
  setup: Setup
  config: Any
  it: data.PromptIterator | None = None
  metrics: Any = None
  samples: Any = None
  ckpt: Any = None
  health: Any = None
  fresh: bool = False  # warm-started in this process (no checkpoint to resume from)
  bad: int = 0  # consecutive steps with a skipped (non-finite) update
  streaks: dict = dataclasses.field(default_factory=dict)  # restored RewardHealth streaks

  @property
  def workdir(self):
    return self.setup.workdir

  def next_rows(self, peek: bool = False) -> list:
    """The dataset rows of the run's next train.prompts_per_step prompts (peek: without moving
    its data order on)."""
    indices = self.it.peek_indices() if peek else self.it.next_indices()
    return [self.setup.train_rows[i] for i in indices]

  def counters(self) -> dict:
    """What the stopping rules have counted so far (bad steps, reward streaks), checkpointed so
    that a resumed run stops where the uninterrupted one would."""
    return {"bad_steps": self.bad, "reward_streaks": dict(self.health.streak)}

  def open(self, start: int, main: bool) -> None:
    """The run's writers and checkpointer, from `start` on (a fresh run: from scratch)."""
    c, resume = self.config, -1 if self.fresh else start
    self.metrics = logging_io.MetricsWriter(
        self.workdir, resume_step=resume, tensorboard=c.train.tensorboard, wandb=c.train.wandb,
        wandb_kwargs=logging_io.wandb_init_kwargs(c, self.workdir) if c.train.wandb else None,
        plot_step=c.train.steps) if main else logging_io.NullWriter()
    self.samples = (logging_io.SamplesWriter(self.workdir, resume_step=resume) if main
                    else logging_io.NullWriter())
    self.ckpt = checkpoint.Checkpointer(self.workdir, max_to_keep=c.train.keep_checkpoints)
    self.health = RewardHealth(self.setup.rewards, c.train.max_missing_reward_steps,
                               log=lambda line: tqdm.write(line, file=sys.stderr))
    for name, streak in self.streaks.items():  # a reward renamed since is not counted
      if name in self.health.streak:
        self.health.streak[name] = int(streak)
    failure = storage.path(self.workdir) / FAILURE_FILE
    if main and failure.exists():  # an earlier attempt's: this one starts again
      failure.unlink()

  def close(self) -> None:
    """Checkpoints finished; on an object store the logs' appended parts folded in."""
    for part in (self.ckpt, self.metrics, self.samples):
      if part is not None:
        part.close()
    self.ckpt = self.metrics = self.samples = None


@dataclasses.dataclass
class Group:
  """The device side of K runs: train states, frozen params (the reference, or a LoRA run's
  base) and hparams, stacked on a leading K axis when K > 1; a plain run (K = 1) holds its own,
  unstacked. LoRA members share one frozen base (shared_ref): one copy, never stacked."""
  k: int
  state: Any
  ref: Any
  hparams: Any
  shared_ref: bool = False

  @staticmethod
  def of(states, refs, hparams, shared_ref=False):
    return Group._of(stack, states, refs, hparams, shared_ref)

  @staticmethod
  def spec(states, refs, hparams, shared_ref=False):
    """What Group.of will hold, its stacked parts as jax.ShapeDtypeStructs (stacked_spec),
    computed without stacking anything: what its programs compile ahead for."""
    return Group._of(stacked_spec, states, refs, hparams, shared_ref)

  @staticmethod
  def _of(put, states, refs, hparams, shared_ref):
    if len(states) == 1:
      return Group(1, states[0], refs[0], hparams[0], shared_ref)
    ref = refs[0] if shared_ref or refs[0] is None else put(refs)
    return Group(len(states), put(states), ref, put(hparams), shared_ref)

  def member(self, k):
    """Member k's (state, frozen params)."""
    if self.k == 1 or self.shared_ref:
      return (self.state if self.k == 1 else unstack(self.state, k)), self.ref
    return unstack(self.state, k), None if self.ref is None else unstack(self.ref, k)


# --- the loop -----------------------------------------------------------------------------------

def run(config, workdir: str) -> dict:
  """One run; returns its summary (on every process but the first: {})."""
  return run_group([config], [workdir])[0]


def run_group(configs, workdirs) -> list[dict]:
  """K >= 1 runs as one program; returns their summaries (see the module docstring). SIGINT
  or SIGTERM stops it with a checkpoint of the phase it is in: interrupts.Stopped, raised once
  its files are written (docs/faults.md)."""
  with interrupts.Interrupts() as stop:
    stop.abortable(STARTING)
    return _run_group(configs, workdirs, stop)


# What a signal before the warm start (or before the resume's first step) says: setup and the
# initial params are recomputed by the next start.
STARTING = ("while starting (data, model, compiling), before any step of this start: nothing "
            "new was saved; run the same command to start again")


def _run_group(configs, workdirs, stop) -> list[dict]:
  if len(configs) > 1:
    check_vmappable(configs)
  shared = {}  # what the members' setups have in common is built once
  members = [Member(setup(c, w, shared), c) for c, w in zip(configs, workdirs)]
  # A signal makes a reward waiting on its scorer give up (rewards.Interrupted).
  stop.events += [m.setup.interrupt for m in members]
  if len(members) > 1:
    _check_shared([m.setup for m in members])
  m0, s0 = members[0], members[0].setup
  config, cfg = m0.config, s0.cfg
  mesh = sharding.make_mesh(tuple(config.mesh))
  trainer = Trainer(config, cfg, mesh, s0.tokenizer, s0.stop_ids, interrupt=s0.interrupt)
  _announce(members, cfg, mesh)

  # Each member's own view of the shared compiled pieces: its config, tokenizer and rollout.
  trainers = [trainer] + [trainer.for_member(m.config, m.setup.tokenizer) for m in members[1:]]
  start, states, refs = _start(members, trainers, stop)
  hparams = [trainer.hparams(m.config) for m in members]
  shared_ref = trainer.lora is not None
  # The first step's train program compiles from here on, in the background, for the first rows'
  # likely batch: beside the stacking, the step-0 eval (runs warm-started here) and the first
  # rows' sampling, not after them.
  if start < config.train.steps:
    trainer.compile_ahead(trainers, Group.spec(states, refs, hparams, shared_ref),
                          [m.next_rows(peek=True) for m in members], len(s0.rewards))
  main = hosts.is_main()  # the one process that writes the runs' files
  _open(members, start, main)
  group = Group.of(states, refs, hparams, shared_ref)
  del states, refs  # the group's copies are the live ones
  stop.abortable(None)  # from here on each phase saves its checkpoint before it stops
  stopped = None  # where the loop stopped, and what it saved, for interrupts.Stopped
  # Several processes: a signal to one interrupts the rewards of all (docs/faults.md).
  shared_interrupt = hosts.SharedEvents([m.setup.interrupt for m in members])

  failures = {}  # workdir -> error: vmapped members that failed; the others go on

  def save(step, only=None):
    for k, m in enumerate(members):
      if only is not None and m not in only or m.workdir in failures:
        continue
      state, ref = group.member(k)
      ckpt_state = {"train": state}
      if ref is not None and trainer.lora is None:  # a LoRA base is not checkpointed (BASE_DIR)
        ckpt_state["ref"] = ref
      m.ckpt.save(step, ckpt_state, m.it.position(), m.counters())

  def fail(m, error, step):
    """A run's failure: a plain run raises it; a vmapped member leaves what its separate run
    would (its files up to the failure) and a failure record, and the group goes on without it
    (its device state is still computed in the stacked program, and nothing of it written)."""
    if len(members) == 1:
      raise error
    failures[m.workdir] = error
    m.close()
    if main:
      storage.write_text(storage.path(m.workdir) / FAILURE_FILE, json.dumps(
          {"error": type(error).__name__, "message": str(error), "step": step}, indent=2))
    print(f"grpo_jax: {m.workdir}: failed at step {step}: {error}", file=sys.stderr, flush=True)
    if len(failures) == len(members):  # none left: the group fails as a separate run does
      raise error

  done = start
  # What setup built lives for the run (data, tokenizer, modules): frozen out of the cyclic
  # collector's view, a full collection walks only what the steps allocate (0.20 s against
  # 0.04 s per collection in benchmarks/trl_step.py's small workload).
  gc.freeze()
  try:
    fresh = [m for m in members if m.fresh]
    if fresh:  # the step-0 eval of runs warm-started here
      _evaluate_step_0(trainers, group, members)
      save(0, only=fresh)
      for m in fresh if main else ():  # an interrupted warm start's, once step 0 is saved
        sft.delete_checkpoint(m.workdir, m.ckpt)
    c = config.train
    # A signal during the step-0 eval stops here, not after a whole step more. Every member
    # already has its checkpoint of `start` (saved just above, or the one it resumed from).
    if hosts.any_(stop.requested()):
      stopped = (f"in the step-0 evaluation: {_saved(members, start)}" if fresh else
                 f"before GRPO step {start + 1}: the checkpoint of step {start} is kept")
    bar = progress.Bar(range(start, start if stopped else c.steps), initial=start, total=c.steps,
                       desc="grpo" if len(members) == 1 else f"grpo x{len(members)}",
                       every_s=c.progress_every_s, disable=not main)
    for step in bar:
      positions = [m.it.position() for m in members]
      t_step = time.perf_counter()
      live = [m for m in members if m.workdir not in failures]
      try:
        group, ms, samples = group_step(
            trainers, group, [m.setup.rewards for m in members],
            [m.next_rows if m in live else None for m in members],
            step)
      except Interrupted:  # a signal while a reward waited on its scorer: drop this step
        for m, p in zip(members, positions):
          m.it.restore(p)
        save(step)
        stopped = (f"in GRPO step {step + 1} of {c.steps}, waiting on a reward's scorer: "
                   f"dropped the step, {_saved(members, step)}")
        break
      done = step + 1
      if step == start and len(members) > 1 and not fresh:  # (fresh: the step-0 eval compiled)
        trainer.compile_evals_ahead(trainers, group, [m.setup.eval_rows for m in members])
      for m, m_k in zip(members, ms):
        if m in live:
          m_k["time/step_s"] = time.perf_counter() - t_step  # rollouts and update, for all K
          _count_bad_step(m, m_k, done, c.max_bad_steps, len(members), fail)
      live = [m for m in live if m.workdir not in failures]
      if c.eval_every and done % c.eval_every == 0 or done == c.steps:
        accs = evaluate_group(trainers, group, [m.setup.eval_rows for m in members])
        for m_k, acc in zip(ms, accs):
          if m_k is not None:
            m_k["eval/accuracy"] = acc
      _write_step(live, members, ms, samples, done)
      bar.set_postfix(_postfix([m_k for m, m_k in zip(members, ms) if m in live]))
      for m, m_k in zip(members, ms):  # before the save: its checkpoint holds the streaks
        if m not in live:
          continue
        try:
          m.health.update(done, m_k)  # warns; raises after too many steps with a reward missing
        except MissingRewardsError as e:
          save(done, only=[m])
          fail(m, e, done)
      if done % c.checkpoint_every == 0 or done == c.steps:
        save(done)
      if hosts.any_(stop.requested()):  # every process stops at the same step
        save(done)
        stopped = f"in GRPO step {done} of {c.steps}: {_saved(members, done)}"
        break
  finally:
    gc.unfreeze()  # run() may be called again in this process (tests, sweeps)
    shared_interrupt.stop()
    for m in members:
      m.close()

  finished = done >= config.train.steps  # a signal in the last step: its export stops at once
  if finished and hosts.count() == 1:  # (several processes take part in the export: not cut)
    stop.abortable(f"in the final export: the checkpoint of step {done} is kept, and "
                   "final_model/ is whole or absent; run the same command to export it")
  summaries = _finish_all(members, trainers, group, failures, finished, done, main)
  stop.abortable(None)
  if stopped is not None and not finished:  # (a run that got to train.steps is exported)
    raise stop.stopped(f"{stopped}; run the same command to resume")
  return summaries


def _announce(members, cfg, mesh) -> None:
  """The run's first line: the model, data, mesh and workdir (a group: its members)."""
  s0 = members[0].setup
  if len(members) > 1:
    print(f"grpo_jax: {len(members)} runs as one program: "
          + ", ".join(os.path.basename(m.workdir) for m in members), flush=True)
    return
  num_params = sum(x.size for x in jax.tree.leaves(qwen.abstract_params(cfg)))
  print(f"grpo_jax: {cfg.model_type} {cfg.num_layers}x{cfg.hidden_size}, "
        f"{num_params / 1e6:.2f}M params, "
        f"{len(s0.train_rows)} train / {len(s0.eval_rows)} eval prompts"
        f"{f' / {len(s0.sft_eval_rows)} warm-start validation' if s0.sft_eval_rows else ''}, "
        f"mesh {dict(mesh.shape)}, workdir {s0.workdir}, "
        f"compilation cache {jax.config.jax_compilation_cache_dir or 'off'}", flush=True)


def _open(members, start: int, main: bool) -> None:
  """Each member's config.json (process 0), writers and checkpointer from `start` on."""
  for m in members:
    if main:
      write_config(m)
    m.open(start, main)
    if len(members) > 1:  # a member that got further than the others redoes those steps
      m.ckpt.delete_after(start)


def _evaluate_step_0(trainers, group, members) -> None:
  """The held-out greedy accuracy of the runs warm-started here (m.fresh), written as step 0."""
  accs = evaluate_group(trainers, group, [m.setup.eval_rows for m in members])
  for m, acc in zip(members, accs):
    if m.fresh:
      m.metrics.write(0, {"eval/accuracy": acc})
      where = "" if len(members) == 1 else f"{m.workdir}: "
      print(f"grpo_jax: {where}held-out greedy accuracy at GRPO step 0: {acc:.1%}", flush=True)


def _write_step(live, members, ms, samples, done: int) -> None:
  """The step's metrics and samples, in each live member's files."""
  for m, m_k, samples_k in zip(members, ms, samples):
    if m in live:
      m.metrics.write(done, m_k)
      m.samples.write(done, samples_k)


def _count_bad_step(m, m_k, done: int, max_bad_steps: int, k: int, fail) -> None:
  """Counts member m's consecutive bad steps; fail(m, TooManyBadSteps, done) at the limit.
  step/skipped is the fraction of the step's loss.num_iterations updates skipped as not
  finite: the state is unchanged only at 1. Any skipped update makes a bad step, whether or not
  an earlier one moved the params."""
  if not m_k["step/skipped"] > 0:
    m.bad = 0
    return
  m.bad += 1
  if m.bad >= max_bad_steps:
    where = "" if k == 1 else f"{m.workdir}: "
    fail(m, TooManyBadSteps(
        f"{where}{m.bad} consecutive non-finite steps up to step {done} "
        f"(train.max_bad_steps); try a lower optim.lr or optim.max_grad_norm. The last "
        f"good checkpoint is in {checkpoint.checkpoint_dir(m.workdir)}"), done)


def _finish_all(members, trainers, group, failures, finished: bool, done: int,
                main: bool) -> list[dict]:
  """Each member's summary and export (a failed member's: its error). The plots (on a signal
  every second counts: `python -m grpo_jax.plots` draws them later), a group's drawn by other
  processes while the models are exported."""
  summaries = []
  plotted = [m.workdir for m in members if m.workdir not in failures] if finished and main else []
  with plots.drawing(plotted):
    for k, m in enumerate(members):
      if m.workdir in failures:
        summaries.append({"failed": str(failures[m.workdir])} if main else {})
        continue
      state, ref = group.member(k)
      summaries.append(_finish(m, trainers[k], state["params"], ref, finished, done, main))
  return summaries


def _saved(members, step) -> str:
  """'saved step N to <its checkpoint>', for a group in each member's checkpoints/."""
  if len(members) == 1:
    return f"saved step {step} to {checkpoint.checkpoint_dir(members[0].workdir)}/{step}"
  return f"saved step {step} of each of its {len(members)} runs (<workdir>/checkpoints/{step})"


def _postfix(ms) -> dict:
  if len(ms) > 1:
    return {"reward": "/".join(f"{m['reward/total/mean']:.2f}" for m in ms)}
  m, postfix = ms[0], {"reward": f"{ms[0]['reward/total/mean']:.3f}"}
  if "reward/math_accuracy/mean" in m:
    postfix["acc"] = f"{m['reward/math_accuracy/mean']:.2f}"
  if "eval/accuracy" in m:
    postfix["eval"] = f"{m['eval/accuracy']:.3f}"
  return postfix


def _finish(m: Member, trainer, params, ref, finished: bool, done: int, main: bool) -> dict:
  """The run's summary and exported model (LoRA: the merged model, and the adapter in PEFT's
  format)."""
  s, lcfg = m.setup, trainer.lora
  # What is exported: the params, or with LoRA the adapters and the base they merge into.
  # Several processes: every one takes part in gathering them, process 0 writes.
  exported = params if lcfg is None else (params, ref)
  final_params = hosts.fetch(exported) if finished and hosts.count() > 1 else exported
  if not main:
    return {}
  summary = logging_io.write_summary(s.workdir, stopped_at=None if finished else done,
                                     eval_examples=len(s.eval_rows))
  if finished:
    gen = s.generation_config or {"eos_token_id": s.stop_ids,
                                  "pad_token_id": s.tokenizer.pad_token_id}
    root = storage.path(s.workdir)
    if lcfg is None:
      with storage.local_dir(root / "final_model", whole=True) as out:
        weights.save_checkpoint(final_params, s.cfg, out, generation_config=gen,
                                tokenizer=s.tokenizer)
    else:
      adapters, base = final_params
      with storage.local_dir(root / "final_model", whole=True) as out:
        lora_lib.save_merged(base, adapters, s.cfg, lcfg, out, generation_config=gen,
                             tokenizer=s.tokenizer)
      with storage.local_dir(root / "final_adapter", whole=True) as out:
        lora_lib.save_peft(adapters, s.cfg, lcfg, out,
                           base_model=_base_model_name(m.config, s.workdir))
  return summary


def _base_model_name(config, workdir) -> str:
  """What a LoRA adapter's adapter_config.json names as its base: the warm-started base's
  directory, else the model checkpoint (empty for a random initialisation)."""
  if config.sft.steps:
    return os.path.join(workdir, BASE_DIR)
  return "" if config.model.random_init else str(config.model.checkpoint)


def _start(members, trainers, stop=None):
  """Each member's state at one common step: resumed from its latest usable checkpoint, or
  warm-started (a member without one; stop: its interrupts, which save the warm start's
  progress in the member's workdir, resumed from there). Returns (start step, states,
  references)."""
  abstract = trainers[0].abstract_checkpoint()
  if len(members) == 1:
    # The latest checkpoint whose files pass their checksums; damaged newer ones are skipped.
    restored = [checkpoint.resume(members[0].workdir, abstract)]
    start = 0 if restored[0] is None else restored[0].step
  else:
    # Each member's latest step that passes its checksums (a damaged newer one is skipped, as a
    # single run skips it; the members' steps after the group's start are deleted below).
    latest = [checkpoint.latest_usable_step(m.workdir) for m in members]
    start = min(s or 0 for s in latest)
    restored = []
    for m, s in zip(members, latest):
      if s is None:
        restored.append(None)
        continue
      try:  # the step latest_usable_step checked is not checked again
        restored.append(checkpoint.restore(m.workdir, abstract, step=start, verified=s == start))
      except Exception as e:  # the step every member has is gone from this one
        raise VmapError(f"{m.workdir}: no checkpoint at step {start}, where the group's other "
                        f"members resume ({e})") from None
  states, refs = [], []
  for m, r, trainer in zip(members, restored, trainers):
    c, s = m.config, m.setup
    lora = trainer.lora is not None
    if r is None:
      warm = c.sft.steps and sft.has_checkpoint(m.workdir)  # (holds the params)
      params = None if warm else inputs.initial_params(c, s.cfg, trainer.mesh)
      if c.sft.steps:
        params = sft.run_sft(c, trainer, params, s.train_rows, s.sft_eval_rows,
                             workdir=m.workdir, stop=stop)
        if lora:  # the base GRPO adapts: kept for resuming and for the adapter's export
          host_params = hosts.fetch(params) if hosts.count() > 1 else params
          if hosts.is_main():
            with storage.local_dir(storage.path(m.workdir) / BASE_DIR, whole=True) as out:
              weights.save_checkpoint(host_params, s.cfg, out, tokenizer=s.tokenizer)
          del host_params
      states.append(trainer.init_state(params))
      ref = trainer.reference(params) if lora or grpo.needs_reference(c.loss) else None
      del params  # the state and the reference are copies
      refs.append(_shared_base(members, refs, m, ref) if lora and refs else ref)
      m.it = data.PromptIterator(len(s.train_rows), c.train.prompts_per_step, c.seed)
      m.fresh = True
    else:
      where = f"{checkpoint.checkpoint_dir(m.workdir)}/{r.step}"
      if r.step > c.train.steps:
        raise checkpoint.RestoreError(
            f"{where}: the workdir's run got to step {r.step}, past train.steps={c.train.steps}; "
            f"set train.steps >= {r.step}, or use a new workdir to train for {c.train.steps}")
      try:
        m.it = data.PromptIterator(len(s.train_rows), c.train.prompts_per_step, c.seed,
                                   position=r.data_position)
      except ValueError as e:  # another seed or dataset than the checkpoint's
        raise checkpoint.RestoreError(f"{where}: {e}; run with the config it was saved with, "
                                      "or use a new workdir") from None
      # The counts a checkpoint holds (none in one saved before grpo_jax saved them: zeros).
      m.bad = int(r.counters.get("bad_steps", 0))
      m.streaks = dict(r.counters.get("reward_streaks", {}))
      changes = config_changes(s.previous_config, c)
      if changes:
        warn(f"{where}: resuming with settings changed since the workdir's config.json was "
             f"written: {'; '.join(changes)}. The steps up to {r.step} ran with the old values; "
             "config.json now holds the new ones")
      states.append(r.state["train"])
      ref = _lora_base(m, trainer) if lora else r.state.get("ref")
      refs.append(_shared_base(members, refs, m, ref) if lora and refs else ref)
      print(f"grpo_jax: {m.workdir if len(members) > 1 else ''}"
            f"{': ' if len(members) > 1 else ''}resumed from step {r.step}", flush=True)
  return start, states, refs


def _lora_base(m, trainer):
  """A resumed LoRA run's frozen base: the warm-started one it wrote (BASE_DIR), or the initial
  model, exactly as the run built it."""
  c = m.config
  if c.sft.steps:
    where = storage.path(m.workdir) / BASE_DIR
    if not where.exists():
      raise checkpoint.RestoreError(
          f"{where}: missing; a LoRA run with a warm start (sft.steps={c.sft.steps}) keeps its "
          "base there, and its checkpoints hold only the adapters")
    params, _ = weights.load_checkpoint(storage.local_copy(where),
                                        param_dtype=c.optim.param_dtype, mesh=trainer.mesh)
  else:
    params = inputs.initial_params(c, m.setup.cfg, trainer.mesh)
  return trainer.reference(params)


def _shared_base(members, refs, m, ref):
  """LoRA members of a group share one frozen base: member m's, built, must equal the first
  member's to the bit, and is dropped for it (so at most two bases exist at once)."""
  # Compared in the widest dtype among the leaves (an int8 kernel compares exactly as bf16).
  dtype = jnp.result_type(*jax.tree.leaves(refs[0]))
  if not bool(train_step.same_params(refs[0], ref, dtype)):
    raise VmapError(
        f"{m.workdir} and {members[0].workdir} have different frozen bases (a warm start or "
        "random initialisation that depends on the seed): LoRA members of a vmapped group "
        "share one base; run them without --vmap, or from one base (the same seed, or a "
        "model.checkpoint without a warm start)")
  return refs[0]


# --- one GRPO step ------------------------------------------------------------------------------

class Trainer:
  """The compiled pieces of a run (sampler, rollout, train step); grpo_step is one run's GRPO
  step (group_step with K = 1)."""

  def __init__(self, config, cfg: qwen.QwenConfig, mesh, tokenizer, stop_ids, interrupt=None):
    self.config, self.cfg, self.mesh, self.tokenizer = config, cfg, mesh, tokenizer
    s, valid = config.sampling, tokenizer_lib.valid_vocab_size(tokenizer)
    self.sampler = sampler_lib.Sampler(
        qwen.build(cfg, dtype=config.optim.compute_dtype, param_dtype=config.optim.param_dtype),
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        max_new_tokens=s.max_new_tokens, stop_ids=stop_ids,
        buckets=tuple(config.data.prompt_buckets), valid_vocab_size=valid,
        pad_id=tokenizer.pad_token_id, mesh=mesh)
    # The one rollout interface (grpo_jax.rollout): single-turn completions, or for
    # config.agent.enabled multi-turn trajectories with tools. `interrupt` (SIGTERM) stops a
    # wait on an agent role's server.
    self.rollout = (agent_rollout.Agent(config, tokenizer, self.sampler, interrupt)
                    if config.agent.enabled else rollout.SingleTurn(config, tokenizer,
                                                                    self.sampler))
    self.optim = config_lib.optim_settings(config)
    # LoRA (config.model.lora.rank > 0): the state trains adapters on a frozen base, which is
    # also the reference policy (adapters off); None: full fine-tuning.
    self.lora = lora_settings(config)
    self._merge = (jax.jit(functools.partial(lora_lib.merged_kernels, lcfg=self.lora))
                   if self.lora and self.lora.merge_for_sampling else None)
    self.step_fn = train_step.TrainStep(
        cfg, config.loss, self.optim, mesh, temperature=s.temperature, valid_vocab_size=valid,
        max_completion_length=self.rollout.completion_width,
        group_size=config_lib.group_size(config), reward_weights=config.rewards.weights,
        max_turns=self.rollout.max_turns, lora=self.lora)
    self.accuracy = rollout.accuracy_reward(config)
    # A vmapped group's members: batched under jax.vmap, or each in turn (train.members).
    self.members_batched = config_lib.members_batched(config, jax.default_backend())

  def for_member(self, config, tokenizer) -> Trainer:
    """This trainer for another member of a vmapped group: the same sampler and train step
    (compiled once for all), the member's own config, tokenizer and rollout (its prompts,
    decoding and warm-start examples)."""
    other = copy.copy(self)
    other.config, other.tokenizer = config, tokenizer
    other.rollout = rollout.SingleTurn(config, tokenizer, self.sampler)
    other.accuracy = rollout.accuracy_reward(config)
    return other

  def hparams(self, config):
    """A run's train-step hyperparameters (its lr, β, ε, ε_high, reward weights and LoRA
    scale)."""
    return train_step.hparams(config.loss, config.optim, config.rewards.weights,
                              lora_settings(config))

  def init_state(self, params):
    """The train state from the starting params: over them (full fine-tuning), or over fresh
    adapters (LoRA; PEFT's initialisation from the run's seed, b = 0)."""
    if self.lora is None:
      return train_step.create_train_state(params, self.cfg, self.optim, self.mesh)
    key = jax.random.fold_in(jax.random.key(self.config.seed), LORA_INIT_STREAM)
    adapters = lora_lib.init(key, self.cfg, self.lora, jnp.dtype(self.optim.param_dtype))
    return train_step.create_train_state(adapters, self.cfg, self.optim, self.mesh, self.lora)

  def reference(self, params):
    """The frozen params: the reference (loss.beta > 0) or LoRA's base (always), in
    train_step.reference_dtype (LoRA: int8 kernels where model.lora.quantize says)."""
    return train_step.reference_params(params, self.cfg, self.optim, self.mesh, self.lora)

  def policy(self, params, frozen):
    """What the sampler runs: the params, or with LoRA the base with the adapters merged into
    its target kernels (model.lora.merge_for_sampling), or beside them (a group's K adapters:
    members.policy)."""
    if self.lora is None:
      return params
    if self.lora.merge_for_sampling:
      return lora_lib.merged_policy(frozen, params, self.lora, self._merge)
    return lora_lib.variables(frozen, params, self.lora)

  def abstract_checkpoint(self):
    abstract = {"train": train_step.abstract_state(self.cfg, self.optim, self.mesh, self.lora)}
    if self.lora is None and grpo.needs_reference(self.config.loss):
      abstract["ref"] = train_step.abstract_reference(self.cfg, self.optim, self.mesh)
    return abstract

  def evaluate(self, params, rows, ref_params=None) -> float:
    """Greedy pass@1 on rows (ref_params: for an agent's 'reference' role)."""
    return self.rollout.evaluate(params, rows, self.accuracy, ref_params)

  def compile_ahead(self, trainers, group, rows_K, num_rewards):
    """Starts compiling the group's train program for the first rows' likely batch (each
    member's longest completion at max_new_tokens) while they are sampled: the first step then
    takes about the longer of sampling and compiling, not their sum. A group (K > 1) without
    LoRA also compiles its sampling programs for those rows, in the sampler's compile thread.
    group may be abstract (Group.spec). A head start only: a layout that cannot be predicted
    (an agent's) or raises is left to the step."""
    try:
      layouts = [t.rollout.batch_layout(rows, num_rewards) for t, rows in zip(trainers, rows_K)]
    except Exception:  # noqa: BLE001 - sampling these rows reports it
      return
    if any(layout is None for layout in layouts):
      return
    if group.k == 1:
      self.step_fn.precompile(group.state, layouts[0], group.ref)
      return
    # The members' batches as members() gets them: padded to one layout, then stacked.
    empty = [{name: np.zeros(s.shape, s.dtype) for name, s in layout.items()}
             for layout in layouts]
    padded = pad_batches(empty, self.tokenizer.pad_token_id)
    spec = {name: jax.ShapeDtypeStruct((group.k,) + b.shape, b.dtype)
            for name, b in padded[0].items()}
    members_lib.precompile_train(self.step_fn, group.state, spec, group.ref,
                                 hparams_K=group.hparams, batched=self.members_batched)
    if self.lora is None:  # (a LoRA policy is built from the arrays: compiled when sampled)
      members_lib.precompile_sample([t.rollout for t in trainers], group.state["params"],
                                    rows_K, batched=self.members_batched)

  def compile_evals_ahead(self, trainers, group, rows_K):
    """Starts compiling, in the background, the programs evaluate_group will run on rows_K: a
    vmapped group (K > 1) that did not evaluate at its start calls it after its first step, so
    that its first eval (at the latest, the final one) finds them compiled. One run (K = 1)
    compiles its eval's programs at its first eval."""
    if group.k == 1:
      return
    policy = members_lib.policy(self.lora, group.state["params"], group.ref)
    members_lib.precompile_evaluate([t.rollout for t in trainers], policy, rows_K,
                                    batched=self.members_batched)

  def grpo_step(self, state, ref_params, next_rows, rewards, step):
    """One run's GRPO step (group_step with K = 1): next_rows() returns the next
    train.prompts_per_step dataset rows. Returns (state, metrics, samples)."""
    group = Group(1, state, ref_params, self.hparams(self.config))
    group, ms, samples = group_step([self], group, [rewards], [next_rows], step)
    return group.state, ms[0], samples[0]


def evaluate_group(trainers, group: Group, rows_K) -> list[float]:
  """Greedy pass@1 of each member on its rows (trainers: one per member, for_member)."""
  if group.k == 1:
    policy = trainers[0].policy(group.state["params"], group.ref)
    return [trainers[0].evaluate(policy, rows_K[0], group.ref)]
  policy = members_lib.policy(trainers[0].lora, group.state["params"], group.ref)
  return members_lib.evaluate([t.rollout for t in trainers], policy, rows_K,
                              trainers[0].accuracy, batched=trainers[0].members_batched)


def group_step(trainers, group: Group, rewards_K, next_rows_K, step):
  """One GRPO step of K >= 1 runs (trainers: one per member, Trainer.for_member): rollouts
  (host; one sampler call per round for all of them), then one compiled program on the device
  (advantages, reference log-probs and the loss.num_iterations updates). next_rows_K[k]()
  returns run k's next train.prompts_per_step dataset rows, or next_rows_K[k] is None for a
  member that failed: it samples nothing, trains on another member's batch (thrown away) and
  gets None metrics and samples. Returns (group, per run metrics, per run samples)."""
  first, k = trainers[0], group.k
  configs = [t.config for t in trainers]
  params = (first.policy(group.state["params"], group.ref) if k == 1  # what the sampler runs
            else members_lib.policy(first.lora, group.state["params"], group.ref))
  colls = [rollout.Collection(c) for c in configs]
  keys = [jax.random.fold_in(jax.random.key(c.seed), step) for c in configs]
  live = [f is not None for f in next_rows_K]
  ahead = not first.step_fn.num_traces and all(live)  # the first step: compile while sampling
  while any(c.wants_round() for c, on in zip(colls, live) if on):
    want = [c.wants_round() and on for c, on in zip(colls, live)]
    rows = [f() if w else None for f, w in zip(next_rows_K, want)]
    if ahead:
      first.compile_ahead(trainers, group, rows, len(rewards_K[0]))
      ahead = False
    round_keys = [c.round_key(key) for c, key in zip(colls, keys)]
    if k == 1:
      parts = [first.rollout.sample(params, rows[0], rewards_K[0], round_keys[0],
                                    ref_params=group.ref)]
    else:
      parts = members_lib.sample([t.rollout for t in trainers], params, rows, rewards_K,
                                 round_keys, batched=first.members_batched)
    for c, part in zip(colls, parts):
      if part is not None:
        c.add(*part)
  pools, ms = zip(*[c.result() if on else (None, None) for c, on in zip(colls, live)])
  t0 = time.perf_counter()
  pad_id = first.tokenizer.pad_token_id
  batches = [pool.train_batch(c, pad_id) for c, pool in zip(configs, pools) if pool is not None]
  batches = [pool.train_batch(c, pad_id) if pool is not None else batches[0]
             for c, pool in zip(configs, pools)]
  # Host arrays: checked without a device round trip, then uploaded once, by the jitted
  # step's input shardings (the batch split over data × fsdp).
  if k == 1:
    state, train_m, adv = first.step_fn(group.state, batches[0], group.ref, group.hparams)
    train_m, adv = hosts.fetch((train_m, adv))
    train_m, adv = [train_m], [adv]
  else:
    state, train_m, adv = members_lib.train(first.step_fn, group.state,
                                            pad_batches(batches, pad_id), group.hparams,
                                            group.ref, batched=first.members_batched)
    train_m, adv = jax.device_get((train_m, adv))
    train_m = [{name: v[j] for name, v in train_m.items()} for j in range(k)]
  train_s = time.perf_counter() - t0
  ms = [None if m_k is None else dict(m_k) for m_k in ms]
  for m_k, t_k in zip(ms, train_m):
    if m_k is not None:
      m_k.update({name: float(v) for name, v in t_k.items()})
      m_k["time/train_s"] = train_s
  samples = [None if pool is None else _samples(c, pool, adv_k, rewards)
             for c, pool, adv_k, rewards in zip(configs, pools, adv, rewards_K)]
  return dataclasses.replace(group, state=state), ms, samples


LORA_INIT_STREAM = 0x10A  # fold_in stream of the seed for the adapters' initialisation


def lora_settings(config) -> lora_lib.LoraConfig | None:
  """config.model.lora as a LoraConfig, or None (rank 0, or a config without the block)."""
  return lora_lib.LoraConfig.from_config(config.model.get("lora"))


def _samples(config, batch_r, adv_B, rewards):
  """The samples file's records: the first completion of the first train.samples_per_step
  prompts, with its rewards, advantage and gold answer."""
  g = config_lib.group_size(config)
  k = min(config.train.samples_per_step, len(batch_r.rows))
  texts = batch_r.trajectories or batch_r.texts
  return [{"prompt": batch_r.prompts[p], "completion": texts[p * g],
           "rewards": {r.name: float(batch_r.reward_BR[p * g, j]) for j, r in enumerate(rewards)},
           "advantage": float(adv_B[p * g]),
           "gold": data.gold_answer(batch_r.rows[p]["answer"])} for p in range(k)]


# --- command line: a group from a spec file ------------------------------------------------------

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
