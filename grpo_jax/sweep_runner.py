"""Runs a planned sweep: each run `python -m grpo_jax.main` in its own process (a crash or an
out-of-memory kill takes down that run only), up to `parallel` at once.

    <workdir>/sweep.json              every run's status, exit code, wall time and log path
    <workdir>/<run>/                  the run's own workdir (metrics.jsonl, summary.json, ...)
    <workdir>/<run>/log.txt           its stdout and stderr, appended to by each attempt
    <workdir>/<run>/sweep_run.json    its overrides, status and attempts
    <workdir>/<run>/sweep_overrides.json  the --overrides file main reads: fixed + own overrides
    <workdir>/prefixes/<name>/        a shared warm start (sweep.py), the same files
    <workdir>/vmapped/<group>/        --vmap: a group's spec.json and log.txt (its members'
                                      log.txt point there)

A run is finished when its last attempt exited 0 and its summary.json has the gain (a run
stopped by SIGTERM writes one with stopped_early). Running the sweep again skips finished runs
and starts the others again: main resumes each from its latest checkpoint. A run that fails is
recorded and the sweep goes on; the exit status is 1 when any run failed. A --vmap group's
member that fails alone (FAILURE_FILE in its workdir, with the reason) is failed while the
group's other members go on (docs/faults.md).

Ctrl-C (SIGINT) or SIGTERM stops the sweep: each run gets SIGTERM, which main answers by saving
a checkpoint of the phase it is in and exiting with status 143 (grpo_jax.interrupts); a second
Ctrl-C kills them. Runs are started in their own process group, so the terminal's Ctrl-C
reaches the sweep alone and each run gets one SIGTERM (two would make it exit without
finishing its save). A run that exits 130 or 143 while the sweep goes on (a SIGTERM that
reached it alone, a preemption) is recorded as interrupted, not failed: it saved its progress,
and the sweep's status is 130, "run the same command to finish".
If the sweep itself dies (SIGKILL, a crash), the kernel sends each run SIGKILL
(grpo_jax.die_with_parent): nothing is left running; rerunning the sweep resumes the runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from tqdm.auto import tqdm

from grpo_jax import workdir_files
from grpo_jax.errors import UserError

PREFIX_DIR = "prefixes"
SWEEP_FILE = "sweep.json"
RUN_FILE = "sweep_run.json"
OVERRIDES_FILE = "sweep_overrides.json"  # main's --overrides: the run's args as JSON
LOG_FILE = "log.txt"
GROUP_DIR = "vmapped"          # <workdir>/vmapped/<group>/{spec.json,log.txt}: a vmapped group
SUMMARY_FILE = "summary.json"  # logging_io.SUMMARY_FILE; not imported: it would load numpy
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"    # checkpoint.SUBDIR; not imported: it would load jax and orbax
FAILURE_FILE = workdir_files.FAILURE_FILE  # a vmapped member that failed, and why
BASE_DIR = workdir_files.BASE_DIR  # a LoRA run's warm-started base
STOP_GRACE_S = 300             # how long stopped runs get to save their checkpoint
STOPPED_CODES = (130, 143)     # main stopped by SIGINT / SIGTERM, its checkpoint saved
POLL_S = 0.5


class SweepError(UserError):
  """A sweep file, its overrides or its working directory cannot be used as given."""


def plain_value(value):
  """A numpy scalar (np.logspace's np.float64) as the Python number it holds, in sequences
  too; other values as they are."""
  if isinstance(value, (list, tuple)):
    return type(value)(plain_value(v) for v in value)
  if type(value).__module__ == "numpy" and hasattr(value, "item"):
    return value.item()
  return value


def cli_value(value) -> str:
  """The text of --config.k=<value> that ml_collections parses back to value; None and other
  values flag text cannot carry need main's --overrides file (the runner writes one)."""
  value = plain_value(value)
  if isinstance(value, (list, tuple)):
    return repr(tuple(value))
  return value if isinstance(value, str) else repr(value)


def read_json(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _write_json(path, obj):
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(path + ".tmp", path)  # a reader never sees half a file


def summary_complete(run_dir: str) -> bool:
  """summary.json of a run that reached train.steps (write_summary: the gain is only written
  then; a SIGTERM'd run writes stopped_early instead)."""
  s = read_json(os.path.join(run_dir, SUMMARY_FILE))
  return isinstance(s, dict) and "eval_accuracy_gain_points" in s and not s.get("stopped_early")


def failure(run_dir: str) -> str | None:
  """Why a vmapped group's member failed while the group went on (FAILURE_FILE), if so."""
  f = read_json(os.path.join(run_dir, FAILURE_FILE))
  if not isinstance(f, dict):
    return None
  return f"{f.get('error')} at step {f.get('step')}: {f.get('message')}"


def _clear_failure(run_dir: str) -> None:
  """Removes an earlier attempt's failure record before a new attempt starts: one that ends
  before train removes it (a crash in setup, a kill while compiling, a Ctrl-C) is reported
  with its own exit, not with the earlier attempt's failure."""
  try:
    os.remove(os.path.join(run_dir, FAILURE_FILE))
  except FileNotFoundError:
    pass


def latest_checkpoint(run_dir: str) -> int | None:
  """The latest finished checkpoint step, or None: its dir is named by the step and holds
  SHA256SUMS, written last (checkpoint.py); restore checks the checksums."""
  d = os.path.join(run_dir, CHECKPOINTS)
  if not os.path.isdir(d):
    return None
  steps = [int(n) for n in os.listdir(d)
           if n.isdigit() and os.path.exists(os.path.join(d, n, "SHA256SUMS"))]
  return max(steps, default=None)


def has_checkpoint(run_dir: str) -> bool:
  return latest_checkpoint(run_dir) is not None


def _link_or_copy(src, dst):
  try:
    os.link(src, dst)  # no second copy of the weights; checkpoints are never written in place
  except OSError:
    shutil.copy2(src, dst)


def start_from_prefix(prefix_dir: str, run_dir: str) -> bool:
  """Gives run_dir the prefix's step-0 checkpoint and step-0 metrics (and a LoRA prefix's
  warm-started base), unless it has a checkpoint of its own (a resumed run). The checkpoint
  lands by one rename, after the rest: an interrupted copy leaves no checkpoint, and the run
  would compute its own warm start."""
  if has_checkpoint(run_dir):
    return False
  src = os.path.join(prefix_dir, CHECKPOINTS, "0")
  if not os.path.exists(os.path.join(src, "SHA256SUMS")):
    raise FileNotFoundError(f"the prefix {prefix_dir} has no finished step-0 checkpoint")
  os.makedirs(os.path.join(run_dir, CHECKPOINTS), exist_ok=True)
  # Step 0's eval (summary.json's start); main keeps lines up to the step it resumes from.
  with open(os.path.join(prefix_dir, METRICS_FILE)) as f:
    first = [line for line in f if line.strip() and json.loads(line).get("step", 1) <= 0]
  with open(os.path.join(run_dir, METRICS_FILE), "w") as f:
    f.writelines(first)
  base = os.path.join(prefix_dir, BASE_DIR)
  if os.path.isdir(base):
    shutil.rmtree(os.path.join(run_dir, BASE_DIR), ignore_errors=True)
    shutil.copytree(base, os.path.join(run_dir, BASE_DIR), copy_function=_link_or_copy)
  tmp = os.path.join(run_dir, ".prefix-tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(src, tmp, copy_function=_link_or_copy)
  os.rename(tmp, os.path.join(run_dir, CHECKPOINTS, "0"))
  return True


def _exit_text(code: int) -> str:
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  if code in STOPPED_CODES:
    return f"exit code {code}: stopped by {signal.Signals(code - 128).name}, its checkpoint saved"
  return f"exit code {code}"


def _last_line(path: str) -> str:
  """The log's last non-empty line, progress-bar carriage returns resolved."""
  try:
    with open(path, "rb") as f:
      f.seek(max(0, os.path.getsize(path) - 4096))
      tail = f.read().decode(errors="replace")
  except OSError:
    return ""
  lines = [line.split("\r")[-1].strip() for line in tail.splitlines()]
  lines = [line for line in lines if line]
  return lines[-1][:200] if lines else ""


@dataclasses.dataclass
class Group:
  """--vmap: runs that share one process and one vmapped program (grpo_jax.train.run_group)."""
  members: list

  @property
  def dir(self) -> str:
    names = ",".join(r.name for r in self.members)
    return os.path.join(GROUP_DIR, hashlib.sha256(names.encode()).hexdigest()[:12])


class Runner:
  """Launches, watches and records the runs of a plan (sweep.plan)."""

  def __init__(self, sweep, runs, workdir, *, parallel=1, main_module="grpo_jax.main",
               sweep_file=None, python=sys.executable, vmap_groups=None):
    self.sweep, self.runs, self.parallel = sweep, list(runs), parallel
    self.vmap_groups = vmap_groups  # lists of runs that may share a vmapped program
    self.workdir = os.path.abspath(workdir)
    self.main_module, self.sweep_file, self.python = main_module, sweep_file, python
    self.by_name = {r.name: r for r in self.runs if r.kind == "prefix"}
    self.status, self.records, self.procs = {}, {}, {}
    self._stopping, self._killed = False, False
    for r in self.runs:
      d = self.run_dir(r)
      rec = read_json(os.path.join(d, RUN_FILE))
      if rec is not None:
        self._check_same(r, rec)
      self.records[r.dir] = rec or {"name": r.name, "kind": r.kind, "config": sweep.config,
                                    "overrides": r.overrides, "args": r.args,
                                    "prefix": r.prefix, "attempts": []}
      done = (self.records[r.dir].get("returncode") == 0 and summary_complete(d)
              and (r.kind == "run" or has_checkpoint(d)))
      self.status[r.dir] = "done" if done else "pending"

  def run_dir(self, r) -> str:
    return os.path.join(self.workdir, r.dir)

  def _check_same(self, r, rec):
    """A rerun must be the same sweep: a run dir made with other settings is not 'finished'."""
    same = (rec.get("config") == self.sweep.config
            and rec.get("args") == json.loads(json.dumps(r.args)))
    if not same:
      raise SweepError(
          f"{self.run_dir(r)} was run with --config={rec.get('config')} and overrides "
          f"{rec.get('args')}, this sweep gives it --config={self.sweep.config} and {r.args}: "
          "use another --workdir, or delete that run's directory to redo it")

  def command(self, r) -> list[str]:
    """A group: grpo_jax.train --spec; a run or prefix: main with its args in an --overrides
    file (JSON, so None stays None: flag text would make it 'None'), written by _start."""
    if isinstance(r, Group):
      return [self.python, "-m", "grpo_jax.train",
              f"--spec={os.path.join(self.workdir, r.dir, 'spec.json')}"]
    return [self.python, "-m", self.main_module, f"--config={self.sweep.config}",
            f"--workdir={self.run_dir(r)}",
            f"--overrides={os.path.join(self.run_dir(r), OVERRIDES_FILE)}"]

  # --- records ----------------------------------------------------------------------------------

  def _save(self, r=None):
    for x in [r] if r is not None else self.runs:
      rec = dict(self.records[x.dir], status=self.status[x.dir],
                 log=os.path.join(self.run_dir(x), LOG_FILE))
      rec["wall_s"] = round(sum(a.get("wall_s", 0) for a in rec["attempts"]), 1)
      self.records[x.dir] = rec
      if os.path.isdir(self.run_dir(x)):
        _write_json(os.path.join(self.run_dir(x), RUN_FILE), rec)
    _write_json(os.path.join(self.workdir, SWEEP_FILE), {
        "sweep_file": self.sweep_file, "config": self.sweep.config, "fixed": self.sweep.fixed,
        "runs": [{"dir": x.dir, **{k: self.records[x.dir].get(k) for k in (
            "name", "kind", "prefix", "overrides", "status", "returncode", "reason", "wall_s",
            "log")}} for x in self.runs]})

  # --- running ----------------------------------------------------------------------------------

  def print_plan(self):
    for r in self.runs:
      start = f" (starts from prefixes/{r.prefix})" if r.prefix else ""
      print(f"[{self.status[r.dir]}] {r.dir}{start}\n  {shlex.join(self.command(r))}\n"
            f"  overrides: {json.dumps(r.args)}")
    for x in self._units([r for r in self.runs if self.status[r.dir] != "done"]):
      if isinstance(x, Group):
        print(f"vmapped: {x.dir}: {', '.join(r.name for r in x.members)}\n  "
              f"{shlex.join(self.command(x))}")

  def _units(self, todo):
    """What to launch: runs, and with --vmap each group of 2+ unfinished runs that resume from
    the same step as one Group. Finished members are left out (a rerun of a finished group
    skips it); the others are split by their latest checkpoint's step (none: 0), because a
    group resumes all its members from one step, which a member's later checkpoints may have
    pruned from another's (one that failed alone and one that went on)."""
    if not self.vmap_groups:
      return list(todo)
    pending = {r.dir for r in todo}
    units = [r for r in todo if r.kind == "prefix"]
    for members in self.vmap_groups:
      by_step = {}
      for r in members:
        if r.dir in pending:
          by_step.setdefault(latest_checkpoint(self.run_dir(r)) or 0, []).append(r)
      for same in by_step.values():
        units += [Group(same)] if len(same) > 1 else same
    return units

  def _members(self, x):
    return x.members if isinstance(x, Group) else [x]

  def _ready(self, r) -> bool | None:
    """True: can start; False: waits for its prefix; None: its prefix failed."""
    if isinstance(r, Group):
      states = [self._ready(m) for m in r.members]
      return None if None in states else all(states)
    if r.prefix is None:
      return True
    s = self.status[os.path.join(PREFIX_DIR, r.prefix)]
    return True if s == "done" else None if s == "failed" else False

  def _popen(self, argv, log, env) -> subprocess.Popen:
    """Starts a run in its own process group (a terminal's Ctrl-C reaches the sweep alone),
    through grpo_jax.die_with_parent: the run gets SIGKILL if the sweep dies, even by SIGKILL,
    so no orphan writes into a directory that a rerun starts again."""
    wrapped = [self.python, "-m", "grpo_jax.die_with_parent", str(os.getpid()), *argv]
    return subprocess.Popen(wrapped, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

  def _start_group(self, group):
    d = os.path.join(self.workdir, group.dir)
    os.makedirs(d, exist_ok=True)
    for r in group.members:
      os.makedirs(self.run_dir(r), exist_ok=True)
      _clear_failure(self.run_dir(r))
      if r.prefix is not None:
        start_from_prefix(self.run_dir(self.by_name[r.prefix]), self.run_dir(r))
    _write_json(os.path.join(d, "spec.json"), {
        "config": self.sweep.config,
        "members": [{"workdir": self.run_dir(r), "args": r.args} for r in group.members]})
    argv = self.command(group)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if self.parallel > 1:
      env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    stamp = f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n"
    for r in group.members:
      with open(os.path.join(self.run_dir(r), LOG_FILE), "a") as f:
        f.write(stamp + f"vmapped with {len(group.members) - 1} other run(s); log: "
                f"{os.path.join(d, LOG_FILE)}\n")
    log = open(os.path.join(d, LOG_FILE), "a")
    log.write(stamp)
    log.flush()
    proc = self._popen(argv, log, env)
    log.close()
    self.procs[group.dir] = (group, proc, time.monotonic())
    for r in group.members:
      self.status[r.dir] = "running"
      self.records[r.dir]["attempts"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                              "vmapped": group.dir})
      self._save(r)

  def _start(self, r):
    if isinstance(r, Group):
      return self._start_group(r)
    d = self.run_dir(r)
    os.makedirs(d, exist_ok=True)
    _clear_failure(d)
    if r.prefix is not None:
      start_from_prefix(self.run_dir(self.by_name[r.prefix]), d)
    _write_json(os.path.join(d, OVERRIDES_FILE), r.args)
    argv = self.command(r)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if self.parallel > 1:  # JAX would take 75% of an accelerator's memory for each run
      env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    log = open(os.path.join(d, LOG_FILE), "a")
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(argv)}\n")
    log.flush()
    proc = self._popen(argv, log, env)
    log.close()  # the child holds its own copy
    self.procs[r.dir] = (r, proc, time.monotonic())
    self.status[r.dir] = "running"
    self.records[r.dir]["attempts"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S")})
    self._save(r)

  def _finish(self, r, code, started, k=1):
    """Records how run r's attempt ended; k: the members of its vmapped group, which share
    the process's wall time (each is charged 1/k of it)."""
    d = self.run_dir(r)
    attempt = self.records[r.dir]["attempts"][-1]
    wall = time.monotonic() - started
    attempt.update(returncode=code, wall_s=round(wall / k, 1))
    if k > 1:
      attempt["group_wall_s"] = round(wall, 1)
    complete = summary_complete(d) and (r.kind == "run" or has_checkpoint(d))
    if code == 0 and complete:
      status, reason = "done", None
    elif failure(d) is not None:  # a vmapped member that failed; its group may have gone on
      status, reason = "failed", failure(d)
    elif self._stopping or code in STOPPED_CODES:
      status, reason = "interrupted", _exit_text(code)
    elif code == 0:  # an older main exited 0 after a SIGTERM it did not get from us
      status, reason = "failed", "exit code 0 without a finished summary.json (stopped early?)"
    else:
      status, reason = "failed", _exit_text(code)
    self.status[r.dir] = status
    self.records[r.dir].update(returncode=code, reason=reason)
    self._save(r)
    return status, reason

  def _signal(self, signum, _frame):
    if self._stopping:
      self._killed = True
      self._kill_all(signal.SIGKILL)
    else:
      self._stopping, self._stop_at = True, time.monotonic() + STOP_GRACE_S
      tqdm.write(f"grpo_jax.sweep: {signal.Signals(signum).name}: stopping {len(self.procs)} "
                 "run(s) (SIGTERM, they save a checkpoint); again to kill them", file=sys.stderr)
      self._kill_all(signal.SIGTERM)

  def _kill_all(self, sig):
    for _, proc, _ in self.procs.values():
      try:
        os.killpg(proc.pid, sig)
      except ProcessLookupError:
        pass

  def run(self) -> int:
    """Runs every unfinished run; 0 when all finished, 1 when some failed, 130 when stopped
    (the sweep, or runs that a signal stopped and none failed)."""
    os.makedirs(self.workdir, exist_ok=True)
    self._save()
    runs = [r for r in self.runs if r.kind == "run"]
    todo = [r for r in self.runs if self.status[r.dir] != "done"]
    skipped = len(runs) - sum(r.kind == "run" for r in todo)
    todo = self._units(todo)
    if skipped:
      print(f"grpo_jax.sweep: {skipped} of {len(runs)} runs already finished", flush=True)
    previous = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
    bar = tqdm(total=len(runs), initial=skipped, desc="sweep", unit="run", dynamic_ncols=True)
    try:
      while (todo and not self._stopping) or self.procs:
        for r in list(todo):
          if self._stopping or len(self.procs) >= self.parallel:
            break
          ready = self._ready(r)
          if ready is None:
            todo.remove(r)
            for m in self._members(r):
              if self._ready(m) is None:
                self.status[m.dir] = "failed"
                self.records[m.dir].update(reason=f"its prefix prefixes/{m.prefix} failed")
                os.makedirs(self.run_dir(m), exist_ok=True)
                self._save(m)
                bar.update(1)
              else:  # a group member whose own prefix is fine runs alone
                todo.append(m)
          elif ready:
            todo.remove(r)
            try:
              self._start(r)
            except OSError as e:  # the prefix's files went missing, a full disk: this run only
              for m in self._members(r):
                self.status[m.dir] = "failed"
                self.records[m.dir].update(reason=f"could not start: {e}")
                self._save(m)
                bar.update(1)
        for key, (r, proc, started) in list(self.procs.items()):
          code = proc.poll()
          if code is None:
            continue
          del self.procs[key]
          log = os.path.join(self.workdir, key, LOG_FILE)
          for m in self._members(r):
            status, reason = self._finish(m, code, started, len(self._members(r)))
            minutes = (time.monotonic() - started) / 60
            if status == "failed":
              tqdm.write(f"grpo_jax.sweep: FAILED {m.dir} ({reason}, {minutes:.1f} min): "
                         f"{_last_line(log)!r}; log {log}", file=sys.stderr)
            else:
              tqdm.write(f"grpo_jax.sweep: {status} {m.dir} ({minutes:.1f} min)")
            if m.kind == "run" and status != "interrupted":
              bar.update(1)
        counts = {s: list(self.status[r.dir] for r in runs).count(s)
                  for s in ("running", "failed")}
        bar.set_postfix(counts, refresh=False)
        if self._stopping and self.procs and time.monotonic() > self._stop_at:
          self._kill_all(signal.SIGKILL)
        time.sleep(POLL_S if self.procs or todo else 0)
    finally:
      bar.close()
      for s, handler in previous.items():
        signal.signal(s, handler)
    failed = [r for r in self.runs if self.status[r.dir] == "failed"]
    for r in failed:
      print(f"grpo_jax.sweep: failed: {r.dir}: {self.records[r.dir].get('reason')}; log "
            f"{os.path.join(self.run_dir(r), LOG_FILE)}", file=sys.stderr)
    interrupted = [r for r in self.runs if self.status[r.dir] == "interrupted"]
    if self._stopping or interrupted and not failed:
      print("grpo_jax.sweep: stopped; run the same command to finish the sweep", flush=True)
      return 130
    done = sum(self.status[r.dir] == "done" for r in runs)
    print(f"grpo_jax.sweep: {done} of {len(runs)} runs finished, {len(failed)} failed; "
          f"{os.path.join(self.workdir, SWEEP_FILE)}", flush=True)
    return 1 if failed else 0
