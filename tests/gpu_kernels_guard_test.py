"""The default GPU decode path's kernels per step, compiled for an H100 without one
(benchmarks/gpu_kernels.py, JAX's CUDA plugin): a step is bound by its kernel count on a GPU
(docs/performance.md), so a change that adds more than 10% to it fails here, in CI, before any
GPU sees it. After a change that lowers the count, lower tests/testdata/gpu_kernels.json's."""
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, "tests", "testdata", "gpu_kernels.json")
# Where pyproject.toml's [test] extra installs the plugin.
HAS_PLUGIN_WHEELS = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.mark.skipif(not HAS_PLUGIN_WHEELS, reason="JAX's CUDA plugin has Linux x86-64 wheels only")
def test_default_gpu_decode_step_kernels_do_not_regress():
  assert importlib.util.find_spec("jax_plugins.xla_cuda12") is not None, (
      "JAX's CUDA plugin is missing: pip install -r requirements-test.txt")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_kernels.py")],
                       capture_output=True, text=True, timeout=900, check=False,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  (count,) = [int(n) for n in re.findall(r"^decode_kernels\[0\.5b\]=(\d+)$", out.stdout, re.M)]
  with open(BASELINE) as f:
    baseline = json.load(f)["decode_kernels[0.5b]"]
  assert count <= 1.1 * baseline, (
      f"a decode step launches {count} kernels on an H100, {count / baseline - 1:.0%} more than "
      f"the {baseline} of tests/testdata/gpu_kernels.json:\n{out.stdout[-2000:]}")
