"""Per-token log-probs through the LM head without [tokens, vocabulary] logits.

    logp_N, entropy_N = token_logprobs(hidden_ND, head_VD, targets_N, temperature=1.0)

  logits l = hidden @ head^T / temperature;  logp[n] = l[n, y_n] - logsumexp_v l[n, v];
  entropy[n] = -sum_v p log p = logsumexp - sum_v p l.

Legend: N tokens, D model width, V vocabulary rows (pass only the rows the sampler can draw),
t tokens per block, c vocabulary rows per block.

Why it is written by hand: at Qwen's 151,936-row vocabulary the logits of 64 completions × 64
tokens are 2.5 GB of fp32, far larger than any cache, so every pass over them (write, max,
exp-sum, gather, and their backward) is memory-bound. Here the head is walked in [t, c] blocks
of at most `block_bytes` (default 4 MiB, inside this CPU's L3): each block's logits are folded
into a running (max, sum exp, sum exp·l) per token and dropped. The target logit is a dot
product with the gathered head row. The backward (a custom VJP) recomputes each block from the
saved logsumexp: d l = g (onehot - softmax) / temperature, so
  d hidden += d l @ head_c,   d head_c^T += hidden^T @ d l   (accumulated as [D, c]),
one block at a time (the one-hot enters each block by a compare of ids, so there is no scatter
into the [V, D] gradient). The whole pass costs four matmuls with the head (one forward, three
backward) and the traffic of the blocks.
The entropy is a metric and carries no gradient, unless `entropy_grad=True` (an entropy bonus
in the loss): then its cotangent g_H joins the same backward, d l −= g_H p (log p + H), from the
entropy H saved by the forward (dH/dl_v = −p_v (log p_v + H)); no extra matmul.

Inputs may be bf16 (the compute dtype): the matmuls accumulate in fp32 and every softmax
statistic is fp32; the backward casts d l to the compute dtype for its two matmuls, as an
autodiff backward of a bf16 matmul would.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

DEFAULT_BLOCK_BYTES = 4 << 20  # fp32 logits per [t, c] block: on a CPU, inside its L3
# On a GPU or TPU each block is an iteration of a device loop and a few kernels of its own (a GPU
# launches each): at 4 MiB the log-probs of 32,768 tokens over Qwen's vocabulary launch 82,469
# kernels (forward and backward, compiled for an H100), at 64 MiB 5,634, for 0.12 GB more
# temporaries (docs/performance.md).
ACCELERATOR_BLOCK_BYTES = 64 << 20
_MAX_BLOCK_TOKENS = 1024  # a floor: blocks of fewer tokens only where there are fewer
_MIN_BLOCK_ROWS = 128


def check_temperature(temperature, setting: str = "temperature") -> None:
  """The temperature rule, for the sampler, the train step and the config alike: log-probs are
  those of logits / temperature, so a number > 0. ValueError naming `setting`."""
  if isinstance(temperature, bool) or not (isinstance(temperature, (int, float))
                                           and 0 < temperature < math.inf):
    raise ValueError(f"{setting}: must be a finite number > 0, got {temperature!r}")


def platform_block_bytes(block_bytes: int, platform: str) -> int:
  """optim.logprob_block_bytes as the program uses it: 0 means the platform's default
  (DEFAULT_BLOCK_BYTES on 'cpu', ACCELERATOR_BLOCK_BYTES elsewhere)."""
  if block_bytes:
    return block_bytes
  return DEFAULT_BLOCK_BYTES if platform == "cpu" else ACCELERATOR_BLOCK_BYTES


def block_shape(num_tokens: int, vocab: int, block_bytes: int = DEFAULT_BLOCK_BYTES):
  """(t, c): tokens and vocabulary rows per block, t·c·4 bytes <= block_bytes where possible.

  Square where the tokens allow (t at most the largest power of two <= sqrt(block_bytes / 4),
  and never under 1024): the backward writes one [D, c] partial of the head's gradient per token
  block and one [N, D] partial of the hidden states' per vocabulary block, D·N·V·(1/t + 1/c)
  elements, least for t = c at a given t·c.
  Examples: 4,096 tokens, 151,665 rows, 4 MiB → (1024, 1024); 32,640 tokens, 64 MiB →
  (4096, 4096).
  """
  side = 1 << (math.isqrt(max(1, block_bytes // 4)).bit_length() - 1)
  t = max(1, min(num_tokens, max(_MAX_BLOCK_TOKENS, side)))
  c = max(_MIN_BLOCK_ROWS, block_bytes // (4 * t)) // _MIN_BLOCK_ROWS * _MIN_BLOCK_ROWS
  return t, max(1, min(vocab, c))


def _split_rows(w_VD, c):
  """[V, D] → full blocks [n, c, D] and the rest [V - n·c, D] (possibly empty)."""
  n = w_VD.shape[0] // c
  return w_VD[:n * c].reshape(n, c, w_VD.shape[1]), w_VD[n * c:]


def _logits(h_tD, w_cD, inv_temp):
  return jnp.einsum("tD,cD->tc", h_tD, w_cD, preferred_element_type=jnp.float32) * inv_temp


def _forward(h_ND, w_VD, y_N, inv_temp, t, c):
  """(logp, entropy, logsumexp) per token, all [N] fp32."""
  n_tok = h_ND.shape[0]
  full_ncD, rest_rD = _split_rows(w_VD, c)

  def fold(carry, w_cD, h_tD):
    m_t, s_t, a_t = carry
    l_tc = _logits(h_tD, w_cD, inv_temp)
    new_m = jnp.maximum(m_t, l_tc.max(-1))
    e_tc = jnp.exp(l_tc - new_m[:, None])
    scale = jnp.exp(m_t - new_m)  # 0 on the first block, where m = -inf
    return new_m, s_t * scale + e_tc.sum(-1), a_t * scale + (e_tc * l_tc).sum(-1)

  def one_block(h_tD):
    init = (jnp.full(h_tD.shape[:1], -jnp.inf), jnp.zeros(h_tD.shape[:1]),
            jnp.zeros(h_tD.shape[:1]))
    carry, _ = jax.lax.scan(lambda cr, w: (fold(cr, w, h_tD), None), init, full_ncD)
    if rest_rD.shape[0]:
      carry = fold(carry, rest_rD, h_tD)
    m_t, s_t, a_t = carry
    lse_t = m_t + jnp.log(s_t)
    return lse_t, lse_t - a_t / s_t

  h_btD = _blocks(h_ND, t)
  lse_N, entropy_N = jax.tree.map(lambda x: x.reshape(-1)[:n_tok],
                                  jax.lax.map(one_block, h_btD))
  target_N = jnp.einsum("ND,ND->N", h_ND, w_VD[y_N],
                        preferred_element_type=jnp.float32) * inv_temp
  return target_N - lse_N, entropy_N, lse_N


def _blocks(x_N, t):
  """[N, ...] → [ceil(N / t), t, ...], zero-padded (zero rows give finite, unused results)."""
  pad = -x_N.shape[0] % t
  x_N = jnp.pad(x_N, [(0, pad)] + [(0, 0)] * (x_N.ndim - 1))
  return x_N.reshape(-1, t, *x_N.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(h_ND, w_VD, y_N, inv_temp, t, c, entropy_grad):
  logp_N, entropy_N, _ = _forward(h_ND, w_VD, y_N, inv_temp, t, c)
  return logp_N, entropy_N


def _fused_fwd(h_ND, w_VD, y_N, inv_temp, t, c, entropy_grad):
  logp_N, entropy_N, lse_N = _forward(h_ND, w_VD, y_N, inv_temp, t, c)
  return (logp_N, entropy_N), (h_ND, w_VD, y_N, lse_N, entropy_N)


def _fused_bwd(inv_temp, t, c, entropy_grad, residuals, cotangents):
  h_ND, w_VD, y_N, lse_N, entropy_N = residuals
  g_N = cotangents[0].astype(jnp.float32) * inv_temp
  n_tok, d = h_ND.shape
  cdt = h_ND.dtype
  h_btD, lse_bt, g_bt, y_bt = _blocks(h_ND, t), _blocks(lse_N, t), _blocks(g_N, t), _blocks(y_N, t)
  if entropy_grad:
    gh_bt = _blocks(cotangents[1].astype(jnp.float32) * inv_temp, t)
    ent_bt = _blocks(entropy_N, t)
  else:  # the entropy's cotangent is dropped: nothing more in the loop
    gh_bt = ent_bt = jnp.zeros(g_bt.shape[:1], jnp.float32)

  def rows_block(w_cD, offset):
    """d head for rows [offset, offset + c) and these rows' share of d hidden."""
    rows_c = offset + jnp.arange(w_cD.shape[0], dtype=jnp.int32)

    def tokens_block(dw_Dc, xs):
      h_tD, lse_t, g_t, y_t, gh_t, ent_t = xs
      # d l = g (onehot - p), the one-hot folded in by a compare: no gather or scatter.
      logp_tc = _logits(h_tD, w_cD, inv_temp) - lse_t[:, None]
      p_tc = jnp.exp(logp_tc)
      dl_tc = g_t[:, None] * ((y_t[:, None] == rows_c[None, :]) - p_tc)
      if entropy_grad:
        dl_tc = dl_tc - gh_t[:, None] * p_tc * (logp_tc + ent_t[:, None])
      dl_tc = dl_tc.astype(cdt)
      dh_tD = jnp.einsum("tc,cD->tD", dl_tc, w_cD, preferred_element_type=jnp.float32)
      # d head transposed, [D, c]: XLA:CPU runs "tD,tc->Dc" at 1.45x the speed of "tc,tD->cD"
      # (2.0 against 2.9 ms for a [1024, 1024] block, D = 256).
      return dw_Dc + jnp.einsum("tD,tc->Dc", h_tD, dl_tc, preferred_element_type=jnp.float32), dh_tD
    dw_Dc, dh_btD = jax.lax.scan(tokens_block, jnp.zeros(w_cD.shape[::-1], jnp.float32),
                                 (h_btD, lse_bt, g_bt, y_bt, gh_bt, ent_bt))
    return dw_Dc.T.astype(w_cD.dtype), dh_btD.reshape(-1, d)[:n_tok]

  full_ncD, rest_rD = _split_rows(w_VD, c)

  def over_rows(dh, xs):
    w_cD, i = xs
    dw_cD, dh_part = rows_block(w_cD, i * c)
    return dh + dh_part, dw_cD
  dh_ND, dw_ncD = jax.lax.scan(over_rows, jnp.zeros((n_tok, d), jnp.float32),
                               (full_ncD, jnp.arange(full_ncD.shape[0], dtype=jnp.int32)))
  dw_VD = dw_ncD.reshape(-1, d)
  if rest_rD.shape[0]:
    dw_rest, dh_rest = rows_block(rest_rD, full_ncD.shape[0] * c)
    dh_ND, dw_VD = dh_ND + dh_rest, jnp.concatenate([dw_VD, dw_rest])
  return dh_ND.astype(h_ND.dtype), dw_VD, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def token_logprobs(hidden_ND, head_VD, targets_N, *, temperature: float = 1.0,
                   block_bytes: int = DEFAULT_BLOCK_BYTES, entropy_grad: bool = False):
  """log softmax(hidden @ head^T / temperature)[target] and the entropy per token, fp32 [N].

  hidden_ND [N, D] and head_VD [V, D] share a dtype; leading axes of hidden and targets are
  flattened (e.g. [B, C, D] with [B, C] targets gives [B, C] results).
  Example: hidden [2, 5, 8], head [11, 8], targets int [2, 5] → (logp [2, 5], entropy [2, 5]).
  Targets must lie in [0, V); nothing here checks it (it runs traced): another reads row V - 1's
  log-prob, with a gradient that is not that value's. train_step.check_batch checks the loss
  tokens on the host. entropy_grad: whether the entropy carries its gradient (else it is a
  metric, and its cotangent is dropped).
  """
  lead = targets_N.shape
  h_ND = hidden_ND.reshape(-1, hidden_ND.shape[-1])
  y_N = targets_N.reshape(-1).astype(jnp.int32)
  t, c = block_shape(h_ND.shape[0], head_VD.shape[0], block_bytes)
  with jax.named_scope("token_logprobs"):  # names its kernels in compiled programs and profiles
    logp_N, entropy_N = _fused(h_ND, head_VD.astype(h_ND.dtype), y_N, 1.0 / float(temperature),
                               t, c, bool(entropy_grad))
  return logp_N.reshape(lead), entropy_N.reshape(lead)
