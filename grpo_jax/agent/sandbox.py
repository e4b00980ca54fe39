"""The one place model-written text is executed: `run_python(code)` in a contained child process.

    >>> run_python("print(2 + 2)")
    SandboxResult(stdout='4\\n', stderr='', status='ok', exit_code=0, signal=None, seconds=0.1)
    >>> run_python("while True: pass", timeout_s=1.0).status
    'timeout'

The boundary is the kernel's, set up by bubblewrap (`bwrap`, apt-get install bubblewrap) and a
seccomp filter compiled with libseccomp; the child's side is sandbox_child.py. Layer by layer
(docs/sandbox.md says which layer stops which escape):
- PID namespace: the child sees only its own processes; the trainer has no pid in it (no kill,
  no pidfd, no /proc/PID of the parent), and every process in it dies with the call (its init is
  killed with bwrap, and bwrap with the call).
- user: as root, bwrap mounts as root and the child drops to nobody (65534) before reading the
  code: a real unprivileged uid, no capabilities. As an ordinary user, a user namespace maps
  nobody inside to the trainer's uid outside, with no further user namespaces
  (--disable-userns); the trainer's files are then kept out by the mounts. Either way the child
  starts with CAP_SYS_ADMIN for one mount (below) and clears every capability before the code.
- mounts: a fresh root holding only /usr (and the /bin, /lib links), ld.so's cache, the Python
  installation (a venv at /sandbox/venv), a new /proc (/proc/keys and its like covered) and a
  minimal /dev, all read-only but the working directory (/sandbox/work): a tmpfs capped at
  disk_bytes and max_inodes, which the child mounts itself in a mount namespace of its own (no
  bwrap option caps a tmpfs's inodes; sandbox_child.mount_workdir). The child then holds no
  capability, so it cannot remount anything, and seccomp refuses the mount calls besides.
- network, IPC, UTS, cgroup namespaces: no interface but a down loopback, no abstract sockets,
  no System V objects of the host.
- seccomp (refused with EPERM; loaded by the child after its mount): a second process (fork,
  vfork, clone without CLONE_THREAD: a call is one process, so RLIMIT_AS bounds its whole
  memory), ptrace and process_vm_*, every
  mount and namespace call, pidfd_*, kcmp, socket() (socketpair only for AF_UNIX),
  connect/bind/listen/accept, keyctl, bpf, perf_event_open, userfaultfd, io_uring, AIO,
  inotify, memfd_create, System V IPC, module/kexec/reboot/clock calls; clone3 answers ENOSYS
  so that clone's flags can be checked.
- rlimits (sandbox_child.py): CPU seconds, address space, processes, file size, open files,
  queued signals (and so POSIX timers); none of locked memory, message queues, real-time or
  raised priority; and oom_score_adj 1000, so that the OOM killer takes the call before the
  trainer. docs/sandbox.md has a table of what each layer bounds and the error the code sees.
- wall clock and output: every call has `timeout_s` and `max_output_bytes`; past either, bwrap's
  process group gets SIGKILL, and the namespace with it.
- environment: only PATH, HOME, TMPDIR and the locale; nothing of the parent's (no tokens).
- audit hook: a tripwire, not the boundary. It turns the common attempts (fork, subprocess,
  sockets, ctypes, subinterpreters, writes outside the working directory) into a clear
  PermissionError for the model.

Where the kernel or the machine refuses a layer, `check('strict')` raises SandboxUnavailable
naming it. sandbox='unsafe' runs the code without the kernel layers (rlimits, nobody when root,
a temporary directory and the audit hook only), and warns at every start.
Tests: tests/agent_sandbox_test.py (each layer, and the attacks as root and as nobody).
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno as errno_lib
import functools
import json
import math
import os
import selectors
import shutil
import signal as signal_lib
import subprocess
import sys
import tempfile
import threading
import time

from grpo_jax.errors import UserError, warn

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
NOBODY = 65534
MODES = ("strict", "unsafe")
# Inside the sandbox: the working directory (a tmpfs) and a copy of sandbox_child.py. Under
# /sandbox, a path no Python installation should be at (_python_dirs refuses one there).
WORKDIR = "/sandbox/work"
CHILD_PATH = "/sandbox/child.py"
MAIN_PATH = "/sandbox/main.py"  # the code, read-only; the child copies it into WORKDIR
VENV = "/sandbox/venv"  # where the trainer's venv is mounted, if it runs in one (see _venv)
# Kernel files that a new /proc shows of the whole machine: /proc/keys lists the keys of the
# trainer's session keyring (names and sizes) by possession. Each is hidden under /dev/null.
MASKED_PROC = ("/proc/keys", "/proc/key-users", "/proc/timer_list", "/proc/sched_debug")
# Statuses: 'ok' (exit 0), 'error' (non-zero exit, e.g. an exception), 'timeout' (wall clock),
# 'killed' (a signal, e.g. SIGXCPU at the CPU limit), 'output_limit' (too much output).
STATUSES = ("ok", "error", "timeout", "killed", "output_limit")


class SandboxError(RuntimeError):
  """The sandbox itself could not be set up (a bug or an OS that refuses a limit), which is no
  property of the code: raised rather than shown to the model as the code's error."""


class SandboxUnavailable(UserError):
  """A layer of the strict sandbox is missing on this machine; the message names it."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  stdout: str  # its first max_output_bytes (decoded as UTF-8, bad bytes replaced)
  stderr: str
  status: str  # one of STATUSES
  exit_code: int | None  # None when a signal ended the child
  signal: int | None  # the signal that ended it (ours, SIGKILL, on timeout / output_limit)
  seconds: float


# --- seccomp ------------------------------------------------------------------------------------

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 1, 4, 7
AF_UNIX = 1
CLONE_THREAD = 0x00010000
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                    0x40000000, 0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID,
#                                              NEWNET, NEWTIME
# Refused whatever their arguments. Names this libseccomp does not know are skipped, except
# those given by number (the same on every 64-bit architecture since Linux 5.1).
REFUSED_SYSCALLS = (
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    # mounts and namespaces
    "mount", "umount", "umount2", "mount_setattr", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "pivot_root", "chroot", "unshare", "setns", 467,  # open_tree_attr
    # network: a socketpair is all a program needs (see the socketpair rule)
    "socket", "connect", "bind", "listen", "accept", "accept4",
    # a second process: a call is one process (its threads share its address space, so
    # RLIMIT_AS bounds the whole call's memory); clone is checked for CLONE_THREAD below
    "fork", "vfork",
    # kernel interfaces no tool needs; the AIO contexts and inotify instances are counted
    # machine-wide and per uid, so a call holding them all would starve the trainer
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "inotify_init", "inotify_init1",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "memfd_create", "memfd_secret",
    "name_to_handle_at", "open_by_handle_at", "fanotify_init", "lookup_dcookie", "quotactl",
    "quotactl_fd", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "swapoff", "syslog", "acct", "vhangup", "iopl",
    "ioperm", "modify_ldt", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl", "personality",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname",
    # System V IPC (a new IPC namespace has no size limit that binds us)
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget",
    "semop", "semtimedop", "semctl",
)


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
  _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
              ("datum_b", ctypes.c_uint64)]


def _libseccomp():
  try:
    lib = ctypes.CDLL("libseccomp.so.2")
  except OSError as e:
    raise SandboxUnavailable(
        f"python tool: no seccomp: libseccomp.so.2 cannot be loaded ({e}); install libseccomp2, "
        "or set agent.sandbox='unsafe' to run model code without the kernel's layers") from None
  lib.seccomp_init.restype = ctypes.c_void_p
  lib.seccomp_init.argtypes = [ctypes.c_uint32]
  lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
  lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                         ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
  lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
  lib.seccomp_release.argtypes = [ctypes.c_void_p]
  return lib


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
  """The filter as a BPF program (what bwrap --seccomp loads): everything allowed but the calls
  above, which fail with EPERM. Other architectures' calling conventions (i386, x32) kill."""
  lib = _libseccomp()
  ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
  if not ctx:
    raise SandboxError("seccomp_init failed")
  eperm = 0x00050000 | errno_lib.EPERM  # SCMP_ACT_ERRNO(EPERM)
  try:
    def rule(action: int, name, *cmps: tuple[int, int, int, int]) -> None:
      nr = name if isinstance(name, int) else lib.seccomp_syscall_resolve_name(name.encode())
      if nr == -1:  # __NR_SCMP_ERROR: a name this libseccomp does not know
        return
      args = (_ArgCmp * len(cmps))(*(_ArgCmp(*c) for c in cmps)) if cmps else None
      rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), args)
      if rc != 0:
        raise SandboxError(f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")

    for name in REFUSED_SYSCALLS:
      rule(eperm, name)
    rule(eperm, "socketpair", (0, SCMP_CMP_NE, AF_UNIX, 0))
    for request in (TIOCSTI, TIOCLINUX):  # typing into a terminal (none is open; --new-session)
      rule(eperm, "ioctl", (1, SCMP_CMP_EQ, request, 0))
    for flag in CLONE_NAMESPACES:
      rule(eperm, "clone", (0, SCMP_CMP_MASKED_EQ, flag, flag))
    rule(eperm, "clone", (0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    # clone3 passes its flags in memory, where seccomp cannot look: ENOSYS makes glibc fall
    # back to clone, whose flags the rules above check.
    rule(0x00050000 | errno_lib.ENOSYS, "clone3")
    with tempfile.TemporaryFile() as f:
      rc = lib.seccomp_export_bpf(ctx, f.fileno())
      if rc != 0:
        raise SandboxError(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
      f.seek(0)
      return f.read()
  finally:
    lib.seccomp_release(ctx)


# --- bubblewrap ---------------------------------------------------------------------------------

def _venv() -> str | None:
  """The venv the trainer runs in (its directory, resolved), or None: a directory holding
  pyvenv.cfg whose bin/ holds sys.executable. Python finds a venv from where its executable
  is, so the sandbox can mount it at VENV and run VENV/bin/<name> (the base installation it
  points to stays at its own path): a venv under /tmp or /home shows no /tmp or /home."""
  prefix = os.path.realpath(sys.prefix)
  if (prefix != os.path.realpath(sys.base_prefix)
      and os.path.isfile(os.path.join(prefix, "pyvenv.cfg"))
      and os.path.realpath(os.path.dirname(sys.executable)) == os.path.join(prefix, "bin")):
    return prefix
  return None


def _interpreter() -> str:
  """The interpreter's path inside the sandbox."""
  if _venv() is None:
    return sys.executable
  return os.path.join(VENV, "bin", os.path.basename(sys.executable))


def _python_dirs() -> list[str]:
  """The directories the interpreter needs at their own paths, outside /usr: its prefixes (a
  venv's base; the venv itself is mounted at VENV). SandboxUnavailable for one where the
  sandbox mounts its own (/sandbox, /proc, /dev, /etc)."""
  venv = _venv()
  dirs = []
  for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
            os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
    p = os.path.realpath(p)
    if p != "/" and p != venv and not any(p == d or p.startswith(d + "/")
                                          for d in ["/usr"] + dirs):
      dirs = [d for d in dirs if not d.startswith(p + "/")] + [p]
  for d in dirs:
    for own in ("/sandbox", "/proc", "/dev", "/etc"):
      if d == own or d.startswith(own + "/") or own.startswith(d + "/"):
        raise SandboxUnavailable(
            f"python tool: this Python ({d}) is installed where the sandbox mounts its own "
            f"{own}; run the trainer with a Python installed elsewhere (e.g. a venv outside "
            f"{own})")
  return dirs


def _bwrap_args(root: bool, main_fd: int, child_fd: int, info_fd: int) -> list[str]:
  """bwrap's command line: the namespaces and the read-only mounts. The working directory is
  only a mount point here: the child mounts the tmpfs itself, and loads the seccomp filter
  after that (sandbox_child.set_up), as bwrap has no option for a tmpfs's inodes."""
  if root:
    # bwrap mounts as root (it can reach a Python under a 0700 /root); the child then drops to
    # nobody itself with two of the three capabilities it keeps, before any model text is read.
    ns = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
          "--unshare-cgroup-try", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
          "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SYS_ADMIN"]
  else:
    ns = ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(NOBODY),
          "--gid", str(NOBODY), "--cap-add", "CAP_SYS_ADMIN"]
  # CAP_SYS_ADMIN: for the child to mount its working directory (sandbox_child.mount_workdir),
  # cleared there, with the rest, before the code is read.
  args = ["bwrap", *ns, "--die-with-parent", "--new-session", "--hostname", "sandbox",
          "--info-fd", str(info_fd),
          "--ro-bind", "/usr", "/usr"]
  for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(top):
      args += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      args += ["--ro-bind", top, top]
  args += ["--perms", "0755", "--dir", "/etc"]  # bwrap would copy the host's mode
  for path in ("/etc/ld.so.cache", "/etc/localtime"):
    args += ["--ro-bind-try", path, path]
  made = {"/etc"}
  for d in _python_dirs():
    parents = d.split("/")[1:-1]
    for i in range(1, len(parents) + 1):  # bwrap would copy a 0700 /root's mode
      parent = "/" + "/".join(parents[:i])
      if parent not in made:
        made.add(parent)
        args += ["--perms", "0755", "--dir", parent]
    args += ["--ro-bind", d, d]
  # The child's file is copied in (no host path of the checkout in bwrap's argv, which the
  # sandbox's pid 1 shows in /proc/1/cmdline).
  args += ["--perms", "0755", "--dir", "/sandbox", "--perms", "0644", "--file", str(child_fd),
           CHILD_PATH, "--perms", "0644", "--file", str(main_fd), MAIN_PATH]
  venv = _venv()
  if venv is not None:
    args += ["--ro-bind", venv, VENV]
  args += ["--proc", "/proc", "--dev", "/dev"]
  for path in MASKED_PROC:
    if os.path.exists(path):  # the new /proc has what the host's has (one kernel)
      args += ["--ro-bind", "/dev/null", path]
  args += ["--perms", "0755", "--dir", WORKDIR,
           "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR,
           "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR,
           "--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8"]
  return args


def _memfd(name: str, data: bytes) -> int:
  fd = os.memfd_create(name, os.MFD_CLOEXEC)
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


# --- layers: checked once per process -----------------------------------------------------------

_checked: dict[str, bool] = {}
_check_lock = threading.Lock()
PROBE = """
import json, os
status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines())
print(json.dumps({'uid': os.getuid(), 'pid': os.getpid(), 'pids': os.listdir('/proc'),
                  'caps': int(status['CapEff'], 16), 'seccomp': status['Seccomp'].strip(),
                  'nnp': status['NoNewPrivs'].strip(),
                  'net': sorted(line.split(':')[0].strip()
                                for line in open('/proc/self/net/dev').readlines()[2:])}))
"""


def check(mode: str = "strict") -> None:
  """Raises SandboxUnavailable (one line, naming the layer) unless every layer of the strict
  sandbox works here; sandbox='unsafe' skips the layers and warns. The first strict check
  of a process runs one probe (~0.1 s); later ones are free."""
  if mode not in MODES:
    raise SandboxUnavailable(f"agent.sandbox={mode!r}: use 'strict' (the kernel's layers) or "
                             "'unsafe' (no kernel layers; only for a machine that refuses them)")
  if mode == "unsafe":
    warn("agent.sandbox='unsafe': the python tool runs model-written code WITHOUT the kernel's "
         "layers (no PID, mount, network or user namespace, no seccomp): only rlimits and an "
         "audit hook that code can switch off. Use it only on a machine of no value.")
    return
  with _check_lock:
    if _checked.get(mode):
      return
    hint = "or set agent.sandbox='unsafe' to run model code without the kernel's layers"
    if shutil.which("bwrap") is None:
      raise SandboxUnavailable(f"python tool: no bubblewrap: `bwrap` is not on PATH; install it "
                               f"(apt-get install bubblewrap), {hint}")
    seccomp_program()  # raises SandboxUnavailable without libseccomp
    try:
      r = run_python(PROBE, timeout_s=10.0, audit=False)
    except SandboxError as e:
      line = str(e).strip().splitlines()[-1].removeprefix("the sandbox's set-up failed: ")
      if "bwrap" in line and ("namespace" in line or "Operation not permitted" in line):
        raise SandboxUnavailable(f"python tool: no user or PID namespaces: {line}; allow them "
                                 f"(sysctl kernel.unprivileged_userns_clone=1 or "
                                 f"user.max_user_namespaces > 0), {hint}") from None
      raise SandboxUnavailable(f"python tool: the sandbox does not start: {line}; {hint}") from None
    try:
      seen = json.loads(r.stdout)
    except ValueError:
      raise SandboxUnavailable(f"python tool: the sandbox's probe failed ({r.status}): "
                               f"{r.stderr.strip()[-300:]}; {hint}") from None
    missing = [layer for layer, ok in (
        ("seccomp (the kernel did not apply the filter)", seen["seccomp"] == "2"),
        ("no_new_privs", seen["nnp"] == "1"),
        ("dropped capabilities", seen["caps"] == 0),
        ("unprivileged uid", seen["uid"] == NOBODY),
        ("PID namespace", sorted(p for p in seen["pids"] if p.isdigit()) == ["1", "2"]),
        ("network namespace", seen["net"] == ["lo"])) if not ok]
    if missing:
      raise SandboxUnavailable(f"python tool: missing sandbox layer: {', '.join(missing)}; {hint}")
    _checked[mode] = True


# --- running ------------------------------------------------------------------------------------

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
  """Removes the unsafe mode's directory, whatever modes the code left on what it made (as an
  ordinary user a 0000 directory can be neither listed nor emptied); warns rather than raises
  (the call's result matters more than its litter)."""
  def make_writable(func, p, _):
    for d in (os.path.dirname(p), p):
      if os.path.isdir(d) and not os.path.islink(d):
        os.chmod(d, 0o700)
    if os.path.isdir(p) and not os.path.islink(p):
      shutil.rmtree(p, onerror=make_writable)
    else:
      os.remove(p)
  try:
    shutil.rmtree(path, onerror=make_writable)
  except OSError as e:
    warn(f"python tool: could not remove the unsafe mode's directory {path}: {e}")


def _wait_for_namespace(info: bytes, deadline_s: float = 5.0) -> None:
  """Waits (up to deadline_s) until the call's PID namespace is empty. Its init's pid comes from
  bwrap's --info-fd; the kernel lets that init finish exiting (a zombie, or reaped) only after
  every other process of the namespace is gone, and tears it down after bwrap returns."""
  try:
    pid = int(json.loads(info)["child-pid"])
  except (ValueError, KeyError, TypeError):
    return  # bwrap stopped before starting the namespace
  end = time.monotonic() + deadline_s
  while time.monotonic() < end:
    try:
      with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
          return
    except (OSError, IndexError):
      return  # reaped
    time.sleep(0.005)


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: float | None = None,
               memory_bytes: int = 1 << 30, max_output_bytes: int = 1 << 16,
               max_processes: int = 32, max_file_bytes: int = 8 << 20, max_open_files: int = 64,
               disk_bytes: int = 64 << 20, max_inodes: int = 10_000, max_write_opens: int = 64,
               audit: bool = True, seccomp: bool = True, mode: str = "strict") -> SandboxResult:
  """Runs `code` as a Python program; its stdout/stderr, how it ended and how long it took.

  cpu_s defaults to one second more than timeout_s: the wall clock stops a busy loop, the CPU
  limit stops threads that burn CPU faster than the clock runs. max_processes is RLIMIT_NPROC,
  which the kernel counts per user (per user namespace as an ordinary user, across concurrent
  sandboxes as root: all are nobody). disk_bytes is the size of the tmpfs working directory
  (RAM, freed with the call) and max_inodes the number of files, directories, links and nodes
  it holds (main.py and the directory itself are 2 of them; the code gets ENOSPC past either);
  max_file_bytes bounds each file. max_write_opens bounds the files
  the audit hook lets the code open for writing. audit=False leaves the hook out, so tests can
  show that the kernel's layers hold on their own; seccomp=False likewise the filter, so they
  can show the namespaces and the missing capabilities beneath it. mode='unsafe' skips the
  kernel's layers (no bwrap; see check) and writes to a temporary directory of the host.
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: use one of {MODES}")
  _check_tmpfs_limits(disk_bytes, max_inodes)
  start = time.monotonic()
  root = os.geteuid() == 0
  ready_r, ready_w = os.pipe()
  info_r, info_w = os.pipe() if mode == "strict" else (-1, -1)
  fds, workdir = [], None
  try:
    config = dict(memory_bytes=memory_bytes, max_processes=max_processes,
                  max_file_bytes=max_file_bytes, max_open_files=max_open_files,
                  cpu_s=max(1, math.ceil(timeout_s + 1 if cpu_s is None else cpu_s)), uid=NOBODY,
                  max_write_opens=max_write_opens, audit=audit, ready_fd=ready_w, mode=mode,
                  workdir=WORKDIR, main_path=MAIN_PATH, disk_bytes=disk_bytes,
                  max_inodes=max_inodes, seccomp_fd=-1)
    source = code.encode("utf-8", "surrogatepass")
    if mode == "strict":
      argv, fds = _strict_command(source, config, root, seccomp, info_w)
      cwd, env = "/", {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    else:
      workdir = _unsafe_workdir(source, root)
      argv = [sys.executable, "-I", "-u", CHILD, json.dumps(config)]
      cwd, env = workdir, {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                           "LANG": "C.UTF-8"}
    proc = _spawn(argv, cwd, env, (ready_w, *fds, *([info_w] if info_w >= 0 else [])))
    os.close(ready_w)
    ready_w = -1
    if info_w >= 0:
      os.close(info_w)
      info_w = -1
    for fd in fds:
      os.close(fd)
    fds = []
    try:
      out, err, why = _collect(proc, start + timeout_s, max_output_bytes)
    finally:
      # Not reaped yet, so the group id is still ours. bwrap's init dies with bwrap
      # (--die-with-parent), and the kernel kills everything in its PID namespace with it.
      _kill_group(proc.pid)
      code_or_signal = proc.wait()
      proc.stdout.close()
      proc.stderr.close()
    ready = os.read(ready_r, 1) == b"1"  # the child has exited: this does not block
    if info_r >= 0:
      with os.fdopen(info_r, "rb") as f:  # bwrap has exited: its write end is closed
        info_r = -1
        _wait_for_namespace(f.read(1 << 16))
  finally:
    for fd in (ready_r, ready_w, info_r, info_w, *fds):
      if fd >= 0:
        os.close(fd)
    if workdir is not None:
      _remove(workdir)
  if not ready and not why:
    raise SandboxError(f"the sandbox's set-up failed: {err.decode('utf-8', 'replace')[-2000:]}")
  return _result(out, err, why, code_or_signal, mode == "strict", time.monotonic() - start)


def _strict_command(source: bytes, config: dict, root: bool, seccomp: bool, info_w: int):
  """bwrap's argv and the memfds it reads (the code, the child, the seccomp program, which the
  child loads itself: see _bwrap_args); sets config['seccomp_fd']."""
  fds = [_memfd("main.py", source), _memfd("child.py", _child_source())] + (
      [_memfd("seccomp", seccomp_program())] if seccomp else [])
  config["seccomp_fd"] = fds[2] if seccomp else -1
  argv = _bwrap_args(root, fds[0], fds[1], info_w) + [
      "--", _interpreter(), "-I", "-u", CHILD_PATH, json.dumps(config)]
  return argv, fds


def _spawn(argv, cwd, env, pass_fds) -> subprocess.Popen:
  """The call's process, in a session of its own (its group is killed whole), its output piped."""
  try:
    return subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, close_fds=True, pass_fds=pass_fds)
  except FileNotFoundError as e:
    raise SandboxError(f"the sandbox's set-up failed: {e.filename} not found (bubblewrap "
                       "installed? see sandbox.check)") from None


def _check_tmpfs_limits(disk_bytes, max_inodes) -> None:
  """ValueError unless both are ints in tmpfs's range: it reads 0 as no limit at all, and
  2**64 wraps to 0."""
  for name, value, least in (("disk_bytes", disk_bytes, 1), ("max_inodes", max_inodes, 2)):
    if not isinstance(value, int) or not least <= value <= 1 << 50:
      raise ValueError(f"{name}={value!r}: use an int from {least} to 2**50")


def _unsafe_workdir(source: bytes, root: bool) -> str:
  """mode='unsafe': a temporary directory of the host holding the code as main.py (nobody's,
  as root)."""
  workdir = tempfile.mkdtemp(prefix="grpo_sandbox_")
  with open(os.path.join(workdir, "main.py"), "wb") as f:
    f.write(source)
  if root:
    for path in (workdir, os.path.join(workdir, "main.py")):
      os.chown(path, NOBODY, NOBODY)
  return workdir


def _result(out: bytes, err: bytes, why: str | None, code_or_signal: int, strict: bool,
            seconds: float) -> SandboxResult:
  """The call's SandboxResult from what the process printed, why it was stopped (a timeout or
  too much output; None: it ended) and its wait status."""
  if strict and code_or_signal > 128 and code_or_signal - 128 in _SIGNALS:
    code_or_signal = 128 - code_or_signal  # bwrap reports a child's signal N as status 128 + N
  if why:
    status, exit_code, sig = why, None, signal_lib.SIGKILL
  elif code_or_signal < 0:
    status, exit_code, sig = "killed", None, -code_or_signal
  else:
    status, exit_code, sig = ("ok" if code_or_signal == 0 else "error"), code_or_signal, None
  return SandboxResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), status,
                       exit_code, sig, seconds)


_SIGNALS = frozenset(int(s) for s in signal_lib.Signals)


@functools.lru_cache(maxsize=1)
def _child_source() -> bytes:
  with open(CHILD, "rb") as f:
    return f.read()
