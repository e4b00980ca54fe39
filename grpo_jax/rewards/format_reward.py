"""`format`: does the response follow the reasoning template?

Range: {incorrect, correct}, by default {-0.1, +0.1}; never None.

The default template is `<think>…</think>` then `<answer>…</answer>` with only whitespace
between and after, each tag exactly once, and a non-empty answer:

  "<think>3+4=7</think>\\n<answer>7</answer>"    -> +0.1
  "<think>3+4=7</think><answer>7</answer> ok"    -> -0.1  (text after the answer)

The check is a sequence of `str.find` calls rather than one DOTALL regex, whose lazy
`.*?` groups can backtrack quadratically on adversarial text.
"""
from __future__ import annotations

from collections.abc import Sequence

from grpo_jax.rewards import text
from grpo_jax.rewards.options import FormatOptions


def follows_format(response: str, opts: FormatOptions = FormatOptions()) -> bool:
  # With require_think=False the think block is optional, but if present it must be well formed.
  # A prompt that opened it (think_in_prompt) leaves the response to close it, required or not.
  think = (opts.require_think or opts.think_in_prompt or opts.think_close in response
           or opts.think_open in response)
  expected = {opts.answer_open: 1, opts.answer_close: 1}
  if think:
    expected[opts.think_open] = 0 if opts.think_in_prompt else 1
    expected[opts.think_close] = 1
  for tag, n in expected.items():
    if response.count(tag) != n:
      return False
  pos = 0
  if think:
    if not opts.think_in_prompt:
      lead = response.find(opts.think_open)
      if response[:lead].strip():
        return False
      pos = lead + len(opts.think_open)
    think_end = response.find(opts.think_close, pos)
    if think_end < 0:
      return False
    pos = think_end + len(opts.think_close)
  start = response.find(opts.answer_open, pos)
  if start < 0 or response[pos:start].strip():
    return False
  body_start = start + len(opts.answer_open)
  end = response.find(opts.answer_close, body_start)
  if end < 0:
    return False
  if opts.require_nonempty_answer and not response[body_start:end].strip():
    return False
  return opts.allow_text_after or not response[end + len(opts.answer_close):].strip()


def format_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    opts: FormatOptions = FormatOptions(),
    **columns,
) -> list[float | None]:
  del prompts, columns
  completions = text.clean_all(completions, field="completions")
  return [float(opts.correct if follows_format(c, opts) else opts.incorrect) for c in completions]
