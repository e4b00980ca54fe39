"""Sampler benchmark: grpo_jax.sampler against transformers' generate, and decode vs hardware.

    python benchmarks/sampler.py [--repeats 3] [--part both|generate|decode] [--devices 1]

(1) The GRPO generation workload: 8 GSM8K test questions through the Qwen2.5 chat template of
    ../shared/qwen2-tokenizer, G = 8 completions each, 128 new tokens, greedy, on a tiny random
    Qwen2 (the fixtures' 2 layers x 64) with the real 151,936-row vocabulary. transformers gets
    the 64 rows as a GRPO trainer builds them (each prompt repeated G times, left-padded).
    Both produce exactly 128 tokens per row: no stop ids for grpo_jax, eos_token_id=None and
    min_new_tokens=128 for transformers. grpo_jax also returns per-token log-probs (transformers
    returns none); the tokens are checked equal. The two run alternately, so both see the same
    machine load; medians of --repeats runs after a warm-up (compile) run.
(2) Decode throughput at batch 64 of a 12-layer x 768 Qwen2 (vocab 151,936, tied) against the
    fp32 compute bound (2 x params x tokens FLOPs over a measured 2048^3 matmul peak) and the
    memory bound (params + KV cache bytes read once per step over a measured copy bandwidth).
    Decode time is the difference of two runs that differ only in max_new_tokens, so prefill,
    head set-up and dispatch cancel.

--devices N splits the CPU into N XLA devices and the batch over a (N, 1, 1) mesh.
The last line is `sampler_speedup_vs_transformers=<ratio of medians for (1)>`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--part", choices=("both", "generate", "decode"), default="both")
  parser.add_argument("--devices", type=int, default=1)
  return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices > 1:  # must precede the first jax import
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={ARGS.devices}")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fixtures  # noqa: E402
from grpo_jax import sampler as sampler_lib  # noqa: E402
from grpo_jax import sharding  # noqa: E402
from grpo_jax.models import qwen, weights  # noqa: E402

NUM_PROMPTS, G, NEW_TOKENS = 8, 8, 128


def clock(fn):
  """(wall seconds, process CPU seconds, result) of one call."""
  wall, cpu = time.perf_counter(), time.process_time()
  result = fn()
  return time.perf_counter() - wall, time.process_time() - cpu, result


def alternate(fns, repeats):
  """Warm-up call of each fn, then `repeats` rounds calling them in turn (same load for all).

  Returns {name: (warm-up seconds, wall seconds per round, CPU seconds per round, last result,
  decode seconds per round where fn returns sampler metrics)}.
  """
  out = {}
  for name, fn in fns.items():
    warm, _, result = clock(fn)
    out[name] = (warm, [], [], result, [])
  for _ in range(repeats):
    for name, fn in fns.items():
      time.sleep(1.0)  # let the previous run's threads (torch's OpenMP pool spins) go idle
      wall, cpu, result = clock(fn)
      out[name][1].append(wall)
      out[name][2].append(cpu)
      if isinstance(result, dict) and "sampler/seconds" in result:  # sampler metrics
        out[name][4].append(result["sampler/seconds"] - result["sampler/prefill_seconds"])
      out[name] = out[name][:3] + (result, out[name][4])
  return out


def mesh_and_put(params, cfg, devices):
  if devices <= 1:
    return None, params
  mesh = sharding.make_mesh((devices, 1, 1))
  shardings = sharding.param_shardings(qwen.logical_axes(cfg), qwen.abstract_params(cfg), mesh)
  return mesh, jax.device_put(params, shardings)


def gsm8k_prompts(tokenizer):
  with open(fixtures.GSM8K / "test.jsonl") as f:
    questions = [json.loads(line)["question"] for line in f][:NUM_PROMPTS]
  chats = [[{"role": "user", "content": q}] for q in questions]
  return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
               ["input_ids"]) for c in chats]


def generation_workload(repeats, devices):
  import torch
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(fixtures.REAL_TOKENIZER)
  prompts = gsm8k_prompts(tokenizer)
  pad = tokenizer.pad_token_id
  with tempfile.TemporaryDirectory() as tmp:
    path = fixtures.make_checkpoint(tmp, "qwen2_tied", vocab_size=151936)
    params, cfg = weights.load_checkpoint(path)
    hf = fixtures.hf_model(path)
  mesh, params = mesh_and_put(params, cfg, devices)
  sampler = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=NEW_TOKENS, greedy=True,
                                stop_ids=(), valid_vocab_size=len(tokenizer), pad_id=pad,
                                mesh=mesh)

  rows = [r for r in prompts for _ in range(G)]
  width = max(map(len, rows))
  input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
  attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

  def hf_generate(threads):
    torch.set_num_threads(threads)
    with torch.no_grad():
      return hf.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                         pad_token_id=pad)

  load = os.getloadavg()[0]
  # transformers at torch's default thread count and at 1 thread: on a shared machine an OpenMP
  # pool that cannot get all its cores spins, so the faster of the two is the baseline.
  threads = torch.get_num_threads()
  fns = {"grpo_jax": lambda: sampler({"params": params}, prompts, num_samples=G),
         f"hf {threads} thr": lambda: hf_generate(threads)}
  if threads > 1:
    fns["hf 1 thr"] = lambda: hf_generate(1)
  res = alternate(fns, repeats)
  torch.set_num_threads(threads)
  best = min((k for k in res if k.startswith("hf")), key=lambda k: np.median(res[k][1]))
  out, ref = res["grpo_jax"][3], res[best][3]
  same = np.asarray(out.tokens) == ref[:, width:].numpy()
  print(f"(1) GRPO generation: {NUM_PROMPTS} GSM8K prompts ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, bucket {out.metrics['sampler/prompt_bucket']}) x G={G}"
        f" = {len(rows)} rows, {NEW_TOKENS} new tokens each (no stop ids on either side), greedy,"
        f" tiny Qwen2 2 x 64, vocab {cfg.vocab_size}; grpo_jax on {devices} XLA device(s); "
        f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
  for name, (warm, walls, cpus, _, _) in res.items():
    print(f"    {name:9s} median {np.median(walls):.3f}s wall, {np.median(cpus):.3f}s CPU; "
          f"runs {[round(t, 3) for t in walls]}; first call (incl. compile) {warm:.2f}s")
  print(f"    grpo_jax prefill {out.metrics['sampler/prefill_seconds']:.3f}s of the call; "
        f"tokens equal to transformers': {same.mean() * 100:.2f}% of {same.size}")
  ratio = np.median(res[best][1]) / np.median(res["grpo_jax"][1])
  cpu_ratio = np.median(res[best][2]) / np.median(res["grpo_jax"][2])
  print(f"    speedup vs the faster transformers ({best}): {ratio:.2f}x wall, "
        f"{cpu_ratio:.2f}x CPU time")
  return ratio


def decode_throughput(repeats, devices, batch=64, prompt=32, short=8, long=24):
  """Decode tokens/s of a 12 x 768 Qwen2 at batch 64 against compute and memory bounds.

  The decode runs, a 2048^3 matmul (the peak) and a 256 MB scale-copy (the bandwidth) are
  timed alternately, so the bounds are measured under the same machine load as the decode.
  """
  cfg = qwen.QwenConfig(vocab_size=151936, hidden_size=768, intermediate_size=3072,
                        num_layers=12, num_heads=12, num_kv_heads=2, head_dim=64,
                        tie_word_embeddings=True)
  mesh, params = mesh_and_put(qwen.init_params(cfg, jax.random.key(0)), cfg, devices)
  # Per token every weight is one multiply-add (the embedding as the tied head); the norms and
  # biases counted here are < 0.1% of the total.
  n_params = sum(x.size for x in jax.tree.leaves(params))
  prompts = np.random.default_rng(0).integers(0, 151000, (batch, prompt)).tolist()
  samplers = {n: sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=n, greedy=True,
                                     buckets=(prompt,), mesh=mesh) for n in (short, long)}
  a = jnp.ones((2048, 2048), jnp.float32) * 1e-3
  x = jnp.ones((64 << 20,), jnp.float32)
  matmul, scale = jax.jit(lambda a, b: a @ b), jax.jit(lambda x: x * 2.0)
  load = os.getloadavg()[0]
  res = alternate({
      "short": lambda: samplers[short]({"params": params}, prompts).metrics,
      "long": lambda: samplers[long]({"params": params}, prompts).metrics,
      "matmul": lambda: jax.block_until_ready(matmul(a, a)),
      "copy": lambda: jax.block_until_ready(scale(x)),
  }, repeats)
  # Decode-only seconds of each call (the sampler's total minus its prefill).
  decode_s = {k: res[k][4] for k in ("short", "long")}
  t_short, t_long = np.median(decode_s["short"]), np.median(decode_s["long"])
  steps = long - short
  tok_s = batch * steps / (t_long - t_short)
  peak = 2 * 2048 ** 3 / np.median(res["matmul"][1])
  bw = 2 * x.nbytes / np.median(res["copy"][1])  # bytes read + written
  compute_bound = peak / (2 * n_params)
  cache_bytes = 2 * cfg.num_layers * batch * cfg.num_kv_heads * (prompt + long) * cfg.head_dim * 4
  step_bytes = 4 * n_params + cache_bytes
  memory_bound = batch * bw / step_bytes
  print(f"(2) decode, Qwen2 12 x 768 (heads 12/2, MLP 3072, vocab {cfg.vocab_size}, tied): "
        f"{n_params / 1e6:.1f}M params, batch {batch}, prompt {prompt}, greedy, {devices} XLA "
        f"device(s); load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
  print(f"    decode {tok_s:,.0f} tokens/s = {batch} x ({long}-{short}) tokens / ({t_long:.3f}s - "
        f"{t_short:.3f}s) median decode seconds; {1e3 * (t_long - t_short) / steps:.0f} ms/step; "
        f"first calls (incl. compile) {res['short'][0]:.1f}s / {res['long'][0]:.1f}s")
  print(f"    compute bound {compute_bound:,.0f} tokens/s (matmul peak {peak / 1e9:.1f} GFLOP/s, "
        f"2 x {n_params / 1e6:.1f}M FLOPs/token): {100 * tok_s / compute_bound:.0f}% of it")
  print(f"    memory bound {memory_bound:,.0f} tokens/s (copy bandwidth {bw / 1e9:.1f} GB/s, "
        f"{step_bytes / 1e6:.0f} MB read per step): {100 * tok_s / memory_bound:.0f}% of it")


def main():
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({len(jax.devices())} device(s)), "
        f"{os.cpu_count()} CPUs shared with other processes")
  if ARGS.part in ("both", "decode"):
    decode_throughput(ARGS.repeats, ARGS.devices)
  if ARGS.part in ("both", "generate"):
    ratio = generation_workload(ARGS.repeats, ARGS.devices)
    print(f"sampler_speedup_vs_transformers={ratio:.2f}")


if __name__ == "__main__":
  main()
