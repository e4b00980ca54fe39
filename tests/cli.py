"""Running the real command in tests: `python -m grpo_jax.main` in a subprocess, and the check
that a user error is one line with status 2."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def env(**extra) -> dict:
  """The environment of a user's run: CPU, one device (no fake-device XLA_FLAGS), unbuffered."""
  out = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  out.pop("XLA_FLAGS", None)
  out.update(extra)
  return out


def assert_user_error(proc, *named) -> str:
  """Status 2, no traceback, one `grpo_jax: error:` line that names each of `named`; the line."""
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  message = [line for line in proc.stderr.splitlines() if line.startswith("grpo_jax: error:")]
  assert len(message) == 1, proc.stderr[-3000:]
  for thing in named:
    assert thing in message[0], message[0]
  return message[0]
