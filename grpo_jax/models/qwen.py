"""Qwen2 / Qwen2.5 / Qwen3 decoder in Flax linen, used functionally.

One code path serves the family; the checkpoint's config.json switches the differences:
q/k/v bias (Qwen2), q_norm/k_norm and an explicit head_dim (Qwen3), tied or untied lm_head.

Shape legend: B batch, T query length, S key slots (T without a cache, the cache length with
one), D model width, N query heads, K key/value heads, G = N // K heads per kv head, H head dim,
I MLP width, V vocabulary, L layers.

    cfg = QwenConfig.from_hf(json.load(open("config.json")))
    model = Qwen(cfg)
    params = init_params(cfg, jax.random.key(0))
    hidden_BTD, _ = model.apply({"params": params}, tokens_BT, positions_BT, mask_BT)
    logits_BTV = model.apply({"params": params}, hidden_BTD, method=Qwen.logits)

Masks are explicit: `attn_mask_BS` is 1 where a key slot holds a real token. A query at slot t
sees the key slots s <= t whose mask is 1, so left-padded batches are exact. Positions (RoPE)
are passed separately; `positions_from_mask` gives them for left-padded prompts.

A checkpoint whose config.json says `"is_causal": false` (an embedder such as gte-Qwen2, as
transformers >= 5.2 reads it) is bidirectional: a query sees every key slot whose mask is 1,
later ones included. Such a model has no next-token distribution to decode from, so calling it
with a KV cache raises `BidirectionalDecodeError`.

Parameters carry logical axis names ('vocab', 'embed', 'q_heads', 'kv_heads', 'head_dim',
'mlp', 'norm', 'layers'); grpo_jax.sharding maps them onto the device mesh with one table.
Parameter names follow the Hugging Face checkpoint so the weight map stays readable.

LoRA adapters travel in a second variable collection, 'lora', beside 'params' (built by
grpo_jax.models.lora): a projection whose adapter is there adds its low-rank path; without the
collection the model is the base model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import custom_batching

from grpo_jax.errors import UserError
from grpo_jax.models import decode_attention, nf4
from grpo_jax.models.rope import apply_rope, rope_tables

Array = jax.Array
# {'k': [L, B, K, S, H], 'v': [L, B, K, S, H]}: kv heads before slots, so a decode step's
# attention reads each head's keys contiguously (no per-step transpose of the cache).
Cache = dict[str, Array]

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# RunOptions.attention: None (JAX's choice, XLA today), 'xla', 'cudnn' (NVIDIA GPUs, bf16/fp16).
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn")


class BidirectionalDecodeError(UserError, ValueError):
  """A bidirectional model (is_causal=false, e.g. an embedder) was asked to decode."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How the model runs, not what the checkpoint is: never read from or written to config.json
  (config.model's choices, set by inputs.runtime_options).

  attention: jax.nn.dot_product_attention's `implementation`. None lets JAX choose (XLA today),
    'xla' forces it, 'cudnn' is cuDNN's fused flash kernel on NVIDIA GPUs (bf16/fp16 only); see
    ATTENTION_IMPLEMENTATIONS and docs/performance.md.
  unroll_decode: how the sampler's decode step runs its layers. False, one scan over the
    stacked [L, ...] weights, as prefill and training run them; True, the L layers written out,
    each on its own copy of its weights made once per generate call (see apply_unrolled). On a
    GPU the scan is a loop inside every decode step.
  decode_attention: a decode step's attention. 'xla', the grouped einsum of `attend`; 'pallas',
    one fused kernel per layer that applies RoPE, writes the step's k and v and reads the
    stacked cache in place (grpo_jax/models/decode_attention.py: Triton on NVIDIA GPUs, Pallas's
    interpreter on CPU).
  """
  attention: str | None = None
  unroll_decode: bool = False
  decode_attention: str = "xla"

  def __post_init__(self):
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention={self.attention!r} is not one of "
                       f"{ATTENTION_IMPLEMENTATIONS} (jax.nn.dot_product_attention's)")
    if self.decode_attention not in decode_attention.IMPLEMENTATIONS:
      raise ValueError(f"decode_attention={self.decode_attention!r} is not one of "
                       f"{decode_attention.IMPLEMENTATIONS}")


@dataclasses.dataclass(frozen=True)
class QwenConfig:
  """The architecture, as the checkpoint's config.json says it (from_hf, to_hf), and in `run`
  how this process runs it (RunOptions, which config.json never holds)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = True  # Qwen2: bias on q/k/v projections only.
  o_bias: bool = False  # Qwen3's attention_bias covers o_proj too.
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE.
  max_position_embeddings: int = 32768
  model_type: str = "qwen2"
  # False: every token attends to every real token (config.json "is_causal": false).
  is_causal: bool = True
  run: RunOptions = RunOptions()

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates the two halves of "
                       "each head)")
    if self.run.decode_attention == "pallas":  # the fused kernel's bound on the architecture
      decode_attention.check_head_dim(self.head_dim)

  def with_run(self, **changes) -> "QwenConfig":
    """The same architecture run otherwise: cfg.with_run(unroll_decode=True)."""
    return dataclasses.replace(self, run=dataclasses.replace(self.run, **changes))

  @classmethod
  def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "QwenConfig":
    """Builds the config from a Hugging Face config.json dict (transformers 4.x or 5.x).

    Every error names `source`. What transformers would compute differently (quantized
    weights, RoPE scaling, sliding windows, layer_types other than full attention) is refused
    rather than loaded as something else.
    """
    _check_hf_fields(hf, source)
    rope_theta = _hf_rope_theta(hf, source)
    _check_hf_attention(hf, source)
    head_dim = _hf_head_dim(hf, source)
    model_type, heads = hf["model_type"], hf["num_attention_heads"]
    qwen3 = model_type == "qwen3"
    attention_bias = bool(hf.get("attention_bias", False))
    try:
      return cls(
          vocab_size=hf["vocab_size"],
          hidden_size=hf["hidden_size"],
          intermediate_size=hf["intermediate_size"],
          num_layers=hf["num_hidden_layers"],
          num_heads=heads,
          num_kv_heads=hf.get("num_key_value_heads") or heads,
          head_dim=head_dim,
          rope_theta=float(rope_theta),
          rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
          tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
          qkv_bias=attention_bias if qwen3 else True,
          o_bias=attention_bias if qwen3 else False,
          qk_norm=qwen3,
          max_position_embeddings=hf.get("max_position_embeddings", 32768),
          model_type=model_type,
          is_causal=hf.get("is_causal", True),
      )
    except ValueError as e:  # __post_init__'s checks, e.g. heads not a multiple of kv heads
      raise ValueError(f"{source}: {e}") from e

  def to_hf(self) -> dict[str, Any]:
    """The config.json fields transformers needs to rebuild this model."""
    hf = {
        "architectures": [ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        "tie_word_embeddings": self.tie_word_embeddings,
        "use_sliding_window": False,
    }
    if not self.is_causal:  # absent means causal: only a bidirectional model needs the field
      hf["is_causal"] = False
    # config.json says only model_type (and attention_bias for qwen3); transformers derives
    # the switches from it, so a config it cannot express would be read back as another model.
    if self.qk_norm != (self.model_type == "qwen3"):
      raise ValueError(f"a {self.model_type} config must have qk_norm="
                       f"{self.model_type == 'qwen3'} (got {self.qk_norm})")
    if self.model_type == "qwen3":
      if self.qkv_bias != self.o_bias:
        raise ValueError("a qwen3 config must have qkv_bias == o_bias (config.json "
                         f"attention_bias covers both; got {self.qkv_bias}, {self.o_bias})")
      hf["attention_bias"] = self.qkv_bias
    elif self.o_bias or not self.qkv_bias:
      raise ValueError("a qwen2 config must have qkv_bias=True and o_bias=False")
    return hf


def _check_hf_fields(hf: dict[str, Any], source: str) -> None:
  """ValueError unless config.json is a Qwen2/Qwen3 of unquantized weights whose required sizes
  are there, its sizes positive integers and its rope_theta and rms_norm_eps numbers."""
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES:
    raise ValueError(
        f"{source}: unsupported model_type {model_type!r} (architectures="
        f"{hf.get('architectures')}); grpo_jax supports {sorted(ARCHITECTURES)}")
  quantization = hf.get("quantization_config")
  if quantization:
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    raise ValueError(f"{source}: quantization_config (quant_method={method!r}) is not "
                     "supported; use the unquantized checkpoint")
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads"):
    if key not in hf:
      raise ValueError(f"{source}: missing field {key!r}")
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings"):
    value = hf.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value <= 0):
      raise ValueError(f"{source}: {key}={value!r} must be a positive integer")
  for key in ("rope_theta", "rms_norm_eps"):
    value = hf.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise ValueError(f"{source}: {key}={value!r} must be a number")


def _hf_rope_theta(hf: dict[str, Any], source: str) -> float | int:
  """config.json's RoPE base; ValueError for any RoPE but the default one (scaled, per layer)."""
  # transformers (4.x and 5.x) reads rope_scaling first, rope_parameters only without it.
  rope_field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rope = hf.get(rope_field) or {}
  if not isinstance(rope, dict):
    raise ValueError(f"{source}: {rope_field}={rope!r} must be an object")
  nested = [key for key, value in rope.items() if isinstance(value, dict)]
  if nested:  # transformers 5's per-layer-type form, e.g. {"full_attention": {...}}
    raise ValueError(f"{source}: {rope_field}: RoPE parameters per layer type ({nested}) are "
                     "not supported; give one flat object")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"{source}: {rope_field}: rope type {rope_type!r} is not supported "
                     "(only 'default')")
  rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
  if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)):
    raise ValueError(f"{source}: {rope_field}.rope_theta={rope_theta!r} must be a number")
  return rope_theta


def _check_hf_attention(hf: dict[str, Any], source: str) -> None:
  """ValueError unless every layer is full attention (no sliding window) over SiLU MLPs, and
  is_causal, when given, is a boolean."""
  sliding = hf.get("use_sliding_window")
  if sliding is not None and not isinstance(sliding, bool):
    raise ValueError(f"{source}: use_sliding_window must be true or false, got {sliding!r}")
  if sliding:
    raise ValueError(f"{source}: use_sliding_window=true is not supported")
  # transformers 5 builds each layer's attention from layer_types: only full attention is ours.
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    if not isinstance(layer_types, list) or len(layer_types) != hf["num_hidden_layers"]:
      raise ValueError(f"{source}: layer_types={layer_types!r} must list one entry per layer "
                       f"(num_hidden_layers={hf['num_hidden_layers']})")
    other = [t for t in layer_types if t != "full_attention"]
    if other:
      raise ValueError(f"{source}: layer_types entry {other[0]!r} is not supported (only "
                       "'full_attention')")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported")
  is_causal = hf.get("is_causal", True)
  if not isinstance(is_causal, bool):
    raise ValueError(f"{source}: is_causal must be true or false, got {is_causal!r}")


def _hf_head_dim(hf: dict[str, Any], source: str) -> int:
  """The head width transformers would use for config.json (its default differs by family)."""
  heads = hf["num_attention_heads"]
  qwen3 = hf["model_type"] == "qwen3"
  # transformers' rule: Qwen3Config's head_dim defaults to 128 (and may not be null); Qwen2's
  # attention takes the config's head_dim when it has one, else hidden_size // heads.
  if qwen3 and "head_dim" in hf and hf["head_dim"] is None:
    raise ValueError(f"{source}: head_dim=None must be a positive integer (qwen3 configs "
                     "without the field have head_dim 128)")
  return (hf.get("head_dim", 128) if qwen3
          else hf.get("head_dim") or hf["hidden_size"] // heads)


def positions_from_mask(mask_BT: Array) -> Array:
  """RoPE positions for left-padded rows: 0 at each row's first real token.

  >>> positions_from_mask(jnp.array([[0, 0, 1, 1, 1]]))
  Array([[0, 0, 0, 1, 2]], dtype=int32)
  """
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def init_cache(cfg: QwenConfig, batch: int, max_len: int, dtype=jnp.float32) -> Cache:
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _param(module: nn.Module, name: str, shape, axes, init, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _dense_init(scale: float = 0.02):
  return nn.initializers.normal(stddev=scale)


class RMSNorm(nn.Module):
  """x / rms(x) * weight, computed in fp32 and cast back before the weight (as transformers)."""
  eps: float
  dtype: Any
  param_dtype: Any
  axis_name: str = "norm"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    weight = _param(self, "weight", (x.shape[-1],), (self.axis_name,), nn.initializers.ones,
                    self.param_dtype)
    return _rms_norm(x, weight, self.eps, jnp.dtype(self.dtype))


def _rms_norm_impl(x, weight, eps, dtype):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(dtype) * x32.astype(dtype)


# The backward pass recomputes the norm from its input instead of keeping the fp32 copy of it
# (and the fp32 normalised values) that autodiff would save: with bf16 compute, two fp32
# [B, T, D] arrays per layer less (2.9 GiB of the Qwen2.5-1.5B step at 128 rows x 448 tokens,
# grad_accum_steps 4), for a few elementwise ops more. Without a gradient nothing changes.
_rms_norm = jax.checkpoint(_rms_norm_impl, prevent_cse=False, static_argnums=(2, 3),
                           policy=jax.checkpoint_policies.nothing_saveable)


def _kernel(module: nn.Module, shape, axes, param_dtype) -> Array:
  """The module's kernel in param_dtype: its 'kernel' param, or, for a base quantized by
  grpo_jax.models.quant, int8 'kernel_q' times the per-output-channel 'kernel_scale' (NF4 codes
  times their block's absmax)."""
  if module.has_variable("params", "kernel_q"):
    q = module.get_variable("params", "kernel_q")
    scale = module.get_variable("params", "kernel_scale")  # [*out]: broadcast over the inputs
    if q.dtype == jnp.uint4:  # NF4 codes, scale per block of inputs
      return nf4.dequantize(q, scale, 0, len(shape) - scale.ndim + 1, param_dtype)
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(param_dtype)
  return _param(module, "kernel", shape, axes, _dense_init(), param_dtype)


def _adapter(module: nn.Module) -> tuple[Array, Array] | None:
  """The module's LoRA factors (a, b) from the 'lora' collection, or None (see models/lora.py)."""
  if not module.has_variable("lora", "lora_a"):
    return None
  return module.get_variable("lora", "lora_a"), module.get_variable("lora", "lora_b")


def project(spec: str, x: Array, w: Array, adapter: tuple[Array, Array] | None = None) -> Array:
  """einsum(spec, x, w), plus the low-rank path (x · a) · b when an adapter is given.

  The kernel's letters that x shares are its input dims, the others its output dims; a holds
  the input dims then the rank r, b the rank then the output dims ('BTD,DnH->BTnH': a [D, r],
  b [r, n, H]). b arrives already multiplied by alpha / r (lora.variables does it).
  """
  y = jnp.einsum(spec, x, w)
  if adapter is None:
    return y
  a, b = adapter
  xs, rest = spec.split(",")
  ks, ys = rest.split("->")
  ins = "".join(c for c in ks if c in xs)
  outs = "".join(c for c in ks if c not in xs)
  batch = "".join(c for c in xs if c not in ks)
  x_r = jnp.einsum(f"{xs},{ins}r->{batch}r", x, a.astype(x.dtype))
  return y + jnp.einsum(f"{batch}r,r{outs}->{ys}", x_r, b.astype(x.dtype))


class Linear(nn.Module):
  """y = einsum(spec, x, kernel) (+ bias): one transformers nn.Linear, kernel laid out by axes."""
  spec: str
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  bias_ndim: int  # 0: no bias; else the bias covers the kernel's last bias_ndim axes
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    w = _kernel(self, self.shape, self.axes, self.param_dtype)
    y = project(self.spec, x, w.astype(self.dtype), _adapter(self))
    if self.bias_ndim:
      b = _param(self, "bias", self.shape[-self.bias_ndim:], self.axes[-self.bias_ndim:],
                 nn.initializers.zeros, self.param_dtype)
      y = y + b.astype(self.dtype)
    return y


class Attention(nn.Module):
  cfg: QwenConfig
  dtype: Any
  param_dtype: Any
  packed: tuple[int, int] | None = None  # (P, G): see Qwen.packed
  mesh: Any = None  # the model's mesh (Qwen.act_sharding's), for the fused decode attention

  @nn.compact
  def __call__(self, x_BTD, rope_BT, attn_mask_BS, cache, layer, cache_index):
    """rope_BT: rope_tables at the tokens' positions."""
    cfg = self.cfg
    d, h = cfg.hidden_size, cfg.head_dim

    def proj(name, heads, axis):
      return Linear("BTD,DnH->BTnH", (d, heads, h), ("embed", axis, "head_dim"),
                    2 if cfg.qkv_bias else 0, self.dtype, self.param_dtype, name=name)(x_BTD)

    q = proj("q_proj", cfg.num_heads, "q_heads")
    k = proj("k_proj", cfg.num_kv_heads, "kv_heads")
    v = proj("v_proj", cfg.num_kv_heads, "kv_heads")
    if cfg.qk_norm:
      q = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, "head_dim", name="q_norm")(q)
      k = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, "head_dim", name="k_norm")(k)
    if (cfg.run.decode_attention == "pallas" and cache is not None and self.packed is None
        and k.shape[1] == 1 < cache["k"].shape[3]):
      # One query per row (a decode step): one kernel applies RoPE to q and k, writes k and v
      # into slot cache_index of layer `layer` of the stacked caches and attends over slots
      # 0..cache_index where they lie, with no copy of the layer (decode_attention.py).
      cos, sin = rope_BT
      out_BNH, k_cache, v_cache = decode_attention.step(
          q[:, 0], k[:, 0], v[:, 0], (cos[:, 0, 0], sin[:, 0, 0]), cache["k"], cache["v"], layer,
          attn_mask_BS, cache_index, mesh=self.mesh)
      return self._out(out_BNH[:, None]), {"k": k_cache, "v": v_cache}
    q, k = apply_rope(q, rope_BT), apply_rope(k, rope_BT)

    if self.packed is not None:
      return self._packed_attention(q, k, v, attn_mask_BS), cache
    if cache is None:
      keys, values, start = k, v, 0
    else:
      # Write this call's k/v at slots [cache_index, cache_index + T) of this layer, straight
      # into the stacked cache: a decode step then writes T slots, not a copy of the layer.
      idx = tuple(jnp.asarray(i, jnp.int32) for i in (layer, 0, 0, cache_index, 0))
      cache = {name: update_slice(
                   cache[name], new.transpose(0, 2, 1, 3)[None].astype(cache[name].dtype), idx)
               for name, new in (("k", k), ("v", v))}
      if k.shape[1] == cache["k"].shape[3]:
        # This call fills every slot of the layer (a prefill, so cache_index is 0): reading the
        # layer back would give k/v as the cache stores them, so they are used as such. The
        # dynamic slice of the stack is the prefill program's costliest kernel to compile
        # (small benchmark: the prefill compiles in 0.45 s against 0.52 s, medians of 3).
        keys, values, start = k.astype(cache["k"].dtype), v.astype(cache["v"].dtype), 0
      else:
        # Read as the cache stores them, kv heads before slots: attend takes that layout, so a
        # decode step copies no layer of the cache into another one. (Under jax.vmap XLA:CPU
        # still fuses the write into this read and copies the whole cache per layer and step:
        # experiments/one_loop.md.)
        # The query batch may be the cache's first rows only: the sampler's live rows, moved
        # to the front of the cache once others have finished (Sampler's compact_rows).
        b = q.shape[0]
        out_BTNH = attend(q, cache["k"][layer, :b].astype(self.dtype),
                          cache["v"][layer, :b].astype(self.dtype), attn_mask_BS, cache_index,
                          cfg.is_causal, cfg.run.attention, heads_first=True)
        return self._out(out_BTNH), cache
    out_BTNH = attend(q, keys.astype(self.dtype), values.astype(self.dtype), attn_mask_BS, start,
                      cfg.is_causal, cfg.run.attention)
    return self._out(out_BTNH), cache

  def _out(self, out_BTNH):
    cfg = self.cfg
    return Linear("BTNH,NHD->BTD", (cfg.num_heads, cfg.head_dim, cfg.hidden_size),
                  ("q_heads", "head_dim", "embed"), 1 if cfg.o_bias else 0, self.dtype,
                  self.param_dtype, name="o_proj")(out_BTNH)

  def _packed_attention(self, q_bTNH, k_bTKH, v_bTKH, masks):
    """Rows of a prompt (slots 0..P-1) followed by its G completions' c tokens each: the prompt
    attends to itself, each completion to the prompt's keys/values (tiled G times) then its own
    tokens, its queries sitting at slots P, P + 1, ..."""
    p, g = self.packed
    prompt_mask_bP, mask_BS = masks
    b, t, n, h = q_bTNH.shape
    c = (t - p) // g
    causal, impl = self.cfg.is_causal, self.cfg.run.attention
    out_p = attend(q_bTNH[:, :p], k_bTKH[:, :p], v_bTKH[:, :p], prompt_mask_bP, 0, causal, impl)
    rows = lambda a_bTxH: a_bTxH[:, p:].reshape(b * g, c, *a_bTxH.shape[2:])
    keys, values = (jnp.concatenate([jnp.repeat(a_bTKH[:, :p], g, axis=0), rows(a_bTKH)], axis=1)
                    for a_bTKH in (k_bTKH, v_bTKH))
    out_c = attend(rows(q_bTNH), keys, values, mask_BS, p, causal, impl)
    return self._out(jnp.concatenate([out_p, out_c.reshape(b, g * c, n, h)], axis=1))


def attend(q_BTNH: Array, k: Array, v: Array, attn_mask_BS: Array, start: Array | int,
           causal: bool = True, implementation: str | None = None, *,
           heads_first: bool = False) -> Array:
  """Grouped-query attention; the query at row t sits at key slot start + t.

  k, v: [B, S, K, H], or with heads_first [B, K, S, H] (the KV cache's layout, read as stored).
  causal: the query sees key slots <= its own; otherwise every slot whose mask is 1.
  Scores and softmax are fp32 (for bf16 inputs too). A query that sees no key (a left-pad
  position) gets a uniform, finite row.

  implementation None or 'xla': a grouped einsum (below). 'cudnn': cuDNN's fused kernel through
  jax.nn.dot_product_attention; when the queries fill the key slots from slot 0 (`start` the
  Python int 0 and T == S: a prefill or a training forward) the causal rule reaches it as
  `is_causal`, which it uses to skip the upper triangle. Single-query calls (decode steps) run
  the einsum under 'cudnn' too.
  """
  b, t = q_BTNH.shape[:2]
  s = k.shape[2 if heads_first else 1]
  visible_B11S = (attn_mask_BS > 0)[:, None, None, :]
  aligned = causal and isinstance(start, int) and start == 0 and t == s
  if causal and not aligned:
    q_slot_T = start + jnp.arange(t)
    visible = visible_B11S & (jnp.arange(s)[None, :] <= q_slot_T[:, None])
  else:
    visible = visible_B11S
  if implementation == "cudnn" and t > 1:
    if q_BTNH.dtype not in (jnp.bfloat16, jnp.float16):
      raise ValueError(f"attention='cudnn' needs bf16 or fp16 compute, got {q_BTNH.dtype}: set "
                       "the compute dtype to bfloat16 or the attention to 'xla'")
    if heads_first:
      k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return _cudnn_attend(q_BTNH, k, v, jnp.broadcast_to(visible, (b, 1, t, s)), aligned)
  # A decode step (T = 1) gets here under 'cudnn' too: one query reads the cache once whichever
  # kernel runs, and cuDNN's flash kernel is built for blocks of queries (it would pad this one
  # to two).
  core = lambda q, k, v, m: _grouped_attend(q, k, v, m, aligned, heads_first)
  # The [B, N, T, S] scores and probabilities would be kept for the backward pass: 41 GB of the
  # Qwen2.5-1.5B step at 128 rows x 448 tokens (CPU AOT figures, docs/performance.md).
  # Recomputing them from q, k, v instead costs one more QK^T and softmax, ~1.5% of that
  # step's FLOPs, as a flash kernel would. No effect without a gradient (sampling).
  return jax.checkpoint(core, prevent_cse=False)(q_BTNH, k, v, visible)


def scores_einsum(q_BTKGH: Array, k: Array, *, kv: str, heads_major: bool) -> Array:
  """q·k per kv head and query head, fp32 [B, K, G, T, S]; k laid out as `kv` says ('BSKH' or
  'BKSH'). The same numbers either way, up to fp32 rounding; what differs is what XLA makes of
  the backward.

  heads_major: q laid out as the scores are, [B, K, G, T, H], first. The backward's gradient of k
  contracts G and T, then adjacent and in the same order in q and in the scores' gradient.
  Compiled for an H100 (benchmarks/gpu_kernels.py), the 0.5B train step then writes
  score-sized fp32 arrays twice a layer in its backward instead of four times (556 -> 523 GB
  written, 14,058 -> 13,702 kernels) and a decode step launches 680 kernels instead of 752
  (experiments/train_traffic_2026-11-27.md).

  The CPU keeps q in the tokens' order (heads_major False): there a decode step's dot (one query
  per row) is 1.8x slower the other way (fp32, 64 rows x 352 slots: 0.84 against 0.48 ms) and
  the whole CPU step no faster, while the other order moves the CPU's training numbers by fp32
  rounding, which a long warm start amplifies: the tiny presets' results over seeds in
  experiments/ hold for this order."""
  if heads_major:
    return jnp.einsum(f"BKGTH,{kv}->BKGTS", q_BTKGH.transpose(0, 2, 3, 1, 4), k,
                      preferred_element_type=jnp.float32)
  return jnp.einsum(f"BTKGH,{kv}->BKGTS", q_BTKGH, k, preferred_element_type=jnp.float32)


def _grouped_attend(q_BTNH, k, v, visible_B1TS, causal_aligned: bool, heads_first: bool):
  """softmax(q k^T / sqrt(H)) v with the G = N / K query heads of a kv head batched against its
  keys: no copy of k or v per query head, the mask applied once for all heads.

  Not jax.nn.dot_product_attention's XLA path: it transposes the cache's [B, K, S, H] to
  [B, S, K, H] every decode step and, under jax.vmap (a sweep's members), XLA:CPU runs its
  [B, K, G, T, S] dots much slower: the tiny sweep's vmapped sampler takes 0.64 s with it
  against 0.48 s with this formulation (experiments/one_loop.md)."""
  b, t, n, h = q_BTNH.shape
  kv = "BKSH" if heads_first else "BSKH"
  kh = k.shape[1 if heads_first else 2]
  s = k.shape[2 if heads_first else 1]
  q_BTKGH = q_BTNH.reshape(b, t, kh, n // kh, h)
  scores = jax.lax.platform_dependent(
      q_BTKGH, k, cpu=functools.partial(scores_einsum, kv=kv, heads_major=False),
      default=functools.partial(scores_einsum, kv=kv, heads_major=True))
  scores = scores * (h ** -0.5)
  visible = visible_B1TS[:, :, None]  # [B, 1, 1, T or 1, S]
  if causal_aligned:
    visible = visible & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])
  scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  # Heads-major output, transposed after: asking einsum for BTKGH directly makes XLA:CPU pick
  # a dot ~13x slower at decode shapes (B 64, K 2, S 352: 2.5 ms against 0.19 ms per layer).
  out_BKGTH = jnp.einsum(f"BKGTS,{kv}->BKGTH", probs, v)
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


@custom_batching.custom_vmap
def update_slice(operand: Array, update: Array, starts: tuple) -> Array:
  """jax.lax.dynamic_update_slice(operand, update, starts), also under jax.vmap.

  JAX batches dynamic_update_slice as a scatter, and XLA:CPU turned the KV cache's one-slot
  write under vmap (a sweep's members decoding together) into a copy of the whole cache per
  layer and step. Here, while the start indices are the same for every member, the vmapped
  write stays a dynamic_update_slice whose first index is 0."""
  return jax.lax.dynamic_update_slice(operand, update, starts)


@update_slice.def_vmap
def _update_slice_vmap(axis_size, in_batched, operand, update, starts):
  operand_b, update_b, starts_b = in_batched
  if any(starts_b):  # each member writes elsewhere: JAX's own rule
    return jax.vmap(jax.lax.dynamic_update_slice,
                    in_axes=(0 if operand_b else None, 0 if update_b else None,
                             tuple(0 if x else None for x in starts_b)))(
                                 operand, update, starts), True
  grow = lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
  zero = jnp.zeros((), jnp.result_type(*starts)) if starts else jnp.int32(0)
  return update_slice(grow(operand, operand_b), grow(update, update_b), (zero, *starts)), True


def _cudnn_attend(q_BTNH, k_BSKH, v_BSKH, visible_B1TS, is_causal, implementation="cudnn"):
  """cuDNN's fused attention takes the mask as a [B, 1, T, S] bias, and with a bias it trains
  only at even T and S: an odd length gets one more query row (dropped from the output) and
  one more key slot, which no query sees."""
  t, s = q_BTNH.shape[1], k_BSKH.shape[1]
  dt, ds = t % 2, s % 2
  if dt or ds:
    pad = lambda a, n: jnp.pad(a, ((0, 0), (0, n), (0, 0), (0, 0)))
    q_BTNH, k_BSKH, v_BSKH = pad(q_BTNH, dt), pad(k_BSKH, ds), pad(v_BSKH, ds)
    visible_B1TS = jnp.pad(visible_B1TS, ((0, 0), (0, 0), (0, dt), (0, ds)))
    # The causal rule stays aligned only while T and S stay equal.
    is_causal = is_causal and t + dt == s + ds
  out = jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=visible_B1TS,
                                     is_causal=is_causal, implementation=implementation)
  return out[:, :t]


class _Kernel(nn.Module):
  """A Linear's kernel alone (the MLP multiplies by it itself): keeps the params' names.
  Returns (kernel, its LoRA adapter (a, b) or None)."""
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  param_dtype: Any

  @nn.compact
  def __call__(self):
    return _kernel(self, self.shape, self.axes, self.param_dtype), _adapter(self)


@jax.custom_vjp
def gated_mlp(x_BTD: Array, wg_DI: Array, wu_DI: Array, wd_ID: Array) -> Array:
  """down(silu(x @ wg) * (x @ wu)), with a hand-written backward.

  Why: for the autodiff backward XLA:CPU fuses a transpose of the [B·T, I] gate gradient into
  the elementwise fusion that computes it (strided writes): 2.1x slower than this backward,
  whose weight-gradient einsums take the gradients in the layout they are made in.
  """
  return _gated_mlp_fwd(x_BTD, wg_DI, wu_DI, wd_ID)[0]


def _gated_mlp_fwd(x_BTD, wg_DI, wu_DI, wd_ID):
  g = jnp.einsum("BTD,DI->BTI", x_BTD, wg_DI)
  u = jnp.einsum("BTD,DI->BTI", x_BTD, wu_DI)
  y = jnp.einsum("BTI,ID->BTD", jax.nn.silu(g) * u, wd_ID)
  return y, (x_BTD, g, u, wg_DI, wu_DI, wd_ID)


def _gated_mlp_bwd(res, dy_BTD):
  x, g, u, wg, wu, wd = res
  sig = jax.nn.sigmoid(g)
  act = g * sig  # silu(g)
  dh = jnp.einsum("BTD,ID->BTI", dy_BTD, wd)
  dg = dh * u * (sig * (1 + g * (1 - sig)))  # silu'(g) = sig (1 + g (1 - sig))
  du = dh * act
  return (jnp.einsum("BTI,DI->BTD", dg, wg) + jnp.einsum("BTI,DI->BTD", du, wu),
          jnp.einsum("BTD,BTI->DI", x, dg), jnp.einsum("BTD,BTI->DI", x, du),
          jnp.einsum("BTI,BTD->ID", act * u, dy_BTD))


gated_mlp.defvjp(_gated_mlp_fwd, _gated_mlp_bwd)


@jax.custom_vjp
def gated_mlp_lora(x_BTD: Array, wg_DI: Array, wu_DI: Array, wd_ID: Array,
                   lora: tuple[Array, ...]) -> Array:
  """gated_mlp with a LoRA path on each projection: lora = (ag [D, r], bg [r, I], au, bu,
  ad [I, r], bd [r, D]), b already scaled; a projection without adapter gets r = 0 factors.

  Its backward is written out for the same reason as gated_mlp's: the factors' gradients
  contract the [B·T, I] gradients over B·T as a kernel's gradient does, and with JAX's autodiff
  backward XLA:CPU wrote them transposed (its optimized HLO transposes the gate and up
  gradients to [I, B·T]; this one transposes only [r, B·T] and [D, B·T] arrays). Gradient w.r.t. the factors and x at 2048 tokens,
  D 896, I 4864, r 16, medians of 5 on a loaded 2-core CPU: autodiff 2.67 s, this 1.73 s, the
  frozen MLP's x-gradient alone 1.52 s.
  """
  return _gated_mlp_lora_fwd(x_BTD, wg_DI, wu_DI, wd_ID, lora)[0]


def _gated_mlp_lora_fwd(x, wg, wu, wd, lora):
  ag, bg, au, bu, ad, bd = lora
  xg = jnp.einsum("BTD,Dr->BTr", x, ag)
  xu = jnp.einsum("BTD,Dr->BTr", x, au)
  g = jnp.einsum("BTD,DI->BTI", x, wg) + jnp.einsum("BTr,rI->BTI", xg, bg)
  u = jnp.einsum("BTD,DI->BTI", x, wu) + jnp.einsum("BTr,rI->BTI", xu, bu)
  h = jax.nn.silu(g) * u
  hd = jnp.einsum("BTI,Ir->BTr", h, ad)
  y = jnp.einsum("BTI,ID->BTD", h, wd) + jnp.einsum("BTr,rD->BTD", hd, bd)
  return y, (x, g, u, xg, xu, hd, wg, wu, wd, lora)


def _gated_mlp_lora_bwd(res, dy):
  x, g, u, xg, xu, hd, wg, wu, wd, (ag, bg, au, bu, ad, bd) = res
  sig = jax.nn.sigmoid(g)
  act = g * sig  # silu(g)
  h = act * u
  dhd = jnp.einsum("BTD,rD->BTr", dy, bd)
  dh = jnp.einsum("BTD,ID->BTI", dy, wd) + jnp.einsum("BTr,Ir->BTI", dhd, ad)
  dg = dh * u * (sig * (1 + g * (1 - sig)))  # silu'(g) = sig (1 + g (1 - sig))
  du = dh * act
  dxg = jnp.einsum("BTI,rI->BTr", dg, bg)
  dxu = jnp.einsum("BTI,rI->BTr", du, bu)
  dx = (jnp.einsum("BTI,DI->BTD", dg, wg) + jnp.einsum("BTI,DI->BTD", du, wu)
        + jnp.einsum("BTr,Dr->BTD", dxg, ag) + jnp.einsum("BTr,Dr->BTD", dxu, au))
  dlora = (jnp.einsum("BTD,BTr->Dr", x, dxg), jnp.einsum("BTr,BTI->rI", xg, dg),
           jnp.einsum("BTD,BTr->Dr", x, dxu), jnp.einsum("BTr,BTI->rI", xu, du),
           jnp.einsum("BTI,BTr->Ir", h, dhd), jnp.einsum("BTr,BTD->rD", hd, dy))
  return (dx, jnp.einsum("BTD,BTI->DI", x, dg), jnp.einsum("BTD,BTI->DI", x, du),
          jnp.einsum("BTI,BTD->ID", h, dy), dlora)


gated_mlp_lora.defvjp(_gated_mlp_lora_fwd, _gated_mlp_lora_bwd)


class MLP(nn.Module):
  cfg: QwenConfig
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x_BTD):
    d, i = self.cfg.hidden_size, self.cfg.intermediate_size
    (wg, lg), (wu, lu), (wd, ld) = (
        _Kernel(shape, axes, self.param_dtype, name=name)()
        for name, shape, axes in (("gate_proj", (d, i), ("embed", "mlp")),
                                  ("up_proj", (d, i), ("embed", "mlp")),
                                  ("down_proj", (i, d), ("mlp", "embed"))))
    wg, wu, wd = (w.astype(self.dtype) for w in (wg, wu, wd))
    if lg is None and lu is None and ld is None:
      return gated_mlp(x_BTD, wg, wu, wd)
    factors = []
    for ab, (n_in, n_out) in ((lg, (d, i)), (lu, (d, i)), (ld, (i, d))):
      if ab is None:  # no adapter on this projection: rank-0 factors add nothing
        ab = (jnp.zeros((n_in, 0)), jnp.zeros((0, n_out)))
      factors += [t.astype(self.dtype) for t in ab]
    return gated_mlp_lora(x_BTD, wg, wu, wd, tuple(factors))


def _constrain(x: Array, sharding) -> Array:
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


class DecoderLayer(nn.Module):
  """One pre-norm block, written as a scan body over layers: carry = (x, cache, layer index)."""
  cfg: QwenConfig
  dtype: Any
  param_dtype: Any
  act_sharding: Any = None
  packed: tuple[int, int] | None = None

  @nn.compact
  def __call__(self, carry, _):
    x, cache, layer, rope_BT, attn_mask_BS, cache_index = carry
    cfg = self.cfg
    h = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, "norm",
                name="input_layernorm")(x)
    mesh = None if self.act_sharding is None else self.act_sharding.mesh
    h, cache = Attention(cfg, self.dtype, self.param_dtype, self.packed, mesh, name="self_attn")(
        h, rope_BT, attn_mask_BS, cache, layer, cache_index)
    x = _constrain(x + h, self.act_sharding)
    h = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, "norm",
                name="post_attention_layernorm")(x)
    x = _constrain(x + MLP(cfg, self.dtype, self.param_dtype, name="mlp")(h), self.act_sharding)
    return (x, cache, layer + 1, rope_BT, attn_mask_BS, cache_index), None


class Qwen(nn.Module):
  cfg: QwenConfig
  dtype: Any = jnp.float32  # compute dtype
  param_dtype: Any = jnp.float32
  remat: bool = False  # rematerialise each layer in the backward pass (training memory)
  # Where the residual stream [B, T, D] lives, e.g. NamedSharding(mesh, P(('data', 'fsdp'))).
  # Without it the partitioner may follow the FSDP weights and split activations along D, so
  # that every device computes the whole batch (2.7x the memory for Qwen2.5-1.5B, fsdp = 8).
  act_sharding: Any = None
  # (P, G): each row is a prompt of P tokens followed by the c tokens of each of its G
  # completions, [b, P + G·c]; the prompt runs once for its G completions (the training
  # forward of a GRPO group). attn_mask_BS is then (prompt mask [b, P], the completions' mask
  # [b·G, P + c]), positions_BT packed like the tokens.
  packed: tuple[int, int] | None = None

  def setup(self):
    cfg = self.cfg
    self.embed_tokens = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
        embedding_init=nn.with_logical_partitioning(_dense_init(), ("vocab", "embed")))
    layer = DecoderLayer
    if self.remat:
      layer = nn.remat(layer, prevent_cse=False)
    self.layers = nn.scan(
        layer, variable_axes={"params": 0, "lora": 0}, split_rngs={"params": True},
        length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg, self.dtype, self.param_dtype, self.act_sharding, self.packed)
    self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = self.param(
          "lm_head", nn.with_logical_partitioning(_dense_init(), ("embed", "vocab")),
          (cfg.hidden_size, cfg.vocab_size), self.param_dtype)

  def __call__(self, tokens_BT: Array, positions_BT: Array, attn_mask_BS: Array,
               cache: Cache | None = None, cache_index: Array | int | None = None):
    """Returns (hidden_BTD after the final norm, updated cache or None)."""
    if cache is not None and cache_index is None:
      raise ValueError("a cache needs a cache_index (the slot of the first token)")
    if cache is not None and self.packed is not None:
      raise ValueError("a packed call takes no cache")
    if cache is not None and not self.cfg.is_causal:
      raise BidirectionalDecodeError(not_causal_message(self.cfg))
    rope_BT = rope_tables(positions_BT, self.cfg.head_dim, self.cfg.rope_theta)
    carry = (self.embed(tokens_BT), cache, jnp.int32(0), rope_BT, attn_mask_BS,
             None if cache is None else jnp.asarray(cache_index, jnp.int32))
    (x, cache, *_), _ = self.layers(carry, None)
    return self.norm(x), cache

  def embed(self, tokens_BT: Array) -> Array:
    return _constrain(self.embed_tokens(tokens_BT), self.act_sharding)

  def final_norm(self, x_BTD: Array) -> Array:
    return self.norm(x_BTD)

  def logits(self, hidden_BTD: Array) -> Array:
    """fp32 logits; for training use grpo_jax.logprobs.token_logprobs (blocked over the
    vocabulary, no [B, T, V] array) instead of this."""
    if self.cfg.tie_word_embeddings:
      head = self.embed_tokens.embedding.T
    else:
      head = self.lm_head
    return jnp.einsum("BTD,DV->BTV", hidden_BTD, head.astype(self.dtype),
                      preferred_element_type=jnp.float32)


class Unrolled(NamedTuple):
  """Variables for apply_unrolled (see unroll): `rest`, each collection without its stacked
  'layers' (embedding, final norm, head); `layers`, one set of variables per decoder layer."""
  rest: dict
  layers: list


def unroll(variables: dict) -> Unrolled:
  """The variables with each decoder layer's sliced off the scan's stacked [L, ...] leaves of
  every collection (params, LoRA adapters): new arrays, one set per layer. Made once, before a
  decode loop, so that no step slices the stack."""
  stacked = {col: tree["layers"] for col, tree in variables.items() if "layers" in tree}
  num_layers = jax.tree.leaves(stacked)[0].shape[0]
  rest = {col: {k: x for k, x in tree.items() if k != "layers"}
          for col, tree in variables.items()}
  return Unrolled(rest, [{col: jax.tree.map(lambda w: w[i], tree)
                          for col, tree in stacked.items()} for i in range(num_layers)])


def apply_unrolled(model: "Qwen", unrolled: Unrolled, tokens_BT: Array, positions_BT: Array,
                   attn_mask_BS: Array, cache: Cache, cache_index):
  """model.apply(variables, tokens, positions, mask, cache, cache_index) with the decoder
  layers written out one after the other: layer i runs on unrolled.layers[i] and writes slot
  `cache_index` of layer i of the stacked cache at a constant layer index.

  The same numbers as the scan (tests/sampler_test.py). In a decode loop it leaves no loop over
  layers inside each step."""
  if model.packed is not None:
    raise ValueError("apply_unrolled runs a cached (prefill or decode) forward, not a packed one")
  x = model.apply(unrolled.rest, tokens_BT, method=Qwen.embed)
  block = DecoderLayer(model.cfg, model.dtype, model.param_dtype, model.act_sharding)
  index = jnp.asarray(cache_index, jnp.int32)
  rope_BT = rope_tables(positions_BT, model.cfg.head_dim, model.cfg.rope_theta)
  for i, layer_vars in enumerate(unrolled.layers):
    (x, cache, *_), _ = block.apply(
        layer_vars, (x, cache, jnp.int32(i), rope_BT, attn_mask_BS, index), None)
  return model.apply(unrolled.rest, x, method=Qwen.final_norm), cache


def not_causal_message(cfg: QwenConfig) -> str:
  return (f"this {cfg.model_type} model is bidirectional (config.json \"is_causal\": false, an "
          "embedder): each token attends to later ones, so it cannot generate token by token "
          "with a KV cache. Use a causal language model checkpoint to sample from.")


DTYPES = ("float32", "bfloat16")  # the names every dtype setting of the project takes


def build(cfg: QwenConfig, *, dtype="float32", param_dtype="float32", remat: bool = False,
          mesh=None) -> Qwen:
  """The one way the project builds the model: compute and param dtypes (names from DTYPES or
  dtypes), remat, and with a mesh the residual stream pinned to the batch split over the
  ('data', 'fsdp') axes (see Qwen.act_sharding). The sampler, the train step, the model
  rewards and export all take their module from here."""
  act = None
  if mesh is not None:
    act = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
  return Qwen(cfg, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype), remat=remat,
              act_sharding=act)


def head_kernel(params, cfg: QwenConfig) -> Array:
  """The [D, V] output projection: the embedding transposed when tied."""
  if cfg.tie_word_embeddings:
    return params["embed_tokens"]["embedding"].T
  return params["lm_head"]


def _init_variables(cfg: QwenConfig, key, param_dtype):
  model = Qwen(cfg, param_dtype=param_dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  return model.init(key, tokens, tokens, jnp.ones((1, 1), jnp.int32))


def init_params(cfg: QwenConfig, key, param_dtype=jnp.float32):
  """Random params (normal(0.02) weights, unit norms, zero biases) as a plain pytree."""
  return nn.unbox(_init_variables(cfg, key, param_dtype))["params"]


@functools.lru_cache(maxsize=32)
def _boxed_shapes(cfg: QwenConfig, param_dtype):
  """The init's variables as ShapeDtypeStructs in their logical-axis boxes. Tracing the init
  takes about 0.1 s on a 2-core CPU, and a run asks for these shapes and axes some 16 times (the
  shardings of its states, programs and checkpoints), so they are traced once per config.
  The callers get new dicts (nn.unbox and nn.get_partition_spec build them) and may edit
  them."""
  return jax.eval_shape(lambda k: _init_variables(cfg, k, param_dtype), jax.random.key(0))


def abstract_params(cfg: QwenConfig, param_dtype=jnp.float32):
  """ShapeDtypeStructs of the params: no memory is allocated."""
  return nn.unbox(_boxed_shapes(cfg, jnp.dtype(param_dtype)))["params"]  # new dicts


def logical_axes(cfg: QwenConfig):
  """A pytree (same structure as params) of PartitionSpecs of logical axis names."""
  return nn.get_partition_spec(_boxed_shapes(cfg, jnp.dtype(jnp.float32)))["params"]
