"""LoRA adapters for grpo_jax.models.qwen: a separate params pytree, merge, and PEFT export.

A target projection W (q_proj ... down_proj, named as in transformers and PEFT) gets two factors
and computes y = x·W + (alpha / r)·(x·a)·b. The adapters are a pytree of their own, shaped like
the base params' subtrees they attach to, stacked over layers:

    lcfg = lora.LoraConfig(rank=16, alpha=32, targets=("q_proj", "v_proj"))
    adapters = lora.init(jax.random.key(0), cfg, lcfg)
    # {'layers': {'self_attn': {'q_proj': {'lora_a': [L, D, r], 'lora_b': [L, r, N, H]},
    #                           'v_proj': {'lora_a': [L, D, r], 'lora_b': [L, r, K, H]}}}}
    hidden, _ = model.apply(lora.variables(params, adapters, lcfg), tokens, positions, mask)
    hidden, _ = model.apply(lora.variables(params, None, lcfg), ...)   # the base model

With lcfg.modules_to_save the adapters also hold full trained copies under the params' own
keys ({'embed_tokens': {'embedding': [V, D]}, 'lm_head': [D, V]}), which lora.variables puts in
place of the base's. Per-module ranks and scales (PEFT's patterns, layers_to_transform, full
module paths, rsLoRA) are resolved by `layout`.

`a` holds the kernel's input dims then the rank, `b` the rank then its output dims (o_proj:
a [L, N, H, r], b [L, r, D]), so each factor is sharded by the same rules-table entries as the
base kernel's dims (grpo_jax.sharding; the rank axis is replicated). Only the adapters are
trained: the optimizer holds state for them alone and the frozen base can stay in bf16.

Initialisation follows PEFT's default: a ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming-uniform
with a = sqrt(5) on lora_A's [r, in] weight), b = 0, so a fresh adapter leaves the model as it
was. `save_peft` writes a directory that `peft.PeftModel.from_pretrained` loads onto the
transformers model; `save_merged` writes the base with W + (alpha / r)·a·b folded in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from grpo_jax.models import quant, qwen, weights

# target -> (parent module inside a layer, number of input dims of our kernel layout).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn", 1),   # [D, N, H]
    "k_proj": ("self_attn", 1),   # [D, K, H]
    "v_proj": ("self_attn", 1),   # [D, K, H]
    "o_proj": ("self_attn", 2),   # [N, H, D]
    "gate_proj": ("mlp", 1),      # [D, I]
    "up_proj": ("mlp", 1),        # [D, I]
    "down_proj": ("mlp", 1),      # [I, D]
}
# Modules a run may train whole beside the adapters (modules_to_save), keyed as in the params.
SAVED_MODULES = ("embed_tokens", "lm_head")
_SAVED_ALIASES = {"model.embed_tokens": "embed_tokens"}
RANK_AXIS = "lora_rank"  # logical axis of the rank dim (replicated, see sharding.RULES)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r, alpha (the update is scaled by alpha / r, as PEFT's lora_alpha), target modules,
  and PEFT's LoraConfig options that change which projections get which rank and scale:

  targets: short names (q_proj ... down_proj: that projection in every layer, or in the layers
    of layers_to_transform), or PEFT's full module paths (model.layers.0.self_attn.q_proj: that
    one module, whatever layers_to_transform says), as PEFT's target_modules list matches them.
  use_rslora: scale alpha / sqrt(r) (rsLoRA) instead of alpha / r.
  rank_pattern, alpha_pattern: ((regex, value), ...) pairs, PEFT's dicts in order: the first
    regex matching the end of a module's path (re.match('(.*\\.)?(regex)$', path), PEFT's
    get_pattern_key) gives that module its rank / alpha, e.g. (('down_proj', 4),) or
    (('model.layers.1.self_attn.q_proj', 2),).
  layers_to_transform: the layer indices the short-name targets apply to; () = all.
  modules_to_save: "embed_tokens" and / or "lm_head" (PEFT's names; "model.embed_tokens" too):
    the optimizer trains a full copy of each beside the adapters, as PEFT's ModulesToSaveWrapper
    does; the reference keeps the base's. Untied models only (check_saved).
  init_from: a PEFT adapter directory or hub id whose weights a fresh run starts from (its
    settings must give the same modules, ranks and scales as these: check_init_from).

  The adapters keep one stacked [L, ...] array per target of the largest rank any layer has; a
  layer with a smaller rank (or none) has zero columns of a and rows of b there, multiplied by a
  zero scale (variables), so they neither compute nor train.
  """
  rank: int
  alpha: float
  targets: tuple[str, ...] = tuple(TARGETS)
  dropout: float = 0.0
  # 'int8' / 'nf4': the frozen base's seven projection kernels as int8 or NF4 (QLoRA, quant.py).
  quantize: str = "none"
  # The sampler runs one model with W + (alpha / r)·a·b in each target (merged_policy), not the
  # base and the adapters side by side; sweeps of K members always run them side by side.
  merge_for_sampling: bool = True
  use_rslora: bool = False
  rank_pattern: tuple[tuple[str, int], ...] = ()
  alpha_pattern: tuple[tuple[str, float], ...] = ()
  layers_to_transform: tuple[int, ...] = ()
  # Full trained copies of these (PEFT's modules_to_save): "embed_tokens", "lm_head".
  modules_to_save: tuple[str, ...] = ()
  init_from: str = ""

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"model.lora.rank must be a positive integer, got {self.rank!r}")
    if not _positive(self.alpha):
      raise ValueError(f"model.lora.alpha must be a positive number, got {self.alpha!r}")
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    object.__setattr__(self, "targets", targets)
    unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
      raise ValueError(f"model.lora.targets must be distinct names among {list(TARGETS)} (or "
                       f"full module paths such as model.layers.0.self_attn.q_proj), got "
                       f"{list(targets)}")
    if self.dropout != 0:
      raise ValueError(f"model.lora.dropout={self.dropout!r}: only 0 is supported")
    if self.quantize not in quant.MODES:
      raise ValueError(f"model.lora.quantize={self.quantize!r}: expected one of {quant.MODES}")
    for name in ("merge_for_sampling", "use_rslora"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"model.lora.{name} must be True or False, got "
                         f"{getattr(self, name)!r}")
    for name, ok in (("rank_pattern", _rank_ok), ("alpha_pattern", _positive)):
      pairs = _pairs(getattr(self, name))
      object.__setattr__(self, name, pairs)
      for key, value in pairs:
        if not isinstance(key, str) or not _regex_ok(key) or not ok(value):
          raise ValueError(f"model.lora.{name}: {key!r}: {value!r} must map a module-path regex "
                           f"to a positive {'integer' if name == 'rank_pattern' else 'number'}")
    layers = self.layers_to_transform
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    object.__setattr__(self, "layers_to_transform", layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
      raise ValueError(f"model.lora.layers_to_transform must be layer indices >= 0, got "
                       f"{list(layers)}")
    saved = (self.modules_to_save,) if isinstance(self.modules_to_save, str) else tuple(
        self.modules_to_save or ())
    names = tuple(sorted({_SAVED_ALIASES.get(m, m) for m in saved}))
    if any(m not in SAVED_MODULES for m in names):
      raise ValueError(f"model.lora.modules_to_save must name among {list(SAVED_MODULES)}, got "
                       f"{list(saved)}")
    object.__setattr__(self, "modules_to_save", names)
    if not isinstance(self.init_from, str):
      raise ValueError(f"model.lora.init_from must be a path or hub id, got {self.init_from!r}")

  @property
  def scale(self) -> float:
    """The default module's scale: alpha / r, or alpha / sqrt(r) with use_rslora."""
    return _scale(self.alpha, self.rank, self.use_rslora)

  @classmethod
  def from_config(cls, c: Mapping[str, Any] | None) -> "LoraConfig | None":
    """From a config block (a ConfigDict or dict: rank, alpha, targets, dropout, ...); rank 0 =
    off. rank_pattern / alpha_pattern may be dicts (None: none), as PEFT's are."""
    if c is None or not c.get("rank", 0):
      return None
    known = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(c.keys()) - known)
    if extra:
      raise ValueError(f"model.lora: unknown field(s) {extra}; known: {sorted(known)}")
    return cls(**{k: (tuple(v) if k in ("targets", "layers_to_transform", "modules_to_save")
                      else v) for k, v in c.items()})


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _rank_ok(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _regex_ok(pattern: str) -> bool:
  try:
    re.compile(pattern)
  except re.error:
    return False
  return True


def _pairs(pattern) -> tuple:
  """A pattern as ((key, value), ...): from a dict (or ConfigDict), pairs, or None."""
  if not pattern:
    return ()
  if hasattr(pattern, "items"):
    return tuple((k, v) for k, v in pattern.items())
  return tuple(tuple(p) for p in pattern)


def _scale(alpha, rank, rslora: bool) -> float:
  return alpha / math.sqrt(rank) if rslora else alpha / rank


def module_path(layer: int, target: str) -> str:
  """PEFT's name of a target module inside the causal LM: model.layers.{layer}.self_attn.q_proj."""
  return f"model.layers.{layer}.{TARGETS[target][0]}.{target}"


def _targets_module(lcfg: LoraConfig, path: str, layer: int) -> bool:
  """Whether PEFT's target_modules list matching (tuners_utils.check_target_module_exists) adapts
  the module at path: named exactly, or by a suffix in a layer of layers_to_transform."""
  if path in lcfg.targets:
    return True
  if not any(path.endswith("." + t) for t in lcfg.targets):
    return False
  return not lcfg.layers_to_transform or layer in lcfg.layers_to_transform


def _pattern_value(pattern, path: str, default):
  """PEFT's get_pattern_key: the value of the first key matching the end of path."""
  for key, value in pattern:
    if re.match(rf"(.*\.)?({key})$", path):
      return value
  return default


def check_saved(lcfg: LoraConfig, cfg: qwen.QwenConfig) -> None:
  """ValueError for modules_to_save on a model whose LM head is its embedding: PEFT would train
  two separate copies of the one matrix (untying them), which this model cannot hold."""
  if lcfg.modules_to_save and cfg.tie_word_embeddings:
    raise ValueError(f"model.lora.modules_to_save={list(lcfg.modules_to_save)}: the model ties "
                     "its LM head to the embedding (config.json tie_word_embeddings=true), and "
                     "PEFT would train separate copies of them; use an untied model or leave "
                     "modules_to_save empty")


def check_model(lcfg: LoraConfig, cfg: qwen.QwenConfig) -> None:
  """ValueError naming the first LoRA setting this model cannot take: the per-module layout
  (layout), modules_to_save on a tied model (check_saved), a base kernel that the quantized
  format cannot store (quant.check_shapes)."""
  layout(lcfg, cfg.num_layers)
  check_saved(lcfg, cfg)
  quant.check_shapes(cfg, lcfg.quantize)


def _saved_of(adapters) -> list[str]:
  return [m for m in SAVED_MODULES if m in adapters]


def with_saved(params, adapters):
  """params with the adapters' trained copies (modules_to_save) in place of the base's
  embed_tokens / lm_head; params itself where there are none."""
  saved = _saved_of(adapters) if adapters is not None else []
  return dict(params, **{m: adapters[m] for m in saved}) if saved else params


@functools.lru_cache(maxsize=None)
def layout(lcfg: LoraConfig, num_layers: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
  """{target: (rank per layer, scale per layer)} as PEFT builds the adapter on a model of
  num_layers decoder layers: rank 0 where a layer's module is not adapted; targets adapted in
  no layer are left out. ValueError (naming model.lora's field) for an entry that matches no
  module or a layer index past the model's."""
  bad = [i for i in lcfg.layers_to_transform if i >= num_layers]
  if bad:
    raise ValueError(f"model.lora.layers_to_transform: layer {bad[0]} does not exist (the model "
                     f"has {num_layers} layers)")
  paths = [module_path(i, t) for t in TARGETS for i in range(num_layers)]
  unmatched = [t for t in lcfg.targets if t not in paths
               and not any(p.endswith("." + t) for p in paths)]
  if unmatched:
    raise ValueError(f"model.lora.targets: {unmatched[0]!r} matches no module of this "
                     f"{num_layers}-layer model (its paths run model.layers.0 to "
                     f"model.layers.{num_layers - 1})")
  out = {}
  # In the order targets first names them (init draws each target's a from its own key).
  for t in dict.fromkeys(name.rsplit(".", 1)[-1] for name in lcfg.targets):
    ranks, scales = [], []
    for i in range(num_layers):
      path = module_path(i, t)
      on = _targets_module(lcfg, path, i)
      r = _pattern_value(lcfg.rank_pattern, path, lcfg.rank) if on else 0
      alpha = _pattern_value(lcfg.alpha_pattern, path, lcfg.alpha)
      ranks.append(r)
      scales.append(_scale(alpha, r, lcfg.use_rslora) if r else 0.0)
    if any(ranks):
      out[t] = (tuple(ranks), tuple(scales))
  if not out:
    raise ValueError(f"model.lora: targets {list(lcfg.targets)} with layers_to_transform "
                     f"{list(lcfg.layers_to_transform)} adapt no module")
  return out


def _is_uniform(lcfg: LoraConfig, num_layers: int) -> bool:
  """Whether every adapted module has rank lcfg.rank and scale lcfg.scale in every layer."""
  return all(set(r) == {lcfg.rank} and set(s) == {lcfg.scale}
             for r, s in layout(lcfg, num_layers).values())


@functools.lru_cache(maxsize=None)
def _relative_scales(lcfg: LoraConfig, num_layers: int):
  """None when uniform; else {target: [L, R] float32}, each layer's scale / lcfg.scale on its
  own rank's columns and 0 on the padding up to the target's largest rank R."""
  if _is_uniform(lcfg, num_layers):
    return None
  out = {}
  for t, (ranks, scales) in layout(lcfg, num_layers).items():
    rel = np.zeros((num_layers, max(ranks)), np.float32)
    for i, (r, s) in enumerate(zip(ranks, scales)):
      rel[i, :r] = s / lcfg.scale
    out[t] = rel
  return out


def _scaled_b(lora_b, rel, scale):
  """b (fp32) times scale, and per layer and rank by rel [L, R] (None: uniform)."""
  b = lora_b.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
  if rel is None:
    return b
  return b * jnp.asarray(rel).reshape(rel.shape + (1,) * (b.ndim - 2))


def _kernel_path(target: str) -> tuple[str, str, str]:
  return ("layers", TARGETS[target][0], target)


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree: dict, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _shapes(cfg: qwen.QwenConfig, lcfg: LoraConfig):
  """target -> (a shape, b shape), both with the leading layer axis."""
  base = qwen.abstract_params(cfg)
  out = {}
  for t, (ranks, _) in layout(lcfg, cfg.num_layers).items():
    shape = _get(base, _kernel_path(t))["kernel"].shape  # [L, *in, *out]
    n_in, r = TARGETS[t][1], max(ranks)
    out[t] = ((*shape[:1 + n_in], r), (shape[0], r, *shape[1 + n_in:]))
  return out


def init(key: jax.Array, cfg: qwen.QwenConfig, lcfg: LoraConfig, dtype=jnp.float32,
         params=None):
  """Fresh adapters: a uniform in ±1/sqrt(fan_in) (PEFT's default), b zeros; a's padding
  columns (a layer of smaller rank, or none) zeros; with modules_to_save, a copy (in dtype) of
  the base params' embed_tokens / lm_head, which params must then hold."""
  adapters: dict = {}
  check_saved(lcfg, cfg)
  if lcfg.modules_to_save and params is None:
    raise ValueError("lora.init: model.lora.modules_to_save copies the base's modules; pass "
                     "params")
  for m in lcfg.modules_to_save:
    adapters[m] = jax.tree.map(lambda x: jnp.asarray(x, dtype), params[m])
  shapes = _shapes(cfg, lcfg)
  rel = _relative_scales(lcfg, cfg.num_layers)
  for k, t in zip(jax.random.split(key, len(shapes)), shapes):
    a_shape, b_shape = shapes[t]
    bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
    a = jax.random.uniform(k, a_shape, dtype, -bound, bound)
    if rel is not None:
      on = (rel[t] > 0).reshape(a_shape[0], *([1] * (len(a_shape) - 2)), a_shape[-1])
      a = jnp.where(on, a, jnp.zeros((), dtype))
    _set(adapters, _kernel_path(t), {"lora_a": a, "lora_b": jnp.zeros(b_shape, dtype)})
  return adapters


def abstract(cfg: qwen.QwenConfig, lcfg: LoraConfig, dtype=jnp.float32):
  """ShapeDtypeStructs of the adapters: nothing allocated."""
  return jax.eval_shape(lambda k, p: init(k, cfg, lcfg, dtype, p), jax.random.key(0),
                        qwen.abstract_params(cfg))


def logical_axes(cfg: qwen.QwenConfig, lcfg: LoraConfig):
  """PartitionSpecs of logical axis names (the adapters' structure): each factor takes its base
  kernel's names for the dims it shares with it, and RANK_AXIS for the rank."""
  base = qwen.logical_axes(cfg)
  axes: dict = {m: base[m] for m in lcfg.modules_to_save}
  for t in layout(lcfg, cfg.num_layers):
    names = tuple(_get(base, _kernel_path(t))["kernel"])  # ('layers', *in, *out)
    n_in = TARGETS[t][1]
    _set(axes, _kernel_path(t), {"lora_a": P(*names[:1 + n_in], RANK_AXIS),
                                 "lora_b": P(names[0], RANK_AXIS, *names[1 + n_in:])})
  return axes


def num_trainable(adapters) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))


def variables(params, adapters, lcfg: LoraConfig | None, scale=None) -> dict:
  """The variables for model.apply: the base alone when adapters is None (the reference policy),
  else with the 'lora' collection, b multiplied by alpha / r (or `scale`, which may be a traced
  array, e.g. one per sweep member). Differentiating through this gives PEFT's gradients.
  The scaled b is fp32 whatever the adapters' dtype: the factor is alpha / r to fp32, as in
  save_peft's adapter and merge (bf16 would make 16 / 6 into 2.671875); the forward casts it to
  the compute dtype (qwen.project)."""
  if adapters is None:
    return {"params": params}
  s = lcfg.scale if scale is None else scale
  scaled = jax.tree.map(lambda x: x, {"layers": adapters["layers"]})
  rel = _relative_scales(lcfg, _num_layers(adapters))
  for t in _targets_of(adapters):
    node = _get(scaled, _kernel_path(t))
    node["lora_b"] = _scaled_b(node["lora_b"], None if rel is None else rel[t], s)
  return {"params": with_saved(params, adapters), "lora": scaled}


def _num_layers(adapters) -> int:
  return jax.tree.leaves(adapters["layers"])[0].shape[0]


def b_factors(adapters) -> list:
  """Every target's b factor (all zero: the adapters change nothing)."""
  return [_get(adapters, _kernel_path(t))["lora_b"] for t in _targets_of(adapters)]


def _targets_of(adapters) -> list[str]:
  layers = adapters.get("layers", {})
  return [t for t, (parent, _) in TARGETS.items() if t in layers.get(parent, {})]


def _outer(lora_a: jax.Array, lora_b: jax.Array) -> jax.Array:
  """a·b over the rank, per layer, in fp32 and the base kernel's layout [L, *in, *out]."""
  a, b = lora_a.astype(jnp.float32), lora_b.astype(jnp.float32)
  l, r = a.shape[0], a.shape[-1]
  a2 = a.reshape(l, -1, r)
  b2 = b.reshape(l, r, -1)
  return jnp.einsum("lir,lro->lio", a2, b2).reshape(a.shape[:-1] + b.shape[2:])


def merged_kernels(params, adapters, lcfg: LoraConfig) -> dict[str, jax.Array]:
  """{target: W + (alpha / r)·a·b}, each computed in fp32 and stored in W's dtype (an int8 W,
  models/quant.py, is dequantized first, into the embedding's dtype)."""
  out = {}
  rel = _relative_scales(lcfg, _num_layers(adapters))
  for t in _targets_of(adapters):
    node = _get(params, _kernel_path(t))
    w = (quant.dequantize_kernel(node, TARGETS[t][1], params["embed_tokens"]["embedding"].dtype)
         if "kernel_q" in node else node["kernel"])
    ab = _get(adapters, _kernel_path(t))
    delta = (lcfg.scale * _outer(**ab) if rel is None
             else _outer(ab["lora_a"], _scaled_b(ab["lora_b"], rel[t], lcfg.scale)))
    out[t] = (w.astype(jnp.float32) + delta).astype(w.dtype)
  return out


def with_kernels(params, kernels: dict[str, jax.Array]):
  """params with each target's kernel replaced by kernels[target] (an int8 kernel's kernel_q
  and kernel_scale too); every other leaf, biases included, is params' own array."""
  out = quant.copy_tree(params)
  for t, w in kernels.items():
    node = _get(out, _kernel_path(t))
    node.pop("kernel_q", None), node.pop("kernel_scale", None)
    node["kernel"] = w
  return out


def merge(params, adapters, lcfg: LoraConfig):
  """The base params with each target kernel W replaced by W + (alpha / r)·a·b, and the trained
  copies of modules_to_save in place (in the base's dtype): one plain model that computes what
  base + adapters compute (an int8 base is dequantized throughout, into the embedding's dtype),
  e.g. to export."""
  plain = quant.dequantize(params)
  dtype = plain["embed_tokens"]["embedding"].dtype
  saved = {m: jax.tree.map(lambda x: x.astype(dtype), adapters[m]) for m in _saved_of(adapters)}
  return with_saved(with_kernels(plain, merged_kernels(params, adapters, lcfg)), saved)


def merged_policy(params, adapters, lcfg: LoraConfig, merge_fn=None):
  """What the sampler runs with lcfg.merge_for_sampling: the base with merged target kernels
  (merge_fn(params, adapters): a jitted merged_kernels with lcfg bound; default: merged_kernels
  itself), its other leaves shared with the base; an int8 base keeps its other projections
  int8. While sampling, this costs one copy of the target kernels in the compute dtype beside
  the base."""
  kernels = (merge_fn(params, adapters) if merge_fn is not None
             else merged_kernels(params, adapters, lcfg))
  dtype = params["embed_tokens"]["embedding"].dtype
  saved = {m: jax.tree.map(lambda x: x.astype(dtype), adapters[m]) for m in _saved_of(adapters)}
  return with_saved(with_kernels(params, kernels), saved)


# --- PEFT export -------------------------------------------------------------------------------

def peft_tensors(adapters, cfg: qwen.QwenConfig, lcfg: LoraConfig) -> dict[str, np.ndarray]:
  """PEFT's names and layouts: lora_A.weight [r, in_features], lora_B.weight [out_features, r],
  for each adapted module at its own rank r (layout: a layer's padding is left out, and a layer
  its target does not adapt has no tensors).

  Our kernels flatten to transformers' [in, out] in order (weights.py: q_proj [D, N, H] is
  [N·H, D] transposed, o_proj [N, H, D] is [D, N·H] transposed), so a flattens to [in, R] and b
  to [R, out] the same way.
  """
  lay = layout(lcfg, cfg.num_layers)
  out = {}
  for m in _saved_of(adapters):  # PEFT's ModulesToSaveWrapper saves the copy as the module's own
    w = np.asarray(jax.device_get(qwen_weight(adapters, m)), np.float32)
    out[f"base_model.model.{_SAVED_PATHS[m]}.weight"] = np.ascontiguousarray(w)
  for t in _targets_of(adapters):
    node = _get(adapters, _kernel_path(t))
    a = np.asarray(jax.device_get(node["lora_a"]), np.float32)
    b = np.asarray(jax.device_get(node["lora_b"]), np.float32)
    big = a.shape[-1]
    for i, r in enumerate(lay[t][0]):
      if not r:
        continue
      name = f"base_model.model.{module_path(i, t)}"
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, big)[:, :r].T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(big, -1)[:r].T)
  return out


# modules_to_save: the module's path in the causal LM (PEFT's tensor names) and its weight as
# transformers holds it ([V, D] both: our lm_head is [D, V]).
_SAVED_PATHS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}


def qwen_weight(tree, module: str):
  """A modules_to_save module's transformers weight [V, D] from a params-like tree."""
  return tree["embed_tokens"]["embedding"] if module == "embed_tokens" else tree["lm_head"].T


def peft_config(lcfg: LoraConfig, base_model: str = "") -> dict:
  """adapter_config.json: the fields PEFT reads for a LoRA on a causal LM, lcfg's options in
  PEFT's own fields (its patterns as dicts, layers_to_transform a list or null)."""
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model or None,
      "r": lcfg.rank,
      "lora_alpha": lcfg.alpha,
      "lora_dropout": lcfg.dropout,
      "target_modules": sorted(lcfg.targets),
      "rank_pattern": dict(lcfg.rank_pattern),
      "alpha_pattern": dict(lcfg.alpha_pattern),
      "layers_to_transform": list(lcfg.layers_to_transform) or None,
      "layers_pattern": None,
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": lcfg.use_rslora,
      "use_dora": False,
      "init_lora_weights": True,
      "modules_to_save": list(lcfg.modules_to_save) or None,
      "inference_mode": True,
  }


def save_peft(adapters, cfg: qwen.QwenConfig, lcfg: LoraConfig, out_dir,
              base_model: str = "", dtype=None) -> Path:
  """Writes adapter_config.json + adapter_model.safetensors (fp32, or `dtype`) into out_dir:
  `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)`. Written
  beside out_dir and renamed into it, so a crash leaves no half adapter. The adapters must hold
  exactly the targets lcfg adapts (layout), each of its largest rank: adapter_config.json says
  so, and PEFT would load an adapter of another target without a word and compute without it."""
  lay = layout(lcfg, cfg.num_layers)
  held = _targets_of(adapters)
  missing = [t for t in lay if t not in held]
  if missing:
    raise ValueError(f"save_peft: the adapters have no {missing} although model.lora.targets "
                     "names them")
  extra = [t for t in held if t not in lay]
  if extra:
    raise ValueError(f"save_peft: the adapters hold {extra}, which model.lora.targets "
                     f"{list(lcfg.targets)} does not name (PEFT would load them as no adapter)")
  if _saved_of(adapters) != list(lcfg.modules_to_save):
    raise ValueError(f"save_peft: the adapters hold copies of {_saved_of(adapters)}, "
                     f"model.lora.modules_to_save names {list(lcfg.modules_to_save)}")
  for t in held:
    r, want = _get(adapters, _kernel_path(t))["lora_a"].shape[-1], max(lay[t][0])
    if r != want:
      source = "model.lora.rank_pattern gives" if lcfg.rank_pattern else "model.lora.rank is"
      raise ValueError(f"save_peft: the adapters' {t} has rank {r}, {source} {want}")
  tensors = peft_tensors(adapters, cfg, lcfg)
  if dtype is not None:
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
  out_dir = Path(out_dir)
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
  try:
    save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(lcfg, base_model), indent=2))
    weights.replace_dir(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


# adapter_config.json fields that do not change what the adapter computes (metadata, training
# settings), and those _config_of reads (r, lora_alpha, target_modules, the patterns, rsLoRA,
# the layers). Every other field must hold its default (null, false, {}, [] or the value in
# _PEFT_DEFAULTS): PEFT adds variants as new fields (lora_bias, trainable_token_indices,
# alora_invocation_tokens, layer_replication...), and one this loader does not know would
# otherwise load as plain LoRA, silently wrong.
_PEFT_IGNORED = frozenset({
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules",
    "runtime_config", "megatron_core", "qalora_group_size", "use_rslora", "rank_pattern",
    "alpha_pattern", "layers_to_transform", "layers_pattern", "modules_to_save"})
_PEFT_DEFAULTS = {"bias": "none"}
# init_lora_weights that only chose the starting A and B. pissa, olora, corda, loftq and lora_ga
# also rewrite the base weights, so their adapters do not apply to the original base.
_PEFT_INITS = (True, False, "gaussian", "orthogonal", "eva")
# Modules of the causal LM besides the decoder layers' projections that a target_modules regex
# could name; this model adapts neither.
_OTHER_MODULES = ("lm_head", "model.embed_tokens")


def _read_adapter_config(cfg_file: Path) -> dict:
  """adapter_config.json as a dict, every field it does not read at its default."""
  try:
    pc = json.loads(cfg_file.read_text())
  except json.JSONDecodeError as e:
    raise weights.CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
  if not isinstance(pc, dict):
    raise weights.CheckpointError(f"{cfg_file}: expected a JSON object")

  def bad(field, why):
    return weights.CheckpointError(f"{cfg_file}: {field}={pc.get(field)!r}: {why}")
  if pc.get("peft_type") != "LORA":
    raise bad("peft_type", "only LORA adapters load")
  for field, value in pc.items():
    if field in _PEFT_IGNORED:
      continue
    if field == "init_lora_weights":
      if not any(value is ok or (isinstance(ok, str) and value == ok) for ok in _PEFT_INITS):
        raise bad(field, f"not supported (only {_PEFT_INITS}; the others change the base "
                  "weights)")
    elif value not in (None, False, {}, [], _PEFT_DEFAULTS.get(field)):
      default = (repr(_PEFT_DEFAULTS[field]) if field in _PEFT_DEFAULTS
                 else "its default: null, false, {} or []")
      raise bad(field, f"not supported (load_peft computes plain LoRA; only {default})")
  if pc.get("layers_pattern") not in (None, "", [], "layers", ["layers"]):
    raise bad("layers_pattern", "not supported (a Qwen model's decoder layers are 'layers')")
  return pc


def _config_of(pc: dict, cfg_file: Path, cfg: qwen.QwenConfig) -> LoraConfig:
  """The LoraConfig of an adapter_config.json. A target_modules string is PEFT's regex, matched
  whole against each module path: it becomes the list of the paths it matches."""
  targets = pc.get("target_modules")
  if isinstance(targets, str):
    named = [m for m in _OTHER_MODULES if re.fullmatch(targets, m)]
    if named:
      raise weights.CheckpointError(f"{cfg_file}: target_modules={targets!r} adapts {named[0]}, "
                                    "which this model does not (only the decoder projections)")
    targets = [module_path(i, t) for t in TARGETS for i in range(cfg.num_layers)
               if re.fullmatch(targets, module_path(i, t))]
  try:
    lcfg = LoraConfig(rank=pc.get("r"), alpha=pc.get("lora_alpha"),
                      targets=tuple(sorted(targets or ())), dropout=0.0,
                      use_rslora=bool(pc.get("use_rslora") or False),
                      rank_pattern=pc.get("rank_pattern") or (),
                      alpha_pattern=pc.get("alpha_pattern") or (),
                      layers_to_transform=pc.get("layers_to_transform") or (),
                      modules_to_save=tuple(pc.get("modules_to_save") or ()))
    layout(lcfg, cfg.num_layers)
    check_saved(lcfg, cfg)
  except ValueError as e:
    raise weights.CheckpointError(f"{cfg_file}: {e}") from e
  return lcfg


def load_peft(adapter_dir, cfg: qwen.QwenConfig, dtype=jnp.float32):
  """Reads a PEFT LoRA adapter directory (save_peft's or PEFT's own save_pretrained) into
  (adapters, LoraConfig). Only what this model computes is accepted: LoRA on the seven
  projections, with PEFT's target_modules (names, full paths or a regex), rank / alpha patterns,
  rsLoRA and layers_to_transform; any other adapter_config.json field that is not at its
  default, and any tensor this does not read, stops with a line naming it."""
  adapter_dir = Path(adapter_dir)
  cfg_file, w_file = adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
  for f in (cfg_file, w_file):
    if not f.is_file():
      raise weights.CheckpointError(f"{f}: missing (a PEFT adapter directory holds "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE})")
  lcfg = _config_of(_read_adapter_config(cfg_file), cfg_file, cfg)
  try:
    with safe_open(w_file, framework="numpy") as f:
      adapters, unread = _read_tensors(f, w_file, cfg, lcfg, dtype)
  except (SafetensorError, OSError) as e:
    raise weights.CheckpointError(f"{w_file}: unreadable safetensors file ({e})") from e
  if unread:
    raise weights.CheckpointError(
        f"{w_file}: tensor {sorted(unread)[0]!r} ({len(unread)} such) is not a lora_A/lora_B "
        f"of target_modules {list(lcfg.targets)}; load_peft computes plain LoRA only")
  return adapters, lcfg


def _read_tensors(f, w_file, cfg, lcfg, dtype):
  """(adapters, names of the file's tensors left unread): each adapted module's factors at its
  own rank, zero-padded to its target's largest (layout)."""
  shapes = _shapes(cfg, lcfg)
  names = set(f.keys())
  unread = set(names)
  adapters: dict = {}
  for m in lcfg.modules_to_save:
    key, want = f"base_model.model.{_SAVED_PATHS[m]}.weight", (cfg.vocab_size, cfg.hidden_size)
    if key not in names:
      raise weights.CheckpointError(f"{w_file}: tensor {key!r} is missing (modules_to_save "
                                    f"names {m})")
    unread.discard(key)
    x = f.get_tensor(key)
    if x.shape != want:
      raise weights.CheckpointError(f"{w_file}: tensor {key!r} has shape {tuple(x.shape)}; the "
                                    f"model's config.json implies {want}")
    x = jnp.asarray(x, dtype)
    adapters[m] = {"embedding": x} if m == "embed_tokens" else x.T
  for t, (ranks, _) in layout(lcfg, cfg.num_layers).items():
    a_shape, b_shape = shapes[t]
    n_in, n_out, big = math.prod(a_shape[1:-1]), math.prod(b_shape[2:]), a_shape[-1]
    a_all = np.zeros((cfg.num_layers, n_in, big), np.float32)
    b_all = np.zeros((cfg.num_layers, big, n_out), np.float32)
    for i, r in enumerate(ranks):
      if not r:
        continue
      for factor, shape, into in (("lora_A", (r, n_in), a_all), ("lora_B", (n_out, r), b_all)):
        key = f"base_model.model.{module_path(i, t)}.{factor}.weight"
        if key not in names:
          raise weights.CheckpointError(f"{w_file}: tensor {key!r} is missing")
        unread.discard(key)
        x = f.get_tensor(key)
        if x.shape != shape:
          raise weights.CheckpointError(
              f"{w_file}: tensor {key!r} has shape {tuple(x.shape)}; r={r} and the "
              f"model's config.json imply {shape}")
        if factor == "lora_A":
          into[i, :, :r] = x.T
        else:
          into[i, :r, :] = x.T
    _set(adapters, _kernel_path(t), {"lora_a": jnp.asarray(a_all.reshape(a_shape), dtype),
                                     "lora_b": jnp.asarray(b_all.reshape(b_shape), dtype)})
  return adapters, unread


def start_adapters(lcfg: LoraConfig, cfg: qwen.QwenConfig, dtype=jnp.float32):
  """The adapters of lcfg.init_from (a PEFT adapter directory, or a hub id downloaded through
  weights.resolve), which must adapt the modules lcfg adapts with the same rank and scale
  (layout); else a CheckpointError naming adapter_config.json, the first module that differs
  and the adapter's settings to copy."""
  field = "config.model.lora.init_from"
  where = weights.resolve(lcfg.init_from, field)
  try:
    adapters, theirs = load_peft(where, cfg, dtype)
  except weights.CheckpointError as e:
    raise weights.CheckpointError(f"{field}: {e}") from None
  mine_l, theirs_l = layout(lcfg, cfg.num_layers), layout(theirs, cfg.num_layers)
  for t in TARGETS:
    none = ((0,) * cfg.num_layers, (0.0,) * cfg.num_layers)
    (mr, ms), (tr, ts) = mine_l.get(t, none), theirs_l.get(t, none)
    for i in range(cfg.num_layers):
      if (mr[i], ms[i]) != (tr[i], ts[i]):
        raise weights.CheckpointError(
            f"{field}: {where / CONFIG_FILE}: the adapter gives {module_path(i, t)} rank "
            f"{tr[i]} and scale {ts[i]:g}, model.lora gives it rank {mr[i]} and scale {ms[i]:g}; "
            f"set model.lora to the adapter's settings ({_settings(theirs)})")
  return adapters


def _settings(lcfg: LoraConfig) -> str:
  """lcfg's options as model.lora fields, those at their defaults left out."""
  out = [f"rank={lcfg.rank}", f"alpha={lcfg.alpha:g}", f"targets={list(lcfg.targets)}"]
  for name, default in (("use_rslora", False), ("rank_pattern", ()), ("alpha_pattern", ()),
                        ("layers_to_transform", ())):
    value = getattr(lcfg, name)
    if value != default:
      out.append(f"{name}={dict(value) if name.endswith('pattern') else value!r}")
  return ", ".join(out)


def save_merged(params, adapters, cfg: qwen.QwenConfig, lcfg: LoraConfig, out_dir,
                **kwargs) -> Path:
  """The merged model as a full transformers checkpoint (weights.save_checkpoint's kwargs)."""
  return weights.save_checkpoint(merge(params, adapters, lcfg), cfg, out_dir, **kwargs)
