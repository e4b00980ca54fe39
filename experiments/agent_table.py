"""Per-seed diagnostics of agent runs (Flow-GRPO), for experiments/agent_seeds.md.

    python experiments/agent_table.py runs/agent_seeds/seed=*

Columns: the warm start's length and its validation accuracy (from the run's log.txt), the
held-out accuracy at GRPO steps 0 and the last eval, the gain, then means over the first and
the last 50 GRPO steps of: tool calls and turns per trajectory, the fraction answered, invalid
actions per trajectory, the entropy (nats a token), the fraction of first-round groups that were
informative (rewards not all equal) and the sampling rounds a step needed.
"""
import json
import os
import re
import sys


def mean(xs):
  xs = [x for x in xs if x is not None]
  return sum(xs) / len(xs) if xs else float("nan")


def warm_start(workdir):
  """(steps, validation accuracy %) from the log line sft.run_sft prints when the warm start
  stops; (None, None) when there is none."""
  path = os.path.join(workdir, "log.txt")
  if not os.path.exists(path):
    return None, None
  text = open(path, errors="replace").read()
  m = re.findall(r"warm start reached ([\d.]+)% on \d+ validation problems .*? after (\d+) steps",
                 text)
  if m:
    return int(m[-1][1]), float(m[-1][0])
  # At its step limit below the target (sft.run_sft's warning).
  m = re.findall(r"warm start ended at its limit of (\d+) steps with validation accuracy "
                 r"([\d.]+)%", text)
  return (int(m[-1][0]), float(m[-1][1])) if m else (None, None)


def row(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  evals = {r["step"]: r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None}
  steps = [r for r in records if "agent/turns/mean" in r]
  first, last = steps[:50], steps[-50:]
  start, end = evals.get(0), evals[max(evals)]
  ws_steps, ws_val = warm_start(workdir)
  cells = [os.path.basename(workdir.rstrip("/")),
           f"{ws_steps} ({ws_val:.1f}%)" if ws_steps is not None else "?",
           f"{100 * start:.1f}", f"{100 * end:.1f}", f"{100 * (end - start):+.1f}"]
  for key, fmt in (("agent/tool_calls/mean", "{:.2f}"), ("agent/turns/mean", "{:.2f}"),
                   ("agent/answered_frac", "{:.2f}"), ("agent/invalid_actions/mean", "{:.2f}"),
                   ("entropy", "{:.3f}"), ("sampling/informative_frac_first_round", "{:.2f}"),
                   ("sampling/rounds", "{:.2f}")):
    cells.append(" → ".join(fmt.format(mean([r.get(key) for r in part]))
                            for part in (first, last)))
  return cells


def main(workdirs):
  header = ["run", "warm start: steps (validation acc)", "acc@0", "final acc", "gain",
            "tool calls", "turns", "answered", "invalid actions", "entropy",
            "informative groups, first round", "sampling rounds"]
  print("| " + " | ".join(header) + " |")
  print("|" + " --- |" * len(header))
  for w in workdirs:
    print("| " + " | ".join(row(w)) + " |")
  print("\nEach 'a → b' is the mean over the first 50 GRPO steps, then over the last 50.")


if __name__ == "__main__":
  main(sys.argv[1:])
