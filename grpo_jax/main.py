"""Entry point: python -m grpo_jax.main --config=configs/gsm8k.py[:preset] --workdir=DIR
[--config.a.b=value ...]. Running it again on the same workdir resumes from the last
checkpoint.

A user error (grpo_jax.errors.UserError: config, data, paths, mesh, checkpoint, scorer) prints
one line naming the bad thing and exits with status 2; a bug keeps its traceback.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from grpo_jax.errors import UserError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with a preset: configs/gsm8k.py:tiny",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics, samples and plots go")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from grpo_jax import train  # imports jax: after flags, so --help stays fast

  try:
    train.run(_CONFIG.value, _WORKDIR.value)
  except UserError as e:
    print(f"grpo_jax: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def run():
  """The `grpo-jax` console script: the same as python -m grpo_jax.main."""
  app.run(main)


if __name__ == "__main__":
  run()
