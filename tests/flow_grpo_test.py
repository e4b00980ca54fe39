"""loss.loss_type='flow_grpo' (AgentFlow's Flow-GRPO) against a NumPy implementation of its
objective, written from the paper's formula with loops over queries, trajectories, turns and
tokens (no masks, no turn-id arrays: each trajectory is a list of turns, each a list of token
columns); its gradient by central finite differences in float64; one turn per row against
loss_type='grpo'; and through the train step on a tiny Qwen (rollout layout with
loss_mask_BC / turn_ids_BC, one and two micro-batches, a hand-built train layout).

  J(θ) = 1/Q Σ_q 1/G Σ_i 1/T_i Σ_t 1/|a_t^i| Σ_j min(ρ A_i, clip(ρ, 1 − ε, 1 + ε_high) A_i)
         − β · (the same average of the per-token k3 KL),   loss = −J.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_test import finite_diff_grad
from grpo_jax import config as config_lib, grpo, sharding, train_step
from grpo_jax.models import qwen

EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.05

# ------------------------------------------------------------------------------------------------
# Hand-built multi-turn trajectories: ('a', n) an action of n tokens, ('o', n) an observation.

G, C = 3, 12
ROWS = [
    # query 0: 1, 2 and 3 turns, actions of different lengths, padding
    [("a", 3)],
    [("a", 2), ("o", 3), ("a", 4)],
    [("a", 1), ("o", 2), ("a", 3), ("o", 1), ("a", 2)],
    # query 1: rewards all equal (advantages 0)
    [("a", 5), ("o", 2), ("a", 2)],
    [("a", 4)],
    [("a", 2), ("o", 1), ("a", 1), ("o", 2), ("a", 3)],
    # query 2: a full-width row (no padding), a row with no action token at all, 3 short turns
    [("a", 6), ("o", 4), ("a", 2)],
    [("o", 4)],
    [("a", 2), ("o", 2), ("a", 2), ("o", 2), ("a", 2), ("o", 2)],
]
REWARDS = np.array([1.0, 0.0, 0.5, 0.3, 0.3, 0.3, 0.0, 1.0, 0.2])


def turns_of(spec):
  """The trajectory as a list of turns, each the list of its action tokens' columns."""
  turns, col = [], 0
  for kind, n in spec:
    if kind == "a":
      turns.append(list(range(col, col + n)))
    col += n
  return turns


def arrays_of(rows, width, rng):
  """mask_BC (1 on action tokens), turn_ids_BC (0-based action index; random garbage, out of
  range included, on observations and padding: never read), lengths_B (real tokens)."""
  mask = np.zeros((len(rows), width), np.float32)
  turn_ids = rng.integers(-3, 50, (len(rows), width)).astype(np.int32)
  lengths = np.zeros(len(rows), np.int32)
  for b, spec in enumerate(rows):
    for t, cols in enumerate(turns_of(spec)):
      mask[b, cols] = 1.0
      turn_ids[b, cols] = t
    lengths[b] = sum(n for _, n in spec)
  return mask, turn_ids, lengths


def np_advantages(rewards, group):
  """(R − mean) / (std + 1e-4) per query, std with ddof = 1 (grpo.group_advantages' choice)."""
  adv = np.zeros(len(rewards))
  for q in range(len(rewards) // group):
    r = rewards[q * group:(q + 1) * group]
    std = np.sqrt(sum((x - np.mean(r)) ** 2 for x in r) / (group - 1))
    for i in range(group):
      adv[q * group + i] = 0.0 if std == 0 else (r[i] - np.mean(r)) / (std + 1e-4)
  return adv


def np_flow_loss(logp, old, ref, rewards, rows, group, beta=BETA, eps=EPS, eps_high=EPS_HIGH):
  """−J of the module docstring; returns (loss, policy part −J_π, KL part)."""
  adv = np_advantages(rewards, group)
  n_queries = len(rows) // group
  policy = kl = 0.0
  for q in range(n_queries):
    j_q = kl_q = 0.0
    for i in range(q * group, (q + 1) * group):
      turns = turns_of(rows[i])
      if not turns:  # nothing to learn from: no action token
        continue
      for cols in turns:
        for j in cols:
          rho = np.exp(logp[i, j] - old[i, j])
          clipped = min(max(rho, 1 - eps), 1 + eps_high)
          term = min(rho * adv[i], clipped * adv[i])
          log_r = ref[i, j] - logp[i, j]
          k3 = np.exp(log_r) - 1 - log_r
          j_q += term / (group * len(turns) * len(cols))
          kl_q += k3 / (group * len(turns) * len(cols))
    policy += j_q / n_queries
    kl += kl_q / n_queries
  return -policy + beta * kl, -policy, kl


def flow_config(**kw):
  cfg = config_lib.loss()
  cfg.update(loss_type="flow_grpo", beta=BETA, kl_estimator="k3", epsilon=EPS,
             epsilon_high=EPS_HIGH)
  cfg.update(**kw)
  return cfg


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  mask, turn_ids, _ = arrays_of(ROWS, C, rng)
  logp = rng.normal(size=(len(ROWS), C)) - 2.0
  # Old log-ratios over both clip edges, >= 0.03 from them (finite differences never cross a
  # kink). Off the action tokens: wild values, which must not leak into the loss.
  delta = rng.uniform(-0.6, 0.6, logp.shape)
  for edge in (np.log(1 - EPS), np.log(1 + EPS_HIGH)):
    near = np.abs(delta - edge) < 0.03
    delta[near] += 0.06 * np.sign(delta[near] - edge + 1e-12)
  delta[mask == 0] = rng.choice([-30.0, 30.0], int((mask == 0).sum()))
  old = logp - delta
  ref = logp + rng.normal(scale=0.5, size=logp.shape)
  ref[mask == 0] += 40.0
  return logp, old, ref, mask, turn_ids


def jax_loss(cfg, logp, old, ref, mask, turn_ids, rewards=REWARDS, group=G, max_turns=4):
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  adv, _ = grpo.group_advantages(rewards, group)
  fn = lambda lp: grpo.grpo_loss(lp, adv, f32(mask), cfg, old_logp_BC=f32(old),
                                 ref_logp_BC=f32(ref), turn_ids_BC=jnp.asarray(turn_ids),
                                 max_turns=max_turns)
  (loss, metrics), g = jax.value_and_grad(fn, has_aux=True)(f32(logp))
  return float(loss), jax.tree.map(float, metrics), np.asarray(g, np.float64)


def test_flow_grpo_value_and_gradient_match_numpy(case):
  logp, old, ref, mask, turn_ids = case
  cfg = flow_config()
  loss, metrics, g = jax_loss(cfg, logp, old, ref, mask, turn_ids)
  want, want_policy, want_kl = np_flow_loss(logp, old, ref, REWARDS, ROWS, G)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["loss/policy"], want_policy, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["loss/kl"], want_kl, rtol=1e-5, atol=1e-6)
  x = ref - logp  # `kl`: k3 per action token, not weighted per turn
  np.testing.assert_allclose(metrics["kl"], (np.exp(x) - 1 - x)[mask > 0].mean(), rtol=1e-5)
  fd = finite_diff_grad(lambda lp: np_flow_loss(lp, old, ref, REWARDS, ROWS, G)[0], logp)
  np.testing.assert_allclose(g, fd, rtol=1e-4, atol=1e-6)
  # The case means something: both clip edges bind, the KL is on, observations carry nothing.
  assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0 and want_kl > 0
  assert np.all(g[mask == 0] == 0.0) and np.all(g[mask > 0] != 0.0)


def test_constant_reward_group_gets_only_the_kl_gradient(case):
  logp, old, ref, mask, turn_ids = case
  _, _, g = jax_loss(flow_config(beta=0.0), logp, old, ref, mask, turn_ids)
  assert np.all(g[3:6] == 0.0)  # query 1: advantages exactly 0
  assert np.any(g[:3] != 0.0) and np.any(g[6:] != 0.0)  # the other queries still learn
  # With β > 0 those rows get the KL's gradient alone: β · ∂KL, weighted per turn.
  _, _, g_kl = jax_loss(flow_config(beta=BETA), logp, old, ref, mask, turn_ids)
  fd = finite_diff_grad(lambda lp: BETA * np_flow_loss(lp, old, ref, REWARDS, ROWS, G)[2],
                        logp)
  np.testing.assert_allclose(g_kl[3:6], fd[3:6], rtol=1e-4, atol=1e-7)


def test_weights_worked_example_and_turn_labels_are_just_labels():
  mask = jnp.asarray([[1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 0]], jnp.float32)
  turns = jnp.asarray([[0, 0, 7, 1, 1, 1], [0, 0, 0, 0, 0, 0], [2, 9, 0, 0, -1, 5]])
  w = np.asarray(grpo.token_weights(mask, "flow_grpo", num_sequences=3, num_tokens=None,
                                    turn_ids_BC=turns, max_turns=3))
  np.testing.assert_allclose(w, np.array([[1 / 4, 1 / 4, 0, 1 / 6, 1 / 6, 1 / 6],
                                          [0] * 6,
                                          [1 / 2, 0, 1 / 4, 1 / 4, 0, 0]]) / 3, rtol=1e-6)
  # Any injective relabelling of the turns (gaps included) gives the same weights.
  relabel = jnp.asarray([4, 0, 2, 5, 1, 3])
  w2 = grpo.token_weights(mask, "flow_grpo", num_sequences=3, num_tokens=None,
                          turn_ids_BC=relabel[jnp.clip(turns, 0, 5)], max_turns=6)
  np.testing.assert_allclose(np.asarray(w2), w, rtol=1e-6)


@pytest.mark.parametrize("level", grpo.IS_LEVELS)
def test_single_turn_rows_equal_grpo(level):
  """1/T = 1 and 1/|a| = 1/len: flow_grpo with one turn per row is loss_type='grpo'."""
  rng = np.random.default_rng(1)
  B, width = 6, 7
  logp = rng.normal(size=(B, width)) - 2.0
  old = logp + rng.normal(scale=0.4, size=(B, width))
  ref = logp + rng.normal(scale=0.5, size=(B, width))
  mask = (rng.random((B, width)) < 0.8).astype(np.float32)
  mask[2] = 0.0
  turn_ids = np.repeat(rng.integers(0, 3, (B, 1)), width, 1)  # one turn, any label, per row
  rewards = rng.normal(size=B)
  cfg = flow_config(importance_sampling_level=level)
  got = jax_loss(cfg, logp, old, ref, mask, turn_ids, rewards=rewards, group=3, max_turns=3)
  cfg.loss_type = "grpo"
  want = jax_loss(cfg, logp, old, ref, mask, turn_ids, rewards=rewards, group=3)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for k, v in want[1].items():
    np.testing.assert_allclose(got[1][k], v, rtol=1e-6, err_msg=k)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-9)
  assert np.any(got[2] != 0)


def test_flow_grpo_needs_turn_ids_and_rejects_out_of_range_ones(case):
  logp, old, ref, mask, turn_ids = case
  with pytest.raises(ValueError, match="flow_grpo.*turn_ids_BC"):
    grpo.token_weights(jnp.asarray(mask), "flow_grpo", num_sequences=9, num_tokens=1.0)
  with pytest.raises(ValueError, match="max_turns"):
    grpo.token_weights(jnp.asarray(mask), "flow_grpo", num_sequences=9, num_tokens=1.0,
                       turn_ids_BC=turn_ids, max_turns=None)
  # A loss token whose turn is past the bound: NaN (the step is skipped), never a silent merge.
  assert np.isnan(jax_loss(flow_config(), logp, old, ref, mask, turn_ids, max_turns=2)[0])
  # The other loss types ignore turn ids.
  cfg = flow_config(loss_type="grpo")
  assert np.isfinite(jax_loss(cfg, logp, old, ref, mask, turn_ids, max_turns=2)[0])


# ------------------------------------------------------------------------------------------------
# Through the train step.

MODEL = qwen.QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0,
                        tie_word_embeddings=True, qkv_bias=True)
EOS, P, TG, MAX_TURNS = MODEL.vocab_size - 1, 5, 4, 4
STEP_ROWS = [  # two queries × 4 trajectories; completion width C = 12
    [("a", 3)],
    [("a", 2), ("o", 3), ("a", 4)],
    [("a", 1), ("o", 2), ("a", 3), ("o", 1), ("a", 2)],
    [("a", 5), ("o", 4), ("a", 3)],
    [("a", 4), ("o", 2), ("a", 1)],
    [("a", 2), ("o", 1), ("a", 1), ("o", 2), ("a", 3), ("o", 1), ("a", 1)],
    [("a", 6)],
    [("a", 2), ("o", 5), ("a", 2)],
]


def step_optim(accum):
  cfg = config_lib.optim()
  # max_grad_norm=0: AdamW's first moment after one step is (1 − b1)·grad (train_step_test).
  cfg.update(lr=1e-3, max_grad_norm=0.0, grad_accum_steps=accum, compute_dtype="float32")
  return cfg


def first_moment(state):
  return [s.mu for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda s: hasattr(s, "mu"))
          if hasattr(s, "mu")][0]


@pytest.fixture(scope="module")
def step_case():
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda x: x * 5.0 if x.ndim >= 2 else x,
                        qwen.init_params(MODEL, jax.random.key(0)))
  B = len(STEP_ROWS)
  mask, turn_ids, lengths = arrays_of(STEP_ROWS, C, rng)
  prompt = np.zeros((B // TG, P), np.int32)
  pmask = np.zeros((B // TG, P), np.int32)
  for q, n in enumerate((3, 5)):
    prompt[q, P - n:] = rng.integers(1, EOS, n)
    pmask[q, P - n:] = 1
  completion = np.zeros((B, C), np.int32)
  for b in range(B):
    completion[b, :lengths[b]] = rng.integers(1, EOS, lengths[b])
    if lengths[b] < C:
      completion[b, lengths[b] - 1] = EOS
  # loss_mask_BC: the action tokens, and (rows 0, 6) 1 on padding too: the length mask drops it.
  loss_mask = mask.astype(np.int32)
  for b in (0, 6):
    loss_mask[b, lengths[b]:] = 1
  rollout = dict(prompt_NP=prompt, prompt_mask_NP=pmask,
                 completion_BC=completion, lengths_B=lengths,
                 rewards_BR=rng.normal(size=(B, 1)).astype(np.float32),
                 loss_mask_BC=loss_mask, turn_ids_BC=turn_ids)
  real = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
  adv, _ = grpo.group_advantages(rollout["rewards_BR"], TG)
  train = dict(tokens_BS=np.concatenate([np.repeat(prompt, TG, 0), completion], 1),
               attn_mask_BS=np.concatenate([np.repeat(pmask, TG, 0), real], 1),  # obs too
               completion_mask_BC=mask.astype(np.int32),
               advantages_B=np.asarray(adv, np.float32), turn_ids_BC=turn_ids)
  return params, rollout, train, mask


def run_step(params, batch, accum, mesh_shape=(1, 1, 1), ref_scale=0.9):
  optim, mesh = step_optim(accum), sharding.make_mesh(mesh_shape)
  step = train_step.make_train_step(MODEL, flow_config(), optim, mesh, group_size=TG,
                                    reward_weights=(1.0,), max_turns=MAX_TURNS)
  state = train_step.create_train_state(params, MODEL, optim, mesh)
  ref = jax.tree.map(lambda x: x * ref_scale, state["params"])
  state, metrics, adv = step(state, batch, ref)
  host = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)
  return host(metrics), host(first_moment(state)), np.asarray(adv)


def dense_logprobs(params, tokens, attn):
  model = qwen.Qwen(MODEL)
  hidden, _ = model.apply({"params": params}, tokens, qwen.positions_from_mask(attn), attn)
  logits = np.asarray(model.apply({"params": params}, hidden, method=qwen.Qwen.logits),
                      np.float64)[:, P - 1:-1]
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return np.take_along_axis(logits, tokens[:, P:, None], -1)[..., 0] - lse


def assert_same(got, want, tol=1e-5):
  (m1, mu1, _), (m2, mu2, _) = got, want
  for k in ("loss", "loss/policy", "loss/kl", "tokens/completion", "entropy", "grad_norm"):
    np.testing.assert_allclose(m1[k], m2[k], rtol=tol, atol=1e-7, err_msg=k)
  scale = max(np.abs(x).max() for x in jax.tree.leaves(mu2))
  for x, y in zip(jax.tree.leaves(mu1), jax.tree.leaves(mu2)):
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol * scale)


def test_train_step_rollout_layout_micro_batching_and_train_layout_agree(step_case):
  params, rollout, train, mask = step_case
  one = run_step(params, rollout, accum=1)
  two = run_step(params, rollout, accum=2, mesh_shape=(2, 1, 1))  # 2 rows of a group share
  assert one[0]["step/skipped"] == 0 and one[0]["loss/kl"] > 0
  assert one[0]["tokens/completion"] == mask.sum()
  assert_same(two, one)
  by_hand = run_step(params, train, accum=1)
  np.testing.assert_allclose(by_hand[2], one[2], rtol=1e-6)
  assert_same(by_hand, one)
  # The loss is the formula's on the model's own log-probs (μ = 1: ratio 1, old = current);
  # the dense forward attends to the observation tokens.
  logp = dense_logprobs(params, train["tokens_BS"], train["attn_mask_BS"])
  ref_params = jax.tree.map(lambda x: x * 0.9, params)
  ref = dense_logprobs(ref_params, train["tokens_BS"], train["attn_mask_BS"])
  want, want_policy, want_kl = np_flow_loss(logp, logp, ref, rollout["rewards_BR"][:, 0],
                                            STEP_ROWS, TG)
  np.testing.assert_allclose(one[0]["loss/kl"], want_kl, rtol=1e-5)
  np.testing.assert_allclose(one[0]["loss"], want, rtol=1e-5, atol=1e-7)
  # Observations are attended to: masking them out of attention changes the step.
  blind = dict(train, attn_mask_BS=np.concatenate(
      [train["attn_mask_BS"][:, :P], train["completion_mask_BC"]], 1))
  assert abs(run_step(params, blind, accum=1)[0]["loss/kl"] - one[0]["loss/kl"]) > 1e-4


def test_train_step_flow_grpo_errors(step_case):
  params, rollout, train, _ = step_case
  optim, mesh = step_optim(1), sharding.make_mesh((1, 1, 1))
  with pytest.raises(ValueError, match="max_turns"):
    train_step.TrainStep(MODEL, flow_config(), optim, mesh, group_size=TG)
  check = lambda batch, **kw: train_step.check_batch(
      batch, flow_config(), optim, mesh, has_ref_params=True, group_size=TG, **kw)
  for batch in (rollout, train):
    check(batch, max_turns=MAX_TURNS)
    with pytest.raises(ValueError, match=r"loss.loss_type='flow_grpo'.*batch\['turn_ids_BC'\]"):
      check({k: v for k, v in batch.items() if k != "turn_ids_BC"})
    with pytest.raises(ValueError, match=r"turn_ids_BC.*outside \[0, max_turns=2\)"):
      check(batch, max_turns=2)
    with pytest.raises(ValueError, match="turn_ids_BC.*shape"):
      check(dict(batch, turn_ids_BC=batch["turn_ids_BC"][:, 1:]))
  with pytest.raises(ValueError, match="loss_mask_BC.*shape"):
    check(dict(rollout, loss_mask_BC=rollout["loss_mask_BC"][:, 1:]))
  with pytest.raises(ValueError, match="unknown"):  # the train layout's loss mask is its own
    check(dict(train, loss_mask_BC=rollout["loss_mask_BC"]))
