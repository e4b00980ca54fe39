"""Reward options: a frozen dataclass per reward, filled from that reward's config block.

Unknown keys are an error naming the key, so a typo in `--config.rewards.format.corect=1`
fails at start-up rather than silently using the default. Every reward's options live here,
apart from the reward code, so that building the default config imports no model code.

  rewards.math_accuracy  MathAccuracyOptions    rewards.verifier   VerifierOptions
  rewards.format         FormatOptions          rewards.diversity  DiversityOptions
  rewards.quality        QualityOptions, with blocks .http (HttpOptions) and .local (LocalOptions)
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, TypeVar

import ml_collections

T = TypeVar("T")

DTYPES = ("float32", "bfloat16")  # = models.qwen.DTYPES; not imported: no jax here
ATTENTION = ("auto", "causal", "bidirectional")
# The forms in which math_accuracy looks for a response's final answer, in its default order
# (see math_accuracy.py: 'last_number' reads the whole text, the others are span finders).
ANSWER_FORMS = ("answer_tag", "boxed", "hashes", "answer_is", "last_number")


def to_config(options: Any) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dataclasses.asdict(options))


def from_config(cls: type[T], cfg: Any, where: str) -> T:
  """Builds `cls` from a ConfigDict/dict, naming `where.key` in every error."""
  if cfg is None:
    return cls()
  items = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else dict(cfg)
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(items) - known)
  if unknown:
    raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
  hints = typing.get_type_hints(cls)
  for k, v in items.items():
    if isinstance(v, list):
      items[k] = tuple(v)
    if dataclasses.is_dataclass(hints.get(k)):  # a nested block, e.g. rewards.quality.http
      items[k] = from_config(hints[k], v, f"{where}.{k}")
  try:
    return cls(**items)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from e


def check(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ValueError(f"{field}: {msg}")


def json_object(text: str, field: str) -> dict:
  """Parses an option holding a JSON object ('' -> {}); errors name the field."""
  if not text:
    return {}
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{field}: not valid JSON ({e})") from e
  check(isinstance(value, dict), field, "must be a JSON object")
  return value


@dataclasses.dataclass(frozen=True)
class MathAccuracyOptions:
  order: tuple[str, ...] = ANSWER_FORMS
  strict: bool = False
  # Only the tail of a response is searched: answers come last, and this bounds the work.
  max_chars: int = 20_000
  gold_column: str = "answer"

  def __post_init__(self):
    check(len(self.order) > 0, "order", "must name at least one form")
    for m in self.order:
      check(m in ANSWER_FORMS, "order", f"unknown form {m!r}; known: {list(ANSWER_FORMS)}")
    check(isinstance(self.strict, bool), "strict", "must be a bool")
    check(isinstance(self.max_chars, int) and self.max_chars > 0, "max_chars", "must be a positive int")


@dataclasses.dataclass(frozen=True)
class FormatOptions:
  think_open: str = "<think>"
  think_close: str = "</think>"
  answer_open: str = "<answer>"
  answer_close: str = "</answer>"
  require_think: bool = True
  # Set when the prompt already ends with the think_open tag (the completion starts inside it).
  think_in_prompt: bool = False
  allow_text_after: bool = False
  require_nonempty_answer: bool = True
  correct: float = 0.1
  incorrect: float = -0.1

  def __post_init__(self):
    for f in ("think_open", "think_close", "answer_open", "answer_close"):
      check(isinstance(getattr(self, f), str) and getattr(self, f), f, "must be a non-empty str")
    for f in ("correct", "incorrect"):
      check(isinstance(getattr(self, f), (int, float)), f, "must be a number")


@dataclasses.dataclass(frozen=True)
class HttpOptions:
  """The quality reward's `http` backend: an OpenAI-compatible server (see chat_http.py)."""
  base_url: str = "http://127.0.0.1:8000/v1"  # the server's OpenAI root; /chat/completions is appended
  model: str = "Qwen/Qwen3-32B"
  api_key_env: str = ""  # name of an environment variable holding the key (never the key itself)
  max_concurrency: int = 16
  # A grade is a ~50-token JSON reply (thinking off): a served 32B model answers in a few
  # seconds even under load, so 30 s per attempt is ~10x a normal reply and a silent server
  # is noticed in 30 s, not minutes. The batch deadline fits a step of a few hundred grades
  # at max_concurrency 16 (e.g. 384 = 24 waves of ~3 s = 72 s) with room for retries; raise
  # max_concurrency (or deadline_s) for bigger steps. Items past the deadline are missing.
  timeout_s: float = 30.0  # per attempt (socket timeout)
  max_retries: int = 3
  backoff_s: float = 1.0  # first retry waits ~backoff_s, doubling up to backoff_max_s
  backoff_max_s: float = 16.0
  deadline_s: float = 120.0  # the whole batch; items unfinished by then fail
  max_tokens: int = 512
  temperature: float = 0.0
  # JSON merged into every request body. The default turns Qwen3's thinking off on vLLM/SGLang
  # (a grade needs no chain of thought, and thinking would blow max_tokens); templates of other
  # models ignore it.
  extra_body_json: str = '{"chat_template_kwargs": {"enable_thinking": false}}'
  cache_size: int = 200_000  # entries; 0 disables the cache
  max_response_bytes: int = 1 << 20
  use_env_proxy: bool = False  # loopback scorers must not be sent through an HTTP proxy

  def __post_init__(self):
    check(self.base_url.startswith(("http://", "https://")), "base_url", f"must be an http(s) URL, got {self.base_url!r}")
    check(bool(self.model), "model", "must name the served model")
    for f in ("max_concurrency", "max_response_bytes"):
      check(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
    for f in ("max_retries", "cache_size", "max_tokens"):
      check(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f, "must be an int >= 0")
    for f in ("timeout_s", "deadline_s"):
      check(getattr(self, f) > 0, f, "must be > 0")
    for f in ("backoff_s", "backoff_max_s"):
      check(getattr(self, f) >= 0, f, "must be >= 0")
    json_object(self.extra_body_json, "extra_body_json")


@dataclasses.dataclass(frozen=True)
class LocalOptions:
  """The quality reward's `local` backend: a Flax Qwen scorer run by grpo_jax.sampler
  (see model_rewards.LocalChatBackend)."""
  checkpoint: str = ""  # a local Hugging Face checkpoint folder
  tokenizer: str = ""  # '' -> the checkpoint folder
  dtype: str = "bfloat16"
  batch_size: int = 8
  max_prompt_tokens: int = 2048  # longer prompts lose the middle of the response
  max_new_tokens: int = 256
  temperature: float = 0.0  # 0 = greedy
  seed: int = 0  # with temperature > 0: a reply's draw is a function of (seed, its prompt)
  # JSON passed to apply_chat_template, e.g. '{"enable_thinking": false}' for a Qwen3 scorer.
  chat_template_kwargs_json: str = ""

  def __post_init__(self):
    check(self.dtype in DTYPES, "dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
    for f in ("batch_size", "max_new_tokens"):
      check(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
    check(isinstance(self.max_prompt_tokens, int) and self.max_prompt_tokens >= 16,
          "max_prompt_tokens", "must be an int >= 16")
    check(isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", "must be >= 0")
    json_object(self.chat_template_kwargs_json, "chat_template_kwargs_json")


@dataclasses.dataclass(frozen=True)
class QualityOptions:
  backend: str = "http"  # 'http' or 'local'
  fallback: float | None = None
  max_question_chars: int = 4_000
  max_response_chars: int = 12_000
  # The dataset column with the bare question (the trainer passes GSM8K's 'question');
  # '' -> the chat-formatted prompt text instead.
  question_column: str = "question"
  http: HttpOptions = dataclasses.field(default_factory=HttpOptions)
  local: LocalOptions = dataclasses.field(default_factory=LocalOptions)

  def __post_init__(self):
    check(self.backend in ("http", "local"), "backend", f"must be 'http' or 'local', got {self.backend!r}")
    check(self.fallback is None or isinstance(self.fallback, (int, float)), "fallback", "must be a number or None")
    for f in ("max_question_chars", "max_response_chars"):
      check(isinstance(getattr(self, f), int) and getattr(self, f) > 16, f, "must be an int > 16")


def _check_frozen_model(o) -> None:
  """The fields every reward run on a frozen local checkpoint has (verifier, diversity)."""
  check(isinstance(o.checkpoint, str), "checkpoint", "must be a str (a local checkpoint folder)")
  check(isinstance(o.batch_size, int) and o.batch_size > 0, "batch_size", "must be a positive int")
  check(isinstance(o.max_tokens, int) and o.max_tokens >= 16, "max_tokens", "must be an int >= 16")
  check(o.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {o.dtype!r}")


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
    _check_frozen_model(self)
    check(bool(self.yes_token) and bool(self.no_token), "yes_token/no_token", "must be non-empty")
    check("{response}" in self.template, "template", "must contain '{response}'")
    try:
      self.template.format(question="", response="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"template: only {{question}} and {{response}} may appear in braces ({e!r})") from e
    json_object(self.chat_template_kwargs_json, "chat_template_kwargs_json")


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
    _check_frozen_model(self)
    check(self.attention in ATTENTION, "attention", f"must be one of {ATTENTION}, got {self.attention!r}")


# Each reward's options, by its name in rewards.names (the registry's table; KNOWN_REWARDS).
REWARDS = {
    "math_accuracy": MathAccuracyOptions,
    "format": FormatOptions,
    "quality": QualityOptions,
    "verifier": VerifierOptions,
    "diversity": DiversityOptions,
}


def weighted_names(rewards_cfg) -> tuple[tuple[str, float], ...]:
  """The (name, weight) pairs of rewards.names and rewards.weights: the one check of the two
  (grpo_jax.validate and build_rewards both use it). ValueError naming the setting."""
  names, weights = tuple(rewards_cfg.names), tuple(rewards_cfg.weights)
  for name in names:
    check(name in REWARDS, "rewards.names",
          f"unknown reward {name!r}; known rewards: {list(REWARDS)}")
  check(len(names) == len(weights), "rewards.weights",
        f"{len(weights)} weights for {len(names)} rewards")
  check(len(names) >= 1, "rewards.names", "at least one reward is needed")
  check(len(set(names)) == len(names), "rewards.names", f"lists a reward twice: {names}")
  for name, weight in zip(names, weights):
    check(not isinstance(weight, bool) and isinstance(weight, (int, float))
          and math.isfinite(weight), "rewards.weights",
          f"weight of {name!r} must be a finite number, got {weight!r}")
  return tuple((name, float(weight)) for name, weight in zip(names, weights))
