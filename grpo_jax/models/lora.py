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
import json
import math
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
RANK_AXIS = "lora_rank"  # logical axis of the rank dim (replicated, see sharding.RULES)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r, alpha (the update is scaled by alpha / r, as PEFT's lora_alpha), target modules."""
  rank: int
  alpha: float
  targets: tuple[str, ...] = tuple(TARGETS)
  dropout: float = 0.0
  # 'int8': the frozen base's seven projection kernels stored as int8 (QLoRA, models/quant.py).
  quantize: str = "none"
  # The sampler runs one model with W + (alpha / r)·a·b in each target (merged_policy), not the
  # base and the adapters side by side; sweeps of K members always run them side by side.
  merge_for_sampling: bool = True

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"model.lora.rank must be a positive integer, got {self.rank!r}")
    if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
      raise ValueError(f"model.lora.alpha must be a positive number, got {self.alpha!r}")
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    object.__setattr__(self, "targets", targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
      raise ValueError(f"model.lora.targets must be distinct names among {list(TARGETS)}, got "
                       f"{list(targets)}")
    if self.dropout != 0:
      raise ValueError(f"model.lora.dropout={self.dropout!r}: only 0 is supported")
    if self.quantize not in quant.MODES:
      raise ValueError(f"model.lora.quantize={self.quantize!r}: expected one of {quant.MODES}")
    if not isinstance(self.merge_for_sampling, bool):
      raise ValueError(f"model.lora.merge_for_sampling must be True or False, got "
                       f"{self.merge_for_sampling!r}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @classmethod
  def from_config(cls, c: Mapping[str, Any] | None) -> "LoraConfig | None":
    """From a config block (a ConfigDict or dict: rank, alpha, targets, dropout); rank 0 = off."""
    if c is None or not c.get("rank", 0):
      return None
    known = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(c.keys()) - known)
    if extra:
      raise ValueError(f"model.lora: unknown field(s) {extra}; known: {sorted(known)}")
    return cls(**{k: (tuple(v) if k == "targets" else v) for k, v in c.items()})


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
  for t in lcfg.targets:
    shape = _get(base, _kernel_path(t))["kernel"].shape  # [L, *in, *out]
    n_in = TARGETS[t][1]
    out[t] = ((*shape[:1 + n_in], lcfg.rank), (shape[0], lcfg.rank, *shape[1 + n_in:]))
  return out


def init(key: jax.Array, cfg: qwen.QwenConfig, lcfg: LoraConfig, dtype=jnp.float32):
  """Fresh adapters: a uniform in ±1/sqrt(fan_in) (PEFT's default), b zeros."""
  adapters: dict = {}
  shapes = _shapes(cfg, lcfg)
  for k, t in zip(jax.random.split(key, len(lcfg.targets)), lcfg.targets):
    a_shape, b_shape = shapes[t]
    bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
    _set(adapters, _kernel_path(t), {
        "lora_a": jax.random.uniform(k, a_shape, dtype, -bound, bound),
        "lora_b": jnp.zeros(b_shape, dtype)})
  return adapters


def abstract(cfg: qwen.QwenConfig, lcfg: LoraConfig, dtype=jnp.float32):
  """ShapeDtypeStructs of the adapters: nothing allocated."""
  return jax.eval_shape(lambda k: init(k, cfg, lcfg, dtype), jax.random.key(0))


def logical_axes(cfg: qwen.QwenConfig, lcfg: LoraConfig):
  """PartitionSpecs of logical axis names (the adapters' structure): each factor takes its base
  kernel's names for the dims it shares with it, and RANK_AXIS for the rank."""
  base = qwen.logical_axes(cfg)
  axes: dict = {}
  for t in lcfg.targets:
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
  scaled = jax.tree.map(lambda x: x, adapters)
  for t in _targets_of(adapters):
    node = _get(scaled, _kernel_path(t))
    node["lora_b"] = node["lora_b"].astype(jnp.float32) * jnp.asarray(s, jnp.float32)
  return {"params": params, "lora": scaled}


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
  for t in _targets_of(adapters):
    node = _get(params, _kernel_path(t))
    w = (quant.dequantize_kernel(node, TARGETS[t][1], params["embed_tokens"]["embedding"].dtype)
         if "kernel_q" in node else node["kernel"])
    out[t] = (w.astype(jnp.float32) + lcfg.scale * _outer(
        **_get(adapters, _kernel_path(t)))).astype(w.dtype)
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
  """The base params with each target kernel W replaced by W + (alpha / r)·a·b: one plain model
  that computes what base + adapters compute (an int8 base is dequantized throughout, into the
  embedding's dtype), e.g. to export."""
  return with_kernels(quant.dequantize(params), merged_kernels(params, adapters, lcfg))


def merged_policy(params, adapters, lcfg: LoraConfig, merge_fn=None):
  """What the sampler runs with lcfg.merge_for_sampling: the base with merged target kernels
  (merge_fn(params, adapters): a jitted merged_kernels with lcfg bound; default: merged_kernels
  itself), its other leaves shared with the base; an int8 base keeps its other projections
  int8. While sampling, this costs one copy of the target kernels in the compute dtype beside
  the base."""
  kernels = (merge_fn(params, adapters) if merge_fn is not None
             else merged_kernels(params, adapters, lcfg))
  return with_kernels(params, kernels)


# --- PEFT export -------------------------------------------------------------------------------

def peft_tensors(adapters, cfg: qwen.QwenConfig) -> dict[str, np.ndarray]:
  """PEFT's names and layouts: lora_A.weight [r, in_features], lora_B.weight [out_features, r].

  Our kernels flatten to transformers' [in, out] in order (weights.py: q_proj [D, N, H] is
  [N·H, D] transposed, o_proj [N, H, D] is [D, N·H] transposed), so a flattens to [in, r] and b
  to [r, out] the same way.
  """
  out = {}
  for t in _targets_of(adapters):
    parent = TARGETS[t][0]
    node = _get(adapters, _kernel_path(t))
    a = np.asarray(jax.device_get(node["lora_a"]), np.float32)
    b = np.asarray(jax.device_get(node["lora_b"]), np.float32)
    r = a.shape[-1]
    for i in range(cfg.num_layers):
      name = f"base_model.model.model.layers.{i}.{parent}.{t}"
      out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
      out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
  return out


def peft_config(lcfg: LoraConfig, base_model: str = "") -> dict:
  """adapter_config.json: the fields PEFT reads for a plain LoRA on a causal LM."""
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model or None,
      "r": lcfg.rank,
      "lora_alpha": lcfg.alpha,
      "lora_dropout": lcfg.dropout,
      "target_modules": sorted(lcfg.targets),
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "modules_to_save": None,
      "inference_mode": True,
  }


def save_peft(adapters, cfg: qwen.QwenConfig, lcfg: LoraConfig, out_dir,
              base_model: str = "", dtype=None) -> Path:
  """Writes adapter_config.json + adapter_model.safetensors (fp32, or `dtype`) into out_dir:
  `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)`. Written
  beside out_dir and renamed into it, so a crash leaves no half adapter. The adapters must hold
  exactly lcfg's targets, of rank lcfg.rank: adapter_config.json says so, and PEFT would load
  an adapter of another target without a word and compute without it."""
  held = _targets_of(adapters)
  missing = [t for t in lcfg.targets if t not in held]
  if missing:
    raise ValueError(f"save_peft: the adapters have no {missing} although model.lora.targets "
                     "names them")
  extra = [t for t in held if t not in lcfg.targets]
  if extra:
    raise ValueError(f"save_peft: the adapters hold {extra}, which model.lora.targets "
                     f"{list(lcfg.targets)} does not name (PEFT would load them as no adapter)")
  for t in held:
    r = _get(adapters, _kernel_path(t))["lora_a"].shape[-1]
    if r != lcfg.rank:
      raise ValueError(f"save_peft: the adapters' {t} has rank {r}, model.lora.rank is "
                       f"{lcfg.rank}")
  tensors = peft_tensors(adapters, cfg)
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
# settings, and r / lora_alpha / target_modules, which load_peft reads). Every other field must
# hold its default (null, false, {}, [] or the value in _PEFT_DEFAULTS): PEFT adds variants as
# new fields (lora_bias, trainable_token_indices, alora_invocation_tokens, layer_replication...),
# and one this loader does not know would otherwise load as plain LoRA, silently wrong.
_PEFT_IGNORED = frozenset({
    "peft_type", "task_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules",
    "runtime_config", "megatron_core", "qalora_group_size"})
_PEFT_DEFAULTS = {"bias": "none"}
# init_lora_weights that only chose the starting A and B. pissa, olora, corda, loftq and lora_ga
# also rewrite the base weights, so their adapters do not apply to the original base.
_PEFT_INITS = (True, False, "gaussian", "orthogonal", "eva")


def load_peft(adapter_dir, cfg: qwen.QwenConfig, dtype=jnp.float32):
  """Reads a PEFT LoRA adapter directory (save_peft's or PEFT's own save_pretrained) into
  (adapters, LoraConfig). Only what this model computes is accepted: plain LoRA on the seven
  projections of every layer, scale alpha / r; any other adapter_config.json field that is not
  at its default, and any tensor this does not read, stops with a line naming it."""
  adapter_dir = Path(adapter_dir)
  cfg_file, w_file = adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
  for f in (cfg_file, w_file):
    if not f.is_file():
      raise weights.CheckpointError(f"{f}: missing (a PEFT adapter directory holds "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE})")
  try:
    pc = json.loads(cfg_file.read_text())
  except json.JSONDecodeError as e:
    raise weights.CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e

  def bad(field, why):
    return weights.CheckpointError(f"{cfg_file}: {field}={pc.get(field)!r}: {why}")
  if not isinstance(pc, dict):
    raise weights.CheckpointError(f"{cfg_file}: expected a JSON object")
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
  targets = pc.get("target_modules")
  if isinstance(targets, str):
    targets = [targets]
  try:
    lcfg = LoraConfig(rank=pc.get("r"), alpha=pc.get("lora_alpha"),
                      targets=tuple(sorted(targets or ())), dropout=0.0)
  except ValueError as e:
    raise weights.CheckpointError(f"{cfg_file}: {e}") from e
  shapes = _shapes(cfg, lcfg)
  adapters: dict = {}
  try:
    with safe_open(w_file, framework="numpy") as f:
      names = set(f.keys())
      unread = set(names)
      for t in lcfg.targets:
        a_shape, b_shape = shapes[t]
        want = {"lora_A": (lcfg.rank, math.prod(a_shape[1:-1])),   # [r, in]
                "lora_B": (math.prod(b_shape[2:]), lcfg.rank)}     # [out, r]
        layers = {"lora_A": [], "lora_B": []}
        for i in range(cfg.num_layers):
          for factor, shape in want.items():
            key = f"base_model.model.model.layers.{i}.{TARGETS[t][0]}.{t}.{factor}.weight"
            if key not in names:
              raise weights.CheckpointError(f"{w_file}: tensor {key!r} is missing")
            unread.discard(key)
            x = f.get_tensor(key)
            if x.shape != shape:
              raise weights.CheckpointError(
                  f"{w_file}: tensor {key!r} has shape {tuple(x.shape)}; r={lcfg.rank} and the "
                  f"model's config.json imply {shape}")
            layers[factor].append(x.T)
        _set(adapters, _kernel_path(t), {
            "lora_a": jnp.asarray(np.stack(layers["lora_A"]).reshape(a_shape), dtype),
            "lora_b": jnp.asarray(np.stack(layers["lora_B"]).reshape(b_shape), dtype)})
      if unread:
        raise weights.CheckpointError(
            f"{w_file}: tensor {sorted(unread)[0]!r} ({len(unread)} such) is not a lora_A/lora_B "
            f"of target_modules {list(lcfg.targets)}; load_peft computes plain LoRA only")
  except (SafetensorError, OSError) as e:
    raise weights.CheckpointError(f"{w_file}: unreadable safetensors file ({e})") from e
  return adapters, lcfg


def save_merged(params, adapters, cfg: qwen.QwenConfig, lcfg: LoraConfig, out_dir,
                **kwargs) -> Path:
  """The merged model as a full transformers checkpoint (weights.save_checkpoint's kwargs)."""
  return weights.save_checkpoint(merge(params, adapters, lcfg), cfg, out_dir, **kwargs)
