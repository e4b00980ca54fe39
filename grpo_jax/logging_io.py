"""Run logs in the workdir: metrics.jsonl (+ TensorBoard, optional wandb) and sampled completions.

    metrics.jsonl   one JSON object per write, flat namespaced keys, non-finite values as null:
                    {"step": 12, "reward/math_accuracy/mean": 0.41, "loss/kl": null}
    tensorboard/    the same scalars (tensorboardX), for `tensorboard --logdir WORKDIR/tensorboard`
                    (the app: pip install ".[tensorboard]")
    wandb_run_id.txt, wandb/   with train.wandb: the Weights & Biases run a resume continues, and
                    wandb's local files (pip install ".[wandb]")
    samples.jsonl   one sampled completion per line, with its reward components (the record)
    samples.md      the same samples rendered for reading; rebuilt from samples.jsonl on resume
    summary.json    held-out accuracy at the start and end of GRPO and the gain (write_summary)

Samples are kept as JSONL because it can be cut at a step exactly and parsed back whatever the
completion text holds; the Markdown is a view of it, so the two never disagree.

Resume: pass the step the run continues from (the restored checkpoint's step, 0 for a fresh
start) as resume_step; lines for later steps, written after that checkpoint by a run that then
died, are dropped so each step appears once.
"""
from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grpo_jax import storage
from grpo_jax.errors import UserError
# The metrics log's name and reader live in jsonl, so that plots reads the log without importing
# this writer, which imports plots to draw it; logging_io.read_jsonl stays for its callers.
from grpo_jax.jsonl import METRICS_FILE, read_jsonl  # pylint: disable=unused-import

SAMPLES_FILE = "samples.jsonl"
SAMPLES_MD_FILE = "samples.md"
TENSORBOARD_DIR = "tensorboard"
# Metrics that measure the machine, not the run: they differ between any two runs.
TIMING_METRICS = ("time/sample_s", "time/reward_s", "time/train_s", "time/step_s",
                  "sampler/tokens_per_s", "sampler/seconds", "sampler/prefill_seconds",
                  "time/reward_wait_s", "time/param_transfer_s", "time/tool_s",
                  "time/generator_s", "time/executor_s", "time/verifier_s")


def _scalar(key: str, value: Any) -> float | int | bool | str | None:
  """A JSON-safe scalar; NaN/inf become None (JSON has no NaN; strict parsers reject it)."""
  if isinstance(value, (str, bool)) or value is None:
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value) if math.isfinite(value) else None
  array = np.asarray(value)  # numpy / jax scalars and 0-d arrays
  if array.ndim != 0 or array.dtype.kind not in "biuf":
    raise ValueError(f"metric {key!r} must be a scalar, got {type(value).__name__} with shape "
                     f"{array.shape} and dtype {array.dtype}")
  return _scalar(key, array.item())


def _truncate_after(path: str, step: int) -> list[dict]:
  """Keeps the records with record['step'] <= step; rewrites atomically; returns them."""
  kept = [r for r in read_jsonl(path) if r.get("step", -1) <= step]
  if storage.path(path).exists():
    storage.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
  return kept


def check_tensorboard_store(workdir) -> None:
  """UserError when tensorboardX cannot write to the object store `workdir` is on (gs://, s3://:
  its optional google-cloud-storage or boto3 package is missing); nothing for a local one."""
  from tensorboardX import record_writer  # pylint: disable=import-outside-toplevel
  enabled = {"gs://": record_writer.GCS_ENABLED, "s3://": record_writer.S3_ENABLED}
  scheme = os.fspath(workdir)[:5]
  if scheme in enabled and not enabled[scheme]:
    raise UserError(
        f"config.train.tensorboard: TensorBoard events in {workdir} need tensorboardX's "
        f"{'google-cloud-storage' if scheme == 'gs://' else 'boto3'} package; install it, "
        "or set --config.train.tensorboard=False (metrics.jsonl has the same numbers)")


class MetricsWriter:
  """Writes one flat metrics dict per call to metrics.jsonl, TensorBoard and (optionally) wandb."""

  def __init__(self, workdir: str, *, resume_step: int | None = None, tensorboard: bool = True,
               wandb: bool = False, wandb_kwargs: Mapping[str, Any] | None = None,
               plot_step: int | None = None):
    """resume_step: the step a run resumes from (None: append, -1: a fresh start). wandb_kwargs:
    wandb.init's project, name, ... (wandb_init_kwargs). plot_step: the run's last step; a
    wandb run that got there gets metrics.png drawn and logged at that step on close."""
    root = storage.path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    self.root, self.path = root, root / METRICS_FILE
    self._last_step = None
    if resume_step is not None:
      _truncate_after(self.path, resume_step)
    self._tb = None
    if tensorboard:
      import tensorboardX
      check_tensorboard_store(root)
      # purge_step hides events a crashed run logged after the restored step. The file's name
      # holds the time in seconds; the suffix keeps a writer opened in the same second from
      # overwriting the last one's file, and sorts the two in order (TensorBoard reads by name).
      self._tb = tensorboardX.SummaryWriter(
          os.fspath(root / TENSORBOARD_DIR),
          purge_step=None if resume_step is None else resume_step + 1,
          filename_suffix=f".{time.time_ns()}")
    self._wandb = None
    self._plot_step = None
    if wandb:
      self._wandb = _wandb_init(root, resume_step, wandb_kwargs or {})
      self._plot_step = plot_step

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
    """Logs metrics for `step`; returns the JSON record written. Values: Python/NumPy/JAX scalars."""
    record = {"step": int(step)}
    for key, value in metrics.items():
      if not isinstance(key, str) or key == "step":
        raise ValueError(f"metric key {key!r} must be a string other than 'step'")
      record[key] = _scalar(key, value)
    storage.append_text(self.path, json.dumps(record) + "\n")  # closed after each record
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
          self._tb.add_scalar(key, value, global_step=step)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
    self._last_step = int(step)
    return record

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    storage.compact(self.path)  # an object store's appended parts, folded into the file
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      if self._plot_step is not None and self._last_step == self._plot_step:
        _wandb_log_plot(self._wandb, self.root, self._plot_step)
      self._wandb.finish()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


# --- Weights & Biases (optional: pip install ".[wandb]") ---------------------------------------

WANDB_ID_FILE = "wandb_run_id.txt"  # the wandb run a resumed run continues
WANDB_MODES = ("online", "offline", "disabled")
WANDB_INSTALL = 'pip install ".[wandb]" (wandb==0.31.0)'


def check_wandb_config(t) -> None:
  """The train.wandb_* fields (config.train); ValueError('train.wandb_tags: ...')."""
  for field in ("wandb_project", "wandb_entity", "wandb_name"):
    value = t[field]
    if value is not None and not (isinstance(value, str) and value.strip()):
      raise ValueError(f"train.{field}: must be a non-empty string or None, got {value!r}")
  tags = t.wandb_tags
  if not isinstance(tags, (tuple, list)) or not all(
      isinstance(tag, str) and 0 < len(tag) <= 64 for tag in tags):
    raise ValueError("train.wandb_tags: must be a tuple of strings of 1 to 64 characters "
                     f"(wandb's limit), e.g. ('tiny', 'baseline'), got {tags!r}")
  if t.wandb_mode is not None and t.wandb_mode not in WANDB_MODES:
    raise ValueError(f"train.wandb_mode: {t.wandb_mode!r} is not one of "
                     f"{', '.join(map(repr, WANDB_MODES))} or None (wandb's own: $WANDB_MODE, "
                     "else online)")


def wandb_init_kwargs(config, workdir: str) -> dict:
  """wandb.init's arguments from config.train.wandb_* and the resolved config:
  {"project": "grpo_jax", "entity": None, "name": "tiny", "tags": ["tiny"], "mode": None,
   "config": {"seed": 0, "train": {...}, ...}}. The name defaults to the workdir's."""
  t = config.train
  return {"project": t.wandb_project, "entity": t.wandb_entity,
          "name": t.wandb_name or os.path.basename(os.fspath(workdir).rstrip("/")),
          "tags": list(t.wandb_tags), "mode": t.wandb_mode,
          "config": json.loads(config.to_json_best_effort())}


def _wandb_run_id(root, resume_step: int | None) -> str:
  """The run id kept in WORKDIR/wandb_run_id.txt: a resume continues the same wandb run; a fresh
  start (resume_step -1, its metrics.jsonl emptied) begins a new one."""
  path = root / WANDB_ID_FILE
  if resume_step != -1 and path.exists():
    return storage.read_text(path).strip()
  run_id = secrets.token_hex(6)  # wandb's ids: letters and digits
  storage.write_text(path, run_id + "\n")
  return run_id


def _wandb_init(root, resume_step: int | None, kwargs: Mapping[str, Any]):
  try:
    import wandb
  except ImportError:
    raise UserError(f"config.train.wandb: the wandb package is not installed: {WANDB_INSTALL}, "
                    "or set --config.train.wandb=False") from None
  local = None if storage.is_remote(root) else os.fspath(root)  # wandb's files: WORKDIR/wandb/
  try:
    # create_new: the members of a vmapped group each log their own run from one process.
    return wandb.init(dir=local, id=_wandb_run_id(root, resume_step), resume="allow",
                      reinit="create_new", **dict(kwargs))
  except wandb.errors.Error as e:
    raise UserError(f"config.train.wandb: wandb.init failed: {str(e).strip().splitlines()[0]}; "
                    "run `wandb login`, or set --config.train.wandb_mode=offline (sync later "
                    "with `wandb sync`)") from None


def _wandb_log_plot(run, root, step: int) -> None:
  """metrics.png of the run's metrics.jsonl, drawn now (train draws its own after the writers
  close) and logged as an image at the run's last step."""
  import tempfile
  import wandb
  from grpo_jax import plots
  with tempfile.TemporaryDirectory() as tmp:
    path = plots.plot_metrics(os.fspath(root), out_path=os.path.join(tmp, plots.PLOT_FILE))
    if path is not None:
      run.log({"plots/metrics": wandb.Image(path)}, step=step)


class NullWriter:
  """A MetricsWriter/SamplesWriter that writes nothing: the other processes of a multi-host
  run (process 0 writes the run's files)."""

  def write(self, step, records):
    del step, records

  def close(self):
    pass


def _fence(text: str) -> str:
  """A ~~~ fence longer than any run of ~ in text, so a completion cannot close its own block."""
  longest, run = 0, 0
  for ch in text:
    run = run + 1 if ch == "~" else 0
    longest = max(longest, run)
  return "~" * max(4, longest + 1)


def _render_sample(number: int, record: Mapping[str, Any]) -> str:
  rewards = record.get("rewards") or {}
  fields = [f"{k}={'missing' if v is None else f'{v:g}' if isinstance(v, float) else v}"
            for k, v in rewards.items()]
  fields += [f"{k}={v}" for k, v in record.items()
             if k not in ("step", "prompt", "completion", "rewards")]
  out = [f"### sample {number}: {', '.join(fields)}\n"]
  for part in ("prompt", "completion"):
    if part in record:
      fence = _fence(record[part])
      out.append(f"**{part}**\n\n{fence}text\n{record[part]}\n{fence}\n")
  return "\n".join(out) + "\n"


class SamplesWriter:
  """Appends a few sampled completions per step to samples.jsonl and samples.md.

    writer.write(12, [{"prompt": "...", "completion": "<think>..</think><answer>72</answer>",
                       "rewards": {"math_accuracy": 1.0, "format": 0.1}, "gold": "72"}])
  """

  def __init__(self, workdir: str, *, resume_step: int | None = None):
    root = storage.path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    self.path, self.md_path = root / SAMPLES_FILE, root / SAMPLES_MD_FILE
    if resume_step is not None:
      kept = _truncate_after(self.path, resume_step)
      storage.write_text(self.md_path, _render_steps(kept))

  def write(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
    records = []
    for i, sample in enumerate(samples):
      if "completion" not in sample:
        raise ValueError(f"sample {i} at step {step} has no 'completion' field")
      record = {"step": int(step)}
      for key, value in sample.items():
        if key in ("prompt", "completion"):
          record[key] = str(value)
        elif key == "rewards":
          record[key] = {k: _scalar(f"rewards/{k}", v) for k, v in value.items()}
        else:
          record[key] = _scalar(key, value)
      records.append(record)
    storage.append_text(self.path, "".join(json.dumps(r) + "\n" for r in records))
    storage.append_text(self.md_path, _render_steps(records))

  def close(self) -> None:
    """Folds an object store's appended parts into the files (they read the same before)."""
    storage.compact(self.path)
    storage.compact(self.md_path)


def _render_steps(records: Sequence[Mapping[str, Any]]) -> str:
  out, step, number = [], None, 0
  for record in records:
    if record["step"] != step:
      step, number = record["step"], 0
      out.append(f"## step {step}\n\n")
    number += 1
    out.append(_render_sample(number, record))
  return "".join(out)


SUMMARY_FILE = "summary.json"


def write_summary(workdir, stopped_at: int | None = None, eval_examples: int | None = None):
  """summary.json from the eval rows of metrics.jsonl: held-out accuracy at the start and end of
  GRPO and the gain. A run stopped early (SIGTERM) at step `stopped_at` has no end: it reports
  where it stopped and what it measured, and no gain (that needs the completed run).
  eval_examples: how many problems each eval scored, recorded so a report can put a binomial
  interval on the accuracy (grpo_jax.report)."""
  evals = [r for r in read_jsonl(storage.path(workdir) / METRICS_FILE)
           if r.get("eval/accuracy") is not None]
  if not evals:
    return {}
  first, last = evals[0], evals[-1]
  summary = {"eval_accuracy_start": first["eval/accuracy"], "start_step": first["step"]}
  if eval_examples is not None:
    summary["eval_examples"] = int(eval_examples)
  if stopped_at is None:
    summary.update(eval_accuracy_end=last["eval/accuracy"], end_step=last["step"])
    summary["eval_accuracy_gain_points"] = 100 * (summary["eval_accuracy_end"]
                                                  - summary["eval_accuracy_start"])
    line = (f"held-out greedy accuracy {first['eval/accuracy']:.1%} (step {first['step']}) -> "
            f"{last['eval/accuracy']:.1%} (step {last['step']}): "
            f"{summary['eval_accuracy_gain_points']:+.1f} points")
  else:
    summary = {"stopped_early": True, "stopped_at_step": stopped_at, **summary}
    line = (f"stopped early at step {stopped_at}; held-out greedy accuracy "
            f"{first['eval/accuracy']:.1%} at step {first['step']}")
    if last["step"] > first["step"]:
      summary.update(eval_accuracy_latest=last["eval/accuracy"], latest_eval_step=last["step"])
      line += f", {last['eval/accuracy']:.1%} at step {last['step']}"
    line += "; the gain is reported when the run completes (run the same command to resume)"
  storage.write_text(storage.path(workdir) / SUMMARY_FILE, json.dumps(summary, indent=2))
  print(f"grpo_jax: {line}", flush=True)
  return summary
