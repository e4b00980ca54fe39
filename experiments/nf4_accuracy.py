"""How much a 4-bit NF4 base (QLoRA) moves a model, measured before grpo_jax stores one: the seven
projection kernels of a tiny random Qwen2 replaced by their NF4 dequantization (qwix 0.1.8, and
bitsandbytes 0.50.2 on the same weights), against the fp32 base, beside bf16 and grpo_jax's int8.

    pip install --no-deps --target /tmp/nf4_deps qwix==0.1.8 bitsandbytes==0.50.2
    PYTHONPATH=/tmp/nf4_deps python3 experiments/nf4_accuracy.py

Neither library is a grpo_jax dependency: this script is the only user. Printed per variant: the
dequantized weights' largest error relative to each block's absmax, and for the model the largest
|Δ logit|, the mean KL(base || variant) per token and the top-1 agreement with the base, on 8
random sequences of 64 tokens. And qwix against bitsandbytes: their dequantized weights' largest
difference, without and with double quantization.

NF4 as QLoRA defines it (and bitsandbytes computes it): blocks of 64 consecutive weights of a
row of transformers' [out, in] weight share one absmax; each weight becomes the nearest of the
16 NF4 levels times that absmax. Double quantization stores the absmax values themselves in 8
bits: bitsandbytes subtracts their mean and quantizes blocks of 256 with its dynamic 8-bit map;
here qwix quantizes the same centred blocks of 256 to int8 (absmax), the nearest qwix has.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo_jax.models import quant, qwen  # noqa: E402

BLOCK, BLOCK2 = 64, 256
CFG = qwen.QwenConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
                      qkv_bias=True)


def _rows(w, n_in):
  """Our kernel [*in, *out] (one layer) as transformers' weight [out, in]."""
  return np.asarray(w, np.float32).reshape(int(np.prod(w.shape[:n_in])), -1).T


def _back(rows, shape):
  return np.ascontiguousarray(rows.T).reshape(shape)


def qwix_nf4(rows, double: bool):
  """qwix's NF4 dequantization of [out, in] rows (blocks of 64 along in)."""
  import qwix
  q = qwix.quantize(jnp.asarray(rows), "nf4", channelwise_axes=(0,), tiled_axes={1: BLOCK})
  if double:
    absmax = q.scale.reshape(-1)
    mean = absmax.mean()
    pad = (-absmax.size) % BLOCK2
    centred = jnp.pad(absmax - mean, (0, pad)).reshape(-1, BLOCK2)
    q2 = qwix.quantize(centred, jnp.int8, channelwise_axes=(0,))
    restored = qwix.dequantize(q2).reshape(-1)[:absmax.size] + mean
    q = q.replace(scale=restored.reshape(q.scale.shape)) if hasattr(q, "replace") else (
        type(q)(q.qvalue, restored.reshape(q.scale.shape), q.zero_point, q.qtype))
  return np.asarray(qwix.dequantize(q), np.float32)


def bnb_nf4(rows, double: bool):
  """bitsandbytes' NF4 dequantization of the same rows (its CPU path)."""
  import torch
  import bitsandbytes.functional as F
  w = torch.from_numpy(np.ascontiguousarray(rows))
  packed, state = F.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4",
                                  compress_statistics=double)
  return F.dequantize_4bit(packed, state).numpy()


def _int8(rows):
  """grpo_jax's int8 (quant.py: absmax per output channel) on [out, in] rows."""
  node = quant._quantize_kernel(jnp.asarray(rows.T)[None], 1)  # pylint: disable=protected-access
  return np.asarray(quant.dequantize_kernel(node, 1, jnp.float32))[0].T


def variant_params(params, fn):
  """params with every projection kernel replaced, layer by layer, by fn([out, in] rows)."""
  out = quant.copy_tree(params)
  for name, (parent, n_in) in quant.KERNELS.items():
    node = out["layers"][parent][name]
    w = np.asarray(node["kernel"])
    node["kernel"] = jnp.asarray(np.stack([_back(fn(_rows(w[i], n_in)), w.shape[1:])
                                           for i in range(w.shape[0])]))
  return out


def block_error(params, approx):
  """Largest |W - W'| over all kernels, relative to the absmax of the weight's block of 64."""
  worst = 0.0
  for name, (parent, n_in) in quant.KERNELS.items():
    w, v = (np.asarray(p["layers"][parent][name]["kernel"]) for p in (params, approx))
    for i in range(w.shape[0]):
      a, b = _rows(w[i], n_in), _rows(v[i], n_in)
      absmax = np.abs(a.reshape(a.shape[0], -1, BLOCK)).max(-1, keepdims=True)
      err = np.abs((a - b).reshape(absmax.shape[0], -1, BLOCK)) / absmax
      worst = max(worst, float(err.max()))
  return worst


def main():
  params = qwen.init_params(CFG, jax.random.key(0))
  model = qwen.Qwen(CFG)
  tokens = jax.random.randint(jax.random.key(1), (8, 64), 0, CFG.vocab_size)
  mask = jnp.ones_like(tokens)

  @jax.jit
  def logits(p):
    hidden, _ = model.apply({"params": p}, tokens, qwen.positions_from_mask(mask), mask)
    return model.apply({"params": p}, hidden, method=qwen.Qwen.logits)

  ref = logits(params)
  ref_logp = jax.nn.log_softmax(ref, -1)
  variants = {
      "bf16": jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params),
      "int8 (grpo_jax)": variant_params(params, _int8),
      "nf4 qwix": variant_params(params, lambda r: qwix_nf4(r, False)),
      "nf4 qwix + double quant (int8)": variant_params(params, lambda r: qwix_nf4(r, True)),
      "nf4 bitsandbytes": variant_params(params, lambda r: bnb_nf4(r, False)),
      "nf4 bitsandbytes + double quant": variant_params(params, lambda r: bnb_nf4(r, True)),
  }
  print(f"model: {CFG.num_layers} layers, D {CFG.hidden_size}, MLP {CFG.intermediate_size}, "
        f"random init (normal 0.02); 8 x 64 random tokens")
  print(f"{'variant':34s} {'block err':>9s} {'max|dlogit|':>11s} {'KL/token':>10s} {'top-1':>7s}")
  for name, p in variants.items():
    out = logits(p)
    logp = jax.nn.log_softmax(out, -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), -1)))
    top1 = float(jnp.mean(jnp.argmax(out, -1) == jnp.argmax(ref, -1)))
    print(f"{name:34s} {block_error(params, p):9.4f} {float(jnp.abs(out - ref).max()):11.3e} "
          f"{kl:10.3e} {top1:7.1%}")
  for double in (False, True):
    diff = 0.0
    for name, (parent, n_in) in quant.KERNELS.items():
      w = np.asarray(params["layers"][parent][name]["kernel"])
      for i in range(w.shape[0]):
        rows = _rows(w[i], n_in)
        diff = max(diff, float(np.abs(qwix_nf4(rows, double) - bnb_nf4(rows, double)).max()))
    biggest = max(float(np.abs(np.asarray(params["layers"][parent][name]["kernel"])).max())
                  for name, (parent, _) in quant.KERNELS.items())
    print(f"qwix vs bitsandbytes dequantized weights{' (double quant)' if double else ''}: "
          f"max |diff| {diff:.3e} (the kernels' max |w| {biggest:.3e})")


if __name__ == "__main__":
  main()
