"""Paired comparison of two sets of runs by seed, for runs that live in different sweeps
(within one sweep, `python -m grpo_jax.report` pairs settings itself; docs/report.md).

    python experiments/paired_seeds.py A_DIR B_DIR [--effect=5]

A_DIR and B_DIR each hold one run directory per seed, named like the sweep tool names them
(`seed=7`, or any name ending in `seed=7`), with a finished summary.json. For the seeds both
finished: each side's gains, the per-seed difference B − A, its mean, std, 95% BCa bootstrap
interval and whether it excludes 0, and the seeds a paired comparison needs to detect --effect
points (grpo_jax.stats).
"""
import argparse
import json
import os
import re

from grpo_jax import stats


def gains(sweep_dir):
  out = {}
  for name in sorted(os.listdir(sweep_dir)):
    m = re.search(r"seed=(\d+)$", name)
    path = os.path.join(sweep_dir, name, "summary.json")
    if m and os.path.exists(path):
      summary = json.load(open(path))
      if "eval_accuracy_gain_points" in summary:
        out[int(m.group(1))] = summary["eval_accuracy_gain_points"]
  return dict(sorted(out.items()))


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("a")
  parser.add_argument("b")
  parser.add_argument("--effect", type=float, default=5.0)
  args = parser.parse_args()
  a, b = gains(args.a), gains(args.b)
  p = stats.paired(a, b)
  print("| seed | A gain | B gain | B − A |")
  print("| --- | --- | --- | --- |")
  for seed, d in zip(p.seeds, p.diffs):
    print(f"| {seed} | {a[seed]:+.1f} | {b[seed]:+.1f} | {d:+.1f} |")
  lo, hi = p.ci
  print(f"\nB − A over {len(p.seeds)} seeds: mean {p.mean:+.1f}, std {p.std:.1f}, 95% BCa interval "
        f"[{lo:+.1f}, {hi:+.1f}], excludes 0: {p.excludes_zero}; seeds for {args.effect:g} "
        f"points (paired, 80% power, 5% level): {stats.seeds_needed(args.effect, p.std, True)}")


if __name__ == "__main__":
  main()
