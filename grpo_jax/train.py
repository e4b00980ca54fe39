"""The GRPO outer loop: sample -> reward -> advantages -> num_iterations updates, with eval,
checkpoints, metrics, samples and plots. `run(config, workdir)` is the whole program.

Resuming is automatic: a workdir holding a checkpoint continues from it. Every source of
randomness is a pure function of (seed, step) and the data order of (seed, epoch), so on one
machine a resumed run reproduces an uninterrupted one bit for bit.

Files in the workdir: see README ("What a run writes").
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from grpo_jax import (checkpoint, data, grpo, logging_io, plots, rollout, sampler as sampler_lib,
                      sft, sharding, synthetic, tokenizer as tokenizer_lib, train_step, validate)
from grpo_jax.errors import UserError, warn
from grpo_jax.models import qwen, weights
from grpo_jax.rewards import Interrupted, MissingRewardsError, RewardHealth, build_rewards, probe, score

SUMMARY_FILE = "summary.json"


class TooManyBadSteps(UserError):
  """Consecutive non-finite steps: a setting (usually optim.lr) to change, not a crash."""


# --- set-up ------------------------------------------------------------------------------------

def _tokenizer(config, workdir, train_rows):
  name = config.model.tokenizer or config.model.checkpoint
  if name == "tiny":
    # BPE merges learnt from the training problems (deterministic), plus the chat roles.
    corpus = [r["question"] for r in train_rows] + [r["answer"] for r in train_rows]
    corpus += ["user assistant system"] * 100
    name = tokenizer_lib.build_tiny_tokenizer(os.path.join(workdir, "tokenizer"), corpus,
                                              config.model.tiny.vocab_size)
  field = "config.model.tokenizer" if config.model.tokenizer else "config.model.checkpoint"
  tok = tokenizer_lib.load_tokenizer(name, field)
  return tok, tokenizer_lib.stop_ids(tok, name)


def _datasets(config, workdir):
  d = config.data
  if d.source == "synthetic":
    spec = synthetic.ProblemSpec(num_operands=d.synthetic_operands, digits=d.synthetic_digits)
    source = synthetic.write_splits(os.path.join(workdir, "data"), d.synthetic_train,
                                    d.synthetic_test, seed=config.seed, spec=spec)
  else:
    source = d.source
  kw = dict(config_name=d.config_name or None, question_field=d.question_field,
            answer_field=d.answer_field)
  return (data.load_rows(source, d.train_split, **kw), data.load_rows(source, d.eval_split, **kw))


def _model_config(config, tokenizer):
  """(QwenConfig, generation_config or None) without loading any weights."""
  m = config.model
  if m.random_init:
    t = m.tiny
    # Exactly the tokenizer's ids: no unused rows whose logits would enter the loss's softmax.
    cfg = qwen.QwenConfig(
        vocab_size=len(tokenizer), hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
        tie_word_embeddings=t.tie_word_embeddings, max_position_embeddings=4096)
    generation_config = None
  else:
    path = weights.resolve(m.checkpoint, "config.model.checkpoint")
    cfg, generation_config = weights.read_config(path), weights.read_generation_config(path)
  if cfg.vocab_size < len(tokenizer):
    raise validate.ConfigError(
        f"config.model: the model's vocabulary ({cfg.vocab_size}) is smaller than the "
        f"tokenizer's ({len(tokenizer)}); they do not belong together")
  return cfg, generation_config


def _initial_params(config, cfg, mesh):
  """The starting policy: random (tiny preset) or the checkpoint, placed in its shardings."""
  param_dtype = jnp.dtype(config.optim.param_dtype)
  if config.model.random_init:
    params = qwen.init_params(cfg, jax.random.key(config.seed), param_dtype)
    shard = sharding.param_shardings(qwen.logical_axes(cfg), qwen.abstract_params(cfg), mesh)
    return jax.device_put(params, shard)
  params, _ = weights.load_checkpoint(config.model.checkpoint, param_dtype=param_dtype,
                                      mesh=mesh)
  return params


# --- the program -------------------------------------------------------------------------------

def run(config, workdir: str) -> dict:
  workdir = os.path.abspath(os.path.expanduser(workdir))
  os.makedirs(workdir, exist_ok=True)
  validate.validate(config, jax.device_count())
  (open(os.path.join(workdir, "config.json"), "w")).write(config.to_json_best_effort(indent=2))

  mesh = sharding.make_mesh(tuple(config.mesh))
  train_rows, eval_rows = _datasets(config, workdir)
  tokenizer, stop_ids = _tokenizer(config, workdir, train_rows)
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
  interrupt = threading.Event()  # set on SIGTERM: a reward waiting on its scorer gives up
  rewards = build_rewards(config.rewards, interrupt=interrupt)
  probe_rows = train_rows[:2]  # real questions and gold answers: a working judge grades them
  probe(rewards, rollout.prompt_texts(config, tokenizer, probe_rows),
        [r["answer"] for r in probe_rows], rollout.reward_columns(probe_rows, 1),
        allow_missing=config.rewards.allow_missing)
  cfg, generation_config = _model_config(config, tokenizer)
  trainer = Trainer(config, cfg, mesh, tokenizer, stop_ids)
  num_params = sum(x.size for x in jax.tree.leaves(qwen.abstract_params(cfg)))
  print(f"grpo_jax: {cfg.model_type} {cfg.num_layers}x{cfg.hidden_size}, "
        f"{num_params / 1e6:.2f}M params, "
        f"{len(train_rows)} train / {len(eval_rows)} eval prompts"
        f"{f' / {len(sft_eval_rows)} warm-start validation' if sft_eval_rows else ''}, "
        f"mesh {dict(mesh.shape)}, "
        f"workdir {workdir}", flush=True)

  # The latest checkpoint whose files pass their checksums; damaged newer ones are skipped.
  restored = checkpoint.resume(workdir, trainer.abstract_checkpoint())
  if restored is None:
    params = _initial_params(config, cfg, mesh)
    if config.sft.steps:
      params = sft.run_sft(config, trainer, params, train_rows, sft_eval_rows)
    state = trainer.init_state(params)
    ref_params = params if grpo.needs_reference(config.loss) else None
    start = 0
    it = data.PromptIterator(len(train_rows), config.train.prompts_per_step, config.seed)
  else:
    state, ref_params = restored.state["train"], restored.state.get("ref")
    start = restored.step
    it = data.PromptIterator(len(train_rows), config.train.prompts_per_step, config.seed,
                             position=restored.data_position)
    print(f"grpo_jax: resumed from step {start}", flush=True)

  resume_step = -1 if restored is None else start
  metrics_writer = logging_io.MetricsWriter(
      workdir, resume_step=resume_step, tensorboard=config.train.tensorboard,
      wandb=config.train.wandb)
  samples_writer = logging_io.SamplesWriter(workdir, resume_step=resume_step)
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
  try:
    if restored is None:
      acc = trainer.evaluate(state["params"], eval_rows)
      metrics_writer.write(0, {"eval/accuracy": acc})
      print(f"grpo_jax: held-out greedy accuracy at GRPO step 0: {acc:.1%}", flush=True)
      save(0)
    bad = 0
    health = RewardHealth(rewards, config.train.max_missing_reward_steps,
                          log=lambda line: tqdm.write(line, file=sys.stderr))
    bar = tqdm(range(start, config.train.steps), initial=start, total=config.train.steps,
               desc="grpo", dynamic_ncols=True, mininterval=2.0)
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
        m["eval/accuracy"] = trainer.evaluate(state["params"], eval_rows)
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
      if stop["requested"]:
        save(done)
        print(f"grpo_jax: SIGTERM: saved step {done}, exiting", flush=True)
        break
  finally:
    ckpt.close()
    metrics_writer.close()
    signal.signal(signal.SIGTERM, previous)

  finished = done >= config.train.steps  # a SIGTERM in the last step still finishes the run
  summary = _summary(workdir, stopped_at=None if finished else done)
  if finished:  # on SIGTERM every second counts; `python -m grpo_jax.plots` draws it later
    plots.plot_metrics(workdir)
  if generation_config is None:
    generation_config = {"eos_token_id": stop_ids, "pad_token_id": tokenizer.pad_token_id}
  if finished:
    weights.save_checkpoint(state["params"], cfg, os.path.join(workdir, "final_model"),
                            generation_config=generation_config, tokenizer=tokenizer)
  return summary


def _summary(workdir, stopped_at: int | None = None):
  """summary.json from the eval rows of metrics.jsonl: held-out accuracy at the start and end of
  GRPO and the gain. A run stopped early (SIGTERM) at step `stopped_at` has no end: it reports
  where it stopped and what it measured, and no gain (that needs the completed run)."""
  evals = [r for r in logging_io.read_jsonl(os.path.join(workdir, logging_io.METRICS_FILE))
           if r.get("eval/accuracy") is not None]
  if not evals:
    return {}
  first, last = evals[0], evals[-1]
  summary = {"eval_accuracy_start": first["eval/accuracy"], "start_step": first["step"]}
  if stopped_at is None:
    summary.update(eval_accuracy_end=last["eval/accuracy"], end_step=last["step"])
    summary["eval_accuracy_gain_points"] = 100 * (summary["eval_accuracy_end"]
                                                  - summary["eval_accuracy_start"])
    line = (f"held-out greedy accuracy {first['eval/accuracy']:.1%} (step {first['step']}) -> "
            f"{last['eval/accuracy']:.1%} (step {last['step']}): "
            f"{summary['eval_accuracy_gain_points']:+.1f} points")
  else:
    summary = {"stopped_early": True, "stopped_at_step": stopped_at, **summary}
    line = (f"stopped early at step {stopped_at}; held-out greedy accuracy "
            f"{first['eval/accuracy']:.1%} at step {first['step']}")
    if last["step"] > first["step"]:
      summary.update(eval_accuracy_latest=last["eval/accuracy"], latest_eval_step=last["step"])
      line += f", {last['eval/accuracy']:.1%} at step {last['step']}"
    line += "; the gain is reported when the run completes (run the same command to resume)"
  with open(os.path.join(workdir, SUMMARY_FILE), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"grpo_jax: {line}", flush=True)
  return summary


# --- one GRPO step ------------------------------------------------------------------------------

class Trainer:
  """The compiled pieces of a run (sampler, train step) and one GRPO step."""

  def __init__(self, config, cfg: qwen.QwenConfig, mesh, tokenizer, stop_ids):
    self.config, self.cfg, self.mesh, self.tokenizer = config, cfg, mesh, tokenizer
    optim = config.optim.copy_and_resolve_references()
    if optim.schedule == "cosine" and not optim.total_steps:
      # The schedule counts optimizer updates: μ per GRPO step.
      optim.total_steps = config.train.steps * config.loss.num_iterations
    self.optim = optim
    s, valid = config.sampling, tokenizer_lib.valid_vocab_size(tokenizer)
    self.step_fn = train_step.TrainStep(
        cfg, config.loss, optim, mesh, temperature=s.temperature, valid_vocab_size=valid,
        max_completion_length=s.max_new_tokens, group_size=s.num_generations,
        reward_weights=config.rewards.weights)
    model = qwen.Qwen(cfg, dtype=jnp.dtype(optim.compute_dtype),
                      param_dtype=jnp.dtype(optim.param_dtype))
    self.sampler = sampler_lib.Sampler(
        model, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        max_new_tokens=s.max_new_tokens, stop_ids=stop_ids,
        buckets=tuple(config.data.prompt_buckets), valid_vocab_size=valid,
        pad_id=tokenizer.pad_token_id, mesh=mesh)
    self.accuracy = rollout.accuracy_reward(config)
    self.base_key = jax.random.key(config.seed)

  def init_state(self, params):
    return train_step.create_train_state(params, self.cfg, self.optim, self.mesh)

  def abstract_checkpoint(self):
    abstract = {"train": train_step.abstract_state(self.cfg, self.optim, self.mesh)}
    if grpo.needs_reference(self.config.loss):
      abstract["ref"] = abstract["train"]["params"]
    return abstract

  def evaluate(self, params, rows) -> float:
    return rollout.evaluate(self.config, self.sampler, self.tokenizer, params, rows,
                            self.accuracy)

  def _collect(self, params, next_rows, rewards, key):
    """Rollouts for one step. With train.dynamic_sampling (DAPO), groups whose G rewards are all
    equal (zero advantage: they teach nothing) are set aside and further prompts sampled, up to
    train.max_sampling_rounds rounds in all; a batch still short of prompts_per_step informative
    groups is completed with set-aside groups, so the train step's row count never changes.
    Returns (batch Rollouts, first round's Rollouts, metrics): reward and completion metrics
    describe the first round, an unbiased sample of the policy."""
    cfg = self.config
    g, n = cfg.sampling.num_generations, cfg.train.prompts_per_step
    weights_R = np.asarray(cfg.rewards.weights, np.float32)
    rounds = cfg.train.max_sampling_rounds if cfg.train.dynamic_sampling else 1
    m = {"time/sample_s": 0.0, "time/reward_s": 0.0}
    parts, informative = [], []
    for r in range(rounds):
      part, part_metrics, sampler_metrics, (t_sample, t_reward) = rollout.sample_and_score(
          cfg, self.sampler, self.tokenizer, params, next_rows(), rewards,
          key if r == 0 else jax.random.fold_in(key, r))
      m["time/sample_s"] += t_sample
      m["time/reward_s"] += t_reward
      if r == 0:
        m.update(part_metrics)
        m.update(sampler_metrics)
      parts.append(part)
      informative.append(np.asarray(grpo.informative_groups(
          part.reward_BR, g, weights_R, cfg.loss.reward_aggregation)))
      if not cfg.train.dynamic_sampling or np.concatenate(informative).sum() >= n:
        break
    first, pool, informative = parts[0], rollout.Rollouts.pool(parts), np.concatenate(informative)
    if cfg.train.dynamic_sampling:
      m["sampling/rounds"] = len(parts)
      m["sampling/informative_frac_first_round"] = float(informative[:n].mean())
      m["sampling/filled_groups"] = int(max(0, n - informative.sum()))
      order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])
      pool = pool.take(order[:n], g)
    total = np.nansum(first.reward_BR * weights_R, axis=1)
    m.update({
        "reward/total/mean": float(total.mean()), "reward/total/std": float(total.std()),
        "completion/mean_length": float(first.lengths_B.mean()),
        "completion/max_length": int(first.lengths_B.max()),
        "completion/truncated_frac": float(first.truncated_B.mean()),
    })
    return pool, m

  def grpo_step(self, state, ref_params, next_rows, rewards, step):
    """One GRPO step: rollouts (host), then one compiled program on the device: advantages,
    reference log-probs and the loss.num_iterations updates. next_rows() returns the next
    train.prompts_per_step dataset rows. Returns (state, metrics, samples)."""
    cfg = self.config
    g = cfg.sampling.num_generations
    key = jax.random.fold_in(self.base_key, step)
    batch_r, m = self._collect(state["params"], next_rows, rewards, key)
    t0 = time.perf_counter()
    host = batch_r.device_batch(self.tokenizer.pad_token_id, buckets=cfg.data.prompt_buckets,
                                multiple=cfg.train.pad_multiple,
                                with_truncated=cfg.loss.mask_truncated_completions)
    batch = jax.device_put(host, train_step.batch_shardings(host, self.mesh))  # one upload
    state, train_m, adv_B = self.step_fn(state, batch, ref_params)
    train_m, adv_B = jax.device_get((train_m, adv_B))
    m.update({k: float(v) for k, v in train_m.items()})
    m["time/train_s"] = time.perf_counter() - t0
    k = min(cfg.train.samples_per_step, len(batch_r.rows))
    samples = [{"prompt": batch_r.prompts[p], "completion": batch_r.texts[p * g],
                "rewards": {r.name: float(batch_r.reward_BR[p * g, j])
                            for j, r in enumerate(rewards)},
                "advantage": float(adv_B[p * g]),
                "gold": data.gold_answer(batch_r.rows[p]["answer"])} for p in range(k)]
    return state, m, samples
