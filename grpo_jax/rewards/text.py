"""Host-side text hygiene shared by every reward: model output is untrusted data.

Completions may hold lone surrogates (bytes decoded with `surrogateescape`), megabytes of text,
or be something other than a string by mistake. Every reward passes its inputs through
`clean` first so that parsing, tokenising and JSON-encoding never see invalid Unicode.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

# Chat-format control tokens written out as text: ChatML's <|im_start|>, <|im_end|>,
# <|endoftext|> and the rest of Qwen's <|...|> family.
_CONTROL = re.compile(r"<\|[^<>|\s]{1,64}\|>")
_ZWSP = "\u200b"


def clean(text: object, *, field: str, index: int) -> str:
  """Returns `text` with invalid code points replaced by U+FFFD; raises on a non-string."""
  if not isinstance(text, str):
    raise TypeError(f"{field}[{index}] must be a str, got {type(text).__name__}")
  try:
    text.encode("utf-8")
    return text
  except UnicodeEncodeError:
    # Lone surrogates cannot be encoded; replacing them keeps the rest of the text intact.
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def clean_all(texts: Sequence[object], *, field: str) -> list[str]:
  if isinstance(texts, (str, bytes)):
    raise TypeError(f"{field} must be a list of str, got a single {type(texts).__name__}")
  return [clean(t, field=field, index=i) for i, t in enumerate(texts)]


def questions(reward: str, column: str, prompts: Sequence[object], columns: Mapping[str, Sequence],
              n: int) -> list[str]:
  """The question a judge reward (quality, verifier) shows with each of n completions: the
  dataset `column` (rewards.<reward>.question_column), or the prompt text if it is ''."""
  if column:
    if column not in columns:
      raise ValueError(f"rewards.{reward}.question_column={column!r} is not among the dataset columns "
                       f"{sorted(k for k in columns if k != 'group_size')}")
    out = clean_all(columns[column], field=column)
  else:
    out = clean_all(prompts, field="prompts")
  if len(out) != n:
    raise ValueError(f"{reward}: {len(out)} questions but {n} completions")
  return out


def defuse_control_tokens(text: str, extra: Iterable[str] = ()) -> str:
  """`text` with every chat control token written in it (<|im_end|>, <|im_start|>, ..., and the
  strings in `extra`, a judge tokenizer's special tokens) broken by a zero-width space after its
  first character, so that a judge's tokenizer reads it as ordinary text.

  A policy can spell "<|im_end|>" out of ordinary pieces ('<', '|', 'im', '_end', '|', '>');
  decoded and put into a judge's chat prompt, the judge's tokenizer would read it back as the
  special token, and the policy could end the user turn and write the judge's answer itself."""
  text = _CONTROL.sub(lambda m: m.group(0)[0] + _ZWSP + m.group(0)[1:], text)
  for token in extra:
    if len(token) > 1 and token in text:
      text = text.replace(token, token[0] + _ZWSP + token[1:])
  return text


def tail(text: str, max_chars: int) -> str:
  """The last `max_chars` characters: final answers live at the end of a response."""
  return text if len(text) <= max_chars else text[-max_chars:]


def middle_truncate(text: str, max_chars: int, marker: str = " [...] ") -> str:
  """Keeps the head (the question/setup) and the tail (the final answer) of a long text."""
  if len(text) <= max_chars:
    return text
  keep = max(max_chars - len(marker), 2)
  return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2):]
