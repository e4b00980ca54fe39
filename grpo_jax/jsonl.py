"""JSONL logs of a run (metrics.jsonl, samples.jsonl): reading one back, and the metrics log's
name. Below both the writer (logging_io) and the plots, which read what it writes.

    records = jsonl.read_jsonl(workdir / jsonl.METRICS_FILE)   # [{"step": 0, ...}, ...]
"""
from __future__ import annotations

import json

from grpo_jax import storage

METRICS_FILE = "metrics.jsonl"


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
