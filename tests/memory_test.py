"""benchmarks/memory.py: its memory formula on a program whose buffers are known by hand, the
presets' declared hardware, and the CLI on the tiny preset (prints the keys the issue asks for)."""
import functools
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import gsm8k
from grpo_jax import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _memory_module():  # once per process: it defines absl flags (lora_members_memory shares it)
  if "memory_bench" not in sys.modules:
    spec = importlib.util.spec_from_file_location("memory_bench",
                                                  os.path.join(ROOT, "benchmarks", "memory.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["memory_bench"] = mod
  return sys.modules["memory_bench"]


def test_peak_is_arguments_plus_outputs_minus_aliased_plus_temporaries():
  """out = x + y with x donated: arguments 2·N·4 bytes, outputs N·4 written into x's buffer,
  so the peak is the two inputs (and XLA's few bytes of temporaries at most)."""
  memory = _memory_module()
  n = 1 << 18
  x = jax.ShapeDtypeStruct((n,), jnp.float32)
  compiled = jax.jit(lambda a, b: a + b, donate_argnums=0).lower(x, x).compile()
  m = compiled.memory_analysis()
  assert (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes) == (
      2 * 4 * n, 4 * n, 4 * n)
  peak, line = memory.peak_bytes(compiled)
  assert 2 * 4 * n <= peak <= 2 * 4 * n + 1024, peak
  assert peak == 8 * n + m.temp_size_in_bytes and line.endswith(f"= {peak / 1e9:.2f} GB")
  # Without the donation the output needs its own buffer: one more N·4.
  plain = jax.jit(lambda a, b: a + b).lower(x, x).compile()
  assert memory.peak_bytes(plain)[0] == 3 * 4 * n + plain.memory_analysis().temp_size_in_bytes


def test_device_bytes_counts_one_shard():
  memory = _memory_module()
  mesh = sharding.make_mesh((1, 8, 1))
  tree = {"split": jax.ShapeDtypeStruct((8, 100), jnp.float32,
                                        sharding=NamedSharding(mesh, P("fsdp"))),
          "replicated": jax.ShapeDtypeStruct((3,), jnp.bfloat16,
                                             sharding=NamedSharding(mesh, P()))}
  assert memory.device_bytes(tree) == 100 * 4 + 3 * 2


def test_every_preset_names_its_hardware():
  want = {"default": (8, 16.0), "0.5b": (1, 16.0), "tiny": (1, 4.0)}
  for preset, (devices, gb) in want.items():
    hw = gsm8k.get_config(preset).hardware
    assert (hw.devices, hw.memory_gb_per_device) == (devices, gb), preset
    assert hw.name


def _memory_cli(preset):
  """benchmarks/memory.py on a preset of configs/gsm8k.py: its output and its key=value lines."""
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "memory.py"),
       "--config=" + os.path.join(ROOT, "configs", "gsm8k.py") + ":" + preset, "--skip_eval"],
      capture_output=True, text=True, timeout=300, cwd=ROOT, check=True).stdout
  return out, dict(line.split("=", 1) for line in out.splitlines()
                   if "=" in line and " " not in line)


def test_cli_on_the_tiny_preset_prints_peaks_and_the_verdict():
  out, values = _memory_cli("tiny")
  train, sampler = float(values["train_step_peak_gb_per_device"]), float(
      values["sampler_peak_gb_per_device"])
  assert 0 < train < 4 and 0 < sampler < 4, out
  assert values["hardware_gb_per_device"] == "4.0" and values["preset_fits"] == "yes", out
  assert np.isfinite([train, sampler]).all()


def test_known_models_have_the_published_sizes():
  """The shapes memory.py knows without the hub give the parameter totals the hub lists for
  the Qwen2.5 instruct checkpoints' safetensors (model cards: 0.49B, 1.54B, 3.09B, 7.61B),
  with 7B's LM head untied and its vocab 152,064."""
  memory = _memory_module()
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  want = {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "3B": 3_085_938_688,
          "7B": 7_615_616_512}
  for size, n_want in want.items():
    config = gsm8k.get_config("tiny")
    config.model.random_init, config.model.checkpoint = False, f"Qwen/Qwen2.5-{size}-Instruct"
    cfg, valid = memory.model_config(config)
    n = sum(x.size for x in jax.tree.leaves(qwen.abstract_params(cfg)))
    assert n == n_want, (size, n)
    assert valid == 151_665 and cfg.tie_word_embeddings == (size != "7B"), size
  assert cfg.vocab_size == 152_064


def test_cli_on_the_tiny_lora_preset_compiles_without_hoisted_converts():
  out, values = _memory_cli("tiny_lora")
  assert "LoRA base" in out and "--gpu_like: compiled without XLA:CPU's while-loop invariant" in out, out
  assert values["preset_fits"] == "yes", out


def test_lora_members_share_one_base():
  """benchmarks/lora_members_memory.py's K-member program takes the base once: its arguments
  are the base plus K times a member's state, batch and hparams, by the abstract inputs' sizes."""
  spec = importlib.util.spec_from_file_location(
      "lora_members_memory", os.path.join(ROOT, "benchmarks", "lora_members_memory.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  one, many = bench.measure("tiny_lora", 2, 1)
  per_member = one["state"] + one["batch"] + one["hparams"]
  assert one["analysis"].argument_size_in_bytes == one["base"] + per_member
  assert many["analysis"].argument_size_in_bytes == one["base"] + 2 * per_member
