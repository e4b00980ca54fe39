"""Jitted batched sampling from a functional Qwen model: prefill once, tile ×G, decode in a loop.

    sampler = Sampler(qwen.Qwen(cfg), max_new_tokens=256, stop_ids=[151645, 151643],
                      temperature=1.0, top_p=0.95, valid_vocab_size=151665, mesh=mesh)
    out = sampler(params, [[151644, 8948, ...], [151644, ...]], num_samples=8,
                  rng=jax.random.key(step))
    out.tokens     # [B*G, C] int32, completion ids; pad_id after the stop token
    out.lengths    # [B*G]   int32, tokens produced, the stop token included
    out.truncated  # [B*G]   bool, True where max_new_tokens was reached without a stop id
    out.logprobs   # [B*G, C] fp32, log-prob of each sampled token (see below); 0 past `lengths`
    out.prompt_tokens, out.prompt_mask  # [B, P] the left-padded prompts used (P = a bucket)
    out.metrics    # {'sampler/tokens_per_s': ..., ...} host floats

Row b*G + g is sample g of prompt b (rows of one prompt are contiguous). `prompts` may also be a
(tokens [B, P], mask [B, P]) pair of left-padded arrays.

What happens in one call (C = max_new_tokens, P = the smallest bucket holding every prompt):
  1. host: left-pad the prompts to P (numpy, so no new shape reaches the device);
  2. `prefill` (jitted per (B, P, G)): one forward of the B prompts into a [L, B, P, K, H] cache,
     which is then padded to P + C slots and tiled G times (never a G-fold prefill);
  3. `decode` (jitted per (B, P, G), the state donated so the cache is updated in place): sample
     token 0 from the prefill's last hidden state, then a `lax.while_loop` feeds one token per
     step and exits as soon as every row has produced a stop id or C tokens.

Sampling settings (fixed when the Sampler is built): `greedy`, `temperature`, `top_k`, `top_p`,
`min_p`. The cuts apply in that order to logits / temperature: keep the top_k largest (ties at
the k-th value kept); then, renormalised over what is left, keep token i iff the mass of tokens
strictly more probable than i is < top_p; then keep p_i >= min_p * p_max. Embedding rows at or
above `valid_vocab_size` are never sampled.

`logprobs` are log_softmax(logits / temperature) over the valid vocabulary, at the sampled token,
BEFORE the top-k/top-p/min-p cut (the distribution the policy-gradient loss differentiates;
grpo.token_logprobs gives the same numbers from head[:, :valid_vocab_size]). Greedy decoding
reports them at `temperature` too.

Randomness: each row has its own key, fold_in(fold_in(rng, prompt_id), g) with prompt_id
defaulting to the prompt's index in the batch (pass `prompt_ids` for stable ids), and every
step folds in the step number, so a row's tokens do not depend on the other rows of its batch.

Performance notes (why the code looks the way it does):
  * The vocabulary head is never materialised as [B, V] logits: `_vocab_scan` walks the head in
    chunks of `vocab_chunk` columns and keeps running (max, sum-exp, argmax or sample) per row,
    so each chunk's logits stay in cache. On CPU that halves the head's cost at V = 151,936.
  * Sampling needs no per-vocabulary-entry random numbers (threefry over [B, V] costs more than
    the whole forward on CPU): within a chunk a token is drawn by inverse CDF over two levels
    of blocks, and across chunks by weighted reservoir sampling (replace the running pick by the
    chunk's with probability chunk mass / mass so far). Both are exact.
  * top-k / top-p / min-p first try the top candidates (lax.top_k, merged chunk by chunk); only a
    row whose kept set does not fit in the candidates falls back to an exact threshold found by
    bisection over float bit patterns (32 more head passes; counted in
    metrics['sampler/cut_fallback_steps']; raise `top_p_candidates` if it fires often).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax import sharding as sharding_lib
from grpo_jax.models import qwen

Array = jax.Array
DEFAULT_BUCKETS = (64, 128, 256, 512, 1024)
CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")  # qwen.init_cache's layout


class SampleOutput(NamedTuple):
  tokens: Array  # [B*G, C] int32
  lengths: Array  # [B*G] int32, stop token included
  truncated: Array  # [B*G] bool
  logprobs: Array  # [B*G, C] fp32, 0 past lengths
  prompt_tokens: Array  # [B, P] int32, left-padded with pad_id
  prompt_mask: Array  # [B, P] int32
  metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (part of the compiled program's cache key)."""
  greedy: bool = False
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  min_p: float = 0.0  # 0: off

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
      raise ValueError(f"temperature={self.temperature!r} must be a number > 0")
    if not (isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0):
      raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 disables it)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 disables it)")
    if not 0.0 <= self.min_p < 1.0:
      raise ValueError(f"min_p={self.min_p!r} must be in [0, 1) (0 disables it)")

  @property
  def cuts(self) -> bool:
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def _settings(greedy=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingParams:
  """SamplingParams from user values; temperature 0 means greedy (log-probs at temperature 1)."""
  if temperature == 0:
    greedy, temperature = True, 1.0
  if greedy:  # the cuts cannot change an argmax; normalised away so greedy compiles once
    top_k, top_p, min_p = 0, 1.0, 0.0
  return SamplingParams(bool(greedy), float(temperature), int(top_k), float(top_p),
                        float(min_p))


# ------------------------------------------------------------------------------------------------
# The vocabulary head, walked in chunks.


class _Head(NamedTuple):
  """The [D, V_valid] head split as full chunks [n, D, c] plus one narrower rest [D, r]."""
  chunks_NDc: Array | None
  rest_Dr: Array | None


def _prepare_head(head_DV: Array, valid: int, chunk: int) -> _Head:
  n = valid // chunk
  chunks = None
  if n:
    chunks = head_DV[:, :n * chunk].reshape(head_DV.shape[0], n, chunk).transpose(1, 0, 2)
  rest = head_DV[:, n * chunk:valid] if valid > n * chunk else None
  return _Head(chunks, rest)


def _num_chunks(valid: int, chunk: int) -> int:
  return -(-valid // chunk)


def _vocab_scan(head: _Head, h_BD: Array, inv_temp: float, body, carry, per_chunk=None):
  """carry = body(carry, logits_Bc / temperature, column offset, per_chunk[i]) over all chunks.

  `per_chunk` is a pytree with a leading axis of _num_chunks entries (e.g. random numbers).
  """
  n = 0 if head.chunks_NDc is None else head.chunks_NDc.shape[0]
  chunk = 0 if head.chunks_NDc is None else head.chunks_NDc.shape[2]
  take = lambda sl: jax.tree.map(lambda x: x[sl], per_chunk)

  def logits(w_Dc):
    return jnp.einsum("BD,Dc->Bc", h_BD, w_Dc.astype(h_BD.dtype),
                      preferred_element_type=jnp.float32) * inv_temp

  if n:
    def step(c, xs):
      w_Dc, i, extra = xs
      return body(c, logits(w_Dc), i * chunk, extra), None
    carry, _ = jax.lax.scan(step, carry, (head.chunks_NDc, jnp.arange(n, dtype=jnp.int32),
                                          take(slice(0, n))))
  if head.rest_Dr is not None:
    carry = body(carry, logits(head.rest_Dr), jnp.int32(n * chunk), take(n))
  return carry


# ------------------------------------------------------------------------------------------------
# Exact categorical draws without per-entry random numbers.


def _first_true(mask_BR: Array, fallback_BR: Array) -> Array:
  """Index of the first True per row; where there is none, the last True of `fallback`."""
  r = mask_BR.shape[-1]
  first = jnp.argmax(mask_BR, axis=-1)
  last = r - 1 - jnp.argmax(fallback_BR[:, ::-1], axis=-1)
  return jnp.where(jnp.any(mask_BR, axis=-1), first, last).astype(jnp.int32)


def _block_size(width: int) -> int:
  """A power of two near sqrt(width): both levels of `_draw` then cost about sqrt(width)²."""
  return 1 << max(0, int(math.log2(max(width, 1))) // 2)


def _inverse_cdf(w_BR: Array, u_B: Array) -> Array:
  """One index per row with P(i) = w[i] / sum(w), w >= 0, from one uniform u in [0, 1) per row.

  The cumulative sum is a triangular matmul (XLA's cumsum is a slow scan on CPU); an index with
  weight 0 is never returned even where rounding makes neighbouring partial sums disagree.
  Rows with no mass return their last index (callers give such rows zero weight).
  """
  r = w_BR.shape[-1]
  cum_BR = jnp.einsum("BR,RS->BS", w_BR, jnp.triu(jnp.ones((r, r), w_BR.dtype)),
                      precision=jax.lax.Precision.HIGHEST)
  target_B = u_B * cum_BR[:, -1]
  positive = w_BR > 0
  return _first_true((cum_BR > target_B[:, None]) & positive, positive)


def _draw(e_BC: Array, u_B2: Array) -> Array:
  """Index drawn with P ∝ e over [B, C]: a block of ~sqrt(C) entries first, then one inside it."""
  b, c = e_BC.shape
  r = _block_size(c)
  e_BC = jnp.pad(e_BC, ((0, 0), (0, -c % r)))
  blocks_BNR = e_BC.reshape(b, -1, r)
  blk_B = _inverse_cdf(blocks_BNR.sum(-1), u_B2[:, 0])
  inner_BR = jnp.take_along_axis(blocks_BNR, blk_B[:, None, None], 1)[:, 0]
  return blk_B * r + _inverse_cdf(inner_BR, u_B2[:, 1])


# ------------------------------------------------------------------------------------------------
# Streaming passes over the vocabulary. Each returns per-row results; logits are temperature-scaled.


def _greedy_pass(head, h_BD, inv_temp):
  """(argmax token, its logit, logsumexp) per row."""
  def body(c, l_Bc, off, _):
    m, s, tok = c
    cm = jnp.max(l_Bc, -1)
    nm = jnp.maximum(m, cm)
    s = s * jnp.exp(m - nm) + jnp.sum(jnp.exp(l_Bc - cm[:, None]), -1) * jnp.exp(cm - nm)
    # Strict '>' keeps the earliest index on ties, as argmax over the full row would.
    tok = jnp.where(cm > m, off + jnp.argmax(l_Bc, -1).astype(jnp.int32), tok)
    return nm, s, tok
  b = h_BD.shape[0]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.zeros((b,), jnp.int32))
  m, s, tok = _vocab_scan(head, h_BD, inv_temp, body, init)
  return tok, m, m + jnp.log(s)


def _reservoir_pass(head, h_BD, inv_temp, u_NB3, tau_B=None):
  """A draw ∝ exp(logits) over {logits >= tau} (all when tau is None), exact.

  Within a chunk `_draw` picks a candidate; across chunks the running pick is replaced by the
  chunk's with probability (chunk mass) / (mass so far), so chunk c wins with probability
  mass_c / total. Returns (token, its logit, logsumexp of the kept set).
  """
  def body(c, l_Bc, off, u_B3):
    m, s, tok, tok_logit = c
    if tau_B is not None:
      l_Bc = jnp.where(l_Bc >= tau_B[:, None], l_Bc, -jnp.inf)
    cm = jnp.max(l_Bc, -1)
    cm_safe = jnp.where(jnp.isfinite(cm), cm, 0.0)  # a chunk may be entirely cut
    e_Bc = jnp.exp(l_Bc - cm_safe[:, None])
    nm = jnp.maximum(m, cm)
    nm_safe = jnp.where(jnp.isfinite(nm), nm, 0.0)
    w = jnp.sum(e_Bc, -1) * jnp.exp(cm_safe - nm_safe) * jnp.isfinite(cm)
    s = s * jnp.exp(m - nm_safe) + w
    take = (w > 0) & (u_B3[:, 0] * s < w)
    idx = _draw(e_Bc, u_B3[:, 1:])
    picked = jnp.take_along_axis(l_Bc, idx[:, None], 1)[:, 0]
    return (nm, s, jnp.where(take, off + idx, tok), jnp.where(take, picked, tok_logit))
  b = h_BD.shape[0]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.zeros((b,), jnp.int32),
          jnp.zeros((b,)))
  m, s, tok, tok_logit = _vocab_scan(head, h_BD, inv_temp, body, init, u_NB3)
  return tok, tok_logit, m + jnp.log(s)


def _candidates_pass(head, h_BD, inv_temp, k):
  """(max, logsumexp, top-k logits [B, k] descending, their ids) per row."""
  def body(c, l_Bc, off, _):
    m, s, vals, ids = c
    cm = jnp.max(l_Bc, -1)
    nm = jnp.maximum(m, cm)
    s = s * jnp.exp(m - nm) + jnp.sum(jnp.exp(l_Bc - cm[:, None]), -1) * jnp.exp(cm - nm)
    cv, ci = jax.lax.top_k(l_Bc, min(k, l_Bc.shape[1]))
    vals, pos = jax.lax.top_k(jnp.concatenate([vals, cv], 1), k)
    ids = jnp.take_along_axis(jnp.concatenate([ids, off + ci.astype(jnp.int32)], 1), pos, 1)
    return nm, s, vals, ids
  b = h_BD.shape[0]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.full((b, k), -jnp.inf),
          jnp.zeros((b, k), jnp.int32))
  m, s, vals, ids = _vocab_scan(head, h_BD, inv_temp, body, init)
  return m, m + jnp.log(s), vals, ids


def _mass_pass(head, h_BD, inv_temp, ref_B, above_B, floor_B):
  """sum over logits l > above and l >= floor of exp(l - ref), per row."""
  def body(acc, l_Bc, off, _):
    keep = (l_Bc > above_B[:, None]) & (l_Bc >= floor_B[:, None])
    return acc + jnp.sum(jnp.where(keep, jnp.exp(l_Bc - ref_B[:, None]), 0.0), -1)
  return _vocab_scan(head, h_BD, inv_temp, body, jnp.zeros(h_BD.shape[:1]))


def _float_key(x):
  """float32 -> uint32 with the same order (radix-sort key)."""
  b = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _key_float(k):
  b = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
  return jax.lax.bitcast_convert_type(b, jnp.float32)


def _top_p_threshold(head, h_BD, inv_temp, top_p, max_B, mass_B, floor_B):
  """Smallest logit value v such that the kept mass strictly above v is < top_p · mass.

  mass above v only changes at logit values, so the bisection over float bit patterns (32 steps,
  one head pass each) ends exactly on a logit value: the nucleus is {l >= v}.
  """
  lo = jnp.broadcast_to(_float_key(jnp.float32(-jnp.inf)), max_B.shape)
  hi = _float_key(max_B)  # nothing lies above the max: kept mass 0 < top_p

  def step(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = _mass_pass(head, h_BD, inv_temp, max_B, _key_float(mid), floor_B) < top_p * mass_B
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
  _, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
  return _key_float(hi)


def _cut_threshold(sp: SamplingParams, m_B, lse_B, vals_BK, valid: int):
  """From the top-K candidates: (threshold tau, top-k floor, covered) per row.

  covered: every token with logit >= tau is among the candidates and tau is exact, so the draw
  can be made among them.
  """
  b, k = vals_BK.shape
  all_in = k >= valid  # the candidates are the whole vocabulary
  tau_k = vals_BK[:, sp.top_k - 1] if 0 < sp.top_k < valid else jnp.full((b,), -jnp.inf)
  tau, covered = tau_k, jnp.ones((b,), bool)
  if sp.top_k and not all_in:
    covered &= vals_BK[:, -1] < tau_k  # no ties of the k-th value outside the candidates
  if sp.top_p < 1.0:
    p_BK = jnp.exp(vals_BK - m_B[:, None]) * (vals_BK >= tau_k[:, None])
    mass_B = jnp.sum(p_BK, -1) if sp.top_k else jnp.exp(lse_B - m_B)
    reach_BK = jnp.cumsum(p_BK, -1) >= sp.top_p * mass_B[:, None]
    tau = jnp.maximum(tau, jnp.take_along_axis(vals_BK, jnp.argmax(reach_BK, -1)[:, None], 1)[:, 0])
    covered &= jnp.any(reach_BK, -1) | all_in
  if sp.min_p > 0.0:
    tau = jnp.maximum(tau, m_B + math.log(sp.min_p))
  if not all_in:
    covered &= vals_BK[:, -1] < tau
  return tau, tau_k, covered


def _next_token(sp: SamplingParams, head: _Head, h_BD, u_BU, valid: int, num_candidates: int):
  """One token per row from hidden states h_BD. Returns (token, log-prob, used the fallback).

  u_BU: the row's uniforms for this step, [B, 3 * num_chunks + 1].
  """
  inv_temp = 1.0 / sp.temperature
  b = h_BD.shape[0]
  no_fallback = jnp.zeros((), bool)
  if sp.greedy:
    tok, logit, lse = _greedy_pass(head, h_BD, inv_temp)
    return tok, logit - lse, no_fallback
  u_NB3 = u_BU[:, 1:].reshape(b, -1, 3).transpose(1, 0, 2)
  if not sp.cuts:
    tok, logit, lse = _reservoir_pass(head, h_BD, inv_temp, u_NB3)
    return tok, logit - lse, no_fallback

  m, lse, vals, ids = _candidates_pass(head, h_BD, inv_temp, num_candidates)
  tau, tau_k, covered = _cut_threshold(sp, m, lse, vals, valid)
  pick = _inverse_cdf(jnp.exp(vals - m[:, None]) * (vals >= tau[:, None]), u_BU[:, 0])
  tok = jnp.take_along_axis(ids, pick[:, None], 1)[:, 0]
  logit = jnp.take_along_axis(vals, pick[:, None], 1)[:, 0]

  def exact(_):
    # A row whose kept set overflows the candidates: exact threshold, then a streaming draw.
    t = tau
    if sp.top_p < 1.0:
      mass = (_mass_pass(head, h_BD, inv_temp, m, jnp.full((b,), -jnp.inf), tau_k)
              if sp.top_k else jnp.exp(lse - m))
      t = jnp.maximum(tau_k, _top_p_threshold(head, h_BD, inv_temp, sp.top_p, m, mass, tau_k))
      if sp.min_p > 0.0:
        t = jnp.maximum(t, m + math.log(sp.min_p))
    t_tok, t_logit, _ = _reservoir_pass(head, h_BD, inv_temp, u_NB3, t)
    return t_tok, t_logit

  fallback = ~jnp.all(covered)
  f_tok, f_logit = jax.lax.cond(fallback, exact, lambda _: (tok, logit), None)
  # Per-row choice: a covered row's draw never depends on whether another row fell back.
  tok = jnp.where(covered, tok, f_tok)
  logit = jnp.where(covered, logit, f_logit)
  return tok, logit - lse, fallback


# ------------------------------------------------------------------------------------------------
# The sampler.


class Sampler:
  """Built once per model; each call compiles once per (B, bucket, G, sampling settings).

  Args:
    model: a `qwen.Qwen` module (its cfg and compute dtype are used) or a `qwen.QwenConfig`.
    max_new_tokens: C, the fixed completion length budget.
    stop_ids: token ids that end a completion (kept in the output, counted in `lengths`).
    buckets: prompt lengths P the batch is left-padded to (the smallest that fits is used).
    greedy, temperature, top_k, top_p, min_p: default sampling settings (module docstring);
      each call may override them. temperature=0 means greedy (log-probs then at temperature 1).
    valid_vocab_size: ids >= this are never sampled (default: the whole embedding).
    pad_id: written after a row's stop token and used to left-pad prompts.
    mesh: a (data, fsdp, tensor) mesh; the batch is split over data × fsdp.
    dtype: compute dtype when `model` is a config (default fp32).
    vocab_chunk: columns of the head processed at a time (keeps one chunk's logits in cache).
    top_p_candidates: candidates kept for top-p / min-p before the exact fallback.
  """

  def __init__(self, model: qwen.Qwen | qwen.QwenConfig, *, max_new_tokens: int,
               stop_ids: Sequence[int] = (), buckets: Sequence[int] = DEFAULT_BUCKETS,
               greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, valid_vocab_size: int | None = None,
               pad_id: int = 0, mesh=None, dtype=None, vocab_chunk: int = 4096,
               top_p_candidates: int = 512):
    if isinstance(model, qwen.QwenConfig):
      model = qwen.Qwen(model, dtype=jnp.float32 if dtype is None else dtype)
    elif not isinstance(model, qwen.Qwen):
      raise TypeError(f"model must be a qwen.Qwen or a qwen.QwenConfig, got {type(model)}")
    self.model, cfg = model, model.cfg
    self.cfg = cfg
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
    if vocab_chunk < 1 or top_p_candidates < 1:
      raise ValueError(f"vocab_chunk={vocab_chunk} and top_p_candidates={top_p_candidates} "
                       "must be >= 1")
    self.defaults = _settings(greedy, temperature, top_k, top_p, min_p)
    self.max_new_tokens, self.stop_ids, self.buckets = int(max_new_tokens), stop_ids, buckets
    self.valid, self.pad_id, self.mesh = valid, int(pad_id), mesh
    self.vocab_chunk = min(int(vocab_chunk), valid)
    self.top_p_candidates = int(top_p_candidates)
    self._prefill = jax.jit(self._prefill_impl, static_argnums=(3,))
    # The cache (argument 1) is donated: the decode loop updates the prefill's buffer in place.
    self._decode = jax.jit(self._decode_impl, static_argnums=(5,), donate_argnums=(1,))

  def _num_candidates(self, sp: SamplingParams) -> int:
    if 0 < sp.top_k < self.valid:
      return sp.top_k + 1  # one more than k: shows whether the k-th value is tied beyond it
    return min(self.top_p_candidates, self.valid)

  # --- device side -------------------------------------------------------------------------

  def _constrain(self, x, logical):
    if self.mesh is None:
      return x
    spec = sharding_lib.logical_to_spec(P(*logical), x.shape, self.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def _prefill_impl(self, params, tokens_BP, mask_BP, num_samples):
    """Prompt forward into a P-slot cache, then tiled to [L, B*G, K, P+C, H]."""
    cfg, g, c = self.cfg, num_samples, self.max_new_tokens
    b, _ = tokens_BP.shape
    cache = qwen.init_cache(cfg, b, tokens_BP.shape[1], self.model.dtype)
    cache = jax.tree.map(lambda x: self._constrain(x, CACHE_AXES), cache)
    hidden_BPD, cache = self.model.apply({"params": params}, tokens_BP,
                                         qwen.positions_from_mask(mask_BP), mask_BP, cache, 0)
    tile = lambda x: jnp.repeat(x, g, axis=0)
    cache = jax.tree.map(lambda x: self._constrain(
        jnp.pad(jnp.repeat(x, g, axis=1), ((0, 0), (0, 0), (0, 0), (0, c), (0, 0))),
        CACHE_AXES), cache)
    # Every completion slot is marked real: the causal rule (slot s <= t) hides unwritten ones.
    mask_RS = jnp.concatenate([tile(mask_BP), jnp.ones((b * g, c), mask_BP.dtype)], 1)
    return cache, {
        "hidden": self._constrain(tile(hidden_BPD[:, -1]), ("batch", None)),
        "mask": self._constrain(mask_RS, ("batch", None)),
        "prompt_len": tile(jnp.sum(mask_BP, 1, dtype=jnp.int32)),
    }

  def _decode_impl(self, params, cache, state, rng, row_ids_R2, sp: SamplingParams):
    """A while_loop: sample a token per row from the last hidden state, feed it, repeat."""
    c, cfg = self.max_new_tokens, self.cfg
    r = state["hidden"].shape[0]
    p = state["mask"].shape[1] - c
    keys_R = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(rng, i[0]), i[1]))(
        row_ids_R2)
    head = _prepare_head(qwen.head_kernel(params, cfg), self.valid, self.vocab_chunk)
    stop = jnp.asarray(self.stop_ids or (-1,), jnp.int32)
    num_uniforms = 1 + 3 * _num_chunks(self.valid, self.vocab_chunk)

    def next_token(h_RD, step):
      u_RU = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, step),
                                                   (num_uniforms,)))(keys_R)
      return _next_token(sp, head, h_RD, u_RU, self.valid, self._num_candidates(sp))

    # One sampling site in the program (half the compile time of sampling token 0 separately):
    # each step samples from the carried hidden state, then runs the forward for the next step.
    # The forward after a row's last step is wasted work, one model step per call.
    carry = dict(step=jnp.int32(0), cache=cache, hidden=state["hidden"],
                 tokens=jnp.full((r, c), self.pad_id, jnp.int32),
                 logp=jnp.zeros((r, c), jnp.float32), done=jnp.zeros((r,), bool),
                 stopped=jnp.zeros((r,), bool), lengths=jnp.zeros((r,), jnp.int32),
                 fallbacks=jnp.int32(0))

    def cond(s):
      return (s["step"] < c) & ~jnp.all(s["done"])

    def body(s):
      i = s["step"]
      tok, logp, fb = next_token(s["hidden"], i)
      live = ~s["done"]
      tok = jnp.where(live, tok, self.pad_id)
      stopped = live & jnp.isin(tok, stop)
      hidden, cache = self.model.apply(
          {"params": params}, tok[:, None], (state["prompt_len"] + i)[:, None], state["mask"],
          s["cache"], p + i)
      put = lambda x_RC, x_R: jax.lax.dynamic_update_index_in_dim(x_RC, x_R, i, 1)
      return dict(step=i + 1, cache=cache, hidden=hidden[:, 0], tokens=put(s["tokens"], tok),
                  logp=put(s["logp"], jnp.where(live, logp, 0.0)),
                  done=s["done"] | stopped, stopped=s["stopped"] | stopped,
                  lengths=s["lengths"] + live, fallbacks=s["fallbacks"] + fb)

    out = jax.lax.while_loop(cond, body, carry)
    results = {
        "tokens": self._constrain(out["tokens"], ("batch", None)),
        "lengths": out["lengths"], "truncated": ~out["stopped"],
        "logprobs": self._constrain(out["logp"], ("batch", None)),
        "steps": out["step"], "fallbacks": out["fallbacks"],
    }
    # Returning the cache aliases it with the donated input, so no copy is made on entry.
    return results, out["cache"]

  # --- host side ---------------------------------------------------------------------------

  def _as_token_lists(self, prompts, mask) -> list[np.ndarray]:
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

  def _batch_multiple(self) -> int:
    if self.mesh is None:
      return 1
    return int(np.prod([self.mesh.shape[a] for a in sharding_lib.BATCH_AXES]))

  def generate(self, params, prompts, mask=None, *, num_samples: int = 1, key=None,
               prompt_ids=None, **settings) -> SampleOutput:
    """num_samples (G) completions per prompt; see the module docstring for the output.

    prompts: B lists of token ids, or a left-padded [B, P] array with `mask`.
    key: a jax PRNG key (required unless sampling greedily).
    prompt_ids: B ints folded into each row's key instead of the prompt's batch index.
    settings: greedy / temperature / top_k / top_p / min_p overriding the Sampler's defaults.
    """
    if not (isinstance(num_samples, (int, np.integer)) and num_samples >= 1):
      raise ValueError(f"num_samples={num_samples!r} (G) must be an int >= 1")
    unknown = set(settings) - {"greedy", "temperature", "top_k", "top_p", "min_p"}
    if unknown:
      raise TypeError(f"unknown sampling settings {sorted(unknown)}")
    sp = _settings(**{**dataclasses.asdict(self.defaults), **settings})
    if key is None:
      if not sp.greedy:
        raise ValueError("key is required unless sampling greedily")
      key = jax.random.key(0)
    rows = self._as_token_lists(prompts, mask)
    b, g = len(rows), int(num_samples)
    ids = np.arange(b) if prompt_ids is None else np.asarray(prompt_ids)
    if ids.shape != (b,) or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt_ids must be {b} ints (one per prompt), got shape {ids.shape}")
    p = next(x for x in self.buckets if x >= max(r.size for r in rows))
    # Rows added so the batch splits evenly over the mesh (copies of the last prompt); dropped.
    b_pad = -(-b // self._batch_multiple()) * self._batch_multiple()
    tokens = np.full((b_pad, p), self.pad_id, np.int32)
    mask_BP = np.zeros((b_pad, p), np.int32)
    for i in range(b_pad):
      row = rows[min(i, b - 1)]
      tokens[i, p - row.size:], mask_BP[i, p - row.size:] = row, 1
    row_ids = np.stack([np.repeat(np.resize(ids, b_pad), g), np.tile(np.arange(g), b_pad)], 1)
    put = lambda x: jnp.asarray(x) if self.mesh is None else jax.device_put(
        x, sharding_lib.batch_sharding(self.mesh, x.ndim))

    start = time.perf_counter()
    cache, state = jax.block_until_ready(self._prefill(params, put(tokens), put(mask_BP), g))
    prefill_s = time.perf_counter() - start
    results, _ = self._decode(params, cache, state, key, put(row_ids.astype(np.int32)), sp)
    results = jax.block_until_ready(results)
    seconds = time.perf_counter() - start
    if b_pad > b:
      results = {k: v[:b * g] if np.ndim(v) else v for k, v in results.items()}
    generated = int(np.asarray(results["lengths"]).sum())
    metrics = {
        "sampler/tokens_per_s": generated / seconds,
        "sampler/seconds": seconds,
        "sampler/prefill_seconds": prefill_s,
        "sampler/decode_steps": int(results["steps"]),
        "sampler/cut_fallback_steps": int(results["fallbacks"]),
        "sampler/prompt_bucket": p,
    }
    return SampleOutput(results["tokens"], results["lengths"], results["truncated"],
                        results["logprobs"], jnp.asarray(tokens[:b]), jnp.asarray(mask_BP[:b]),
                        metrics)

  __call__ = generate
