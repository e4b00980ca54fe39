"""The warm start's and GRPO's progress: a tqdm bar on a terminal (or a notebook), plain lines
elsewhere (a log file, CI, nohup), where a bar's `\\r` frames would fill the log.

    bar = Bar(range(start, steps), initial=start, total=steps, desc="grpo", every_s=30)
    for step in bar:
      ...
      bar.set_postfix({"reward": "0.412", "acc": "0.31"})

Off a terminal it prints, to stderr as tqdm would, a line after the first step (its time holds
the compiles), then one at most every `every_s` seconds (0: every step), and a last one on close:

    grpo_jax: grpo 1/50 steps, 41s elapsed, reward=0.125 acc=0.06
    grpo_jax: grpo 12/50 steps, 1m15s elapsed, 3.1s/step, reward=0.412 acc=0.31
    grpo_jax: grpo 50/50 steps, done in 3m12s, 3.0s/step, reward=0.530 acc=0.44 eval=0.250

A loop that ends before its total says so: close(stopped="target reached") ends the warm start's
bar at its real count, `330/330 steps (stopped at 330 of at most 1000: target reached)`.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping

from tqdm.auto import tqdm


def interactive(stream) -> bool:
  """Whether `stream` shows a redrawn bar: a terminal, or a Jupyter kernel's output (tqdm.auto
  draws a widget there)."""
  if type(stream).__module__.startswith("ipykernel"):
    return True
  isatty = getattr(stream, "isatty", None)
  return bool(isatty and isatty())


def quiet_library_bars(stream=None) -> None:
  """Off a terminal, turns off the bars of datasets (building a split) and huggingface_hub
  (downloads), whose `\r` frames would land in the log too."""
  if interactive(sys.stderr if stream is None else stream):
    return
  # Read when the libraries are imported; the calls cover ones imported already.
  os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
  os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
  if "datasets" in sys.modules:
    sys.modules["datasets"].disable_progress_bars()
  if "huggingface_hub" in sys.modules:  # (its package loads `utils` lazily: imported by name)
    importlib.import_module("huggingface_hub.utils").disable_progress_bars()


def _duration(seconds: float) -> str:
  """41s, 1m15s, 2h03m."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Bar:
  """A loop's progress out of `total` steps, counted from `initial` (a resumed run's step).

  Iterating it yields `iterable`'s items and counts each once the next is asked for, or once
  its postfix is set (so a loop that breaks after finishing a step counts that step). The sft
  loop calls update() itself."""

  def __init__(self, iterable: Iterable | None = None, *, total: int, desc: str, initial: int = 0,
               every_s: float = 30.0, disable: bool = False, stream=None,
               clock: Callable[[], float] = time.monotonic, tty: bool | None = None):
    self.total, self.desc, self.n, self.initial = int(total), desc, int(initial), int(initial)
    self._iterable, self._every_s, self._disable, self._clock = iterable, every_s, disable, clock
    self._stream = sys.stderr if stream is None else stream
    self._postfix: dict = {}
    self._pending = False  # the current item's postfix is set: it is done
    self._closed = disable
    self._start = self._last = clock()
    self._printed_n = None  # the count the last plain line showed
    self._tqdm = None
    if not disable and (interactive(self._stream) if tty is None else tty):
      self._tqdm = tqdm(total=self.total, initial=self.n, desc=desc, dynamic_ncols=True,
                        mininterval=2.0, file=self._stream)

  def __iter__(self):
    try:
      for item in self._iterable:
        self._pending = False
        yield item
        self.update(1)
    finally:  # the loop ended or broke out
      if self._pending:
        self.update(1)
      self.close()

  def update(self, n: int = 1) -> None:
    """Counts n more steps done; off a terminal, prints a line when one is due."""
    self._pending = False
    if self._closed:
      return
    self.n += n
    if self._tqdm is not None:
      self._tqdm.update(n)
      return
    now = self._clock()
    if self._printed_n is None or now - self._last >= self._every_s:
      self._print(self._line(now), now)

  def set_postfix(self, values: Mapping[str, str] | None = None, **more: str) -> None:
    """The values shown after the count (tqdm's set_postfix): {"loss": "0.412"}."""
    self._postfix = {**(values or {}), **more}
    self._pending = True
    if self._tqdm is not None:
      self._tqdm.set_postfix(self._postfix, refresh=False)

  def set_count(self, n: int) -> None:
    """Sets the count (the warm start going back to an earlier check)."""
    self.n = int(n)
    if self._tqdm is not None:
      self._tqdm.n = self.n
      self._tqdm.refresh()

  def write(self, line: str) -> None:
    """A message on stdout that does not tear the bar."""
    if self._tqdm is not None:
      self._tqdm.write(line)
    else:
      print(line, flush=True)

  def close(self, stopped: str | None = None) -> None:
    """Ends the bar, and off a terminal prints its last line. stopped: why a loop ended before
    its total (the bar then ends at its real count)."""
    if self._closed:
      return
    self._closed = True
    note = None if stopped is None else f"stopped at {self.n} of at most {self.total}: {stopped}"
    if stopped is not None:
      self.total = self.n
    if self._tqdm is not None:
      if note:
        self._tqdm.total = self.n
        self._tqdm.set_postfix_str(note, refresh=False)
      self._tqdm.close()
      return
    now = self._clock()
    self._print(self._line(now, last=True, note=note), now)

  def _line(self, now: float, last: bool = False, note: str | None = None) -> str:
    elapsed = now - self._start
    parts = [f"{self.n}/{self.total} steps" + (f" ({note})" if note else "")]
    if last and self.n >= self.total:
      parts.append(f"done in {_duration(elapsed)}")
    else:
      parts.append(f"{_duration(elapsed)} elapsed")
    counted = self.n - self.initial
    if counted > 1 or counted == 1 and last:
      parts.append(f"{elapsed / counted:.1f}s/step")
    text = f"grpo_jax: {self.desc} " + ", ".join(parts)
    if self._postfix:
      text += ", " + " ".join(f"{k}={v}" for k, v in self._postfix.items())
    return text

  def _print(self, line: str, now: float) -> None:
    self._last, self._printed_n = now, self.n
    print(line, file=self._stream, flush=True)
