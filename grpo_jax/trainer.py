"""The compiled pieces of a run: its sampler, rollout (single-turn or the agent's) and train
step, and its policy type (grpo_jax.policy: full fine-tuning or LoRA), which says how its
train state, frozen params and sampled policy are made.

    trainer = trainer_lib.Trainer(config, cfg, mesh, tokenizer, stop_ids)
    state, metrics, samples = trainer.grpo_step(state, ref, next_rows, rewards, step)
"""

from __future__ import annotations

import jax.numpy as jnp

from grpo_jax import (config as config_lib, grpo, members, policy as policy_lib, rollout,
                      sampler as sampler_lib, tokenizer as tokenizer_lib, train_step)
from grpo_jax.agent import rollout as agent_rollout
from grpo_jax.models import lora as lora_lib, qwen


class Trainer:
  """The compiled pieces of a run (sampler, rollout, train step); grpo_step is one run's GRPO
  step (members.group_step with K = 1)."""

  def __init__(self, config, cfg: qwen.QwenConfig, mesh, tokenizer, stop_ids, interrupt=None):
    self.config, self.cfg, self.mesh, self.tokenizer = config, cfg, mesh, tokenizer
    s, valid = config.sampling, tokenizer_lib.valid_vocab_size(tokenizer)
    self.stop_ids = stop_ids
    self.sampler = self.sampler_on(mesh)
    # The one rollout interface (grpo_jax.rollout): single-turn completions, or for
    # config.agent.enabled multi-turn trajectories with tools. `interrupt` (SIGTERM) stops a
    # wait on an agent role's server.
    self.rollout = (agent_rollout.Agent(config, tokenizer, self.sampler, interrupt)
                    if config.agent.enabled else rollout.SingleTurn(config, tokenizer,
                                                                    self.sampler))
    self.optim = config_lib.optim_settings(config)
    # LoRA (config.model.lora.rank > 0): the state trains adapters on a frozen base, which is
    # also the reference policy (adapters off); else full fine-tuning.
    self.policy_type = policy_lib.of(lora_settings(config))
    self.step_fn = train_step.TrainStep(
        cfg, config.loss, self.optim, mesh, temperature=s.temperature, valid_vocab_size=valid,
        max_completion_length=self.rollout.completion_width,
        group_size=config_lib.group_size(config), reward_weights=config.rewards.weights,
        max_turns=self.rollout.max_turns, policy=self.policy_type)
    self.accuracy = rollout.accuracy_reward(config)

  def sampler_on(self, mesh) -> sampler_lib.Sampler:
    """The run's sampler, its batch split over `mesh` (the train mesh, or train.sample_devices'
    sampling mesh: grpo_jax.pipeline)."""
    c, s = self.config, self.config.sampling
    return sampler_lib.Sampler(
        qwen.build(self.cfg, dtype=c.optim.compute_dtype, param_dtype=c.optim.param_dtype),
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        max_new_tokens=s.max_new_tokens, stop_ids=self.stop_ids,
        buckets=tuple(c.data.prompt_buckets),
        valid_vocab_size=tokenizer_lib.valid_vocab_size(self.tokenizer),
        pad_id=self.tokenizer.pad_token_id, mesh=mesh, compact_rows=s.compact_rows)

  def hparams(self, config):
    """A run's train-step hyperparameters (its lr, β, ε, ε_high, reward weights and LoRA
    scale)."""
    return train_step.hparams(config.loss, config.optim, config.rewards.weights,
                              policy_lib.of(lora_settings(config)))

  def init_state(self, params):
    """The train state from the starting params: over them (full fine-tuning), or over fresh
    adapters (LoRA; PEFT's initialisation from the run's seed, b = 0)."""
    trainable = self.policy_type.init_trainable(params, self.cfg, self.config.seed,
                                                jnp.dtype(self.optim.param_dtype))
    return train_step.create_train_state(trainable, self.cfg, self.optim, self.mesh,
                                         self.policy_type, self.config.loss)

  def reference(self, params):
    """The frozen params: the reference (loss.beta > 0) or LoRA's base (always), in
    train_step.reference_dtype (LoRA: int8 kernels where model.lora.quantize says)."""
    return train_step.reference_params(params, self.cfg, self.optim, self.mesh,
                                       self.policy_type)

  def policy(self, params, frozen):
    """What the sampler runs: the params, or with LoRA the base with the adapters merged into
    its target kernels (model.lora.merge_for_sampling), or beside them (a group's K adapters:
    members.policy)."""
    return self.policy_type.sampled(params, frozen)

  def abstract_checkpoint(self):
    """What a checkpoint holds: the train state, and the reference where the policy keeps it
    there (full fine-tuning with β > 0; a LoRA base is the model or BASE_DIR). A reference that
    follows the policy (loss.sync_ref_model) is in the train state."""
    abstract = {"train": train_step.abstract_state(self.cfg, self.optim, self.mesh,
                                                   self.policy_type, self.config.loss)}
    if self.policy_type.frozen_in_checkpoint and self.policy_type.needs_frozen(
        grpo.frozen_reference(self.config.loss)):
      abstract["ref"] = train_step.abstract_reference(self.cfg, self.optim, self.mesh,
                                                      self.policy_type)
    return abstract

  def evaluate(self, variables, rows, ref_params=None) -> float:
    """Greedy pass@1 on rows of what the sampler runs (policy: model.apply's variables;
    ref_params: for an agent's 'reference' role)."""
    return self.rollout.evaluate(variables, rows, self.accuracy, ref_params)

  def grpo_step(self, state, ref_params, next_rows, rewards, step):
    """One run's GRPO step (members.group_step with K = 1): next_rows() returns the next
    train.prompts_per_step dataset rows. Returns (state, metrics, samples)."""
    group = members.Group(1, state, ref_params, self.hparams(self.config))
    group, ms, samples = members.group_step([self], group, [rewards], [next_rows], step)
    return group.state, ms[0], samples[0]


def lora_settings(config) -> lora_lib.LoraConfig | None:
  """config.model.lora as a LoraConfig, or None (rank 0, or a config without the block)."""
  return lora_lib.LoraConfig.from_config(config.model.get("lora"))
