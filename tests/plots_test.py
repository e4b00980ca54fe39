"""Metric plots: a panel per logged metric that has data (a reward component each, no KL at
beta 0), EMA smoothing as computed by hand, missing values skipped, a real PNG.

The keys are the trainer's own: train_test checks plots.PLOTTED_KEYS against a real run's log."""
import json
import math

import numpy as np
import pytest
from matplotlib import image as mpimg

from grpo_jax import logging_io, plots

REWARDS = ("math_accuracy", "format")  # the default preset's components


def _record(rng, i, steps):
  """One step's metrics under the names grpo_step logs (train.py, scoring.py, grpo.py)."""
  accuracy = min(1.0, 0.1 + 0.6 * i / steps + rng.normal(0, 0.05))
  fmt = float(i > 10)
  return {"reward/math_accuracy/mean": accuracy, "reward/math_accuracy/std": 0.3,
          "reward/math_accuracy/missing_frac": 0.0,
          "reward/format/mean": fmt, "reward/format/std": 0.0, "reward/format/missing_frac": 0.0,
          "reward/total/mean": accuracy + fmt, "reward/total/std": 0.4,
          "loss": 0.3, "loss/policy": 0.3, "loss/kl": 0.0003 * i, "kl": 0.001 * i,
          "clip/region_frac": 0.0,
          "clip/low_frac": 0.0, "ratio/mean": 1.0, "entropy": 0.3 - 0.001 * i,
          "grad_norm": 1.0 + rng.normal(0, 0.1), "completion/mean_length": 200.0 - i,
          "completion/max_length": 256, "time/sample_s": 1.5, "sampler/tokens_per_s": 300.0,
          "step/skipped": 0.0, "drift/logp_diff_mean": 0.01, "drift/kl": 1e-4}


def _write_run(workdir, steps=60, beta=None, **overrides):
  """Writes a run's metrics.jsonl (eval at step 0 and every 20 steps; `overrides`: key ->
  value(step)) and, with beta, config.json; returns the records as read back."""
  rng = np.random.default_rng(0)
  with logging_io.MetricsWriter(str(workdir), tensorboard=False) as writer:
    writer.write(0, {"eval/accuracy": 0.1})
    for step in range(1, steps + 1):
      m = {**_record(rng, step, steps), **{k: v(step) for k, v in overrides.items()}}
      if step % 20 == 0:
        m["eval/accuracy"] = 0.1 + step / 100
      writer.write(step, m)
  if beta is not None:
    (workdir / "config.json").write_text(json.dumps({"loss": {"beta": beta}}))
  return logging_io.read_jsonl(str(workdir / "metrics.jsonl"))


def _titles(drawn):
  return [p.title for p in drawn]


def test_a_panel_per_metric_and_per_reward_component(tmp_path):
  records = _write_run(tmp_path)
  drawn = plots.panels(records, beta=0.04)
  assert _titles(drawn) == [
      "Reward: total", "Reward: math_accuracy", "Reward: format", "Held-out accuracy (greedy)",
      "KL to reference", "Policy loss", "Entropy (nats/token)", "Gradient norm",
      "Completion length (tokens)",
      "Rollout/train drift: mean |Δ log p|"]  # clip/region_frac is all 0: no panel
  by_key = {p.key: p for p in drawn}
  assert set(by_key) == set(plots.PLOTTED_KEYS) - {"clip/region_frac"} | {
      f"reward/{name}/mean" for name in REWARDS}
  # The per-token `kl`, not the loss's term `loss/kl`.
  assert by_key["kl"].values == [r["kl"] for r in records[1:]]
  math_acc = by_key["reward/math_accuracy/mean"]
  assert math_acc.steps == list(range(1, 61))
  assert math_acc.values == [r["reward/math_accuracy/mean"] for r in records[1:]]
  evals = by_key["eval/accuracy"]
  assert evals.sparse and evals.steps == [0, 20, 40, 60]
  np.testing.assert_allclose(evals.values, [0.1, 0.3, 0.5, 0.7])
  assert not any(p.sparse for p in drawn if p.key != "eval/accuracy")


def test_no_kl_panel_at_beta_0(tmp_path):
  records = _write_run(tmp_path)
  zero_kl = [{**r, "kl": 0.0} if "kl" in r else r for r in records]
  assert "KL to reference" not in _titles(plots.panels(zero_kl))  # all 0: beta was 0
  no_kl = [{k: v for k, v in r.items() if k != "kl"} for r in records]
  assert "KL to reference" not in _titles(plots.panels(no_kl))
  assert "KL to reference" not in _titles(plots.panels(records, beta=0.0))
  assert "KL to reference" in _titles(plots.panels(records, beta=0.04))
  assert "KL to reference" in _titles(plots.panels(records))  # beta unknown: values decide

  # plot_metrics reads loss.beta from WORKDIR/config.json: 9 panels are 3 rows, 8 (no KL) too,
  # so keep only rewards and KL: 4 panels (2 rows) with KL, 3 (1 row) without.
  keep = ("step", "reward/total/mean", "reward/format/mean", "reward/math_accuracy/mean",
          "kl")
  for beta, rows in ((0.04, 2), (0.0, 1)):
    workdir = tmp_path / f"beta_{beta}"
    workdir.mkdir()
    with logging_io.MetricsWriter(str(workdir), tensorboard=False) as writer:
      for r in records[1:]:
        writer.write(r["step"], {k: v for k, v in r.items() if k in keep and k != "step"})
    (workdir / "config.json").write_text(json.dumps({"loss": {"beta": beta}}))
    assert mpimg.imread(plots.plot_metrics(str(workdir))).shape[:2] == (340 * rows, 1500)


def test_ema_is_debiased_like_tensorboard():
  # s_t = w s_{t-1} + (1 - w) x_t from s_0 = 0, divided by 1 - w^t; by hand for w = 0.5:
  # 0.5 / 0.5 = 1;  (0.25 + 1) / 0.75 = 5/3;  (0.625 + 2) / 0.875 = 3.
  np.testing.assert_allclose(plots.ema([1.0, 2.0, 4.0], 0.5), [1.0, 5 / 3, 3.0])
  assert plots.ema([3.0, 1.0], 0.0) == [3.0, 1.0]
  assert plots.ema([2.0, 2.0, 2.0], 0.99) == pytest.approx([2.0] * 3)  # no pull towards 0
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    plots.ema([1.0], 1.0)
  assert plots.smoothing_weight(2) == plots.smoothing_weight(40) == 0.0
  assert plots.smoothing_weight(400) == pytest.approx(0.9)


def test_drawn_lines_are_the_raw_values_and_their_ema(tmp_path):
  records = _write_run(tmp_path)
  drawn = plots.panels(records)
  fig = plots.figure(drawn, "run", smoothing=0.8)
  axes = [ax for ax in fig.axes if ax.get_visible()]
  assert [ax.get_title() for ax in axes] == _titles(drawn)
  for ax, panel in zip(axes, drawn):
    if panel.sparse:  # eval: the points themselves, joined, with markers
      (line,) = ax.get_lines()
      assert line.get_marker() == "o"
      np.testing.assert_allclose(line.get_ydata(), panel.values)
      continue
    raw, smooth = ax.get_lines()
    assert raw.get_alpha() < 0.5 and smooth.get_alpha() is None  # faint raw behind
    np.testing.assert_allclose(raw.get_xdata(), panel.steps)
    np.testing.assert_allclose(raw.get_ydata(), panel.values)
    np.testing.assert_allclose(smooth.get_ydata(), plots.ema(panel.values, 0.8))
  assert "weight 0.80" in fig.get_suptitle()
  # Auto: 60 points make a window of 1.5 points, w = 1/3.
  assert "weight 0.33" in plots.figure(drawn, "run").get_suptitle()


def test_missing_values_are_skipped(tmp_path):
  def gappy_accuracy(step):  # None: the reward could not score this step (logged as null)
    return None if step in (5, 6) else 0.5
  records = _write_run(tmp_path, **{"reward/math_accuracy/mean": gappy_accuracy,
                                    "reward/format/mean": lambda step: math.nan,
                                    "grad_norm": lambda step: math.inf})
  assert records[5]["reward/math_accuracy/mean"] is None and records[5]["grad_norm"] is None
  records[3]["entropy"] = "text"  # not a number: skipped
  records[4]["entropy"] = True
  drawn = {p.key: p for p in plots.panels(records)}
  assert "reward/format/mean" not in drawn and "grad_norm" not in drawn  # never a value
  assert drawn["reward/math_accuracy/mean"].steps == [s for s in range(1, 61) if s not in (5, 6)]
  assert drawn["entropy"].steps == [s for s in range(1, 61) if s not in (3, 4)]
  assert plots.main([str(tmp_path)]) == 0  # draws with the gaps


def test_png_is_written_and_not_blank(tmp_path, capsys):
  _write_run(tmp_path, beta=0.0)
  assert plots.main([str(tmp_path), "--smoothing", "0.6"]) == 0
  path = tmp_path / "metrics.png"
  assert capsys.readouterr().out.strip() == str(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  pixels = mpimg.imread(str(path))
  assert pixels.shape[:2] == (1020, 1500)  # 8 panels, 3 a row at 5x3.4 in, 100 dpi
  colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
  assert len(colours) > 50  # curves, faint and solid: far more than a blank canvas
  assert (pixels[..., :3] < 0.5).mean() > 0.005  # text, axes and lines drawn in dark ink


def test_nothing_to_plot_and_no_log(tmp_path, capsys):
  with logging_io.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
    writer.write(1, {"time/sample_s": 0.5, "reward/format/mean": math.nan, "note": "text"})
  assert plots.plot_metrics(str(tmp_path)) is None
  assert plots.main([str(tmp_path)]) == 1
  assert "nothing to plot" in capsys.readouterr().err
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl in"):
    plots.plot_metrics(str(tmp_path / "nowhere"))
  with pytest.raises(SystemExit):
    plots.main([str(tmp_path), "--smoothing", "1"])


def test_a_groups_plots_drawn_by_worker_processes_are_the_runs_own(tmp_path, monkeypatch):
  """plots.drawing: runs' plots drawn by 2 worker processes while the block runs, byte for
  byte what plot_metrics draws here; a run whose worker fails is drawn again here, which
  raises its error naming the run."""
  runs = [tmp_path / f"run{i}" for i in range(3)]
  for i, run in enumerate(runs):
    run.mkdir()
    _write_run(run, steps=30 + 10 * i, beta=0.04)
  here = plots.plot_metrics
  with monkeypatch.context() as patch:
    patch.setattr(plots, "plot_metrics", lambda *_: pytest.fail("drawn in this process"))
    with plots.drawing(runs, workers=2):
      pass
  assert plots.plot_metrics is here
  drawn = [(run / plots.PLOT_FILE).read_bytes() for run in runs]
  for run, png in zip(runs, drawn):
    (run / plots.PLOT_FILE).unlink()
    plots.plot_metrics(str(run))
    assert (run / plots.PLOT_FILE).read_bytes() == png, run
  assert len(set(drawn)) == 3

  missing = tmp_path / "no_metrics"
  missing.mkdir()
  with pytest.raises(FileNotFoundError, match=f"no metrics.jsonl in '{missing}'"):
    with plots.drawing([runs[0], missing], workers=2):
      pass
  with pytest.raises(SystemExit):  # --out names one PNG
    plots.main([str(runs[0]), str(runs[1]), "--out", str(tmp_path / "x.png")])
