"""A short supervised warm start (a "cold start" before RL): next-token cross-entropy on
reference completions, the prompt tokens masked out.

    tokens_BS, mask_BS, loss_mask_BS = sft_batch(prompt_ids, completion_ids, length, pad_id)
    step = make_sft_step(model, cfg, optax.adam(1e-3))
    params, opt_state, loss = step(params, opt_state, tokens_BS, mask_BS, loss_mask_BS)
"""

from __future__ import annotations

import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import grpo
from grpo_jax.models import qwen

_CALCULATOR = re.compile(r"<<[^<>]{0,200}>>")


def reference_completion(answer_text: str) -> str:
  """A GSM8K answer as a completion: the calculator annotations (<<6*4=24>>) removed."""
  return _CALCULATOR.sub("", answer_text)


def sft_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              length: int, pad_id: int):
  """Left-padded prompt+completion rows and the mask of the tokens that are trained on.

  loss_mask_BS[b, s] = 1 where token s is a completion token (predicted from position s - 1).
  """
  b = len(prompt_ids)
  tokens = np.full((b, length), pad_id, np.int32)
  mask = np.zeros((b, length), np.int32)
  loss_mask = np.zeros((b, length), np.int32)
  for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
    seq = list(p) + list(c)
    if len(seq) > length:
      raise ValueError(f"SFT row {i}: prompt+completion has {len(seq)} tokens, more than the "
                       f"sequence length {length}")
    tokens[i, length - len(seq):] = seq
    mask[i, length - len(seq):] = 1
    loss_mask[i, length - len(c):] = 1
  return tokens, mask, loss_mask


def make_sft_step(model: qwen.Qwen, cfg: qwen.QwenConfig, optimizer, chunk_size: int = 0):
  """A jitted (params, opt_state, tokens, mask, loss_mask) -> (params, opt_state, loss)."""

  def loss_fn(params, tokens_BS, mask_BS, loss_mask_BS):
    hidden, _ = model.apply({"params": params}, tokens_BS, qwen.positions_from_mask(mask_BS),
                            mask_BS)
    logp, _ = grpo.token_logprobs(hidden[:, :-1], qwen.head_kernel(params, cfg).astype(
        hidden.dtype), tokens_BS[:, 1:], chunk_size=chunk_size or None)
    w = loss_mask_BS[:, 1:].astype(jnp.float32)
    return -(logp * w).sum() / jnp.maximum(w.sum(), 1.0)

  @jax.jit
  def step(params, opt_state, tokens_BS, mask_BS, loss_mask_BS):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BS, mask_BS, loss_mask_BS)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, opt_state, loss

  return step
