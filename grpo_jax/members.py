"""The K runs of a vmapped sweep as one program: the one module that knows K exists.

    group = members.Group.of(states, refs, hparams)   # K = 1: the run's own, unstacked
    group, metrics_K, samples_K = members.group_step(trainers, group, rewards_K, next_rows_K,
                                                     step)
    accuracies_K = members.evaluate(trainers, group, eval_rows_K)

Everything else is written for one run (grpo_jax.loop, grpo_jax.start, the sampler, the rollout
and the train step): a run's loop asks this module for its step, its eval and whatever depends
on how many runs share the program, and one run (K = 1) goes straight to the one-run functions,
paying for no stacking. For K > 1 the runs' device side is stacked on a leading K axis (Group,
stack, unstack) and their programs wrap the one-run functions:

    params = policy(lora, state_K["params"], frozen)      # what the members' sampler runs
    parts = sample(rollouts_K, params, rows_K, rewards_K, keys_K, batched=True)
    accs = evaluate_rollouts(rollouts_K, params, eval_rows_K, reward, batched=True)
    state_K, metrics_K, adv_KB = train(step, state_K, batches, hparams_K, ref_K, batched=True)
    precompile_sample(...), precompile_evaluate(...), precompile_train(...)  # in the background

The host side stays per run: each member has its own data order, rewards, files and stopping
rules (grpo_jax.runs.Run), and the loop visits them in turn. Members may differ only in
VARIABLE (check_vmappable). A member that fails alone is recorded (Failures) and the others go
on; a plain run raises.

What the device side owns:
  - generate / precompile_generate: Sampler.generate for K param sets. The prefill is the
    sampler's _prefill_impl under jax.vmap. The decode loop is this module's own (see below),
    built from the sampler's decode pieces (narrow, head, row_keys, decode_carry, decode_step,
    decode_results). _prefill_impl and _decode_impl keep their underscores because their
    names are those of the sampler's compiled programs, which profiles show
    (jit__decode_impl).
  - sample / evaluate / encode: one rollout round (rollout.SingleTurn.sample) and the greedy
    eval for K runs. Each member keeps its own config, tokenizer, rows and rewards; the device
    work is one generate call for all of them.
  - train / precompile_train: train_step.train_step for K runs, one program per batch layout,
    held by the TrainStep beside its own.
  - policy: what the sampler runs. With LoRA that is the K adapters beside the one base the
    members share; a single run instead merges its adapters into the base.

`batched` (config.members_batched, from the setting train.members) chooses the transformation.
True batches the members under jax.vmap. False runs each member's own program in turn inside
the one program (jax.lax.map), which is what a CPU runs fastest: batching gives it no extra
arithmetic rate. In turn, a member's numbers are its separate run's to the bit. Batched, they
match within rounding (tests/vmapped_test.py).

Why the members' decode loop is its own: jax.vmap of Sampler._decode_impl's while_loop, whose
condition differs per member, selects every carried array between its old and new value at
every step. The KV cache is one of them, so that would copy the cache once per step.
_decode_members_impl instead runs one while_loop over a vmapped decode step, for as long as
any member has a live row. A member whose rows are all done steps on with pads, which leaves
its tokens, log-probs and lengths as its own loop leaves them, and it counts only the steps
its own loop takes. In turn (_decode_members_in_turn_impl), each member runs its own run's
_decode_impl under jax.lax.map, one member after another.

The train step branches on whether the policy is the reference (StepSpec.cond). Under jax.vmap
a per-member predicate would make that cond a select that runs both branches, with every
operand broadcast to K, including the members' shared LoRA base (K copies of it). _cond_all
branches on all members at once (a pmin over AXIS); when the members disagree, it selects per
member.

One process only (check_vmappable refuses several): generate samples each process's rows as if
they were all.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import functools
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import (checkpoint, compile_cache, config as config_lib, data, hosts,
                      policy as policy_lib, rollout, sweep, train_step as train_step_lib)
from grpo_jax.errors import UserError
from grpo_jax.models import qwen
from grpo_jax.sampler import SampleOutput

VARIABLE = sweep.VMAP_VARIABLE  # the settings members may differ in (flat, dotted config keys)


class VmapError(UserError):
  """Runs that cannot share one vmapped program."""


def check_vmappable(configs) -> None:
  """Raises VmapError naming the first setting that keeps these configs out of one program:
  anything but VARIABLE changes a shape or the host's control flow (G, prompts per step,
  max_new_tokens, the temperature, which is static in the sampler and the log-probs)."""
  flats = [config_lib.flat(c.to_dict()) for c in configs]
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
  if len(configs) > 1 and configs[0].model.lora.get("modules_to_save"):
    raise VmapError("config.model.lora.modules_to_save: the members' programs share the base's "
                    "embedding and LM head, not trained copies; run them without --vmap")
  if len(configs) > 1 and configs[0].agent.enabled:
    raise VmapError("config.agent.enabled: multi-turn agent rollouts are not vmapped; run them "
                    "without --vmap")
  if len(configs) > 1 and configs[0].train.off_policy_steps:
    raise VmapError("config.train.off_policy_steps=1: the pipelined loop runs one run at a "
                    "time; run the sweep without --vmap, or with train.off_policy_steps=0")
  if len(configs) > 1 and hosts.count() > 1:  # the members' sampler gathers no process's rows
    raise VmapError(f"a vmapped group runs in one process, and this is one of "
                    f"{hosts.count()}: run its {len(configs)} runs without --vmap")


def check_shared(members):
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
    for k in ("loss_mask_BC", "turn_ids_BC", "sampler_logp_BC"):
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


class Failures:
  """The members that failed while the others went on: a plain run raises its failure; a
  vmapped member leaves what its separate run would (its files up to the failure) and a
  failure record, and the group goes on without it (its device state is still computed in the
  stacked program, and nothing of it written)."""

  def __init__(self, members, main: bool):
    self.members, self.main, self.errors = members, main, {}  # workdir -> error

  def __contains__(self, m) -> bool:
    return m.workdir in self.errors

  def live(self, members) -> list:
    return [m for m in members if m not in self]

  def record(self, m, error, step: int) -> None:
    if len(self.members) == 1:
      raise error
    self.errors[m.workdir] = error
    m.close()
    if self.main:
      m.write_failure(error, step)
    print(f"grpo_jax: {m.workdir}: failed at step {step}: {error}", file=sys.stderr, flush=True)
    if len(self.errors) == len(self.members):  # none left: the group fails as a separate run does
      raise error


def trainers(trainer, runs) -> list:
  """Each run's view of the shared compiled pieces: `trainer` for the first, and for each other
  member the same sampler and train step (compiled once for all) with its own config,
  tokenizer and rollout (its prompts, decoding and warm-start examples)."""
  out = [trainer]
  for m in runs[1:]:
    other = copy.copy(trainer)
    other.config, other.tokenizer = m.config, m.setup.tokenizer
    other.rollout = rollout.SingleTurn(m.config, m.setup.tokenizer, trainer.sampler)
    other.accuracy = rollout.accuracy_reward(m.config)
    out.append(other)
  return out


def vmapped(config) -> bool:
  """Whether the members' programs batch them under jax.vmap (True) or run each member's own
  program in turn (jax.lax.map): train.members, 'auto' by the backend."""
  return config_lib.members_batched(config, jax.default_backend())


def label(m, members) -> str:
  """What a message about run m starts with: nothing for a plain run, a member's workdir."""
  return "" if len(members) == 1 else f"{m.workdir}: "


def progress_name(members) -> str:
  return "grpo" if len(members) == 1 else f"grpo x{len(members)}"


def restore_all(members, abstract):
  """The group's common start step and each member's restored checkpoint there (None: none).
  A plain run restores its latest checkpoint whose files pass their checksums (damaged newer
  ones are skipped); a group, each member's latest usable step, at the earliest of them (a
  member's steps after the group's start are deleted when it opens: open_all)."""
  if len(members) == 1:
    restored = checkpoint.resume(members[0].workdir, abstract)
    return (0 if restored is None else restored.step), [restored]
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
  return start, restored


def shared_base(members, refs, m, ref):
  """LoRA members of a group share one frozen base: member m's, built, must equal the first
  member's to the bit, and is dropped for it (so at most two bases exist at once)."""
  # Compared in the widest dtype among the leaves (an int8 kernel compares exactly as bf16).
  dtype = jnp.result_type(*jax.tree.leaves(refs[0]))
  if not bool(policy_lib.same_params(refs[0], ref, dtype)):
    raise VmapError(
        f"{m.workdir} and {members[0].workdir} have different frozen bases (a warm start or "
        "random initialisation that depends on the seed): LoRA members of a vmapped group "
        "share one base; run them without --vmap, or from one base (the same seed, or a "
        "model.checkpoint without a warm start)")
  return refs[0]


def saved(members, step) -> str:
  """'saved step N to <its checkpoint>', for a group in each member's checkpoints/."""
  if len(members) == 1:
    return f"saved step {step} to {checkpoint.checkpoint_dir(members[0].workdir)}/{step}"
  return f"saved step {step} of each of its {len(members)} runs (<workdir>/checkpoints/{step})"


def postfix(ms) -> dict:
  """The progress bar's figures: a run's reward, accuracy and eval; a group's rewards."""
  if len(ms) > 1:
    return {"reward": "/".join(f"{m['reward/total/mean']:.2f}" for m in ms)}
  m, postfix = ms[0], {"reward": f"{ms[0]['reward/total/mean']:.3f}"}
  if "reward/math_accuracy/mean" in m:
    postfix["acc"] = f"{m['reward/math_accuracy/mean']:.2f}"
  if "eval/accuracy" in m:
    postfix["eval"] = f"{m['eval/accuracy']:.3f}"
  return postfix


def announce(members, cfg, mesh) -> None:
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


def open_all(members, start: int, main: bool) -> None:
  """Each member's config.json (process 0), writers and checkpointer from `start` on."""
  for m in members:
    m.open(start, main)
    if len(members) > 1:  # a member that got further than the others redoes those steps
      m.ckpt.delete_after(start)


def compile_ahead(trainers, group, rows_K, num_rewards, behaviour_logp=False):
  """Starts compiling the group's train program for the first rows' likely batch (each
  member's longest completion at max_new_tokens) while they are sampled: the first step then
  takes about the longer of sampling and compiling, not their sum. A group (K > 1) without
  LoRA also compiles its sampling programs for those rows, in the sampler's compile thread.
  group may be abstract (Group.spec); behaviour_logp: the batch carries the sampler's
  log-probs (train.off_policy_steps=1, one run). A head start only: a layout that cannot be predicted
  (an agent's) or raises is left to the step."""
  first = trainers[0]
  try:
    layouts = [t.rollout.batch_layout(rows, num_rewards) for t, rows in zip(trainers, rows_K)]
  except Exception:  # noqa: BLE001 - sampling these rows reports it
    return
  if any(layout is None for layout in layouts):
    return
  if group.k == 1:
    layout = layouts[0]
    if behaviour_logp:  # one step behind: the sampler's log-probs ride with the batch
      layout = dict(layout, old_logp_BC=jax.ShapeDtypeStruct(layout["completion_BC"].shape,
                                                             np.float32))
    first.step_fn.precompile(group.state, layout, group.ref)
    return
  # The members' batches as members() gets them: padded to one layout, then stacked.
  empty = [{name: np.zeros(s.shape, s.dtype) for name, s in layout.items()}
           for layout in layouts]
  padded = pad_batches(empty, first.tokenizer.pad_token_id)
  spec = {name: jax.ShapeDtypeStruct((group.k,) + b.shape, b.dtype)
          for name, b in padded[0].items()}
  precompile_train(first.step_fn, group.state, spec, group.ref, hparams_K=group.hparams,
                   batched=vmapped(first.config))
  # Members sharing a LoRA base sample variables built from the arrays: compiled when sampled.
  if not first.policy_type.members_share_frozen:
    precompile_sample([t.rollout for t in trainers],
                      policy(first.policy_type, group.state["params"], group.ref), rows_K,
                      batched=vmapped(first.config))


def compile_evals_ahead(trainers, group, rows_K):
  """Starts compiling, in the background, the programs evaluate will run on rows_K: a
  vmapped group (K > 1) that did not evaluate at its start calls it after its first step, so
  that its first eval (at the latest, the final one) finds them compiled. One run (K = 1)
  compiles its eval's programs at its first eval."""
  if group.k == 1:
    return
  first = trainers[0]
  params = policy(first.policy_type, group.state["params"], group.ref)
  precompile_evaluate([t.rollout for t in trainers], params, rows_K,
                      batched=vmapped(first.config))


def evaluate(trainers, group: Group, rows_K) -> list[float]:
  """Greedy pass@1 of each member on its rows (trainers: one per member, as trainers() makes)."""
  first = trainers[0]
  if group.k == 1:
    return [first.evaluate(first.policy(group.state["params"], group.ref), rows_K[0], group.ref)]
  params = policy(first.policy_type, group.state["params"], group.ref)
  return evaluate_rollouts([t.rollout for t in trainers], params, rows_K, first.accuracy,
                           batched=vmapped(first.config))


def group_step(trainers, group: Group, rewards_K, next_rows_K, step):
  """One GRPO step of K >= 1 runs (trainers: one per member, as trainers() makes): rollouts
  (host; one sampler call per round for all of them), then one compiled program on the device
  (advantages, reference log-probs and the loss.num_iterations updates). next_rows_K[k]()
  returns run k's next train.prompts_per_step dataset rows, or next_rows_K[k] is None for a
  member that failed: it samples nothing, trains on another member's batch (thrown away) and
  gets None metrics and samples. Returns (group, per run metrics, per run samples)."""
  first, k = trainers[0], group.k
  configs = [t.config for t in trainers]
  params = (first.policy(group.state["params"], group.ref) if k == 1  # what the sampler runs
            else policy(first.policy_type, group.state["params"], group.ref))
  colls = [rollout.Collection(c) for c in configs]
  keys = [jax.random.fold_in(jax.random.key(c.seed), step) for c in configs]
  live = [f is not None for f in next_rows_K]
  ahead = not first.step_fn.num_traces and all(live)  # the first step: compile while sampling
  while any(c.wants_round() for c, on in zip(colls, live) if on):
    want = [c.wants_round() and on for c, on in zip(colls, live)]
    rows = [f() if w else None for f, w in zip(next_rows_K, want)]
    if ahead:
      compile_ahead(trainers, group, rows, len(rewards_K[0]))
      ahead = False
    round_keys = [c.round_key(key) for c, key in zip(colls, keys)]
    if k == 1:
      parts = [first.rollout.sample(params, rows[0], rewards_K[0], round_keys[0],
                                    ref_params=group.ref)]
    else:
      parts = sample([t.rollout for t in trainers], params, rows, rewards_K, round_keys,
                     batched=vmapped(first.config))
    for c, part in zip(colls, parts):
      if part is not None:
        c.add(*part)
  pools, ms = zip(*[c.result() if on else (None, None) for c, on in zip(colls, live)])
  t0 = time.perf_counter()
  pad_id = first.tokenizer.pad_token_id
  batches = [pool.train_batch(c, pad_id) for c, pool in zip(configs, pools) if pool is not None]
  batches = [pool.train_batch(c, pad_id) if pool is not None else batches[0]
             for c, pool in zip(configs, pools)]
  return update(trainers, group, pools, ms, batches, rewards_K, t0)


def update(trainers, group: Group, pools, ms, batches, rewards_K, t0):
  """group_step's second half, the update: batches (one host batch per member, in the rollout
  layout; a failed member's is another's) trained on in one compiled program. pools, ms: each
  member's Rollouts and rollout metrics (None for a failed member); t0: when the update's
  host work began (time/train_s). Returns (group, per run metrics, per run samples)."""
  first, k = trainers[0], group.k
  configs = [t.config for t in trainers]
  pad_id = first.tokenizer.pad_token_id
  # Host arrays: checked without a device round trip, then uploaded once, by the jitted
  # step's input shardings (the batch split over data × fsdp).
  if k == 1:
    state, train_m, adv = first.step_fn(group.state, batches[0], group.ref, group.hparams)
    train_m, adv = hosts.fetch((train_m, adv))
    train_m, adv = [train_m], [adv]
  else:
    state, train_m, adv = train(first.step_fn, group.state, pad_batches(batches, pad_id),
                                group.hparams, group.ref, batched=vmapped(first.config))
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


# --- the members' device side ---------------------------------------------------------------

AXIS = "members"  # the jax.vmap axis of the K members (batched)


def policy(policy_type, params_K, frozen):
  """What the members' sampler runs, as model.apply's variables (a policy.Policy's): the K
  stacked params; with LoRA the K stacked adapters beside the one frozen base they share (never
  merged: K merged bases would be K copies of it)."""
  return policy_type.variables(params_K, frozen)


# --- sampling --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Inputs:
  tokens: jax.Array    # [K, B_pad, bucket]
  masks: jax.Array     # [K, B_pad, bucket] int32
  capacity: int        # the cache's slots: the bucket and max_new_tokens
  row_ids: jax.Array   # [B_pad * G, 2]: (prompt, sample) of each row, folded into its key
  active: jax.Array    # [B_pad * G]: False for the rows padding the batch to the mesh
  settings: Any        # token_choice.SamplingParams
  keys: jax.Array      # [K] PRNG keys
  b: int               # the prompts a member gave
  own_buckets: list    # the bucket each member's own prompts need


def generate(sampler, params_K, prompts_K, *, num_samples, keys_K=None, greedy=False,
             batched=True):
  """sampler.generate for K runs of a sweep at once: params_K stacked on a leading K axis (LoRA
  members: variables whose 'lora' adapters are stacked and whose 'params', the frozen base,
  is one copy they share); the prefill under jax.vmap over the members' params, the decode
  too (batched) or each member's own decode loop in turn in one program (batched=False,
  jax.lax.map; config.members_batched says which a run uses).

  prompts_K: per member a list of token-id lists (all of one length B), or None for a member
  that sits this call out (it samples another member's prompts, thrown away). Returns per
  member a SampleOutput (its prompt fields None), or None. As generate: rows b*G + g, each
  row's key fold_in(fold_in(key, b), g); every member's prompts left-padded to one bucket
  (the largest any member needs), which changes no number. One process only."""
  g = int(num_samples)
  prefill, decode = _programs(sampler, params_K, batched)
  sits_out = [p is None for p in prompts_K]
  x = _inputs(sampler, prompts_K, g, greedy, keys_K)
  b, own_buckets = x.b, x.own_buckets
  ahead = sampler.cached(_ahead_key(params_K, batched, x, g))
  if ahead is not None:  # compiled ahead: wait for it rather than compile the same again
    concurrent.futures.wait([ahead])  # (had it failed, the call compiles and raises)
  start = time.perf_counter()
  cache, state = prefill(params_K, x.tokens, x.masks, g, x.capacity)
  jax.block_until_ready(state)
  prefill_s = time.perf_counter() - start
  out, _, _ = decode(params_K, cache, state, x.keys, x.row_ids, x.active, x.settings,
                     sampler.max_new_tokens)
  out = jax.device_get(out)
  seconds = time.perf_counter() - start
  results = []
  for k in range(len(prompts_K)):
    lengths = out["lengths"][k, :b * g]
    row_steps = int(out["row_steps"][k])  # the member's own loop's: its steps x every row
    results.append(SampleOutput(out["tokens"][k, :b * g], lengths, out["truncated"][k, :b * g],
                                out["logprobs"][k, :b * g], None, None, {
        "sampler/tokens_per_s": int(lengths.sum()) / seconds,
        "sampler/seconds": seconds,
        "sampler/prefill_seconds": prefill_s,
        "sampler/decode_steps": int(out["steps"][k]),
        "sampler/cut_extra_rounds": int(out["extra_rounds"][k]),
        "sampler/cut_fallback_rows": int(out["fallback_rows"][k]),
        "sampler/prompt_bucket": own_buckets[k],  # what the member's own run pads to
        "sampler/row_steps": row_steps,
        "sampler/row_steps_wasted": 1.0 - int(lengths.sum()) / row_steps if row_steps else 0.0,
    }))
  return [None if out_k else r for r, out_k in zip(results, sits_out)]


def precompile_generate(sampler, params_K, prompts_K, *, num_samples, greedy=False,
                        batched=True):
  """Starts compiling, in the sampler's compile thread (compile_cache.in_background), the two
  programs that generate runs for prompts of this layout: their number and prompt bucket (the
  token values do not matter) and the same num_samples, greedy and batched. A later generate
  call runs them without compiling, or waits for the compile under way. A vmapped group
  compiles its first step's sampling programs this way from its start, and its evals' while
  it trains. params_K may be abstract (train.stacked_spec)."""
  g = int(num_samples)
  prefill, decode = _programs(sampler, params_K, batched)
  x = _inputs(sampler, prompts_K, g, greedy, None)
  key = _ahead_key(params_K, batched, x, g)
  if sampler.cached(key) is not None:
    return
  params = jax.tree.map(compile_cache.abstract, params_K)
  # (Abstract params, train.stacked_spec's, are committed where they have a sharding.)
  committed = any(getattr(leaf, "committed", getattr(leaf, "sharding", None) is not None)
                  for leaf in jax.tree.leaves(params_K))

  def compile_both():
    # The prefill's outputs as the compiled program lays them out: what the decode gets
    # (committed as its inputs were).
    out = prefill.lower(params, x.tokens, x.masks, g, x.capacity).compile().out_info
    cache, state = jax.tree.map(lambda o: compile_cache.abstract(o, committed), out)
    decode.lower(params, cache, state, x.keys, x.row_ids, x.active, x.settings,
                 sampler.max_new_tokens).compile()
  sampler.cached(key, lambda: compile_cache.in_background(compile_both, lane="sampler"))


def _programs(sampler, params_K, batched):
  """generate's jitted (prefill, decode) for these params (a shared LoRA base or not) and
  batched, kept by the sampler."""
  shared_base = _shared_base(params_K)

  def make():
    opts = compile_cache.compiler_options(sampler.mesh)
    axes = {"params": None, "lora": 0} if shared_base else 0
    # Every member's prompts are padded to one bucket: one slot to write from, for all.
    prefill = lambda p, t, m, g, c: jax.vmap(
        lambda p, t, m: sampler._prefill_impl(p, t, m, g, c), in_axes=(axes, 0, 0),
        out_axes=(0, {"hidden": 0, "mask": 0, "pos": 0, "slot": None}))(p, t, m)
    decode = functools.partial(
        _decode_members_impl if batched else _decode_members_in_turn_impl, sampler)
    return (jax.jit(prefill, static_argnums=(3, 4), compiler_options=opts),
            # Batched, the loop updates the prefill's cache in place; in turn, each member's
            # loop works on its own slice of it, and nothing is returned to alias the donation
            # with.
            jax.jit(decode, static_argnums=(6, 7), donate_argnums=(1,) if batched else (),
                    compiler_options=opts))
  return sampler.cached((__name__, "programs", shared_base, batched), make)


def _inputs(sampler, prompts_K, g, greedy, keys_K) -> _Inputs:
  """generate's arguments on the host: every member's prompts left-padded to one bucket (a
  member sitting out, None, takes the first given member's) and the batch padded to the mesh;
  the decode's row ids, active rows, settings and keys."""
  given = [p for p in prompts_K if p is not None]
  rows_K = [sampler.as_token_lists(p if p is not None else given[0], None) for p in prompts_K]
  b = len(rows_K[0])
  own_buckets = [data.bucket_length(max(len(r) for r in rows), sampler.buckets)
                 for rows in rows_K]
  bucket = max(own_buckets)
  b_pad = -(-b // sampler.batch_multiple()) * sampler.batch_multiple()
  tokens, masks = zip(*[data.pad_to_bucket([rows[min(i, b - 1)] for i in range(b_pad)],
                                           (bucket,), sampler.pad_id) for rows in rows_K])
  row_ids = np.stack([np.repeat(np.arange(b_pad), g), np.tile(np.arange(g), b_pad)], 1)
  active = np.zeros((b_pad * g,), bool)
  active[:b * g] = True
  if keys_K is None:
    keys_K = [jax.random.key(0)] * len(prompts_K)
  return _Inputs(
      jnp.asarray(np.stack(tokens)), jnp.asarray(np.stack(masks).astype(np.int32)),
      bucket + sampler.max_new_tokens, jnp.asarray(row_ids.astype(np.int32)),
      jnp.asarray(active), sampler.sampling_params({"greedy": True} if greedy else {}),
      jnp.stack(keys_K), b, own_buckets)


def _ahead_key(params_K, batched, x: _Inputs, g: int) -> tuple:
  """What tells generate's programs apart, but the params' shapes (one run's)."""
  return __name__, "ahead", _shared_base(params_K), batched, tuple(x.tokens.shape), g, x.settings


def _shared_base(params_K) -> bool:
  """Whether params_K are LoRA members' variables: stacked adapters on one base."""
  return isinstance(params_K, dict) and "lora" in params_K


def _decode_members_impl(sampler, params_K, cache_K, state_K, rng_K, row_ids_R2, active_R,
                         sp, c: int):
  """sampler._decode_impl for K members at once (params, cache, state and key stacked on a
  leading K; state_K['slot'] one scalar for all): each member's results are those of its own
  loop, from one while_loop over a vmapped step (the module docstring says why)."""
  # LoRA members (variables with 'lora') share one base, unstacked; else all is stacked.
  shared_base = "lora" in params_K
  v_K = sampler.narrow(params_K)
  head_K = sampler.head(v_K["params"]) if shared_base else jax.vmap(sampler.head)(v_K["params"])
  keys_K = jax.vmap(sampler.row_keys, in_axes=(0, None))(rng_K, row_ids_R2)
  params_K, p_axes = _layer_major(sampler, v_K, shared_base)
  s_axes = {name: None if name == "slot" else 0 for name in state_K}
  carry_K = jax.vmap(lambda st: sampler.decode_carry(st, active_R, c), in_axes=(s_axes,))(
      state_K)

  def step_member(params, head, keys_R, state, cache, s, i):
    running = ~jnp.all(s["done"])
    cache, new = sampler.decode_step(params, head, keys_R, state, sp, cache, s, i)
    return cache, dict(new, step=s["step"] + running,
                       **{k: jnp.where(running, new[k], s[k])
                          for k in ("extra_rounds", "fallback_rows")})

  step_K = jax.vmap(step_member, in_axes=(p_axes, None if shared_base else 0, 0, s_axes, 0,
                                          0, None))

  def body(x):
    i, cache, s = x
    cache, s = step_K(params_K, head_K, keys_K, state_K, cache, s, i)
    return i + 1, cache, s

  cond = lambda x: (x[0] < c) & ~jnp.all(x[2]["done"])
  _, cache_K, out_K = jax.lax.while_loop(cond, body, (jnp.int32(0), cache_K, carry_K))
  results, new_state = jax.vmap(sampler.decode_results, in_axes=(s_axes, 0, None))(
      state_K, out_K, active_R)
  return results, cache_K, new_state


def _layer_major(sampler, v_K, shared_base):
  """The members' narrowed variables v_K (sampler.narrow's, a dict this updates) with the
  layer axis first ([L, K, ...]), and their vmap in_axes. The layer scan slices its weights
  along the layer axis: with that axis first a slice is one contiguous block, where
  [K, L, ...] made XLA copy every weight each step. With cfg.run.unroll_decode, a qwen.Unrolled
  whose layer i is [K, ...]: the members' axis is 0."""
  p_axes = {}
  for col, tree in v_K.items():
    if shared_base and col == "params":
      p_axes[col] = None
      continue
    v_K[col] = dict(tree, layers=jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), tree["layers"]))
    p_axes[col] = jax.tree.map(lambda _: 0, v_K[col])
    p_axes[col]["layers"] = jax.tree.map(lambda _: 1, v_K[col]["layers"])
  if sampler.cfg.run.unroll_decode:
    v_K = qwen.unroll(v_K)
    p_axes = qwen.Unrolled(
        {col: None if a is None else {k: x for k, x in a.items() if k != "layers"}
         for col, a in p_axes.items()},
        [{col: None if p_axes[col] is None else jax.tree.map(lambda _: 0, tree)
          for col, tree in layer.items()} for layer in v_K.layers])
  return v_K, p_axes


def _decode_members_in_turn_impl(sampler, params_K, cache_K, state_K, rng_K, row_ids_R2,
                                 active_R, sp, c: int):
  """_decode_members_impl's results with the members' loops run one after another
  (jax.lax.map) in the one program: member k's decode is its own run's _decode_impl, with no
  batching across members (what a CPU runs fastest; train.members). No cache or state comes
  back (None, None): generate uses neither."""
  shared_base = "lora" in params_K
  slot = state_K["slot"]

  def one(x):
    p, cache, state, rng = x
    p = dict(params_K, lora=p) if shared_base else p
    return sampler._decode_impl(p, cache, dict(state, slot=slot), rng, row_ids_R2, active_R,
                                sp, c)[0]
  state = {name: x for name, x in state_K.items() if name != "slot"}
  own = params_K["lora"] if shared_base else params_K  # what differs per member
  return jax.lax.map(one, (own, cache_K, state, rng_K)), None, None


# --- rollouts --------------------------------------------------------------------------------

def sample(rollouts_K, params_K, rows_K, rewards_K, keys_K, batched=True):
  """One round of rollout.SingleTurn.sample for each of K runs at once (params stacked on a
  leading K axis), through the first one's sampler: rows_K[k] None for a member that sits
  this round out (its result None). Each member's prompts, tokenizer and rewards are its own;
  what shapes the program is shared (grpo_jax.train.check_vmappable)."""
  t0 = time.perf_counter()
  prompts = encode(rollouts_K, rows_K)
  first = rollouts_K[0]
  outs = generate(first.sampler, params_K, [None if p is None else p.ids for p in prompts],
                  num_samples=config_lib.group_size(first.config), keys_K=keys_K,
                  batched=batched)
  return [None if rows is None else rollout.score_samples(r.config, r.tokenizer, rows, p, out,
                                                          rewards, t0)
          for r, rows, p, out, rewards in zip(rollouts_K, rows_K, prompts, outs, rewards_K)]


def encode(rollouts_K, rows_K) -> list[rollout.Prompts | None]:
  """rollout.encode for each member's rows (None for a member without rows), run once for
  members whose rows, tokenizer and prompt settings agree, as a sweep's members from one seed
  draw the same rows: those members hold the same Prompts."""
  done, out = {}, []
  for r, rows in zip(rollouts_K, rows_K):
    if rows is None:
      out.append(None)
      continue
    key = (id(r.tokenizer), rollout.prompt_settings(r.config),
           tuple(x["question"] for x in rows))
    if key not in done:
      done[key] = rollout.encode(r.config, r.tokenizer, rows)
    out.append(done[key])
  return out


def evaluate_rollouts(rollouts_K, params_K, rows_K, reward, batched=True) -> list[float]:
  """rollout.SingleTurn.evaluate for each of K runs at once, each on its own rows (of one
  length), with its own tokenizer."""
  first = rollouts_K[0]
  correct = np.zeros(len(rows_K), int)
  for chunks, prompts in _eval_chunks(rollouts_K, rows_K):
    outs = generate(first.sampler, params_K, [p.ids for p in prompts], num_samples=1,
                    greedy=True, batched=batched)
    for k, (r, chunk, p, out) in enumerate(zip(rollouts_K, chunks, prompts, outs)):
      texts = r.tokenizer.batch_decode([t[:n] for t, n in zip(out.tokens, out.lengths)],
                                       skip_special_tokens=True)
      scores = reward.fn(p.texts, texts, group_size=1, **rollout.reward_columns(chunk, 1))
      correct[k] += sum(s == 1.0 for s in scores)
  return [c / max(len(rows), 1) for c, rows in zip(correct, rows_K)]


def precompile_sample(rollouts_K, params_K, rows_K, batched=True) -> None:
  """Starts compiling, in the background, the programs `sample` will run on these rows
  (precompile_generate)."""
  first = rollouts_K[0]
  prompts = [p.ids for p in encode(rollouts_K, rows_K)]
  precompile_generate(first.sampler, params_K, prompts,
                      num_samples=config_lib.group_size(first.config), batched=batched)


def precompile_evaluate(rollouts_K, params_K, rows_K, batched=True) -> None:
  """Starts compiling, in the background, the programs `evaluate_rollouts` will run on these rows
  (precompile_generate, once per distinct chunk layout)."""
  for _, prompts in _eval_chunks(rollouts_K, rows_K):
    precompile_generate(rollouts_K[0].sampler, params_K, [p.ids for p in prompts],
                        num_samples=1, greedy=True, batched=batched)


def _eval_chunks(rollouts_K, rows_K):
  """evaluate_rollouts' chunks of train.eval_batch_size rows: (each member's rows, their encoded
  prompts)."""
  bs = rollouts_K[0].config.train.eval_batch_size
  for i in range(0, len(rows_K[0]), bs):
    chunks = [rows[i:i + bs] for rows in rows_K]
    yield chunks, encode(rollouts_K, chunks)


# --- the train step --------------------------------------------------------------------------

def train(step, state_K, batches, hparams_K, ref_K=None, batched=True):
  """step (a train_step.TrainStep) for K runs at once: batches is K host batches of one layout
  (train.pad_batches), hparams_K the members' hparams stacked, state_K and ref_K their states
  stacked on a leading K axis (with LoRA ref_K is the one frozen base they share, unstacked).
  Returns (state_K, metrics with a leading K axis, advantages [K, B])."""
  for b in batches:
    step.check(b, ref_K is not None)
  batch_K = {name: np.stack([b[name] for b in batches]) for name in batches[0]}
  need_ref = step.needs_ref(batch_K)
  return train_program(step, batch_K, need_ref, batched)(state_K, hparams_K,
                                                          ref_K if need_ref else None, batch_K)


def precompile_train(step, state_K, batch_spec_K, ref_K=None, *, hparams_K, batched=True):
  """Starts compiling, in a background thread, the program `train` runs for batches of
  batch_spec_K's layout (name -> jax.ShapeDtypeStruct with a leading K axis, as `train`
  stacks them), as TrainStep.precompile does for one run."""
  need_ref = step.needs_ref(batch_spec_K)
  step.precompile_program(_train_key(batch_spec_K, need_ref, batched),
                          lambda: train_program(step, batch_spec_K, need_ref, batched),
                          state_K, batch_spec_K, ref_K if need_ref else None, hparams_K)


def _train_key(batch_K, with_ref: bool, batched: bool) -> tuple:
  return (__name__, batched) + train_step_lib.layout_key(batch_K, with_ref)


def train_program(step, batch_K, with_ref: bool, batched: bool):
  """The members' jitted program (state_K, hparams_K, ref_K, batch_K) for this stacked layout,
  kept by step (a train_step.TrainStep): train_step.train_step under jax.vmap (its cond over
  all members, _cond_all) or under jax.lax.map. Its shardings follow its inputs."""
  def make():
    spec = dataclasses.replace(step.spec, with_ref=with_ref,
                               **({"cond": _cond_all} if batched else {}))
    one = functools.partial(train_step_lib.train_step, spec=spec)

    def fn(state, hp, ref, b):
      # LoRA members share one frozen base: it enters unbatched.
      shared = ref is not None and spec.policy.members_share_frozen
      if not batched:
        if shared:
          return jax.lax.map(lambda x: one(*x, ref), (state, b, hp))
        return jax.lax.map(lambda x: one(*x), (state, b, hp, ref))
      return jax.vmap(one, in_axes=(0, 0, 0, None if shared else 0),
                      axis_name=AXIS)(state, b, hp, ref)
    return fn, {"donate_argnums": 0}
  return step.jitted(_train_key(batch_K, with_ref, batched), make)


def _cond_all(pred, if_true, if_false):
  """StepSpec.cond under jax.vmap over AXIS: one branch for all members when they agree (the
  module docstring says why), else a select per member."""
  everyone = jax.lax.pmin(pred.astype(jnp.int32), AXIS) > 0
  return jax.lax.cond(everyone, if_true, lambda: jnp.where(pred, if_true(), if_false()))
