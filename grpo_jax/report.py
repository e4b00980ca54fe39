"""A sweep directory → report.md and one PNG per metric: each setting's mean, std and a 95%
interval over seeds, each run's binomial interval, paired differences and the seeds an effect
needs. docs/report.md is the guide; grpo_jax/stats.py holds the statistics.

    python -m grpo_jax.report runs/tiny_lr              # runs/tiny_lr/report.md, plots/*.png
    python -m grpo_jax.report runs/tiny_lr --effect=5   # seeds to detect 5 points (the default)

A setting is a run's overrides without `seed` (compared as values; its name, the run name
without the seed, is for display, with a hash added where two settings' names are equal); its
row averages the finished runs of that setting (summary.json has the gain;
sweep_runner.summary_complete), and n says how many there are, "n of N" where some of the N
runs sweep.json lists have not finished (or not started: those have no directory yet).
Columns of the first table, each mean ± sample std (ddof 1) over those runs:

    start, final          held-out greedy accuracy (%) at GRPO step 0 and at the end (summary.json)
    gain                  eval_accuracy_gain_points (summary.json)
    reward, KL, length    reward/total/mean, kl (per token; not loss/kl, whose scale depends on
                          loss_type), completion/mean_length: the mean over each run's last
                          TAIL_STEPS GRPO steps (metrics.jsonl)
    wall                  minutes the run's processes ran, over all attempts (sweep_run.json);
                          a run started from a shared warm start does not count that warm start;
                          a --vmap member is charged its group's process time / K (K members)
    half                  steps to half the gain: the first held-out evaluation (metrics.jsonl's
                          eval/accuracy) at or above start + (final − start) / 2, so its
                          resolution is train.eval_every; none for a run that gained nothing

Intervals over seeds: the 95% Student-t interval of the mean (stats.mean_ci: mean ± t·s/√n)
of start, final and gain, and the seeds per setting a
two-sample comparison needs to detect --effect points of gain with 80% power at the 5% level
(stats.seeds_needed, normal approximation with Guenther's correction, at the setting's std).

Paired differences: for each pair of settings that finished on two or more of the same seeds,
B − A of --metric (gain by default) seed by seed: mean, std, the t interval of the mean
difference, whether it excludes 0, and the seeds a paired comparison needs for --effect.

Runs: each run's values, with the 95% Wilson interval of its final accuracy over the n eval
problems (summary.json's eval_examples; for older runs, read from its config.json and data/).

Plots: each metric plots.panels draws for a run, one line per setting: the mean over seeds of
each seed's series, smoothed as plots.py smooths it (sparse eval points are not), at the steps
every seed logged, shaded with the 95% Student-t interval of that mean where there are two
seeds or more. A metric plots.panels leaves out when it is all 0 (kl, clip/region_frac) is left
out for a setting only when it is 0 for every seed; a seed at 0 counts in the mean.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Sequence

from grpo_jax import logging_io, plots, stats, sweep as sweep_lib, sweep_runner

REPORT_FILE = "report.md"
PLOTS_DIR = "plots"
TAIL_STEPS = 50
TAIL_KEYS = (("reward", "reward/total/mean"), ("KL", "kl"),
             ("length", "completion/mean_length"))
EFFECT_POINTS = 5.0     # --effect: the difference in points the seed counts are for
INTERVAL_KEYS = ("start", "final", "gain", "half")


@dataclasses.dataclass
class RunResult:
  dir: str
  overrides: dict
  status: str
  summary: dict | None        # None unless finished
  records: list[dict]
  wall_s: float | None

  @property
  def seed(self):
    return self.overrides.get("seed")

  @property
  def setting(self) -> str:
    """The setting's name, for display."""
    return sweep_lib.run_name({k: v for k, v in self.overrides.items() if k != "seed"})

  @property
  def setting_key(self) -> str:
    """What identifies the setting: its overrides without the seed, as sorted JSON."""
    return json.dumps({k: v for k, v in self.overrides.items() if k != "seed"}, sort_keys=True,
                      default=str)


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
  """(mean, sample std with ddof 1 (nan for one value), n) of the finite values."""
  xs = [float(x) for x in values if x is not None and math.isfinite(x)]
  n = len(xs)
  if not n:
    return math.nan, math.nan, 0
  mean = sum(xs) / n
  std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else math.nan
  return mean, std, n


def tail_mean(records: Sequence[dict], key: str, tail: int = TAIL_STEPS) -> float:
  """The mean of key over the last `tail` GRPO steps (step > 0) that logged a finite value."""
  xs = [r[key] for r in records if r.get("step", 0) > 0 and isinstance(r.get(key), (int, float))
        and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
  return sum(xs[-tail:]) / len(xs[-tail:]) if xs else math.nan


def half_gain_step(records: Sequence[dict]) -> float:
  """The first step whose held-out accuracy has reached half of the run's gain: the first
  eval/accuracy at or above start + (final − start) / 2, start and final being the first and
  the last evaluation. nan without two evaluations, or for a gain <= 0.

  >>> half_gain_step([{"step": 0, "eval/accuracy": .2}, {"step": 50, "eval/accuracy": .3},
  ...                 {"step": 100, "eval/accuracy": .5}, {"step": 150, "eval/accuracy": .6}])
  100
  """
  evals = [(r["step"], r["eval/accuracy"]) for r in records
           if isinstance(r.get("eval/accuracy"), (int, float)) and math.isfinite(r["eval/accuracy"])]
  if len(evals) < 2 or evals[-1][1] <= evals[0][1]:
    return math.nan
  half = evals[0][1] + (evals[-1][1] - evals[0][1]) / 2
  return next(step for step, accuracy in evals if accuracy >= half)


def load_runs(sweep_dir: str) -> list[RunResult]:
  """The sweep's runs (not its prefixes), in sweep.json's order when there is one. A run that
sweep.json lists but that has no sweep_run.json (not started yet) comes from its sweep.json
entry (overrides, status), so a setting's "n of N" counts it."""
  index = sweep_runner.read_json(os.path.join(sweep_dir, sweep_runner.SWEEP_FILE)) or {}
  listed = {r["dir"]: r for r in index.get("runs", []) if r.get("kind") == "run"}
  dirs = list(listed)
  if not dirs:
    dirs = sorted(d for d in os.listdir(sweep_dir)
                  if os.path.exists(os.path.join(sweep_dir, d, sweep_runner.RUN_FILE)))
  out = []
  for d in dirs:
    path = os.path.join(sweep_dir, d)
    rec = sweep_runner.read_json(os.path.join(path, sweep_runner.RUN_FILE)) or listed.get(d)
    if rec is None or rec.get("kind", "run") != "run":
      continue
    finished = sweep_runner.summary_complete(path)
    summary = sweep_runner.read_json(os.path.join(path, sweep_runner.SUMMARY_FILE))
    out.append(RunResult(d, rec.get("overrides", {}), "finished" if finished else
                         rec.get("status", "pending"), summary if finished else None,
                         logging_io.read_jsonl(os.path.join(path, logging_io.METRICS_FILE)),
                         rec.get("wall_s")))
  return out


def by_setting(runs: Sequence[RunResult]) -> dict[str, list[RunResult]]:
  """{setting's display name: its runs}, settings in first-run order. Runs are grouped by
  their overrides (setting_key), not by the name: 'Be brief!' and 'Be brief?' both give the
  name 'Be_brief_', which then ends in a hash of each one's overrides."""
  groups: dict[str, list[RunResult]] = {}
  for r in runs:
    groups.setdefault(r.setting_key, []).append(r)
  names = [members[0].setting for members in groups.values()]
  out = {}
  for key, members in groups.items():
    name = members[0].setting
    if names.count(name) > 1:
      name += "," + hashlib.sha256(key.encode()).hexdigest()[:8]
    out[name] = members
  return out


def run_values(r: RunResult) -> dict[str, float]:
  """The table's columns for one finished run."""
  s = r.summary
  out = {"start": 100 * s["eval_accuracy_start"], "final": 100 * s["eval_accuracy_end"],
         "gain": s["eval_accuracy_gain_points"]}
  out.update({name: tail_mean(r.records, key) for name, key in TAIL_KEYS})
  out["wall"] = math.nan if r.wall_s is None else r.wall_s / 60
  out["half"] = half_gain_step(r.records)
  return out


def eval_examples(sweep_dir: str, r: RunResult) -> int | None:
  """How many problems the run's evals scored: summary.json's eval_examples; for a run written
  before it was recorded, train.eval_examples of its config.json, capped by (or, when 0, equal
  to) the rows of its own data/test.jsonl (a synthetic dataset); None when neither tells."""
  if r.summary is not None and isinstance(r.summary.get("eval_examples"), int):
    return r.summary["eval_examples"]
  path = os.path.join(sweep_dir, r.dir)
  config = sweep_runner.read_json(os.path.join(path, plots.CONFIG_FILE)) or {}
  limit = (config.get("train") or {}).get("eval_examples") or 0
  rows = None
  test_file = os.path.join(path, "data", "test.jsonl")
  if os.path.exists(test_file):
    with open(test_file) as f:
      rows = sum(1 for line in f if line.strip())
  if rows is None:
    return None
  return min(limit, rows) if limit else rows


def accuracy_interval(accuracy: float, n: int | None) -> tuple[float, float]:
  """The 95% Wilson interval (in %) of an accuracy measured on n problems; nan without n."""
  if n is None or accuracy is None or not math.isfinite(accuracy):
    return math.nan, math.nan
  lo, hi = stats.wilson_ci(round(accuracy * n), n)
  return 100 * lo, 100 * hi


COLUMNS = (("start", "start acc %", 1), ("final", "final acc %", 1), ("gain", "gain (points)", 1),
           ("reward", "reward", 3), ("KL", "KL", 4), ("length", "length", 1),
           ("wall", "wall (min)", 1), ("half", "steps to half gain", 0))


def _cell(mean, std, digits) -> str:
  if math.isnan(mean):
    return "—"
  return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def table(runs: Sequence[RunResult]) -> list[dict]:
  """One row a setting: {'setting', 'n', 'runs', column: (mean, std, n)} over finished runs."""
  rows = []
  for setting, members in by_setting(runs).items():
    values = [run_values(r) for r in members if r.summary is not None]
    row = {"setting": setting, "n": len(values), "runs": len(members)}
    for key, _, _ in COLUMNS:
      row[key] = mean_std([v[key] for v in values])
    rows.append(row)
  return rows


def interval_rows(runs: Sequence[RunResult], effect: float = EFFECT_POINTS) -> list[dict]:
  """One row a setting: {'setting', 'n', key: (mean, std, lo, hi) for INTERVAL_KEYS,
  'seeds_needed': two-sample seeds per setting to detect `effect` points of gain}."""
  rows = []
  for setting, members in by_setting(runs).items():
    values = [run_values(r) for r in members if r.summary is not None]
    row = {"setting": setting, "n": len(values)}
    for key in INTERVAL_KEYS:
      xs = [v[key] for v in values if math.isfinite(v[key])]
      mean, std, _ = mean_std(xs)
      row[key] = (mean, std, *stats.mean_ci(xs))
    row["seeds_needed"] = stats.seeds_needed(effect, row["gain"][1], paired=False)
    rows.append(row)
  return rows


def paired_rows(runs: Sequence[RunResult], metric: str = "gain",
                effect: float = EFFECT_POINTS) -> list[dict]:
  """For each pair of settings (A before B in sweep order) with two or more finished seeds in
  common: {'a', 'b', 'paired': stats.Paired of B − A, 'seeds_needed': paired seeds for effect}."""
  per_setting = {}
  for setting, members in by_setting(runs).items():
    values = {r.seed: run_values(r)[metric] for r in members
              if r.summary is not None and r.seed is not None}
    per_setting[setting] = {seed: v for seed, v in values.items() if math.isfinite(v)}
  names, out = list(per_setting), []
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      p = stats.paired(per_setting[a], per_setting[b])
      if len(p.seeds) >= 2:
        out.append({"a": a, "b": b, "paired": p,
                    "seeds_needed": stats.seeds_needed(effect, p.std, paired=True)})
  return out


# --- plots --------------------------------------------------------------------------------------

def _seed_series(members, key, weight):
  """{dir: {step: value}} of each member's series of key, smoothed with weight (0 for sparse
  eval points); {} for a metric that plots.panels leaves out when all 0 (plots.OFF_WHEN_ZERO)
  and that is 0 at every step of every member. A member at 0 alone stays in."""
  raw = {r.dir: plots.metric_series(r.records).get(key) for r in members}
  raw = {d: s for d, s in raw.items() if s is not None}
  if key in plots.OFF_WHEN_ZERO and all(v == 0 for _, values in raw.values() for v in values):
    return {}
  return {d: dict(zip(steps, plots.ema(values, weight))) for d, (steps, values) in raw.items()}


def plot_metric(runs, key, title, sparse, out_path, smoothing=None) -> str | None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  finished = [r for r in runs if r.summary is not None]
  series = [plots.metric_series(r.records).get(key) for r in finished]
  lengths = [len(s[1]) for s in series if s is not None]
  if not lengths:
    return None
  weight = 0.0 if sparse else (plots.smoothing_weight(max(lengths)) if smoothing is None
                               else smoothing)
  fig = Figure(figsize=(8, 4.8), layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for setting, members in by_setting(finished).items():
    series = _seed_series(members, key, weight)
    if not series:
      continue
    steps = sorted(set.intersection(*(set(s) for s in series.values())))
    per_step = [[s[t] for s in series.values()] for t in steps]
    mean = [mean_std(xs)[0] for xs in per_step]
    line, = ax.plot(steps, mean, marker="o" if sparse or len(steps) < 30 else None,
                    markersize=3, label=f"{setting} (n={len(series)})")
    if len(series) > 1:
      band = [stats.mean_ci(xs) for xs in per_step]
      ax.fill_between(steps, [lo for lo, _ in band], [hi for _, hi in band],
                      color=line.get_color(), alpha=0.2, linewidth=0)
  how = "not smoothed" if weight == 0 else f"EMA weight {weight:.2f}"
  ax.set_title(f"{title}: mean over seeds, shaded 95% t interval of the mean ({how})",
               fontsize=9)
  ax.set_xlabel("GRPO step")
  ax.set_ylabel(key, fontsize=8)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.savefig(out_path + ".tmp.png", dpi=100)
  os.replace(out_path + ".tmp.png", out_path)
  return out_path


def plot_all(sweep_dir, runs, smoothing=None) -> list[tuple[str, str]]:
  """[(metric key, png path relative to sweep_dir)], one per metric any finished run logs."""
  metrics = {}
  for r in runs:
    if r.summary is not None:
      for p in plots.panels(r.records, beta=plots.config_beta(os.path.join(sweep_dir, r.dir))):
        metrics.setdefault(p.key, (p.title, p.sparse))
  os.makedirs(os.path.join(sweep_dir, PLOTS_DIR), exist_ok=True)
  out = []
  for key, (title, sparse) in metrics.items():
    rel = os.path.join(PLOTS_DIR, re.sub(r"[^A-Za-z0-9._-]", "_", key) + ".png")
    if plot_metric(runs, key, title, sparse, os.path.join(sweep_dir, rel), smoothing):
      out.append((key, rel))
  return out


# --- report.md ----------------------------------------------------------------------------------

def _interval(lo, hi, digits=1) -> str:
  return "—" if math.isnan(lo) else f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def _seeds(n) -> str:
  return "—" if n is None else str(n)


def _interval_lines(runs, effect) -> list[str]:
  """The report's "Intervals over seeds" section."""
  lines = ["", "## Intervals over seeds", "",
           "Mean [95% interval of the mean over seeds]: Student's t, mean ± t(0.975, n − 1) "
           "· s / √n with s the sample std; none for one seed. It assumes roughly normal seed "
           "outcomes, and from 2-3 seeds it is wide: that is how little they say. Seeds "
           "needed: per setting, for a two-sample comparison of gain to detect "
           f"{effect:g} points with {stats.POWER:.0%} power at the 5% level (two-sided), at "
           "this setting's std (normal approximation with Guenther's correction).", ""]
  header = ["setting", "n", "start acc %", "final acc %", "gain (points)",
            "steps to half gain", f"seeds for {effect:g} points"]
  lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  for row in interval_rows(runs, effect):
    cells = [f"`{row['setting']}`", str(row["n"])]
    for key in INTERVAL_KEYS:
      mean, _, lo, hi = row[key]
      digits = 0 if key == "half" else 1
      cells.append("—" if math.isnan(mean) else f"{mean:.{digits}f} {_interval(lo, hi, digits)}")
    cells.append(_seeds(row["seeds_needed"]))
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def render(sweep_dir, runs, plotted, effect=EFFECT_POINTS, metric="gain") -> str:
  index = sweep_runner.read_json(os.path.join(sweep_dir, sweep_runner.SWEEP_FILE)) or {}
  lines = [f"# Sweep {os.path.basename(os.path.abspath(sweep_dir))}", ""]
  if index:
    lines += [f"Sweep file `{index.get('sweep_file')}`, config `{index.get('config')}`, fixed "
              f"overrides `{json.dumps(index.get('fixed') or {})}`.", ""]
  lines += [f"Mean ± sample std over the finished runs of each setting (n); reward, KL and "
            f"length: the mean over each run's last {TAIL_STEPS} GRPO steps; wall: the minutes "
            "its processes ran (a `--vmap` member: its group's time / K members). "
            "`python -m grpo_jax.report` wrote this; grpo_jax/report.py and docs/report.md "
            "say how.", ""]
  header = ["setting", "n"] + [title for _, title, _ in COLUMNS]
  lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  for row in table(runs):
    n = f"{row['n']}" if row["n"] == row["runs"] else f"{row['n']} of {row['runs']}"
    cells = [f"`{row['setting']}`", n] + [_cell(*row[k][:2], d) for k, _, d in COLUMNS]
    lines.append("| " + " | ".join(cells) + " |")
  prefixes = [r for r in index.get("runs", []) if r.get("kind") == "prefix"]
  if prefixes:
    lines += ["", "Shared warm starts, computed once for their runs and not counted in their "
              "wall time: " + ", ".join(
                  f"`{r['dir']}` ({r['status']}, {(r.get('wall_s') or 0) / 60:.1f} min)"
                  for r in prefixes) + "."]

  lines += _interval_lines(runs, effect)

  pairs = paired_rows(runs, metric, effect)
  if pairs:
    lines += ["", "## Paired differences", "",
              f"B − A of {metric} (points) over the seeds both settings finished, seed by seed. "
              "Interval: the t interval of the mean difference as above; 'excludes 0' is "
              "yes when the whole interval lies on one side of 0. Seeds needed: for a paired "
              f"comparison to detect {effect:g} points with {stats.POWER:.0%} power at the 5% "
              "level, at the std of the differences.", ""]
    header = ["B", "A", "seeds", "mean B − A", "std", "95% interval", "excludes 0",
              f"seeds for {effect:g} points"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in pairs:
      p = row["paired"]
      excl = {True: "yes", False: "no", None: "—"}[p.excludes_zero]
      cells = [f"`{row['b']}`", f"`{row['a']}`", str(len(p.seeds)), f"{p.mean:+.1f}",
               "—" if math.isnan(p.std) else f"{p.std:.1f}", _interval(*p.ci), excl,
               _seeds(row["seeds_needed"])]
      lines.append("| " + " | ".join(cells) + " |")

  lines += ["", "## Runs", "",
            "eval n: the problems each eval scored; final 95%: the Wilson score interval of "
            "the final accuracy over them (binomial, from this run's eval alone).", ""]
  header = ["run", "status"] + [title for _, title, _ in COLUMNS] + ["eval n", "final 95%"]
  lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  for r in runs:
    values = run_values(r) if r.summary is not None else {}
    n = eval_examples(sweep_dir, r) if r.summary is not None else None
    final = r.summary["eval_accuracy_end"] if r.summary is not None else math.nan
    cells = [f"`{r.dir}`", r.status] + [_cell(values.get(k, math.nan), math.nan, d)
                                        for k, _, d in COLUMNS]
    cells += [_seeds(n), _interval(*accuracy_interval(final, n))]
    lines.append("| " + " | ".join(cells) + " |")
  if plotted:
    lines += ["", "## Plots", "",
              "Each setting's mean over seeds, shaded with the 95% Student-t interval of that "
              "mean at each step where it has two seeds or more.", ""]
    lines += [f"![{key}]({path})" for key, path in plotted]
  return "\n".join(lines) + "\n"


def write_report(sweep_dir: str, smoothing: float | None = None, effect: float = EFFECT_POINTS,
                 metric: str = "gain") -> str:
  runs = load_runs(sweep_dir)
  if not runs:
    raise FileNotFoundError(f"no sweep runs in {sweep_dir} (directories with "
                            f"{sweep_runner.RUN_FILE})")
  plotted = plot_all(sweep_dir, runs, smoothing)
  path = os.path.join(sweep_dir, REPORT_FILE)
  with open(path + ".tmp", "w") as f:
    f.write(render(sweep_dir, runs, plotted, effect, metric))
  os.replace(path + ".tmp", path)
  return path


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m grpo_jax.report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sweep_dir", help="a sweep's --workdir")
  parser.add_argument("--smoothing", type=float, default=None,
                      help="EMA weight in [0, 1), 0 = none (default: from the runs' length)")
  parser.add_argument("--effect", type=float, default=EFFECT_POINTS,
                      help="the difference (points) the seed counts are for (default %(default)s)")
  parser.add_argument("--metric", choices=INTERVAL_KEYS, default="gain",
                      help="what the paired differences compare (default %(default)s)")
  args = parser.parse_args(argv)
  if args.smoothing is not None and not 0 <= args.smoothing < 1:
    parser.error(f"--smoothing {args.smoothing} must be in [0, 1)")
  if not args.effect > 0:
    parser.error(f"--effect {args.effect} must be > 0 (points)")
  try:
    print(write_report(args.sweep_dir, args.smoothing, args.effect, args.metric))
  except FileNotFoundError as e:
    print(f"grpo_jax.report: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
