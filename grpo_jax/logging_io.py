"""Run logs in the workdir: metrics.jsonl (+ TensorBoard, optional wandb) and sampled completions.

    metrics.jsonl   one JSON object per write, flat namespaced keys, non-finite values as null:
                    {"step": 12, "reward/math_accuracy/mean": 0.41, "loss/kl": null}
    tensorboard/    the same scalars, for `tensorboard --logdir WORKDIR`
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

import json
import math
import numbers
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grpo_jax import storage
from grpo_jax.errors import UserError

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
SAMPLES_MD_FILE = "samples.md"
TENSORBOARD_DIR = "tensorboard"


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


def read_jsonl(path: str) -> list[dict]:
  """Records of a JSONL log (a local path or a gs:// URL); a torn last line (a crash mid-write)
  is ignored."""
  path = storage.path(path)
  if not path.exists():
    return []
  lines = storage.read_text(path).split("\n")
  records = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if number == len(lines):  # the last line has no newline: it was never finished
        break
      raise ValueError(f"{path}:{number}: not valid JSON ({e}); fix or delete that line") from e
  return records


def _truncate_after(path: str, step: int) -> list[dict]:
  """Keeps the records with record['step'] <= step; rewrites atomically; returns them."""
  kept = [r for r in read_jsonl(path) if r.get("step", -1) <= step]
  if storage.path(path).exists():
    storage.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
  return kept


class MetricsWriter:
  """Writes one flat metrics dict per call to metrics.jsonl, TensorBoard and (optionally) wandb."""

  def __init__(self, workdir: str, *, resume_step: int | None = None, tensorboard: bool = True,
               wandb: bool = False, wandb_kwargs: Mapping[str, Any] | None = None):
    root = storage.path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    self.path = root / METRICS_FILE
    if resume_step is not None:
      _truncate_after(self.path, resume_step)
    self._tb = None
    if tensorboard:
      import tensorboardX
      from tensorboardX import record_writer
      enabled = {"gs://": record_writer.GCS_ENABLED, "s3://": record_writer.S3_ENABLED}
      scheme = os.fspath(root)[:5]
      if scheme in enabled and not enabled[scheme]:
        raise UserError(
            f"config.train.tensorboard: TensorBoard events in {root} need tensorboardX's "
            f"{'google-cloud-storage' if scheme == 'gs://' else 'boto3'} package; install it, "
            "or set --config.train.tensorboard=False (metrics.jsonl has the same numbers)")
      # purge_step hides events a crashed run logged after the restored step. The file's name
      # holds the time in seconds; the suffix keeps a writer opened in the same second from
      # overwriting the last one's file, and sorts the two in order (TensorBoard reads by name).
      self._tb = tensorboardX.SummaryWriter(
          os.fspath(root / TENSORBOARD_DIR),
          purge_step=None if resume_step is None else resume_step + 1,
          filename_suffix=f".{time.time_ns()}")
    self._wandb = None
    if wandb:
      try:
        import wandb as wandb_lib
      except ImportError as e:
        raise ImportError("wandb logging is enabled but the wandb package is not installed: "
                          "`pip install wandb`, or turn wandb logging off") from e
      # wandb keeps its own files in a local directory.
      local = None if storage.is_remote(root) else os.fspath(root)
      self._wandb = wandb_lib.init(dir=local, resume="allow", **dict(wandb_kwargs or {}))

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
    return record

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    storage.compact(self.path)  # an object store's appended parts, folded into the file
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


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
