"""The one place model-written text is executed: `run_python(code)` in a contained child process.

    >>> run_python("print(2 + 2)")
    SandboxResult(stdout='4\\n', stderr='', status='ok', exit_code=0, signal=None, seconds=0.05)
    >>> run_python("while True: pass", timeout_s=1.0).status
    'timeout'

Containment, layer by layer (the child's side is sandbox_child.py):
- process: `sys.executable -I -u` (no user site, no PYTHON* variables) in its own session, never
  through a shell; the code goes in a file of the working directory, never on a command line.
- wall clock: every call has `timeout_s`; past it the whole process group gets SIGKILL.
- output: stdout and stderr are read as they come; past `max_output_bytes` (both together) the
  group is killed at once.
- environment: only PATH, HOME, TMPDIR and the locale; nothing of the parent's (no tokens).
- working directory: a fresh temporary directory, removed afterwards whatever happened.
- rlimits, set in the child before the code is read: CPU seconds, address space, processes,
  file size, open files, no core files.
- network: a new network namespace (nothing but a down loopback) where the OS allows it (root,
  or unprivileged user namespaces); the audit hook refuses every socket event in any case.
- file system: in a new mount namespace every mount is read-only but the working directory
  (mount_setattr, Linux 5.12+; where refused, the audit hook alone guards writes to /tmp).
- user: as root the child drops to nobody (65534) after start-up, since RLIMIT_NPROC does not
  bind root and root may write anywhere; the directory is chowned to it.
- audit hook: refuses processes (fork, exec, spawn, system, subprocess), signals, sockets,
  ctypes, links, and opening or changing files outside the working directory.
Each layer is tested alone where it can be: tests/agent_sandbox_test.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import selectors
import shutil
import signal as signal_lib
import subprocess
import sys
import tempfile
import time

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
NOBODY = 65534
# Statuses: 'ok' (exit 0), 'error' (non-zero exit, e.g. an exception), 'timeout' (wall clock),
# 'killed' (a signal, e.g. SIGXCPU at the CPU limit), 'output_limit' (too much output).
STATUSES = ("ok", "error", "timeout", "killed", "output_limit")


class SandboxError(RuntimeError):
  """The sandbox itself could not be set up (a bug or an OS that refuses a limit), which is no
  property of the code: raised rather than shown to the model as the code's error."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  stdout: str  # its first max_output_bytes (decoded as UTF-8, bad bytes replaced)
  stderr: str
  status: str  # one of STATUSES
  exit_code: int | None  # None when a signal ended the child
  signal: int | None  # the signal that ended it (ours, SIGKILL, on timeout / output_limit)
  seconds: float


def _exited(pid: int) -> bool:
  """Whether the child has exited, leaving it a zombie: its pid, and so the process group id,
  cannot be reused until it is reaped, which makes killing the group afterwards safe."""
  return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pid: int) -> None:
  try:
    os.killpg(pid, signal_lib.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _collect(proc: subprocess.Popen, deadline: float, max_bytes: int) -> tuple[bytes, bytes, str]:
  """Reads both pipes until EOF; returns (stdout, stderr, '' | 'timeout' | 'output_limit')."""
  bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
  total, why = 0, ""
  with selectors.DefaultSelector() as sel:
    for fd in bufs:
      sel.register(fd, selectors.EVENT_READ)
    while sel.get_map():
      left = deadline - time.monotonic()
      if left <= 0:
        why = "timeout"
        break
      # A short wait so a child that exits while a grandchild holds the pipes is noticed.
      for key, _ in sel.select(min(left, 0.1)):
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fd)
        bufs[key.fd] += chunk
        total += len(chunk)
      if total > max_bytes:
        why = "output_limit"
        break
      if _exited(proc.pid):
        _kill_group(proc.pid)  # stragglers it left would otherwise hold the pipes open
  out, err = bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()]
  return bytes(out[:max_bytes]), bytes(err[:max_bytes]), why


def _remove(path: str) -> None:
  def make_writable(func, p, _):  # the code may have chmod-ed a directory read-only
    os.chmod(os.path.dirname(p), 0o700)
    func(p)
  shutil.rmtree(path, onerror=make_writable)


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: float | None = None,
               memory_bytes: int = 1 << 30, max_output_bytes: int = 1 << 16,
               max_processes: int = 32, max_file_bytes: int = 8 << 20, max_open_files: int = 64,
               max_write_opens: int = 64, audit: bool = True) -> SandboxResult:
  """Runs `code` as a Python program; its stdout/stderr, how it ended and how long it took.

  cpu_s defaults to one second more than timeout_s: the wall clock stops a busy loop, the CPU
  limit stops threads that burn CPU faster than the clock runs, and a child whose parent could
  not kill it (a stalled parent). max_processes is RLIMIT_NPROC, which the kernel counts per
  user, zombies included: concurrent sandboxes (all nobody) share it. max_write_opens bounds the
  files opened for writing (disk use <= max_write_opens * max_file_bytes). audit=False leaves
  the audit hook out, only so tests can show that the other layers hold on their own.
  """
  start = time.monotonic()
  workdir = tempfile.mkdtemp(prefix="grpo_sandbox_")
  ready_r, ready_w = os.pipe()
  try:
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
      f.write(code)
    if os.geteuid() == 0:
      for path in (workdir, os.path.join(workdir, "main.py")):
        os.chown(path, NOBODY, NOBODY)
    config = dict(memory_bytes=memory_bytes, max_processes=max_processes,
                  max_file_bytes=max_file_bytes, max_open_files=max_open_files,
                  cpu_s=max(1, math.ceil(timeout_s + 1 if cpu_s is None else cpu_s)), uid=NOBODY,
                  max_write_opens=max_write_opens, audit=audit, ready_fd=ready_w)
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-u", CHILD, json.dumps(config)], cwd=workdir, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, close_fds=True, pass_fds=(ready_w,))
    os.close(ready_w)
    ready_w = -1
    try:
      out, err, why = _collect(proc, start + timeout_s, max_output_bytes)
    finally:
      _kill_group(proc.pid)  # not reaped yet, so the group id is still ours: nothing outlives us
      code_or_signal = proc.wait()
      proc.stdout.close()
      proc.stderr.close()
    ready = os.read(ready_r, 1) == b"1"  # the child has exited: this does not block
  finally:
    for fd in (ready_r, ready_w):
      if fd >= 0:
        os.close(fd)
    _remove(workdir)
  if not ready and not why:
    raise SandboxError(f"the sandbox's set-up failed: {err.decode('utf-8', 'replace')[-2000:]}")
  if why:
    status, exit_code, sig = why, None, signal_lib.SIGKILL
  elif code_or_signal < 0:
    status, exit_code, sig = "killed", None, -code_or_signal
  else:
    status, exit_code, sig = ("ok" if code_or_signal == 0 else "error"), code_or_signal, None
  return SandboxResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), status,
                       exit_code, sig, time.monotonic() - start)
