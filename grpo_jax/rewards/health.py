"""Rewards that fail loudly: a start-up probe and a watch on missing scores, step after step.

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

import math
import sys
from collections.abc import Callable, Mapping, Sequence

from grpo_jax.errors import UserError
from grpo_jax.rewards.scoring import Reward

# A step where a reward is missing on at least this fraction of completions is a bad step.
MISSING_FRAC = 0.5


class MissingRewardsError(UserError):
  """A reward cannot be computed: its scorer is unreachable or its replies do not parse."""


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
