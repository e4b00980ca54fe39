"""Agreement of math_accuracy with math-verify on responses generated from real GSM8K rows.

Each response is a real gold solution's reasoning (the text before '####') followed by a final
answer in one of TEMPLATES' forms, right or wrong. Every template on which the two checkers
disagree is listed in DISAGREEMENTS with the reason and the exact count, so a change in either
checker shows up here.

Run `pytest -s tests/rewards_math_verify_test.py` to see the agreement table.
"""
import json
from pathlib import Path

import pytest

from grpo_jax.rewards import math_accuracy as ma
from grpo_jax.rewards.options import MathAccuracyOptions

math_verify = pytest.importorskip("math_verify")

GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "gsm8k"
N_ROWS = 40

# name -> f(reasoning, gold int) -> response
TEMPLATES = {
    "boxed": lambda r, g: f"{r}\nSo the answer is $\\boxed{{{g}}}$.",
    "answer_tags": lambda r, g: f"<think>{r}</think>\n<answer>{g}</answer>",
    "answer_is": lambda r, g: f"{r}\nThe answer is {g}.",
    "hashes": lambda r, g: f"{r}\n#### {g}",
    "thousands": lambda r, g: f"{r}\nThe answer is $\\boxed{{{g:,}}}$.",
    "dollars_cents": lambda r, g: f"{r}\nThe answer is \\boxed{{\\${g}.00}}.",
    "dollars_text": lambda r, g: f"{r}\nThe answer is ${g}.00.",
    "percent_tag": lambda r, g: f"{r}\n<answer>{g}%</answer>",
    "fraction": lambda r, g: f"{r}\nThe answer is $\\boxed{{\\frac{{{2 * g}}}{{2}}}}$.",
    "decimal": lambda r, g: f"{r}\nThe answer is $\\boxed{{{g}.0}}$.",
    "last_number": lambda r, g: f"{r}\nSo in total it is {g} altogether",
    "wrong_boxed": lambda r, g: f"{r}\nSo the answer is $\\boxed{{{g + 1}}}$.",
    "wrong_tag": lambda r, g: f"<think>{r}</think>\n<answer>{g - 1}</answer>",
    "negated": lambda r, g: f"{r}\nThe answer is $\\boxed{{{-g}}}$.",
    "right_then_check": lambda r, g: f"{r}\nThe answer is {g}. Check: {g} + 1 = {g + 1}.",
    "hedged_boxed": lambda r, g: f"{r}\nEither $\\boxed{{{g + 1}}}$ or $\\boxed{{{g}}}$.",
    "no_answer": lambda r, g: "I am not sure how to solve this problem.",
}

# template -> (number of disagreements among N_ROWS responses, why). Measured with
# math-verify 0.9.0; math-verify does not read inside <answer> tags (the number is glued to the
# tag, so its expression extraction skips it) and falls back to the last number standing alone
# in the text, which in these responses is the end of the gold reasoning.
DISAGREEMENTS = {
    "answer_tags": (2, "math-verify skips '<answer>15</answer>' and reads the reasoning's last "
                       "number; in 38 rows that is the gold result (agreement by luck), in 2 it "
                       "is not ('... out of the 24 liters', '... in the 40 minutes'): ours 1, mv 0."),
    "percent_tag": (2, "same 2 rows as answer_tags: the '15%' in the tag is skipped by math-verify."),
    "wrong_tag": (38, "the tag holds gold-1 and we score 0; math-verify skips the tag and reads "
                      "the reasoning's final result, i.e. scores a wrong final answer as right "
                      "(the 2 rows above end on another number, so both say 0 there)."),
    "right_then_check": (40, "'The answer is 18. Check: 18 + 1 = 19.': math-verify takes the last "
                             "expression (19), we take the number after 'The answer is' (18)."),
    "hedged_boxed": (40, "'\\boxed{19} or \\boxed{18}': math-verify parses the set {18, 19} and "
                         "rejects it; lenient math_accuracy takes the last box (18). Strict mode "
                         "rejects hedging too (checked below)."),
}


def _data():
  rows = []
  with open(GSM8K / "test.jsonl") as f:
    for line in f:
      rows.append(json.loads(line))
      if len(rows) == N_ROWS:
        break
  out = []
  for row in rows:
    reasoning, _, gold_text = row["answer"].rpartition("####")
    gold = int(gold_text.strip().replace(",", ""))
    for name, make in TEMPLATES.items():
      out.append((name, make(reasoning.strip(), gold), row["answer"], gold))
  return out


def _math_verify_correct(response: str, gold: int) -> bool:
  gold_parsed = math_verify.parse(str(gold), extraction_config=[math_verify.ExprExtractionConfig()])
  return bool(math_verify.verify(gold_parsed, math_verify.parse(response)))


def test_agreement_with_math_verify():
  data = _data()
  ours = ma.math_accuracy([""] * len(data), [d[1] for d in data], answer=[d[2] for d in data])
  theirs = [float(_math_verify_correct(d[1], d[3])) for d in data]
  per_template: dict[str, list] = {name: [] for name in TEMPLATES}
  for (name, response, _, gold), o, t in zip(data, ours, theirs):
    if o != t:
      per_template[name].append((response[-70:], gold, o, t))
  n_dis = sum(len(v) for v in per_template.values())
  print(f"\nmath_accuracy vs math-verify on {len(data)} responses ({N_ROWS} GSM8K test rows x "
        f"{len(TEMPLATES)} forms): agreement {1 - n_dis / len(data):.3f} ({n_dis} disagreements)")
  for name in TEMPLATES:
    ours_mean = sum(o for (n, *_), o in zip(data, ours) if n == name) / N_ROWS
    theirs_mean = sum(t for (n, *_), t in zip(data, theirs) if n == name) / N_ROWS
    print(f"  {name:18s} ours {ours_mean:.2f}  math-verify {theirs_mean:.2f}  disagree {len(per_template[name])}")
    for tail, gold, o, t in per_template[name][:2]:
      print(f"      e.g. ...{tail!r} gold={gold} ours={o} math-verify={t}")
  got = {name: len(v) for name, v in per_template.items() if v}
  want = {name: n for name, (n, _) in DISAGREEMENTS.items()}
  assert got == want, f"disagreements per template {got} differ from the explained ones {want}"
  # Where they agree, the verdict must be the designed one: right forms 1, wrong forms 0.
  wrong_forms = {"wrong_boxed", "wrong_tag", "negated", "no_answer"}
  for (name, *_), o in zip(data, ours):
    if name in wrong_forms:
      assert o == 0.0, name
    else:
      assert o == 1.0, name
  strict = ma.math_accuracy([""] * len(data), [d[1] for d in data], answer=[d[2] for d in data],
                            opts=MathAccuracyOptions(strict=True))
  assert all(s == 0.0 for (name, *_), s in zip(data, strict) if name == "hedged_boxed")
