"""Options of the rewards computed by a local Flax Qwen (verifier, diversity).

Kept apart from the model code so that building the default config imports no model code.
"""
from __future__ import annotations

import dataclasses

from grpo_jax.rewards import options

DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "causal", "bidirectional")


def _check_common(o) -> None:
  options.check(isinstance(o.checkpoint, str), "checkpoint", "must be a str (a local checkpoint folder)")
  options.check(isinstance(o.batch_size, int) and o.batch_size > 0, "batch_size", "must be a positive int")
  options.check(isinstance(o.max_tokens, int) and o.max_tokens >= 16, "max_tokens", "must be an int >= 16")
  options.check(o.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {o.dtype!r}")


@dataclasses.dataclass(frozen=True)
class VerifierOptions:
  """GenRM judge: P(Yes) at the next token after the question, the response and `question`."""
  checkpoint: str = ""  # judge checkpoint folder (safetensors + config.json + tokenizer files)
  tokenizer: str = ""  # '' -> the checkpoint folder
  batch_size: int = 8
  max_tokens: int = 2048  # longer prompts lose the middle of the response
  dtype: str = "bfloat16"
  renormalize: bool = True  # P(Yes) / (P(Yes) + P(No)) instead of the raw P(Yes)
  yes_token: str = "Yes"
  no_token: str = "No"
  template: str = "Question: {question}\n\nResponse: {response}\n\nIs the answer correct (Yes/No)?"
  use_chat_template: bool = True
  # JSON passed to apply_chat_template, e.g. '{"enable_thinking": false}' for a Qwen3 judge.
  chat_template_kwargs_json: str = ""
  # The dataset column with the bare question (the trainer passes GSM8K's 'question');
  # '' -> the chat-formatted prompt text instead.
  question_column: str = "question"

  def __post_init__(self):
    _check_common(self)
    options.check(bool(self.yes_token) and bool(self.no_token), "yes_token/no_token", "must be non-empty")
    options.check("{response}" in self.template, "template", "must contain '{response}'")
    try:
      self.template.format(question="", response="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"template: only {{question}} and {{response}} may appear in braces ({e!r})") from e
    options.check_json_object(self.chat_template_kwargs_json, "chat_template_kwargs_json")


@dataclasses.dataclass(frozen=True)
class DiversityOptions:
  """Embedding model (gte-Qwen2 style): last-token pooling of the final hidden state."""
  checkpoint: str = ""
  tokenizer: str = ""  # '' -> the checkpoint folder
  batch_size: int = 16
  max_tokens: int = 1024  # completions are cut at the end beyond this
  dtype: str = "bfloat16"
  leave_one_out: bool = False  # compare e_i with the mean of the *other* members of its group
  # gte-Qwen2's tokenizer appends <|endoftext|> and pools that position; keep it on for gte.
  append_eos: bool = True
  instruction: str = ""  # a prefix for every text ('' for documents, as gte embeds them)
  # gte-Qwen2 was trained with bidirectional attention, but its config.json need not say so.
  # 'auto': the checkpoint's "is_causal" where config.json has one, else bidirectional when the
  # checkpoint's name, its _name_or_path or its auto_map mention gte-Qwen, else causal.
  attention: str = "auto"

  def __post_init__(self):
    _check_common(self)
    options.check(self.attention in ATTENTION, "attention",
                  f"must be one of {ATTENTION}, got {self.attention!r}")
