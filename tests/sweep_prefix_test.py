"""A run started from a shared warm start (a prefix's step-0 checkpoint) equals the same run
with its own warm start: the real main, the tiny preset cut to 2 warm-start and 2 GRPO steps.

Three processes of main, about 60-75 s on a shared 2-core CPU (sweep_test has the fast tests).
At 2 warm-start steps the policy never answers right, so the GRPO steps have zero advantages
and leave the params as they were: what is compared is what the prefix hands over (params,
optimizer state, data position, the step-0 eval) and everything computed from it (the sampled
completions' lengths and entropies, every logged metric but timings, the final state).
"""

import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

from cli import REPO, env
from grpo_jax import sweep, sweep_runner

SHORT = {"sft.steps": 2, "sft.target_accuracy": 0.0, "sft.eval_examples": 8,
         "data.synthetic_train": 600, "train.steps": 2, "train.eval_examples": 8,
         "train.prompts_per_step": 4, "train.tensorboard": False}


def _arrays(step_dir):
  state = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"))
  return {"/".join(map(str, path)): np.asarray(x)
          for path, x in _flatten(state)}


def _flatten(tree, path=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flatten(v, path + (k,))
  elif isinstance(tree, (list, tuple)):
    for i, v in enumerate(tree):
      yield from _flatten(v, path + (i,))
  elif tree is not None:
    yield path, tree


def _metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items()
             if not (k.startswith("time/") or k.startswith("sampler/") and "second" in k
                     or k.endswith("per_s"))} for line in f]


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_shared_warm_start_equals_own_warm_start(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  for k, v in env().items():
    monkeypatch.setenv(k, v)
  s = sweep.Sweep("configs/gsm8k.py:tiny", [{"optim.lr": 1e-4}], fixed=SHORT)
  shared = sweep_runner.Runner(s, sweep.plan(s, min_shared=1), tmp_path / "shared")
  own = sweep_runner.Runner(s, sweep.plan(s, share_prefix=False), tmp_path / "own")
  assert shared.run() == 0 and own.run() == 0
  a, b = tmp_path / "shared/optim.lr=0.0001", tmp_path / "own/optim.lr=0.0001"
  assert json.load(open(a / "sweep_run.json"))["prefix"] == "base"
  assert (a / "checkpoints/0/SHA256SUMS").samefile(
      tmp_path / "shared/prefixes/base/checkpoints/0/SHA256SUMS")  # linked, not copied
  assert _metrics(a) == _metrics(b) and len(_metrics(a)) == 3
  assert (a / "summary.json").read_text() == (b / "summary.json").read_text()
  for step in ("0", "2"):
    x, y = _arrays(a / "checkpoints" / step), _arrays(b / "checkpoints" / step)
    assert x.keys() == y.keys() and len(x) > 10
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=f"step {step} {k}")
