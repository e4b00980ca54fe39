"""The `local` backend of the quality reward: a Flax Qwen scorer generating with grpo_jax.sampler.

Same contract as chat_http.ChatClient.complete: conversations in, one reply (or None) each and
counters out. Prompts are chat-templated, cut in the middle to `max_prompt_tokens`, and run in
batches of exactly `batch_size` (the last batch is filled with copies, then dropped) so the
sampler compiles once per prompt bucket. Time is bounded by `max_new_tokens` per batch.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sampler as sampler_lib
from grpo_jax import tokenizer as tokenizer_lib
from grpo_jax.models import qwen, weights
from grpo_jax.rewards import frozen_model, text


class LocalChatBackend:
  def __init__(self, opts):  # opts: quality.LocalOptions
    if not opts.checkpoint:
      raise ValueError("rewards.quality.local.checkpoint is empty: set it to a local checkpoint folder")
    self.opts = opts
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[opts.dtype]
    self.params, cfg = weights.load_checkpoint(opts.checkpoint, param_dtype=dtype)
    tok_path = opts.tokenizer or opts.checkpoint
    self.tokenizer = tokenizer_lib.load_tokenizer(tok_path)
    pad = self.tokenizer.pad_token_id
    self.sampler = sampler_lib.Sampler(
        qwen.Qwen(cfg, dtype=dtype, param_dtype=dtype), max_new_tokens=opts.max_new_tokens,
        stop_ids=tokenizer_lib.stop_ids(self.tokenizer, tok_path),
        buckets=frozen_model.length_buckets(opts.max_prompt_tokens),
        temperature=opts.temperature, valid_vocab_size=min(len(self.tokenizer), cfg.vocab_size),
        pad_id=0 if pad is None else pad)
    self._template_kwargs = json.loads(opts.chat_template_kwargs_json) if opts.chat_template_kwargs_json else {}
    self._key = jax.random.key(opts.seed)
    self._calls = 0

  def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
    prompt = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                **self._template_kwargs)
    prompt = text.middle_truncate(prompt, 16 * self.opts.max_prompt_tokens)  # cheap tokenising
    ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
    return frozen_model.middle_cut(ids, self.opts.max_prompt_tokens)

  def complete(self, batch: Sequence[Sequence[dict]]) -> tuple[list[str | None], dict[str, float]]:
    ids = [self.prompt_ids(m) for m in batch]
    replies: list[str | None] = []
    truncated = 0
    bs = self.opts.batch_size
    for start in range(0, len(ids), bs):
      chunk = ids[start:start + bs]
      n = len(chunk)
      chunk = chunk + [chunk[-1]] * (bs - n)
      key = jax.random.fold_in(self._key, self._calls)
      self._calls += 1
      out = self.sampler.generate(self.params, chunk, num_samples=1, key=key)
      tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
      truncated += int(np.asarray(out.truncated)[:n].sum())
      replies += self.tokenizer.batch_decode([t[:k] for t, k in zip(tokens[:n], lengths[:n])],
                                             skip_special_tokens=True)
    return replies, {"local_truncated": float(truncated)}
