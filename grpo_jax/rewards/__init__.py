"""Rewards for GRPO: each is `fn(prompts, completions, group_size=G, **columns) -> [float | None]`.

Completions of one prompt are contiguous (groups of G); dataset columns arrive repeated per
completion (e.g. `answer=[...]`). None means "could not score" and becomes NaN in the matrix.

  cfg = grpo_jax.config.rewards()           # names=('math_accuracy', 'format'), weights=(1., 1.)
  rewards = build_rewards(cfg)
  R, metrics = score(rewards, prompts, completions, group_size=G, columns={"answer": answers})

A failing scorer is loud (see scoring.py): `probe` before training, `RewardHealth` per step.

Ranges: math_accuracy {0, 1}; format {-0.1, +0.1}; quality [0.2, 1]; verifier [0, 1];
diversity [0, 2].
"""
from __future__ import annotations

import functools
import threading
from typing import Any

from grpo_jax.errors import UserError
from grpo_jax.rewards import format_reward, math_accuracy, options, quality
from grpo_jax.rewards.scoring import (Interrupted, MissingRewardsError, Reward, RewardHealth,
                                      merge_metrics, probe, score)

__all__ = ["Reward", "build_rewards", "score", "KNOWN_REWARDS", "probe", "RewardHealth",
           "MissingRewardsError", "Interrupted", "RewardConfigError"]

KNOWN_REWARDS = tuple(options.REWARDS)


class RewardConfigError(UserError, ValueError):
  """A reward's options, or what they point at (a judge checkpoint), are unusable."""


def _build_fn(name: str, opts: Any, interrupt):
  if name == "math_accuracy":
    return functools.partial(math_accuracy.math_accuracy, opts=opts)
  if name == "format":
    return functools.partial(format_reward.format_reward, opts=opts)
  if name == "quality":
    return quality.QualityReward(opts, interrupt=interrupt)
  if name == "verifier":
    from grpo_jax.rewards import model_rewards  # JAX model code, loaded only when configured
    return model_rewards.VerifierReward(opts)
  if name == "diversity":
    from grpo_jax.rewards import model_rewards
    return model_rewards.DiversityReward(opts)
  raise AssertionError(name)


def build_rewards(rewards_cfg: Any, interrupt: threading.Event | None = None) -> list[Reward]:
  """The configured rewards. `interrupt`: set it (on SIGTERM) to make a reward waiting on a
  remote scorer raise Interrupted instead of waiting out its deadline."""
  out = []
  for name, weight in options.weighted_names(rewards_cfg):
    sub = rewards_cfg.get(name) if hasattr(rewards_cfg, "get") else getattr(rewards_cfg, name, None)
    try:
      opts = options.from_config(options.REWARDS[name], sub, f"rewards.{name}")
      fn = _build_fn(name, opts, interrupt)
    except ValueError as e:  # bad options, a missing judge checkpoint: the user's to fix
      msg = str(e)
      raise RewardConfigError(msg if msg.startswith(f"rewards.{name}") else f"rewards.{name}: {msg}") from e
    out.append(Reward(name=name, weight=weight, fn=fn))
  return out
