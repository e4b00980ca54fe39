"""One run's host side between its start and its end (Run): data order, writers, checkpointer,
reward health and the stopping rules' counts."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from tqdm.auto import tqdm

from grpo_jax import checkpoint, data, logging_io, prepare, storage, workdir_files
from grpo_jax.errors import UserError
from grpo_jax.rewards import RewardHealth


class TooManyBadSteps(UserError):
  """Consecutive non-finite steps: a setting (usually optim.lr) to change, not a crash."""


@dataclasses.dataclass(eq=False)  # runs are told apart by identity (`m in live`)
class Run:
  """One run's host side: its Setup (data, tokenizer, rewards), data order, writers, checkpoints
  and reward health; the device state lives with members.Group."""
  setup: prepare.Setup
  config: Any
  it: data.PromptIterator | None = None
  metrics: Any = None
  samples: Any = None
  ckpt: Any = None
  health: Any = None
  fresh: bool = False  # warm-started in this process (no checkpoint to resume from)
  bad: int = 0  # consecutive steps with a skipped (non-finite) update
  streaks: dict = dataclasses.field(default_factory=dict)  # restored RewardHealth streaks
  in_flight: dict | None = None  # the checkpoint's batch sampled ahead (grpo_jax.pipeline)

  @property
  def workdir(self):
    return self.setup.workdir

  def next_rows(self, peek: bool = False) -> list:
    """The dataset rows of the run's next train.prompts_per_step prompts (peek: without moving
    its data order on)."""
    indices = self.it.peek_indices() if peek else self.it.next_indices()
    return [self.setup.train_rows[i] for i in indices]

  def counters(self) -> dict:
    """What the stopping rules have counted so far (bad steps, reward streaks), checkpointed so
    that a resumed run stops where the uninterrupted one would."""
    return {"bad_steps": self.bad, "reward_streaks": dict(self.health.streak)}

  def open(self, start: int, main: bool) -> None:
    """The run's config.json (process 0: prepare.write_config), writers and checkpointer, from
    `start` on (a fresh run: from scratch)."""
    if main:
      prepare.write_config(self.config, self.workdir)
    c, resume = self.config, -1 if self.fresh else start
    self.metrics = logging_io.MetricsWriter(
        self.workdir, resume_step=resume, tensorboard=c.train.tensorboard, wandb=c.train.wandb,
        wandb_kwargs=logging_io.wandb_init_kwargs(c, self.workdir) if c.train.wandb else None,
        plot_step=c.train.steps) if main else logging_io.NullWriter()
    self.samples = (logging_io.SamplesWriter(self.workdir, resume_step=resume) if main
                    else logging_io.NullWriter())
    self.ckpt = checkpoint.Checkpointer(self.workdir, max_to_keep=c.train.keep_checkpoints)
    self.health = RewardHealth(self.setup.rewards, c.train.max_missing_reward_steps,
                               log=lambda line: tqdm.write(line, file=sys.stderr))
    for name, streak in self.streaks.items():  # a reward renamed since is not counted
      if name in self.health.streak:
        self.health.streak[name] = int(streak)
    failure = storage.path(self.workdir) / workdir_files.FAILURE_FILE
    if main and failure.exists():  # an earlier attempt's: this one starts again
      failure.unlink()

  def count_bad_step(self, metrics: dict, done: int, max_bad_steps: int, label: str = ""):
    """Counts consecutive bad steps; returns TooManyBadSteps at the limit, else None.
    step/skipped is the fraction of the step's loss.num_iterations updates skipped as not
    finite: the state is unchanged only at 1. Any skipped update makes a bad step, whether or
    not an earlier one moved the params. label: what the message starts with (members.label)."""
    if not metrics["step/skipped"] > 0:
      self.bad = 0
      return None
    self.bad += 1
    if self.bad < max_bad_steps:
      return None
    return TooManyBadSteps(
        f"{label}{self.bad} consecutive non-finite steps up to step {done} "
        f"(train.max_bad_steps); try a lower optim.lr or optim.max_grad_norm. The last "
        f"good checkpoint is in {checkpoint.checkpoint_dir(self.workdir)}")

  def write_failure(self, error, step: int) -> None:
    """The failure record of a group's member that failed while the others went on
    (FAILURE_FILE: what grpo_jax.sweep_runner reads); a run that starts removes it."""
    storage.write_text(storage.path(self.workdir) / workdir_files.FAILURE_FILE, json.dumps(
        {"error": type(error).__name__, "message": str(error), "step": step}, indent=2))

  def close(self) -> None:
    """Checkpoints finished; on an object store the logs' appended parts folded in."""
    for part in (self.ckpt, self.metrics, self.samples):
      if part is not None:
        part.close()
    self.ckpt = self.metrics = self.samples = None
