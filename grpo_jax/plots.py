"""PNG plots of a run's metrics.jsonl: rewards, accuracy (train and eval), KL, completion length.

    python -m grpo_jax.plots WORKDIR            # writes WORKDIR/metrics.png
    plots.plot_metrics(workdir)                 # the same, at the end of a run

Panels pick their series by key pattern, so whatever the loop logs under these names is drawn
and a panel with no matching key is left out:

    Rewards            reward/<name>/mean
    Accuracy           any key with 'accuracy' (reward/math_accuracy/mean, eval/accuracy, ...)
    KL                 a 'kl' path component (loss/kl, kl/mean, ...)
    Completion length  any key with 'length' (completion/length/mean, ...)

Spread statistics (…/std, /min, /max, /count, /sum) are not drawn.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence

from grpo_jax import logging_io

PLOT_FILE = "metrics.png"
_SPREAD_SUFFIXES = ("/std", "/min", "/max", "/count", "/sum")
PANELS = (
    ("Rewards", re.compile(r"^reward/[^/]+/mean$")),
    ("Accuracy", re.compile(r"accuracy")),
    ("KL", re.compile(r"(^|/)kl($|/)")),
    ("Completion length", re.compile(r"length")),
)


def panel_series(records: Sequence[dict]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
  """{panel title: {metric key: (steps, values)}}, keeping only finite numeric points.

    panel_series([{"step": 1, "loss/kl": 0.5}, {"step": 2, "loss/kl": None}])
    -> {"KL": {"loss/kl": ([1], [0.5])}}
  """
  panels: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
  for record in records:
    step = record.get("step")
    if not isinstance(step, int):
      continue
    for key, value in record.items():
      if (key == "step" or key.endswith(_SPREAD_SUFFIXES) or isinstance(value, bool)
          or not isinstance(value, (int, float)) or not math.isfinite(value)):
        continue
      for title, pattern in PANELS:
        if pattern.search(key):
          steps, values = panels.setdefault(title, {}).setdefault(key, ([], []))
          steps.append(step)
          values.append(float(value))
  # Keep PANELS' order.
  return {title: panels[title] for title, _ in PANELS if title in panels}


def plot_metrics(workdir: str, out_path: str | None = None) -> str | None:
  """Draws WORKDIR/metrics.jsonl into a PNG; returns its path, or None if nothing is plottable."""
  metrics_path = os.path.join(workdir, logging_io.METRICS_FILE)
  if not os.path.exists(metrics_path):
    raise FileNotFoundError(f"no {logging_io.METRICS_FILE} in {workdir!r}")
  panels = panel_series(logging_io.read_jsonl(metrics_path))
  if not panels:
    return None
  # Figure + Agg canvas directly: no pyplot global state, works without a display.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  cols = 2 if len(panels) > 1 else 1
  rows = math.ceil(len(panels) / cols)
  fig = Figure(figsize=(6.5 * cols, 3.8 * rows), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  for ax, (title, series) in zip(axes, panels.items()):
    for key, (steps, values) in sorted(series.items()):
      # Sparse series (eval every N steps) get markers so single points stay visible.
      ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3,
              linewidth=1.2, label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  for ax in axes[len(panels):]:
    ax.set_visible(False)
  fig.suptitle(os.path.basename(os.path.abspath(workdir)))
  out_path = out_path or os.path.join(workdir, PLOT_FILE)
  fig.savefig(out_path + ".tmp.png", dpi=100)
  os.replace(out_path + ".tmp.png", out_path)  # Viewers never see a half-written PNG.
  return out_path


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m grpo_jax.plots", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir", help="run directory holding metrics.jsonl")
  parser.add_argument("--out", default=None, help=f"PNG path (default WORKDIR/{PLOT_FILE})")
  args = parser.parse_args(argv)
  path = plot_metrics(args.workdir, args.out)
  if path is None:
    print(f"nothing to plot in {args.workdir}/{logging_io.METRICS_FILE}", file=sys.stderr)
    return 1
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
