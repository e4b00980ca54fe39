"""The sharded GRPO train step on a tiny Qwen: finite differences of the whole loss, sharded
meshes against one device, gradient accumulation against one big batch, dense log-probs, and a
failed step leaving the state alone. Compilations are the cost here, so one baseline config is
shared and each test compiles at most two programs."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import config as config_lib, grpo, members, sharding, train_step
from grpo_jax.models import qwen

MODEL = qwen.QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0,
                        tie_word_embeddings=True, qkv_bias=True)
B, P, C, G = 32, 6, 8, 4
EOS = MODEL.vocab_size - 1
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring


def loss_config(**kw):
  cfg = config_lib.loss()
  cfg.update(loss_type="dapo", beta=0.05, kl_estimator="k3", epsilon_high=0.28,
             num_iterations=1, mask_truncated_completions=True)
  cfg.update(**kw)
  return cfg


def optim_config(**kw):
  cfg = config_lib.optim()
  # max_grad_norm=0: AdamW's first moment after one step is exactly (1 − b1)·grad, which is how
  # these tests read the step's gradients back without compiling a second program.
  cfg.update(lr=1e-3, weight_decay=0.1, max_grad_norm=0.0, grad_accum_steps=4,
             compute_dtype="float32", remat=True)
  cfg.update(**kw)
  return cfg


def single_mesh():
  return sharding.make_mesh((1, 1, 1))


def host(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def first_moment(state):
  """mu of AdamW inside the (adamw) state; the chain holds one ScaleByAdamState."""
  found = [s.mu for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda s: hasattr(s, "mu"))
           if hasattr(s, "mu")]
  assert len(found) == 1
  return found[0]


@pytest.fixture(scope="module")
def params():
  rng = np.random.default_rng(5)

  def one(path, x):
    name = path[-1].key
    if name in ("kernel", "embedding"):  # std 0.1: logits far from uniform, loss not ~linear
      return np.asarray(x) * 5.0
    if name == "bias":                   # random, so a mishandled bias cannot hide
      return rng.normal(0, 0.1, x.shape).astype(np.float32)
    return rng.uniform(0.5, 1.5, x.shape).astype(np.float32)  # norm weights
  return jax.tree_util.tree_map_with_path(one, qwen.init_params(MODEL, jax.random.key(0)))


def make_rows(rng):
  """Left-padded prompts and right-padded completions; rows of length C without EOS truncated."""
  tokens = np.zeros((B, P + C), np.int32)
  attn = np.zeros((B, P + C), np.int32)
  cmask = np.zeros((B, C), np.int32)
  plen = rng.integers(2, P + 1, B)
  clen = rng.integers(1, C + 1, B)
  truncated = rng.random(B) < 0.25
  clen[truncated] = C
  for b in range(B):
    tokens[b, P - plen[b]:P] = rng.integers(1, EOS, plen[b])
    tokens[b, P:P + clen[b]] = rng.integers(1, EOS, clen[b])
    if not truncated[b]:
      tokens[b, P + clen[b] - 1] = EOS
    attn[b, P - plen[b]:P + clen[b]] = 1
    cmask[b, :clen[b]] = 1
  return tokens, attn, cmask, truncated


@pytest.fixture(scope="module")
def data(params):
  """A baseline batch; old/ref log-probs from logprob_fn on a (2, 2, 2) mesh, 4 micro-batches."""
  rng = np.random.default_rng(0)
  tokens, attn, cmask, truncated = make_rows(rng)
  rewards = rng.normal(size=(B, 1))
  rewards[4:8] = 1.0  # a constant-reward group
  adv, _ = grpo.group_advantages(rewards, G)
  mesh = sharding.make_mesh((2, 2, 2))
  logprob_fn = train_step.make_logprob_fn(MODEL, optim_config(), mesh)
  sh = train_step.state_shardings(MODEL, optim_config(), mesh)["params"]
  logp = np.asarray(logprob_fn(jax.device_put(params, sh), tokens, attn, C), np.float64)
  # Old log-ratios spread over both clip edges but >= 0.03 from them, so that the finite
  # differences below (which move log-probs by ~1e-4) never step across a kink.
  delta = rng.uniform(-0.5, 0.5, (B, C))
  for edge in (np.log(0.8), np.log(1.28)):
    near = np.abs(delta - edge) < 0.03
    delta[near] += 0.06 * np.sign(delta[near] - edge + 1e-12)
  batch = dict(tokens_BS=tokens, attn_mask_BS=attn, completion_mask_BC=cmask,
               advantages_B=np.asarray(adv, np.float32),
               old_logp_BC=(logp - delta).astype(np.float32),
               ref_logp_BC=(logp + rng.normal(scale=0.3, size=(B, C))).astype(np.float32),
               truncated_B=truncated)
  return batch, logp


def dense_logprobs(params, tokens, attn, valid=MODEL.vocab_size):
  """Completion log-probs from the model's dense logits (first `valid` rows), in float64."""
  model = qwen.Qwen(MODEL)
  hidden, _ = model.apply({"params": params}, tokens, qwen.positions_from_mask(attn), attn)
  logits = np.asarray(model.apply({"params": params}, hidden, method=qwen.Qwen.logits),
                      np.float64)[:, P - 1:-1, :valid]
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return np.take_along_axis(logits, tokens[:, P:, None], -1)[..., 0] - lse


def test_logprob_fn_matches_dense_logits(params, data):
  """Chunked, micro-batched, sharded log-probs == log_softmax of the model's dense logits."""
  batch, logp = data
  want = dense_logprobs(params, batch["tokens_BS"], batch["attn_mask_BS"])
  mask = batch["completion_mask_BC"] > 0
  np.testing.assert_allclose(logp[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_valid_vocab_size_restricts_the_softmax(params, data):
  """With valid_vocab_size=V', log-probs are those of softmax over the first V' rows only (the
  distribution the sampler draws from when the embedding has rows past the tokenizer)."""
  batch, _ = data
  valid = MODEL.vocab_size - 10  # EOS (vocab - 1) is past it; remap those targets
  tokens = np.where(batch["tokens_BS"] >= valid, 1, batch["tokens_BS"])
  attn = batch["attn_mask_BS"]
  mesh = single_mesh()
  optim = optim_config(grad_accum_steps=1)
  fn = train_step.make_logprob_fn(MODEL, optim, mesh, valid_vocab_size=valid)
  got = np.asarray(fn(jax.device_put(params, train_step.state_shardings(MODEL, optim, mesh)[
      "params"]), tokens, attn, C))
  want = dense_logprobs(params, tokens, attn, valid)
  mask = batch["completion_mask_BC"] > 0
  np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_bf16_compute_log_probs_stay_fp32_and_close(params, data):
  batch, logp = data
  optim = optim_config(compute_dtype="bfloat16", grad_accum_steps=1)
  mesh = single_mesh()
  fn = train_step.make_logprob_fn(MODEL, optim, mesh)
  out = fn(jax.device_put(params, train_step.state_shardings(MODEL, optim, mesh)["params"]),
           batch["tokens_BS"], batch["attn_mask_BS"], C)
  assert out.dtype == jnp.float32
  mask = batch["completion_mask_BC"] > 0
  err = np.abs(np.asarray(out) - logp)[mask]
  # bf16 keeps 8 mantissa bits (relative 2^-9 per rounding); over two layers and a 64-way
  # softmax that is ~1e-2 in a log-prob of magnitude ~5. A wrong dtype path is off by O(1).
  assert err.mean() < 0.03 and err.max() < 0.15, (err.mean(), err.max())


@pytest.fixture(scope="module")
def grad_fn(data):
  """(params) → (loss, grads) of the baseline config on one device (dapo, 4 micro-batches)."""
  batch, _ = data
  mesh = single_mesh()
  fn = train_step.make_grad_fn(MODEL, loss_config(), optim_config(), mesh, batch)
  sh = train_step.state_shardings(MODEL, optim_config(), mesh)["params"]
  return lambda p: fn(jax.device_put(p, sh), batch)


def test_gradient_of_whole_loss_matches_finite_differences(params, grad_fn):
  loss_at = lambda p: float(grad_fn(p)[0])
  grads = host(grad_fn(params)[1])
  rng = np.random.default_rng(1)
  leaves = [("embed_tokens", "embedding"), ("layers", "self_attn", "q_proj", "bias"),
            ("layers", "mlp", "down_proj", "kernel"), ("norm", "weight"), None]
  for leaf in leaves:
    # Direction: the gradient, reweighted per coordinate at random (on one leaf, or all), so a
    # wrong sign or size anywhere changes <g, v>; unit norm.
    v = jax.tree.map(lambda g: g * rng.uniform(0.5, 1.5, g.shape) * (leaf is None), grads)
    if leaf is not None:
      node_g, node_v = grads, v
      for k in leaf[:-1]:
        node_g, node_v = node_g[k], node_v[k]
      node_v[leaf[-1]] = node_g[leaf[-1]] * rng.uniform(0.5, 1.5, node_g[leaf[-1]].shape)
    norm = np.sqrt(sum(np.sum(x * x) for x in jax.tree.leaves(v)))
    v = jax.tree.map(lambda x: x / norm, v)

    def central(h):
      plus = jax.tree.map(lambda p, d: (p + h * d).astype(np.float32), params, v)
      minus = jax.tree.map(lambda p, d: (p - h * d).astype(np.float32), params, v)
      return (loss_at(plus) - loss_at(minus)) / (2 * h)
    fd = (4 * central(5e-3) - central(1e-2)) / 3  # Richardson: cancels the h² term
    analytic = sum(np.sum(g * d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(v)))
    assert analytic > 1e-3, leaf  # the direction must carry signal for the check to bite
    # atol: the fp32 loss carries ~1e-7 rounding; over 2h = 1e-2 and Richardson's (4 + 1) / 3
    # that is ~2e-5 in a derivative. A gradient off by 0.1 % fails on the full direction.
    np.testing.assert_allclose(fd, analytic, rtol=1e-4, atol=5e-5, err_msg=str(leaf))


@pytest.fixture(scope="module")
def baseline(params, data):
  """One step on one device with the baseline config (dapo, 4 micro-batches, β > 0, given old
  log-probs, so ratios spread over both clip edges)."""
  batch, _ = data
  mesh = single_mesh()
  step = train_step.make_train_step(MODEL, loss_config(), optim_config(), mesh)
  state = train_step.create_train_state(params, MODEL, optim_config(), mesh)
  state, metrics, _ = step(state, batch)
  return step, host(state), host(metrics)


def assert_same_step(got_state, got_metrics, want_state, want_metrics, tol=1e-5):
  """Metrics and params to tol; gradients (read from AdamW's mu) to tol of their own scale."""
  for k, v in want_metrics.items():
    np.testing.assert_allclose(got_metrics[k], v, rtol=tol, atol=tol, err_msg=k)
  want_mu = first_moment(want_state)
  mu_scale = max(np.abs(x).max() for x in jax.tree.leaves(want_mu))
  for name, a, b, atol in [("grads", first_moment(got_state), want_mu, tol * mu_scale),
                           ("params", got_state["params"], want_state["params"], tol)]:
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(x, y, rtol=tol, atol=atol,
                                 err_msg=name + jax.tree_util.keystr(path))
  assert got_state["step"] == want_state["step"] == 1


def test_baseline_step_is_sane(baseline, data):
  _, state, metrics = baseline
  batch, _ = data
  assert metrics["step/skipped"] == 0
  mask = grpo.loss_mask(batch["completion_mask_BC"], batch["truncated_B"], True)
  assert metrics["tokens/completion"] == float(np.asarray(mask).sum())
  assert metrics["clip/low_frac"] > 0 and metrics["clip/high_frac"] > 0
  assert metrics["loss/kl"] > 0
  np.testing.assert_allclose(metrics["loss"], metrics["loss/policy"] + 0.05 * metrics["loss/kl"],
                             rtol=1e-6)
  # `kl`: k3 averaged over the loss tokens of all four micro-batches.
  x = batch["ref_logp_BC"] - data[1]
  on = np.asarray(mask) > 0
  np.testing.assert_allclose(metrics["kl"], (np.exp(x) - 1 - x)[on].mean(), rtol=1e-5)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (2, 2, 2)])
def test_sharded_step_matches_single_device(params, data, baseline, shape):
  batch, _ = data
  mesh = sharding.make_mesh(shape)
  step = train_step.make_train_step(MODEL, loss_config(), optim_config(), mesh)
  state = train_step.create_train_state(params, MODEL, optim_config(), mesh)
  state, metrics, _ = step(state, batch)
  assert state["params"]["layers"]["mlp"]["up_proj"]["kernel"].sharding.mesh.shape == mesh.shape
  _, want_state, want_metrics = baseline
  assert_same_step(host(state), host(metrics), want_state, want_metrics)


def test_step_gradients_are_the_grad_fn_gradients(params, grad_fn, baseline):
  """Ties the step to the finite-difference-checked gradient: mu = (1 − b1)·grad."""
  _, state, metrics = baseline
  loss, grads = grad_fn(params)
  np.testing.assert_allclose(float(loss), metrics["loss"], rtol=1e-6)
  for x, y in zip(jax.tree.leaves(first_moment(state)), jax.tree.leaves(host(grads))):
    np.testing.assert_allclose(x, 0.1 * y, rtol=1e-5, atol=1e-9)
  g = np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(host(grads))))
  np.testing.assert_allclose(metrics["grad_norm"], g, rtol=1e-5)


def test_dapo_one_micro_batch_equals_four(params, data, baseline):
  batch, _ = data
  mesh = single_mesh()
  optim = optim_config(grad_accum_steps=1)
  step = train_step.make_train_step(MODEL, loss_config(), optim, mesh)
  state, metrics, _ = step(train_step.create_train_state(params, MODEL, optim, mesh), batch)
  _, want_state, want_metrics = baseline
  assert_same_step(host(state), host(metrics), want_state, want_metrics)


def test_bnpo_on_policy_one_micro_batch_equals_four(params, data):
  """β = 0 and μ = 1: no reference or old log-probs; ratios exactly 1, nothing clipped."""
  batch, _ = data
  batch = {k: v for k, v in batch.items() if k not in ("old_logp_BC", "ref_logp_BC")}
  results = _one_step_each(params, batch, loss_config(loss_type="bnpo", beta=0.0,
                                                     num_iterations=1), (1, 4))
  for _, metrics in results:
    assert metrics["ratio/min"] == 1.0 and metrics["ratio/max"] == 1.0
    assert metrics["clip/region_frac"] == 0.0 and metrics["loss/kl"] == 0.0
  assert_same_step(*results[1], *results[0])


def _one_step_each(params, batch, loss_cfg, accums):
  """[(state, metrics) on the host] after one step from params, for each grad_accum_steps."""
  mesh = single_mesh()
  results = []
  for accum in accums:
    optim = optim_config(grad_accum_steps=accum)
    step = train_step.make_train_step(MODEL, loss_cfg, optim, mesh)
    state, metrics, _ = step(train_step.create_train_state(params, MODEL, optim, mesh,
                                                           loss_cfg=loss_cfg), batch)
    results.append((host(state), host(metrics)))
  return results


def test_nonfinite_step_leaves_state_unchanged(params, data, baseline):
  batch, _ = data
  step = baseline[0]
  state = train_step.create_train_state(params, MODEL, optim_config(), single_mesh())
  before = host(state)
  bad = dict(batch, advantages_B=np.full(B, np.nan, np.float32))
  state, metrics, _ = step(state, bad)
  assert float(metrics["step/skipped"]) == 1.0
  after = host(state)
  for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(x, y)


def _put_loss_token(batch, token, row=3):
  """The batch with the last loss token of a row set to `token`."""
  tokens = batch["tokens_BS"].copy()
  j = np.flatnonzero(batch["completion_mask_BC"][row])[-1]
  tokens[row, P + j] = token
  batch["tokens_BS"] = tokens
  return batch


def test_completion_ids_outside_the_head_rows_are_refused_on_loss_tokens_only(data):
  """token_logprobs would read an id >= V off row V - 1 (a gather clamps) with a gradient that
  is not that value's: a loss token's id must lie in [0, valid), in the train layout and in a
  rollout's; off the loss (padding, observation tokens) any id passes."""
  batch, _ = data
  check = lambda b, valid: train_step.check_batch(b, loss_config(), optim_config(),
                                                  single_mesh(), valid=valid)
  check(batch, MODEL.vocab_size)
  valid = int(batch["tokens_BS"][:, P:][batch["completion_mask_BC"] > 0].max())  # the top id
  with pytest.raises(ValueError, match=rf"outside \[0, V={valid}\) .* on \d+ loss tokens"):
    check(batch, valid)
  off = batch["completion_mask_BC"] == 0
  assert off.any()
  tokens = batch["tokens_BS"].copy()
  tokens[:, P:][off] = 1000  # not in the loss: passes
  check(dict(batch, tokens_BS=tokens), MODEL.vocab_size)
  rewards = np.zeros((B, 1), np.float32)
  roll = _rollout_from(_shared_prompts(dict(batch, tokens_BS=tokens)), rewards)
  rollout_check = lambda r: train_step.check_batch(
      r, loss_config(), optim_config(), single_mesh(), has_ref_params=True, group_size=G,
      valid=MODEL.vocab_size)
  rollout_check(roll)  # past each row's length: passes
  r = int(np.flatnonzero(roll["lengths_B"] >= 2)[0])
  roll["loss_mask_BC"] = np.ones((B, C), np.int32)
  roll["loss_mask_BC"][r, 0] = 0  # an observation token
  roll["completion_BC"] = roll["completion_BC"].copy()
  roll["completion_BC"][r, 0] = 70
  rollout_check(roll)
  roll["completion_BC"][r, 1] = 65
  with pytest.raises(ValueError, match=rf"batch\['completion_BC'\] holds completion token ids "
                                       rf"\[65\] outside \[0, V=64\) .* at completion \[{r}, 1\]"):
    rollout_check(roll)


@pytest.mark.parametrize("change,match", [
    (lambda b: b.pop("advantages_B"), "missing"),
    (lambda b: b.update(advantages_B=np.zeros(B - 1, np.float32)), "advantages_B"),
    (lambda b: b.pop("ref_logp_BC"), "ref_params"),
    (lambda b: b.pop("truncated_B"), "mask_truncated_completions"),
    (lambda b: b.update(tokens_BS=b["tokens_BS"][:24]),
     "attn_mask_BS|completion_mask_BC|advantages_B"),
    (lambda b: b.update(extra=1), "unknown"),
    (lambda b: _put_loss_token(b, MODEL.vocab_size),
     r"batch\['tokens_BS'\] holds completion token ids \[64\] outside \[0, V=64\)"),
    (lambda b: _put_loss_token(b, -1), r"ids \[-1\] outside \[0, V=64\)"),
])
def test_bad_batch_raises_before_anything_is_donated(params, data, baseline, change, match):
  batch, _ = data
  step = baseline[0]
  state = train_step.create_train_state(params, MODEL, optim_config(), single_mesh())
  bad = dict(batch)
  change(bad)
  with pytest.raises(ValueError, match=match):
    step(state, bad)
  assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_reference_log_probs_rejected_when_beta_is_zero(data):
  batch, _ = data
  with pytest.raises(ValueError, match="beta"):
    train_step.check_batch(batch, loss_config(beta=0.0), optim_config(), single_mesh())


def test_micro_batches_must_divide_over_devices(data):
  batch, _ = data
  with pytest.raises(ValueError, match="grad_accum_steps=3"):
    train_step.check_batch(batch, loss_config(), optim_config(grad_accum_steps=3), single_mesh())
  with pytest.raises(ValueError, match="data×fsdp=8"):
    train_step.check_batch(batch, loss_config(), optim_config(grad_accum_steps=8),
                           sharding.make_mesh((2, 4, 1)))


@pytest.mark.parametrize("schedule,warmup", list(itertools.product(["constant", "cosine"],
                                                                   [0, 10])))
def test_learning_rate_schedule(schedule, warmup):
  cfg = optim_config(lr=3e-4, warmup_steps=warmup, schedule=schedule, total_steps=50)
  lr = train_step.learning_rate_schedule(cfg)
  for t in range(0, 60, 3):
    if t < warmup:
      want = 3e-4 * t / warmup
    elif schedule == "constant":
      want = 3e-4
    else:
      frac = min(t - warmup, 50 - warmup) / (50 - warmup)
      want = 3e-4 * 0.5 * (1 + np.cos(np.pi * frac))
    np.testing.assert_allclose(float(lr(t)), want, rtol=1e-5, atol=1e-12, err_msg=str(t))


def test_weight_decay_only_on_matrices(params):
  mask = train_step.decay_mask(params)
  flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
  assert flat["['embed_tokens']['embedding']"] and flat["['layers']['mlp']['up_proj']['kernel']"]
  assert not flat["['norm']['weight']"] and not flat["['layers']['self_attn']['q_proj']['bias']"]
  assert not flat["['layers']['input_layernorm']['weight']"]


@pytest.mark.parametrize("name,value", [
    ("lr", 0.0), ("warmup_steps", -1), ("schedule", "linear"), ("weight_decay", -1.0),
    ("b1", 1.0), ("b2", -0.1), ("max_grad_norm", -1.0), ("grad_accum_steps", 0),
    ("param_dtype", "float16"), ("compute_dtype", "int8")])
def test_bad_optim_config_names_the_setting(name, value):
  cfg = optim_config()
  train_step.validate_optim_config(cfg)
  cfg[name] = value
  with pytest.raises(ValueError, match=f"optim.{name}="):
    train_step.validate_optim_config(cfg)


def test_cosine_needs_total_steps():
  with pytest.raises(ValueError, match="optim.total_steps"):
    train_step.validate_optim_config(optim_config(schedule="cosine", total_steps=0))


# ------------------------------------------------------------------------------------------------
# The one-program step: μ updates, the reference pass and make_batch inside it; SFT; the cache.


def _on_one_device(params, optim):
  mesh = single_mesh()
  sh = train_step.state_shardings(MODEL, optim, mesh)["params"]
  return mesh, jax.device_put(params, sh)


def test_mu_updates_in_one_call_equal_separate_updates_with_old_logprobs(params, data):
  """μ = 2 without old log-probs == two single updates whose old log-probs are the params'
  before the first update (what the first update's forward gives the second); its metrics are
  the two updates' mean (the ratio's range over both)."""
  batch, _ = data
  optim = optim_config(grad_accum_steps=2)
  mesh, p = _on_one_device(params, optim)
  plain = {k: v for k, v in batch.items() if k != "old_logp_BC"}
  step2 = train_step.make_train_step(MODEL, loss_config(num_iterations=2), optim, mesh)
  got, got_m, _ = step2(train_step.create_train_state(p, MODEL, optim, mesh), plain)
  old = train_step.make_logprob_fn(MODEL, optim, mesh)(p, batch["tokens_BS"],
                                                         batch["attn_mask_BS"], C)
  step1 = train_step.make_train_step(MODEL, loss_config(), optim, mesh)
  want = train_step.create_train_state(p, MODEL, optim, mesh)
  want_ms = []
  for _ in range(2):
    want, want_m, _ = step1(want, dict(plain, old_logp_BC=np.asarray(old)))
    want_ms.append({k: float(v) for k, v in want_m.items()})
  assert int(got["step"]) == int(want["step"]) == 2
  for x, y in zip(jax.tree.leaves(host(got)), jax.tree.leaves(host(want))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  for k in ("loss", "grad_norm", "ratio/mean", "loss/kl", "kl", "entropy", "clip/high_frac",
            "lr"):
    np.testing.assert_allclose(float(got_m[k]), (want_ms[0][k] + want_ms[1][k]) / 2, rtol=1e-5,
                               err_msg=k)
  assert float(got_m["ratio/min"]) == pytest.approx(min(m["ratio/min"] for m in want_ms), 1e-5)
  assert float(got_m["ratio/max"]) == pytest.approx(max(m["ratio/max"] for m in want_ms), 1e-5)
  assert float(got_m["ratio/max"]) != 1.0  # the second update is off-policy
  assert float(got_m["step/skipped"]) == 0.0


def test_mu_updates_report_the_fraction_skipped(params, data):
  """μ = 2 at lr 1e36: the first update is finite and throws the params to ~1e36, the second is
  not finite and is skipped, so half the step's updates were skipped (and the state moved); with
  NaN advantages both are skipped and the state is unchanged."""
  batch, _ = data
  optim = optim_config(lr=1e36, weight_decay=0.0, grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  plain = {k: v for k, v in batch.items() if k not in ("old_logp_BC", "ref_logp_BC")}
  step = train_step.make_train_step(MODEL, loss_config(beta=0.0, num_iterations=2), optim, mesh)
  state, m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), plain)
  assert float(m["step/skipped"]) == 0.5 and int(state["step"]) == 1
  assert max(np.abs(x).max() for x in jax.tree.leaves(host(state["params"]))) > 1e30
  state = train_step.create_train_state(p, MODEL, optim, mesh)
  before = host(state)
  state, m, _ = step(state, dict(plain, advantages_B=np.full(B, np.nan, np.float32)))
  assert float(m["step/skipped"]) == 1.0 and int(state["step"]) == 0
  for x, y in zip(jax.tree.leaves(host(state)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(x, y)


def test_reference_pass_inside_the_step_equals_given_reference_logprobs(params, data):
  batch, _ = data
  optim = optim_config(grad_accum_steps=2)
  mesh, p = _on_one_device(params, optim)
  ref = jax.tree.map(lambda x: x * 0.9, p)  # a reference other than the policy
  ref_logp = train_step.make_logprob_fn(MODEL, optim, mesh)(ref, batch["tokens_BS"],
                                                              batch["attn_mask_BS"], C)
  step = train_step.make_train_step(MODEL, loss_config(), optim, mesh)
  without = {k: v for k, v in batch.items() if k != "ref_logp_BC"}
  got, got_m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), without, ref)
  want, want_m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh),
                         dict(without, ref_logp_BC=np.asarray(ref_logp)))
  assert float(got_m["loss/kl"]) > 0
  np.testing.assert_allclose(float(got_m["loss/kl"]), float(want_m["loss/kl"]), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(host(got)), jax.tree.leaves(host(want))):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8)


def _shared_prompts(batch):
  """The baseline batch with each group's prompt made that of its first row, as in a rollout."""
  out = dict(batch)
  for k in ("tokens_BS", "attn_mask_BS"):
    x = batch[k].copy()
    x[:, :P] = np.repeat(x[::G, :P], G, axis=0)
    out[k] = x
  return out


def _rollout_from(batch, rewards):
  tokens, attn = batch["tokens_BS"], batch["attn_mask_BS"]
  return {"prompt_NP": tokens[::G, :P], "prompt_mask_NP": attn[::G, :P],  # a prompt a group
          "completion_BC": tokens[:, P:], "lengths_B": batch["completion_mask_BC"].sum(1),
          "truncated_B": batch["truncated_B"], "rewards_BR": rewards}


def test_rollout_batch_builds_the_train_batch_on_device(params, data):
  """Advantages and masks made inside the program == the host-built train batch (whose
  forward runs every row's prompt; the rollout's runs each group's prompt once)."""
  batch = _shared_prompts(data[0])
  rng = np.random.default_rng(3)
  rewards = rng.normal(size=(B, 2)).astype(np.float32)
  rewards[rng.random((B, 2)) < 0.1] = np.nan
  rewards[5] = np.nan  # a row with every reward missing: advantage 0, counted as missing
  weights = (1.0, 0.5)
  adv, _ = grpo.group_advantages(rewards, G, weights_R=np.asarray(weights))
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  step = train_step.make_train_step(MODEL, loss_config(), optim, mesh, group_size=G,
                                    reward_weights=weights)
  given = dict(batch, advantages_B=np.asarray(adv, np.float32))
  want, want_m, want_adv = step(train_step.create_train_state(p, MODEL, optim, mesh),
                                {k: v for k, v in given.items() if k != "old_logp_BC"})
  roll = dict(_rollout_from(batch, rewards), prompt_NP=batch["tokens_BS"][:, :P],
              prompt_mask_NP=batch["attn_mask_BS"][:, :P])  # a prompt a row: not a rollout
  with pytest.raises(ValueError, match="one row per group"):
    step(train_step.create_train_state(p, MODEL, optim, mesh), roll)
  roll = _rollout_from(batch, rewards)
  roll["ref_logp_BC"] = batch["ref_logp_BC"]  # not a rollout key: rejected
  with pytest.raises(ValueError, match="unknown"):
    step(train_step.create_train_state(p, MODEL, optim, mesh), roll)
  ref = jax.tree.map(lambda x: x * 0.9, p)
  del roll["ref_logp_BC"]
  got, got_m, got_adv = step(train_step.create_train_state(p, MODEL, optim, mesh), roll, ref)
  np.testing.assert_allclose(np.asarray(got_adv), np.asarray(want_adv), rtol=1e-6, atol=1e-7)
  for k in ("loss/policy", "tokens/completion", "tokens/total", "entropy"):
    np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-6, err_msg=k)
  assert 0 < float(got_m["advantages/frac_reward_missing"]) < 1


def test_dr_grpo_divides_by_max_completion_length_not_the_padded_width(params, data):
  """Trimming a batch's completion width (fine padding) must not change dr_grpo's loss."""
  batch, _ = data
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  cfg = loss_config(loss_type="dr_grpo", beta=0.0)
  base = {k: batch[k] for k in ("tokens_BS", "attn_mask_BS", "completion_mask_BC",
                                "advantages_B", "truncated_B")}
  wide = {k: np.pad(v, ((0, 0), (0, 4))) if k in ("tokens_BS", "attn_mask_BS",
                                                    "completion_mask_BC") else v
          for k, v in base.items()}
  results = []
  for b in (base, wide):
    step = train_step.make_train_step(MODEL, cfg, optim, mesh, max_completion_length=C + 4)
    results.append(step(train_step.create_train_state(p, MODEL, optim, mesh), b))
  (s1, m1, _), (s2, m2, _) = results
  np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
  # The wider batch sums in another order, so the step is compared as assert_same_step does:
  # gradients to 1e-5 of their scale, params to 1e-5. Not params to 1e-7: AdamW's first update
  # is lr·g/(|g| + eps), which turns a rounding difference in a gradient near eps (1e-8) into
  # a visible one in the param (on one machine: g 4.91e-8 against 4.87e-8, 2e-7 of the
  # gradients' scale, moved a q_proj weight by 8.31e-4 against 8.30e-4 at lr 1e-3).
  assert_same_step(host(s2), host(m2), host(s1), host(m1))


def test_sft_objective_is_the_mean_nll_of_completion_tokens(params, data):
  batch, _ = data
  sft_batch = {k: batch[k] for k in ("tokens_BS", "attn_mask_BS", "completion_mask_BC")}
  nll = -dense_logprobs(params, batch["tokens_BS"], batch["attn_mask_BS"])
  mask = batch["completion_mask_BC"]
  want = (nll * mask).sum() / mask.sum()
  optim = optim_config(grad_accum_steps=4, lr=1e-2)
  mesh = sharding.make_mesh((2, 2, 2))
  step = train_step.make_train_step(MODEL, loss_config(), optim, mesh, objective="sft")
  state = train_step.create_train_state(params, MODEL, optim, mesh)
  state, m, _ = step(state, sft_batch)
  np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)
  # The next call reports the loss at the updated params: Adam at lr 1e-2 lowered the NLL.
  assert float(step(state, sft_batch)[1]["loss"]) < want
  with pytest.raises(ValueError, match="unknown keys"):
    step(train_step.create_train_state(params, MODEL, optim, mesh), dict(sft_batch,
                                                                          advantages_B=0))


def test_compile_cache_is_keyed_by_shape(params, data):
  """A second batch shape compiles once and does not evict the first."""
  batch, _ = data
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  step = train_step.make_train_step(MODEL, loss_config(beta=0.0), optim, mesh)
  keys = ("tokens_BS", "attn_mask_BS", "completion_mask_BC", "advantages_B", "truncated_B")
  a = {k: batch[k] for k in keys}
  b = {k: (v[:, :-2] if k != "completion_mask_BC" else v[:, :-2]) if v.ndim == 2 else v
       for k, v in a.items()}
  state = train_step.create_train_state(p, MODEL, optim, mesh)
  for x in (a, b, a, b, a):
    state, _, _ = step(state, x)
  assert step.num_traces == 2 and step.num_programs == 2


def test_a_precompiled_layout_runs_its_batches_with_the_same_numbers(params, data):
  """precompile compiles a layout's program in the background; a batch of that layout runs
  that program (traced and compiled once: the call waits for it) and gets what a step
  compiling on the call gets; a batch of another layout compiles its own."""
  batch, _ = data
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  keys = ("tokens_BS", "attn_mask_BS", "completion_mask_BC", "advantages_B", "truncated_B")
  a = {k: batch[k] for k in keys}
  b = {k: v[:, :-2] if v.ndim == 2 else v for k, v in a.items()}
  fresh = lambda: train_step.create_train_state(p, MODEL, optim, mesh)
  plain = train_step.make_train_step(MODEL, loss_config(beta=0.0), optim, mesh)
  want, want_m, _ = plain(fresh(), a)

  step = train_step.make_train_step(MODEL, loss_config(beta=0.0), optim, mesh)
  state = fresh()
  layout = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in a.items()}
  compiled = []
  listener = lambda name, secs, **_: compiled.append(name == _BACKEND_COMPILE)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    step.precompile(state, layout)
    step.precompile(state, layout)  # the same layout again: nothing more
    # Called at once, while the program compiles: the call waits for it, no second compile.
    got, got_m, _ = step(state, a)
    assert sum(compiled) == 1
    assert step.num_traces == 1
    assert float(got_m["loss"]) == float(want_m["loss"])
    for x, y in zip(jax.tree.leaves(host(got["params"])),
                    jax.tree.leaves(host(want["params"]))):
      np.testing.assert_array_equal(x, y)
    step(got, b)
    assert sum(compiled) == 2
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert step.num_traces == 2


def test_cosine_schedule_counts_every_update_of_mu(params, data):
  """With μ = 2 the schedule runs over train.steps × μ updates: step i's lr is the mean of its
  updates' rates, the schedule's at updates 2i and 2i + 1 (> 0 to the end), not 0 from halfway
  on."""
  batch, _ = data
  steps, mu = 2, 2
  optim = optim_config(grad_accum_steps=1, schedule="cosine", total_steps=steps * mu, lr=1e-3)
  mesh, p = _on_one_device(params, optim)
  step = train_step.make_train_step(MODEL, loss_config(num_iterations=mu, beta=0.0), optim, mesh)
  plain = {k: v for k, v in batch.items() if k not in ("old_logp_BC", "ref_logp_BC")}
  state = train_step.create_train_state(p, MODEL, optim, mesh)
  schedule = train_step.learning_rate_schedule(optim)
  for i in range(steps):
    state, m, _ = step(state, plain)
    want = np.mean([float(schedule(mu * i + j)) for j in range(mu)])
    np.testing.assert_allclose(float(m["lr"]), want, rtol=1e-6)
  assert int(state["step"]) == steps * mu and float(m["lr"]) > 0


def _prompt_once_step(params, data, accum, shape):
  """(step, its rollout-layout result (state, metrics, advantages), params, ref) for accum and
  a mesh shape: the shared-prompt forward, from the baseline batch's prompts."""
  batch = _shared_prompts(data[0])
  rewards = np.random.default_rng(4).normal(size=(B, 1)).astype(np.float32)
  optim = optim_config(grad_accum_steps=accum)
  mesh = sharding.make_mesh(shape)
  p = jax.device_put(params, train_step.state_shardings(MODEL, optim, mesh)["params"])
  step = train_step.make_train_step(MODEL, loss_config(), optim, mesh, group_size=G,
                                    reward_weights=(1.0,))
  ref = jax.tree.map(lambda x: x * 0.9, p)
  out = step(train_step.create_train_state(p, MODEL, optim, mesh),
             _rollout_from(batch, rewards), ref)
  return step, out, p, ref


@pytest.fixture(scope="module")
def full_forward_step(params, data):
  """The full forward over every row (the train layout), on one device, in one micro-batch,
  with the advantages the rollout layout made there: host (state, metrics)."""
  step, (_, _, adv), p, ref = _prompt_once_step(params, data, 1, (1, 1, 1))
  train = {k: v for k, v in _shared_prompts(data[0]).items()
           if k not in ("old_logp_BC", "ref_logp_BC")}
  optim = optim_config(grad_accum_steps=1)
  want, want_m, _ = step(train_step.create_train_state(p, MODEL, optim, single_mesh()),
                         dict(train, advantages_B=np.asarray(adv)), ref)
  return host(want), host(want_m)


# Each layout against the one full forward (one program, not one per layout): the step's own
# micro-batching and mesh give the one-device step (test_sharded_step_matches_single_device,
# test_dapo_one_micro_batch_equals_four), so what is compared here is the layout.
@pytest.mark.parametrize("accum,shape,layout", [
    (1, (1, 1, 1), (G, G)), (2, (2, 2, 2), (G, G)), (4, (1, 1, 1), (G, G)),  # whole groups
    (2, (1, 8, 1), (1, G // 2)),  # 8 prompts do not split into 2 × 8: G / accum rows per group
    (4, (2, 2, 2), (1, 1))])      # ... and accum = G leaves one: the full forward
def test_prompt_run_once_per_group_equals_running_every_row(params, data, full_forward_step,
                                                            accum, shape, layout):
  """The shared-prompt forward (whole groups per micro-batch, or G / accum rows of each) gives
  the step of the full forward over every row."""
  step, (got, got_m, _), _, _ = _prompt_once_step(params, data, accum, shape)
  assert step.micro_layout(B) == layout
  want, want_m = full_forward_step
  for k in ("loss", "loss/kl", "entropy", "grad_norm"):
    np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-5, err_msg=k)
  assert_same_step(host(got), host(got_m), want, want_m)



def test_reference_in_compute_dtype_gives_the_same_step_bit_for_bit(params, data):
  """With fp32 params and bf16 compute the reference is stored in bf16 (half the memory): every
  use casts a parameter to the compute dtype first, so its log-probs, the KL and the whole
  update are exactly those of an fp32 reference."""
  batch, _ = data
  optim = optim_config(compute_dtype="bfloat16", grad_accum_steps=2)
  assert train_step.reference_dtype(optim) == jnp.bfloat16
  assert train_step.reference_dtype(optim_config()) == jnp.float32  # fp32 compute: kept
  mesh = sharding.make_mesh((1, 2, 1))
  sh = train_step.state_shardings(MODEL, optim, mesh)["params"]
  p = jax.device_put(params, sh)
  ref32 = jax.tree.map(lambda x: x * 0.9, p)  # a reference other than the policy
  ref16 = train_step.reference_params(ref32, MODEL, optim, mesh)
  assert {x.dtype for x in jax.tree.leaves(ref16)} == {jnp.dtype(jnp.bfloat16)}
  assert jax.tree.map(lambda x: x.sharding, ref16) == sh
  want_abstract = train_step.abstract_reference(MODEL, optim, mesh)
  assert jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), want_abstract) == jax.tree.map(
      lambda x: (x.shape, x.dtype, x.sharding), ref16)
  step = train_step.make_train_step(MODEL, loss_config(), optim, mesh)
  without = {k: v for k, v in batch.items() if k != "ref_logp_BC"}
  got, got_m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), without, ref16)
  want, want_m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), without, ref32)
  assert float(got_m["loss/kl"]) > 0
  assert {k: float(v) for k, v in got_m.items()} == {k: float(v) for k, v in want_m.items()}
  for x, y in zip(jax.tree.leaves(host(got)), jax.tree.leaves(host(want))):
    np.testing.assert_array_equal(x, y)


def test_reference_equal_to_the_policy_gives_exactly_zero_kl_and_gradient(params, data):
  """A run's first step: the reference is the policy (here its bf16 copy, equal as the bf16
  forward uses it). In exact arithmetic, with all advantages 0 and on-policy ratios, the loss
  and its gradient are 0, so AdamW (no weight decay) leaves every parameter as it was. A second
  forward for the reference would differ from the policy's in rounding, and Adam would turn
  that noise into lr-sized steps."""
  batch, _ = data
  optim = optim_config(compute_dtype="bfloat16", grad_accum_steps=2, weight_decay=0.0)
  mesh = sharding.make_mesh((1, 2, 1))
  p = jax.device_put(params, train_step.state_shardings(MODEL, optim, mesh)["params"])
  ref = train_step.reference_params(p, MODEL, optim, mesh)
  assert {x.dtype for x in jax.tree.leaves(ref)} == {jnp.dtype(jnp.bfloat16)}
  flat = {k: v for k, v in batch.items() if k not in ("ref_logp_BC", "old_logp_BC")}
  flat["advantages_B"] = np.zeros(B, np.float32)
  step = train_step.make_train_step(MODEL, loss_config(), optim, mesh)
  got, m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), flat, ref)
  assert float(m["loss/kl"]) == 0.0 and float(m["loss"]) == 0.0
  assert float(m["grad_norm"]) == 0.0 and float(m["step/skipped"]) == 0.0
  for x, y in zip(jax.tree.leaves(host(got["params"])), jax.tree.leaves(host(params))):
    np.testing.assert_array_equal(x, y)
  # The same program with a reference that differs in one element runs the reference forward.
  leaf = ref["layers"]["mlp"]["up_proj"]["kernel"]
  moved = dict(ref, layers=dict(ref["layers"], mlp=dict(ref["layers"]["mlp"], up_proj={
      "kernel": leaf.at[0, 0, 0].add(jnp.asarray(0.5, leaf.dtype))})))
  _, m2, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), flat, moved)
  assert step.num_traces == 1
  assert float(m2["loss/kl"]) > 0 and float(m2["grad_norm"]) > 0


@pytest.mark.parametrize("batched", [True, False])
def test_members_program_is_each_members_own_step(params, data, batched):
  """members.train (train_step under jax.vmap over a leading K axis, or under jax.lax.map: each
  member's step in turn) gives member k what its own step gives it: its rewards, lr, β and clip
  bounds enter as arrays (train_step.hparams). On CPU the vmapped matmuls may round otherwise,
  so: within 1e-5 relative, params within 1e-6."""
  batch = _shared_prompts(data[0])
  rng = np.random.default_rng(11)
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  cfgs = [(loss_config(), optim, (1.0, 0.5)),
          (loss_config(beta=0.1, epsilon=0.1, epsilon_high=0.3), optim_config(
              grad_accum_steps=1, lr=3e-4), (2.0, 1.0))]
  step = train_step.make_train_step(MODEL, cfgs[0][0], optim, mesh, group_size=G,
                                    reward_weights=cfgs[0][2])
  ref = jax.tree.map(lambda x: x * 0.9, p)
  rolls = [_rollout_from(batch, rng.normal(size=(B, 2)).astype(np.float32)) for _ in cfgs]
  hps = [train_step.hparams(lc, oc, w) for lc, oc, w in cfgs]
  want = [step(train_step.create_train_state(p, MODEL, optim, mesh), r, ref, h)
          for r, h in zip(rolls, hps)]
  state_K = train_step_stack([train_step.create_train_state(p, MODEL, optim, mesh)] * 2)
  got_state, got_m, got_adv = members.train(step, state_K, rolls, train_step_stack(hps),
                                            train_step_stack([ref, ref]), batched=batched)
  assert step.num_programs == 2  # one program for one run, one for two
  for k, (w_state, w_m, w_adv) in enumerate(want):
    np.testing.assert_allclose(np.asarray(got_adv)[k], np.asarray(w_adv), rtol=1e-6, atol=1e-7)
    for name in ("loss", "loss/policy", "loss/kl", "clip/high_frac", "grad_norm", "lr"):
      np.testing.assert_allclose(float(got_m[name][k]), float(w_m[name]), rtol=1e-5,
                                 atol=1e-8, err_msg=f"member {k}: {name}")
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x[k], got_state["params"])),
                    jax.tree.leaves(w_state["params"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
  # The members' settings reached the program: lr as given, and loss = policy + β·KL with each
  # member's own β (0.05 and 0.1).
  assert float(got_m["lr"][1]) == pytest.approx(3e-4)
  for k, beta in enumerate((0.05, 0.1)):
    m = {name: float(v[k]) for name, v in got_m.items()}
    assert m["loss"] - m["loss/policy"] == pytest.approx(beta * m["loss/kl"], rel=1e-4)



@pytest.mark.parametrize("batched", [True, False])
def test_a_precompiled_members_layout_compiles_once(params, data, batched):
  """members.precompile_train: the members' program, for the stacked layout members.train makes
  of their batches, compiles in the background; members.train then runs it without compiling
  again and gets what a step compiling on the call gets, to the bit."""
  batch = _shared_prompts(data[0])
  rng = np.random.default_rng(12)
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  ref = jax.tree.map(lambda x: x * 0.9, p)
  rolls = [_rollout_from(batch, rng.normal(size=(B, 2)).astype(np.float32)) for _ in range(2)]
  hps = train_step_stack([train_step.hparams(loss_config(), optim, (1.0, 0.5)),
                          train_step.hparams(loss_config(beta=0.1), optim, (2.0, 1.0))])
  fresh = lambda: train_step_stack([train_step.create_train_state(p, MODEL, optim, mesh)] * 2)
  make = lambda: train_step.make_train_step(MODEL, loss_config(), optim, mesh, group_size=G,
                                            reward_weights=(1.0, 0.5))
  ref_K = train_step_stack([ref, ref])
  want_state, want_m, _ = members.train(make(), fresh(), rolls, hps, ref_K, batched=batched)

  step, state_K = make(), fresh()
  spec = {name: jax.ShapeDtypeStruct((2,) + np.shape(v), np.asarray(v).dtype)
          for name, v in rolls[0].items()}
  compiled = []
  listener = lambda name, secs, **_: compiled.append(name == _BACKEND_COMPILE)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    members.precompile_train(step, state_K, spec, ref_K, hparams_K=hps, batched=batched)
    members.precompile_train(step, state_K, spec, ref_K, hparams_K=hps,
                             batched=batched)  # nothing more
    got_state, got_m, _ = members.train(step, state_K, rolls, hps, ref_K, batched=batched)
    assert sum(compiled) == 1
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert step.num_traces == 1
  np.testing.assert_array_equal(np.asarray(got_m["loss"]), np.asarray(want_m["loss"]))
  for a, b in zip(jax.tree.leaves(host(got_state["params"])),
                  jax.tree.leaves(host(want_state["params"]))):
    np.testing.assert_array_equal(a, b)

def train_step_stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *trees)


def _with_sampler(batch, seed=11):
  """The batch with a sampler's log-probs near the old ones (a drifted rollout engine)."""
  rng = np.random.default_rng(seed)
  noise = rng.normal(scale=0.2, size=batch["old_logp_BC"].shape)
  return dict(batch, sampler_logp_BC=(batch["old_logp_BC"] + noise).astype(np.float32))


# Each new loss option, alone or with the others: 4 micro-batches give the one-batch step.
@pytest.mark.parametrize("loss_kw", [
    dict(loss_type="cispo", epsilon_high=1.2, rollout_is_correction=True,
         rollout_is_mode="token_truncate", rollout_is_clip_min=0.8),
    dict(loss_type="sapo", off_policy_mask_threshold=0.02),
    dict(loss_type="luspo", importance_sampling_level="sequence", use_bias_correction_kl=True),
    dict(loss_type="vespo", rollout_is_correction=True, rollout_is_mode="token_mask",
         rollout_is_clip_max=1.2),
    dict(loss_type="dapo", top_entropy_quantile=0.3, entropy_coef=0.05,
         rollout_is_correction=True, rollout_is_mode="sequence_mask", rollout_is_clip_max=2.0),
    # The first update applies no bonus (no entropy measured yet) and steps the coefficient up.
    dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=100.0,
         top_entropy_quantile=0.5),
], ids=["cispo", "sapo", "luspo", "vespo", "entropy", "adaptive_entropy"])
def test_new_loss_options_one_micro_batch_equals_four(params, data, loss_kw):
  results = _one_step_each(params, _with_sampler(data[0]), loss_config(**loss_kw), (1, 4))
  assert_same_step(*results[1], *results[0])
  m = results[0][1]
  assert {"drift/logp_diff_mean", "drift/logp_diff_max", "drift/kl",
          "drift/is_clipped_frac"} <= set(m)
  assert ("loss/entropy" in m) == ("entropy_coef" in loss_kw)
  if loss_kw.get("use_adaptive_entropy"):
    for state, metrics in results:
      np.testing.assert_allclose(state["entropy_ctrl"]["coef"], 0.055, rtol=1e-6)
      np.testing.assert_allclose(metrics["entropy_coef"], 0.055, rtol=1e-6)
      assert metrics["entropy_coef/applied"] == 0
      # 'last': the step's mean entropy over the trained (top-half) tokens.
      np.testing.assert_allclose(state["entropy_ctrl"]["last"], metrics["loss/entropy"],
                                 rtol=1e-6)
  if "off_policy_mask_threshold" in loss_kw:
    assert 0 < m["drift/off_policy_masked_frac"] < 1


def test_drift_metrics_are_the_first_updates_log_probs_against_the_samplers(params, data):
  """drift/* compare the step's own log-probs at the params that sampled (dense NumPy ones
  here) with the batch's sampler_logp_BC, over the loss tokens; μ = 2 changes nothing."""
  batch = {k: v for k, v in _with_sampler(data[0]).items() if k != "old_logp_BC"}
  optim = optim_config(grad_accum_steps=2)
  mesh = single_mesh()
  step = train_step.make_train_step(MODEL, loss_config(num_iterations=2), optim, mesh)
  _, m, _ = step(train_step.create_train_state(params, MODEL, optim, mesh), batch)
  logp = dense_logprobs(params, batch["tokens_BS"], batch["attn_mask_BS"])
  on = (batch["completion_mask_BC"] > 0) & ~batch["truncated_B"][:, None]  # mask_truncated
  d_BC = np.where(on, logp - batch["sampler_logp_BC"], 0.0)
  d = d_BC[on]
  np.testing.assert_allclose(float(m["drift/logp_diff_mean"]), np.abs(d).mean(), rtol=1e-4)
  np.testing.assert_allclose(float(m["drift/logp_diff_max"]), np.abs(d).max(), rtol=1e-4)
  np.testing.assert_allclose(float(m["drift/kl"]), np.mean(np.expm1(d) - d), rtol=1e-3)
  # The default sequence_mask with C_max = 3 drops the rows whose exp(Σ_t Δ) exceeds 3.
  dropped_B = np.exp(d_BC.sum(1)) > 3.0
  want = (dropped_B[:, None] & on).sum() / on.sum()
  assert 0 < want < 1
  np.testing.assert_allclose(float(m["drift/is_clipped_frac"]), want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# loss.steps_per_generation (S updates per generation batch) and loss.sync_ref_model.


def _slice_rows(s, S):
  """The rows of slice s of S (train_step._slice_batch): runs s, s + S, … of G rows."""
  rows = np.arange(B)
  return rows[(rows // G) % S == s]


@pytest.mark.parametrize("given_old", [True, False])
def test_steps_per_generation_is_one_update_per_slice_with_the_start_log_probs(params, data,
                                                                                given_old):
  """S = 2, μ = 2 in one call == four single updates in TRL's order (slice 0, 1, 0, 1), each on
  its slice's rows, with the batch's old log-probs or (none given) those of the params before
  the first update, and the reference's from its params (a forward in the step)."""
  batch, _ = data
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  ref = jax.tree.map(lambda x: x * 0.9, p)
  logprob_fn = train_step.make_logprob_fn(MODEL, optim, mesh)
  ref_logp = np.asarray(logprob_fn(ref, batch["tokens_BS"], batch["attn_mask_BS"], C))
  old = (batch["old_logp_BC"] if given_old else
         np.asarray(logprob_fn(p, batch["tokens_BS"], batch["attn_mask_BS"], C)))
  drop = ("ref_logp_BC",) if given_old else ("ref_logp_BC", "old_logp_BC")
  plain = {k: v for k, v in batch.items() if k not in drop}
  lc = loss_config(loss_type="grpo", num_iterations=2, steps_per_generation=2)
  step = train_step.make_train_step(MODEL, lc, optim, mesh, group_size=G)
  got, got_m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), plain, ref)
  one = train_step.make_train_step(MODEL, loss_config(loss_type="grpo"), optim, mesh)
  want, want_ms = train_step.create_train_state(p, MODEL, optim, mesh), []
  for s in (0, 1, 0, 1):
    rows = _slice_rows(s, 2)
    part = {k: v[rows] for k, v in plain.items()}
    want, m, _ = one(want, dict(part, old_logp_BC=old[rows], ref_logp_BC=ref_logp[rows]))
    want_ms.append({k: float(v) for k, v in m.items()})
  assert int(got["step"]) == int(want["step"]) == 4  # the schedule counts every update
  for x, y in zip(jax.tree.leaves(host(got)), jax.tree.leaves(host(want))):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8)
  for k in ("loss", "loss/kl", "grad_norm", "ratio/mean", "lr"):
    np.testing.assert_allclose(float(got_m[k]), np.mean([m[k] for m in want_ms]), rtol=1e-6,
                               err_msg=k)
  assert float(got_m["ratio/max"]) == pytest.approx(max(m["ratio/max"] for m in want_ms), 1e-6)
  assert float(got_m["loss/kl"]) > 0


def test_steps_per_generation_normalises_dapo_over_the_generation_batch_and_micro_batches(
    params, data):
  """dapo with S = 2 divides each update's token sum by the generation batch's loss tokens / S
  (TRL's normaliser), so at a rate too small to move any parameter its two updates' mean loss
  is the whole batch's (S = 1) loss; bnpo (each update's own tokens) is not. And with S = 2
  four micro-batches per update (a rollout batch: prompts once per group) give one's result."""
  batch = {k: v for k, v in _shared_prompts(data[0]).items() if k != "ref_logp_BC"}
  optim = optim_config(grad_accum_steps=1, lr=1e-30, weight_decay=0.0)
  mesh, p = _on_one_device(params, optim)
  losses = {}
  for loss_type, S in itertools.product(("dapo", "bnpo"), (1, 2)):
    lc = loss_config(loss_type=loss_type, beta=0.0, steps_per_generation=S)
    step = train_step.make_train_step(MODEL, lc, optim, mesh, group_size=G)
    state, m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), batch)
    for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(p)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # nothing moved
    losses[loss_type, S] = float(m["loss"])
  np.testing.assert_allclose(losses["dapo", 2], losses["dapo", 1], rtol=1e-6)
  assert abs(losses["bnpo", 2] - losses["bnpo", 1]) > 1e-3 * abs(losses["bnpo", 1])
  rollout = _rollout_from(_shared_prompts(data[0]), np.random.default_rng(3).normal(
      size=(B, 1)).astype(np.float32))
  results = []
  for accum in (1, 4):
    optim = optim_config(grad_accum_steps=accum)
    lc = loss_config(steps_per_generation=2, num_iterations=2)
    step = train_step.make_train_step(MODEL, lc, optim, mesh, group_size=G, reward_weights=(1.0,))
    assert step.micro_layout(B // 2) == (G, G)  # whole groups, their prompts run once
    state, m, _ = step(train_step.create_train_state(p, MODEL, optim, mesh), rollout,
                       jax.tree.map(lambda x: x * 0.9, p))
    results.append((host(state), host(m)))
  for k, v in results[0][1].items():
    np.testing.assert_allclose(results[1][1][k], v, rtol=1e-5, atol=1e-7, err_msg=k)
  for x, y in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(results[0][0])):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_synced_reference_mixes_in_the_policy_every_n_updates(params, data):
  """loss.sync_ref_model: the reference is train state, starting as the params; after every
  ref_model_sync_steps-th update it is α·params + (1 − α)·ref (NumPy, float32), between them it
  is unchanged, and the KL is taken against it (exactly 0 while it is the policy)."""
  batch = {k: v for k, v in data[0].items() if k != "ref_logp_BC"}
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  lc = loss_config(sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.6)
  step = train_step.make_train_step(MODEL, lc, optim, mesh)
  state = train_step.create_train_state(p, MODEL, optim, mesh, loss_cfg=lc)
  assert not step.needs_ref(batch)  # no frozen reference beside the state
  want = jax.tree.map(np.asarray, state["ref"])
  for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(p)):
    np.testing.assert_array_equal(x, np.asarray(y))
  for n in range(1, 5):
    state, m, _ = step(state, batch)
    if n == 1:
      assert float(m["loss/kl"]) == 0.0
    else:
      assert float(m["loss/kl"]) > 0
    if n % 2 == 0:
      want = jax.tree.map(lambda r, x: r * np.float32(0.4) + np.asarray(x) * np.float32(0.6),
                          want, state["params"])
    for x, y in zip(jax.tree.leaves(state["ref"]), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(x), y, rtol=1e-6, atol=1e-9)
  moved = max(np.abs(np.asarray(x) - np.asarray(y)).max()
              for x, y in zip(jax.tree.leaves(state["ref"]), jax.tree.leaves(p)))
  assert moved > 1e-3  # the reference did follow the policy
  # In the compute dtype (bf16 here) the reference is stored as the frozen one is.
  bf16 = optim_config(compute_dtype="bfloat16")
  ref = train_step.create_train_state(p, MODEL, bf16, mesh, loss_cfg=lc)["ref"]
  assert {x.dtype for x in jax.tree.leaves(ref)} == {jnp.dtype(jnp.bfloat16)}


def test_a_reference_synced_past_the_run_leaves_the_step_as_a_frozen_one(params, data):
  """sync_ref_model with a period no run reaches == the frozen reference (sync_ref_model=False,
  the default) bit for bit: the reference as train state changes nothing else."""
  batch = {k: v for k, v in data[0].items() if k != "ref_logp_BC"}
  optim = optim_config(grad_accum_steps=2)
  mesh, p = _on_one_device(params, optim)
  frozen_lc, synced_lc = loss_config(), loss_config(sync_ref_model=True,
                                                    ref_model_sync_steps=10**6)
  frozen = train_step.make_train_step(MODEL, frozen_lc, optim, mesh)
  synced = train_step.make_train_step(MODEL, synced_lc, optim, mesh)
  ref = train_step.reference_params(p, MODEL, optim, mesh)
  a = train_step.create_train_state(p, MODEL, optim, mesh, loss_cfg=frozen_lc)
  b = train_step.create_train_state(p, MODEL, optim, mesh, loss_cfg=synced_lc)
  for _ in range(2):
    a, ma, _ = frozen(a, batch, ref)
    b, mb, _ = synced(b, batch)
    assert {k: float(v) for k, v in ma.items()} == {k: float(v) for k, v in mb.items()}
  ref_b = b.pop("ref")
  for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b))):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(ref_b), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_members_each_sync_their_own_reference(params, data):
  """A vmapped group with loss.sync_ref_model (in turn, jax.lax.map): each member's reference is
  in its own stacked state, and members.train leaves each member's reference and params where
  its own step does (their β differ, so do their updates)."""
  batch = _shared_prompts(data[0])
  rng = np.random.default_rng(12)
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  lcs = [loss_config(sync_ref_model=True, ref_model_sync_steps=1, beta=b) for b in (0.05, 0.2)]
  step = train_step.make_train_step(MODEL, lcs[0], optim, mesh, group_size=G,
                                    reward_weights=(1.0, 0.5))
  rolls = [_rollout_from(batch, rng.normal(size=(B, 2)).astype(np.float32)) for _ in lcs]
  hps = [train_step.hparams(lc, optim, (1.0, 0.5)) for lc in lcs]
  fresh = lambda: train_step.create_train_state(p, MODEL, optim, mesh, loss_cfg=lcs[0])
  want = [step(fresh(), r, None, h)[0] for r, h in zip(rolls, hps)]
  got, _, _ = members.train(step, train_step_stack([fresh(), fresh()]), rolls,
                            train_step_stack(hps), None, batched=False)
  for k, w in enumerate(want):
    for part in ("ref", "params"):
      for a, b in zip(jax.tree.leaves(jax.tree.map(lambda x: x[k], got[part])),
                      jax.tree.leaves(w[part])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
  moved = [max(np.abs(np.asarray(x) - np.asarray(y)).max()
               for x, y in zip(jax.tree.leaves(w["ref"]), jax.tree.leaves(p))) for w in want]
  assert min(moved) > 1e-4
  assert max(np.abs(np.asarray(x) - np.asarray(y)).max()
             for x, y in zip(jax.tree.leaves(want[0]["ref"]), jax.tree.leaves(want[1]["ref"]))) > 0


def test_steps_per_generation_with_lora_slices_the_adapters_updates(params, data):
  """S = 2 with LoRA (fresh adapters, b = 0: the policy is the base, the reference): two single
  updates of the adapters, one per slice, whose old and reference log-probs are both the base's
  (one forward before the first update). The baseline's come from the plain forward, the step's
  from the base with zero adapters, another program: within 1e-5, as the μ test above."""
  from grpo_jax import policy as policy_lib  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import lora as lora_lib  # pylint: disable=import-outside-toplevel
  batch = {k: v for k, v in data[0].items() if k not in ("old_logp_BC", "ref_logp_BC")}
  optim = optim_config(grad_accum_steps=1)
  mesh, p = _on_one_device(params, optim)
  lora = policy_lib.Lora(lora_lib.LoraConfig(rank=4, alpha=8.0))
  base = train_step.reference_params(p, MODEL, optim, mesh, lora)
  fresh = lambda: train_step.create_train_state(
      lora.init_trainable(p, MODEL, 0, jnp.float32), MODEL, optim, mesh, lora)
  sliced = train_step.make_train_step(MODEL, loss_config(loss_type="grpo", steps_per_generation=2),
                                      optim, mesh, group_size=G, policy=lora)
  got, _, _ = sliced(fresh(), batch, base)
  logp = np.asarray(train_step.make_logprob_fn(MODEL, optim, mesh)(p, batch["tokens_BS"],
                                                                   batch["attn_mask_BS"], C))
  one = train_step.make_train_step(MODEL, loss_config(loss_type="grpo"), optim, mesh, policy=lora)
  want = fresh()
  for s in (0, 1):
    rows = _slice_rows(s, 2)
    want, _, _ = one(want, dict({k: v[rows] for k, v in batch.items()}, old_logp_BC=logp[rows],
                                ref_logp_BC=logp[rows]), base)
  assert int(got["step"]) == 2
  for x, y in zip(jax.tree.leaves(host(got)), jax.tree.leaves(host(want))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  assert max(np.abs(b).max() for b in lora_lib.b_factors(host(got["params"]))) > 0
