"""Multi-turn sampling: the KV cache carried across turns against re-prefilling every turn.

    python benchmarks/agent_cache.py [--layers 4] [--hidden 256] [--vocab 4096] [--turns 4]
                                     [--prompts 8] [--g 8] [--prompt_len 96] [--action 24]
                                     [--observation 16] [--repeats 5]

Both sides run the same Sampler on the same random Qwen2 and the same conversations, greedy:
  carried      begin (prompt prefill, room for every turn), then per turn `extend` (the action)
               and `append` (the observation: random ids) into the same cache;
  re-prefill   per turn a fresh `begin` of each row's whole conversation so far (prompt,
               actions and observations, as ids) and one `extend`: what a loop that rebuilds
               the conversation as a new prompt every turn pays.
Each side is compiled by a warm-up run first; the timed runs alternate sides and the medians
are printed, with the tokens each side pushes through the model, and
`agent_cache_speedup=<re-prefill / carried>`. No stop ids: every action runs to its budget, so
the two sides sample exactly the same tokens (checked).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sampler as sampler_lib
from grpo_jax.models import qwen


def carried(sampler, params, prompts, g, turns, action, observations):
  conv = sampler.begin(params, prompts, num_samples=g, room=turns * (action + observations[0]
                                                                     .shape[1]))
  out = []
  for t in range(turns):
    res, conv = sampler.extend(params, conv, None, max_tokens=action, greedy=True)
    out.append(np.asarray(res["tokens"]))
    if t < turns - 1:
      conv = sampler.append(params, conv, observations[t].tolist(), observations[t].shape[1])
  return out


def reprefill(sampler, params, prompts, g, turns, action, observations):
  history = [list(prompts[i // g]) for i in range(len(prompts) * g)]
  out = []
  for t in range(turns):
    conv = sampler.begin(params, history, num_samples=1, room=action)
    res, _ = sampler.extend(params, conv, None, max_tokens=action, greedy=True)
    tokens = np.asarray(res["tokens"])
    out.append(tokens)
    for r, h in enumerate(history):
      h.extend(tokens[r].tolist())
      if t < turns - 1:
        h.extend(observations[t][r].tolist())
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  for name, default in (("layers", 4), ("hidden", 256), ("vocab", 4096), ("turns", 4),
                        ("prompts", 8), ("g", 8), ("prompt_len", 96), ("action", 24),
                        ("observation", 16), ("repeats", 5)):
    ap.add_argument(f"--{name}", type=int, default=default)
  a = ap.parse_args()
  cfg = qwen.QwenConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                        num_layers=a.layers, num_heads=a.hidden // 64, num_kv_heads=2,
                        head_dim=64, rope_theta=1e6, tie_word_embeddings=True,
                        max_position_embeddings=8192)
  params = qwen.init_params(cfg, jax.random.key(0), jnp.float32)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, a.vocab, a.prompt_len).tolist() for _ in range(a.prompts)]
  rows = a.prompts * a.g
  observations = [rng.integers(1, a.vocab, (rows, a.observation)) for _ in range(a.turns - 1)]
  longest = a.prompt_len + a.turns * (a.action + a.observation)
  buckets = tuple(range(a.prompt_len, longest + 32, 32))
  sampler = sampler_lib.Sampler(cfg, max_new_tokens=a.action, buckets=buckets)
  args = (sampler, {"params": params}, prompts, a.g, a.turns, a.action, observations)
  sides = {"carried": carried, "re-prefill": reprefill}
  outputs = {name: fn(*args) for name, fn in sides.items()}  # warm-up: compiles
  for t in range(a.turns):
    np.testing.assert_array_equal(outputs["carried"][t], outputs["re-prefill"][t],
                                  err_msg=f"turn {t}: the two sides sampled different tokens")
  times = {name: [] for name in sides}
  for _ in range(a.repeats):
    for name, fn in sides.items():
      start = time.perf_counter()
      fn(*args)
      times[name].append(time.perf_counter() - start)
  # Tokens through the model: carried reads each prompt once and each turn's new tokens once;
  # re-prefill re-reads the whole conversation (tiled per row) every turn.
  fed_carried = a.prompts * a.prompt_len + rows * (a.turns * a.action +
                                                   (a.turns - 1) * a.observation)
  fed_reprefill = sum(rows * (a.prompt_len + t * (a.action + a.observation) + a.action)
                      for t in range(a.turns))
  print(f"model {a.layers}x{a.hidden}, vocab {a.vocab}; {a.prompts} prompts x G={a.g}, "
        f"{a.turns} turns of {a.action} action + {a.observation} observation tokens, "
        f"prompt {a.prompt_len}; {jax.devices()[0].platform}")
  for name in sides:
    print(f"{name:>11}: median {statistics.median(times[name]):.3f} s over {a.repeats} "
          f"(min {min(times[name]):.3f}, max {max(times[name]):.3f}); tokens fed "
          f"{fed_carried if name == 'carried' else fed_reprefill:,}")
  ratio = statistics.median(times["re-prefill"]) / statistics.median(times["carried"])
  print(f"agent_cache_speedup={ratio:.2f}")


if __name__ == "__main__":
  main()
