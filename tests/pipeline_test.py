"""One step behind (train.off_policy_steps=1, grpo_jax.pipeline): which params each step samples
with, the sampler's log-probs as the behaviour policy, the batch in flight in a checkpoint (a
resumed run is the uninterrupted one, bit for bit), and the settings it refuses."""
import json
import signal
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

import cli
import train_test
from configs import gsm8k
from grpo_jax import (checkpoint, logging_io, members, pipeline, sampler as sampler_lib, train,
                      train_step, validate)

REPO = cli.REPO
PIPELINED = "--config.train.off_policy_steps=1"


def _tiny_config(**train_kw):
  config = gsm8k.get_config("tiny")
  # A short warm start: rewards that differ within groups, so that updates move the params.
  config.data.synthetic_train, config.data.synthetic_test = 400, 8
  config.sft.steps = 10
  config.train.update(steps=4, prompts_per_step=4, eval_examples=4, eval_batch_size=4,
                      eval_every=0, checkpoint_every=100, tensorboard=False,
                      off_policy_steps=1, **train_kw)
  return config


def _fingerprint(params) -> float:
  """A number that changes with any update of the params (their sum, in float64)."""
  return float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(params)))


def test_each_step_samples_with_the_params_before_the_previous_update(tmp_path, monkeypatch):
  sampled, updated, batches = [], [], []  # params' fingerprints; the update's batches
  real_generate, real_call = sampler_lib.Sampler.generate, train_step.TrainStep.__call__

  def generate(self, variables, prompts, *args, **kw):
    if not kw.get("greedy"):  # the eval decodes greedily
      sampled.append(_fingerprint(variables["params"]))
    return real_generate(self, variables, prompts, *args, **kw)

  def call(self, state, batch, *args, **kw):
    if train_step.is_rollout(batch):  # a GRPO update, not the warm start's
      updated.append(_fingerprint(state["params"]))
      batches.append(batch)
    return real_call(self, state, batch, *args, **kw)
  monkeypatch.setattr(sampler_lib.Sampler, "generate", generate)
  monkeypatch.setattr(train_step.TrainStep, "__call__", call)
  config = _tiny_config(dynamic_sampling=False)
  train.run(config, str(tmp_path))
  # Step 1 samples its own batch and step 2's before its update; step t + 1's batch is sampled
  # with the params step t's update starts from: never older than one update.
  assert len(updated) == 4 and len(set(updated)) > 1, updated  # (the params do move)
  assert sampled == [updated[0]] + updated[:-1]
  # The update's behaviour policy is what the sampler reported for those tokens: 0 past each
  # row's length, a log-probability (< 0) on its tokens.
  for b in batches:
    mask = np.arange(b["completion_BC"].shape[1])[None] < b["lengths_B"][:, None]
    assert b["old_logp_BC"].dtype == np.float32
    assert np.all(b["old_logp_BC"][~mask] == 0) and np.all(b["old_logp_BC"][mask] < 0)
  records = logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))[1:]
  assert [r["async/staleness"] for r in records] == [0, 1, 1, 1]
  # Step 1 trains on its own params' samples: the ratio is 1 up to the sampler's rounding.
  # Later steps' ratios are the correction: π_θ / π_sampler away from 1.
  assert abs(records[0]["ratio/mean"] - 1) < 1e-4
  assert max(abs(r["ratio/max"] - 1) for r in records[2:]) > 1e-3
  assert all(0 <= r["clip/region_frac"] <= 1 for r in records)


def test_a_flight_survives_its_json_bit_for_bit():
  rng = np.random.default_rng(0)
  arrays = {"tokens": rng.integers(0, 300, (4, 6)).astype(np.int32),
            "lengths": np.array([1, 6, 3, 2], np.int32),
            "truncated": np.array([False, True, False, False]),
            "logprobs": rng.normal(size=(4, 6)).astype(np.float32)}
  flight = pipeline.Flight(3, 1, [5, 9], arrays, {"sampler/decode_steps": 6}, 0.25)
  back = pipeline.Flight.from_json(json.loads(json.dumps(flight.to_json())))
  assert (back.step, back.staleness, back.indices, back.metrics, back.sample_s) == (
      3, 1, [5, 9], {"sampler/decode_steps": 6}, 0.25)
  for name, a in arrays.items():
    assert back.arrays[name].dtype == a.dtype
    assert back.arrays[name].tobytes() == a.tobytes()


@pytest.mark.parametrize("value, match", [
    (2, r"config\.train\.off_policy_steps: must be 0 \(on-policy\) or 1 .*got 2"),
    (True, r"config\.train\.off_policy_steps: must be of type int, got True"),
])
def test_off_policy_steps_out_of_range_is_refused(value, match):
  config = gsm8k.get_config("tiny")
  config.train.off_policy_steps = value
  with pytest.raises(validate.ConfigError, match=match):
    validate.validate(config, 1)


def test_an_agent_on_split_meshes_or_a_vmapped_group_refuses_one_step_behind():
  from configs import gsm8k_agent
  agent = gsm8k_agent.get_config("tiny")
  agent.train.update(off_policy_steps=1, sample_devices=1)
  with pytest.raises(validate.ConfigError, match=r"config\.train\.sample_devices: .*agent"):
    validate.validate(agent, 2)
  agent.train.sample_devices = 0
  validate.validate(agent, 1)  # one mesh: an agent runs one step behind
  group = [gsm8k.get_config("tiny") for _ in range(2)]
  for c in group:
    c.train.off_policy_steps = 1
  with pytest.raises(members.VmapError, match=r"config\.train\.off_policy_steps=1: .*without "
                                              r"--vmap"):
    members.check_vmappable(group)


def test_the_cli_refuses_off_policy_steps_2_in_one_line(tmp_path):
  done = subprocess.run(train_test._command(tmp_path, "--config.train.off_policy_steps=2"),
                        cwd=REPO, env=cli.env(), capture_output=True, text=True, timeout=300)
  cli.assert_user_error(done, "config.train.off_policy_steps: must be 0")


def test_a_pipelined_run_stopped_and_resumed_is_the_uninterrupted_one_bit_for_bit(tmp_path):
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  steps = "--config.train.steps=8"
  train_test._run(straight, steps, PIPELINED)
  code, out = train_test._start_and_signal(stopped, 2, signal.SIGTERM, steps, PIPELINED)
  assert code == 128 + signal.SIGTERM, out[-3000:]
  at = checkpoint.latest_step(str(stopped))
  assert 2 <= at < 8, out[-3000:]
  # The checkpoint holds the batch sampled for the next step, before its update.
  meta = json.loads((Path(checkpoint.checkpoint_dir(str(stopped))) / str(at) / "meta"
                     / "metadata").read_text())
  assert meta["in_flight"]["step"] == at and meta["in_flight"]["staleness"] == 1
  assert "resumed from step" in train_test._run(stopped, steps, PIPELINED).stdout
  ma = _assert_the_same_run(straight, stopped, 8)
  assert [r["async/staleness"] for r in ma[1:]] == [0] + [1] * 7


def _assert_the_same_run(straight, resumed, steps: int, timing=()) -> list[dict]:
  """Both workdirs hold the same final model, samples and metrics (but their timings, and
  `timing`), bit for bit; returns the metrics."""
  a, b = train_test._final_params(straight), train_test._final_params(resumed)
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  timing = set(logging_io.TIMING_METRICS) | set(timing)
  ma, mb = (logging_io.read_jsonl(str(d / "metrics.jsonl")) for d in (straight, resumed))
  assert [r["step"] for r in mb] == [r["step"] for r in ma] == list(range(steps + 1))
  for ra, rb in zip(ma, mb):
    same = lambda r: {k: v for k, v in r.items() if k not in timing}
    assert same(ra) == same(rb), (ra, rb)
  sa, sb = (logging_io.read_jsonl(str(d / "samples.jsonl")) for d in (straight, resumed))
  assert sa and sa == sb
  return ma


def _devices(tree) -> set:
  """The devices the arrays of a pytree are placed on."""
  return set().union(*(x.sharding.device_set for x in jax.tree.leaves(tree)))


def test_split_meshes_sample_on_their_own_devices_and_match_one_mesh(tmp_path, monkeypatch):
  sampled, trained = [], []  # the device sets of the sampled variables and of the train states
  real_generate, real_call = sampler_lib.Sampler.generate, train_step.TrainStep.__call__

  def generate(self, variables, prompts, *args, **kw):
    if not kw.get("greedy"):
      sampled.append(_devices(variables))
    return real_generate(self, variables, prompts, *args, **kw)

  def call(self, state, batch, *args, **kw):
    if train_step.is_rollout(batch):
      trained.append(_devices(state))
    return real_call(self, state, batch, *args, **kw)
  monkeypatch.setattr(sampler_lib.Sampler, "generate", generate)
  monkeypatch.setattr(train_step.TrainStep, "__call__", call)
  records = {}
  for name, n in (("one", 0), ("split", 4)):
    config = _tiny_config(dynamic_sampling=False, sample_devices=n)
    config.mesh = (1, 4, 1)
    train.run(config, str(tmp_path / name))
    records[name] = logging_io.read_jsonl(str(tmp_path / name / "metrics.jsonl"))
  devices = jax.devices()
  # One mesh: the first 4 devices sample and train. Split: the first 4 sample, the next 4 train.
  # (4 steps: step 1 samples its own batch and step 2's, steps 2 and 3 the next step's.)
  assert sampled[:4] == [set(devices[:4])] * 4 and trained[:4] == [set(devices[:4])] * 4
  assert sampled[4:] == [set(devices[:4])] * 4, sampled[4:]
  assert trained[4:] == [set(devices[4:])] * 4, trained[4:]
  one, split = records["one"], records["split"]
  # Steps 1-3 copy the params for the next step's batch (step 1 also for its own); the last
  # step samples nothing ahead.
  assert all(r["time/param_transfer_s"] > 0 for r in split[1:-1])
  assert split[-1]["time/param_transfer_s"] == 0
  assert not any("time/param_transfer_s" in r for r in one)
  # The same programs on the same mesh shapes, on other devices: the same numbers, bit for bit.
  timing = set(logging_io.TIMING_METRICS)
  same = lambda r: {k: v for k, v in r.items() if k not in timing}
  assert [same(r) for r in split] == [same(r) for r in one]


@pytest.mark.parametrize("overrides, match", [
    (dict(sample_devices=2, off_policy_steps=0),
     r"config\.train\.sample_devices: 2 devices .*needs train\.off_policy_steps=1"),
    (dict(sample_devices=8), r"config\.train\.sample_devices: 8 leaves none of the 8 devices"),
    (dict(sample_devices=-1), r"config\.train\.sample_devices: must be an int >= 0"),
])
def test_bad_sample_devices_are_refused(overrides, match):
  config = gsm8k.get_config("tiny")
  config.train.update(off_policy_steps=1)
  config.train.update(**overrides)
  with pytest.raises(validate.ConfigError, match=match):
    validate.validate(config, 8)


def test_the_train_mesh_is_checked_on_the_devices_sampling_leaves():
  config = gsm8k.get_config("tiny")
  config.train.update(off_policy_steps=1, sample_devices=2)
  config.mesh = (1, -1, 1)  # 6 train devices: the tiny step's 16 × 8 completions do not split
  with pytest.raises(validate.ConfigError, match=r"not divisible by the 6 devices"):
    validate.validate(config, 8)


def test_the_cli_refuses_sample_devices_on_policy_in_one_line(tmp_path):
  done = subprocess.run(train_test._command(tmp_path, "--config.train.sample_devices=2"),
                        cwd=REPO, env=cli.env(), capture_output=True, text=True, timeout=300)
  cli.assert_user_error(done, "config.train.sample_devices: 2 devices", "train.off_policy_steps=1")


# After 10 warm-start steps every trajectory of the tiny agent scores 0: its groups carry no
# advantage, no update moves the params, and a resumed run would equal an uninterrupted one
# trivially. After 40, some trajectories end in a well-formed <answer> and others do not, so
# the format reward (without the <think> block the agent's prompt never asks for) differs
# within groups and every step's loss moves the params.
AGENT_REWARDS = ["--config.sft.steps=40", "--config.rewards.names=('math_accuracy','format')",
                 "--config.rewards.weights=(1.0,1.0)", "--config.rewards.format.require_think=False"]


def _agent_command(workdir, *flags):
  """The tiny agent preset, shortened as train_test's runs are (the sandboxed Python tool),
  with rewards that differ within groups."""
  return [train_test.sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k_agent.py:tiny",
          f"--workdir={workdir}", *train_test.TINY_FLAGS, *AGENT_REWARDS, PIPELINED, *flags]


def test_an_agent_one_step_behind_stopped_and_resumed_is_the_uninterrupted_one(tmp_path,
                                                                              monkeypatch):
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  steps = "--config.train.steps=6"
  monkeypatch.setattr(train_test, "_command", _agent_command)  # _run and _start_and_signal's
  train_test._run(straight, steps)
  code, out = train_test._start_and_signal(stopped, 2, signal.SIGTERM, steps)
  assert code == 128 + signal.SIGTERM, out[-3000:]
  at = checkpoint.latest_step(str(stopped))
  assert 2 <= at < 6, out[-3000:]
  # The batch in flight is whole trajectories: their arrays and their answers' texts.
  meta = json.loads((Path(checkpoint.checkpoint_dir(str(stopped))) / str(at) / "meta"
                     / "metadata").read_text())
  flight = meta["in_flight"]
  assert flight["step"] == at and flight["staleness"] == 1
  assert {"completion", "loss_mask", "turn_ids", "sampler_logp"} <= set(flight["arrays"])
  rows = flight["arrays"]["completion"]["shape"][0]
  assert rows == 4 * gsm8k.get_config("tiny").sampling.num_generations  # prompts_per_step × G
  assert len(flight["extra"]["texts"]) == len(flight["extra"]["trajectories"]) == rows
  assert "resumed from step" in train_test._run(stopped, steps).stdout
  ma = _assert_the_same_run(straight, stopped, 6)
  assert [r["async/staleness"] for r in ma[1:]] == [0] + [1] * 5
  # The comparison is not of a run that stood still: rewards differed within groups and the
  # policy loss was nonzero on the steps before and after the stop.
  assert all(r["reward/total/std"] > 0 for r in ma[1:])
  assert all(r["loss/policy"] != 0 for r in ma[2:]), [r["loss/policy"] for r in ma]
  # The first step trains on its own params' trajectories: the sampler's log-probs of the
  # action tokens are the train step's own, up to rounding (a misplaced token would not be).
  assert abs(ma[1]["ratio/max"] - 1) < 1e-4 and abs(ma[1]["ratio/min"] - 1) < 1e-4
  assert 1 <= ma[-1]["agent/turns/mean"] <= 4
