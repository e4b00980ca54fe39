"""The fused decode attention (model.decode_attention='pallas', grpo_jax/models/decode_attention.py)
against qwen.attend (the einsum the decode step runs otherwise) and a NumPy formula, run here by
Pallas's interpreter: the same kernel program a GPU compiles with Triton."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import sharding
from grpo_jax.models import decode_attention, qwen

L, B, K, S, N = 3, 8, 2, 77, 6  # 77 slots: a last block of 13 of BLOCK_SLOTS = 64
THETA = 10_000.0


def _case(seed=0, dtype=jnp.float32, h=16):
  """This step's q, k, v (before RoPE), positions, the caches and a mask, as NumPy float64 and
  as jax arrays of `dtype` (the mask int)."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, N, h))
  k_new, v_new = rng.normal(size=(2, B, K, h))
  k, v = rng.normal(size=(2, L, B, K, S, h))
  mask = (rng.random((B, S)) > 0.25).astype(np.int32)  # holes anywhere
  mask[1, :30] = 0  # a left-padded prompt
  mask[2] = 0  # a row that sees nothing
  mask[3] = 1
  positions = rng.integers(0, 200, size=B)
  as_jax = tuple(jnp.asarray(x, dtype) for x in (q, k_new, v_new, k, v))
  # Rounded as the jax arrays are, so that NumPy starts from the same numbers.
  q, k_new, v_new, k, v = (np.asarray(x, np.float64) for x in as_jax)
  return (q, k_new, v_new, k, v, mask, positions), as_jax + (jnp.asarray(mask),
                                                            jnp.asarray(positions))


def _tables(positions, h):
  cos, sin = qwen.rope_tables(positions[:, None], h, THETA)
  return cos[:, 0, 0], sin[:, 0, 0]


def _numpy_rope(x, positions):
  """x [B, n, H] at each row's position: halves rotated (transformers' rotate_half)."""
  h = x.shape[-1]
  angle = positions[:, None, None] * THETA ** -(np.arange(0, h, 2) / h)  # [B, 1, H/2]
  x1, x2 = x[..., :h // 2], x[..., h // 2:]
  return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                         x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


def _numpy(q, k_new, v_new, k, v, mask, positions, layer, index):
  """float64: RoPE on q and k, k and v written at slot `index` of layer `layer`, then each
  row's query over slots 0..index; a row that sees none of them gets their mean."""
  h = q.shape[-1]
  g = N // K
  k, v = k.copy(), v.copy()
  k[layer, :, :, index] = _numpy_rope(k_new, positions)
  v[layer, :, :, index] = v_new
  q = _numpy_rope(q, positions)
  out = np.zeros((B, N, h))
  for b in range(B):
    for n in range(N):
      keys, values = k[layer, b, n // g, :index + 1], v[layer, b, n // g, :index + 1]
      scores = keys @ q[b, n] / np.sqrt(h)
      seen = mask[b, :index + 1] > 0
      w = np.where(seen, np.exp(scores - scores[seen].max()), 0.0) if seen.any() else np.ones(
          index + 1)
      out[b, n] = w @ values / w.sum()
  return out, k, v


def _xla_path(q, k_new, v_new, k, v, mask, tables, layer, index):
  """What the decode step runs with decode_attention='xla': qwen.apply_rope, the cache write,
  qwen.attend on the slots 0..index of the layer (the cache's layout, kv heads first)."""
  rope = tuple(t[:, None, None] for t in tables)
  q, k_new = qwen.apply_rope(q[:, None], rope), qwen.apply_rope(k_new[:, None], rope)
  write = lambda c, x: jax.lax.dynamic_update_slice(
      c, x.transpose(0, 2, 1, 3)[None].astype(c.dtype), (layer, 0, 0, index, 0))
  k, v = write(k, k_new), write(v, v_new[:, None])
  out = qwen.attend(q, k[layer][:, :, :index + 1], v[layer][:, :, :index + 1],
                    mask[:, :index + 1], jnp.int32(index), True, None, heads_first=True)
  return out[:, 0], k, v


@pytest.mark.parametrize("h", [16, 64])  # 16: halves of 8, read as blocks of 16 (masked)
@pytest.mark.parametrize("layer,index", [(0, 0), (1, 40), (2, 63), (0, 64), (1, 76)])
def test_fp32_equals_the_xla_path_and_numpy(layer, index, h):
  (q, k_new, v_new, k, v, mask, pos), (qj, knj, vnj, kj, vj, mj, pj) = _case(h=h)
  tables = _tables(pj, h)
  got = jax.jit(decode_attention.step)(qj, knj, vnj, tables, kj, vj, layer, mj, index)
  want = _xla_path(qj, knj, vnj, kj, vj, mj, tables, layer, index)
  exact = _numpy(q, k_new, v_new, k, v, mask, pos, layer, index)
  for part, g, w, e in zip(("out", "k cache", "v cache"), got, want, exact):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0, err_msg=part)
    np.testing.assert_allclose(np.asarray(g), e, atol=1e-5, rtol=0, err_msg=part)
  # Only slot `index` of layer `layer` was written.
  for c, new, old in ((1, got[1], kj), (2, got[2], vj)):
    changed = np.argwhere(np.asarray(new) != np.asarray(old))
    assert set(map(tuple, changed[:, [0, 3]])) <= {(layer, index)}, c
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # v: copied as is
  # The path of platforms without the kernel (TPU) keeps the same contract.
  ref = jax.jit(decode_attention.reference)(qj, knj, vnj, *tables, kj, vj, layer, mj, index)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(np.asarray(r), np.asarray(g), atol=1e-5, rtol=0)


def test_bf16_is_as_close_to_numpy_as_the_xla_path():
  (_, _, _, _, _, mask, pos), args = _case(1, jnp.bfloat16, h=64)
  qj, knj, vnj, kj, vj, mj, pj = args
  tables = _tables(pj, 64)
  as_f64 = lambda x: np.asarray(x, np.float64)
  exact = _numpy(*(as_f64(x) for x in (qj, knj, vnj, kj, vj)), mask, pos, 1, 70)[0]
  raw, k_cache, v_cache = jax.jit(decode_attention.step)(qj, knj, vnj, tables, kj, vj, 1, mj, 70)
  assert raw.dtype == k_cache.dtype == jnp.bfloat16  # the compute dtype, as qwen.attend gives
  xla, xla_k, xla_v = _xla_path(qj, knj, vnj, kj, vj, mj, tables, 1, 70)
  err, err_xla = np.abs(as_f64(raw) - exact).max(), np.abs(as_f64(xla) - exact).max()
  assert err <= max(2 * err_xla, 2 ** -8), (err, err_xla)
  # RoPE in the compute dtype, as qwen.apply_rope: the cache holds what the XLA path writes.
  np.testing.assert_array_equal(as_f64(k_cache), as_f64(xla_k))
  np.testing.assert_array_equal(as_f64(v_cache), as_f64(xla_v))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (CI has 8 CPU devices)")
def test_sharded_equals_one_device():
  """Under a (2, 2, 2) mesh the kernel runs per device (rows over data x fsdp, kv heads over
  tensor): the same numbers and caches."""
  _, (q, k_new, v_new, k, v, mask, pos) = _case(2)
  tables = _tables(pos, 16)
  mesh = sharding.make_mesh((2, 2, 2))
  one = jax.jit(decode_attention.step)(q, k_new, v_new, tables, k, v, 2, mask, 50)
  split = jax.jit(lambda *a: decode_attention.step(*a, mesh=mesh))(
      q, k_new, v_new, tables, k, v, 2, mask, 50)
  for a, b in zip(split, one):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_head_dim_and_heads_are_checked():
  _, (q, k_new, v_new, k, v, mask, pos) = _case()
  tables = _tables(pos, 16)
  z24 = lambda *shape: jnp.zeros((*shape, 24))
  with pytest.raises(ValueError, match="head_dim that is a power of two >= 16.*got 24"):
    decode_attention.step(z24(B, N), z24(B, K), z24(B, K), (z24(B), z24(B)), z24(L, B, K, S),
                          z24(L, B, K, S), 0, mask, 3)
  with pytest.raises(ValueError, match="5 query heads are not a multiple of 2 kv heads"):
    decode_attention.step(q[:, :5], k_new, v_new, tables, k, v, 0, mask, 3)
  with pytest.raises(ValueError, match="decode_attention='flash' is not one of"):
    qwen.QwenConfig(64, 32, 64, 1, 2, 1, 16).with_run(decode_attention="flash")


def test_config_model_decode_attention_reaches_the_model_config():
  from configs import gsm8k
  from grpo_jax import inputs, validate
  config = gsm8k.get_config("tiny")
  tokenizer = list(range(config.model.tiny.vocab_size))
  assert inputs.model_config(config, tokenizer)[0].run.decode_attention == "xla"
  config.model.decode_attention = "pallas"
  assert inputs.model_config(config, tokenizer)[0].run.decode_attention == "pallas"
  config.model.decode_attention = "triton"
  with pytest.raises(validate.ConfigError,
                     match="config.model.decode_attention='triton' is not one of"):
    inputs.model_config(config, tokenizer)
