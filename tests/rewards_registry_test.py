"""build_rewards / score: config handling, the reward matrix and its metrics (vs NumPy)."""
import math

import ml_collections
import numpy as np
import pytest

from grpo_jax import config as config_lib, rewards as rewards_lib
from grpo_jax.errors import UserError
from grpo_jax.rewards import Reward


def test_default_config_builds_math_and_format():
  rewards = rewards_lib.build_rewards(config_lib.rewards())
  assert [(r.name, r.weight) for r in rewards] == [("math_accuracy", 1.0), ("format", 1.0)]
  good = "<think>48/2 = 24, 48 + 24 = 72</think>\n<answer>72</answer>"
  R, metrics = rewards_lib.score(rewards, ["q"] * 4, [good, "72", "<think>x</think><answer>71</answer>", ""],
                                 group_size=2, columns={"answer": ["... #### 72"] * 4})
  np.testing.assert_array_equal(R, np.array([[1, 0.1], [1, -0.1], [0, 0.1], [0, -0.1]], np.float32))
  assert metrics["reward/math_accuracy/mean"] == 0.5 and metrics["reward/format/mean"] == pytest.approx(0.0)


def test_score_matrix_and_metrics_against_numpy():
  table = [[0.5, None, 1.0, 2.0, None, -1.0], [None] * 6]

  def make(col):
    return lambda prompts, completions, **kw: list(table[col])

  rewards = [Reward("a", 1.0, make(0)), Reward("b", 2.0, make(1))]
  R, m = rewards_lib.score(rewards, ["p"] * 6, ["c"] * 6, group_size=3, columns={})
  assert R.dtype == np.float32 and R.shape == (6, 2)
  vals = np.array([0.5, 1.0, 2.0, -1.0])
  assert m["reward/a/mean"] == pytest.approx(vals.mean())
  assert m["reward/a/std"] == pytest.approx(vals.std())
  assert m["reward/a/missing_frac"] == pytest.approx(2 / 6)
  assert np.isnan(R[:, 1]).all() and math.isnan(m["reward/b/mean"]) and m["reward/b/missing_frac"] == 1.0


def test_rewards_receive_group_size_and_columns():
  seen = {}

  def spy(prompts, completions, **kw):
    seen.update(kw)
    return [0.0] * len(completions)

  rewards_lib.score([Reward("spy", 1.0, spy)], ["p"] * 4, ["c"] * 4, group_size=2,
                    columns={"answer": ("1", "1", "2", "2")})
  assert seen == {"group_size": 2, "answer": ["1", "1", "2", "2"]}


def test_unknown_reward_lists_known_ones():
  cfg = config_lib.rewards()
  cfg.names, cfg.weights = ("math_accuracy", "helpfulness"), (1.0, 1.0)
  with pytest.raises(ValueError, match=r"'helpfulness'.*math_accuracy.*format.*quality.*verifier.*diversity"):
    rewards_lib.build_rewards(cfg)


@pytest.mark.parametrize("mutate,match", [
    (lambda c: setattr(c, "weights", (1.0,)), r"rewards\.weights: 1 weights for 2 rewards"),
    (lambda c: setattr(c, "weights", (1.0, "x")), "weight of 'format'"),
    (lambda c: setattr(c, "names", ("format", "format")), "twice"),
    (lambda c: c.math_accuracy.update({"order": ("boxed", "nope")}), "rewards.math_accuracy: order"),
    (lambda c: c.format.unlock().update({"corect": 1.0}), r"rewards.format: unknown option\(s\) \['corect'\]"),
])
def test_bad_config_names_the_setting(mutate, match):
  cfg = config_lib.rewards()
  mutate(cfg)
  with pytest.raises(ValueError, match=match):
    rewards_lib.build_rewards(cfg)


def test_nested_options_and_plain_dicts():
  cfg = ml_collections.ConfigDict({"names": ["quality"], "weights": [0.5],
                                   "quality": {"fallback": 0.3, "http": {"base_url": "http://10.0.0.1:1/v1"}}})
  (r,) = rewards_lib.build_rewards(cfg)
  assert r.fn.opts.fallback == 0.3 and r.fn.opts.http.base_url == "http://10.0.0.1:1/v1"
  cfg.quality.http.timeout_s = -1.0
  # A user error: grpo_jax.main prints it and exits 2, no traceback.
  with pytest.raises(UserError, match=r"^rewards.quality.http: timeout_s"):
    rewards_lib.build_rewards(cfg)
  cfg.quality.http.timeout_s = 1.0
  cfg.quality.backend = "local"
  with pytest.raises(UserError, match=r"^rewards.quality.local.checkpoint is empty"):
    rewards_lib.build_rewards(cfg)


@pytest.mark.parametrize("kwargs,match", [
    (dict(group_size=3), "group_size=3"),
    (dict(group_size=0), "group_size=0"),
    (dict(columns={"answer": ["1"]}), "column 'answer' has 1 rows"),
    (dict(columns={"group_size": [1] * 4}), "reserved"),
])
def test_bad_batch_names_the_field(kwargs, match):
  args = dict(group_size=2, columns={})
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    rewards_lib.score(rewards_lib.build_rewards(config_lib.rewards()),
                      ["p"] * 4, ["c"] * 4, **args)


def test_bad_reward_outputs_name_the_reward():
  for out, match in (([1.0], "returned 1 values"), (["x"] * 2, "'bad' returned str"), ([math.inf] * 2, "finite")):
    with pytest.raises((ValueError, TypeError), match=match):
      rewards_lib.score([Reward("bad", 1.0, lambda p, c, **kw: out)], ["p"] * 2, ["c"] * 2, 2, {})
