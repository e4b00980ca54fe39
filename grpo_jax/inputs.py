"""What a run is built from: its data, tokenizer, model config and initial params.

    train_rows, eval_rows = inputs.datasets(config, workdir)
    tokenizer, stop_ids = inputs.tokenizer(config, workdir, train_rows)
    cfg, generation_config = inputs.model_config(config, tokenizer)
    params = inputs.initial_params(config, cfg, mesh)

`shared` (a dict that the runs of one process pass along, as a vmapped sweep's members do):
what an earlier run with the same data (or tokenizer) settings built or loaded is reused, and
its files copied into this run's workdir, rather than built again. The rows and the tokenizer
are only read, never changed, so the runs can hold the same objects.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax import data, sharding, storage, synthetic, tokenizer as tokenizer_lib, validate
from grpo_jax.models import qwen, weights


def tokenizer(config, workdir, train_rows, build=True, shared=None):
  """build=False: load the tiny tokenizer that process 0 built into the workdir."""
  name = config.model.tokenizer or config.model.checkpoint
  # The tiny tokenizer is learnt from the training rows (and the agent's tool descriptions).
  key = ("tokenizer", name, build) + ((_data_key(config), config.model.tiny.vocab_size,
                                       config.agent.enabled, tuple(config.agent.tools))
                                      if name == "tiny" and shared is not None else ())
  if shared is not None and key in shared:
    built, out = shared[key]
    if built is not None:
      storage.copy_files(built, storage.path(workdir) / "tokenizer")
    return out
  built = None
  if name == "tiny" and not build:
    name = storage.local_copy(storage.path(workdir) / "tokenizer")
  elif name == "tiny":
    # BPE merges learnt from the training problems (deterministic), plus the chat roles.
    corpus = [r["question"] for r in train_rows] + [r["answer"] for r in train_rows]
    corpus += ["user assistant system"] * 100
    tags = ()
    if config.agent.enabled:  # the toolset's descriptions and the tool-call tags
      from grpo_jax.agent import env, tools  # pylint: disable=import-outside-toplevel
      names = tuple(config.agent.tools)
      toolset = tools.select(names, check_sandbox=False)  # only the descriptions are read
      corpus += [env.toolset_text(toolset) + " " + ", ".join(names)] * 100
      tags = ("<tool>", "</tool>")
    with storage.local_dir(storage.path(workdir) / "tokenizer") as out:
      name = built = tokenizer_lib.build_tiny_tokenizer(out, corpus,
                                                        config.model.tiny.vocab_size,
                                                        extra_tags=tags)
  field = "config.model.tokenizer" if config.model.tokenizer else "config.model.checkpoint"
  tok = tokenizer_lib.load_tokenizer(name, field)
  out = tok, tokenizer_lib.stop_ids(tok, name)
  if shared is not None:
    shared[key] = built, out
  return out


def _data_key(config) -> tuple:
  """What the rows depend on: the data settings (some of which only shape the prompts: erring
  towards building again) and, for the synthetic problems, the seed."""
  return (config.data.to_json_best_effort(sort_keys=True), config.seed)


def datasets(config, workdir, build=True, shared=None):
  """build=False: read the synthetic splits that process 0 wrote into the workdir."""
  d = config.data
  key = ("datasets", build) + (_data_key(config) if shared is not None else ())
  if shared is not None and key in shared:
    written, rows = shared[key]
    if written is not None:
      storage.copy_files(written, storage.path(workdir) / "data")
  else:
    written = None
    if d.source == "synthetic" and not build:
      source = storage.local_copy(storage.path(workdir) / "data")
    elif d.source == "synthetic":
      spec = synthetic.ProblemSpec(num_operands=d.synthetic_operands,
                                   digits=d.synthetic_digits, ops=tuple(d.synthetic_ops))
      with storage.local_dir(storage.path(workdir) / "data") as out:
        source = written = synthetic.write_splits(out, d.synthetic_train, d.synthetic_test,
                                                  seed=config.seed, spec=spec)
    else:
      source = d.source
    kw = dict(config_name=d.config_name or None, question_field=d.question_field,
              answer_field=d.answer_field)
    rows = data.load_train_eval(source, d.train_split, d.eval_split, **kw)
    if shared is not None:
      shared[key] = written, rows
  return tuple(list(r) for r in rows)  # the run's own lists, when others hold the same rows


def model_config(config, tokenizer):
  """(QwenConfig, generation_config or None) without loading any weights."""
  m = config.model
  if m.random_init:
    t = m.tiny
    # Exactly the tokenizer's ids: no unused rows whose logits would enter the loss's softmax.
    cfg = qwen.QwenConfig(
        vocab_size=len(tokenizer), hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
        tie_word_embeddings=t.tie_word_embeddings, max_position_embeddings=4096)
    generation_config = None
  else:
    path = weights.resolve(m.checkpoint, "config.model.checkpoint")
    cfg, generation_config = weights.read_config(path), weights.read_generation_config(path)
  cfg = runtime_options(config, cfg)
  if cfg.vocab_size < len(tokenizer):
    raise validate.ConfigError(
        f"config.model: the model's vocabulary ({cfg.vocab_size}) is smaller than the "
        f"tokenizer's ({len(tokenizer)}); they do not belong together")
  return cfg, generation_config


def runtime_options(config, cfg: qwen.QwenConfig) -> qwen.QwenConfig:
  """cfg with config.model's choices of how the model runs (attention kernels, unrolled decode),
  which are no part of a checkpoint: for a cfg read from one, or built by hand."""
  m = config.model
  try:  # RunOptions and QwenConfig check them (values, head_dim for the fused kernel)
    return dataclasses.replace(cfg, run=qwen.RunOptions(
        attention=m.get("attention"), unroll_decode=bool(m.unroll_decode),
        decode_attention=m.get("decode_attention", "xla")))
  except ValueError as e:
    raise validate.ConfigError(f"config.model.{e}") from None


def initial_params(config, cfg, mesh):
  """The starting policy: random (tiny preset) or the checkpoint, placed in its shardings."""
  param_dtype = jnp.dtype(config.optim.param_dtype)
  if config.model.random_init:
    params = qwen.init_params(cfg, jax.random.key(config.seed), param_dtype)
    shard = sharding.param_shardings(qwen.logical_axes(cfg), qwen.abstract_params(cfg), mesh)
    return jax.device_put(params, shard)
  params, _ = weights.load_checkpoint(config.model.checkpoint, param_dtype=param_dtype,
                                      mesh=mesh)
  return params
