"""The one config schema: every section's fields with their defaults, and the values derived
from them.

A config file builds on `defaults()` and states only what its presets change
(configs/gsm8k.py, configs/gsm8k_agent.py); `grpo_jax.validate.validate` checks the result
before anything loads. A field that is not here is unknown: `--config.train.stepz=3` stops main
with the field named, and `validate` refuses a config carrying one.

    c = config.defaults()           # a runnable config: Qwen2.5-1.5B-Instruct on openai/gsm8k
    c.loss.loss_type = "grpo"       # what a preset changes
    optim = config.optim_settings(c)  # derived values: a new ConfigDict, c is never rewritten

Sections: model, data, sampling, rewards, loss, optim, train, sft, agent, hardware, with
`preset`, `seed` and `mesh` at the top. The rewards' per-reward option blocks are typed by their
dataclasses in grpo_jax/rewards/options.py (defaults and checks beside the reward code).
"""

from __future__ import annotations

import copy
import json
import typing

from ml_collections import config_dict
from ml_collections.config_dict import ConfigDict, placeholder

from grpo_jax.rewards import options as reward_options


def defaults() -> ConfigDict:
  """The whole schema at its defaults."""
  c = ConfigDict()
  c.preset = "default"              # the preset a config file was asked for (after the colon)
  c.seed = 0                        # data order, initial weights, warm start and GRPO draws
  c.model = model()
  c.data = data()
  c.sampling = sampling()
  c.rewards = rewards()
  c.loss = loss()
  c.optim = optim()
  c.train = train()
  c.sft = sft()
  c.agent = agent()
  c.mesh = (1, -1, 1)               # (data, fsdp, tensor); -1 takes the remaining devices
  c.hardware = hardware()
  return c


def model() -> ConfigDict:
  return ConfigDict(dict(
      checkpoint="Qwen/Qwen2.5-1.5B-Instruct",  # local directory or hub id
      tokenizer="",                 # '' = the checkpoint's; 'tiny' = a BPE learnt offline
      random_init=False,            # True: no checkpoint, build `tiny` below with random weights
      # Attention: None or 'xla' (a grouped-query einsum, XLA fuses it), or 'cudnn' (cuDNN's
      # fused kernel through jax.nn.dot_product_attention for prompts and training; NVIDIA
      # GPUs, bf16/fp16 compute). See docs/performance.md.
      attention=placeholder(str),
      # True: the sampler's decode step runs the layers written out, on per-layer copies of
      # their weights made once per call, instead of a scan over the stacked weights
      # (qwen.RunOptions.unroll_decode; docs/performance.md). The same numbers either way.
      unroll_decode=False,
      # A decode step's attention: 'xla' (the grouped einsum) or 'pallas' (one fused kernel per
      # layer reading the KV cache in place: Triton on NVIDIA GPUs, Pallas's interpreter on CPU,
      # the einsum on TPU; head_dim a power of two). See docs/performance.md.
      decode_attention="xla",
      # Used only when random_init: a Qwen2 architecture of this size.
      tiny=ConfigDict(dict(
          hidden_size=128,          # D
          intermediate_size=384,    # MLP width
          num_layers=2,             # decoder layers
          num_heads=4,              # query heads
          num_kv_heads=2,           # key/value heads (grouped-query attention)
          head_dim=32,              # H, per attention head
          rope_theta=10000.0,       # RoPE base frequency
          tie_word_embeddings=True,  # the LM head is the embedding
          vocab_size=512)),         # for tokenizer='tiny': BPE vocabulary learnt offline
      # LoRA (docs/lora.md): rank 0 = off (full fine-tuning). Else the optimizer trains
      # adapters of this rank on the target projections of a frozen base (stored in the compute
      # dtype, or int8 with quantize='int8'), which with the adapters off is the reference.
      lora=ConfigDict(dict(
          rank=0,                   # r; 0 = off
          alpha=32.0,               # the update is scaled by alpha / r, as PEFT's lora_alpha
          # The decoder layer's projections adapted (names: grpo_jax.models.lora.TARGETS).
          targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
          dropout=0.0,              # only 0 is supported
          quantize="none",          # 'int8' or 'nf4': the frozen base's projection kernels (QLoRA)
          # True: the sampler runs the base with W + (alpha / r)·a·b in each target, merged
          # once per step (decode 1.18x faster on an H100 at 1.5B; costs a copy of the target
          # kernels while sampling). False: base and adapters side by side. K-member sweeps
          # always sample side by side (one base for all).
          merge_for_sampling=True,
          # PEFT's LoraConfig options, with PEFT's meaning (docs/lora.md, "Settings"): targets
          # may also be full module paths (model.layers.0.self_attn.q_proj).
          use_rslora=False,         # scale alpha / sqrt(r) (rsLoRA) instead of alpha / r
          rank_pattern=placeholder(dict),   # {module-path regex: rank}; None: none
          alpha_pattern=placeholder(dict),  # {module-path regex: alpha}; None: none
          layers_to_transform=(),   # layer indices the targets' short names apply to; () all
          # Modules trained whole beside the adapters (a full copy each; untied models only):
          # 'embed_tokens', 'lm_head'.
          modules_to_save=(),
          # A PEFT adapter directory or hub id a fresh run starts its adapters from (it must
          # adapt the same modules with the same ranks and scales as the fields above say).
          init_from="",
      )),
  ))


def data() -> ConfigDict:
  return ConfigDict(dict(
      source="openai/gsm8k",        # hub id, a directory of {train,test}.jsonl, or 'synthetic'
      config_name="main",           # the hub dataset's config
      train_split="train",          # the split GRPO (and the warm start) trains on
      eval_split="test",            # the split greedy pass@1 is measured on
      question_field="question",    # the column holding the question
      answer_field="answer",        # the gold text; GSM8K's ends in '#### N'
      system_prompt=placeholder(str),  # None: the chat template's default
      user_template=(               # the user turn; {question}, its one placeholder, is the
          # row's question (a literal brace is written {{ or }})
          "{question}\nThink step by step inside <think> </think>, then give the final number "
          "inside <answer> </answer>."),
      # A batch's prompts are left-padded to the smallest of these that holds its longest:
      # fine steps keep padding small; each one used compiles the sampler and step once.
      prompt_buckets=tuple(range(64, 513, 32)),
      # For source='synthetic' (see grpo_jax/synthetic.py).
      synthetic_train=7000,         # training problems
      synthetic_test=500,           # held-out problems
      synthetic_digits=2,           # digits per operand
      synthetic_operands=2,         # operands per problem
      synthetic_ops=("+",),         # operations drawn from, applied left to right
  ))


def sampling() -> ConfigDict:
  return ConfigDict(dict(
      num_generations=8,            # G completions per prompt (read it through group_size)
      max_new_tokens=1024,          # a completion's budget (agents: agent.action_tokens a turn)
      temperature=1.0,              # > 0; log-probs are those of logits / temperature
      top_k=0,                      # 0 = off
      top_p=1.0,                    # 1 = off
      min_p=0.0,                    # 0 = off
      # Finished rows leave the decode's work: the live rows move to the front of the KV cache
      # and later steps compute those only (docs/performance.md, "Live rows"). None = on a GPU
      # or TPU with the batch on one device, off on a CPU; True needs the batch on one device.
      compact_rows=placeholder(bool),
  ))


def rewards() -> ConfigDict:
  """Every reward's options at their defaults; `names`/`weights` select what is used."""
  c = ConfigDict()
  c.names = ("math_accuracy", "format")  # the rewards trained on (rewards.KNOWN_REWARDS)
  c.weights = (1.0, 1.0)            # one per name: the advantage is of the weighted sum
  # False: a model-based reward that cannot score the start-up probe (scorer unreachable,
  # replies that do not parse) stops the run before training; True: warn and train on.
  c.allow_missing = False
  for name, cls in reward_options.REWARDS.items():  # one block per reward: its options
    c[name] = _typed_options(cls)
  return c


def _typed_options(cls) -> ConfigDict:
  """An options dataclass's defaults as a block, an `X | None` option defaulting to None as a
  placeholder(X) (as data.system_prompt), so that --config.a.b=value can set it."""
  block = reward_options.to_config(cls())
  for key, hint in typing.get_type_hints(cls).items():
    if block[key] is None:
      (kind,) = [t for t in typing.get_args(hint) if t is not type(None)]
      block[key] = placeholder(kind)
  return block


def loss() -> ConfigDict:
  """The loss settings, with TRL-like defaults (DAPO token aggregation, no KL)."""
  return ConfigDict(dict(
      loss_type="dapo",              # one of grpo.LOSS_TYPES
      beta=0.0,                      # KL coefficient; 0 skips the reference forward entirely
      kl_estimator="k3",             # one of grpo.KL_ESTIMATORS
      epsilon=0.2,                   # lower clip: ratio >= 1 - epsilon
      epsilon_high=0.2,              # upper clip: ratio <= 1 + epsilon_high (DAPO uses 0.28)
      delta=placeholder(float),      # None, or cap of the unclipped ratio (> 1 + eps_high)
      importance_sampling_level="token",     # 'token' or 'sequence' (GSPO)
      num_iterations=1,              # μ: optimizer steps per generation batch
      # S: each of the μ passes over a generation batch is S optimizer updates, update s on its
      # s-th slice of whole groups (TRL's steps_per_generation counts micro-batches: S ×
      # optim.grad_accum_steps there); the old log-probs are those at the sampling params.
      steps_per_generation=1,
      scale_rewards="group",         # one of grpo.SCALE_REWARDS
      reward_aggregation="sum_then_normalize",  # one of grpo.REWARD_AGGREGATIONS
      mask_truncated_completions=False,  # drop completions that hit max length from the loss
      # sapo's gate temperatures, for A > 0 and A <= 0 (TRL's sapo_temperature_pos/neg)
      sapo_temperature_pos=1.0,
      sapo_temperature_neg=1.05,
      # vespo's gamma weight φ(w) = exp(λ + k log w − λ w), for A >= 0 (pos) and A < 0 (neg)
      vespo_k_pos=2.0,
      vespo_lambda_pos=3.0,
      vespo_k_neg=3.0,
      vespo_lambda_neg=2.0,
      # Importance sampling between the sampler's and the trainer's log-probs (TRL's
      # vllm_importance_sampling_*); off by default: the sampler is this model's own code.
      rollout_is_correction=False,
      rollout_is_mode="sequence_mask",     # one of grpo.ROLLOUT_IS_MODES
      rollout_is_clip_min=placeholder(float),  # None: no lower bound
      rollout_is_clip_max=3.0,             # None: no upper bound (TRL's deprecated _cap)
      # Drop sequences with A < 0 whose mean (sampler − policy) log-prob exceeds this (None: off)
      off_policy_mask_threshold=placeholder(float),
      use_bias_correction_kl=False,        # KL term times π_θ / π_old (TRL's default is True)
      top_entropy_quantile=1.0,            # train only the top ρ of tokens by entropy (1: all)
      entropy_coef=0.0,                    # loss −= coef · mean entropy of the trained tokens
      # Skywork-OR1's adaptive coefficient (TRL's names): entropy_coef is the start; after each
      # optimizer update it moves by entropy_coef_delta, up while the mean entropy is at or below
      # entropy_target, down otherwise, within [entropy_coef_min, entropy_coef_max], and the
      # bonus applies only while the last update's entropy was at or below the target. The
      # coefficient is train state, in the checkpoint.
      use_adaptive_entropy=False,
      entropy_target=0.2,                  # nats per token, over the trained tokens
      entropy_coef_min=0.0,
      entropy_coef_max=1.0,
      entropy_coef_delta=0.005,
      # TR-DPO's reference that follows the policy (TRL's names, defaults and
      # SyncRefModelCallback): after every ref_model_sync_steps-th optimizer update,
      # ref <- alpha * policy + (1 - alpha) * ref. Needs beta > 0 and full fine-tuning; the
      # reference is then train state, in the checkpoint.
      sync_ref_model=False,
      ref_model_mixup_alpha=0.6,
      ref_model_sync_steps=512,
  ))


def optim() -> ConfigDict:
  """The optimizer, with the param/compute dtypes and remat of the train step."""
  return ConfigDict(dict(
      lr=1e-6,                 # peak learning rate
      warmup_steps=0,          # linear from 0 to lr over these steps
      schedule="constant",     # after warmup: 'constant' or 'cosine' (to 0 at total_steps)
      total_steps=0,           # cosine's length; 0 = the run's updates (optim_settings)
      weight_decay=0.0,        # AdamW, on kernels and embeddings only (not norms, biases)
      b1=0.9,                  # Adam's first-moment decay
      b2=0.99,                 # Adam's second-moment decay
      max_grad_norm=1.0,       # global-norm clipping; 0 disables it
      grad_accum_steps=1,      # micro-batches per optimizer step
      param_dtype="float32",   # dtype the params and optimizer moments are stored in
      compute_dtype="bfloat16",  # dtype of the forward/backward matmuls
      remat=True,              # rematerialise each decoder layer in the backward pass
      # fp32 logits per block of the head's log-prob pass; 0 = the platform's (4 MiB on a CPU,
      # 64 MiB on a GPU or TPU: grpo_jax.logprobs.platform_block_bytes)
      logprob_block_bytes=0,
  ))


def train() -> ConfigDict:
  return ConfigDict(dict(
      steps=500,                    # GRPO steps (each: sample, reward, μ × S updates)
      prompts_per_step=96,          # prompts per step; the batch is prompts_per_step × G rows
      eval_every=50,                # greedy pass@1 on the eval split; 0 = only at start and end
      eval_examples=0,              # the eval split's first N problems; 0 = all of it
      eval_batch_size=64,           # prompts per greedy eval batch
      checkpoint_every=50,          # steps between checkpoints
      keep_checkpoints=3,           # the newest kept on disk
      samples_per_step=4,           # completions written to samples.md per step
      # A batch's completions are padded to its longest, rounded up to a multiple of this
      # (at most sampling.max_new_tokens): fine widths, few compiled shapes.
      pad_multiple=16,
      max_bad_steps=5,              # consecutive non-finite steps before the run stops
      # DAPO's dynamic sampling: set aside groups whose G rewards are all equal (they teach
      # nothing) and sample more prompts, up to max_sampling_rounds rounds per step.
      dynamic_sampling=False,
      max_sampling_rounds=3,        # rounds per step, the first included
      # Consecutive steps with a reward missing on >= 50% of completions (scorer down, judge
      # replies that do not parse) before the run saves a checkpoint and stops; 0 = warn only.
      max_missing_reward_steps=3,
      # Off a terminal (a log file, CI, nohup) progress is a plain line every this many seconds
      # (0 = every step) and a last one, instead of a redrawn bar (grpo_jax.progress).
      progress_every_s=30.0,
      tensorboard=True,             # TensorBoard event files in WORKDIR/tensorboard/
      # Also log to Weights & Biases (pip install ".[wandb]"): each step's metrics, the resolved
      # config and metrics.png at the end; a resumed run continues the same wandb run (its id is
      # kept in WORKDIR/wandb_run_id.txt; wandb's own files go to WORKDIR/wandb/).
      wandb=False,
      wandb_project="grpo_jax",
      wandb_entity=placeholder(str),  # a team or user; None = your default entity
      wandb_name=placeholder(str),    # the run's name; None = the workdir's name
      wandb_tags=(),                # e.g. ("tiny", "baseline")
      # 'online', 'offline' (files only, `wandb sync` uploads them later), 'disabled';
      # None = wandb's own choice ($WANDB_MODE, else online).
      wandb_mode=placeholder(str),
      # Compiled programs on disk, loaded by a resumed or repeated run instead of compiled
      # (grpo_jax.compile_cache): None = $JAX_COMPILATION_CACHE_DIR or ~/.cache/grpo_jax/xla;
      # a path (gs:// too); "" = off.
      compilation_cache=placeholder(str),
      # How the K runs of a vmapped sweep group (python -m grpo_jax.sweep --vmap) share the
      # sampler and the train step in their one program (MEMBERS): "vmap" batches them (K-wide
      # kernels: for a GPU or TPU, where a small model's kernels are bound by launches); "map"
      # runs each run's own program in turn inside it (what a CPU runs fastest: batching adds no
      # arithmetic rate there); "auto" = map on CPU, else vmap. A plain run ignores it.
      members="auto",
      # 0: each step samples with the params it then updates. 1: one step behind: step t+1's
      # rollouts are sampled with step t's params, before step t's update, and step t's rewards
      # are scored on a host thread while the device samples (grpo_jax.pipeline); the loss takes
      # the sampler's log-probs as the behaviour policy (docs/loss.md, "One step behind").
      off_policy_steps=0,
      # With off_policy_steps=1 on several devices: the first N of jax.devices() sample (a
      # (1, N, 1) mesh) and `mesh` trains on the rest; after each update the params are copied
      # to the sampling devices (time/param_transfer_s). 0: one mesh samples and trains.
      sample_devices=0,
  ))


def sft() -> ConfigDict:
  """Supervised warm start (cold start) on the training answers before GRPO; steps 0 = off.
  The targets are the dataset's answers without GSM8K's <<calculator>> annotations."""
  return ConfigDict(dict(
      steps=0,                      # the most warm-start steps; 0 = no warm start
      # Examples per step: optim.grad_accum_steps micro-batches, each split over the mesh's
      # data × fsdp devices, as a GRPO batch.
      batch_size=32,
      lr=1e-3,                      # Adam's rate (sft.sft_optim_config: no decay, no clipping)
      # > 0: stop at the first check (every eval_every steps) whose greedy accuracy on
      # eval_examples training problems, held out of both phases, reaches it.
      target_accuracy=0.0,
      eval_every=50,                # steps between those checks
      # > 0 (above target_accuracy): a check past it overshot the target between two checks;
      # go back to the previous check and check after every step (sft.run_sft).
      overshoot_accuracy=0.0,
      eval_examples=256,            # held-out training problems checked
  ))


def agent() -> ConfigDict:
  """Multi-turn agent rollouts with tools (Flow-GRPO; configs/gsm8k_agent.py). Off: one
  completion per sample. See grpo_jax/agent/."""
  return ConfigDict(dict(
      enabled=False,                # True: trajectories of tool calls instead of completions
      tools=("calculator",),        # by name: grpo_jax.agent.tools.TOOLS
      max_turns=4,                  # actions per trajectory, the final answer included
      action_tokens=32,             # sampled tokens per action (the turn's budget)
      observation_tokens=32,        # a tool's output is cut to this many tokens
      tool_workers=8,               # tool calls run in parallel, at most this many at once
      tool_timeout_s=5.0,           # wall-clock limit of every tool call
      # The python tool's sandbox (docs/sandbox.md): 'strict' needs bubblewrap, libseccomp and
      # the kernel's namespaces, and refuses to start without them; 'unsafe' runs model code
      # without those layers (warns at every start).
      sandbox="strict",
      # The first user turn: the toolset K ({tools}: each tool's description with its call
      # syntax; {tool_names}: just the names) and the query.
      user_template="{tools}\n\n{question}",
      # Frozen roles beside the planner (grpo_jax/agent/roles.py; never trained, loss mask 0):
      # 'policy' (generator only: the planner's own <answer> action, trained), 'frozen_policy'
      # (the policy's params under stop-gradient, on the carried cache), 'reference' (the
      # reference params; needs loss.beta > 0), 'server' (an OpenAI-compatible endpoint,
      # agent.server); 'none' (verifier only: the planner alone decides when to stop).
      executor="none",              # writes a tool action's input from its sub-goal ('none': the
                                    # planner writes the input itself)
      executor_prompt="Write only the input for the {tool} tool that does this.",  # its turn
      executor_tokens=32,           # the executor's input budget
      generator="policy",           # writes the scored final answer when a trajectory ends
      verifier="none",              # after each tool observation: is the memory enough? Yes ends it
      generator_prompt="Give the final answer as <answer>NUMBER</answer>.",  # its turn
      generator_tokens=32,          # the generator's answer budget
      verifier_prompt=("Is the information above enough to answer the question? "
                       "Answer Yes or No."),
      verifier_yes="Yes",           # P(first token of each) at one position; 'server': the
      verifier_no="No",             # reply starting with verifier_yes means Yes
      # The 'server' roles' endpoint (rewards.options.HttpOptions).
      server=reward_options.to_config(reward_options.HttpOptions(max_tokens=256)),
  ))


def hardware() -> ConfigDict:
  """What the preset is sized for: benchmarks/memory.py compiles its train step and sampler on
  `devices` (fake) devices and checks their peaks against memory_gb_per_device (GB = 1e9 B)."""
  return ConfigDict(dict(
      name="TPU v5e-8",             # in words, for the report
      memory_gb_per_device=16.0,    # each device's memory (GB = 1e9 B)
      devices=8,                    # how many devices
  ))


# --- accessors for settings read in many places, and derived values -------------------------------

MEMBERS = ("auto", "vmap", "map")  # train.members


def members_batched(config, platform: str) -> bool:
  """Whether a vmapped group on `platform` (jax.default_backend()) batches its members under
  jax.vmap (train.members "vmap", or "auto" off the CPU) rather than running them in turn."""
  return config.train.members == "vmap" or (config.train.members == "auto" and platform != "cpu")


def group_size(config) -> int:
  """G, the completions sampled per prompt (sampling.num_generations)."""
  return config.sampling.num_generations


def rows_per_step(config) -> int:
  """The completions (rows) of one GRPO step's batch: train.prompts_per_step × G."""
  return config.train.prompts_per_step * group_size(config)


def updates_per_step(config) -> int:
  """The optimizer updates of one GRPO step: μ passes over its batch (loss.num_iterations), each
  loss.steps_per_generation updates (one per slice)."""
  return config.loss.num_iterations * config.loss.steps_per_generation


def updates_per_run(config) -> int:
  """The run's optimizer updates: train.steps × updates_per_step."""
  return config.train.steps * updates_per_step(config)


def cosine_total_steps(optim_cfg, updates: int) -> int:
  """What optim.total_steps = 0 means for the cosine schedule: the run's optimizer updates T, so
  the rate reaches 0 at update count T, one after the last. The last update (count T − 1) runs
  at lr·(1 − cos(π / (T − W))) / 2 with W = optim.warmup_steps, near 0; with W > 0 the first
  (count 0) runs at 0, the warm-up's start. optax's schedules and Hugging Face's
  get_cosine_schedule_with_warmup do the same. A run no longer than the warm-up (a preset
  shortened for a smoke test) ends on the warm-up's ramp: the cosine then starts right after it,
  where the run never goes. A run with no updates (train.steps = 0) never reads the schedule."""
  return max(int(updates), optim_cfg.warmup_steps + 1)


def optim_settings(config) -> ConfigDict:
  """The run's optimizer settings: a copy of config.optim with the derived values filled in
  (cosine's total_steps counts optimizer updates, updates_per_step per GRPO step). config is
  never rewritten."""
  out = config.optim.copy_and_resolve_references()
  if out.schedule == "cosine" and not out.total_steps:
    out.total_steps = cosine_total_steps(out, updates_per_run(config))
  return out


def unknown_fields(config, schema: ConfigDict | None = None, prefix: str = "") -> list[str]:
  """The dotted names of fields in `config` that the schema does not have (sorted)."""
  schema = defaults() if schema is None else schema
  out = []
  for key in sorted(config.keys()):
    if key not in schema:
      out.append(prefix + key)
      continue
    value, known = config[key], schema[key]
    if isinstance(value, config_dict.ConfigDict) and isinstance(known, config_dict.ConfigDict):
      out += unknown_fields(value, known, f"{prefix}{key}.")
  return out


def _fits(value, kind) -> bool:
  """Whether `value` is of the schema's type `kind` (an int is a float; a bool is not a number)."""
  if kind is bool:
    return isinstance(value, bool)
  if kind in (int, float):
    return (isinstance(value, (int, float) if kind is float else int)
            and not isinstance(value, bool))
  return isinstance(value, kind)


def type_errors(config, schema: ConfigDict | None = None, prefix: str = "") -> list[str]:
  """'<dotted name>: <what is wrong>' for each field of the schema that `config` lacks or holds
  a value of another type in (None only where the schema's default is None: a placeholder).
  ml_collections lets None, and True for an int, through an override."""
  schema = defaults() if schema is None else schema
  out = []
  for key in sorted(schema.keys()):
    name, known = prefix + key, schema[key]
    if key not in config:
      out.append(f"{name}: missing (a section set whole drops its other fields; set single "
                 "fields by their dotted names)")
      continue
    value, kind = config[key], schema.get_type(key)
    if isinstance(known, ConfigDict):
      out += (type_errors(value, known, name + ".") if isinstance(value, ConfigDict)
              else [f"{name}: must be a section of fields, got {value!r}"])
    elif kind is not type(None) and not (value is None and known is None or _fits(value, kind)):
      out.append(f"{name}: must be {'None or ' if known is None else ''}of type "
                 f"{kind.__name__}, got {value!r}")
  return out


def apply_overrides(config, args: dict) -> None:
  """Sets flat dotted keys on a ConfigDict as --config.a.b=v would, values as given (None, a
  tuple; a JSON list becomes a tuple): main's --overrides file, a sweep's runs and a vmapped
  group's members. KeyError: the key names no field; TypeError: the value does not fit its
  type."""
  for key, value in args.items():
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      node = node[part]
    if leaf not in node:
      raise KeyError(key)
    node[leaf] = tuple(value) if isinstance(value, list) else value


def flat(d: dict, prefix: str = "") -> dict:
  """A nested dict (a config's to_dict() or its config.json) as {"block.field": value}, lists
  as tuples."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
  return out


# Settings that change how a run is run or recorded, not its numbers: a resume may change them.
RESUME_NEUTRAL = ("train.compilation_cache", "train.tensorboard", "train.wandb",
                  "train.progress_every_s", "hardware.")


def config_changes(previous: dict | None, config) -> list[str]:
  """'key: old -> new' for each setting of `config` that differs from `previous` (a config.json
  written by an earlier run in the workdir), RESUME_NEUTRAL left out; with a cosine schedule
  whose length follows train.steps (optim.total_steps=0), also that length when it changes."""
  if previous is None:
    return []
  old, new = flat(previous), flat(json.loads(config.to_json_best_effort()))
  keys = [k for k in sorted(set(old) | set(new))
          if old.get(k) != new.get(k) and not k.startswith(RESUME_NEUTRAL)]
  changes = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys]
  if keys and config.optim.schedule == "cosine" and not config.optim.total_steps:
    before = copy.deepcopy(config)
    try:
      apply_overrides(before, {k: old[k] for k in keys if k in old})
      lengths = [optim_settings(c).total_steps for c in (before, config)]
    except (KeyError, TypeError, ValueError, AttributeError):
      lengths = []  # a setting the old config had and this one cannot take: listed above
    if lengths and lengths[0] != lengths[1]:
      changes.append(f"the cosine schedule's length (optim.total_steps=0: the run's updates): "
                     f"{lengths[0]} -> {lengths[1]} updates")
  return changes
