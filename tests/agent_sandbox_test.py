"""The sandbox against the escapes a model's code could try.

Two kinds of tests. The layer tests show each layer alone where it can be shown: the code runs
without the audit hook (audit=False) so that the kernel's layers (PID, mount, network and user
namespaces, seccomp, the tmpfs, rlimits) are seen to hold by themselves, and with it to see the
tripwire fire. The attack tests run tests/sandbox_attacks.py, a process that plays the trainer
(a secret in its command line, environment, files and sockets), once as the caller (root in
CI) and once as nobody (the test drops to it with unshare and setpriv where it can, and says
why it is skipped where it cannot); every attack must leave the trainer as it was.
"""
import errno
import inspect
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import sandbox_attacks
from grpo_jax.agent import sandbox, sandbox_child
from grpo_jax.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SLACK_S = 0.75  # start-up, kill and reap on a loaded 2-core machine
ROOT = os.geteuid() == 0


def _run(code: str, **kwargs) -> sandbox.SandboxResult:
  return sandbox.run_python(textwrap.dedent(code), **kwargs)


def _tasks_of(uid: int) -> int:
  """The processes and threads of `uid` now: what RLIMIT_NPROC counts (zombies included)."""
  n = 0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      lines = Path(f"/proc/{pid}/status").read_text().splitlines()
      status = dict(line.split(":\t", 1) for line in lines)
    except (OSError, ValueError):
      continue
    if int(status["Uid"].split()[0]) == uid:
      n += int(status.get("Threads", "1"))
  return n


def _assert_contained_afterwards(pid_ns: str | None = None) -> None:
  """Nothing the code started is alive, and the next call works."""
  if pid_ns is not None:  # run_python returns once its namespace is empty: no waiting here
    assert sandbox_attacks._pid_namespace_members(pid_ns) == [], "processes outlived the call"
  assert sandbox.run_python("print('fine')").stdout == "fine\n"


@pytest.fixture(scope="module", autouse=True)
def strict_layers():
  """Every test here needs the strict sandbox; where a layer is missing the module fails with
  the one-line message naming it (CI installs bubblewrap)."""
  sandbox.check("strict")


# --- the layers ---------------------------------------------------------------------------------

def test_normal_code_runs_in_its_namespaces():
  r = _run("""
      import os
      print(2 + 2)
      st = os.statvfs('.')
      print(os.getcwd(), os.getuid(), os.getpid(), st.f_blocks * st.f_frsize,
            sorted(os.listdir('/')))
  """, disk_bytes=8 << 20)
  assert (r.status, r.exit_code, r.signal, r.stderr) == ("ok", 0, None, "")
  four, rest = r.stdout.split("\n", 1)
  workdir, uid, pid, size, top = rest.split(" ", 4)
  assert four == "4" and workdir == sandbox.WORKDIR
  assert int(uid) == sandbox.NOBODY
  assert int(pid) == 2  # bwrap's init is 1: a PID namespace of its own
  assert int(size) == 8 << 20  # the working directory is the capped tmpfs
  assert "tmp" not in top and "home" not in top and "sandbox" in top


def test_a_venv_is_mounted_without_the_path_it_lives_under(tmp_path):
  """A trainer in a venv under /tmp: the sandbox runs the venv's interpreter, its packages
  importable, with no /tmp (or anything else of the venv's path) at the sandbox's root."""
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                 timeout=120)
  site = subprocess.run([str(venv / "bin" / "python3"), "-c",
                         "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        capture_output=True, text=True, check=True).stdout.strip()
  Path(site, "venv_only_module.py").write_text("WHERE = __file__\n")
  code = ("import json, os, sys, venv_only_module\n"
          "print(json.dumps([sys.prefix, venv_only_module.WHERE, sorted(os.listdir('/'))]))")
  p = subprocess.run([str(venv / "bin" / "python3"), "-c",
                      "import sys; from grpo_jax.agent import sandbox; "
                      f"r = sandbox.run_python({code!r}); print(r.stdout, r.stderr)"],
                     cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
                     capture_output=True, text=True, timeout=60, check=False)
  assert p.returncode == 0, p.stderr
  prefix, where, top = json.loads(p.stdout)
  assert prefix == sandbox.VENV and where.startswith(sandbox.VENV + "/"), (prefix, where)
  assert tmp_path.parts[1] not in top and "sandbox" in top, top


def test_errors_and_bad_source_are_results_not_exceptions():
  assert _run("import sys; sys.exit(3)").exit_code == 3
  r = _run("print('before')\n1 / 0")
  assert (r.status, r.exit_code, r.stdout) == ("error", 1, "before\n")
  assert r.stderr.strip().endswith("ZeroDivisionError: division by zero")
  assert "sandbox_child" not in r.stderr and "child.py" not in r.stderr
  for code in ("x = = 1", "print(1)\x00", "print('\ud800')"):
    r = sandbox.run_python(code)
    assert r.status == "error" and "Error" in r.stderr, (code, r)


def test_the_code_is_text_whatever_its_coding_line_says():
  # Compiled as a str: a PEP 263 line cannot make the child decode it again (as Latin-1 the
  # two UTF-8 bytes of 'é' would be two characters). A leading BOM is dropped, as Python would.
  for code in ("# coding: latin-1\nprint(len('é'), 'é')", "\ufeffprint(len('é'), 'é')"):
    r = sandbox.run_python(code)
    assert (r.status, r.stdout) == ("ok", "1 é\n"), (code, r)


def test_a_python_where_the_sandbox_mounts_its_own_is_refused_by_name(monkeypatch):
  monkeypatch.setattr(sys, "prefix", "/sandbox/venv")
  with pytest.raises(UserError, match=r"this Python \(/sandbox/venv\) is installed where the "
                                      r"sandbox mounts its own /sandbox") as e:
    sandbox.run_python("print(1)")
  assert "unsafe" not in str(e.value)


def test_the_working_directory_allows_mkdir_rename_and_remove():
  r = _run("""
      import os, tempfile
      os.mkdir('d')
      os.rename('d', 'e')
      with open('e/f', 'w') as f:
        f.write('written')
      os.rename('e/f', 'g')
      print(open('g').read(), sorted(os.listdir('.')))
      os.remove('g')
      os.rmdir('e')
      with tempfile.NamedTemporaryFile() as t:  # TMPDIR is the working directory
        print(os.path.dirname(t.name),
              sorted(os.listdir('.')) == ['main.py', os.path.basename(t.name)])
      print(sorted(os.listdir('.')))
  """)
  assert r.status == "ok", r.stderr
  assert r.stdout.splitlines() == ["written ['e', 'g', 'main.py']", f"{sandbox.WORKDIR} True",
                                   "['main.py']"]


def test_an_infinite_loop_times_out_and_its_namespace_dies():
  start = time.monotonic()
  r = _run("""
      import os
      print(os.readlink('/proc/self/ns/pid'), flush=True)
      while True:
        pass
  """, timeout_s=1.0)
  wall = time.monotonic() - start
  assert (r.status, r.exit_code, r.signal) == ("timeout", None, signal.SIGKILL)
  assert 1.0 <= wall < 1.0 + SLACK_S, wall
  _assert_contained_afterwards(r.stdout.strip())


def test_the_cpu_limit_kills_a_busy_loop_before_the_wall_clock():
  r = _run("while True:\n  pass", cpu_s=1, timeout_s=20)
  assert (r.status, r.signal) == ("killed", signal.SIGXCPU)
  assert r.seconds < 10  # 1 CPU second, however busy the machine is


def test_fork_is_refused_by_the_audit_hook():
  r = _run("""
      import os
      while True:
        os.fork()
  """)
  assert r.status == "error" and "sandbox refused: os.fork" in r.stderr


def test_without_the_hook_the_filter_refuses_a_second_process_but_not_threads():
  """A call is one process, so RLIMIT_AS bounds its whole memory: four threads cannot hold
  more than the limit together, and no fork or spawn can start a process with a limit of its
  own. The child is also the first the kernel's OOM killer takes."""
  r = _run("""
      import os, threading
      def fork():
        if os.fork() == 0:
          os._exit(0)
      for name, fn in (("fork", fork),
                       ("posix_spawn", lambda: os.posix_spawn('/bin/true', ['true'], {}))):
        try:
          fn()
          print(name, "ok")
        except OSError as e:
          print(name, e.errno)
      held, errors, started = [], [], threading.Barrier(4)
      def hold():
        started.wait()  # every thread (and its stack) exists before any allocates
        try:
          held.append(bytearray(400 << 20))
        except MemoryError:
          errors.append(1)
      threads = [threading.Thread(target=hold) for _ in range(4)]
      for t in threads:
        t.start()
      for t in threads:
        t.join()
      print(len(held), len(errors), open('/proc/self/oom_score_adj').read().strip())
  """, audit=False, memory_bytes=1 << 30)
  assert r.status == "ok", r.stderr
  lines = r.stdout.splitlines()
  assert lines[:2] == [f"fork {errno.EPERM}", f"posix_spawn {errno.EPERM}"], r.stdout
  held, errors, oom_score_adj = map(int, lines[2].split())
  # 400 MiB each under 1 GiB for all: one or two threads hold theirs, the rest get MemoryError.
  assert 1 <= held <= 2 and held + errors == 4, r.stdout
  assert oom_score_adj == 1000


def test_without_the_hook_and_the_filter_rlimit_nproc_caps_a_fork_bomb():
  # As root the child is the machine's nobody, whose every process counts: the cap is set 4
  # above what exists now. As an ordinary user the count is the sandbox's user namespace's:
  # bwrap's init and the program are 2 of the 4.
  base = _tasks_of(sandbox.NOBODY) if ROOT else 0
  r = _run("""
      import os, time
      children = 0
      try:
        while True:
          if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
          children += 1
      except OSError as e:
        print(children, e.errno, os.readlink('/proc/self/ns/pid'), flush=True)
  """, audit=False, seccomp=False, max_processes=base + 4, timeout_s=5)
  children, error, pid_ns = r.stdout.split()
  assert r.status == "ok" and int(error) == errno.EAGAIN
  assert 1 <= int(children) <= 3
  _assert_contained_afterwards(pid_ns)  # the sleeping children died with the call
  # A real one (every process forks forever): held at the cap until the wall clock kills all.
  r = _run("""
      import os
      print(os.readlink('/proc/self/ns/pid'), flush=True)
      while True:
        try:
          os.fork()
        except OSError:
          pass
  """, audit=False, seccomp=False,
           max_processes=(_tasks_of(sandbox.NOBODY) if ROOT else 0) + 4, timeout_s=1.0, cpu_s=5)
  assert r.status == "timeout" and r.seconds < 1.0 + SLACK_S
  _assert_contained_afterwards(r.stdout.strip())


def test_the_kernels_other_counts_are_capped_by_rlimits():
  """What the kernel keeps per process or per user: pipes and eventfds count as open files,
  POSIX timers hold a queued signal each, message queues and locked memory get nothing, and
  the priority cannot be raised. Through libc (ctypes; the hook off), as the kernel sees it."""
  r = _run("""
      import ctypes, errno, json, mmap, os, resource
      libc = ctypes.CDLL(None, use_errno=True)
      def count(make):  # [how many, the errno that stopped it]
        n = 0
        try:
          while n < 100_000:
            if make() < 0:
              return [n, errno.errorcode[ctypes.get_errno()]]
            n += 1
        except OSError as e:
          return [n, errno.errorcode[e.errno]]
        return [n, 'none']
      def close_all():
        for fd in range(3, 64):
          try:
            os.close(fd)
          except OSError:
            pass
      seen = {'pipes': count(lambda: os.pipe()[0])}
      close_all()
      seen['eventfds'] = count(lambda: os.eventfd(0))
      close_all()
      timer = ctypes.c_void_p()
      seen['timers'] = count(lambda: libc.timer_create(1, None, ctypes.byref(timer)))
      seen['mq_open'] = count(lambda: libc.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None))
      page = mmap.mmap(-1, 1 << 16)
      address = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(page)))
      seen['mlock'] = count(lambda: libc.mlock(address, 1 << 16) - 1)  # 0 (locked) stops too
      seen['SCHED_FIFO'] = count(
          lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1)) or -1)
      seen['nice(-1)'] = count(lambda: os.nice(-1) and -1)
      seen['rlimits'] = {name: resource.getrlimit(getattr(resource, name))[0] for name in (
          'RLIMIT_MEMLOCK', 'RLIMIT_MSGQUEUE', 'RLIMIT_SIGPENDING', 'RLIMIT_RTPRIO',
          'RLIMIT_NICE')}
      print(json.dumps(seen))
  """, audit=False, max_open_files=32)
  assert r.status == "ok", r.stderr
  seen = json.loads(r.stdout)
  # 32 descriptors, stdin/out/err and the few the interpreter holds among them; a pipe is two.
  assert seen["pipes"][1] == "EMFILE" and 10 <= seen["pipes"][0] <= 14, seen
  assert seen["eventfds"][1] == "EMFILE" and 20 <= seen["eventfds"][0] <= 29, seen
  assert seen["timers"] == [sandbox_child.MAX_PENDING_SIGNALS, "EAGAIN"], seen
  assert seen["mq_open"] == [0, "EMFILE"] and seen["mlock"] == [0, "EPERM"], seen
  assert seen["SCHED_FIFO"] == [0, "EPERM"] and seen["nice(-1)"] == [0, "EPERM"], seen
  assert seen["rlimits"] == {"RLIMIT_MEMLOCK": 0, "RLIMIT_MSGQUEUE": 0, "RLIMIT_RTPRIO": 0,
                             "RLIMIT_NICE": 0,
                             "RLIMIT_SIGPENDING": sandbox_child.MAX_PENDING_SIGNALS}, seen


def test_a_10_gb_allocation_fails_at_the_address_space_limit():
  r = _run("""
      import resource
      print(resource.getrlimit(resource.RLIMIT_AS)[0], flush=True)
      x = bytearray(10 * 1024**3)
  """, memory_bytes=512 << 20)
  assert int(r.stdout) == 512 << 20
  assert r.status == "error" and r.stderr.strip().endswith("MemoryError")
  assert r.seconds < 3
  _assert_contained_afterwards()


@pytest.mark.parametrize("write", [
    "open(P, 'w').write('x')",
    "os.close(os.open(P, os.O_WRONLY | os.O_CREAT))",
    "os.mkdir(P)",
    "os.rename('main.py', P)",
    "os.symlink(P, 'link')",
    "d = os.open(os.path.dirname(P), os.O_RDONLY)\n"
    "os.open(os.path.basename(P), os.O_WRONLY | os.O_CREAT, dir_fd=d)",
])
def test_the_hook_refuses_writing_outside_the_directory(write):
  for target in ("/", "/usr", "/dev/shm"):
    r = _run(f"import os\nP = {target.rstrip('/') + '/x_outside'!r}\n{write}")
    assert r.status == "error" and "sandbox refused" in r.stderr, r


def test_without_the_hook_everything_but_the_directory_is_read_only():
  r = _run("""
      import errno, json, os
      seen = {}
      for path in ('/x', '/usr/x', '/dev/x', '/dev/shm/x', '/proc/x', '/tmp/x', '/etc/x'):
        try:
          open(path, 'w')
          seen[path] = 'written'
        except OSError as e:
          seen[path] = errno.errorcode[e.errno]
      os.mkdir('d')
      print(json.dumps(seen), os.getuid())
  """, audit=False)
  seen, uid = r.stdout.rsplit(" ", 1)
  assert r.status == "ok" and int(uid) == sandbox.NOBODY
  assert {p: e in ("EROFS", "ENOENT", "EACCES") for p, e in json.loads(seen).items()} == {
      p: True for p in json.loads(seen)}, seen
  for outside in ("/x", "/usr/x", "/dev/shm/x", "/tmp/x"):
    assert not (os.path.exists(outside) and os.path.getmtime(outside) > time.time() - 60)


def test_the_disk_is_bounded_by_the_tmpfs():
  r = _run("""
      import os
      written = 0
      try:
        for i in range(10):
          with open(f'f{i}', 'wb') as f:
            for _ in range(4):
              f.write(b'x' * (1 << 20))
              f.flush()
              written += 1 << 20
      except OSError as e:
        print(written, e.errno)
  """, audit=False, disk_bytes=8 << 20, max_file_bytes=8 << 20)
  written, error = map(int, r.stdout.split())
  assert int(error) == errno.ENOSPC
  assert 6 << 20 <= written <= 8 << 20


BOUND_S = 1.5  # how long past its timeout a call may return, on a loaded 2-core machine
MAX_INODES = inspect.signature(sandbox.run_python).parameters["max_inodes"].default


@pytest.mark.parametrize("make, timeout_s", [
    ("os.mknod(name, stat.S_IFIFO | 0o600)", 5.0),  # the timeout of the agent presets' tool
    ("os.mkdir(name)", 2.0),
    ("os.symlink('x' * 200, name)", 2.0),
    ("os.close(os.open(name, os.O_WRONLY | os.O_CREAT))", 2.0),
])
def test_a_flood_of_inodes_meets_the_cap_and_the_call_still_ends_on_time(make, timeout_s):
  """Files that cost no byte still cost an inode and kernel memory: the working directory's
  tmpfs holds at most max_inodes (the directory and main.py among them), the code gets ENOSPC
  past it, and, as the kernel has only that many to free, the call returns on time. At
  tmpfs's default (half the RAM's pages) a 5 s flood makes ~1M inodes and the call returns
  1.6-2.0 s late, the kernel freeing them (experiments/sandbox_attacks.md)."""
  start = time.monotonic()
  r = _run(f"""
      import errno, os, stat
      st = os.statvfs('.')
      print(os.readlink('/proc/self/ns/pid'), st.f_files, st.f_files - st.f_ffree, flush=True)
      made = refused = 0
      while True:  # for the whole timeout: past the cap, every try is refused
        name = f'n{{made + refused}}'
        try:
          {make}
          made += 1
        except OSError as e:
          if refused == 0:
            print(made, errno.errorcode[e.errno], flush=True)
          refused += 1
  """, audit=False, timeout_s=timeout_s)
  wall = time.monotonic() - start
  assert (r.status, r.exit_code, r.signal) == ("timeout", None, signal.SIGKILL), r
  assert timeout_s <= wall < timeout_s + BOUND_S, wall
  first, second = r.stdout.splitlines()
  pid_ns, files, used = first.split()
  made, error = second.split()
  assert (int(files), int(used), error) == (MAX_INODES, 2, "ENOSPC"), r.stdout
  assert int(made) == MAX_INODES - 2
  _assert_contained_afterwards(pid_ns)


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)",
    "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
    "_socket = __import__('_socket')",
])
def test_sockets_are_refused_by_the_hook(code):
  r = _run(code.replace("PORT", "80"))
  assert r.status == "error" and "sandbox refused" in r.stderr, r


def test_without_the_hook_seccomp_refuses_sockets_but_unix_socketpairs():
  r = _run("""
      import errno, socket
      a, b = socket.socketpair()
      a.sendall(b'pair works')
      print(b.recv(100).decode())
      for family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX, socket.AF_NETLINK):
        try:
          socket.socket(family)
          print('opened', family)
        except OSError as e:
          print(errno.errorcode[e.errno])
  """, audit=False)
  assert r.status == "ok", r.stderr
  assert r.stdout.split("\n")[:5] == ["pair works", "EPERM", "EPERM", "EPERM", "EPERM"]


def test_the_child_has_its_own_empty_network_namespace():
  def interfaces(text: str) -> set[str]:
    return {line.split(":")[0].strip() for line in text.strip().splitlines()[2:]}
  r = _run("print(open('/proc/self/net/dev').read())", audit=False)
  assert r.status == "ok" and interfaces(r.stdout) == {"lo"}
  # No IPv4 route at all (not even the header line), so no address can be reached.
  r = _run("print(open('/proc/self/net/route').read())", audit=False)
  assert r.status == "ok" and len(r.stdout.strip().splitlines()) <= 1


@pytest.mark.parametrize("audit", [True, False])
def test_the_parents_environment_and_command_line_are_not_visible(monkeypatch, audit):
  monkeypatch.setenv("GRPO_SANDBOX_TEST_SECRET", "hf_not_for_the_model")
  r = _run(f"""
      import json, os
      seen = {{}}
      for pid in ['{os.getpid()}', str(os.getppid())] + os.listdir('/proc'):
        for what in ('environ', 'cmdline'):
          try:
            seen[pid + what] = open(f'/proc/{{pid}}/{{what}}', 'rb').read().decode(errors='replace')
          except OSError as e:
            seen[pid + what] = f'refused: {{e}}'
      print(json.dumps({{'env': dict(os.environ), 'seen': seen}}))
  """, audit=audit)
  assert r.status == "ok", r.stderr
  assert "hf_not_for_the_model" not in r.stdout and "pytest" not in r.stdout
  seen = json.loads(r.stdout)
  assert set(seen["env"]) == {"PATH", "HOME", "TMPDIR", "LANG", "PWD"}  # PWD: bwrap's --chdir
  assert seen["seen"][f"{os.getpid()}environ"].startswith("refused")


@pytest.mark.parametrize("code", [
    "import os\nos.system('echo hi')",
    "import os\nos.popen('echo hi').read()",
    "import os\nos.execv('/bin/echo', ['echo', 'hi'])",
    "import os\nos.posix_spawn('/bin/echo', ['echo', 'hi'], {})",
    "import os\nos.kill(1, 0)",
    "import subprocess\nsubprocess.run(['echo', 'hi'])",
    "import ctypes\nctypes.CDLL(None).system(b'echo hi')",
    "import importlib\nimportlib.import_module('_posixsubprocess')",
    "import importlib\nimportlib.import_module('_cffi_backend')",
])
def test_processes_shells_signals_and_ctypes_are_refused_by_the_hook(code):
  r = _run(code)
  assert r.status == "error" and ("sandbox refused" in r.stderr or "halted" in r.stderr), r
  assert "hi" not in r.stdout


@pytest.mark.parametrize("code", [
    "import sys\nsys.stdout.write('x' * 100_000_000)",
    "while True:\n  print('y' * 1000)",
    "import sys\nwhile True:\n  sys.stderr.write('z' * 1000)",
])
def test_a_flood_of_output_is_stopped_at_the_bound(code):
  r = _run(code, max_output_bytes=1 << 16, timeout_s=10)
  assert (r.status, r.signal) == ("output_limit", signal.SIGKILL)
  assert len(r.stdout) <= 1 << 16 and len(r.stderr) <= 1 << 16
  assert max(len(r.stdout), len(r.stderr)) > 1 << 15
  assert r.seconds < 3


def test_a_sandbox_that_cannot_be_set_up_raises(monkeypatch):
  # The child's set-up failing (here the kernel refusing a filter with no return instruction)
  # is the sandbox's error, raised before the code runs, not a result of the code.
  monkeypatch.setattr(sandbox, "seccomp_program", lambda: bytes(8))
  with pytest.raises(sandbox.SandboxError,
                     match=r"set-up failed: sandbox: .*prctl\(PR_SET_SECCOMP\): Invalid argument"):
    sandbox.run_python("print('the code ran')")
  # tmpfs reads a size or an inode count of 0 (or 2**64, which wraps to 0) as no limit.
  for limits in (dict(disk_bytes=0), dict(max_inodes=0), dict(max_inodes=1 << 64),
                 dict(disk_bytes=1 << 64), dict(max_inodes=1e4)):
    with pytest.raises(ValueError, match=f"{next(iter(limits))}=.*: use an int from"):
      sandbox.run_python("print(1)", **limits)


# --- a missing layer refuses to start; 'unsafe' warns -------------------------------------------

def test_a_missing_layer_is_named_in_one_line(monkeypatch, tmp_path):
  monkeypatch.setattr(sandbox, "_checked", {})
  monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
  with pytest.raises(UserError,
                     match=r"^python tool: no bubblewrap: .*agent.sandbox='unsafe'") as e:
    sandbox.check("strict")
  assert "\n" not in str(e.value)
  # A bwrap that the kernel refuses, as on a machine without unprivileged user namespaces.
  fake = tmp_path / "bwrap"
  fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely "
                  "because the kernel does not allow non-privileged user namespaces.' >&2\n"
                  "exit 1\n")
  fake.chmod(0o755)
  with pytest.raises(UserError, match=r"^python tool: no user or PID namespaces: bwrap: No "):
    sandbox.check("strict")
  with pytest.raises(UserError, match="agent.sandbox='lax'"):
    sandbox.check("lax")


def test_without_libseccomp_the_tool_refuses_to_start(monkeypatch):
  monkeypatch.setattr(sandbox, "_checked", {})
  sandbox.seccomp_program.cache_clear()
  real = sandbox.ctypes.CDLL

  def no_libseccomp(name, *args, **kwargs):
    if "seccomp" in str(name):
      raise OSError(f"{name}: cannot open shared object file")
    return real(name, *args, **kwargs)
  monkeypatch.setattr(sandbox.ctypes, "CDLL", no_libseccomp)
  try:
    with pytest.raises(UserError, match=r"^python tool: no seccomp: libseccomp.so.2"):
      sandbox.check("strict")
  finally:
    sandbox.seccomp_program.cache_clear()


def test_unsafe_runs_without_the_kernel_layers_and_warns(capsys):
  sandbox.check("unsafe")
  assert "grpo_jax: warning: agent.sandbox='unsafe'" in capsys.readouterr().err
  r = sandbox.run_python("import os\nprint(os.getpid() > 2, os.getcwd() != '/work')", mode="unsafe")
  assert (r.status, r.stdout) == ("ok", "True True\n")
  assert "sandbox refused: os.fork" in sandbox.run_python("import os\nos.fork()",
                                                          mode="unsafe").stderr


# --- the attacks, as the caller and as nobody ---------------------------------------------------

SECRET = "hf_" + uuid.uuid4().hex


def _attack_report(lines: list[str]) -> dict:
  results = {}
  for line in lines:
    if line.startswith("{"):
      result = json.loads(line)
      results[result["attack"]] = result
  return results


def _assert_no_escape(results: dict) -> None:
  assert set(results) == set(sandbox_attacks.ATTACKS), "some attacks did not report"
  for name, result in results.items():
    assert result["escaped"] == [], (name, result)
    assert result["layers"], f"{name}: nothing stopped it? {result}"
  # The layers meant to stop each class, with and without the hook and the filter above them.
  for name in ("daemon: fork, setsid, fork", "daemon: subprocess (_posixsubprocess)",
               "daemon: libc through cffi"):
    assert results[name]["layers"] == ["PID namespace (killed with the call)"], results[name]
  assert "PID namespace" in results["kill the caller with kill"]["layers"]
  assert "PID namespace" in results["kill the caller with a pidfd (no seccomp)"]["layers"]
  assert "PID namespace" in results["read the caller's command line and environment"]["layers"]
  assert results["read the caller's files"]["layers"] == ["mount namespace (absent)"]
  assert results["a second process: fork, vfork, posix_spawn, clone"]["layers"] == ["seccomp"]
  assert results["switch off the audit hook with a subinterpreter"]["layers"] == ["audit hook"]
  assert results["unsafe mode: leave an unremovable directory"]["layers"] == [
      "clean-up (unsafe mode)"]
  assert {"mount namespace (absent)", "network namespace"} <= set(
      results["connect to the caller's unix sockets (no seccomp)"]["layers"])
  assert "network namespace" in results["network (no seccomp)"]["layers"]
  remount = set(results["remount / and /dev/shm read-write (no seccomp)"]["layers"])
  assert {"no capability", "read-only mounts"} <= remount
  assert "locked mounts" in remount or "--disable-userns" in remount, remount
  assert "tmpfs size" in results["fill the disk past the cap"]["layers"]
  assert results["fill the inodes past the cap"]["layers"] == ["tmpfs inodes"]
  assert "audit hook" in results["switch off the audit hook from inside"]["layers"]


def _driver_env() -> dict:
  return {"PATH": "/usr/bin:/bin", "GRPO_TRAINER_TOKEN": SECRET, "LANG": "C.UTF-8"}


def test_the_attacks_fail_as_the_caller():
  p = subprocess.run([sys.executable, str(REPO / "tests" / "sandbox_attacks.py"), SECRET],
                     env={**_driver_env(), "PYTHONPATH": str(REPO)}, capture_output=True,
                     text=True, timeout=120, check=False)
  assert p.returncode == 0, p.stderr[-3000:]  # the trainer is alive and finished
  _assert_no_escape(_attack_report(p.stdout.splitlines()))


def _blocking_ancestor(path: str) -> str | None:
  """The highest directory above `path` that nobody cannot enter (a 0700 /root), if any."""
  parts = Path(path).parts
  for i in range(2, len(parts)):
    d = os.path.join(*parts[:i])
    if not os.stat(d).st_mode & stat.S_IXOTH:
      return d
  return None


def test_the_attacks_fail_as_nobody():
  """The same attacks with the trainer run as nobody (65534): the ordinary-user case."""
  if not ROOT:
    pytest.skip("the caller is already an ordinary user: "
                "test_the_attacks_fail_as_the_caller is that run")
  missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
  if missing:
    pytest.skip(f"cannot drop to nobody: {', '.join(missing)} not installed (util-linux)")
  # A copy of the package that nobody can read (the checkout may sit in a 0700 directory).
  copy = tempfile.mkdtemp(prefix="grpo_sandbox_nobody_")
  try:
    for rel in ("grpo_jax/__init__.py", "grpo_jax/errors.py", "grpo_jax/agent/__init__.py",
                "grpo_jax/agent/sandbox.py", "grpo_jax/agent/sandbox_child.py",
                "tests/sandbox_attacks.py"):
      os.makedirs(os.path.join(copy, os.path.dirname(rel)), exist_ok=True)
      shutil.copy(REPO / rel, os.path.join(copy, rel))
    for d, _, files in os.walk(copy):
      os.chmod(d, 0o755)
      for f in files:
        os.chmod(os.path.join(d, f), 0o644)
    # Python may sit under a 0700 /root: in a private mount namespace, a tmpfs over that
    # directory holds just the Python installation, so nobody can run it; nothing else of the
    # machine's changes.
    prefix = os.path.realpath(sys.base_prefix)
    script = ""
    blocking = _blocking_ancestor(prefix)
    if blocking is not None:
      stage = os.path.join(copy, "stage")
      os.mkdir(stage)
      script = (f"mount --bind {prefix} {stage} && mount -t tmpfs -o mode=0755 none {blocking} "
                f"&& mkdir -p {prefix} && mount --move {stage} {prefix} && ")
    script += ('exec setpriv --reuid 65534 --regid 65534 --clear-groups --inh-caps=-all '
               '--no-new-privs -- "$@"')
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            sys.executable, os.path.join(copy, "tests", "sandbox_attacks.py"), SECRET]
    p = subprocess.run(argv, env=_driver_env(), capture_output=True, text=True, timeout=120,
                       check=False, cwd="/")
    if p.returncode != 0 and "unshare failed" in p.stderr:
      pytest.skip(f"cannot drop to nobody here: {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    results = _attack_report(p.stdout.splitlines())
    _assert_no_escape(results)
  finally:
    shutil.rmtree(copy, ignore_errors=True)
