"""grpo.py against direct NumPy (float64) implementations of each formula, written per sequence
and per group with loops so they share no structure with the vectorised code; gradients against
central finite differences of those NumPy references."""
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import config as config_lib, grpo, logprobs

# ------------------------------------------------------------------------------------------------
# NumPy references.


def np_log_softmax_gather(hidden, head, targets, temperature):
  logits = hidden.astype(np.float64) @ head.astype(np.float64) / temperature
  m = logits.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  probs = np.exp(logits - lse[..., None])
  logp = np.take_along_axis(logits, targets[..., None], -1)[..., 0] - lse
  entropy = -(probs * np.log(probs)).sum(-1)
  return logp, entropy, probs


def filled_totals(rewards, group_size, weights):
  """Σ_k w_k r_k per row, a missing r_k replaced by the mean of component k over the rows of the
  group that have it (0 when none has it)."""
  B, R = rewards.shape
  out = np.zeros(B)
  for i in range(B):
    group = range(i // group_size * group_size, (i // group_size + 1) * group_size)
    for k in range(R):
      if np.isnan(rewards[i, k]):
        have = [rewards[j, k] for j in group if not np.isnan(rewards[j, k])]
        value = np.mean(have) if have else 0.0
      else:
        value = rewards[i, k]
      out[i] += weights[k] * value
  return out


def np_advantages(rewards, group_size, weights, scale, aggregation, eps):
  """Loops over groups; NaN = missing; std with ddof=1 over present entries (0 if < 2)."""
  B, R = rewards.shape

  def std(xs):
    return float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0

  def normalise(r, present):
    out = np.zeros(B)
    batch_std = std([r[i] for i in range(B) if present[i]])
    for g in range(B // group_size):
      idx = [i for i in range(g * group_size, (g + 1) * group_size) if present[i]]
      vals = [r[i] for i in idx]
      for i in idx:
        centred = r[i] - np.mean(vals)
        out[i] = {"group": centred / (std(vals) + eps), "batch": centred / (batch_std + eps),
                  "none": centred}[scale]
    return out

  present = [not np.all(np.isnan(rewards[i])) for i in range(B)]
  if aggregation == "sum_then_normalize":
    return normalise(filled_totals(rewards, group_size, weights), present), filled_totals(
        rewards, group_size, weights)
  per_k = [normalise(rewards[:, k], ~np.isnan(rewards[:, k])) for k in range(R)]
  s = sum(weights[k] * per_k[k] for k in range(R))
  vals = [s[i] for i in range(B) if present[i]]
  adv = np.array([(s[i] - np.mean(vals)) / (std(vals) + eps) if present[i] else 0.0
                  for i in range(B)])
  return adv, s


def np_kl(logp, ref, estimator):
  x = ref - logp
  return {"k1": -x, "k2": 0.5 * x * x, "k3": np.exp(x) - 1 - x}[estimator]


def np_loss(logp, old, ref, adv, mask, cfg, gen_tokens=None):
  """Loss and metrics of one batch, straight from the papers' formulas."""
  B, C = logp.shape
  per_seq_loss, per_tok = [], []
  low = high = 0
  ratios = []
  for b in range(B):
    toks = [t for t in range(C) if mask[b, t]]
    if cfg.importance_sampling_level == "sequence":  # GSPO: exp(mean log ratio), per sequence
      s = np.mean([logp[b, t] - old[b, t] for t in toks]) if toks else 0.0
      r_t = {t: np.exp(s) for t in toks}
    else:
      r_t = {t: np.exp(logp[b, t] - old[b, t]) for t in toks}
    losses = []
    for t in toks:
      r = r_t[t]
      ratios.append(r)
      clipped = min(max(r, 1 - cfg.epsilon), 1 + cfg.epsilon_high)
      capped = r if cfg.delta is None else min(r, cfg.delta)
      l = -min(capped * adv[b], clipped * adv[b])
      kl = np_kl(logp[b, t], ref[b, t], cfg.kl_estimator) if cfg.beta else 0.0
      losses.append((l, kl))
      low += (r < 1 - cfg.epsilon) and adv[b] < 0
      high += (r > 1 + cfg.epsilon_high) and adv[b] > 0
    per_seq_loss.append(losses)
    per_tok.extend(losses)
  n_tok = len(per_tok)

  def aggregate(i):
    if cfg.loss_type == "grpo":
      return np.mean([np.mean([x[i] for x in s]) if s else 0.0 for s in per_seq_loss])
    total = sum(x[i] for x in per_tok)
    if cfg.loss_type == "bnpo":
      return total / max(n_tok, 1)
    if cfg.loss_type == "dr_grpo":
      return total / (B * C)
    return total / (gen_tokens if gen_tokens is not None else max(n_tok, 1))

  pol, kl = aggregate(0), aggregate(1)
  # TRL's `kl`: the per-token mean over the loss tokens, whatever the loss type.
  kl_tok = np.mean([x[1] for x in per_tok])
  metrics = {"loss/policy": pol, "loss/kl": kl, "kl": kl_tok, "clip/low_frac": low / n_tok,
             "clip/high_frac": high / n_tok, "clip/region_frac": (low + high) / n_tok,
             "ratio/min": min(ratios), "ratio/mean": np.mean(ratios), "ratio/max": max(ratios)}
  return pol + cfg.beta * kl, metrics


def finite_diff_grad(f, x, h=1e-6):
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    g[idx] = (f(xp) - f(xm)) / (2 * h)
  return g


# ------------------------------------------------------------------------------------------------
# Token log-probs (logprobs.py: the fused, blocked head pass with its hand-written backward).


def fused(hidden, head_DV, targets, temperature=1.0, blocks=None, entropy_grad=False):
  """logprobs' custom-VJP pass on [B, T] targets with explicit (tokens, rows) per block."""
  h_ND = hidden.reshape(-1, hidden.shape[-1])
  t, c = blocks or logprobs.block_shape(h_ND.shape[0], head_DV.shape[1])
  logp, ent = logprobs._fused(h_ND, head_DV.T.astype(h_ND.dtype), targets.reshape(-1),
                              1.0 / temperature, t, c, entropy_grad)
  return logp.reshape(targets.shape), ent.reshape(targets.shape)


def test_block_shape_stays_within_the_budget():
  assert logprobs.block_shape(4096, 151_665, 4 << 20) == (1024, 1024)
  assert logprobs.block_shape(64, 151_665, 4 << 20) == (64, 16384)
  assert logprobs.block_shape(10, 13, 4 << 20) == (10, 13)  # never wider than the vocabulary
  # An accelerator's 64 MiB: square blocks, which write the backward's partial sums least.
  assert logprobs.block_shape(32_640, 151_936, 64 << 20) == (4096, 4096)
  assert logprobs.block_shape(5000, 151_665, 1 << 20) == (1024, 256)  # never under 1024 tokens
  for n, budget in ((32_640, 64 << 20), (4096, 4 << 20), (100_000, 256 << 20)):
    t, c = logprobs.block_shape(n, 151_936, budget)
    # Of the shapes of this budget, the one with the fewest backward partials: 1/t + 1/c.
    assert t * c * 4 <= budget
    assert 1 / t + 1 / c <= min(1 / x + 4 * x / budget for x in (256, 512, 1024, 2048, 8192))


def test_log_prob_block_is_the_platforms_unless_set():
  """optim.logprob_block_bytes = 0: 4 MiB on a CPU, 64 MiB on a GPU or TPU (in the train step's
  spec, resolved from the mesh's devices); a value set is kept everywhere."""
  assert logprobs.platform_block_bytes(0, "cpu") == logprobs.DEFAULT_BLOCK_BYTES == 4 << 20
  assert logprobs.platform_block_bytes(0, "gpu") == logprobs.ACCELERATOR_BLOCK_BYTES == 64 << 20
  assert logprobs.platform_block_bytes(0, "tpu") == 64 << 20
  assert logprobs.platform_block_bytes(1 << 20, "gpu") == 1 << 20
  from grpo_jax import train_step  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  model_cfg = qwen.QwenConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                              num_heads=2, num_kv_heads=1, head_dim=4)
  build = lambda mesh: train_step.StepSpec.build(model_cfg, config_lib.loss(), config_lib.optim(),
                                                 mesh)
  gpu_mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))
  assert build(None).optim.logprob_block_bytes == 4 << 20  # this CPU
  assert build(gpu_mesh).optim.logprob_block_bytes == 64 << 20


@pytest.fixture(scope="module")
def lm_case():
  rng = np.random.default_rng(0)
  B, T, D, V = 2, 7, 6, 13
  hidden = rng.normal(size=(B, T, D)).astype(np.float32)
  head = rng.normal(size=(D, V)).astype(np.float32)
  targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
  weights = rng.normal(size=(B, T)).astype(np.float32)
  return hidden, head, targets, weights


# (tokens, vocabulary rows) per block over 14 tokens × 13 rows: one block, 1 × 1 blocks, and
# blocks with a remainder along either axis or both.
@pytest.mark.parametrize("blocks,temperature", [((14, 13), 1.0), ((1, 1), 0.7), ((3, 4), 1.0),
                                                ((5, 13), 0.7), ((14, 5), 1.3), ((4, 6), 1.0)])
def test_token_logprobs_value_and_grad_match_dense_numpy(lm_case, blocks, temperature):
  hidden, head, targets, w = lm_case
  logp, ent = fused(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(targets),
                    temperature=temperature, blocks=blocks)
  np_logp, np_ent, probs = np_log_softmax_gather(hidden, head, targets, temperature)
  np.testing.assert_allclose(np.asarray(logp), np_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), np_ent, rtol=1e-5, atol=1e-5)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32

  # d Σ w·logp / d logits = w (onehot − p) / temperature; chain to hidden and head by hand.
  onehot = np.eye(head.shape[1])[targets]
  dlogits = w[..., None] * (onehot - probs) / temperature
  f = lambda h_, W_: jnp.sum(jnp.asarray(w) * fused(
      h_, W_, jnp.asarray(targets), temperature=temperature, blocks=blocks)[0])
  g_hidden, g_head = jax.grad(f, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(head))
  np.testing.assert_allclose(np.asarray(g_hidden), dlogits @ head.T.astype(np.float64),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_head), np.einsum("btd,btv->dv", hidden, dlogits),
                             rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("blocks,temperature", [((14, 13), 1.0), ((3, 4), 0.7)])
def test_token_logprobs_entropy_gradient_when_asked_matches_dense(lm_case, blocks, temperature):
  """entropy_grad=True (loss.entropy_coef): the gradient of Σ w_n (logp_n + 2 H_n) through the
  fused pass is jax.grad of the same sum over dense log_softmax (float64, x64 mode)."""
  hidden, head, targets, weights = lm_case

  def dense(h, w):
    logits = h @ w / temperature
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    ent = -(jnp.exp(logp_all) * logp_all).sum(-1)
    return jnp.sum(weights * (logp + 2.0 * ent))

  def ours(h, w):
    logp, ent = fused(h, w, jnp.asarray(targets), temperature, blocks, entropy_grad=True)
    return jnp.sum(weights * (logp + 2.0 * ent))
  got = jax.grad(ours, argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(head))
  with jax.enable_x64():
    want = jax.grad(dense, argnums=(0, 1))(jnp.asarray(hidden, jnp.float64),
                                           jnp.asarray(head, jnp.float64))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
  # The entropy's share is not 0: without it the gradient differs.
  no_h = jax.grad(lambda h, w: jnp.sum(weights * fused(h, w, jnp.asarray(targets), temperature,
                                                       blocks)[0]))(jnp.asarray(hidden),
                                                                    jnp.asarray(head))
  assert np.abs(np.asarray(no_h) - np.asarray(got[0])).max() > 1e-2


def test_token_logprobs_entropy_carries_no_gradient(lm_case):
  hidden, head, targets, _ = lm_case
  g = jax.grad(lambda h_: jnp.sum(fused(h_, jnp.asarray(head), jnp.asarray(targets),
                                        blocks=(3, 4))[1]))(jnp.asarray(hidden))
  assert not np.any(np.asarray(g))


def test_token_logprobs_bf16_inputs_give_fp32_logprobs(lm_case):
  hidden, head, targets, _ = lm_case
  h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(head, jnp.bfloat16)
  logp, _ = fused(h16, w16, jnp.asarray(targets), blocks=(3, 4))
  assert logp.dtype == jnp.float32
  # Reference on the bf16-rounded inputs: only the inputs are rounded, not the maths.
  np_logp, _, _ = np_log_softmax_gather(np.asarray(h16, np.float32), np.asarray(w16, np.float32),
                                        targets, 1.0)
  np.testing.assert_allclose(np.asarray(logp), np_logp, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# Advantages.


def _reward_matrix(R):
  rng = np.random.default_rng(R)
  G, n_groups = 4, 5
  r = rng.normal(size=(G * n_groups, R))
  r[4:8] = r[4]                 # group 1: constant reward in every component
  r[9, 0] = np.nan              # group 2: one component missing for one row
  r[13, :] = np.nan             # group 3: one row missing entirely
  r[16:19, :] = np.nan          # group 4: a single present row
  return r, G


@pytest.mark.parametrize("R,scale,aggregation", list(itertools.product(
    [1, 3], grpo.SCALE_REWARDS, grpo.REWARD_AGGREGATIONS)))
def test_group_advantages_match_numpy(R, scale, aggregation):
  rewards, G = _reward_matrix(R)
  weights = np.array([1.0, 0.5, 2.0][:R])
  adv, stats = grpo.group_advantages(rewards, G, weights_R=weights, scale_rewards=scale,
                                     aggregation=aggregation, eps=1e-4)
  np_adv, signal = np_advantages(rewards, G, weights, scale, aggregation, 1e-4)
  np.testing.assert_allclose(np.asarray(adv), np_adv, rtol=1e-5, atol=1e-5)
  # Groups with no spread in the (pre-batch-normalisation) signal: group 1 and the lone row.
  present = [~np.all(np.isnan(rewards[g * G:(g + 1) * G]), -1) for g in range(5)]
  zero = [np.std(signal[g * G:(g + 1) * G][present[g]]) < 1e-6 for g in range(5)]
  assert zero == [False, True, False, False, True]
  assert float(stats["frac_reward_zero_std"]) == pytest.approx(0.4)
  missing = np.all(np.isnan(rewards), -1)  # rows 13, 16-18, and row 9 when R = 1
  assert missing.sum() == (5 if R == 1 else 4) and np.all(np.asarray(adv)[missing] == 0)
  assert float(stats["frac_reward_missing"]) == pytest.approx(missing.mean())


@pytest.mark.parametrize("R,aggregation", list(itertools.product([1, 3],
                                                                  grpo.REWARD_AGGREGATIONS)))
def test_informative_groups_are_those_with_a_signal(R, aggregation):
  rewards, G = _reward_matrix(R)
  weights = np.array([1.0, 0.5, 2.0][:R])
  got = np.asarray(grpo.informative_groups(rewards, G, weights, aggregation))
  # NumPy: a group informs when its present rows' weighted totals (sum_then_normalize) or any
  # one component (normalize_then_sum) differ.
  expected = []
  for g in range(5):
    block = rewards[g * G:(g + 1) * G]
    present = ~np.all(np.isnan(block), -1)
    if aggregation == "sum_then_normalize":
      signals = [filled_totals(block, G, weights)[present]]
    else:
      signals = [col[~np.isnan(col)] for col in block.T]
    expected.append(any(len(x) > 1 and np.ptp(x) > 1e-6 for x in signals))
  assert got.tolist() == expected and expected == [True, False, True, True, False]
  # With group scaling, a group informs exactly when some advantage in it is non-zero.
  if aggregation == "sum_then_normalize":
    adv, _ = grpo.group_advantages(rewards, G, weights_R=weights, aggregation=aggregation)
    assert [bool(np.any(np.asarray(adv)[g * G:(g + 1) * G] != 0)) for g in range(5)] == expected


def test_a_missing_component_is_neutral_within_its_group():
  """Rewards (math, judge), weights (1, 2), the judge missing for the one right answer. By hand,
  the missing judge filled with its group's mean (0.9): totals [2.8, 1.8, 1.8, 1.8], mean 2.05,
  deviations [0.75, -0.25 x3], std (ddof 1) sqrt(0.75 / 3) = 0.5: advantages [1.5, -0.5 x3].
  Counted as 0 (TRL's nansum) the totals were [1.0, 1.8, 1.8, 1.8]: the right answer got -1.5."""
  rewards = np.array([[1.0, np.nan], [0.0, 0.9], [0.0, 0.9], [0.0, 0.9]])
  adv, stats = grpo.group_advantages(rewards, 4, weights_R=np.array([1.0, 2.0]), eps=0.0)
  np.testing.assert_allclose(np.asarray(adv), [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
  assert float(stats["frac_reward_missing"]) == 0.0
  # Two right answers, one judged 0.8 and one missing (filled with the group's 0.6667): ranked
  # above the wrong ones and near the other right one, not level with the wrong answers.
  adv, _ = grpo.group_advantages(np.array([[1, .8], [1, np.nan], [0, .6], [0, .6]]), 4, eps=0.0)
  totals = np.array([1.8, 1 + 2 / 3, 0.6, 0.6])
  np.testing.assert_allclose(np.asarray(adv), (totals - totals.mean()) / totals.std(ddof=1),
                             rtol=1e-5)


def test_group_advantages_worked_example():
  adv, stats = grpo.group_advantages(np.array([[1.0], [0.0], [np.nan], [1.0]]), 2, eps=0.0)
  # ddof=1: std of {1, 0} is sqrt(1/2); the lone present row in group 2 has no spread → 0.
  np.testing.assert_allclose(np.asarray(adv), [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5), 0, 0],
                             rtol=1e-6)
  assert float(stats["frac_reward_zero_std"]) == 0.5


@pytest.mark.parametrize("scale", grpo.SCALE_REWARDS)
def test_constant_group_has_exactly_zero_advantage_and_policy_gradient(scale):
  rng = np.random.default_rng(1)
  rewards = rng.normal(size=(12, 1))
  rewards[3:6] = 0.1  # 0.1 + 0.1 + 0.1 != 0.3 in floating point: the mean must not round
  adv, _ = grpo.group_advantages(rewards, 3, scale_rewards=scale)
  assert np.all(np.asarray(adv[3:6]) == 0.0)
  cfg = config_lib.loss()
  logp = jnp.asarray(rng.normal(size=(12, 5)) - 2, jnp.float32)
  old = logp + jnp.asarray(rng.normal(scale=0.3, size=(12, 5)), jnp.float32)
  mask = jnp.ones((12, 5))
  turns = jnp.asarray(np.arange(5) // 2)[None, :].repeat(12, 0)  # flow_grpo: 3 turns a row
  for loss_type in grpo.LOSS_TYPES:
    cfg.loss_type = loss_type
    g = jax.grad(lambda lp: grpo.grpo_loss(lp, adv, mask, cfg, old_logp_BC=old,
                                           turn_ids_BC=turns, max_turns=3)[0])(logp)
    assert np.all(np.asarray(g[3:6]) == 0.0) and np.any(np.asarray(g) != 0.0)


def test_group_advantages_rejects_bad_shapes():
  with pytest.raises(ValueError, match="group_size=3"):
    grpo.group_advantages(np.zeros((8, 1)), 3)
  with pytest.raises(ValueError, match="scale_rewards='std'"):
    grpo.group_advantages(np.zeros((8, 1)), 4, scale_rewards="std")
  with pytest.raises(ValueError, match="reward_aggregation"):
    grpo.group_advantages(np.zeros((8, 1)), 4, aggregation="mean")
  with pytest.raises(ValueError, match="weights"):
    grpo.group_advantages(np.zeros((8, 2)), 4, weights_R=[1.0])


# ------------------------------------------------------------------------------------------------
# KL and the loss.


@pytest.mark.parametrize("estimator", grpo.KL_ESTIMATORS)
def test_kl_estimators_value_and_grad(estimator):
  rng = np.random.default_rng(2)
  logp, ref = rng.normal(size=(2, 10)) - 1
  kl = grpo.kl_estimate(jnp.asarray(logp), jnp.asarray(ref), estimator)
  np.testing.assert_allclose(np.asarray(kl), np_kl(logp, ref, estimator), rtol=1e-6, atol=1e-6)
  g = jax.grad(lambda lp: jnp.sum(grpo.kl_estimate(lp, jnp.asarray(ref), estimator)))(
      jnp.asarray(logp))
  fd = finite_diff_grad(lambda lp: np.sum(np_kl(lp, ref, estimator)), logp)
  np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-4, atol=1e-6)


def test_kl_estimators_expected_gradients_by_enumeration(capsys):
  """What each KL term's gradient pulls on, exactly: a 6-way policy softmax(θ), every token y
  weighted by π(y) (the samples are not differentiated), the term differentiated through log π(y).
  Against jax.grad of the exact divergences: k1 → 0, k2 → ∇KL(π‖ref), k3 → ∇KL(ref‖π)."""
  rng = np.random.default_rng(5)
  theta = jnp.asarray(rng.normal(size=6))
  ref = jax.nn.log_softmax(jnp.asarray(rng.normal(size=6)))

  def expected_grad(estimator):
    weights = jax.nn.softmax(theta)  # π(y), held fixed: the sampling distribution
    return jax.grad(lambda t: jnp.sum(weights * grpo.kl_estimate(jax.nn.log_softmax(t), ref,
                                                                estimator)))(theta)
  kl_pi_ref = lambda t: jnp.sum(jax.nn.softmax(t) * (jax.nn.log_softmax(t) - ref))
  kl_ref_pi = lambda t: jnp.sum(jnp.exp(ref) * (ref - jax.nn.log_softmax(t)))
  np.testing.assert_allclose(expected_grad("k1"), 0.0, atol=1e-7)
  np.testing.assert_allclose(expected_grad("k2"), jax.grad(kl_pi_ref)(theta), atol=1e-6)
  np.testing.assert_allclose(expected_grad("k3"), jax.grad(kl_ref_pi)(theta), atol=1e-6)
  assert np.abs(np.asarray(jax.grad(kl_pi_ref)(theta) - jax.grad(kl_ref_pi)(theta))).max() > 1e-2
  # k1 with a KL weight regularises nothing: the config check says so.
  cfg = config_lib.loss()
  cfg.update(kl_estimator="k1", beta=0.04)
  grpo.validate_loss_config(cfg)
  assert "kl_estimator='k1'" in capsys.readouterr().err
  cfg.beta = 0.0
  grpo.validate_loss_config(cfg)
  assert capsys.readouterr().err == ""


def _loss_case(seed=3, B=6, C=5):
  rng = np.random.default_rng(seed)
  logp = rng.normal(size=(B, C)) - 2.0
  old = logp + rng.normal(scale=0.4, size=(B, C))   # ratios spread over both clip edges
  ref = logp + rng.normal(scale=0.5, size=(B, C))
  adv = np.abs(rng.normal(size=B)) * np.resize([-1.0, 1.0, 1.0], B)  # both signs for both clips
  mask = (rng.random((B, C)) < 0.8).astype(np.float64)
  mask[2] = 0.0                                     # a fully masked row
  mask[0, 0] = 1.0
  return logp, old, ref, adv, mask


def _check_loss(cfg, case, gen_tokens=None):
  logp, old, ref, adv, mask = case
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  jloss = lambda lp: grpo.grpo_loss(lp, f32(adv), f32(mask), cfg, old_logp_BC=f32(old),
                                    ref_logp_BC=f32(ref), num_tokens=gen_tokens)
  (loss, metrics), g = jax.value_and_grad(jloss, has_aux=True)(f32(logp))
  np_value, np_metrics = np_loss(logp, old, ref, adv, mask, cfg, gen_tokens)
  np.testing.assert_allclose(float(loss), np_value, rtol=1e-5, atol=1e-6)
  for k, v in np_metrics.items():
    np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
  fd = finite_diff_grad(lambda lp: np_loss(lp, old, ref, adv, mask, cfg, gen_tokens)[0], logp)
  np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-4, atol=1e-6)
  return np_metrics


# flow_grpo (multi-turn rows) has its own NumPy reference in flow_grpo_test.py; cispo, sapo,
# luspo and vespo are checked against TRL's own code in grpo_trl_test.py.
@pytest.mark.parametrize("loss_type,level", list(itertools.product(
    ("grpo", "bnpo", "dr_grpo", "dapo"), grpo.IS_LEVELS)))
def test_loss_types_and_is_levels_match_numpy(loss_type, level):
  cfg = config_lib.loss()
  cfg.update(loss_type=loss_type, importance_sampling_level=level, beta=0.04, epsilon_high=0.28)
  case = _loss_case()
  metrics = _check_loss(cfg, case)
  if level == "token":  # the case must exercise both clip edges to test anything
    assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0


@pytest.mark.parametrize("estimator,delta", [("k1", None), ("k2", 1.5), ("k3", 1.5)])
def test_kl_estimators_and_delta_in_loss_match_numpy(estimator, delta):
  cfg = config_lib.loss()
  cfg.update(loss_type="grpo", beta=0.1, kl_estimator=estimator, delta=delta)
  case = _loss_case(seed=4)
  logp, old, _, adv, mask = case
  if delta is not None:  # the cap must bind on some token for this case to mean anything
    assert np.any((np.exp(logp - old) > delta) & (adv[:, None] < 0) & (mask > 0))
  _check_loss(cfg, case)


def test_dapo_uses_the_generation_batch_token_count():
  cfg = config_lib.loss()
  cfg.loss_type = "dapo"
  case = _loss_case(seed=5)
  _check_loss(cfg, case, gen_tokens=57.0)


def test_truncated_completions_are_masked_out():
  cfg = config_lib.loss()
  cfg.update(loss_type="bnpo", mask_truncated_completions=True)
  logp, old, ref, adv, mask = _loss_case(seed=6)
  truncated = np.array([0, 1, 0, 0, 1, 0], bool)
  m = grpo.loss_mask(mask, truncated, True)
  np.testing.assert_array_equal(np.asarray(m), mask * ~truncated[:, None])
  _check_loss(cfg, (logp, old, ref, adv, np.asarray(m)))
  np.testing.assert_array_equal(np.asarray(grpo.loss_mask(mask, truncated, False)), mask)
  with pytest.raises(ValueError, match="mask_truncated_completions"):
    grpo.loss_mask(mask, None, True)


@pytest.mark.parametrize("level", grpo.IS_LEVELS)
def test_on_policy_ratio_is_exactly_one_with_no_clipping(level):
  cfg = config_lib.loss()
  cfg.update(loss_type="grpo", importance_sampling_level=level)
  logp, _, _, adv, mask = _loss_case(seed=7)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  (loss, m), g = jax.value_and_grad(
      lambda lp: grpo.grpo_loss(lp, f32(adv), f32(mask), cfg), has_aux=True)(f32(logp))
  assert float(m["ratio/min"]) == 1.0 and float(m["ratio/max"]) == 1.0
  assert float(m["ratio/mean"]) == pytest.approx(1.0, abs=1e-6)
  assert float(m["clip/region_frac"]) == 0.0
  # The on-policy gradient is the old-fixed-at-current one: −A ∂(mean of ratios) at ratio 1.
  fd = finite_diff_grad(lambda lp: np_loss(lp, logp, logp, adv, mask, cfg)[0], logp)
  np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-4, atol=1e-6)


def test_beta_zero_needs_no_reference_and_positive_beta_requires_one():
  cfg = config_lib.loss()
  assert cfg.beta == 0 and not grpo.needs_reference(cfg)
  logp, old, _, adv, mask = _loss_case()
  loss, m = grpo.grpo_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), cfg,
                           old_logp_BC=jnp.asarray(old))
  assert float(m["loss/kl"]) == 0.0
  cfg.beta = 0.1
  assert grpo.needs_reference(cfg)
  with pytest.raises(ValueError, match="beta"):
    grpo.grpo_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask), cfg)


@pytest.mark.parametrize("name,value", [
    ("loss_type", "ppo"), ("kl_estimator", "k4"), ("importance_sampling_level", "chunk"),
    ("scale_rewards", "std"), ("reward_aggregation", "max"), ("beta", -0.1), ("epsilon", 1.5),
    ("epsilon_high", 0.0), ("delta", 1.1), ("num_iterations", 0)])
def test_bad_loss_config_names_the_setting(name, value):
  cfg = config_lib.loss()
  grpo.validate_loss_config(cfg)
  cfg[name] = value
  with pytest.raises(ValueError, match=f"loss.{name}="):
    grpo.validate_loss_config(cfg)


@pytest.mark.parametrize("changes,message", [
    (dict(entropy_coef_max=float("inf")), "loss.entropy_coef_max=inf must be a finite number"),
    (dict(entropy_coef_delta=0.0), "loss.entropy_coef_delta=0.0 must be a finite number > 0"),
    (dict(entropy_target=float("nan")), "loss.entropy_target=nan must be a finite number"),
    (dict(use_adaptive_entropy=True, entropy_coef=2.0),
     r"loss.entropy_coef=2.0 is the adaptive coefficient's start: it must lie in "
     r"\[loss.entropy_coef_min, loss.entropy_coef_max\] = \[0.0, 1.0\]")])
def test_bad_adaptive_entropy_settings_name_the_field(changes, message):
  cfg = config_lib.loss()
  cfg.update(**changes)
  with pytest.raises(ValueError, match=message):
    grpo.validate_loss_config(cfg)


def test_adaptive_entropy_controller_against_a_numpy_loop():
  """Skywork-OR1's rule as TRL writes it (grpo_trainer.py, _compute_loss: apply_coef, then the
  step's update), re-run in NumPy float64 on a sequence of entropies."""
  cfg = config_lib.loss()
  cfg.update(use_adaptive_entropy=True, entropy_coef=0.5, entropy_target=1.0,
             entropy_coef_delta=0.25, entropy_coef_min=0.1, entropy_coef_max=1.0)
  entropies = [0.5, 2.0, 2.0, 2.0, 0.9, 1.0, 0.2, 0.3, 3.0]
  coef, last, ctrl = 0.5, np.inf, grpo.adaptive_entropy_start(cfg)
  for h in entropies:
    np.testing.assert_allclose(float(grpo.adaptive_entropy_applied(ctrl, cfg)),
                               coef if last <= 1.0 else 0.0, rtol=1e-6)
    coef = min(coef + 0.25, 1.0) if h <= 1.0 else max(coef - 0.25, 0.1)
    last = h
    ctrl = grpo.adaptive_entropy_next(ctrl, h, cfg)
    np.testing.assert_allclose(float(ctrl["coef"]), coef, rtol=1e-6)
    assert float(ctrl["last"]) == np.float32(h)
