"""Sweep report: the table's statistics against a hand computation on fabricated run
directories (summary.json, metrics.jsonl, sweep_run.json as main and the runner write them),
unfinished runs left out and counted, one PNG per metric; the intervals, paired differences,
seed counts and Wilson intervals the report prints are those of grpo_jax.stats (tested on its
own in stats_test) on the right numbers, and the plots shade the t interval of the mean."""

import json
import math

import numpy as np
import pytest
import scipy.stats
from matplotlib import image as mpimg

from grpo_jax import report, stats

STEPS = 60


def _write_run(sweep_dir, overrides, *, start, end, reward, wall_s, finished=True,
               eval_examples=None):
  """A run whose reward/total/mean is reward + step / 1000 and whose length is 20 + step."""
  d = sweep_dir / ",".join(f"{k}={v!r}" for k, v in sorted(overrides.items()))
  d.mkdir(parents=True)
  records = [{"step": 0, "eval/accuracy": start}]
  records += [{"step": s, "reward/total/mean": reward + s / 1000, "kl": 0.0,
               "loss/kl": 1.0,  # the loss's term, not the KL column's
               "completion/mean_length": 20.0 + s, "entropy": 1.0}
              for s in range(1, STEPS + 1)]
  records[-1]["eval/accuracy"] = end
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  summary = {"eval_accuracy_start": start, "start_step": 0}
  if eval_examples is not None:
    summary["eval_examples"] = eval_examples
  if finished:
    summary.update(eval_accuracy_end=end, end_step=STEPS,
                   eval_accuracy_gain_points=100 * (end - start))
  else:
    summary = {"stopped_early": True, "stopped_at_step": 30, **summary}
  (d / "summary.json").write_text(json.dumps(summary))
  (d / "sweep_run.json").write_text(json.dumps({
      "kind": "run", "overrides": overrides, "wall_s": wall_s,
      "status": "done" if finished else "interrupted"}))
  return d


@pytest.fixture
def sweep_dir(tmp_path):
  # lr 1e-3: three seeds; lr 2e-3: two finished seeds and one stopped early.
  for seed, (start, end, reward, wall) in enumerate([(0.20, 0.50, 0.1, 60), (0.25, 0.59, 0.2, 90),
                                                     (0.30, 0.71, 0.3, 120)]):
    _write_run(tmp_path, {"optim.lr": 1e-3, "seed": seed}, start=start, end=end, reward=reward,
               wall_s=wall)
  for seed, (start, end) in enumerate([(0.20, 0.40), (0.25, 0.45)]):
    _write_run(tmp_path, {"optim.lr": 2e-3, "seed": seed}, start=start, end=end, reward=0.0,
               wall_s=30)
  _write_run(tmp_path, {"optim.lr": 2e-3, "seed": 2}, start=0.3, end=0.3, reward=0.0, wall_s=10,
             finished=False)
  return tmp_path


def test_mean_std_is_the_sample_std():
  assert report.mean_std([30.0, 34.0, 41.0]) == pytest.approx((35.0, math.sqrt(31.0), 3))
  mean, std, n = report.mean_std([2.0, None, float("nan")])
  assert (mean, n) == (2.0, 1) and math.isnan(std)


def test_table_against_hand_computation(sweep_dir):
  rows = {r["setting"]: r for r in report.table(report.load_runs(str(sweep_dir)))}
  assert set(rows) == {"optim.lr=0.001", "optim.lr=0.002"}
  a, b = rows["optim.lr=0.001"], rows["optim.lr=0.002"]
  assert (a["n"], a["runs"], b["n"], b["runs"]) == (3, 3, 2, 3)
  # Gains 30, 34, 41 points: mean 35, squared deviations 25 + 1 + 36 = 62 over n - 1 = 2.
  assert a["gain"] == pytest.approx((35.0, math.sqrt(31.0), 3))
  assert a["final"] == pytest.approx((60.0, math.sqrt(((50 - 60) ** 2 + 1 + 11 ** 2) / 2), 3))
  assert a["start"] == pytest.approx((25.0, 5.0, 3))
  # Reward over the last 50 steps (11..60): reward + 35.5 / 1000; seeds 0.1, 0.2, 0.3.
  assert a["reward"] == pytest.approx((0.2355, 0.1, 3))
  assert a["length"] == pytest.approx((55.5, 0.0, 3))
  assert a["KL"] == pytest.approx((0.0, 0.0, 3))
  assert a["wall"] == pytest.approx((1.5, 0.5, 3))  # 60, 90, 120 s
  # The stopped-early seed is not averaged in: gains 20 and 20.
  assert b["gain"] == pytest.approx((20.0, 0.0, 2))
  assert b["final"] == pytest.approx((42.5, math.sqrt(12.5), 2))


def test_steps_to_half_the_gain_against_numpy(tmp_path):
  """half: the first evaluation at or above half of each run's gain, as NumPy finds it on the
  same curves; none for a run that did not gain, left out of its setting's mean and interval."""
  rng = np.random.default_rng(0)
  steps = np.arange(0, 401, 50)
  curves = {seed: np.concatenate([[0.2], 0.2 + np.sort(rng.uniform(0, 0.4, len(steps) - 1))])
            for seed in range(4)}
  curves[4] = np.full(len(steps), 0.3)  # no gain
  for seed, acc in curves.items():
    d = tmp_path / f"seed={seed}"
    d.mkdir()
    records = [{"step": int(s), "eval/accuracy": float(a), "reward/total/mean": 0.0}
               for s, a in zip(steps, acc)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "summary.json").write_text(json.dumps({
        "eval_accuracy_start": acc[0], "eval_accuracy_end": acc[-1], "start_step": 0,
        "end_step": 400, "eval_accuracy_gain_points": 100 * (acc[-1] - acc[0])}))
    (d / "sweep_run.json").write_text(json.dumps({"kind": "run", "overrides": {"seed": seed},
                                                  "status": "done", "wall_s": 1.0}))
  expected = [steps[np.argmax(a - a[0] >= (a[-1] - a[0]) / 2)] for a in curves.values()][:4]
  runs = report.load_runs(str(tmp_path))
  got = [report.run_values(r)["half"] for r in runs]
  assert got[:4] == expected and math.isnan(got[4])
  (row,) = report.interval_rows(runs)
  mean, std, lo, hi = row["half"]
  assert mean == pytest.approx(np.mean(expected)) and std == pytest.approx(np.std(expected, ddof=1))
  assert (lo, hi) == pytest.approx(stats.t_mean_ci(expected))
  text = report.render(str(tmp_path), runs, [])
  assert f"{np.mean(expected):.0f} [{lo:.0f}, {hi:.0f}]" in text


def test_report_md_and_plots(sweep_dir):
  path = report.write_report(str(sweep_dir))
  text = open(path).read()
  assert "| `optim.lr=0.001` | 3 | 25.0 ± 5.0 | 60.0 ± 10.5 | 35.0 ± 5.6 |" in text
  assert "| `optim.lr=0.002` | 2 of 3 |" in text
  assert "| `optim.lr=0.002,seed=2` | interrupted |" in text
  for key in ("reward_total_mean", "eval_accuracy", "completion_mean_length", "entropy"):
    assert f"(plots/{key}.png)" in text
    image = mpimg.imread(sweep_dir / "plots" / f"{key}.png")
    assert image.shape[0] > 100 and image.std() > 0  # a real picture, not blank
  assert not (sweep_dir / "plots" / "kl.png").exists()  # all zero: plots.panels drops it


def test_plot_band_is_mean_pm_std_of_the_smoothed_seeds(sweep_dir, monkeypatch):
  """What plot_metric draws: for each setting, the mean and std over seeds of each seed's
  EMA-smoothed series (weight from plots.smoothing_weight of 60 points)."""
  from grpo_jax import plots

  drawn, real = [], report.mean_std

  def spy(xs):
    drawn.append(list(xs))
    return real(xs)
  monkeypatch.setattr(report, "mean_std", spy)
  runs = report.load_runs(str(sweep_dir))
  report.plot_metric(runs, "reward/total/mean", "Reward", False, str(sweep_dir / "r.png"))
  w = plots.smoothing_weight(STEPS)
  smoothed = [plots.ema([r + s / 1000 for s in range(1, STEPS + 1)], w) for r in (0.1, 0.2, 0.3)]
  assert drawn[0] == pytest.approx([s[0] for s in smoothed])        # lr 1e-3, step 1
  assert drawn[STEPS - 1] == pytest.approx([s[-1] for s in smoothed])  # step 60
  assert len(drawn) == 2 * STEPS  # then lr 2e-3's two finished seeds


def _t(xs):
  """scipy's 95% t interval of the mean, the reference for stats.mean_ci."""
  xs = np.asarray(xs, float)
  return scipy.stats.t.interval(0.95, len(xs) - 1, loc=xs.mean(), scale=scipy.stats.sem(xs))


def test_intervals_paired_differences_and_seed_counts(sweep_dir):
  runs = report.load_runs(str(sweep_dir))
  rows = {r["setting"]: r for r in report.interval_rows(runs, effect=5.0)}
  a, b = rows["optim.lr=0.001"], rows["optim.lr=0.002"]
  assert a["gain"] == pytest.approx((35.0, math.sqrt(31.0), *_t([30.0, 34.0, 41.0])))
  assert a["final"][2:] == pytest.approx(_t([50.0, 59.0, 71.0]))
  assert a["start"][2:] == pytest.approx(_t([20.0, 25.0, 30.0]))
  assert a["seeds_needed"] == stats.seeds_needed(5.0, math.sqrt(31.0), paired=False)
  assert b["seeds_needed"] is None  # gains 20 and 20: no spread to size a study with
  # Paired over seeds 0 and 1 (seed 2 of lr 2e-3 stopped early): gains 20 - 30, 20 - 34.
  (pair,) = report.paired_rows(runs, "gain", effect=5.0)
  assert (pair["a"], pair["b"]) == ("optim.lr=0.001", "optim.lr=0.002")
  p = pair["paired"]
  assert p.seeds == [0, 1] and p.diffs.tolist() == pytest.approx([-10.0, -14.0])
  assert (p.mean, p.std) == pytest.approx((-12.0, math.sqrt(8.0)))
  assert p.ci == pytest.approx(_t([-10.0, -14.0])) and not p.excludes_zero  # 2 seeds: ± 25
  assert pair["seeds_needed"] == stats.seeds_needed(5.0, math.sqrt(8.0), paired=True)
  # Final accuracy: 40 - 50, 45 - 59.
  (final,) = report.paired_rows(runs, "final")
  assert final["paired"].diffs.tolist() == pytest.approx([-10.0, -14.0])

  text = report.render(str(sweep_dir), runs, [], effect=5.0)
  lo, hi = _t([30.0, 34.0, 41.0])
  # Every run evaluates at steps 0 and 60 only: each reaches half its gain at step 60.
  assert f"| 35.0 [{lo:.1f}, {hi:.1f}] | 60 [60, 60] | {a['seeds_needed']} |" in text
  lo, hi = p.ci
  assert (f"| `optim.lr=0.002` | `optim.lr=0.001` | 2 | -12.0 | 2.8 | [{lo:.1f}, {hi:.1f}] | "
          f"no | {pair['seeds_needed']} |") in text
  assert "Student's t, mean ± t(0.975, n − 1) · s / √n" in text


def test_wilson_interval_of_each_run(tmp_path):
  d = _write_run(tmp_path, {"seed": 0}, start=0.25, end=0.5, reward=0.1, wall_s=60,
                 eval_examples=512)
  # Written before summary.json recorded eval_examples: config.json and the run's data/.
  old = _write_run(tmp_path, {"seed": 1}, start=0.25, end=0.375, reward=0.1, wall_s=60)
  (old / "config.json").write_text(json.dumps({"train": {"eval_examples": 0}}))
  (old / "data").mkdir()
  (old / "data" / "test.jsonl").write_text("{}\n" * 200)
  capped = _write_run(tmp_path, {"seed": 2}, start=0.25, end=0.5, reward=0.1, wall_s=60)
  (capped / "config.json").write_text(json.dumps({"train": {"eval_examples": 64}}))
  (capped / "data").mkdir()
  (capped / "data" / "test.jsonl").write_text("{}\n" * 200)
  unknown = _write_run(tmp_path, {"seed": 3}, start=0.25, end=0.5, reward=0.1, wall_s=60)
  runs = {r.dir: r for r in report.load_runs(str(tmp_path))}
  counts = [report.eval_examples(str(tmp_path), runs[x.name]) for x in (d, old, capped, unknown)]
  assert counts == [512, 200, 64, None]
  # Half-width of the Wilson interval at p = 1/2: z / (2 sqrt(n + z^2)), z = 1.95996.
  z = 1.959963984540054
  half = 100 * z / (2 * math.sqrt(512 + z * z))
  assert report.accuracy_interval(0.5, 512) == pytest.approx((50 - half, 50 + half))
  assert report.accuracy_interval(0.375, 200) == pytest.approx(
      tuple(100 * v for v in stats.wilson_ci(75, 200)))
  assert all(math.isnan(v) for v in report.accuracy_interval(0.5, None))
  text = open(report.write_report(str(tmp_path))).read()
  lo, hi = report.accuracy_interval(0.5, 512)
  assert f"| 512 | [{lo:.1f}, {hi:.1f}] |" in text
  (row,) = [line for line in text.splitlines() if line.startswith("| `seed=3` | finished |")]
  assert row.endswith("| — | — |")  # no eval count known: no interval


def test_plot_band_is_the_t_interval(sweep_dir, monkeypatch):
  """The shaded band at each step: the t interval of the mean of the seeds' smoothed values."""
  import matplotlib.axes

  from grpo_jax import plots

  bands, real = [], matplotlib.axes.Axes.fill_between

  def spy(self, x, y1, y2, **kw):
    bands.append((list(x), list(y1), list(y2)))
    return real(self, x, y1, y2, **kw)
  monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", spy)
  runs = report.load_runs(str(sweep_dir))
  report.plot_metric(runs, "reward/total/mean", "Reward", False, str(sweep_dir / "r.png"))
  w = plots.smoothing_weight(STEPS)
  smoothed = [plots.ema([r + s / 1000 for s in range(1, STEPS + 1)], w) for r in (0.1, 0.2, 0.3)]
  steps, lo, hi = bands[0]  # lr 1e-3
  assert steps == list(range(1, STEPS + 1))
  for i in (0, STEPS - 1):
    want = _t([s[i] for s in smoothed])
    assert (lo[i], hi[i]) == pytest.approx(want)
    mean = sum(s[i] for s in smoothed) / 3
    assert lo[i] < mean < hi[i]
  assert len(bands) == 2  # lr 2e-3's two finished seeds have a band too


def test_settings_with_one_name_stay_two_rows(tmp_path):
  """'Be brief!' and 'Be brief?' both give the name 'data.system_prompt=Be_brief_': settings
  are grouped by their overrides, and the names get a hash of them to tell the rows apart."""
  for prompt, ends in (("Be brief!", (0.10, 0.12)), ("Be brief?", (0.40, 0.44))):
    for seed, end in enumerate(ends):
      _write_run(tmp_path, {"data.system_prompt": prompt, "seed": seed}, start=0.0, end=end,
                 reward=0.1, wall_s=60)
  runs = report.load_runs(str(tmp_path))
  rows = report.table(runs)
  assert [row["n"] for row in rows] == [2, 2]
  assert rows[0]["gain"] == pytest.approx((11.0, math.sqrt(2.0), 2))  # gains 10, 12
  assert rows[1]["gain"] == pytest.approx((42.0, math.sqrt(8.0), 2))  # gains 40, 44
  names = [row["setting"] for row in rows]
  assert len(set(names)) == 2 and all(n.startswith("data.system_prompt=Be_brief_,")
                                      for n in names)
  (pair,) = report.paired_rows(runs)
  assert pair["paired"].diffs.tolist() == pytest.approx([30.0, 32.0])


def test_plotted_mean_counts_a_seed_whose_series_is_all_zero(tmp_path, monkeypatch):
  """plots.panels leaves out a run's kl / clip/region_frac when it is all 0; the report keeps
  such a seed in its setting's mean, and leaves the metric out only for a setting that is 0
  on every seed."""
  def run(setting, seed, clip, kl):
    records = [{"step": t, "reward/total/mean": 0.5, "clip/region_frac": clip, "kl": kl}
               for t in range(1, 6)]
    return report.RunResult(f"x={setting},seed={seed}", {"x": setting, "seed": seed},
                            "finished", {"eval_accuracy_gain_points": 1.0}, records, None)
  runs = [run(1, 0, 0.0, 0.0), run(1, 1, 0.02, 0.001), run(2, 0, 0.0, 0.0), run(2, 1, 0.0, 0.0)]
  drawn, real = [], report.mean_std

  def spy(xs):
    drawn.append(list(xs))
    return real(xs)
  monkeypatch.setattr(report, "mean_std", spy)
  for key, value in (("clip/region_frac", 0.02), ("kl", 0.001)):
    drawn.clear()
    report.plot_metric(runs, key, key, False, str(tmp_path / "p.png"), smoothing=0.0)
    assert drawn == [[0.0, value]] * 5, key  # x=1's two seeds at steps 1-5; x=2 not drawn
    assert real(drawn[0])[0] == pytest.approx(value / 2)


def test_runs_not_started_count_from_sweep_json(tmp_path):
  """A run sweep.json lists without a directory yet (the sweep stopped before it, or it waits
  for its prefix): listed with sweep.json's overrides and status, and counted in "n of N"."""
  listed = []
  for seed in range(3):
    overrides = {"optim.lr": 1e-3, "seed": seed}
    if seed < 2:
      _write_run(tmp_path, overrides, start=0.2, end=0.5, reward=0.1, wall_s=60)
    listed.append({"dir": f"optim.lr=0.001,seed={seed}", "name": f"optim.lr=0.001,seed={seed}",
                   "kind": "run", "prefix": None, "overrides": overrides,
                   "status": "done" if seed < 2 else "pending", "returncode": None,
                   "reason": None, "wall_s": 0.0, "log": None})
  (tmp_path / "sweep.json").write_text(json.dumps({"sweep_file": "s.py", "config": "c.py",
                                                   "fixed": {}, "runs": listed}))
  runs = report.load_runs(str(tmp_path))
  assert [(r.dir, r.status, r.seed) for r in runs][2] == ("optim.lr=0.001,seed=2", "pending", 2)
  (row,) = report.table(runs)
  assert (row["n"], row["runs"]) == (2, 3)
  text = report.render(str(tmp_path), runs, [])
  assert "| `optim.lr=0.001` | 2 of 3 |" in text
  assert "| `optim.lr=0.001,seed=2` | pending |" in text
