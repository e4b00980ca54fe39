"""An int8 frozen base for QLoRA: the seven projection kernels stored as int8 with one fp32
scale per output channel (absmax), dequantized by the model where it multiplies by them.

    qparams = quant.quantize(params)          # q/k/v/o/gate/up/down kernels -> int8 + scale
    hidden, _ = model.apply(lora.variables(qparams, adapters, lcfg), tokens, positions, mask)
    shardings = sharding.param_shardings(quant.logical_axes(cfg), quant.abstract(cfg), mesh)

A kernel W [L, *in, *out] becomes kernel_q = round(W / s) in [-127, 127] (int8, same layout,
same logical axes) and kernel_scale s = max|W| over the input dims / 127, shape [L, *out]; the
dequantized W' = kernel_q · s is within s / 2 of W entry by entry. The embedding, the LM head,
norms and biases stay in their dtype. Only the frozen base of a LoRA run is meant to be stored
this way: nothing here trains int8 weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax import sharding as sharding_lib
from grpo_jax.models import qwen, weights

# target -> (parent module in a layer, number of input dims of the kernel), as models/lora.py.
KERNELS = {"q_proj": ("self_attn", 1), "k_proj": ("self_attn", 1), "v_proj": ("self_attn", 1),
           "o_proj": ("self_attn", 2), "gate_proj": ("mlp", 1), "up_proj": ("mlp", 1),
           "down_proj": ("mlp", 1)}
MODES = ("none", "int8")


def copy_tree(tree):
  """New dicts all the way down, the same leaves (arrays or PartitionSpecs)."""
  return {k: copy_tree(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _quantize_kernel(w: jax.Array, in_ndim: int) -> dict[str, jax.Array]:
  w32 = w.astype(jnp.float32)
  axes = tuple(range(1, 1 + in_ndim))  # the input dims (axis 0 is the layer)
  scale = jnp.max(jnp.abs(w32), axis=axes) / 127.0
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel: any scale gives zeros
  expand = jnp.expand_dims(scale, axes)
  q = jnp.clip(jnp.round(w32 / expand), -127, 127).astype(jnp.int8)
  return {"kernel_q": q, "kernel_scale": scale}


def quantize(params):
  """The params with the seven projection kernels as int8 + per-output-channel scale."""
  out = copy_tree(params)
  for name, (parent, in_ndim) in KERNELS.items():
    node = out["layers"][parent][name]
    node.update(_quantize_kernel(node.pop("kernel"), in_ndim))
  return out


def is_quantized(params) -> bool:
  return "kernel_q" in params["layers"]["self_attn"]["q_proj"]


def dequantize(params, dtype=None):
  """Plain params again (kernel = kernel_q · scale, in `dtype`, default the embedding's), e.g.
  to merge adapters into or export; a plain tree is returned unchanged."""
  if not is_quantized(params):
    return params
  dtype = dtype or params["embed_tokens"]["embedding"].dtype
  out = copy_tree(params)
  for name, (parent, in_ndim) in KERNELS.items():
    node = out["layers"][parent][name]  # a new dict: its bias, if any, stays
    node["kernel"] = dequantize_kernel(node, in_ndim, dtype)
    del node["kernel_q"], node["kernel_scale"]
  return out


def dequantize_kernel(node, in_ndim: int, dtype) -> jax.Array:
  """kernel_q · kernel_scale of one quantized node, in dtype."""
  scale = jnp.expand_dims(node["kernel_scale"], tuple(range(1, 1 + in_ndim)))
  return (node["kernel_q"].astype(jnp.float32) * scale).astype(dtype)


def abstract(cfg: qwen.QwenConfig, param_dtype=jnp.float32):
  """ShapeDtypeStructs of the quantized params (nothing allocated)."""
  return jax.eval_shape(quantize, qwen.abstract_params(cfg, param_dtype))


def logical_axes(cfg: qwen.QwenConfig):
  """kernel_q keeps the kernel's logical names; kernel_scale takes those of its output dims."""
  axes = copy_tree(qwen.logical_axes(cfg))
  for name, (parent, in_ndim) in KERNELS.items():
    node = axes["layers"][parent][name]
    names = tuple(node.pop("kernel"))
    node["kernel_q"] = P(*names)
    node["kernel_scale"] = P(names[0], *names[1 + in_ndim:])
  return axes


def load_quantized(path_or_id, param_dtype=jnp.bfloat16, mesh=None):
  """(int8 params, QwenConfig) from a Hugging Face checkpoint, without the full-precision base
  ever on the accelerator: the checkpoint is read into host memory (the CPU device, in
  param_dtype: 15.2 GB of host RAM for a 7B model in bf16), quantized there, and only the int8
  params go to the devices, each in its logical sharding when a mesh is given."""
  with jax.default_device(jax.devices("cpu")[0]):
    params, cfg = weights.load_checkpoint(path_or_id, param_dtype=param_dtype)
    qparams = jax.jit(quantize)(params)
  del params
  if mesh is not None:
    target = sharding_lib.param_shardings(logical_axes(cfg), abstract(cfg, param_dtype), mesh)
  else:
    target = jax.tree.map(lambda _: jax.devices()[0], qparams)
  return jax.device_put(qparams, target), cfg
