"""experiments/colab.ipynb, executed with nbclient on the CPU: a shortened tiny run from this
checkout. What the notebook shows is checked against the run's own files: the gain it prints
against the held-out accuracies in metrics.jsonl, the plot as a PNG output, the completions it
prints against samples.jsonl."""

import json
import os
import re

import nbformat
import numpy as np
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "experiments", "colab.ipynb")


def _outputs(cell, kind):
  if kind == "text":
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
  return [o for o in cell.outputs if "data" in o and "image/png" in o["data"]]


def test_stored_notebook_has_no_outputs_and_one_parameter_cell():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.outputs and c.execution_count is None for c in code)
  assert [c for c in code if "parameters" in c.metadata.get("tags", [])] == [code[0]]


def test_notebook_runs_the_tiny_preset_and_shows_gain_plot_and_completions(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  workdir = str(tmp_path / "tiny")
  # Seed 0's warm start, then 100 GRPO steps with one held-out check at the end (the preset's
  # gain at step 100 was +28 points on seed 0: experiments/tiny_seeds_report).
  params = nbformat.v4.new_code_cell(
      f"REPO_DIR = {REPO!r}\nWORKDIR = {workdir!r}\n"
      "TINY_OVERRIDES = ['--config.train.steps=100', '--config.train.eval_every=100', "
      "'--config.train.eval_examples=256']\nRUN_HUB_PRESET = False")
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(at + 1, params)
  NotebookClient(nb, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  code = [c for c in nb.cells if c.cell_type == "code"]
  text = "\n".join(_outputs(c, "text") for c in code)

  # The gain it prints is the one in the run's metrics.
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    evals = [r["eval/accuracy"] for r in map(json.loads, f) if "eval/accuracy" in r]
  shown = re.search(r"held-out greedy accuracy ([\d.]+)% \(step 0\) -> ([\d.]+)% \(step 100\): "
                    r"gain ([+-][\d.]+) points", text)
  assert shown, text[-2000:]
  np.testing.assert_allclose([float(x) for x in shown.groups()],
                             [100 * evals[0], 100 * evals[-1], 100 * (evals[-1] - evals[0])],
                             atol=0.051)
  assert float(shown.group(3)) > 0  # the tiny preset learns

  # A plot, inline.
  assert sum(len(_outputs(c, "png")) for c in code) == 1
  # The completions of the last step, as samples.jsonl holds them.
  with open(os.path.join(workdir, "samples.jsonl")) as f:
    last = [s for s in map(json.loads, f) if s["step"] == 100]
  for s in last[:4]:
    assert f"completion: {s['completion']!r}" in text
  assert "RUN_HUB_PRESET is False" in text
