"""The child side of the sandbox: `python -I -u sandbox_child.py CONFIG_JSON` (see sandbox.py).

This file runs first in the child interpreter, before any model-written text is read, in this
order: new network and mount namespaces, the rlimits, common modules imported while the
interpreter is still readable, root dropped to nobody, an audit hook, and only then ./main.py
is compiled and run. The limits are set here rather than in a `preexec_fn`: that runs Python in
a fork of a multi-threaded parent (run_calls' pool, JAX), which CPython documents as
deadlock-prone, and the interpreter could not start as nobody anyway when it lives under a 0700
/root (as on pyenv).
Nothing in this file is model text; CONFIG_JSON is written by sandbox.run_python.
"""
import builtins
import ctypes
import json
import os
import resource
import sys
import traceback
import types

# Imported as root so user code can use them after the drop (the stdlib may not be readable).
PRELOAD = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools",
           "collections", "json", "re", "random", "datetime", "string", "heapq", "bisect",
           "operator", "textwrap", "time")

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1  # Linux 5.12+
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# Audit events refused outright: processes, signals, links that could point out of the
# directory, introspection that reaches the hook's state, and every socket / ctypes event.
REFUSED = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.symlink", "os.link",
    "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "sys._current_frames"})
REFUSED_PREFIXES = ("socket.", "ctypes.")
REFUSED_IMPORTS = frozenset({"subprocess", "_posixsubprocess", "multiprocessing", "socket",
                             "_socket", "ctypes", "_ctypes", "pty"})
# Events that change the file system: (indices of path arguments, indices of dir_fd arguments).
PATH_EVENTS = {
    "os.mkdir": ((0,), (2,)), "os.rmdir": ((0,), (1,)), "os.remove": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
    "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
}


class _MountAttr(ctypes.Structure):
  _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
              ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _set_read_only(libc, path: bytes, read_only: bool, recursive: bool) -> bool:
  attr = _MountAttr(*((MOUNT_ATTR_RDONLY, 0) if read_only else (0, MOUNT_ATTR_RDONLY)), 0, 0)
  return libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path,
                      ctypes.c_uint(AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                      ctypes.c_size_t(ctypes.sizeof(attr))) == 0


def isolate(workdir: str) -> None:
  """New network and mount namespaces where the OS allows them (as root, or through an
  unprivileged user namespace): no network at all (a loopback that is down), and every file
  system read-only but `workdir`. Where they are refused only the audit hook is left for these.
  """
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.unshare(CLONE_NEWNET | CLONE_NEWNS) != 0:
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0:
      return
  w = os.fsencode(workdir)
  # Private first, so nothing done here propagates to the machine's mounts; then the directory
  # becomes a mount of its own that stays writable when all the others turn read-only.
  if (libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
      and libc.mount(w, w, None, MS_BIND, None) == 0
      and _set_read_only(libc, b"/", True, recursive=True)):
    _set_read_only(libc, w, False, recursive=False)
    os.chdir(workdir)  # the cwd still pointed into the mount beneath the bind


def set_limits(c: dict) -> None:
  for limit, value in ((resource.RLIMIT_AS, c["memory_bytes"]),
                       (resource.RLIMIT_NPROC, c["max_processes"]),
                       (resource.RLIMIT_FSIZE, c["max_file_bytes"]),
                       (resource.RLIMIT_NOFILE, c["max_open_files"]),
                       (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
  # SIGXCPU at the soft limit, SIGKILL one second later if it is caught.
  resource.setrlimit(resource.RLIMIT_CPU, (c["cpu_s"], c["cpu_s"] + 1))


def drop_root(uid: int) -> None:
  # RLIMIT_NPROC does not bind root, and root could write anywhere.
  if os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def make_hook(root: str, max_write_opens: int):
  """The audit hook: refuses the events above and writes outside `root`.

  A second layer, not the boundary (CPython's docs say audit hooks are no sandbox, and code can
  reach the hook's closure through frames or race its checks): it turns the common escapes
  into a clear PermissionError for the model, and stands in where the OS refuses a namespace.
  """
  root = os.path.realpath(root)
  realpath, fspath, getpid = os.path.realpath, os.fspath, os.getpid
  writes = 0

  def inside(full: str) -> bool:
    return full == root or full.startswith(root + "/")

  def resolve(path) -> str:
    return realpath(os.fsdecode(fspath(path)))

  def refuse(what: str):
    raise PermissionError(f"sandbox refused: {what}")

  def check_open(path, mode, flags) -> None:
    nonlocal writes
    if isinstance(path, int):  # an fd that was opened (and checked) before
      return
    full = resolve(path)
    write = bool(flags & WRITE_FLAGS) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
    if write:
      if full != "/dev/null" and not inside(full):
        refuse(f"writing {full!r} outside the working directory")
      writes += bool(flags & WRITE_FLAGS)
      if writes > max_write_opens:  # with RLIMIT_FSIZE this bounds the disk used
        refuse(f"more than {max_write_opens} files opened for writing")
      return
    if os.path.isdir(full):  # a directory fd would let dir_fd= paths escape the checks above
      refuse(f"opening the directory {full!r}")
    parts = full.split("/")
    if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and int(parts[2]) != getpid():
      refuse("reading another process's /proc entry")

  def hook(event: str, args: tuple) -> None:
    if event in REFUSED or event.startswith(REFUSED_PREFIXES):
      refuse(event)
    elif event == "import" and args[0] in REFUSED_IMPORTS:
      refuse(f"import {args[0]}")
    elif event == "open":
      check_open(*args)
    elif event in PATH_EVENTS:
      path_at, fd_at = PATH_EVENTS[event]
      if any(args[i] is not None for i in fd_at):
        refuse(f"{event} relative to a directory fd")
      for i in path_at:
        if not isinstance(args[i], int) and not inside(resolve(args[i])):
          refuse(f"{event} on {resolve(args[i])!r} outside the working directory")

  return hook


def run_main() -> None:
  """Compiles and runs ./main.py as __main__."""
  with open("main.py", "rb") as f:
    source = f.read()
  module = types.ModuleType("__main__")
  module.__builtins__ = builtins
  sys.modules["__main__"] = module  # user code must not see this file's globals
  sys.argv = ["main.py"]
  try:
    exec(compile(source, "main.py", "exec"), module.__dict__)  # pylint: disable=exec-used
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    # The traceback the code would get run as a script: no frames of this file (run_main, hook).
    report = traceback.TracebackException(type(e), e, e.__traceback__)
    report.stack = traceback.StackSummary.from_list(
        [f for f in report.stack if f.filename != __file__])
    sys.stderr.write("".join(report.format()))
    sys.exit(1)


def main() -> None:
  config = json.loads(sys.argv[1])
  isolate(os.getcwd())
  # Gone from sys.modules, so a later `import ctypes` raises the import event the hook refuses.
  for name in [m for m in sys.modules if m == "_ctypes" or m.split(".")[0] == "ctypes"]:
    del sys.modules[name]
  set_limits(config)
  for name in PRELOAD:
    __import__(name)
  drop_root(config["uid"])
  os.umask(0o077)
  if config["audit"]:
    sys.addaudithook(make_hook(os.getcwd(), config["max_write_opens"]))
  # Tells the parent the set-up is done; closed before the code runs, which cannot fake it.
  os.write(config["ready_fd"], b"1")
  os.close(config["ready_fd"])
  run_main()


if __name__ == "__main__":
  main()
