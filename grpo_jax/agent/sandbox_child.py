"""The child side of the sandbox: `python -I -u sandbox_child.py CONFIG_JSON` (see sandbox.py).

This file runs first in the child interpreter, before any model-written text is read. In the
strict mode bwrap has already built the namespaces and the read-only mounts; here come the
working directory (a tmpfs capped in bytes and inodes, mounted with the CAP_SYS_ADMIN that
bwrap left for it), the rlimits, root dropped to nobody (as root; bwrap also left CAP_SETUID and
CAP_SETGID), every capability cleared, the seccomp filter, a check that no capability is left
and the filter is on, an audit hook, and only then ./main.py is compiled and run. The limits
are set here rather than in a `preexec_fn`: that runs Python in a fork of a multi-threaded
parent (run_calls' pool, JAX), which CPython documents as deadlock-prone. Nothing in this file
is model text; CONFIG_JSON is written by sandbox.run_python.
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


# Kernel constants (the same on every Linux architecture).
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV = 0x2, 0x4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Queued signals (and POSIX timers, each of which holds one): a few for a program's own use.
# Above it a real-time signal fails with EAGAIN; SIGKILL and the other standard signals are
# delivered whatever the count.
MAX_PENDING_SIGNALS = 64


def set_limits(c: dict) -> None:
  """Every count the kernel keeps per process or per user, capped: the ones a call does not
  need at 0. The trainer's own limits would otherwise be inherited (a container may allow
  real-time priority or much locked memory)."""
  for limit, value in ((resource.RLIMIT_AS, c["memory_bytes"]),
                       (resource.RLIMIT_NPROC, c["max_processes"]),
                       (resource.RLIMIT_FSIZE, c["max_file_bytes"]),
                       (resource.RLIMIT_NOFILE, c["max_open_files"]),
                       (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_MEMLOCK, 0),
                       (resource.RLIMIT_MSGQUEUE, 0),  # POSIX message queues: mq_open fails
                       (resource.RLIMIT_SIGPENDING, MAX_PENDING_SIGNALS),
                       (resource.RLIMIT_RTPRIO, 0),  # no real-time scheduling
                       (resource.RLIMIT_NICE, 0)):  # no raising its priority
    resource.setrlimit(limit, (value, value))
  # SIGXCPU at the soft limit, SIGKILL one second later if it is caught.
  resource.setrlimit(resource.RLIMIT_CPU, (c["cpu_s"], c["cpu_s"] + 1))


def prefer_for_oom_kill() -> None:
  """oom_score_adj 1000: if the machine runs out of memory, the kernel kills this call before
  the trainer (raising one's own score needs no privilege)."""
  with open("/proc/self/oom_score_adj", "w", encoding="ascii") as f:
    f.write("1000")


def _libc():
  """(ctypes, libc), for the calls the os module lacks. Imported only in the set-up, before the
  code is read; main() takes ctypes out of sys.modules again for the code (audit hook on)."""
  import ctypes  # pylint: disable=import-outside-toplevel
  return ctypes, ctypes.CDLL(None, use_errno=True)


def _call(what: str, fn, *args) -> None:
  ctypes, _ = _libc()
  if fn(*args) != 0:
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")


def mount_workdir(c: dict) -> None:
  """Mounts c['workdir']: a tmpfs of c['disk_bytes'] bytes and c['max_inodes'] inodes, in a
  mount namespace of this process's own; makes it the current directory, holding a copy of
  the code (c['main_path']) as main.py.

  A size-capped tmpfs bounds bytes only: an empty file, a FIFO, a directory or a symlink costs
  an inode (about 1 KiB of kernel memory) and no byte, so a 5 s call could make a million of
  them, which the kernel frees as the call ends (~2 s for a million, which run_python waits
  for: docs/sandbox.md).
  tmpfs bounds them with nr_inodes (ENOSPC past it; hard links and xattrs count too), which
  bwrap (to 0.11) cannot pass: it writes the tmpfs options itself, size= only. Hence this
  mount, made while the process still holds CAP_SYS_ADMIN (bwrap's --cap-add; cleared before
  any model text is read). The namespace is a new one because, as an ordinary user, bwrap's
  belongs to a user namespace above the child's, where the child holds no capability; one
  that the child's user namespace owns lets it mount a tmpfs, over mounts that then stay
  locked.
  """
  _, libc = _libc()
  _call("unshare(CLONE_NEWNS)", libc.unshare, CLONE_NEWNS)
  options = f"mode=0777,size={c['disk_bytes']},nr_inodes={c['max_inodes']}"
  _call(f"mount tmpfs ({options}) on {c['workdir']}", libc.mount, b"tmpfs",
        c["workdir"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode())
  os.chdir(c["workdir"])  # bwrap's --chdir is the directory beneath the mount
  with open(c["main_path"], "rb") as f:
    source = f.read()
  with open(os.open("main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
    f.write(source)
  os.chmod("main.py", 0o644)  # whatever the umask


def clear_capabilities() -> None:
  """Clears every capability of this process (capset(2); the ambient ones go with them). As
  an ordinary user the child is nobody in its user namespace and still holds the CAP_SYS_ADMIN
  that mount_workdir used; as root, drop_root has cleared them already."""
  ctypes, libc = _libc()

  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Data(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]
  _call("capset", libc.capset, ctypes.byref(Header(LINUX_CAPABILITY_VERSION_3, 0)),
        (Data * 2)())


def load_seccomp(fd: int) -> None:
  """Loads the filter that sandbox.seccomp_program compiled (a BPF program, read from `fd`).
  Here rather than by bwrap's --seccomp, which loads it before the exec: the filter refuses the
  mount that mount_workdir needs. bwrap set no_new_privs, which lets nobody load it."""
  ctypes, libc = _libc()
  with os.fdopen(fd, "rb") as f:
    program = f.read()
  if not program or len(program) % 8:
    raise OSError(f"seccomp: a BPF program of {len(program)} bytes")

  class Program(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
  prog = Program(len(program) // 8, program)
  libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                         ctypes.c_ulong]
  _call("prctl(PR_SET_SECCOMP)", libc.prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER,
        ctypes.byref(prog), 0, 0)


def drop_root(uid: int) -> None:
  """As root: to `uid` for good, with no capability left (RLIMIT_NPROC does not bind root, and
  root could write anywhere)."""
  if os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def capabilities() -> int:
  """The effective, permitted and ambient capabilities of this process (a bit mask; 0 = none)."""
  caps = 0
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(("CapEff:", "CapPrm:", "CapAmb:")):
        caps |= int(line.split()[1], 16)
  return caps


def seccomp_mode() -> str:
  """'2' once a filter is loaded (/proc/self/status's Seccomp)."""
  with open("/proc/self/status", encoding="ascii") as f:
    return next(line.split()[1] for line in f if line.startswith("Seccomp:"))


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


def set_up(config: dict) -> None:
  """Everything before the code: a set-up failure exits with one line on stderr (the parent
  raises it as SandboxError), before the ready byte."""
  strict = config["mode"] == "strict"
  try:
    if strict:
      mount_workdir(config)
    set_limits(config)
    prefer_for_oom_kill()
    if not strict:
      for name in PRELOAD:
        __import__(name)
    drop_root(config["uid"])
    if strict:
      clear_capabilities()
      if config["seccomp_fd"] >= 0:
        load_seccomp(config["seccomp_fd"])
  except OSError as e:
    sys.exit(f"sandbox: {e}")
  if strict and (os.getuid() == 0 or capabilities() != 0):
    sys.exit(f"sandbox: uid {os.getuid()} with capabilities {capabilities():#x} after the drop")
  if strict and config["seccomp_fd"] >= 0 and seccomp_mode() != "2":
    sys.exit(f"sandbox: seccomp mode {seccomp_mode()} after loading the filter")


def main() -> None:
  config = json.loads(sys.argv[1])
  set_up(config)
  os.umask(0o077)
  if config["audit"]:
    # `importlib.import_module` raises no import event; an entry of None refuses the import
    # on every path (code can delete the entry: a tripwire like the rest of the hook). The
    # set-up's own ctypes goes too.
    for name in [n for n in sys.modules if n.startswith("ctypes.")]:
      del sys.modules[name]
    for name in REFUSED_IMPORTS:
      sys.modules[name] = None
    sys.addaudithook(make_hook(os.getcwd(), config["max_write_opens"]))
  # Tells the parent the set-up is done; closed before the code runs, which cannot fake it.
  os.write(config["ready_fd"], b"1")
  os.close(config["ready_fd"])
  run_main()


if __name__ == "__main__":
  main()
