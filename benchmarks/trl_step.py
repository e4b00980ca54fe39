"""Whole-GRPO-step benchmark: grpo_jax's training loop against TRL 1.16's GRPOTrainer on CPU.

    pip install -r requirements-bench.txt    # TRL + accelerate, benchmark-only
    python benchmarks/trl_step.py [--sizes small,large] [--small_vocab] [--steps 1] [--warmup 1]
                                  [--rounds N] [--forced_length] [--smoke]

One step is one generation batch: sample, reward, group advantages, reference log-probs, one
optimizer update (μ = 1: TRL num_iterations=1, steps_per_generation=1; one micro-batch, no
gradient accumulation). Same workload on both sides:
  8 GSM8K train questions (the first 8·(warmup + steps) of ../shared/gsm8k/train.jsonl, in file
  order, step i taking rows 8i..8i+7 on both sides) × G = 8 = 64 completions per step, in the
  gsm8k config's prompt (data.user_template; data.system_prompt None = the chat template's
  default system turn) through the tokenizer's chat template (the prompt token ids are checked
  equal on both sides; padded differently: grpo_jax to one bucket holding every prompt of the
  run, TRL to each batch's longest, both widths printed); temperature 1.0, no top-k / top-p; reward = grpo_jax.rewards
  math_accuracy only (TRL calls the same function from a plain reward function); loss 'grpo'
  with ε = 0.2, β = 0.04 with the k3 KL (TRL: use_bias_correction_kl=False, the plain k3);
  Adam(W) lr 1e-6 constant, β = (0.9, 0.999), no weight decay, max grad norm 1.0; fp32 params
  and compute; activation checkpointing on both sides (grpo_jax optim.remat, TRL's default
  gradient_checkpointing).
  Models: random-init Qwen2 built once per size with transformers (Qwen2Config +
  Qwen2ForCausalLM, torch seed 0), saved with save_pretrained and loaded by both sides, so both
  start from the same weights. Qwen2-like ratios: head_dim 64, 2 KV heads, MLP 4 × hidden,
  tied embeddings, qkv bias, rope θ 1e6:
    small        4 layers × 256 (4 heads, MLP 1024), vocab 151,936, 64 new tokens
    large        12 layers × 768 (12 heads, MLP 3072), vocab 151,936, 128 new tokens
    small_vocab  (--small_vocab) the small model with a 519-id vocabulary: 512 BPE ids learnt
                 from GSM8K train text by grpo_jax.tokenizer.build_tiny_tokenizer, plus Qwen's 3
                 special tokens and 4 tag tokens; there the LM head is tiny and per-step overhead
                 dominates
    smoke        (--smoke) 2 layers × 64 (4 heads of 16, MLP 256), 16 new tokens
  Qwen2 models use ../shared/qwen2-tokenizer; both sides stop on its generation_config eos ids.
  With random weights a stop id is drawn ~1 in 76,000 tokens, so completions run to the limit.

grpo_jax side: configs/gsm8k.py's default preset with the fields above overridden, then
grpo_jax.trainer.Trainer(config, cfg, mesh, tokenizer, stop_ids) as train.run builds it, and
trainer.grpo_step(state, ref_params, next_rows, rewards, step) per step (see run_grpo_jax),
ref_params as a run stores them (Trainer.reference, in train_step.reference_dtype), moved
one ulp from the policy in that dtype, so that every step runs the reference forward
(benchmark_reference).
TRL side: GRPOTrainer(model=<checkpoint dir>, ...) with GRPOConfig (use_vllm False, bf16/fp16
False, per_device_train_batch_size 64, max_steps warmup + steps, logging/saving off, dataset
not shuffled) and trainer.train(); the step is timed by a TrainerCallback (on_step_begin to
on_step_end), the phases by wrapping its methods (see run_trl).

Phases (each side's own clocks; medians over the measured steps):
  step       grpo_jax: the grpo_step call until its new state is ready. TRL: on_step_begin ->
             on_step_end = training_step (generation, scoring, reference, loss, backward) +
             grad clipping + optimizer.step + zero_grad (the dataloader fetch, ~ms, is outside).
  sample     grpo_jax: time/sample_s = chat template + tokenize + pad, sampler prefill + decode,
             copy to host. TRL: _generate = chat template + tokenize, transformers generate,
             EOS masking, batch_decode.
  reward     grpo_jax: time/reward_s = batch_decode + math_accuracy. TRL: _calculate_rewards.
  reference  grpo_jax: the reference forward runs inside the step's one compiled program, so
             the same forward (train_step.make_logprob_fn, reference params, the step's batch)
             is timed alone after each step, outside the step's time. TRL:
             _get_per_token_logps_and_entropies called under no_grad (only the reference model
             here: with μ = 1 TRL computes no old log-probs). Both run the LM head on CPU, but
             TRL's fused head scores every position, prompt included (it keeps only the
             completion positions where Triton runs); grpo_jax scores the C completion ones.
  update     grpo_jax: time/train_s (less the reference where that sits inside it) =
             advantages, batch assembly, the jitted train step (policy forward + backward +
             clip + Adam), metrics to host. TRL: step - _prepare_inputs = compute_loss (policy
             forward, printed as "loss forward") + backward + clip + Adam + zero_grad.
  other      step - sample - reward - reference - update (TRL: padding, advantages, metrics
             inside _prepare_inputs).
The first step of every worker is reported separately (grpo_jax: includes XLA compilation,
from scratch: the worker turns the persistent compilation cache off).

FLOPs of one grpo_jax step, counted analytically (matmuls only: 2 FLOPs per multiply-add;
biases, norms, RoPE, softmax and the optimizer's elementwise work are left out):
  per token per layer  W = 2·(2·D·H·h + 2·D·K·h + 3·D·I)    (q, o; k, v; gate, up, down)
  per (query, key) pair per layer  A = 4·H·h               (QKᵀ and AV, dense: the masked
                                                           full matrix is what both compute)
  log-prob forward     F = B·L·(W·P + A·P²) + R·[L·(W·c + A·c·(P + c)) + 2·D·V·C]
                           (c = C - 1: each prompt runs once for its G rows (train_step's
                            shared-prompt forward), then the R rows' completion positions
                            against the P + c key slots; the LM head only over the C
                            completion ones)
  sampling             S = B·L·(W·P + A·P²) + n·R·[2·D·V + L·(W + A·(P + C))]
                           (prefill of the B prompts once, then n decode steps over R rows
                            against the P + C cache slots, one LM-head pass per step)
  step                 S + F (reference) + 3·F (policy forward + backward)
with L layers, D hidden, H heads, K KV heads, h head dim, I MLP width, V = the tokenizer's
vocabulary (grpo_jax samples and scores over it only), B = 8 prompts, R = 64 rows, P the
prompt bucket, C the new tokens, n the decode steps the sampler ran. Rematerialisation
recomputes the body once more (F less its LM head), not counted in the step total. The floor
is that total over the fp32 matmul peak (a 2048³ jnp matmul, median of 5, timed in every
grpo_jax worker of the run). XLA's cost_analysis is no cross-check here: it counts the body of
every scan once (the layers, and the LM head's blocks in logprobs.py).

Protocol: every (side, size) runs in its own process (this script with --worker), grpo_jax then
TRL, alternated A/B/A/B for --rounds rounds (default 2 for small and small_vocab, 1 for large).
Measured 2026-11-23 on 2 otherwise idle cores: `--sizes small --small_vocab --steps 2` took
18 minutes, `--sizes large --steps 1` 21 minutes (TRL's steps: ~136 s small, 450-550 s large).
Each worker runs --warmup steps (dropped) and then --steps measured ones. A side that fails (out of memory: killed by a signal, or XLA's
RESOURCE_EXHAUSTED) is reported and not run again; the others go on. If the mean completion
lengths differ by more than 3% (or with --forced_length), the size is run again with no stop
tokens on either side (grpo_jax: stop_ids=(); TRL: generation_kwargs min_new_tokens = C), so
both produce exactly C tokens per row.

The last lines are `grpo_step_speedup_vs_trl[<size>]=<TRL median step / grpo_jax median step>`
(and `[<size>/forced_length]` where that variant ran).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
QWEN_TOKENIZER = SHARED / "qwen2-tokenizer"
GSM8K = SHARED / "gsm8k"
sys.path.insert(0, str(REPO))  # configs/ is not an installed package

RESULT, STEP = "TRL_STEP_RESULT ", "TRL_STEP_STEP "
SIDES = ("grpo_jax", "trl")
NUM_PROMPTS, G = 8, 8
BETA, LR, MAX_GRAD_NORM, SEED = 0.04, 1e-6, 1.0, 0
QWEN_VOCAB = 151936
LENGTH_TOLERANCE = 0.03
_SMALL = dict(layers=4, hidden=256, heads=4, kv_heads=2, mlp=1024, new_tokens=64)
_SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=2, mlp=256, new_tokens=16)
# bpe: None = the Qwen2 tokenizer and vocabulary; N = a BPE tokenizer of N learnt ids.
SIZES = {
    "small": dict(_SMALL, bpe=None, rounds=2),
    "large": dict(layers=12, hidden=768, heads=12, kv_heads=2, mlp=3072, new_tokens=128,
                  bpe=None, rounds=1),
    "small_vocab": dict(_SMALL, bpe=512, rounds=2),
    "smoke": dict(_SMOKE, bpe=None, rounds=1),
    "smoke_vocab": dict(_SMOKE, bpe=512, rounds=1),
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="small,large", help=f"comma-separated, of {list(SIZES)}")
  p.add_argument("--small_vocab", action="store_true", help="add the small_vocab workload")
  p.add_argument("--steps", type=int, default=1, help="measured steps per worker")
  p.add_argument("--warmup", type=int, default=1, help="steps per worker dropped first")
  p.add_argument("--rounds", type=int, default=None,
                 help="A/B alternations (default: 2 small, 1 large, 2 small_vocab)")
  p.add_argument("--forced_length", action="store_true",
                 help="also run every size with no stop tokens (exactly C tokens per row)")
  p.add_argument("--sides", default=",".join(SIDES),
                 help="comma-separated sides to run (a one-sided run prints no speedup)")
  p.add_argument("--smoke", action="store_true",
                 help="2 layers x 64, 16 new tokens, 1 warm-up + 1 measured step, 1 round")
  # Internal: one (side, size) in this process; prints one RESULT line.
  p.add_argument("--worker", nargs=2, metavar=("SIDE", "SIZE"), help=argparse.SUPPRESS)
  p.add_argument("--dir", help=argparse.SUPPRESS)
  p.add_argument("--forced", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def median(xs):
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


# --- workers -------------------------------------------------------------------------------------

def prepare(size: str, out_dir: Path, num_steps: int) -> dict:
  """The shared inputs of one size: random Qwen2 checkpoint, tokenizer, rows, prompt ids."""
  import torch
  import transformers
  from configs import gsm8k
  from grpo_jax import data, tokenizer as tokenizer_lib

  m = SIZES[size]
  d = gsm8k.get_config().data
  rows = data.load_rows(str(GSM8K), "train")
  if m["bpe"]:
    # The corpus train.run gives the tiny tokenizer: questions, answers and the chat roles.
    corpus = ([r["question"] for r in rows] + [r["answer"] for r in rows]
              + ["user assistant system"] * 100)
    tok_path = tokenizer_lib.build_tiny_tokenizer(str(out_dir / "tokenizer"), corpus, m["bpe"])
  else:
    tok_path = str(QWEN_TOKENIZER)
  tok = tokenizer_lib.load_tokenizer(tok_path)
  stop = tokenizer_lib.stop_ids(tok, tok_path)
  vocab = len(tok) if m["bpe"] else QWEN_VOCAB
  rows = rows[:NUM_PROMPTS * num_steps]
  texts = [data.build_prompt(tok, r["question"], d.system_prompt, d.user_template) for r in rows]
  prompt_ids = data.encode_prompts(tok, texts)
  # One bucket holding every prompt of the run: grpo_jax compiles one shape.
  bucket = -(-max(map(len, prompt_ids)) // 16) * 16

  torch.manual_seed(SEED)
  cfg = transformers.Qwen2Config(
      vocab_size=vocab, hidden_size=m["hidden"], intermediate_size=m["mlp"],
      num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
      num_key_value_heads=m["kv_heads"], max_position_embeddings=4096, rms_norm_eps=1e-6,
      rope_theta=1e6, tie_word_embeddings=True, eos_token_id=stop[0],
      pad_token_id=tok.pad_token_id)
  model = transformers.Qwen2ForCausalLM(cfg).float()
  # TRL stops on the model's generation_config eos ids (plus the tokenizer's): the same set as
  # grpo_jax's stop_ids, which come from the tokenizer's generation_config.json.
  model.generation_config = transformers.GenerationConfig(eos_token_id=stop,
                                                          pad_token_id=tok.pad_token_id)
  model.save_pretrained(out_dir / "model")
  return dict(size=size, **m, model=str(out_dir / "model"), tokenizer=tok_path, vocab=vocab,
              valid_vocab=len(tok), stop_ids=stop, bucket=bucket, num_steps=num_steps,
              num_params=sum(p.numel() for p in model.parameters()),
              system_prompt=d.system_prompt, user_template=d.user_template, rows=rows,
              prompt_ids=prompt_ids)


class _Spy:
  """Stands in for the Trainer's train step and keeps the last call's arguments (the step's
  batch, for timing the reference forward beside it)."""

  def __init__(self, fn):
    self.fn, self.last = fn, None

  def __call__(self, *args):
    self.last = args
    return self.fn(*args)

  def __getattr__(self, name):
    return getattr(self.fn, name)


def run_grpo_jax(spec: dict, forced: bool, out: dict) -> None:
  """grpo_jax's own training-loop code, configured from configs/gsm8k.py. Kept in one place:
  only Trainer(...), init_state and grpo_step(...) -> (state, metrics, samples) are relied on;
  the spy on step_fn keeps the step's batch for the phase split.

  The reference forward runs inside the step's one compiled program, so its share is measured
  beside it: after each step the same forward (train_step.make_logprob_fn on the reference
  params, the step's batch) is timed on its own, outside the step's time, and subtracted from
  time/train_s to give the update's share."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from configs import gsm8k
  from grpo_jax import (compile_cache, inputs, sharding, tokenizer as tokenizer_lib, train_step,
                        trainer as trainer_lib, validate)
  from grpo_jax.models import weights
  from grpo_jax.rewards import build_rewards

  # The first step compiles from scratch: no persistent compilation cache, whatever
  # JAX_COMPILATION_CACHE_DIR says (train.run would use one; a re-run would then load them).
  compile_cache.enable("")

  c = gsm8k.get_config("default")
  c.seed = SEED
  c.model.checkpoint, c.model.tokenizer = spec["model"], spec["tokenizer"]
  c.data.prompt_buckets = (spec["bucket"],)
  c.sampling.num_generations = G
  c.sampling.max_new_tokens = spec["new_tokens"]
  c.sampling.temperature, c.sampling.top_k, c.sampling.top_p, c.sampling.min_p = 1.0, 0, 1.0, 0.0
  c.rewards.names, c.rewards.weights = ("math_accuracy",), (1.0,)
  c.loss.loss_type, c.loss.beta, c.loss.kl_estimator = "grpo", BETA, "k3"
  c.loss.num_iterations = 1
  o = c.optim
  o.lr, o.schedule, o.warmup_steps, o.weight_decay = LR, "constant", 0, 0.0
  o.b1, o.b2, o.max_grad_norm = 0.9, 0.999, MAX_GRAD_NORM  # torch AdamW's betas, as TRL
  # gpu_step.py sets the compute dtype, remat, micro-batches and attention kernel in the spec;
  # CPU: fp32, remat, one micro-batch.
  o.grad_accum_steps, o.param_dtype = spec.get("grad_accum", 1), "float32"
  o.compute_dtype, o.remat = spec.get("compute_dtype", "float32"), spec.get("remat", True)
  c.model.attention = spec.get("attention")
  c.model.unroll_decode = spec.get("unroll_decode", False)
  c.model.decode_attention = spec.get("decode_attention", "xla")
  o.logprob_block_bytes = spec.get("logprob_block_bytes", 0)  # 0: the platform's
  c.train.prompts_per_step, c.train.dynamic_sampling = NUM_PROMPTS, False
  c.mesh = (1, 1, 1)
  validate.validate(c, jax.device_count())

  mesh = sharding.make_mesh(tuple(c.mesh))
  tokenizer = tokenizer_lib.load_tokenizer(spec["tokenizer"])
  stop_ids = [] if forced else tokenizer_lib.stop_ids(tokenizer, spec["tokenizer"])
  params, cfg = weights.load_checkpoint(spec["model"], param_dtype=jnp.float32, mesh=mesh)
  cfg = inputs.runtime_options(c, cfg)  # the attention kernel and decode loop asked for
  rewards = build_rewards(c.rewards)
  trainer = trainer_lib.Trainer(c, cfg, mesh, tokenizer, stop_ids)
  # What the sampler and step really run with (gpu_step.py prints these, not its flags).
  run = trainer.sampler.cfg.run
  out["model_options"] = {"attention": run.attention, "unroll_decode": run.unroll_decode,
                          "decode_attention": run.decode_attention,
                          "vocab_chunk": trainer.sampler.vocab_chunk,
                          "logprob_block_bytes": trainer.step_fn.spec.optim.logprob_block_bytes}
  spies = {"step_fn": _Spy(trainer.step_fn)}
  trainer.step_fn = spies["step_fn"]
  state = jax.block_until_ready(trainer.init_state(params))
  ref_params = benchmark_reference(trainer, params)
  unit, group = spies["step_fn"].fn.micro_layout(NUM_PROMPTS * G)  # as the step runs it
  logprob_fn = train_step.make_logprob_fn(
      cfg, trainer.optim, mesh, temperature=c.sampling.temperature,
      valid_vocab_size=tokenizer_lib.valid_vocab_size(tokenizer), group=group, unit=unit)
  gc.freeze()  # as train.run does before its loop
  out["setup_s"] = time.perf_counter() - out["t_start"]

  def reference_inputs(batch):
    b = jax.device_get(batch)
    C = b["completion_BC"].shape[1]
    cmask = (np.arange(C)[None, :] < b["lengths_B"][:, None]).astype(np.int32)
    prompt, pmask = (np.repeat(b[k], G, axis=0) for k in ("prompt_NP", "prompt_mask_NP"))
    return (np.concatenate([prompt, b["completion_BC"]], 1),
            np.concatenate([pmask, cmask], 1).astype(np.int32), C)

  def reference_seconds(batch):
    """The reference forward alone on the step's batch (compiled first, then timed)."""
    args = (ref_params,) + reference_inputs(batch)
    jax.block_until_ready(logprob_fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(logprob_fn(*args))
    return time.perf_counter() - t

  rows = spec["rows"]
  for step in range(spec["num_steps"]):
    batch = iter([rows[step * NUM_PROMPTS:(step + 1) * NUM_PROMPTS]])
    t0 = time.perf_counter()
    state, m, _ = trainer.grpo_step(state, ref_params, lambda: next(batch), rewards, step)
    jax.block_until_ready(state)
    step_s = time.perf_counter() - t0
    sample_s, reward_s = m.get("time/sample_s"), m.get("time/reward_s")
    train_s = m.get("time/train_s")
    step_batch = spies["step_fn"].last[1]
    ref_s = reference_seconds(step_batch)  # inside time/train_s
    update_s = train_s - ref_s
    rec = {"step_s": step_s, "sample_s": sample_s, "reward_s": reward_s,
           "reference_s": ref_s, "update_s": update_s,
           "mean_length": m.get("completion/mean_length"),
           "decode_steps": m.get("sampler/decode_steps"),
           "skipped": m.get("step/skipped"),
           "prompt_width": int(np.shape(step_batch["prompt_NP"])[1])}  # the padded prompt
    known = [rec[k] for k in ("sample_s", "reward_s", "reference_s", "update_s")]
    rec["other_s"] = step_s - sum(x for x in known if x is not None)
    out["time_keys"] = sorted(k for k in m if k.startswith("time/"))
    out["steps"].append(rec)
    print(STEP + json.dumps(rec), flush=True)

  # The machine's fp32 matmul peak under this run's load (the floor's denominator).
  a = jnp.ones((2048, 2048), jnp.float32) * 1e-3
  matmul = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(matmul(a, a))
  times = []
  for _ in range(5):
    t = time.perf_counter()
    jax.block_until_ready(matmul(a, a))
    times.append(time.perf_counter() - t)
  out["matmul_gflops"] = 2 * 2048 ** 3 / np.median(times) / 1e9

  out["versions"] = {"jax": jax.__version__}


def benchmark_reference(trainer, params):
  """The reference params as a run makes them (Trainer.reference: a copy in
  train_step.reference_dtype, bf16 with fp32 params and bf16 compute, placed as a run places
  it), each element then moved by one ulp in that dtype: the same forward and the same memory
  as a run's in every way that costs, but not equal to the policy as the forward uses it, so
  the step runs its reference forward as TRL does every step. (While the policy equals its
  reference, train_step skips that forward; a real run's policy leaves it at its first update,
  this random model earns no reward and never would.)"""
  import jax
  import jax.numpy as jnp
  return jax.tree.map(lambda x: jnp.nextafter(x, jnp.asarray(jnp.inf, x.dtype)),
                      trainer.reference(params))


def run_trl(spec: dict, forced: bool, out: dict) -> None:
  """TRL's GRPOTrainer.train() on the same checkpoint, prompts and reward."""
  import datasets
  import torch
  import transformers
  import trl
  from grpo_jax.rewards import math_accuracy as ma

  def math_accuracy(prompts, completions, answer, **_):
    # Conversational completions are [{'role': 'assistant', 'content': text}].
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return ma.math_accuracy(prompts, texts, answer=answer)

  def messages(question):
    chat = [{"role": "user", "content": spec["user_template"].format(question=question)}]
    if spec["system_prompt"] is not None:
      chat.insert(0, {"role": "system", "content": spec["system_prompt"]})
    return chat

  c, vllm = spec["new_tokens"], spec.get("vllm", False)
  dataset = datasets.Dataset.from_list(
      [{"prompt": messages(r["question"]), "answer": r["answer"]} for r in spec["rows"]])
  args = trl.GRPOConfig(
      output_dir=str(Path(spec["model"]).parent / "trl_out"), seed=SEED,
      use_cpu=not spec.get("trl_gpu", False),
      per_device_train_batch_size=NUM_PROMPTS * G, gradient_accumulation_steps=1,
      steps_per_generation=1, num_generations=G, num_iterations=1,
      max_steps=spec["num_steps"], shuffle_dataset=False, dataloader_num_workers=0,
      learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
      adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=MAX_GRAD_NORM,
      loss_type="grpo", epsilon=0.2, scale_rewards="group", beta=BETA,
      use_bias_correction_kl=False, max_completion_length=c, temperature=1.0, top_k=0,
      top_p=1.0, bf16=spec.get("compute_dtype") == "bfloat16", fp16=False,
      gradient_checkpointing=spec.get("remat", True),
      # gpu_step.py: TRL generating with vLLM inside the trainer's process (colocate mode),
      # without the importance-sampling correction: TRL's default would add a forward of the
      # policy (old log-probs) every step, which grpo_jax does not run (μ = 1).
      use_vllm=vllm,
      **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
          "vllm_importance_sampling_correction": False} if vllm else {}),
      model_init_kwargs={"dtype": "float32"},
      # Forced length: EOS ids are masked until C tokens, so every row has exactly C. TRL hands
      # these to transformers' GenerationConfig (min_new_tokens) or vLLM's SamplingParams
      # (min_tokens; an unknown name there is a TypeError).
      generation_kwargs={"min_tokens" if vllm else "min_new_tokens": c} if forced else None,
      logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
      log_completions=False)
  tokenizer = transformers.AutoTokenizer.from_pretrained(spec["tokenizer"], padding_side="left")
  trainer = trl.GRPOTrainer(model=spec["model"], reward_funcs=math_accuracy, args=args,
                            train_dataset=dataset, processing_class=tokenizer)

  acc = collections.defaultdict(float)

  def timed(name, key, when=None):
    original = getattr(trainer, name)

    def wrapper(*a, **k):
      if when is not None and not when():
        return original(*a, **k)
      t = time.perf_counter()
      try:
        return original(*a, **k)
      finally:
        acc[key] += time.perf_counter() - t
        acc[key + "_calls"] += 1
    setattr(trainer, name, wrapper)  # instance attribute: self.<name>(...) finds it first

  timed("_prepare_inputs", "prepare")
  timed("_generate", "sample")
  timed("_calculate_rewards", "reward")
  # Under no_grad only the reference forward calls it (μ = 1: no old log-probs).
  timed("_get_per_token_logps_and_entropies", "reference", when=lambda: not torch.is_grad_enabled())
  timed("compute_loss", "loss_forward")
  seen_prompts = []
  tokenize = trainer._tokenize_prompts

  def tokenize_and_record(prompts):
    result = tokenize(prompts)
    seen_prompts.append([list(map(int, ids)) for ids in result[0]])
    return result
  trainer._tokenize_prompts = tokenize_and_record
  widths = []  # the padded prompt of each step (TRL pads to the batch's longest prompt)
  prepare_inputs = trainer._prepare_inputs

  def prepare_and_record(*a, **k):
    inputs = prepare_inputs(*a, **k)
    widths.append(int(inputs["prompt_ids"].shape[1]))
    return inputs
  trainer._prepare_inputs = prepare_and_record

  class Clock(transformers.TrainerCallback):
    def on_step_begin(self, *_, **__):
      acc.clear()
      self.t0 = time.perf_counter()

    def on_step_end(self, *_, **__):
      step_s = time.perf_counter() - self.t0
      step = len(out["steps"])
      expected = [ids for ids in spec["prompt_ids"][step * NUM_PROMPTS:(step + 1) * NUM_PROMPTS]
                  for _ in range(G)]
      rec = {"step_s": step_s, "sample_s": acc["sample"], "reward_s": acc["reward"],
             "reference_s": acc["reference"], "update_s": step_s - acc["prepare"],
             "other_s": acc["prepare"] - acc["sample"] - acc["reward"] - acc["reference"],
             "loss_forward_s": acc["loss_forward"],
             "reference_calls": int(acc["reference_calls"]),
             "mean_length": trainer._metrics["train"]["completions/mean_length"][-1],
             "prompts_match": bool(seen_prompts) and seen_prompts[-1] == expected,
             "prompt_width": widths[-1] if widths else None}
      out["steps"].append(rec)
      print(STEP + json.dumps(rec), flush=True)

  trainer.add_callback(Clock())
  out["setup_s"] = time.perf_counter() - out["t_start"]
  trainer.train()
  out["versions"] = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                     "transformers": transformers.__version__, "trl": trl.__version__}
  try:  # TRL's fused LM head scores only completion positions where Triton runs, else all
    from trl.kernels import chunked_logprob
    out["head_compacts"] = bool(chunked_logprob._use_triton(trainer.accelerator.device))
  except (ImportError, AttributeError):
    pass


def worker(args) -> None:
  side, size = args.worker
  workdir = Path(args.dir) / size
  out = {"side": side, "size": size, "forced": args.forced, "steps": [], "error": None,
         "t_start": time.perf_counter()}
  try:
    if side == "prepare":
      workdir.mkdir(parents=True, exist_ok=True)
      spec = prepare(size, workdir, args.warmup + args.steps)
      (workdir / "spec.json").write_text(json.dumps(spec))
    else:
      spec = json.loads((workdir / "spec.json").read_text())
      if side == "grpo_jax":
        run_grpo_jax(spec, args.forced, out)
      else:
        run_trl(spec, args.forced, out)
  except BaseException as e:  # noqa: BLE001 - reported to the parent, which goes on
    traceback.print_exc()
    out["error"] = f"{type(e).__name__}: {e}"[:600]
  out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
  del out["t_start"]
  print(RESULT + json.dumps(out), flush=True)


# --- the parent: alternation and report -----------------------------------------------------------

def spawn(side, size, tmp: Path, args, label, forced=False) -> dict:
  """Runs one worker process; its output goes to a log, its RESULT line comes back."""
  log = tmp / "logs" / f"{label}.log"
  log.parent.mkdir(exist_ok=True)
  cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, size, "--dir", str(tmp),
         "--steps", str(args.steps), "--warmup", str(args.warmup)]
  cmd += ["--forced"] * forced
  # Offline, CPU only; tokenizers' own thread pool would compete with torch's and XLA's.
  env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
             HF_DATASETS_OFFLINE="1", JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
  t = time.perf_counter()
  with open(log, "w") as f:
    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
  wall = time.perf_counter() - t
  lines = log.read_text(errors="replace").splitlines()
  found = [json.loads(x[len(RESULT):]) for x in lines if x.startswith(RESULT)]
  # A worker killed (out of memory) prints no result: keep the steps it finished.
  result = found[-1] if found else {
      "side": side, "size": size, "error": None,
      "steps": [json.loads(x[len(STEP):]) for x in lines if x.startswith(STEP)]}
  if rc != 0 and not result["error"]:
    why = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
    if rc in (-9, 137):
      why += " (likely the out-of-memory killer)"
    result["error"] = why
  result["wall_s"] = wall
  if result["error"]:
    tail = "\n      ".join(lines[-12:])
    print(f"  {label}: FAILED after {wall:.0f}s: {result['error']}\n      {tail}\n"
          f"      (full log: {log})", flush=True)
  elif side != "prepare":
    steps = [round(s["step_s"], 2) for s in result["steps"]]
    print(f"  {label}: steps {steps}s (first {args.warmup} dropped), setup "
          f"{result.get('setup_s', 0):.1f}s, peak RSS {result['peak_rss_gb']:.1f} GB, "
          f"process {wall:.0f}s", flush=True)
  return result


def step_flops(spec: dict, decode_steps: float, layers: int | None = None) -> dict:
  """The docstring's analytic FLOP count of one grpo_jax step (`layers` overrides L)."""
  L, D, H, K, I = (spec[k] for k in ("layers", "hidden", "heads", "kv_heads", "mlp"))
  L = layers or L
  h, V = D // H, spec["valid_vocab"]
  P, C, B, R = spec["bucket"], spec["new_tokens"], NUM_PROMPTS, NUM_PROMPTS * G
  W = 2 * (2 * D * H * h + 2 * D * K * h + 3 * D * I)
  A = 4 * H * h
  c = C - 1
  body = B * L * (W * P + A * P * P) + R * L * (W * c + A * c * (P + c))
  fwd = body + R * 2 * D * V * C
  prefill = B * L * (W * P + A * P * P)
  decode = decode_steps * R * (2 * D * V + L * (W + A * (P + C)))
  return {"prefill": prefill, "decode": decode, "sample": prefill + decode, "reference": fwd,
          "policy": 3 * fwd, "remat": body, "total": prefill + decode + 4 * fwd}


PHASES = ("sample", "reward", "reference", "update", "other")


def side_summary(runs: list[dict], warmup: int) -> dict:
  done = [r for r in runs if r["steps"]]
  measured = [s for r in done for s in r["steps"][warmup:]]
  s = {"first": median([r["steps"][0]["step_s"] for r in done]),
       "step": median([x["step_s"] for x in measured]),
       "steps": [x["step_s"] for x in measured],
       "length": median([x["mean_length"] for x in measured]),
       "setup": median([r.get("setup_s") for r in done]),
       "rss": max([r["peak_rss_gb"] for r in runs if "peak_rss_gb" in r], default=None),
       "errors": [r["error"] for r in runs if r["error"]]}
  for p in PHASES:
    s[p] = median([x.get(p + "_s") for x in measured])
  s["loss_forward"] = median([x.get("loss_forward_s") for x in measured])
  return s


def fmt(x, unit="s", width=8, digits=2):
  return f"{'n/a':>{width}}" if x is None else f"{x:{width}.{digits}f}{unit}"


def report(label, spec, runs, args, peak_gflops) -> float | None:
  m = spec
  print(f"\n== {label}: Qwen2 {m['layers']} x {m['hidden']} (heads {m['heads']}/{m['kv_heads']}, "
        f"MLP {m['mlp']}, tied), {m['num_params'] / 1e6:.1f}M params, vocab {m['vocab']:,} "
        f"({m['valid_vocab']:,} tokenizer ids); {NUM_PROMPTS} prompts x G={G}, "
        f"{m['new_tokens']} new tokens; prompts "
        f"{min(map(len, m['prompt_ids']))}-{max(map(len, m['prompt_ids']))} tokens "
        f"(grpo_jax bucket {m['bucket']}); {len(runs['grpo_jax'])} round(s) x ({args.warmup} "
        f"warm-up + {args.steps} measured) steps")
  sums = {side: side_summary(runs[side], args.warmup) for side in SIDES}
  print(f"  {'side':9s}{'first':>9s}{'median':>9s}{'sample':>9s}{'reward':>9s}{'reference':>10s}"
        f"{'update':>9s}{'other':>9s}{'mean len':>10s}{'setup':>9s}{'peak RSS':>10s}  measured")
  for side in SIDES:
    s = sums[side]
    print(f"  {side:9s}{fmt(s['first'])}{fmt(s['step'])}{fmt(s['sample'])}{fmt(s['reward'])}"
          f" {fmt(s['reference'])}{fmt(s['update'])}{fmt(s['other'])}"
          f"{fmt(s['length'], '', 10, 1)}{fmt(s['setup'])}{fmt(s['rss'], ' GB', 7, 1)}  "
          f"{[round(x, 2) for x in s['steps']]}")
    for e in s["errors"]:
      print(f"  {side} FAILED: {e}")
  trl_steps = [x for r in runs["trl"] for x in r["steps"][args.warmup:]]
  if sums["trl"]["loss_forward"] is not None:
    print(f"  TRL update = loss forward {sums['trl']['loss_forward']:.2f}s + backward, clip, "
          f"AdamW; reference forwards per step: "
          f"{sorted({x['reference_calls'] for x in trl_steps})}")
  gj_runs = [r for r in runs["grpo_jax"] if r["steps"]]
  if gj_runs:
    keys = gj_runs[0].get("time_keys", [])
    print(f"  grpo_jax step time metrics: {keys}"
          + "; reference: the same forward timed alone beside the step")
  compacts = next((r["head_compacts"] for r in runs["trl"] if "head_compacts" in r), None)
  if compacts is False:
    print(f"  TRL's fused LM head (no Triton on CPU) scores every one of the ~P + C - 1 "
          f"positions, prompt included, in the reference and policy forwards; grpo_jax "
          f"scores the C = {m['new_tokens']} completion positions")
  if trl_steps:
    print(f"  prompt token ids identical on both sides: "
          f"{'yes' if all(x['prompts_match'] for x in trl_steps) else 'NO'}")
  widths = {side: median([x.get("prompt_width") for r in runs[side]
                           for x in r["steps"][args.warmup:]]) for side in SIDES}
  if None not in widths.values():
    print(f"  padded prompt width (median): grpo_jax {widths['grpo_jax']:.0f} (its bucket), "
          f"TRL {widths['trl']:.0f} (each batch's longest prompt)")
  lj, lt = sums["grpo_jax"]["length"], sums["trl"]["length"]
  differ = None
  if lj is not None and lt is not None:
    differ = abs(lj / lt - 1) > LENGTH_TOLERANCE
    print(f"  mean completion length: grpo_jax {lj:.1f}, TRL {lt:.1f} (ratio {lj / lt:.3f}"
          f"{', differ by more than 3%' if differ else ''})")

  gj_steps = [x for r in gj_runs for x in r["steps"][args.warmup:]]
  if any(x.get("skipped") for x in gj_steps):
    print("  note: grpo_jax skipped a non-finite update in a measured step")
  decode_steps = median([x.get("decode_steps") for x in gj_steps]) or m["new_tokens"]
  f = step_flops(m, decode_steps)
  T = 1e12
  print(f"  grpo_jax step FLOPs (analytic, {decode_steps:.0f} decode steps): {f['total'] / T:.3f} "
        f"TFLOP = sampling {f['sample'] / T:.3f} (prefill {f['prefill'] / T:.3f}) + reference "
        f"forward {f['reference'] / T:.3f} + policy forward+backward {f['policy'] / T:.3f}; "
        f"remat recompute +{f['remat'] / T:.3f} not counted")
  if peak_gflops and sums["grpo_jax"]["step"]:
    floor = f["total"] / (peak_gflops * 1e9)
    print(f"  floor at the measured fp32 matmul peak ({peak_gflops:.1f} GFLOP/s): {floor:.2f}s; "
          f"grpo_jax median step {sums['grpo_jax']['step'] / floor:.1f}x the floor "
          f"({100 * floor / sums['grpo_jax']['step']:.0f}% of peak)")
  ratio = None
  if sums["grpo_jax"]["step"] and sums["trl"]["step"]:
    ratio = sums["trl"]["step"] / sums["grpo_jax"]["step"]
    print(f"  speedup (TRL median step / grpo_jax median step): {ratio:.2f}x")
  return ratio


def main():
  args = parse_args()
  if args.worker:
    return worker(args)
  sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
  if args.smoke:
    sizes = ["smoke"] + ["smoke_vocab"] * args.small_vocab
  elif args.small_vocab and "small_vocab" not in sizes:
    sizes.append("small_vocab")
  unknown = [s for s in sizes if s not in SIZES]
  if unknown:
    sys.exit(f"unknown sizes {unknown}; known: {list(SIZES)}")
  if args.steps < 1 or args.warmup < 0:
    sys.exit("--steps must be >= 1 and --warmup >= 0")
  rounds = {s: args.rounds or (1 if args.smoke else SIZES[s]["rounds"]) for s in sizes}
  print(f"trl_step: sizes {sizes}, rounds {rounds}, {args.warmup} warm-up + {args.steps} "
        f"measured step(s) per worker; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; python {sys.executable}", flush=True)

  results, order = {}, []
  with tempfile.TemporaryDirectory(prefix="trl_step_") as tmp_name:
    tmp = Path(tmp_name)
    specs = {}
    for size in sizes:
      r = spawn("prepare", size, tmp, args, f"prepare_{size}")
      if not r["error"]:
        specs[size] = json.loads((tmp / size / "spec.json").read_text())
    failed = set()

    def run_variant(size, forced):
      variant = "forced_length" if forced else "natural"
      key = (size, variant)
      results[key] = {side: [] for side in SIDES}
      order.append(key)
      return key

    def one_round(key, r):
      size, variant = key
      for side in SIDES:
        if (side, size) in failed or side not in args.sides.split(","):
          continue
        label = f"round{r + 1}_{size}_{variant}_{side}"
        res = spawn(side, size, tmp, args, label, forced=variant == "forced_length")
        results[key][side].append(res)
        if res["error"]:
          failed.add((side, size))  # an out-of-memory side would only fail again

    keys = {size: run_variant(size, False) for size in specs}
    for r in range(max(rounds.values(), default=0)):
      print(f"round {r + 1}:", flush=True)
      for size in specs:
        if r < rounds[size]:
          one_round(keys[size], r)
    # Lengths that differ change the work: repeat with both sides producing exactly C tokens.
    for size in specs:
      runs = results[keys[size]]
      lengths = {side: median([s["mean_length"] for x in runs[side]
                               for s in x["steps"][args.warmup:]]) for side in SIDES}
      differ = None not in lengths.values() and (
          abs(lengths["grpo_jax"] / lengths["trl"] - 1) > LENGTH_TOLERANCE)
      if args.forced_length or differ:
        key = run_variant(size, True)
        for r in range(rounds[size]):
          print(f"{size}, forced length, round {r + 1}:", flush=True)
          one_round(key, r)

  peaks = [r["matmul_gflops"] for runs in results.values() for r in runs["grpo_jax"]
           if "matmul_gflops" in r]
  peak = median(peaks)
  versions = {}
  for runs in results.values():
    for side in SIDES:
      for r in runs[side]:
        versions.update(r.get("versions", {}))
  print(f"\nversions: {versions}; fp32 matmul peak {peak and round(peak, 1)} GFLOP/s "
        f"(median of {len(peaks)} grpo_jax workers); load average {os.getloadavg()[0]:.1f}")
  finals = []
  for size, variant in order:
    label = size if variant == "natural" else f"{size}/forced_length"
    title = label if variant == "natural" else f"{size}, forced length (no stop tokens)"
    ratio = report(title, specs[size], results[(size, variant)], args, peak)
    finals.append((label, ratio))
  for size in sizes:
    if size not in specs:
      print(f"\n== {size}: preparation failed (see above)")
      finals.append((size, None))
  print()
  for label, ratio in finals:
    print(f"grpo_step_speedup_vs_trl[{label}]={'nan' if ratio is None else f'{ratio:.2f}'}")


if __name__ == "__main__":
  main()
