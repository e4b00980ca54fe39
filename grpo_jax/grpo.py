"""GRPO maths in pure jnp: group advantages, KL estimators, the loss family.

Nothing here knows about models, meshes or optimizers; `train_step.py` wires these functions to
the Qwen forward pass and `logprobs.py` (and documents the batch layouts).

Legend: B sequences (prompt × G completions, group-major), G group size, R reward components,
C completion width (of the batch; dr_grpo divides by the fixed max_completion_length).

Which paper defines what:
  * GRPO, group-normalised advantages, k3 KL in the loss: DeepSeekMath (Shao et al. 2024).
  * scale_rewards='batch' (group mean, batch std): Lite PPO, "Tricks or Traps?" (Liu et al. 2025).
  * scale_rewards='none' and loss_type='dr_grpo': Dr. GRPO, "Understanding R1-Zero-Like
    Training" (Liu et al. 2025).
  * reward_aggregation='normalize_then_sum': GDPO (group reward-decoupled normalisation).
  * loss_type='dapo' (token mean over the generation batch) and clip-higher (epsilon_high): DAPO
    (Yu et al. 2025). loss_type='bnpo': batch-normalised PO (Xiao et al. 2025).
  * delta, the two-sided cap of the unclipped ratio: INTELLECT-2 (Prime Intellect 2025).
  * importance_sampling_level='sequence': GSPO (Zheng et al. 2025).
  * KL estimators k1, k2, k3: J. Schulman, "Approximating KL Divergence" (2020).
  * loss_type='flow_grpo' (a multi-turn trajectory is one row; its actions' tokens are
    averaged per turn, then over turns, then over trajectories): AgentFlow, "In-the-Flow
    Agentic System Optimization" (2025).
  * loss_type='cispo' (the clipped, stop-gradient importance weight times A times log π):
    MiniMax-M1 (arXiv 2506.13585); its cap epsilon_high is ScaleRL's ε_max (arXiv 2510.13786).
  * loss_type='sapo' (a sigmoid gate in place of the clip): Soft Adaptive Policy Optimization
    (arXiv 2511.20347). loss_type='luspo' (GSPO's loss times each sequence's length): LUSPO
    (arXiv 2602.05261). loss_type='vespo' (a gamma-shaped weight of the sequence ratio): VESPO
    (arXiv 2602.10693).
  * rollout_is_correction (truncated or masked importance sampling between the sampler's and
    the trainer's log-probs): Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training"; TRL's vllm_importance_sampling_*.
  * off_policy_mask_threshold (eq. 9) and use_bias_correction_kl: DeepSeek-V3.2 (arXiv
    2512.02556).
  * top_entropy_quantile: "Beyond the 80/20 Rule" (arXiv 2506.01939). entropy_coef: the
    entropy bonus of PPO (Schulman et al. 2017), as a mean per token (TRL's).
  * use_adaptive_entropy (the coefficient stepped towards an entropy target): Skywork-OR1
    (arXiv 2505.22312), TRL's controller.

Every loss type is written as one weighted token sum, `sum(weight_BC * per_token_loss_BC)`, whose
weights use normalisers of the whole optimizer step (or generation batch), so gradient
accumulation over micro-batches adds up to exactly the full-batch loss:

  grpo       weight = mask / (len_b · B_step)         mean over tokens, then over sequences
  bnpo       weight = mask / tokens_step              token mean over the optimizer step's batch
  dr_grpo    weight = mask / (B_step · C)             token sum over batch × max completion length
  dapo       weight = mask / tokens_generation        token mean over the generation batch
  cispo      weight = mask / tokens_generation        (as dapo; TRL's)
  vespo      weight = mask / tokens_generation        (as dapo; TRL's)
  sapo       weight = mask / (len_b · B_step)         (as grpo; TRL's)
  luspo      weight = mask / B_step                   token sum per sequence, mean over sequences
  flow_grpo  weight = mask / (B_step · T_b · |a_t|)   token mean per action turn t, then mean
                                                      over the row's T_b turns, then over rows

flow_grpo reads turn_ids_BC (0-based turn of each completion token; observation tokens between
actions have mask 0, so their turn id is never read; they are still attended to). T_b counts the
turns of row b with a loss token, |a_t| the loss tokens of turn t in row b. With one turn per row
it is exactly grpo. The advantage is the trajectory's (one row, grpo.group_advantages), the same
at every one of its action tokens.

TRL's bnpo normalises by the tokens of each micro-batch on each process; here it is the step's
batch, so that it is invariant to micro-batching. One generation batch is one optimizer step's
batch here (loss.steps_per_generation = 1), so bnpo and dapo give the same loss; both names are
kept so configs written for TRL mean what they say. With S > 1 slices, an update's batch is a
slice: B_step and tokens_step are the slice's, tokens_generation / S is dapo's normaliser. `grpo_loss(num_tokens=...)` takes a larger dapo normaliser for maths tests.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_jax import errors

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "flow_grpo", "cispo", "sapo", "luspo", "vespo")
# Rollout importance sampling (TRL's vllm_importance_sampling_mode): the ratio per token or one
# per sequence; a ratio outside [clip_min, clip_max] truncated to it or masked to 0.
ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# Loss types normalised by the loss tokens of the whole generation batch (TRL's num_items_in_batch;
# with loss.steps_per_generation S > 1 an update's weight is mask / (those tokens / S)).
GENERATION_NORMALISED = ("dapo", "cispo", "vespo")
# Loss types whose per-token term is -weight · A · log π with the weight under stop-gradient
# (no ratio in the gradient path, so no PPO clip metrics of their own).
_LOGP_WEIGHTED = ("cispo", "vespo")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")

# A group whose reward spread is below this is reported as giving no learning signal.
_ZERO_STD_ATOL = 1e-6


def _one_of(cfg, name, allowed):
  value = cfg[name]
  if value not in allowed:
    raise ValueError(f"loss.{name}={value!r} is not one of {allowed}")


def validate_loss_config(cfg) -> None:
  """Raises ValueError naming the first bad setting of a loss config."""
  _one_of(cfg, "loss_type", LOSS_TYPES)
  _one_of(cfg, "kl_estimator", KL_ESTIMATORS)
  _one_of(cfg, "importance_sampling_level", IS_LEVELS)
  _one_of(cfg, "scale_rewards", SCALE_REWARDS)
  _one_of(cfg, "reward_aggregation", REWARD_AGGREGATIONS)
  if not 0 <= cfg.beta < math.inf:
    raise ValueError(f"loss.beta={cfg.beta!r} must be finite and >= 0")
  if not 0 < cfg.epsilon < 1:
    raise ValueError(f"loss.epsilon={cfg.epsilon!r} must be in (0, 1)")
  if not cfg.epsilon_high > 0:
    raise ValueError(f"loss.epsilon_high={cfg.epsilon_high!r} must be > 0")
  if cfg.delta is not None and not cfg.delta > 1 + cfg.epsilon_high:
    raise ValueError(f"loss.delta={cfg.delta!r} must be None or > 1 + epsilon_high "
                     f"= {1 + cfg.epsilon_high}")
  if not (isinstance(cfg.num_iterations, int) and cfg.num_iterations >= 1):
    raise ValueError(f"loss.num_iterations={cfg.num_iterations!r} must be an int >= 1")
  _validate_new_losses(cfg)
  _validate_reference_sync(cfg)
  if cfg.kl_estimator == "k1" and cfg.beta > 0:
    errors.warn(f"loss.kl_estimator='k1' with beta={cfg.beta}: as a loss term its gradient is 0 "
                "in expectation (docs/loss.md, 'The KL term'), so it holds nothing near the "
                "reference; use 'k3' (the default) or 'k2'")


def _finite(cfg, name, low=-math.inf, *, positive=False, optional=False):
  value = cfg[name]
  if optional and value is None:
    return
  ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and low <= value < math.inf
        and (value > 0 or not positive))
  if not ok:
    raise ValueError(f"loss.{name}={value!r} must be {'None or ' if optional else ''}a finite "
                     f"number {'> 0' if positive else f'>= {low}'}")


def _validate_new_losses(cfg) -> None:
  """The settings of cispo / sapo / luspo / vespo, the rollout correction and the masks."""
  for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
    _finite(cfg, name, positive=True)
  for name in ("vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
    _finite(cfg, name, 0.0)
  _one_of(cfg, "rollout_is_mode", ROLLOUT_IS_MODES)
  _finite(cfg, "rollout_is_clip_min", 0.0, optional=True)
  _finite(cfg, "rollout_is_clip_max", positive=True, optional=True)
  lo, hi = cfg.rollout_is_clip_min, cfg.rollout_is_clip_max
  if lo is not None and hi is not None and not lo < hi:
    raise ValueError(f"loss.rollout_is_clip_min={lo!r} must be below loss.rollout_is_clip_max="
                     f"{hi!r}")
  if cfg.rollout_is_mode.endswith("_truncate") and lo is None and hi is None:
    raise ValueError(f"loss.rollout_is_mode={cfg.rollout_is_mode!r} truncates to [clip_min, "
                     "clip_max]: set loss.rollout_is_clip_min or loss.rollout_is_clip_max")
  if (cfg.loss_type == "vespo" and cfg.rollout_is_correction
      and not cfg.rollout_is_mode.startswith("token_")):
    raise ValueError(f"loss.rollout_is_mode={cfg.rollout_is_mode!r}: loss_type='vespo' folds "
                     "the rollout ratio into its sequence weight per token; use 'token_truncate' "
                     "or 'token_mask'")
  _finite(cfg, "off_policy_mask_threshold", 0.0, optional=True)
  q = cfg.top_entropy_quantile
  if isinstance(q, bool) or not (isinstance(q, (int, float)) and 0 <= q <= 1):
    raise ValueError(f"loss.top_entropy_quantile={q!r} must be in [0, 1] (1 keeps every token)")
  _finite(cfg, "entropy_coef")
  _validate_adaptive_entropy(cfg)
  for name in ("rollout_is_correction", "use_bias_correction_kl"):
    if not isinstance(cfg[name], bool):
      raise ValueError(f"loss.{name}={cfg[name]!r} must be True or False")
  level = cfg.importance_sampling_level
  if cfg.loss_type == "luspo" and level != "sequence":
    errors.warn("loss.loss_type='luspo' with importance_sampling_level='token': LUSPO is GSPO's "
                "sequence loss; set loss.importance_sampling_level='sequence' (TRL warns alike)")
  if cfg.loss_type == "vespo" and level != "token":
    errors.warn("loss.loss_type='vespo' forms its own sequence weight: importance_sampling_level"
                f"={level!r} reaches only the bias-corrected KL; leave it 'token' (TRL warns "
                "alike)")


def _validate_reference_sync(cfg) -> None:
  """steps_per_generation, and sync_ref_model with its alpha and period."""
  for name in ("steps_per_generation", "ref_model_sync_steps"):
    value = cfg[name]
    if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
      raise ValueError(f"loss.{name}={value!r} must be an int >= 1")
  if not isinstance(cfg.sync_ref_model, bool):
    raise ValueError(f"loss.sync_ref_model={cfg.sync_ref_model!r} must be True or False")
  alpha = cfg.ref_model_mixup_alpha
  if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
    raise ValueError(f"loss.ref_model_mixup_alpha={alpha!r} must be in (0, 1] (the policy's "
                     "share of the synced reference; 1 copies the policy)")
  if cfg.sync_ref_model and not needs_reference(cfg):
    raise ValueError("loss.sync_ref_model=True with loss.beta=0: no reference is held (beta = 0 "
                     "skips it), so none can follow the policy; set loss.beta > 0, or "
                     "sync_ref_model=False")


def _validate_adaptive_entropy(cfg) -> None:
  """use_adaptive_entropy and its target, bounds and step."""
  if not isinstance(cfg.use_adaptive_entropy, bool):
    raise ValueError(f"loss.use_adaptive_entropy={cfg.use_adaptive_entropy!r} must be True or "
                     "False")
  for name in ("entropy_target", "entropy_coef_min", "entropy_coef_max"):
    _finite(cfg, name)
  _finite(cfg, "entropy_coef_delta", positive=True)
  if not cfg.use_adaptive_entropy:
    return
  lo, hi = cfg.entropy_coef_min, cfg.entropy_coef_max
  if not lo <= cfg.entropy_coef <= hi:
    raise ValueError(f"loss.entropy_coef={cfg.entropy_coef!r} is the adaptive coefficient's "
                     f"start: it must lie in [loss.entropy_coef_min, loss.entropy_coef_max] = "
                     f"[{lo}, {hi}]")


def entropy_bonus(cfg) -> bool:
  """Whether the loss has an entropy term: a fixed coefficient != 0, or the adaptive one (on
  even while it sits at 0, so that it can grow again)."""
  return cfg.entropy_coef != 0 or cfg.use_adaptive_entropy


def adaptive_entropy_start(cfg) -> dict:
  """The controller's state before any update: {'coef': entropy_coef, 'last': +inf} (float32
  scalars; 'last' is the previous update's mean entropy, inf: no bonus before a measurement)."""
  return {"coef": jnp.float32(cfg.entropy_coef), "last": jnp.float32(jnp.inf)}


def adaptive_entropy_applied(ctrl, cfg):
  """The coefficient an update applies: ctrl['coef'] where the previous update's entropy was at
  or below entropy_target, else 0 (Skywork-OR1; TRL's apply_coef)."""
  return jnp.where(ctrl["last"] <= cfg.entropy_target, ctrl["coef"], 0.0)


def adaptive_entropy_next(ctrl, entropy, cfg) -> dict:
  """The controller after an update whose mean entropy (over the trained tokens) is `entropy`:
  coef + delta capped at entropy_coef_max when entropy <= entropy_target, else coef − delta
  floored at entropy_coef_min; 'last' = entropy.

  Example (target 0.2, delta 0.005, bounds [0, 1]): coef 0.01, entropy 0.1 → coef 0.015.
  """
  up = jnp.minimum(ctrl["coef"] + cfg.entropy_coef_delta, cfg.entropy_coef_max)
  down = jnp.maximum(ctrl["coef"] - cfg.entropy_coef_delta, cfg.entropy_coef_min)
  entropy = jnp.asarray(entropy, jnp.float32)
  return {"coef": jnp.where(entropy <= cfg.entropy_target, up, down).astype(jnp.float32),
          "last": entropy}


def needs_reference(cfg) -> bool:
  """Whether the loop must compute reference log-probs at all (β = 0 skips that forward)."""
  return cfg.beta != 0


def syncs_reference(cfg) -> bool:
  """Whether the reference follows the policy (loss.sync_ref_model with β > 0): it is then
  train state (the state's 'ref'), updated by the step and saved with it."""
  return needs_reference(cfg) and cfg.sync_ref_model


def frozen_reference(cfg) -> bool:
  """Whether a frozen reference is held beside the train state: β > 0 without sync_ref_model."""
  return needs_reference(cfg) and not cfg.sync_ref_model


def reference_sync_due(updates, cfg):
  """Whether the update that brings the count of applied updates to `updates` (traced int)
  syncs the reference: every ref_model_sync_steps-th, as TRL's SyncRefModelCallback at
  on_step_end (global_step % ref_model_sync_steps == 0, global_step counting the updates)."""
  return updates % cfg.ref_model_sync_steps == 0


def mix_reference(ref, params, alpha):
  """ref ← α · params + (1 − α) · ref, leaf by leaf (TR-DPO, Gorbatovski et al. 2024; TRL's
  SyncRefModelCallback._sync_target_model, ref · (1 − α) + α · params), computed in float32
  and stored in each ref leaf's own dtype (train_step.reference_dtype).

  Example (α = 0.6): ref [1.0, 0.0], params [2.0, 1.0] → [1.6, 0.6].
  """
  a, b = jnp.float32(alpha), jnp.float32(1.0 - alpha)
  return jax.tree.map(
      lambda r, p: (r.astype(jnp.float32) * b + p.astype(jnp.float32) * a).astype(r.dtype),
      ref, params)


# ------------------------------------------------------------------------------------------------
# Advantages.


def _centre_and_scale(r_B, valid_B, group_size, scale_rewards, eps):
  """(r − mean_g) / (std_g + eps) over the valid entries of each group; invalid → 0.

  std is the unbiased (ddof = 1) one, as torch.std in TRL; a group with < 2 valid entries has
  std 0. Returns the advantages and the per-group std (for the zero-spread statistic).
  """
  r_GN = jnp.where(valid_B, r_B, 0.0).reshape(-1, group_size)
  v_GN = valid_B.reshape(-1, group_size)
  n_G = v_GN.sum(-1)
  # Centre on a valid member first: a constant group then gets advantages of exactly 0
  # (a plain sum / n can round away from the common value).
  first_G1 = jnp.take_along_axis(r_GN, jnp.argmax(v_GN, -1)[:, None], -1)
  shifted_GN = jnp.where(v_GN, r_GN - first_G1, 0.0)
  dev_GN = jnp.where(v_GN, shifted_GN - shifted_GN.sum(-1, keepdims=True)
                     / jnp.maximum(n_G, 1)[:, None], 0.0)
  std_G = jnp.sqrt((dev_GN ** 2).sum(-1) / jnp.maximum(n_G - 1, 1))
  if scale_rewards == "group":
    dev_GN = _safe_divide(dev_GN, std_G[:, None] + eps)
  elif scale_rewards == "batch":  # Lite PPO: group mean, but the std of the whole batch's rewards
    dev_GN = _safe_divide(dev_GN, _masked_std(r_B, valid_B) + eps)
  elif scale_rewards != "none":
    raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}")
  return dev_GN.reshape(-1), std_G


def _safe_divide(num, den):
  """num / den, with 0 where den is 0 (then num is exactly 0 too: a group without spread)."""
  return num / jnp.where(den > 0, den, 1.0)


def _masked_std(x_B, valid_B):
  n = valid_B.sum()
  mean = jnp.where(valid_B, x_B, 0.0).sum() / jnp.maximum(n, 1)
  dev_B = jnp.where(valid_B, x_B - mean, 0.0)
  return jnp.sqrt((dev_B ** 2).sum() / jnp.maximum(n - 1, 1))


def weighted_total(rewards_BR, valid_BR, weights_R, group_size):
  """Σ_k w_k r_k per row; a missing component (invalid) counts as the mean of that component
  over the present rows of its group (0 where none has it).

  A filled-in component moves no row against its group: it adds the same to the row as the
  group's mean does, so it centres to 0. Counting it as 0 instead (TRL's nansum) ranked a right
  answer whose judge timed out below wrong ones that were scored."""
  R = rewards_BR.shape[1]
  r_GNR = jnp.where(valid_BR, rewards_BR, 0.0).reshape(-1, group_size, R)
  v_GNR = valid_BR.reshape(-1, group_size, R)
  # The mean relative to a present member, so a component equal on every present row fills
  # in exactly that value (a plain sum / n can round away from it).
  first_G1R = jnp.take_along_axis(r_GNR, jnp.argmax(v_GNR, 1)[:, None], 1)
  offset_GR = (jnp.where(v_GNR, r_GNR - first_G1R, 0.0).sum(1)
               / jnp.maximum(v_GNR.sum(1), 1))
  mean_G1R = jnp.where(v_GNR.any(1, keepdims=True), first_G1R + offset_GR[:, None], 0.0)
  filled_GNR = jnp.where(v_GNR, r_GNR, mean_G1R)
  return (filled_GNR * weights_R).sum(-1).reshape(-1)


def group_advantages(rewards_BR, group_size, *, weights_R=None, scale_rewards="group",
                     aggregation="sum_then_normalize", eps=1e-4):
  """Group-relative advantages from a reward matrix with NaN for missing rewards.

  Rows are group-major: rows [g·G, (g+1)·G) are the G completions of prompt g.
  * sum_then_normalize: r = Σ_k w_k r_k, a missing component counted as its group's mean
    (weighted_total), then (r − mean_g) / (std_g + eps), std per `scale_rewards`.
  * normalize_then_sum (GDPO): each component normalised within its group as above, weighted
    sum, then normalised over the batch: (s − mean) / (std + eps).
  A row whose every component is missing is left out of all statistics and gets advantage 0.

  Example: rewards_BR [[1.], [0.], [nan], [1.]] with group_size=2 → advantages [0.707, -0.707,
  0, 0] (eps aside) and stats {'frac_reward_zero_std': 0.5}.
  Returns (advantages_B float32, stats dict of scalars).
  """
  rewards_BR = jnp.asarray(rewards_BR, jnp.float32)
  if rewards_BR.ndim == 1:
    rewards_BR = rewards_BR[:, None]
  B, R = rewards_BR.shape
  if group_size < 1 or B % group_size:
    raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch of {B} rows")
  if aggregation not in REWARD_AGGREGATIONS:
    raise ValueError(f"reward_aggregation={aggregation!r} is not one of {REWARD_AGGREGATIONS}")
  if not eps >= 0:
    raise ValueError(f"advantage eps={eps!r} must be >= 0")
  if scale_rewards not in SCALE_REWARDS:
    raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}")
  weights_R = jnp.ones((R,), jnp.float32) if weights_R is None else jnp.asarray(
      weights_R, jnp.float32)
  if weights_R.shape != (R,):
    raise ValueError(f"reward weights have shape {weights_R.shape}, expected ({R},)")
  valid_BR = ~jnp.isnan(rewards_BR)
  valid_B = valid_BR.any(-1)
  if aggregation == "sum_then_normalize":
    r_B = weighted_total(rewards_BR, valid_BR, weights_R, group_size)
    adv_B, std_G = _centre_and_scale(r_B, valid_B, group_size, scale_rewards, eps)
  else:
    a_RB, _ = jax.vmap(_centre_and_scale, in_axes=(1, 1, None, None, None))(
        rewards_BR, valid_BR, group_size, scale_rewards, eps)
    s_B = (a_RB * weights_R[:, None]).sum(0)
    # The within-group spread of the summed signal, measured before the batch normalisation.
    _, std_G = _centre_and_scale(s_B, valid_B, group_size, "none", eps)
    mean = jnp.where(valid_B, s_B, 0.0).sum() / jnp.maximum(valid_B.sum(), 1)
    adv_B = jnp.where(valid_B, _safe_divide(s_B - mean, _masked_std(s_B, valid_B) + eps), 0.0)
  stats = {"frac_reward_zero_std": jnp.mean((std_G < _ZERO_STD_ATOL).astype(jnp.float32)),
           "frac_reward_missing": 1.0 - jnp.mean(valid_B.astype(jnp.float32))}
  return adv_B, stats


def informative_groups(rewards_BR, group_size: int, weights_R=None,
                       aggregation: str = "sum_then_normalize") -> jax.Array:
  """bool [B / group_size]: the groups whose rewards differ between their completions.

  Only these carry a group-relative signal: a group whose G rewards are equal gets advantages
  of 0 (sum_then_normalize: its weighted total is constant; normalize_then_sum: every component
  is). DAPO's dynamic sampling trains on these groups and samples more prompts for the rest.
  """
  rewards_BR = jnp.asarray(rewards_BR, jnp.float32)
  if rewards_BR.ndim == 1:
    rewards_BR = rewards_BR[:, None]
  R = rewards_BR.shape[1]
  weights_R = jnp.ones((R,), jnp.float32) if weights_R is None else jnp.asarray(
      weights_R, jnp.float32)
  valid_BR = ~jnp.isnan(rewards_BR)
  if aggregation == "sum_then_normalize":
    r_B = weighted_total(rewards_BR, valid_BR, weights_R, group_size)
    _, std_G = _centre_and_scale(r_B, valid_BR.any(-1), group_size, "none", 0.0)
  else:
    _, std_RG = jax.vmap(_centre_and_scale, in_axes=(1, 1, None, None, None))(
        rewards_BR, valid_BR, group_size, "none", 0.0)
    std_G = std_RG.max(0)
  return std_G >= _ZERO_STD_ATOL


# ------------------------------------------------------------------------------------------------
# KL and the policy loss.


def kl_estimate(logp, ref_logp, estimator="k3"):
  """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman 2020).

  With log r = ref_logp − logp: k1 = −log r, k2 = ½ (log r)², k3 = r − 1 − log r (unbiased and
  non-negative; DeepSeekMath's choice). As loss terms, differentiated through logp at tokens
  sampled from π_θ, their expected gradients are: k1 0, k2 ∇KL(π_θ ‖ π_ref), k3 ∇KL(π_ref ‖ π_θ).
  """
  log_r = ref_logp - logp
  if estimator == "k1":
    return -log_r
  if estimator == "k2":
    return 0.5 * log_r ** 2
  if estimator == "k3":
    return jnp.exp(log_r) - 1.0 - log_r
  raise ValueError(f"kl_estimator={estimator!r} is not one of {KL_ESTIMATORS}")


def loss_mask(completion_mask_BC, truncated_B=None, mask_truncated_completions=False):
  """The tokens that enter the loss: the completion mask, minus truncated rows if asked."""
  mask_BC = jnp.asarray(completion_mask_BC, jnp.float32)
  if mask_truncated_completions:
    if truncated_B is None:
      raise ValueError("loss.mask_truncated_completions=True needs batch['truncated_B']")
    mask_BC = mask_BC * (1.0 - jnp.asarray(truncated_B, jnp.float32))[:, None]
  return mask_BC


def token_weights(mask_BC, loss_type, *, num_sequences, num_tokens, max_completion_length=None,
                  turn_ids_BC=None, max_turns=None):
  """Per-token weights that turn a token sum into the loss_type's aggregation.

  num_sequences: sequences in the optimizer step's batch (all micro-batches).
  num_tokens: loss tokens in the step's batch (bnpo) or in the whole generation batch (dapo).
  max_completion_length: dr_grpo's constant C (sampling.max_new_tokens), never the padded width
  of a batch; default: the mask's width.
  turn_ids_BC, max_turns: flow_grpo only (ignored by the others): int turn index in
  [0, max_turns) of each completion token, and the static bound on turns (see
  flow_grpo_weights).
  """
  C = mask_BC.shape[-1] if max_completion_length is None else max_completion_length
  if loss_type == "grpo":
    return mask_BC / (jnp.maximum(mask_BC.sum(-1, keepdims=True), 1.0) * num_sequences)
  if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
    return mask_BC / jnp.maximum(num_tokens, 1.0)
  if loss_type == "sapo":
    return mask_BC / (jnp.maximum(mask_BC.sum(-1, keepdims=True), 1.0) * num_sequences)
  if loss_type == "luspo":  # the sequence's token sum: its loss times its length
    return mask_BC / num_sequences
  if loss_type == "dr_grpo":
    return mask_BC / (num_sequences * C)
  if loss_type == "flow_grpo":
    if turn_ids_BC is None or max_turns is None:
      raise ValueError("loss.loss_type='flow_grpo' needs turn_ids_BC (the turn of each "
                       f"completion token) and max_turns; got turn_ids_BC="
                       f"{'None' if turn_ids_BC is None else 'given'}, max_turns={max_turns!r}")
    return flow_grpo_weights(mask_BC, turn_ids_BC, max_turns, num_sequences)
  raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}")


def flow_grpo_weights(mask_BC, turn_ids_BC, max_turns, num_sequences):
  """mask / (num_sequences · T_b · |a_t|): Flow-GRPO's 1/G Σ_i 1/T_i Σ_t 1/|a_t^i| Σ_j.

  |a_t| (loss tokens of turn t in row b) and T_b (turns of row b with >= 1 loss token) come
  from a one-hot of the turn ids over a static bound, [B, C, max_turns]: a compare that XLA
  fuses into the row-local sums (no scatter, nothing across rows, so any batch sharding and any
  micro-batching give the same weights). A row without loss tokens gets weight 0. A loss token
  whose turn id is outside [0, max_turns) makes the weights NaN (the step is then skipped),
  rather than silently merging or dropping turns; train_step.check_batch rejects such a batch
  on the host first.

  Example: mask [[1, 1, 0, 1]], turn_ids [[0, 0, 0, 1]] (an observation token between two
  actions), num_sequences 1 → weights [[1/4, 1/4, 0, 1/2]].
  """
  if not (isinstance(max_turns, int) and max_turns >= 1):
    raise ValueError(f"max_turns={max_turns!r} must be an int >= 1")
  mask_BC = jnp.asarray(mask_BC, jnp.float32)
  turn_ids_BC = jnp.asarray(turn_ids_BC, jnp.int32)
  onehot_BCM = (turn_ids_BC[..., None] == jnp.arange(max_turns, dtype=jnp.int32)).astype(
      jnp.float32)
  len_BM = jnp.einsum("BC,BCM->BM", mask_BC, onehot_BCM)        # |a_t|: loss tokens per turn
  turns_B1 = (len_BM > 0).sum(-1, keepdims=True).astype(jnp.float32)  # T_b
  len_BC = jnp.einsum("BM,BCM->BC", len_BM, onehot_BCM)        # |a_{t(j)}| at each token
  in_range_BC = (turn_ids_BC >= 0) & (turn_ids_BC < max_turns)
  weights_BC = mask_BC / (num_sequences * jnp.maximum(turns_B1, 1.0) * jnp.maximum(len_BC, 1.0))
  return jnp.where((mask_BC > 0) & ~in_range_BC, jnp.nan, weights_BC)


def log_importance_ratio(logp_BC, old_logp_BC, mask_BC, level):
  """log π_θ/π_old per token ('token') or GSPO's length-normalised sequence ratio, broadcast."""
  log_ratio_BC = logp_BC - old_logp_BC
  if level == "token":
    return log_ratio_BC
  if level == "sequence":
    seq_B = (log_ratio_BC * mask_BC).sum(-1) / jnp.maximum(mask_BC.sum(-1), 1.0)
    return jnp.broadcast_to(seq_B[:, None], log_ratio_BC.shape)
  raise ValueError(f"importance_sampling_level={level!r} is not one of {IS_LEVELS}")


def rollout_is_ratio(old_logp_BC, sampler_logp_BC, mask_BC, mode, clip_min, clip_max):
  """The rollout correction's weight of each token, and which tokens it truncated or masked.

  ρ = π_train / π_sampler at the sampled tokens, with π_train the old (pre-update) policy: per
  token exp(old − sampler), or per sequence exp(Σ_t m_t (old − sampler)) broadcast to its
  tokens (a sum, not GSPO's mean: TRL's). '*_truncate' clips ρ to [clip_min, clip_max] (None:
  no bound on that side), '*_mask' sets a ρ outside it to 0.
  Example: old − sampler = [[0.0, 2.0]], mask [[1, 1]], 'token_truncate', clip_max 3 →
  ratio [[1, 3]], outside [[False, True]].
  Returns (ratio_BC float32, outside_BC bool), both [B, C].
  """
  diff_BC = (old_logp_BC - sampler_logp_BC) * mask_BC
  if mode.startswith("sequence_"):
    diff_BC = jnp.broadcast_to(diff_BC.sum(-1, keepdims=True), diff_BC.shape)
  ratio_BC = jnp.exp(diff_BC)
  lo = -jnp.inf if clip_min is None else clip_min
  hi = jnp.inf if clip_max is None else clip_max
  outside_BC = (ratio_BC < lo) | (ratio_BC > hi)
  if mode.endswith("_truncate"):
    return jnp.clip(ratio_BC, lo, hi), outside_BC
  if mode.endswith("_mask"):
    return jnp.where(outside_BC, 0.0, ratio_BC), outside_BC
  raise ValueError(f"rollout_is_mode={mode!r} is not one of {ROLLOUT_IS_MODES}")


def off_policy_keep(logp_BC, behaviour_logp_BC, advantages_B, mask_BC, threshold):
  """DeepSeek-V3.2's off-policy sequence mask, [B, 1] float (1 keep, 0 drop).

  A sequence is dropped when its advantage is negative and the mean over its tokens of
  behaviour − logp (a k1 estimate of KL(π_behaviour ‖ π_θ), logp under stop-gradient) exceeds
  `threshold`. behaviour: the sampler's log-probs where the batch has them, else the old ones.
  """
  kl_BC = (behaviour_logp_BC - jax.lax.stop_gradient(logp_BC)) * mask_BC
  mean_B1 = kl_BC.sum(-1, keepdims=True) / jnp.maximum(mask_BC.sum(-1, keepdims=True), 1.0)
  keep_B1 = (advantages_B[:, None] >= 0) | (mean_B1 <= threshold)
  return keep_B1.astype(jnp.float32)


def entropy_threshold(entropy_BC, mask_BC, quantile):
  """The entropy at the (1 − quantile) quantile of the loss tokens (linear interpolation, as
  torch.quantile); NaN when there are none. Over the whole step's batch, so that every
  micro-batch masks against the same bar."""
  values = jnp.where(mask_BC > 0, entropy_BC.astype(jnp.float32), jnp.nan)
  return jnp.nanquantile(values.reshape(-1), 1.0 - quantile)


def high_entropy_keep(entropy_BC, mask_BC, threshold):
  """[B, C] float: the loss tokens whose entropy is at or above `threshold` ("80/20": the
  forking tokens). A NaN threshold (no loss tokens) keeps none."""
  return ((entropy_BC >= threshold) & (mask_BC > 0)).astype(jnp.float32)


def vespo_weights(log_ratio_BC, mask_BC, advantages_B, is_ratio_BC, cfg):
  """VESPO's sequence weight φ(w) = exp(λ + k log w − λ w), [B, 1], under stop-gradient.

  log w = Σ_t m_t clip(log ratio_t, ±20) (a sum, not a mean), plus Σ_t clip(log ρ_t, log 1e-8,
  20) of the rollout correction's ratio where it is on, then clipped to [log 1e-8, 20]; k, λ
  are the _pos settings where A >= 0, else the _neg ones (λ at least 1e-4). φ(1) = 1; a
  non-finite φ counts as 0.
  """
  lower = math.log(1e-8)
  log_w_B1 = jnp.sum(jnp.clip(log_ratio_BC, -20.0, 20.0) * mask_BC, -1, keepdims=True)
  if is_ratio_BC is not None:
    log_w_B1 += jnp.sum(jnp.clip(jnp.log(is_ratio_BC), lower, 20.0), -1, keepdims=True)
  log_w_B1 = jnp.clip(log_w_B1, lower, 20.0)
  pos_B1 = advantages_B[:, None] >= 0
  k_B1 = jnp.where(pos_B1, cfg.vespo_k_pos, cfg.vespo_k_neg)
  lam_B1 = jnp.maximum(jnp.where(pos_B1, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
  phi_B1 = jnp.exp(lam_B1 + k_B1 * log_w_B1 - lam_B1 * jnp.exp(log_w_B1))
  phi_B1 = jnp.where(jnp.isfinite(phi_B1), phi_B1, 0.0)
  return jax.lax.stop_gradient(phi_B1)


def policy_term(logp_BC, ratio_BC, log_ratio_BC, adv_B1, mask_BC, cfg, bounds, is_ratio_BC):
  """The per-token policy loss of cfg.loss_type before masks and aggregation, [B, C].

  bounds: (low, high, epsilon_high), the clip 1 − ε, 1 + ε_high and ε_high itself (cispo's
  cap). ratio_BC: π_θ / π_old at cfg.importance_sampling_level; log_ratio_BC per token (vespo).
  """
  low, high, eps_high = bounds
  if cfg.loss_type == "cispo":  # the weight clipped from above and held: -sg(min(ρ, ε)) A log π
    return -jax.lax.stop_gradient(jnp.minimum(ratio_BC, eps_high)) * adv_B1 * logp_BC
  if cfg.loss_type == "sapo":  # a sigmoid gate, slope 1 at ρ = 1 whatever the temperature τ
    tau_B1 = jnp.where(adv_B1 > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    return -jax.nn.sigmoid(tau_B1 * (ratio_BC - 1.0)) * 4.0 / tau_B1 * adv_B1
  if cfg.loss_type == "vespo":
    phi_B1 = vespo_weights(log_ratio_BC, mask_BC, adv_B1[:, 0], is_ratio_BC, cfg)
    return -phi_B1 * adv_B1 * logp_BC
  clipped_BC = jnp.clip(ratio_BC, low, high)
  capped_BC = ratio_BC if cfg.delta is None else jnp.minimum(ratio_BC, cfg.delta)
  return -jnp.minimum(capped_BC * adv_B1, clipped_BC * adv_B1)


def loss_terms(logp_BC, old_logp_BC, ref_logp_BC, advantages_B, mask_BC, weights_BC, cfg,
               hp=None, *, sampler_logp_BC=None, entropy_BC=None, entropy_keep_BC=None,
               entropy_weights_BC=None):
  """The weighted-sum loss of one (micro-)batch, and its metric sums.

  hp: the train step's hyperparameter arrays ('beta', 'clip_low' = 1 - epsilon, 'clip_high' =
  1 + epsilon_high, 'epsilon_high'; train_step.hparams), which take the place of cfg's values;
  the program's structure (whether there is a KL term at all) still follows cfg.beta.

  old_logp_BC None → on-policy: stop_gradient(logp), so the ratio is exactly 1 (μ = 1).
  ref_logp_BC is read only when cfg.beta > 0.
  sampler_logp_BC: the sampler's log-probs of the same tokens (the rollout correction's and
  the off-policy mask's behaviour policy); required by cfg.rollout_is_correction.
  hp['entropy_coef'] (where given) is the bonus's coefficient in place of cfg.entropy_coef: the
  adaptive controller's (adaptive_entropy_applied).
  entropy_keep_BC: top_entropy_quantile's mask (high_entropy_keep), None for every token.
  entropy_BC, entropy_weights_BC: the per-token entropy (with its gradient) and the weights of
  its mean over the step (mask · keep / the step's kept tokens), read when entropy_bonus(cfg).
  The per-token policy term is multiplied, as in TRL, by the off-policy mask, the entropy mask
  and the rollout ratio (not vespo's, which folds it into its weight); the β·KL term by none.
  Returns (loss scalar, sums) where `sums` holds token-summed quantities the caller divides by
  the step's loss-token count (clip counts, ratio sum, per-token KL sum 'kl/sum') and the
  already-normalised 'loss/policy', 'loss/kl' (and with entropy_coef 'loss/entropy', the bonus's
  mean entropy); plus 'ratio/min', 'ratio/max'.
  The β·KL term is the per-token KL estimate under the same weights_BC as the policy term, so
  it is aggregated like it (flow_grpo: KL per action token, averaged per turn, over the row's
  turns, over sequences).
  """
  if old_logp_BC is None:
    old_logp_BC = jax.lax.stop_gradient(logp_BC)
  log_ratio_BC = log_importance_ratio(logp_BC, old_logp_BC, mask_BC,
                                      cfg.importance_sampling_level)
  ratio_BC = jnp.exp(log_ratio_BC)
  adv_B1 = advantages_B[:, None].astype(jnp.float32)
  if hp is None:
    beta, low, high = cfg.beta, 1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high
    eps_high = cfg.epsilon_high
  else:
    beta, low, high = hp["beta"], hp["clip_low"], hp["clip_high"]
    eps_high = hp.get("epsilon_high", cfg.epsilon_high)  # in hp for cispo, which alone reads it
  is_BC = None
  if cfg.rollout_is_correction:
    if sampler_logp_BC is None:
      raise ValueError("loss.rollout_is_correction=True needs batch['sampler_logp_BC']")
    is_BC, _ = rollout_is_ratio(jax.lax.stop_gradient(old_logp_BC), sampler_logp_BC, mask_BC,
                                cfg.rollout_is_mode, cfg.rollout_is_clip_min,
                                cfg.rollout_is_clip_max)
  policy_BC = policy_term(logp_BC, ratio_BC, logp_BC - old_logp_BC, adv_B1, mask_BC, cfg,
                          (low, high, eps_high), is_BC)
  policy_BC = _gated(policy_BC, logp_BC, old_logp_BC, sampler_logp_BC, advantages_B, mask_BC,
                     cfg, entropy_keep_BC, is_BC)
  policy_loss = jnp.sum(weights_BC * policy_BC)
  if needs_reference(cfg):
    if ref_logp_BC is None:
      raise ValueError(f"loss.beta={cfg.beta} > 0 needs batch['ref_logp_BC']")
    kl_BC = kl_estimate(logp_BC, ref_logp_BC, cfg.kl_estimator)
    if cfg.use_bias_correction_kl:  # weighted by π_θ / π_old, its gradient included
      kl_BC = kl_BC * ratio_BC
    kl = jnp.sum(weights_BC * kl_BC)
  else:
    kl_BC = kl = jnp.zeros((), jnp.float32)
  loss = policy_loss + beta * kl
  if entropy_bonus(cfg):
    if entropy_BC is None or entropy_weights_BC is None:
      raise ValueError(f"loss.entropy_coef={cfg.entropy_coef} needs the per-token entropy and "
                       "its weights")
    entropy = jnp.sum(entropy_weights_BC * entropy_BC)
    coef = cfg.entropy_coef if hp is None else hp.get("entropy_coef", cfg.entropy_coef)
    loss = loss - coef * entropy
  sums = _loss_sums(cfg, ratio_BC, adv_B1, mask_BC, (low, high, eps_high), kl_BC)
  sums.update({"loss/policy": jax.lax.stop_gradient(policy_loss),
               "loss/kl": jax.lax.stop_gradient(kl)})
  if entropy_bonus(cfg):
    sums["loss/entropy"] = jax.lax.stop_gradient(entropy)
  return loss, sums


def _gated(policy_BC, logp_BC, old_logp_BC, sampler_logp_BC, advantages_B, mask_BC, cfg,
           entropy_keep_BC, is_BC):
  """The policy term times TRL's per-token factors: the off-policy mask, the entropy mask and
  the rollout ratio (not vespo's: it folds the ratio into its sequence weight)."""
  if cfg.off_policy_mask_threshold is not None:
    behaviour_BC = old_logp_BC if sampler_logp_BC is None else sampler_logp_BC
    policy_BC = policy_BC * off_policy_keep(logp_BC, behaviour_BC, advantages_B, mask_BC,
                                            cfg.off_policy_mask_threshold)
  if entropy_keep_BC is not None:
    policy_BC = policy_BC * entropy_keep_BC
  if is_BC is not None and cfg.loss_type != "vespo":
    policy_BC = policy_BC * is_BC
  return policy_BC


def _loss_sums(cfg, ratio_BC, adv_B1, mask_BC, bounds, kl_BC):
  """Token sums of the clip counts, the ratio and the KL. A token is clipped (DAPO's metrics)
  when the clipped branch is the active one; cispo's when its weight hit the cap ε_high
  (TRL's cispo_clip_ratio, counted as 'high'); sapo and vespo have no hard clip."""
  low, high, eps_high = bounds
  ratio_BC = jax.lax.stop_gradient(ratio_BC)
  on_BC = mask_BC > 0
  if cfg.loss_type == "cispo":
    low_BC, high_BC = jnp.zeros_like(on_BC), (ratio_BC > eps_high) & (adv_B1 > 0)
  elif cfg.loss_type in ("sapo", "vespo"):
    low_BC = high_BC = jnp.zeros_like(on_BC)
  else:
    low_BC = (ratio_BC < low) & (adv_B1 < 0)
    high_BC = (ratio_BC > high) & (adv_B1 > 0)
  return {
      "kl/sum": jax.lax.stop_gradient(jnp.sum(jnp.where(on_BC, kl_BC, 0.0))),
      "clip/low_count": jnp.sum(low_BC & on_BC),
      "clip/high_count": jnp.sum(high_BC & on_BC),
      "ratio/sum": jnp.sum(jnp.where(on_BC, ratio_BC, 0.0)),
      "ratio/min": jnp.min(jnp.where(on_BC, ratio_BC, jnp.inf)),
      "ratio/max": jnp.max(jnp.where(on_BC, ratio_BC, -jnp.inf)),
  }


def drift_metrics(train_logp_BC, sampler_logp_BC, mask_BC, advantages_B, cfg):
  """How far the sampler's log-probs are from the train step's at the same params, over the
  loss tokens: 'drift/logp_diff_mean' and '_max' (|Δ log p|), 'drift/kl' (the k3 estimate of
  KL(π_sampler ‖ π_train) from the sampled tokens: exp(Δ) − 1 − Δ, Δ = train − sampler; ≥ 0,
  unbiased), 'drift/is_clipped_frac' (the share of loss tokens whose rollout ratio lies outside
  [rollout_is_clip_min, rollout_is_clip_max], which the correction truncates or masks: reported
  whether or not it is on), and with off_policy_mask_threshold 'drift/off_policy_masked_frac'
  (the share of loss tokens in sequences the off-policy mask drops, at these log-probs).
  NaN when there is no loss token."""
  on_BC = mask_BC > 0
  n = jnp.maximum(on_BC.sum(), 1)
  has = on_BC.any()
  delta_BC = jnp.where(on_BC, train_logp_BC - sampler_logp_BC, 0.0)
  mean = lambda x_BC: jnp.where(has, jnp.sum(jnp.where(on_BC, x_BC, 0.0)) / n, jnp.nan)
  _, outside_BC = rollout_is_ratio(train_logp_BC, sampler_logp_BC, mask_BC, cfg.rollout_is_mode,
                                   cfg.rollout_is_clip_min, cfg.rollout_is_clip_max)
  out = {
      "drift/logp_diff_mean": mean(jnp.abs(delta_BC)),
      "drift/logp_diff_max": jnp.where(has, jnp.max(jnp.abs(delta_BC)), jnp.nan),
      "drift/kl": mean(jnp.expm1(delta_BC) - delta_BC),
      "drift/is_clipped_frac": mean(outside_BC.astype(jnp.float32)),
  }
  if cfg.off_policy_mask_threshold is not None:
    keep_B1 = off_policy_keep(train_logp_BC, sampler_logp_BC, advantages_B, mask_BC,
                              cfg.off_policy_mask_threshold)
    out["drift/off_policy_masked_frac"] = mean(jnp.broadcast_to(1.0 - keep_B1, mask_BC.shape))
  return out


def finalize_metrics(sums, num_tokens):
  """Turns accumulated `loss_terms` sums (over a step's micro-batches) into flat metrics."""
  n = jnp.maximum(num_tokens, 1.0)
  extra = {"loss/entropy": sums["loss/entropy"]} if "loss/entropy" in sums else {}
  low = sums["clip/low_count"] / n
  high = sums["clip/high_count"] / n
  has_tokens = num_tokens > 0
  return {
      "loss/policy": sums["loss/policy"],
      "loss/kl": sums["loss/kl"],
      "kl": sums["kl/sum"] / n,  # per loss token, whatever the loss type (TRL's `kl`)
      "clip/low_frac": low,
      "clip/high_frac": high,
      "clip/region_frac": low + high,  # disjoint: low needs A < 0, high needs A > 0
      "ratio/min": jnp.where(has_tokens, sums["ratio/min"], jnp.nan),
      "ratio/mean": jnp.where(has_tokens, sums["ratio/sum"] / n, jnp.nan),
      "ratio/max": jnp.where(has_tokens, sums["ratio/max"], jnp.nan),
      **extra,
  }


def grpo_loss(logp_BC, advantages_B, mask_BC, cfg, *, old_logp_BC=None, ref_logp_BC=None,
              num_tokens=None, max_completion_length=None, turn_ids_BC=None, max_turns=None,
              sampler_logp_BC=None, entropy_BC=None):
  """The whole-batch loss and metrics of one un-accumulated step (convenience for tests/tools).

  num_tokens: the dapo normaliser (loss tokens of the generation batch); default: this batch's.
  turn_ids_BC, max_turns: flow_grpo's turn of each token and bound on turns (token_weights).
  sampler_logp_BC: the sampler's log-probs (rollout correction, off-policy mask).
  entropy_BC: per-token entropies, needed by top_entropy_quantile < 1 and entropy_bonus(cfg).
  """
  mask_BC = jnp.asarray(mask_BC, jnp.float32)
  step_tokens = mask_BC.sum()
  if num_tokens is None or cfg.loss_type not in ("dapo", "cispo", "vespo"):
    num_tokens = step_tokens
  weights_BC = token_weights(mask_BC, cfg.loss_type, num_sequences=mask_BC.shape[0],
                             num_tokens=num_tokens, max_completion_length=max_completion_length,
                             turn_ids_BC=turn_ids_BC, max_turns=max_turns)
  keep_BC = entropy_weights_BC = None
  if cfg.top_entropy_quantile < 1:
    threshold = entropy_threshold(jax.lax.stop_gradient(entropy_BC), mask_BC,
                                  cfg.top_entropy_quantile)
    keep_BC = high_entropy_keep(jax.lax.stop_gradient(entropy_BC), mask_BC, threshold)
  if entropy_bonus(cfg):
    entropy_weights_BC = entropy_weights(mask_BC, keep_BC)
  loss, sums = loss_terms(logp_BC, old_logp_BC, ref_logp_BC, advantages_B, mask_BC,
                          weights_BC, cfg, sampler_logp_BC=sampler_logp_BC,
                          entropy_BC=entropy_BC, entropy_keep_BC=keep_BC,
                          entropy_weights_BC=entropy_weights_BC)
  return loss, finalize_metrics(sums, step_tokens)


def entropy_weights(mask_BC, keep_BC=None, num_kept=None):
  """Weights of the entropy bonus's mean: mask · keep / (kept loss tokens of the step, >= 1).
  num_kept: that count over the whole step (default: these rows'), so micro-batches add up."""
  eff_BC = mask_BC if keep_BC is None else mask_BC * keep_BC
  n = eff_BC.sum() if num_kept is None else num_kept
  return eff_BC / jnp.maximum(n, 1.0)
