"""The members' sampler against the separate runs' on the CPU: K = 8 tiny models' members.generate
call, batched and in turn (batched=False), against 8 generate calls, at the vmapped sweep's
shapes (the tiny preset's model, 16 prompts x G = 8, 20 new tokens). Medians of 5 alternated
calls after one warm-up each.

    PYTHONPATH=$PWD python3 experiments/members_sampler.py

Measured on the 2-core machine (2026-11-27, experiments/one_loop.md, "The members' sampler and
the KV cache copies"): 8 separate 0.179 s, members 0.306 s. Again at 19:45 UTC with the members
in turn ("The members in turn"): 8 separate 0.362 s, batched 0.565 s, in turn 0.373 s.
"""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import members as members_lib, sampler as sampler_lib
from grpo_jax.models import qwen

K, B, G, NEW = 8, 16, 8, 20


def main():
  cfg = qwen.QwenConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
                        tie_word_embeddings=True, max_position_embeddings=4096)
  params = [qwen.init_params(cfg, jax.random.key(k)) for k in range(K)]
  params_K = jax.tree.map(lambda *x: jnp.stack(x), *params)
  s = sampler_lib.Sampler(qwen.build(cfg), max_new_tokens=NEW,
                          buckets=(24, 32, 40, 48, 56, 64))
  rng = np.random.default_rng(0)
  prompts = [[list(rng.integers(1, 512, size=rng.integers(20, 40))) for _ in range(B)]
             for _ in range(K)]
  keys = [jax.random.key(k) for k in range(K)]
  arms = {
      "8 separate": lambda: [s.generate({"params": params[k]}, prompts[k], num_samples=G,
                                        key=keys[k]) for k in range(K)],
      "members": lambda: members_lib.generate(s, {"params": params_K}, prompts, num_samples=G,
                                              keys_K=keys),
      "members in turn": lambda: members_lib.generate(s, {"params": params_K}, prompts,
                                                      num_samples=G, keys_K=keys, batched=False),
  }
  times = {name: [] for name in arms}
  for f in arms.values():
    f()  # compile
  for _ in range(5):
    for name, f in arms.items():
      t = time.perf_counter()
      f()
      times[name].append(time.perf_counter() - t)
  for name, ts in times.items():
    print(f"{name}: median {statistics.median(ts):.3f} s ({', '.join(f'{t:.3f}' for t in ts)})")
  sep, mem, in_turn = (statistics.median(times[n]) for n in arms)
  print(f"members_over_separate={mem / sep:.2f}")
  print(f"in_turn_over_separate={in_turn / sep:.2f}")


if __name__ == "__main__":
  main()
