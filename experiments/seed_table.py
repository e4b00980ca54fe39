"""Per-seed table of tiny-preset runs, for experiments/tiny_seeds.md.

    python experiments/seed_table.py runs/tiny_s0 runs/tiny_s1 ...

Columns: held-out greedy accuracy after the warm start (GRPO step 0) and at each eval, the gain
in points, the fraction of sampled groups with zero spread (all G rewards equal, so zero
advantage) and the training reward, each averaged over the first and the last 50 GRPO steps.
"""
import json
import os
import sys


def read(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def mean(xs):
  return sum(xs) / len(xs) if xs else float("nan")


def zero_spread(record):
  """Zero-spread fraction of the groups sampled (with dynamic sampling: of the first round, not
  of the batch trained on, which it fills with informative groups)."""
  if "sampling/informative_frac_first_round" in record:
    return 1.0 - record["sampling/informative_frac_first_round"]
  return record["advantages/frac_reward_zero_std"]


def row(workdir):
  records = read(workdir)
  evals = {r["step"]: r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None}
  steps = [r for r in records if "advantages/frac_reward_zero_std" in r]
  first, last = steps[:50], steps[-50:]
  start, end = evals.get(0), evals[max(evals)]
  cells = [os.path.basename(workdir.rstrip("/"))]
  cells += [f"{100 * evals[s]:.1f}" for s in sorted(evals)]
  cells.append(f"{100 * (end - start):+.1f}")
  for part in (first, last):
    cells.append(f"{mean([zero_spread(r) for r in part]):.2f}")
  for part in (first, last):
    cells.append(f"{mean([r['reward/total/mean'] for r in part]):.3f}")
  return sorted(evals), cells


def main(workdirs):
  header_steps, rows = None, []
  for w in workdirs:
    steps, cells = row(w)
    header_steps = header_steps or steps
    rows.append(cells)
  header = (["run"] + [f"acc@{s}" for s in header_steps] + ["gain", "zero-spread first 50",
            "zero-spread last 50", "reward first 50", "reward last 50"])
  print("| " + " | ".join(header) + " |")
  print("|" + " --- |" * len(header))
  for cells in rows:
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main(sys.argv[1:])
