"""The sampler with its decode layers scanned against written out (model.unroll_decode), in one
process, alternated so that both see the same machine load.

    python3 benchmarks/unroll_decode.py [--layers 12] [--hidden 256] [--repeats 5]

(1) generate: 8 prompts × G = 8 = 64 rows, 64 new tokens, a random Qwen2 of --layers × --hidden
    (vocabulary 4,096), fp32 on JAX's default device.
(2) members.generate: a sweep's 8 members of the tiny preset's shape (2 layers × 128, vocabulary
    512), 16 prompts × G = 8 each, 20 new tokens.
Each prints the median seconds per call of --repeats calls after one warm-up (compile) call,
checks the tokens are equal, and the last line is `unroll_decode_speedup=<scan / unrolled>`
for (1).
"""
import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from grpo_jax import members, sampler as sampler_lib  # noqa: E402
from grpo_jax.models import qwen  # noqa: E402


def compare(name, cfg, make, repeats):
  """Median seconds per call for the scan and the unrolled decode, make(cfg) giving each one's
  call (its sampler built once: the first call compiles); their tokens equal."""
  calls = {u: make(cfg.with_run(unroll_decode=u)) for u in (False, True)}
  times, tokens = {False: [], True: []}, {}
  for rep in range(repeats + 1):
    for u, call in calls.items():
      t = time.perf_counter()
      out = jax.block_until_ready(call())
      if rep:
        times[u].append(time.perf_counter() - t)
      tokens[u] = [np.asarray(o.tokens) for o in (out if isinstance(out, list) else [out])]
  assert all((a == b).all() for a, b in zip(tokens[False], tokens[True])), name
  scan, unrolled = (statistics.median(times[u]) for u in (False, True))
  print(f"{name}: scan {scan:.3f} s, unrolled {unrolled:.3f} s (medians of {repeats}); "
        f"tokens equal")
  return scan / unrolled


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args()
  rng = np.random.default_rng(0)
  print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")

  cfg = qwen.QwenConfig(vocab_size=4096, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                        num_layers=a.layers, num_heads=a.hidden // 64, num_kv_heads=2,
                        head_dim=64)
  params = qwen.init_params(cfg, jax.random.key(0))
  prompts = [rng.integers(1, 4000, 20).tolist() for _ in range(8)]
  speedup = compare(
      f"generate ({a.layers} x {a.hidden}, 64 rows, 64 tokens)", cfg,
      lambda c: functools.partial(
          sampler_lib.Sampler(c, max_new_tokens=64, buckets=(32,), pad_id=0),
          {"params": params}, prompts, num_samples=8, key=jax.random.key(1)), a.repeats)

  tiny = qwen.QwenConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
  k = 8
  params_k = jax.vmap(lambda key: qwen.init_params(tiny, key))(
      jax.random.split(jax.random.key(0), k))
  prompts_k = [[rng.integers(1, 500, 30).tolist() for _ in range(16)] for _ in range(k)]
  keys = list(jax.random.split(jax.random.key(1), k))
  compare("members.generate (8 tiny members, 128 rows each, 20 tokens)", tiny,
          lambda c: functools.partial(
              members.generate, sampler_lib.Sampler(c, max_new_tokens=20, buckets=(32,),
                                                    pad_id=0),
              {"params": params_k}, prompts_k, num_samples=8, keys_K=keys), a.repeats)
  print(f"unroll_decode_speedup={speedup:.3f}")


if __name__ == "__main__":
  main()
