"""Metric plots: the right series in the right panels, a real PNG, missing keys skipped."""
import math

import numpy as np
import pytest
from matplotlib import image as mpimg

from grpo_jax import logging_io, plots


def _write_run(workdir, steps=60):
  rng = np.random.default_rng(0)
  accuracy = np.clip(np.linspace(0.1, 0.7, steps) + rng.normal(0, 0.05, steps), 0, 1)
  kl = np.linspace(0, 0.02, steps)
  kl[5] = np.nan  # logged as null: that point is dropped, not a crash
  with logging_io.MetricsWriter(str(workdir), tensorboard=False) as writer:
    for i in range(steps):
      step = i + 1
      writer.write(step, {"reward/math_accuracy/mean": accuracy[i],
                          "reward/format/mean": 0.1 * (i > 10), "reward/format/std": 0.05,
                          "loss/kl": kl[i], "loss/policy": 0.3,
                          "completion/length/mean": 200 - i})
      if step % 20 == 0:
        writer.write(step, {"eval/accuracy": accuracy[i] - 0.05})
  return accuracy, kl


def test_panel_series_match_the_logged_values(tmp_path):
  accuracy, kl = _write_run(tmp_path)
  series = plots.panel_series(logging_io.read_jsonl(str(tmp_path / "metrics.jsonl")))
  assert list(series) == ["Rewards", "Accuracy", "KL", "Completion length"]
  assert set(series["Rewards"]) == {"reward/math_accuracy/mean", "reward/format/mean"}
  assert set(series["Accuracy"]) == {"reward/math_accuracy/mean", "eval/accuracy"}
  steps, values = series["Accuracy"]["eval/accuracy"]
  assert steps == [20, 40, 60]
  np.testing.assert_allclose(values, accuracy[[19, 39, 59]] - 0.05)
  steps, values = series["KL"]["loss/kl"]
  assert steps == [s for s in range(1, 61) if s != 6]
  np.testing.assert_allclose(values, np.delete(kl, 5))
  assert series["Completion length"]["completion/length/mean"][1][:2] == [200.0, 199.0]


def test_png_is_written_and_not_blank(tmp_path):
  _write_run(tmp_path)
  assert plots.main([str(tmp_path)]) == 0
  path = tmp_path / "metrics.png"
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  pixels = mpimg.imread(str(path))
  assert pixels.shape[:2] == (760, 1300)  # 2x2 panels at 6.5x3.8 in, 100 dpi
  # Curves in several colours: far more than a blank or single-colour canvas.
  colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
  assert len(colours) > 50
  assert (pixels[..., :3] < 0.5).mean() > 0.005  # text, axes and lines drawn in dark ink


def test_missing_keys_are_skipped(tmp_path):
  with logging_io.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
    for step in range(1, 4):
      writer.write(step, {"loss/kl": step * 0.01, "reward/format/mean": math.nan,
                          "note": "text"})
  assert list(plots.panel_series(logging_io.read_jsonl(str(tmp_path / "metrics.jsonl")))) == [
      "KL"]
  out = plots.plot_metrics(str(tmp_path), str(tmp_path / "only_kl.png"))
  assert mpimg.imread(out).shape[:2] == (380, 650)  # one panel

  empty = tmp_path / "empty"
  with logging_io.MetricsWriter(str(empty), tensorboard=False) as writer:
    writer.write(1, {"loss/policy": 0.5})
  assert plots.plot_metrics(str(empty)) is None
  assert plots.main([str(empty)]) == 1
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl in"):
    plots.plot_metrics(str(tmp_path / "nowhere"))
