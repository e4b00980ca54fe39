"""One run per workdir: a lock file in the workdir, held from the start of a run to its end.

    lock = workdir_lock.acquire("runs/tiny")   # WorkdirInUse (a UserError) naming the holder
    ...                                        # the run
    lock.release()                             # else at exit (atexit)

<workdir>/.grpo_jax.lock names its holder, as JSON:

    {"pid": 1234, "host": "h", "started": "2026-12-07 08:04:16 UTC",
     "command": "python -m grpo_jax.main --config=configs/gsm8k.py:tiny --workdir=runs/tiny"}

A local workdir: the run opens the file and holds an exclusive flock on it for its lifetime. The
kernel drops that lock when the process ends by any path (a SIGKILL and a crash included), so
liveness is exact: a lock that can be taken has no live holder, whatever the file says, and a
lock that cannot be taken has one. A file that can be locked but still names a holder was left
by a run that died without releasing (SIGKILL, or a SIGTERM before the run's handler was
installed): it is taken over, with a warning naming the dead holder. Releasing removes the file
(while still locked) and closes it. A process that opened the file just before it was removed
would lock a file no path names, so acquire, once it has the flock, checks that the path still
names the file it locked, and otherwise starts again. (Linux's NFS client maps flock to the
server's byte-range locks, so the rule holds across hosts on NFS too.)

An object-store workdir (gs://, s3://) has no locks: the file is a best-effort one. acquire
reads it; absent, it writes its own record and reads it back, and finding another run's record
there means another run wrote in between (it holds the workdir). A record naming a process on
this host that no longer exists (os.kill(pid, 0)) is stale and taken over with a warning; one
naming another host cannot be checked from here, so it holds the workdir until its run releases
it, or until the user deletes the file (the message says so). Two runs that write the file at
the same instant can both read their own record back on a store without read-after-write
consistency; Cloud Storage has it, which leaves only the gap between the two reads. A local file
system that refuses flock (some FUSE mounts) gets this same rule, with a warning.

Several processes of one run lock once: process 0 alone (grpo_jax.main), since it writes the
run's files (grpo_jax.hosts).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time

from grpo_jax import storage
from grpo_jax.errors import UserError, warn

LOCK_FILE = ".grpo_jax.lock"


class WorkdirInUse(UserError):
  """Another live run holds the workdir; the message names it."""


def record() -> dict:
  """This process as a lock holder: {"pid", "host", "started", "command"}."""
  return {"pid": os.getpid(), "host": socket.gethostname(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
          "command": shlex.join([os.path.basename(sys.executable), *sys.orig_argv[1:]])}


def describe(holder: dict | None) -> str:
  """'PID 1234 on host h since 2026-12-07 08:04:16 UTC' (or what of it the record has)."""
  if not holder:
    return "another run (its lock file is empty or unreadable)"
  return (f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')} since "
          f"{holder.get('started', '?')}")


def _in_use(workdir, holder: dict | None, best_effort: bool = False) -> WorkdirInUse:
  hint = (f"; if that run is gone, delete {storage.path(workdir) / LOCK_FILE}"
          if best_effort else "")
  return WorkdirInUse(f"{os.fspath(workdir)} is in use by {describe(holder)}; stop that run or "
                      f"use another --workdir{hint}")


def _parse(text: str) -> dict | None:
  try:
    holder = json.loads(text)
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


def _alive_here(holder: dict) -> bool | None:
  """Whether the holder's process runs; None when it is on another host (cannot be told)."""
  if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
    return None
  try:
    os.kill(holder["pid"], 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


class Lock:
  """A held lock; release() gives it up (once; later calls do nothing)."""

  def __init__(self, workdir: str, fd: int | None, content: str):
    self.workdir, self._fd, self._content = workdir, fd, content
    self.path = storage.path(workdir) / LOCK_FILE
    self._held = True
    # Registered now, after the store's client has registered its own exit handlers: atexit
    # runs the last registered first, so this release still finds gcsfs's session open.
    atexit.register(self.release)

  def release(self) -> None:
    if not self._held:
      return
    self._held = False
    atexit.unregister(self.release)
    if self._fd is None:  # a best-effort lock: remove the file if it is still ours
      with contextlib.suppress(OSError):
        if storage.read_text(self.path) == self._content:
          self.path.unlink()
      return
    with contextlib.suppress(FileNotFoundError):
      os.unlink(self.path)  # before the lock goes: no one takes over a file that is going away
    os.close(self._fd)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def acquire(workdir) -> Lock:
  """The lock on `workdir` (created, with its parents, if missing), or WorkdirInUse."""
  root = storage.path(workdir)
  if storage.is_remote(root):
    return _acquire_by_content(root)
  root.mkdir(parents=True, exist_ok=True)
  path = os.fspath(root / LOCK_FILE)
  while True:
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise UserError(f"--workdir={os.fspath(root)}: cannot open its lock file {path} "
                      f"({e.strerror})") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _parse(_read_fd(fd))
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
        raise _in_use(root, holder) from None
      # A file system without flock (some FUSE mounts): the object store's rule instead.
      warn(f"{os.fspath(root)}: no file locks here ({e.strerror}); the workdir's lock is a "
           "best-effort file, as on an object store")
      return _acquire_by_content(root)
    try:
      same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)  # the holder removed that file as it released: lock the one the path names
  left = _read_fd(fd)
  if left.strip():
    warn(f"{os.fspath(root)}: taking over the lock left by {describe(_parse(left))}, which is "
         "no longer running (it ended without releasing it)")
  content = json.dumps(record())
  os.ftruncate(fd, 0)
  os.pwrite(fd, content.encode(), 0)
  return Lock(os.fspath(root), fd, content)


def _read_fd(fd: int) -> str:
  return os.pread(fd, 1 << 16, 0).decode(errors="replace")


def _acquire_by_content(root) -> Lock:
  """The best-effort lock of an object store (module docstring)."""
  path = root / LOCK_FILE
  if path.exists():
    holder = _parse(storage.read_text(path))
    if holder is None or _alive_here(holder) is not False:
      raise _in_use(root, holder, best_effort=True)
    warn(f"{os.fspath(root)}: taking over the lock left by {describe(holder)}, which is no "
         "longer running (it ended without releasing it)")
  content = json.dumps(record())
  storage.write_text(path, content)
  back = storage.read_text(path)
  if back != content:  # another run wrote it between our check and our write
    raise _in_use(root, _parse(back), best_effort=True)
  return Lock(os.fspath(root), None, content)
