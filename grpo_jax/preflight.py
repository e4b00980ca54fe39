"""What a run needs, checked before it compiles or writes anything; and a start that fails those
checks leaves the workdir as it found it.

    preflight.check_fields(config, {"model.checkpoint": "--config.model.checkpoint"})
    preflight.check_workdir(workdir)           # a regular file, not writable: one line each
    preflight.check_packages(config, workdir)  # wandb, tensorboardX, gcsfs, the python sandbox
    with preflight.Start([workdir]):           # locks each workdir (grpo_jax.workdir_lock)
      train.run(config, workdir)               # prepare.setup calls passed(workdir) once its
                                               # checks (data, tokenizer, rewards, checkpoint) pass

Each check raises a UserError (grpo_jax.main: one line, status 2). Start records, for each
workdir, whether it existed and which files and directories it held; when the block ends with an
exception before every workdir's setup passed, it removes what this start created there (a
workdir that did not exist, with the parents it made, is removed whole). Files that were there
already are left as they were: setup writes the first start's config.json only after its checks,
and the synthetic data and tiny tokenizer it writes on a resume are the same bytes as before
(both are pure functions of the config). Once every setup passed, a failure leaves the files
(config.json says what the failed run was).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

from grpo_jax import logging_io, storage, workdir_lock
from grpo_jax.errors import UserError


# --- fields the config never reads -------------------------------------------------------------

# (field, or a prefix ending in '.' or '_'; fields under it that stay read; when the config
# never reads it; why, with {field}). Each verified where the field is read: model.checkpoint
# only by inputs.model_config/initial_params and export._base_model_name, each under not
# random_init (the tokenizer falls back to it only when model.tokenizer is '', which random_init
# refuses); model.tiny in inputs.model_config under random_init, its vocab_size by the 'tiny'
# tokenizer; model.lora through models.lora.LoraConfig.from_config, None at rank 0; sft.* by
# sft.run_sft and prepare.setup, each under sft.steps; agent.* by the agent's rollout and the tiny
# tokenizer, each under agent.enabled; data.synthetic_* by inputs.datasets under 'synthetic'.
DEAD_FIELDS = (
    ("model.checkpoint", (), lambda c: c.model.random_init,
     "the config has model.random_init=True, which builds random weights and never reads "
     "{field}"),
    ("model.tiny.", ("model.tiny.vocab_size",), lambda c: not c.model.random_init,
     "the config has model.random_init=False, which reads the architecture from "
     "model.checkpoint and never reads {field}"),
    ("model.tiny.vocab_size", (), lambda c: (c.model.tokenizer or c.model.checkpoint) != "tiny",
     "the config's tokenizer is not 'tiny' (model.tokenizer), and only the tiny tokenizer "
     "reads {field}"),
    ("model.lora.", ("model.lora.rank",), lambda c: not c.model.lora.rank,
     "the config has model.lora.rank=0, which turns LoRA off and never reads {field}"),
    ("sft.", ("sft.steps",), lambda c: not c.sft.steps,
     "the config has sft.steps=0, which turns the warm start off and never reads {field}"),
    ("agent.", ("agent.enabled",), lambda c: not c.agent.enabled,
     "the config has agent.enabled=False (single-turn rollouts), which never reads {field}"),
    ("data.synthetic_", (), lambda c: c.data.source != "synthetic",
     "the config's data.source is not 'synthetic', so its problems come from there and "
     "{field} is never read"),
    ("loss.sapo_", (), lambda c: c.loss.loss_type != "sapo",
     "the config has a loss.loss_type other than 'sapo', and only sapo reads {field}"),
    ("loss.vespo_", (), lambda c: c.loss.loss_type != "vespo",
     "the config has a loss.loss_type other than 'vespo', and only vespo reads {field}"),
    ("loss.ref_model_", (), lambda c: not c.loss.sync_ref_model,
     "the config has loss.sync_ref_model=False (the reference stays frozen), which never reads "
     "{field}"),
)


def set_fields(flag_overrides, file_overrides=(), file=None) -> dict[str, str]:
  """{dotted field: how the user set it} for the --config.a.b=v flags and --overrides=FILE keys:
  {"model.checkpoint": "--config.model.checkpoint", "sft.lr": "sft.lr in --overrides=o.json"}."""
  out = {key: f"--config.{key}" for key in flag_overrides}
  out.update({key: f"{key} in --overrides={file}" for key in file_overrides})
  return out


def _rule(key: str):
  """The DEAD_FIELDS rule for `key` (the most specific), or None."""
  rules = [r for r in DEAD_FIELDS
           if (key == r[0] or r[0][-1] in "._" and key.startswith(r[0]))
           and not any(key == k or key.startswith(k + ".") for k in r[1])]
  return max(rules, key=lambda r: len(r[0]), default=None)


def check_fields(config, set_by: dict[str, str]) -> None:
  """UserError for a field the user set that `config`, as set, never reads."""
  for key, where in set_by.items():
    rule = _rule(key)
    if rule is not None and rule[2](config):
      raise UserError(f"{where} is set but {rule[3].format(field=key)}; drop one of the two")


# --- the workdir and the packages a run needs ----------------------------------------------------

def check_workdir(workdir, name: str = "--workdir") -> None:
  """A local workdir must be a directory (or creatable) that this user can write."""
  if storage.is_remote(workdir):
    return  # an object store: what the bucket allows shows at the first write
  path = os.fspath(storage.path(workdir))
  where = f"{name}={workdir}"
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f"{where}: {path} is a file, not a directory; give a directory (a new one, "
                    "or an earlier run's to resume it)")
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise UserError(f"{where}: {existing} is a file, so no directory can be made under it")
  if not os.access(existing, os.W_OK | os.X_OK):
    what = "it" if existing == path else f"{existing}, where it would be made,"
    raise UserError(f"{where}: {what} is not writable by this user; give a directory you can "
                    "write to")


def _have(*modules: str) -> bool:
  return any(importlib.util.find_spec(m) is not None for m in modules)


# A remote path's scheme -> (the fsspec package etils.epath reaches it through, the pip name).
_STORES = {"gs://": ("gcsfs", "gcsfs"), "s3://": ("s3fs", "s3fs")}


def check_packages(config, workdir) -> None:
  """The optional packages the config asks for are importable (without importing them)."""
  t = config.train
  if t.wandb and not _have("wandb"):
    raise UserError("config.train.wandb=True logs to Weights & Biases, but the wandb package is "
                    f"not installed: {logging_io.WANDB_INSTALL}, or set --config.train.wandb=False")
  if t.tensorboard and not _have("tensorboardX"):
    raise UserError("config.train.tensorboard=True writes TensorBoard events, but tensorboardX "
                    "is not installed: `pip install -r requirements.txt`, or set "
                    "--config.train.tensorboard=False (metrics.jsonl has the same numbers)")
  paths = {"--workdir": os.fspath(workdir),
           "config.train.compilation_cache": t.compilation_cache or ""}
  for where, p in paths.items():
    store = next((v for k, v in _STORES.items() if p.startswith(k)), None)
    # etils.epath uses TensorFlow's file system where TensorFlow is installed, else fsspec's.
    if store and not _have(store[0], "tensorflow"):
      raise UserError(f"{where}={p}: reaching {p[:5]} needs the {store[0]} package: "
                      f"`pip install {store[1]}` (requirements: pip install -e .[gcs])")
  if t.tensorboard and storage.is_remote(workdir):
    logging_io.check_tensorboard_store(workdir)
  a = config.agent
  if a.enabled and "python" in tuple(a.tools) and a.sandbox != "unsafe":
    # The rollout checks it again when it starts (free by then); 'unsafe' warns there, once.
    from grpo_jax.agent import sandbox  # pylint: disable=import-outside-toplevel
    sandbox.check(a.sandbox)


# --- a start that fails leaves nothing ------------------------------------------------------------

_CURRENT: list[Start] = []  # the Start in progress, which prepare.setup reports to


def passed(workdir) -> None:
  """prepare.setup: this workdir's checks passed (a no-op outside a Start)."""
  if _CURRENT:
    _CURRENT[-1].passed.add(os.fspath(storage.path(workdir)))


def _listing(root) -> set[str]:
  """Every file and directory under root, relative to it, the lock file left out."""
  out = set()
  if storage.is_remote(root):
    base = os.fspath(root).split("://", 1)[-1]
    for d, dirs, names in root.walk():
      rel = os.path.relpath(os.fspath(d).split("://", 1)[-1], base)
      out.update(os.path.normpath(os.path.join(rel, n)) for n in [*dirs, *names])
  else:
    for d, dirs, names in os.walk(root):
      rel = os.path.relpath(d, root)
      out.update(os.path.normpath(os.path.join(rel, n)) for n in [*dirs, *names])
  out.discard(workdir_lock.LOCK_FILE)
  return out


class Start:
  """Locks the workdirs (main=True: the process that writes them) and, on an exception before
  every workdir passed its setup, removes what this start created in them (module docstring)."""

  def __init__(self, workdirs, main: bool = True):
    self.workdirs = [os.fspath(storage.path(w)) for w in workdirs]
    self.main, self.passed, self.locks = main, set(), []
    self._made, self._before = {}, {}

  def __enter__(self):
    _CURRENT.append(self)
    if not self.main:
      return self
    try:
      for w in self.workdirs:
        self._made[w] = _first_missing(w)
        self.locks.append(workdir_lock.acquire(w))
        self._before[w] = _listing(storage.path(w)) if self._made[w] is None else set()
    except BaseException:
      self._undo()
      raise
    return self

  def __exit__(self, exc_type, exc, tb):
    _CURRENT.remove(self)
    if not self.main:
      return
    if exc_type is not None and not set(self.workdirs) <= self.passed:
      self._undo()
    for lock in self.locks:
      lock.release()

  def _undo(self) -> None:
    """Removes what this start made: new files, then new directories; a new workdir whole.
    Only in workdirs it holds the lock of: another run's files are never touched."""
    for w, before in self._before.items():
      root = storage.path(w)
      new = sorted(_listing(root) - before, key=lambda rel: -rel.count(os.sep))
      for rel in new:
        p = root / rel
        with contextlib.suppress(OSError):
          if p.is_dir():
            if not storage.is_remote(root):
              os.rmdir(p)  # empty by now: its files came first (deepest first)
          else:
            p.unlink()
    for lock in self.locks:
      lock.release()
    self.locks = []
    for w, made in self._made.items():
      if made is not None and not storage.is_remote(w):
        _remove_empty_up_to(w, made)


def _first_missing(workdir: str) -> str | None:
  """The outermost directory that making `workdir` would create; None when it exists."""
  if storage.path(workdir).exists():
    return None
  if storage.is_remote(workdir):
    return workdir
  missing = workdir
  while not os.path.exists(os.path.dirname(missing)):
    missing = os.path.dirname(missing)
  return missing


def _remove_empty_up_to(path: str, top: str) -> None:
  """Removes path and its parents up to top, each only while empty (another run may use one)."""
  while True:
    try:
      os.rmdir(path)
    except OSError:
      return
    if path == top:
      return
    path = os.path.dirname(path)

