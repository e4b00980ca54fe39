"""Ahead-of-time compile helpers shared by the benchmarks (no flags, no device): the train
step's rollout batch as sharded abstracts, and a compiled program's peak memory per device.
Used by benchmarks/memory.py, lora_members_memory.py and gpu_kernels.py."""
from __future__ import annotations

GB = 1e9


def peak_bytes(compiled) -> tuple[int, str]:
  """arguments + outputs − aliased + temporaries, per device, and a one-line breakdown."""
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)
  line = (f"arguments {m.argument_size_in_bytes / GB:.2f} + outputs "
          f"{m.output_size_in_bytes / GB:.2f} − aliased {m.alias_size_in_bytes / GB:.2f} + "
          f"temporaries {m.temp_size_in_bytes / GB:.2f} = {peak / GB:.2f} GB")
  return peak, line


def device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def abstract(tree, shardings):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def rollout_batch(config, rows, prompt_len, completion_len, mesh):
  """The train step's rollout layout (rollout.Rollouts.device_batch) as sharded abstracts."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from grpo_jax import train_step  # pylint: disable=import-outside-toplevel
  from grpo_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  prompts = rows // config_lib.group_size(config)  # each prompt once, for its group
  shapes = {"prompt_NP": ((prompts, prompt_len), jnp.int32),
            "prompt_mask_NP": ((prompts, prompt_len), jnp.int32),
            "completion_BC": ((rows, completion_len), jnp.int32),
            "lengths_B": ((rows,), jnp.int32),
            "rewards_BR": ((rows, len(config.rewards.names)), jnp.float32)}
  if config.loss.mask_truncated_completions:
    shapes["truncated_B"] = ((rows,), jnp.bool_)
  out = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
  return abstract(out, train_step.batch_shardings(out, mesh))
