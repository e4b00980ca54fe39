"""experiments/colab.ipynb, executed with nbclient on the CPU: a shortened tiny run of this
checkout. What the notebook shows is checked against the run's own files: the gain it prints
against summary.json and the held-out accuracies in metrics.jsonl, the plot as a PNG output,
the completions it prints against samples.jsonl."""

import json
import os
import re
import sys

import nbformat
import numpy as np
from nbclient import NotebookClient

import cli

NOTEBOOK = os.path.join(cli.REPO, "experiments", "colab.ipynb")


def _text(cells) -> str:
  return "\n".join(o.get("text", "") for c in cells for o in c.outputs
                   if o.output_type == "stream")


def _pngs(cells) -> list:
  return [o for c in cells for o in c.outputs if "image/png" in o.get("data", {})]


def test_stored_notebook_has_no_outputs_and_one_parameter_cell():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.outputs and c.execution_count is None for c in code)
  assert [c for c in code if "parameters" in c.metadata.get("tags", [])] == [code[0]]


def test_notebook_runs_the_tiny_preset_and_shows_gain_plot_and_completions(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  workdir = str(tmp_path / "tiny")
  # Papermill's way: a cell after the parameter cell overrides it. Seed 0's warm start (340
  # steps), then 100 GRPO steps with one held-out evaluation on 256 problems at the end: 27.3%
  # -> 39.8%, +12.5 points, at commit b3a38a8 (+31.2 at 1caca6e, before the preset's warm
  # start and learning-rate schedule changed).
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
      f"REPO_DIR = {str(cli.REPO)!r}\nWORKDIR = {workdir!r}\n"
      "SEED, GRPO_STEPS, EVAL_EVERY, EVAL_EXAMPLES = 0, 100, 100, 256\n"
      "RUN_HUB_PRESET = False\nimport sys; print('kernel interpreter:', sys.executable)"))
  # The kernel runs as a user's would (one CPU device, no fake-device flags) and imports this
  # checkout, also when the venv's editable install points at another one.
  env = cli.env(PYTHONPATH=os.pathsep.join(
      [str(cli.REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  NotebookClient(nb, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute(env=env)
  code = [c for c in nb.cells if c.cell_type == "code"]
  text = _text(code)
  assert f"kernel interpreter: {sys.executable}\n" in text
  assert f"grpo_jax from {cli.REPO / 'grpo_jax'} |" in text

  # The gain it prints is summary.json's, and the held-out accuracies in metrics.jsonl give it.
  shown = re.search(r"held-out greedy accuracy ([\d.]+)% \(step (\d+)\) -> ([\d.]+)% "
                    r"\(step (\d+)\): gain ([+-][\d.]+) points", text)
  assert shown, text[-3000:]
  start, start_step, end, end_step, gain = map(float, shown.groups())
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    evals = [r for r in map(json.loads, f) if r.get("eval/accuracy") is not None]
  assert (start_step, end_step) == (summary["start_step"], summary["end_step"]) == (0, 100)
  assert [r["step"] for r in evals] == [0, 100]
  np.testing.assert_allclose(gain, summary["eval_accuracy_gain_points"], atol=0.051)
  np.testing.assert_allclose(
      [start, end, gain],
      [100 * evals[0]["eval/accuracy"], 100 * evals[1]["eval/accuracy"],
       100 * (evals[1]["eval/accuracy"] - evals[0]["eval/accuracy"])], atol=0.051)
  assert gain > 0  # GRPO lifts the warm start

  # One plot, inline.
  assert len(_pngs(code)) == 1
  # The last step's completions, as samples.jsonl holds them.
  with open(os.path.join(workdir, "samples.jsonl")) as f:
    last = [s for s in map(json.loads, f) if s["step"] == 100]
  assert last
  for s in last[:4]:
    assert f"completion: {s['completion']!r}" in text
  assert "RUN_HUB_PRESET is False" in text
