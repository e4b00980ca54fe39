"""Where a response states its final answer: one finder per surface form.

Each finder returns the candidate answer spans of one form, in text order. They run in
linear time on any input: tags are found with `str.find`, braces are matched by one
stack pass over the text, and the phrase regexes have no nested quantifiers.

  >>> spans("<think>3+4</think><answer>7</answer>", "answer_tag")
  ['7']
  >>> spans(r"so \\boxed{\\frac{1}{2}} or \\boxed{3}", "boxed")
  ['\\\\frac{1}{2}', '3']
"""
from __future__ import annotations

import re

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


FINDERS = {
    "answer_tag": _answer_tag,
    "boxed": _boxed,
    "hashes": _hashes,
    "answer_is": lambda text: _after_phrase(text, _ANSWER_IS_RE),
}
# 'last_number' is not a span finder: it is handled by the caller on the whole text.
METHODS = tuple(FINDERS) + ("last_number",)


def spans(text: str, method: str) -> list[str]:
  if method not in FINDERS:
    raise ValueError(f"unknown answer-extraction method {method!r}; known: {sorted(FINDERS)}")
  return FINDERS[method](text)
