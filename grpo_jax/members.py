"""The K members of a vmapped sweep as one program: the one module that knows K exists.

A sweep's runs that differ only in array settings (grpo_jax.train.check_vmappable) run as one
program: their states are stacked on a leading K axis, and the single-run pieces of
grpo_jax.sampler, grpo_jax.rollout and grpo_jax.train_step run for all of them at once. Those
modules are written for one run; this one wraps them.

    params = policy(lora, state_K["params"], frozen)      # what the members' sampler runs
    parts = sample(rollouts_K, params, rows_K, rewards_K, keys_K, batched=True)
    accs = evaluate(rollouts_K, params, eval_rows_K, reward, batched=True)
    state_K, metrics_K, adv_KB = train(step, state_K, batches, hparams_K, ref_K, batched=True)
    precompile_sample(...), precompile_evaluate(...), precompile_train(...)  # in the background

What it owns:
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
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import compile_cache, config as config_lib, data, rollout, sampling
from grpo_jax import train_step as train_step_lib
from grpo_jax.models import lora as lora_lib, qwen
from grpo_jax.sampler import SampleOutput

AXIS = "members"  # the jax.vmap axis of the K members (batched)


def policy(lora, params_K, frozen):
  """What the members' sampler runs: params_K; with LoRA (a lora.LoraConfig) the variables of
  the K stacked adapters on the one frozen base they share (never merged: K merged bases would
  be K copies of it)."""
  if lora is None:
    return params_K
  return lora_lib.variables(frozen, params_K, lora)


# --- sampling --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Inputs:
  tokens: jax.Array    # [K, B_pad, bucket]
  masks: jax.Array     # [K, B_pad, bucket] int32
  capacity: int        # the cache's slots: the bucket and max_new_tokens
  row_ids: jax.Array   # [B_pad * G, 2]: (prompt, sample) of each row, folded into its key
  active: jax.Array    # [B_pad * G]: False for the rows padding the batch to the mesh
  settings: sampling.SamplingParams
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
    results.append(SampleOutput(out["tokens"][k, :b * g], lengths, out["truncated"][k, :b * g],
                                out["logprobs"][k, :b * g], None, None, {
        "sampler/tokens_per_s": int(lengths.sum()) / seconds,
        "sampler/seconds": seconds,
        "sampler/prefill_seconds": prefill_s,
        "sampler/decode_steps": int(out["steps"][k]),
        "sampler/cut_extra_rounds": int(out["extra_rounds"][k]),
        "sampler/cut_fallback_rows": int(out["fallback_rows"][k]),
        "sampler/prompt_bucket": own_buckets[k],  # what the member's own run pads to
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
                         sp: sampling.SamplingParams, c: int):
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
  [K, L, ...] made XLA copy every weight each step. With cfg.unroll_decode, a qwen.Unrolled
  whose layer i is [K, ...]: the members' axis is 0."""
  p_axes = {}
  for col, tree in v_K.items():
    if shared_base and col == "params":
      p_axes[col] = None
      continue
    v_K[col] = dict(tree, layers=jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), tree["layers"]))
    p_axes[col] = jax.tree.map(lambda _: 0, v_K[col])
    p_axes[col]["layers"] = jax.tree.map(lambda _: 1, v_K[col]["layers"])
  if sampler.cfg.unroll_decode:
    v_K = qwen.unroll(v_K)
    p_axes = qwen.Unrolled(
        {col: None if a is None else {k: x for k, x in a.items() if k != "layers"}
         for col, a in p_axes.items()},
        [{col: None if p_axes[col] is None else jax.tree.map(lambda _: 0, tree)
          for col, tree in layer.items()} for layer in v_K.layers])
  return v_K, p_axes


def _decode_members_in_turn_impl(sampler, params_K, cache_K, state_K, rng_K, row_ids_R2,
                                 active_R, sp: sampling.SamplingParams, c: int):
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


def evaluate(rollouts_K, params_K, rows_K, reward, batched=True) -> list[float]:
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
  """Starts compiling, in the background, the programs `evaluate` will run on these rows
  (precompile_generate, once per distinct chunk layout)."""
  for _, prompts in _eval_chunks(rollouts_K, rows_K):
    precompile_generate(rollouts_K[0].sampler, params_K, [p.ids for p in prompts],
                        num_samples=1, greedy=True, batched=batched)


def _eval_chunks(rollouts_K, rows_K):
  """evaluate's chunks of train.eval_batch_size rows: (each member's rows, their encoded
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
      shared = ref is not None and spec.lora is not None
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
