"""The child side of the sandbox: `python -I -u sandbox_child.py CONFIG_JSON` (see sandbox.py).

This file runs first in the child interpreter, before any model-written text is read. In the
strict mode bwrap has already built the namespaces, the mounts and the seccomp filter; here
come the rlimits, root dropped to nobody (as root; bwrap left only CAP_SETUID and CAP_SETGID
for it), a check that no capability is left, an audit hook, and only then ./main.py is compiled
and run. The limits are set here rather than in a `preexec_fn`: that runs Python in a fork of a
multi-threaded parent (run_calls' pool, JAX), which CPython documents as deadlock-prone.
Nothing in this file is model text; CONFIG_JSON is written by sandbox.run_python.
"""
import builtins
import json
import os
import resource
import sys
import traceback
import types

# In the unsafe mode, imported as root so user code can use them after the drop (a standard
# library under a 0700 /root is not readable by nobody). The strict mode mounts it readable.
PRELOAD = ("math", "cmath", "fractions", "decimal", "statistics", "itertools", "functools",
           "collections", "json", "re", "random", "datetime", "string", "heapq", "bisect",
           "operator", "textwrap", "time")

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# Audit events refused outright: processes, signals, links that could point out of the
# directory, introspection that reaches the hook's state, and every socket / ctypes event.
REFUSED = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.symlink", "os.link",
    "resource.prlimit", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "sys._current_frames", "cpython.PyInterpreterState_New"})
REFUSED_PREFIXES = ("socket.", "ctypes.")
# A subinterpreter starts without this interpreter's audit hooks: its modules are refused, and
# its creation (the cpython.PyInterpreterState_New event) too.
REFUSED_IMPORTS = frozenset({"subprocess", "_posixsubprocess", "multiprocessing", "socket",
                             "_socket", "ctypes", "_ctypes", "pty", "_cffi_backend", "cffi",
                             "_xxsubinterpreters", "_xxinterpchannels", "_interpreters",
                             "_interpchannels", "_interpqueues", "concurrent.interpreters"})
# Events that change the file system: (indices of path arguments, indices of dir_fd arguments).
PATH_EVENTS = {
    "os.mkdir": ((0,), (2,)), "os.rmdir": ((0,), (1,)), "os.remove": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
    "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
}


def set_limits(c: dict) -> None:
  for limit, value in ((resource.RLIMIT_AS, c["memory_bytes"]),
                       (resource.RLIMIT_NPROC, c["max_processes"]),
                       (resource.RLIMIT_FSIZE, c["max_file_bytes"]),
                       (resource.RLIMIT_NOFILE, c["max_open_files"]),
                       (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
  # SIGXCPU at the soft limit, SIGKILL one second later if it is caught.
  resource.setrlimit(resource.RLIMIT_CPU, (c["cpu_s"], c["cpu_s"] + 1))


def prefer_for_oom_kill() -> None:
  """oom_score_adj 1000: if the machine runs out of memory, the kernel kills this call before
  the trainer (raising one's own score needs no privilege)."""
  with open("/proc/self/oom_score_adj", "w", encoding="ascii") as f:
    f.write("1000")


def drop_root(uid: int) -> None:
  """As root: to `uid` for good, with no capability left (RLIMIT_NPROC does not bind root, and
  root could write anywhere)."""
  if os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def capabilities() -> int:
  """The effective capabilities of this process (a bit mask; 0 = none)."""
  with open("/proc/self/status", encoding="ascii") as f:
    return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


def make_hook(root: str, max_write_opens: int):
  """The audit hook: refuses the events above and writes outside `root`.

  A tripwire, not the boundary (CPython's docs say audit hooks are no sandbox): it turns the
  common attempts into a clear PermissionError for the model. Everything it reads is bound
  here, so emptying this module's globals or rebinding builtins through frames does not switch
  it off; code can still race or outwit it, which is why the kernel's layers are the boundary.
  """
  root = os.path.realpath(root)
  realpath, fspath, isdir = os.path.realpath, os.fspath, os.path.isdir
  encoding = sys.getfilesystemencoding()
  getpid, is_a, any_of, as_bool, integer, text = os.getpid, isinstance, any, bool, int, str
  refused, prefixes, refused_imports = frozenset(REFUSED), REFUSED_PREFIXES, frozenset(
      REFUSED_IMPORTS)
  path_events, write_flags = dict(PATH_EVENTS), WRITE_FLAGS
  writes = 0

  def inside(full: str) -> bool:
    return full == root or full.startswith(root + "/")

  def resolve(path) -> str:
    path = fspath(path)
    return realpath(path.decode(encoding, "surrogateescape") if is_a(path, bytes) else path)

  def refuse(what: str):
    raise PermissionError(f"sandbox refused: {what}")

  def check_open(path, mode, flags) -> None:
    nonlocal writes
    if is_a(path, integer):  # an fd that was opened (and checked) before
      return
    full = resolve(path)
    write = as_bool(flags & write_flags) or (is_a(mode, text) and any_of(c in mode for c in "wax+"))
    if write:
      if full != "/dev/null" and not inside(full):
        refuse(f"writing {full!r} outside the working directory")
      writes += as_bool(flags & write_flags)
      if writes > max_write_opens:
        refuse(f"more than {max_write_opens} files opened for writing")
      return
    if isdir(full) and not inside(full):  # a directory fd would let dir_fd= paths escape
      refuse(f"opening the directory {full!r}")
    parts = full.split("/")
    if (len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit()
        and integer(parts[2]) != getpid()):
      refuse("reading another process's /proc entry")

  def hook(event: str, args: tuple) -> None:
    if event in refused or event.startswith(prefixes):
      refuse(event)
    elif event == "import" and args[0] in refused_imports:
      refuse(f"import {args[0]}")
    elif event == "open":
      check_open(*args)
    elif event in path_events:
      path_at, fd_at = path_events[event]
      # CPython passes dir_fd=-1 (or None) when no dir_fd was given.
      if any_of(args[i] is not None and args[i] != -1 for i in fd_at):
        refuse(f"{event} relative to a directory fd")
      for i in path_at:
        if not is_a(args[i], integer) and not inside(resolve(args[i])):
          refuse(f"{event} on {resolve(args[i])!r} outside the working directory")

  return hook


def run_main() -> None:
  """Compiles and runs ./main.py as __main__."""
  with open("main.py", "rb") as f:
    # The model's code is text: compiled as a str, so a `# coding:` line cannot re-decode it.
    # (sandbox.run_python encodes it with surrogatepass; a lone surrogate fails to compile.)
    source = f.read().decode("utf-8", "surrogatepass").removeprefix("\ufeff")
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
  set_limits(config)
  prefer_for_oom_kill()
  if config["mode"] == "unsafe":
    for name in PRELOAD:
      __import__(name)
  drop_root(config["uid"])
  if config["mode"] == "strict" and (os.getuid() == 0 or capabilities() != 0):
    sys.exit(f"sandbox: uid {os.getuid()} with capabilities {capabilities():#x} after the drop")
  os.umask(0o077)
  if config["audit"]:
    # `importlib.import_module` raises no import event; an entry of None refuses the import
    # on every path (code can delete the entry: a tripwire like the rest of the hook).
    for name in REFUSED_IMPORTS:
      if name not in sys.modules:
        sys.modules[name] = None
    sys.addaudithook(make_hook(os.getcwd(), config["max_write_opens"]))
  # Tells the parent the set-up is done; closed before the code runs, which cannot fake it.
  os.write(config["ready_fd"], b"1")
  os.close(config["ready_fd"])
  run_main()


if __name__ == "__main__":
  main()
