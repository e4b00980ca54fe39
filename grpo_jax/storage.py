"""Where a run's files live: a local directory or an object-store URL (gs://, s3://), reached
through etils.epath, the path library orbax checkpoints with.

    root = storage.path("gs://bucket/runs/tiny")      # or "runs/tiny" (absolute, ~ expanded)
    storage.write_text(root / "summary.json", text)   # whole or not at all
    storage.append_text(root / "metrics.jsonl", line)
    with storage.local_dir(root / "final_model") as d:  # for writers that take a local directory
      model.save_pretrained(d)                         # (copied up when the block ends)
    d = storage.local_copy(root / "tokenizer")        # a local directory to read from

Object stores have no append and no rename: an appended file is rewritten whole (a run's logs
are small next to a step), and a single object write is already all-or-nothing. Libraries that
only write local files (safetensors, transformers' save_pretrained, the tokenizer builder) write
into a local directory that is then copied up.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

from etils import epath

REMOTE_PREFIXES = ("gs://", "s3://")


def is_remote(p) -> bool:
  return os.fspath(p).startswith(REMOTE_PREFIXES)


def path(p) -> epath.Path:
  """An epath.Path: a URL as it is, a local path absolute with ~ expanded."""
  p = os.fspath(p)
  return epath.Path(p if is_remote(p) else os.path.abspath(os.path.expanduser(p)))


def write_bytes(p, data: bytes) -> None:
  """Writes a whole file so that a reader sees the old or the new contents, never half."""
  p = path(p)
  if is_remote(p):
    p.write_bytes(data)  # one object write
    return
  tmp = os.fspath(p) + ".tmp"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())  # on disk before the rename makes it the file
  os.replace(tmp, p)


def write_text(p, text: str) -> None:
  write_bytes(p, text.encode())


def append_text(p, text: str) -> None:
  """Appends to a file (an object store's file is rewritten with the text added)."""
  p = path(p)
  if is_remote(p):
    p.write_text((p.read_text() if p.exists() else "") + text)
    return
  with open(p, "a") as f:
    f.write(text)


@contextlib.contextmanager
def local_dir(p):
  """A local directory for writers that cannot write to p: p itself when it is local; else a
  temporary directory whose files are copied to p when the block ends (and that stays, so what
  was written can be read back locally)."""
  p = path(p)
  if not is_remote(p):
    p.mkdir(parents=True, exist_ok=True)
    yield os.fspath(p)
    return
  local = tempfile.mkdtemp(prefix="grpo_jax_")
  yield local
  _copy_files(local, p)


def files(p) -> list[str]:
  """The paths of every file under directory p, relative to it, sorted."""
  p = path(p)
  # gcsfs walks a gs:// tree as scheme-less 'bucket/dir/...' roots: compare without the scheme.
  base = os.fspath(p).split("://", 1)[-1]
  out = []
  for root, _, names in p.walk():
    rel = os.path.relpath(os.fspath(root).split("://", 1)[-1], base)
    out += [name if rel == "." else os.path.join(rel, name) for name in names]
  return sorted(out)


def local_copy(p) -> str:
  """A local directory holding p's files: p itself when it is local; else a downloaded copy."""
  p = path(p)
  if not is_remote(p):
    return os.fspath(p)
  local = tempfile.mkdtemp(prefix="grpo_jax_")
  _copy_files(p, local)
  return local


def _copy_files(src, dst) -> None:
  """Every file under directory src to the same relative path under dst (either may be remote)."""
  src, dst = path(src), path(dst)
  for name in files(src):
    (dst / name).parent.mkdir(parents=True, exist_ok=True)
    (dst / name).write_bytes((src / name).read_bytes())
