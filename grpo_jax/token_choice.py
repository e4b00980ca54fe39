"""How grpo_jax.sampler chooses each next token: the sampling settings (SamplingParams) and the
choice of one token per row from last hidden states, with the [B, V] logits never materialised.

    sp = token_choice.parse_settings(temperature=0.7, top_p=0.95)  # a static SamplingParams
    head = token_choice.prepare_head(head_VD, valid_vocab_size, vocab_chunk)
    tok_B, logp_B, extra_rounds, fell_back_B = token_choice.next_token(
        sp, head, h_BD, step_keys_B, valid_vocab_size, top_p_draws)
    # One program for every setting with the same cuts on (tests: a compile per kind of setting):
    shape, nums = token_choice.traced(sp)
    ... = token_choice.next_token(shape, head, h_BD, step_keys_B, valid_vocab_size,
                                  top_p_draws, nums)

Settings: `greedy` (or temperature=0: the first argmax), `temperature`, `top_k`, `top_p`,
`min_p`, applied as transformers' generate applies its warpers (Temperature-, TopK-, TopP- and
MinPLogitsWarper, in that order) to the logits of the valid vocabulary (embedding rows at or
above `valid_vocab_size` are never sampled):
  1. l = logits / temperature;
  2. top-k: keep the tokens whose l is >= the k-th largest (ties kept);
  3. top-p: renormalised over the top-k set, keep token i iff the mass of the tokens strictly
     more probable than i is < top_p;
  4. min-p: renormalised over what is left, keep p_i >= min_p * p_max. The top token survives
     every cut, so this is l_i >= max(l) + log(min_p) whatever came before; being last, it
     never changes the total top-p is measured on.
The token is drawn ∝ exp(l) over the kept set; `cut_probs` computes that distribution densely.
Ties are the one difference from transformers (apart from float rounding at a cut): in step 3
tokens of equal l stand or fall together, so a group of them straddling the top-p boundary is
kept whole, where transformers' TopPLogitsWarper (a cumulative sum in its sort order) keeps only
the members its sort puts last. Ties at the top-k and min-p cuts are kept by both.

`next_token` returns log_softmax(logits / temperature) over the valid vocabulary at the sampled
token, BEFORE the cuts (the policy's own distribution: what train_step.completion_logprobs
computes for the loss, which recomputes its old log-probs itself rather than reading these).

Performance notes (why the code looks the way it does):
  * The [B, V] logits are never materialised: `_vocab_scan` walks the head in chunks of
    `vocab_chunk` columns and keeps running (max, sum-exp, best block or draw) per row, so each
    chunk's logits stay in cache; greedy keeps only the best block of 32 columns and recomputes
    that block's logits at the end (a max is much cheaper than an argmax on CPU).
  * Sampling needs no per-vocabulary-entry random numbers (threefry over [B, V] costs more than
    the whole forward on CPU): within a chunk a token is drawn by inverse CDF over two levels
    of blocks, and across chunks by weighted reservoir sampling (replace the running pick by the
    chunk's with probability chunk mass / mass so far). Both are exact.
  * top-k takes the top k + 1 candidates (lax.top_k merged chunk by chunk), which decide the cut
    exactly unless the k-th value is tied beyond them. top-p is by rejection: draw
    `top_p_draws` candidates from the (top-k and min-p cut) distribution and keep the first whose
    higher-ranked mass is < top_p of the top-k set's (or the vocabulary's) mass; a row with
    none accepted (probability < (1 - top_p)^draws) is redrawn (counted in the extra rounds).
    After MAX_EXTRA_ROUNDS redraws a row takes its top token, which every cut keeps (counted
    as a fallback row); this binds only at a tiny top_p over a flat distribution (top_p = 0.01
    over 500 near-equal logits, 8 draws: 0.7% of rows; top_p = 0.05: none), and the draw is
    exact unless it does.
    A top-p step costs about two head passes, with no sort of the vocabulary (one more on the
    top-k tie path with min-p, to measure the top-k set).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import logprobs

Array = jax.Array


def _is_number(v) -> bool:
  return not isinstance(v, bool) and isinstance(v, (int, float, np.number))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (part of the compiled program's cache key)."""
  greedy: bool = False
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  min_p: float = 0.0  # 0: off

  def __post_init__(self):
    """The sampling settings' rules, written once: grpo_jax.validate checks a config's
    sampling section with them (prefixing `config.sampling.`)."""
    logprobs.check_temperature(self.temperature)
    if isinstance(self.top_k, bool) or not (isinstance(self.top_k, (int, np.integer))
                                            and self.top_k >= 0):
      raise ValueError(f"top_k: must be an int >= 0 (0 = off), got {self.top_k!r}")
    if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
      raise ValueError(f"top_p: must be in (0, 1] (1 = off), got {self.top_p!r}")
    if not (_is_number(self.min_p) and 0.0 <= self.min_p < 1.0):
      raise ValueError(f"min_p: must be in [0, 1) (0 = off), got {self.min_p!r}")

  @property
  def cuts(self) -> bool:
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


class Numbers(NamedTuple):
  """The numbers of a SamplingParams as `next_token` computes with them. From `numbers_of(sp)`
  they are Python floats, constants of the compiled program (as the sampler runs it); as
  float32 scalars (`traced`) they are arguments, and one program serves every setting of one
  shape. The two compute the same: a Python float enters the program as the float32 it rounds
  to."""
  inv_temp: float | Array   # 1 / temperature
  top_p: float | Array
  log_min_p: float | Array  # log(min_p); unread when min_p is off


def numbers_of(sp: SamplingParams) -> Numbers:
  return Numbers(1.0 / sp.temperature, sp.top_p, math.log(sp.min_p) if sp.min_p > 0.0 else 0.0)


def traced(sp: SamplingParams) -> tuple[SamplingParams, Numbers]:
  """(the shape of sp's program, its numbers as float32 scalars) for
  `next_token(shape, ..., nums=...)`: the tokens of `next_token(sp, ...)`, from one compile for
  every SamplingParams with the same greedy, top_k and cuts switched on.

  >>> traced(parse_settings(temperature=0.7, top_p=0.9))[0]
  SamplingParams(greedy=False, temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)
  """
  shape = SamplingParams(sp.greedy, 1.0, sp.top_k, 0.5 if sp.top_p < 1.0 else 1.0,
                         0.5 if sp.min_p > 0.0 else 0.0)
  return shape, Numbers(*(np.float32(x) for x in numbers_of(sp)))


def parse_settings(greedy=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingParams:
  """SamplingParams from user values; temperature 0 means greedy (log-probs at temperature 1)."""
  for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
      raise ValueError(f"{name}: must be a finite number, got {v!r}")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
    raise ValueError(f"top_k: must be an int >= 0 (0 = off), got {top_k!r}")
  if temperature == 0:
    greedy, temperature = True, 1.0
  if greedy:  # the cuts cannot change an argmax; normalised away so greedy compiles once
    top_k, top_p, min_p = 0, 1.0, 0.0
  return SamplingParams(bool(greedy), float(temperature), int(top_k), float(top_p),
                        float(min_p))


def cut_probs(sp: SamplingParams, logits_BV: Array) -> Array:
  """[B, V] probabilities `next_token` draws from, given the valid vocabulary's logits [B, V].

  The cuts of the module docstring computed densely (with a sort): a reference for tests and
  analysis; `next_token` draws from the same distribution without materialising it. Greedy: a
  one-hot at the first argmax.
  """
  l_BV = logits_BV.astype(jnp.float32) * (1.0 / sp.temperature)  # as next_token scales them
  v = l_BV.shape[-1]
  if sp.greedy:
    return jax.nn.one_hot(jnp.argmax(l_BV, -1), v)
  m_B1 = jnp.max(l_BV, -1, keepdims=True)
  keep_BV = jnp.ones(l_BV.shape, bool)
  if 0 < sp.top_k < v:
    keep_BV &= l_BV >= jax.lax.top_k(l_BV, sp.top_k)[0][:, -1:]
  if sp.top_p < 1.0:
    # Mass strictly above token i = the mass at ascending positions past the last logit <= l_i.
    order_BV = jnp.argsort(l_BV, -1)
    asc_BV = jnp.take_along_axis(l_BV, order_BV, -1)
    e_asc_BV = jnp.take_along_axis(jnp.where(keep_BV, jnp.exp(l_BV - m_B1), 0.0), order_BV, -1)
    tail_BV1 = jnp.pad(jnp.flip(jnp.cumsum(jnp.flip(e_asc_BV, -1), -1), -1), ((0, 0), (0, 1)))
    n_at_most_BV = jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="right"))(asc_BV, l_BV)
    above_BV = jnp.take_along_axis(tail_BV1, n_at_most_BV, -1)
    keep_BV &= above_BV < sp.top_p * tail_BV1[:, :1]  # the total: over the top-k set only
  if sp.min_p > 0.0:
    keep_BV &= l_BV >= m_B1 + math.log(sp.min_p)
  return jax.nn.softmax(jnp.where(keep_BV, l_BV, -jnp.inf), -1)


# ------------------------------------------------------------------------------------------------
# The vocabulary head, walked in chunks.


class _Head(NamedTuple):
  """The [V_valid, D] head (vocabulary-major, like a tied embedding) as full chunks [n, c, D]
  plus one narrower rest [r, D]. Chunk logits are computed vocabulary-major too, [c, B]: on
  CPU that matmul and the reductions over c (vectorised across the batch) are ~15% faster
  than the [B, c] layout."""
  chunks_NcD: Array | None
  rest_rD: Array | None
  source_VD: Array  # the whole head, for recomputing a few rows of logits per batch row


def prepare_head(head_VD: Array, valid: int, chunk: int) -> _Head:
  n = valid // chunk
  chunks = head_VD[:n * chunk].reshape(n, chunk, head_VD.shape[1]) if n else None
  rest = head_VD[n * chunk:valid] if valid > n * chunk else None
  return _Head(chunks, rest, head_VD)


def _num_chunks(valid: int, chunk: int) -> int:
  return -(-valid // chunk)


def _head_chunk(head: _Head) -> int:
  return head.chunks_NcD.shape[1] if head.chunks_NcD is not None else head.rest_rD.shape[0]


def _vocab_scan(head: _Head, h_BD: Array, inv_temp: float, body, carry, per_chunk=None):
  """carry = body(carry, logits_cB / temperature, vocab offset, per_chunk[i]) over all chunks.

  `per_chunk` is a pytree with a leading axis of _num_chunks entries (e.g. random numbers).
  """
  n = 0 if head.chunks_NcD is None else head.chunks_NcD.shape[0]
  chunk = 0 if head.chunks_NcD is None else head.chunks_NcD.shape[1]
  take = lambda sl: jax.tree.map(lambda x: x[sl], per_chunk)

  def logits(w_cD):
    return jnp.einsum("cD,BD->cB", w_cD.astype(h_BD.dtype), h_BD,
                      preferred_element_type=jnp.float32) * inv_temp

  if n:
    def step(c, xs):
      w_cD, i, extra = xs
      return body(c, logits(w_cD), i * chunk, extra), None
    carry, _ = jax.lax.scan(step, carry, (head.chunks_NcD, jnp.arange(n, dtype=jnp.int32),
                                          take(slice(0, n))))
  if head.rest_rD is not None:
    carry = body(carry, logits(head.rest_rD), jnp.int32(n * chunk), take(n))
  return carry


# ------------------------------------------------------------------------------------------------
# Exact categorical draws without per-entry random numbers.


def _first_true(mask: Array, fallback: Array) -> Array:
  """Index of the first True along the last axis; where there is none, the last True of
  `fallback`."""
  r = mask.shape[-1]
  first = jnp.argmax(mask, axis=-1)
  last = r - 1 - jnp.argmax(jnp.flip(fallback, -1), axis=-1)
  return jnp.where(jnp.any(mask, axis=-1), first, last).astype(jnp.int32)


ARGMAX_BLOCK = 32  # vocabulary entries per block in the greedy pass; divides every vocab_chunk


def _block_size(width: int) -> int:
  """A power of two near sqrt(width): both levels of `_draw` then cost about sqrt(width)²."""
  return 1 << max(0, int(math.log2(max(width, 1))) // 2)


def _inverse_cdf(w_BR: Array, u_BS: Array) -> Array:
  """S indices per row, draw s with P(i) = w[i] / sum(w) (w >= 0) from uniform u[:, s] in [0, 1).

  The cumulative sum is a triangular matmul (XLA's cumsum is a slow scan on CPU); an index with
  weight 0 is never returned even where rounding makes neighbouring partial sums disagree.
  """
  r = w_BR.shape[-1]
  # The triangle as a NumPy constant: built with jnp, a GPU compile makes it (and its padding for
  # the matmul) again in every decode step, two kernels of about 270.
  cum_BR = jnp.einsum("BR,RQ->BQ", w_BR, np.triu(np.ones((r, r), w_BR.dtype)),
                      precision=jax.lax.Precision.HIGHEST)
  target_BS = u_BS * cum_BR[:, -1:]
  positive_B1R = (w_BR > 0)[:, None, :]
  hit_BSR = (cum_BR[:, None, :] > target_BS[..., None]) & positive_B1R
  return _first_true(hit_BSR, jnp.broadcast_to(positive_B1R, hit_BSR.shape))


def _draw(e_cB: Array, u_BS2: Array) -> Array:
  """[B, S] indices drawn with P ∝ e over c: a block of ~sqrt(c) entries, then one inside it."""
  c, b = e_cB.shape
  s = u_BS2.shape[1]
  r = _block_size(c)
  blocks_NRB = jnp.pad(e_cB, ((0, -c % r), (0, 0))).reshape(-1, r, b)
  blk_BS = _inverse_cdf(blocks_NRB.sum(1).T, u_BS2[..., 0])
  inner_BSR = blocks_NRB[blk_BS, :, jnp.arange(b)[:, None]]
  inner_BS = _inverse_cdf(inner_BSR.reshape(b * s, r), u_BS2[..., 1].reshape(b * s, 1))
  return blk_BS * r + inner_BS.reshape(b, s)


# ------------------------------------------------------------------------------------------------
# Streaming passes over the vocabulary. Each returns per-row results; logits are temperature-scaled
# and arrive vocabulary-major, [c, B].


def _online_lse(m, s, l_cB, cm=None):
  """Running (max, sum exp(l - max)) updated with one chunk; also the chunk's max."""
  cm = jnp.max(l_cB, 0) if cm is None else cm
  nm = jnp.maximum(m, cm)
  s = s * jnp.exp(m - nm) + jnp.sum(jnp.exp(l_cB - cm[None, :]), 0) * jnp.exp(cm - nm)
  return nm, s, cm


def _greedy_pass(head, h_BD, inv_temp, valid, argmax=True):
  """(argmax token or None, its logit = the max, logsumexp) per row.

  The argmax is found in two steps: the pass keeps only the best block of `ARGMAX_BLOCK`
  entries (a plain max reduction, much cheaper on CPU than a value-and-index reduction over
  every entry), then that block's logits are recomputed per row and searched.
  """
  def body(c, l_cB, off, _):
    m, s, blk = c
    if not argmax:
      return _online_lse(m, s, l_cB)[:2] + (blk,)
    blocks_KB = _block_maxima(l_cB)
    nm, s, cm = _online_lse(m, s, l_cB, jnp.max(blocks_KB, 0))
    return nm, s, _best_block(blk, m, cm, blocks_KB, off)
  b = h_BD.shape[0]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.zeros((b,), jnp.int32))
  m, s, blk = _vocab_scan(head, h_BD, inv_temp, body, init)
  if not argmax:
    return None, m, m + jnp.log(s)
  return _argmax_in_block(head, h_BD, inv_temp, valid, blk)[0], m, m + jnp.log(s)


def _block_maxima(l_cB: Array) -> Array:
  """[c / ARGMAX_BLOCK, B]: the max of each block of ARGMAX_BLOCK entries."""
  w, b = l_cB.shape
  r = ARGMAX_BLOCK
  return jnp.pad(l_cB, ((0, -w % r), (0, 0)), constant_values=-jnp.inf).reshape(-1, r, b).max(1)


def _best_block(blk_B, m_B, cm_B, blocks_KB, off):
  """The running best block, given the max so far m and this chunk's max cm."""
  cb = jnp.argmax(blocks_KB, 0).astype(jnp.int32)
  # Strict '>' keeps the earliest block on ties, as argmax over the whole row would.
  return jnp.where(cm_B > m_B, off // ARGMAX_BLOCK + cb, blk_B)


def _argmax_in_block(head, h_BD, inv_temp, valid, blk_B):
  """(first argmax, its logit) per row within its block blk of ARGMAX_BLOCK entries, whose
  logits are recomputed."""
  r = ARGMAX_BLOCK
  rows_BR = blk_B[:, None] * r + jnp.arange(r)
  w_BRD = head.source_VD[jnp.minimum(rows_BR, valid - 1)]
  l_BR = jnp.einsum("BRD,BD->BR", w_BRD.astype(h_BD.dtype), h_BD,
                    preferred_element_type=jnp.float32) * inv_temp
  l_BR = jnp.where(rows_BR < valid, l_BR, -jnp.inf)
  j = jnp.argmax(l_BR, -1)
  return blk_B * r + j.astype(jnp.int32), jnp.take_along_axis(l_BR, j[:, None], 1)[:, 0]


def _reservoir_pass(head, h_BD, inv_temp, u_NBS3, tau_B=None, top_block=False):
  """S independent draws per row ∝ exp(logits) over {logits >= tau} (all when tau is None).

  Within a chunk `_draw` picks a candidate; across chunks the running pick is replaced by the
  chunk's with probability (chunk mass) / (mass so far), so chunk c wins with probability
  mass_c / total: exact. Returns (tokens [B, S], their logits, max and sum exp(l - max) of the
  kept set, the block of ARGMAX_BLOCK entries holding the max if `top_block`, else 0).
  """
  def body(c, l_cB, off, u_BS3):
    m, s, tok, tok_logit, blk = c
    if tau_B is not None:
      l_cB = jnp.where(l_cB >= tau_B[None, :], l_cB, -jnp.inf)
    if top_block:  # the max through the blocks' maxima: the same number, and their argmax
      blocks_KB = _block_maxima(l_cB)
      cm = jnp.max(blocks_KB, 0)
      blk = _best_block(blk, m, cm, blocks_KB, off)
    else:
      cm = jnp.max(l_cB, 0)
    cm_safe = jnp.where(jnp.isfinite(cm), cm, 0.0)  # a chunk may be entirely cut
    e_cB = jnp.exp(l_cB - cm_safe[None, :])
    nm = jnp.maximum(m, cm)
    nm_safe = jnp.where(jnp.isfinite(nm), nm, 0.0)
    w = jnp.sum(e_cB, 0) * jnp.exp(cm_safe - nm_safe) * jnp.isfinite(cm)
    s = s * jnp.exp(m - nm_safe) + w
    take_BS = (w > 0)[:, None] & (u_BS3[..., 0] * s[:, None] < w[:, None])
    idx_BS = _draw(e_cB, u_BS3[..., 1:])
    picked_BS = jnp.take_along_axis(l_cB, idx_BS.T, 0).T
    return (nm, s, jnp.where(take_BS, off + idx_BS, tok), jnp.where(take_BS, picked_BS, tok_logit),
            blk)
  b, n_draws = h_BD.shape[0], u_NBS3.shape[2]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.zeros((b, n_draws), jnp.int32),
          jnp.zeros((b, n_draws)), jnp.zeros((b,), jnp.int32))
  m, s, tok, tok_logit, blk = _vocab_scan(head, h_BD, inv_temp, body, init, u_NBS3)
  return tok, tok_logit, m, s, blk


def _candidates_pass(head, h_BD, inv_temp, k):
  """(max, logsumexp, top-k logits [B, k] descending, their ids) per row."""
  def body(c, l_cB, off, _):
    m, s, vals, ids = c
    nm, s, _ = _online_lse(m, s, l_cB)
    cv, ci = jax.lax.top_k(l_cB.T, min(k, l_cB.shape[0]))
    vals, pos = jax.lax.top_k(jnp.concatenate([vals, cv], 1), k)
    ids = jnp.take_along_axis(jnp.concatenate([ids, off + ci.astype(jnp.int32)], 1), pos, 1)
    return nm, s, vals, ids
  b = h_BD.shape[0]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.full((b, k), -jnp.inf),
          jnp.zeros((b, k), jnp.int32))
  m, s, vals, ids = _vocab_scan(head, h_BD, inv_temp, body, init)
  return m, m + jnp.log(s), vals, ids


def _mass_above_pass(head, h_BD, inv_temp, v_BS, tau_B, ref_B, tok_BS=None):
  """[B, S]: sum of exp(l - ref) over logits l > v[:, s] with l >= tau (the mass ranked above),
  leaving out token tok[:, s] itself.

  v was recorded by another pass over the head; where this pass rounds a token's logit
  differently (a GPU may compile the two matmuls differently), the token's own logit could count
  as above its recorded value. Leaving its id out changes nothing in exact arithmetic.
  """
  def body(acc, l_cB, off, _):
    e_cB = jnp.where(l_cB >= tau_B[None, :], jnp.exp(l_cB - ref_B[None, :]), 0.0)
    above_cBS = l_cB[:, :, None] > v_BS[None, :, :]
    if tok_BS is not None:
      ids_c = off + jnp.arange(l_cB.shape[0], dtype=jnp.int32)
      above_cBS &= ids_c[:, None, None] != tok_BS[None, :, :]
    return acc + jnp.sum(jnp.where(above_cBS, e_cB[:, :, None], 0.0), 0)
  return _vocab_scan(head, h_BD, inv_temp, body, jnp.zeros(v_BS.shape))


# ------------------------------------------------------------------------------------------------
# One token per row.


def _cut_threshold(sp: SamplingParams, num: Numbers, m_B, lse_B, vals_BK, valid: int):
  """From the top-K candidates (K = top_k + 1): (threshold tau, top-k floor, covered) per row.

  covered: every token with logit >= tau is among the candidates and tau is exact, so the draw
  can be made among them (false only when the k-th value is tied beyond the candidates).
  """
  b, k = vals_BK.shape
  all_in = k >= valid  # the candidates are the whole vocabulary
  tau_k = vals_BK[:, sp.top_k - 1] if sp.top_k < valid else jnp.full((b,), -jnp.inf)
  covered = jnp.ones((b,), bool) if all_in else vals_BK[:, -1] < tau_k
  tau = tau_k
  if sp.top_p < 1.0:  # measured on the top-k set; min-p comes after
    p_BK = jnp.exp(vals_BK - m_B[:, None]) * (vals_BK >= tau_k[:, None])
    reach_BK = jnp.cumsum(p_BK, -1) >= num.top_p * jnp.sum(p_BK, -1, keepdims=True)
    tau = jnp.maximum(tau, jnp.take_along_axis(vals_BK, jnp.argmax(reach_BK, -1)[:, None], 1)[:, 0])
  if sp.min_p > 0.0:
    tau = jnp.maximum(tau, m_B + num.log_min_p)
  return tau, tau_k, covered


MAX_EXTRA_ROUNDS = 64  # top-p redraws per step before a row falls back to its top token


def _nucleus_draw(sp: SamplingParams, num: Numbers, head, h_BD, uniforms, num_draws, valid,
                  tau_B=None, nucleus_lse_B=None):
  """A draw ∝ exp(logit) over {logit >= tau} (None: every token) and the top-p nucleus.

  The nucleus is measured on a set holding the cut set, of log-mass `nucleus_lse` (None: the cut
  set itself): the top-k set, or the vocabulary, as min-p comes after top-p and must not shrink
  top-p's total. top-p by rejection: draw S candidates from the cut distribution and keep the
  first whose higher-ranked mass is < top_p of that total (every token ranked above a cut-set
  token is in the cut set, so that mass is the same counted in either set); conditioned on
  acceptance a draw follows the cut distribution restricted to the nucleus exactly. Both sets
  are top-ranked prefixes, so a candidate is accepted with probability 1 or (nucleus mass) /
  (cut-set mass) >= top_p: one round (two head passes) almost always settles every row; rows
  that do not are redrawn, up to MAX_EXTRA_ROUNDS times. A row still without an accepted
  candidate then takes its top token (found through its block of the first pass, as greedy
  does), which is always kept: exact unless that happens. Returns (token, logit, logsumexp of
  the cut set, extra rounds, whether each row fell back to its top token).
  """
  n = uniforms.num_chunks
  s = num_draws if sp.top_p < 1.0 else 1
  inv_temp = num.inv_temp

  def draw(round_, top_block=False):
    u_NBS3 = uniforms(round_, (n, s, 3)).transpose(1, 0, 2, 3)
    return _reservoir_pass(head, h_BD, inv_temp, u_NBS3, tau_B, top_block)

  # The first pass also finds the block holding the top token: the fallback below.
  tok_BS, logit_BS, m, z, top_blk = draw(1, top_block=sp.top_p < 1.0)
  lse = m + jnp.log(z)
  if sp.top_p == 1.0:
    return tok_BS[:, 0], logit_BS[:, 0], lse, jnp.int32(0), jnp.zeros(m.shape, bool)
  floor = jnp.full(m.shape, -jnp.inf) if tau_B is None else tau_B
  # The nucleus set's mass in the units of the mass above, exp(l - m).
  total = z if nucleus_lse_B is None else jnp.exp(nucleus_lse_B - m)

  def judge(tok_BS, logit_BS):
    above_BS = _mass_above_pass(head, h_BD, inv_temp, logit_BS, floor, m, tok_BS)
    ok_BS = above_BS < num.top_p * total[:, None]
    j = _first_true(ok_BS, ok_BS)[:, None]
    return (jnp.take_along_axis(tok_BS, j, 1)[:, 0], jnp.take_along_axis(logit_BS, j, 1)[:, 0],
            jnp.any(ok_BS, -1))

  tok, logit, ok = judge(tok_BS, logit_BS)

  def redraw(c):
    round_, tok, logit, ok = c
    t, l, o = judge(*draw(round_ + 2)[:2])
    new = ~ok & o  # rows settled earlier keep their token
    return round_ + 1, jnp.where(new, t, tok), jnp.where(new, l, logit), ok | o
  # A row fails a round with probability < (1 - top_p)^S: the cap binds only at a tiny top_p
  # over a flat distribution.
  rounds, tok, logit, ok = jax.lax.while_loop(
      lambda c: ~jnp.all(c[3]) & (c[0] < MAX_EXTRA_ROUNDS), redraw, (jnp.int32(0), tok, logit, ok))

  def top(_):  # the top token survives every cut
    t, l = _argmax_in_block(head, h_BD, inv_temp, valid, top_blk)
    return jnp.where(ok, tok, t), jnp.where(ok, logit, l)
  tok, logit = jax.lax.cond(jnp.all(ok), lambda _: (tok, logit), top, None)
  return tok, logit, lse, rounds, ~ok


class _Uniforms:
  """Per-row uniforms: round r of a step gets uniform(fold_in(row step key, r), shape)."""

  def __init__(self, keys_B, num_chunks):
    self.keys_B, self.num_chunks = keys_B, num_chunks

  def __call__(self, round_, shape):
    # Drawn flat, then shaped: the same numbers (threefry counts elements in row-major order),
    # and XLA:CPU compiles the flat draw faster. Drawn [64, 19, 1, 3], they are the small
    # benchmark decode program's two largest kernels, 0.49 s of LLVM time, against 0.19 s flat;
    # that program compiles in 1.35 s drawing flat, 1.52 s shaped.
    flat = lambda k: jax.random.uniform(jax.random.fold_in(k, round_), (math.prod(shape),))
    return jax.vmap(lambda k: flat(k).reshape(shape))(self.keys_B)


def next_token(sp: SamplingParams, head: _Head, h_BD, keys_B, valid: int, num_draws: int,
               nums: Numbers | None = None):
  """One token per row from hidden states h_BD and per-row step keys.

  sp decides the program; its numbers are `nums` where given (`traced`), else sp's own.

  Returns (token, log-prob before the cuts, extra rounds: top-p redraws, or 1 where a tie at
  the k-th value sent top-k down the streaming path, and per row whether its top-p redraws ran
  out and it took its top token instead: False unless top_p is tiny and the distribution flat).
  """
  num = numbers_of(sp) if nums is None else nums
  inv_temp = num.inv_temp
  none_B = jnp.zeros(h_BD.shape[:1], bool)
  if sp.greedy:
    tok, logit, lse = _greedy_pass(head, h_BD, inv_temp, valid)
    return tok, logit - lse, jnp.int32(0), none_B
  uniforms = _Uniforms(keys_B, _num_chunks(valid, _head_chunk(head)))
  if not sp.cuts:
    tok, logit, lse, _, _ = _nucleus_draw(sp, num, head, h_BD, uniforms, 1, valid)
    return tok, logit - lse, jnp.int32(0), none_B
  min_p_cut = (lambda m: m + num.log_min_p) if sp.min_p > 0.0 else (lambda m: -jnp.inf)

  if not 0 < sp.top_k < valid:  # top-p and/or min-p only
    lse, tau = None, None
    if sp.min_p > 0.0:  # lse: also the mass top-p is measured on, the whole vocabulary's
      _, m, lse = _greedy_pass(head, h_BD, inv_temp, valid, argmax=False)
      tau = min_p_cut(m)
    tok, logit, kept_lse, rounds, fell_back = _nucleus_draw(sp, num, head, h_BD, uniforms,
                                                            num_draws, valid, tau, lse)
    return tok, logit - (kept_lse if lse is None else lse), rounds, fell_back

  # top-k: the k + 1 best candidates decide everything unless the k-th value is tied beyond them.
  m, lse, vals, ids = _candidates_pass(head, h_BD, inv_temp, sp.top_k + 1)
  tau, tau_k, covered = _cut_threshold(sp, num, m, lse, vals, valid)
  pick = _inverse_cdf(jnp.exp(vals - m[:, None]) * (vals >= tau[:, None]), uniforms(0, (1,)))
  tok = jnp.take_along_axis(ids, pick, 1)[:, 0]
  logit = jnp.take_along_axis(vals, pick, 1)[:, 0]

  def exact(_):
    floor = jnp.maximum(tau_k, min_p_cut(m))
    top_k_lse = None  # None: the draw's cut set is the top-k set
    if sp.min_p > 0.0 and sp.top_p < 1.0:  # top-p is measured on the top-k set, before min-p
      every_B1 = jnp.full((m.shape[0], 1), -jnp.inf)
      top_k_lse = m + jnp.log(_mass_above_pass(head, h_BD, inv_temp, every_B1, tau_k, m)[:, 0])
    t, l, _, rounds, fell_back = _nucleus_draw(sp, num, head, h_BD, uniforms, num_draws,
                                               valid, floor, top_k_lse)
    return t, l, rounds + 1, fell_back
  f_tok, f_logit, extra, fell_back = jax.lax.cond(
      jnp.all(covered), lambda _: (tok, logit, jnp.int32(0), none_B), exact, None)
  # Per-row choice: a covered row's draw never depends on whether another row was tied.
  return (jnp.where(covered, tok, f_tok), jnp.where(covered, logit, f_logit) - lse, extra,
          ~covered & fell_back)
