"""Where a finished tiny-preset run's greedy answers go wrong, by kind of sum (tiny_seeds.md).

    python experiments/tiny_errors.py runs/tiny_seeds/seed=8 [more run dirs...]

Loads the run's final_model with transformers (PyTorch, CPU; the test dependencies), answers the
run's own held-out problems (data/test.jsonl) greedily with up to 20 new tokens, as the
trainer's eval does, and prints accuracy split by whether the units digits carry and whether the
sum has three digits, and per-digit accuracy of the '#### N' answer (hundreds, tens, units).
Two-operand addition problems only (the tiny preset's).
"""
import collections
import json
import os
import re
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

_OPERANDS = re.compile(r"has (\d+) \w+ and gets (\d+) more")


def answers(run_dir, batch_size=128, max_new_tokens=20):
  """[(a, b, the model's '#### N' answer or '')] over the run's held-out problems."""
  model_dir = os.path.join(run_dir, "final_model")
  tok = AutoTokenizer.from_pretrained(model_dir)
  tok.padding_side = "left"
  model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
  with open(os.path.join(run_dir, "data", "test.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  out = []
  for i in range(0, len(rows), batch_size):
    batch = rows[i:i + batch_size]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["question"]}],
                                       tokenize=False, add_generation_prompt=True) for r in batch]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
      ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)
    for r, row_ids in zip(batch, ids):
      text = tok.decode(row_ids[enc["input_ids"].shape[1]:], skip_special_tokens=True)
      a, b = map(int, _OPERANDS.search(r["question"]).groups())
      m = re.search(r"#### *(\d+)", text)
      out.append((a, b, m.group(1) if m else ""))
  return out


def summarize(run_dir):
  kinds = collections.defaultdict(lambda: [0, 0])
  digits = [[0, 0] for _ in range(3)]
  results = answers(run_dir)
  for a, b, got in results:
    total = a + b
    kind = ("carry" if a % 10 + b % 10 >= 10 else "no carry",
            "3-digit sum" if total >= 100 else "2-digit sum")
    kinds[kind][0] += got == str(total)
    kinds[kind][1] += 1
    for j, (g, w) in enumerate(zip(got.rjust(3, "0")[-3:], str(total).rjust(3, "0"))):
      digits[j][0] += g == w
      digits[j][1] += 1
  correct = sum(c for c, _ in kinds.values())
  cells = [f"{run_dir}: greedy {correct}/{len(results)} = {100 * correct / len(results):.1f}%"]
  cells += [f"{' '.join(k)} {100 * c / n:.0f}% (n={n})" for k, (c, n) in sorted(kinds.items())]
  cells.append("digits h/t/u " + " ".join(f"{100 * c / n:.0f}%" for c, n in digits))
  return "; ".join(cells)


if __name__ == "__main__":
  torch.set_num_threads(1)
  for d in sys.argv[1:]:
    print(summarize(d))
