"""Interrupts are checkpoints: SIGINT or SIGTERM in each phase of a real tiny run (the warm
start, the step-0 evaluation, a GRPO step, the final export) stops it with one line and status
130 or 143, and rerunning the same command finishes a run equal, byte for byte, to one that was
never interrupted (its final model, samples and metrics less the timings). A second signal
exits at once. Each signal lands in its phase by waiting for a marker: a line the run prints,
or a checkpoint's last file.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cli
from grpo_jax import checkpoint, logging_io, sft

REPO = cli.REPO
TESTS = os.path.dirname(os.path.abspath(__file__))
# A warm start of 20 steps checked every 5 (its target is out of reach: all 20 are taken), then
# 6 GRPO steps checkpointed every 2: room to land a signal in each phase.
FLAGS = ["--config.sft.steps=20", "--config.sft.eval_every=5", "--config.sft.target_accuracy=0.99",
         "--config.sft.eval_examples=16", "--config.train.steps=6",
         "--config.train.checkpoint_every=2", "--config.train.prompts_per_step=4",
         "--config.train.eval_examples=8", "--config.train.eval_every=0",
         "--config.train.tensorboard=False", "--config.data.synthetic_train=400",
         "--config.data.synthetic_test=40"]


def _command(workdir, module="grpo_jax.main"):
  return [sys.executable, "-m", module, "--config=configs/gsm8k.py:tiny", f"--workdir={workdir}",
          *FLAGS]


def _run(workdir, module="grpo_jax.main"):
  """The command to its end: (status, stdout and stderr together)."""
  done = subprocess.run(_command(workdir, module), cwd=REPO, capture_output=True, text=True,
                        timeout=600, env=cli.env(PYTHONPATH=os.pathsep.join([TESTS, str(REPO)])))
  return done.returncode, done.stdout + done.stderr


class _Running:
  """The command in the background, its output lines collected as they come."""

  def __init__(self, workdir):
    self.proc = subprocess.Popen(_command(workdir), cwd=REPO, env=cli.env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines = []
    self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout))
    self._reader.start()

  def wait_for(self, ready):
    """Until ready() (then the run must still be running)."""
    deadline = time.monotonic() + 600
    while not ready() and self.proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.02)
    assert self.proc.poll() is None, f"the run ended before its marker: {self.out()[-3000:]}"

  def printed(self, text):
    return lambda: any(text in line for line in self.lines)

  def finish(self):
    """(status, output) once it has exited."""
    self.proc.wait(timeout=300)
    self._reader.join(timeout=30)
    return self.proc.returncode, self.out()

  def out(self):
    return "".join(self.lines)


def _signalled(workdir, ready, sig):
  """(status, output) of a run sent `sig` once ready(run) holds."""
  run = _Running(workdir)
  run.wait_for(ready(run))
  run.proc.send_signal(sig)
  return run.finish()


def _lines(out, text="grpo_jax: "):
  """The run's lines from `text` on (a progress bar may precede one on its terminal line)."""
  return [line[line.index(text):] for line in out.splitlines() if text in line]


def _interrupted_line(out):
  """The run's one line saying where it stopped (no traceback beside it)."""
  assert "Traceback" not in out, out[-3000:]
  lines = _lines(out, "grpo_jax: interrupted")
  assert len(lines) == 1, out[-3000:]
  return lines[0]


def _assert_same_run(reference, workdir):
  """workdir finished as the uninterrupted reference: the same final model bytes, samples and
  metrics (timings aside), no warm-start checkpoint left."""
  name = "final_model/model.safetensors"
  assert (workdir / name).read_bytes() == (reference / name).read_bytes()
  assert (workdir / "samples.jsonl").read_bytes() == (reference / "samples.jsonl").read_bytes()
  timing = set(logging_io.TIMING_METRICS)
  rows = [[{k: v for k, v in r.items() if k not in timing}
           for r in logging_io.read_jsonl(str(d / "metrics.jsonl"))] for d in (reference, workdir)]
  assert [r["step"] for r in rows[1]] == list(range(7))
  assert rows[0] == rows[1]
  assert not sft.has_checkpoint(str(workdir))
  assert "stopped_early" not in json.loads((workdir / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One uninterrupted run, shared by the tests."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  code, out = _run(workdir)
  assert code == 0, out[-3000:]
  return workdir


def test_sigint_in_the_warm_start_saves_it_and_the_rerun_resumes_it(reference, tmp_path):
  code, out = _signalled(tmp_path, lambda r: r.printed("warm start step 5: validation accuracy"),
                         signal.SIGINT)
  assert code == 130, out[-3000:]
  line = _interrupted_line(out)
  stopped = re.fullmatch(
      rf"grpo_jax: interrupted \(SIGINT\) in the warm start at step (\d+) of at most 20: saved "
      rf"it to {re.escape(sft.checkpoint_dir(str(tmp_path)))}; run the same command to resume",
      line)
  assert stopped, line
  step = int(stopped.group(1))
  assert 5 <= step < 20, line
  # Its own checksummed checkpoint, no GRPO step yet.
  saved = [p for p in Path(sft.checkpoint_dir(str(tmp_path))).iterdir()]
  assert [p.name for p in saved] == [str(step)] and (saved[0] / "SHA256SUMS").is_file()
  assert checkpoint.latest_step(str(tmp_path)) is None

  code, out = _run(tmp_path)
  assert code == 0, out[-3000:]
  assert f"resumed the warm start from step {step}" in out
  assert "warm start step 5:" not in out  # the checks before it are not taken again
  _assert_same_run(reference, tmp_path)


def test_sigterm_in_the_step_0_evaluation_saves_step_0(reference, tmp_path):
  # The warm start's last line: the step-0 evaluation (its programs compiling) comes next.
  code, out = _signalled(tmp_path,
                         lambda r: r.printed("the warm start ended at its limit of 20 steps"),
                         signal.SIGTERM)
  assert code == 143, out[-3000:]
  assert _interrupted_line(out) == (
      f"grpo_jax: interrupted (SIGTERM) in the step-0 evaluation: saved step 0 to "
      f"{tmp_path}/checkpoints/0; run the same command to resume")
  assert "held-out greedy accuracy at GRPO step 0" in out  # the evaluation finished first
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["0"]
  assert [r["step"] for r in logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0]

  code, out = _run(tmp_path)
  assert code == 0, out[-3000:]
  assert "resumed from step 0" in out and "validation accuracy" not in out  # no warm start
  _assert_same_run(reference, tmp_path)


def test_sigint_in_a_grpo_step_saves_that_step(reference, tmp_path):
  saved = tmp_path / "checkpoints" / "2" / "SHA256SUMS"
  code, out = _signalled(tmp_path, lambda r: saved.is_file, signal.SIGINT)
  assert code == 130, out[-3000:]
  stopped = re.fullmatch(
      rf"grpo_jax: interrupted \(SIGINT\) in GRPO step (\d+) of 6: saved step \1 to "
      rf"{re.escape(str(tmp_path))}/checkpoints/\1; run the same command to resume",
      _interrupted_line(out))
  assert stopped, _interrupted_line(out)
  step = int(stopped.group(1))
  assert 2 <= step < 6 and checkpoint.latest_step(str(tmp_path)) == step
  assert not (tmp_path / "final_model").exists()
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["stopped_early"] and summary["stopped_at_step"] == step

  code, out = _run(tmp_path)
  assert code == 0, out[-3000:]
  assert f"resumed from step {step}" in out
  _assert_same_run(reference, tmp_path)


def test_an_interrupt_while_final_model_is_written_leaves_none_and_a_rerun_exports(reference,
                                                                                   tmp_path):
  """The reference's workdir without its final model: a start resumes at train.steps, takes no
  step and exports; export_interrupted_main sends SIGINT once the model's files are written."""
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  shutil.rmtree(workdir / "final_model")
  code, out = _run(workdir, module="export_interrupted_main")
  assert code == 130, out[-3000:]
  assert "resumed from step 6" in out
  assert _interrupted_line(out) == (
      "grpo_jax: interrupted (SIGINT) in the final export: the checkpoint of step 6 is kept, "
      "and final_model/ is whole or absent; run the same command to export it")
  assert sorted(p.name for p in workdir.iterdir() if p.name.startswith("final_model")) == []

  code, out = _run(workdir)
  assert code == 0, out[-3000:]
  assert "resumed from step 6" in out
  _assert_same_run(reference, workdir)


def test_a_second_sigint_exits_at_once(tmp_path):
  """SIGINT in the warm start, then SIGINT again every 0.1 s (signals that come before
  Python's handler runs count as one) until the run exits: the second one it sees ends it at
  once, while it saves the warm start or while it winds down after its line, with status 130,
  one more line and no traceback."""
  run = _Running(tmp_path)
  run.wait_for(run.printed("warm start step 5: validation accuracy"))
  t0 = time.monotonic()
  while run.proc.poll() is None and time.monotonic() < t0 + 30:
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
  code, out = run.finish()
  assert code == 130, out[-3000:]
  assert time.monotonic() - t0 < 10, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  lines = _lines(out)
  assert lines[-1] == (
      "grpo_jax: interrupted again (SIGINT): exiting at once, without finishing the save in "
      "progress; the same command resumes from the last finished checkpoint"), out[-3000:]
  # Before it, at most the first signal's line (when the run had stopped by then).
  assert all(l.startswith("grpo_jax: interrupted (SIGINT) in the warm start")
             for l in lines[:-1] if "interrupted" in l), out[-3000:]
  assert checkpoint.latest_step(str(tmp_path)) is None
