"""Numbers as written in GSM8K answers and model responses, parsed to exact `Fraction`s.

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

Every pattern here is linear-time: no nested quantifiers that can fail after consuming input.
"""
from __future__ import annotations

import re
from fractions import Fraction

# Longer digit strings are not answers; also keeps int() below Python's 4,300-digit limit.
MAX_DIGITS = 40

NUMBER_RE = re.compile(
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


def _is_word_char(ch: str) -> bool:
  return ch.isalnum() or ch == "_"


def value(m: re.Match, text: str) -> Fraction | None:
  """The value of a NUMBER_RE match in `text`, or None if it is not a usable number."""
  int_part = (m.group("int") or "").replace(",", "")
  dec = m.group("dec") or ""
  digits = len(int_part) + max(len(dec) - 1, 0)
  if digits == 0 or digits > MAX_DIGITS:
    return None
  num = Fraction(int(int_part or "0"))
  if dec:
    num += Fraction(int(dec[1:]), 10 ** (len(dec) - 1))
  den = m.group("den")
  if den is not None:
    if len(den) > MAX_DIGITS or int(den) == 0:
      return None
    num /= int(den)
  sign = m.group("sign")
  start = m.start()
  # "3-5" and "x-2": the dash joins two tokens, so it is not a minus sign.
  if sign and start > 0 and (_is_word_char(text[start - 1]) or text[start - 1] in ")]}"):
    sign = None
  if sign in ("-", "−") or m.group("sign2"):
    num = -num
  return num


def first_number(text: str) -> Fraction | None:
  for m in NUMBER_RE.finditer(text):
    v = value(m, text)
    if v is not None:
      return v
  return None


def last_number(text: str) -> Fraction | None:
  # Values are computed from the end only: building a Fraction for every number is the cost.
  for m in reversed(list(NUMBER_RE.finditer(text))):
    v = value(m, text)
    if v is not None:
      return v
  return None


def delatex(span: str) -> str:
  """Rewrites the LaTeX wrappers models put around numbers into plain text."""
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
  return value(m, span) if m else None


def parse_gold(answer: str) -> Fraction | None:
  """The GSM8K gold value: the text after the last '####' (e.g. '... #### 1,200' -> 1200)."""
  head, sep, tail = answer.rpartition("####")
  if not sep:
    return None
  return parse_exact(tail.strip())
