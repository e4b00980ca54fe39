"""`math_accuracy`: exact numeric match of the response's final answer with the GSM8K gold.

Range: {0.0, 1.0}; None when the gold answer itself cannot be parsed (row cannot be scored).

The gold is the number after the last '####' of the dataset's `answer` column (or the whole
column if it is a bare number). The response's answer is looked for in the forms of
`order`, first form first (see "Answer forms" below); numbers are compared as exact fractions
after normalisation (see "Numbers" below: 1,000 == 1000, $18.00 == 18, 18% == 18, 3/4 == 0.75).

Lenient mode (default): the first form that yields a number wins; within a form the last
occurrence wins (models restate and correct themselves); a span that is not a bare number
gives its number by form: tag/boxed -> the last number in it ("<answer>3+4 = 7</answer>"),
'####' -> the first, "the answer is" -> the first after the last '=' if there is one, else
the first ("the answer is 18 apples, 3 more than 15" -> 18).
Strict mode: the first form that is *present* decides, later forms are not consulted; its
spans must be bare numbers, and several spans with different values (hedging, e.g.
"\\boxed{17} or \\boxed{18}") score 0. Only the last MAX_SPANS occurrences of a form are
considered (this bounds the work on responses that repeat a marker thousands of times).

Numbers, as written in GSM8K answers and model responses, parse to exact `Fraction`s.
Supported (all compare exactly, so 18 == 18.0 == 18.00 == $18 == 18% == 36/2):
  signs           -5, −5 (U+2212), +5; a '-' right after a digit or letter is a range or
                  subtraction (3-5, x-2), not a sign
  thousands       1,000  12,345,678  (groups of three after a comma)
  decimals        3.50   .5
  currency        $18  $-18  -$18  €, £, ¥, ₹  and LaTeX \\$
  percent         18%  18\\%  18 percent  -> 18 (GSM8K golds state percentages as bare numbers)
  fractions       3/4  \\frac{3}{4}  \\dfrac{3}{4}  \\tfrac{3}{4}
  LaTeX spacing   1{,}000  1\\,000  \\text{...} wrappers, \\! and \\, removed inside extracted spans
Unsupported, by design (they parse as something else or as nothing):
  1 000 (space-separated thousands), 1.000,50 (European), 1e3 (scientific), mixed numbers
  (2 1/2 reads as the last number 1/2), number words (eighteen), more than MAX_DIGITS digits.

Answer forms: one finder per surface form returns that form's candidate answer spans, in text
order. Everything here runs in linear time on any input: tags are found with `str.find`,
braces are matched by one stack pass over the text, and no regex has nested quantifiers that
can fail after consuming input.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from grpo_jax.rewards import text as text_lib  # `text` names the strings parsed below
from grpo_jax.rewards.options import MathAccuracyOptions

# --- numbers -------------------------------------------------------------------------------------

# Longer digit strings are not answers; also keeps int() below Python's 4,300-digit limit.
MAX_DIGITS = 40

# Every match starts with one of these characters (a sign, a currency sign or LaTeX's \$, a
# digit, or the '.' of ".5"). Stated first as a lookahead, it fails the other positions of a
# search at once instead of after the pattern's optional groups: the same matches, about twice
# as fast (tests/rewards_math_test.py compares the two patterns).
NUMBER_START = r"(?=[-−+$€£¥₹\\\d.])"
NUMBER_RE = re.compile(
    NUMBER_START +
    r"(?P<sign>[-−+])?"
    r"(?P<cur>[$€£¥₹]|\\\$)?"
    r"(?P<sign2>[-−])?"
    r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)?"
    r"(?P<dec>\.\d+)?"
    r"(?(int)|(?(dec)|(?!)))"  # at least an integer part or a decimal part
    r"(?: ?/ ?(?P<den>\d+)(?!\.\d|,\d{3}))?"
    r"(?P<pct> ?(?:%|\\%| percent\b))?"
)

_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]{1,64})\}\s*\{([^{}]{1,64})\}")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]{0,200})\}")
_LATEX_NOISE_RE = re.compile(r"\\[!,;: ]|\\left|\\right|\\\(|\\\)|\\\[|\\\]")
_LATEX_CHARS_RE = re.compile(r"[\\${}]")


def _is_word_char(ch: str) -> bool:
  return ch.isalnum() or ch == "_"


def _match_value(m: re.Match, text: str) -> Fraction | None:
  """The value of a NUMBER_RE match in `text`, or None if it is not a usable number."""
  int_part = (m.group("int") or "").replace(",", "")
  decimals = (m.group("dec") or ".")[1:]  # the digits after the point
  digits = len(int_part) + len(decimals)
  if digits == 0 or digits > MAX_DIGITS:
    return None
  # One Fraction from integers (12.50 -> 1250/100): it reduces once, where adding and dividing
  # Fractions reduces at every operation.
  num, scale = int(int_part + decimals), 10 ** len(decimals)
  den = m.group("den")
  if den is not None:
    if len(den) > MAX_DIGITS or int(den) == 0:
      return None
    scale *= int(den)
  sign = m.group("sign")
  start = m.start()
  # "3-5" and "x-2": the dash joins two tokens, so it is not a minus sign.
  if sign and start > 0 and (_is_word_char(text[start - 1]) or text[start - 1] in ")]}"):
    sign = None
  if sign in ("-", "−") or m.group("sign2"):
    num = -num
  return Fraction(num, scale)


def first_number(text: str) -> Fraction | None:
  for m in NUMBER_RE.finditer(text):
    v = _match_value(m, text)
    if v is not None:
      return v
  return None


def last_number(text: str) -> Fraction | None:
  # Values are computed from the end only: building a Fraction for every number is the cost.
  for m in reversed(list(NUMBER_RE.finditer(text))):
    v = _match_value(m, text)
    if v is not None:
      return v
  return None


def delatex(span: str) -> str:
  """Rewrites the LaTeX wrappers models put around numbers into plain text."""
  # Every rewrite needs a '\\', '$', '{' or '}': text without them (most of it) is skipped.
  return _rewrite_latex(span) if _LATEX_CHARS_RE.search(span) else span


def _rewrite_latex(span: str) -> str:
  span = _FRAC_RE.sub(r"\1/\2", span)
  span = _TEXT_RE.sub(r" \1", span)
  # '$' is either currency or a math delimiter; the value is the same without it.
  span = span.replace("{,}", ",").replace("\\%", "%").replace("\\$", "").replace("$", "")
  span = re.sub(r"(?<=\d)\\,(?=\d{3})", ",", span)  # 1\,000 is a thousands separator
  span = _LATEX_NOISE_RE.sub(" ", span)
  return span.replace("{", " ").replace("}", " ")


def parse_exact(span: str) -> Fraction | None:
  """The value of `span` if it is one number and nothing else (after LaTeX clean-up).

  Trailing sentence punctuation is allowed: "18." and "$18.00!" are 18.
  """
  span = delatex(span).strip().rstrip(".!;:").strip()
  m = NUMBER_RE.fullmatch(span)
  return _match_value(m, span) if m else None


# --- answer forms --------------------------------------------------------------------------------

# Enough for any real answer span; longer spans are cut so later parsing stays cheap.
MAX_SPAN_CHARS = 400
# Only the last occurrences of a form are returned: a response that repeats '####' thousands
# of times would otherwise cost (occurrences x span length) to parse.
MAX_SPANS = 16

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s{0,3}\{")
_ANSWER_IS_RE = re.compile(r"(?i)\banswer(?:[ \t]{1,3}(?:is|was|will be|would be)\b[ \t]*:?|[ \t]*:)")
_HASHES_RE = re.compile(r"####")
# The answer phrase ends at a line break or a sentence end ('.' not followed by a digit).
_SENTENCE_END_RE = re.compile(r"\n|\.(?!\d)|\?|!")


def _answer_tag(text: str, open_tag: str = "<answer>", close_tag: str = "</answer>") -> list[str]:
  bounds, pos = [], 0
  while True:
    start = text.find(open_tag, pos)
    if start < 0:
      break
    end = text.find(close_tag, start + len(open_tag))
    if end < 0:
      break  # an unclosed tag (truncated output) states no answer
    bounds.append((start + len(open_tag), end))
    pos = end + len(close_tag)
  return [text[a:b][:MAX_SPAN_CHARS] for a, b in bounds[-MAX_SPANS:]]


def _matching_braces(text: str) -> dict[int, int]:
  """Maps the index of each '{' to the index of its matching '}' (one pass, O(n))."""
  stack, match = [], {}
  for i, ch in enumerate(text):
    if ch == "{":
      stack.append(i)
    elif ch == "}" and stack:
      match[stack.pop()] = i
  return match


def _boxed(text: str) -> list[str]:
  hits = list(_BOXED_RE.finditer(text))
  if not hits:
    return []
  match = _matching_braces(text)
  bounds = []
  for m in hits:
    open_idx = m.end() - 1
    close_idx = match.get(open_idx)
    if close_idx is not None:  # unbalanced \boxed{ ... is no answer
      bounds.append((open_idx + 1, close_idx))
  return [text[a:b][:MAX_SPAN_CHARS] for a, b in bounds[-MAX_SPANS:]]


def _after_phrase(text: str, regex: re.Pattern) -> list[str]:
  out = []
  for end_pos in [m.end() for m in regex.finditer(text)][-MAX_SPANS:]:
    rest = text[end_pos: end_pos + MAX_SPAN_CHARS]
    end = _SENTENCE_END_RE.search(rest)
    out.append(rest[: end.start()] if end else rest)
  return out


def _hashes(text: str) -> list[str]:
  out = []
  for end_pos in [m.end() for m in _HASHES_RE.finditer(text)][-MAX_SPANS:]:
    rest = text[end_pos: end_pos + MAX_SPAN_CHARS]
    newline = rest.find("\n")
    out.append(rest if newline < 0 else rest[:newline])
  return out


# Every form of options.ANSWER_FORMS but 'last_number', which reads the whole text instead.
FINDERS = {
    "answer_tag": _answer_tag,
    "boxed": _boxed,
    "hashes": _hashes,
    "answer_is": lambda text: _after_phrase(text, _ANSWER_IS_RE),
}


def spans(text: str, method: str) -> list[str]:
  """The candidate answer spans of one form, in text order.

    >>> spans("<think>3+4</think><answer>7</answer>", "answer_tag")
    ['7']
    >>> spans(r"so \\boxed{\\frac{1}{2}} or \\boxed{3}", "boxed")
    ['\\\\frac{1}{2}', '3']
  """
  if method not in FINDERS:
    raise ValueError(f"unknown answer-extraction method {method!r}; known: {sorted(FINDERS)}")
  return FINDERS[method](text)


# --- the reward ----------------------------------------------------------------------------------

def _lenient_span_value(span: str, method: str) -> Fraction | None:
  exact = parse_exact(span)
  if exact is not None:
    return exact
  plain = delatex(span)
  if method in ("answer_tag", "boxed"):
    return last_number(plain)
  if method == "answer_is" and "=" in plain:
    return first_number(plain[plain.rfind("=") + 1:])
  return first_number(plain)


def extract_answer(response: str, opts: MathAccuracyOptions = MathAccuracyOptions()) -> Fraction | None:
  """The response's final answer as an exact fraction, or None if it states none."""
  response = text_lib.tail(response, opts.max_chars)
  for method in opts.order:
    if method == "last_number":
      value = last_number(delatex(response))
      if value is not None or opts.strict:
        return value
      continue
    found = spans(response, method)
    if opts.strict:
      if not found:
        continue
      values = {parse_exact(s) for s in found}
      return values.pop() if len(values) == 1 else None  # {None} -> None as well
    for span in reversed(found):
      value = _lenient_span_value(span, method)
      if value is not None:
        return value
  return None


def gold_value(answer: str) -> Fraction | None:
  """The GSM8K gold value: the text after the last '####' (e.g. '... #### 1,200' -> 1200), or
  the whole answer if it has no '####' (a bare number)."""
  _, sep, after = answer.rpartition("####")
  return parse_exact(after.strip()) if sep else parse_exact(answer)


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
  golds = text_lib.clean_all(columns[opts.gold_column], field=opts.gold_column)
  completions = text_lib.clean_all(completions, field="completions")
  if len(golds) != len(completions):
    raise ValueError(f"{opts.gold_column} has {len(golds)} rows but completions has {len(completions)}")
  out: list[float | None] = []
  gold_of = {}  # a group's G rows share their gold text: parsed once
  for gold_text, response in zip(golds, completions):
    if gold_text not in gold_of:
      gold_of[gold_text] = gold_value(text_lib.tail(gold_text, opts.max_chars))
    gold = gold_of[gold_text]
    if gold is None:
      out.append(None)
      continue
    pred = extract_answer(response, opts)
    out.append(1.0 if pred is not None and pred == gold else 0.0)
  return out
