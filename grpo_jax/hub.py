"""Local path or Hugging Face hub id: one rule for every model, tokenizer and data set in a config.

- A name that exists on disk is local, always ("models/qwen" included, when it exists).
- A name that cannot be a hub id ('.', '/' or '~' first, more than one '/', a trailing '/') and
  does not exist is an error naming it.
- Anything else is a hub id. Before the first hub access the hub is probed once (one TCP
  connect, at most PROBE_TIMEOUT_S); when it cannot be reached the Hugging Face libraries are
  switched to offline mode, so a hub id comes from the local cache or fails at once. Without
  this, transformers retried for 47 s and datasets for 24 s on this offline machine.

    path = hub.local_path("../shared/gsm8k", "config.data.source")  # str, or None for a hub id
    if path is None:
      hub.prepare()                      # offline mode if the hub is unreachable
      ...load from the hub, and on failure: raise hub.unavailable(name, field, "data set", e)
"""
from __future__ import annotations

import functools
import os
import socket
import sys
import urllib.parse

from huggingface_hub import constants

from grpo_jax.errors import UserError

PROBE_TIMEOUT_S = 5.0


def looks_like_path(name: str) -> bool:
  """True when `name` cannot be a hub id ('owner/name' or 'name')."""
  return (name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/")
          or (os.sep != "/" and os.sep in name))


def local_path(name: str, field: str) -> str | None:
  """`name` as a local path if it exists; None for a hub id; UserError for a missing path."""
  if not name:
    raise UserError(f"{field} is empty: set a local path or a hub id")
  expanded = os.path.expanduser(name)
  if os.path.exists(expanded):
    return expanded
  if looks_like_path(name):
    raise UserError(f"{field}: {name!r} does not exist (relative paths start at {os.getcwd()})")
  return None


@functools.cache
def offline() -> bool:
  """True when hub ids must come from the local cache: HF_HUB_OFFLINE, or the hub unreachable."""
  if constants.HF_HUB_OFFLINE:
    return True
  url = urllib.parse.urlparse(constants.ENDPOINT)
  port = url.port or (443 if url.scheme == "https" else 80)
  try:
    socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S).close()
    return False
  except OSError:
    # The libraries read these flags at call time; the environment variable is read only at
    # import, which has already happened.
    constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
      sys.modules["datasets"].config.HF_HUB_OFFLINE = True
    return True


def prepare() -> None:
  """Call before loading a hub id: switches to offline mode when the hub is unreachable."""
  offline()


def unavailable(name: str, field: str, what: str, error: BaseException) -> UserError:
  """The error for a hub id that could not be loaded, saying how to use a local copy instead."""
  why = ("the hub cannot be reached and it is not in the local Hugging Face cache" if offline()
         else f"the hub refused it ({type(error).__name__}: {str(error)[:200]})")
  repo_type = " --repo-type dataset" if what == "data set" else ""
  return UserError(
      f"{field}: {name!r} is not a local path (nothing at {os.path.abspath(name)}), and the "
      f"{what} could not be loaded as a hub id: "
      f"{why}. Download it where there is network (hf download {name}{repo_type} --local-dir "
      f"DIR), then set {field}=DIR.")
