"""The GRPO program: `run(config, workdir)` builds the run, then loops: rollouts (host:
sample, decode, reward) → one compiled train step (advantages, reference pass, μ updates) →
metrics, samples, eval and checkpoints at their cadence; plots, summary and the exported model
at the end.

Resuming is automatic: a workdir holding a checkpoint continues from it. Every source of
randomness is a pure function of (seed, step) and the data order of (seed, epoch), so on one
machine a resumed run reproduces an uninterrupted one bit for bit.

Files in the workdir: see README ("What a run writes").
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from grpo_jax import (checkpoint, compile_cache, data, grpo, hosts, inputs, logging_io, plots,
                      rollout, sampler as sampler_lib, sft, sharding, storage,
                      tokenizer as tokenizer_lib, train_step, validate)
from grpo_jax.agent import rollout as agent_rollout, traces as agent_traces
from grpo_jax.errors import UserError
from grpo_jax.models import qwen, weights
from grpo_jax.rewards import Interrupted, MissingRewardsError, RewardHealth, build_rewards, probe



class TooManyBadSteps(UserError):
  """Consecutive non-finite steps: a setting (usually optim.lr) to change, not a crash."""


# --- the program -------------------------------------------------------------------------------

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
  interrupt: threading.Event  # set on SIGTERM: a reward waiting on its scorer gives up
  cfg: qwen.QwenConfig
  generation_config: dict | None


def setup(config, workdir: str) -> Setup:
  """Validates the config, writes config.json, loads data and tokenizer, builds and probes the
  rewards, reads the model config (no weights). Shared by run and grpo_jax.vmapped.

  With several processes, process 0 writes the workdir's files (config.json, a synthetic
  dataset, the tiny tokenizer) and the others read them once it has."""
  root = storage.path(workdir)  # a local directory or a gs:// URL
  workdir = os.fspath(root)
  validate.validate(config, jax.device_count())
  validate.validate_processes(config, jax.device_count(), hosts.count())
  compile_cache.enable(config.train.compilation_cache)  # before anything compiles
  main = hosts.is_main()
  if main:
    root.mkdir(parents=True, exist_ok=True)
    storage.write_text(root / "config.json", config.to_json_best_effort(indent=2))
    train_rows, eval_rows = inputs.datasets(config, workdir)
    tokenizer, stop_ids = inputs.tokenizer(config, workdir, train_rows)
  hosts.barrier("setup: process 0 wrote the workdir's inputs")
  if not main:
    train_rows, eval_rows = inputs.datasets(config, workdir, build=False)
    tokenizer, stop_ids = inputs.tokenizer(config, workdir, train_rows, build=False)
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
  return Setup(workdir, train_rows, eval_rows, sft_eval_rows, tokenizer, stop_ids, rewards,
               interrupt, cfg, generation_config)


def run(config, workdir: str) -> dict:
  s = setup(config, workdir)
  workdir, train_rows, eval_rows, sft_eval_rows = (s.workdir, s.train_rows, s.eval_rows,
                                                   s.sft_eval_rows)
  tokenizer, stop_ids, rewards, interrupt = s.tokenizer, s.stop_ids, s.rewards, s.interrupt
  cfg, generation_config = s.cfg, s.generation_config
  mesh = sharding.make_mesh(tuple(config.mesh))
  trainer = Trainer(config, cfg, mesh, tokenizer, stop_ids, interrupt=interrupt)
  num_params = sum(x.size for x in jax.tree.leaves(qwen.abstract_params(cfg)))
  print(f"grpo_jax: {cfg.model_type} {cfg.num_layers}x{cfg.hidden_size}, "
        f"{num_params / 1e6:.2f}M params, "
        f"{len(train_rows)} train / {len(eval_rows)} eval prompts"
        f"{f' / {len(sft_eval_rows)} warm-start validation' if sft_eval_rows else ''}, "
        f"mesh {dict(mesh.shape)}, "
        f"workdir {workdir}, "
        f"compilation cache {jax.config.jax_compilation_cache_dir or 'off'}", flush=True)

  # The latest checkpoint whose files pass their checksums; damaged newer ones are skipped.
  restored = checkpoint.resume(workdir, trainer.abstract_checkpoint())
  if restored is None:
    params = inputs.initial_params(config, cfg, mesh)
    if config.sft.steps:
      params = sft.run_sft(config, trainer, params, train_rows, sft_eval_rows)
    state = trainer.init_state(params)
    ref_params = trainer.reference(params) if grpo.needs_reference(config.loss) else None
    del params  # the state and the reference are copies; the loaded params would only hold memory
    start = 0
    it = data.PromptIterator(len(train_rows), config.train.prompts_per_step, config.seed)
  else:
    state, ref_params = restored.state["train"], restored.state.get("ref")
    start = restored.step
    it = data.PromptIterator(len(train_rows), config.train.prompts_per_step, config.seed,
                             position=restored.data_position)
    print(f"grpo_jax: resumed from step {start}", flush=True)

  resume_step = -1 if restored is None else start
  main = hosts.is_main()  # the one process that writes the run's files
  metrics_writer = logging_io.MetricsWriter(
      workdir, resume_step=resume_step, tensorboard=config.train.tensorboard,
      wandb=config.train.wandb) if main else logging_io.NullWriter()
  samples_writer = (logging_io.SamplesWriter(workdir, resume_step=resume_step) if main
                    else logging_io.NullWriter())
  stop = {"requested": False}
  previous = signal.signal(signal.SIGTERM,
                           lambda *_: (stop.update(requested=True), interrupt.set()))
  ckpt = checkpoint.Checkpointer(workdir, max_to_keep=config.train.keep_checkpoints)

  def save(step):
    ckpt_state = {"train": state}
    if ref_params is not None:
      ckpt_state["ref"] = ref_params
    ckpt.save(step, ckpt_state, it.position())

  done = start
  # What setup built lives for the run (data, tokenizer, modules): frozen out of the cyclic
  # collector's view, a full collection walks only what the steps allocate. In the first step
  # of benchmarks/trl_step.py's small workload (its programs trace then) the collector took
  # 0.20 s over ~340,000 setup objects, 0.04 s with them frozen.
  gc.freeze()
  try:
    if restored is None:
      acc = trainer.evaluate(state["params"], eval_rows, ref_params)
      metrics_writer.write(0, {"eval/accuracy": acc})
      print(f"grpo_jax: held-out greedy accuracy at GRPO step 0: {acc:.1%}", flush=True)
      save(0)
    bad = 0
    health = RewardHealth(rewards, config.train.max_missing_reward_steps,
                          log=lambda line: tqdm.write(line, file=sys.stderr))
    bar = tqdm(range(start, config.train.steps), initial=start, total=config.train.steps,
               desc="grpo", dynamic_ncols=True, mininterval=2.0, disable=not main)
    for step in bar:
      position = it.position()
      try:
        new_state, m, samples = trainer.grpo_step(
            state, ref_params, lambda: [train_rows[i] for i in it.next_indices()], rewards, step)
      except Interrupted:  # SIGTERM while a reward waited on its scorer: drop this step
        it.restore(position)
        save(step)
        print(f"grpo_jax: SIGTERM: saved step {step}, exiting", flush=True)
        break
      if m["step/skipped"]:  # the train step left the state unchanged
        bad += 1
        if bad >= config.train.max_bad_steps:
          raise TooManyBadSteps(
              f"{bad} consecutive non-finite steps up to step {step + 1} (train.max_bad_steps); "
              f"try a lower optim.lr or optim.max_grad_norm. The last good checkpoint is in "
              f"{checkpoint.checkpoint_dir(workdir)}")
      else:
        bad = 0
      state = new_state
      done = step + 1
      if config.train.eval_every and done % config.train.eval_every == 0 or done == (
          config.train.steps):
        m["eval/accuracy"] = trainer.evaluate(state["params"], eval_rows, ref_params)
      metrics_writer.write(done, m)
      samples_writer.write(done, samples)
      postfix = {"reward": f"{m['reward/total/mean']:.3f}"}
      if "reward/math_accuracy/mean" in m:
        postfix["acc"] = f"{m['reward/math_accuracy/mean']:.2f}"
      if "eval/accuracy" in m:
        postfix["eval"] = f"{m['eval/accuracy']:.3f}"
      bar.set_postfix(postfix)
      if done % config.train.checkpoint_every == 0 or done == config.train.steps:
        save(done)
      try:
        health.update(done, m)  # warns; raises after too many steps with a reward missing
      except MissingRewardsError:
        save(done)
        raise
      if hosts.any_(stop["requested"]):  # every process stops at the same step
        save(done)
        print(f"grpo_jax: SIGTERM: saved step {done}, exiting", flush=True)
        break
  finally:
    gc.unfreeze()  # run() may be called again in this process (tests, sweeps)
    ckpt.close()
    metrics_writer.close()
    signal.signal(signal.SIGTERM, previous)

  finished = done >= config.train.steps  # a SIGTERM in the last step still finishes the run
  # Several processes: every one takes part in gathering the params, process 0 writes.
  final_params = hosts.fetch(state["params"]) if finished and hosts.count() > 1 else (
      state["params"])
  if not main:
    return {}
  summary = logging_io.write_summary(workdir, stopped_at=None if finished else done,
                                     eval_examples=len(eval_rows))
  if finished:  # on SIGTERM every second counts; `python -m grpo_jax.plots` draws it later
    plots.plot_metrics(workdir)
  if generation_config is None:
    generation_config = {"eos_token_id": stop_ids, "pad_token_id": tokenizer.pad_token_id}
  if finished:
    with storage.local_dir(storage.path(workdir) / "final_model") as out:
      weights.save_checkpoint(final_params, cfg, out, generation_config=generation_config,
                              tokenizer=tokenizer)
  return summary


# --- one GRPO step ------------------------------------------------------------------------------

class Trainer:
  """The compiled pieces of a run (sampler, train step) and one GRPO step."""

  def __init__(self, config, cfg: qwen.QwenConfig, mesh, tokenizer, stop_ids, interrupt=None):
    self.config, self.cfg, self.mesh, self.tokenizer = config, cfg, mesh, tokenizer
    optim = config.optim.copy_and_resolve_references()
    if optim.schedule == "cosine" and not optim.total_steps:
      # The schedule counts optimizer updates: μ per GRPO step.
      optim.total_steps = config.train.steps * config.loss.num_iterations
    self.optim = optim
    s, valid = config.sampling, tokenizer_lib.valid_vocab_size(tokenizer)
    model = qwen.Qwen(cfg, dtype=jnp.dtype(optim.compute_dtype),
                      param_dtype=jnp.dtype(optim.param_dtype))
    self.sampler = sampler_lib.Sampler(
        model, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        max_new_tokens=s.max_new_tokens, stop_ids=stop_ids,
        buckets=tuple(config.data.prompt_buckets), valid_vocab_size=valid,
        pad_id=tokenizer.pad_token_id, mesh=mesh)
    # Multi-turn runs (config.agent.enabled): trajectories with tools instead of completions.
    # `interrupt` (SIGTERM) stops a wait on an agent role's server.
    self.agent = agent_rollout.Agent(config, tokenizer, self.sampler, interrupt) if (
        config.agent.enabled) else None
    self.step_fn = train_step.TrainStep(
        cfg, config.loss, optim, mesh, temperature=s.temperature, valid_vocab_size=valid,
        max_completion_length=self.agent.room if self.agent else s.max_new_tokens,
        group_size=s.num_generations, reward_weights=config.rewards.weights,
        max_turns=config.agent.max_turns if self.agent else None)
    self.accuracy = rollout.accuracy_reward(config)
    self.base_key = jax.random.key(config.seed)

  def init_state(self, params):
    return train_step.create_train_state(params, self.cfg, self.optim, self.mesh)

  def reference(self, params):
    """The frozen reference (loss.beta > 0): params in train_step.reference_dtype."""
    return train_step.reference_params(params, self.cfg, self.optim, self.mesh)

  def abstract_checkpoint(self):
    abstract = {"train": train_step.abstract_state(self.cfg, self.optim, self.mesh)}
    if grpo.needs_reference(self.config.loss):
      abstract["ref"] = train_step.abstract_reference(self.cfg, self.optim, self.mesh)
    return abstract

  def evaluate(self, params, rows, ref_params=None) -> float:
    if self.agent:  # ref_params: for an agent's 'reference' role
      return self.agent.evaluate(params, rows, self.accuracy, ref_params)
    return rollout.evaluate(self.config, self.sampler, self.tokenizer, params, rows,
                            self.accuracy)

  def sft_examples(self, rows):
    """The warm start's (prompt ids, completion ids, loss masks): reference solutions, or for
    an agent, traces that call its tools (grpo_jax.agent.traces)."""
    if self.agent:
      return agent_traces.examples(self.agent, rows)
    return sft.examples(self.config, self.tokenizer, rows)

  def _compiling_ahead(self, next_rows, state, ref_params, num_rewards):
    """next_rows, which also starts compiling the train program for its first rows' likely
    batch (their longest completion at max_new_tokens) while they are sampled: the first
    step then takes about the longer of sampling and compiling, not their sum."""
    def first_rows():
      rows = next_rows()
      try:
        layout = rollout.batch_layout(self.config, self.tokenizer, rows, num_rewards)
      except Exception:  # noqa: BLE001 - a head start only: sampling these rows reports it
        return rows
      self.step_fn.precompile(state, layout, ref_params)
      return rows

    calls = iter([first_rows])
    return lambda: next(calls, next_rows)()

  def grpo_step(self, state, ref_params, next_rows, rewards, step):
    """One GRPO step: rollouts (host), then one compiled program on the device: advantages,
    reference log-probs and the loss.num_iterations updates. next_rows() returns the next
    train.prompts_per_step dataset rows. Returns (state, metrics, samples)."""
    cfg = self.config
    g = cfg.sampling.num_generations
    key = jax.random.fold_in(self.base_key, step)
    params = state["params"]
    if self.agent:
      sample_fn = lambda rows, k: self.agent.sample_and_score(params, rows, rewards, k,
                                                              ref_params=ref_params)
    else:
      sample_fn = lambda rows, k: rollout.sample_and_score(cfg, self.sampler, self.tokenizer,
                                                           params, rows, rewards, k)
    if not (self.agent or self.step_fn.num_traces):
      next_rows = self._compiling_ahead(next_rows, state, ref_params, len(rewards))
    batch_r, m = rollout.collect(cfg, sample_fn, next_rows, key)
    t0 = time.perf_counter()
    host = batch_r.train_batch(cfg, self.tokenizer.pad_token_id)
    # Host arrays: checked here without a device round trip, then uploaded once, by the jitted
    # step's input shardings (the batch split over data × fsdp).
    state, train_m, adv_B = self.step_fn(state, host, ref_params)
    train_m, adv_B = hosts.fetch((train_m, adv_B))
    m.update({k: float(v) for k, v in train_m.items()})
    m["time/train_s"] = time.perf_counter() - t0
    k = min(cfg.train.samples_per_step, len(batch_r.rows))
    texts = batch_r.trajectories or batch_r.texts
    samples = [{"prompt": batch_r.prompts[p], "completion": texts[p * g],
                "rewards": {r.name: float(batch_r.reward_BR[p * g, j])
                            for j, r in enumerate(rewards)},
                "advantage": float(adv_B[p * g]),
                "gold": data.gold_answer(batch_r.rows[p]["answer"])} for p in range(k)]
    return state, m, samples
