"""Rewards computed by a frozen local Flax Qwen: `verifier`, `diversity`, and the `local` backend
of `quality`. This module imports JAX (and the sampler), so the registry imports it only when
one of them is configured.

`FrozenModel` runs a checkpoint forward-only in batches. Texts are tokenised on the host, cut
to `max_tokens`, left-padded to a power-of-two length bucket and grouped into batches of
exactly `batch_size` rows (short batches are filled with one-token dummy rows), so each bucket
compiles once. Only the last position is read: left padding puts every row's last real token
there.

    fm = FrozenModel("judge_dir", tokenizer="judge_dir", dtype="bfloat16", batch_size=8, max_tokens=2048)
    ids = [fm.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    h_ND = fm.last_hidden(ids)                       # final-norm hidden state at the last token
    lp_NK = fm.next_token_logprobs(ids, [9454, 2753])  # log-softmax over the full vocabulary

`verifier` (GenRM): a judge model's probability that the response is correct. Range: [0, 1].
The judge sees the question and the response, is asked "Is the answer correct (Yes/No)?"
(the `template`, wrapped in its chat template with the assistant turn opened), and the reward
is read from its next-token distribution in one batched forward, no generation:
  raw:          P(Yes)                         = softmax(logits)[yes]
  renormalize:  P(Yes) / (P(Yes) + P(No))      = sigmoid(logit_yes - logit_no)
The softmax is over the model's full vocabulary, as transformers computes it.

`diversity`: how far each completion's embedding lies from its group's. Range: [0, 2]
(1 - cosine); None when undefined (a group of one with leave_one_out, or a group mean of
norm ~0). The embedding is gte-Qwen2's: the final-norm hidden state of a Qwen2 network at the
last token (the appended <|endoftext|> when append_eos), L2-normalised.
  reward_i = 1 - cos(e_i, mean_j e_j)                 over the group of e_i
  leave_one_out: 1 - cos(e_i, mean_{j != i} e_j)
gte-Qwen2 was trained with bidirectional attention (every token sees the whole text), so by
default (`attention='auto'`, see `embedder_is_causal`) a gte-Qwen checkpoint runs that way, as
transformers runs a checkpoint whose config.json says "is_causal": false.

`LocalChatBackend` generates quality's grades with grpo_jax.sampler. Same contract as
chat_http.ChatClient.complete: conversations in, one reply (or None) each and counters out.
Prompts are chat-templated, cut in the middle to `max_prompt_tokens`, and run in batches of
exactly `batch_size` (the last batch is filled with copies, then dropped) so the sampler
compiles once per prompt bucket. Time is bounded by `max_new_tokens` per batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import compile_cache, data, sampler as sampler_lib, tokenizer as tokenizer_lib
from grpo_jax.models import qwen, weights
from grpo_jax.rewards import text
from grpo_jax.rewards.options import DiversityOptions, LocalOptions, VerifierOptions, json_object

_MIN_BUCKET = 16


def _load(checkpoint: str, tokenizer: str, dtype: str, field: str, is_causal: bool | None = None):
  """A checkpoint's params, config, Flax module (compute and params in `dtype`) and tokenizer."""
  if not checkpoint:
    raise ValueError(f"{field} is empty: set it to a local checkpoint folder")
  jdtype = jnp.dtype(dtype)  # a name from options.DTYPES, checked there
  params, cfg = weights.load_checkpoint(checkpoint, param_dtype=jdtype)
  if is_causal is not None:
    cfg = dataclasses.replace(cfg, is_causal=is_causal)
  model = qwen.build(cfg, dtype=jdtype, param_dtype=jdtype)
  return params, cfg, model, tokenizer_lib.load_tokenizer(tokenizer or checkpoint)


def length_buckets(max_tokens: int) -> tuple[int, ...]:
  out, b = [], _MIN_BUCKET
  while b < max_tokens:
    out.append(b)
    b *= 2
  return tuple(out) + (max_tokens,)


def _cut_ids(tokenizer, prompt: str, max_tokens: int) -> list[int]:
  """`prompt`'s tokens, cut in the middle to max_tokens: the head (instructions, question) and
  the tail (final answer, judge question) of a long prompt are kept."""
  # Cap characters first so tokenising megabytes of model output stays cheap.
  prompt = text.middle_truncate(prompt, 16 * max_tokens)
  ids = list(tokenizer(prompt, add_special_tokens=False).input_ids)
  if len(ids) <= max_tokens:
    return ids
  head = max_tokens // 2
  return ids[:head] + ids[len(ids) - (max_tokens - head):]


class FrozenModel:
  def __init__(self, checkpoint: str, *, tokenizer: str = "", dtype: str = "float32",
               batch_size: int = 8, max_tokens: int = 2048, field: str = "checkpoint",
               is_causal: bool | None = None):
    """is_causal: the attention to run (None: what the checkpoint's config.json says)."""
    self.params, self.cfg, self.model, self.tokenizer = _load(checkpoint, tokenizer, dtype, field, is_causal)
    self.batch_size, self.max_tokens = batch_size, max_tokens
    self.buckets = length_buckets(max_tokens)
    opts = compile_cache.compiler_options()
    self._last_hidden = jax.jit(self._last_hidden_impl, compiler_options=opts)
    self._logprobs = jax.jit(self._logprobs_impl, compiler_options=opts)

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


# --- verifier ------------------------------------------------------------------------------------

# Below this P(yes_token) + P(no_token) at the judge's answer position (mean over a batch), the
# start-up probe warns: the judge does not answer with those tokens (rewards.verifier docs).
MIN_YES_NO_MASS = 0.5


class VerifierReward:
  def __init__(self, opts: VerifierOptions):
    self.opts = opts
    self.model = FrozenModel.from_options(opts, "rewards.verifier.checkpoint")
    self.yes_id = self.model.single_token_id(opts.yes_token, "rewards.verifier.yes_token")
    self.no_id = self.model.single_token_id(opts.no_token, "rewards.verifier.no_token")
    self._template_kwargs = json_object(opts.chat_template_kwargs_json, "chat_template_kwargs_json")
    self.last_metrics: dict[str, float] = {}
    self.last_warning = ""  # why the latest scores may be noise (read by scoring.probe)
    self.source = f"judge checkpoint {opts.checkpoint}"  # named in messages (scoring.py)

  def prompt_ids(self, question: str, response: str) -> list[int]:
    """The judge's input tokens for one pair, cut in the middle to max_tokens. Control tokens
    written in the question or response stay text (text.defuse_control_tokens)."""
    tok = self.model.tokenizer
    question, response = (text.defuse_control_tokens(s, tok.all_special_tokens)
                          for s in (question, response))
    content = self.opts.template.format(question=question, response=response)
    if self.opts.use_chat_template:
      prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True, **self._template_kwargs)
    else:
      prompt = content
    return _cut_ids(tok, prompt, self.opts.max_tokens)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float | None]:
    completions = text.clean_all(completions, field="completions")
    questions = text.questions("verifier", self.opts.question_column, prompts, columns, len(completions))
    ids = [self.prompt_ids(q, c) for q, c in zip(questions, completions)]
    logp_N2 = self.model.next_token_logprobs(ids, [self.yes_id, self.no_id]).astype(np.float64)
    if self.opts.renormalize:
      p = 1.0 / (1.0 + np.exp(logp_N2[:, 1] - logp_N2[:, 0]))
    else:
      p = np.exp(logp_N2[:, 0])
    mass = float(np.exp(logp_N2).sum(1).mean()) if len(ids) else 0.0
    self.last_metrics = {"p_yes_no_mass": mass}
    self.last_warning = "" if mass >= MIN_YES_NO_MASS or not len(ids) else (
        f"the judge puts {mass:.2g} of its next-token probability on yes_token "
        f"{self.opts.yes_token!r} / no_token {self.opts.no_token!r}: it answers with other tokens "
        "there, so P(Yes) is noise. Without the chat template the answer follows a space "
        "(yes_token=' Yes', no_token=' No'); a Qwen3 judge thinks first unless "
        """chat_template_kwargs_json='{"enable_thinking": false}'""")
    return [float(v) for v in p]


# --- diversity -----------------------------------------------------------------------------------

_EPS = 1e-6
_GTE_QWEN = "gte-qwen"  # gte-Qwen1.5 and gte-Qwen2: both bidirectional


def embedder_is_causal(attention: str, checkpoint: str) -> bool:
  """The attention an embedder runs: 'causal' / 'bidirectional' as given; 'auto' follows the
  checkpoint's config.json "is_causal" where it has one. Otherwise gte-Qwen is bidirectional:
  its config.json need not say so (its own remote modeling code chose the attention), so it is
  recognised by name, in the checkpoint argument or its resolved path (a hub id, a hub cache
  folder), config.json's _name_or_path, or its auto_map (fine-tunes keep the last two).
  Anything else is causal. A renamed local copy of gte-Qwen2 needs attention='bidirectional'.
  """
  if attention != "auto":
    return attention == "causal"
  path = weights.resolve(checkpoint)
  hf = weights.read_hf_config(path)
  if "is_causal" in hf:
    return weights.read_config(path).is_causal  # validated there
  names = [str(checkpoint), str(Path(path).resolve()), str(hf.get("_name_or_path", ""))]
  names += [str(v) for v in (hf.get("auto_map") or {}).values()]
  return not any(_GTE_QWEN in n.lower() for n in names)


def group_diversity(e_ND: np.ndarray, group_size: int, leave_one_out: bool) -> list[float | None]:
  """1 - cos(e_i, group mean) for L2-normalised rows e_ND, groups of contiguous rows."""
  n, d = e_ND.shape
  if n % group_size:
    raise ValueError(f"group_size={group_size} does not divide the {n} completions")
  e_GKD = e_ND.astype(np.float64).reshape(n // group_size, group_size, d)
  total_GD = e_GKD.sum(axis=1)
  if leave_one_out:
    if group_size == 1:
      return [None] * n
    ref_GKD = (total_GD[:, None, :] - e_GKD) / (group_size - 1)
  else:
    ref_GKD = np.broadcast_to(total_GD[:, None, :] / group_size, e_GKD.shape)
  ref_norm_GK = np.linalg.norm(ref_GKD, axis=-1)
  cos_GK = np.einsum("gkd,gkd->gk", e_GKD, ref_GKD) / np.maximum(ref_norm_GK, _EPS)
  out = 1.0 - cos_GK
  return [None if r < _EPS else float(np.clip(v, 0.0, 2.0))
          for v, r in zip(out.reshape(-1), ref_norm_GK.reshape(-1))]


class DiversityReward:
  def __init__(self, opts: DiversityOptions):
    self.opts = opts
    # An empty checkpoint is reported by FrozenModel, naming the field.
    is_causal = embedder_is_causal(opts.attention, opts.checkpoint) if opts.checkpoint else None
    self.model = FrozenModel.from_options(opts, "rewards.diversity.checkpoint", is_causal=is_causal)
    self.source = f"embedding checkpoint {opts.checkpoint}"  # named in messages (scoring.py)
    tok = self.model.tokenizer
    self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
    if opts.append_eos and self.eos_id is None:
      raise ValueError("rewards.diversity.append_eos=True but the tokenizer has no eos/pad token")

  def token_ids(self, completion: str) -> list[int]:
    tok = self.model.tokenizer
    # Cap characters first so tokenising megabytes of model output stays cheap; the head of a
    # completion is what gets embedded when it is too long.
    body = self.opts.instruction + completion[: 16 * self.opts.max_tokens]
    ids = tok(body, add_special_tokens=False).input_ids[: self.opts.max_tokens - int(self.opts.append_eos)]
    if self.opts.append_eos:
      ids.append(self.eos_id)
    return ids or [self.eos_id if self.eos_id is not None else 0]

  def embed(self, completions: Sequence[str]) -> np.ndarray:
    """[N, D] L2-normalised embeddings."""
    completions = text.clean_all(completions, field="completions")
    h_ND = self.model.last_hidden([self.token_ids(c) for c in completions]).astype(np.float64)
    return (h_ND / np.maximum(np.linalg.norm(h_ND, axis=-1, keepdims=True), 1e-12)).astype(np.float32)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], *, group_size: int = 0,
               **columns) -> list[float | None]:
    del prompts, columns
    if not isinstance(group_size, int) or group_size <= 0:
      raise ValueError(f"diversity needs group_size (a positive int), got {group_size!r}")
    e_ND = self.embed(completions)
    return group_diversity(e_ND, group_size, self.opts.leave_one_out)


# --- quality's local backend ---------------------------------------------------------------------

def prompt_hash(ids: Sequence[int]) -> int:
  """A stable 31-bit id of a token sequence (the same in every process, unlike hash())."""
  digest = hashlib.blake2b(np.asarray(ids, np.int64).tobytes(), digest_size=4).digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF


class LocalChatBackend:
  def __init__(self, opts: LocalOptions):
    self.opts = opts
    self.params, cfg, model, self.tokenizer = _load(opts.checkpoint, opts.tokenizer, opts.dtype,
                                                    "rewards.quality.local.checkpoint")
    tok_path = opts.tokenizer or opts.checkpoint
    pad = self.tokenizer.pad_token_id
    self.sampler = sampler_lib.Sampler(
        model, max_new_tokens=opts.max_new_tokens,
        stop_ids=tokenizer_lib.stop_ids(self.tokenizer, tok_path),
        buckets=length_buckets(opts.max_prompt_tokens),
        temperature=opts.temperature, valid_vocab_size=min(len(self.tokenizer), cfg.vocab_size),
        pad_id=0 if pad is None else pad)
    self._template_kwargs = json_object(opts.chat_template_kwargs_json, "chat_template_kwargs_json")
    self._key = jax.random.key(opts.seed)

  def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
    prompt = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                **self._template_kwargs)
    return _cut_ids(self.tokenizer, prompt, self.opts.max_prompt_tokens)

  def complete(self, batch: Sequence[Sequence[dict]]) -> tuple[list[str | None], dict[str, float]]:
    ids = [self.prompt_ids(m) for m in batch]
    replies: list[str | None] = []
    truncated = 0
    bs = self.opts.batch_size
    for start in range(0, len(ids), bs):
      chunk = ids[start:start + bs]
      n = len(chunk)
      chunk = chunk + [chunk[-1]] * (bs - n)
      # Each reply's randomness is a function of (seed, its prompt) alone: the same in a resumed
      # process, whatever was scored before, and wherever the prompt falls in the batch.
      out = self.sampler.generate({"params": self.params}, chunk, num_samples=1, key=self._key,
                                  prompt_ids=[prompt_hash(c) for c in chunk])
      tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
      truncated += int(np.asarray(out.truncated)[:n].sum())
      replies += self.tokenizer.batch_decode([t[:k] for t, k in zip(tokens[:n], lengths[:n])],
                                             skip_special_tokens=True)
    return replies, {"local_truncated": float(truncated)}
