"""Jitted batched sampling from a functional Qwen model: prefill once, tile ×G, decode in a loop.

    sampler = Sampler(qwen.Qwen(cfg), max_new_tokens=256, stop_ids=[151645, 151643],
                      buckets=(128, 256), valid_vocab_size=151665, pad_id=151643, mesh=mesh)
    out = sampler.generate(params, [[151644, 8948, ...], [151644, ...]], num_samples=8,
                           key=jax.random.key(step), temperature=1.0, top_p=0.95)
    out.tokens     # [B*G, C] int32, completion ids; pad_id after the stop token
    out.lengths    # [B*G]   int32, tokens produced, the stop token included
    out.truncated  # [B*G]   bool, True where max_new_tokens was reached without a stop id
    out.logprobs   # [B*G, C] fp32, log-prob of each sampled token (see below); 0 past `lengths`
    out.prompt_tokens, out.prompt_mask  # [B, P] the left-padded prompts used (P = a bucket)
    out.metrics    # {'sampler/tokens_per_s', 'sampler/seconds', ...} host floats

Row b*G + g is sample g of prompt b (rows of one prompt are contiguous). `prompts` may also be a
left-padded [B, P] array passed with its mask: `generate(params, tokens_BP, mask_BP, ...)`.
`sampler(...)` is `sampler.generate(...)`. Any `qwen.Qwen` (policy, judge, reward model) works.

What happens in one call (C = max_new_tokens, P = the smallest bucket holding every prompt):
  1. host: left-pad the prompts to P (numpy, so no new shape reaches the device);
  2. `prefill` (jitted per (B, P, G)): one forward of the B prompts into a [L, B, K, P, H] cache,
     which is then padded to P + C slots and tiled G times (never a G-fold prefill);
  3. `decode` (jitted per (B, P, G, settings); the cache is donated, so the loop updates the
     prefill's buffer in place): a `lax.while_loop` samples one token per row from the last
     hidden state, feeds it through the model, and exits as soon as every row has produced a
     stop id or C tokens.
The batch (B, and B*G after tiling) is split over the mesh's data × fsdp axes; B is padded to a
multiple of that size with copies of the last prompt, whose rows are dropped from the output.

Sampling settings (defaults given to the Sampler, overridable per call; each distinct setting
compiles once): `greedy` (or temperature=0), `temperature`, `top_k`, `top_p`, `min_p`. The cuts
apply in that order to logits / temperature: keep the tokens whose logit is >= the k-th largest
(ties kept); then, renormalised over those, keep token i iff the mass of tokens strictly more
probable than i is < top_p; then keep p_i >= min_p * p_max. Embedding rows at or above
`valid_vocab_size` are never sampled.

`logprobs` are log_softmax(logits / temperature) over the valid vocabulary at the sampled token,
BEFORE the top-k/top-p/min-p cut: the policy's own distribution, which the GRPO ratio needs
(grpo.token_logprobs gives the same numbers from head[:, :valid_vocab_size] at the same
temperature). Greedy decoding reports them at `temperature` too (1 for temperature=0).

Randomness: each row has its own key, fold_in(fold_in(key, prompt_id), g) with prompt_id
defaulting to the prompt's index in the batch (pass `prompt_ids` for stable ids), and every
step folds in the step number, so a row's tokens do not depend on the other rows of its batch.

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
    exactly unless the k-th value is tied beyond them. top-p is exact by rejection: draw
    `top_p_draws` candidates from the (top-k / min-p cut) distribution and keep the first whose
    higher-ranked mass is < top_p; a row with none accepted (probability < (1 - top_p)^draws)
    is redrawn (metrics['sampler/cut_extra_rounds']). A top-p step costs about two head passes,
    with no sort of the vocabulary.
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
  for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
      raise ValueError(f"{name}={v!r} must be a finite number")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
    raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0 disables it)")
  if temperature == 0:
    greedy, temperature = True, 1.0
  if greedy:  # the cuts cannot change an argmax; normalised away so greedy compiles once
    top_k, top_p, min_p = 0, 1.0, 0.0
  return SamplingParams(bool(greedy), float(temperature), int(top_k), float(top_p),
                        float(min_p))


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


def _prepare_head(head_VD: Array, valid: int, chunk: int) -> _Head:
  n = valid // chunk
  chunks = head_VD[:n * chunk].reshape(n, chunk, head_VD.shape[1]) if n else None
  rest = head_VD[n * chunk:valid] if valid > n * chunk else None
  return _Head(chunks, rest, head_VD)


def _num_chunks(valid: int, chunk: int) -> int:
  return -(-valid // chunk)


def head_chunk(head: _Head) -> int:
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


_ARGMAX_BLOCK = 32  # vocabulary entries per block in the greedy pass; divides every vocab_chunk


def _block_size(width: int) -> int:
  """A power of two near sqrt(width): both levels of `_draw` then cost about sqrt(width)²."""
  return 1 << max(0, int(math.log2(max(width, 1))) // 2)


def _inverse_cdf(w_BR: Array, u_BS: Array) -> Array:
  """S indices per row, draw s with P(i) = w[i] / sum(w) (w >= 0) from uniform u[:, s] in [0, 1).

  The cumulative sum is a triangular matmul (XLA's cumsum is a slow scan on CPU); an index with
  weight 0 is never returned even where rounding makes neighbouring partial sums disagree.
  """
  r = w_BR.shape[-1]
  cum_BR = jnp.einsum("BR,RQ->BQ", w_BR, jnp.triu(jnp.ones((r, r), w_BR.dtype)),
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

  The argmax is found in two steps: the pass keeps only the best block of `_ARGMAX_BLOCK`
  entries (a plain max reduction, much cheaper on CPU than a value-and-index reduction over
  every entry), then that block's logits are recomputed per row and searched.
  """
  r = _ARGMAX_BLOCK

  def body(c, l_cB, off, _):
    m, s, blk = c
    if not argmax:
      return _online_lse(m, s, l_cB)[:2] + (blk,)
    w, b = l_cB.shape
    blocks_KB = jnp.pad(l_cB, ((0, -w % r), (0, 0)), constant_values=-jnp.inf).reshape(
        -1, r, b).max(1)
    cb = jnp.argmax(blocks_KB, 0).astype(jnp.int32)
    nm, s, cm = _online_lse(m, s, l_cB, jnp.max(blocks_KB, 0))
    # Strict '>' keeps the earliest block on ties, as argmax over the whole row would.
    return nm, s, jnp.where(cm > m, off // r + cb, blk)
  b = h_BD.shape[0]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.zeros((b,), jnp.int32))
  m, s, blk = _vocab_scan(head, h_BD, inv_temp, body, init)
  if not argmax:
    return None, m, m + jnp.log(s)
  rows_BR = blk[:, None] * r + jnp.arange(r)
  w_BRD = head.source_VD[jnp.minimum(rows_BR, valid - 1)]
  l_BR = jnp.einsum("BRD,BD->BR", w_BRD.astype(h_BD.dtype), h_BD,
                    preferred_element_type=jnp.float32) * inv_temp
  l_BR = jnp.where(rows_BR < valid, l_BR, -jnp.inf)
  return blk * r + jnp.argmax(l_BR, -1).astype(jnp.int32), m, m + jnp.log(s)


def _reservoir_pass(head, h_BD, inv_temp, u_NBS3, tau_B=None):
  """S independent draws per row ∝ exp(logits) over {logits >= tau} (all when tau is None).

  Within a chunk `_draw` picks a candidate; across chunks the running pick is replaced by the
  chunk's with probability (chunk mass) / (mass so far), so chunk c wins with probability
  mass_c / total: exact. Returns (tokens [B, S], their logits, max and sum exp(l - max) of the
  kept set).
  """
  def body(c, l_cB, off, u_BS3):
    m, s, tok, tok_logit = c
    if tau_B is not None:
      l_cB = jnp.where(l_cB >= tau_B[None, :], l_cB, -jnp.inf)
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
    return (nm, s, jnp.where(take_BS, off + idx_BS, tok), jnp.where(take_BS, picked_BS, tok_logit))
  b, n_draws = h_BD.shape[0], u_NBS3.shape[2]
  init = (jnp.full((b,), -jnp.inf), jnp.zeros((b,)), jnp.zeros((b, n_draws), jnp.int32),
          jnp.zeros((b, n_draws)))
  m, s, tok, tok_logit = _vocab_scan(head, h_BD, inv_temp, body, init, u_NBS3)
  return tok, tok_logit, m, s


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


def _mass_above_pass(head, h_BD, inv_temp, v_BS, tau_B, ref_B):
  """[B, S]: sum of exp(l - ref) over logits l > v[:, s] with l >= tau (the mass ranked above)."""
  def body(acc, l_cB, off, _):
    e_cB = jnp.where(l_cB >= tau_B[None, :], jnp.exp(l_cB - ref_B[None, :]), 0.0)
    above_cBS = l_cB[:, :, None] > v_BS[None, :, :]
    return acc + jnp.sum(jnp.where(above_cBS, e_cB[:, :, None], 0.0), 0)
  return _vocab_scan(head, h_BD, inv_temp, body, jnp.zeros(v_BS.shape))


# ------------------------------------------------------------------------------------------------
# One token per row.


def _cut_threshold(sp: SamplingParams, m_B, lse_B, vals_BK, valid: int):
  """From the top-K candidates (K = top_k + 1): (threshold tau, top-k floor, covered) per row.

  covered: every token with logit >= tau is among the candidates and tau is exact, so the draw
  can be made among them (false only when the k-th value is tied beyond the candidates).
  """
  b, k = vals_BK.shape
  all_in = k >= valid  # the candidates are the whole vocabulary
  tau_k = vals_BK[:, sp.top_k - 1] if sp.top_k < valid else jnp.full((b,), -jnp.inf)
  covered = jnp.ones((b,), bool) if all_in else vals_BK[:, -1] < tau_k
  tau = tau_k
  if sp.top_p < 1.0:
    p_BK = jnp.exp(vals_BK - m_B[:, None]) * (vals_BK >= tau_k[:, None])
    reach_BK = jnp.cumsum(p_BK, -1) >= sp.top_p * jnp.sum(p_BK, -1, keepdims=True)
    tau = jnp.maximum(tau, jnp.take_along_axis(vals_BK, jnp.argmax(reach_BK, -1)[:, None], 1)[:, 0])
  if sp.min_p > 0.0:
    tau = jnp.maximum(tau, m_B + math.log(sp.min_p))
  return tau, tau_k, covered


def _nucleus_draw(sp: SamplingParams, head, h_BD, inv_temp, uniforms, num_draws, tau_B=None):
  """A draw from the distribution cut at tau (None: no cut) and then at top_p, exactly.

  top-p by rejection: draw S candidates from the cut distribution and keep the first whose
  higher-ranked mass is < top_p of the total; conditioned on acceptance a draw follows the
  nucleus distribution exactly. Each candidate is accepted with probability >= top_p, so one
  round (two head passes) almost always settles every row; rows that do not are redrawn.
  Returns (token, logit, logsumexp of the kept set, extra rounds).
  """
  n = uniforms.num_chunks
  s = num_draws if sp.top_p < 1.0 else 1

  def draw(round_):
    u_NBS3 = uniforms(round_, (n, s, 3)).transpose(1, 0, 2, 3)
    return _reservoir_pass(head, h_BD, inv_temp, u_NBS3, tau_B)

  tok_BS, logit_BS, m, z = draw(1)
  lse = m + jnp.log(z)
  if sp.top_p == 1.0:
    return tok_BS[:, 0], logit_BS[:, 0], lse, jnp.int32(0)
  floor = jnp.full(m.shape, -jnp.inf) if tau_B is None else tau_B

  def judge(tok_BS, logit_BS):
    ok_BS = _mass_above_pass(head, h_BD, inv_temp, logit_BS, floor, m) < sp.top_p * z[:, None]
    j = _first_true(ok_BS, ok_BS)[:, None]
    return (jnp.take_along_axis(tok_BS, j, 1)[:, 0], jnp.take_along_axis(logit_BS, j, 1)[:, 0],
            jnp.any(ok_BS, -1))

  tok, logit, ok = judge(tok_BS, logit_BS)

  def redraw(c):
    round_, tok, logit, ok = c
    t, l, o = judge(*draw(round_ + 2)[:2])
    new = ~ok & o  # rows settled earlier keep their token
    return round_ + 1, jnp.where(new, t, tok), jnp.where(new, l, logit), ok | o
  # The cap is never reached in practice: a row fails a round with probability < (1-top_p)^S.
  rounds, tok, logit, _ = jax.lax.while_loop(lambda c: ~jnp.all(c[3]) & (c[0] < 64), redraw,
                                             (jnp.int32(0), tok, logit, ok))
  return tok, logit, lse, rounds


class _Uniforms:
  """Per-row uniforms: round r of a step gets uniform(fold_in(row step key, r), shape)."""

  def __init__(self, keys_B, num_chunks):
    self.keys_B, self.num_chunks = keys_B, num_chunks

  def __call__(self, round_, shape):
    return jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, round_), shape))(self.keys_B)


def _next_token(sp: SamplingParams, head: _Head, h_BD, keys_B, valid: int, num_draws: int):
  """One token per row from hidden states h_BD and per-row step keys.

  Returns (token, log-prob before the cuts, extra rounds: top-p redraws, or 1 where a tie at
  the k-th value sent top-k down the streaming path).
  """
  inv_temp = 1.0 / sp.temperature
  if sp.greedy:
    tok, logit, lse = _greedy_pass(head, h_BD, inv_temp, valid)
    return tok, logit - lse, jnp.int32(0)
  uniforms = _Uniforms(keys_B, _num_chunks(valid, head_chunk(head)))
  if not sp.cuts:
    tok, logit, lse, _ = _nucleus_draw(sp, head, h_BD, inv_temp, uniforms, 1)
    return tok, logit - lse, jnp.int32(0)
  min_p_cut = (lambda m: m + math.log(sp.min_p)) if sp.min_p > 0.0 else (lambda m: -jnp.inf)

  if not 0 < sp.top_k < valid:  # top-p and/or min-p only
    lse, tau = None, None
    if sp.min_p > 0.0:
      _, m, lse = _greedy_pass(head, h_BD, inv_temp, valid, argmax=False)
      tau = min_p_cut(m)
    tok, logit, kept_lse, rounds = _nucleus_draw(sp, head, h_BD, inv_temp, uniforms, num_draws,
                                                 tau)
    return tok, logit - (kept_lse if lse is None else lse), rounds

  # top-k: the k + 1 best candidates decide everything unless the k-th value is tied beyond them.
  m, lse, vals, ids = _candidates_pass(head, h_BD, inv_temp, sp.top_k + 1)
  tau, tau_k, covered = _cut_threshold(sp, m, lse, vals, valid)
  pick = _inverse_cdf(jnp.exp(vals - m[:, None]) * (vals >= tau[:, None]), uniforms(0, (1,)))
  tok = jnp.take_along_axis(ids, pick, 1)[:, 0]
  logit = jnp.take_along_axis(vals, pick, 1)[:, 0]

  def exact(_):
    floor = jnp.maximum(tau_k, min_p_cut(m))
    t, l, _, rounds = _nucleus_draw(sp, head, h_BD, inv_temp, uniforms, num_draws, floor)
    return t, l, rounds + 1
  f_tok, f_logit, extra = jax.lax.cond(jnp.all(covered), lambda _: (tok, logit, jnp.int32(0)),
                                       exact, None)
  # Per-row choice: a covered row's draw never depends on whether another row was tied.
  return jnp.where(covered, tok, f_tok), jnp.where(covered, logit, f_logit) - lse, extra


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
    top_p_draws: candidates drawn per row and step for top-p's rejection step (module doc).
  """

  def __init__(self, model: qwen.Qwen | qwen.QwenConfig, *, max_new_tokens: int,
               stop_ids: Sequence[int] = (), buckets: Sequence[int] = DEFAULT_BUCKETS,
               greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, min_p: float = 0.0, valid_vocab_size: int | None = None,
               pad_id: int = 0, mesh=None, dtype=None, vocab_chunk: int = 8192,
               top_p_draws: int = 8):
    if isinstance(model, qwen.QwenConfig):
      model = qwen.Qwen(model, dtype=jnp.float32 if dtype is None else dtype)
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
    if vocab_chunk < 1 or vocab_chunk % _ARGMAX_BLOCK:
      raise ValueError(f"vocab_chunk={vocab_chunk} must be a positive multiple of {_ARGMAX_BLOCK}")
    if top_p_draws < 1:
      raise ValueError(f"top_p_draws={top_p_draws} must be >= 1")
    self.defaults = _settings(greedy, temperature, top_k, top_p, min_p)
    self.max_new_tokens, self.stop_ids, self.buckets = int(max_new_tokens), stop_ids, buckets
    self.valid, self.pad_id, self.mesh = valid, int(pad_id), mesh
    self.vocab_chunk = min(int(vocab_chunk), valid)
    self.top_p_draws = int(top_p_draws)
    self._prefill = jax.jit(self._prefill_impl, static_argnums=(3,))
    # The cache (argument 1) is donated: the decode loop updates the prefill's buffer in place.
    self._decode = jax.jit(self._decode_impl, static_argnums=(5,), donate_argnums=(1,))

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
    # qwen.head_kernel is [D, V]; for a tied model its .T is the embedding itself, no copy.
    head = _prepare_head(qwen.head_kernel(params, cfg).T, self.valid, self.vocab_chunk)
    stop = jnp.asarray(self.stop_ids or (-1,), jnp.int32)

    def next_token(h_RD, step):
      step_keys_R = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys_R)
      return _next_token(sp, head, h_RD, step_keys_R, self.valid, self.top_p_draws)

    # One sampling site in the program (half the compile time of sampling token 0 separately):
    # each step samples from the carried hidden state, then runs the forward for the next step.
    # The forward after a row's last step is wasted work, one model step per call.
    carry = dict(step=jnp.int32(0), cache=cache, hidden=state["hidden"],
                 tokens=jnp.full((r, c), self.pad_id, jnp.int32),
                 logp=jnp.zeros((r, c), jnp.float32), done=jnp.zeros((r,), bool),
                 stopped=jnp.zeros((r,), bool), lengths=jnp.zeros((r,), jnp.int32),
                 extra_rounds=jnp.int32(0))

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
                  lengths=s["lengths"] + live, extra_rounds=s["extra_rounds"] + fb)

    out = jax.lax.while_loop(cond, body, carry)
    results = {
        "tokens": self._constrain(out["tokens"], ("batch", None)),
        "lengths": out["lengths"], "truncated": ~out["stopped"],
        "logprobs": self._constrain(out["logp"], ("batch", None)),
        "steps": out["step"], "extra_rounds": out["extra_rounds"],
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
        "sampler/cut_extra_rounds": int(results["extra_rounds"]),
        "sampler/prompt_bucket": p,
    }
    return SampleOutput(results["tokens"], results["lengths"], results["truncated"],
                        results["logprobs"], jnp.asarray(tokens[:b]), jnp.asarray(mask_BP[:b]),
                        metrics)

  __call__ = generate
