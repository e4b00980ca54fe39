"""One run per workdir (grpo_jax.workdir_lock): a second run on a held workdir stops at once with
one line naming the holder and changes nothing; a lock left by a dead process is taken over with
a warning; the lock goes when its run ends, whichever way. The holder here is a small helper
process that takes the lock with the module, so no case trains anything."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from cli import REPO, assert_user_error, env
from grpo_jax import preflight, workdir_lock
from grpo_jax.errors import UserError

TINY = ["--config=configs/gsm8k.py:tiny", "--config.sft.steps=0", "--config.train.steps=1"]
HOLD = ("import sys\nfrom grpo_jax import workdir_lock\n"
        "workdir_lock.acquire(sys.argv[1])\nprint('held', flush=True)\nsys.stdin.read()\n")


def run_main(workdir, *flags):
  return subprocess.run([sys.executable, "-m", "grpo_jax.main", *TINY, f"--workdir={workdir}",
                         *flags], cwd=REPO, env=env(), capture_output=True, text=True,
                        timeout=300)


def snapshot(root) -> dict:
  return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
          for d, _, names in os.walk(root) for n in names}


def test_a_second_run_on_a_held_workdir_stops_at_once_naming_the_holder(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text('{"step": 0}\n')
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    record = json.loads((workdir / workdir_lock.LOCK_FILE).read_text())
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    before = snapshot(workdir)
    start = time.monotonic()
    proc = run_main(workdir)
    elapsed = time.monotonic() - start
    message = assert_user_error(
        proc, f"{workdir} is in use by PID {holder.pid} on host {socket.gethostname()} since "
        f"{record['started']}", "stop that run or use another --workdir")
    assert message == (f"grpo_jax: error: {workdir} is in use by PID {holder.pid} on host "
                       f"{socket.gethostname()} since {record['started']}; stop that run or use "
                       "another --workdir")
    assert snapshot(workdir) == before  # the holder's lock file included
    assert elapsed < 60, elapsed  # a JAX import; ~3 s when the machine is quiet
  finally:
    holder.stdin.close()
    holder.wait(timeout=30)
  # Its holder gone (it released at exit), the workdir is free: the next start gets past the
  # lock (here to a bad data source) and leaves the workdir as it was.
  assert not (workdir / workdir_lock.LOCK_FILE).exists()
  assert_user_error(run_main(workdir, f"--config.data.source={tmp_path}/none"), "data.source")
  assert snapshot(workdir) == {"metrics.jsonl": b'{"step": 0}\n'}


def _dead_holder(workdir) -> int:
  """Takes the lock in a process that then dies without releasing it (no atexit): its PID."""
  proc = subprocess.run(
      [sys.executable, "-c", "import os, sys\nfrom grpo_jax import workdir_lock\n"
       "workdir_lock.acquire(sys.argv[1])\nprint(os.getpid(), flush=True)\nos._exit(0)\n",
       str(workdir)], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
  return int(proc.stdout)


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path):
  workdir = tmp_path / "run"
  pid = _dead_holder(workdir)
  assert json.loads((workdir / workdir_lock.LOCK_FILE).read_text())["pid"] == pid
  proc = run_main(workdir, f"--config.data.source={tmp_path}/none")
  assert_user_error(proc, "config.data.source")  # got past the lock, to the data
  warnings = [line for line in proc.stderr.splitlines() if line.startswith("grpo_jax: warning:")]
  assert len(warnings) == 1 and f"taking over the lock left by PID {pid} on host" in warnings[0]
  assert "no longer running" in warnings[0]
  # The workdir existed (the dead run made it), so it stays; the stale lock went with the
  # release of the run that took it over.
  assert os.listdir(workdir) == []


def test_acquire_in_process_takes_over_releases_and_refuses_a_live_holder(tmp_path, capfd):
  workdir = tmp_path / "run"
  pid = _dead_holder(workdir)
  lock = workdir_lock.acquire(workdir)
  assert f"taking over the lock left by PID {pid}" in capfd.readouterr().err
  assert json.loads((workdir / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
  # Another process while this one holds it: refused, naming this process.
  proc = subprocess.run([sys.executable, "-c", HOLD, str(workdir)], cwd=REPO, env=env(),
                        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
  assert proc.returncode == 1 and f"in use by PID {os.getpid()} on host" in proc.stderr
  lock.release()
  lock.release()  # once; later calls do nothing
  assert os.listdir(workdir) == []
  with workdir_lock.acquire(workdir):  # free again, with no warning: nothing was left
    assert os.listdir(workdir) == [workdir_lock.LOCK_FILE]
  assert "warning" not in capfd.readouterr().err


def test_a_start_releases_its_locks_on_any_exit_and_undoes_only_its_own_files(tmp_path):
  """preflight.Start: an error before setup passed removes what it made and releases; after,
  the files stay (the lock goes either way). Workdirs: a new one and one with a file."""
  new, old = tmp_path / "new" / "run", tmp_path / "old"
  old.mkdir()
  (old / "keep.txt").write_text("mine")
  with pytest.raises(UserError):
    with preflight.Start([new, old]):
      for w in (new, old):
        (w / "data").mkdir()
        (w / "data" / "train.jsonl").write_text("{}\n")
      preflight.passed(new)  # one member passed, the other did not: both are undone
      raise UserError("config.model.checkpoint: missing")
  assert not (tmp_path / "new").exists() and snapshot(old) == {"keep.txt": b"mine"}
  with pytest.raises(KeyError):
    with preflight.Start([old]):
      (old / "config.json").write_text("{}")
      preflight.passed(old)
      raise KeyError("a bug after setup")
  assert snapshot(old) == {"keep.txt": b"mine", "config.json": b"{}"}
  assert workdir_lock.LOCK_FILE not in os.listdir(old)


def test_a_group_locks_each_members_workdir_and_a_held_one_stops_it_untouched(tmp_path):
  """python -m grpo_jax.train --spec (sweep --vmap): member 1's workdir is held, so the group
  stops before setup, naming the holder; member 0's workdir, which its lock made, is gone."""
  free, held = tmp_path / "a", tmp_path / "b"
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps({"config": "configs/gsm8k.py:tiny", "members": [
      {"workdir": str(free), "args": {"seed": 0}}, {"workdir": str(held), "args": {"seed": 1}}]}))
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    before = snapshot(held)
    proc = subprocess.run([sys.executable, "-m", "grpo_jax.train", f"--spec={spec}"], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (f"grpo_jax.train: error: {held} is in use by PID {holder.pid} on host"
            in proc.stderr), proc.stderr
    assert not free.exists() and snapshot(held) == before
  finally:
    holder.stdin.close()
    holder.wait(timeout=30)


def test_without_file_locks_the_lock_is_the_best_effort_file(tmp_path, monkeypatch, capfd):
  """A file system that refuses flock: the object store's rule (module docstring), here on a
  local directory: a live holder of this host refuses, a dead one is taken over, another host's
  refuses with the file to delete."""
  import errno
  import fcntl

  def no_flock(fd, op):
    raise OSError(errno.EOPNOTSUPP, "Operation not supported")
  monkeypatch.setattr(fcntl, "flock", no_flock)
  workdir = tmp_path / "run"
  workdir.mkdir()
  lock_file = workdir / workdir_lock.LOCK_FILE
  live = dict(workdir_lock.record(), pid=os.getppid())  # pytest's parent: alive
  lock_file.write_text(json.dumps(live))
  with pytest.raises(workdir_lock.WorkdirInUse,
                     match=f"in use by PID {os.getppid()} .*; if that run is gone, delete "
                           f"{lock_file}"):
    workdir_lock.acquire(workdir)
  other_host = dict(live, host="elsewhere", pid=1)
  lock_file.write_text(json.dumps(other_host))
  with pytest.raises(workdir_lock.WorkdirInUse, match="PID 1 on host elsewhere"):
    workdir_lock.acquire(workdir)
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  lock_file.write_text(json.dumps(dict(live, pid=int(dead.stdout))))
  capfd.readouterr()
  with workdir_lock.acquire(workdir):
    err = capfd.readouterr().err
    assert "no file locks here" in err and f"lock left by PID {int(dead.stdout)}" in err
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
  assert not lock_file.exists()
