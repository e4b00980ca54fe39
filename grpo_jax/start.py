"""A run's start: its state resumed from its latest usable checkpoint, or built by the warm
start (grpo_jax.sft); its end is grpo_jax.export.

    step, states, refs = start.start(runs, trainers, stop)   # one common step for a group

Resuming is automatic: a workdir holding a checkpoint continues from it, with the stopping
rules' counts (runs.Run.counters). A resume with other settings goes on with a warning naming
each change (config.config_changes); one with another seed or dataset size, other shapes, or a
checkpoint past train.steps stops with a checkpoint.RestoreError.
"""

from __future__ import annotations

from grpo_jax import (checkpoint, config as config_lib, data, grpo, hosts, inputs,
                      members as members_lib, sft, storage, workdir_files)
from grpo_jax.errors import warn
from grpo_jax.models import weights

BASE_DIR = workdir_files.BASE_DIR


def warm_start_done(m) -> None:
  """Deletes run m's interrupted warm start's checkpoint (what a restart would have resumed
  from) once GRPO's step 0 is saved: from then on a restart resumes from that."""
  sft.delete_checkpoint(m.workdir, m.ckpt)


def start(runs, trainers, stop=None):
  """Each run's state at one common step: resumed from its latest usable checkpoint, or
  warm-started (a run without one; stop: its interrupts, which save the warm start's progress
  in the run's workdir, resumed from there). Returns (start step, states, references): the
  frozen params, the reference or a LoRA run's base (one base for a group's LoRA members)."""
  step, restored = members_lib.restore_all(runs, trainers[0].abstract_checkpoint())
  states, refs = [], []
  for m, r, trainer in zip(runs, restored, trainers):
    if r is None:
      state, ref = _fresh(m, trainer, stop)
    else:
      state, ref = _resumed(m, r, trainer, members_lib.label(m, runs))
    states.append(state)
    shared = trainer.policy_type.members_share_frozen and refs
    refs.append(members_lib.shared_base(runs, refs, m, ref) if shared else ref)
  return step, states, refs


def _fresh(m, trainer, stop):
  """A run without a checkpoint: its initial params, warm-started (sft.steps > 0), as the train
  state and frozen params; its data order from the start."""
  c, s = m.config, m.setup
  policy = trainer.policy_type
  warm = c.sft.steps and sft.has_checkpoint(m.workdir)  # (holds the params)
  params = None if warm else inputs.initial_params(c, s.cfg, trainer.mesh)
  if c.sft.steps:
    params = sft.run_sft(c, sft.Model(s.cfg, trainer.mesh, trainer.rollout, trainer.evaluate),
                         params, s.train_rows, s.sft_eval_rows, workdir=m.workdir, stop=stop)
    if not policy.frozen_in_checkpoint:  # LoRA's base: kept for resuming and for the export
      host_params = hosts.fetch(params) if hosts.count() > 1 else params
      if hosts.is_main():
        with storage.local_dir(storage.path(m.workdir) / BASE_DIR, whole=True) as out:
          weights.save_checkpoint(host_params, s.cfg, out, tokenizer=s.tokenizer)
      del host_params
  state = trainer.init_state(params)
  ref = trainer.reference(params) if policy.needs_frozen(grpo.frozen_reference(c.loss)) else None
  m.it = data.PromptIterator(len(s.train_rows), c.train.prompts_per_step, c.seed)
  m.fresh = True
  return state, ref


def _resumed(m, r, trainer, label: str):
  """A run resumed from its checkpoint r: its state, frozen params, data position and the
  stopping rules' counts; refused (RestoreError) for a checkpoint past train.steps or of
  another seed or dataset."""
  c, s = m.config, m.setup
  where = f"{checkpoint.checkpoint_dir(m.workdir)}/{r.step}"
  if r.step > c.train.steps:
    raise checkpoint.RestoreError(
        f"{where}: the workdir's run got to step {r.step}, past train.steps={c.train.steps}; "
        f"set train.steps >= {r.step}, or use a new workdir to train for {c.train.steps}")
  try:
    m.it = data.PromptIterator(len(s.train_rows), c.train.prompts_per_step, c.seed,
                               position=r.data_position)
  except ValueError as e:  # another seed or dataset than the checkpoint's
    raise checkpoint.RestoreError(f"{where}: {e}; run with the config it was saved with, "
                                  "or use a new workdir") from None
  # The stopping rules' counts (zeros where a checkpoint holds none).
  m.bad = int(r.counters.get("bad_steps", 0))
  m.streaks = dict(r.counters.get("reward_streaks", {}))
  m.in_flight = r.in_flight  # a pipelined run's next batch, sampled before the checkpoint
  changes = config_lib.config_changes(s.previous_config, c)
  if changes:
    warn(f"{where}: resuming with settings changed since the workdir's config.json was "
         f"written: {'; '.join(changes)}. The steps up to {r.step} ran with the old values; "
         "config.json now holds the new ones")
  ref = (r.state.get("ref") if trainer.policy_type.frozen_in_checkpoint
         else _lora_base(m, trainer))
  print(f"grpo_jax: {label}resumed from step {r.step}", flush=True)
  return r.state["train"], ref


def _lora_base(m, trainer):
  """A resumed LoRA run's frozen base: the warm-started one it wrote (BASE_DIR), or the initial
  model, exactly as the run built it."""
  c = m.config
  if c.sft.steps:
    where = storage.path(m.workdir) / BASE_DIR
    if not where.exists():
      raise checkpoint.RestoreError(
          f"{where}: missing; a LoRA run with a warm start (sft.steps={c.sft.steps}) keeps its "
          "base there, and its checkpoints hold only the adapters")
    params, _ = weights.load_checkpoint(storage.local_copy(where),
                                        param_dtype=c.optim.param_dtype, mesh=trainer.mesh)
  else:
    params = inputs.initial_params(c, m.setup.cfg, trainer.mesh)
  return trainer.reference(params)
