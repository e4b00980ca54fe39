"""Sampler benchmark: grpo_jax.sampler against transformers' generate, and decode vs hardware.

    python benchmarks/sampler.py [--repeats 3] [--part both|generate|decode]

(1) The GRPO generation workload: 8 GSM8K test questions through the Qwen2.5 chat template of
    ../shared/qwen2-tokenizer, G = 8 completions each, 128 new tokens, greedy, on a tiny random
    Qwen2 (the fixtures' 2 × 64 shape) with the real 151,936-row vocabulary. transformers gets
    the 64 rows as a GRPO trainer builds them (each prompt repeated G times, left-padded).
    Both produce exactly 128 tokens per row: no stop ids for grpo_jax, eos_token_id=None and
    min_new_tokens=128 for transformers. The tokens are checked equal.
(2) Decode throughput at batch 64 of a 12-layer × 768 Qwen2 (vocab 151,936) against the fp32
    compute bound (2 · matmul params · tokens over a measured matmul peak) and the memory bound
    (params + KV cache bytes read per step over a measured copy bandwidth). Decode time is the
    difference of two runs that differ only in max_new_tokens, so prefill, head set-up and
    dispatch cancel.

Timings are medians of --repeats runs after a warm-up (compile) run, whose time is reported
separately. The last line is `sampler_speedup_vs_transformers=<ratio for (1)>`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fixtures  # noqa: E402
from grpo_jax import sampler as sampler_lib  # noqa: E402
from grpo_jax.models import qwen, weights  # noqa: E402

NUM_PROMPTS, G, NEW_TOKENS = 8, 8, 128


def timed(fn, repeats):
  """(compile/warm-up seconds, median seconds, all seconds) of fn()."""
  start = time.perf_counter()
  result = fn()
  warm = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - start)
  return warm, float(np.median(times)), times, result


def gsm8k_prompts(tokenizer):
  with open(fixtures.GSM8K / "test.jsonl") as f:
    questions = [json.loads(line)["question"] for line in f][:NUM_PROMPTS]
  return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"])
          for q in questions]


def generation_workload(repeats):
  import torch
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(fixtures.REAL_TOKENIZER)
  prompts = gsm8k_prompts(tokenizer)
  pad = tokenizer.pad_token_id
  with tempfile.TemporaryDirectory() as tmp:
    path = fixtures.make_checkpoint(tmp, "qwen2_tied", vocab_size=151936)
    params, cfg = weights.load_checkpoint(path)
    hf = fixtures.hf_model(path)

  sampler = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=NEW_TOKENS, greedy=True,
                                stop_ids=(), valid_vocab_size=len(tokenizer), pad_id=pad)
  ours_warm, ours, ours_all, out = timed(lambda: sampler(params, prompts, num_samples=G), repeats)

  rows = [r for r in prompts for _ in range(G)]
  width = max(map(len, rows))
  input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
  attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

  def hf_generate():
    with torch.no_grad():
      return hf.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                         pad_token_id=pad)
  hf_warm, theirs, theirs_all, ref = timed(hf_generate, repeats)
  # transformers may sample the ~270 embedding rows beyond the tokenizer; we never do.
  same = np.asarray(out.tokens) == ref[:, width:].numpy()
  print(f"(1) GRPO generation: {NUM_PROMPTS} GSM8K prompts ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, bucket {out.metrics['sampler/prompt_bucket']}) x G={G}"
        f", {NEW_TOKENS} new tokens each (no stop ids on either side), greedy, tiny Qwen2 "
        f"2x64, vocab {cfg.vocab_size}")
  print(f"    grpo_jax     median {ours:.3f}s  runs {[round(t, 3) for t in ours_all]}  "
        f"(first call incl. compile {ours_warm:.2f}s; prefill "
        f"{out.metrics['sampler/prefill_seconds']:.3f}s)")
  print(f"    transformers median {theirs:.3f}s  runs {[round(t, 3) for t in theirs_all]}  "
        f"(first call {hf_warm:.2f}s; torch threads {torch.get_num_threads()})")
  print(f"    tokens equal: {same.mean() * 100:.2f}% of {same.size}; "
        f"rows fully equal {same.all(1).sum()}/{same.shape[0]}")
  return theirs / ours


def matmul_peak_flops(repeats, n=2048):
  a = jnp.ones((n, n), jnp.float32) * 1e-3
  f = jax.jit(lambda a, b: a @ b)
  _, t, _, _ = timed(lambda: jax.block_until_ready(f(a, a)), max(repeats, 5))
  return 2 * n ** 3 / t


def copy_bandwidth(repeats, n=64 << 20):
  x = jnp.ones((n,), jnp.float32)
  f = jax.jit(lambda x: x * 2.0)
  _, t, _, _ = timed(lambda: jax.block_until_ready(f(x)), max(repeats, 5))
  return 2 * 4 * n / t  # bytes read + written


def decode_throughput(repeats, batch=64, prompt=32, short=8, long=24):
  """Decode tokens/s of a 12 x 768 Qwen2 at batch 64 against compute and memory bounds."""
  cfg = qwen.QwenConfig(vocab_size=151936, hidden_size=768, intermediate_size=3072,
                        num_layers=12, num_heads=12, num_kv_heads=2, head_dim=64,
                        tie_word_embeddings=True)
  params = qwen.init_params(cfg, jax.random.key(0))
  sizes = {jax.tree_util.keystr(k): v.size for k, v in
           jax.tree_util.tree_flatten_with_path(params)[0]}
  total = sum(sizes.values())
  # Per token every weight is one multiply-add, the embedding too as the tied head; norms and
  # biases are counted though they are not matmuls (< 0.1%).
  matmul_params = total
  prompts = np.random.default_rng(0).integers(0, 151000, (batch, prompt)).tolist()

  def run(new_tokens):
    sampler = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=new_tokens, greedy=True,
                                  buckets=(prompt,))
    return timed(lambda: sampler(params, prompts), repeats)
  warm_s, t_short, _, _ = run(short)
  warm_l, t_long, runs, out = run(long)
  steps = long - short
  tok_s = batch * steps / (t_long - t_short)
  peak = matmul_peak_flops(repeats)
  bw = copy_bandwidth(repeats)
  compute_bound = peak / (2 * matmul_params)
  cache_bytes = 2 * cfg.num_layers * batch * cfg.num_kv_heads * (prompt + long) * cfg.head_dim * 4
  memory_bound = batch * bw / (4 * total + cache_bytes)  # tokens/s if each step read it all once
  print(f"(2) decode, Qwen2 12 x 768 (heads 12/2, MLP 3072, vocab {cfg.vocab_size}, tied): "
        f"{total / 1e6:.1f}M params, batch {batch}, prompt {prompt}, greedy")
  print(f"    decode {tok_s:,.0f} tokens/s = {batch} x ({long}-{short}) tokens / "
        f"({t_long:.3f}s - {t_short:.3f}s) medians; {1e3 * (t_long - t_short) / steps:.1f} ms/step;"
        f" compile+first run {warm_s:.1f}s / {warm_l:.1f}s")
  print(f"    compute bound {compute_bound:,.0f} tokens/s (matmul peak {peak / 1e9:.1f} GFLOP/s, "
        f"2 x {matmul_params / 1e6:.1f}M FLOPs/token): {100 * tok_s / compute_bound:.0f}% of it")
  print(f"    memory bound {memory_bound:,.0f} tokens/s (copy bandwidth {bw / 1e9:.1f} GB/s, "
        f"{(4 * total + cache_bytes) / 1e6:.0f} MB read per step): "
        f"{100 * tok_s / memory_bound:.0f}% of it")
  return tok_s / compute_bound


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--part", choices=("both", "generate", "decode"), default="both")
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
        f"load average at start {os.getloadavg()[0]:.1f} (other processes share the CPUs)")
  if args.part in ("both", "decode"):
    decode_throughput(args.repeats)
  if args.part in ("both", "generate"):
    ratio = generation_workload(args.repeats)
    print(f"sampler_speedup_vs_transformers={ratio:.2f}")


if __name__ == "__main__":
  main()
