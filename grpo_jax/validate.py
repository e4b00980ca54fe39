"""The one config validator: before anything loads or compiles, each error names the setting.

Each rule is written once, where its subject lives, and checked here for a config:
token_choice.SamplingParams (sampling.temperature through logprobs.check_temperature, top_k, top_p,
min_p), sharding.mesh_shape (mesh), rewards.options.weighted_names (rewards.names,
rewards.weights), grpo.validate_loss_config (loss), models.lora.LoraConfig (model.lora),
train_step.validate_optim_config (optim), data.check_user_template (data.user_template),
logging_io.check_wandb_config (train.wandb_*); the rest are here. The schema, with every
field's default, is grpo_jax/config.py; a field it does not have is refused.
"""

from __future__ import annotations

import math

from grpo_jax import (config as config_lib, data, grpo, logging_io, sharding, token_choice,
                      train_step)
from grpo_jax.errors import UserError
from grpo_jax.models import lora
from grpo_jax.rewards import options as reward_options


class ConfigError(UserError, ValueError):
  """A config field is invalid; the message starts with `config.<field>:`."""


def _check(ok: bool, setting: str, message: str) -> None:
  if not ok:
    raise ConfigError(f"config.{setting}: {message}")


def _named(rule, *args):
  """rule(*args), its ValueError ('<setting>: ...' or '<setting>=...') as a ConfigError."""
  try:
    return rule(*args)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None


def batch_devices(config, num_devices: int) -> int:
  """How many ways the batch is split: the data × fsdp extent of the configured mesh."""
  shape = _named(sharding.mesh_shape, config.mesh, num_devices)
  # A mesh over a subset of the devices is allowed (a 1-device run on an 8-device host), but
  # only a divisor of the device count: (1, 3, 1) on 8 devices is a typo, not a plan.
  _check(num_devices % math.prod(shape) == 0, "mesh",
         f"{tuple(config.mesh)} uses {math.prod(shape)} of the {num_devices} devices, which does "
         f"not divide {num_devices}; use a shape whose product divides it, e.g. "
         f"(1, {num_devices}, 1) or (1, -1, 1)")
  return shape[0] * shape[1]


def check_lora(config, cfg, first_start: bool = True) -> None:
  """model.lora against the model (a QwenConfig): its targets and layers exist there, and on a
  first start an init_from adapter is readable and adapts the same modules with the same ranks
  and scales (weights.CheckpointError naming config.model.lora.init_from; a resumed run has
  its adapters in its checkpoint). Reads no base weights."""
  lcfg = lora.LoraConfig.from_config(config.model.get("lora"))
  if lcfg is None:
    return
  _named(lora.check_model, lcfg, cfg)
  if lcfg.init_from and first_start:
    lora.start_adapters(lcfg, cfg)


def validate(config, num_devices: int) -> None:
  """Raises ConfigError naming the first bad setting of `config` for a run on num_devices."""
  unknown = config_lib.unknown_fields(config)
  _check(not unknown, unknown[0] if unknown else "",
         "no such field in the config schema (grpo_jax/config.py)")
  wrong = config_lib.type_errors(config)  # None or True where a number goes, a section set whole
  if wrong:
    raise ConfigError(f"config.{wrong[0]}")
  s, t, o, lc = config.sampling, config.train, config.optim, config.loss
  g = config_lib.group_size(config)
  _check(isinstance(g, int) and g >= 2, "sampling.num_generations",
         f"must be an int >= 2 (group-relative advantages need a group), got {g!r}")
  _check(s.max_new_tokens >= 1, "sampling.max_new_tokens", f"must be >= 1, got {s.max_new_tokens}")
  try:
    token_choice.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            min_p=s.min_p)
  except ValueError as e:
    raise ConfigError(f"config.sampling.{e}") from None
  _named(grpo.validate_loss_config, lc)
  _named(lora.LoraConfig.from_config, config.model.get("lora"))
  _named(reward_options.weighted_names, config.rewards)

  updates = config_lib.updates_per_run(config)
  # total_steps 0 with the cosine schedule means the run's updates: check the schedule the
  # trainer will run.
  _named(train_step.validate_optim_config, config_lib.optim_settings(config))
  _check(o.schedule != "cosine" or o.total_steps in (0, updates), "optim.total_steps",
         f"leave it 0: the cosine schedule spans the run's {updates} optimizer updates "
         "(train.steps × loss.num_iterations × loss.steps_per_generation)")
  _check(isinstance(t.pad_multiple, int) and t.pad_multiple >= 1, "train.pad_multiple",
         f"must be an int >= 1, got {t.pad_multiple!r}")

  _check(t.prompts_per_step >= 1, "train.prompts_per_step", "must be >= 1")
  slices = lc.steps_per_generation
  _check(t.prompts_per_step % slices == 0, "loss.steps_per_generation",
         f"{slices} updates per generation batch each take whole groups: it must divide "
         f"train.prompts_per_step={t.prompts_per_step}")
  rows = config_lib.rows_per_step(config) // slices  # an update's
  _check(rows % o.grad_accum_steps == 0, "optim.grad_accum_steps",
         f"{o.grad_accum_steps} does not divide the {rows} completions of an update "
         f"(train.prompts_per_step={t.prompts_per_step} × G={g} / "
         f"loss.steps_per_generation={slices})")
  split = batch_devices(config, _train_devices(config, num_devices))
  micro = rows // o.grad_accum_steps
  _check(micro % split == 0, "train.prompts_per_step",
         f"a micro-batch of {micro} completions (prompts_per_step × G / steps_per_generation / "
         f"grad_accum_steps) is not divisible by the {split} devices the mesh "
         f"{tuple(config.mesh)} splits the batch over")
  _check(not (s.compact_rows and split > 1), "sampling.compact_rows",
         f"True needs the batch on one device, but the mesh {tuple(config.mesh)} splits it "
         f"{split} ways (rows move within one device's cache): leave it unset (None)")
  _validate_train(config)
  _check(isinstance(config.rewards.allow_missing, bool), "rewards.allow_missing",
         f"must be True or False, got {config.rewards.allow_missing!r}")
  _validate_sft(config, split)
  if config.model.random_init:
    _check(config.model.tokenizer != "", "model.tokenizer",
           "a randomly initialised model needs a tokenizer ('tiny' or a path)")
  else:
    _check(bool(config.model.checkpoint), "model.checkpoint",
           "set a local directory or hub id (or model.random_init=True)")
  _check(len(config.data.prompt_buckets) >= 1, "data.prompt_buckets", "needs at least one length")
  _named(data.check_user_template, config.data.user_template)
  _validate_agent(config)
  _check(lc.loss_type != "flow_grpo" or config.agent.enabled, "loss.loss_type",
         "'flow_grpo' normalises over an agent's turns: it needs agent.enabled=True")
  _check(not (lc.rollout_is_correction and config.agent.enabled), "loss.rollout_is_correction",
         "multi-turn agent rollouts do not carry the sampler's log-probs it corrects with; set "
         "it False or agent.enabled=False")
  _check(not (lc.sync_ref_model and config.model.lora.rank), "loss.sync_ref_model",
         f"True with LoRA (model.lora.rank={config.model.lora.rank}): its reference is the "
         "frozen base (the adapters off), which nothing may change; set it False, or "
         "model.lora.rank=0 (full fine-tuning)")



def _validate_train(config) -> None:
  """train.*'s counts, cadences and logging settings, and the seed."""
  t = config.train
  _check(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
  _check(t.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1")
  _check(t.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
  _check(t.eval_every >= 0, "train.eval_every", "must be >= 0")
  _check(t.eval_examples >= 0, "train.eval_examples",  # an int: validate's type_errors, first
         f"must be an int >= 0 (0 = the whole eval split), got {t.eval_examples!r}")
  _check(t.samples_per_step >= 0, "train.samples_per_step",
         f"must be >= 0, got {t.samples_per_step}")
  _check(config.seed >= 0, "seed", f"must be >= 0 (numpy's generators refuse < 0), got "
         f"{config.seed}")
  _check(t.eval_batch_size >= 1, "train.eval_batch_size", "must be >= 1")
  _check(t.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1")
  _check(isinstance(t.max_sampling_rounds, int) and t.max_sampling_rounds >= 1,
         "train.max_sampling_rounds", f"must be an int >= 1, got {t.max_sampling_rounds!r}")
  _check(isinstance(t.max_missing_reward_steps, int) and t.max_missing_reward_steps >= 0,
         "train.max_missing_reward_steps", "must be an int >= 0 (0 = only warn)")
  _check(0 <= t.progress_every_s < math.inf, "train.progress_every_s",
         f"must be a number of seconds >= 0 (0 = a line every step), got {t.progress_every_s!r}")
  _named(logging_io.check_wandb_config, t)
  _check(t.members in config_lib.MEMBERS, "train.members",
         f"{t.members!r} is not one of {', '.join(map(repr, config_lib.MEMBERS))}")
  _validate_off_policy(config)


def _validate_off_policy(config) -> None:
  """train.off_policy_steps: 0, or 1 (the pipelined loop splits a rollout into the sampling and
  the host's scoring); an agent's turns sample on the train mesh."""
  n = config.train.off_policy_steps
  _check(n in (0, 1), "train.off_policy_steps",
         f"must be 0 (on-policy) or 1 (one step behind), got {n!r}")
  if n == 0:
    return
  _check(not (config.agent.enabled and config.train.sample_devices), "train.sample_devices",
         "an agent's turns sample on the train mesh (its roles read the reference there): "
         "set it to 0 with agent.enabled=True")


def _train_devices(config, num_devices: int) -> int:
  """The devices the train mesh spans: those train.sample_devices leaves (all where it is 0)."""
  n = config.train.sample_devices
  _check(isinstance(n, int) and not isinstance(n, bool) and n >= 0, "train.sample_devices",
         f"must be an int >= 0 (0 = sampling shares the train mesh), got {n!r}")
  if n == 0:
    return num_devices
  _check(config.train.off_policy_steps == 1, "train.sample_devices",
         f"{n} devices sampling apart from training needs train.off_policy_steps=1 (at 0 "
         "sampling waits for each update anyway); set it to 0 or off_policy_steps to 1")
  _check(n < num_devices, "train.sample_devices",
         f"{n} leaves none of the {num_devices} devices to train on; " +
         (f"use at most {num_devices - 1}" if num_devices > 1 else
          "on one device leave it 0 (sampling shares it)"))
  return num_devices - n


def _validate_sft(config, split: int) -> None:
  """sft.*: the warm start's steps, batch, target and overshoot accuracy."""
  _check(config.sft.steps >= 0, "sft.steps", "must be >= 0")
  if config.sft.steps:
    _validate_sft_batch(config, split)
  _check(0 <= config.sft.target_accuracy <= 1, "sft.target_accuracy",
         f"must be in [0, 1] (0 = run all sft.steps), got {config.sft.target_accuracy}")
  if config.sft.target_accuracy:
    _check(config.sft.eval_every >= 1, "sft.eval_every", "must be >= 1")
    _check(config.sft.eval_examples >= 1, "sft.eval_examples", "must be >= 1")
  o = config.sft.overshoot_accuracy
  _check(o == 0 or config.sft.target_accuracy < o <= 1, "sft.overshoot_accuracy",
         f"must be 0 (off) or in (sft.target_accuracy, 1] = ({config.sft.target_accuracy}, 1], "
         f"got {o}")


def _validate_agent(config) -> None:
  """agent.*, when multi-turn rollouts are on: the tools, turn budgets and roles."""
  a = config.agent
  if not a.enabled:
    return
  from grpo_jax.agent import tools  # pylint: disable=import-outside-toplevel
  unknown = [name for name in a.tools if name not in tools.TOOLS]
  _check(not unknown and len(a.tools) >= 1, "agent.tools",
         f"unknown tools {unknown}; known tools: {list(tools.TOOLS)}")
  for name in ("max_turns", "action_tokens", "observation_tokens", "tool_workers"):
    _check(isinstance(a[name], int) and a[name] >= 1, f"agent.{name}",
           f"must be an int >= 1, got {a[name]!r}")
  _check(a.tool_timeout_s > 0, "agent.tool_timeout_s", f"must be > 0, got {a.tool_timeout_s}")
  _named(lambda: data.check_user_template(a.user_template, "agent.user_template",
                                          tools="the tools", tool_names="their names"))
  _validate_roles(config)


def _validate_sft_batch(config, split: int) -> None:
  """The warm start's batch: its Adam keeps optim.grad_accum_steps (sft.sft_optim_config), and
  the train step splits each micro-batch over the `split` devices of the mesh, as GRPO's."""
  s, accum = config.sft, config.optim.grad_accum_steps
  _check(s.batch_size >= 1, "sft.batch_size", f"must be >= 1, got {s.batch_size}")
  _check(s.batch_size % accum == 0 and s.batch_size // accum % split == 0, "sft.batch_size",
         f"{s.batch_size} examples do not split into optim.grad_accum_steps={accum} "
         f"micro-batches each divisible by the {split} devices the mesh {tuple(config.mesh)} "
         "splits the batch over")
  _check(0 < s.lr < math.inf, "sft.lr", f"must be finite and > 0, got {s.lr}")


def _validate_roles(config) -> None:
  """agent.executor / generator / verifier (grpo_jax/agent/roles.py) and what each needs."""
  from grpo_jax.agent import roles  # pylint: disable=import-outside-toplevel
  a = config.agent
  _check(a.generator in roles.GENERATORS, "agent.generator",
         f"unknown generator {a.generator!r}; one of {list(roles.GENERATORS)}")
  _check(a.verifier in roles.VERIFIERS, "agent.verifier",
         f"unknown verifier {a.verifier!r}; one of {list(roles.VERIFIERS)}")
  _check(a.executor in roles.EXECUTORS, "agent.executor",
         f"unknown executor {a.executor!r}; one of {list(roles.EXECUTORS)}")
  for role in ("executor", "generator", "verifier"):
    _check(a[role] != "reference" or grpo.needs_reference(config.loss), f"agent.{role}",
           f"'reference' needs the reference params, which exist only when loss.beta > 0 (got "
           f"{config.loss.beta}); set loss.beta > 0, or use 'frozen_policy' (the policy under "
           f"stop-gradient) or 'server'")
    _check(a[role] != "reference" or not config.loss.sync_ref_model, f"agent.{role}",
           "'reference' plays the frozen reference, and loss.sync_ref_model=True makes it follow "
           "the policy: set sync_ref_model False, or use 'frozen_policy' or 'server'")
  _check(a.verifier == "none" or a.generator != "policy", "agent.verifier",
         f"{a.verifier!r} ends trajectories so that a frozen generator answers; with "
         "agent.generator='policy' no one would: set agent.generator to 'frozen_policy', "
         "'reference' or 'server'")
  _check(isinstance(a.generator_tokens, int) and a.generator_tokens >= 1, "agent.generator_tokens",
         f"must be an int >= 1, got {a.generator_tokens!r}")
  _check(isinstance(a.executor_tokens, int) and a.executor_tokens >= 1, "agent.executor_tokens",
         f"must be an int >= 1, got {a.executor_tokens!r}")
  try:
    executor_ok = bool(a.executor_prompt.format(tool="calculator").strip())
  except (KeyError, IndexError, ValueError):
    executor_ok = False
  _check(executor_ok, "agent.executor_prompt",
         f"must be non-empty text whose only placeholder is {{tool}}, got {a.executor_prompt!r}")
  _check(bool(a.generator_prompt.strip()), "agent.generator_prompt", "must not be empty")
  _check(bool(a.verifier_prompt.strip()), "agent.verifier_prompt", "must not be empty")
  _check(bool(a.verifier_yes) and bool(a.verifier_no) and a.verifier_yes != a.verifier_no,
         "agent.verifier_yes", f"verifier_yes={a.verifier_yes!r} and verifier_no="
         f"{a.verifier_no!r} must be two different non-empty words")
  if "server" in (a.executor, a.generator, a.verifier):
    _named(roles.server_options, a)


def validate_processes(config, num_devices: int, num_processes: int) -> None:
  """What a run over several processes (hosts) needs: grpo_jax.hosts gives each process its own
  rows of the batch, so the mesh spans every device and splits the batch over the processes."""
  if num_processes == 1:
    return
  where = f"with {num_processes} processes"
  _check(not config.sampling.compact_rows, "sampling.compact_rows",
         f"True needs one process (rows move within one device's cache); {where}, leave it "
         "unset (None)")
  _check(not config.agent.enabled, "agent.enabled",
         f"multi-turn agent runs use one process; {where}, run single-turn GRPO or one host")
  split = batch_devices(config, num_devices)
  used = math.prod(sharding.mesh_shape(config.mesh, num_devices))
  _check(used == num_devices, "mesh",
         f"{tuple(config.mesh)} uses {used} of the {num_devices} devices; {where} the mesh must "
         f"span them all, e.g. (1, -1, 1)")
  _check(split % num_processes == 0, "mesh",
         f"{tuple(config.mesh)} splits the batch {split} ways; {where} that must be a multiple "
         f"of {num_processes} (each process holds its own rows): grow data or fsdp, shrink tensor")
  _check(config.train.off_policy_steps == 0, "train.off_policy_steps",
         f"the pipelined loop scores on a host thread of one process; {where}, set it to 0")
  n = config.train.prompts_per_step
  _check(n % num_processes == 0, "train.prompts_per_step",
         f"{n} prompts do not split evenly over {num_processes} processes")
