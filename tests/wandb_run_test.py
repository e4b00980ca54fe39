"""Weights & Biases through the real command, offline (no network): the tiny preset shortened
logs every step's metrics, the resolved config and metrics.png to one wandb run, and running the
command again on the workdir continues that run."""

import glob
import json
import subprocess
import sys

import cli
import train_test
import wandb_files
from grpo_jax import logging_io


def test_a_run_logs_its_steps_config_and_plot_and_a_rerun_continues_the_same_wandb_run(tmp_path):
  workdir = tmp_path / "run"
  command = [sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k.py:tiny",
             f"--workdir={workdir}", *train_test.TINY_FLAGS, "--config.train.wandb=True",
             "--config.train.wandb_tags=('tiny','ci')"]
  for _ in range(2):  # the second: a resume from the last checkpoint (step 6 = train.steps)
    proc = subprocess.run(command, cwd=cli.REPO, env=cli.env(WANDB_MODE="offline"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
  run_id = (workdir / logging_io.WANDB_ID_FILE).read_text().strip()
  runs = sorted(glob.glob(str(workdir / "wandb" / f"offline-run-*-{run_id}*")))
  assert len(runs) == 2 and not set(glob.glob(str(workdir / "wandb" / "offline-run-*"))) - set(runs)
  first = wandb_files.records(runs[0])
  (run,) = [r.run for r in first if r.HasField("run")]
  assert (run.project, run.display_name, list(run.tags)) == ("grpo_jax", "run", ["tiny", "ci"])
  history, config = wandb_files.history(first)
  # Every metrics.jsonl record, key for key, at its step (step 0: the eval after the warm start).
  metrics = logging_io.read_jsonl(str(workdir / "metrics.jsonl"))
  assert sorted(history) == [r["step"] for r in metrics] == list(range(7))
  for record in metrics:
    logged = {k: v for k, v in history[record["step"]].items() if k != "plots/metrics"}
    assert logged == {k: v for k, v in record.items() if k != "step"}
  assert history[6]["plots/metrics"]["_type"] == "image-file"
  resolved = json.loads((workdir / "config.json").read_text())
  assert {k: config[k] for k in resolved} == resolved
