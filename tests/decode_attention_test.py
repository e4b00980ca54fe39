"""The fused decode attention (model.decode_attention='pallas', grpo_jax/models/decode_attention.py)
against qwen.attend (the einsum the decode step runs otherwise) and a NumPy formula, run here by
Pallas's interpreter: the same kernel program a GPU compiles with Triton."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import sharding
from grpo_jax.models import decode_attention, qwen

L, B, K, S, H, N = 3, 8, 2, 77, 16, 6  # 77 slots: a last block of 13 of BLOCK_SLOTS = 64


def _case(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, N, H))
  k, v = rng.normal(size=(2, L, B, K, S, H))
  mask = (rng.random((B, S)) > 0.25).astype(np.int32)  # holes anywhere
  mask[1, :30] = 0  # a left-padded prompt
  mask[2] = 0  # a row that sees nothing
  mask[3] = 1
  return q, k, v, mask, tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + (jnp.asarray(mask),)


def _numpy(q, k, v, mask, layer, index):
  """float64: each row's query at slot `index` over slots 0..index of layer `layer`; a row that
  sees none of them gets their mean."""
  g = N // K
  out = np.zeros((B, N, H))
  for b in range(B):
    for n in range(N):
      keys, values = k[layer, b, n // g, :index + 1], v[layer, b, n // g, :index + 1]
      scores = keys @ q[b, n] / np.sqrt(H)
      seen = mask[b, :index + 1] > 0
      w = np.where(seen, np.exp(scores - scores[seen].max()), 0.0) if seen.any() else np.ones(
          index + 1)
      out[b, n] = w @ values / w.sum()
  return out


@pytest.mark.parametrize("layer,index", [(0, 0), (1, 40), (2, 63), (0, 64), (1, 76)])
def test_fp32_equals_attend_and_numpy(layer, index):
  q, k, v, mask, (qj, kj, vj, mj) = _case()
  got = np.asarray(jax.jit(decode_attention.attend)(qj, kj, vj, layer, mj, index))
  # qwen.attend on the slots 0..index of the layer, the cache's layout (kv heads first).
  want = np.asarray(qwen.attend(qj[:, None], kj[layer][:, :, :index + 1],
                                vj[layer][:, :, :index + 1], mj[:, :index + 1],
                                jnp.int32(index), True, None, heads_first=True))[:, 0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  np.testing.assert_allclose(got, _numpy(q, k, v, mask, layer, index), atol=1e-5, rtol=0)
  # The path of platforms without the kernel (TPU) keeps the same contract.
  np.testing.assert_allclose(
      np.asarray(jax.jit(decode_attention.reference)(qj, kj, vj, layer, mj, index)), got,
      atol=1e-5, rtol=0)


def test_bf16_is_as_close_to_numpy_as_the_einsum():
  q, k, v, mask, (qj, kj, vj, mj) = _case(1, jnp.bfloat16)
  as_f64 = lambda x: np.asarray(x, np.float64)
  exact = _numpy(as_f64(qj), as_f64(kj), as_f64(vj), mask, 1, 70)
  raw = jax.jit(decode_attention.attend)(qj, kj, vj, 1, mj, 70)
  assert raw.dtype == jnp.bfloat16  # the compute dtype, as qwen.attend gives
  got = as_f64(raw)
  einsum = as_f64(qwen.attend(qj[:, None], kj[1][:, :, :71], vj[1][:, :, :71], mj[:, :71],
                              jnp.int32(70), True, None, heads_first=True)[:, 0])
  err, err_einsum = np.abs(got - exact).max(), np.abs(einsum - exact).max()
  assert err <= max(2 * err_einsum, 2 ** -8), (err, err_einsum)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (CI has 8 CPU devices)")
def test_sharded_equals_one_device():
  """Under a (2, 2, 2) mesh the kernel runs per device (rows over data x fsdp, kv heads over
  tensor): the same numbers."""
  _, _, _, _, (q, k, v, mask) = _case(2)
  mesh = sharding.make_mesh((2, 2, 2))
  one = jax.jit(decode_attention.attend)(q, k, v, 2, mask, 50)
  split = jax.jit(lambda *a: decode_attention.attend(*a, mesh=mesh))(q, k, v, 2, mask, 50)
  np.testing.assert_array_equal(np.asarray(split), np.asarray(one))


def test_head_dim_and_heads_are_checked():
  _, _, _, _, (q, k, v, mask) = _case()
  with pytest.raises(ValueError, match="head_dim that is a power of two >= 16.*got 24"):
    decode_attention.attend(jnp.zeros((B, N, 24)), jnp.zeros((L, B, K, S, 24)),
                            jnp.zeros((L, B, K, S, 24)), 0, mask, 3)
  with pytest.raises(ValueError, match="5 query heads are not a multiple of 2 kv heads"):
    decode_attention.attend(q[:, :5], k, v, 0, mask, 3)
  with pytest.raises(ValueError, match="decode_attention='flash' is not one of"):
    dataclasses.replace(qwen.QwenConfig(64, 32, 64, 1, 2, 1, 16), decode_attention="flash")


def test_config_model_decode_attention_reaches_the_model_config():
  from configs import gsm8k
  from grpo_jax import inputs, validate
  config = gsm8k.get_config("tiny")
  tokenizer = list(range(config.model.tiny.vocab_size))
  assert inputs.model_config(config, tokenizer)[0].decode_attention == "xla"
  config.model.decode_attention = "pallas"
  assert inputs.model_config(config, tokenizer)[0].decode_attention == "pallas"
  config.model.decode_attention = "triton"
  with pytest.raises(validate.ConfigError,
                     match="config.model.decode_attention='triton' is not one of"):
    inputs.model_config(config, tokenizer)
