"""An H100 for XLA to compile for on a machine without a GPU.

JAX's CUDA plugin compiles against XLA's description of a device (its GPU target description,
xla/stream_executor/device_description.proto) through `jax.experimental.topologies`, with no
driver and no device: `devices()` gives one such compile-only device. Programs placed on it are
compiled by the GPU compiler (its fusions, kernels and buffer assignment) and never run.

It needs the plugin at the installed JAX's version, best in a virtual environment of its own
(the plugin makes JAX look for a GPU at start-up):

    python3 -m venv --system-site-packages /tmp/cuda-venv
    /tmp/cuda-venv/bin/pip install "jax-cuda12-plugin[with-cuda]==$(python3 -c 'import jax; print(jax.__version__)')"

Used by benchmarks/gpu_kernels.py and benchmarks/memory.py --h100.
"""
from __future__ import annotations

import os
import sys

# One H100 SXM (80 GB HBM3), in the fields XLA reads.
TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def prepare_environment() -> None:
  """Before JAX's backends start: the CPU as JAX's platform, and the plugin loaded without the
  GPU its start-up check looks for."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def cublas_matmuls() -> None:
  """Before JAX's backends start: compile every matmul as a cuBLAS call. Without the device,
  XLA's Triton GEMM tiler cannot autotune and finds no tile for some of a train step's matmuls
  ("Couldn't find output tile sizes")."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_enable_triton_gemm=false")


def devices(script: str) -> list:
  """One compile-only H100; exits naming `script` when no CUDA compiler is installed."""
  prepare_environment()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return list(topologies.get_topology_desc(platform="cuda", target_config=TARGET,
                                             topology="1x1x1").devices)
  except (NotImplementedError, RuntimeError) as e:
    sys.exit(f"{script}: no CUDA compiler ({type(e).__name__}: {str(e)[:200]}); install "
             "jax-cuda12-plugin as benchmarks/h100.py says")
