"""The sandbox against the escapes a model's code could try: each is stopped within its limit,
comes back as an error / killed / timeout result, and leaves the parent and the machine as they
were. Where a layer can be shown alone, the code runs again without the audit hook
(audit=False) so the OS layers (rlimits, nobody, network and mount namespaces) are seen to hold
by themselves.
"""
import errno
import json
import os
import signal
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from grpo_jax.agent import sandbox

REPO = Path(__file__).resolve().parents[1]
SLACK_S = 0.75  # start-up, kill and reap on a loaded 2-core machine
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="privilege drop and network namespace need root")


def _run(code: str, **kwargs) -> sandbox.SandboxResult:
  return sandbox.run_python(textwrap.dedent(code), **kwargs)


def _group(pgid: int) -> list[int]:
  """Live (non-zombie) processes in process group `pgid`, from /proc."""
  members = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
      continue
    state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
    if int(pgrp) == pgid and state != "Z":
      members.append(int(pid))
  return members


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


def _assert_contained_afterwards(pgid: int | None = None, workdir: str | None = None) -> None:
  """Nothing the code started is alive, its directory is gone, and the next call works."""
  if pgid is not None:
    deadline = time.monotonic() + 1.0  # SIGKILL is sent; dying takes a moment
    while _group(pgid) and time.monotonic() < deadline:
      time.sleep(0.02)
    assert _group(pgid) == [], f"processes of the sandbox outlived it: {_group(pgid)}"
  if workdir is not None:
    assert not os.path.exists(workdir)
  assert sandbox.run_python("print('fine')").stdout == "fine\n"


def test_normal_code_runs_and_its_directory_is_removed():
  r = _run("""
      import os
      print(2 + 2)
      print(os.getcwd(), os.getuid())
  """)
  assert (r.status, r.exit_code, r.signal, r.stderr) == ("ok", 0, None, "")
  four, workdir, uid = r.stdout.split()
  assert four == "4"
  assert not os.path.exists(workdir)
  if ROOT:
    assert int(uid) == sandbox.NOBODY


def test_errors_and_bad_source_are_results_not_exceptions():
  assert _run("import sys; sys.exit(3)").exit_code == 3
  r = _run("print('before')\n1 / 0")
  assert (r.status, r.exit_code, r.stdout) == ("error", 1, "before\n")
  assert r.stderr.strip().endswith("ZeroDivisionError: division by zero")
  assert "sandbox_child" not in r.stderr  # the traceback shows only the program's frames
  for code in ("x = = 1", "print(1)\x00", "print('\ud800')"):
    r = sandbox.run_python(code)
    assert r.status == "error" and "Error" in r.stderr, (code, r)


def test_an_infinite_loop_times_out_and_the_group_is_killed():
  start = time.monotonic()
  r = _run("""
      import os
      print(os.getcwd(), os.getpgid(0), flush=True)
      while True:
        pass
  """, timeout_s=1.0)
  wall = time.monotonic() - start
  assert (r.status, r.exit_code, r.signal) == ("timeout", None, signal.SIGKILL)
  assert 1.0 <= wall < 1.0 + SLACK_S, wall
  workdir, pgid = r.stdout.split()
  _assert_contained_afterwards(int(pgid), workdir)


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


@needs_root
def test_without_the_hook_rlimit_nproc_caps_a_fork_bomb():
  # The kernel counts all of nobody's processes, so the cap is set 4 above what exists now.
  cap = _tasks_of(sandbox.NOBODY) + 4
  # A bounded bomb: children sleep, the parent counts forks until the kernel refuses one.
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
        print(children, e.errno, os.getpgid(0), flush=True)
  """, audit=False, max_processes=cap, timeout_s=5)
  children, error, pgid = map(int, r.stdout.split())
  assert r.status == "ok" and error == errno.EAGAIN
  assert 1 <= children <= 3  # the program itself is one of the 4
  _assert_contained_afterwards(pgid)  # the sleeping children died with the call
  # A real one (every process forks forever): held at the cap until the wall clock kills all.
  r = _run("""
      import os
      print(os.getpgid(0), flush=True)
      while True:
        try:
          os.fork()
        except OSError:
          pass
  """, audit=False, max_processes=_tasks_of(sandbox.NOBODY) + 4, timeout_s=1.0, cpu_s=5)
  assert r.status == "timeout" and r.seconds < 1.0 + SLACK_S
  _assert_contained_afterwards(int(r.stdout))


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
def test_writing_outside_the_directory_is_refused(write):
  for target in (Path("/tmp"), REPO):
    path = target / f"x_outside_{uuid.uuid4().hex}"
    r = _run(f"import os\nP = {str(path)!r}\n{write}")
    assert r.status == "error" and "sandbox refused" in r.stderr, r
    assert not path.exists()


@needs_root
def test_without_the_hook_the_file_system_is_read_only_but_the_directory():
  for target in (Path("/tmp"), REPO):  # /tmp is world-writable: nobody alone would not stop it
    path = target / f"x_outside_{uuid.uuid4().hex}"
    r = _run(f"open({str(path)!r}, 'w')", audit=False)
    assert r.status == "error" and "[Errno 30] Read-only file system" in r.stderr, r
    assert not path.exists()
  r = _run("""
      import os
      os.mkdir('d')
      with open('d/f', 'w') as f:
        f.write('written')
      print(open('d/f').read(), os.getuid())
  """, audit=False)
  assert r.stdout.split() == ["written", str(sandbox.NOBODY)]


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=1)",
    "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
    "_socket = __import__('_socket')",
])
def test_sockets_are_refused(code):
  r = _run(code.replace("PORT", "80"))
  assert r.status == "error" and "sandbox refused" in r.stderr, r


@needs_root
def test_the_child_has_its_own_empty_network_namespace():
  def interfaces(text: str) -> set[str]:
    return {line.split(":")[0].strip() for line in text.strip().splitlines()[2:]}
  r = _run("print(open('/proc/self/net/dev').read())", audit=False)
  assert r.status == "ok" and interfaces(r.stdout) == {"lo"}
  ours = interfaces(Path("/proc/self/net/dev").read_text())
  if ours == {"lo"}:
    pytest.skip("this machine has only a loopback, so the two cannot be told apart")
  # No IPv4 route at all (not even the header line), so no address can be reached.
  r = _run("print(open('/proc/self/net/route').read())", audit=False)
  assert r.status == "ok" and len(r.stdout.strip().splitlines()) <= 1


@pytest.mark.parametrize("audit", [True, False])
def test_the_parents_environment_is_not_visible(monkeypatch, audit):
  monkeypatch.setenv("GRPO_SANDBOX_TEST_SECRET", "hf_not_for_the_model")
  r = _run("""
      import json, os
      try:
        parent = open(f'/proc/{os.getppid()}/environ', 'rb').read().decode(errors='replace')
      except OSError as e:
        parent = f'refused: {e}'
      print(json.dumps({'env': dict(os.environ), 'parent': parent}))
  """, audit=audit)
  seen = json.loads(r.stdout)
  assert "hf_not_for_the_model" not in r.stdout
  assert set(seen["env"]) == {"PATH", "HOME", "TMPDIR", "LANG"}
  if audit or ROOT:  # the hook, or the uid: nobody cannot read root's /proc/PID/environ
    assert seen["parent"].startswith("refused"), seen["parent"][:200]


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


@pytest.mark.parametrize("code", [
    "import subprocess\nsubprocess.run(['ls'])",
    "import os\nos.system('echo hi')",
    "import os\nos.popen('echo hi').read()",
    "import os\nos.execv('/bin/echo', ['echo', 'hi'])",
    "import os\nos.posix_spawn('/bin/echo', ['echo', 'hi'], {})",
    "import os\nos.kill(1, 0)",
    "import ctypes\nctypes.CDLL(None).system(b'echo hi')",
])
def test_processes_shells_signals_and_ctypes_are_refused(code):
  r = _run(code)
  assert r.status == "error" and "sandbox refused" in r.stderr, r
  assert "hi" not in r.stdout


def test_a_sandbox_that_cannot_be_set_up_raises():
  with pytest.raises(sandbox.SandboxError, match="set-up failed"):
    sandbox.run_python("print(1)", memory_bytes=1 << 20)  # too little even for the imports
