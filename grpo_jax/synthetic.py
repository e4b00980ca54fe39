"""Arithmetic word problems in GSM8K's schema, generated from a seed, for the offline `tiny` preset.

Short ASCII text, so a 2-layer model with a small context can learn them:

    generate(2, "train", seed=0)  # ProblemSpec(): two 2-digit operands, "+"
    -> [{"question": "Mia has 47 pens and gets 31 more. How many pens does Mia have now?",
         "answer": "47 + 31 = <<47+31=78>>78\\n#### 78"}, ...]

Operations apply left to right, as the story tells them (no precedence). Which split a problem
belongs to depends only on its arithmetic (e.g. "47+31"), through a fixed hash, never on the
seed or the wording: no held-out expression is ever trained on, under any seed. Held out means
the expression as written: its reordered twin ("31+47", the same sum) hashes on its own, so at the
default 10% held out most held-out sums have their twin among the training problems.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

NAMES = ("Mia", "Ben", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Amy")
ITEMS = ("pens", "apples", "cards", "books", "coins", "eggs", "shells", "stickers")
# How each operation is told; "{x}" is the operand.
CLAUSES = {"+": "gets {x} more", "-": "gives away {x}", "*": "ends up with {x} times as many"}
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
  """Difficulty: operand count, digits per operand (exactly, e.g. 2 -> 10..99), operations."""
  num_operands: int = 2
  digits: int = 2
  ops: tuple[str, ...] = ("+",)
  heldout_fraction: float = 0.1

  def __post_init__(self):
    if self.num_operands < 2:
      raise ValueError(f"ProblemSpec.num_operands must be >= 2, got {self.num_operands}")
    if self.digits < 1:
      raise ValueError(f"ProblemSpec.digits must be >= 1, got {self.digits}")
    bad = [op for op in self.ops if op not in CLAUSES]
    if not self.ops or bad:
      raise ValueError(f"ProblemSpec.ops must be a non-empty subset of {tuple(CLAUSES)}, "
                       f"got {self.ops}")
    if not 0 < self.heldout_fraction < 1:
      raise ValueError(f"ProblemSpec.heldout_fraction must be in (0, 1), got "
                       f"{self.heldout_fraction}")


def split_of(expression: str, heldout_fraction: float) -> str:
  """'train' or 'test' for an expression like '47+31-5', from a fixed hash of its text."""
  h = int.from_bytes(hashlib.blake2b(expression.encode(), digest_size=8).digest(), "big")
  return "test" if h / 2.0**64 < heldout_fraction else "train"


def _draw(rng: np.random.Generator, spec: ProblemSpec) -> tuple[list[int], list[str]] | None:
  """Operands and ops, or None when a running total would go negative (then draw again)."""
  low, high = 10 ** (spec.digits - 1), 10 ** spec.digits
  operands = [int(x) for x in rng.integers(low, high, size=spec.num_operands)]
  ops = [spec.ops[i] for i in rng.integers(0, len(spec.ops), size=spec.num_operands - 1)]
  total = operands[0]
  for op, x in zip(ops, operands[1:]):
    total = total + x if op == "+" else total - x if op == "-" else total * x
    if total < 0:
      return None
  return operands, ops


def _render(rng: np.random.Generator, operands: list[int], ops: list[str]) -> dict[str, str]:
  name = NAMES[rng.integers(len(NAMES))]
  item = ITEMS[rng.integers(len(ITEMS))]
  clauses = [CLAUSES[op].format(x=x) for op, x in zip(ops, operands[1:])]
  # ", then" tells the left-to-right order the answer follows.
  story = clauses[0] + "".join(f", then {c}" for c in clauses[1:])
  question = (f"{name} has {operands[0]} {item} and {story}. "
              f"How many {item} does {name} have now?")
  steps, total = [], operands[0]
  for op, x in zip(ops, operands[1:]):
    new = total + x if op == "+" else total - x if op == "-" else total * x
    steps.append(f"{total} {op} {x} = <<{total}{op}{x}={new}>>{new}")
    total = new
  return {"question": question, "answer": "\n".join(steps) + f"\n#### {total}"}


def generate(n: int, split: str, seed: int = 0,
             spec: ProblemSpec = ProblemSpec()) -> list[dict[str, str]]:
  """n distinct problems (distinct arithmetic) of the given split, deterministic in seed."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  rng = np.random.default_rng([seed, SPLITS.index(split)])
  seen, rows = set(), []
  # Rejection sampling; the cap turns an impossible request into an error, not a hang.
  for _ in range(100 * n + 10_000):
    if len(rows) == n:
      return rows
    drawn = _draw(rng, spec)
    if drawn is None:
      continue
    operands, ops = drawn
    expression = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:]))
    if expression in seen or split_of(expression, spec.heldout_fraction) != split:
      continue
    seen.add(expression)
    rows.append(_render(rng, operands, ops))
  if len(rows) == n:
    return rows
  raise ValueError(f"found only {len(rows)} distinct {split} problems for {spec}, {n} asked: "
                   "ask for fewer or make the problems harder (more digits or operands)")


def write_splits(out_dir: str, n_train: int, n_test: int, seed: int = 0,
                 spec: ProblemSpec = ProblemSpec()) -> str:
  """Writes out_dir/{train,test}.jsonl, loadable with data.load_rows(out_dir, split)."""
  os.makedirs(out_dir, exist_ok=True)
  for split, n in (("train", n_train), ("test", n_test)):
    path = os.path.join(out_dir, f"{split}.jsonl")
    with open(path + ".tmp", "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in generate(n, split, seed, spec))
    os.replace(path + ".tmp", path)  # A reader never sees a half-written file.
  return out_dir
