"""The whole GRPO step on one GPU: grpo_jax against TRL's GRPOTrainer, with the hardware's limits.

    python benchmarks/gpu_step.py                       # 0.5b and 1.5b, under 8 min on an H100
    python benchmarks/gpu_step.py --sizes 0.5b --attention cudnn
    python benchmarks/gpu_step.py --sizes 1.5b --remat '' --grad_accum 2 --sides grpo_jax
    python benchmarks/gpu_step.py --smoke               # the same code on CPU at a toy shape

Workload (issue 30, both sides in the same call on the same GPU): random weights at the real
Qwen2.5-0.5B / 1.5B shapes, built by transformers (benchmarks/trl_step.py's `prepare`, seed 0,
tied embeddings, vocabulary 151,936) and the real Qwen2.5 tokenizer (--tokenizer); 16 GSM8K
train prompts × G = 8 = 128 completions of exactly 256 new tokens (no stop ids on either side:
TRL gets min_new_tokens, with vLLM min_tokens), β = 0.04 (k3 KL: a reference forward every
step), prompts padded to a bucket of 192 by grpo_jax and to each batch's longest by TRL (146 in
its measured step: grpo_jax runs the longer prompts; the report prints both widths),
one AdamW update, fp32 master params and bf16 compute on both sides. Remat (activation
checkpointing) per size, the same on both sides: off for 0.5b, on for 1.5b unless --remat says
otherwise. The steps themselves are trl_step.py's: `run_grpo_jax`
(grpo_jax.trainer.Trainer.grpo_step, the reference timed alone beside the step) and `run_trl`
(GRPOTrainer.train with per-phase clocks). TRL runs with transformers' generate, and again with vLLM (colocate mode) where
`import vllm` works, its importance-sampling correction off
(vllm_importance_sampling_correction=False: TRL's default adds a forward of the policy for old
log-probs every step, which grpo_jax does not run at μ = 1).

Besides the step and its phases (sample, reward, reference, update), the grpo_jax worker
measures, after its steps, in the same process:
  decode     the sampler alone on the first batch: prefill, then the decode loop of C = 256
             steps (Sampler.begin / extend, timed to block_until_ready): ms per decode step and
             decode tokens/s (128 rows per step);
  roofline   bytes one decode step must move, counted analytically:
               weights  every parameter once, in the compute dtype (bf16; the tied LM head is
                        the embedding, counted once)
               KV cache k and v of every layer over the live slots only, the ones a step
                        attends to: step i (of C) of the loop reads the P prompt-bucket slots
                        and the i tokens generated before it and writes its own, P + i + 1
                        slots, so P + (C + 1) / 2 on average over the C steps (not the whole
                        P + C capacity). The same floor for both decode attentions: the XLA
                        einsum reads all P + C slots every step (unwritten ones masked), the
                        Pallas kernel the slots before its own in whole blocks of 64; what
                        either reads beyond the live slots is its overhead, not the floor
               logits   R × V fp32, written once
             over the HBM bandwidth of the device's datasheet (`datasheet`; "n/a" for a card
             not in its table) and of a measured copy (read + write of a 1 GiB array), giving
             the ms per step at the roofline and the fraction of it reached. Also the weights
             as the step reads them today (fp32 master params, cast per step);
  kernels    kernels per decode step, counted in the decode program's optimized HLO
             (`count_loop_kernels`): every instruction of the decode loop's body and condition
             that launches work (fusions, custom calls such as cuBLAS GEMMs, copies, ...), with
             the layer scan's body counted once per layer (its known trip count). The
             optimized HLO is written to <dir>/<size>/decode_hlo.txt;
  fused      with --decode_attention pallas: the kernel on this device against the same
             attention in jax.numpy, on the sampler's own KV cache after that decode loop (a
             random bf16 query for every row, the last layer, the last slot): the largest
             difference of each from the float32 result; FAILED when the kernel's is more
             than twice jax.numpy's bf16 one and more than 2^-8;
  MFU        model FLOPs of the reference forward (F) and of the update (policy forward +
             backward, 3F), trl_step.step_flops' count (matmuls only, no remat recompute), over
             the phase times and two peaks: the bf16 matmul rate measured in the same process
             (an 8192³ bf16 product of random data, median of 10; on an H100 about 2/3 of the
             datasheet's) and the datasheet's dense bf16 peak (`datasheet`; "n/a" for a card
             not in its table), the usual MFU denominator;
  memory     peak device memory of the process (`device.memory_stats()['peak_bytes_in_use']`);
             TRL's from torch.cuda.max_memory_allocated;
  profile    with --profile, last: one sampling call (prefill and the decode loop) and one call
             of the train program (the last step's batch) under jax.profiler.trace, summed from
             the trace (trace_summary): per XLA program the kernels launched, their summed
             device time and the span they ran in (busy well under 100%: the device waited
             between kernels), then the instruction families with the most device time.

Protocol: one process per (side, size), run one after the other (JAX and PyTorch never share
the GPU): prepare 0.5b, grpo_jax, TRL, [TRL + vLLM], then the same for 1.5b. grpo_jax runs
--warmup steps (dropped; the first includes compilation) then --steps measured ones; TRL runs
1 warm-up and 1 measured step (its steps are the long ones). Workers that would not finish
inside --budget_s (default 450 s) are skipped and named. The last lines are
`gpu_step_speedup_vs_trl[<size>]=<TRL median step / grpo_jax median step>`.

--smoke: the same code on CPU (JAX_PLATFORMS=cpu) at a toy shape (2 layers × 64, vocabulary
151,936, 2 prompts × G = 2, 4 new tokens, the prompts' own bucket), 0 warm-up + 1 measured
step, and the TRL side only where trl imports.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_step  # noqa: E402  (puts the repository on sys.path)

RESULT = "GPU_STEP_RESULT "
NUM_PROMPTS, G, NEW_TOKENS, BUCKET = 16, 8, 256, 192
GB = 1e9
# Qwen2.5 shapes (config.json of Qwen/Qwen2.5-{0.5B,1.5B}): head_dim = hidden / heads = 64, 128.
SIZES = {
    "0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, mlp=4864, remat=False),
    "1.5b": dict(layers=28, hidden=1536, heads=12, kv_heads=2, mlp=8960, remat=True),
    "smoke": dict(layers=2, hidden=64, heads=4, kv_heads=2, mlp=256, remat=False),
}
SMOKE = dict(prompts=2, g=2, new_tokens=4)
# Datasheet figures by jax's device_kind: (name, HBM bandwidth TB/s, dense bf16 matmul peak
# TFLOP/s, without sparsity), None where not listed. `datasheet` takes the first entry whose name
# is in device_kind as whole words, so the variants come before the names they contain.
DATASHEETS = (
    ("GH200 144G HBM3e", 4.9, None), ("GH200 480GB", 4.0, None),
    ("H100 NVL", 3.9, None), ("H100 PCIe", 2.0, 756), ("H100 80GB HBM3", 3.35, 989),
    ("H100 SXM", 3.35, 989), ("H200 NVL", 4.8, None), ("H200", 4.8, 989),
    ("A100-SXM4-80GB", 2.039, 312), ("A100 80GB PCIe", 1.935, 312),
    ("A100-SXM4-40GB", 1.555, 312), ("A100-PCIE-40GB", 1.555, 312), ("A100", None, 312),
    ("L4", 0.3, None),
)


def datasheet(device_kind: str) -> tuple[float | None, float | None]:
  """(HBM TB/s, dense bf16 TFLOP/s) of the card jax's device_kind names ('NVIDIA H100 80GB
  HBM3'), from DATASHEETS: the first entry whose name appears in it as whole words (so 'H100'
  is not 'GH200', and 'H100 NVL' is found before any H100); None for what is not known, rather
  than a near match (an 'NVIDIA H800', a CPU)."""
  for name, tbps, tflops in DATASHEETS:
    if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", device_kind, re.IGNORECASE):
      return tbps, tflops
  return None, None


def configure(smoke: bool, tokenizer: str, gsm8k: str) -> None:
  """trl_step.py's workers read the workload from its module globals: set this one's."""
  prompts, g, c = ((SMOKE["prompts"], SMOKE["g"], SMOKE["new_tokens"]) if smoke
                   else (NUM_PROMPTS, G, NEW_TOKENS))
  trl_step.NUM_PROMPTS, trl_step.G = prompts, g
  trl_step.QWEN_TOKENIZER, trl_step.GSM8K = Path(tokenizer), Path(gsm8k)
  for name, m in SIZES.items():
    trl_step.SIZES[name] = dict(m, new_tokens=c, bpe=None, rounds=1)


# --- counting kernels in an optimized HLO module ----------------------------------------------

# Instructions that launch nothing on their own (control flow is expanded, not counted).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
         "conditional", "after-all", "opt-barrier", "partition-id", "replica-id",
         "add-dependency", "domain", "copy-done", "async-done", "async-update", "fusion-done",
         "send-done", "recv-done", "all-reduce-done", "all-gather-done",
         "collective-permute-done"}
_HEADER = re.compile(r"^(ENTRY )?%?([^\s(]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?(\S+) = (.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9-]*)\(")


def hlo_instructions(text: str):
  """Each instruction of an HLO module as (computation, is it the entry computation,
  instruction name, opcode, the text after '= ': output shape, opcode, operands, attributes)."""
  current, entry = None, False
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current, entry = m.group(2), bool(m.group(1))
        yield current, entry, None, None, None  # a computation, even one with no instruction
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTRUCTION.match(line)
    op = m and _OPCODE.search(" " + m.group(2))
    if op:
      yield current, entry, m.group(1), op.group(1), m.group(2)


def parse_hlo(text: str) -> tuple[dict[str, list[tuple[str, str]]], str | None]:
  """{computation: [(opcode, instruction text)]} and the entry computation's name."""
  comps, entry = {}, None
  for comp, is_entry, name, op, rest in hlo_instructions(text):
    comps.setdefault(comp, [])
    entry = comp if is_entry else entry
    if name is not None:
      comps[comp].append((op, rest))
  return comps, entry


def _loop_parts(text: str) -> tuple[str, str, int | None]:
  body = re.search(r"body=%?([^\s,]+)", text).group(1)
  cond = re.search(r"condition=%?([^\s,]+)", text).group(1)
  trip = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', text)
  return body, cond, int(trip.group(1)) if trip else None


def computation_kernels(comps, name, memo=None, key=None) -> collections.Counter:
  """Kernels one run of computation `name` launches, by opcode (or by key(opcode, instruction
  text)): a nested while loop counts its body and condition times its known trip count (1 if
  unknown), a call its callees, a conditional the one of its branches that launches the most
  kernels (the path a train step usually takes: the update rather than the identity of a
  skipped one, whose copies of the state never run otherwise; the reference forward rather
  than the shortcut of a first step)."""
  memo = {} if memo is None else memo
  if name not in memo:
    total = collections.Counter()
    for op, text in comps[name]:
      if op == "while":
        body, cond, trip = _loop_parts(text)
        for k, v in (computation_kernels(comps, body, memo, key)
                     + computation_kernels(comps, cond, memo, key)).items():
          total[k] += (trip or 1) * v
      elif op == "call":
        for callee in re.findall(r"to_apply=%?([^\s,}]+)", text):
          if callee in comps:
            total.update(computation_kernels(comps, callee, memo, key))
      elif op == "conditional":
        branches = [computation_kernels(comps, callee, memo, key)
                    for callee in _branches(text) if callee in comps]
        if branches:
          total.update(max(branches, key=lambda k: sum(k.values())))
      elif op not in _FREE:
        total[op if key is None else key(op, text)] += 1
    memo[name] = total
  return memo[name]


def _branches(text: str) -> list[str]:
  """A conditional's branch computations: true_computation/false_computation, or the list of
  branch_computations."""
  listed = re.search(r"branch_computations=\{([^}]*)\}", text)
  if listed:
    return [c.strip().lstrip("%") for c in listed.group(1).split(",")]
  return re.findall(r"(?:true|false)_computation=%?([^\s,}]+)", text)


def count_loop_kernels(hlo_text: str, key=None) -> collections.Counter:
  """Kernels per iteration of the entry computation's largest while loop (the decode loop:
  its trip count is dynamic), by opcode (or by key(opcode, instruction text))."""
  comps, entry = parse_hlo(hlo_text)
  best = collections.Counter()
  for op, text in comps.get(entry, []):
    if op == "while":
      body, cond, _ = _loop_parts(text)
      memo = {}
      k = computation_kernels(comps, body, memo, key) + computation_kernels(comps, cond, memo, key)
      if sum(k.values()) > sum(best.values()):
        best = k
  return best


# --- analytic decode traffic ------------------------------------------------------------------

def decode_bytes(spec: dict, rows: int, prompt_slots: int, steps: int, weight_bytes: int = 2,
                 cache_bytes: int = 2) -> dict:
  """Bytes one decode step moves at least, on average over a loop of `steps` steps after a
  prompt bucket of `prompt_slots`: every weight once, k and v of the live slots (step i attends
  to prompt_slots + i + 1 of them: `live_slots` is their mean), the logits."""
  L, D, H, K, I = (spec[k] for k in ("layers", "hidden", "heads", "kv_heads", "mlp"))
  h, V = D // H, spec["vocab"]
  per_layer = D * (H + 2 * K) * h + (H + 2 * K) * h + H * h * D + 3 * D * I + 2 * D
  params = L * per_layer + V * D + D  # tied: the LM head is the embedding
  live = prompt_slots + (steps + 1) / 2
  return {"params": params, "weights": params * weight_bytes, "live_slots": live,
          "kv_cache": 2 * L * rows * K * h * cache_bytes * live,
          "logits": rows * spec["valid_vocab"] * 4}


# --- where the device time goes: a jax.profiler trace, summed ------------------------------

# Instructions whose events hold their callees' (a CPU trace nests a loop's body in its event).
_CONTAINERS = ("while", "call", "conditional")


def _op_family(op: str) -> str:
  """An HLO instruction's name without its number: 'loop_add_fusion.12' -> 'loop_add_fusion'."""
  return re.sub(r"(\.\d+)+$", "", op)


def trace_summary(trace_dir, platform: str, top: int = 12) -> dict:
  """Device time from the jax.profiler trace in trace_dir: for each XLA program (hlo_module),
  the summed duration of its kernels (on a CPU: its thunks), how many there were, and the
  span from the first one's start to the last one's end; busy = summed / span (well under 1:
  the device waited between kernels, for launches or the host). Then the `top` instruction
  families by summed time. Events without an hlo_op (memcpys, the host's own work) and those of
  loops and calls themselves (their bodies' are counted) are left out; on a GPU whose trace ties
  no kernel to its HLO instruction, the kernels of the stream lines are summed by kernel name."""
  import jax  # pylint: disable=import-outside-toplevel
  paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
  if not paths:
    return {"error": "the profiler wrote no trace"}
  data = jax.profiler.ProfileData.from_file(str(paths[-1]))
  prefix = "/host:CPU" if platform == "cpu" else "/device:"
  modules, ops = {}, collections.defaultdict(lambda: [0, 0])

  def add(module, op, e):
    m = modules.setdefault(module, {"busy_ns": 0, "kernels": 0, "start": e.start_ns,
                                    "end": e.end_ns})
    m["busy_ns"] += e.duration_ns
    m["kernels"] += 1
    m["start"], m["end"] = min(m["start"], e.start_ns), max(m["end"], e.end_ns)
    ops[module, op][0] += e.duration_ns
    ops[module, op][1] += 1

  planes = [p for p in data.planes if p.name.startswith(prefix)]
  for plane in planes:
    for line in plane.lines:
      for e in line.events:
        stats = dict(e.stats)
        op, module = stats.get("hlo_op"), stats.get("hlo_module")
        if op and module and not e.name.startswith("end: ") and (
            _op_family(str(op)) not in _CONTAINERS):
          add(str(module), _op_family(str(op)), e)
  if not modules and platform != "cpu":  # kernels not tied to their HLO: by kernel name
    for plane in planes:
      for line in plane.lines:
        if "stream" in line.name.lower():
          for e in line.events:
            add(str(dict(e.stats).get("hlo_module", "(kernels by name)")), e.name[:60], e)
  if not modules:
    return {"error": f"no events with an hlo_op on {prefix}* planes (is CUPTI there?)"}
  out = {"modules": {}, "top_ops": []}
  for name, m in sorted(modules.items(), key=lambda kv: -kv[1]["busy_ns"]):
    span = max(m["end"] - m["start"], 1)
    out["modules"][name] = {"busy_ms": m["busy_ns"] / 1e6, "kernels": m["kernels"],
                            "span_ms": span / 1e6, "busy": m["busy_ns"] / span}
  for (module, op), (ns, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
    out["top_ops"].append({"module": module, "op": op, "ms": ns / 1e6, "count": n})
  return out


def profiled(fn, trace_dir, platform: str) -> dict:
  """fn() run once under jax.profiler.trace (to block_until_ready), summed by trace_summary."""
  import jax  # pylint: disable=import-outside-toplevel
  with jax.profiler.trace(str(trace_dir)):
    jax.block_until_ready(fn())
  return trace_summary(trace_dir, platform)


def print_profile(name: str, summary: dict) -> None:
  if "error" in summary:
    print(f"  profile of {name}: n/a ({summary['error']})")
    return
  print(f"  profile of {name} (jax.profiler, one call): program, kernels, device-busy ms over "
        f"its span ms")
  for module, m in summary["modules"].items():
    print(f"    {module[:48]:48s}{m['kernels']:>9,d}{m['busy_ms']:>11.1f} /{m['span_ms']:>9.1f}"
          f" ms ({100 * m['busy']:.0f}% busy)")
  print("    the instruction families with the most device time (program, family, ms, count):")
  for o in summary["top_ops"]:
    print(f"      {o['module'][:28]:28s} {o['op'][:44]:44s}{o['ms']:>9.2f}{o['count']:>9,d}")


# --- the grpo_jax worker's device figures ----------------------------------------------------

def _median_seconds(fn, reps):
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def device_figures(spec: dict, trainer, state, out: dict, smoke: bool, kernels: bool,
                   profile: bool = False) -> None:
  """Matmul peak, HBM copy bandwidth, the sampler alone, decode kernels, peak memory; with
  profile, where the device time of one sampling call and of one train program call goes
  (the train call is last: it consumes `state`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  dev = jax.devices()[0]
  out["device"] = f"{dev.platform}: {dev.device_kind}"
  out["jax"] = jax.__version__
  stats = dev.memory_stats() or {}  # before this function's own arrays
  if "peak_bytes_in_use" in stats:
    out["peak_memory_gb"] = stats["peak_bytes_in_use"] / GB
    out["memory_limit_gb"] = stats.get("bytes_limit", 0) / GB
  n = 1024 if smoke else 8192
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  out["bf16_peak_tflops"] = 2 * n ** 3 / _median_seconds(lambda: matmul(a, a), 10) / 1e12
  x = jnp.ones((2 ** (22 if smoke else 28),), jnp.float32)
  add = jax.jit(lambda x: x + 1)
  out["copy_tbps"] = 2 * x.nbytes / _median_seconds(lambda: add(x), 10) / 1e12
  del a, x

  params = {"params": state["params"]}  # what the sampler runs
  try:
    _sampler_figures(spec, trainer.sampler, params, out, kernels)
  except Exception as e:  # noqa: BLE001 - figures missing, not a failed run
    out["sampler_error"] = f"{type(e).__name__}: {e}"[:300]
  if not profile:
    return
  traces = Path(spec["model"]).parent / "traces"
  sampler, c = trainer.sampler, spec["new_tokens"]
  prompts = spec["prompt_ids"][:trl_step.NUM_PROMPTS]

  def sample():
    conv = sampler.begin(params, prompts, num_samples=trl_step.G, room=c)
    return sampler.extend(params, conv, jax.random.key(1), max_tokens=c)

  # The train program on the last step's batch (TrainStep(state, batch, ref_params, hparams),
  # as trl_step.py's spy kept it) and the state that step returned (the one it took was donated).
  step_fn = trainer.step_fn
  for name, fn in (("sampling", sample), ("train", lambda: step_fn.fn(state, *step_fn.last[1:]))):
    try:
      out[f"profile_{name}"] = profiled(fn, traces / name, dev.platform)
    except Exception as e:  # noqa: BLE001 - a figure missing, not a failed run
      out[f"profile_{name}"] = {"error": f"{type(e).__name__}: {e}"[:300]}


def fused_attention_error(cfg, conv) -> tuple[float, float]:
  """(kernel, jax.numpy in bf16): each one's largest difference from jax.numpy in float32, over
  the attention's output and the k cache it writes, for the fused decode attention
  (grpo_jax/models/decode_attention.py) on this device, on a decode loop's cache `conv.cache`
  and mask, with random q, k and v for the last slot of the last layer."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import decode_attention, qwen  # pylint: disable=import-outside-toplevel
  k, v, mask = conv.cache["k"], conv.cache["v"], conv.state["mask"]
  layer, index = k.shape[0] - 1, k.shape[3] - 1
  rows, kv = k.shape[1], k.shape[2]
  keys = jax.random.split(jax.random.key(0), 3)
  q, k_new, v_new = (jax.random.normal(key, (rows, n, cfg.head_dim), k.dtype)
                     for key, n in zip(keys, (cfg.num_heads, kv, kv)))
  tables = tuple(t[:, 0, 0] for t in qwen.rope_tables(
      jnp.full((rows, 1), index, jnp.int32), cfg.head_dim, cfg.rope_theta))
  f32 = lambda x: x.astype(jnp.float32)
  exact = jax.jit(decode_attention.reference)(f32(q), f32(k_new), f32(v_new), *tables, f32(k),
                                              f32(v), layer, mask, index)

  def err(fn):
    got = jax.jit(fn)(q, k_new, v_new, *tables, k, v, layer, mask, index)
    return max(float(jnp.abs(f32(got[i]) - exact[i]).max()) for i in (0, 1))
  step = lambda q, k_new, v_new, cos, sin, *rest: decode_attention.step(q, k_new, v_new,
                                                                        (cos, sin), *rest)
  return err(step), err(decode_attention.reference)


def _sampler_figures(spec, sampler, params, out, kernels):
  """The sampler alone on the step's first prompts, then its decode program's kernels."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  prompts = spec["prompt_ids"][:trl_step.NUM_PROMPTS]
  c = spec["new_tokens"]
  times = {"prefill": [], "decode": []}
  for rep in range(2):  # the step compiled both programs; the first rep warms nothing new
    t = time.perf_counter()
    conv = sampler.begin(params, prompts, num_samples=trl_step.G, room=c)
    jax.block_until_ready(conv.cache)
    times["prefill"].append(time.perf_counter() - t)
    t = time.perf_counter()
    results, conv = sampler.extend(params, conv, jax.random.key(rep), max_tokens=c)
    jax.block_until_ready((results, conv.cache))
    times["decode"].append(time.perf_counter() - t)
    out["decode_steps"] = int(results["steps"])
  out["prefill_s"], out["decode_s"] = min(times["prefill"]), min(times["decode"])
  out["rows"], out["slots"] = int(conv.row_ids.shape[0]), int(conv.cache["k"].shape[3])
  out["prompt_slots"] = int(conv.state["slot"]) - out["decode_steps"]  # the prompt bucket
  if sampler.cfg.run.decode_attention == "pallas":
    out["fused_attention_error"] = fused_attention_error(sampler.cfg, conv)
  if kernels:
    try:  # the decode program as the sampler compiles it, lowered again for its HLO
      active = jnp.ones((out["rows"],), bool)
      compiled = sampler.lower_decode(params, conv.cache, conv.state, jax.random.key(0),
                                      conv.row_ids, active, c).compile()
      text = compiled.as_text()
      # Kept beside the size's inputs, for reading the kernels off the GPU machine.
      (Path(spec["model"]).parent / "decode_hlo.txt").write_text(text)
      k = count_loop_kernels(text)
      out["decode_kernels"] = sum(k.values())
      out["decode_kernel_ops"] = dict(k.most_common(12))
    except Exception as e:  # noqa: BLE001 - a figure missing, not a failed run
      out["decode_kernels_error"] = f"{type(e).__name__}: {e}"[:300]


def worker(args) -> None:
  """One (side, size) in this process, through trl_step.py's worker (its RESULT line), with
  this script's options in the spec and the device figures added to the grpo_jax side."""
  configure(args.smoke, args.tokenizer, args.gsm8k)
  side, size = args.worker
  options = {"compute_dtype": "bfloat16", "remat": args.remat_on, "attention": args.attention,
             "unroll_decode": args.unroll_decode, "decode_attention": args.decode_attention,
             "grad_accum": args.grad_accum,
             "logprob_block_bytes": args.logprob_block_mib << 20,
             "trl_gpu": not args.smoke, "vllm": side == "trl_vllm"}
  run_grpo_jax, run_trl = trl_step.run_grpo_jax, trl_step.run_trl
  captured = {}

  def grpo_jax_side(spec, forced, out):
    from grpo_jax import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
    spec.update(options, num_steps=args.warmup + args.steps)
    if not args.smoke:
      longest = max(map(len, spec["prompt_ids"]))
      if longest > BUCKET:
        raise SystemExit(f"a prompt has {longest} tokens, more than the bucket {BUCKET}")
      spec["bucket"] = BUCKET

    class Trainer(trainer_lib.Trainer):  # keeps the trainer and the latest state for the figures
      def __init__(self, *a, **k):
        super().__init__(*a, **k)
        captured["trainer"] = self

      def grpo_step(self, *a, **k):
        result = super().grpo_step(*a, **k)
        captured["state"] = result[0]
        return result

    trainer_lib.Trainer = Trainer
    run_grpo_jax(spec, forced, out)
    device_figures(spec, captured["trainer"], captured["state"], out, args.smoke,
                   not args.no_kernels, args.profile)

  def trl_side(spec, forced, out):
    import torch  # pylint: disable=import-outside-toplevel
    spec.update(options, num_steps=args.warmup + args.steps)
    run_trl(spec, forced, out)
    if torch.cuda.is_available():
      out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / GB
      out["device"] = f"gpu: {torch.cuda.get_device_name()}"

  trl_step.run_grpo_jax, trl_step.run_trl = grpo_jax_side, trl_side
  trl_step.RESULT = RESULT
  trl_step.worker(argparse.Namespace(
      worker=("trl" if side == "trl_vllm" else side, size), dir=args.dir, steps=args.steps,
      warmup=args.warmup, forced=True))


# --- the parent ------------------------------------------------------------------------------

def spawn(side, size, args, remat, budget_end) -> dict:
  left = budget_end - time.perf_counter()
  label = f"{size}_{side}"
  if left < 20:
    print(f"  {label}: skipped, {max(left, 0):.0f} s of --budget_s left", flush=True)
    return {"side": side, "size": size, "error": "skipped (budget)", "steps": []}
  trl = side.startswith("trl")  # TRL: 1 warm-up (none in smoke) + 1 measured step
  cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, size, "--dir",
         args.dir, "--steps", str(1 if trl else args.steps), "--warmup",
         str((0 if args.smoke else 1) if trl else args.warmup),
         "--tokenizer", args.tokenizer, "--gsm8k", args.gsm8k]
  cmd += ["--attention", args.attention] if args.attention else []
  cmd += ["--grad_accum", str(args.grad_accum)] + ["--unroll_decode"] * args.unroll_decode
  cmd += ["--decode_attention", args.decode_attention]
  cmd += ["--logprob_block_mib", str(args.logprob_block_mib)]
  cmd += ["--remat_on"] * remat + ["--smoke"] * args.smoke + ["--no_kernels"] * args.no_kernels
  cmd += ["--profile"] * args.profile
  env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
             HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
  if args.smoke:
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
  else:  # JAX takes 75% of the GPU by default; the 1.5B step without remat wants more
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
  if side != "grpo_jax":
    env["JAX_PLATFORMS"] = "cpu"  # the reward code may import JAX: keep it off the GPU
  log = Path(args.dir) / "logs" / f"{label}.log"
  log.parent.mkdir(parents=True, exist_ok=True)
  t = time.perf_counter()
  with open(log, "w") as f:
    try:
      rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                          timeout=max(left, 1)).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  wall = time.perf_counter() - t
  lines = log.read_text(errors="replace").splitlines()
  found = [json.loads(x[len(RESULT):]) for x in lines if x.startswith(RESULT)]
  result = found[-1] if found else {"side": side, "size": size, "steps": [],
                                    "error": f"no result ({rc})"}
  result["wall_s"] = wall
  if result.get("error"):
    tail = "\n      ".join(lines[-15:])
    print(f"  {label}: FAILED after {wall:.0f} s: {result['error']}\n      {tail}", flush=True)
  elif side != "prepare":
    print(f"  {label}: steps {[round(s['step_s'], 2) for s in result['steps']]} s, process "
          f"{wall:.0f} s", flush=True)
  return result


def _phase(result, key, skip):
  xs = [s[key] for s in result.get("steps", [])[skip:] if s.get(key) is not None]
  return statistics.median(xs) if xs else None


def _fmt(x, unit=" s", digits=2):
  return "n/a" if x is None else f"{x:.{digits}f}{unit}"


def report(size, spec, runs, args, remat) -> float | None:
  c = spec["new_tokens"]
  print(f"\n== {size}: Qwen2.5 shape {spec['layers']} x {spec['hidden']} (heads {spec['heads']}"
        f"/{spec['kv_heads']}, MLP {spec['mlp']}, tied), {spec['num_params'] / 1e6:.1f}M params,"
        f" vocabulary {spec['vocab']:,} ({spec['valid_vocab']:,} tokenizer ids); "
        f"{trl_step.NUM_PROMPTS} prompts x G={trl_step.G}, {c} new tokens (no stop ids), bucket "
        f"{BUCKET if not args.smoke else spec['bucket']}; bf16 compute, fp32 master params, "
        f"remat {'on' if remat else 'off'}, grpo_jax micro-batches {args.grad_accum}")
  gj = runs.get("grpo_jax") or {}
  if gj.get("model_options"):  # as the grpo_jax process ran them
    o = gj["model_options"]
    print(f"  grpo_jax model: attention {o['attention'] or 'default (XLA)'}, decode layers "
          f"{'unrolled' if o['unroll_decode'] else 'scanned'}, decode attention "
          f"{o.get('decode_attention', 'xla')}, head chunk "
          f"{o.get('vocab_chunk')} columns, log-prob blocks "
          f"{o.get('logprob_block_bytes', 0) / 2**20:g} MiB")
  print(f"  {'side':10s}{'first':>9s}{'median':>9s}{'sample':>9s}{'reward':>9s}"
        f"{'reference':>11s}{'update':>9s}{'peak mem':>10s}  device")
  steps, widths, refs = {}, {}, {}
  for side, r in runs.items():
    skip = args.warmup if side == "grpo_jax" else (0 if args.smoke else 1)
    first = r["steps"][0]["step_s"] if r.get("steps") else None
    steps[side] = _phase(r, "step_s", skip)
    widths[side], refs[side] = _phase(r, "prompt_width", skip), _phase(r, "reference_calls", skip)
    cells = [_fmt(first), _fmt(steps[side])] + [
        _fmt(_phase(r, k, skip)) for k in ("sample_s", "reward_s", "reference_s", "update_s")]
    print(f"  {side:10s}{cells[0]:>9s}{cells[1]:>9s}{cells[2]:>9s}{cells[3]:>9s}{cells[4]:>11s}"
          f"{cells[5]:>9s}{_fmt(r.get('peak_memory_gb'), ' GB', 1):>10s}  "
          f"{r.get('device', '')}{'  FAILED: ' + r['error'] if r.get('error') else ''}")
  shown = ", ".join(f"{side} {w:.0f}" for side, w in widths.items() if w is not None)
  if shown:  # TRL's work grows with its prompt width: it differs from grpo_jax's bucket
    print(f"  padded prompt width (median): {shown} (grpo_jax: the bucket; TRL: each batch's "
          f"longest prompt)")
  for side, n in refs.items():
    if n is not None:  # 1: the reference alone; 2: old log-probs too (not grpo_jax's work)
      print(f"  {side} forwards timed as the reference per step: {n:.0f}")
  if not gj.get("steps"):
    return None
  rows, skip = trl_step.NUM_PROMPTS * trl_step.G, args.warmup
  sample = _phase(gj, "sample_s", skip)
  length = _phase(gj, "mean_length", skip) or c
  if sample:
    print(f"  grpo_jax generated tokens/s over the sample phase: {rows * length / sample:,.0f}")
  if "decode_s" in gj:
    n = gj["decode_steps"]
    ms = 1e3 * gj["decode_s"] / n
    print(f"  sampler alone: prefill {1e3 * gj['prefill_s']:.1f} ms; decode {n} steps in "
          f"{gj['decode_s']:.3f} s = {ms:.3f} ms/step, {gj['rows'] * n / gj['decode_s']:,.0f} "
          f"tokens/s ({gj['rows']} rows)")
    b = decode_bytes(spec, gj["rows"], gj["prompt_slots"], n)
    total = b["weights"] + b["kv_cache"] + b["logits"]
    print(f"  bytes per decode step (analytic): weights {b['weights'] / GB:.3f} GB (bf16, "
          f"{b['params'] / 1e6:.0f}M params) + KV cache {b['kv_cache'] / GB:.3f} GB (the live "
          f"slots: {gj['prompt_slots']} prompt + those generated so far, {b['live_slots']:g} "
          f"of the {gj['slots']} on average over {n} steps, x {gj['rows']} rows, bf16) + "
          f"logits {b['logits'] / GB:.3f} GB = {total / GB:.3f} GB; with the fp32 master "
          f"weights read each step: {(total + b['weights']) / GB:.3f} GB")
    tbps = datasheet(gj.get("device", ""))[0]
    for name, bw in (("datasheet", tbps), ("measured copy", gj.get("copy_tbps"))):
      if bw:
        floor = 1e3 * total / (bw * 1e12)
        print(f"  HBM roofline ({name} {bw:.2f} TB/s): {floor:.3f} ms/step; grpo_jax "
              f"{ms:.3f} ms/step = {100 * floor / ms:.0f}% of it")
      elif name == "datasheet":
        print(f"  HBM roofline ({name}): n/a ({gj.get('device', 'the device')} is not in the "
              f"datasheet table)")
  if "decode_kernels" in gj:
    print(f"  kernels per decode step (optimized HLO of the decode loop): "
          f"{gj['decode_kernels']} {gj['decode_kernel_ops']}")
  elif "decode_kernels_error" in gj:
    print(f"  kernels per decode step: n/a ({gj['decode_kernels_error']})")
  if "sampler_error" in gj:
    print(f"  sampler alone: n/a ({gj['sampler_error']})")
  for name in ("sampling", "train"):
    if f"profile_{name}" in gj:
      print_profile(name, gj[f"profile_{name}"])
  if "fused_attention_error" in gj:
    kernel, xla = gj["fused_attention_error"]
    bad = kernel > max(2 * xla, 2 ** -8)
    print(f"  fused decode attention against float32: max |diff| {kernel:.2e} (jax.numpy in "
          f"bf16: {xla:.2e}){'  FAILED' if bad else ''}")
  f = trl_step.step_flops(spec, _phase(gj, "decode_steps", skip) or c)
  ref, upd = _phase(gj, "reference_s", skip), _phase(gj, "update_s", skip)
  for name, peak in (("the measured bf16 matmul peak", gj.get("bf16_peak_tflops")),
                     ("the datasheet dense bf16 peak", datasheet(gj.get("device", ""))[1])):
    if not peak:
      if "datasheet" in name:
        print(f"  train MFU at {name}: n/a ({gj.get('device', 'the device')} is not in the "
              f"datasheet table)")
      continue
    mfu = lambda flops, s, peak=peak: "n/a" if not s else f"{100 * flops / (s * peak * 1e12):.0f}%"
    print(f"  train MFU at {name} {peak:.3g} TFLOP/s: reference forward"
          f" {f['reference'] / 1e12:.2f} TFLOP in {_fmt(ref)} = {mfu(f['reference'], ref)}; "
          f"update (policy forward + backward) {f['policy'] / 1e12:.2f} TFLOP in {_fmt(upd)} = "
          f"{mfu(f['policy'], upd)}; whole step {f['total'] / 1e12:.2f} TFLOP = "
          f"{mfu(f['total'], steps.get('grpo_jax'))}")
  ratio = None
  for side in ("trl", "trl_vllm"):
    if steps.get(side) and steps.get("grpo_jax"):
      r = steps[side] / steps["grpo_jax"]
      print(f"  ratio {side} median step / grpo_jax median step: {r:.2f}x")
      ratio = r if side == "trl" else ratio
  return ratio


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="0.5b,1.5b", help="comma-separated, of 0.5b, 1.5b")
  p.add_argument("--steps", type=int, default=2, help="grpo_jax measured steps")
  p.add_argument("--warmup", type=int, default=1, help="grpo_jax steps dropped first")
  p.add_argument("--attention", default=None, choices=["xla", "cudnn"],
                 help="config.model.attention (default: JAX's choice, XLA)")
  p.add_argument("--unroll_decode", action="store_true",
                 help="config.model.unroll_decode: the decode step's layers written out")
  p.add_argument("--decode_attention", default="xla", choices=["xla", "pallas"],
                 help="config.model.decode_attention: 'pallas' is one fused kernel per layer "
                      "reading the KV cache in place")
  p.add_argument("--logprob_block_mib", type=int, default=0,
                 help="optim.logprob_block_bytes in MiB (0: the platform's, 64 on a GPU)")
  p.add_argument("--remat", default="1.5b", help="sizes run with remat on both sides")
  p.add_argument("--grad_accum", type=int, default=1,
                 help="grpo_jax's micro-batches per update (optim.grad_accum_steps)")
  p.add_argument("--sides", default="grpo_jax,trl,trl_vllm",
                 help="trl_vllm runs only where `import vllm` works")
  p.add_argument("--budget_s", type=float, default=450.0,
                 help="skip workers that would start later than this after the start")
  p.add_argument("--no_kernels", action="store_true", help="skip the decode HLO kernel count")
  p.add_argument("--profile", action="store_true",
                 help="grpo_jax: where the device time of one sampling call and one train "
                      "program call goes (jax.profiler), printed by program and instruction")
  p.add_argument("--tokenizer", default=str(trl_step.QWEN_TOKENIZER))
  p.add_argument("--gsm8k", default=str(trl_step.GSM8K), help="a directory with train.jsonl")
  p.add_argument("--smoke", action="store_true", help="CPU, toy shape (see the docstring)")
  p.add_argument("--dir", default=None, help="work directory (default: a temporary one); a "
                 "size whose inputs it already holds is not prepared again")
  p.add_argument("--worker", nargs=2, metavar=("SIDE", "SIZE"), help=argparse.SUPPRESS)
  p.add_argument("--remat_on", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.worker:
    return worker(args)
  t_start = time.perf_counter()
  configure(args.smoke, args.tokenizer, args.gsm8k)
  sizes = ["smoke"] if args.smoke else [s.strip() for s in args.sizes.split(",") if s.strip()]
  bad = [s for s in sizes if s not in ("0.5b", "1.5b", "smoke")]
  if bad:
    sys.exit(f"gpu_step.py: unknown --sizes {bad}; known: 0.5b, 1.5b")
  if args.smoke:
    args.warmup, args.steps = 0, 1
  sides = [s for s in args.sides.split(",") if s]
  have = {"trl": importlib.util.find_spec("trl") is not None,
          "vllm": importlib.util.find_spec("vllm") is not None}
  skipped = []
  if not have["trl"]:
    skipped.append("trl, trl_vllm (trl does not import)")
    sides = [s for s in sides if not s.startswith("trl")]
  elif "trl_vllm" in sides and not have["vllm"]:
    skipped.append("trl_vllm (vllm does not import)")
    sides.remove("trl_vllm")
  print(f"gpu_step: sizes {sizes}, sides {sides}"
        f"{'; skipped: ' + ', '.join(skipped) if skipped else ''}; grpo_jax {args.warmup} "
        f"warm-up + {args.steps} measured steps; budget {args.budget_s:.0f} s; python "
        f"{sys.executable}", flush=True)
  budget_end = t_start + args.budget_s
  finals = []
  with tempfile.TemporaryDirectory(prefix="gpu_step_") as tmp:
    args.dir = args.dir or tmp
    for size in sizes:
      remat = size in args.remat.split(",")
      spec_file = Path(args.dir) / size / "spec.json"
      # A --dir that already holds this size's inputs (an earlier run's) is used as it is.
      prep = {} if spec_file.exists() else spawn("prepare", size, args, remat, budget_end)
      if prep.get("error"):
        finals.append((size, None))
        continue
      spec = json.loads(spec_file.read_text())
      runs = {side: spawn(side, size, args, remat, budget_end) for side in sides}
      if not args.smoke:
        spec["bucket"] = BUCKET
      finals.append((size, report(size, spec, runs, args, remat)))
  print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
  for size, ratio in finals:
    print(f"gpu_step_speedup_vs_trl[{size}]={'nan' if ratio is None else f'{ratio:.2f}'}")


if __name__ == "__main__":
  main()
