"""Runs a list of rewards over one batch: the reward matrix and its flat metrics."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np


class Interrupted(Exception):
  """A reward gave up waiting for its scorer because the run is stopping (SIGTERM).

  Unlike a missing score this is no property of the batch: the caller drops the whole step.
  """


@dataclasses.dataclass
class Reward:
  """A named, weighted reward: `fn(prompts, completions, group_size=G, **columns)`.

  `fn` returns one float or None (could not score) per completion. If it has a
  `last_metrics` dict (backend counters of its latest call), `score` logs it.
  """
  name: str
  weight: float
  fn: Callable[..., list]

  def __call__(self, prompts, completions, **columns) -> list[float | None]:
    return self.fn(prompts, completions, **columns)


def _as_value(v, name: str, i: int) -> float:
  if v is None:
    return math.nan
  if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
    raise TypeError(f"reward {name!r} returned {type(v).__name__} at row {i}; expected float or None")
  v = float(v)
  if math.isinf(v):
    raise ValueError(f"reward {name!r} returned {v} at row {i}; rewards must be finite or None")
  return v


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[str],
    completions: Sequence[str],
    group_size: int,
    columns: Mapping[str, Sequence],
) -> tuple[np.ndarray, dict[str, float]]:
  """Scores n = len(completions) completions with k rewards.

  Returns R [n, k] float32 (NaN where a reward returned None) and metrics
  `reward/<name>/{mean,std,missing_frac}` (mean/std over the scored rows; NaN if none)
  plus each reward's `last_metrics` as `reward/<name>/<counter>`.

    R, m = score(rewards, ["q"] * 4, ["a", "b", "c", "d"], group_size=2, columns={"answer": [...] * 4})
  """
  n = len(completions)
  if len(prompts) != n:
    raise ValueError(f"prompts has {len(prompts)} rows but completions has {n}")
  if not isinstance(group_size, int) or group_size <= 0 or n % group_size:
    raise ValueError(f"group_size={group_size!r} must be a positive int dividing the {n} completions")
  for key, col in columns.items():
    if key == "group_size":
      raise ValueError("columns: 'group_size' is reserved; pass it as the group_size argument")
    if len(col) != n:
      raise ValueError(f"column {key!r} has {len(col)} rows but completions has {n}")
  R = np.full((n, len(rewards)), np.nan, np.float32)
  metrics: dict[str, float] = {}
  for j, reward in enumerate(rewards):
    out = reward(list(prompts), list(completions), group_size=group_size, **{k: list(v) for k, v in columns.items()})
    if len(out) != n:
      raise ValueError(f"reward {reward.name!r} returned {len(out)} values for {n} completions")
    R[:, j] = [_as_value(v, reward.name, i) for i, v in enumerate(out)]
    col = R[:, j]
    scored = col[~np.isnan(col)]
    prefix = f"reward/{reward.name}/"
    metrics[prefix + "mean"] = float(scored.mean()) if scored.size else math.nan
    metrics[prefix + "std"] = float(scored.std()) if scored.size else math.nan
    metrics[prefix + "missing_frac"] = float(1.0 - scored.size / n) if n else 0.0
    for k, v in (getattr(reward.fn, "last_metrics", None) or {}).items():
      metrics[prefix + k] = float(v)
  return R, metrics
