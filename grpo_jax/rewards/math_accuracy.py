"""`math_accuracy`: exact numeric match of the response's final answer with the GSM8K gold.

Range: {0.0, 1.0}; None when the gold answer itself cannot be parsed (row cannot be scored).

The gold is the number after the last '####' of the dataset's `answer` column (or the whole
column if it is a bare number). The response's answer is looked for in the forms of
`order`, first form first (see `extract.py`); numbers are compared as exact fractions after
normalisation (see `numbers.py`: 1,000 == 1000, $18.00 == 18, 18% == 18, 3/4 == 0.75).

Lenient mode (default): the first form that yields a number wins; within a form the last
occurrence wins (models restate and correct themselves); a span that is not a bare number
gives its number by form: tag/boxed -> the last number in it ("<answer>3+4 = 7</answer>"),
'####' -> the first, "the answer is" -> the first after the last '=' if there is one, else
the first ("the answer is 18 apples, 3 more than 15" -> 18).
Strict mode: the first form that is *present* decides, later forms are not consulted; its
spans must be bare numbers, and several spans with different values (hedging, e.g.
"\\boxed{17} or \\boxed{18}") score 0. Only the last extract.MAX_SPANS occurrences of a form
are considered (this bounds the work on responses that repeat a marker thousands of times).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from fractions import Fraction

from grpo_jax.rewards import extract, numbers, options, text

DEFAULT_ORDER = ("answer_tag", "boxed", "hashes", "answer_is", "last_number")


@dataclasses.dataclass(frozen=True)
class MathAccuracyOptions:
  order: tuple[str, ...] = DEFAULT_ORDER
  strict: bool = False
  # Only the tail of a response is searched: answers come last, and this bounds the work.
  max_chars: int = 20_000
  gold_column: str = "answer"

  def __post_init__(self):
    options.check(len(self.order) > 0, "order", "must name at least one form")
    for m in self.order:
      options.check(m in extract.METHODS, "order", f"unknown form {m!r}; known: {list(extract.METHODS)}")
    options.check(isinstance(self.strict, bool), "strict", "must be a bool")
    options.check(isinstance(self.max_chars, int) and self.max_chars > 0, "max_chars", "must be a positive int")


def _lenient_span_value(span: str, method: str) -> Fraction | None:
  exact = numbers.parse_exact(span)
  if exact is not None:
    return exact
  plain = numbers.delatex(span)
  if method in ("answer_tag", "boxed"):
    return numbers.last_number(plain)
  if method == "answer_is" and "=" in plain:
    return numbers.first_number(plain[plain.rfind("=") + 1:])
  return numbers.first_number(plain)


def extract_answer(response: str, opts: MathAccuracyOptions = MathAccuracyOptions()) -> Fraction | None:
  """The response's final answer as an exact fraction, or None if it states none."""
  response = text.tail(response, opts.max_chars)
  for method in opts.order:
    if method == "last_number":
      value = numbers.last_number(numbers.delatex(response))
      if value is not None or opts.strict:
        return value
      continue
    found = extract.spans(response, method)
    if opts.strict:
      if not found:
        continue
      values = {numbers.parse_exact(s) for s in found}
      return values.pop() if len(values) == 1 else None  # {None} -> None as well
    for span in reversed(found):
      value = _lenient_span_value(span, method)
      if value is not None:
        return value
  return None


def gold_value(answer: str) -> Fraction | None:
  if "####" in answer:
    return numbers.parse_gold(answer)
  return numbers.parse_exact(answer)


def math_accuracy(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    opts: MathAccuracyOptions = MathAccuracyOptions(),
    **columns,
) -> list[float | None]:
  del prompts  # the gold answer carries everything needed
  if opts.gold_column not in columns:
    raise ValueError(
        f"math_accuracy needs the dataset column {opts.gold_column!r} (rewards.math_accuracy.gold_column);"
        f" got columns {sorted(columns)}")
  golds = text.clean_all(columns[opts.gold_column], field=opts.gold_column)
  completions = text.clean_all(completions, field="completions")
  if len(golds) != len(completions):
    raise ValueError(f"{opts.gold_column} has {len(golds)} rows but completions has {len(completions)}")
  out: list[float | None] = []
  for gold_text, response in zip(golds, completions):
    gold = gold_value(text.tail(gold_text, opts.max_chars))
    if gold is None:
      out.append(None)
      continue
    pred = extract_answer(response, opts)
    out.append(1.0 if pred is not None and pred == gold else 0.0)
  return out
