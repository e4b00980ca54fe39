"""Peak device memory of one LoRA update, from the compiler, without weights.

    python3 benchmarks/lora_memory.py --model=Qwen2.5-1.5B --rows=16 --prompt_len=256 \
        --completion_len=512 --rank=16

AOT-compiles (`jax.ShapeDtypeStruct` inputs: nothing allocated, one CPU device) the program a
LoRA GRPO micro-batch needs: the frozen base params in bf16 (arguments, not donated, not
differentiated), the adapters and their AdamW moments in fp32 (donated, updated in place), a
[rows, prompt + completion] batch; the policy log-probs of the completion tokens (bf16 compute,
remat per layer, grpo_jax.logprobs' chunked head), with --beta > 0 a second forward with the
adapters off as the reference (no second copy of the weights), a GRPO-shaped loss
(ratio · advantage + beta · k3 KL), gradients w.r.t. the adapters only, and the AdamW update.
--quantize=int8 stores the base's projection kernels as int8 (grpo_jax.models.quant, QLoRA).

Per device: peak = arguments + outputs − aliased + temporaries (as benchmarks/memory.py).
The sampler's figure adds the KV cache, [L, rows, K, slots, H] × 2 in bf16, to the bf16 base:
`kv_cache_gb` is printed for --sample_rows rows. The CPU compiler stands in for the accelerator's
(it converts some bf16 matmul operands to fp32, so its figures run high).
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
import shapes  # noqa: E402

MODELS, VALID_VOCAB = shapes.MODELS, shapes.VALID_VOCAB

_MODEL = flags.DEFINE_enum("model", "Qwen2.5-1.5B", sorted(MODELS), "model shape")
_ROWS = flags.DEFINE_integer("rows", 16, "rows (completions) per micro-batch")
_PROMPT = flags.DEFINE_integer("prompt_len", 256, "prompt tokens per row")
_COMPLETION = flags.DEFINE_integer("completion_len", 512, "completion tokens per row")
_RANK = flags.DEFINE_integer("rank", 16, "LoRA rank")
_TARGETS = flags.DEFINE_list("targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                             "LoRA target modules")
_BETA = flags.DEFINE_float("beta", 0.04, "KL weight; > 0 adds the reference forward")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "bfloat16", ["bfloat16", "float32"],
                                 "the frozen base's dtype (compute stays bf16)")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8", "nf4"],
                              "int8: the projection kernels of the base as int8 (QLoRA)")
_SAMPLE_ROWS = flags.DEFINE_integer("sample_rows", 64, "rows decoded at once (KV cache figure)")
GB = 1e9


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import optax
  from grpo_jax import logprobs
  from grpo_jax.models import lora, quant, qwen

  cfg = qwen.QwenConfig(**MODELS[_MODEL.value], rope_theta=1_000_000.0)
  lcfg = lora.LoraConfig(rank=_RANK.value, alpha=2 * _RANK.value, targets=tuple(_TARGETS.value))
  pdtype = jnp.dtype(_PARAM_DTYPE.value)
  model = qwen.Qwen(cfg, dtype=jnp.bfloat16, param_dtype=pdtype, remat=True)
  params = qwen.abstract_params(cfg, pdtype)
  if _QUANTIZE.value != "none":
    params = quant.abstract(cfg, pdtype, _QUANTIZE.value)
  adapters = lora.abstract(cfg, lcfg)
  opt = optax.adamw(1e-5, weight_decay=0.0)
  opt_state = jax.eval_shape(opt.init, adapters)
  rows, p, c, beta = _ROWS.value, _PROMPT.value, _COMPLETION.value, _BETA.value
  t = p + c
  batch = {"tokens": jax.ShapeDtypeStruct((rows, t), jnp.int32),
           "mask": jax.ShapeDtypeStruct((rows, t), jnp.int32),
           "old_logp": jax.ShapeDtypeStruct((rows, c), jnp.float32),
           "advantages": jax.ShapeDtypeStruct((rows,), jnp.float32)}

  def completion_logp(params, adapters, batch):
    tokens, mask = batch["tokens"], batch["mask"]
    hidden, _ = model.apply(lora.variables(params, adapters, lcfg), tokens[:, :-1],
                            qwen.positions_from_mask(mask[:, :-1]), mask[:, :-1])
    head = qwen.head_kernel(params, cfg).T[:VALID_VOCAB].astype(jnp.bfloat16)
    logp, _ = logprobs.token_logprobs(hidden[:, p - 1:], head, tokens[:, p:])
    return logp

  def loss_fn(adapters, params, batch):
    logp = completion_logp(params, adapters, batch)
    ratio = jnp.exp(logp - batch["old_logp"])
    loss = -(ratio * batch["advantages"][:, None])
    if beta > 0:
      ref = jax.lax.stop_gradient(completion_logp(params, None, batch))
      loss = loss + beta * (jnp.exp(ref - logp) - (ref - logp) - 1)
    w = batch["mask"][:, p:].astype(jnp.float32)
    return (loss * w).sum() / w.sum()

  def step(adapters, opt_state, params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(adapters, params, batch)
    updates, opt_state = opt.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state, loss

  n_base = sum(x.size for x in jax.tree.leaves(params))
  # uint4 (NF4 codes) has itemsize 1 but takes half a byte on the device, as the compiler counts it
  base_bytes = sum(x.size * jnp.iinfo(x.dtype).bits / 8 if x.dtype == jnp.uint4
                   else x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  n_lora = lora.num_trainable(adapters)
  t0 = time.time()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(adapters, opt_state, params,
                                                        batch).compile()
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)
  kv = 2 * cfg.num_layers * _SAMPLE_ROWS.value * cfg.num_kv_heads * t * cfg.head_dim * 2
  print(f"{_MODEL.value}: base {n_base / 1e9:.3f}B params {pdtype.name}{f' + {_QUANTIZE.value} projections' if _QUANTIZE.value != 'none' else ''} ({base_bytes / GB:.2f} GB), "
        f"LoRA rank {lcfg.rank} on {len(lcfg.targets)} targets: {n_lora / 1e6:.2f}M params "
        f"(+ AdamW: {3 * 4 * n_lora / GB:.3f} GB); {rows} rows × ({p} + {c}) tokens, "
        f"beta={beta}; compiled in {time.time() - t0:.0f} s")
  print(f"  arguments {m.argument_size_in_bytes / GB:.2f} + outputs "
        f"{m.output_size_in_bytes / GB:.2f} − aliased {m.alias_size_in_bytes / GB:.2f} + "
        f"temporaries {m.temp_size_in_bytes / GB:.2f} GB")
  print(f"lora_step_peak_gb={peak / GB:.2f}")
  print(f"kv_cache_gb={kv / GB:.2f} ({_SAMPLE_ROWS.value} rows × {t} slots, bf16); "
        f"sampler_floor_gb={(base_bytes + 4 * 3 * n_lora + kv) / GB:.2f} (base + adapters and "
        "moments + cache, before activations)")


if __name__ == "__main__":
  app.run(main)
