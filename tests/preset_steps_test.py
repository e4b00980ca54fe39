"""benchmarks/preset_steps.py: a preset's first steps through train.run, end to end on CPU at a
toy shape (--smoke), and its refusal of a preset whose model shape it does not know."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "preset_steps.py")


def _run(*args):
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        cwd=ROOT, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))


def test_smoke_runs_the_lora_preset_steps():
  proc = _run("--preset", "1.5b_lora", "--smoke")
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  # The preset's recipe is kept where the smoke shape does not change it: LoRA rank 16, β 0.04.
  assert "LoRA rank 16, beta 0.04" in out, out[-3000:]
  rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out,
                    re.M)
  assert [int(r[0]) for r in rows] == [1, 2], out[-3000:]
  for _, step, sample, reward, train, length in rows:
    assert 0 < float(length) <= 8  # no completion is longer than the 8 new tokens
  # The step's clock holds its phases: checked on the worker's unrounded figures (its result
  # line), since the table's two decimals can round a sum of phases above the step.
  result = json.loads(re.search(r"^PRESET_STEPS_RESULT (.*)$", out, re.M).group(1))
  assert [s["step"] for s in result["steps"]] == [1, 2]
  for s in result["steps"]:
    assert s["time/step_s"] >= s["time/sample_s"] + s["time/train_s"] > 0, s
  assert re.search(r"^preset_steps\[1\.5b_lora\]=ok ", out, re.M), out[-3000:]


def test_unknown_model_shape_is_refused():
  proc = _run("--preset", "tiny")  # random_init's own tiny model: no checkpoint shape to build
  assert proc.returncode != 0
  assert "benchmarks/shapes.py does not know" in proc.stderr, proc.stderr[-2000:]
