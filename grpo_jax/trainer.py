"""The compiled pieces of a run: its sampler, rollout (single-turn or the agent's) and train
step, its LoRA settings, and how its train state, reference and sampled policy are made.

    trainer = trainer_lib.Trainer(config, cfg, mesh, tokenizer, stop_ids)
    state, metrics, samples = trainer.grpo_step(state, ref, next_rows, rewards, step)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax import (config as config_lib, grpo, members, rollout, sampler as sampler_lib,
                      tokenizer as tokenizer_lib, train_step)
from grpo_jax.agent import rollout as agent_rollout
from grpo_jax.models import lora as lora_lib, qwen


class Trainer:
  """The compiled pieces of a run (sampler, rollout, train step); grpo_step is one run's GRPO
  step (members.group_step with K = 1)."""

  def __init__(self, config, cfg: qwen.QwenConfig, mesh, tokenizer, stop_ids, interrupt=None):
    self.config, self.cfg, self.mesh, self.tokenizer = config, cfg, mesh, tokenizer
    s, valid = config.sampling, tokenizer_lib.valid_vocab_size(tokenizer)
    self.sampler = sampler_lib.Sampler(
        qwen.build(cfg, dtype=config.optim.compute_dtype, param_dtype=config.optim.param_dtype),
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        max_new_tokens=s.max_new_tokens, stop_ids=stop_ids,
        buckets=tuple(config.data.prompt_buckets), valid_vocab_size=valid,
        pad_id=tokenizer.pad_token_id, mesh=mesh)
    # The one rollout interface (grpo_jax.rollout): single-turn completions, or for
    # config.agent.enabled multi-turn trajectories with tools. `interrupt` (SIGTERM) stops a
    # wait on an agent role's server.
    self.rollout = (agent_rollout.Agent(config, tokenizer, self.sampler, interrupt)
                    if config.agent.enabled else rollout.SingleTurn(config, tokenizer,
                                                                    self.sampler))
    self.optim = config_lib.optim_settings(config)
    # LoRA (config.model.lora.rank > 0): the state trains adapters on a frozen base, which is
    # also the reference policy (adapters off); None: full fine-tuning.
    self.lora = lora_settings(config)
    self._merge = (jax.jit(functools.partial(lora_lib.merged_kernels, lcfg=self.lora))
                   if self.lora and self.lora.merge_for_sampling else None)
    self.step_fn = train_step.TrainStep(
        cfg, config.loss, self.optim, mesh, temperature=s.temperature, valid_vocab_size=valid,
        max_completion_length=self.rollout.completion_width,
        group_size=config_lib.group_size(config), reward_weights=config.rewards.weights,
        max_turns=self.rollout.max_turns, lora=self.lora)
    self.accuracy = rollout.accuracy_reward(config)

  def hparams(self, config):
    """A run's train-step hyperparameters (its lr, β, ε, ε_high, reward weights and LoRA
    scale)."""
    return train_step.hparams(config.loss, config.optim, config.rewards.weights,
                              lora_settings(config))

  def init_state(self, params):
    """The train state from the starting params: over them (full fine-tuning), or over fresh
    adapters (LoRA; PEFT's initialisation from the run's seed, b = 0)."""
    if self.lora is None:
      return train_step.create_train_state(params, self.cfg, self.optim, self.mesh)
    key = jax.random.fold_in(jax.random.key(self.config.seed), LORA_INIT_STREAM)
    adapters = lora_lib.init(key, self.cfg, self.lora, jnp.dtype(self.optim.param_dtype))
    return train_step.create_train_state(adapters, self.cfg, self.optim, self.mesh, self.lora)

  def reference(self, params):
    """The frozen params: the reference (loss.beta > 0) or LoRA's base (always), in
    train_step.reference_dtype (LoRA: int8 kernels where model.lora.quantize says)."""
    return train_step.reference_params(params, self.cfg, self.optim, self.mesh, self.lora)

  def policy(self, params, frozen):
    """What the sampler runs: the params, or with LoRA the base with the adapters merged into
    its target kernels (model.lora.merge_for_sampling), or beside them (a group's K adapters:
    members.policy)."""
    if self.lora is None:
      return params
    if self.lora.merge_for_sampling:
      return lora_lib.merged_policy(frozen, params, self.lora, self._merge)
    return lora_lib.variables(frozen, params, self.lora)

  def abstract_checkpoint(self):
    abstract = {"train": train_step.abstract_state(self.cfg, self.optim, self.mesh, self.lora)}
    if self.lora is None and grpo.needs_reference(self.config.loss):
      abstract["ref"] = train_step.abstract_reference(self.cfg, self.optim, self.mesh)
    return abstract

  def evaluate(self, params, rows, ref_params=None) -> float:
    """Greedy pass@1 on rows (ref_params: for an agent's 'reference' role)."""
    return self.rollout.evaluate(params, rows, self.accuracy, ref_params)

  def grpo_step(self, state, ref_params, next_rows, rewards, step):
    """One run's GRPO step (members.group_step with K = 1): next_rows() returns the next
    train.prompts_per_step dataset rows. Returns (state, metrics, samples)."""
    group = members.Group(1, state, ref_params, self.hparams(self.config))
    group, ms, samples = members.group_step([self], group, [rewards], [next_rows], step)
    return group.state, ms[0], samples[0]


LORA_INIT_STREAM = 0x10A  # fold_in stream of the seed for the adapters' initialisation


def lora_settings(config) -> lora_lib.LoraConfig | None:
  """config.model.lora as a LoraConfig, or None (rank 0, or a config without the block)."""
  return lora_lib.LoraConfig.from_config(config.model.get("lora"))
