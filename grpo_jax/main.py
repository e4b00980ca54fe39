"""Entry point: python -m grpo_jax.main --config=configs/gsm8k.py[:preset] --workdir=DIR
[--config.a.b=value ...] [--overrides=FILE]. Running it again on the same workdir resumes from
the last checkpoint.

--overrides=FILE: a JSON object of dotted config keys to values, {"data.system_prompt": null,
"optim.lr": 1e-05}, set after --config and its --config.a.b=value overrides with
grpo_jax.config.apply_overrides, the function a vmapped group's members use. It carries values
that flag text cannot (None stays None, not 'None'); grpo_jax.sweep passes every run's
overrides this way.

A user error (grpo_jax.errors.UserError: config, data, paths, mesh, checkpoint, scorer) prints
one line naming the bad thing and exits with status 2; a bug keeps its traceback. What a run
needs is checked before it compiles or writes (grpo_jax.preflight: a failed start leaves no
files), and the run holds its workdir's lock (grpo_jax.workdir_lock: one run per workdir).
SIGINT (Ctrl-C) or SIGTERM saves a checkpoint of the phase the run is in, prints one line saying
where it stopped and what it saved, and exits with status 130 or 143 (grpo_jax.interrupts).

Several processes (hosts): start the same command on each with --coordinator_address=HOST:PORT
(process 0's), --num_processes=N and --process_id=i, or with --distributed where JAX finds the
cluster itself (TPU pods, SLURM). This module is the only one that knows how processes start;
process 0 alone prints and writes the run's files (grpo_jax.hosts).
"""

import json
import os
import re
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from grpo_jax import config as config_lib, interrupts, progress
from grpo_jax.errors import UserError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with a preset: configs/gsm8k.py:tiny",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None,
    "Where checkpoints, metrics, samples and plots go: a directory or gs://BUCKET/PATH")
flags.mark_flags_as_required(["config", "workdir"])
_OVERRIDES = flags.DEFINE_string(
    "overrides", None,
    "A JSON file of {dotted config key: value}, set after --config.a.b=value (grpo_jax.sweep "
    "writes one per run): values flag text cannot carry, such as None")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "Several processes: HOST:PORT of process 0's coordinator (or env JAX_COORDINATOR_ADDRESS)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Several processes: how many")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Several processes: this one's index")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Several processes on a cluster JAX detects (TPU pod slices, SLURM): "
    "jax.distributed.initialize() without an address")


def _exit_user_error(message: str):
  print(f"grpo_jax: error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def _apply_overrides_file(config, path) -> list[str]:
  """Sets the keys of the JSON object in `path` on config (grpo_jax.config.apply_overrides);
  returns them."""
  try:
    with open(path) as f:
      args = json.load(f)
  except (OSError, ValueError) as e:
    _exit_user_error(f"--overrides={path}: cannot be read as JSON ({e})")
  if not isinstance(args, dict):
    _exit_user_error(f"--overrides={path}: must hold a JSON object of dotted config keys, not "
                     f"{type(args).__name__}")
  for key, value in args.items():
    try:
      config_lib.apply_overrides(config, {key: value})
    except (KeyError, AttributeError):
      _exit_user_error(f"--overrides={path}: {key!r} names no config field")
    except TypeError as e:
      _exit_user_error(f"--overrides={path}: {key}={value!r} does not fit the field's type ({e})")
  return list(args)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  progress.quiet_library_bars()  # before datasets and huggingface_hub are imported
  try:
    config = _CONFIG.value
    config.get("seed")  # ml_collections defers a config file's load error to the first access
  except OSError as e:
    _exit_user_error(f"--config: {str(e).splitlines()[-1].strip()}")
  file_keys = _apply_overrides_file(config, _OVERRIDES.value) if _OVERRIDES.value else []
  from grpo_jax import preflight  # pylint: disable=import-outside-toplevel
  workdir = _WORKDIR.value
  try:  # before JAX starts: a config that cannot run fails in a second, writing nothing
    preflight.check_fields(config, preflight.set_fields(
        config_flags.get_override_values(flags.FLAGS["config"]), file_keys, _OVERRIDES.value))
    preflight.check_workdir(workdir)
    preflight.check_packages(config, workdir)
  except UserError as e:
    _exit_user_error(str(e))
  try:
    from grpo_jax import hosts  # imports jax: after flags, so --help stays fast
    if hosts.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                        auto=_DISTRIBUTED.value) and not hosts.is_main():
      # Process 0 prints and shows progress; the others' errors still reach stderr.
      sys.stdout = open(os.devnull, "w")
    from grpo_jax import train
    # Process 0 locks the workdir for the run; a start that fails its checks leaves nothing.
    with preflight.Start([workdir], main=hosts.is_main()):
      train.run(config, workdir)
  except UserError as e:
    _exit_user_error(str(e))
  except interrupts.Stopped as e:  # SIGINT or SIGTERM, with the phase's checkpoint saved
    interrupts.exit_with(e)
  except KeyboardInterrupt:  # Ctrl-C before the run's handlers (importing jax)
    interrupts.exit_with(interrupts.Stopped(
        signal.SIGINT, "interrupted (SIGINT) while starting: nothing was saved; run the same "
        "command to start again"))


def _parse_flags(argv):
  """absl's parsing, with a bad flag, config file or override reported as a user error."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    text = str(e)
    if isinstance(e, flags.Error):
      # A config file's get_config that raised comes with its whole traceback: keep the flag
      # and the exception's line.
      lines = [line.strip() for line in text.splitlines() if line.strip()]
      _exit_user_error(text.split(":", 1)[0] + ": " + lines[-1] if "Traceback" in text
                       else " ".join(lines))
    # ml_collections raises a bare AttributeError/KeyError for an unknown override field.
    field = re.search(r"'(\w+)\\?'", text)
    hint = re.search(r"Did you mean [^?]*\?", text)
    _exit_user_error(f"a --config override names no config field"
                     f"{' ' + repr(field.group(1)) if field else ''}"
                     f"{'; ' + hint.group(0) if hint else ''}")


def _as_main_module():
  """absl's --help prints __main__'s docstring and the flags registered for the module named
  sys.argv[0]. Under python -m both are this file's; under the `grpo-jax` console script they are
  the launcher's (no docstring, no flags: help said only "Try --helpfull"). This gives the
  launcher this module's docstring and flags, so both commands print the same help."""
  launcher = sys.modules["__main__"]
  if launcher is sys.modules.get(__name__):  # python -m grpo_jax.main
    return
  launcher.__doc__ = __doc__
  for flag in flags.FLAGS.get_key_flags_for_module(__name__):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def run():
  """The `grpo-jax` console script: the same as python -m grpo_jax.main."""
  _as_main_module()
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
