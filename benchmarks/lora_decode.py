"""The layers of one decode step (a token per row into the KV cache) with LoRA adapters unmerged
(the base params + the 'lora' collection) against merged (lora.merge: plain params), same shapes.

    python3 benchmarks/lora_decode.py --model=Qwen2.5-0.5B --rows=16 --slots=512 --rank=16

(--targets is ignored: all seven projections carry adapters.)
Random weights at the model's real shape, fp32 (bf16 with --dtype=bfloat16), on JAX's default
device (a GPU where there is one; JAX_PLATFORMS=cpu for the CPU). Prints the median step time of
each over --repeats alternated rounds of --steps steps, and their ratio.

What is timed (`decode_step`): model.apply on one token per row against the whole cache, the
decoder layers and the final norm only: no LM head and no sampling, which the sampler's decode
step adds (the same work merged and unmerged). The KV cache is donated and carried from step to
step, so it is written in place as in the sampler's decode loop, not copied whole each step.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
_PLATFORMS = os.environ.get("JAX_PLATFORMS")

from absl import app, flags  # noqa: E402

# The model shapes and the --model, --rows and --rank flags are lora_memory.py's.
import lora_memory  # noqa: E402

_MODEL, _ROWS, _RANK = lora_memory._MODEL, lora_memory._ROWS, lora_memory._RANK
if _PLATFORMS is None:  # lora_memory (an ahead-of-time benchmark) pins the CPU: this one times
  os.environ.pop("JAX_PLATFORMS", None)  # steps, on whatever device JAX picks
_SLOTS = flags.DEFINE_integer("slots", 512, "KV cache slots (the step attends to all)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "params and compute")
_STEPS = flags.DEFINE_integer("steps", 20, "steps per timed round")
_REPEATS = flags.DEFINE_integer("repeats", 3, "alternated rounds")


def decode_step(model, rows: int, slots: int):
  """The timed step, jitted: (variables, cache, tokens [rows, 1], index) -> (the final-normed
  hidden state, the cache with slot `index` written), attending to all `slots`. The cache is
  donated (argument 1), so the step writes it in place, as the sampler's decode step does."""
  import jax
  import jax.numpy as jnp

  def step(variables, cache, tokens, index):
    mask = jnp.ones((rows, slots), jnp.int32)
    pos = jnp.full((rows, 1), index, jnp.int32)
    hidden, cache = model.apply(variables, tokens, pos, mask, cache=cache, cache_index=index)
    return hidden, cache
  return jax.jit(step, donate_argnums=1)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  from grpo_jax.models import lora, qwen

  dtype = jnp.dtype(_DTYPE.value)
  cfg = qwen.QwenConfig(**lora_memory.MODELS[_MODEL.value], rope_theta=1_000_000.0)
  lcfg = lora.LoraConfig(rank=_RANK.value, alpha=2 * _RANK.value)
  params = qwen.init_params(cfg, jax.random.key(0), param_dtype=dtype)
  adapters = jax.tree.map(lambda x: x + 0.01, lora.init(jax.random.key(1), cfg, lcfg))
  merged = jax.jit(lambda p, a: lora.merge(p, a, lcfg))(params, adapters)
  model = qwen.Qwen(cfg, dtype=dtype, param_dtype=dtype)
  r, s = _ROWS.value, _SLOTS.value

  step = decode_step(model, r, s)
  runs = {"unmerged": lora.variables(params, adapters, lcfg), "merged": {"params": merged}}
  tokens = jnp.zeros((r, 1), jnp.int32)
  times = {k: [] for k in runs}
  for name, variables in runs.items():  # compile
    jax.block_until_ready(step(variables, qwen.init_cache(cfg, r, s, dtype), tokens, s - 1))
  for _ in range(_REPEATS.value):
    for name, variables in runs.items():
      cache = qwen.init_cache(cfg, r, s, dtype)
      t0 = time.perf_counter()
      for _ in range(_STEPS.value):
        hidden, cache = step(variables, cache, tokens, s - 1)
      jax.block_until_ready((hidden, cache))
      times[name].append((time.perf_counter() - t0) / _STEPS.value)
  med = {k: statistics.median(v) for k, v in times.items()}
  print(f"{_MODEL.value} {dtype.name}, {r} rows × {s} slots, LoRA rank {lcfg.rank} on 7 targets "
        f"({lora.num_trainable(adapters) / 1e6:.2f}M params); the decoder layers' step alone (no "
        f"LM head, no sampling), KV cache donated and updated in place")
  for k, v in times.items():
    print(f"  {k}: median {med[k] * 1e3:.1f} ms/step ({', '.join(f'{x * 1e3:.1f}' for x in v)})")
  print(f"unmerged_over_merged={med['unmerged'] / med['merged']:.3f}")


if __name__ == "__main__":
  app.run(main)
