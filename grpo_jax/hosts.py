"""Several processes (hosts) of one run: who does what, and the few collectives the host side
needs. With one process every function here is the plain single-process operation, with no
collective, so nothing else in grpo_jax branches on the process count.

How a multi-host run divides the work (see docs/platforms.md, "Several hosts"):
- every process reads the dataset index and draws the same data order; each samples and scores
  its own contiguous share of a step's prompts (`share`), on the devices it owns;
- the numbers that leave a host (completion ids, lengths, rewards: kilobytes) are gathered, so
  every process then holds the same global batch and runs the same host code on it (dynamic
  sampling picks groups across hosts); `put` uploads only each process's own shards of it;
- only process 0 writes files (`is_main`); checkpoints are written by every process (orbax).

    rows = rows_of_step[hosts.share(len(rows_of_step))]       # this process's prompts
    x = hosts.to_global(local_rows_BP, sharding)              # local rows -> one global array
    local = hosts.to_local(x, sharding)                       # and back
    all_rows = hosts.gather(local_rewards_BR)                 # [sum of rows, R] on every process
"""
from __future__ import annotations

import itertools
import json
import os
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from grpo_jax.errors import UserError


def count() -> int:
  return jax.process_count()


def index() -> int:
  return jax.process_index()


def is_main() -> bool:
  """Process 0: the one that prints, writes logs, samples, plots, the summary and the model."""
  return jax.process_index() == 0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, auto: bool = False) -> bool:
  """jax.distributed.initialize when asked: an address (or JAX_COORDINATOR_ADDRESS) with the
  process count and id, or `auto` (cluster detection: TPU pods, SLURM, ...). Must run before
  anything touches a device. Returns whether it initialized."""
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not (address or auto):
    if num_processes is not None or process_id is not None:
      raise UserError("--num_processes/--process_id need --coordinator_address (host:port of "
                      "process 0), or --distributed on a cluster JAX detects (TPU pods)")
    return False
  if address and (num_processes is None or process_id is None):
    raise UserError(f"--coordinator_address={address}: also give --num_processes and "
                    "--process_id (this process's index, 0 on the coordinator's host)")
  if address and not 0 <= process_id < num_processes:
    raise UserError(f"--process_id={process_id} must be in [0, --num_processes={num_processes})")
  # CPU devices of different processes talk through gloo; GPU and TPU clients ignore this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(address, num_processes, process_id)
  return True


def share(n: int, even: bool = True) -> slice:
  """This process's contiguous share of n rows (process p: [p·n/P, (p+1)·n/P)). even=False
  allows a remainder: the first n % P processes take one row more, and a share may be empty."""
  count, p = jax.process_count(), jax.process_index()
  if even and n % count:
    raise ValueError(f"{n} rows do not split evenly over {count} processes")
  k, extra = divmod(n, count)
  start = p * k + min(p, extra)
  return slice(start, start + k + (p < extra))


def agree_max(*values: int) -> tuple[int, ...]:
  """The elementwise maximum of the values over all processes (shapes every process must use)."""
  return tuple(int(v) for v in gather(np.asarray([values], np.int64)).max(axis=0))


def gather(x: np.ndarray) -> np.ndarray:
  """Each process's rows (the same shape on every process) concatenated in process order."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_json(value) -> list:
  """[process 0's value, process 1's, ...] of a JSON-able value (texts, rows, metric dicts)."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  (width,) = agree_max(data.size)
  padded = np.zeros((1, width + 8), np.uint8)
  padded[0, :8] = np.frombuffer(np.int64(data.size).tobytes(), np.uint8)
  padded[0, 8:8 + data.size] = data
  out = []
  for row in gather(padded):
    size = int(np.frombuffer(row[:8].tobytes(), np.int64)[0])
    out.append(json.loads(row[8:8 + size].tobytes()))
  return out


def to_global(x, sharding):
  """This process's rows of a batch-sharded array → the global array (process order)."""
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def to_local(x, sharding) -> np.ndarray:
  """The rows of a batch-sharded global array that this process's devices hold."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.global_array_to_host_local_array(x, sharding.mesh,
                                                                     sharding.spec))


def put(tree, shardings):
  """Host arrays that every process holds whole → global arrays; each process transfers only
  its own shards. (A jitted function refuses numpy inputs with a multi-host sharding.)"""
  if jax.process_count() == 1:
    return tree
  return jax.device_put(tree, shardings)


def fetch(tree):
  """device_get that also works on arrays spread over several processes (allgathered)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_get(x)
  return jax.tree.map(one, tree)


def any_(flag: bool) -> bool:
  """True on every process when it is True on any (e.g. a SIGTERM seen by one host)."""
  return bool(gather(np.asarray([bool(flag)])).any())


class SharedEvents:
  """Makes threading.Events one flag over the processes: set on any process, they are set on
  every process within about 2 × poll_s. A run's SIGTERM interrupt is one: a reward waiting on
  its scorer on another host gives up too, so that every host reaches the collective that
  agrees to stop (grpo_jax.rollout.sample_and_score), not just the one that got the signal.

  Through the key-value store of jax.distributed's coordination service, polled by a thread
  (no collective: the main thread may be in one, or waiting on a scorer). With one process it
  does nothing. stop() ends the thread; a store that has gone away (process 0 exited) ends it
  too, without setting anything."""

  _runs = itertools.count()  # one key per use; every process uses them in the same order

  def __init__(self, events, poll_s: float = 0.1):
    self.events, self.poll_s = list(events), poll_s
    self._done = threading.Event()
    self._thread = None
    if jax.process_count() > 1:
      from jax._src import distributed  # the client jax.distributed.initialize made
      self._client = distributed.global_state.client
      self._key = f"grpo_jax/shared_events/{next(self._runs)}"
      self._thread = threading.Thread(target=self._watch, name="grpo_jax-shared-events",
                                      daemon=True)
      self._thread.start()

  def _watch(self):
    while not self._done.wait(self.poll_s):
      try:
        if any(e.is_set() for e in self.events):
          self._client.key_value_set(self._key, str(jax.process_index()), allow_overwrite=True)
          return
        self._client.key_value_try_get(self._key)  # raises NOT_FOUND until a process sets it
      except Exception as e:  # noqa: BLE001 - NOT_FOUND: not set; anything else: store gone
        if "NOT_FOUND" in str(e):
          continue
        return
      for e in self.events:  # another process set it
        e.set()
      return

  def stop(self) -> None:
    self._done.set()
    if self._thread is not None:
      self._thread.join()


def barrier(name: str) -> None:
  """Waits until every process gets here (e.g. process 0 has written what the others read)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
