"""benchmarks/gpu_step.py: its HLO kernel counter on a module counted by hand and on decode
programs of 2-4 layers, its analytic parameter count against transformers', its report (each
side's padded prompt width among its figures), and `--smoke` (the whole script on CPU at a toy
shape) end to end."""
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from grpo_jax import sampler as sampler_lib
from grpo_jax.models import qwen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_step  # noqa: E402

# A decode-shaped module: the entry's while loop (trip count unknown) runs 2 kernels in its body
# (a fusion, a custom call) and 1 in its condition, plus a layer loop of known trip count 3
# whose body runs 2 (a fusion, a copy) and whose condition runs 1 (a compare). Per iteration:
# 2 + 1 + 3 * (2 + 1) = 12. Constants, tuples, parameters and bitcasts launch nothing.
HLO = """HloModule decode

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(f32[4]{0} %p)
}

%layer_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %t), index=0
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %t), index=1
  %f = f32[4]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%fused_a
  %c = f32[4]{0} copy(f32[4]{0} %f)
  ROOT %r = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %c)
}

%layer_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

%step_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %t), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
  %g = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="__cublas$gemm"
  %b = f32[4]{0} bitcast(f32[4]{0} %g)
  %f = f32[4]{0} fusion(f32[4]{0} %b), kind=kLoop, calls=%fused_a
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %w), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %f)
}

%step_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %t), index=1
  %z = f32[] constant(0)
  ROOT %any = pred[] fusion(f32[4]{0} %x, f32[] %z), kind=kLoop, calls=%fused_a
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %s = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(s32[] %s, f32[4]{0} %a)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %t), condition=%step_cond, body=%step_body
  ROOT %out = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
}
"""


def test_kernel_count_of_a_module_counted_by_hand():
  k = gpu_step.count_loop_kernels(HLO)
  assert dict(k) == {"fusion": 2 + 3, "custom-call": 1, "copy": 3, "compare": 3}
  assert sum(k.values()) == 12


# A conditional as a train step's skip-if-not-finite makes it: the update branch launches 3
# kernels (two fusions, a cuBLAS call), the identity branch copies the state (2 copies). One
# run takes one branch: the count is the update's, with the entry's fusion, 1 + 3.
COND_HLO = """HloModule step

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(f32[4]{0} %p)
}

%update (t: (f32[4], f32[4])) -> (f32[4], f32[4]) {
  %t = (f32[4]{0}, f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=0
  %y = f32[4]{0} get-tuple-element(%t), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %g = f32[4]{0} custom-call(%f, %y), custom_call_target="__cublas$gemm"
  %h = f32[4]{0} fusion(%g), kind=kLoop, calls=%fused_a
  ROOT %r = (f32[4]{0}, f32[4]{0}) tuple(%h, %g)
}

%skip (t: (f32[4], f32[4])) -> (f32[4], f32[4]) {
  %t = (f32[4]{0}, f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=0
  %y = f32[4]{0} get-tuple-element(%t), index=1
  %cx = f32[4]{0} copy(%x)
  %cy = f32[4]{0} copy(%y)
  ROOT %r = (f32[4]{0}, f32[4]{0}) tuple(%cx, %cy)
}

ENTRY %main (a: f32[4], ok: pred[]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %ok = pred[] parameter(1)
  %b = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_a
  %t = (f32[4]{0}, f32[4]{0}) tuple(%b, %a)
  ROOT %c = (f32[4]{0}, f32[4]{0}) conditional(%ok, %t, %t), true_computation=%update, false_computation=%skip
}
"""


def test_a_conditional_counts_the_branch_with_the_most_kernels():
  comps, entry = gpu_step.parse_hlo(COND_HLO)
  assert dict(gpu_step.computation_kernels(comps, entry)) == {"fusion": 1 + 2, "custom-call": 1}
  # The same with the branches listed (an index-switched conditional), the copies first.
  listed = COND_HLO.replace("true_computation=%update, false_computation=%skip",
                            "branch_computations={%skip, %update}")
  comps, entry = gpu_step.parse_hlo(listed)
  assert dict(gpu_step.computation_kernels(comps, entry)) == {"fusion": 1 + 2, "custom-call": 1}


def test_an_async_fusion_is_one_kernel():
  """XLA:GPU may run a fusion asynchronously as a fusion-start / fusion-done pair: one launch
  (the start); the done only waits."""
  line = "  %f = f32[4]{0} fusion(f32[4]{0} %b), kind=kLoop, calls=%fused_a\n"
  assert HLO.count(line) == 1
  pair = ("  %fs = ((f32[4]{0}), f32[4]{0}) fusion-start(f32[4]{0} %b), kind=kLoop, "
          "calls=%fused_a\n  %f = f32[4]{0} fusion-done(((f32[4]{0}), f32[4]{0}) %fs)\n")
  k = gpu_step.count_loop_kernels(HLO.replace(line, pair))
  assert dict(k) == {"fusion": 1 + 3, "fusion-start": 1, "custom-call": 1, "copy": 3,
                     "compare": 3}
  assert sum(k.values()) == 12


def _decode_hlo(layers, unroll=False):
  cfg = qwen.QwenConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=layers,
                        num_heads=4, num_kv_heads=2, head_dim=8,
                        run=qwen.RunOptions(unroll_decode=unroll))
  smp = sampler_lib.Sampler(qwen.Qwen(cfg, dtype=jnp.bfloat16), max_new_tokens=4, buckets=(8,),
                            pad_id=0, stop_ids=(1,))
  params = jax.eval_shape(lambda: qwen.init_params(cfg, jax.random.key(0)))
  tok = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  cache, state = jax.eval_shape(smp._prefill, {"params": params}, tok, tok, 2, 12)
  text = smp._decode.lower({"params": params}, cache, state, jax.eval_shape(lambda: jax.random.key(0)),
                           jax.ShapeDtypeStruct((4, 2), jnp.int32),
                           jax.ShapeDtypeStruct((4,), jnp.bool_), smp.sampling_params({}),
                           4).compile().as_text()
  return text


def _decode_kernels(layers, unroll=False):
  return sum(gpu_step.count_loop_kernels(_decode_hlo(layers, unroll)).values())


def test_decode_kernels_grow_by_the_same_count_per_layer():
  """The layer scan's body is counted once per layer: 2, 3, 4 layers give an arithmetic
  progression whose step is the per-layer count (one compiled body, whatever L is). One layer
  is left out: XLA inlines a scan of trip count 1."""
  two, three, four = (_decode_kernels(n) for n in (2, 3, 4))
  assert three - two == four - three > 0, (two, three, four)


def test_unrolled_decode_has_no_layer_loop():
  """cfg.run.unroll_decode: the one while loop that carries the KV cache (bf16[L=3, rows 4, kv
  heads 2, slots 12, 8]) is the token loop; the scan adds a second, over layers. (The other
  loops are the random bits' threefry rounds.) Its kernels still grow by the same count per
  layer."""
  whiles = lambda text: sum(" while(" in line and "bf16[3,4,2,12,8]" in line
                            for line in text.splitlines())
  assert whiles(_decode_hlo(3)) == 2 and whiles(_decode_hlo(3, unroll=True)) == 1
  two, three, four = (_decode_kernels(n, unroll=True) for n in (2, 3, 4))
  assert three - two == four - three > 0, (two, three, four)


def test_smoke_run(tmp_path):
  """The whole script on CPU, every figure the GPU run prints, and its parameter count equal
  to the transformers model's. The model options asked for on the command line reach the
  trainer's sampler (the worker reports them). TRL's side runs where trl imports (the script
  asks the interpreter it runs in, this one: requirements-bench.txt installs it, the test
  extra does not); then the report has TRL's figures too."""
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_step.py"), "--smoke", "--dir",
       str(tmp_path), "--attention", "xla", "--unroll_decode", "--decode_attention", "pallas",
       "--logprob_block_mib", "1", "--profile"],
      capture_output=True, text=True,
      cwd=ROOT, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  for line in ("grpo_jax generated tokens/s over the sample phase:", "ms/step",
               "bytes per decode step (analytic): weights", "HBM roofline (measured copy",
               "kernels per decode step (optimized HLO of the decode loop):",
               "train MFU at the measured bf16 matmul peak", "gpu_step_speedup_vs_trl[smoke]=",
               "train MFU at the datasheet dense bf16 peak: n/a (cpu: cpu is not in the",
               "HBM roofline (datasheet): n/a (cpu: cpu is not in the datasheet table)",
               "grpo_jax model: attention xla, decode layers unrolled, decode attention pallas",
               "log-prob blocks 1 MiB", "fused decode attention against float32: max |diff|",
               "profile of sampling (jax.profiler, one call)", "jit__decode_impl",
               "profile of train (jax.profiler, one call)"):
    assert line in out, (line, out[-3000:])
  assert "FAILED" not in out, out[-3000:]
  spec = json.loads((tmp_path / "smoke" / "spec.json").read_text())
  # The width each side ran: grpo_jax the bucket prepare chose for these prompts; TRL, in its
  # one batch of them all, the longest prompt.
  width = f"padded prompt width (median): grpo_jax {spec['bucket']}"
  if importlib.util.find_spec("trl") is None:
    assert "sides ['grpo_jax']; skipped: trl, trl_vllm (trl does not import)" in out, out[:3000]
    assert f"{width} (grpo_jax: the bucket" in out, out[-3000:]
    assert "trl forwards timed" not in out and "ratio trl" not in out, out[-3000:]
  else:
    assert "sides ['grpo_jax', 'trl']" in out, out[:3000]
    longest = max(map(len, spec["prompt_ids"]))
    assert longest < spec["bucket"]
    assert f"{width}, trl {longest} (grpo_jax: the bucket" in out, out[-3000:]
    for line in ("trl forwards timed as the reference per step: 1",
                 "ratio trl median step / grpo_jax median step: "):
      assert line in out, (line, out[-3000:])
  assert gpu_step.decode_bytes(spec, 4, 96, 4)["params"] == spec["num_params"]
  # The decode program's HLO is kept, and the printed count is the count of that text.
  counted = gpu_step.count_loop_kernels((tmp_path / "smoke" / "decode_hlo.txt").read_text())
  printed = re.search(r"kernels per decode step \(optimized HLO of the decode loop\): (\d+)", out)
  assert int(printed.group(1)) == sum(counted.values()) > 0


def test_trace_summary_counts_what_ran(tmp_path):
  """A jax.profiler trace summed by trace_summary: a loop of n iterations launches its body n
  times, so going from 5 to 10 iterations adds exactly 5 times what one iteration launches, and
  two calls launch twice what one does."""
  @jax.jit
  def f(x, n):
    return jax.lax.fori_loop(0, n, lambda i, x: jnp.tanh(x @ x) + 1.0, x)

  x = jnp.ones((64, 64))
  kernels = {}
  for n, calls in ((5, 1), (10, 1), (5, 2)):
    jax.block_until_ready(f(x, n))
    summary = gpu_step.profiled(lambda: [f(x, n) for _ in range(calls)],
                                tmp_path / f"{n}_{calls}", "cpu")
    kernels[n, calls] = summary["modules"]["jit_f"]["kernels"]
    assert summary["top_ops"] and summary["modules"]["jit_f"]["busy_ms"] > 0
    assert "while" not in {o["op"] for o in summary["top_ops"]}  # a loop's own event
  per_iteration = (kernels[10, 1] - kernels[5, 1]) / 5
  assert per_iteration == int(per_iteration) > 0, kernels
  assert kernels[5, 2] == 2 * kernels[5, 1], kernels
  assert gpu_step.trace_summary(tmp_path / "none", "cpu") == {
      "error": "the profiler wrote no trace"}


def test_decode_bytes_at_the_qwen25_shapes():
  """Parameter counts equal the published ones (Qwen2.5-0.5B: 494,032,768; 1.5B:
  1,543,714,304, tied heads); the logits by hand at 128 rows; the KV cache at 128 rows over the
  live slots of a 256-step loop after a 192-slot prompt bucket (step i attends to 192 + i + 1
  slots), summed step by step, not the 448-slot capacity."""
  for size, params, layers, kv_h in (("0.5b", 494_032_768, 24, 64),
                                     ("1.5b", 1_543_714_304, 28, 128)):
    spec = dict(gpu_step.SIZES[size], vocab=151_936, valid_vocab=151_665)
    b = gpu_step.decode_bytes(spec, rows=128, prompt_slots=192, steps=256)
    assert b["params"] == params and b["weights"] == 2 * params
    slot = 2 * layers * 128 * 2 * kv_h * 2  # k and v of one slot: 2 kv heads, bf16
    per_step = [slot * (192 + i + 1) for i in range(256)]
    assert b["kv_cache"] == pytest.approx(sum(per_step) / 256, rel=1e-12)
    assert b["kv_cache"] < slot * 448
    assert b["logits"] == 128 * 151_665 * 4
  b = gpu_step.decode_bytes(dict(gpu_step.SIZES["smoke"], vocab=100, valid_vocab=90), 1, 3, 2)
  assert b["live_slots"] == 4.5  # steps attending to 4 and 5 slots


def test_datasheet_lookup_matches_the_most_specific_card():
  """device_kind strings of cards against their datasheets: the variants (H100 NVL, PCIe,
  GH200's two memories, H200 NVL) are not taken for the plain card, and an unknown card (or a
  CPU) gets None, not a near match."""
  cases = {
      "gpu: NVIDIA H100 80GB HBM3": (3.35, 989), "NVIDIA H100 PCIe": (2.0, 756),
      "NVIDIA H100 NVL": (3.9, None), "NVIDIA H200": (4.8, 989), "NVIDIA H200 NVL": (4.8, None),
      "NVIDIA GH200 480GB": (4.0, None), "NVIDIA GH200 144G HBM3e": (4.9, None),
      "NVIDIA A100-SXM4-80GB": (2.039, 312), "NVIDIA A100-SXM4-40GB": (1.555, 312),
      "NVIDIA A100 80GB PCIe": (1.935, 312), "NVIDIA A100-PCIE-40GB": (1.555, 312),
      "NVIDIA L4": (0.3, None), "NVIDIA GH200": (None, None), "NVIDIA H800": (None, None),
      "NVIDIA H100": (None, None), "NVIDIA GeForce RTX 4090": (None, None),
      "cpu: cpu": (None, None), "TPU v5 lite": (None, None), "": (None, None)}
  for kind, want in cases.items():
    assert gpu_step.datasheet(kind) == want, kind


def test_report_figures_by_hand(capsys):
  """report() on the recorded H100 0.5B figures (2026-11-26): the roofline over the live slots
  and the MFU at both peaks, each against the formula by hand."""
  import trl_step  # pylint: disable=import-outside-toplevel
  gpu_step.configure(False, str(trl_step.QWEN_TOKENIZER), str(trl_step.GSM8K))
  spec = dict(gpu_step.SIZES["0.5b"], vocab=151_936, valid_vocab=151_665, bucket=192,
              new_tokens=256, num_params=494_032_768)
  step = {"step_s": 2.27, "sample_s": 1.27, "reward_s": 0.09, "reference_s": 0.19,
          "update_s": 0.72, "decode_steps": 256, "mean_length": 256.0}
  gj = {"steps": [step], "device": "gpu: NVIDIA H100 80GB HBM3", "bf16_peak_tflops": 632.0,
        "copy_tbps": 2.33, "prefill_s": 0.011, "decode_s": 1.246, "decode_steps": 256,
        "rows": 128, "slots": 448, "prompt_slots": 192}
  args = type("Args", (), {"warmup": 0, "smoke": False, "grad_accum": 1})()
  gpu_step.report("0.5b", spec, {"grpo_jax": gj}, args, False)
  out = capsys.readouterr().out
  ms = 1e3 * 1.246 / 256
  total = 2 * 494_032_768 + 2 * 24 * 128 * 2 * 64 * 2 * (192 + 257 / 2) + 128 * 151_665 * 4
  floor = 1e3 * total / 3.35e12
  assert f"HBM roofline (datasheet 3.35 TB/s): {floor:.3f} ms/step" in out, out
  assert f"= {100 * floor / ms:.0f}% of it" in out, out
  f = trl_step.step_flops(spec, 256)
  for peak in (632, 989):
    update = f"{100 * f['policy'] / (0.72 * peak * 1e12):.0f}%"
    whole = f"{100 * f['total'] / (2.27 * peak * 1e12):.0f}%"
    line = next(x for x in out.splitlines() if f"peak {peak:.3g} TFLOP/s" in x)
    assert f"in 0.72 s = {update}" in line and line.endswith(f"TFLOP = {whole}"), line
  assert "datasheet dense bf16 peak 989 TFLOP/s" in out, out


def test_report_prints_both_sides_prompt_width(capsys):
  """TRL pads each batch to its longest prompt, grpo_jax to the bucket: the report prints both,
  from TRL's measured step (its warm-up dropped), and how many forwards TRL's reference clock
  timed. TRL's widths are the longest of gpu_step's three 16-prompt batches, counted here from
  the real prompts and tokenizer."""
  import trl_step  # pylint: disable=import-outside-toplevel
  from configs import gsm8k  # pylint: disable=import-outside-toplevel
  from grpo_jax import data, tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  gpu_step.configure(False, str(trl_step.QWEN_TOKENIZER), str(trl_step.GSM8K))
  tok = tokenizer_lib.load_tokenizer(str(trl_step.QWEN_TOKENIZER))
  d = gsm8k.get_config().data
  rows = data.load_rows(str(trl_step.GSM8K), "train")[:32]
  ids = data.encode_prompts(tok, [data.build_prompt(tok, r["question"], d.system_prompt,
                                                    d.user_template) for r in rows])
  longest = [max(map(len, ids[:16])), max(map(len, ids[16:]))]
  spec = dict(gpu_step.SIZES["0.5b"], vocab=151_936, valid_vocab=151_665, bucket=192,
              new_tokens=256, num_params=494_032_768)
  gj = {"steps": [{"step_s": 2.27, "prompt_width": 192, "mean_length": 256.0}]}
  trl = {"steps": [{"step_s": 30.0, "prompt_width": w, "reference_calls": 1} for w in longest]}
  args = type("Args", (), {"warmup": 0, "smoke": False, "grad_accum": 1})()
  gpu_step.report("0.5b", spec, {"grpo_jax": gj, "trl": trl}, args, False)
  out = capsys.readouterr().out
  assert longest[1] < 192
  assert f"padded prompt width (median): grpo_jax 192, trl {longest[1]} (" in out, out
  assert "trl forwards timed as the reference per step: 1" in out, out


def test_gpu_kernels_runs_on_the_cpu_programs():
  """benchmarks/gpu_kernels.py end to end on the CPU (the GPU compile needs the CUDA
  plugin): a decode step's parts add up to its kernels; the train step compiles and counts."""
  import gpu_kernels  # pylint: disable=import-outside-toplevel
  for extra in ([], ["--unroll_decode"], ["--decode_attention", "pallas"]):
    c = gpu_kernels.main(["--platform", "cpu", "--smoke"] + extra)
    assert sum(c["parts"].values()) == sum(c["ops"].values()) == c["total"] > 0
  c = gpu_kernels.main(["--program", "train", "--platform", "cpu", "--smoke"])
  assert sum(c["ops"].values()) == c["total"] > 0


# A train-shaped module, written as XLA:GPU prints optimized HLO (operands by name only): a loop
# of known trip count 4 whose body writes one row of a stacked f32[4,8] in place (a fusion
# rooted at a dynamic-update-slice: 1 x 8 x 4 bytes written, not the 128-byte buffer), runs a
# cuBLAS call (a bf16[16,16] output and an int8 workspace, which is not data) and an MLP
# fusion (bf16[16,32]); after the loop, a copy of the stack (f32[4,8]) with no op_name.
TRAIN_HLO = """HloModule train

%fused_row (p0: f32[4,8], p1: f32[1,8], p2: s32[]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[1,8]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[4,8]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z), metadata={op_name="jit(f)/token_logprobs/while/body/dynamic_update_slice"}
}

%fused_mul (a: bf16[16,32]) -> bf16[16,32] {
  %a = bf16[16,32]{1,0} parameter(0)
  ROOT %m = bf16[16,32]{1,0} multiply(%a, %a)
}

%body (t: (s32[], f32[4,8], bf16[16,32])) -> (s32[], f32[4,8], bf16[16,32]) {
  %t = (s32[], f32[4,8]{1,0}, bf16[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %buf = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %x = bf16[16,32]{1,0} get-tuple-element(%t), index=2
  %row = f32[1,8]{1,0} constant({...})
  %u = f32[4,8]{1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%fused_row, metadata={op_name="jit(f)/token_logprobs/while/body/dynamic_update_slice"}
  %g = (bf16[16,16]{1,0}, s8[1024]{0}) custom-call(%x, %x), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/Qwen/layers/self_attn/dot_general"}
  %f = bf16[16,32]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(f)/Qwen/layers/mlp/mul"}
  ROOT %r = (s32[], f32[4,8]{1,0}, bf16[16,32]{1,0}) tuple(%i, %u, %f)
}

%cond (t: (s32[], f32[4,8], bf16[16,32])) -> pred[] {
  %t = (s32[], f32[4,8]{1,0}, bf16[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT, metadata={op_name="jit(f)/Qwen/while"}
}

ENTRY %main (a: f32[4,8], b: bf16[16,32]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[16,32]{1,0} parameter(1)
  %s = s32[] constant(0)
  %t = (s32[], f32[4,8]{1,0}, bf16[16,32]{1,0}) tuple(%s, %a, %b)
  %w = (s32[], f32[4,8]{1,0}, bf16[16,32]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %o = f32[4,8]{1,0} get-tuple-element(%w), index=1
  ROOT %c = f32[4,8]{1,0} copy(%o)
}
"""


def test_written_bytes_of_a_module_counted_by_hand():
  import gpu_kernels  # pylint: disable=import-outside-toplevel
  written = gpu_kernels.written_bytes(TRAIN_HLO)
  assert dict(written) == {
      "log-probs": 4 * 1 * 8 * 4,           # 4 rows of 8 fp32 written in place
      "attention": 4 * 16 * 16 * 2,         # the GEMM's output, not its workspace
      "MLP": 4 * 16 * 32 * 2,
      "layers, other": 4 * 1,               # the loop condition's compare (pred)
      "loss, optimizer, other": 4 * 8 * 4}  # the copy after the loop


def test_gpu_kernels_attributes_one_layer_per_layer_on_h100_programs():
  """On decode programs compiled for an H100 by gpu_kernels.py (the smoke shape with the
  layer scan, 2 and 3 layers, kept in tests/testdata): one more layer adds to the step exactly
  the kernels the script attributes to one layer."""
  import gzip  # pylint: disable=import-outside-toplevel
  import gpu_kernels  # pylint: disable=import-outside-toplevel
  parts = {}
  for layers in (2, 3):
    path = os.path.join(ROOT, "tests", "testdata", f"decode_h100_smoke_{layers}_layers.hlo.gz")
    with gzip.open(path, "rt") as f:
      parts[layers] = gpu_step.count_loop_kernels(f.read(), key=gpu_kernels.where)
  per_layer = sum(parts[3].values()) - sum(parts[2].values())
  assert per_layer > 0
  assert parts[2]["layers"] == 2 * per_layer and parts[3]["layers"] == 3 * per_layer
  assert parts[2] - collections.Counter(layers=parts[2]["layers"]) == (
      parts[3] - collections.Counter(layers=parts[3]["layers"]))
