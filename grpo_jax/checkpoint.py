"""Checkpoints with orbax: train state arrays + JSON (data position, ...), last K kept, atomic,
checksummed.

Layout: <workdir>/checkpoints/<step>/{state,meta,SHA256SUMS}. orbax writes each step into
`<step>.orbax-checkpoint-tmp` and renames it to `<step>` only when every file is written, so a
crash mid-save leaves the previous steps untouched and the half-written one invisible (its tmp
dir is deleted the next time a Checkpointer opens the workdir).

Right after that rename, the save writes SHA256SUMS (the `sha256sum` format: check a step by hand
with `cd checkpoints/<step> && sha256sum -c SHA256SUMS`). Restoring checks every file of a step
against it first, because orbax alone would restore flipped bytes in a data file as silently
wrong values. A step that fails (changed, missing or extra files; no SHA256SUMS because the
process died while writing it) is skipped with a warning naming it, and the next older one is
tried; when none is left, restore raises RestoreError naming the checkpoint directory. A step
whose files are intact but do not fit the requested state (another tree or shape) also raises
RestoreError at once: the config changed, and an older step would not fit either. dtypes are not
checked: arrays come back in the dtypes the requested state asks for, so a run resumed with
another `optim.param_dtype` gets its saved params and moments converted (rounded) silently.

    with Checkpointer(workdir, max_to_keep=3) as ckpt:
      ckpt.save(step, {"params": params, "opt_state": opt_state, "rng": key}, it.position(),
                {"bad_steps": 0})  # counters: optional, any JSON object
    # later, in a fresh process
    restored = resume(workdir, abstract_state)   # leaves: ShapeDtypeStruct with .sharding
    if restored is not None:
      restored.step, restored.state["rng"], restored.data_position, restored.counters

`state` is any pytree of jax arrays (typed PRNG keys included: orbax stores their key_data and
rewraps them with the abstract leaf's key type) and numpy arrays.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from grpo_jax import storage
from grpo_jax.errors import UserError, warn

SUBDIR = "checkpoints"
CHECKSUMS_FILE = "SHA256SUMS"


class RestoreError(UserError, ValueError):
  """No checkpoint of the workdir can be restored: all are damaged, or none fits this config."""


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data_position: dict
  counters: dict = dataclasses.field(default_factory=dict)  # {} from a save that passed none
  in_flight: dict | None = None  # the batch sampled ahead of the step (grpo_jax.pipeline)


def checkpoint_dir(workdir: str) -> str:
  return os.fspath(storage.path(workdir) / SUBDIR)


# --- checksums -----------------------------------------------------------------------------------

def _files(step_dir: str) -> list[str]:
  """Paths of the step's files relative to step_dir, sorted; the checksum file itself excluded."""
  return [n for n in storage.files(step_dir) if n not in (CHECKSUMS_FILE, CHECKSUMS_FILE + ".tmp")]


def _sha256(path) -> str:
  with storage.path(path).open("rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(step_dir: str) -> None:
  """Writes step_dir/SHA256SUMS for every file in step_dir; a crash leaves none, never half."""
  root = storage.path(step_dir)
  storage.write_text(root / CHECKSUMS_FILE,
                     "".join(f"{_sha256(root / n)}  {n}\n" for n in _files(step_dir)))


def verify(step_dir: str) -> str | None:
  """None when every file of step_dir matches SHA256SUMS (no more, no fewer); else what is wrong."""
  try:
    lines = (storage.path(step_dir) / CHECKSUMS_FILE).read_bytes().decode(
        errors="replace").splitlines()
  except FileNotFoundError:
    return (f"it has no {CHECKSUMS_FILE}: its save did not finish (or it was written before "
            "grpo_jax recorded checksums)")
  expected = {}
  for line in lines:
    digest, sep, name = line.partition("  ")
    if not sep or len(digest) != 64:
      return f"its {CHECKSUMS_FILE} is damaged"
    expected[name] = digest
  names = _files(step_dir)
  missing = sorted(expected.keys() - set(names))
  if missing:
    return f"{missing[0]} is missing"
  for name in names:
    if name not in expected:
      return f"{name} is not in its {CHECKSUMS_FILE}"
    if _sha256(storage.path(step_dir) / name) != expected[name]:
      return f"{name} does not match its checksum"
  return None


class _Checksummed:
  """orbax's commit of a step, then the step's SHA256SUMS.

  Hooked here because this runs once the step's files are final, in orbax's save thread (async
  saves stay async) and before wait()/close() return; orbax 0.12's own hook,
  AsyncOptions.post_finalization_callback, runs before the commit and is not told the step. A
  crash between the commit and the checksums leaves a step without SHA256SUMS, which restore
  treats as unfinished.
  """

  async def finalize(self):
    await super().finalize()
    final = self.get_final()
    if final.name.isdigit():  # a step dir; orbax commits its items (state/, meta/) this way too
      await asyncio.to_thread(write_checksums, os.fspath(final))


class _ChecksummedRename(_Checksummed, ocp.path.atomicity.AtomicRenameTemporaryPath):
  """Local files: the step is written to a tmp dir and renamed to <step> when complete."""


class _ChecksummedCommit(_Checksummed, ocp.path.atomicity.CommitFileTemporaryPath):
  """Object stores (gs://), which cannot rename a directory: orbax's commit-success file marks
  a step complete, as orbax does there by default."""


# --- saving and restoring ------------------------------------------------------------------------

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
               read_only: bool = False, subdir: str = SUBDIR):
    """subdir: where in the workdir (the warm start's own: sft.CHECKPOINT_DIR)."""
    if max_to_keep < 1:
      raise ValueError(f"checkpoint max_to_keep must be >= 1, got {max_to_keep}")
    self.directory = os.fspath(storage.path(workdir) / subdir)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
        enable_async_checkpointing=async_save,
        # Removes the tmp dirs of saves a crash interrupted; finished steps are never touched.
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
        create=not read_only,
        temporary_path_class=(_ChecksummedCommit if storage.is_remote(self.directory)
                              else _ChecksummedRename))
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    # orbax clears the tmp dirs of interrupted saves in a thread of its own and waits for that
    # thread only in save(), not in close(). A run that stops before its first save (a resume
    # that finds no usable checkpoint) could exit with the thread still running, and at
    # interpreter shutdown it printed a traceback under the run's one-line error. So wait here:
    # listing the checkpoint directory is quick. (orbax 0.12.8 has no public call for this.)
    wait_for_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if wait_for_cleanup is not None:
      wait_for_cleanup()

  def save(self, step: int, state, data_position: dict, counters: dict | None = None,
           in_flight: dict | None = None) -> bool:
    """Starts saving (async by default); False when `step` is not after the latest saved step.
    counters: the loop's own JSON-able counts (train: its stopping rules'), restored with it.
    in_flight: JSON, the batch a pipelined run sampled for the next step (grpo_jax.pipeline)."""
    meta = {"step": int(step), "data_position": data_position, "counters": counters or {}}
    if in_flight is not None:
      meta["in_flight"] = in_flight
    for name in [n for n in ("data_position", "counters", "in_flight") if n in meta]:
      try:
        json.dumps(meta[name])  # Fail here, not later in the background save thread.
      except TypeError as e:
        raise TypeError(f"checkpoint {name} must be JSON-serialisable: {e}") from e
    return self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def latest_step(self) -> int | None:
    """The latest finished step, verified or not (restore checks it)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, abstract_state, step: int | None = None, verified: bool = False) -> Restored:
    """Restores `step`, by default the latest step whose files match their checksums, with arrays
    placed as abstract_state's shardings say. verified: `step` passed its checksums already
    (usable_step said so): they are not read again.

    Each newer step that fails its checksums gets a warning naming it. Raises RestoreError when
    no step (or not `step`) passes, or when a step that passes does not fit abstract_state (its
    files are intact, so the run's config differs from the one that saved it).
    """
    steps = self.all_steps()
    if step is not None and step not in steps:
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} "
                              f"(have {steps})")
    if not steps:
      raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
    if step is not None and verified:
      return self._restore_verified(abstract_state, step)
    candidates = [step] if step is not None else steps[::-1]
    usable = self.usable_step(candidates)
    if usable is not None:
      return self._restore_verified(abstract_state, usable)
    raise RestoreError(
        f"no usable checkpoint in {self.directory}: tried step {', '.join(map(str, candidates))}, "
        "damaged or unfinished (the warnings above say how). Nothing was restored. To start the "
        f"run over, delete {self.directory} (or the whole workdir); move it elsewhere first if "
        "you want to keep the files")

  def usable_step(self, candidates: list[int] | None = None) -> int | None:
    """The first of `candidates` (default: every finished step, newest first) whose files match
    their checksums, each one before it named in a warning; None when none does."""
    candidates = self.all_steps()[::-1] if candidates is None else candidates
    for s in candidates:
      problem = verify(os.path.join(self.directory, str(s)))
      if problem is None:
        return s
      warn(f"checkpoint step {s} in {self.directory} is unusable: {problem}"
           + ("; trying the one before" if s != candidates[-1] else ""))
    return None

  def _restore_verified(self, abstract_state, step: int) -> Restored:
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_abstract_with_shardings(abstract_state)),
          meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as e:
      raise RestoreError(
          f"checkpoint {self.directory}/{step} does not fit this run's state: its files are "
          f"intact, so this run's model or optimizer config differs from the one that saved it "
          f"({type(e).__name__}: {e}). Run with the config it was saved with, or use a new "
          "workdir") from e
    meta = out["meta"]
    return Restored(step=step, state=out["state"], data_position=meta["data_position"],
                    counters=meta.get("counters", {}), in_flight=meta.get("in_flight"))

  def delete_after(self, step: int) -> list[int]:
    """Deletes the steps after `step` (those restore skipped); returns them."""
    newer = [s for s in self.all_steps() if s > step]
    for s in newer:
      self._manager.delete(s)
    return newer

  def wait(self) -> None:
    """Blocks until the async save in flight (if any) is on disk, checksums included."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()  # Also waits for the save in flight.

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def latest_step(workdir: str) -> int | None:
  """The latest finished checkpoint's step, or None; ignores half-written (tmp) saves."""
  if not storage.path(checkpoint_dir(workdir)).is_dir():
    return None
  with Checkpointer(workdir, read_only=True) as ckpt:
    return ckpt.latest_step()


def latest_usable_step(workdir: str) -> int | None:
  """The latest finished step whose files pass their checksums (newer damaged ones are named in
  a warning), or None when there is no finished step. Raises RestoreError when there are
  finished steps and none passes."""
  if not storage.path(checkpoint_dir(workdir)).is_dir():
    return None
  with Checkpointer(workdir, read_only=True) as ckpt:
    steps, usable = ckpt.all_steps(), ckpt.usable_step()
  if usable is not None or not steps:
    return usable
  raise RestoreError(f"no usable checkpoint in {checkpoint_dir(workdir)}: steps "
                     f"{', '.join(map(str, steps))} are damaged or unfinished (the warnings "
                     "above say how). Nothing was restored")


def has_checkpoint(workdir: str) -> bool:
  return latest_step(workdir) is not None


def restore(workdir: str, abstract_state, step: int | None = None,
            verified: bool = False) -> Restored:
  """Restores from workdir without keeping a Checkpointer open (see Checkpointer.restore)."""
  if not storage.path(checkpoint_dir(workdir)).is_dir():
    raise FileNotFoundError(f"no checkpoint directory {checkpoint_dir(workdir)}")
  with Checkpointer(workdir, read_only=True) as ckpt:
    return ckpt.restore(abstract_state, step, verified)


def resume(workdir: str, abstract_state) -> Restored | None:
  """What a run continues from: the latest usable checkpoint, or None when there is none yet.

  The damaged steps it skipped are deleted: they would otherwise stay "latest" and stop this run
  from saving those steps again.
  """
  if not storage.path(checkpoint_dir(workdir)).is_dir():
    return None
  with Checkpointer(workdir) as ckpt:
    if not ckpt.all_steps():
      return None
    restored = ckpt.restore(abstract_state)
    for s in ckpt.delete_after(restored.step):
      warn(f"deleted the unusable checkpoint step {s}; this run recomputes it from step "
            f"{restored.step}")
  return restored
