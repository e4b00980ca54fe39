"""The K runs of a vmapped sweep as one program: the one module that knows K exists.

    group = members.Group.of(states, refs, hparams)   # K = 1: the run's own, unstacked
    group, metrics_K, samples_K = members.group_step(trainers, group, rewards_K, next_rows_K, step)
    accuracies_K = members.evaluate(trainers, group, eval_rows_K)

Everything else is written for one run (grpo_jax.loop, grpo_jax.start, the sampler, the rollout
and the train step). Here the K runs' device side is stacked on a leading K axis (Group, stack,
unstack) and their programs wrap the one-run functions; one run (K = 1) goes straight to them
and pays for no stacking. The host side stays per run: each member has its own data order,
rewards, files and stopping rules (grpo_jax.runs.Run), and the loop visits them in turn. Members
may differ only in VARIABLE (check_vmappable). A member that fails alone is recorded
(Failures: FAILURE_FILE) and the others go on; a plain run raises.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import (checkpoint, config as config_lib, data, hosts, rollout, storage, sweep,
                      train_step, workdir_files)
from grpo_jax.errors import UserError
from grpo_jax.models import qwen

FAILURE_FILE = workdir_files.FAILURE_FILE

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
  if len(configs) > 1 and configs[0].agent.enabled:
    raise VmapError("config.agent.enabled: multi-turn agent rollouts are not vmapped; run them "
                    "without --vmap")
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
      storage.write_text(storage.path(m.workdir) / FAILURE_FILE, json.dumps(
          {"error": type(error).__name__, "message": str(error), "step": step}, indent=2))
    print(f"grpo_jax: {m.workdir}: failed at step {step}: {error}", file=sys.stderr, flush=True)
    if len(self.errors) == len(self.members):  # none left: the group fails as a separate run does
      raise error


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
  if not bool(train_step.same_params(refs[0], ref, dtype)):
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


def compile_ahead(trainers, group, rows_K, num_rewards):
  """Starts compiling the group's train program for the first rows' likely batch (each
  member's longest completion at max_new_tokens) while they are sampled: the first step then
  takes about the longer of sampling and compiling, not their sum. A group (K > 1) without
  LoRA also compiles its sampling programs for those rows, in the sampler's compile thread.
  group may be abstract (Group.spec). A head start only: a layout that cannot be predicted
  (an agent's) or raises is left to the step."""
  first = trainers[0]
  try:
    layouts = [t.rollout.batch_layout(rows, num_rewards) for t, rows in zip(trainers, rows_K)]
  except Exception:  # noqa: BLE001 - sampling these rows reports it
    return
  if any(layout is None for layout in layouts):
    return
  if group.k == 1:
    first.step_fn.precompile(group.state, layouts[0], group.ref)
    return
  # The members' batches as members() gets them: padded to one layout, then stacked.
  empty = [{name: np.zeros(s.shape, s.dtype) for name, s in layout.items()}
           for layout in layouts]
  padded = pad_batches(empty, first.tokenizer.pad_token_id)
  spec = {name: jax.ShapeDtypeStruct((group.k,) + b.shape, b.dtype)
          for name, b in padded[0].items()}
  first.step_fn.precompile(group.state, spec, group.ref, k=group.k,
                           batched=first.members_batched, hparams=group.hparams)
  if first.lora is None:  # (a LoRA policy is built from the arrays: compiled when sampled)
    rollout.precompile_sample_members([t.rollout for t in trainers],
                                      first.policy(group.state["params"], group.ref, True),
                                      rows_K, batched=first.members_batched)


def compile_evals_ahead(trainers, group, rows_K):
  """Starts compiling, in the background, the programs evaluate will run on rows_K: a
  vmapped group (K > 1) that did not evaluate at its start calls it after its first step, so
  that its first eval (at the latest, the final one) finds them compiled. One run (K = 1)
  compiles its eval's programs at its first eval."""
  if group.k == 1:
    return
  first = trainers[0]
  policy = first.policy(group.state["params"], group.ref, members=True)
  rollout.precompile_evaluate_members([t.rollout for t in trainers], policy, rows_K,
                                      batched=first.members_batched)


def evaluate(trainers, group: Group, rows_K) -> list[float]:
  """Greedy pass@1 of each member on its rows (trainers: one per member, for_member)."""
  policy = trainers[0].policy(group.state["params"], group.ref, members=group.k > 1)
  if group.k == 1:
    return [trainers[0].evaluate(policy, rows_K[0], group.ref)]
  return rollout.evaluate_members([t.rollout for t in trainers], policy, rows_K,
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
  params = first.policy(group.state["params"], group.ref, members=k > 1)  # what the sampler runs
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
      parts = rollout.sample_members([t.rollout for t in trainers], params, rows, rewards_K,
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
    state, train_m, adv = first.step_fn.members(group.state, pad_batches(batches, pad_id),
                                                group.hparams, group.ref,
                                                batched=first.members_batched)
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
