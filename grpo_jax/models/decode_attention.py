"""A decode step's attention as one kernel: RoPE, the cache write and the attention.

`model.decode_attention='pallas'` (QwenConfig.decode_attention). In the sampler's decode step a
layer's attention takes this step's q, k and v (one token per row, before RoPE) and the
stacked [L, B, K, S, H] caches. With the XLA attention, a GPU compile of it is several kernels a
layer: q's RoPE, the k cache's write (with k's RoPE), the v cache's write, and the scores, mask,
softmax and probs.V (with the layer scan, also a copy of layer l of each cache: a scan's
dynamic slice is a copy on a GPU). benchmarks/gpu_kernels.py --layer lists them.

Here they are one Pallas kernel per layer. Program (b, j) of its (B, K) grid:
- reads row b of q, k and v joined ([B, N + 2K, H]: the caller's concatenation, which XLA
  makes in the same kernel as the projection's partial sums and biases);
- applies RoPE to its G query heads and to k (rotate-half, on the two halves of the head, in the
  compute dtype, as rope.apply_rope does);
- writes k and v at slot `index` of layer `layer` of the caches (the caches are aliased to the
  kernel's outputs: written in place, the layer is a scalar operand, nothing is copied);
- attends over slots 0..index: the step's own slot from registers (as the cache stores it),
  slots before it from the cache in blocks of BLOCK_SLOTS, with a running max and sum (fp32).

Where it runs (jax.lax.platform_dependent, chosen when the program is lowered):
- NVIDIA GPUs: Pallas's Triton backend.
- CPU: Pallas's interpreter, the same kernel run as XLA:CPU ops; slow, for tests.
- elsewhere (TPU): `reference` below, plain jax.numpy (no Mosaic kernel is written).

Numbers against the XLA path (rope.apply_rope, the cache write, qwen.attend over the first
index + 1 slots): the same RoPE and the same cache contents; the same scores and softmax in
fp32, probabilities cast to the compute dtype before they multiply V; qwen.attend divides by the
sum before that cast, this kernel after the product (as flash attention does). fp32: equal to
rounding (tests/decode_attention_test.py, <= 1e-5); bf16: within bf16's rounding. A row that
sees none of slots 0..index gets the mean of v over them, as qwen.attend gives over the slots it
is handed; the sampler makes no such row (a decode step's own slot is always real).

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
from grpo_jax.models.rope import apply_rope

Array = jax.Array

IMPLEMENTATIONS = ("xla", "pallas")  # QwenConfig.decode_attention
BLOCK_SLOTS = 64  # cache slots per step of a program's loop
MIN_ROWS = 16  # Triton's smallest matmul side: the G query heads and half-heads are padded to it


def _both(a, b):
  """Two optional load/store masks as one (None: every element)."""
  return b if a is None else a if b is None else a & b


def _load(ref, mask=None):
  """ref's elements, zeros where mask is False (Triton takes no `other` without a mask). The
  mask is broadcast to the ref's shape first: Triton's lowering broadcasts no lower rank."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def _store(ref, x, mask=None):
  """x into ref where mask is True (broadcast to the ref's shape, as in _load)."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  plgpu.store(ref, x.astype(ref.dtype),
              mask=None if mask is None else jnp.broadcast_to(mask, ref.shape))


def _kernel(layer_ref, index_ref, qkv_ref, cos_ref, sin_ref, mask_ref, k_in, v_in, o_ref,
            k_ref, v_ref, *, heads: int, kv: int, groups: int, head_dim: int):
  """Program (b, j): qkv_ref [W, C], row b of q, k and v joined (W >= N + 2K rows, the rows
  past N + 2K never read); cos_ref, sin_ref [C] fp32 at row b's position; mask_ref [S]; o_ref
  [R, C], a block of R >= G rows over kv head j's G query heads (the rows past G are another
  program's: never stored); k_ref, v_ref [L, S, C]: every layer of row b and kv head j, aliased
  to k_in and v_in (only slot `index` of layer `layer` is written, slots 0..index-1 of it read).
  C >= head_dim columns: blocks wider than the head (a head_dim of 16) are masked to it."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  del k_in, v_in  # the same buffers as k_ref and v_ref
  f32, dtype = jnp.float32, qkv_ref.dtype
  j = pl.program_id(1)
  rows, columns = o_ref.shape
  scale = head_dim ** -0.5
  head = None if columns == head_dim else jnp.arange(columns) < head_dim
  half = head_dim // 2
  # Each half of the head is read as a block of `width` columns (>= MIN_ROWS, Triton's smallest
  # matmul side), the columns past the half masked to zeros, which add nothing to any product.
  width = max(half, MIN_ROWS)
  cols = None if width == half else jnp.arange(width) < half
  halves = (pl.ds(0, width), pl.ds(half, width))
  layer, index = layer_ref[()], index_ref[()]

  def load_halves(ref, at=(), row_mask=None):
    """ref[*at] ([..., C]) -> its two halves, each [..., width]."""
    return tuple(_load(ref.at[(*at, h)], _both(row_mask, cols)) for h in halves)

  def store_halves(ref, at, xs):
    for h, x in zip(halves, xs):
      _store(ref.at[(*at, h)], x, cols)

  # The two halves of RoPE's tables are equal: the first is read.
  cos, sin = (_load(t.at[halves[0]], cols).astype(dtype) for t in (cos_ref, sin_ref))

  def rope(x1, x2):  # apply_rope: x * cos + concat(-x2, x1) * sin, by halves
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin

  ours = (jnp.arange(rows) < groups)[:, None]
  q1, q2 = rope(*load_halves(qkv_ref, (pl.ds(j * groups, rows),), ours))
  k1, k2 = rope(*load_halves(qkv_ref, (pl.ds(heads + j, 1),)))
  v_own = _load(qkv_ref.at[pl.ds(heads + kv + j, 1), :], head)
  own = pl.ds(index, 1)
  store_halves(k_ref, (layer, own), (k1, k2))
  _store(v_ref.at[layer, own, :], v_own, head)
  # The own slot's score and value from registers, as the cache stores them.
  k1, k2, v_own = (x.astype(k_ref.dtype).astype(dtype) for x in (k1, k2, v_own))
  top = ((q1.astype(f32) * k1.astype(f32)).sum(axis=1)
         + (q2.astype(f32) * k2.astype(f32)).sum(axis=1)) * scale  # [R]
  real = plgpu.load(mask_ref.at[own]) > 0  # [1]
  # Hidden slots get fp32's lowest value, as in qwen.attend (a row that sees nothing is then
  # uniform); slots after the query's own get nothing at all.
  top = jnp.where(real, top, jnp.finfo(f32).min)

  def block(i, carry):
    out, top, total = carry
    slot = i * BLOCK_SLOTS + jnp.arange(BLOCK_SLOTS)
    before = slot < index  # the slot being written is never read back
    span = pl.ds(i * BLOCK_SLOTS, BLOCK_SLOTS)
    c1, c2 = load_halves(k_ref, (layer, span), before[:, None])
    v = _load(v_ref.at[layer, span, :], _both(before[:, None], head))
    real = _load(mask_ref.at[span], before) > 0
    scores = (plgpu.dot(q1, c1.astype(dtype), trans_b=True, allow_tf32=False)
              + plgpu.dot(q2, c2.astype(dtype), trans_b=True, allow_tf32=False)) * scale
    scores = jnp.where(real[None, :], scores, jnp.finfo(f32).min)
    scores = jnp.where(before[None, :], scores, -jnp.inf)
    new_top = jnp.maximum(top, scores.max(axis=1))
    rescale = jnp.exp(top - new_top)
    probs = jnp.exp(scores - new_top[:, None])
    total = total * rescale + probs.sum(axis=1)
    out = out * rescale[:, None] + plgpu.dot(probs.astype(dtype), v.astype(dtype),
                                             allow_tf32=False)
    return out, new_top, total

  # The own slot is the first term of the running sums: probability exp(0) = 1 times its v.
  carry = (jnp.broadcast_to(v_own.astype(f32), (rows, columns)), top, jnp.ones((rows,), f32))
  out, _, total = jax.lax.fori_loop(0, (index + BLOCK_SLOTS - 1) // BLOCK_SLOTS, block, carry)
  _store(o_ref, out / total[:, None], _both(ours, head))


def _pallas(q_BNH, k_BKH, v_BKH, cos_BH, sin_BH, k_LBKSH, v_LBKSH, layer, mask_BS, index, *,
            interpret: bool):
  # Imported here, not with the module: the model imports this one, and Pallas's experimental
  # API should cost nothing to a run that does not ask for the kernel.
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  b, n, h = q_BNH.shape
  num_layers, _, kv, s, _ = k_LBKSH.shape
  g = n // kv
  rows = max(MIN_ROWS, 1 << (g - 1).bit_length())
  qkv_BMH = jnp.concatenate([q_BNH, k_BKH, v_BKH], axis=1)
  # A block's sides are powers of two: the row's block covers q, k, v and the last program's R;
  # on the head axis, both halves' blocks of at least MIN_ROWS columns.
  width = 1 << (max(n + 2 * kv, (kv - 1) * g + rows) - 1).bit_length()
  c = max(h, 2 * MIN_ROWS)
  scalar = pl.BlockSpec((), lambda i, j: ())
  row = pl.BlockSpec((None, width, c), lambda i, j: (i, 0, 0))
  table = pl.BlockSpec((None, c), lambda i, j: (i, 0))
  row_mask = pl.BlockSpec((None, s), lambda i, j: (i, 0))
  cache = pl.BlockSpec((num_layers, None, None, s, c), lambda i, j: (0, i, j, 0, 0))
  per_head = pl.BlockSpec((None, None, rows, c), lambda i, j: (i, j, 0, 0))
  out, k_LBKSH, v_LBKSH = pl.pallas_call(
      functools.partial(_kernel, heads=n, kv=kv, groups=g, head_dim=h),
      grid=(b, kv),
      in_specs=[scalar, scalar, row, table, table, row_mask, cache, cache],
      out_specs=[per_head, cache, cache],
      out_shape=[jax.ShapeDtypeStruct((b, kv, g, h), q_BNH.dtype),
                 jax.ShapeDtypeStruct(k_LBKSH.shape, k_LBKSH.dtype),
                 jax.ShapeDtypeStruct(v_LBKSH.shape, v_LBKSH.dtype)],
      input_output_aliases={6: 1, 7: 2},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="decode_attention")(
          layer, index, qkv_BMH, cos_BH, sin_BH, mask_BS, k_LBKSH, v_LBKSH)
  return out.reshape(b, n, h), k_LBKSH, v_LBKSH


def reference(q_BNH, k_BKH, v_BKH, cos_BH, sin_BH, k_LBKSH, v_LBKSH, layer, mask_BS, index):
  """The kernel's contract in jax.numpy; the path on platforms without the kernel."""
  b, n, h = q_BNH.shape
  kv, s = k_LBKSH.shape[2], k_LBKSH.shape[3]
  tables = (cos_BH[:, None], sin_BH[:, None])  # one position per row: [B, 1, H]
  write = lambda c, new: jax.lax.dynamic_update_slice(
      c, new[None, :, :, None].astype(c.dtype), (layer, 0, 0, index, 0))
  k_LBKSH = write(k_LBKSH, apply_rope(k_BKH, tables))
  v_LBKSH = write(v_LBKSH, v_BKH)
  # The rows may be the cache's first b only (the sampler's compacted live rows).
  k, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)[:b].astype(q_BNH.dtype)
          for c in (k_LBKSH, v_LBKSH))
  q_BKGH = apply_rope(q_BNH, tables).reshape(b, kv, n // kv, h)
  scores = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k, preferred_element_type=jnp.float32)
  scores = jnp.where((mask_BS > 0)[:, None, None, :], scores * h ** -0.5,
                     jnp.finfo(jnp.float32).min)
  scores = jnp.where(jnp.arange(s) <= index, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_BNH.dtype)
  out = jnp.einsum("BKGS,BKSH->BKGH", probs, v).reshape(b, n, h)
  return out, k_LBKSH, v_LBKSH


def check_head_dim(head_dim: int) -> None:
  if head_dim < MIN_ROWS or head_dim & (head_dim - 1):
    raise ValueError(f"decode_attention='pallas' needs a head_dim that is a power of two >= "
                     f"{MIN_ROWS} (Triton's block sides), got {head_dim}: use 'xla'")


def step(q_BNH: Array, k_BKH: Array, v_BKH: Array, rope_BH: tuple[Array, Array],
         k_LBKSH: Array, v_LBKSH: Array, layer, mask_BS: Array, index, *,
         mesh=None) -> tuple[Array, Array, Array]:
  """One layer's attention in a decode step. q [B, N, H], k and v [B, K, H]: this step's, before
  RoPE; rope_BH: the fp32 (cos, sin) [B, H] at each row's position (qwen.rope_tables); the
  stacked caches [L, B', K, S, H] (B' >= B: the rows are the cache's first B); the query sits at slot `index`, and attends to slots
  0..index whose mask [B, S] is > 0. -> (out [B, N, H], k cache, v cache), the caches with k
  (after RoPE) and v written at slot `index` of layer `layer`."""
  b, n, h = q_BNH.shape
  kv = k_LBKSH.shape[2]
  if n % kv:
    raise ValueError(f"decode attention: {n} query heads are not a multiple of {kv} kv heads")
  check_head_dim(h)
  args = (q_BNH, k_BKH, v_BKH, *rope_BH, k_LBKSH, v_LBKSH, jnp.asarray(layer, jnp.int32),
          mask_BS.astype(jnp.int32), jnp.asarray(index, jnp.int32))

  def run(*a):
    return jax.lax.platform_dependent(
        *a, cuda=functools.partial(_pallas, interpret=False),
        cpu=functools.partial(_pallas, interpret=True), default=reference)

  if mesh is None or mesh.size == 1:
    return run(*args)
  rows = sharding_lib.logical_to_spec(P("batch"), (b,), mesh)[0]
  tensor = mesh.shape["tensor"]
  heads = "tensor" if tensor > 1 and kv % tensor == 0 else None
  per_row, cache = P(rows, heads, None), P(None, rows, heads, None, None)
  return jax.shard_map(
      run, mesh=mesh,
      in_specs=(per_row, per_row, per_row, P(rows, None), P(rows, None), cache, cache, P(),
                P(rows, None), P()),
      out_specs=(per_row, cache, cache), check_vma=False)(*args)
