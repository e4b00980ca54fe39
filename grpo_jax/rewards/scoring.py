"""Runs a list of rewards over one batch: the reward matrix and its flat metrics. Rewards that
cannot score fail loudly.

A reward that cannot score a completion returns None (NaN in the reward matrix) and the step
trains on the other rewards: right for a blip, wrong for a scorer that is down or a judge
whose replies never parse, where the run would train on for hours with only
`reward/<name>/missing_frac = 1` in metrics.jsonl to say so. So:

- `probe` scores a couple of real examples with every model-based reward before training and
  raises MissingRewardsError, naming the reward, its scorer and the reason, if any is missing
  (or only warns, with rewards.allow_missing=True).
- `RewardHealth.update` warns on every step where a reward is missing on at least half of the
  completions, with the reasons counted (timeout, refused, http_503, unparseable, ...), and
  raises MissingRewardsError after train.max_missing_reward_steps such steps in a row; the
  trainer saves a checkpoint first, so the same command resumes once the scorer is fixed.

"Missing" includes a score replaced by the reward's `fallback` value (quality's
`fallback_frac`): a constant stands in for a scorer that did not answer.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from grpo_jax.errors import UserError

# A step where a reward is missing on at least this fraction of completions is a bad step.
MISSING_FRAC = 0.5


class Interrupted(Exception):
  """A reward gave up waiting for its scorer because the run is stopping (SIGTERM).

  Unlike a missing score this is no property of the batch: the caller drops the whole step.
  """


class MissingRewardsError(UserError):
  """A reward cannot be computed: its scorer is unreachable or its replies do not parse."""


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
    metrics.update(_column_metrics(reward.name, R[:, j]))
    for k, v in (getattr(reward.fn, "last_metrics", None) or {}).items():
      metrics[f"reward/{reward.name}/{k}"] = float(v)
  return R, metrics


def _column_metrics(name: str, col: np.ndarray) -> dict[str, float]:
  scored = col[~np.isnan(col)]
  prefix = f"reward/{name}/"
  return {prefix + "mean": float(scored.mean()) if scored.size else math.nan,
          prefix + "std": float(scored.std()) if scored.size else math.nan,
          prefix + "missing_frac": float(1.0 - scored.size / col.size) if col.size else 0.0}


def merge_metrics(rewards: Sequence[Reward], R: np.ndarray,
                  per_process: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """`score`'s metrics of a batch that several processes scored in equal shares: mean, std and
  missing_frac from the whole reward matrix R; the rewards' backend counters summed over the
  processes, except fractions and means (names ending in _frac or _mass), which are averaged."""
  metrics: dict[str, float] = {}
  for j, reward in enumerate(rewards):
    metrics.update(_column_metrics(reward.name, R[:, j]))
  for key in sorted(set().union(*per_process) - set(metrics)):
    values = [m.get(key, 0.0) for m in per_process]
    average = key.endswith(("_frac", "_mass"))
    metrics[key] = float(np.mean(values) if average else np.sum(values))
  return metrics


def _stderr(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _source(reward: Reward) -> str:
  return getattr(reward.fn, "source", "")


def probe(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          columns: Mapping[str, Sequence], *, allow_missing: bool,
          log: Callable[[str], None] = _stderr) -> None:
  """Scores one group of examples with each model-based reward (those with a `source`).

  Pure rewards (math_accuracy, format) have nothing to reach and are skipped. Use real rows
  (question, gold answer): a working judge grades them, so a missing score means a broken one.
  """
  for reward in rewards:
    source = _source(reward)
    if not source:
      continue
    try:
      out = reward(list(prompts), list(completions), group_size=len(completions),
                   **{k: list(v) for k, v in columns.items()})
    except ValueError as e:  # e.g. a question_column the data lacks
      raise MissingRewardsError(f"rewards.{reward.name} ({source}): the start-up probe failed: {e}") from None
    missing = [v is None or (isinstance(v, float) and math.isnan(v)) for v in out]
    warning = getattr(reward.fn, "last_warning", "")
    if warning:  # scores came, but may mean nothing (a verifier reading the wrong tokens)
      log(f"grpo_jax: warning: rewards.{reward.name} ({source}), start-up probe: {warning}")
    problem = getattr(reward.fn, "last_problem", "")
    if not any(missing) and not problem:
      continue
    message = (f"rewards.{reward.name}: the start-up probe got no score from {source} for "
               f"{sum(missing) or len(out)} of {len(out)} examples: {problem or 'the reward returned None'}")
    if not allow_missing:
      raise MissingRewardsError(f"{message}. Fix the scorer, or set --config.rewards.allow_missing=True "
                                "to start anyway")
    log(f"grpo_jax: warning: {message} (starting anyway: rewards.allow_missing=True)")


class RewardHealth:
  """Counts, per reward, the consecutive steps where it is missing on >= MISSING_FRAC of rows.

    health = RewardHealth(rewards, max_steps=3)
    health.update(step, metrics)   # warns; raises MissingRewardsError on the 3rd bad step in a row
  """

  def __init__(self, rewards: Sequence[Reward], max_steps: int, log: Callable[[str], None] = _stderr):
    self.sources = {r.name: _source(r) for r in rewards}
    self.max_steps, self.log = max_steps, log  # max_steps 0: warn only, never stop
    self.streak = dict.fromkeys(self.sources, 0)

  def update(self, step: int, metrics: Mapping[str, float]) -> None:
    """`metrics` as from rewards.score: reward/<name>/{missing_frac,fallback_frac,missing/<why>}."""
    for name, source in self.sources.items():
      prefix = f"reward/{name}/"
      frac = max(metrics.get(prefix + "missing_frac", 0.0), metrics.get(prefix + "fallback_frac", 0.0))
      if not frac >= MISSING_FRAC:
        self.streak[name] = 0
        continue
      self.streak[name] += 1
      why = {k[len(prefix + "missing/"):]: int(v) for k, v in metrics.items()
             if k.startswith(prefix + "missing/") and v}
      reasons = ", ".join(f"{k} {v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])) or "no reason given"
      where = f" from {source}" if source else ""
      what = f"reward {name!r} missing on {frac:.0%} of completions at step {step}{where} ({reasons})"
      limit = f"/{self.max_steps}" if self.max_steps else ""
      self.log(f"grpo_jax: warning: {what} [{self.streak[name]}{limit} bad steps in a row]")
      if self.max_steps and self.streak[name] >= self.max_steps:
        hint = (" Items past the batch deadline: raise rewards.quality.http.max_concurrency or deadline_s."
                if "deadline" in why else "")
        raise MissingRewardsError(
            f"{what}; {self.streak[name]} steps in a row with the reward missing on >= "
            f"{MISSING_FRAC:.0%} of completions (train.max_missing_reward_steps={self.max_steps}). "
            f"A checkpoint of step {step} was saved: fix the scorer and run the same command to "
            f"resume, or set train.max_missing_reward_steps=0 to only warn.{hint}")
