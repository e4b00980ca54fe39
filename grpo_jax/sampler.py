"""Jitted sampling of a prompt batch from a functional Qwen model: prefill once, tile ×G, decode.

    sampler = Sampler(qwen.build(cfg), max_new_tokens=256, stop_ids=[151645, 151643],
                      buckets=(128, 256), valid_vocab_size=151665, pad_id=151643, mesh=mesh)
    out = sampler.generate({"params": params}, [[151644, 8948, ...], [151644, ...]],
                           num_samples=8, key=jax.random.key(step), temperature=1.0, top_p=0.95)
    out.tokens     # [B*G, C] int32, completion ids; pad_id after the stop token
    out.lengths    # [B*G]   int32, tokens produced, the stop token included
    out.truncated  # [B*G]   bool, True where max_new_tokens was reached without a stop id
    out.logprobs   # [B*G, C] fp32, log-prob of each sampled token (see below); 0 past `lengths`
    out.prompt_tokens, out.prompt_mask  # [B, P] the left-padded prompts used (P = a bucket)
    out.metrics    # {'sampler/tokens_per_s', 'sampler/seconds', 'sampler/row_steps', ...}

Row b*G + g is sample g of prompt b (rows of one prompt are contiguous). `prompts` may also be a
left-padded [B, P] array passed with its mask: `generate(variables, tokens_BP, mask_BP, ...)`.
`sampler(...)` is `sampler.generate(...)`. Any `qwen.Qwen` (policy, judge, reward model) works.

The first argument of every call is what model.apply takes: {'params': params}, or a LoRA
policy's {'params': base, 'lora': adapters} (a run's is policy.Policy.sampled's).

What happens in one call (C = max_new_tokens, P = the smallest bucket holding every prompt):
  1. host: left-pad the prompts to P (numpy, so no new shape reaches the device);
  2. `prefill` (jitted per (B, P, G)): one forward of the B prompts into a [L, B, K, P, H] cache,
     which is then padded to P + C slots and tiled G times (never a G-fold prefill);
  3. `decode` (jitted per (B, P, G, settings); the cache is donated, so the loop updates the
     prefill's buffer in place): a `lax.while_loop` samples one token per row from the last
     hidden state (grpo_jax.token_choice.next_token), feeds it through the model, and exits as soon
     as every row has produced a stop id or C tokens (or its own budget: row_budgets).
     With compact_rows (on by default on a GPU or TPU with the batch on one device), generate
     decodes in levels of narrowing width instead: once no more rows are live than the next
     width holds, the live rows move to the front of the cache (in place) and the steps after
     compute those only (_decode_compacting; docs/performance.md, "Live rows").
The batch (B, and B*G after tiling) is split over the mesh's data × fsdp axes; B is padded to a
multiple of that size with copies of the last prompt, whose rows are dropped from the output.

Several processes (grpo_jax.hosts): each passes its own prompts and gets its own rows back (host
numpy); they are padded to common shapes (the most prompts and the longest prompt of any
process) and the device work is one program over the global batch.

Multi-turn (grpo_jax.agent): `begin` prefills with room for several turns, `extend` samples
the next turn of every active row from where its conversation stands, and `append` feeds each
row's next user turn (e.g. a tool's output) into the same cache; `generate` is begin + one
extend. The cache slot a call writes is the same for every row, while each row keeps its own
RoPE position: the slots a row leaves unused after its stop token are masked out as holes, so
the rows' conversations need not be aligned.

Sampling settings (defaults given to the Sampler, overridable per call; each distinct setting
compiles once): `greedy` (or temperature=0), `temperature`, `top_k`, `top_p`, `min_p`, defined
in grpo_jax.token_choice (the cuts, their order and how they are drawn from exactly).

`logprobs` are log_softmax(logits / temperature) over the valid vocabulary at the sampled token,
BEFORE the top-k/top-p/min-p cut: the policy's own distribution, the quantity the loss uses
(train_step.completion_logprobs, through logprobs.token_logprobs over head[:, :valid_vocab_size]
at the same temperature, gives the same numbers up to rounding). The train step recomputes the
old policy's log-probs in its own forward; single-turn rollouts pass these to it as
sampler_logp_BC, for its drift/* metrics and loss.rollout_is_correction (docs/loss.md).
Greedy decoding reports them at `temperature` too (1 for temperature=0).

Randomness: each row has its own key, fold_in(fold_in(key, prompt_id), g) with prompt_id
defaulting to the prompt's index in the batch (pass `prompt_ids` for stable ids), and every
step folds in the step number, so a row's tokens do not depend on the other rows of its batch.
metrics['sampler/cut_extra_rounds'] counts the steps' extra rounds of the cuts (top-p redraws,
top-k ties; see grpo_jax.token_choice), and metrics['sampler/cut_fallback_rows'] the draws whose
top-p redraws ran out and took the row's top token instead (0 unless top_p is tiny).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax import compile_cache, data, errors, hosts, token_choice
from grpo_jax import sharding as sharding_lib
from grpo_jax.models import qwen

Array = jax.Array
DEFAULT_BUCKETS = (64, 128, 256, 512, 1024)
VOCAB_CHUNK = 8192  # head columns per pass, except on a GPU (see Sampler's vocab_chunk)
CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")  # qwen.init_cache's layout
# generate's compacting decode (Sampler's compact_rows): each level is COMPACT_RATIO as wide as
# the one before, COMPACT_LEVELS widths in all. On a long-tailed length distribution (median
# 250 of 1024, 5% at the budget) 8 levels of 0.7 leave ~14% of row-steps on finished rows, where
# one width leaves ~67%; each level is one more program to compile.
COMPACT_RATIO = 0.7
COMPACT_LEVELS = 8


def default_vocab_chunk(platform: str, valid: int) -> int:
  """Sampler's vocab_chunk on `platform` ('cpu', 'gpu', 'tpu') for `valid` vocabulary rows:
  the whole vocabulary on a GPU, VOCAB_CHUNK elsewhere."""
  return valid if platform == "gpu" else VOCAB_CHUNK


class SampleOutput(NamedTuple):
  tokens: Array  # [B*G, C] int32
  lengths: Array  # [B*G] int32, stop token included
  truncated: Array  # [B*G] bool
  logprobs: Array  # [B*G, C] fp32, 0 past lengths
  prompt_tokens: Array  # [B, P] int32, left-padded with pad_id
  prompt_mask: Array  # [B, P] int32
  metrics: dict[str, float]


class Conversation(NamedTuple):
  """G conversations per prompt on the device (Sampler.begin / extend / append): the KV cache
  and decode state carried from turn to turn, so no turn re-reads what came before it."""
  cache: dict  # [L, R_pad, K, slots, H] per 'k'/'v', donated by each extend/append
  state: dict  # hidden [R_pad, D], mask [R_pad, slots], pos [R_pad], slot (see _prefill_impl)
  row_ids: Array  # [R_pad, 2] (prompt id, sample index): each row's random stream
  rows: int  # R = B*G real rows; the rest pad the batch to the mesh
  prompt_tokens: np.ndarray  # [B, P] left-padded
  prompt_mask: np.ndarray  # [B, P]
  # On the host, at least state['slot']: P + every max_tokens and width so far. Checked before
  # each write, so no call writes past the cache (JAX would clamp it onto the last slot).
  slots_used: int = 0


class Sampler:
  """Built once per model; each call compiles once per (B, bucket, G, sampling settings).

  Args:
    model: a `qwen.Qwen` module (its cfg and compute dtype are used) or a `qwen.QwenConfig`.
    max_new_tokens: C, the fixed completion length budget.
    stop_ids: token ids that end a completion (kept in the output, counted in `lengths`).
    buckets: prompt lengths P the batch is left-padded to (the smallest that fits is used).
    greedy, temperature, top_k, top_p, min_p: default sampling settings (grpo_jax.token_choice);
      each call may override them. temperature=0 means greedy (log-probs then at temperature 1).
    valid_vocab_size: ids >= this are never sampled (default: the whole embedding).
    pad_id: written after a row's stop token and used to left-pad prompts.
    mesh: a (data, fsdp, tensor) mesh; the batch is split over data × fsdp.
    dtype: compute dtype when `model` is a config (default fp32).
    vocab_chunk: columns of the head processed at a time. Default: the whole vocabulary on a
      GPU, where each chunk costs its kernel launches in every decode step; VOCAB_CHUNK
      elsewhere (on a CPU one chunk's logits stay in cache; docs/performance.md).
    top_p_draws: candidates drawn per row and step for top-p's rejection step
      (grpo_jax.token_choice).
    compact_rows: whether generate drops finished rows from the decode's work
      (_decode_compacting); None: on a GPU or TPU with the batch on one device, else off.
    compact_ratio, compact_levels: its widths (see widths()).
    compiler_options: XLA options added to this sampler's jax.jit calls.
  """

  def __init__(self, model: qwen.Qwen | qwen.QwenConfig, *, max_new_tokens: int,
               stop_ids: Sequence[int] = (), buckets: Sequence[int] = DEFAULT_BUCKETS,
               greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, valid_vocab_size: int | None = None,
               pad_id: int = 0, mesh=None, dtype=None, vocab_chunk: int | None = None,
               top_p_draws: int = 8, compact_rows: bool | None = None,
               compact_ratio: float = COMPACT_RATIO, compact_levels: int = COMPACT_LEVELS,
               compiler_options: dict | None = None):
    if isinstance(model, qwen.QwenConfig):
      model = qwen.build(model, dtype=jnp.float32 if dtype is None else dtype)
    elif not isinstance(model, qwen.Qwen):
      raise TypeError(f"model must be a qwen.Qwen or a qwen.QwenConfig, got {type(model)}")
    self.model, cfg = model, model.cfg
    self.cfg = cfg
    if not cfg.is_causal:  # fail here, not inside the first jit trace
      raise qwen.BidirectionalDecodeError(qwen.not_causal_message(cfg))
    if not (isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens > 0):
      raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int > 0")
    buckets = tuple(sorted(set(buckets)))
    if not buckets or not all(isinstance(b, (int, np.integer)) and b > 0 for b in buckets):
      raise ValueError(f"buckets={buckets!r} must be a non-empty list of ints > 0")
    valid = cfg.vocab_size if valid_vocab_size is None else valid_vocab_size
    if not 0 < valid <= cfg.vocab_size:
      raise ValueError(f"valid_vocab_size={valid_vocab_size!r} must be in [1, "
                       f"vocab_size={cfg.vocab_size}]")
    stop_ids = tuple(int(i) for i in stop_ids)
    bad = [i for i in stop_ids if not 0 <= i < cfg.vocab_size]
    if bad:
      raise ValueError(f"stop_ids {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    if not 0 <= pad_id < cfg.vocab_size:
      raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, {cfg.vocab_size})")
    block = token_choice.ARGMAX_BLOCK
    platform = compile_cache.platform(mesh)
    if cfg.run.decode_attention == "pallas" and platform != "gpu":
      runs = ("Pallas's interpreter (exact, and slow)" if platform == "cpu"
              else "the same attention in jax.numpy")
      errors.warn(f"model.decode_attention='pallas' is a GPU kernel; on {platform} the decode "
                  f"step runs {runs}: 'xla' suits it")
    if vocab_chunk is None:
      vocab_chunk = default_vocab_chunk(platform, valid)
    elif vocab_chunk < valid and (vocab_chunk < 1 or vocab_chunk % block):
      raise ValueError(f"vocab_chunk={vocab_chunk} must be a positive multiple of {block}, or "
                       f"the whole vocabulary ({valid})")
    if top_p_draws < 1:
      raise ValueError(f"top_p_draws={top_p_draws} must be >= 1")
    if not 0 < compact_ratio < 1 or compact_levels < 1:
      raise ValueError(f"compact_ratio={compact_ratio} must be in (0, 1) and compact_levels="
                       f"{compact_levels} >= 1")
    self.compact_rows = self._compacts(compact_rows, platform, mesh)
    self.compact_ratio, self.compact_levels = float(compact_ratio), int(compact_levels)
    self.defaults = token_choice.parse_settings(greedy, temperature, top_k, top_p, min_p)
    self.max_new_tokens, self.stop_ids, self.buckets = int(max_new_tokens), stop_ids, buckets
    self.valid, self.pad_id, self.mesh = valid, int(pad_id), mesh
    self.vocab_chunk = min(int(vocab_chunk), valid)
    self.top_p_draws = int(top_p_draws)
    opts = compile_cache.compiler_options(mesh)
    if compiler_options:  # XLA options for this sampler's programs (benchmarks/gpu_decide.py)
      opts = {**(opts or {}), **compiler_options}
    self._prefill = jax.jit(self._prefill_impl, static_argnums=(3, 4), compiler_options=opts)
    # The cache (argument 1) is donated: the decode loop updates the prefill's buffer in place.
    self._decode = jax.jit(self._decode_impl, static_argnums=(6, 7), donate_argnums=(1,),
                           compiler_options=opts)
    self._append = jax.jit(self._append_impl, donate_argnums=(1,), compiler_options=opts)
    self._next_logprobs = jax.jit(self._next_logprobs_impl, compiler_options=opts)
    # One program per (width, next width) of generate's compacting decode; the cache is
    # donated and returned, so every level updates the prefill's buffer in place.
    self._carry = jax.jit(self.decode_carry, static_argnums=(2,), compiler_options=opts)
    self._level = jax.jit(self._level_impl, static_argnums=(8, 9, 10, 11), donate_argnums=(1,),
                          compiler_options=opts)
    self._cache = {}  # what wrappers compose from this sampler's pieces (see cached)

  # --- device side -------------------------------------------------------------------------

  @staticmethod
  def _compacts(compact_rows, platform: str, mesh) -> bool:
    """Whether generate's decode drops finished rows (see _decode_compacting). Default: on a
    GPU or TPU whose batch is on one device. Rows move within one device's cache only, so a
    batch split over several devices keeps one width."""
    one = (mesh is None or mesh.devices.size == 1
           or all(mesh.shape[a] == 1 for a in sharding_lib.BATCH_AXES))
    if compact_rows is None:
      return platform in ("gpu", "tpu") and one and hosts.count() == 1
    if compact_rows and not (one and hosts.count() == 1):
      raise ValueError("compact_rows=True needs the batch on one device (the mesh's data and "
                       "fsdp axes of size 1, one process): rows move within a device's cache")
    return bool(compact_rows)

  def _constrain(self, x, logical):
    if self.mesh is None:
      return x
    spec = sharding_lib.logical_to_spec(P(*logical), x.shape, self.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def _prefill_impl(self, variables, tokens_BP, mask_BP, num_samples, capacity):
    """Prompt forward into a P-slot cache, then tiled to [L, B*G, K, capacity, H].

    The decode state: `hidden` [R, D] (the last position's, which predicts the next token),
    `mask` [R, capacity] (1 on slots a row may attend to), `pos` [R] (each row's next RoPE
    position) and `slot` (the next cache slot to write, the same for every row).
    """
    cfg, g = self.cfg, num_samples
    b, p = tokens_BP.shape
    cache = qwen.init_cache(cfg, b, p, self.model.dtype)
    cache = jax.tree.map(lambda x: self._constrain(x, CACHE_AXES), cache)
    hidden_BPD, cache = self.model.apply(variables, tokens_BP, qwen.positions_from_mask(mask_BP),
                                         mask_BP, cache, 0)
    tile = lambda x: jnp.repeat(x, g, axis=0)
    cache = jax.tree.map(lambda x: self._constrain(
        jnp.pad(jnp.repeat(x, g, axis=1), ((0, 0), (0, 0), (0, 0), (0, capacity - p), (0, 0))),
        CACHE_AXES), cache)
    # Every later slot is marked real: the causal rule (slot s <= t) hides unwritten ones; a
    # decode call marks the slots a row left unused (after its stop token) as holes.
    mask_RS = jnp.concatenate([tile(mask_BP), jnp.ones((b * g, capacity - p), mask_BP.dtype)], 1)
    return cache, {
        "hidden": self._constrain(tile(hidden_BPD[:, -1]), ("batch", None)),
        "mask": self._constrain(mask_RS, ("batch", None)),
        "pos": tile(jnp.sum(mask_BP, 1, dtype=jnp.int32)),
        "slot": jnp.int32(p),
    }

  def _decode_impl(self, variables, cache, state, rng, row_ids_R2, active_R,
                   sp: token_choice.SamplingParams, c: int):
    """A while_loop: sample a token per row from the last hidden state, feed it, repeat; at
    most c tokens, written from slot state['slot']; rows not active_R sample nothing."""
    v, head, keys_R = self._decode_setup(variables, rng, row_ids_R2)
    step = lambda cache, s: self.decode_step(v, head, keys_R, state, sp, cache, s)
    cond = lambda cs: (cs[1]["step"] < c) & ~jnp.all(cs[1]["done"])
    cache, out = jax.lax.while_loop(cond, lambda cs: step(*cs),
                                    (cache, self.decode_carry(state, active_R, c)))
    results, new_state = self.decode_results(state, out, active_R)
    # Returning the cache aliases it with the donated input, so no copy is made on entry.
    return results, cache, new_state

  def _level_impl(self, variables, cache, state, rng, row_ids_W2, carry, rows_W, full,
                  sp: token_choice.SamplingParams, c: int, width: int, next_width: int):
    """One level of generate's compacting decode (_decode_compacting). The previous level's
    rows (their cache rows first in `cache`, their state, row ids, carry, and rows_W, each
    one's index in the batch) are compacted to the `width` that come first, the live ones
    (none is dropped: at most `width` are live), and the loop runs until at most next_width
    are live (0: none) or c steps are done. `full` holds every row's outputs: each level
    writes its rows' there. -> (cache, state, row_ids, carry, rows, full, row_steps, over)."""
    if width < rows_W.shape[0]:
      cache, (state, row_ids_W2, carry, rows_W) = self._compact(
          cache, (state, row_ids_W2, carry, rows_W), carry["done"], width)
    v, head, keys_W = self._decode_setup(variables, rng, row_ids_W2)
    step = lambda cache, s: self.decode_step(v, head, keys_W, state, sp, cache, s)
    live = lambda s: jnp.sum(~s["done"], dtype=jnp.int32)
    cond = lambda cs: (cs[1]["step"] < c) & (live(cs[1]) > next_width)
    start = carry["step"]
    cache, carry = jax.lax.while_loop(cond, lambda cs: step(*cs), (cache, carry))
    full = {name: x.at[rows_W].set(carry[name]) for name, x in full.items()}
    over = (carry["step"] >= c) | (live(carry) == 0)
    return cache, state, row_ids_W2, carry, rows_W, full, (carry["step"] - start) * width, over

  @staticmethod
  def _compact(cache, rows, done_W, width):
    """Moves the live rows (done_W False) of the cache to its first rows, in place, and gathers
    the per-row arrays of `rows` (a pytree; scalars stay) in the same order, cut to `width`:
    first the live rows, then finished ones. Row j's source is at j or after it (live rows
    keep their order), so moving rows 0, 1, ... in turn never reads a row already written;
    finished rows' cache rows are left as they are (nothing reads them again)."""
    order = jnp.argsort(done_W, stable=True)[:width]
    n = done_W.shape[0]

    def move(j, kv):
      row = lambda x: jax.lax.dynamic_slice_in_dim(x, order[j], 1, axis=1)
      return {name: jax.lax.dynamic_update_slice_in_dim(x, row(x), j, axis=1)
              for name, x in kv.items()}
    cache = jax.lax.fori_loop(0, jnp.sum(~done_W, dtype=jnp.int32), move, cache)
    take = lambda x: jnp.take(x, order, axis=0) if x.ndim and x.shape[0] == n else x
    return cache, jax.tree.map(take, rows)

  def _decode_setup(self, variables, rng, row_ids_R2):
    """(variables with the layers in the compute dtype, the sampling head, each row's key).
    With cfg.run.unroll_decode the variables are a qwen.Unrolled, one narrowed copy per layer."""
    if self.cfg.run.unroll_decode:
      v = qwen.unroll(self.narrow(variables))
      return v, self.head(v.rest["params"]), self.row_keys(rng, row_ids_R2)
    v = self.narrow(variables)
    return v, self.head(v["params"]), self.row_keys(rng, row_ids_R2)

  def _forward(self, v, tokens_RT, positions_RT, mask_RS, cache, index):
    """The cached forward of a decode step: the layer scan, or the layers written out."""
    if isinstance(v, qwen.Unrolled):
      return qwen.apply_unrolled(self.model, v, tokens_RT, positions_RT, mask_RS, cache, index)
    return self.model.apply(v, tokens_RT, positions_RT, mask_RS, cache, index)

  def narrow(self, variables):
    """The variables, their decoder layers' weights in the compute dtype: cast once, before the
    loop, not in every step of it, so each step reads the narrow copy (fp32 params, bf16
    compute: half the bytes). The forward casts every weight to this dtype anyway, so the
    numbers are the same. Not narrowed: the embedding and head (the sampler reads the head in
    its own dtype), integer leaves (an int8 base's kernel_q) and an int8 base's kernel_scale,
    which qwen._kernel multiplies with kernel_q in fp32 before it casts the product: a scale
    rounded to bf16 first would change each output channel by up to 2^-9, a policy that is not
    the train step's."""
    keep = jax.tree_util.DictKey("kernel_scale")
    narrow = lambda path, x: x if path[-1] == keep else self._narrow_leaf(x)
    return {col: dict(tree, layers=jax.tree_util.tree_map_with_path(narrow, tree["layers"]))
            for col, tree in variables.items()}

  def _narrow_leaf(self, x):
    return x.astype(self.model.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  def head(self, params):
    # qwen.head_kernel is [D, V]; for a tied model its .T is the embedding itself. Narrowed once
    # here, before the loop: every pass over the vocabulary casts the head to the compute dtype
    # anyway, and a GPU compile keeps that cast inside each decode step (fp32 params: a read of
    # the fp32 head and a write of its bf16 copy per step).
    head_VD = self._narrow_leaf(qwen.head_kernel(params, self.cfg).T)
    return token_choice.prepare_head(head_VD, self.valid, self.vocab_chunk)

  @staticmethod
  def row_keys(rng, row_ids_R2):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(rng, i[0]), i[1]))(
        row_ids_R2)

  def decode_carry(self, state, active_R, c: int):
    r = state["hidden"].shape[0]
    carry = dict(step=jnp.int32(0), hidden=state["hidden"],
                 tokens=jnp.full((r, c), self.pad_id, jnp.int32),
                 logp=jnp.zeros((r, c), jnp.float32), done=~active_R,
                 stopped=jnp.zeros((r,), bool), lengths=jnp.zeros((r,), jnp.int32),
                 extra_rounds=jnp.int32(0), fallback_rows=jnp.int32(0))
    if "budget" in state:  # per-row token budgets (extend's row_budgets)
      carry.update(budget=state["budget"], done=carry["done"] | (state["budget"] <= 0))
    return carry

  def decode_step(self, params, head, keys_R, state, sp, cache, s, i=None):
    """One step of the loop: sample from the carried hidden state, then run the forward for the
    next step. `i` (default s['step']) is the slot offset and token column written."""
    # One sampling site in the program (half the compile time of sampling token 0 separately):
    # each step samples from the carried hidden state, then runs the forward for the next step.
    # The forward after a row's last step is wasted work, one model step per call.
    i = s["step"] if i is None else i
    step_keys_R = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys_R)
    tok, logp, extra, fell_back = token_choice.next_token(sp, head, s["hidden"], step_keys_R,
                                                      self.valid, self.top_p_draws)
    live = ~s["done"]
    tok = jnp.where(live, tok, self.pad_id)
    stopped = live & jnp.isin(tok, jnp.asarray(self.stop_ids or (-1,), jnp.int32))
    hidden, cache = self._forward(params, tok[:, None], (state["pos"] + i)[:, None],
                                  state["mask"], cache, state["slot"] + i)
    put = lambda x_RC, x_R: jax.lax.dynamic_update_index_in_dim(x_RC, x_R, i, 1)
    # A row that stopped keeps the hidden state of its last token (what a later turn
    # continues from), not that of the pads it is fed afterwards.
    hidden = jnp.where(live[:, None], hidden[:, 0], s["hidden"])
    new = dict(s, step=s["step"] + 1, hidden=hidden, tokens=put(s["tokens"], tok),
               logp=put(s["logp"], jnp.where(live, logp, 0.0)),
               done=s["done"] | stopped, stopped=s["stopped"] | stopped,
               lengths=s["lengths"] + live, extra_rounds=s["extra_rounds"] + extra,
               fallback_rows=s["fallback_rows"] + jnp.sum(live & fell_back, dtype=jnp.int32))
    if "budget" in s:  # a row that has used its budget is done, truncated
      new["done"] = new["done"] | (new["lengths"] >= s["budget"])
    return cache, new

  def decode_results(self, state, out, active_R):
    p = state["slot"]
    # Slots [p + length, p + steps) of a row hold what it was fed after stopping: holes.
    j_S = jnp.arange(state["mask"].shape[1]) - p
    hole_RS = (j_S[None] >= out["lengths"][:, None]) & (j_S[None] < out["step"])
    new_state = {"hidden": out["hidden"], "mask": jnp.where(hole_RS, 0, state["mask"]),
                 "pos": state["pos"] + out["lengths"], "slot": p + out["step"]}
    results = {
        "tokens": self._constrain(out["tokens"], ("batch", None)),
        "lengths": out["lengths"], "truncated": ~out["stopped"] & active_R,  # inactive: False
        "logprobs": self._constrain(out["logp"], ("batch", None)),
        "steps": out["step"], "extra_rounds": out["extra_rounds"],
        "fallback_rows": out["fallback_rows"],
        "row_steps": out["step"] * out["lengths"].shape[0],  # rows computed, live or not
    }
    return results, new_state

  def _append_impl(self, variables, cache, state, tokens_RO, mask_RO):
    """Feeds right-padded tokens (an observation) to every row at slots [slot, slot + O): the
    multi-turn rollout's next user turn, written into the carried cache, no re-prefill."""
    p = state["slot"]
    n_R = jnp.sum(mask_RO, 1, dtype=jnp.int32)
    positions_RO = state["pos"][:, None] + qwen.positions_from_mask(mask_RO)
    mask_RS = jax.lax.dynamic_update_slice(state["mask"], mask_RO.astype(state["mask"].dtype),
                                           (0, p))
    hidden_ROD, cache = self.model.apply(variables, tokens_RO, positions_RO, mask_RS, cache, p)
    last_RD = jnp.take_along_axis(hidden_ROD, jnp.maximum(n_R - 1, 0)[:, None, None], 1)[:, 0]
    return cache, {"hidden": jnp.where(n_R[:, None] > 0, last_RD, state["hidden"]),
                   "mask": mask_RS, "pos": state["pos"] + n_R, "slot": p + tokens_RO.shape[1]}

  def _next_logprobs_impl(self, variables, hidden_RD, ids_K):
    """log_softmax at temperature 1 over the valid vocabulary, at ids_K: [R, K]. One position
    per row, so the [R, V] logits are one decode step's worth."""
    logits_RV = self.model.apply(variables, hidden_RD[:, None],
                                 method=qwen.Qwen.logits)[:, 0, :self.valid]
    return jax.nn.log_softmax(logits_RV.astype(jnp.float32), axis=-1)[:, ids_K]

  # --- host side ---------------------------------------------------------------------------

  def as_token_lists(self, prompts, mask) -> list[np.ndarray]:
    """Validates prompts (lists of ids, or a left-padded [B, P] array with its mask)."""
    if mask is not None or (hasattr(prompts, "ndim") and prompts.ndim == 2):
      tokens = np.asarray(prompts)
      if mask is None:
        raise ValueError("prompts given as a [B, P] array need their mask [B, P]")
      mask = np.asarray(mask)
      if tokens.ndim != 2 or tokens.shape != mask.shape:
        raise ValueError(f"prompts {tokens.shape} and mask {mask.shape} must both be [B, P]")
      if not np.isin(mask, (0, 1)).all():
        raise ValueError("mask must hold only 0 and 1")
      if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
        raise ValueError("prompts must be left-padded: each mask row 0...0 1...1")
      rows = [t[m.astype(bool)] for t, m in zip(tokens, mask)]
    else:
      if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of token-id lists or a [B, P] array with a "
                        f"mask, got {type(prompts).__name__}")
      rows = [np.asarray(p) for p in prompts]
    if not rows:
      raise ValueError("prompts is empty: need at least one prompt")
    vocab = self.cfg.vocab_size
    for i, row in enumerate(rows):
      if row.ndim != 1 or not (row.size == 0 or np.issubdtype(row.dtype, np.integer)):
        raise ValueError(f"prompts[{i}] must be a flat sequence of int token ids")
      if row.size == 0:
        raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
      if row.min() < 0 or row.max() >= vocab:
        raise ValueError(f"prompts[{i}] holds ids outside the vocabulary [0, {vocab})")
      if row.size > self.buckets[-1]:
        raise ValueError(f"prompts[{i}] has {row.size} tokens, more than the largest bucket "
                         f"{self.buckets[-1]} (buckets={self.buckets})")
    return rows

  def batch_multiple(self) -> int:
    if self.mesh is None:
      return 1
    return int(np.prod([self.mesh.shape[a] for a in sharding_lib.BATCH_AXES]))

  def sampling_params(self, settings) -> token_choice.SamplingParams:
    unknown = set(settings) - {"greedy", "temperature", "top_k", "top_p", "min_p"}
    if unknown:
      raise TypeError(f"unknown sampling settings {sorted(unknown)}")
    return token_choice.parse_settings(**{**dataclasses.asdict(self.defaults), **settings})

  def _put(self, x):
    """This process's rows → the batch-sharded array (with several processes, each passes its
    own rows: a global array)."""
    return jnp.asarray(x) if self.mesh is None else hosts.to_global(
        x, sharding_lib.batch_sharding(self.mesh, x.ndim))

  def _local_rows(self, results):
    """The per-row outputs of this process's rows (several processes: host-local numpy)."""
    if hosts.count() == 1:
      return results
    return {k: hosts.to_local(v, sharding_lib.batch_sharding(self.mesh, v.ndim))
            if np.ndim(v) else v for k, v in results.items()}

  def begin(self, variables, prompts, mask=None, *, num_samples: int = 1, room: int,
            prompt_ids=None) -> Conversation:
    """Prefills the prompts into a cache with `room` free slots after the prompt bucket, tiled
    ×G: the start of G conversations per prompt, continued by `extend` and `append`. An extend
    takes up to max_tokens slots, an append or peek `width`: a call that might not fit in
    what is left raises a ValueError."""
    if not (isinstance(num_samples, (int, np.integer)) and num_samples >= 1):
      raise ValueError(f"num_samples={num_samples!r} (G) must be an int >= 1")
    rows = self.as_token_lists(prompts, mask)
    b, g = len(rows), int(num_samples)
    # Several processes each pass their own prompts and pad them to common shapes: the most
    # prompts and the longest prompt of any process (one process: its own).
    most, longest = hosts.agree_max(b, max(len(r) for r in rows))
    ids = (np.arange(b) + hosts.index() * most if prompt_ids is None
           else np.asarray(prompt_ids))
    if ids.shape != (b,) or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt_ids must be {b} ints (one per prompt), got shape {ids.shape}")
    # Rows added so the batch splits evenly over the mesh (copies of the last prompt); dropped.
    multiple = max(1, self.batch_multiple() // hosts.count())  # this process's devices
    b_pad = -(-most // multiple) * multiple
    tokens, mask_BP = data.pad_to_bucket([rows[min(i, b - 1)] for i in range(b_pad)],
                                         self.buckets, self.pad_id, longest)
    mask_BP = mask_BP.astype(np.int32)
    row_ids = np.stack([np.repeat(np.resize(ids, b_pad), g), np.tile(np.arange(g), b_pad)], 1)
    cache, state = self._prefill(variables, self._put(tokens), self._put(mask_BP), g,
                                 tokens.shape[1] + int(room))
    return Conversation(cache, state, self._put(row_ids.astype(np.int32)), b * g,
                        tokens[:b], mask_BP[:b], tokens.shape[1])

  def _reserve(self, conv: Conversation, n: int, what: str) -> Conversation:
    """conv with n more slots counted as used; raises if they might not fit in its cache.

    The host's count assumes every extend ran its max_tokens steps; only when that would not
    fit is the device's slot read (one sync), as rows that stop early leave room."""
    capacity = conv.state["mask"].shape[1]
    if conv.slots_used + n > capacity:
      conv = conv._replace(slots_used=int(conv.state["slot"]))
      if conv.slots_used + n > capacity:
        raise ValueError(
            f"{what} needs {n} cache slots but the conversation has {capacity - conv.slots_used}"
            f" left (capacity {capacity} = the prompt bucket + begin's room): pass a larger "
            f"room to begin")
    return conv._replace(slots_used=conv.slots_used + n)

  def extend(self, variables, conv: Conversation, key, *, max_tokens: int, active=None,
             row_budgets=None, **settings) -> tuple[dict, Conversation]:
    """Samples up to max_tokens more tokens for every active row (default: all), from where
    each conversation stands. Returns ({'tokens' [R, max_tokens], 'lengths', 'truncated',
    'logprobs', 'steps', 'extra_rounds', 'fallback_rows', 'row_steps'} as in SampleOutput, the
    conversation continued). A row not active gets no tokens: lengths 0, truncated False.
    row_budgets: R ints <= max_tokens, each row's own budget (a row that reaches it is
    truncated there), or None."""
    sp, key = self._settings_and_key(settings, key)
    conv = self._reserve(conv, int(max_tokens), f"extend(max_tokens={max_tokens})")
    act, state = self._rows_in(conv, active, row_budgets, max_tokens)
    results, cache, state = self._decode(variables, conv.cache, state, key, conv.row_ids, act,
                                         sp, int(max_tokens))
    return self._rows_out(conv, results), conv._replace(cache=cache, state=state)

  def _settings_and_key(self, settings, key):
    sp = self.sampling_params(settings)
    if key is None:
      if not sp.greedy:
        raise ValueError("key is required unless sampling greedily")
      key = jax.random.key(0)
    return sp, key

  def _rows_in(self, conv: Conversation, active, row_budgets, max_tokens: int):
    """(active rows [R_pad] on the device, the decode's state: the conversation's, with
    'budget' [R_pad] when row_budgets are given)."""
    r_pad = conv.row_ids.shape[0] // hosts.count()  # this process's rows
    act = np.zeros((r_pad,), bool)
    act[:conv.rows] = True if active is None else np.asarray(active, bool)
    if row_budgets is None:
      return self._put(act), conv.state
    budgets = np.zeros((r_pad,), np.int32)
    budgets[:conv.rows] = np.asarray(row_budgets, np.int64)
    if budgets.min() < 0 or budgets.max() > max_tokens:
      raise ValueError(f"row_budgets must lie in [0, {max_tokens}], got [{budgets.min()}, "
                       f"{budgets.max()}]")
    return self._put(act), dict(conv.state, budget=self._put(budgets))

  def _rows_out(self, conv: Conversation, results) -> dict:
    """The device's per-row results as this process's rows, the batch's padding cut off."""
    results = self._local_rows(results)
    r_pad = conv.row_ids.shape[0] // hosts.count()
    if r_pad > conv.rows:
      results = {k: v[:conv.rows] if np.ndim(v) else v for k, v in results.items()}
    return results

  def widths(self, rows: int) -> tuple[int, ...]:
    """The compacting decode's widths for a batch of `rows`: rows, then each level
    compact_ratio as wide as the one before (rounded up), compact_levels in all, distinct."""
    out = [rows]
    for _ in range(self.compact_levels - 1):
      w = max(1, math.ceil(out[-1] * self.compact_ratio))
      if w < out[-1]:
        out.append(w)
    return tuple(out)

  def _decode_compacting(self, variables, conv: Conversation, key, settings, row_budgets):
    """extend's results for generate, with finished rows dropped from the work: the rows run
    at widths(R); once no more than the next width are live, the live ones move to the
    cache's first rows and the loop goes on over those only. A row's tokens are those of the
    one-width loop: its key, step numbers and cache rows are its own, whichever rows share
    its batch. The cache is spent (generate continues no conversation)."""
    sp, key = self._settings_and_key(settings, key)
    c = self.max_new_tokens
    act, state = self._rows_in(conv, None, row_budgets, c)
    carry = self._carry(state, act, c)
    full = {name: carry[name] for name in ("tokens", "logp", "lengths", "stopped")}
    cache, row_ids, rows = conv.cache, conv.row_ids, jnp.arange(act.shape[0])
    widths, row_steps = self.widths(act.shape[0]), []
    for level, width in enumerate(widths):
      following = widths[level + 1] if level + 1 < len(widths) else 0
      cache, state, row_ids, carry, rows, full, steps, over = self._level(
          variables, cache, state, key, row_ids, carry, rows, full, sp, c, width, following)
      row_steps.append(steps)
      if bool(over):
        break
    results = {"tokens": full["tokens"], "lengths": full["lengths"],
               "truncated": ~full["stopped"] & act, "logprobs": full["logp"],
               "steps": carry["step"], "extra_rounds": carry["extra_rounds"],
               "fallback_rows": carry["fallback_rows"], "row_steps": sum(row_steps)}
    return self._rows_out(conv, results)

  def append(self, variables, conv: Conversation, token_lists, width: int) -> Conversation:
    """Feeds each row its token list (an observation; may be empty), right-padded to `width`
    (a fixed width compiles once), into the carried cache."""
    if len(token_lists) != conv.rows:
      raise ValueError(f"append got {len(token_lists)} token lists for {conv.rows} rows")
    longest = max((len(t) for t in token_lists), default=0)
    if longest > width:
      raise ValueError(f"an appended token list has {longest} tokens, more than width={width}")
    conv = self._reserve(conv, int(width), f"append(width={width})")
    r_pad = conv.row_ids.shape[0] // hosts.count()  # this process's rows
    tokens_RO, mask_RO = data.pad_right(list(token_lists) + [[]] * (r_pad - conv.rows), width,
                                        self.pad_id)
    cache, state = self._append(variables, conv.cache, conv.state, self._put(tokens_RO),
                                self._put(mask_RO.astype(np.int32)))
    return conv._replace(cache=cache, state=state)

  def next_logprobs(self, variables, conv: Conversation, ids) -> np.ndarray:
    """[R, len(ids)] log-probs of each row's next token being ids[k] (temperature 1, over the
    valid vocabulary), read where each conversation stands: a score, nothing is sampled."""
    out = self._next_logprobs(variables, conv.state["hidden"],
                              jnp.asarray(list(ids), jnp.int32))
    return np.asarray(out)[:conv.rows]

  def peek(self, variables, conv: Conversation, token_lists, width: int,
           ids) -> tuple[np.ndarray, Conversation]:
    """next_logprobs after feeding `token_lists` (e.g. a yes/no question), leaving the
    conversation where it stood: the question is not kept. Its keys and values are written to
    the slots the next append or extend writes first (no copy of the donated cache); until then
    the causal rule hides them, and the old state's mask is 1 on every slot from `slot` on.
    The cache needs `width` free slots for it."""
    asked = self.append(variables, conv, token_lists, width)
    logp = self.next_logprobs(variables, asked, ids)
    # The question's slots are free again (asked's count may be the device's, exact).
    return logp, conv._replace(cache=asked.cache, slots_used=asked.slots_used - int(width))

  def generate(self, variables, prompts, mask=None, *, num_samples: int = 1, key=None,
               prompt_ids=None, row_budgets=None, **settings) -> SampleOutput:
    """num_samples (G) completions per prompt; see the module docstring for the output.

    prompts: B lists of token ids, or a left-padded [B, P] array with `mask`.
    key: a jax PRNG key (required unless sampling greedily).
    prompt_ids: B ints folded into each row's key instead of the prompt's batch index.
    settings: greedy / temperature / top_k / top_p / min_p overriding the Sampler's defaults.
    """
    if key is None and not self.sampling_params(settings).greedy:  # fail before any device work
      raise ValueError("key is required unless sampling greedily")
    start = time.perf_counter()
    conv = self.begin(variables, prompts, mask, num_samples=num_samples, room=self.max_new_tokens,
                      prompt_ids=prompt_ids)
    jax.block_until_ready(conv.state)
    prefill_s = time.perf_counter() - start
    if self.compact_rows:
      results = self._decode_compacting(variables, conv, key, settings, row_budgets)
    else:
      results, _ = self.extend(variables, conv, key, max_tokens=self.max_new_tokens,
                               row_budgets=row_budgets, **settings)
    results = jax.block_until_ready(results)
    seconds = time.perf_counter() - start
    generated = int(np.asarray(results["lengths"]).sum())
    row_steps = int(results["row_steps"])
    metrics = {
        "sampler/tokens_per_s": generated / seconds,
        "sampler/seconds": seconds,
        "sampler/prefill_seconds": prefill_s,
        "sampler/decode_steps": int(results["steps"]),
        "sampler/cut_extra_rounds": int(results["extra_rounds"]),
        "sampler/cut_fallback_rows": int(results["fallback_rows"]),
        "sampler/prompt_bucket": conv.prompt_tokens.shape[1],
        # Rows the decode steps computed (live or finished, the mesh's padding included; every
        # process's), and the share of them spent on rows that had already finished (of this
        # process's tokens: rollout.sample_and_score counts every process's).
        "sampler/row_steps": row_steps,
        "sampler/row_steps_wasted": 1.0 - generated / row_steps if row_steps else 0.0,
    }
    return SampleOutput(results["tokens"], results["lengths"], results["truncated"],
                        results["logprobs"], jnp.asarray(conv.prompt_tokens),
                        jnp.asarray(conv.prompt_mask), metrics)

  __call__ = generate

  def lower_prefill(self, variables, tokens_BP, mask_BP, num_samples: int, capacity: int):
    """The prefill program lowered for these (abstract) arguments: ahead-of-time memory and
    cost analysis (benchmarks/memory.py). Its out_info holds the cache and decode state."""
    return self._prefill.lower(variables, tokens_BP, mask_BP, num_samples, capacity)

  def lower_decode(self, variables, cache, state, key, row_ids_R2, active_R, max_tokens: int,
                   **settings):
    """The decode program lowered for these (abstract) arguments and sampling settings."""
    return self._decode.lower(variables, cache, state, key, row_ids_R2, active_R,
                              self.sampling_params(settings), max_tokens)

  def cached(self, key, make=None):
    """What is kept under `key` for as long as the sampler lives: make() on the first call that
    passes it, else None while nothing is. Programs and compiles that a wrapper composes from
    the pieces above (_prefill_impl, decode_step, ...) live here, with the sampler's own."""
    if key not in self._cache and make is not None:
      self._cache[key] = make()
    return self._cache.get(key)
