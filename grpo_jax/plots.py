"""PNG plots of a run's metrics.jsonl: rewards (total and each component), held-out accuracy,
KL, policy loss, entropy, gradient norm, completion length and clipping, one metric a panel.

    python -m grpo_jax.plots WORKDIR [WORKDIR ...]   # writes each WORKDIR/metrics.png
    plots.plot_metrics(workdir)                      # the same, at the end of a run
    with plots.drawing(workdirs): ...                # a vmapped group's, while it exports

Panels, in this order, each drawn only when its key has at least one finite value:

    Reward: total            reward/total/mean
    Reward: <name>           reward/<name>/mean, one panel per reward component, in logged order
    Held-out accuracy        eval/accuracy (every train.eval_every steps: points joined by a line)
    KL to reference          kl (per token, whatever the loss type; loss/kl is the loss's term);
                             left out when loss.beta is 0 in WORKDIR/config.json or every value
                             is 0 (no reference model, nothing to show)
    Policy loss              loss/policy
    Entropy                  entropy
    Gradient norm            grad_norm
    Completion length        completion/mean_length
    Clipped fraction         clip/region_frac; left out when every value is 0 (one update per
                             batch, loss.num_iterations = 1, is on-policy: the ratio is 1)

Dense series are drawn faint as logged, with a TensorBoard-style smoothed line on top: an
exponential moving average over the logged points, debiased so its start is not pulled to 0,

    s_t = w * s_{t-1} + (1 - w) * x_t,  s_0 = 0;   smoothed_t = s_t / (1 - w^t)

with weight w = 1 - 1 / max(1, n / 40), n the longest series' points (a window of about a
fortieth of the run; w = 0, no smoothing, up to 40 points) unless --smoothing gives one.
Missing values (null in the JSONL: NaN or inf was logged) are skipped, not drawn as 0.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence

from grpo_jax import jsonl, storage

PLOT_FILE = "metrics.png"
CONFIG_FILE = "config.json"  # written into the workdir by train.run
TOTAL_REWARD = "reward/total/mean"
EVAL_ACCURACY = "eval/accuracy"
_REWARD = re.compile(r"^reward/([^/]+)/mean$")
# (title, key, left out when all zero) after the reward panels; the eval panel comes first.
_METRIC_PANELS = (
    ("Held-out accuracy (greedy)", EVAL_ACCURACY, False),
    ("KL to reference", "kl", True),
    ("Policy loss", "loss/policy", False),
    ("Entropy (nats/token)", "entropy", False),
    ("Gradient norm", "grad_norm", False),
    ("Completion length (tokens)", "completion/mean_length", False),
    ("Clipped fraction", "clip/region_frac", True),
    # The sampler's log-probs against the train step's at the same params (grpo.drift_metrics).
    ("Rollout/train drift: mean |Δ log p|", "drift/logp_diff_mean", False),
)
# Panels left out when the series is 0 at every step.
OFF_WHEN_ZERO = frozenset(key for _, key, off in _METRIC_PANELS if off)
# Keys drawn whatever rewards the run uses; each must be one the trainer logs (train_test).
PLOTTED_KEYS = (TOTAL_REWARD,) + tuple(key for _, key, _ in _METRIC_PANELS)
_WINDOW_FRACTION = 40  # auto smoothing window: a fortieth of the points


@dataclasses.dataclass
class Panel:
  title: str
  key: str
  steps: list[int]
  values: list[float]
  sparse: bool = False  # logged every N steps: points joined by a line, not smoothed


def ema(values: Sequence[float], weight: float) -> list[float]:
  """Debiased exponential moving average (TensorBoard's smoothing); weight 0 returns values."""
  if not 0 <= weight < 1:
    raise ValueError(f"smoothing weight {weight!r} must be in [0, 1)")
  out, last = [], 0.0
  for t, value in enumerate(values, start=1):
    last = weight * last + (1 - weight) * value
    out.append(last / (1 - weight ** t))
  return out


def smoothing_weight(n: int) -> float:
  """The EMA weight for n points: a window of about n / 40 points, none for short runs."""
  return 1 - 1 / max(1.0, n / _WINDOW_FRACTION)


def metric_series(records: Sequence[dict]) -> dict[str, tuple[list[int], list[float]]]:
  """{key: (steps, values)} of every finite numeric value, in first-logged key order."""
  series: dict[str, tuple[list[int], list[float]]] = {}
  for record in records:
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
      continue
    for key, value in record.items():
      if (key == "step" or isinstance(value, bool) or not isinstance(value, (int, float))
          or not math.isfinite(value)):
        continue  # null (a NaN or inf logged), text, flags
      steps, values = series.setdefault(key, ([], []))
      steps.append(step)
      values.append(float(value))
  return series


def panels(records: Sequence[dict], beta: float | None = None) -> list[Panel]:
  """The panels to draw, in order; `beta` is the run's loss.beta if known (0: no KL panel).

    panels([{"step": 1, "reward/total/mean": 0.5, "kl": 0.0}])
    -> [Panel("Reward: total", "reward/total/mean", [1], [0.5])]
  """
  series = metric_series(records)
  out = []
  if TOTAL_REWARD in series:
    out.append(Panel("Reward: total", TOTAL_REWARD, *series[TOTAL_REWARD]))
  for key, (steps, values) in series.items():
    match = _REWARD.match(key)
    if match and key != TOTAL_REWARD:
      out.append(Panel(f"Reward: {match.group(1)}", key, steps, values))
  for title, key, off_when_zero in _METRIC_PANELS:
    if key not in series:
      continue
    steps, values = series[key]
    if off_when_zero and (all(v == 0 for v in values) or key == "kl" and beta == 0):
      continue
    out.append(Panel(title, key, steps, values, sparse=key == EVAL_ACCURACY))
  return out


def config_beta(workdir: str) -> float | None:
  """loss.beta from WORKDIR/config.json, or None if there is none to read."""
  try:
    return float(json.loads((storage.path(workdir) / CONFIG_FILE).read_text())["loss"]["beta"])
  except (OSError, ValueError, KeyError, TypeError):
    return None  # no readable config: the KL panel is judged by its values alone


def _draw(ax, panel: Panel, weight: float) -> None:
  color = "tab:green" if panel.sparse else "tab:blue"
  few = len(panel.steps) < 30  # markers keep single points and short runs visible
  if panel.sparse:
    ax.plot(panel.steps, panel.values, color=color, marker="o", markersize=4, linewidth=1.4)
  else:
    if weight > 0:
      ax.plot(panel.steps, panel.values, color=color, alpha=0.25, linewidth=0.8)
    ax.plot(panel.steps, ema(panel.values, weight), color=color, linewidth=1.6,
            marker="o" if few else None, markersize=3)
  ax.ticklabel_format(axis="y", useOffset=False)  # 6.2263, not "+6.226" and 0.0003
  ax.set_title(panel.title)
  ax.set_ylabel(panel.key, fontsize=8)
  ax.set_xlabel("step")
  ax.grid(alpha=0.3)


def figure(drawn: Sequence[Panel], title: str = "", smoothing: float | None = None):
  """A matplotlib Figure of the panels, 3 a row; smoothing as in plot_metrics."""
  if smoothing is not None and not 0 <= smoothing < 1:
    raise ValueError(f"smoothing={smoothing!r} must be in [0, 1)")
  # Figure + Agg canvas directly: no pyplot global state, works without a display.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  cols = min(3, len(drawn))
  rows = math.ceil(len(drawn) / cols)
  fig = Figure(figsize=(5 * cols, 3.4 * rows), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  if smoothing is None:  # one weight for all panels, from the longest series
    smoothing = smoothing_weight(max((len(p.values) for p in drawn if not p.sparse), default=0))
  for ax, panel in zip(axes, drawn):
    _draw(ax, panel, smoothing)
  for ax in axes[len(drawn):]:
    ax.set_visible(False)
  how = (f"faint: as logged; solid: EMA, weight {smoothing:.2f}" if smoothing > 0
         else "not smoothed")
  fig.suptitle(f"{title}    ({how})", fontsize=11)
  return fig


def plot_metrics(workdir: str, out_path: str | None = None,
                 smoothing: float | None = None) -> str | None:
  """Draws WORKDIR/metrics.jsonl into a PNG; returns its path, or None if nothing is plottable.

  smoothing: the EMA weight in [0, 1); None picks one from the run's length (module docstring).
  """
  root = storage.path(workdir)
  metrics_path = root / jsonl.METRICS_FILE
  if not metrics_path.exists():
    raise FileNotFoundError(f"no {jsonl.METRICS_FILE} in {workdir!r}")
  drawn = panels(jsonl.read_jsonl(metrics_path), beta=config_beta(workdir))
  if not drawn:
    return None
  fig = figure(drawn, root.name, smoothing)
  out_path = out_path or os.fspath(root / PLOT_FILE)
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=100)
  storage.write_bytes(out_path, png.getvalue())  # Viewers never see a half-written PNG.
  return out_path


@contextlib.contextmanager
def drawing(workdirs: Sequence[str], workers: int | None = None):
  """plot_metrics for each of several runs (a vmapped group's members), drawn while the block
  runs by up to `workers` (default: the CPUs this process may use) `python -m grpo_jax.plots`
  processes: the figures are CPU-bound Python, which threads would draw one at a time. The
  block's end waits for them; a run whose process failed is drawn again here, which raises
  its error. One run, or one worker: drawn here, at the block's end.

      with plots.drawing(workdirs):
        ...  # the exports
  """
  workdirs = [os.fspath(w) for w in workdirs]
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  workers = min(len(workdirs), workers or usable or 1)
  shares = [workdirs[i::workers] for i in range(workers)] if workers > 1 else []
  # The workers import this grpo_jax, wherever it was imported from.
  package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  procs = [subprocess.Popen([sys.executable, "-m", "grpo_jax.plots", "--quiet", *share],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
           for share in shares]
  try:
    yield
  finally:
    failed = [w for share, proc in zip(shares, procs) if proc.wait() != 0 for w in share]
  for w in failed if shares else workdirs:
    plot_metrics(w)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m grpo_jax.plots", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+", metavar="WORKDIR",
                      help="run directory holding metrics.jsonl")
  parser.add_argument("--out", default=None,
                      help=f"PNG path, with one WORKDIR (default WORKDIR/{PLOT_FILE})")
  parser.add_argument("--smoothing", type=float, default=None,
                      help="EMA weight in [0, 1), 0 = none (default: from the run's length)")
  parser.add_argument("--quiet", action="store_true", help="print nothing (drawing's workers)")
  args = parser.parse_args(argv)
  if args.smoothing is not None and not 0 <= args.smoothing < 1:
    parser.error(f"--smoothing {args.smoothing} must be in [0, 1)")
  if args.out is not None and len(args.workdirs) > 1:
    parser.error(f"--out names one PNG, and {len(args.workdirs)} WORKDIRs were given")
  status = 0
  for workdir in args.workdirs:
    path = plot_metrics(workdir, args.out, args.smoothing)
    if path is None:
      if not args.quiet:
        print(f"nothing to plot in {workdir}/{jsonl.METRICS_FILE}", file=sys.stderr)
      status = 1
    elif not args.quiet:
      print(path)
  return status


if __name__ == "__main__":
  sys.exit(main())
