"""Does a preset fit its hardware? Peak device memory of its train step and sampler, from the
compiler, without weights.

    python3 benchmarks/memory.py --config=configs/gsm8k.py            # default: v5e-8
    python3 benchmarks/memory.py --config=configs/gsm8k.py:0.5b       # one 16 GB device
    python3 benchmarks/memory.py --config=configs/gsm8k.py:0.5b --config.optim.grad_accum_steps=8

Builds what `grpo_jax.trainer.Trainer` builds for the preset (the same TrainStep and Sampler, its
optimizer, dtypes, remat, loss and mesh) and AOT-compiles them on abstract inputs
(`jax.ShapeDtypeStruct` with the run's shardings: nothing is allocated) over the preset's
`hardware.devices` fake CPU devices:

  train step  TrainStep.program for the rollout layout at its largest shapes:
              B = train.prompts_per_step × G rows, prompts at the largest of data.prompt_buckets
              (--prompt_len to pick another), completions at sampling.max_new_tokens; the
              reference params too when loss.beta > 0, in the dtype the run stores them in
              (train_step.reference_dtype).
  sampler     Sampler prefill + decode for B = train.prompts_per_step prompts × G at the same
              prompt length, with max_new_tokens of room; and the greedy eval at
              train.eval_batch_size × 1.

Per device and per program, from `compiled.memory_analysis()`:

    peak = arguments + outputs − aliased (outputs written into donated arguments) + temporaries

(temporaries: the size of XLA's temp allocation, its buffers packed by liveness). The train step
takes everything the device holds (state, reference params, batch) as arguments. The sampler
does not: the optimizer moments and the reference params stay resident while it runs, so they
are added to its peak; its reported peak is the larger of prefill's and decode's, plus that.

The last lines are `train_step_peak_gb_per_device=`, `sampler_peak_gb_per_device=`,
`hardware_gb_per_device=` (config.hardware.memory_gb_per_device) and `preset_fits=yes|no`
(both peaks ≤ it). GB = 1e9 bytes.

With --gpu_like the compile skips XLA:CPU's while-loop invariant code motion: the CPU runs
bf16 matmuls in fp32, converting their operands, and that pass hoists the converts of the
activations the backward scan reads out of the loop, as fp32 copies of whole [L, ...] stacks
(24 GB of the Qwen2.5-1.5B step at 128 rows × 448 tokens, grad_accum_steps 4). A GPU multiplies
bf16 natively and has none of these converts, so --gpu_like is the closer estimate of a GPU's
peak (docs/performance.md).

Estimates, not a TPU measurement: the CPU compiler's buffer assignment stands in for the
accelerator's. It runs most bf16 matmuls here in fp32, converting their operands (some hoisted
out of loops: whole fp32 copies of bf16 weights and of the LM head), so with bf16 compute its
figures run high (4.8 GB of fp32 converts were live at the peak of the 0.5b step with
beta = 0.001, 48 micro-batches). A TPU pads an array's two minor dimensions to its (8|16, 128)
tiles, which the CPU does not: Qwen2.5-0.5B's head_dim is 64, so on a TPU its KV cache may take
up to twice the figure here (a GPU does not pad).

The programs take the defaults of the platform the preset is sized for (--platform; cpu for a
preset whose hardware is a CPU, else gpu, whose sampler is the larger): on a GPU the sampler's
head is one chunk of the whole vocabulary (8192 columns on a CPU or TPU), and on a GPU or TPU
the log-prob pass uses 64 MiB blocks (4 MiB on a CPU); grpo_jax.sampler, grpo_jax.logprobs.

LoRA presets (model.lora.rank > 0) are compiled without XLA's while-loop-invariant-code-motion
pass. Their frozen base is stored in bf16 and computed in bf16: an accelerator multiplies by it
as it is stored. XLA:CPU instead converts each bf16 matmul operand to fp32, and that pass then
hoists the converts of the stacked layer weights out of the layer loop: whole fp32 copies of
the base's layers (5.2 GB for Qwen2.5-1.5B) for the policy's forward and again for the
reference's, 19.45 against 5.75 GB for the 1.5b_lora step (its reference pass alone: 5.3 GB).
Without the pass the converts happen one layer at a time. So --gpu_like is on by default for
LoRA presets (--nogpu_like measures with the pass) and off for the others, whose published
figures were taken with it.
"""
from __future__ import annotations

import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags, logging  # noqa: E402
import shapes  # noqa: E402
from aot import GB, abstract, device_bytes, peak_bytes, rollout_batch  # noqa: E402,F401  (shared)
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "gsm8k.py"),
    "Config file with its preset: configs/gsm8k.py:0.5b")
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", 0, "prompt width P; 0 = the largest of config.data.prompt_buckets")
_PLATFORM = flags.DEFINE_enum(
    "platform", None, ["cpu", "gpu", "tpu"], "whose defaults the programs take (the sampler's "
    "head chunk, the log-prob block); default: cpu for a preset whose hardware is a CPU, else "
    "gpu (the larger sampler)")
_H100 = flags.DEFINE_bool(
    "h100", False, "compile for one H100 without a GPU (JAX's CUDA plugin, as "
    "benchmarks/h100.py says) instead of fake CPU devices: the GPU compiler's own "
    "buffers (every matmul a cuBLAS call); presets on one device")
_SKIP_SAMPLER = flags.DEFINE_bool("skip_sampler", False, "measure the train step only")
_SKIP_EVAL = flags.DEFINE_bool("skip_eval", False, "skip the eval sampler's shape")
_GPU_LIKE = flags.DEFINE_bool(
    "gpu_like", None, "compile without XLA:CPU's while-loop invariant code motion, which hoists "
    "fp32 copies of whole stacked bf16 activations and weights out of the layer loops (see the "
    "docstring); default: on for LoRA presets, off for the others")
# XLA:CPU runs bf16 matmuls in fp32: it converts their bf16 operands, and this pass then hoists
# the convert of each per-layer slice out of the backward scan as one convert of the whole
# [L, ...] stack of saved activations. A GPU multiplies bf16 natively: it has no such converts.
GPU_LIKE_XLA_FLAGS = " --xla_disable_hlo_passes=while-loop-invariant-code-motion"


# config.json of the checkpoints the presets name (benchmarks/shapes.py), so no hub access is
# needed. A local checkpoint directory is read instead.
KNOWN_MODELS, QWEN25_VALID_VOCAB = shapes.MODELS, shapes.VALID_VOCAB


def model_config(config):
  """(QwenConfig, valid vocabulary) of the preset's model, without weights or a tokenizer, with
  the preset's model options (attention kernel, unrolled decode)."""
  from grpo_jax import inputs  # pylint: disable=import-outside-toplevel
  cfg, valid = _model_config(config)
  return inputs.runtime_options(config, cfg), valid


def _model_config(config):
  from grpo_jax.models import qwen, weights  # pylint: disable=import-outside-toplevel
  m = config.model
  if m.random_init:
    t = m.tiny  # the tiny tokenizer is learnt to exactly tiny.vocab_size ids
    cfg = qwen.QwenConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
        tie_word_embeddings=t.tie_word_embeddings, max_position_embeddings=4096)
    return cfg, cfg.vocab_size
  if os.path.isdir(m.checkpoint):
    cfg = weights.read_config(m.checkpoint)
    return cfg, min(cfg.vocab_size, QWEN25_VALID_VOCAB)
  name = m.checkpoint.split("/")[-1].removesuffix("-Instruct")
  if name not in KNOWN_MODELS:
    raise SystemExit(f"memory.py: no config.json known for {m.checkpoint!r}; pass a local "
                     f"checkpoint directory (known: {sorted(KNOWN_MODELS)})")
  cfg = qwen.QwenConfig(**KNOWN_MODELS[name], rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                        qkv_bias=True)
  return cfg, QWEN25_VALID_VOCAB


def platform(config) -> str:
  """The platform whose defaults the compiled programs take (see --platform)."""
  if _H100.value:
    return "gpu"
  return _PLATFORM.value or ("cpu" if "CPU" in config.hardware.name else "gpu")


def measure_train_step(config, cfg, valid, mesh, prompt_len):
  """The train step's peak. With model.lora the state is the adapters and their moments, and
  the frozen base (bf16, or int8 kernels) an argument: the reference is that base."""
  import jax  # pylint: disable=import-outside-toplevel
  from grpo_jax import config as config_lib, logprobs, policy as policy_lib, train_step, trainer as trainer_lib  # pylint: disable=C0415
  optim = config_lib.optim_settings(config)
  optim.logprob_block_bytes = logprobs.platform_block_bytes(optim.logprob_block_bytes,
                                                            platform(config))
  s, g = config.sampling, config_lib.group_size(config)
  lcfg = trainer_lib.lora_settings(config)
  policy = policy_lib.of(lcfg)
  step = train_step.TrainStep(
      cfg, config.loss, optim, mesh, temperature=s.temperature, valid_vocab_size=valid,
      max_completion_length=s.max_new_tokens, group_size=g,
      reward_weights=config.rewards.weights, policy=policy)
  state = train_step.abstract_state(cfg, optim, mesh, policy)
  rows = config.train.prompts_per_step * g
  batch = rollout_batch(config, rows, prompt_len, s.max_new_tokens, mesh)
  with_ref = step.needs_ref(batch)
  ref = train_step.abstract_reference(cfg, optim, mesh, policy) if with_ref else None
  t0 = time.time()
  hp = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), step.hparams)
  compiled = step.program(batch, with_ref).lower(state, hp, ref, batch).compile()
  peak, line = peak_bytes(compiled)
  frozen = ("none" if ref is None else
            f"{'LoRA base' if lcfg else 'reference'} {jax.tree.leaves(ref)[0].dtype}"
            f"{', int8 kernels' if lcfg and lcfg.quantize == 'int8' else ''}")
  print(f"  train step, {rows} rows × ({prompt_len} + {s.max_new_tokens}) tokens, "
        f"grad_accum_steps={optim.grad_accum_steps}, frozen params {frozen} "
        f"(compiled in {time.time() - t0:.0f} s): {line}", flush=True)
  return peak, state, ref


def measure_sampler(config, cfg, valid, mesh, prompt_len, state, ref, eval_too=True):
  """max over (rollout, eval) shapes of max(prefill, decode) + what stays resident."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=C0415
  from grpo_jax import sampler as sampler_lib, sharding  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  from grpo_jax import config as config_lib, trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  optim, s = config_lib.optim_settings(config), config.sampling
  lcfg = trainer_lib.lora_settings(config)
  model = qwen.build(cfg, dtype=optim.compute_dtype, param_dtype=optim.param_dtype)
  smp = sampler_lib.Sampler(
      model, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
      max_new_tokens=s.max_new_tokens, stop_ids=(0,), buckets=(prompt_len,),
      valid_vocab_size=valid, pad_id=0, mesh=mesh,
      vocab_chunk=sampler_lib.default_vocab_chunk(platform(config), valid))
  # Resident while sampling, outside the sampler's arguments: all but the policy params.
  resident = device_bytes(state) - device_bytes(state["params"])
  if lcfg is None:
    resident += device_bytes(ref) if ref is not None else 0
    params = {"params": state["params"]}
  elif lcfg.merge_for_sampling:
    # The sampler takes the base with merged target kernels (new arrays); the base's own
    # target kernels and the adapters stay beside it.
    from grpo_jax.models import lora  # pylint: disable=import-outside-toplevel
    lowered = jax.jit(functools.partial(lora.merged_kernels, lcfg=lcfg)).lower(
        ref, state["params"])
    kernels = abstract(lowered.out_info, lowered.compile().output_shardings)
    params = {"params": lora.with_kernels(ref, kernels)}
    resident += (device_bytes(state["params"]) + device_bytes(ref) - device_bytes(params)
                 + device_bytes(kernels))
  else:  # the base and the adapters, side by side
    params = {"params": ref, "lora": state["params"]}
  what_stays = ("optimizer state and reference params" if lcfg is None else
                "adapters, their optimizer state and the base's target kernels"
                if lcfg.merge_for_sampling else "optimizer state")
  mult = int(jax.numpy.prod(jnp.array([mesh.shape[a] for a in sharding.BATCH_AXES])))
  row_sh = lambda nd: sharding.batch_sharding(mesh, nd)
  shapes = [("rollout", config.train.prompts_per_step, config_lib.group_size(config), {})]
  if eval_too:
    shapes.append(("eval", config.train.eval_batch_size, 1, {"greedy": True}))
  worst = 0
  for name, b, g, settings in shapes:
    b_pad = -(-b // mult) * mult
    tok = jax.ShapeDtypeStruct((b_pad, prompt_len), jnp.int32, sharding=row_sh(2))
    t0 = time.time()
    lowered = smp.lower_prefill(params, tok, tok, g, prompt_len + s.max_new_tokens)
    prefill = lowered.compile()
    p_peak, p_line = peak_bytes(prefill)
    # jit drops the arguments a program does not read: prefill never reads an untied LM head
    # (decode samples), which stays in memory all the same.
    unread = device_bytes(params) + 2 * device_bytes(tok) - prefill.memory_analysis(
        ).argument_size_in_bytes
    if unread > 0:
      p_peak += unread
      p_line += f" + unread arguments {unread / GB:.2f} = {p_peak / GB:.2f} GB"
    cache, st = lowered.out_info
    cache = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                         cache, prefill.output_shardings[0])
    st = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), st,
                      prefill.output_shardings[1])
    r = b_pad * g
    rep = NamedSharding(mesh, P())
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    row_ids = jax.ShapeDtypeStruct((r, 2), jnp.int32, sharding=row_sh(2))
    active = jax.ShapeDtypeStruct((r,), jnp.bool_, sharding=row_sh(1))
    decode = smp.lower_decode(params, cache, st, key, row_ids, active, s.max_new_tokens,
                              **settings).compile()
    d_peak, d_line = peak_bytes(decode)
    cache_gb = device_bytes(cache) / GB
    peak = max(p_peak, d_peak) + resident
    print(f"  sampler ({name}: {b} prompts × G={g} = {r} rows, {prompt_len} + "
          f"{s.max_new_tokens} slots, KV cache {cache_gb:.2f} GB/device; compiled in "
          f"{time.time() - t0:.0f} s)\n    prefill: {p_line}\n    decode:  {d_line}\n"
          f"    + resident {what_stays} "
          f"{resident / GB:.2f} GB"
          f" → {peak / GB:.2f} GB", flush=True)
    worst = max(worst, peak)
  return worst


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  config = _CONFIG.value
  lora_preset = config.model.get("lora") is not None and config.model.lora.rank > 0
  gpu_like = (lora_preset if _GPU_LIKE.value is None else _GPU_LIKE.value) and not _H100.value
  if _H100.value:
    import h100  # pylint: disable=import-outside-toplevel  (benchmarks/h100.py)
    h100.cublas_matmuls()
  if gpu_like:  # read when the CPU backend starts, below
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + GPU_LIKE_XLA_FLAGS
  import jax  # pylint: disable=import-outside-toplevel
  from grpo_jax import config as config_lib, sharding  # pylint: disable=C0415
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  if config.agent.enabled:
    raise SystemExit("memory.py: agent presets (multi-turn rollouts) are not measured here")
  hw = config.hardware
  if _H100.value:
    if hw.devices != 1:
      raise SystemExit(f"memory.py --h100: one device only, the preset has {hw.devices}")
    devices = h100.devices("memory.py")
  elif hw.devices > jax.device_count():
    raise SystemExit(f"memory.py: hardware.devices={hw.devices} > {jax.device_count()} fake "
                     "devices")
  else:
    devices = jax.devices()[:hw.devices]
  mesh = sharding.make_mesh(tuple(config.mesh), devices=devices)
  cfg, valid = model_config(config)
  prompt_len = _PROMPT_LEN.value or max(config.data.prompt_buckets)
  n_params = sum(x.size for x in jax.tree.leaves(qwen.abstract_params(cfg)))
  o = config.optim
  print(f"preset {config.preset!r}: {config.model.checkpoint or 'tiny random'} "
        f"({n_params / 1e9:.3f}B params, {o.param_dtype} params + AdamW, {o.compute_dtype} "
        f"compute, remat={o.remat}, beta={config.loss.beta}, μ={config.loss.num_iterations}) on "
        f"mesh {dict(mesh.shape)}; {config.train.prompts_per_step} prompts × "
        f"G={config_lib.group_size(config)}; hardware: {hw.name}, {hw.memory_gb_per_device} GB "
        f"× {hw.devices}; {platform(config)} defaults", flush=True)
  if gpu_like:
    print("  (--gpu_like: compiled without XLA:CPU's while-loop invariant code motion, so its "
          "fp32 converts of bf16 operands are made layer by layer, not hoisted as whole copies; "
          "--nogpu_like keeps the pass)", flush=True)
  train_peak, state, ref = measure_train_step(config, cfg, valid, mesh, prompt_len)
  print(f"train_step_peak_gb_per_device={train_peak / GB:.2f}")
  peaks = [train_peak]
  if not _SKIP_SAMPLER.value:
    sampler_peak = measure_sampler(config, cfg, valid, mesh, prompt_len, state, ref,
                                   eval_too=not _SKIP_EVAL.value)
    print(f"sampler_peak_gb_per_device={sampler_peak / GB:.2f}")
    peaks.append(sampler_peak)
  print(f"hardware_gb_per_device={hw.memory_gb_per_device}")
  fits = max(peaks) <= hw.memory_gb_per_device * GB
  print(f"preset_fits={'yes' if fits else 'no'}")


if __name__ == "__main__":
  app.run(main)
