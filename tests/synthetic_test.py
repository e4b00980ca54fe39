"""Synthetic word problems: correct answers (re-read from the text), disjoint splits, determinism."""
import operator
import re

import pytest

from grpo_jax import data, synthetic
from grpo_jax import tokenizer as tokenizer_lib

# How a reader maps the story's phrases to arithmetic; independent of the generator's tables.
PHRASES = {r"gets (\d+) more": operator.add, r"gives away (\d+)": operator.sub,
           r"ends up with (\d+) times as many": operator.mul}
SYMBOL = {operator.add: "+", operator.sub: "-", operator.mul: "*"}
HARD = synthetic.ProblemSpec(num_operands=3, digits=2, ops=("+", "-", "*"))


def _read_story(question):
  """(start, [(fn, x), ...]) read from the question, clause by clause in order."""
  start = int(re.match(r"\w+ has (\d+) ", question).group(1))
  story = question.split(" and ", 1)[1].split(". How many")[0]
  steps = []
  for clause in story.split(", then "):
    matches = [(fn, int(m.group(1))) for pattern, fn in PHRASES.items()
               if (m := re.fullmatch(pattern, clause))]
    assert len(matches) == 1, clause
    steps.append(matches[0])
  return start, steps


def _expression(question):
  start, steps = _read_story(question)
  return str(start) + "".join(SYMBOL[fn] + str(x) for fn, x in steps)


@pytest.mark.parametrize("spec", [synthetic.ProblemSpec(), HARD])
def test_answers_are_right_and_in_gsm8k_format(spec):
  for split in ("train", "test"):
    rows = synthetic.generate(300, split, seed=1, spec=spec)
    assert len(rows) == 300
    for row in rows:
      assert set(row) == {"question", "answer"}
      start, steps = _read_story(row["question"])
      assert len(steps) == spec.num_operands - 1
      total = start
      for fn, x in steps:
        assert SYMBOL[fn] in spec.ops
        assert len(str(x)) == spec.digits
        total = fn(total, x)
      assert len(str(start)) == spec.digits
      assert total >= 0
      assert data.gold_answer(row["answer"]) == str(total)
      # Every <<lhs=rhs>> calculator note is true arithmetic.
      for lhs, rhs in re.findall(r"<<([\d+*-]+)=(\d+)>>", row["answer"]):
        assert eval(lhs) == int(rhs)  # lhs is digits and operators only (matched above)
      assert row["question"].isascii() and row["answer"].isascii()


def test_splits_disjoint_deterministic_and_seeded():
  train = synthetic.generate(2000, "train", seed=0)
  test = synthetic.generate(300, "test", seed=0)
  train_expr = {_expression(r["question"]) for r in train}
  test_expr = {_expression(r["question"]) for r in test}
  assert len(train_expr) == 2000 and len(test_expr) == 300  # distinct within a split
  assert not train_expr & test_expr
  # Held-out arithmetic stays held out under other seeds too.
  other_train = synthetic.generate(2000, "train", seed=5)
  assert not {_expression(r["question"]) for r in other_train} & test_expr
  assert other_train != train
  assert synthetic.generate(2000, "train", seed=0) == train
  # About heldout_fraction of all 90*90 two-digit sums are held out.
  all_sums = [f"{a}+{b}" for a in range(10, 100) for b in range(10, 100)]
  held = sum(synthetic.split_of(e, 0.1) == "test" for e in all_sums)
  assert 0.08 < held / len(all_sums) < 0.12


def test_fits_tiny_tokenizer_and_loads_through_data(tmp_path):
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.build_tiny_tokenizer(str(tmp_path / "tok")))
  out = synthetic.write_splits(str(tmp_path / "synth"), n_train=200, n_test=50, seed=2, spec=HARD)
  rows = data.load_rows(out, split="train", cache_dir=str(tmp_path / "cache"))
  assert rows == synthetic.generate(200, "train", seed=2, spec=HARD)
  assert len(data.load_rows(out, split="test", cache_dir=str(tmp_path / "cache"))) == 50
  prompts = data.encode_prompts(tok, [data.build_prompt(tok, r["question"]) for r in rows])
  # Short enough for a tiny model's context; only plain bytes plus ChatML tokens.
  assert max(len(p) for p in prompts) <= 160
  for row, ids in zip(rows, prompts):
    assert tok.decode(ids, skip_special_tokens=True) == f"user\n{row['question']}\nassistant\n"


def test_bad_specs_and_impossible_requests_fail_clearly():
  with pytest.raises(ValueError, match="ops"):
    synthetic.ProblemSpec(ops=("/",))
  with pytest.raises(ValueError, match="num_operands"):
    synthetic.ProblemSpec(num_operands=1)
  with pytest.raises(ValueError, match="split"):
    synthetic.generate(3, "validation")
  # One-digit sums: 81 expressions in all, so 100 distinct training problems cannot exist.
  with pytest.raises(ValueError, match="found only .* distinct train problems"):
    synthetic.generate(100, "train", spec=synthetic.ProblemSpec(digits=1))
