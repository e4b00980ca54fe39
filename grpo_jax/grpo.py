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

Every loss type is written as one weighted token sum, `sum(weight_BC * per_token_loss_BC)`, whose
weights use normalisers of the whole optimizer step (or generation batch), so gradient
accumulation over micro-batches adds up to exactly the full-batch loss:

  grpo       weight = mask / (len_b · B_step)         mean over tokens, then over sequences
  bnpo       weight = mask / tokens_step              token mean over the optimizer step's batch
  dr_grpo    weight = mask / (B_step · C)             token sum over batch × max completion length
  dapo       weight = mask / tokens_generation        token mean over the generation batch
  flow_grpo  weight = mask / (B_step · T_b · |a_t|)   token mean per action turn t, then mean
                                                      over the row's T_b turns, then over rows

flow_grpo reads turn_ids_BC (0-based turn of each completion token; observation tokens between
actions have mask 0, so their turn id is never read; they are still attended to). T_b counts the
turns of row b with a loss token, |a_t| the loss tokens of turn t in row b. With one turn per row
it is exactly grpo. The advantage is the trajectory's (one row, grpo.group_advantages), the same
at every one of its action tokens.

TRL's bnpo normalises by the tokens of each micro-batch on each process; here it is the step's
batch, so that it is invariant to micro-batching. One generation batch is one optimizer step's
batch here, so bnpo and dapo give the same loss; both names are kept so configs written for TRL
mean what they say. `grpo_loss(num_tokens=...)` takes a larger dapo normaliser for maths tests.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_jax import errors

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "flow_grpo")
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
  if cfg.kl_estimator == "k1" and cfg.beta > 0:
    errors.warn(f"loss.kl_estimator='k1' with beta={cfg.beta}: as a loss term its gradient is 0 "
                "in expectation (docs/loss.md, 'The KL term'), so it holds nothing near the "
                "reference; use 'k3' (the default) or 'k2'")


def needs_reference(cfg) -> bool:
  """Whether the loop must compute reference log-probs at all (β = 0 skips that forward)."""
  return cfg.beta != 0


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
  if loss_type in ("bnpo", "dapo"):
    return mask_BC / jnp.maximum(num_tokens, 1.0)
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


def loss_terms(logp_BC, old_logp_BC, ref_logp_BC, advantages_B, mask_BC, weights_BC, cfg,
               hp=None):
  """The weighted-sum loss of one (micro-)batch, and its metric sums.

  hp: the train step's hyperparameter arrays ('beta', 'clip_low' = 1 - epsilon, 'clip_high' =
  1 + epsilon_high; train_step.hparams), which take the place of cfg's values; the program's
  structure (whether there is a KL term at all) still follows cfg.beta.

  old_logp_BC None → on-policy: stop_gradient(logp), so the ratio is exactly 1 (μ = 1).
  ref_logp_BC is read only when cfg.beta > 0.
  Returns (loss scalar, sums) where `sums` holds token-summed quantities the caller divides by
  the step's loss-token count (clip counts, ratio sum, per-token KL sum 'kl/sum') and the
  already-normalised 'loss/policy', 'loss/kl'; plus 'ratio/min', 'ratio/max'.
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
  else:
    beta, low, high = hp["beta"], hp["clip_low"], hp["clip_high"]
  clipped_BC = jnp.clip(ratio_BC, low, high)
  capped_BC = ratio_BC if cfg.delta is None else jnp.minimum(ratio_BC, cfg.delta)
  policy_BC = -jnp.minimum(capped_BC * adv_B1, clipped_BC * adv_B1)
  policy_loss = jnp.sum(weights_BC * policy_BC)
  if needs_reference(cfg):
    if ref_logp_BC is None:
      raise ValueError(f"loss.beta={cfg.beta} > 0 needs batch['ref_logp_BC']")
    kl_BC = kl_estimate(logp_BC, ref_logp_BC, cfg.kl_estimator)
    kl = jnp.sum(weights_BC * kl_BC)
  else:
    kl_BC = kl = jnp.zeros((), jnp.float32)
  loss = policy_loss + beta * kl

  # DAPO's clip metrics: a token is clipped when the clipped branch is the active one.
  ratio_BC = jax.lax.stop_gradient(ratio_BC)
  low_BC = (ratio_BC < low) & (adv_B1 < 0)
  high_BC = (ratio_BC > high) & (adv_B1 > 0)
  on_BC = mask_BC > 0
  sums = {
      "loss/policy": jax.lax.stop_gradient(policy_loss),
      "loss/kl": jax.lax.stop_gradient(kl),
      "kl/sum": jax.lax.stop_gradient(jnp.sum(jnp.where(on_BC, kl_BC, 0.0))),
      "clip/low_count": jnp.sum(low_BC & on_BC),
      "clip/high_count": jnp.sum(high_BC & on_BC),
      "ratio/sum": jnp.sum(jnp.where(on_BC, ratio_BC, 0.0)),
      "ratio/min": jnp.min(jnp.where(on_BC, ratio_BC, jnp.inf)),
      "ratio/max": jnp.max(jnp.where(on_BC, ratio_BC, -jnp.inf)),
  }
  return loss, sums


def finalize_metrics(sums, num_tokens):
  """Turns accumulated `loss_terms` sums (over a step's micro-batches) into flat metrics."""
  n = jnp.maximum(num_tokens, 1.0)
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
  }


def grpo_loss(logp_BC, advantages_B, mask_BC, cfg, *, old_logp_BC=None, ref_logp_BC=None,
              num_tokens=None, max_completion_length=None, turn_ids_BC=None, max_turns=None):
  """The whole-batch loss and metrics of one un-accumulated step (convenience for tests/tools).

  num_tokens: the dapo normaliser (loss tokens of the generation batch); default: this batch's.
  turn_ids_BC, max_turns: flow_grpo's turn of each token and bound on turns (token_weights).
  """
  mask_BC = jnp.asarray(mask_BC, jnp.float32)
  step_tokens = mask_BC.sum()
  if num_tokens is None or cfg.loss_type != "dapo":
    num_tokens = step_tokens
  weights_BC = token_weights(mask_BC, cfg.loss_type, num_sequences=mask_BC.shape[0],
                             num_tokens=num_tokens, max_completion_length=max_completion_length,
                             turn_ids_BC=turn_ids_BC, max_turns=max_turns)
  loss, sums = loss_terms(logp_BC, old_logp_BC, ref_logp_BC, advantages_B, mask_BC,
                          weights_BC, cfg)
  return loss, finalize_metrics(sums, step_tokens)

