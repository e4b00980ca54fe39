"""Reward options: a frozen dataclass per reward, filled from that reward's config block.

Unknown keys are an error naming the key, so a typo in `--config.rewards.format.corect=1`
fails at start-up rather than silently using the default.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, TypeVar

import ml_collections

T = TypeVar("T")


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


def check_json_object(text: str, field: str) -> dict:
  """Parses an option holding a JSON object ('' -> {}); errors name the field."""
  if not text:
    return {}
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{field}: not valid JSON ({e})") from e
  check(isinstance(value, dict), field, "must be a JSON object")
  return value
