"""K runs of a sweep as one program: the GRPO phase of runs that share every shape, vmapped.

    python -m grpo_jax.vmapped --spec=group.json   # what `python -m grpo_jax.sweep --vmap` runs
    # group.json: {"config": "configs/gsm8k.py:tiny",
    #              "members": [{"workdir": "runs/x/optim.lr=1e-05", "args": {"optim.lr": 1e-05}},
    #                          ...]}

Members may differ only in VARIABLE: the seed (its data order, warm start and random stream),
optim.lr, loss.beta (all zero or all > 0: β > 0 adds the reference forward), loss.epsilon,
loss.epsilon_high and rewards.weights. Anything else changes a shape or the host's control flow
(G, prompts per step, max_new_tokens, the sampling temperature, which is static in the sampler
and in the log-probs' custom VJP) and is rejected up front with the setting named.

Device work is batched over a leading K axis: params, optimizer state and RNG keys are stacked,
the sampler's prefill and decode and the train step's whole program (TrainStep._program) run
under jax.vmap. The host stays per member: its data iterator, its rewards, its dynamic-sampling
rounds (a round is sampled for every member when any needs one; each member keeps only the
rounds its own run would take), its metrics, samples, checkpoints and final model, in its own
workdir, exactly as `python -m grpo_jax.main` writes them. The warm start and the step-0 eval
stay per member (a member's own Trainer, the same code as train.run); a member whose workdir
holds a checkpoint (a sweep prefix's step 0, or an interrupted group) starts from it.

Member k is bitwise the separate run with its settings on CPU (tests/vmapped_test.py): vmapped
matmuls, a shared prompt bucket and completion width give the same numbers here, and a setting
that varies enters the traced program as PerMember, whose arithmetic with Python numbers runs on
the host in float64 like the separate run's constant folding.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from grpo_jax import (checkpoint, compile_cache, data, grpo, inputs, logging_io, plots, rollout,
                      sft, sharding, sweep, train, train_step)
from grpo_jax.errors import UserError
from grpo_jax.models import weights
from grpo_jax.rewards import Interrupted, MissingRewardsError, RewardHealth

VARIABLE = sweep.VMAP_VARIABLE  # the settings members may differ in (flat, dotted config keys)
# Metrics that measure the machine, not the run: they differ between any two runs.
TIMING_METRICS = ("time/sample_s", "time/reward_s", "time/train_s", "sampler/tokens_per_s",
                  "sampler/seconds", "sampler/prefill_seconds")


class VmapError(UserError):
  """Runs that cannot share one vmapped program."""


# --- what may differ ----------------------------------------------------------------------------

def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
  return out


def check_vmappable(configs) -> None:
  """Raises VmapError naming the first setting that keeps these configs out of one program."""
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
  if configs[0].agent.enabled:
    raise VmapError("config.agent.enabled: multi-turn agent rollouts are not vmapped; run them "
                    "without --vmap")


class PerMember:
  """A setting with one value per member, where the train step reads a Python float.

  Inside the vmapped program, `k` is the traced member index. Arithmetic with Python numbers
  stays on the host, per member, in float64, as Python folds constants in a separate run
  (`1.0 - epsilon`); meeting an array, member k's float32 value is gathered, the number the
  separate run's weakly typed constant becomes. Comparisons decide the program's structure
  (`beta != 0`, `lr > 0`): they must come out alike for every member.
  """

  def __init__(self, name, values, k):
    self.name, self.values, self.k = name, [float(v) for v in values], k

  def __jax_array__(self):
    return jnp.asarray(np.asarray(self.values, np.float32))[self.k]

  def _op(self, other, fn):
    if isinstance(other, PerMember):
      return PerMember(self.name, [fn(a, b) for a, b in zip(self.values, other.values)], self.k)
    if isinstance(other, (int, float, np.floating, np.integer)) and not isinstance(other, bool):
      return PerMember(self.name, [fn(v, float(other)) for v in self.values], self.k)
    return fn(self.__jax_array__(), other)

  def _cmp(self, other, fn, op):
    if isinstance(other, (int, float)) and not isinstance(other, bool):
      answers = {bool(fn(v, other)) for v in self.values}
      if len(answers) == 1:
        return answers.pop()
      raise VmapError(f"config.{self.name}: the members {self.values} differ in whether "
                      f"{self.name} {op} {other}, which decides the program's structure")
    return fn(self.__jax_array__(), other)

  __add__ = lambda s, o: s._op(o, lambda a, b: a + b)
  __radd__ = lambda s, o: s._op(o, lambda a, b: b + a)
  __sub__ = lambda s, o: s._op(o, lambda a, b: a - b)
  __rsub__ = lambda s, o: s._op(o, lambda a, b: b - a)
  __mul__ = lambda s, o: s._op(o, lambda a, b: a * b)
  __rmul__ = lambda s, o: s._op(o, lambda a, b: b * a)
  __truediv__ = lambda s, o: s._op(o, lambda a, b: a / b)
  __rtruediv__ = lambda s, o: s._op(o, lambda a, b: b / a)
  __pow__ = lambda s, o: s._op(o, lambda a, b: a ** b)
  __rpow__ = lambda s, o: s._op(o, lambda a, b: b ** a)
  __neg__ = lambda s: PerMember(s.name, [-v for v in s.values], s.k)
  __gt__ = lambda s, o: s._cmp(o, lambda a, b: a > b, ">")
  __ge__ = lambda s, o: s._cmp(o, lambda a, b: a >= b, ">=")
  __lt__ = lambda s, o: s._cmp(o, lambda a, b: a < b, "<")
  __le__ = lambda s, o: s._cmp(o, lambda a, b: a <= b, "<=")
  __eq__ = lambda s, o: s._cmp(o, lambda a, b: a == b, "==")
  __ne__ = lambda s, o: s._cmp(o, lambda a, b: a != b, "!=")
  __hash__ = None

  def __float__(self):
    raise VmapError(f"config.{self.name} is read as a Python float inside the vmapped program, "
                    f"where it differs between members ({self.values}); it cannot vary")

  def __repr__(self):
    return f"PerMember({self.name}={self.values})"

  __format__ = lambda s, spec: repr(s)


# A pytree whose leaf is the member index: jitted jnp functions (jnp.clip, jnp.where) take it
# across their jit boundary and gather the value inside.
jax.tree_util.register_pytree_node(
    PerMember, lambda p: ((p.k,), (p.name, tuple(p.values))),
    lambda aux, children: PerMember(aux[0], aux[1], children[0]))


class _View:
  """A config with some fields replaced: what the train step reads as loss_cfg/optim_cfg."""

  def __init__(self, base, **fields):
    self._base, self._fields = base, fields

  def __getattr__(self, name):
    fields = self.__dict__["_fields"]
    return fields[name] if name in fields else getattr(self.__dict__["_base"], name)

  __getitem__ = __getattr__


# --- the device side: sampler and train step over K ---------------------------------------------

class Sampled(NamedTuple):
  """One member's share of a stacked sampler call (rollout.score_samples reads it)."""
  tokens: np.ndarray
  lengths: np.ndarray
  truncated: np.ndarray
  metrics: dict


class StackedSampler:
  """A Sampler's prefill and decode under jax.vmap over the members' params and keys."""

  def __init__(self, sampler):
    self.s = sampler
    opts = compile_cache.compiler_options(sampler.mesh)
    self._prefill = jax.jit(self._prefill_impl, static_argnums=(3, 4), compiler_options=opts)
    self._decode = jax.jit(self._decode_impl, static_argnums=(6, 7), donate_argnums=(1,),
                           compiler_options=opts)

  def _prefill_impl(self, params_K, tokens_KBP, mask_KBP, g, capacity):
    return jax.vmap(lambda p, t, m: self.s._prefill_impl(p, t, m, g, capacity))(
        params_K, tokens_KBP, mask_KBP)

  def _decode_impl(self, params_K, cache_K, state_K, rng_K, row_ids_R2, active_R, sp, c):
    return jax.vmap(lambda p, cache, st, rng: self.s._decode_impl(
        p, cache, st, rng, row_ids_R2, active_R, sp, c))(params_K, cache_K, state_K, rng_K)

  def generate(self, params_K, prompts_K, *, num_samples, keys_K=None, greedy=False):
    """prompts_K: per member a list of token-id lists (all of one length B), or None for a
    member that sits this call out (it samples another member's prompts, thrown away).
    Returns per member a Sampled, or None. As Sampler.generate: rows b*G + g, each row's key
    fold_in(fold_in(key, b), g); every member's prompts left-padded to one bucket (the largest
    any member needs), which changes no number."""
    s, g = self.s, int(num_samples)
    given = [p for p in prompts_K if p is not None]
    prompts_K = [p if p is not None else given[0] for p in prompts_K]
    b = len(given[0])
    own_buckets = [data.bucket_length(max(len(r) for r in p), s.buckets) for p in prompts_K]
    bucket = max(own_buckets)
    b_pad = -(-b // s._batch_multiple()) * s._batch_multiple()
    tokens, masks = zip(*[data.pad_to_bucket([p[min(i, b - 1)] for i in range(b_pad)], (bucket,),
                                             s.pad_id) for p in prompts_K])
    row_ids = np.stack([np.repeat(np.arange(b_pad), g), np.tile(np.arange(g), b_pad)], 1)
    active = np.zeros((b_pad * g,), bool)
    active[:b * g] = True
    sp = s._settings({"greedy": True} if greedy else {})
    if keys_K is None:
      keys_K = [jax.random.key(0)] * len(prompts_K)
    start = time.perf_counter()
    cache, state = self._prefill(params_K, jnp.asarray(np.stack(tokens)),
                                 jnp.asarray(np.stack(masks).astype(np.int32)), g,
                                 bucket + s.max_new_tokens)
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - start
    out, _, _ = self._decode(params_K, cache, state, jnp.stack(keys_K),
                             jnp.asarray(row_ids.astype(np.int32)), jnp.asarray(active), sp,
                             s.max_new_tokens)
    out = jax.device_get(out)
    seconds = time.perf_counter() - start
    results = []
    for k, p in enumerate(prompts_K):
      lengths = out["lengths"][k, :b * g]
      results.append(Sampled(out["tokens"][k, :b * g], lengths, out["truncated"][k, :b * g], {
          "sampler/tokens_per_s": int(lengths.sum()) / seconds,
          "sampler/seconds": seconds,
          "sampler/prefill_seconds": prefill_s,
          "sampler/decode_steps": int(out["steps"][k]),
          "sampler/cut_extra_rounds": int(out["extra_rounds"][k]),
          "sampler/prompt_bucket": own_buckets[k],  # what the member's own run pads to
      }))
    return results


class StackedTrainStep:
  """TrainStep's program under jax.vmap: member k's settings enter as PerMember values."""

  def __init__(self, step: train_step.TrainStep, configs):
    self.step, self.K = step, len(configs)
    self.values = {
        "loss.beta": [c.loss.beta for c in configs],
        "loss.epsilon": [c.loss.epsilon for c in configs],
        "loss.epsilon_high": [c.loss.epsilon_high for c in configs],
        "optim.lr": [c.optim.lr for c in configs],
    }
    self.weights_KR = np.asarray([c.rewards.weights for c in configs], np.float32)
    self._jitted = {}

  def member(self, k) -> train_step.TrainStep:
    """The TrainStep member k would build, its settings read at traced index k."""
    v = {name: PerMember(name, values, k) for name, values in self.values.items()}
    s = copy.copy(self.step)
    s.loss_cfg = _View(self.step.loss_cfg, beta=v["loss.beta"], epsilon=v["loss.epsilon"],
                       epsilon_high=v["loss.epsilon_high"])
    s.optim_cfg = _View(self.step.optim_cfg, lr=v["optim.lr"])
    s.optimizer = train_step.make_optimizer(s.optim_cfg)
    s.reward_weights = jnp.asarray(self.weights_KR)[k]
    return s

  def _program(self, state_K, ref_K, batch_K):
    one = lambda state, ref, batch, k: self.member(k)._program(state, ref, batch)
    return jax.vmap(one)(state_K, ref_K, batch_K, jnp.arange(self.K))

  def __call__(self, state_K, batches, ref_K=None):
    """batches: K host batches of the rollout layout, of one shape (pad_batches)."""
    st = self.step
    for b in batches:
      train_step.check_batch(b, st.loss_cfg, st.optim_cfg, st.mesh, st.objective,
                             has_ref_params=ref_K is not None, group_size=st.group_size,
                             num_rewards=len(st.reward_weights), max_turns=st.max_turns)
    batch_K = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    key = train_step.TrainStep._key(batch_K, ref_K is not None)
    if key not in self._jitted:
      self._jitted[key] = jax.jit(self._program, donate_argnums=0,
                                  compiler_options=compile_cache.compiler_options(st.mesh))
    return self._jitted[key](state_K, ref_K, batch_K)


def pad_batches(batches, pad_id):
  """Rollout-layout batches to one prompt width (left-padded) and completion width (right):
  the extra columns are masked out, so each member's numbers stay its own."""
  P_ = max(b["prompt_BP"].shape[1] for b in batches)
  C = max(b["completion_BC"].shape[1] for b in batches)
  out = []
  for b in batches:
    p, c = P_ - b["prompt_BP"].shape[1], C - b["completion_BC"].shape[1]
    b = dict(b, prompt_BP=np.pad(b["prompt_BP"], ((0, 0), (p, 0)), constant_values=pad_id),
             prompt_mask_BP=np.pad(b["prompt_mask_BP"], ((0, 0), (p, 0))),
             completion_BC=np.pad(b["completion_BC"], ((0, 0), (0, c)), constant_values=pad_id))
    out.append(b)
  return out


def stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree, k):
  return jax.tree.map(lambda x: x[k], tree)


# --- the host side: one member ------------------------------------------------------------------

@dataclasses.dataclass
class Member(train.Setup):
  """What train.run keeps for one run (its Setup), minus the compiled pieces (shared by the
  group)."""
  config: Any = None
  accuracy: Any = None
  it: data.PromptIterator | None = None
  state: Any = None
  ref: Any = None
  metrics: Any = None
  samples: Any = None
  ckpt: Any = None
  health: Any = None
  acc0: float | None = None        # the step-0 eval of a member warm-started here

  @staticmethod
  def build(config, workdir):
    """train.run's setup, up to the model config."""
    s = train.setup(config, workdir)
    return Member(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)}, config=config,
                  accuracy=rollout.accuracy_reward(config))

  def save(self, step):
    ckpt_state = {"train": self.state}
    if self.ref is not None:
      ckpt_state["ref"] = self.ref
    self.ckpt.save(step, ckpt_state, self.it.position())


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


def _start(members, trainer, mesh):
  """Each member's state at one common step: restored, or warm-started like train.run."""
  abstract = trainer.abstract_checkpoint()
  latest = [checkpoint.latest_step(m.workdir) for m in members]
  start = min(s or 0 for s in latest)
  for m, s in zip(members, latest):
    c = m.config
    if s is None:
      own = train.Trainer(c, m.cfg, mesh, m.tokenizer, m.stop_ids)  # the run's own warm start
      params = inputs.initial_params(c, m.cfg, mesh)
      if c.sft.steps:
        params = sft.run_sft(c, own, params, m.train_rows, m.sft_eval_rows)
      m.state = own.init_state(params)
      m.ref = own.reference(params) if grpo.needs_reference(c.loss) else None
      m.it = data.PromptIterator(len(m.train_rows), c.train.prompts_per_step, c.seed)
      m.acc0 = own.evaluate(m.state["params"], m.eval_rows)
      continue
    try:
      restored = checkpoint.restore(m.workdir, abstract, step=start)
    except Exception as e:  # the step every member has is gone from this one
      raise VmapError(f"{m.workdir}: no checkpoint at step {start}, where the group's other "
                      f"members resume ({e})") from None
    m.state, m.ref = restored.state["train"], restored.state.get("ref")
    m.it = data.PromptIterator(len(m.train_rows), c.train.prompts_per_step, c.seed,
                               position=restored.data_position)
    m.acc0 = None
  return start


def _samples(config, batch_r, adv_B, rewards):
  """The samples file's records, as Trainer.grpo_step builds them."""
  g = config.sampling.num_generations
  k = min(config.train.samples_per_step, len(batch_r.rows))
  texts = batch_r.trajectories or batch_r.texts
  return [{"prompt": batch_r.prompts[p], "completion": texts[p * g],
           "rewards": {r.name: float(batch_r.reward_BR[p * g, j]) for j, r in enumerate(rewards)},
           "advantage": float(adv_B[p * g]),
           "gold": data.gold_answer(batch_r.rows[p]["answer"])} for p in range(k)]


def evaluate(members, sampler, params_K) -> list[float]:
  """rollout.evaluate for every member at once: greedy pass@1 on each member's eval rows."""
  bs = members[0].config.train.eval_batch_size
  correct = [0] * len(members)
  for i in range(0, len(members[0].eval_rows), bs):
    chunks = [m.eval_rows[i:i + bs] for m in members]
    prompts = [rollout.encode(m.config, m.tokenizer, ch) for m, ch in zip(members, chunks)]
    outs = sampler.generate(params_K, [p.ids for p in prompts], num_samples=1, greedy=True)
    for k, (m, ch, p, out) in enumerate(zip(members, chunks, prompts, outs)):
      texts = m.tokenizer.batch_decode([t[:n] for t, n in zip(out.tokens, out.lengths)],
                                       skip_special_tokens=True)
      scores = m.accuracy.fn(p.texts, texts, group_size=1, **rollout.reward_columns(ch, 1))
      correct[k] += sum(s == 1.0 for s in scores)
  return [c / max(len(m.eval_rows), 1) for c, m in zip(correct, members)]


# --- the group's loop ---------------------------------------------------------------------------

def run_group(configs, workdirs) -> list[dict]:
  """Runs the members' GRPO phases as one vmapped program; returns their summaries."""
  check_vmappable(configs)
  members = [Member.build(c, w) for c, w in zip(configs, workdirs)]
  _check_shared(members)
  m0 = members[0]
  mesh = sharding.make_mesh(tuple(m0.config.mesh))
  trainer = train.Trainer(m0.config, m0.cfg, mesh, m0.tokenizer, m0.stop_ids)
  sampler, step_fn = StackedSampler(trainer.sampler), StackedTrainStep(trainer.step_fn, configs)
  print(f"grpo_jax.vmapped: {len(members)} runs as one program: "
        + ", ".join(os.path.basename(m.workdir) for m in members), flush=True)
  start = _start(members, trainer, mesh)
  cfg0 = m0.config
  for m in members:
    resume = -1 if m.acc0 is not None else start
    m.metrics = logging_io.MetricsWriter(m.workdir, resume_step=resume,
                                         tensorboard=m.config.train.tensorboard,
                                         wandb=m.config.train.wandb)
    m.samples = logging_io.SamplesWriter(m.workdir, resume_step=resume)
    m.ckpt = checkpoint.Checkpointer(m.workdir, max_to_keep=m.config.train.keep_checkpoints)
    m.ckpt.delete_after(start)  # a member that got further than the others redoes those steps
    m.health = RewardHealth(m.rewards, m.config.train.max_missing_reward_steps,
                            log=lambda line: tqdm.write(line, file=sys.stderr))
    if m.acc0 is not None:
      m.metrics.write(0, {"eval/accuracy": m.acc0})
      print(f"grpo_jax: {m.workdir}: held-out greedy accuracy at GRPO step 0: {m.acc0:.1%}",
            flush=True)
      m.save(0)
  state_K = stack([m.state for m in members])
  ref_K = None if m0.ref is None else stack([m.ref for m in members])
  for m in members:
    m.state = m.ref = None  # the stacked copies are the live ones
  stop = {"requested": False}
  previous = signal.signal(signal.SIGTERM, lambda *_: (
      stop.update(requested=True), [m.interrupt.set() for m in members]))
  done = start

  def save_all(step):
    for k, m in enumerate(members):
      m.state = unstack(state_K, k)
      m.ref = None if ref_K is None else unstack(ref_K, k)
      m.save(step)

  gc.freeze()  # setup's objects out of the collector's view, as in train.run
  try:
    bad = [0] * len(members)
    bar = tqdm(range(start, cfg0.train.steps), initial=start, total=cfg0.train.steps,
               desc=f"grpo x{len(members)}", dynamic_ncols=True, mininterval=2.0)
    for step in bar:
      positions = [m.it.position() for m in members]
      try:
        ms, pools = _rollouts(members, sampler, state_K["params"], step)
      except Interrupted:
        for m, p in zip(members, positions):
          m.it.restore(p)
        save_all(step)
        print(f"grpo_jax.vmapped: SIGTERM: saved step {step}, exiting", flush=True)
        break
      t0 = time.perf_counter()
      hosts = pad_batches([pool.train_batch(cfg0, m.tokenizer.pad_token_id)
                           for m, pool in zip(members, pools)], m0.tokenizer.pad_token_id)
      state_K, train_m, adv_KB = step_fn(state_K, hosts, ref_K)
      train_m, adv_KB = jax.device_get((train_m, adv_KB))
      train_s = time.perf_counter() - t0
      done = step + 1
      c = cfg0.train
      evals = None
      if c.eval_every and done % c.eval_every == 0 or done == c.steps:
        evals = evaluate(members, sampler, state_K["params"])
      for k, (m, m_k, pool) in enumerate(zip(members, ms, pools)):
        m_k.update({name: float(v[k]) for name, v in train_m.items()})
        m_k["time/train_s"] = train_s
        if m_k["step/skipped"]:
          bad[k] += 1
          if bad[k] >= c.max_bad_steps:
            raise train.TooManyBadSteps(
                f"{m.workdir}: {bad[k]} consecutive non-finite steps up to step {done} "
                f"(train.max_bad_steps); try a lower optim.lr or optim.max_grad_norm")
        else:
          bad[k] = 0
        if evals is not None:
          m_k["eval/accuracy"] = evals[k]
        m.metrics.write(done, m_k)
        m.samples.write(done, _samples(m.config, pool, adv_KB[k],
                                       m.rewards))
      bar.set_postfix(reward="/".join(f"{m_k['reward/total/mean']:.2f}" for m_k in ms))
      if done % c.checkpoint_every == 0 or done == c.steps:
        save_all(done)
      try:
        for m, m_k in zip(members, ms):
          m.health.update(done, m_k)
      except MissingRewardsError:
        save_all(done)
        raise
      if stop["requested"]:
        save_all(done)
        print(f"grpo_jax.vmapped: SIGTERM: saved step {done}, exiting", flush=True)
        break
  finally:
    gc.unfreeze()
    for m in members:
      if m.ckpt is not None:
        m.ckpt.close()
      if m.metrics is not None:
        m.metrics.close()
    signal.signal(signal.SIGTERM, previous)

  finished = done >= cfg0.train.steps
  summaries = []
  for k, m in enumerate(members):
    summaries.append(logging_io.write_summary(m.workdir, stopped_at=None if finished else done,
                                              eval_examples=len(m.eval_rows)))
    if finished:
      plots.plot_metrics(m.workdir)
      gen = m.generation_config or {"eos_token_id": m.stop_ids,
                                    "pad_token_id": m.tokenizer.pad_token_id}
      weights.save_checkpoint(unstack(state_K["params"], k), m.cfg,
                              os.path.join(m.workdir, "final_model"), generation_config=gen,
                              tokenizer=m.tokenizer)
  return summaries


def _rollouts(members, sampler, params_K, step):
  """Every member's rollout.collect, in lockstep: one stacked sampler call per round."""
  colls = [rollout.Collection(m.config) for m in members]
  keys = [jax.random.fold_in(jax.random.key(m.config.seed), step) for m in members]
  g = members[0].config.sampling.num_generations
  while any(c.wants_round() for c in colls):
    want = [c.wants_round() for c in colls]
    rows = [[m.train_rows[i] for i in m.it.next_indices()] if w else None
            for m, w in zip(members, want)]
    t0 = time.perf_counter()
    prompts = [rollout.encode(m.config, m.tokenizer, r) if w else None
               for m, r, w in zip(members, rows, want)]
    round_keys = [c.round_key(key) for c, key in zip(colls, keys)]
    outs = sampler.generate(params_K, [p.ids if p else None for p in prompts], num_samples=g,
                            keys_K=round_keys)
    for m, c, r, p, out, w in zip(members, colls, rows, prompts, outs, want):
      if w:
        c.add(*rollout.score_samples(m.config, m.tokenizer, r, p, out, m.rewards, t0))
  pools, ms = zip(*[c.result() for c in colls])
  return list(ms), list(pools)


# --- command line -------------------------------------------------------------------------------

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
  parser = argparse.ArgumentParser(prog="python -m grpo_jax.vmapped", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--spec", required=True, help="the group's JSON spec")
  args = parser.parse_args(argv)
  try:
    run_group(*load_spec(args.spec))
  except UserError as e:
    print(f"grpo_jax.vmapped: error: {e}", file=sys.stderr, flush=True)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
