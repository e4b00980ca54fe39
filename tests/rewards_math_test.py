"""math_accuracy against the real GSM8K gold solutions and a table of hand-checked tricky cases."""
import json
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest

from grpo_jax.rewards import math_accuracy as ma
from grpo_jax.rewards.options import MathAccuracyOptions

GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "gsm8k"


def _rows():
  rows = []
  for split in ("train", "test"):
    with open(GSM8K / f"{split}.jsonl") as f:
      rows += [json.loads(line) for line in f]
  return rows


@pytest.fixture(scope="module")
def rows():
  return _rows()


def _reference_gold(answer: str) -> int:
  # Independent of math_accuracy's number parsing: GSM8K golds are integers with optional
  # thousands commas.
  return int(answer.split("####")[-1].strip().replace(",", ""))


def test_every_gold_solution_scores_one(rows):
  assert len(rows) == 8792
  answers = [r["answer"] for r in rows]
  for strict in (False, True):
    opts = MathAccuracyOptions(strict=strict)
    got = ma.math_accuracy([r["question"] for r in rows], answers, answer=answers, opts=opts)
    bad = [(i, answers[i][-80:]) for i, v in enumerate(got) if v != 1.0]
    assert not bad, f"strict={strict}: {len(bad)} gold solutions not scored 1.0, e.g. {bad[:3]}"


def test_gold_values_match_an_independent_parse(rows):
  for r in rows:
    assert ma.gold_value(r["answer"]) == _reference_gold(r["answer"]), r["answer"][-60:]


def test_gold_solutions_against_other_rows_answers(rows):
  # Shift answers by one row: the reward must be 1 exactly where the two golds coincide.
  answers = [r["answer"] for r in rows]
  shifted = answers[1:] + answers[:1]
  got = ma.math_accuracy([""] * len(rows), answers, answer=shifted)
  want = [float(_reference_gold(a) == _reference_gold(b)) for a, b in zip(answers, shifted)]
  assert got == want
  assert 0 < sum(want) < len(want) / 10  # both outcomes occur


# (response, gold answer text, expected lenient reward, expected strict reward, why)
CASES = [
    # signs
    ("<answer>-5</answer>", "#### -5", 1, 1, "negative"),
    ("The answer is −5.", "#### -5", 1, 1, "unicode minus U+2212"),
    ("<answer>5</answer>", "#### -5", 0, 0, "sign matters"),
    ("<answer>+7</answer>", "#### 7", 1, 1, "explicit plus"),
    ("She read pages 3-5", "#### 5", 1, 1, "a dash after a digit is a range, not a sign"),
    ("She read pages 3-5", "#### -5", 0, 0, "... so it is not -5"),
    ("<answer>-$18</answer>", "#### -18", 1, 1, "sign before currency"),
    ("<answer>$-18</answer>", "#### -18", 1, 1, "sign after currency"),
    # decimals and trailing zeros
    ("<answer>0.5</answer>", "#### 0.5", 1, 1, "decimal"),
    ("<answer>.5</answer>", "#### 0.5", 1, 1, "leading-dot decimal"),
    ("<answer>2.50</answer>", "#### 2.5", 1, 1, "trailing zero"),
    ("the answer is 3.5 hours.", "#### 3.5", 1, 0, "sentence-final dot is not a decimal; strict rejects units"),
    ("<answer>18.0001</answer>", "#### 18", 0, 0, "exact comparison, no tolerance"),
    ("<answer>17.999999</answer>", "#### 18", 0, 0, "exact comparison, no rounding"),
    ("<answer>007</answer>", "#### 7", 1, 1, "leading zeros"),
    # thousands separators
    ("<answer>1,000</answer>", "#### 1000", 1, 1, "comma thousands in response"),
    ("<answer>1000</answer>", "#### 1,000", 1, 1, "comma thousands in gold"),
    ("<answer>5,000,000</answer>", "#### 5000000", 1, 1, "several groups"),
    (r"\boxed{1{,}000}", "#### 1000", 1, 1, "LaTeX {,} separator"),
    (r"\boxed{1\,000}", "#### 1000", 1, 1, r"LaTeX \, thin-space separator"),
    # currency and percent
    ("<answer>$18.00</answer>", "#### 18", 1, 1, "dollars and cents"),
    (r"\boxed{\$18.00}", "#### 18", 1, 1, r"LaTeX \$"),
    ("answer: $1,234.50", "#### 1234.5", 1, 1, "currency, thousands and cents together"),
    ("<answer>€12</answer>", "#### 12", 1, 1, "euro"),
    ("<answer>18%</answer>", "#### 18", 1, 1, "percent sign dropped: GSM8K golds give percentages bare"),
    (r"\boxed{18\%}", "#### 18", 1, 1, r"LaTeX \%"),
    ("The answer is 18 percent.", "#### 18", 1, 1, "'percent' word belongs to the number, strict too"),
    ("<answer>0.18</answer>", "#### 18", 0, 0, "a fraction of one is not a percentage"),
    # fractions
    (r"\boxed{\frac{3}{4}}", "#### 0.75", 1, 1, r"\frac"),
    (r"\boxed{\dfrac{3}{4}}", "#### 0.75", 1, 1, r"\dfrac"),
    ("<answer>3/4</answer>", "#### 0.75", 1, 1, "slash fraction"),
    ("<answer>5/0</answer>", "#### 5", 0, 0, "division by zero is no number"),
    # boxed forms
    (r"\boxed{{18}}", "#### 18", 1, 1, "nested braces"),
    (r"first \boxed{17}, then \boxed{18}", "#### 18", 1, 0, "several boxed: lenient takes the last, strict rejects hedging"),
    (r"first \boxed{17}, then \boxed{18}", "#### 17", 0, 0, "... the earlier one does not count"),
    (r"\boxed{18} so again \boxed{18.0}", "#### 18", 1, 1, "several boxed that agree"),
    (r"\boxed{18 so The answer is 17", "#### 17", 1, 1, "unbalanced \\boxed{ states nothing"),
    (r"\boxed{18 \text{ dollars}}", "#### 18", 1, 0, "units in a box: lenient takes its number"),
    # a right answer followed by a later wrong number
    ("The answer is 18. Check: 18 + 2 = 20.", "#### 18", 1, 1, "phrase beats the last number"),
    ("#### 18\nBut wait, she also had 20.", "#### 18", 1, 1, "#### beats the last number"),
    ("<answer>18</answer> Actually 20", "#### 18", 1, 1, "tag beats the last number"),
    ("She has 18 apples. Later she has 20.", "#### 18", 0, 0, "no marker: the last number (20) is the answer"),
    # phrases and spans with more than a number
    ("<answer>The total is 18 dollars</answer>", "#### 18", 1, 0, "words in the tag: lenient takes its last number"),
    ("<answer>3 + 15 = 18</answer>", "#### 18", 1, 0, "an equation in the tag: its last number"),
    ("The answer is 18 apples, 3 more than 15.", "#### 18", 1, 0, "phrase: first number"),
    ("the final answer is 15 gallons * 8 pints / gallon = <<15*8=120>>120 pints", "#### 120", 1, 0,
     "phrase with '=': the first number after the last '=' (a GSM8K gold does this)"),
    ("Final answer: 42", "#### 42", 1, 1, "'answer:' form"),
    ("The answer is: 18.", "#### 18", 1, 1, "colon and final period"),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips", "#### 24", 1, 1, "calculator annotations"),
    # no answer
    ("no number at all", "#### 18", 0, 0, "nothing stated"),
    ("", "#### 18", 0, 0, "empty response"),
    ("<answer>18", "#### 18", 1, 1, "unclosed tag is no tag; the last number still reads 18"),
    # unsupported forms, documented in math_accuracy.py
    ("<answer>eighteen</answer>", "#### 18", 0, 0, "UNSUPPORTED: number words"),
    ("<answer>1 000</answer>", "#### 1000", 0, 0, "UNSUPPORTED: space-separated thousands (reads 000)"),
    ("<answer>1.2e3</answer>", "#### 1200", 0, 0, "UNSUPPORTED: scientific notation (reads 3)"),
    ("<answer>2 1/2</answer>", "#### 2.5", 0, 0, "UNSUPPORTED: mixed numbers (reads 1/2)"),
    ("<answer>12,34</answer>", "#### 1234", 0, 0, "UNSUPPORTED: misplaced comma (reads 34)"),
    ("<answer>" + "1" * 60 + "</answer>", "#### " + "1" * 60, None, None,
     "UNSUPPORTED: more than MAX_DIGITS digits; the gold cannot be read -> None"),
    ("<answer>18</answer>", "no gold here", None, None, "unparseable gold -> cannot score"),
]


def test_case_table_size():
  assert len(CASES) >= 40
  assert sum("UNSUPPORTED" in c[4] for c in CASES) >= 5


@pytest.mark.parametrize("strict", [False, True])
def test_tricky_cases(strict):
  opts = MathAccuracyOptions(strict=strict)
  responses = [c[0] for c in CASES]
  golds = [c[1] for c in CASES]
  got = ma.math_accuracy([""] * len(CASES), responses, answer=golds, opts=opts)
  want = [c[3 if strict else 2] for c in CASES]
  wrong = [(c[0], c[1], g, w, c[4]) for c, g, w in zip(CASES, got, want) if g != w]
  assert not wrong, "\n".join(map(repr, wrong))


def test_extracted_values_are_exact_fractions():
  assert ma.extract_answer("<answer>$1,234.50</answer>") == Fraction(2469, 2)
  assert ma.extract_answer(r"\boxed{\frac{2}{3}}") == Fraction(2, 3)
  assert ma.extract_answer("nothing") is None
  assert ma.parse_exact("18.") == 18 and ma.parse_exact("18 apples") is None


def test_order_is_configurable():
  response = r"<answer>17</answer> so \boxed{18}"
  assert ma.extract_answer(response) == 17
  assert ma.extract_answer(response, MathAccuracyOptions(order=("boxed", "answer_tag"))) == 18
  # Without last_number in the order, a bare trailing number is no answer.
  no_last = MathAccuracyOptions(order=("answer_tag", "boxed"))
  assert ma.extract_answer("she has 18 apples", no_last) is None


def test_strict_mode_does_not_fall_through():
  response = "<answer>eighteen</answer> 18"
  assert ma.extract_answer(response) == 18
  assert ma.extract_answer(response, MathAccuracyOptions(strict=True)) is None


def test_bad_settings_and_inputs_name_the_field():
  with pytest.raises(ValueError, match="order.*'boxd'"):
    MathAccuracyOptions(order=("boxd",))
  with pytest.raises(ValueError, match="'answer'"):
    ma.math_accuracy(["q"], ["a"], gold=["#### 1"])
  with pytest.raises(TypeError, match=r"completions\[1\]"):
    ma.math_accuracy(["q", "q"], ["1", None], answer=["#### 1"] * 2)
  with pytest.raises(ValueError, match="1 rows"):
    ma.math_accuracy(["q", "q"], ["1", "2"], answer=["#### 1"])


# --- the parser's fast paths are the plain ones --------------------------------------------------

# Pieces of text where numbers, LaTeX and answer markers meet; random strings of them exercise
# the number pattern's optional groups and the LaTeX rewrites together.
_PIECES = list("0123456789,.-−+$€£¥₹\\{}%/ #=\n!?:;()[]_x٣") + [
    "<answer>", "</answer>", r"\boxed{", r"\frac{", r"\dfrac", r"\text{", "{,}", r"\,", r"\!",
    r"\%", r"\$", " percent", "answer is", "####", r"\left", r"\(", r"\]", "1,000",
    "12,345,678", "3.50", ".5", "1e3", " or "]


def _fuzz(n: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def _reference_value(m: re.Match, text: str) -> Fraction | None:
  """A NUMBER_RE match's value by Fraction's own parse of its decimal digits; None where
  math_accuracy declines the number (no digits, over MAX_DIGITS, a zero or overlong
  denominator). A sign right after a word character or a closing bracket joins two tokens."""
  int_part, dec, den = (m.group("int") or "").replace(",", ""), m.group("dec") or "", m.group("den")
  digits = len(int_part) + len(dec[1:])
  if not 0 < digits <= ma.MAX_DIGITS or (den and (len(den) > ma.MAX_DIGITS or int(den) == 0)):
    return None
  value = Fraction((int_part or "0") + dec) / int(den or 1)
  before = text[m.start() - 1] if m.start() else ""
  joined = bool(before) and (before.isalnum() or before in "_)]}")
  negative = (m.group("sign") in ("-", "−") and not joined) or bool(m.group("sign2"))
  return -value if negative else value


def test_number_pattern_finds_what_it_finds_without_its_lookahead():
  """NUMBER_RE opens with NUMBER_START, a lookahead that only skips positions where no number
  can start: the pattern without it finds the same matches, with the same groups."""
  assert ma.NUMBER_RE.pattern.startswith(ma.NUMBER_START)
  plain = re.compile(ma.NUMBER_RE.pattern[len(ma.NUMBER_START):])
  texts = _fuzz(20_000) + [r["answer"] for r in _rows()[:2000]]
  seen = 0
  for text in texts:
    want = [(m.span(), m.groupdict()) for m in plain.finditer(text)]
    assert [(m.span(), m.groupdict()) for m in ma.NUMBER_RE.finditer(text)] == want, text
    assert bool(ma.NUMBER_RE.fullmatch(text)) == bool(plain.fullmatch(text)), text
    seen += len(want)
  assert seen > 50_000


def test_number_values_and_latex_clean_up_against_plain_references():
  """Each match's value against Fraction's parse of its decimal digits; and delatex, which
  skips text without '\\', '$', '{' or '}', against its rewrites applied to every text."""
  values = 0
  for text in _fuzz(20_000, seed=1):
    for m in ma.NUMBER_RE.finditer(text):
      got = ma._match_value(m, text)
      assert got == _reference_value(m, text), (text, m.group(0))
      values += got is not None
    assert ma.delatex(text) == ma._rewrite_latex(text), text
    plain = "".join(ch for ch in text if ch not in "\\${}")
    assert ma.delatex(plain) == ma._rewrite_latex(plain) == plain, plain
  assert values > 20_000
