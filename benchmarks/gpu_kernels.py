"""The kernels XLA launches for a decode step and for a train step on a GPU, counted without one.

    python3 benchmarks/gpu_kernels.py [--size 0.5b] [--unroll_decode] [--vocab_chunk N]
                                      [--decode_attention pallas]
                                      [--hlo FILE] [--layer]
    python3 benchmarks/gpu_kernels.py --program train [--logprob_block_mib N] [--attention cudnn]
    python3 benchmarks/gpu_kernels.py --platform cpu    # the CPU programs: no plugin needed

On a GPU, decode is bound by the number of kernels each step launches (docs/performance.md):
this counts them without the GPU.

Decode (the default). The sampler's decode program, at benchmarks/gpu_step.py's
workload (16 prompts x G = 8 = 128 rows, prompt bucket 192, 256 new tokens, Qwen2.5 shapes,
fp32 params, bf16 compute), is compiled ahead of time for an H100 described by XLA's GPU target
description (`jax.experimental.topologies`, no device and no driver needed), and the kernels of
one iteration of its token loop are counted in the optimized HLO (gpu_step.count_loop_kernels:
a fusion is one kernel, a loop inside the step counts its body times its trip count). They are
split by where they come from (the instructions' op_name): the decoder layers, the embedding
and final norm, and the rest (the head, the sampling, the loop's own state). A fusion counts
where its own op_name puts it, so one that XLA made across a boundary (with the layers written
out, the embedding's lookup and the first layer's norm) counts in one part.

This count agreed with the H100 itself: 1131 kernels per decode step at 0.5B with the layer
scan and the head in chunks of 8192, as the H100 run's printed count
(experiments/gpu_2026-11-26.md).

Train (--program train). The whole GRPO train step (TrainStep.program: the reference forward,
the policy's forward and backward, AdamW) at the same workload (128 rows x (192 + 256) tokens,
beta = 0.04, remat as gpu_step.py sets it per size, one micro-batch, fp32 params and bf16
compute), compiled for the H100:
its kernels (every loop counted with its trip count), its peak memory (arguments + outputs
- aliased + temporaries, from the compiler), and the bytes its kernels write, by part of the
model (`written_bytes`: each kernel's output shapes times its runs; a fusion updating a buffer
in place counts its update; what kernels read is not counted, so this is a floor on the
traffic, for comparing programs). `--attention cudnn` compiles the model with cuDNN's fused
attention (the prefill and the train step; decode steps keep theirs). Every matmul is compiled
as a cuBLAS call (--xla_gpu_enable_triton_gemm=false): without the device, XLA's Triton GEMM
tiler finds no tile for the backward's matmuls.

It needs JAX's CUDA plugin (benchmarks/h100.py says how to install it; then run this script
with that environment's python). It sets JAX_PLATFORMS=cpu and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
itself, so the plugin loads without a GPU. Prints `decode_kernels[<size>]=<kernels per step>` or
`train_kernels[<size>]=<kernels per step>` last.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step  # noqa: E402  (puts the repository on sys.path)
import h100  # noqa: E402
import shapes  # noqa: E402

h100.prepare_environment()


def where(op: str, text: str) -> str:
  """The part of the model an instruction of the decode step comes from (its op_name)."""
  name = re.search(r'op_name="([^"]*)"', text)
  name = name.group(1) if name else ""
  if "DecoderLayer" in name or "Qwen/while/" in name:  # written out, or the layer scan
    return "layers"
  if "embed" in name or "final_norm" in name or "/norm/" in name:
    return "embedding, final norm"
  return "head, sampling, loop state"


def mesh_for(platform: str):
  """A one-device mesh: this CPU, or a compile-only H100 (h100.py)."""
  import jax  # pylint: disable=import-outside-toplevel
  from grpo_jax import sharding  # pylint: disable=import-outside-toplevel
  devices = jax.devices("cpu")[:1] if platform == "cpu" else h100.devices("gpu_kernels.py")
  return sharding.make_mesh((1, 1, 1), devices=devices)


def workload(size: str, smoke: bool, unroll: bool = False, decode_attention: str = "xla",
             attention: str | None = None):
  """(QwenConfig, valid vocabulary, prompts, G, new tokens, prompt bucket) of gpu_step.py's
  workload at `size` (smoke: a toy vocabulary and batch)."""
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  m = gpu_step.SIZES[size]
  vocab, valid = (512, 500) if smoke else (shapes.MODELS["Qwen2.5-0.5B"]["vocab_size"],
                                            shapes.VALID_VOCAB)
  cfg = qwen.QwenConfig(vocab_size=vocab, hidden_size=m["hidden"], intermediate_size=m["mlp"],
                        num_layers=m["layers"], num_heads=m["heads"], num_kv_heads=m["kv_heads"],
                        head_dim=m["hidden"] // m["heads"], tie_word_embeddings=True,
                        run=qwen.RunOptions(unroll_decode=unroll, attention=attention,
                                            decode_attention=decode_attention))
  batch = (2, 2, 4, 8) if smoke else (gpu_step.NUM_PROMPTS, gpu_step.G, gpu_step.NEW_TOKENS,
                                      gpu_step.BUCKET)
  return (cfg, valid) + batch


def _replicated(tree, mesh):
  import jax  # pylint: disable=import-outside-toplevel
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def decode_hlo(size: str, mesh, unroll: bool, vocab_chunk: int | None, smoke: bool,
               decode_attention: str = "xla", attention: str | None = None) -> str:
  """The optimized HLO of the sampler's decode program at gpu_step.py's workload."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from grpo_jax import sampler as sampler_lib  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  cfg, valid, prompts, g, c, bucket = workload(size, smoke, unroll, decode_attention, attention)
  sampler = sampler_lib.Sampler(qwen.build(cfg, dtype="bfloat16", mesh=mesh), max_new_tokens=c,
                                mesh=mesh, valid_vocab_size=valid, vocab_chunk=vocab_chunk,
                                buckets=(bucket,))
  params = {"params": _replicated(qwen.abstract_params(cfg), mesh)}  # what the sampler runs
  tokens = _replicated(jax.ShapeDtypeStruct((prompts, bucket), jnp.int32), mesh)
  cache, state = _replicated(sampler.lower_prefill(params, tokens, tokens, g, bucket + c).out_info,
                             mesh)
  key = _replicated(jax.eval_shape(lambda: jax.random.key(0)), mesh)
  rows = prompts * g
  return sampler.lower_decode(params, cache, state, key,
                              _replicated(jax.ShapeDtypeStruct((rows, 2), jnp.int32), mesh),
                              _replicated(jax.ShapeDtypeStruct((rows,), jnp.bool_), mesh),
                              c).compile().as_text()


def train_program(size: str, mesh, block_mib: int | None, smoke: bool,
                  attention: str | None = None):
  """The compiled GRPO train step at gpu_step.py's workload (128 rows x (192 + 256) tokens)."""
  import aot  # pylint: disable=import-outside-toplevel  (benchmarks/aot.py)
  from configs import gsm8k  # pylint: disable=import-outside-toplevel
  from grpo_jax import config as config_lib, train_step  # pylint: disable=import-outside-toplevel
  cfg, valid, prompts, g, c, bucket = workload(size, smoke, attention=attention)
  config = gsm8k.get_config("default")
  config.optim.update(remat=gpu_step.SIZES[size]["remat"], grad_accum_steps=1,
                      compute_dtype="bfloat16", param_dtype="float32",
                      logprob_block_bytes=(block_mib or 0) << 20)
  config.loss.beta = 0.04
  config.train.prompts_per_step = prompts
  config.sampling.update(num_generations=g, max_new_tokens=c)
  optim = config_lib.optim_settings(config)
  step = train_step.TrainStep(cfg, config.loss, optim, mesh,
                              temperature=config.sampling.temperature, valid_vocab_size=valid,
                              max_completion_length=c, group_size=g,
                              reward_weights=config.rewards.weights)
  state = train_step.abstract_state(cfg, optim, mesh)
  batch = aot.rollout_batch(config, prompts * g, bucket, c, mesh)
  ref = train_step.abstract_reference(cfg, optim, mesh) if step.needs_ref(batch) else None
  hp = _replicated(step.hparams, mesh)
  compiled = step.program(batch, ref is not None).lower(state, hp, ref, batch).compile()
  return compiled, step.spec.optim.logprob_block_bytes, aot.peak_bytes(compiled)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--program", default="decode", choices=["decode", "train"])
  p.add_argument("--size", default="0.5b", choices=[s for s in gpu_step.SIZES if s != "smoke"])
  p.add_argument("--unroll_decode", action="store_true", help="model.unroll_decode")
  p.add_argument("--decode_attention", default="xla", choices=["xla", "pallas"],
                 help="model.decode_attention: 'pallas' is one fused kernel per layer")
  p.add_argument("--vocab_chunk", type=int, default=None,
                 help="the sampler's head chunk (default: the sampler's own for the platform)")
  p.add_argument("--platform", default="gpu", choices=["gpu", "cpu"],
                 help="gpu: an H100 without a device (needs the CUDA plugin); cpu: this CPU")
  p.add_argument("--logprob_block_mib", type=int, default=None,
                 help="train: optim.logprob_block_bytes in MiB (default: the platform's)")
  p.add_argument("--attention", default=None, choices=["xla", "cudnn"],
                 help="model.attention: the prefill's and the train step's kernel")
  p.add_argument("--hlo", help="write the optimized HLO here")
  p.add_argument("--layer", action="store_true", help="list the kernels of the decoder layers")
  p.add_argument("--smoke", action="store_true", help="a 2-layer toy shape (for the test)")
  a = p.parse_args(argv)
  if a.program == "train" and a.platform == "gpu":  # read when the backend starts (mesh_for)
    h100.cublas_matmuls()
  mesh = mesh_for(a.platform)
  size = "smoke" if a.smoke else a.size
  if a.program == "train":
    return _train(a, mesh, size)
  t = time.perf_counter()
  text = decode_hlo(size, mesh, a.unroll_decode, a.vocab_chunk, a.smoke, a.decode_attention,
                    a.attention)
  seconds = time.perf_counter() - t
  if a.hlo:
    Path(a.hlo).write_text(text)
  by_part = gpu_step.count_loop_kernels(text, key=where)
  by_op = gpu_step.count_loop_kernels(text)
  total = sum(by_part.values())
  device = mesh.devices.flat[0]
  print(f"decode step of {size} on {getattr(device, 'device_kind', device.platform)} "
        f"(unroll_decode={a.unroll_decode}, decode_attention={a.decode_attention}, "
        f"vocab_chunk={a.vocab_chunk or 'default'}); "
        f"compiled in {seconds:.1f} s")
  layers = gpu_step.SIZES[size]["layers"]
  for part, n in by_part.most_common():
    extra = f"  ({n / layers:.1f} per layer)" if part == "layers" else ""
    print(f"  {part:24s} {n:6d}{extra}")
  print(f"  {'by opcode':24s} {dict(by_op.most_common(8))}")
  if a.layer:
    print("  kernels of the decoder layers (count, opcode, output):")
    for (op, line), n in _layer_kernels(text).most_common():
      print(f"    {n:4d} {op:8s} {line}")
  print(f"decode_kernels[{size}]={total}")
  return {"total": total, "parts": dict(by_part), "ops": dict(by_op)}


def _train(a, mesh, size) -> dict:
  t = time.perf_counter()
  compiled, block_bytes, (_, memory_line) = train_program(size, mesh, a.logprob_block_mib,
                                                          a.smoke, a.attention)
  seconds = time.perf_counter() - t
  text = compiled.as_text()
  if a.hlo:
    Path(a.hlo).write_text(text)
  comps, entry = gpu_step.parse_hlo(text)
  by_op = gpu_step.computation_kernels(comps, entry)
  total = sum(by_op.values())
  device = mesh.devices.flat[0]
  print(f"train step of {size} on {getattr(device, 'device_kind', device.platform)} "
        f"(log-prob blocks of {block_bytes / 2**20:g} MiB, attention {a.attention or 'xla'}); "
        f"compiled in {seconds:.1f} s")
  print(f"  kernels {total}: {dict(by_op.most_common(6))}")
  print(f"  memory: {memory_line}")
  written = written_bytes(text)
  print(f"  written by its kernels: {sum(written.values()) / 1e9:.1f} GB "
        f"({', '.join(f'{part} {n / 1e9:.1f}' for part, n in written.most_common())})")
  print(f"train_kernels[{size}]={total}")
  return {"total": total, "ops": dict(by_op), "written": dict(written)}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def _array_bytes(shape: str, skip=()) -> int:
  """Bytes of the arrays in an HLO shape ('f32[2,3]{1,0}' or a tuple of them)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in skip:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _DTYPE_BYTES.get(dtype, 4)
  return total


def _instructions(text) -> dict[str, dict[str, tuple[str, str, str]]]:
  """{computation: {instruction name: (opcode, output shape, its operands and attributes)}}."""
  out = collections.defaultdict(dict)
  for comp, _, name, op, rest in gpu_step.hlo_instructions(text):
    if name is not None:
      shape, _, operands = rest.partition(f" {op}(")
      out[comp][name] = (op, shape, operands)
  return out


def part_of(text: str) -> str:
  """The part of the train step an instruction comes from (its op_name's scopes)."""
  name = re.search(r'op_name="([^"]*)"', text)
  name = name.group(1) if name else ""
  for scope, part in (("token_logprobs", "log-probs"), ("self_attn", "attention"),
                      ("mlp", "MLP")):
    if scope in name:
      return part
  return "layers, other" if "Qwen" in name else "loss, optimizer, other"


def written_bytes(text: str) -> collections.Counter:
  """{part: bytes} the kernels of a program write, by their output shapes, every loop's body
  counted its trip count times (gpu_step.computation_kernels). A fusion that updates a buffer
  in place (a dynamic-update-slice: the scans stacking each layer's activations, the log-prob
  blocks' accumulators) counts the update it writes, not the buffer; a cuBLAS call's int8
  workspace is left out. A lower bound on the memory traffic: what the kernels read is not
  counted."""
  named = _instructions(text)

  def key(op, line):
    shape = line.partition(f" {op}(")[0]
    written = _array_bytes(shape, skip=("s8", "u8") if op == "custom-call" else ())
    callee = re.search(r"calls=%?([^\s,]+)", line)
    if op == "fusion" and callee and callee.group(1) in named:
      body = named[callee.group(1)]
      for dus_op, dus_shape, operands in body.values():
        update = re.match(r"%?([^,\s)]+), %?([^,\s)]+)", operands)
        if dus_op == "dynamic-update-slice" and update and update.group(2) in body:
          written += (_array_bytes(body[update.group(2)][1]) - _array_bytes(dus_shape))
    return (part_of(line), written)

  comps, entry = gpu_step.parse_hlo(text)
  out = collections.Counter()
  for (part, written), n in gpu_step.computation_kernels(comps, entry, {}, key).items():
    out[part] += written * n
  return out


def _layer_kernels(text) -> collections.Counter:
  """{(opcode, fused computation name and output shape): count} of the layers' kernels."""
  def key(op, line):
    if where(op, line) != "layers":
      return None
    called = re.search(r"calls=%?([^\s,]+)", line)
    name = re.sub(r"[._]\d+(?=(_computation)?$)", "", called.group(1)) if called else op
    shape = line.split(f" {op}(")[0].split(" ")[-1] if f" {op}(" in line else ""
    return (op, f"{name} {shape}")
  counts = gpu_step.count_loop_kernels(text, key=key)
  del counts[None]
  return counts


if __name__ == "__main__":
  main()
