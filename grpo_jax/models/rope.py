"""Rotary position embeddings in transformers' convention (halves rotated, not interleaved
pairs): the model's layers (qwen.py) and the decode step's attention (decode_attention.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def rope_tables(positions_BT: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
  """RoPE's fp32 (cos, sin) [B, T, 1, H] at these positions, in transformers' convention (halves
  rotated, not interleaved pairs). Made once per forward and carried through the layer scan: a
  GPU compile of the scan made them again in every layer (two kernels a layer and step)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
  emb = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)[:, :, None, :]
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTnH: Array, tables: tuple[Array, Array]) -> Array:
  cos, sin = (t.astype(x_BTnH.dtype) for t in tables)
  x1, x2 = jnp.split(x_BTnH, 2, axis=-1)
  return x_BTnH * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
