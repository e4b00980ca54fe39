"""Hugging Face safetensors checkpoints <-> the params pytree of grpo_jax.models.qwen.

The key map is one table (`_layer_map`, `_top_map`): each entry names the HF tensor and how its
[out, in] Linear layout is reshaped/transposed into ours. Loading reads one tensor at a time
(per layer for stacked weights), casts it to the param dtype and places it straight into its
target sharding, so the host never holds more than one parameter of the model.

    params, cfg = load_checkpoint("Qwen/Qwen2.5-0.5B-Instruct")         # hub id (online or cached)
    params, cfg = load_checkpoint("/ckpts/qwen", mesh=make_mesh((1, 8, 1)))
    save_checkpoint(params, cfg, "/out/policy", tokenizer=tok)  # transformers-loadable
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from grpo_jax import hub, sharding as sharding_lib
from grpo_jax.errors import UserError
from grpo_jax.models import qwen

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(UserError, ValueError):
  """A checkpoint is missing, malformed or does not match its config."""


# --- the key map -------------------------------------------------------------------------------
# Each entry: our path inside params (tuple of keys), HF name, to_ours(hf_array, cfg),
# to_hf(our_array, cfg). Layer entries use "{i}" in the HF name and are stacked on axis 0.

def _qkv(heads_attr):
  def to_ours(w, cfg):  # HF [heads*H, D] -> [D, heads, H]
    return w.reshape(getattr(cfg, heads_attr), cfg.head_dim, cfg.hidden_size).transpose(2, 0, 1)

  def to_hf(w, cfg):
    return w.transpose(1, 2, 0).reshape(-1, cfg.hidden_size)
  return to_ours, to_hf


def _qkv_bias(heads_attr):
  return (lambda b, cfg: b.reshape(getattr(cfg, heads_attr), cfg.head_dim),
          lambda b, cfg: b.reshape(-1))


_o = (lambda w, cfg: w.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size),  # [D, N*H]
      lambda w, cfg: w.reshape(-1, cfg.hidden_size).T)
_t = (lambda w, cfg: w.T, lambda w, cfg: w.T)
_same = (lambda w, cfg: w, lambda w, cfg: w)


def _layer_map(cfg: qwen.QwenConfig):
  p = "model.layers.{i}."
  m = [
      (("input_layernorm", "weight"), p + "input_layernorm.weight", _same),
      (("post_attention_layernorm", "weight"), p + "post_attention_layernorm.weight", _same),
      (("self_attn", "q_proj", "kernel"), p + "self_attn.q_proj.weight", _qkv("num_heads")),
      (("self_attn", "k_proj", "kernel"), p + "self_attn.k_proj.weight", _qkv("num_kv_heads")),
      (("self_attn", "v_proj", "kernel"), p + "self_attn.v_proj.weight", _qkv("num_kv_heads")),
      (("self_attn", "o_proj", "kernel"), p + "self_attn.o_proj.weight", _o),
      (("mlp", "gate_proj", "kernel"), p + "mlp.gate_proj.weight", _t),
      (("mlp", "up_proj", "kernel"), p + "mlp.up_proj.weight", _t),
      (("mlp", "down_proj", "kernel"), p + "mlp.down_proj.weight", _t),
  ]
  if cfg.qkv_bias:
    m += [
        (("self_attn", "q_proj", "bias"), p + "self_attn.q_proj.bias", _qkv_bias("num_heads")),
        (("self_attn", "k_proj", "bias"), p + "self_attn.k_proj.bias", _qkv_bias("num_kv_heads")),
        (("self_attn", "v_proj", "bias"), p + "self_attn.v_proj.bias", _qkv_bias("num_kv_heads")),
    ]
  if cfg.o_bias:
    m.append((("self_attn", "o_proj", "bias"), p + "self_attn.o_proj.bias", _same))
  if cfg.qk_norm:
    m += [(("self_attn", "q_norm", "weight"), p + "self_attn.q_norm.weight", _same),
          (("self_attn", "k_norm", "weight"), p + "self_attn.k_norm.weight", _same)]
  return m


def _top_map(cfg: qwen.QwenConfig):
  m = [(("embed_tokens", "embedding"), "model.embed_tokens.weight", _same),
       (("norm", "weight"), "model.norm.weight", _same)]
  if not cfg.tie_word_embeddings:
    m.append((("lm_head",), "lm_head.weight", _t))
  return m


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


# --- reading -----------------------------------------------------------------------------------

def resolve(path_or_id: str | os.PathLike, field: str = "checkpoint") -> Path:
  """A local checkpoint directory, or a hub id downloaded (or found in the cache) via
  huggingface_hub; see grpo_jax.hub for the rule. `field` names the setting in errors."""
  name = str(path_or_id)
  local = hub.local_path(name, field)
  if local is not None:
    if not os.path.isdir(local):
      raise CheckpointError(f"{field}: {name!r} is a file; expected a checkpoint directory")
    return Path(local)
  from huggingface_hub import snapshot_download  # only needed for hub ids
  hub.prepare()
  try:
    return Path(snapshot_download(
        name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]))
  except Exception as e:  # offline, unknown repo, gated, ...
    raise hub.unavailable(name, field, "checkpoint", e) from e


def read_hf_config(ckpt: Path) -> dict:
  """config.json as a dict (fields QwenConfig does not keep, e.g. _name_or_path, included)."""
  cfg_file = Path(ckpt) / "config.json"
  if not cfg_file.is_file():
    raise CheckpointError(f"{cfg_file}: missing (every checkpoint needs its config.json)")
  try:
    return json.loads(cfg_file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e


def read_config(ckpt: Path) -> qwen.QwenConfig:
  source = str(Path(ckpt) / "config.json")
  try:
    return qwen.QwenConfig.from_hf(read_hf_config(ckpt), source=source)
  except (ValueError, TypeError, AttributeError) as e:
    message = str(e)
    raise CheckpointError(message if message.startswith(source) else f"{source}: {message}") from e


def _weight_files(ckpt: Path) -> dict[str, Path]:
  """HF tensor name -> the safetensors file that holds it (from the index, or the one file)."""
  index = ckpt / INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index}: malformed index ({e})") from e
    files = {name: ckpt / f for name, f in weight_map.items()}
    for f in set(files.values()):
      if not f.is_file():
        raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
    return files
  single = ckpt / SINGLE_FILE
  if not single.is_file():
    raise CheckpointError(f"{ckpt}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
  try:
    with safe_open(single, framework="numpy") as f:
      return {name: single for name in f.keys()}
  except (SafetensorError, OSError) as e:
    raise CheckpointError(f"{single}: unreadable safetensors file ({e})") from e


def check_weight_files(ckpt: Path) -> None:
  """CheckpointError unless ckpt's weight files are there (the index's shards, or the single
  file with a readable header): a run checks this before it compiles; nothing is loaded."""
  _weight_files(Path(ckpt))


# Stored dtypes that load_checkpoint casts to the param dtype. Anything else (int8, fp8, ...)
# is a quantized checkpoint whose scales this loader does not apply.
_FLOAT_DTYPES = ("F32", "BF16", "F16")


class _Reader:
  """Keeps shard files open while loading; names the file in every error, and where the tensor
  names come from (the index, or the single safetensors file) when one is missing."""

  def __init__(self, ckpt: Path):
    self.files, self.handles = _weight_files(ckpt), {}
    self.listing = ckpt / INDEX_FILE if (ckpt / INDEX_FILE).is_file() else ckpt / SINGLE_FILE

  def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.files:
      raise CheckpointError(f"{self.listing}: tensor {name!r} is missing from the checkpoint")
    path = self.files[name]
    try:
      if path not in self.handles:
        self.handles[path] = safe_open(path, framework="numpy").__enter__()
      dtype = self.handles[path].get_slice(name).get_dtype()
    except Exception as e:  # whatever safetensors raises, say which file and tensor
      raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e
    if dtype not in _FLOAT_DTYPES:
      raise CheckpointError(
          f"{path}: tensor {name!r} is stored as {dtype}; only {'/'.join(_FLOAT_DTYPES)} load "
          "(a quantized checkpoint? use the unquantized one)")
    try:
      arr = self.handles[path].get_tensor(name)
    except Exception as e:
      raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e
    if tuple(arr.shape) != tuple(shape):
      raise CheckpointError(
          f"{path}: tensor {name!r} has shape {tuple(arr.shape)}, config.json implies "
          f"{tuple(shape)}")
    return arr

  def close(self):
    for h in self.handles.values():
      h.__exit__(None, None, None)


def _hf_shape(to_hf: Callable, shape, cfg) -> tuple[int, ...]:
  return jax.eval_shape(lambda x: to_hf(x, cfg), jax.ShapeDtypeStruct(shape, jnp.float32)).shape


def read_generation_config(ckpt: Path) -> dict | None:
  """generation_config.json as a dict (stop ids live here), or None if the checkpoint has none."""
  f = Path(ckpt) / "generation_config.json"
  if not f.is_file():
    return None
  try:
    config = json.loads(f.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{f}: not valid JSON ({e})") from e
  if not isinstance(config, dict):
    raise CheckpointError(f"{f}: expected a JSON object, got {type(config).__name__}")
  return config


def _check_tied_head(read: _Reader, embedding: np.ndarray, ckpt: Path) -> None:
  """A tied config whose file also stores lm_head.weight: the two must be the same values,
  since libraries disagree on which one a tied model uses."""
  if "lm_head.weight" not in read.files:
    return
  head = read("lm_head.weight", embedding.shape)
  if not np.array_equal(head, embedding):
    raise CheckpointError(
        f"{read.files['lm_head.weight']}: tensor 'lm_head.weight' differs from "
        f"'model.embed_tokens.weight' although {ckpt / 'config.json'} sets "
        "tie_word_embeddings=true; fix one of the two (set it false to use the stored head)")


def _check_no_unused_tensors(read: _Reader, cfg: qwen.QwenConfig, ckpt: Path) -> None:
  """Every tensor of the checkpoint is one the config's model uses: a tensor it does not (q/k/v
  biases beside a qwen3 config without attention_bias, layers past num_hidden_layers, a
  misspelt name) means config.json describes another model than the one stored."""
  used = {hf_name for _, hf_name, _ in _top_map(cfg)}
  used |= {hf_name.format(i=i) for _, hf_name, _ in _layer_map(cfg) for i in range(cfg.num_layers)}
  if cfg.tie_word_embeddings:
    used.add("lm_head.weight")  # allowed when it equals the embedding (_check_tied_head)
  unused = sorted(set(read.files) - used)
  if unused:
    more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
    raise CheckpointError(
        f"{read.files[unused[0]]}: tensor {unused[0]!r}{more} is not part of the model "
        f"{ckpt / 'config.json'} describes ({cfg.model_type}, num_hidden_layers="
        f"{cfg.num_layers}); fix config.json (e.g. attention_bias, num_hidden_layers) or remove "
        "the tensor")


def load_checkpoint(path_or_id, param_dtype=jnp.float32, mesh=None):
  """Loads (params, QwenConfig). With a mesh, each param lands in its logical sharding.

  Tensors stored in bf16/fp16/fp32 are cast to `param_dtype`; quantized checkpoints (config.json
  quantization_config, or int8/fp8 tensors) are refused. A tied checkpoint uses the embedding
  as the head; one that also stores an lm_head.weight must store the embedding's values there
  (transformers 5 would use the stored head, 4.x and vLLM the embedding). A tensor the config's
  model does not use (a bias the config does not have, a layer past num_hidden_layers) is
  refused, naming it. Extra rows of the embedding beyond the tokenizer's vocabulary are kept
  (the sampler masks them, see grpo_jax.tokenizer).
  """
  ckpt = resolve(path_or_id)
  cfg = read_config(ckpt)
  abstract = qwen.abstract_params(cfg, param_dtype)
  if mesh is not None:
    shardings = sharding_lib.param_shardings(qwen.logical_axes(cfg), abstract, mesh)
  else:
    shardings = jax.tree.map(lambda _: None, abstract)
  read = _Reader(ckpt)
  params: dict = {}

  def place(path, host_array):
    leaf = _get(abstract, path)
    arr = np.asarray(host_array).astype(param_dtype)
    target = _get(shardings, path)
    value = jax.device_put(arr, target) if target is not None else jnp.asarray(arr)
    node = params
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = value
    assert value.shape == leaf.shape, (path, value.shape, leaf.shape)

  try:
    for path, hf_name, (to_ours, to_hf) in _top_map(cfg):
      shape = _get(abstract, path).shape
      host = read(hf_name, _hf_shape(to_hf, shape, cfg))
      if path == ("embed_tokens", "embedding") and cfg.tie_word_embeddings:
        _check_tied_head(read, host, ckpt)
      place(path, to_ours(host, cfg))
    for path, hf_name, (to_ours, to_hf) in _layer_map(cfg):
      shape = _get(abstract["layers"], path).shape[1:]
      hf_shape = _hf_shape(to_hf, shape, cfg)
      stacked = np.stack([to_ours(read(hf_name.format(i=i), hf_shape), cfg)
                          for i in range(cfg.num_layers)])
      place(("layers",) + path, stacked)
    # Last, so that a quantized tensor or a wrong shape gets its own, more precise error first.
    _check_no_unused_tensors(read, cfg, ckpt)
  finally:
    read.close()
  return params, cfg


# --- writing -----------------------------------------------------------------------------------

_DTYPE_NAMES = {np.dtype(jnp.float32): "float32", np.dtype(jnp.bfloat16): "bfloat16",
                np.dtype(jnp.float16): "float16"}


def replace_dir(tmp: Path, out_dir: Path) -> None:
  """Moves a finished tmp directory to out_dir, replacing what was there: a reader sees the old
  directory or the new one, never half of either (the old one is removed last)."""
  if out_dir.exists():
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old)
  else:
    tmp.rename(out_dir)


def save_checkpoint(params, cfg: qwen.QwenConfig, out_dir, max_shard_bytes: int = 4 << 30,
                    generation_config: dict | None = None, dtype=None, tokenizer=None) -> Path:
  """Writes a Hugging Face checkpoint directory that transformers (and vLLM) load.

  Tensors are stored in `dtype` (default: the params' dtype). Past `max_shard_bytes` the
  weights are split into model-0000k-of-0000n.safetensors with an index. With a `tokenizer`
  its files (vocabulary, special tokens, chat template) go in too, so AutoTokenizer loads the
  directory alone. The directory is written beside its final place and renamed into it, so a
  crash never leaves half a checkpoint.
  """
  out_dir = Path(out_dir)
  if "kernel_q" in params["layers"]["self_attn"]["q_proj"]:
    raise ValueError("save_checkpoint: the params are int8 (grpo_jax.models.quant); pass "
                     "quant.dequantize(params) to export them")
  hf = cfg.to_hf()  # before any work: refuses a config config.json cannot express
  tensors: list[tuple[str, np.ndarray]] = []
  for path, hf_name, (_, to_hf) in _top_map(cfg):
    tensors.append((hf_name, to_hf(np.asarray(jax.device_get(_get(params, path))), cfg)))
  for path, hf_name, (_, to_hf) in _layer_map(cfg):
    stacked = np.asarray(jax.device_get(_get(params["layers"], path)))
    tensors += [(hf_name.format(i=i), to_hf(stacked[i], cfg)) for i in range(cfg.num_layers)]
  if dtype is not None:
    tensors = [(n, t.astype(dtype)) for n, t in tensors]
  tensors = [(n, np.ascontiguousarray(t)) for n, t in tensors]

  shards: list[list[tuple[str, np.ndarray]]] = [[]]
  size = 0
  for name, t in tensors:
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, t))
    size += t.nbytes

  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
  try:
    if tokenizer is not None:  # first, so that config.json below is ours whatever it writes
      tokenizer.save_pretrained(tmp)
    weight_map = {}
    for k, shard in enumerate(shards):
      fname = SINGLE_FILE if len(shards) == 1 else (
          f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
      save_file(dict(shard), tmp / fname, metadata={"format": "pt"})
      weight_map.update({name: fname for name, _ in shard})
    if len(shards) > 1:
      total = sum(t.nbytes for _, t in tensors)
      (tmp / INDEX_FILE).write_text(json.dumps(
          {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf["torch_dtype"] = hf["dtype"] = _DTYPE_NAMES.get(tensors[0][1].dtype, "float32")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    if generation_config is not None:
      (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    replace_dir(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir
