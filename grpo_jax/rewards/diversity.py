"""`diversity`: how far each completion's embedding lies from its group's.

Range: [0, 2] (1 - cosine); None when undefined (a group of one with leave_one_out, or a
group mean of norm ~0). The embedding is gte-Qwen2's: the final-norm hidden state of a Qwen2
network at the last token (the appended <|endoftext|> when append_eos), L2-normalised.
  reward_i = 1 - cos(e_i, mean_j e_j)                 over the group of e_i
  leave_one_out: 1 - cos(e_i, mean_{j != i} e_j)

gte-Qwen2 was trained with bidirectional attention (every token sees the whole text), so by
default (`attention='auto'`, see `embedder_is_causal`) a gte-Qwen checkpoint runs that way, as
transformers runs a checkpoint whose config.json says "is_causal": false.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from grpo_jax.models import weights
from grpo_jax.rewards import frozen_model, text
from grpo_jax.rewards.model_options import DiversityOptions

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
    self.model = frozen_model.FrozenModel.from_options(opts, "rewards.diversity.checkpoint",
                                                       is_causal=is_causal)
    self.source = f"embedding checkpoint {opts.checkpoint}"  # named in messages (health.py)
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
