"""The train step: one pure function, jitted once per batch layout, sharded and donated.

    spec = StepSpec.build(model_cfg, loss_cfg, optim_cfg, mesh, temperature=1.0,
                          valid_vocab_size=151665, group_size=8, num_rewards=2)
    hp = hparams(loss_cfg, optim_cfg, reward_weights=(1.0, 1.0))   # float32 arrays
    state, metrics, advantages_B = train_step(state, rollout, hp, ref_params, spec=spec)

    step = TrainStep(model_cfg, loss_cfg, optim_cfg, mesh, temperature=1.0,  # the host wrapper:
                     valid_vocab_size=151665, max_completion_length=1024,   # checks, shardings,
                     group_size=8, reward_weights=(1.0, 1.0), max_turns=None)  # donation, cache
    state = create_train_state(params, model_cfg, optim_cfg, mesh)
    state, metrics, advantages_B = step(state, rollout, ref_params)

One call is a whole GRPO update: `make_batch` (advantages, masks), the reference log-probs
(β > 0), and the loss.num_iterations (μ) optimizer updates, in one compiled program. The
first update's forward gives the old log-probs for the later ones (its params are the params
before any update), so no separate forward is run for them; with μ = 1 the ratio is exactly 1.
The reference forward runs inside the first update's micro-batch loop; while the params
equal the reference's (a run's first step), the policy's log-probs are taken for it. With
loss.steps_per_generation = S > 1 each of the μ passes is S updates, one per slice of whole
groups, whose old and reference log-probs one forward of every slice takes first
(_sliced_updates).

A call takes one of two batch layouts (B = rows = prompts × G, group-major; P, C the batch's
padded prompt and completion widths, S = P + C):

  rollout (what the training loop uploads, once, with the batch sharding):
    prompt_NP        int32    left-padded prompt of each group (N = B / G prompts: once each,
                              the sampler's padding; the step repeats it for the group's rows)
    prompt_mask_NP   int32    1 on real prompt tokens
    completion_BC    int32    sampled ids, right-padded
    lengths_B        int32    tokens sampled, the stop token included
    truncated_B      bool     max_new_tokens reached without a stop id
    rewards_BR       float32  reward matrix, NaN = missing (grpo.group_advantages)
    loss_mask_BC     int32    optional: 1 on completion tokens that enter the loss (a multi-turn
                              trajectory's action tokens; 0 on the observations between them);
                              the completion mask is the length mask times this, attn_mask_BS
                              still covers every token up to lengths_B
    turn_ids_BC      int32    optional; required by loss.loss_type='flow_grpo': 0-based turn of
                              each completion token (read only where the loss mask is 1)
    sampler_logp_BC  float32  optional; required by loss.rollout_is_correction: the sampler's
                              log-prob of each sampled token (0 past lengths_B). With it the
                              step logs drift/* (grpo.drift_metrics)
    old_logp_BC      float32  optional: the sampler's log-probs, the behaviour policy of a
                              batch sampled one step behind (train.off_policy_steps=1)
  train (the same step with given advantages; tests, the warm start, other rollouts):
    tokens_BS        int32    prompt left-padded to P, then the completion right-padded to C
    attn_mask_BS     int32    1 on real prompt and completion tokens
    completion_mask_BC int32  1 on completion tokens that count: up to and including EOS
    advantages_B     float32
    truncated_B      bool     optional; required if loss.mask_truncated_completions
    old_logp_BC      float32  optional: log-probs of the behaviour policy (default: the
                              params before the first update)
    ref_logp_BC      float32  optional when β > 0 (default: computed from ref_params)
    turn_ids_BC      int32    optional; required by flow_grpo (as in the rollout layout)
    sampler_logp_BC  float32  optional (as in the rollout layout)

Example (B=2, P=3, C=4; 0 is the pad id, 9 the EOS):
  tokens_BS          [[0, 5, 6, 7, 8, 9, 0],  [4, 5, 6, 7, 7, 7, 7]]
  attn_mask_BS       [[0, 1, 1, 1, 1, 1, 0],  [1, 1, 1, 1, 1, 1, 1]]
  completion_mask_BC [[1, 1, 0, 0],           [1, 1, 1, 1]]      truncated_B [False, True]

A multi-turn trajectory (agent rollouts, loss.loss_type='flow_grpo') is one row whose completion
is action_1, observation_1, action_2, …: observation tokens are attended to (attn_mask_BS 1) but
out of the loss and KL (completion_mask_BC 0). Example (C=6, a 2-token action, a 1-token tool
result, a 3-token answer ending in EOS):
  completion_BC  [[7, 8, 5, 6, 4, 9]]  lengths_B [6]
  loss_mask_BC   [[1, 1, 0, 1, 1, 1]]  turn_ids_BC [[0, 0, 0, 1, 1, 1]]
  → attn_mask_BS ends [1, 1, 1, 1, 1, 1], completion_mask_BC [[1, 1, 0, 1, 1, 1]]; flow_grpo
    weights (one row) [[1/4, 1/4, 0, 1/6, 1/6, 1/6]].

`objective="sft"` makes the same step a supervised one (the warm start): the train layout
without advantages, loss = mean negative log-likelihood of the completion tokens.

The state is a plain dict {'step': int32 scalar, 'params': ..., 'opt_state': ...} (with
loss.use_adaptive_entropy also 'entropy_ctrl'; with loss.sync_ref_model also 'ref', the
reference the updates mix the policy into), so checkpoint.py saves it as is. Each update runs grad_accum_steps micro-batches in a scan,
summing gradients of losses that are already normalised over the whole batch (grpo.py), so
the result does not depend on the micro-batching. An update whose loss or gradient is not
finite leaves the state unchanged and is skipped. With loss.num_iterations = μ > 1 the step's
metrics are the mean over its μ updates (the ratio's min and max over all of them), so
`step/skipped` is the fraction of the updates skipped: 1 only when the state is unchanged.

Compiled programs are cached by the batch's layout (keys, shapes, dtypes): a new shape
compiles once and never evicts another. `precompile` compiles a layout's program in a
background thread ahead of the batch (a run's first step: while it samples).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from grpo_jax import (compile_cache, config as config_lib, grpo, hosts, logprobs,
                      policy as policy_lib, sharding)
from grpo_jax.models import qwen

SCHEDULES = ("constant", "cosine")

OBJECTIVES = ("grpo", "sft")


def validate_optim_config(cfg) -> None:
  """Raises ValueError naming the first bad setting of an optimizer config."""
  if not 0 < cfg.lr < np.inf:  # inf times an Adam moment of 0 is a NaN param
    raise ValueError(f"optim.lr={cfg.lr!r} must be finite and > 0")
  for name in ("warmup_steps", "total_steps"):
    if not (isinstance(cfg[name], int) and cfg[name] >= 0):
      raise ValueError(f"optim.{name}={cfg[name]!r} must be an int >= 0")
  if cfg.schedule not in SCHEDULES:
    raise ValueError(f"optim.schedule={cfg.schedule!r} is not one of {SCHEDULES}")
  if cfg.schedule == "cosine" and not cfg.total_steps > cfg.warmup_steps:
    raise ValueError(f"optim.total_steps={cfg.total_steps!r} must exceed optim.warmup_steps="
                     f"{cfg.warmup_steps} for the cosine schedule")
  if not cfg.weight_decay >= 0:
    raise ValueError(f"optim.weight_decay={cfg.weight_decay!r} must be >= 0")
  for name in ("b1", "b2"):
    if not 0 <= cfg[name] < 1:
      raise ValueError(f"optim.{name}={cfg[name]!r} must be in [0, 1)")
  if not cfg.max_grad_norm >= 0:
    raise ValueError(f"optim.max_grad_norm={cfg.max_grad_norm!r} must be >= 0 (0 disables)")
  if not (isinstance(cfg.grad_accum_steps, int) and cfg.grad_accum_steps >= 1):
    raise ValueError(f"optim.grad_accum_steps={cfg.grad_accum_steps!r} must be an int >= 1")
  if not (isinstance(cfg.logprob_block_bytes, int) and (cfg.logprob_block_bytes == 0
                                                        or cfg.logprob_block_bytes >= 4)):
    raise ValueError(f"optim.logprob_block_bytes={cfg.logprob_block_bytes!r} must be an int >= 4, "
                     "or 0 for the platform's default")
  for name in ("param_dtype", "compute_dtype"):
    if cfg[name] not in qwen.DTYPES:
      raise ValueError(f"optim.{name}={cfg[name]!r} is not one of {qwen.DTYPES}")


def learning_rate_schedule(cfg, lr=None) -> optax.Schedule:
  """Linear warmup from 0, then constant or cosine decay to 0 at total_steps. lr: the peak
  (default cfg.lr; an array inside the step, where it is a hyperparameter)."""
  lr = cfg.lr if lr is None else lr
  warmup = optax.linear_schedule(0.0, lr, cfg.warmup_steps)
  if cfg.schedule == "constant":
    after = optax.constant_schedule(lr)
  else:
    after = optax.cosine_decay_schedule(lr, cfg.total_steps - cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def decay_mask(params):
  """Weight decay on matrices (kernels, embedding, lm_head, LoRA factors), not on norm weights
  or biases."""
  def one(path, _):
    return getattr(path[-1], "key", None) in ("kernel", "embedding", "lm_head", "lora_a",
                                              "lora_b")
  return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg, lr=None) -> optax.GradientTransformation:
  """AdamW with the schedule, after global-norm clipping; cfg an optimizer config (validated)
  or an OptimSpec. The state's structure does not depend on lr."""
  if not isinstance(cfg, OptimSpec):
    validate_optim_config(cfg)
  adamw = optax.adamw(learning_rate_schedule(cfg, lr), b1=cfg.b1, b2=cfg.b2,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.max_grad_norm:
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
  return adamw


# ------------------------------------------------------------------------------------------------
# State and shardings.


def abstract_trainable(model_cfg, optim_cfg, policy=policy_lib.FULL):
  """ShapeDtypeStructs of what the optimizer trains, in param_dtype: the model's params, or with
  LoRA (policy a policy.Lora) the adapters alone."""
  return policy.abstract_trainable(model_cfg, jnp.dtype(optim_cfg.param_dtype))


def abstract_state(model_cfg, optim_cfg, mesh=None, policy=policy_lib.FULL, loss_cfg=None):
  """ShapeDtypeStructs of the train state (with shardings if a mesh is given); no allocation.
  With LoRA the state's params are the adapters (abstract_trainable). loss_cfg: where it has
  use_adaptive_entropy, the state also holds the entropy controller (controller_state); where
  the reference follows the policy (grpo.syncs_reference), the reference, as 'ref'."""
  params = abstract_trainable(model_cfg, optim_cfg, policy)
  opt_state = jax.eval_shape(make_optimizer(optim_cfg).init, params)
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": opt_state,
           **jax.eval_shape(lambda: controller_state(loss_cfg))}
  if _state_holds_reference(loss_cfg):
    state["ref"] = abstract_reference(model_cfg, optim_cfg, None, policy)
  if mesh is None:
    return state
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      state_shardings(model_cfg, optim_cfg, mesh, policy, loss_cfg))


def controller_state(loss_cfg) -> dict:
  """The train state's loss controllers beside step, params and opt_state: {'entropy_ctrl':
  grpo.adaptive_entropy_start} with loss.use_adaptive_entropy, else {} (the state of every
  other run keeps its shape, so their checkpoints still fit)."""
  if loss_cfg is None or not loss_cfg.use_adaptive_entropy:
    return {}
  return {"entropy_ctrl": grpo.adaptive_entropy_start(loss_cfg)}


def _state_holds_reference(loss_cfg) -> bool:
  """Whether the train state holds the reference ('ref', abstract_reference's): with
  loss.sync_ref_model the step updates it, so it is state like the optimizer's moments."""
  return loss_cfg is not None and grpo.syncs_reference(loss_cfg)


def reference_dtype(optim_cfg):
  """The dtype the frozen reference params are stored in: compute_dtype where it is narrower
  than param_dtype, else param_dtype. The forward casts every parameter to compute_dtype before
  using it (qwen.Linear, RMSNorm, Embed, the head), so a reference stored in compute_dtype gives
  the same log-probs bit for bit, in half the memory with fp32 params and bf16 compute. A LoRA
  run's frozen base is stored the same way."""
  param, compute = jnp.dtype(optim_cfg.param_dtype), jnp.dtype(optim_cfg.compute_dtype)
  return compute if compute.itemsize < param.itemsize else param


def abstract_reference(model_cfg, optim_cfg, mesh=None, policy=policy_lib.FULL):
  """ShapeDtypeStructs of the frozen params as the run stores them (policy.abstract_frozen in
  reference_dtype): the reference policy, or with LoRA the frozen base."""
  params = policy.abstract_frozen(model_cfg, reference_dtype(optim_cfg))
  if mesh is None:
    return params
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                      reference_shardings(model_cfg, optim_cfg, mesh, policy))


def reference_shardings(model_cfg, optim_cfg, mesh, policy=policy_lib.FULL):
  """NamedShardings of the frozen params (abstract_reference), by the logical-axis rules."""
  return policy.frozen_shardings(model_cfg, reference_dtype(optim_cfg), mesh)


def reference_params(params, model_cfg, optim_cfg, mesh, policy=policy_lib.FULL):
  """The frozen params (policy.make_frozen): a fresh copy of params in reference_dtype, placed
  by the rules. Full fine-tuning: the reference policy. LoRA: the base under the adapters, int8
  kernels where lcfg.quantize = 'int8' (QLoRA, models/quant.py)."""
  return policy.make_frozen(params, model_cfg, reference_dtype(optim_cfg), mesh)


def state_shardings(model_cfg, optim_cfg, mesh, policy=policy_lib.FULL, loss_cfg=None):
  """NamedShardings of the state: params (or LoRA adapters) by the logical-axis rules,
  optimizer moments alike, the controllers (controller_state) replicated, a reference that
  follows the policy as the frozen one's (reference_shardings)."""
  params = abstract_trainable(model_cfg, optim_cfg, policy)
  param_sh = sharding.param_shardings(policy.trainable_axes(model_cfg), params, mesh)
  optimizer = make_optimizer(optim_cfg)
  opt_sh = optax.tree_map_params(
      optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), param_sh,
      transform_non_params=lambda _: sharding.replicated(mesh))
  controllers = jax.tree.map(lambda _: sharding.replicated(mesh), controller_state(loss_cfg))
  if _state_holds_reference(loss_cfg):
    controllers["ref"] = reference_shardings(model_cfg, optim_cfg, mesh, policy)
  return {"step": sharding.replicated(mesh), "params": param_sh, "opt_state": opt_sh,
          **controllers}


def create_train_state(params, model_cfg, optim_cfg, mesh, policy=policy_lib.FULL,
                       loss_cfg=None):
  """The initial state from a params pytree (with LoRA: the adapters, policy.init_trainable):
  cast to param_dtype, placed by the rules; with loss_cfg, its controllers' start and, where the
  reference follows the policy, the reference (a copy of params in reference_dtype)."""
  sh = state_shardings(model_cfg, optim_cfg, mesh, policy, loss_cfg)
  dtype = jnp.dtype(optim_cfg.param_dtype)
  # device_put may hand back the caller's own buffers (e.g. as one shard of a replicated leaf);
  # the jitted cast makes fresh ones, so donating the state never deletes the caller's params
  # (which are often the reference params too).
  params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
                   out_shardings=sh["params"])(jax.device_put(params, sh["params"]))
  opt_state = jax.jit(make_optimizer(optim_cfg).init, out_shardings=sh["opt_state"])(params)
  controllers = {k: jax.device_put(v, sh[k]) for k, v in controller_state(loss_cfg).items()}
  if _state_holds_reference(loss_cfg):  # the reference starts as the starting params
    controllers["ref"] = reference_params(params, model_cfg, optim_cfg, mesh, policy)
  return {"step": jax.device_put(jnp.zeros((), jnp.int32), sh["step"]), "params": params,
          "opt_state": opt_state, **controllers}


def _shape(x) -> tuple[int, ...]:
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)  # arrays or ShapeDtypeStructs


def batch_shardings(batch, mesh):
  """Row-indexed arrays split over (data, fsdp); scalars replicated. A rollout's prompts (one
  row per group, B / G of them) too where their count splits over those devices, else
  replicated: they are small, and the step repeats them to the rows' split."""
  n = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES]))

  def one(k, v):
    shape = _shape(v)
    if not shape or (k in _PROMPTS and shape[0] % n):
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(sharding.BATCH_AXES))
  return {k: one(k, v) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------
# Batch layouts.

ROLLOUT_KEYS = ("prompt_NP", "prompt_mask_NP", "completion_BC", "lengths_B", "rewards_BR")
TRAIN_KEYS = ("tokens_BS", "attn_mask_BS", "completion_mask_BC", "advantages_B")
SFT_KEYS = ("tokens_BS", "attn_mask_BS", "completion_mask_BC")
_OPTIONAL = {"grpo": ("truncated_B", "old_logp_BC", "ref_logp_BC", "turn_ids_BC",
                      "sampler_logp_BC"), "sft": ()}
# The train layout a rollout batch becomes on the device also keeps its prompts once per group,
# for the packed forward (completion_logprobs); a batch given in the train layout has none.
_PROMPTS = ("prompt_NP", "prompt_mask_NP")
ROLLOUT_OPTIONAL = ("truncated_B", "loss_mask_BC", "turn_ids_BC", "sampler_logp_BC",
                    "old_logp_BC")


def is_rollout(batch) -> bool:
  return "rewards_BR" in batch


def check_batch(batch, loss_cfg, optim_cfg, mesh, objective="grpo", *, has_ref_params=False,
                group_size=None, num_rewards=None, max_turns=None, valid=None) -> None:
  """Host-side checks, before anything is donated: a bad batch raises and the state survives.

  max_turns: flow_grpo's bound on turns; the turn ids of loss tokens must lie in [0, max_turns)
  (checked when given: a small fetch of the masks and turn ids).
  valid: the head rows in the softmax; the completion token ids that enter the loss must lie in
  [0, valid) (checked when given: a fetch of the completion ids and masks).
  """
  rollout = objective == "grpo" and is_rollout(batch)
  required = ROLLOUT_KEYS if rollout else SFT_KEYS if objective == "sft" else TRAIN_KEYS
  optional = ROLLOUT_OPTIONAL if rollout else _OPTIONAL[objective]
  missing = [k for k in required if k not in batch]
  unknown = [k for k in batch if k not in required + optional]
  if missing or unknown:
    raise ValueError(f"batch is missing {missing} / has unknown keys {unknown}")
  if rollout:
    B, C = _shape(batch["completion_BC"])
    N, P_ = _shape(batch["prompt_NP"])
    S = P_ + C
    if group_size is None or B != N * group_size:
      raise ValueError(f"a rollout batch of {B} completions needs group_size (G={group_size}) "
                       f"and prompt_NP with one row per group (B / G), got {N} rows")
    expect = {"prompt_mask_NP": (N, P_), "lengths_B": (B,), "truncated_B": (B,),
              "rewards_BR": (B, num_rewards or _shape(batch["rewards_BR"])[-1]),
              "loss_mask_BC": (B, C), "turn_ids_BC": (B, C), "sampler_logp_BC": (B, C),
              "old_logp_BC": (B, C)}
    tokens = batch["prompt_NP"]
  else:
    B, S = _shape(batch["tokens_BS"])
    C = _shape(batch["completion_mask_BC"])[-1]
    expect = {"attn_mask_BS": (B, S), "completion_mask_BC": (B, C), "advantages_B": (B,),
              "old_logp_BC": (B, C), "ref_logp_BC": (B, C), "truncated_B": (B,),
              "turn_ids_BC": (B, C), "sampler_logp_BC": (B, C)}
    tokens = batch["tokens_BS"]
    if not C < S:
      raise ValueError(f"completion length C={C} must be shorter than tokens_BS length S={S}")
  for k, shape in expect.items():
    if k in batch and _shape(batch[k]) != shape:
      raise ValueError(f"batch['{k}'] has shape {_shape(batch[k])}, expected {shape} "
                       f"(B={B}, S={S}, C={C})")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"batch token ids must be integer, got {tokens.dtype}")
  for k in ("turn_ids_BC", "loss_mask_BC"):
    if k in batch and not jnp.issubdtype(batch[k].dtype, jnp.integer):
      raise ValueError(f"batch['{k}'] must be integer, got {batch[k].dtype}")
  if objective == "grpo":
    if not grpo.needs_reference(loss_cfg) and "ref_logp_BC" in batch:
      raise ValueError(f"loss.beta={loss_cfg.beta}: batch['ref_logp_BC'] is never used with "
                       "beta = 0 (the reference forward is skipped)")
    if grpo.needs_reference(loss_cfg) and "ref_logp_BC" not in batch and not has_ref_params:
      raise ValueError(f"loss.beta={loss_cfg.beta} > 0 needs ref_params (or "
                       "batch['ref_logp_BC'])")
    if loss_cfg.mask_truncated_completions and "truncated_B" not in batch:
      raise ValueError("loss.mask_truncated_completions=True needs batch['truncated_B']")
    if loss_cfg.rollout_is_correction and "sampler_logp_BC" not in batch:
      raise ValueError("loss.rollout_is_correction=True needs batch['sampler_logp_BC'] (the "
                       "sampler's log-probs; multi-turn rollouts do not carry them)")
    if loss_cfg.loss_type == "flow_grpo":
      if "turn_ids_BC" not in batch:
        raise ValueError("loss.loss_type='flow_grpo' needs batch['turn_ids_BC'] (the turn of "
                         "each completion token)")
      if max_turns is not None:
        _check_turn_ids(batch, rollout, max_turns)
  if valid is not None:
    _check_token_ids(batch, rollout, valid)
  n_batch_dev = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES]))
  accum = optim_cfg.grad_accum_steps
  S = loss_cfg.steps_per_generation if objective == "grpo" else 1
  if B % (S * (group_size or 1)):
    raise ValueError(f"batch of {B} rows must split into loss.steps_per_generation={S} slices "
                     f"of whole groups of G={group_size or 1} rows")
  rows, what = B // S, f"batch of {B} rows" if S == 1 else f"slice of {B // S} rows"
  if rows % accum or (rows // accum) % n_batch_dev:
    raise ValueError(f"{what} must split into optim.grad_accum_steps={accum} "
                     f"micro-batches each divisible by the data×fsdp={n_batch_dev} devices")


def _loss_tokens(batch, rollout, C: int) -> np.ndarray:
  """[B, C] bool: the completion tokens that may enter the loss."""
  if not rollout:
    return np.asarray(batch["completion_mask_BC"]) > 0
  on = np.arange(C)[None, :] < np.asarray(batch["lengths_B"])[:, None]
  if "loss_mask_BC" in batch:
    on &= np.asarray(batch["loss_mask_BC"]) > 0
  return on


def _check_token_ids(batch, rollout, valid):
  """Completion ids that may enter the loss lie in [0, valid): logprobs.token_logprobs would read
  another's log-prob off a clamped row, and its gradient would not be that value's."""
  name = "completion_BC" if rollout else "tokens_BS"
  ids = np.asarray(batch[name])
  C = ids.shape[1] if rollout else _shape(batch["completion_mask_BC"])[-1]
  ids = ids[:, -C:]
  bad = _loss_tokens(batch, rollout, C) & ((ids < 0) | (ids >= valid))
  if bad.any():
    b, j = np.argwhere(bad)[0]
    shown = np.unique(ids[bad])[:8].tolist()
    raise ValueError(f"batch['{name}'] holds completion token ids {shown} outside [0, V={valid})"
                     f" (V: valid_vocab_size, the head rows in the softmax) on {int(bad.sum())} "
                     f"loss tokens, the first at completion [{b}, {j}]")


def _check_turn_ids(batch, rollout, max_turns):
  """Turn ids of the completion tokens that may enter the loss lie in [0, max_turns)."""
  turns = np.asarray(batch["turn_ids_BC"])
  on = _loss_tokens(batch, rollout, turns.shape[1])
  bad = on & ((turns < 0) | (turns >= max_turns))
  if bad.any():
    b, j = np.argwhere(bad)[0]
    raise ValueError(f"batch['turn_ids_BC'][{b}, {j}]={turns[b, j]} is outside [0, max_turns="
                     f"{max_turns}) on a loss token ({int(bad.sum())} such tokens)")


def make_batch(rollout, loss_cfg, *, group_size, reward_weights):
  """Rollout layout → train layout, and the advantage statistics. Pure; runs on device.

  Example (G = 1): prompt_NP [[0, 4]], completion_BC [[7, 9, 0]], lengths_B [2] → tokens_BS
  [[0, 4, 7, 9, 0]], attn_mask_BS [[0, 1, 1, 1, 0]], completion_mask_BC [[1, 1, 0]]; with
  loss_mask_BC [[0, 1, 1]] the completion mask is [[0, 1, 0]] and attn_mask_BS is unchanged.
  """
  C = rollout["completion_BC"].shape[1]
  cmask_BC = (jnp.arange(C)[None, :] < rollout["lengths_B"][:, None]).astype(jnp.int32)
  # Observation tokens are context: attended to, never in the loss.
  loss_BC = (cmask_BC if "loss_mask_BC" not in rollout
             else cmask_BC * (rollout["loss_mask_BC"] > 0).astype(jnp.int32))
  adv_B, stats = grpo.group_advantages(
      rollout["rewards_BR"], group_size,
      # jnp: the weights are hparams, traced (arrays, which a caller may batch).
      weights_R=jnp.asarray(reward_weights, jnp.float32),
      scale_rewards=loss_cfg.scale_rewards, aggregation=loss_cfg.reward_aggregation)
  batch = {
      "tokens_BS": jnp.concatenate([jnp.repeat(rollout["prompt_NP"], group_size, axis=0),
                                    rollout["completion_BC"]], 1),
      "attn_mask_BS": jnp.concatenate([jnp.repeat(rollout["prompt_mask_NP"].astype(jnp.int32),
                                                  group_size, axis=0), cmask_BC], 1),
      "prompt_NP": rollout["prompt_NP"],
      "prompt_mask_NP": rollout["prompt_mask_NP"].astype(jnp.int32),
      "completion_mask_BC": loss_BC,
      "advantages_B": adv_B,
  }
  for k in ("truncated_B", "turn_ids_BC", "sampler_logp_BC", "old_logp_BC"):
    if k in rollout:
      batch[k] = rollout[k]
  return batch, stats


# ------------------------------------------------------------------------------------------------
# Forward to completion log-probs.


def build_model(model_cfg, optim_cfg, mesh):
  """The training forward's model: compute and param dtypes and remat from the optimizer
  config; the residual stream pinned to the batch split (see qwen.Qwen.act_sharding)."""
  return qwen.build(model_cfg, dtype=optim_cfg.compute_dtype, param_dtype=optim_cfg.param_dtype,
                    remat=optim_cfg.remat, mesh=mesh)


def completion_logprobs(model, variables, tokens_BS, attn_mask_BS, C, *, temperature, valid,
                        block_bytes, group=1, prompts=None, entropy_grad=False):
  """Per-token log-probs and entropies of the last C tokens: ([B, C], [B, C]) fp32.

  variables: what model.apply takes, {'params': ...} and with LoRA {'lora': ...} (policy_vars).

  Position t's hidden state predicts token t + 1, so the completion's C tokens are predicted
  from positions P − 1 … S − 2. Only the first `valid` head rows enter the softmax: rows past
  the tokenizer are never sampled, so these are the log-probs of the distribution the sampler
  drew from.

  group > 1: every `group` consecutive rows share their prompt (a GRPO group, left-padded
  identically). The prompt then runs once per group, in one pass with its completions (each
  row of the pass is a prompt followed by its G completions: qwen.Qwen.packed), instead of
  once per row: the same numbers, at about 1/group of the prompt's cost (in the reference
  forward and the policy's forward and backward alike). prompts: (prompt_bP, prompt_mask_bP),
  the b = B / group prompts once each, as a rollout batch carries them; None: taken from every
  group's first row. entropy_grad: whether the entropies carry a gradient (loss.entropy_coef).
  """
  B, S = tokens_BS.shape
  positions_BS = qwen.positions_from_mask(attn_mask_BS)
  if group > 1 and C > 1:
    P_, c, b = S - C, C - 1, B // group
    if prompts is None:
      prompts = (tokens_BS[::group, :P_], attn_mask_BS[::group, :P_])
    prompt_bP, pmask_bP = prompts
    pack = lambda prompt_bP, x_BS: jnp.concatenate([prompt_bP, x_BS[:, P_:-1].reshape(b, -1)], 1)
    hidden_bTD, _ = model.clone(packed=(P_, group)).apply(
        variables, pack(prompt_bP, tokens_BS),
        pack(qwen.positions_from_mask(pmask_bP), positions_BS), (pmask_bP, attn_mask_BS[:, :-1]))
    last_B1D = jnp.repeat(hidden_bTD[:, P_ - 1:P_], group, axis=0)  # predicts token 0
    hidden_BCD = jnp.concatenate([last_B1D, hidden_bTD[:, P_:].reshape(B, c, -1)], axis=1)
  else:
    hidden_BTD, _ = model.apply(variables, tokens_BS[:, :-1], positions_BS[:, :-1],
                                attn_mask_BS[:, :-1])
    hidden_BCD = hidden_BTD[:, -C:]
  head_VD = qwen.head_kernel(variables["params"], model.cfg).T[:valid].astype(model.dtype)
  return logprobs.token_logprobs(hidden_BCD, head_VD, tokens_BS[:, -C:],
                                 temperature=temperature, block_bytes=block_bytes,
                                 entropy_grad=entropy_grad)


def _split_micro(x, accum, mesh, unit=1):
  """[B, ...] → [accum, B/accum, ...] in runs of `unit` consecutive rows: micro-batch a holds
  runs a, a + accum, … (unit = G keeps a GRPO group whole). When each micro-batch's runs split
  evenly over the devices, every device keeps its own rows of the contiguous batch split, so no
  resharding is needed."""
  x = x.reshape(x.shape[0] // (accum * unit), accum, unit, *x.shape[1:]).swapaxes(0, 1)
  x = x.reshape(accum, -1, *x.shape[3:])
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, sharding.BATCH_AXES)))


def _join_micro(x, unit=1):
  """Inverse of _split_micro."""
  x = x.reshape(x.shape[0], -1, unit, *x.shape[2:]).swapaxes(0, 1)
  return x.reshape(-1, *x.shape[3:])


def make_logprob_fn(model_cfg, optim_cfg, mesh, *, temperature=1.0, valid_vocab_size=None,
                    group=1, unit=1):
  """Jitted (params, tokens_BS, attn_mask_BS, C) → logp_BC, forward only, in grad_accum_steps
  micro-batches of runs of `unit` rows (_split_micro; group: rows per micro-batch sharing a
  prompt, see completion_logprobs; TrainStep.micro_layout gives the step's pair). For tests and
  benchmarks: the train step computes its own."""
  validate_optim_config(optim_cfg)
  model = build_model(model_cfg, optim_cfg, mesh)
  accum = optim_cfg.grad_accum_steps
  param_sh = state_shardings(model_cfg, optim_cfg, mesh)["params"]
  row_sh = NamedSharding(mesh, P(sharding.BATCH_AXES))
  kw = dict(temperature=temperature, valid=valid_vocab_size or model_cfg.vocab_size,
            block_bytes=logprobs.platform_block_bytes(optim_cfg.logprob_block_bytes,
                                                      compile_cache.platform(mesh)),
            group=group)

  def fn(params, tokens_BS, attn_mask_BS, C):
    micro = (_split_micro(tokens_BS, accum, mesh, unit),
             _split_micro(attn_mask_BS, accum, mesh, unit))
    logp_ABC = jax.lax.map(
        lambda xs: completion_logprobs(model, {"params": params}, *xs, C, **kw)[0], micro)
    return _join_micro(logp_ABC, unit)

  return jax.jit(fn, in_shardings=(param_sh, row_sh, row_sh), out_shardings=row_sh,
                 static_argnums=3, compiler_options=compile_cache.compiler_options(mesh))


# ------------------------------------------------------------------------------------------------
# The step: one pure function of (state, batch, hparams, ref_params) and a static spec.


class _SectionSpec:
  """A frozen copy of a config section, hashable, so that a StepSpec holding it can be jit's
  static argument. Its fields are the schema's for that section (_section_spec)."""

  @classmethod
  def of(cls, cfg):
    """The spec of a config section (a ConfigDict holding the schema's fields)."""
    return cls(**{f.name: cfg[f.name] for f in dataclasses.fields(cls)})


def _section_spec(name: str, section, doc: str) -> type:
  """A frozen dataclass with one field per field of the schema's section `section()`
  (grpo_jax.config), typed as the schema types it: the spec is declared once, by the schema."""
  block = section()
  cls = dataclasses.make_dataclass(
      name, [(key, block.get_type(key)) for key in block.keys()], bases=(_SectionSpec,),
      frozen=True, namespace={"__doc__": doc, "__module__": __name__})
  cls.__qualname__ = name
  return cls


LossSpec = _section_spec("LossSpec", config_lib.loss, """\
The static part of a loss config (grpo_jax.config.loss, every field): what shapes the program.
beta, epsilon and epsilon_high are kept for reading; the program takes them from hparams.""")

OptimSpec = _section_spec("OptimSpec", config_lib.optim, """\
The static part of an optimizer config (grpo_jax.config.optim, every field); lr comes from
hparams.""")


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static about a train step: the program is a function of the spec, and jit
  compiles one per (spec, batch layout). Build it with `StepSpec.build`.

  temperature: the sampling temperature (log-probs are those of logits / temperature).
  valid: head rows in the softmax (the tokenizer's size).
  max_completion_length: dr_grpo's constant C (None: the batch's completion width).
  group_size, num_rewards: rollout batches (advantages are computed in the step).
  objective: 'grpo' or 'sft' (the warm start: mean NLL of the completion tokens).
  max_turns: flow_grpo's static bound on a row's turns (grpo.flow_grpo_weights).
  with_ref: whether the program takes frozen params (policy.needs_frozen): the reference (β > 0
    and no ref_logp_BC given), or with LoRA always (the base the adapters attach to).
  policy: what the state's params are and what the frozen params are (grpo_jax.policy): Full
    fine-tuning, or Lora: adapters on the frozen base.
  cond: how the step branches on a traced predicate (whether the policy is the reference),
    with jax.lax.cond's signature: jax.lax.cond itself by default. A program that runs the
    step for several batches at once under a transformation (jax.vmap turns a cond whose
    predicate it batches into a select that runs both branches) passes one that decides for
    all of them; its result must be what jax.lax.cond's would be for each.
  """
  model: qwen.QwenConfig
  loss: LossSpec
  optim: OptimSpec
  mesh: Any
  temperature: float = 1.0
  valid: int = 0
  max_completion_length: int | None = None
  group_size: int | None = None
  num_rewards: int | None = None
  objective: str = "grpo"
  max_turns: int | None = None
  with_ref: bool = False
  policy: policy_lib.Policy = policy_lib.FULL
  cond: Callable = jax.lax.cond

  @staticmethod
  def build(model_cfg, loss_cfg, optim_cfg, mesh, *, temperature=1.0, valid_vocab_size=None,
            max_completion_length=None, group_size=None, num_rewards=None, objective="grpo",
            max_turns=None, policy=policy_lib.FULL) -> StepSpec:
    """Validates the settings (ValueError naming the first bad one) and freezes them."""
    if objective not in OBJECTIVES:
      raise ValueError(f"objective={objective!r} is not one of {OBJECTIVES}")
    grpo.validate_loss_config(loss_cfg)
    if objective == "grpo" and grpo.syncs_reference(loss_cfg) and policy.applies_frozen:
      raise ValueError("loss.sync_ref_model=True: a LoRA run's reference is its frozen base "
                       "(the adapters off), which nothing may change; use full fine-tuning")
    validate_optim_config(optim_cfg)
    logprobs.check_temperature(temperature)
    if objective == "grpo" and loss_cfg.loss_type == "flow_grpo" and not (
        isinstance(max_turns, int) and max_turns >= 1):
      raise ValueError(f"loss.loss_type='flow_grpo' needs max_turns, an int >= 1 (the bound on "
                       f"a row's turns), got max_turns={max_turns!r}")
    optim = OptimSpec.of(optim_cfg)  # with the log-prob block the platform runs
    optim = dataclasses.replace(optim, logprob_block_bytes=logprobs.platform_block_bytes(
        optim.logprob_block_bytes, compile_cache.platform(mesh)))
    return StepSpec(model_cfg, LossSpec.of(loss_cfg), optim, mesh,
                    float(temperature), int(valid_vocab_size or model_cfg.vocab_size),
                    max_completion_length, group_size, num_rewards, objective, max_turns,
                    policy=policy)


def hparams(loss_cfg, optim_cfg, reward_weights=(), policy=policy_lib.FULL
            ) -> dict[str, np.ndarray]:
  """The step's array settings, which may differ between runs of one program: float32 scalars (and
  the reward weights; with LoRA its scale alpha / r). The clip bounds are formed here in
  float64 and rounded once, as Python folds `1.0 - epsilon` when it is a constant."""
  f32 = lambda x: np.asarray(x, np.float32)
  hp = {"lr": f32(optim_cfg.lr), "beta": f32(loss_cfg.beta),
        "clip_low": f32(1.0 - float(loss_cfg.epsilon)),
        "clip_high": f32(1.0 + float(loss_cfg.epsilon_high)),
        "reward_weights": f32(tuple(map(float, reward_weights)))}
  if loss_cfg.loss_type == "cispo":  # its cap of the weight itself (no other loss reads it)
    hp["epsilon_high"] = f32(loss_cfg.epsilon_high)
  hp.update({k: f32(v) for k, v in policy.hparams().items()})
  return hp


def policy_vars(spec: StepSpec, params, frozen, hp=None) -> dict:
  """The policy's variables for model.apply: {'params': params} (full fine-tuning), or with
  LoRA the frozen base with the adapters (params) on, b scaled by hp['lora_scale']."""
  return spec.policy.variables(params, frozen, None if hp is None else hp.get("lora_scale"))


def _policy_is_reference(spec, params, frozen, dtype):
  """A traced bool: whether the policy computes exactly what the reference does. Full
  fine-tuning: the params equal the reference's as the forward uses them. LoRA: every b is 0,
  so each adapted projection adds exact zeros to the base's (policy.is_reference)."""
  return spec.policy.is_reference(params, frozen, dtype)


_METRIC_IDENTITY = {"ratio/min": jnp.inf, "ratio/max": -jnp.inf}


def _metric_merge(a, b):
  """Accumulates loss_terms sums across micro-batches: min/max for the ratio range, else sum."""
  return {k: jnp.minimum(a[k], b[k]) if k == "ratio/min" else
          jnp.maximum(a[k], b[k]) if k == "ratio/max" else a[k] + b[k] for k in a}


def micro_layout(spec: StepSpec, rows: int) -> tuple[int, int]:
  """(unit, group) for a group-major rollout batch of `rows` rows: micro-batches take runs of
  `unit` rows (_split_micro), and every `group` consecutive rows of one share a prompt, which
  then runs once for them (completion_logprobs; 1: none).

  Whole groups (G, G) where each micro-batch's prompts split evenly over the data × fsdp
  devices: the prompt runs once per group whatever grad_accum_steps is. Else rows a, a +
  accum, … (1, G / accum) where accum divides G with at least 2 rows left; else (1, 1).
  Example: 96 prompts × G = 8 on 8 devices: accum 4 → (8, 8) (3 prompts per device and
  micro-batch); accum 8 → (1, 1) (96 prompts do not split into 8 × 8).
  """
  g, accum = spec.group_size or 1, spec.optim.grad_accum_steps
  n_dev = int(np.prod([spec.mesh.shape[a] for a in sharding.BATCH_AXES]))
  prompts = rows // g
  if g > 1 and prompts % (accum * n_dev) == 0:
    return g, g
  if g % accum or g // accum < 2 or prompts % n_dev:
    return 1, 1
  return 1, g // accum


def _normalisers(spec, mask_BC, unit=1, group=1):
  """What the loss divides by, over the whole batch (so micro-batching never changes it), and
  the micro-batch layout (micro_layout)."""
  return {"tokens": mask_BC.sum(), "sequences": mask_BC.shape[0],
          "max_completion_length": spec.max_completion_length or mask_BC.shape[1],
          "unit": unit, "group": group}


def _loss(spec, model, hp, params, ref_params, mb, norm, ref_is_policy):
  """One micro-batch's share of the loss; aux: metric sums, log-probs, reference log-probs.
  ref_params: the frozen params (the reference; with LoRA the base, adapters off).
  ref_is_policy: a traced bool, whether the policy computes what the reference does."""
  C = mb["completion_mask_BC"].shape[1]
  kw = _logprob_kw(spec, norm, mb)
  bonus = spec.objective == "grpo" and grpo.entropy_bonus(spec.loss)
  logp_BC, entropy_BC = completion_logprobs(model, policy_vars(spec, params, ref_params, hp),
                                            mb["tokens_BS"], mb["attn_mask_BS"], C, **kw,
                                            entropy_grad=bonus)
  mask_BC = mb["mask_BC"]
  if spec.objective == "sft":
    loss = -jnp.sum(mask_BC * logp_BC) / jnp.maximum(norm["tokens"], 1.0)
    sums, ref_BC = {}, None
  else:
    ref_BC = mb.get("ref_logp_BC")
    if grpo.needs_reference(spec.loss) and ref_BC is None:
      # While the policy is the reference (a run's first step), its log-probs are the
      # reference's: taken as they are, the KL term is exactly 0 with its exact gradient, and
      # the reference forward is skipped. (A second forward would differ from the policy's in
      # rounding, and that noise, with all advantages 0, is a whole gradient that Adam turns
      # into lr-sized steps.)
      policy = lambda: jax.lax.stop_gradient(logp_BC)
      reference = lambda: jax.lax.stop_gradient(completion_logprobs(
          model, {"params": ref_params}, mb["tokens_BS"], mb["attn_mask_BS"], C, **kw)[0])
      ref_BC = spec.cond(ref_is_policy, policy, reference)
    weights_BC = grpo.token_weights(mask_BC, spec.loss.loss_type,
                                    num_sequences=norm["sequences"],
                                    num_tokens=norm.get("weight_tokens", norm["tokens"]),
                                    max_completion_length=norm["max_completion_length"],
                                    turn_ids_BC=mb.get("turn_ids_BC"), max_turns=spec.max_turns)
    keep_BC, kept = _entropy_keep(spec.loss, mb, mask_BC, entropy_BC, norm)
    loss, sums = grpo.loss_terms(
        logp_BC, mb.get("old_logp_BC"), ref_BC, mb["advantages_B"], mask_BC, weights_BC,
        spec.loss, hp=hp, sampler_logp_BC=mb.get("sampler_logp_BC"), entropy_BC=entropy_BC,
        entropy_keep_BC=keep_BC,
        entropy_weights_BC=grpo.entropy_weights(mask_BC, keep_BC, kept) if bonus else None)
  sums["loss"] = jax.lax.stop_gradient(loss)
  sums["entropy/sum"] = jnp.sum(jax.lax.stop_gradient(entropy_BC) * mask_BC)
  return loss, (sums, jax.lax.stop_gradient(logp_BC), ref_BC)


def _logprob_kw(spec, norm, mb):
  """completion_logprobs' settings for a micro-batch."""
  return dict(temperature=spec.temperature, valid=spec.valid,
              block_bytes=spec.optim.logprob_block_bytes, group=norm["group"],
              prompts=(mb["prompt_NP"], mb["prompt_mask_NP"]) if "prompt_NP" in mb else None)


def _entropy_keep(lc, mb, mask_BC, entropy_BC, norm):
  """top_entropy_quantile's mask of a micro-batch and the step's count of kept loss tokens:
  (None, tokens) when every token is kept; given in mb when _whole_batch_keep made them for
  several micro-batches; else (one micro-batch: the whole batch) from its own entropies."""
  if lc.top_entropy_quantile >= 1:
    return None, norm["tokens"]
  if "entropy_keep_BC" in mb:
    return mb["entropy_keep_BC"], norm["kept_tokens"]
  entropy_BC = jax.lax.stop_gradient(entropy_BC)
  keep_BC = grpo.high_entropy_keep(entropy_BC, mask_BC, grpo.entropy_threshold(
      entropy_BC, mask_BC, lc.top_entropy_quantile))
  return keep_BC, keep_BC.sum()


def _whole_batch_keep(spec, model, hp, params, ref_params, micro, norm):
  """top_entropy_quantile over several micro-batches: the entropies of the whole batch at the
  update's params (a forward of each micro-batch, before the gradients), so that every
  micro-batch masks against the batch's quantile, as one micro-batch would. Returns the
  [accum, b, C] mask and the kept loss tokens' count."""
  variables = policy_vars(spec, params, ref_params, hp)

  def entropy(mb):
    C = mb["completion_mask_BC"].shape[1]
    return completion_logprobs(model, variables, mb["tokens_BS"], mb["attn_mask_BS"], C,
                               **_logprob_kw(spec, norm, mb))[1]
  entropy_ABC = jax.lax.stop_gradient(jax.lax.map(entropy, micro))
  mask_ABC = micro["mask_BC"]
  keep_ABC = grpo.high_entropy_keep(entropy_ABC, mask_ABC, grpo.entropy_threshold(
      entropy_ABC, mask_ABC, spec.loss.top_entropy_quantile))
  return keep_ABC, keep_ABC.sum()


_ROW_KEYS = ("tokens_BS", "attn_mask_BS", "advantages_B", "old_logp_BC", "ref_logp_BC", "mask_BC",
             "completion_mask_BC", "turn_ids_BC", "sampler_logp_BC")


def _micro_batches(spec, batch, norm, accum=None):
  """The batch's row arrays as [accum, B / accum, ...] micro-batches (_split_micro, in runs of
  norm['unit'] rows; accum default grad_accum_steps), with the packed forward's prompts of each
  where norm['group'] > 1."""
  accum, mesh, unit = accum or spec.optim.grad_accum_steps, spec.mesh, norm["unit"]
  micro = {k: _split_micro(batch[k], accum, mesh, unit) for k in _ROW_KEYS if k in batch}
  if norm["group"] > 1 and "prompt_NP" in batch:  # the packed forward's prompts, once per group
    for k in _PROMPTS:
      if unit > 1:  # whole groups: micro-batch a holds groups a, a + accum, …, so their prompts
        micro[k] = _split_micro(batch[k], accum, mesh, 1)
      else:  # rows a, a + accum, … of every group: every micro-batch has every prompt
        micro[k] = jax.lax.with_sharding_constraint(
            jnp.broadcast_to(batch[k], (accum,) + batch[k].shape),
            NamedSharding(mesh, P(None, sharding.BATCH_AXES)))
  return micro


def _grads(spec, hp, params, ref_params, batch, norm):
  """Gradients summed over grad_accum_steps micro-batches, metric sums, [B, C] log-probs and
  reference log-probs (None unless computed)."""
  model = build_model(spec.model, spec.optim, spec.mesh)
  ref_is_policy = (False if ref_params is None or not grpo.needs_reference(spec.loss)
                   or spec.objective != "grpo"
                   else _policy_is_reference(spec, params, ref_params, model.dtype))
  accum, mesh = spec.optim.grad_accum_steps, spec.mesh
  unit = norm["unit"]
  micro = _micro_batches(spec, batch, norm)
  if spec.objective == "grpo" and spec.loss.top_entropy_quantile < 1 and accum > 1:
    micro["entropy_keep_BC"], kept = _whole_batch_keep(spec, model, hp, params, ref_params,
                                                       micro, norm)
    norm = dict(norm, kept_tokens=kept)
  grad_fn = jax.grad(lambda p, mb: _loss(spec, model, hp, p, ref_params, mb, norm, ref_is_policy),
                     has_aux=True)
  param_sh = state_shardings(spec.model, spec.optim, mesh, spec.policy)["params"]
  constrain = lambda g: jax.lax.with_sharding_constraint(g, param_sh)
  if accum == 1:
    grads, (sums, logp, ref) = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
    return constrain(grads), sums, logp, ref

  # One traced copy of the backward pass: scan from zero gradients and identity metric sums.
  grads0, (sums0, _, _) = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
  grads0 = constrain(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), grads0))
  sums0 = {k: jnp.full(v.shape, _METRIC_IDENTITY.get(k, 0), v.dtype) for k, v in sums0.items()}

  def body(carry, mb):
    g_acc, s_acc = carry
    g, (s, logp, ref) = grad_fn(params, mb)
    return (constrain(jax.tree.map(jnp.add, g_acc, g)), _metric_merge(s_acc, s)), (logp, ref)
  (grads, sums), (logp, ref) = jax.lax.scan(body, (grads0, sums0), micro)
  return grads, sums, _join_micro(logp, unit), None if ref is None else _join_micro(ref, unit)


def _adaptive_entropy(spec) -> bool:
  """Whether this step steps the entropy controller: a GRPO step with loss.use_adaptive_entropy,
  whose state create_train_state gave an 'entropy_ctrl' (the warm start's has none)."""
  return spec.objective == "grpo" and spec.loss.use_adaptive_entropy


def _synced_reference(spec) -> bool:
  """Whether this step's reference follows the policy: a GRPO step with loss.sync_ref_model
  (β > 0), whose state create_train_state gave a 'ref' (the warm start's has none)."""
  return spec.objective == "grpo" and grpo.syncs_reference(spec.loss)


def _update(spec, hp, state, ref_params, batch, norm):
  """One optimizer update; skipped (state unchanged) if the loss or gradient is not finite."""
  params = state["params"]
  if _adaptive_entropy(spec):  # the coefficient set by the updates before this one
    hp = dict(hp, entropy_coef=grpo.adaptive_entropy_applied(state["entropy_ctrl"], spec.loss))
  grads, sums, logp, ref = _grads(spec, hp, params, ref_params, batch, norm)
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(grad_norm) & jnp.isfinite(sums["loss"])
  optimizer = make_optimizer(spec.optim, lr=hp["lr"])

  def apply(st):
    updates, opt_state = optimizer.update(grads, st["opt_state"], st["params"])
    return {"params": optax.apply_updates(st["params"], updates), "opt_state": opt_state}
  # where(ok, new, old) per leaf, which XLA fuses into each leaf's in-place update. Not a
  # lax.cond with an identity branch: a GPU compile copies its result, params and moments, into
  # the donated buffers every step (1.5B, gpu_step.py's workload, H100 target: 9.2 GB more peak
  # memory, 26 GB more written; the 0.5b preset 3.1 GB more peak; XLA:CPU's peak is the same
  # within 0.04 GB, benchmarks/memory.py; experiments/train_traffic_2026-11-27.md).
  old = {"params": params, "opt_state": state["opt_state"]}
  new = apply(old)
  if _adaptive_entropy(spec):  # a skipped update leaves the controller as it was, too
    old["entropy_ctrl"] = state["entropy_ctrl"]
    new["entropy_ctrl"] = grpo.adaptive_entropy_next(state["entropy_ctrl"], sums["loss/entropy"],
                                                     spec.loss)
  new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  new_state["step"] = state["step"] + ok.astype(jnp.int32)
  if _synced_reference(spec):  # after every ref_model_sync_steps-th applied update
    due = ok & grpo.reference_sync_due(new_state["step"], spec.loss)
    mixed = grpo.mix_reference(state["ref"], new_state["params"], spec.loss.ref_model_mixup_alpha)
    new_state["ref"] = jax.tree.map(lambda m, r: jnp.where(due, m, r), mixed, state["ref"])
  tokens = norm["tokens"]
  metrics = {} if spec.objective == "sft" else grpo.finalize_metrics(sums, tokens)
  metrics.update({
      "loss": sums["loss"],
      "entropy": sums["entropy/sum"] / jnp.maximum(tokens, 1.0),
      "grad_norm": grad_norm,
      "lr": learning_rate_schedule(spec.optim, lr=hp["lr"])(state["step"]),
      "step/skipped": 1.0 - ok.astype(jnp.float32),
  })
  if _adaptive_entropy(spec):  # TRL's entropy_coef: the coefficient after this update
    metrics["entropy_coef"] = new_state["entropy_ctrl"]["coef"]
    metrics["entropy_coef/applied"] = hp["entropy_coef"]
  return new_state, metrics, logp, ref


def _over_updates(ms):
  """The step's metrics from the μ updates' (stacked on axis 0): the ratio's min and max over
  all of them, the adaptive entropy_coef the last one's, every other metric their mean, so
  `step/skipped` is the fraction skipped."""
  return {k: v.min(0) if k == "ratio/min" else v.max(0) if k == "ratio/max"
          else v[-1] if k == "entropy_coef" else v.mean(0) for k, v in ms.items()}


def _slices(spec) -> int:
  """S, the updates of one pass over a generation batch (loss.steps_per_generation; the warm
  start's batches are one update each)."""
  return spec.loss.steps_per_generation if spec.objective == "grpo" else 1


def _mu_updates(spec, hp, state, ref_params, batch, layout):
  """The μ = loss.num_iterations updates on the whole batch (S = 1): (state, metrics, the first
  update's [B, C] log-probs). The first update's forward gives the old log-probs of updates
  2..μ (its params are the ones that sampled) and their reference log-probs."""
  norm = _normalisers(spec, batch["mask_BC"], *layout)
  state, m, logp_BC, ref_BC = _update(spec, hp, state, ref_params, batch, norm)
  if spec.objective == "grpo" and spec.loss.num_iterations > 1:
    later = dict(batch, old_logp_BC=batch.get("old_logp_BC", logp_BC))
    if ref_BC is not None:
      later["ref_logp_BC"] = ref_BC

    def body(st, _):
      # The reference log-probs are the first update's; LoRA's policy still needs its base.
      st, m_it, _, _ = _update(spec, hp, st, ref_params if spec.policy.applies_frozen else None,
                               later, norm)
      return st, m_it
    state, ms = jax.lax.scan(body, state, None, length=spec.loss.num_iterations - 1)
    m = _over_updates(jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), m, ms))
  return state, m, logp_BC


def _slice_batch(spec, batch):
  """The batch as S = loss.steps_per_generation slices, [S, B / S, ...] per row array: slice s
  holds runs s, s + S, … of G rows (whole groups; G = 1 without group_size), and its groups'
  prompts once each. Example (B = 8, G = 2, S = 2): slice 0 rows 0, 1, 4, 5; slice 1 rows 2,
  3, 6, 7."""
  S, mesh, unit = _slices(spec), spec.mesh, spec.group_size or 1
  sliced = {k: _split_micro(batch[k], S, mesh, unit) for k in _ROW_KEYS if k in batch}
  sliced.update({k: _split_micro(batch[k], S, mesh, 1) for k in _PROMPTS if k in batch})
  return sliced


def _start_logprobs(spec, variables, sliced, layout):
  """[S, b, C] log-probs of every slice of model.apply's `variables` (forward only, in
  grad_accum_steps micro-batches): S > 1 slices' old and reference log-probs, taken before the
  first update."""
  model = build_model(spec.model, spec.optim, spec.mesh)

  def one(sl):
    norm = _normalisers(spec, sl["mask_BC"], *layout)
    C = sl["mask_BC"].shape[1]
    logp = jax.lax.map(lambda mb: completion_logprobs(
        model, variables, mb["tokens_BS"], mb["attn_mask_BS"], C,
        **_logprob_kw(spec, norm, mb))[0], _micro_batches(spec, sl, norm))
    return _join_micro(logp, layout[0])
  return jax.lax.stop_gradient(jax.lax.map(one, sliced))


def _sliced_updates(spec, hp, state, ref_params, batch, layout):
  """loss.steps_per_generation S > 1: μ passes over the S slices (_slice_batch), one update per
  slice, in TRL's order (slice 0, 1, …, S − 1, then again for each further pass). Every update's
  old log-probs are the params' before the first update (or the batch's old_logp_BC), its
  reference log-probs those of the reference before it, both taken for every slice first.
  Returns (state, metrics over the μ·S updates, the [B, C] log-probs at the start params)."""
  S, lc = _slices(spec), spec.loss
  sliced = _slice_batch(spec, batch)
  params = state["params"]
  start_SbC = _start_logprobs(spec, policy_vars(spec, params, ref_params, hp), sliced, layout)
  sliced.setdefault("old_logp_BC", start_SbC)
  if grpo.needs_reference(lc) and "ref_logp_BC" not in sliced:
    # As in _loss: while the policy is the reference, its log-probs are the reference's.
    dtype = jnp.dtype(spec.optim.compute_dtype)
    sliced["ref_logp_BC"] = spec.cond(
        _policy_is_reference(spec, params, ref_params, dtype), lambda: start_SbC,
        lambda: _start_logprobs(spec, {"params": ref_params}, sliced, layout))
  generation_tokens = batch["mask_BC"].sum()
  frozen = ref_params if spec.policy.applies_frozen else None

  def body(st, s):
    sl = jax.tree.map(lambda x: x[s], sliced)
    norm = _normalisers(spec, sl["mask_BC"], *layout)
    if lc.loss_type in grpo.GENERATION_NORMALISED:  # TRL: the generation batch's tokens / S
      norm["weight_tokens"] = generation_tokens / S
    st, m_it, _, _ = _update(spec, hp, st, frozen, sl, norm)
    return st, m_it
  state, ms = jax.lax.scan(body, state, jnp.arange(lc.num_iterations * S) % S)
  return state, _over_updates(ms), _join_micro(start_SbC, spec.group_size or 1)


def train_step(state, batch, hparams, ref_params=None, *, spec: StepSpec):
  """One whole GRPO update, pure: (state, batch, hparams, ref_params) → (state, metrics,
  advantages_B). `spec` is static; `hparams` (see `hparams`) are arrays. See the module
  docstring for the batch layouts."""
  hp = hparams
  metrics, layout = {}, (1, 1)
  if is_rollout(batch):
    batch, stats = make_batch(batch, spec.loss, group_size=spec.group_size,
                              reward_weights=hp["reward_weights"])
    metrics.update({f"advantages/{k}": v for k, v in stats.items()})
    layout = micro_layout(spec, batch["tokens_BS"].shape[0] // _slices(spec))
  lc = spec.loss
  mask_BC = (grpo.loss_mask(batch["completion_mask_BC"], batch.get("truncated_B"),
                            lc.mask_truncated_completions) if spec.objective == "grpo"
             else batch["completion_mask_BC"].astype(jnp.float32))
  batch = dict(batch, mask_BC=mask_BC)
  B = mask_BC.shape[0]
  if _synced_reference(spec):  # the reference that follows the policy: its value before the step
    ref_params = state["ref"]
  updates = _sliced_updates if _slices(spec) > 1 else _mu_updates
  state, m, logp_BC = updates(spec, hp, state, ref_params, batch, layout)
  if spec.objective == "grpo" and "sampler_logp_BC" in batch:
    # The train step's log-probs at the params that sampled (the first update's forward).
    metrics.update(grpo.drift_metrics(logp_BC, batch["sampler_logp_BC"], mask_BC,
                                      batch["advantages_B"], lc))
  metrics.update(m)
  tokens = mask_BC.sum()
  metrics.update({"tokens/completion": tokens, "tokens/completion_per_seq": tokens / B,
                  "tokens/total": batch["attn_mask_BS"].astype(jnp.float32).sum()})
  adv_B = batch.get("advantages_B", jnp.zeros((B,), jnp.float32)).astype(jnp.float32)
  if spec.objective == "grpo":
    metrics.update({"advantages/mean": adv_B.mean(), "advantages/std": adv_B.std(),
                    "advantages/min": adv_B.min(), "advantages/max": adv_B.max()})
  return state, metrics, adv_B


# --- host side: checks, placement, one compiled program per layout ------------------------------


def layout_key(batch, with_ref: bool) -> tuple:
  """What tells one program of TrainStep.program from another: the batch's keys, shapes and
  dtypes, and whether the program takes frozen params."""
  return (with_ref,) + tuple(sorted(
      (name, _shape(v), str(v.dtype) if hasattr(v, "dtype") else str(np.asarray(v).dtype))
      for name, v in batch.items()))


class TrainStep:
  """`step(state, batch, ref_params=None) → (state, metrics, advantages_B)`: `train_step`
  compiled once per batch layout with explicit shardings and the state donated, after
  host-side checks of the batch (a bad batch raises and the state survives).

  Keyword arguments as StepSpec.build; reward_weights and the configs' lr, beta, epsilon and
  epsilon_high (and LoRA's alpha / r) are the default hparams. With `policy` a policy.Lora the
  state holds the adapters and `ref_params` is the frozen base, passed on every call.
  `jitted` and `precompile_program` keep programs that a wrapper builds from `train_step` and
  `spec` beside this step's own, counted and compiled ahead the same way.
  """

  def __init__(self, model_cfg, loss_cfg, optim_cfg, mesh, *, temperature=1.0,
               valid_vocab_size=None, max_completion_length=None, group_size=None,
               reward_weights=None, objective="grpo", max_turns=None,
               policy=policy_lib.FULL):
    self.spec = StepSpec.build(
        model_cfg, loss_cfg, optim_cfg, mesh, temperature=temperature,
        valid_vocab_size=valid_vocab_size, max_completion_length=max_completion_length,
        group_size=group_size, num_rewards=None if reward_weights is None else len(
            reward_weights), objective=objective, max_turns=max_turns, policy=policy)
    self.hparams = hparams(loss_cfg, optim_cfg, () if reward_weights is None else reward_weights,
                           policy)
    self.model_cfg, self.mesh = model_cfg, mesh
    self.state_sh = state_shardings(model_cfg, self.spec.optim, mesh, policy,
                                    loss_cfg if objective == "grpo" else None)
    self.ref_sh = reference_shardings(model_cfg, self.spec.optim, mesh, policy)
    self.num_traces = 0  # programs traced (compiled): one per batch layout
    self._programs = {}
    self._ahead = set()  # program keys whose precompile has started

  def micro_layout(self, rows: int) -> tuple[int, int]:
    return micro_layout(self.spec, rows)

  @property
  def num_programs(self) -> int:
    """Compiled programs held: one per key (batch layout) seen."""
    return len(self._programs)

  def needs_ref(self, batch) -> bool:
    """Whether the program takes the frozen params: always with LoRA (its base); never when
    the reference follows the policy (it is in the state)."""
    return self.spec.policy.needs_frozen(
        self.spec.objective == "grpo" and grpo.frozen_reference(self.spec.loss)
        and "ref_logp_BC" not in batch)

  def check(self, batch, has_ref_params: bool) -> None:
    s = self.spec
    if s.policy.applies_frozen and not has_ref_params:
      raise ValueError("a LoRA train step needs the frozen base params (ref_params)")
    check_batch(batch, s.loss, s.optim, s.mesh, s.objective,
                has_ref_params=has_ref_params or _synced_reference(s),  # the state's 'ref'
                group_size=s.group_size, num_rewards=s.num_rewards, max_turns=s.max_turns,
                valid=s.valid)

  def jitted(self, key, make):
    """The program cached under key. On the first call make() gives (fn, jit_kw): fn(state,
    hparams, ref_params, batch) → (state, metrics, advantages_B), jitted with jit_kw and this
    step's compiler options; each trace of it counts in num_traces."""
    if key not in self._programs:
      fn, jit_kw = make()

      def traced(state, hp, ref, b):
        self.num_traces += 1
        return fn(state, hp, ref, b)
      self._programs[key] = jax.jit(
          traced, compiler_options=compile_cache.compiler_options(self.mesh), **jit_kw)
    return self._programs[key]

  def program(self, batch, with_ref: bool):
    """The jitted program for this batch layout (cached by keys, shapes and dtypes)."""
    def make():
      spec = dataclasses.replace(self.spec, with_ref=with_ref)
      rep = sharding.replicated(self.mesh)
      row_sh = NamedSharding(self.mesh, P(sharding.BATCH_AXES))
      one = functools.partial(train_step, spec=spec)
      return (lambda state, hp, ref, b: one(state, b, hp, ref)), dict(
          in_shardings=(self.state_sh, rep, self.ref_sh if with_ref else None,
                        batch_shardings(batch, self.mesh)),
          out_shardings=(self.state_sh, rep, row_sh), donate_argnums=0)
    return self.jitted(layout_key(batch, with_ref), make)

  def __call__(self, state, batch, ref_params=None, hparams=None):
    self.check(batch, ref_params is not None)
    need_ref = self.needs_ref(batch)
    batch = hosts.put(batch, batch_shardings(batch, self.mesh))  # several processes: global
    hp = self.hparams if hparams is None else hparams
    return self.program(batch, need_ref)(state, hp, ref_params if need_ref else None, batch)

  def precompile(self, state, batch_spec, ref_params=None):
    """Starts compiling, in a background thread, the program for batches of batch_spec's
    layout (name -> jax.ShapeDtypeStruct, as __call__ will get them): a run's first step
    overlaps its compile with sampling this way. __call__ needs nothing more: jax.jit runs the
    executable that `.lower().compile()` made for the same program, and a call made while that
    compile runs waits for it instead of compiling again (tests/train_step_test.py counts the
    compiles). If the background compile fails, the call compiles and reports the error. A
    layout no batch turns out to have costs that compile only."""
    need_ref = self.needs_ref(batch_spec)
    self.precompile_program(layout_key(batch_spec, need_ref),
                            lambda: self.program(batch_spec, need_ref), state, batch_spec,
                            ref_params if need_ref else None)

  def precompile_program(self, key, program, state, batch_spec, ref_params=None,
                         hparams=None):
    """precompile for the program cached under key (program() gives it, as `jitted` does),
    once per key: compiled for the layouts of state, batch_spec, ref_params and hparams
    (default: this step's), as the program will get them."""
    if key in self._ahead:
      return
    self._ahead.add(key)
    fn = program()
    # Abstract values: the thread holds no buffers (the step donates the state meanwhile).
    state, ref = jax.tree.map(compile_cache.abstract, (state, ref_params))
    hp = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                      self.hparams if hparams is None else hparams)
    compile_cache.in_background(lambda: fn.lower(state, hp, ref, batch_spec).compile())


def make_grad_fn(model_cfg, loss_cfg, optim_cfg, mesh, batch, **step_kw):
  """Jitted (params, batch, frozen=None) → (loss, grads) of the train step's first update, for
  tests; with policy=policy.Lora(...) in step_kw, params are the adapters and frozen the base."""
  step = TrainStep(model_cfg, loss_cfg, optim_cfg, mesh, **step_kw)
  spec, hp = step.spec, step.hparams
  check_batch(batch, loss_cfg, optim_cfg, mesh, max_turns=spec.max_turns,
              has_ref_params=spec.policy.applies_frozen, valid=spec.valid)

  def fn(params, batch, frozen):
    mask_BC = grpo.loss_mask(batch["completion_mask_BC"], batch.get("truncated_B"),
                             loss_cfg.mask_truncated_completions)
    grads, sums, _, _ = _grads(spec, hp, params, frozen, dict(batch, mask_BC=mask_BC),
                               _normalisers(spec, mask_BC))
    return sums["loss"], grads
  param_sh = step.state_sh["params"]
  jitted = jax.jit(fn, in_shardings=(param_sh, batch_shardings(batch, mesh),
                                     step.ref_sh if spec.policy.applies_frozen else None),
                   out_shardings=(sharding.replicated(mesh), param_sh),
                   compiler_options=compile_cache.compiler_options(mesh))
  return lambda params, batch, frozen=None: jitted(params, batch, frozen)


def make_train_step(model_cfg, loss_cfg, optim_cfg, mesh, **kw) -> TrainStep:
  return TrainStep(model_cfg, loss_cfg, optim_cfg, mesh, **kw)
