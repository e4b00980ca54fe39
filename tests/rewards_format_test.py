"""format reward: a hand table, and random tag soups checked against a reference regex."""
import random
import re

import pytest

from grpo_jax.rewards import format_reward as fr
from grpo_jax.rewards.options import FormatOptions

_TAG = r"(?:<think>|</think>|<answer>|</answer>)"
_BODY = rf"((?:(?!{_TAG}).)*)"


def _reference(s: str, think: str = "required", trailing: bool = False) -> bool:
  """The default template as one regex (fine on the short strings used here)."""
  think_part = {"required": rf"<think>{_BODY}</think>", "in_prompt": rf"{_BODY}</think>",
                # require_think=False: a think block is optional, but well formed if present.
                "none": rf"(?:<think>{_BODY}</think>)?"}[think]
  tail = r".*" if trailing else r"\s*"
  m = re.fullmatch(rf"\s*{think_part}\s*<answer>{_BODY}</answer>({tail})", s, re.S)
  if not m or not m.groups()[-2].strip():
    return False
  # With text allowed after the answer, that text still may not open another tagged block.
  return not (trailing and re.search(_TAG, m.groups()[-1]))


CASES = [
    ("<think>3+4=7</think>\n<answer>7</answer>", True),
    ("  <think>\nx\n</think>  <answer> 7 </answer>\n\n", True),
    ("<think></think><answer>7</answer>", True),  # an empty think block is still the format
    ("<think>x</think><answer>7</answer> extra", False),
    ("<think>x</think> so <answer>7</answer>", False),
    ("hi <think>x</think><answer>7</answer>", False),
    ("<think>x</think><answer> </answer>", False),
    ("<answer>7</answer>", False),
    ("<think>x</think>", False),
    ("<think>x<answer>7</answer></think>", False),
    ("<think>x</think><answer>7</answer><answer>8</answer>", False),
    ("<think>a</think><think>b</think><answer>7</answer>", False),
    ("<answer>7</answer><think>x</think>", False),
    ("<think>x</think><answer>7", False),
    ("", False),
]


@pytest.mark.parametrize("text,ok", CASES)
def test_hand_table(text, ok):
  assert fr.follows_format(text) is ok
  assert _reference(text) is ok  # the reference agrees with the table too
  assert fr.format_reward([""], [text]) == [0.1 if ok else -0.1]


def _soups(n: int, seed: int, think_open: bool):
  pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "7"]
  rng = random.Random(seed)
  # Bias towards well-formed skeletons so that both outcomes are common.
  skeleton = ["<think>"] * think_open + ["x", "</think>", "\n", "<answer>", "7", "</answer>"]
  out = []
  for _ in range(n):
    s = list(skeleton) if rng.random() < 0.5 else []
    for _ in range(rng.randint(0, 4)):
      s.insert(rng.randint(0, len(s)), rng.choice(pieces))
    out.append("".join(s))
  return out


@pytest.mark.parametrize("think,trailing", [("required", False), ("in_prompt", False), ("none", False),
                                            ("required", True)])
def test_random_soups_match_reference(think, trailing):
  opts = FormatOptions(require_think=think != "none", think_in_prompt=think == "in_prompt",
                       allow_text_after=trailing)
  soups = _soups(4000, seed=len(think) + trailing, think_open=think != "in_prompt")
  got = [fr.follows_format(s, opts) for s in soups]
  want = [_reference(s, think, trailing) for s in soups]
  mismatches = [(s, g, w) for s, g, w in zip(soups, got, want) if g != w]
  assert not mismatches, mismatches[:5]
  assert 0.1 < sum(want) / len(want) < 0.9


def test_a_think_block_the_prompt_opened_must_be_closed():
  """think_in_prompt: the prompt ends with <think>, so an answer before </think> is still
  inside the reasoning, with require_think or without."""
  for require in (True, False):
    opts = FormatOptions(think_in_prompt=True, require_think=require)
    assert not fr.follows_format("<answer>7</answer>", opts)
    assert fr.follows_format("3+4=7</think>\n<answer>7</answer>", opts)


def test_custom_tags_and_scores():
  opts = FormatOptions(think_open="<reasoning>", think_close="</reasoning>", correct=1.0, incorrect=0.0)
  out = fr.format_reward(["", ""], ["<reasoning>r</reasoning><answer>5</answer>", "<think>r</think><answer>5</answer>"],
                         opts=opts)
  assert out == [1.0, 0.0]


def test_bad_options_name_the_field():
  with pytest.raises(ValueError, match="think_open"):
    FormatOptions(think_open="")
  with pytest.raises(ValueError, match="correct"):
    FormatOptions(correct="high")
