"""Checkpoints with orbax: train state arrays + JSON (data position, ...), last K kept, atomic.

Layout: <workdir>/checkpoints/<step>/{state,meta}. orbax writes each step into
`<step>.orbax-checkpoint-tmp` and renames it to `<step>` only when every file is written, so a
crash mid-save leaves the previous steps untouched and the half-written one invisible (its tmp
dir is deleted the next time a Checkpointer opens the workdir).

    with Checkpointer(workdir, max_to_keep=3) as ckpt:
      ckpt.save(step, {"params": params, "opt_state": opt_state, "rng": key}, it.position())
    # later, in a fresh process
    if has_checkpoint(workdir):
      restored = restore(workdir, abstract_state)   # leaves: ShapeDtypeStruct with .sharding
      restored.step, restored.state["rng"], restored.data_position

`state` is any pytree of jax arrays (typed PRNG keys included: orbax stores their key_data and
rewraps them with the abstract leaf's key type) and numpy arrays.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

SUBDIR = "checkpoints"


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data_position: dict


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(os.path.expanduser(workdir)), SUBDIR)


def _abstract_with_shardings(abstract_state):
  """Abstract leaves for StandardRestore; every leaf must say where its array goes."""
  def leaf(path, x):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      raise ValueError(f"abstract_state{jax.tree_util.keystr(path)} has no sharding: pass "
                       "jax.ShapeDtypeStruct(shape, dtype, sharding=...) or a jax.Array")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree_util.tree_map_with_path(leaf, abstract_state)


class Checkpointer:
  """Saves/restores one run's checkpoints; use as a context manager (or call close())."""

  def __init__(self, workdir: str, max_to_keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    if max_to_keep < 1:
      raise ValueError(f"checkpoint max_to_keep must be >= 1, got {max_to_keep}")
    self.directory = checkpoint_dir(workdir)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
        enable_async_checkpointing=async_save,
        # Removes the tmp dirs of saves a crash interrupted; finished steps are never touched.
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
        create=not read_only)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state, data_position: dict) -> bool:
    """Starts saving (async by default); False when `step` is not after the latest saved step."""
    try:
      json.dumps(data_position)  # Fail here, not later in the background save thread.
    except TypeError as e:
      raise TypeError(f"checkpoint data_position must be JSON-serialisable: {e}") from e
    return self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({"step": int(step), "data_position": data_position})))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, abstract_state, step: int | None = None) -> Restored:
    """Restores `step` (default: latest) with arrays placed as abstract_state's shardings say."""
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} "
                              f"(have {self.all_steps()})")
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_abstract_with_shardings(abstract_state)),
          meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"checkpoint {self.directory}/{step} does not match abstract_state "
                       f"(different model or optimizer config?): {e}") from e
    return Restored(step=step, state=out["state"], data_position=out["meta"]["data_position"])

  def wait(self) -> None:
    """Blocks until the async save in flight (if any) is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()  # Also waits for the save in flight.

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def latest_step(workdir: str) -> int | None:
  """The latest finished checkpoint's step, or None; ignores half-written (tmp) saves."""
  if not os.path.isdir(checkpoint_dir(workdir)):
    return None
  with Checkpointer(workdir, read_only=True) as ckpt:
    return ckpt.latest_step()


def has_checkpoint(workdir: str) -> bool:
  return latest_step(workdir) is not None


def restore(workdir: str, abstract_state, step: int | None = None) -> Restored:
  """Restores from workdir without keeping a Checkpointer open (see Checkpointer.restore)."""
  if not os.path.isdir(checkpoint_dir(workdir)):
    raise FileNotFoundError(f"no checkpoint directory {checkpoint_dir(workdir)}")
  with Checkpointer(workdir, read_only=True) as ckpt:
    return ckpt.restore(abstract_state, step)
