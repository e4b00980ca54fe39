"""The int8 frozen base of QLoRA (grpo_jax.models.quant): the quantization against a NumPy
absmax formula, the model on int8 kernels against the model on their dequantized values, LoRA on
top of it, and its sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fixtures
from grpo_jax import sharding
from grpo_jax.models import lora, quant, qwen, weights

VOCAB = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return fixtures.make_checkpoint(tmp_path_factory.mktemp("ckpts"), "qwen3", VOCAB)


def _batch(seed=0, batch=4, length=9):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (batch, length))
  mask = np.ones((batch, length), np.int32)
  mask[1, :3] = 0
  tokens[1, :3] = 0
  return jnp.asarray(tokens), jnp.asarray(mask)


def _forward(cfg, dtype=jnp.float32):
  model = qwen.Qwen(cfg, dtype=dtype, param_dtype=dtype)

  @jax.jit
  def f(variables, tokens, mask):
    hidden, _ = model.apply(variables, tokens, qwen.positions_from_mask(mask), mask)
    return model.apply(variables, hidden, method=qwen.Qwen.logits)
  return f


def test_int8_kernels_follow_the_absmax_formula(checkpoint):
  params, cfg = weights.load_checkpoint(checkpoint)
  qparams = quant.quantize(params)
  assert quant.is_quantized(qparams) and not quant.is_quantized(params)
  deq = quant.dequantize(qparams)
  for name, (parent, in_ndim) in quant.KERNELS.items():
    w = np.asarray(params["layers"][parent][name]["kernel"], np.float64)
    node = qparams["layers"][parent][name]
    assert "kernel" not in node and node["kernel_q"].dtype == jnp.int8
    in_axes = tuple(range(1, 1 + in_ndim))
    scale = np.abs(w).max(axis=in_axes) / 127  # NumPy, per layer and output channel
    np.testing.assert_allclose(node["kernel_scale"], scale, rtol=1e-6)
    q = np.asarray(node["kernel_q"], np.int64)
    assert np.abs(q).max() == 127 and q.shape == w.shape
    step = np.expand_dims(scale, in_axes)
    assert (np.abs(q * step - w) <= step / 2 * (1 + 1e-5)).all(), name
    np.testing.assert_allclose(deq["layers"][parent][name]["kernel"], q * step, rtol=1e-6)
  # Everything else is untouched.
  assert qparams["embed_tokens"]["embedding"] is params["embed_tokens"]["embedding"]
  assert qparams["layers"]["self_attn"]["q_norm"]["weight"] is params["layers"]["self_attn"][
      "q_norm"]["weight"]
  assert quant.dequantize(params) is params


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_model_on_int8_kernels_is_the_model_on_their_values(checkpoint, dtype):
  params, cfg = weights.load_checkpoint(checkpoint, param_dtype=dtype)
  qparams = quant.quantize(params)
  f = _forward(cfg, dtype)
  tokens, mask = _batch()
  got = np.asarray(f({"params": qparams}, tokens, mask))
  want = np.asarray(f({"params": quant.dequantize(qparams)}, tokens, mask))
  np.testing.assert_array_equal(got, want)
  # Half an int8 step per weight moves the logits, but not far (fp32: a property, not a bound).
  base = np.asarray(f({"params": params}, tokens, mask))
  real = np.asarray(mask).astype(bool)
  assert 0 < np.abs(got - base)[real].max() < 0.1 * np.abs(base).max()


def test_qlora_adapters_on_an_int8_base(checkpoint, tmp_path):
  params, cfg = weights.load_checkpoint(checkpoint)
  qparams = quant.quantize(params)
  deq = quant.dequantize(qparams)
  lcfg = lora.LoraConfig(rank=3, alpha=6, quantize="int8")
  adapters = lora.init(jax.random.key(0), cfg, lcfg)
  f = _forward(cfg)
  tokens, mask = _batch(1)
  base = np.asarray(f(lora.variables(qparams, None, lcfg), tokens, mask))
  np.testing.assert_array_equal(np.asarray(f(lora.variables(qparams, adapters, lcfg), tokens,
                                             mask)), base)

  model = qwen.Qwen(cfg)

  def loss(adapters, params):
    variables = lora.variables(params, adapters, lcfg)
    hidden, _ = model.apply(variables, tokens, qwen.positions_from_mask(mask), mask)
    logp = jax.nn.log_softmax(model.apply(variables, hidden, method=qwen.Qwen.logits), -1)
    return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean()

  moved = jax.tree.map(lambda x: x + 0.2, adapters)
  g_int8 = jax.jit(jax.grad(loss))(moved, qparams)
  g_deq = jax.jit(jax.grad(loss))(moved, deq)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      x, y, rtol=1e-5, atol=1e-5 * float(jnp.abs(y).max())), g_int8, g_deq)

  adapted = np.asarray(f(lora.variables(qparams, moved, lcfg), tokens, mask))
  merged = lora.merge(qparams, moved, lcfg)
  assert merged["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.float32
  real = np.asarray(mask).astype(bool)
  assert np.abs(adapted - np.asarray(f({"params": merged}, tokens, mask)))[real].max() <= 1e-4
  out = lora.save_merged(qparams, moved, cfg, lcfg, tmp_path / "merged")
  reloaded, _ = weights.load_checkpoint(out)
  assert np.abs(adapted - np.asarray(f({"params": reloaded}, tokens, mask)))[real].max() <= 1e-4
  with pytest.raises(ValueError, match="model.lora.quantize"):
    lora.LoraConfig(rank=3, alpha=6, quantize="nf4")


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 2, 4)])
def test_sharded_int8_base_gives_the_one_device_forward(checkpoint, mesh_shape):
  params, cfg = weights.load_checkpoint(checkpoint)
  qparams = quant.quantize(params)
  f = _forward(cfg)
  tokens, mask = _batch(2, batch=8)
  want = np.asarray(f({"params": qparams}, tokens, mask))
  mesh = sharding.make_mesh(mesh_shape)
  shardings = sharding.param_shardings(quant.logical_axes(cfg), quant.abstract(cfg), mesh)
  placed = jax.device_put(qparams, shardings)
  up = placed["layers"]["mlp"]["up_proj"]
  assert up["kernel_q"].addressable_shards[0].data.shape == (
      cfg.num_layers, 64 // mesh_shape[1], 96 // mesh_shape[2])
  assert up["kernel_scale"].addressable_shards[0].data.shape == (cfg.num_layers,
                                                                 96 // mesh_shape[2])
  batch = sharding.batch_sharding(mesh)
  got = f({"params": placed}, jax.device_put(tokens, batch), jax.device_put(mask, batch))
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_load_quantized_equals_quantize_of_the_loaded_params(checkpoint):
  params, cfg = weights.load_checkpoint(checkpoint, param_dtype=jnp.bfloat16)
  want = quant.quantize(params)
  mesh = sharding.make_mesh((1, 2, 4))
  got, got_cfg = quant.load_quantized(checkpoint, jnp.bfloat16, mesh=mesh)
  assert got_cfg == cfg
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), got, want)
  shardings = sharding.param_shardings(quant.logical_axes(cfg), quant.abstract(cfg, jnp.bfloat16),
                                       mesh)
  jax.tree.map(lambda x, s: (x.sharding == s) or pytest.fail(f"{x.sharding} != {s}"), got,
               shardings)
  alone, _ = quant.load_quantized(checkpoint, jnp.bfloat16)
  assert alone["layers"]["mlp"]["down_proj"]["kernel_q"].dtype == jnp.int8
