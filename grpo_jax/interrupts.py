"""SIGINT (Ctrl-C) and SIGTERM (a preemption, a sweep stopping its runs): a run stops with a
checkpoint of the phase it is in, prints one line and exits with 128 + the signal's number.

    with interrupts.Interrupts() as stop:      # train.run_group
      stop.abortable("while starting: nothing was saved; ...")  # a signal raises Stopped at once
      ...
      stop.abortable(None)                     # from here on a signal is only recorded
      for step in steps:
        ...
        if stop.requested():                   # a safe point: the phase saves, then
          raise stop.stopped("in GRPO step 3 of 10: saved step 3 to ...")
    # grpo_jax.main: except interrupts.Stopped as e: interrupts.exit_with(e)
    #   -> "grpo_jax: interrupted (SIGINT) in GRPO step 3 of 10: saved step 3 to ...", status 130

The first signal is recorded and sets `events` (a reward waiting on its scorer gives up); the
phase that is running polls `requested()` at its safe points (the warm start before each step,
the GRPO loop after each step and after the step-0 evaluation), saves its checkpoint there and
raises Stopped. A phase that has nothing to save is `abortable`: the start-up before the warm
start (nothing computed yet) and the final export (its checkpoint is on disk): there the signal
raises Stopped at once, from the handler, as Python's KeyboardInterrupt would. A second signal,
in any phase (a save taking too long) or while the stopped process winds down (exit_with),
prints one line and exits at once (_again).

Status 130 (SIGINT) and 143 (SIGTERM) are what a shell reports for a process those signals
killed; grpo_jax.sweep_runner reads them as "stopped, resumable".
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
  """The run stopped on a signal. str(e): where it stopped and what it saved; e.code: the exit
  status (128 + signum). A BaseException, as KeyboardInterrupt: `except Exception` in the
  code between the phase and the entry point lets it through."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.signum, self.code = signum, 128 + signum


def name(signum: int) -> str:
  return signal.Signals(signum).name


def exit_with(e: Stopped):
  """The entry points' end of a stopped run: its one line on stderr, its exit status. Another
  signal while the process winds down (XLA's teardown takes seconds) exits at once."""
  for s in SIGNALS:
    signal.signal(s, _again)
  print(f"grpo_jax: {e}", file=sys.stderr, flush=True)
  sys.exit(e.code)


def _again(signum, _frame):
  """A second signal: one line, and out at once (os._exit: no cleanup, so a checkpoint being
  written is left as an unfinished temporary directory, which the next start deletes)."""
  print(f"grpo_jax: interrupted again ({name(signum)}): exiting at once, without finishing the "
        "save in progress; the same command resumes from the last finished checkpoint",
        file=sys.stderr, flush=True)
  os._exit(128 + signum)


class Interrupts:
  """The run's SIGINT and SIGTERM handlers while the block runs (the previous ones after it).
  events: threading.Events set by the first signal (more may be appended once they exist)."""

  def __init__(self, events=()):
    self.events = list(events)
    self.signum: int | None = None
    self._abort: str | None = None  # abortable: what Stopped says when a signal comes
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # (signal.signal's rule)
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    if self.signum is not None:
      _again(signum, frame)
    self.signum = signum
    for e in self.events:
      e.set()
    if self._abort is not None:
      raise self.stopped(self._abort)

  def requested(self) -> bool:
    """A signal came (this process's; hosts.any_ makes it every process's)."""
    return self.signum is not None

  def agreed(self, check: bool = True) -> bool:
    """requested() alike on every process. With several processes that takes a collective, so
    only where `check` (which must be the same on all of them); elsewhere False."""
    from grpo_jax import hosts  # (this module loads without jax: grpo_jax.main imports it)
    if hosts.count() == 1:
      return self.requested()
    return check and hosts.any_(self.requested())

  def abortable(self, where: str | None) -> None:
    """From now on a signal raises Stopped(where) at once (where=None: it is only recorded);
    one that came already raises it now."""
    self._abort = where
    if where is not None and self.signum is not None:
      raise self.stopped(where)

  def stopped(self, where: str) -> Stopped:
    """Stopped(where); on a process that got no signal itself (another process's stopped the
    run: hosts.any_, hosts.SharedEvents), with SIGTERM's status."""
    if self.signum is None:
      return Stopped(signal.SIGTERM, f"interrupted (another process's signal) {where}")
    return Stopped(self.signum, f"interrupted ({name(self.signum)}) {where}")
