"""A frozen Qwen checkpoint run forward-only in batches, for judge and embedding rewards.

Texts are tokenised on the host, cut to `max_tokens`, left-padded to a power-of-two length
bucket and grouped into batches of exactly `batch_size` rows (short batches are filled with
one-token dummy rows), so each bucket compiles once. Only the last position is read: left
padding puts every row's last real token there.

    fm = FrozenModel("judge_dir", tokenizer="judge_dir", dtype="bfloat16", batch_size=8, max_tokens=2048)
    ids = [fm.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    h_ND = fm.last_hidden(ids)                       # final-norm hidden state at the last token
    lp_NK = fm.next_token_logprobs(ids, [9454, 2753])  # log-softmax over the full vocabulary
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import data, tokenizer as tokenizer_lib
from grpo_jax.models import qwen, weights

_MIN_BUCKET = 16


def length_buckets(max_tokens: int) -> tuple[int, ...]:
  out, b = [], _MIN_BUCKET
  while b < max_tokens:
    out.append(b)
    b *= 2
  return tuple(out) + (max_tokens,)


def middle_cut(ids: Sequence[int], max_tokens: int) -> list[int]:
  """Keeps the head (instructions, question) and tail (final answer, judge question) of a long prompt."""
  ids = list(ids)
  if len(ids) <= max_tokens:
    return ids
  head = max_tokens // 2
  return ids[:head] + ids[len(ids) - (max_tokens - head):]


class FrozenModel:
  def __init__(self, checkpoint: str, *, tokenizer: str = "", dtype: str = "float32",
               batch_size: int = 8, max_tokens: int = 2048, field: str = "checkpoint",
               is_causal: bool | None = None):
    """is_causal: the attention to run (None: what the checkpoint's config.json says)."""
    if not checkpoint:
      raise ValueError(f"{field} is empty: set it to a local checkpoint folder")
    jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    self.params, self.cfg = weights.load_checkpoint(checkpoint, param_dtype=jdtype)
    if is_causal is not None:
      self.cfg = dataclasses.replace(self.cfg, is_causal=is_causal)
    self.model = qwen.Qwen(self.cfg, dtype=jdtype, param_dtype=jdtype)
    self.tokenizer = tokenizer_lib.load_tokenizer(tokenizer or checkpoint)
    self.batch_size, self.max_tokens = batch_size, max_tokens
    self.buckets = length_buckets(max_tokens)
    self._last_hidden = jax.jit(self._last_hidden_impl)
    self._logprobs = jax.jit(self._logprobs_impl)

  @classmethod
  def from_options(cls, opts, field: str, is_causal: bool | None = None) -> "FrozenModel":
    """From a reward's options (checkpoint, tokenizer, dtype, batch_size, max_tokens)."""
    return cls(opts.checkpoint, tokenizer=opts.tokenizer, dtype=opts.dtype,
               batch_size=opts.batch_size, max_tokens=opts.max_tokens, field=field,
               is_causal=is_causal)

  def _last_hidden_impl(self, params, tokens_BT, mask_BT):
    positions_BT = qwen.positions_from_mask(mask_BT)
    hidden_BTD, _ = self.model.apply({"params": params}, tokens_BT, positions_BT, mask_BT)
    return hidden_BTD[:, -1:, :]

  def _logprobs_impl(self, params, tokens_BT, mask_BT, ids_K):
    h_B1D = self._last_hidden_impl(params, tokens_BT, mask_BT)
    # Only the last position's logits: [B, 1, V], never [B, T, V].
    logits_BV = self.model.apply({"params": params}, h_B1D, method=qwen.Qwen.logits)[:, 0, :]
    return jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)[:, ids_K]

  def _batches(self, token_lists: Sequence[Sequence[int]]):
    for start in range(0, len(token_lists), self.batch_size):
      chunk = [list(t) for t in token_lists[start:start + self.batch_size]]
      for i, t in enumerate(chunk):
        if not t:
          raise ValueError(f"text {start + i} has no tokens")
        if len(t) > self.max_tokens:
          raise ValueError(f"text {start + i} has {len(t)} tokens > max_tokens={self.max_tokens}; cut it first")
      n = len(chunk)
      chunk += [[0]] * (self.batch_size - n)  # fixed batch shape: one compile per bucket
      tokens_BT, mask_BT = data.pad_to_bucket(chunk, self.buckets, pad_id=0)
      yield n, jnp.asarray(tokens_BT), jnp.asarray(mask_BT.astype(np.int32))

  def last_hidden(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
    """[N, D] float32: the hidden state after the final norm at each text's last token."""
    out = [np.asarray(self._last_hidden(self.params, t, m)[:n, 0], np.float32)
           for n, t, m in self._batches(token_lists)]
    return np.concatenate(out) if out else np.zeros((0, self.cfg.hidden_size), np.float32)

  def next_token_logprobs(self, token_lists: Sequence[Sequence[int]], ids: Sequence[int]) -> np.ndarray:
    """[N, len(ids)] float32: log P(next token = ids[k]) over the full vocabulary."""
    ids_K = jnp.asarray(list(ids), jnp.int32)
    out = [np.asarray(self._logprobs(self.params, t, m, ids_K)[:n], np.float32)
           for n, t, m in self._batches(token_lists)]
    return np.concatenate(out) if out else np.zeros((0, len(ids)), np.float32)

  def single_token_id(self, token: str, field: str) -> int:
    ids = self.tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
      raise ValueError(f"{field}={token!r} is {len(ids)} tokens {ids} for this tokenizer; it must be exactly one")
    if ids[0] >= self.cfg.vocab_size:
      raise ValueError(f"{field}={token!r} has id {ids[0]} outside the model's vocabulary ({self.cfg.vocab_size})")
    return ids[0]
