"""The tiny preset's gain over seeds 0-19, from seeds 0-17 as recorded and runs of the others.

    python experiments/tiny_seeds_20.py runs/tiny_seeds/seed=*
    python experiments/tiny_seeds_20.py --compare runs/tiny_seeds/seed=*

Seeds 0-17 were run on 2026-11-26 (tiny_seeds.md, "After: lr 3e-4 with a cosine, over 18
seeds"); their run directories are gone, so their held-out accuracy at GRPO steps 0 and 400 is
taken from that page's table (RECORDED, percent to one decimal). Each is k / 512 for a whole k,
which one decimal pins down exactly (1/512 is 0.195 points), so the gains below are exact, not
rounded. A run directory given on the command line (named like the sweep tool's `seed=N`, with
a finished summary.json) supplies its seed; for a seed also recorded it must agree with the
record, or the script stops: the numerics would have moved between the two sweeps, and the
runs could not be pooled.

--compare pools nothing: it summarises the runs given alone (one commit's numerics) and pairs
them, seed by seed, with the record: the gain difference run − record, its mean and BCa
interval (grpo_jax.stats.paired).

Otherwise prints each seed's start, final and gain, then the mean, sample std, the 95% BCa bootstrap
interval of the mean (grpo_jax.stats, values in seed order; the bootstrap draws depend on the
order, which moves the interval's ends by about 0.1-0.2 points), Student's t interval, and the
lowest gain.
"""
import json
import math
import os
import re
import sys

import numpy as np

from grpo_jax import stats

EVAL_N = 512
# seed: (acc@0 %, acc@400 %), tiny_seeds.md's 18-seed table.
RECORDED = {
    0: (22.7, 63.3), 1: (25.6, 68.4), 2: (29.5, 89.6), 3: (30.5, 84.2), 4: (18.9, 71.7),
    5: (18.4, 58.0), 6: (13.5, 60.0), 7: (24.0, 59.2), 8: (21.9, 50.8), 9: (43.9, 87.7),
    10: (21.7, 71.3), 11: (26.0, 49.4), 12: (32.6, 71.9), 13: (24.4, 67.8), 14: (23.0, 84.6),
    15: (23.2, 81.4), 16: (23.6, 55.1), 17: (18.8, 68.8),
}


def correct(percent):
  """The k of k / EVAL_N that prints as `percent` to one decimal."""
  k = round(percent * EVAL_N / 100)
  if round(100 * k / EVAL_N, 1) != percent:
    raise ValueError(f"{percent}% is not k/{EVAL_N} to one decimal")
  return k


def t_interval(x):
  """Student's t 95% interval of the mean (scipy-free: the t quantile by bisection)."""
  n, m, s = len(x), float(np.mean(x)), float(np.std(x, ddof=1))
  df = n - 1

  def cdf(t):  # the t distribution's CDF, its density integrated from 0 (checked against scipy)
    xs = np.linspace(0.0, t, 20001)
    pdf = (math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
           * (1 + xs ** 2 / df) ** (-(df + 1) / 2))
    return 0.5 + float(np.trapezoid(pdf, xs))

  lo, hi = 0.0, 20.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if cdf(mid) < 0.975 else (lo, mid)
  q = (lo + hi) / 2
  return m - q * s / math.sqrt(n), m + q * s / math.sqrt(n)


def read_runs(run_dirs):
  """{seed: (k_start, k_end)} of finished seed=N run directories."""
  out = {}
  for d in run_dirs:
    m = re.search(r"seed=(\d+)$", d.rstrip("/"))
    path = os.path.join(d, "summary.json")
    summary = json.load(open(path)) if os.path.exists(path) else {}
    if not m or "eval_accuracy_gain_points" not in summary:
      print(f"(skipped {d}: not a finished seed=N run)")
      continue
    out[int(m.group(1))] = (round(summary["eval_accuracy_start"] * EVAL_N),
                            round(summary["eval_accuracy_end"] * EVAL_N))
  return dict(sorted(out.items()))


def summarise(label, gains, seeds):
  x = np.array(gains)
  lo, hi = stats.bootstrap_mean_ci(gains)
  tlo, thi = t_interval(x) if len(x) > 1 else (math.nan, math.nan)
  print(f"\n{label}: seeds {len(x)}: gain {x.mean():+.1f} ± {x.std(ddof=1):.1f} (mean ± sample "
        f"std); 95% BCa bootstrap interval of the mean [{lo:.1f}, {hi:.1f}]; Student's t "
        f"[{tlo:.1f}, {thi:.1f}]; lowest {x.min():+.1f} (seed {seeds[int(x.argmin())]}); "
        f"seeds below +15: {int((x < 15).sum())}")


def compare(run_dirs):
  runs = read_runs(run_dirs)
  rec = {seed: (correct(a), correct(b)) for seed, (a, b) in RECORDED.items()}
  gain = lambda k: 100 * (k[1] - k[0]) / EVAL_N
  print("| seed | run: acc@0 → acc@400 | gain | record: acc@0 → acc@400 | gain | run − record |")
  print("| --- | --- | --- | --- | --- | --- |")
  for seed, k in runs.items():
    cells = [f"{100 * k[0] / EVAL_N:.1f} → {100 * k[1] / EVAL_N:.1f}", f"{gain(k):+.1f}"]
    if seed in rec:
      cells += [f"{100 * rec[seed][0] / EVAL_N:.1f} → {100 * rec[seed][1] / EVAL_N:.1f}",
                f"{gain(rec[seed]):+.1f}", f"{gain(k) - gain(rec[seed]):+.1f}"]
    else:
      cells += ["–", "–", "–"]
    print(f"| {seed} | " + " | ".join(cells) + " |")
  summarise("runs", [gain(k) for k in runs.values()], list(runs))
  p = stats.paired({s: gain(k) for s, k in rec.items()}, {s: gain(k) for s, k in runs.items()})
  if len(p.seeds) > 1:
    print(f"paired over seeds {p.seeds}: run − record {p.mean:+.1f} ± {p.std:.1f}, 95% BCa "
          f"[{p.ci[0]:.1f}, {p.ci[1]:.1f}], excludes 0: {p.excludes_zero}")


def main(run_dirs):
  if run_dirs and run_dirs[0] == "--compare":
    return compare(run_dirs[1:])
  ks = {seed: (correct(a), correct(b)) for seed, (a, b) in RECORDED.items()}
  source = {seed: "recorded" for seed in ks}
  for seed, k in read_runs(run_dirs).items():
    if seed in ks and ks[seed] != k:
      raise SystemExit(f"seed {seed}: this run gives {k[0]}/{EVAL_N} -> {k[1]}/{EVAL_N}, the "
                       f"record {ks[seed][0]}/{EVAL_N} -> {ks[seed][1]}/{EVAL_N}: not poolable")
    source[seed] = "run, = recorded" if seed in ks else "run"
    ks[seed] = k
  print("| seed | acc@0 | acc@400 | gain | source |\n| --- | --- | --- | --- | --- |")
  gains = []
  for seed in sorted(ks):
    a, b = ks[seed]
    gains.append(100 * (b - a) / EVAL_N)
    print(f"| {seed} | {100 * a / EVAL_N:.1f} | {100 * b / EVAL_N:.1f} | {gains[-1]:+.1f} | "
          f"{source[seed]} |")
  summarise("recorded and runs", gains, sorted(ks))

if __name__ == "__main__":
  main(sys.argv[1:])
