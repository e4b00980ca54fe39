"""The one exception type for problems with what the user gave us.

A `UserError` (bad config field, data file, path, mesh, checkpoint, scorer setting) reaches
`grpo_jax.main`, which prints its message alone and exits with status 2: no traceback, because
the message already names the file, line, field or URL and says what to do. Anything else is a
bug and keeps its traceback.

    raise UserError(f"config.data.source: {path!r} does not exist; point it at a directory "
                    "with train.jsonl and test.jsonl, or at a hub dataset id")
"""

import sys


class UserError(Exception):
  """Bad input from the user; the message names the bad thing and what to do about it."""


def warn(message: str) -> None:
  """A problem the run survives, on stderr in the one format: `grpo_jax: warning: ...`."""
  print(f"grpo_jax: warning: {message}", file=sys.stderr, flush=True)
