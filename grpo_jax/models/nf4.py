"""NF4 kernels as the model reads them: 4-bit NormalFloat codes and one absmax per block of BLOCK
inputs (the QLoRA paper's format, bitsandbytes' blocking), dequantized through qwix.

    w = nf4.dequantize(q, absmax, lead=1, in_ndim=1, dtype=jnp.bfloat16)

The format's home below both sides: grpo_jax.models.quant stores a base this way and
grpo_jax.models.qwen reads it, so neither imports the other.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

BLOCK = 64  # inputs per absmax block (QLoRA's and bitsandbytes' default)


def dequantize(q, scale, lead: int, in_ndim: int, dtype) -> jax.Array:
  """NF4 codes q [*lead, *in, *out] and absmax [*lead, IN / BLOCK, *out] (lead: 0 or 1
  leading axes, e.g. the layer) as the kernel in dtype, through qwix."""
  import qwix  # pylint: disable=import-outside-toplevel
  n_in = math.prod(q.shape[lead:lead + in_ndim])
  flat = (*q.shape[:lead], n_in, -1)
  blocks = (*q.shape[:lead], n_in // BLOCK, -1)
  w = qwix.dequantize(qwix.QArray(q.reshape(flat), scale.astype(jnp.float32).reshape(blocks),
                                  None, "nf4"))
  return w.reshape(q.shape).astype(dtype)
