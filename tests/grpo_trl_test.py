"""grpo.py's loss options against TRL 1.16.0's own code, on random inputs.

The reference is TRL's: `GRPOTrainer._compute_loss` runs on a stand-in `self` (SimpleNamespace)
whose `_get_per_token_logps_and_entropies` returns fixed log-probs and entropies as torch leaves,
so its loss and its gradient with respect to them are TRL's arithmetic. The rollout (vLLM)
importance-sampling ratio and TRL's sampling-drift metrics are computed inline in TRL's
`_generate_and_score_completions`; their blocks are taken from that function's source and run
as they are. torch runs in float64, grpo_jax in float32: ≤ 1e-6 relative.
"""
import collections
import inspect
import math
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from trl.trainer import grpo_trainer as trl_grpo  # trl==1.16.0, pyproject.toml's [test] extra

from grpo_jax import config as config_lib, grpo

GRPOTrainer = trl_grpo.GRPOTrainer
RTOL = 1e-6


class _Accelerator:
  """One process: every collective is the identity."""
  num_processes = 1
  sync_gradients = True

  def gather(self, x):
    return x

  def reduce(self, x, reduction="sum"):
    return x

  def pad_across_processes(self, x, dim=0, pad_index=0):
    return x


def trl_self(cfg, *, use_vllm=False, logp=None, entropy=None):
  """A stand-in GRPOTrainer `self` for `_compute_loss`, from a grpo_jax loss config (TRL's
  names on the left). The model forward returns `logp` and `entropy` (torch leaves)."""
  args = types.SimpleNamespace(
      use_bias_correction_kl=cfg.use_bias_correction_kl, delta=cfg.delta,
      sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
      vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos,
      vespo_k_neg=cfg.vespo_k_neg, vespo_lambda_neg=cfg.vespo_lambda_neg,
      steps_per_generation=1, entropy_target=0.2)
  s = types.SimpleNamespace(
      args=args, model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
      aux_loss_enabled=False, top_entropy_quantile=cfg.top_entropy_quantile,
      off_policy_mask_threshold=cfg.off_policy_mask_threshold,
      importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta,
      loss_type=cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
      use_vllm=use_vllm, vllm_importance_sampling_correction=cfg.rollout_is_correction,
      vllm_importance_sampling_mode=cfg.rollout_is_mode,
      vllm_importance_sampling_clip_min=cfg.rollout_is_clip_min,
      vllm_importance_sampling_clip_max=cfg.rollout_is_clip_max,
      current_gradient_accumulation_steps=1, max_completion_length=None,
      _entropy_bonus_enabled=cfg.entropy_coef != 0.0, entropy_coef=cfg.entropy_coef,
      use_adaptive_entropy=False,
      _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)})
  s.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, s)
  s.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
  s.get_gamma_weights = GRPOTrainer.get_gamma_weights
  s._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
  return s


def _trl_block(start, end):
  """Lines of GRPOTrainer._generate_and_score_completions from `start` up to `end`, dedented,
  compiled: TRL's own statements, run in a namespace of the names they read."""
  src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
  i = src.index(start)
  j = src.index(end, i)
  return compile(textwrap.dedent(src[i:j]), "trl_grpo_trainer_block", "exec")


_IS_BLOCK = _trl_block(
    "if self.use_vllm and self.vllm_importance_sampling_correction:\n                mask =",
    "# Compute the per-token log probabilities for the reference model")
_DRIFT_BLOCK = _trl_block(
    "if self.use_vllm and self.vllm_importance_sampling_correction:\n            delta =",
    "output = {")


def trl_is_ratio(cfg, old, sampling, mask):
  """TRL's vllm_importance_sampling_ratio ([B, T] token modes, [B, 1] sequence modes)."""
  ns = dict(self=trl_self(cfg, use_vllm=True), old_per_token_logps=old,
            sampling_per_token_logps=sampling, completion_mask=mask, tool_mask=None, torch=torch,
            math=math)
  exec(_IS_BLOCK, ns)
  return ns["vllm_importance_sampling_ratio"]


def t64(x):
  return torch.tensor(np.asarray(x, np.float64))


def case(seed=0, B=8, C=7):
  """Random log-probs (old spread over both clip edges), a sampler's near the old ones,
  entropies, advantages of both signs, a ragged mask with a fully masked row."""
  rng = np.random.default_rng(seed)
  logp = (rng.normal(size=(B, C)) - 2.0).astype(np.float32)
  old = (logp + rng.normal(scale=0.4, size=(B, C))).astype(np.float32)
  sampler = (old + rng.normal(scale=0.3, size=(B, C))).astype(np.float32)
  ref = (logp + rng.normal(scale=0.5, size=(B, C))).astype(np.float32)
  entropy = rng.uniform(0.1, 3.0, size=(B, C)).astype(np.float32)
  adv = (rng.normal(size=B) * np.resize([-1.0, 1.0], B)).astype(np.float32)
  mask = (rng.random((B, C)) < 0.8).astype(np.float32)
  mask[:, 0] = 1.0
  mask[2] = 0.0
  return dict(logp=logp, old=old, sampler=sampler, ref=ref, entropy=entropy, adv=adv, mask=mask)


def ours(cfg, c, *, on_policy=False, with_sampler=True):
  """grpo_jax's loss and its gradients with respect to (logp, entropy)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def loss(lp, ent):
    return grpo.grpo_loss(lp, f32(c["adv"]), f32(c["mask"]), cfg,
                          old_logp_BC=None if on_policy else f32(c["old"]),
                          ref_logp_BC=f32(c["ref"]),
                          sampler_logp_BC=f32(c["sampler"]) if with_sampler else None,
                          entropy_BC=ent)
  (value, metrics), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      f32(c["logp"]), f32(c["entropy"]))
  return float(value), [np.asarray(g, np.float64) for g in grads], metrics


def theirs(cfg, c, *, on_policy=False, with_sampler=True):
  """TRL's _compute_loss on the same numbers, its gradients with respect to (logp, entropy)."""
  logp = t64(c["logp"]).requires_grad_(True)
  entropy = t64(c["entropy"]).requires_grad_(True)
  mask = t64(c["mask"])
  B, C = mask.shape
  old = logp.detach().clone() if on_policy else t64(c["old"])
  use_vllm = cfg.rollout_is_correction
  inputs = {"prompt_ids": torch.zeros((B, 1), dtype=torch.long),
            "prompt_mask": torch.ones((B, 1), dtype=torch.long),
            "completion_ids": torch.zeros((B, C), dtype=torch.long), "completion_mask": mask,
            "advantages": t64(c["adv"]), "num_items_in_batch": mask.sum(),
            "ref_per_token_logps": t64(c["ref"])}
  if not on_policy:
    inputs["old_per_token_logps"] = old
  if with_sampler:
    inputs["sampling_per_token_logps"] = t64(c["sampler"])
  if use_vllm:
    inputs["importance_sampling_ratio"] = trl_is_ratio(cfg, old, t64(c["sampler"]), mask)
  s = trl_self(cfg, use_vllm=use_vllm, logp=logp, entropy=entropy)
  s.max_completion_length = C  # dr_grpo's constant: grpo_loss's default is the mask's width
  loss = GRPOTrainer._compute_loss(s, s.model, inputs)
  loss.backward()
  grad_entropy = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)
  return float(loss.detach()), [logp.grad.numpy(), grad_entropy.numpy()], s._metrics["train"]


def assert_matches_trl(cfg, c, **kw):
  """Loss within RTOL of TRL's, relative to its scale mean |A| (a loss that is a sum of signed
  terms of that size may cancel to near 0); gradients relative to their largest element."""
  value, grads, metrics = ours(cfg, c, **kw)
  want, want_grads, trl_metrics = theirs(cfg, c, **kw)
  np.testing.assert_allclose(value, want, rtol=RTOL, atol=RTOL * np.abs(c["adv"]).mean())
  for name, g, w in zip(("d/dlogp", "d/dentropy"), grads, want_grads):
    # Relative to the gradient's own scale: single elements may be ~0.
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * np.abs(w).max(), err_msg=name)
  assert np.abs(want_grads[0]).max() > 0
  return metrics, trl_metrics


def loss_cfg(**kw):
  cfg = config_lib.loss()
  cfg.update(beta=0.04, epsilon_high=0.28)
  cfg.update(**kw)
  grpo.validate_loss_config(cfg)
  return cfg


@pytest.mark.parametrize("level", grpo.IS_LEVELS)
@pytest.mark.parametrize("loss_type,extra", [
    ("cispo", dict(epsilon_high=1.3)),   # a cap that binds on some tokens, not on all
    ("sapo", {}),
    ("sapo", dict(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)),
    ("luspo", {}),
    ("vespo", {}),
    ("vespo", dict(vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                   vespo_lambda_neg=5.0)),
])
def test_new_loss_types_match_trl(loss_type, extra, level):
  cfg = loss_cfg(loss_type=loss_type, importance_sampling_level=level, **extra)
  c = case(seed=1)
  metrics, trl_metrics = assert_matches_trl(cfg, c)
  # TRL's cispo_clip_ratio is grpo_jax's clip/high_frac; at the sequence level TRL counts
  # sequences and grpo_jax tokens, as for every clip metric (docs/loss.md).
  if loss_type == "cispo" and level == "token":
    np.testing.assert_allclose(float(metrics["clip/high_frac"]),
                               trl_metrics["cispo_clip_ratio"][0], rtol=RTOL)
    assert 0 < trl_metrics["cispo_clip_ratio"][0] < 1
  if loss_type in ("sapo", "vespo"):
    assert float(metrics["clip/region_frac"]) == 0.0  # no hard clip
  np.testing.assert_allclose(float(metrics["kl"]), trl_metrics["kl"][0], rtol=RTOL)


# vespo with a sequence mode is refused, as TRL refuses it (test_settings_that_contradict_...).
@pytest.mark.parametrize("mode,loss_type", [
    (m, t) for m in grpo.ROLLOUT_IS_MODES for t in ("grpo", "dapo", "vespo")
    if not (t == "vespo" and m.startswith("sequence_"))])
@pytest.mark.parametrize("bounds", [(None, 1.5), (0.7, 1.4)])
def test_rollout_is_correction_matches_trl(mode, loss_type, bounds):
  lo, hi = bounds
  cfg = loss_cfg(loss_type=loss_type, rollout_is_correction=True, rollout_is_mode=mode,
                 rollout_is_clip_min=lo, rollout_is_clip_max=hi)
  c = case(seed=2)
  assert_matches_trl(cfg, c, on_policy=True)
  assert_matches_trl(cfg, c)
  # The ratio itself, and that these bounds truncate or mask some tokens, not all.
  old, mask = c["old"], c["mask"]
  want = np.asarray(trl_is_ratio(cfg, t64(old), t64(c["sampler"]), t64(mask)))
  got, outside = grpo.rollout_is_ratio(jnp.asarray(old), jnp.asarray(c["sampler"]),
                                       jnp.asarray(mask), mode, lo, hi)
  got = np.asarray(got)[:, :want.shape[1]]
  np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=RTOL)
  on = mask > 0
  assert 0 < np.asarray(outside)[on].mean() < 1


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.3])
@pytest.mark.parametrize("with_sampler", [True, False])
def test_off_policy_mask_matches_trl(threshold, with_sampler):
  """TRL measures drift from the sampler's log-probs when it has them, else the old ones."""
  cfg = loss_cfg(loss_type="dapo", off_policy_mask_threshold=threshold)
  c = case(seed=3)
  assert_matches_trl(cfg, c, with_sampler=with_sampler)
  keep = np.asarray(grpo.off_policy_keep(jnp.asarray(c["logp"]), jnp.asarray(c["sampler"]),
                                         jnp.asarray(c["adv"]), jnp.asarray(c["mask"]),
                                         threshold))
  if threshold == 0.05:  # drops some negative-advantage rows, never a positive one
    assert 0 < (keep[:, 0] == 0).sum() < (c["adv"] < 0).sum() + 1
    assert np.all(keep[c["adv"] >= 0] == 1)


@pytest.mark.parametrize("level", grpo.IS_LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "luspo"])
def test_bias_corrected_kl_matches_trl(level, loss_type):
  cfg = loss_cfg(loss_type=loss_type, use_bias_correction_kl=True,
                 importance_sampling_level=level, beta=0.3)
  c = case(seed=4)
  metrics, trl_metrics = assert_matches_trl(cfg, c)
  np.testing.assert_allclose(float(metrics["kl"]), trl_metrics["kl"][0], rtol=RTOL)
  # The correction changes the gradient even on-policy, where the ratio's value is 1.
  on = ours(cfg, c, on_policy=True)[1][0]
  cfg.use_bias_correction_kl = False
  off = ours(cfg, c, on_policy=True)[1][0]
  assert np.abs(on - off).max() > 1e-3


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_top_entropy_quantile_matches_trl(quantile, loss_type):
  cfg = loss_cfg(loss_type=loss_type, top_entropy_quantile=quantile,
                 epsilon_high=1.3 if loss_type == "cispo" else 0.28)
  c = case(seed=5)
  assert_matches_trl(cfg, c)
  mask = c["mask"] > 0
  keep = np.asarray(grpo.high_entropy_keep(
      jnp.asarray(c["entropy"]), jnp.asarray(c["mask"]),
      grpo.entropy_threshold(jnp.asarray(c["entropy"]), jnp.asarray(c["mask"]), quantile)))
  kept = keep[mask].mean()
  # ρ of the loss tokens (at least the one with the highest entropy), none outside the mask.
  assert kept == pytest.approx(max(quantile, 1 / mask.sum()), abs=1 / mask.sum())
  assert not keep[~mask].any()


@pytest.mark.parametrize("coef", [0.01, -0.2])
@pytest.mark.parametrize("quantile", [1.0, 0.3])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "luspo"])
def test_entropy_bonus_matches_trl(coef, quantile, loss_type):
  """The bonus is a token mean of the trained tokens' entropy, whatever the loss type."""
  cfg = loss_cfg(loss_type=loss_type, entropy_coef=coef, top_entropy_quantile=quantile)
  c = case(seed=6)
  metrics, _ = assert_matches_trl(cfg, c)
  if quantile == 1:
    np.testing.assert_allclose(float(metrics["loss/entropy"]),
                               (c["entropy"] * c["mask"]).sum() / c["mask"].sum(), rtol=RTOL)


def test_everything_at_once_matches_trl():
  cfg = loss_cfg(loss_type="grpo", rollout_is_correction=True, rollout_is_mode="token_truncate",
                 rollout_is_clip_min=0.8, rollout_is_clip_max=1.3, off_policy_mask_threshold=0.05,
                 use_bias_correction_kl=True, top_entropy_quantile=0.4, entropy_coef=0.05,
                 delta=1.5)
  assert_matches_trl(cfg, case(seed=7))


def test_drift_metrics_match_trls_sampling_logp_difference():
  """drift/logp_diff_mean and _max are TRL's sampling/sampling_logp_difference/{mean,max};
  drift/kl is the k3 estimate of KL(sampler ‖ train) from the same tokens, by NumPy."""
  c = case(seed=8)
  cfg = loss_cfg(rollout_is_correction=True, rollout_is_mode="token_mask", rollout_is_clip_min=0.8,
                 rollout_is_clip_max=1.25, off_policy_mask_threshold=0.05)
  s = trl_self(cfg, use_vllm=True)
  old, sampler, mask = t64(c["old"]), t64(c["sampler"]), t64(c["mask"])
  ns = dict(self=s, old_per_token_logps=old, sampling_per_token_logps=sampler,
            completion_mask=mask, tool_mask=None, torch=torch, math=math, device="cpu",
            mode="train",
            nanmin=trl_grpo.nanmin, nanmax=trl_grpo.nanmax, sequence_level_is=False,
            vllm_importance_sampling_ratio=trl_is_ratio(cfg, old, sampler, mask))
  exec(_DRIFT_BLOCK, ns)
  got = grpo.drift_metrics(jnp.asarray(c["old"]), jnp.asarray(c["sampler"]), jnp.asarray(c["mask"]),
                           jnp.asarray(c["adv"]), cfg)
  m = s._metrics["train"]
  np.testing.assert_allclose(float(got["drift/logp_diff_mean"]),
                             m["sampling/sampling_logp_difference/mean"][0], rtol=RTOL)
  np.testing.assert_allclose(float(got["drift/logp_diff_max"]),
                             m["sampling/sampling_logp_difference/max"][0], rtol=RTOL)
  on = c["mask"] > 0
  d = (c["old"].astype(np.float64) - c["sampler"])[on]
  np.testing.assert_allclose(float(got["drift/kl"]), np.mean(np.expm1(d) - d), rtol=1e-5)
  ratio = np.exp(d)
  np.testing.assert_allclose(float(got["drift/is_clipped_frac"]),
                             np.mean((ratio < 0.8) | (ratio > 1.25)), rtol=RTOL)
  # TRL's masked ratio is 0 exactly where grpo_jax counts a token as masked.
  trl_ratio = np.asarray(ns["vllm_importance_sampling_ratio"])[on]
  assert np.array_equal(trl_ratio == 0, (ratio < 0.8) | (ratio > 1.25))
  keep = np.asarray(grpo.off_policy_keep(jnp.asarray(c["old"]), jnp.asarray(c["sampler"]),
                                         jnp.asarray(c["adv"]), jnp.asarray(c["mask"]), 0.05))
  dropped = np.broadcast_to(keep == 0, on.shape)[on].mean()
  np.testing.assert_allclose(float(got["drift/off_policy_masked_frac"]), dropped, rtol=RTOL)
  assert 0 < dropped < 1


@pytest.mark.parametrize("name,value", [
    ("loss_type", "gspo"), ("sapo_temperature_pos", 0.0), ("sapo_temperature_neg", -1.0),
    ("vespo_k_pos", -1.0), ("vespo_lambda_neg", float("nan")), ("rollout_is_mode", "token"),
    ("rollout_is_clip_min", -0.5), ("rollout_is_clip_max", 0.0),
    ("off_policy_mask_threshold", -0.1), ("top_entropy_quantile", 1.5),
    ("entropy_coef", float("inf"))])
def test_bad_new_settings_name_the_setting(name, value):
  cfg = config_lib.loss()
  grpo.validate_loss_config(cfg)
  cfg[name] = value
  with pytest.raises(ValueError, match=f"loss.{name}=") as e:
    grpo.validate_loss_config(cfg)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,match", [
    (dict(rollout_is_clip_min=2.0, rollout_is_clip_max=1.5), "rollout_is_clip_min=2.0"),
    (dict(rollout_is_mode="token_truncate", rollout_is_clip_min=None, rollout_is_clip_max=None),
     "rollout_is_mode='token_truncate'"),
    (dict(loss_type="vespo", rollout_is_correction=True, rollout_is_mode="sequence_mask"),
     "rollout_is_mode='sequence_mask'"),
])
def test_settings_that_contradict_each_other_are_refused(change, match):
  """TRL's GRPOConfig refuses the first two, its GRPOTrainer the third."""
  cfg = config_lib.loss()
  cfg.update(**change)
  with pytest.raises(ValueError, match=match):
    grpo.validate_loss_config(cfg)


@pytest.mark.parametrize("loss_type,level,warns", [
    ("luspo", "token", "luspo"), ("luspo", "sequence", None), ("vespo", "sequence", "vespo"),
    ("vespo", "token", None)])
def test_level_mismatches_warn_as_trl_does(loss_type, level, warns, capsys):
  cfg = config_lib.loss()
  cfg.update(loss_type=loss_type, importance_sampling_level=level)
  grpo.validate_loss_config(cfg)
  err = capsys.readouterr().err
  assert (warns in err) if warns else err == ""


def test_adaptive_entropy_coefficient_follows_trls_controller_step_by_step():
  """use_adaptive_entropy over eight optimizer steps: TRL's _compute_loss itself (its adaptive
  block, one micro-batch a step, so every call ends an accumulation window) updates the
  coefficient and the last entropy on its stand-in `self`; grpo.adaptive_entropy_next does the
  same from the step's loss/entropy. Entropies alternate around the target and the bounds bind
  (the coefficient climbs to entropy_coef_max, falls to entropy_coef_min). Each step's loss is
  TRL's with the coefficient that step applies (0 while the last entropy is above the target;
  the first step's too: no measurement yet)."""
  cfg = loss_cfg(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.01,
                 entropy_target=1.5, entropy_coef_delta=0.004, entropy_coef_min=0.002,
                 entropy_coef_max=0.02)
  ctrl = grpo.adaptive_entropy_start(cfg)
  trl_state = dict(entropy_coef=cfg.entropy_coef, _last_world_entropy=float("inf"))
  scales = (0.6, 0.5, 0.7, 0.6, 0.5, 1.6, 1.8, 1.7, 1.9, 1.6)
  applied_seen = []
  for t, scale in enumerate(scales):
    c = case(seed=20 + t)
    c["entropy"] = (c["entropy"] * scale).astype(np.float32)
    applied = float(grpo.adaptive_entropy_applied(ctrl, cfg))
    applied_seen.append(applied)
    fixed = loss_cfg(loss_type="grpo", entropy_coef=applied)  # our loss at that coefficient
    value, _, metrics = ours(fixed if applied else loss_cfg(loss_type="grpo", entropy_coef=1.0),
                             c)
    ctrl = grpo.adaptive_entropy_next(ctrl, metrics["loss/entropy"], cfg)

    s = trl_self(cfg, logp=t64(c["logp"]).requires_grad_(True),
                 entropy=t64(c["entropy"]).requires_grad_(True))
    s.use_adaptive_entropy, s._entropy_bonus_enabled, s._entropy_window_stats = True, True, None
    s.__dict__.update(trl_state)
    s.args.__dict__.update(entropy_target=cfg.entropy_target,
                           entropy_coef_delta=cfg.entropy_coef_delta,
                           entropy_coef_min=cfg.entropy_coef_min,
                           entropy_coef_max=cfg.entropy_coef_max)
    mask = t64(c["mask"])
    B, C = mask.shape
    inputs = {"prompt_ids": torch.zeros((B, 1), dtype=torch.long),
              "prompt_mask": torch.ones((B, 1), dtype=torch.long),
              "completion_ids": torch.zeros((B, C), dtype=torch.long), "completion_mask": mask,
              "advantages": t64(c["adv"]), "num_items_in_batch": mask.sum(),
              "ref_per_token_logps": t64(c["ref"]), "old_per_token_logps": t64(c["old"])}
    want = float(GRPOTrainer._compute_loss(s, s.model, inputs).detach())
    trl_state = dict(entropy_coef=s.entropy_coef, _last_world_entropy=s._last_world_entropy)
    if applied:
      np.testing.assert_allclose(value, want, rtol=RTOL, atol=RTOL * np.abs(c["adv"]).mean())
    np.testing.assert_allclose(float(ctrl["coef"]), s.entropy_coef, rtol=RTOL, err_msg=str(t))
    np.testing.assert_allclose(float(ctrl["last"]), s._last_world_entropy, rtol=RTOL)
  # The run went through both bounds and both gates.
  assert applied_seen[0] == 0 and np.float32(0.02) in np.float32(applied_seen)
  assert float(ctrl["coef"]) == np.float32(0.002) and applied_seen[-1] == 0


# --- loss.sync_ref_model: TRL's SyncRefModelCallback --------------------------------------------


def _torch_modules(arrays, dtype):
  """A torch module whose parameters are `arrays` (a list), in dtype."""
  module = torch.nn.Module()
  for i, a in enumerate(arrays):
    module.register_parameter(f"p{i}", torch.nn.Parameter(torch.tensor(a).to(dtype)))
  return module


def test_synced_reference_matches_trls_callback_step_for_step(monkeypatch):
  """grpo.mix_reference and grpo.reference_sync_due against TRL's SyncRefModelCallback.on_step_end,
  run as the Trainer calls it (state.global_step = the updates made so far), over six updates
  with the policy moving between them: float32, ≤ 1e-6 relative at every step. (One process
  without DeepSpeed: accelerate's state, which asks for an Accelerator, says just that.)"""
  from trl.trainer import callbacks  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(callbacks, "AcceleratorState",
                      lambda: types.SimpleNamespace(deepspeed_plugin=None))
  rng = np.random.default_rng(0)
  shapes = [(5, 3), (7,), (2, 4, 3)]
  ref = [rng.normal(size=s).astype(np.float32) for s in shapes]
  cfg = loss_cfg(beta=0.04, sync_ref_model=True, ref_model_sync_steps=2,
                 ref_model_mixup_alpha=0.6)
  trl_ref = _torch_modules(ref, torch.float32)
  callback = callbacks.SyncRefModelCallback(ref_model=trl_ref, accelerator=None)
  args = types.SimpleNamespace(ref_model_sync_steps=cfg.ref_model_sync_steps,
                               ref_model_mixup_alpha=cfg.ref_model_mixup_alpha)
  ours, synced = [jnp.asarray(r) for r in ref], []
  for step in range(1, 7):
    policy = [rng.normal(size=s).astype(np.float32) for s in shapes]
    callback.on_step_end(args, types.SimpleNamespace(global_step=step), None,
                         model=_torch_modules(policy, torch.float32))
    if bool(grpo.reference_sync_due(jnp.int32(step), cfg)):
      ours = grpo.mix_reference(ours, [jnp.asarray(p) for p in policy], cfg.ref_model_mixup_alpha)
      synced.append(step)
    for a, b in zip(ours, trl_ref.parameters()):
      np.testing.assert_allclose(np.asarray(a), b.detach().numpy(), rtol=RTOL, atol=1e-7,
                                 err_msg=f"after update {step}")
  assert synced == [2, 4, 6]


def test_synced_reference_in_bfloat16_is_the_float32_mix_rounded_once():
  """A bf16 reference (train_step.reference_dtype) is mixed in float32 and rounded once; TRL's
  in-place mul_/add_ on bf16 parameters round twice. Pinned: ours is the exact mix rounded to
  bf16 on every element where that rounding is unambiguous, never farther from the exact mix
  than TRL's, and strictly nearer on some."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from trl.trainer import callbacks  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  ref = rng.normal(size=(4096,)).astype(ml_dtypes.bfloat16)
  policy = rng.normal(size=(4096,)).astype(np.float32)
  alpha = 0.6
  got = np.asarray(grpo.mix_reference(jnp.asarray(ref), jnp.asarray(policy), alpha)).astype(
      np.float64)
  assert grpo.mix_reference(jnp.asarray(ref), jnp.asarray(policy), alpha).dtype == jnp.bfloat16
  trl_ref = _torch_modules([np.asarray(ref, np.float32)], torch.bfloat16)
  callbacks.SyncRefModelCallback._sync_target_model(  # pylint: disable=protected-access
      _torch_modules([policy], torch.bfloat16), trl_ref, alpha)
  trl = next(trl_ref.parameters()).detach().to(torch.float64).numpy()
  exact = np.asarray(ref, np.float64) * (1 - alpha) + policy.astype(np.float64) * alpha
  rounded = exact.astype(ml_dtypes.bfloat16).astype(np.float64)
  clear = np.abs(exact - rounded) < 0.45 * np.spacing(rounded.astype(ml_dtypes.bfloat16)
                                                       ).astype(np.float64)
  np.testing.assert_array_equal(got[clear], rounded[clear])
  assert np.all(np.abs(got - exact) <= np.abs(trl - exact) + 1e-12)
  assert np.any(np.abs(got - exact) < np.abs(trl - exact))
