"""The GRPO loop: a run's steps from its start to its end.

    summaries = loop.run_group(configs, workdirs)   # one run: one config, one workdir

Each step: rollouts (host: sample, decode, reward; rollout.SingleTurn or the agent) → one
compiled train step (train_step.train_step: advantages, reference pass, μ updates) → metrics,
samples, eval and checkpoints at their cadence; plots, summary and the exported model at the end
(grpo_jax.start). A vmapped sweep's K runs go through the same loop: their device side is one
members.Group and one members.group_step, their host sides (runs.Run) are visited in turn, and
each writes exactly the files its separate run writes (grpo_jax.members says how close their
numbers are).

Every source of randomness is a pure function of (seed, step) and the data order of (seed,
epoch), so on one machine a resumed run reproduces an uninterrupted one bit for bit. SIGINT or
SIGTERM stops the loop with a checkpoint of the phase it is in (interrupts.Stopped, raised once
its files are written; docs/faults.md).

Files in the workdir: see README ("Outputs and resume").
"""

from __future__ import annotations

import gc
import time

from grpo_jax import (export, hosts, interrupts, members as members_lib, pipeline, prepare,
                      progress, runs as runs_lib, sharding, start as start_lib,
                      trainer as trainer_lib)
from grpo_jax.rewards import Interrupted, MissingRewardsError

# What a signal before the warm start (or before the resume's first step) says: setup and the
# initial params are recomputed by the next start.
STARTING = ("while starting (data, model, compiling), before any step of this start: nothing "
            "new was saved; run the same command to start again")


def run_group(configs, workdirs) -> list[dict]:
  """K >= 1 runs as one program; returns their summaries (on every process but the first:
  {}). SIGINT or SIGTERM stops it with a checkpoint of the phase it is in: interrupts.Stopped,
  raised once its files are written (docs/faults.md)."""
  with interrupts.Interrupts() as stop:
    stop.abortable(STARTING)
    loop = _Loop(configs, workdirs, stop)
    try:
      stopped = loop.steps()
    finally:
      loop.close()
    return loop.finish(stopped)


class _Loop:
  """The loop's state: the runs' host sides, their trainers and device group, the failures of
  a group's members, and the last step done."""

  def __init__(self, configs, workdirs, stop):
    members_lib.check_vmappable(configs)
    shared = {}  # what the runs' setups have in common is built once
    self.runs = [runs_lib.Run(prepare.setup(c, w, shared), c) for c, w in zip(configs, workdirs)]
    self.stop = stop
    # A signal makes a reward waiting on its scorer give up (rewards.Interrupted).
    stop.events += [m.setup.interrupt for m in self.runs]
    members_lib.check_shared([m.setup for m in self.runs])
    config, s0 = self.runs[0].config, self.runs[0].setup
    # train.sample_devices: sampling on devices of its own (one step behind), else shared.
    mesh, sample_mesh = sharding.make_meshes(tuple(config.mesh), config.train.sample_devices)
    trainer = trainer_lib.Trainer(config, s0.cfg, mesh, s0.tokenizer, s0.stop_ids,
                                  interrupt=s0.interrupt)
    members_lib.announce(self.runs, s0.cfg, mesh)
    self.trainers = members_lib.trainers(trainer, self.runs)
    self.start, states, refs = start_lib.start(self.runs, self.trainers, stop)
    hparams = [trainer.hparams(m.config) for m in self.runs]
    shared_ref = trainer.policy_type.members_share_frozen
    # One step behind (one run): the next step's batch is sampled before this step's update.
    self.pipe = (pipeline.Pipeline(self.runs[0], self.trainers[0], self.start, sample_mesh)
                 if config.train.off_policy_steps else None)
    # The first step's train program compiles from here on, in the background, for the first
    # rows' likely batch: beside the stacking, the step-0 eval (runs warm-started here) and the
    # first rows' sampling, not after them.
    if self.start < config.train.steps:
      members_lib.compile_ahead(self.trainers, members_lib.Group.spec(states, refs, hparams,
                                                                      shared_ref),
                                [m.next_rows(peek=True) for m in self.runs], len(s0.rewards),
                                behaviour_logp=self.pipe is not None)
    self.main = hosts.is_main()  # the one process that writes the runs' files
    members_lib.open_all(self.runs, self.start, self.main)
    self.group = members_lib.Group.of(states, refs, hparams, shared_ref)
    del states, refs  # the group's copies are the live ones
    stop.abortable(None)  # from here on each phase saves its checkpoint before it stops
    # Several processes: a signal to one interrupts the rewards of all (docs/faults.md).
    self.shared_interrupt = hosts.SharedEvents([m.setup.interrupt for m in self.runs])
    self.failures = members_lib.Failures(self.runs, self.main)
    self.done = self.start
    self.c = config.train
    # What setup built (data, tokenizer, modules) lives for the whole run: frozen out of the
    # cyclic collector's view, a full collection walks only what the steps allocate.
    gc.freeze()

  def save(self, step: int, only=None) -> None:
    """The checkpoint of `step` of each live run (only: of those)."""
    for k, m in enumerate(self.runs):
      if only is not None and m not in only or m in self.failures:
        continue
      state, ref = self.group.member(k)
      ckpt_state = {"train": state}
      if ref is not None and self.trainers[0].policy_type.frozen_in_checkpoint:
        ckpt_state["ref"] = ref
      if self.pipe is None:
        m.ckpt.save(step, ckpt_state, m.it.position(), m.counters())
      else:  # with the batch sampled for step + 1 (its rows are behind the data position)
        m.ckpt.save(step, ckpt_state, m.it.position(), m.counters(), self.pipe.in_flight())

  def steps(self) -> str | None:
    """The step-0 eval of runs warm-started here, then GRPO steps up to train.steps or a
    signal. Returns where a signal stopped it (what was saved), or None."""
    fresh = [m for m in self.runs if m.fresh]
    if fresh:
      self._evaluate_step_0(fresh)
    # A signal during the step-0 eval stops here, not after a whole step more. Every run
    # already has its checkpoint of `start` (saved just above, or the one it resumed from).
    stopped = None
    if hosts.any_(self.stop.requested()):
      stopped = (f"in the step-0 evaluation: {members_lib.saved(self.runs, self.start)}" if fresh
                 else f"before GRPO step {self.start + 1}: the checkpoint of step {self.start} "
                 "is kept")
    bar = progress.Bar(range(self.start, self.start if stopped else self.c.steps),
                       initial=self.start, total=self.c.steps,
                       desc=members_lib.progress_name(self.runs), every_s=self.c.progress_every_s,
                       disable=not self.main)
    for step in bar:
      stopped = self._step(step, bar, evals_ahead=step == self.start and not fresh)
      if stopped:
        break
    return stopped

  def _evaluate_step_0(self, fresh) -> None:
    """The held-out greedy accuracy of the runs warm-started here, written as step 0, and
    their checkpoint of step 0 (an interrupted warm start's is deleted once it is saved)."""
    accs = members_lib.evaluate(self.trainers, self.group, [m.setup.eval_rows for m in self.runs])
    for m, acc in zip(self.runs, accs):
      if m.fresh:
        m.metrics.write(0, {"eval/accuracy": acc})
        print(f"grpo_jax: {members_lib.label(m, self.runs)}held-out greedy accuracy at GRPO "
              f"step 0: {acc:.1%}", flush=True)
    self.save(0, only=fresh)
    for m in fresh if self.main else ():
      start_lib.warm_start_done(m)

  def _step(self, step: int, bar, evals_ahead: bool) -> str | None:
    """GRPO step step + 1 of every live run: rollouts and update, then the stopping rules,
    metrics, eval and checkpoints. Returns where a signal stopped it, or None."""
    positions = [m.it.position() for m in self.runs]
    t_step = time.perf_counter()
    live = self.failures.live(self.runs)
    try:
      if self.pipe is not None:
        self.group, ms, samples = self.pipe.step(self.group, step, self.c.steps)
      else:
        self.group, ms, samples = members_lib.group_step(
            self.trainers, self.group, [m.setup.rewards for m in self.runs],
            [m.next_rows if m in live else None for m in self.runs], step)
    except Interrupted:  # a signal while a reward waited on its scorer: drop this step
      for m, p in zip(self.runs, positions):
        m.it.restore(p)
      self.save(step)
      return (f"in GRPO step {step + 1} of {self.c.steps}, waiting on a reward's scorer: "
              f"dropped the step, {members_lib.saved(self.runs, step)}")
    self.done = done = step + 1
    if evals_ahead:  # (a run warm-started here compiled its evals for step 0)
      members_lib.compile_evals_ahead(self.trainers, self.group,
                                      [m.setup.eval_rows for m in self.runs])
    for m, m_k in zip(self.runs, ms):
      if m in live:
        m_k["time/step_s"] = time.perf_counter() - t_step  # rollouts and update, for all K
        error = m.count_bad_step(m_k, done, self.c.max_bad_steps, members_lib.label(m, self.runs))
        if error is not None:
          self.failures.record(m, error, done)
    if self.c.eval_every and done % self.c.eval_every == 0 or done == self.c.steps:
      accs = members_lib.evaluate(self.trainers, self.group,
                                  [m.setup.eval_rows for m in self.runs])
      for m_k, acc in zip(ms, accs):
        if m_k is not None:
          m_k["eval/accuracy"] = acc
    self._write(ms, samples, done, bar)
    if done % self.c.checkpoint_every == 0 or done == self.c.steps:
      self.save(done)
    if hosts.any_(self.stop.requested()):  # every process stops at the same step
      self.save(done)
      return f"in GRPO step {done} of {self.c.steps}: {members_lib.saved(self.runs, done)}"
    return None

  def _write(self, ms, samples, done: int, bar) -> None:
    """The step's metrics and samples in each live run's files, the progress bar's figures,
    and the rewards' health (a run whose rewards went missing for too long fails)."""
    live = self.failures.live(self.runs)
    for m, m_k, samples_k in zip(self.runs, ms, samples):
      if m in live:
        m.metrics.write(done, m_k)
        m.samples.write(done, samples_k)
    bar.set_postfix(members_lib.postfix([m_k for m, m_k in zip(self.runs, ms) if m in live]))
    for m, m_k in zip(self.runs, ms):  # before the save: its checkpoint holds the streaks
      if m not in live:
        continue
      try:
        m.health.update(done, m_k)  # warns; raises after too many steps with a reward missing
      except MissingRewardsError as e:
        self.save(done, only=[m])
        self.failures.record(m, e, done)

  def close(self) -> None:
    gc.unfreeze()  # run_group may be called again in this process (tests, sweeps)
    if self.pipe is not None:
      self.pipe.close()
    self.shared_interrupt.stop()
    for m in self.runs:
      m.close()

  def finish(self, stopped: str | None) -> list[dict]:
    """The summaries and exports (a run stopped early: its summary); then, if a signal stopped
    the loop before train.steps, interrupts.Stopped."""
    finished = self.done >= self.c.steps  # a signal in the last step: its export stops at once
    if finished and hosts.count() == 1:  # (several processes take part in the export: not cut)
      self.stop.abortable(f"in the final export: the checkpoint of step {self.done} is kept, "
                          "and final_model/ is whole or absent; run the same command to export it")
    summaries = export.finish_all(self.runs, self.trainers, self.group, self.failures,
                                     finished, self.done, self.main)
    self.stop.abortable(None)
    if stopped is not None and not finished:  # (a run that got to train.steps is exported)
      raise self.stop.stopped(f"{stopped}; run the same command to resume")
    return summaries
