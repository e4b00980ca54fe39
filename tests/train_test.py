"""The training program end to end: the real GSM8K files through the whole data path,
preemption (SIGKILL, SIGTERM) followed by a resume that equals an uninterrupted run bit for bit,
and damaged checkpoints (resume from the last good one, or stop with a clear error)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

import fixtures
from configs import gsm8k
from grpo_jax import logging_io, train

REPO = Path(__file__).resolve().parents[1]


def _gold(answer: str) -> str:
  return answer.rsplit("####", 1)[1].strip().replace(",", "")


def test_real_gsm8k_through_the_whole_data_path(tmp_path):
  config = gsm8k.get_config("tiny")
  config.data.source = str(fixtures.GSM8K)
  config.data.prompt_buckets = (160, 320)
  config.sampling.num_generations = 2
  config.sampling.max_new_tokens = 6
  config.sft.steps = 0
  config.train.update(steps=2, prompts_per_step=2, eval_examples=4, eval_batch_size=4,
                      eval_every=1, checkpoint_every=1, samples_per_step=2, tensorboard=False)
  summary = train.run(config, str(tmp_path))

  train_rows = [json.loads(line) for line in open(fixtures.GSM8K / "train.jsonl")]
  assert len(train_rows) == 7473
  records = logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2]
  assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in records)
  assert summary["end_step"] == 2
  for r in records[1:]:
    assert r["reward/math_accuracy/missing_frac"] == 0.0
    assert 0.0 <= r["reward/math_accuracy/mean"] <= 1.0
  # The prompts are the real questions, in the documented order: a permutation seeded by
  # (seed, epoch); each sample carries its row's gold answer.
  order = np.random.default_rng([config.seed, 0]).permutation(len(train_rows))
  samples = logging_io.read_jsonl(str(tmp_path / "samples.jsonl"))
  expected = [train_rows[i] for i in order[:4]]
  assert len(samples) == 4
  for sample, row in zip(samples, expected):
    assert row["question"] in sample["prompt"]
    assert sample["gold"] == _gold(row["answer"])
    assert set(sample["rewards"]) == {"math_accuracy"}
  assert (tmp_path / "metrics.png").is_file()
  assert (tmp_path / "final_model" / "config.json").is_file()


def test_summary_reports_a_gain_only_for_a_completed_run(tmp_path, capsys):
  rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "loss": 0.5},
          {"step": 2, "eval/accuracy": 0.5}, {"step": 3, "loss": 0.4}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  stopped = train._summary(str(tmp_path), stopped_at=3)
  assert stopped == {"stopped_early": True, "stopped_at_step": 3, "eval_accuracy_start": 0.25,
                     "start_step": 0, "eval_accuracy_latest": 0.5, "latest_eval_step": 2}
  assert json.loads((tmp_path / "summary.json").read_text()) == stopped
  line = capsys.readouterr().out
  assert "stopped early at step 3" in line and "50.0% at step 2" in line and "points" not in line

  done = train._summary(str(tmp_path))
  assert done == {"eval_accuracy_start": 0.25, "start_step": 0, "eval_accuracy_end": 0.5,
                  "end_step": 2, "eval_accuracy_gain_points": 25.0}
  assert "25.0% (step 0) -> 50.0% (step 2): +25.0 points" in capsys.readouterr().out


TINY_FLAGS = ["--config.sft.steps=10", "--config.train.steps=6", "--config.train.checkpoint_every=2",
              "--config.train.prompts_per_step=4", "--config.train.eval_examples=8",
              "--config.train.eval_every=0", "--config.train.tensorboard=False",
              "--config.data.synthetic_train=400", "--config.data.synthetic_test=40"]


def _command(workdir, *extra_flags):
  return [sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k.py:tiny",
          f"--workdir={workdir}", *TINY_FLAGS, *extra_flags]


def _env():
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one device, as a user's run
  return env


def _run(workdir, *extra_flags):
  done = subprocess.run(_command(workdir, *extra_flags), cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def _start_and_signal(workdir, at_step, sig, *extra_flags):
  """Starts a run and sends `sig` once the checkpoint of `at_step` is on disk."""
  proc = subprocess.Popen(_command(workdir, *extra_flags), cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  # Its checksums are the last file a save writes (a step without them is not resumed from).
  target = Path(workdir) / "checkpoints" / str(at_step) / "SHA256SUMS"
  deadline = time.time() + 600
  while not target.is_file() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert proc.poll() is None, f"the run ended before step {at_step}: {proc.stdout.read()[-3000:]}"
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=300)
  return proc.returncode, out


def _final_params(workdir):
  return load_file(str(Path(workdir) / "final_model" / "model.safetensors"))


def test_preempted_runs_resume_to_the_same_params_bit_for_bit(tmp_path):
  straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
  # Steps after the signal's checkpoint to spare: under load orbax commits a checkpoint (and so
  # the signal comes) a few steps after it was started; the run must not have finished by then.
  steps = "--config.train.steps=10"
  _run(straight, steps)

  code, _ = _start_and_signal(interrupted, 2, signal.SIGKILL, steps)
  assert code == -signal.SIGKILL
  assert not (interrupted / "final_model").exists()
  code, out = _start_and_signal(interrupted, 4, signal.SIGTERM, steps)
  assert code == 0, out[-3000:]
  assert "resumed from step 2" in out or "resumed from step 4" in out
  stopped = int(re.search(r"SIGTERM: saved step (\d+)", out).group(1))
  assert 4 <= stopped < 10, out[-3000:]
  summary = json.loads((interrupted / "summary.json").read_text())
  assert summary["stopped_early"] is True and summary["stopped_at_step"] == stopped
  assert summary["start_step"] == 0 and "eval_accuracy_start" in summary
  assert "eval_accuracy_gain_points" not in summary and "eval_accuracy_end" not in summary
  assert f"stopped early at step {stopped}" in out and "points" not in out
  out = _run(interrupted, steps).stdout
  assert "resumed from step" in out
  summary = json.loads((interrupted / "summary.json").read_text())
  assert "stopped_early" not in summary and summary["end_step"] == 10
  assert "eval_accuracy_gain_points" in summary

  a, b = _final_params(straight), _final_params(interrupted)
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  # The metrics of the interrupted run, once resumed, are those of the straight run.
  ma = logging_io.read_jsonl(str(straight / "metrics.jsonl"))
  mb = logging_io.read_jsonl(str(interrupted / "metrics.jsonl"))
  assert [r["step"] for r in mb] == [r["step"] for r in ma] == list(range(11))
  for ra, rb in zip(ma, mb):
    assert ra.get("loss") == rb.get("loss") and ra.get("reward/total/mean") == rb.get(
        "reward/total/mean"), (ra, rb)


def _flip_a_bit(step_dir: Path):
  """Flips one bit in the middle of the step's largest file (an array data file), as bit rot."""
  path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 1
  path.write_bytes(data)


def test_damaged_checkpoints_resume_from_the_last_good_one_or_stop_clearly(tmp_path):
  workdir, no_sft = tmp_path / "run", "--config.sft.steps=0"  # the warm start is beside the point
  ckpts = workdir / "checkpoints"
  _run(workdir, no_sft)
  assert sorted(int(p.name) for p in ckpts.iterdir()) == [2, 4, 6]
  final = _final_params(workdir)

  _flip_a_bit(ckpts / "6")
  done = _run(workdir, no_sft)
  assert "checkpoint step 6" in done.stderr and "does not match its checksum" in done.stderr
  assert "resumed from step 4" in done.stdout
  # Steps 5 and 6 were recomputed from step 4's intact values: the same final params as before.
  again = _final_params(workdir)
  assert again.keys() == final.keys()
  for name in final:
    np.testing.assert_array_equal(again[name], final[name], err_msg=name)
  records = logging_io.read_jsonl(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(7))

  for step_dir in ckpts.iterdir():
    _flip_a_bit(step_dir)
  failed = subprocess.run(_command(workdir, no_sft), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=600)
  assert failed.returncode == 2, failed.stderr[-3000:]
  assert "Traceback" not in failed.stderr
  assert f"grpo_jax: error: no usable checkpoint in {ckpts}" in failed.stderr
  assert "resumed" not in failed.stdout and not (workdir / "checkpoints" / "0").exists()
