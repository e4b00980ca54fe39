"""Every text reward finishes quickly on hostile completions (linear parsing, length caps).

The bound asserted is 100 ms per (reward, input), the best of 3 runs so that a busy shared
machine does not fail the test; quadratic or exponential parsing of these inputs would take
seconds to hours, far beyond it.
"""
import time

import pytest

from grpo_jax.rewards import format_reward, math_accuracy, quality
from grpo_jax.rewards.options import MathAccuracyOptions, QualityOptions

MB = 1_000_000
ADVERSARIAL = {
    "1MB_text": "lorem ipsum dolor sit amet " * (MB // 27),
    "1MB_digits_commas": "1," * (MB // 2),
    "1MB_answer_is": "The answer is " * (MB // 14),
    "1MB_open_tags": "<think><answer>" * (MB // 15),
    "1MB_close_tags": "</answer></think>" * (MB // 17),
    "1MB_boxed_open": "\\boxed{" * (MB // 7),
    "1MB_dollar_signs": "$-" * (MB // 2),
    "1MB_hashes": "####" * (MB // 4),
    "1MB_whitespace_then_number": " " * MB + "7",
    "nested_braces_balanced": "\\boxed{" + "{" * 10_000 + "7" + "}" * 10_000 + "}",
    "nested_braces_unbalanced": "\\boxed{" * 10_000 + "{" * 10_000,
    "5000_digit_number": "The answer is " + "9" * 5000 + ".",
    "5000_digit_boxed": "\\boxed{" + "1" * 5000 + "}",
    "5000_digit_fraction": "\\frac{" + "3" * 5000 + "}{" + "7" * 5000 + "}",
    "invalid_unicode": "\ud800 <answer>\udfff7\udc80</answer> \udcff" * 1000,
    "surrogateescape_bytes": bytes(range(128, 256)).decode("utf-8", "surrogateescape") * 4000,
}


def _best_of_3(fn) -> float:
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def _quality_reward():
  # The grader's replies are hostile too: the same texts come back as its "grade".
  def backend(batch):
    return [m[0]["content"][-50_000:] for m in batch], {}
  return quality.QualityReward(QualityOptions(question_column="", fallback=0.0), backend=backend)


TEXT_REWARDS = {
    "math_accuracy": lambda c: math_accuracy.math_accuracy([""], [c], answer=["#### 7"]),
    "math_accuracy_strict": lambda c: math_accuracy.math_accuracy(
        [""], [c], answer=["#### 7"], opts=MathAccuracyOptions(strict=True)),
    "format": lambda c: format_reward.format_reward([""], [c]),
    "quality_prompt_and_parse": lambda c, r=_quality_reward(): r(["What is 3+4?"], [c]),
    "quality_parse_reply": lambda c: [quality.parse_reward(c)],
}


@pytest.mark.parametrize("reward", sorted(TEXT_REWARDS))
def test_text_rewards_are_fast_on_adversarial_input(reward):
  fn = TEXT_REWARDS[reward]
  timings = {}
  for name, completion in ADVERSARIAL.items():
    out = fn(completion)
    assert len(out) == 1 and (out[0] is None or isinstance(out[0], float))
    timings[name] = _best_of_3(lambda: fn(completion))
  print(f"\n{reward}: " + ", ".join(f"{k} {v * 1e3:.1f}ms" for k, v in timings.items()))
  slow = {k: round(v * 1e3, 1) for k, v in timings.items() if v > 0.1}
  assert not slow, f"{reward} took over 100 ms on {slow} (ms)"


def test_adversarial_verdicts_are_sane():
  # Speed must not come from giving up: these still parse to the right answers.
  assert math_accuracy.extract_answer(ADVERSARIAL["nested_braces_balanced"]) == 7
  assert math_accuracy.extract_answer(ADVERSARIAL["1MB_whitespace_then_number"]) == 7
  assert math_accuracy.extract_answer(ADVERSARIAL["5000_digit_number"]) is None  # over MAX_DIGITS
  assert math_accuracy.math_accuracy([""], [ADVERSARIAL["invalid_unicode"]], answer=["#### 7"]) == [1.0]
  assert format_reward.format_reward([""], [ADVERSARIAL["1MB_open_tags"]]) == [-0.1]
