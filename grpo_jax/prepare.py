"""A run's inputs, checked before anything compiles: data, tokenizer, rewards (probed), the
model's config and its weight files (grpo_jax.inputs builds them), and the workdir's config.json.

    s = prepare.setup(config, workdir)   # a Setup; shared: a group's members build once
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any

import jax

from grpo_jax import compile_cache, hosts, inputs, plots, preflight, rollout, storage, validate
from grpo_jax.models import qwen, weights
from grpo_jax.rewards import build_rewards, probe

CONFIG_FILE = plots.CONFIG_FILE  # the resolved config of the run


@dataclasses.dataclass
class Setup:
  """A run's inputs, checked: data, tokenizer, rewards (probed), the model's config."""
  workdir: str
  train_rows: list
  eval_rows: list
  sft_eval_rows: list
  tokenizer: Any
  stop_ids: list
  rewards: list
  interrupt: threading.Event  # set on SIGINT/SIGTERM: a reward waiting on its scorer gives up
  cfg: qwen.QwenConfig
  generation_config: dict | None
  previous_config: dict | None = None  # the workdir's config.json from an earlier start


def setup(config, workdir: str, shared: dict | None = None) -> Setup:
  """Validates the config, reads an earlier config.json, loads data and tokenizer, builds and
  probes the rewards, reads the model config and checks its weight files (loads none): one
  member's host side. A first start writes config.json here once those checks pass
  (grpo_jax.preflight); a workdir that has one gets this run's once it has resumed
  (write_config), so a refused resume leaves the config the checkpoints were trained with.
  shared: as grpo_jax.inputs takes it (a group's members build their common data and tokenizer
  once).

  With several processes, process 0 writes the workdir's files (a synthetic dataset, the tiny
  tokenizer) and the others read them once it has."""
  root = storage.path(workdir)  # a local directory or a gs:// URL
  workdir = os.fspath(root)
  validate.validate(config, jax.device_count())
  validate.validate_processes(config, jax.device_count(), hosts.count())
  compile_cache.enable(config.train.compilation_cache)  # before anything compiles
  main = hosts.is_main()
  previous_config = None
  if main:
    root.mkdir(parents=True, exist_ok=True)
    previous_config = read_config_json(root / CONFIG_FILE)
    train_rows, eval_rows = inputs.datasets(config, workdir, shared=shared)
    tokenizer, stop_ids = inputs.tokenizer(config, workdir, train_rows, shared=shared)
  hosts.barrier("setup: process 0 wrote the workdir's inputs")
  if not main:
    train_rows, eval_rows = inputs.datasets(config, workdir, build=False, shared=shared)
    tokenizer, stop_ids = inputs.tokenizer(config, workdir, train_rows, build=False,
                                           shared=shared)
  if config.train.eval_examples:
    eval_rows = eval_rows[:config.train.eval_examples]
  # The warm start's stopping rule reads accuracy on training problems that neither phase trains
  # on; the reported held-out accuracy stays on eval_rows, which no decision ever sees.
  sft_eval_rows = []
  if config.sft.steps and config.sft.target_accuracy:
    if config.sft.eval_examples >= len(train_rows):
      raise validate.ConfigError(
          f"config.sft.eval_examples: {config.sft.eval_examples} validation problems leave none "
          f"of the {len(train_rows)} training problems to train on")
    train_rows, sft_eval_rows = (train_rows[:-config.sft.eval_examples],
                                 train_rows[-config.sft.eval_examples:])
  interrupt = threading.Event()
  rewards = build_rewards(config.rewards, interrupt=interrupt)
  probe_rows = train_rows[:2]  # real questions and gold answers: a working judge grades them
  probe(rewards, rollout.prompt_texts(config, tokenizer, probe_rows),
        [r["answer"] for r in probe_rows], rollout.reward_columns(probe_rows, 1),
        allow_missing=config.rewards.allow_missing)
  cfg, generation_config = inputs.model_config(config, tokenizer)
  validate.check_lora(config, cfg, first_start=previous_config is None)
  if main and previous_config is None and not config.model.random_init:
    # A first start loads these weights after compiling; a resume may need only its own.
    weights.check_weight_files(weights.resolve(config.model.checkpoint,
                                               "config.model.checkpoint"))
  if main and previous_config is None:
    # A first start, once its inputs are checked (preflight: a start that fails before here
    # leaves nothing); written now, so a run that fails later still shows its config.
    storage.write_text(root / CONFIG_FILE, config.to_json_best_effort(indent=2))
  preflight.passed(workdir)
  return Setup(workdir, train_rows, eval_rows, sft_eval_rows, tokenizer, stop_ids, rewards,
               interrupt, cfg, generation_config, previous_config)


def write_config(config, workdir) -> None:
  """The run's config.json (process 0), once its start is settled: a resume that is refused
  leaves the config of the run that made the checkpoints there."""
  storage.write_text(storage.path(workdir) / CONFIG_FILE, config.to_json_best_effort(indent=2))


def read_config_json(path) -> dict | None:
  """A workdir's config.json as a dict; None when there is none (or it is not JSON)."""
  try:
    return json.loads(storage.read_text(path))
  except (FileNotFoundError, ValueError):
    return None
