"""benchmarks/gpu_decide.py: its --smoke run on the CPU (the code the GPU runs), and its check."""
import json
import os
import subprocess
import sys
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_smoke_run_decides_and_writes_its_tables(tmp_path):
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_decide.py"), "--smoke", "--dir",
       str(tmp_path), "--candidates", "unroll,no_command_buffers"],
      capture_output=True, text=True, timeout=600, check=False,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  assert lines[-2].startswith("decode_row_steps_wasted=")
  assert lines[-1].startswith("decide_wall_s=")
  result = json.loads((tmp_path / "decide.json").read_text())
  smoke = result["sizes"]["smoke"]
  # The unrolled layers pass the check against the layer scan and are timed; the GPU-only
  # option is skipped on the CPU.
  assert smoke["options"]["unroll"]["ms_per_step"] > 0
  assert smoke["options"]["no_command_buffers"] == {"skipped": "a GPU option"}
  assert smoke["winner"] in ("xla", "unroll")
  # The default path on the CPU does not compact: its waste is the one-width loop's, which
  # the lengths give exactly (every row decodes its budget, the loop the longest one).
  import lengths as lengths_lib  # pylint: disable=import-outside-toplevel
  w = result["workload"]
  budgets = lengths_lib.realistic_lengths(w["prompts"] * w["g"], w["long"],
                                          median=w["long"] * 250 / 1024)
  default = smoke["lengths"]["default"]
  assert not default["compact_rows"] and smoke["lengths"]["other"]["compact_rows"]
  one_width = lengths_lib.wasted(budgets, budgets.max() * len(budgets))
  assert abs(default["row_steps_wasted"] - one_width) < 1e-9
  assert float(lines[-2].split("=")[1]) == round(default["row_steps_wasted"], 3)
  assert smoke["lengths"]["other"]["row_steps_wasted"] < default["row_steps_wasted"]
  md = (tmp_path / "decide.md").read_text()
  assert "| unroll |" in md and "winner" in md


def test_check_fails_a_candidate_whose_tokens_or_logprobs_differ():
  import gpu_decide  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 100, (20, 16))
  logp = -rng.random((20, 16))
  ref = types.SimpleNamespace(tokens=tokens, logprobs=logp)
  same = types.SimpleNamespace(tokens=tokens.copy(), logprobs=logp + 0.01)
  assert gpu_decide.check(same, ref)[0]
  off = types.SimpleNamespace(tokens=tokens.copy(), logprobs=logp + 0.2)  # a wrong kernel
  assert not gpu_decide.check(off, ref)[0]
  drawn = tokens.copy()
  drawn[:3, 5] += 1  # 3 of 20 rows diverge: 85% the same
  assert not gpu_decide.check(types.SimpleNamespace(tokens=drawn, logprobs=logp), ref)[0]
