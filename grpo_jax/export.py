"""A run's end: its summary, its exported model (final_model/; with LoRA the merged model and
final_adapter/ in PEFT's format) and its plots.

    summaries = export.finish_all(runs, trainers, group, failures, finished, done, main)
"""

from __future__ import annotations

import os

from grpo_jax import hosts, logging_io, plots, storage, workdir_files

BASE_DIR = workdir_files.BASE_DIR


def _finish(m, trainer, params, ref, finished: bool, done: int, main: bool) -> dict:
  """The run's summary and exported model (LoRA: the merged model, and the adapter in PEFT's
  format)."""
  s, policy = m.setup, trainer.policy_type
  # What is exported: the params, or with LoRA the adapters and the base they merge into.
  # Several processes: every one takes part in gathering them, process 0 writes.
  exported = policy.exported(params, ref)
  final_params = hosts.fetch(exported) if finished and hosts.count() > 1 else exported
  if not main:
    return {}
  summary = logging_io.write_summary(s.workdir, stopped_at=None if finished else done,
                                     eval_examples=len(s.eval_rows))
  if finished:
    gen = s.generation_config or {"eos_token_id": s.stop_ids,
                                  "pad_token_id": s.tokenizer.pad_token_id}
    policy.save(storage.path(s.workdir), final_params, s.cfg, generation_config=gen,
                tokenizer=s.tokenizer, base_model=_base_model_name(m.config, s.workdir))
  return summary


def _base_model_name(config, workdir) -> str:
  """What a LoRA adapter's adapter_config.json names as its base: the warm-started base's
  directory, else the model checkpoint (empty for a random initialisation)."""
  if config.sft.steps:
    return os.path.join(workdir, BASE_DIR)
  return "" if config.model.random_init else str(config.model.checkpoint)


def finish_all(members, trainers, group, failures, finished: bool, done: int,
               main: bool) -> list[dict]:
  """Each member's summary and export (a failed member's: its error). The plots (on a signal
  every second counts: `python -m grpo_jax.plots` draws them later), a group's drawn by other
  processes while the models are exported."""
  summaries = []
  plotted = [m.workdir for m in failures.live(members)] if finished and main else []
  with plots.drawing(plotted):
    for k, m in enumerate(members):
      if m in failures:
        summaries.append({"failed": str(failures.errors[m.workdir])} if main else {})
        continue
      state, ref = group.member(k)
      summaries.append(_finish(m, trainers[k], state["params"], ref, finished, done, main))
  return summaries
