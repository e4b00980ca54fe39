"""Where a run's files live: a local directory or an object-store URL (gs://, s3://), reached
through etils.epath, the path library orbax checkpoints with.

    root = storage.path("gs://bucket/runs/tiny")      # or "runs/tiny" (absolute, ~ expanded)
    storage.write_text(root / "summary.json", text)   # whole or not at all
    storage.append_text(root / "metrics.jsonl", line)
    text = storage.read_text(root / "metrics.jsonl")  # with the appended parts, if remote
    with storage.local_dir(root / "final_model") as d:  # for writers that take a local directory
      model.save_pretrained(d)                         # (copied up when the block ends)
    with storage.local_dir(root / "final_model", whole=True) as d:  # locally: renamed into
      model.save_pretrained(d)                         # place when whole (an interrupt: none)
    d = storage.local_copy(root / "tokenizer")        # a local directory to read from

Object stores have no append and no rename. A single object write is already all-or-nothing.
An append to FILE writes only the new text, as an object of FILE.parts/; once the parts hold as
many bytes as FILE, they are folded into FILE (one rewrite). The bytes written thus grow
linearly with a run's length (each byte once as a part, and at most about twice more in the
rewrites, whose sizes double), where rewriting FILE at every append grew with its square.
`read_text` / `read_bytes` give FILE with its parts; `compact` folds them in (a writer's
close). A crash between the two steps of a rewrite leaves parts that name an older length of
FILE, which readers skip. Libraries that
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


PARTS = ".parts"  # an appended remote FILE's pieces: FILE.parts/<base>-<seq>-<size>


def _parts(p: epath.Path) -> tuple[int, list[tuple[int, int, epath.Path]], list[epath.Path]]:
  """(FILE's length, its parts as (seq, size, path) in order, stale parts). A part is valid when
  its base is FILE's length now; the others are left from before FILE was last rewritten."""
  length = p.stat().length if p.exists() else 0
  d = p.parent / (p.name + PARTS)
  valid, stale = [], []
  for q in (d.iterdir() if d.exists() else ()):
    base, seq, size = (int(x) for x in q.name.split("-"))
    if base == length:
      valid.append((seq, size, q))
    else:
      stale.append(q)
  return length, sorted(valid), stale


def _drop_parts(p: epath.Path) -> None:
  d = p.parent / (p.name + PARTS)
  if d.exists():
    for q in d.iterdir():
      q.unlink()


def read_bytes(p) -> bytes:
  """A file's contents; on an object store with the parts appended to it."""
  p = path(p)
  if not is_remote(p):
    return p.read_bytes()
  _, valid, _ = _parts(p)
  return p.read_bytes() + b"".join(q.read_bytes() for _, _, q in valid)


def read_text(p) -> str:
  return read_bytes(p).decode()


def compact(p) -> None:
  """Folds an appended remote file's parts into it (a no-op for a local file or no parts)."""
  p = path(p)
  if is_remote(p):
    _, valid, stale = _parts(p)
    if valid or stale:
      write_bytes(p, read_bytes(p))


def write_bytes(p, data: bytes) -> None:
  """Writes a whole file so that a reader sees the old or the new contents, never half."""
  p = path(p)
  if is_remote(p):
    # Parts first: a crash between the two would lose them rather than have the new contents
    # read with parts that belong to the old (the new file may have the old one's length).
    _drop_parts(p)
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
  """Appends to a file; on an object store as a part, folded in when the parts reach FILE's size."""
  p = path(p)
  if is_remote(p):
    data = text.encode()
    length, valid, stale = _parts(p)
    if sum(size for _, size, _ in valid) + len(data) >= length:
      new = (read_bytes(p) if p.exists() else b"") + data
      p.write_bytes(new)  # its new length makes every part stale; removed next
      for q in [q for _, _, q in valid] + stale:
        q.unlink()
      return
    seq = valid[-1][0] + 1 if valid else 0
    part = p.parent / (p.name + PARTS) / f"{length}-{seq}-{len(data)}"
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(data)
    return
  with open(p, "a") as f:
    f.write(text)


PARTIAL = ".partial"  # local_dir(p, whole=True) writes p + PARTIAL and renames it to p


@contextlib.contextmanager
def local_dir(p, whole: bool = False):
  """A local directory for writers that cannot write to p: p itself when it is local; else a
  temporary directory whose files are copied to p when the block ends (and that stays, so what
  was written can be read back locally). An exception in the block copies nothing.

  whole (a local p): the block writes into the sibling p + PARTIAL, renamed to p (replacing an
  older p) once the block ends, so an interrupted write leaves no p that looks complete: its
  partial directory, removed by the exception or by the next such write."""
  p = path(p)
  if not is_remote(p) and not whole:
    p.mkdir(parents=True, exist_ok=True)
    yield os.fspath(p)
    return
  if not is_remote(p):
    partial = p.parent / (p.name + PARTIAL)
    if partial.exists():
      partial.rmtree()
    partial.mkdir(parents=True)
    try:
      yield os.fspath(partial)
    except BaseException:
      partial.rmtree()
      raise
    if p.exists():
      p.rmtree()
    os.replace(partial, p)
    return
  local = tempfile.mkdtemp(prefix="grpo_jax_")
  yield local
  copy_files(local, p)


def files(p) -> list[str]:
  """The paths of every file under directory p, relative to it, sorted."""
  p = path(p)
  # gcsfs walks a gs:// tree as scheme-less 'bucket/dir/...' roots: compare without the scheme.
  base = os.fspath(p).split("://", 1)[-1]
  out = []
  for root, _, names in p.walk():
    rel = os.path.relpath(os.fspath(root).split("://", 1)[-1], base)
    if any(part.endswith(PARTS) for part in rel.split(os.sep)):
      continue  # an appended file's pieces: read_bytes puts them back in the file
    out += [name if rel == "." else os.path.join(rel, name) for name in names]
  return sorted(out)


def local_copy(p) -> str:
  """A local directory holding p's files: p itself when it is local; else a downloaded copy."""
  p = path(p)
  if not is_remote(p):
    return os.fspath(p)
  local = tempfile.mkdtemp(prefix="grpo_jax_")
  copy_files(p, local)
  return local


def copy_files(src, dst) -> None:
  """Every file under directory src to the same relative path under dst (either may be remote)."""
  src, dst = path(src), path(dst)
  for name in files(src):
    (dst / name).parent.mkdir(parents=True, exist_ok=True)
    write_bytes(dst / name, read_bytes(src / name))
