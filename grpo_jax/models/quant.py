"""A quantized frozen base for QLoRA: the seven projection kernels stored as int8 with one fp32
scale per output channel (absmax), or as 4-bit NF4 codes with one fp32 absmax per block of 64
inputs (the QLoRA paper's NormalFloat, through qwix), dequantized by the model where it
multiplies by them.

    qparams = quant.quantize(params)          # q/k/v/o/gate/up/down kernels -> int8 + scale
    hidden, _ = model.apply(lora.variables(qparams, adapters, lcfg), tokens, positions, mask)
    shardings = sharding.param_shardings(quant.logical_axes(cfg), quant.abstract(cfg), mesh)

A kernel W [L, *in, *out] becomes kernel_q = round(W / s) in [-127, 127] (int8, same layout,
same logical axes) and kernel_scale s = max|W| over the input dims / 127, shape [L, *out]; the
dequantized W' = kernel_q · s is within s / 2 of W entry by entry. The embedding, the LM head,
norms and biases stay in their dtype. Only the frozen base of a LoRA run is meant to be stored
this way: nothing here trains int8 weights.

NF4 (mode 'nf4'): the kernel flattened to [L, IN, OUT] (transformers' [out, in] weight
transposed) is cut into blocks of NF4_BLOCK consecutive inputs per output channel, as
bitsandbytes cuts each row of the [out, in] weight; kernel_q holds each weight's index among
the 16 NF4 levels (uint4, the kernel's layout) and kernel_scale the block's absmax [L, IN / 64,
*out]; W' = level[kernel_q] · absmax. qwix's NF4 equals bitsandbytes' on the same weights
(experiments/nf4_accuracy.py). The absmax values are not quantized again (no double
quantization).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax import sharding as sharding_lib
from grpo_jax.models import nf4, qwen, weights

# target -> (parent module in a layer, number of input dims of the kernel), as models/lora.py.
KERNELS = {"q_proj": ("self_attn", 1), "k_proj": ("self_attn", 1), "v_proj": ("self_attn", 1),
           "o_proj": ("self_attn", 2), "gate_proj": ("mlp", 1), "up_proj": ("mlp", 1),
           "down_proj": ("mlp", 1)}
MODES = ("none", "int8", "nf4")
NF4_BLOCK = nf4.BLOCK


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


def _nf4_kernel(w: jax.Array, in_ndim: int) -> dict[str, jax.Array]:
  """NF4 codes (uint4, w's layout) and per-block absmax [L, IN / NF4_BLOCK, *out] (fp32)."""
  import qwix  # pylint: disable=import-outside-toplevel
  l, n_in = w.shape[0], math.prod(w.shape[1:1 + in_ndim])
  if n_in % NF4_BLOCK:
    raise ValueError(f"model.lora.quantize='nf4': a kernel with {n_in} inputs ({w.shape}) is "
                     f"not a whole number of blocks of {NF4_BLOCK}")
  q = qwix.quantize(w.astype(jnp.float32).reshape(l, n_in, -1), "nf4", channelwise_axes=(0, 2),
                    tiled_axes={1: NF4_BLOCK})
  out_shape = w.shape[1 + in_ndim:]
  return {"kernel_q": q.qvalue.reshape(w.shape),
          "kernel_scale": q.scale.reshape(l, n_in // NF4_BLOCK, *out_shape)}


def check_shapes(cfg: qwen.QwenConfig, mode: str) -> None:
  """ValueError (naming model.lora.quantize) when a kernel of this model cannot be stored in
  mode: NF4 needs each kernel's inputs to be whole blocks of NF4_BLOCK."""
  if mode != "nf4":
    return
  base = qwen.abstract_params(cfg)
  for name, (parent, in_ndim) in KERNELS.items():
    shape = base["layers"][parent][name]["kernel"].shape
    n_in = math.prod(shape[1:1 + in_ndim])
    if n_in % NF4_BLOCK:
      raise ValueError(f"model.lora.quantize='nf4': {name} has {n_in} inputs, not a whole number "
                       f"of blocks of {NF4_BLOCK}; use quantize='int8' for this model")


def quantize(params, mode: str = "int8"):
  """The params with the seven projection kernels as int8 + per-output-channel scale, or as
  NF4 codes + per-block absmax (mode 'nf4')."""
  if mode not in MODES[1:]:
    raise ValueError(f"quant.quantize: mode {mode!r} is not one of {MODES[1:]}")
  out = copy_tree(params)
  for name, (parent, in_ndim) in KERNELS.items():
    node = out["layers"][parent][name]
    fn = _nf4_kernel if mode == "nf4" else _quantize_kernel
    node.update(fn(node.pop("kernel"), in_ndim))
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
  """kernel_q · kernel_scale of one quantized node (stacked over layers), in dtype: int8 times
  the channel's scale, or NF4's level times the block's absmax."""
  if node["kernel_q"].dtype == jnp.uint4:
    return nf4.dequantize(node["kernel_q"], node["kernel_scale"], 1, in_ndim, dtype)
  scale = jnp.expand_dims(node["kernel_scale"], tuple(range(1, 1 + in_ndim)))
  return (node["kernel_q"].astype(jnp.float32) * scale).astype(dtype)


def abstract(cfg: qwen.QwenConfig, param_dtype=jnp.float32, mode: str = "int8"):
  """ShapeDtypeStructs of the quantized params (nothing allocated)."""
  return jax.eval_shape(lambda p: quantize(p, mode), qwen.abstract_params(cfg, param_dtype))


def logical_axes(cfg: qwen.QwenConfig, mode: str = "int8"):
  """kernel_q keeps the kernel's logical names; kernel_scale takes those of its output dims
  (NF4: after an unsharded axis of blocks)."""
  axes = copy_tree(qwen.logical_axes(cfg))
  for name, (parent, in_ndim) in KERNELS.items():
    node = axes["layers"][parent][name]
    names = tuple(node.pop("kernel"))
    node["kernel_q"] = P(*names)
    blocks = (None,) if mode == "nf4" else ()
    node["kernel_scale"] = P(names[0], *blocks, *names[1 + in_ndim:])
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
