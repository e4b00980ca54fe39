"""metrics.jsonl / TensorBoard / samples files: strict JSON, NaN-safe, resume-safe."""
import glob
import importlib.util
import json
import math
import os
import re
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

import wandb_files
from grpo_jax import logging_io
from grpo_jax.errors import UserError


def _strict_lines(path):
  """Parses each line with a parser that rejects NaN/Infinity tokens, as strict JSON readers do."""
  def reject(token):
    raise AssertionError(f"non-standard JSON constant {token} in {path}")
  with open(path) as f:
    return [json.loads(line, parse_constant=reject) for line in f]


def _tb_events(logdir):
  """All events in a TensorBoard logdir, read from the TFRecord framing directly."""
  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
      pos += 12 + length + 4  # length, its crc, payload, payload crc
  return events


def test_metrics_are_strict_json_with_nan_as_null(tmp_path):
  with logging_io.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
    writer.write(1, {"reward/math_accuracy/mean": 0.25, "loss/kl": float("nan"),
                     "loss/total": np.float32(1.5), "sampler/tokens_per_s": jnp.asarray(3e4),
                     "clip/high_frac": np.float64("inf"), "sampler/num_truncated": np.int32(2),
                     "eval/ran": True})
    writer.write(2, {"loss/kl": jnp.float32(0.125)})
  assert _strict_lines(tmp_path / "metrics.jsonl") == [
      {"step": 1, "reward/math_accuracy/mean": 0.25, "loss/kl": None, "loss/total": 1.5,
       "sampler/tokens_per_s": 30000.0, "clip/high_frac": None, "sampler/num_truncated": 2,
       "eval/ran": True},
      {"step": 2, "loss/kl": 0.125}]
  with logging_io.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
    with pytest.raises(ValueError, match="'loss/per_token' must be a scalar.*shape \\(3,\\)"):
      writer.write(3, {"loss/per_token": np.zeros(3)})


def test_tensorboard_gets_the_finite_scalars(tmp_path):
  with logging_io.MetricsWriter(str(tmp_path)) as writer:
    for step in range(1, 4):
      writer.write(step, {"loss/kl": step / 8, "loss/nan": math.nan, "note": "text"})
  scalars = [(e.step, v.tag, v.simple_value)
             for e in _tb_events(tmp_path / "tensorboard") for v in e.summary.value]
  assert scalars == [(1, "loss/kl", 0.125), (2, "loss/kl", 0.25), (3, "loss/kl", 0.375)]


def test_tensorboard_itself_reads_the_events_and_honours_a_resume(tmp_path):
  """The tensorboard package (pyproject's [tensorboard] extra): its EventAccumulator reads what
  MetricsWriter wrote in WORKDIR/tensorboard, and drops what a dead run logged past the step a
  resumed run restarts from; `tensorboard --inspect --logdir` (the docs' command) lists the tags."""
  from tensorboard.backend.event_processing import event_accumulator
  with logging_io.MetricsWriter(str(tmp_path)) as writer:
    for step in range(1, 6):
      writer.write(step, {"loss/kl": step / 8, "eval/accuracy": 0.25 * (step % 2), "note": "x"})
  with logging_io.MetricsWriter(str(tmp_path), resume_step=3) as writer:  # died after step 3
    for step in (4, 5):
      writer.write(step, {"loss/kl": 10.0 * step})
  logdir = tmp_path / logging_io.TENSORBOARD_DIR
  events = event_accumulator.EventAccumulator(str(logdir))
  events.Reload()
  assert sorted(events.Tags()["scalars"]) == ["eval/accuracy", "loss/kl"]
  assert [(e.step, e.value) for e in events.Scalars("loss/kl")] == [
      (1, 0.125), (2, 0.25), (3, 0.375), (4, 40.0), (5, 50.0)]
  assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [
      (1, 0.25), (2, 0.0), (3, 0.25)]
  inspect = subprocess.run([sys.executable, "-m", "tensorboard.main", "--inspect",
                            f"--logdir={logdir}"], capture_output=True, text=True, timeout=120)
  assert inspect.returncode == 0, inspect.stderr[-2000:]
  assert re.search(r"scalars\n\s+eval/accuracy\n\s+loss/kl\n", inspect.stdout), inspect.stdout
  assert re.search(r"last_step\s+5\n", inspect.stdout), inspect.stdout


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
  with logging_io.MetricsWriter(str(tmp_path)) as writer:
    for step in range(1, 6):
      writer.write(step, {"loss/kl": float(step)})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "loss/k')  # the crash came mid-line
  assert [r["step"] for r in logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3,
                                                                                       4, 5]
  with logging_io.MetricsWriter(str(tmp_path), resume_step=3) as writer:
    writer.write(4, {"loss/kl": 40.0})
  assert _strict_lines(tmp_path / "metrics.jsonl") == [
      {"step": 1, "loss/kl": 1.0}, {"step": 2, "loss/kl": 2.0}, {"step": 3, "loss/kl": 3.0},
      {"step": 4, "loss/kl": 40.0}]
  # TensorBoard is told to purge what the dead run logged from step 4 on.
  starts = [e.step for e in _tb_events(tmp_path / "tensorboard")
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert starts == [4]


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid JSON"):
    logging_io.MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False)
  assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\nnot json\n{"step": 3}\n'


def test_wandb_is_optional(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, wherever the test runs
  with pytest.raises(UserError, match=r'config\.train\.wandb: .*pip install "\.\[wandb\]"'):
    logging_io.MetricsWriter(str(tmp_path), tensorboard=False, wandb=True)


def test_samples_jsonl_and_markdown_resume(tmp_path):
  nasty = "<think>~~~~\n## step 99\n</think><answer>72</answer>"
  writer = logging_io.SamplesWriter(str(tmp_path))
  writer.write(1, [{"prompt": "Q1", "completion": nasty, "gold": "72",
                    "rewards": {"math_accuracy": np.float32(1.0), "format": float("nan")}}])
  writer.write(2, [{"prompt": "Q2", "completion": "no", "rewards": {"math_accuracy": 0.0}},
                   {"prompt": "Q2", "completion": "yes", "rewards": {"math_accuracy": 1.0}}])
  assert [(r["step"], r["completion"]) for r in _strict_lines(tmp_path / "samples.jsonl")] == [
      (1, nasty), (2, "no"), (2, "yes")]
  md = (tmp_path / "samples.md").read_text()
  assert md.count("## step 1\n") == 1 and md.count("## step 2\n") == 1
  # The completion sits verbatim inside a fence longer than its own "~~~~".
  assert f"~~~~~text\n{nasty}\n~~~~~\n" in md
  assert "### sample 1: math_accuracy=1, format=missing, gold=72" in md

  logging_io.SamplesWriter(str(tmp_path), resume_step=1).write(
      2, [{"prompt": "Q2", "completion": "again", "rewards": {}}])
  assert [(r["step"], r["completion"]) for r in _strict_lines(tmp_path / "samples.jsonl")] == [
      (1, nasty), (2, "again")]
  md = (tmp_path / "samples.md").read_text()
  assert "no\n" not in md and "yes\n" not in md and "again\n" in md
  with pytest.raises(ValueError, match="sample 0 at step 3 has no 'completion'"):
    writer.write(3, [{"prompt": "Q3"}])


def _wandb_config(tmp_path, **train):
  from grpo_jax import config as config_lib
  config = config_lib.defaults()
  config.train.update(wandb=True, wandb_mode="offline", wandb_project="grpo-test",
                      wandb_tags=("tiny", "baseline"), **train)
  return config


def test_wandb_offline_run_holds_the_metrics_config_and_plot(tmp_path):
  """An offline wandb run (no network) written by MetricsWriter, read back from the files wandb
  wrote: each step's flat metrics at its step, the resolved config, the run's name, project
  and tags, and metrics.png logged at the last step."""
  workdir = tmp_path / "tiny_run"
  config = _wandb_config(tmp_path)
  kwargs = logging_io.wandb_init_kwargs(config, str(workdir))
  with logging_io.MetricsWriter(str(workdir), tensorboard=False, wandb=True, wandb_kwargs=kwargs,
                                plot_step=3) as writer:
    for step in range(1, 4):
      writer.write(step, {"reward/total/mean": step / 4, "loss/kl": math.nan, "flag": True})
  run_id = (workdir / logging_io.WANDB_ID_FILE).read_text().strip()
  (run_dir,) = glob.glob(str(workdir / "wandb" / f"offline-run-*-{run_id}"))
  records = wandb_files.records(run_dir)
  (run,) = [r.run for r in records if r.HasField("run")]
  assert (run.run_id, run.project, run.display_name, list(run.tags)) == (
      run_id, "grpo-test", "tiny_run", ["tiny", "baseline"])
  history, logged_config = wandb_files.history(records)
  assert sorted(history) == [1, 2, 3]
  for step in (1, 2, 3):
    assert history[step]["reward/total/mean"] == step / 4
    assert history[step]["loss/kl"] is None and history[step]["flag"] is True
  assert logged_config["train"]["wandb_tags"] == ["tiny", "baseline"]
  assert logged_config["optim"]["lr"] == config.optim.lr and logged_config["seed"] == 0
  image = history[3]["plots/metrics"]
  assert image["_type"] == "image-file"
  png = open(os.path.join(run_dir, "files", image["path"]), "rb").read()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resume_continues_the_wandb_run_and_a_fresh_start_begins_another(tmp_path):
  config = _wandb_config(tmp_path, wandb_name="named")
  kwargs = logging_io.wandb_init_kwargs(config, str(tmp_path))
  ids = []
  for resume_step, steps in ((-1, (1, 2, 3)), (2, (3, 4)), (-1, (1,))):
    with logging_io.MetricsWriter(str(tmp_path), resume_step=resume_step, tensorboard=False,
                                  wandb=True, wandb_kwargs=kwargs) as writer:
      for step in steps:
        writer.write(step, {"loss/kl": 10.0 * step})
    ids.append((tmp_path / logging_io.WANDB_ID_FILE).read_text().strip())
  assert ids[0] == ids[1] != ids[2]
  # Named by the second it started, then the id (and -1 for a second run in that second).
  runs = sorted(glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{ids[0]}*")))
  assert len(runs) == 2  # two processes' files of one wandb run (`wandb sync` joins them)
  resumed = wandb_files.records(runs[1])
  assert [r.run.display_name for r in resumed if r.HasField("run")] == ["named"]
  assert {step: h["loss/kl"] for step, h in wandb_files.history(resumed)[0].items()} == {
      3: 30.0, 4: 40.0}


def test_a_missing_wandb_is_a_user_error_naming_the_field_and_the_install(monkeypatch, tmp_path):
  from grpo_jax import config as config_lib, preflight
  config = config_lib.defaults()
  config.train.tensorboard = False
  preflight.check_packages(config, str(tmp_path))  # off: nothing is needed
  config.train.wandb = True
  preflight.check_packages(config, str(tmp_path))  # installed here
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(UserError, match=r'config\.train\.wandb=True.*pip install "\.\[wandb\]"'):
    preflight.check_packages(config, str(tmp_path))


def test_a_resume_may_change_how_a_run_is_recorded_without_a_warning():
  """config_lib.config_changes (the resume warning) leaves out the logging settings."""
  from grpo_jax import config as config_lib
  before = config_lib.defaults()
  after = config_lib.defaults()
  after.train.update(progress_every_s=0.0, tensorboard=False, wandb=True, wandb_tags=("x",),
                     wandb_mode="offline", wandb_name="n", wandb_project="p", wandb_entity="e")
  previous = json.loads(before.to_json_best_effort())
  assert config_lib.config_changes(previous, after) == []
  after.train.steps = 7
  assert config_lib.config_changes(previous, after) == ["train.steps: 500 -> 7"]
