"""Peak device memory of the GRPO train step for Qwen2.5-1.5B, from the compiler, no weights.

AOT-compiles the GRPO step (`jax.jit(...).lower(abstract state, reference params, rollout
batch).compile()`: advantages, the reference pass, μ = 2 updates) on a simulated mesh of fake
CPU devices and prints `memory_analysis()` per device: arguments (params, optimizer state,
reference params, batch) + outputs − donated aliases + temporaries.

    python3 benchmarks/memory.py                       # fsdp=8, batch 64 × (256 + 1024) tokens
    python3 benchmarks/memory.py --grad_accum_steps=4 --prompt_len=512

The last line is `train_step_peak_gb_per_device=<x>`. Target: under 16 GB, one TPU v5e chip.
The CPU compiler's buffer assignment stands in for the TPU's, so treat the numbers as
estimates.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from grpo_jax import grpo, sharding, train_step  # noqa: E402
from grpo_jax.models import qwen  # noqa: E402

GB = 1e9

# Qwen/Qwen2.5-1.5B(-Instruct) config.json.
QWEN25_1_5B = qwen.QwenConfig(
    vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
    num_kv_heads=2, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768)


def abstract_batch(batch, prompt_len, completion_len, mesh):
  """The rollout layout (train_step.py) as ShapeDtypeStructs with the batch sharding."""
  shapes = {"prompt_BP": ((batch, prompt_len), jnp.int32),
            "prompt_mask_BP": ((batch, prompt_len), jnp.int32),
            "completion_BC": ((batch, completion_len), jnp.int32),
            "lengths_B": ((batch,), jnp.int32), "rewards_BR": ((batch, 1), jnp.float32)}
  out = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
  sh = train_step.batch_shardings(out, mesh)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in out.items()}


def peak_bytes(model_cfg, loss_cfg, optim_cfg, mesh, args):
  state = train_step.abstract_state(model_cfg, optim_cfg, mesh)
  batch = abstract_batch(args.batch, args.prompt_len, args.completion_len, mesh)
  step = train_step.make_train_step(model_cfg, loss_cfg, optim_cfg, mesh,
                                    group_size=args.group, reward_weights=(1.0,),
                                    max_completion_length=args.completion_len)
  with_ref = grpo.needs_reference(loss_cfg)
  ref = state["params"] if with_ref else None
  t0 = time.time()
  compiled = step.jitted(batch, with_ref).lower(state, ref, batch).compile()
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)
  print(f"  compiled in {time.time() - t0:.0f}s: arguments {m.argument_size_in_bytes / GB:.2f} GB,"
        f" outputs {m.output_size_in_bytes / GB:.2f} GB, aliased {m.alias_size_in_bytes / GB:.2f}"
        f" GB, temporaries {m.temp_size_in_bytes / GB:.2f} GB → peak {peak / GB:.2f} GB/device",
        flush=True)
  return peak


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--prompt_len", type=int, default=256)
  p.add_argument("--completion_len", type=int, default=1024)
  p.add_argument("--grad_accum_steps", type=int, default=1)
  p.add_argument("--group", type=int, default=8, help="G: rows sharing a prompt")
  p.add_argument("--block_mb", type=float, default=4.0, help="optim.logprob_block_bytes in MiB")
  p.add_argument("--beta", type=float, default=0.04, help="> 0: the reference pass runs too")
  p.add_argument("--no_remat", action="store_true")
  args = p.parse_args(argv)

  mesh = sharding.make_mesh(tuple(int(x) for x in args.mesh.split(",")))
  loss_cfg = grpo.default_loss_config()
  loss_cfg.update(beta=args.beta, num_iterations=2)
  optim_cfg = train_step.default_optim_config()
  optim_cfg.update(grad_accum_steps=args.grad_accum_steps, remat=not args.no_remat,
                   param_dtype="float32", compute_dtype="bfloat16",
                   logprob_block_bytes=int(args.block_mb * 2**20))
  n_params = sum(x.size for x in jax.tree.leaves(qwen.abstract_params(QWEN25_1_5B)))
  print(f"Qwen2.5-1.5B ({n_params / 1e9:.3f}B params, fp32 params + AdamW, bf16 compute, "
        f"remat={optim_cfg.remat}) on mesh {dict(mesh.shape)}; batch {args.batch} × "
        f"({args.prompt_len} prompt + {args.completion_len} completion) tokens, "
        f"grad_accum_steps={args.grad_accum_steps}, beta={args.beta}", flush=True)

  peak = peak_bytes(QWEN25_1_5B, loss_cfg, optim_cfg, mesh, args)
  print(f"train_step_peak_gb_per_device={peak / GB:.2f}")


if __name__ == "__main__":
  main()
