"""A decode step's attention as one kernel that reads the KV cache where it lies.

`model.decode_attention='pallas'` (QwenConfig.decode_attention). In the sampler's decode step
the layers run as a scan over the stacked weights and the stacked [L, B, K, S, H] cache. With
the XLA attention, a GPU compile of each layer's attention is: a copy of layer l of the k cache
and one of the v cache (a scan's dynamic slice is a copy on a GPU: 2 x B*K*S*H elements written
and read back, per layer and step), then the scores, the mask, the max, the sum, the cast of the
probabilities and probs.V, one kernel each (benchmarks/gpu_kernels.py --layer).

Here that is one Pallas kernel per layer. Program (b, j) of its (B, K) grid holds the G query
heads of kv head j of row b, reads layer `layer` of the cache in place (the layer is a scalar
operand, not a copy), walks the slots 0..index (the causal rule: the query sits at slot
`index`) in blocks of BLOCK_SLOTS with a running max and sum (fp32), and writes its [G, H].

Where it runs (jax.lax.platform_dependent, chosen when the program is lowered):
- NVIDIA GPUs: Pallas's Triton backend.
- CPU: Pallas's interpreter, the same kernel run as XLA:CPU ops; slow, for tests.
- elsewhere (TPU): `reference` below, plain jax.numpy (no Mosaic kernel is written).

Numbers against qwen.attend on the cache's first index + 1 slots: the same scores and softmax
in fp32, probabilities cast to the compute dtype before they multiply V; qwen.attend divides by
the sum before that cast, this kernel after the product (as flash attention does). fp32: equal
to rounding (tests/decode_attention_test.py, <= 1e-5); bf16: within bf16's rounding. A row
that sees none of slots 0..index gets the mean of v over them, as qwen.attend gives over the
slots it is handed; the sampler makes no such row (a decode step's own slot is always real).

With a mesh, the kernel runs per device under jax.shard_map: rows split as the batch is
(sharding.RULES['batch']), kv heads over 'tensor' where it divides them, as the sampler lays the
cache (sampler.CACHE_AXES).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax import sharding as sharding_lib

Array = jax.Array

IMPLEMENTATIONS = ("xla", "pallas")  # QwenConfig.decode_attention
BLOCK_SLOTS = 64  # cache slots per step of a program's loop
MIN_ROWS = 16  # Triton's smallest matmul side: a program's G query heads are padded to this


def _kernel(layer_ref, index_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, *, groups: int,
            scale: float):
  """One (row, kv head): q_ref, o_ref [Gp, H], a block of Gp >= G rows over the G query heads
  (the rows past G are another program's: never stored, and loaded as zeros); k_ref, v_ref
  [L, S, H] (every layer of this row and head: only layer `layer` is read); mask_ref [S]."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  rows, head_dim = q_ref.shape
  slots = mask_ref.shape[0]
  layer, index = layer_ref[()], index_ref[()]
  ours = (jnp.arange(rows) < groups)[:, None]
  q = plgpu.load(q_ref, mask=ours, other=0)

  def block(i, carry):
    out, top, total = carry
    slot = i * BLOCK_SLOTS + jnp.arange(BLOCK_SLOTS)
    inside = slot < slots  # the last block may run past the cache's end
    span = pl.ds(i * BLOCK_SLOTS, BLOCK_SLOTS)
    k = plgpu.load(k_ref.at[layer, span, :], mask=inside[:, None], other=0).astype(q.dtype)
    v = plgpu.load(v_ref.at[layer, span, :], mask=inside[:, None], other=0).astype(q.dtype)
    real = plgpu.load(mask_ref.at[span], mask=inside, other=0) > 0
    scores = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * scale  # [Gp, BLOCK_SLOTS] fp32
    # Hidden slots get fp32's lowest value, as in qwen.attend (a row that sees nothing is then
    # uniform); slots past the query's own (and past the cache) get nothing at all.
    scores = jnp.where(real[None, :], scores, jnp.finfo(jnp.float32).min)
    scores = jnp.where((slot <= index)[None, :], scores, -jnp.inf)
    new_top = jnp.maximum(top, scores.max(axis=1))
    rescale = jnp.exp(top - new_top)
    probs = jnp.exp(scores - new_top[:, None])
    total = total * rescale + probs.sum(axis=1)
    out = out * rescale[:, None] + plgpu.dot(probs.astype(q.dtype), v, allow_tf32=False)
    return out, new_top, total

  carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  out, _, total = jax.lax.fori_loop(0, index // BLOCK_SLOTS + 1, block, carry)
  plgpu.store(o_ref, (out / total[:, None]).astype(o_ref.dtype), mask=ours)


def _pallas(q_BNH, k_LBKSH, v_LBKSH, layer, mask_BS, index, *, interpret: bool):
  # Imported here, not with the module: the model imports this one, and Pallas's experimental
  # API should cost nothing to a run that does not ask for the kernel.
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  b, n, h = q_BNH.shape
  num_layers, _, kv, s, _ = k_LBKSH.shape
  g = n // kv
  rows = max(MIN_ROWS, 1 << (g - 1).bit_length())
  q_BKGH = q_BNH.reshape(b, kv, g, h)
  scalar = pl.BlockSpec((), lambda i, j: ())
  per_head = pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0))
  cache = pl.BlockSpec((num_layers, None, None, s, h), lambda i, j: (0, i, j, 0, 0))
  row_mask = pl.BlockSpec((None, s), lambda i, j: (i, 0))
  out = pl.pallas_call(
      functools.partial(_kernel, groups=g, scale=h ** -0.5),
      grid=(b, kv),
      in_specs=[scalar, scalar, per_head, cache, cache, row_mask],
      out_specs=per_head,
      out_shape=jax.ShapeDtypeStruct((b, kv, g, h), q_BNH.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="decode_attention")(
          layer, index, q_BKGH, k_LBKSH, v_LBKSH, mask_BS)
  return out.reshape(b, n, h)


def reference(q_BNH, k_LBKSH, v_LBKSH, layer, mask_BS, index):
  """The kernel's contract in jax.numpy: attention of each row's query (at slot `index`) over
  slots 0..index of layer `layer`, fp32 scores; the path on platforms without the kernel."""
  b, n, h = q_BNH.shape
  kv, s = k_LBKSH.shape[2], k_LBKSH.shape[3]
  k, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False).astype(q_BNH.dtype)
          for c in (k_LBKSH, v_LBKSH))
  q_BKGH = q_BNH.reshape(b, kv, n // kv, h)
  scores = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k, preferred_element_type=jnp.float32)
  scores = jnp.where((mask_BS > 0)[:, None, None, :], scores * h ** -0.5,
                     jnp.finfo(jnp.float32).min)
  scores = jnp.where(jnp.arange(s) <= index, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_BNH.dtype)
  return jnp.einsum("BKGS,BKSH->BKGH", probs, v).reshape(b, n, h)


def check_head_dim(head_dim: int) -> None:
  if head_dim < MIN_ROWS or head_dim & (head_dim - 1):
    raise ValueError(f"decode_attention='pallas' needs a head_dim that is a power of two >= "
                     f"{MIN_ROWS} (Triton's block sides), got {head_dim}: use 'xla'")


def attend(q_BNH: Array, k_LBKSH: Array, v_LBKSH: Array, layer, mask_BS: Array, index, *,
           mesh=None) -> Array:
  """Each row's one query [B, N, H] (at cache slot `index`) against layer `layer` of the
  stacked cache [L, B, K, S, H] (k and v), slots 0..index whose mask [B, S] is > 0. -> [B, N, H].
  """
  b, n, h = q_BNH.shape
  kv = k_LBKSH.shape[2]
  if n % kv:
    raise ValueError(f"decode attention: {n} query heads are not a multiple of {kv} kv heads")
  check_head_dim(h)
  args = (q_BNH, k_LBKSH, v_LBKSH, jnp.asarray(layer, jnp.int32), mask_BS.astype(jnp.int32),
          jnp.asarray(index, jnp.int32))

  def run(*a):
    return jax.lax.platform_dependent(
        *a, cuda=functools.partial(_pallas, interpret=False),
        cpu=functools.partial(_pallas, interpret=True), default=reference)

  if mesh is None or mesh.size == 1:
    return run(*args)
  rows = sharding_lib.logical_to_spec(P("batch"), (b,), mesh)[0]
  tensor = mesh.shape["tensor"]
  heads = "tensor" if tensor > 1 and kv % tensor == 0 else None
  return jax.shard_map(
      run, mesh=mesh,
      in_specs=(P(rows, heads, None), P(None, rows, heads, None, None),
                P(None, rows, heads, None, None), P(), P(rows, None), P()),
      out_specs=P(rows, heads, None), check_vma=False)(*args)
