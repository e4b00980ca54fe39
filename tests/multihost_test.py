"""Several hosts: two processes on localhost, 4 fake CPU devices each, joined by
jax.distributed (gloo collectives), run the tiny preset through the real `grpo_jax.main` and are
compared with one process on 8 devices running the same command.

What must match, and how closely:
- everything the host side computes from sampled tokens is identical: each step's samples
  (prompt, completion, rewards, gold), the rewards, lengths, eval accuracy, losses (to 1e-6);
- the final params agree to a tolerance, not bit for bit. gloo's all-reduce adds the 8 devices'
  partial sums in another order than the in-process CPU collectives do (the same psum of the
  same shards differs in the last bits: checked in test_gloo_sums_in_another_order), and Adam
  turns a last-bit gradient difference into up to ~lr per element per update where the gradient
  nearly cancels. The bound is 2 x (the sum of every update's lr).

Eval takes 17 problems in chunks of 16: the last chunk leaves process 1 without a row.

The multi-host run is also stopped by SIGTERM (both processes, as a TPU maintenance event does)
and resumed by the same command on both, so the comparison covers resume across processes.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import cli
from grpo_jax import logging_io
from grpo_jax.logging_io import TIMING_METRICS

SFT_STEPS, SFT_LR, STEPS, LR = 3, 1e-3, 4, 3e-5
OVERRIDES = ["--config=configs/gsm8k.py:tiny", "--config.mesh=(1,-1,1)",
             f"--config.sft.steps={SFT_STEPS}", f"--config.sft.lr={SFT_LR}",
             "--config.sft.target_accuracy=0", f"--config.train.steps={STEPS}",
             f"--config.optim.lr={LR}", "--config.train.prompts_per_step=8",
             "--config.train.max_sampling_rounds=2", "--config.train.eval_examples=17",
             "--config.train.eval_batch_size=16", "--config.train.eval_every=2",
             "--config.train.checkpoint_every=1", "--config.train.tensorboard=False"]


def _env(devices: int) -> dict:
  return cli.env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                 PYTHONPATH=str(cli.REPO))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start_pair(workdir: Path, port: int):
  """Processes 0 and 1 of a two-host run; process 1's output goes to a file beside workdir."""
  procs = []
  for pid in (1, 0):
    out = open(f"{workdir}.process{pid}.log", "a")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "grpo_jax.main", f"--workdir={workdir}", *OVERRIDES,
         f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={pid}"],
        cwd=cli.REPO, env=_env(4), stdout=out, stderr=subprocess.STDOUT, text=True))
  return procs[::-1]


def _wait(procs, timeout=600):
  return [p.wait(timeout=timeout) for p in procs]


def _log(workdir: Path, pid: int) -> str:
  return Path(f"{workdir}.process{pid}.log").read_text()[-4000:]


def _runs(root: Path):
  """(single-process workdir, two-process workdir, process 0's output of the first leg)."""
  single, multi = root / "single", root / "multi"
  # The two-host run first, stopped by SIGTERM once its step-1 checkpoint is on disk (three
  # steps to spare: under load orbax commits a checkpoint a little after it was started). The
  # single-process run waits: beside this leg it would only slow it down on 2 cores.
  procs = _start_pair(multi, _free_port())
  target = multi / "checkpoints" / "1" / "SHA256SUMS"
  deadline = time.time() + 600
  while not target.is_file() and all(p.poll() is None for p in procs) and time.time() < deadline:
    time.sleep(0.05)
  assert all(p.poll() is None for p in procs), (_log(multi, 0), _log(multi, 1))
  for p in procs:
    p.send_signal(signal.SIGTERM)
  assert _wait(procs) == [143, 143], (_log(multi, 0), _log(multi, 1))  # stopped by SIGTERM
  first_leg = _log(multi, 0)
  assert "grpo_jax: interrupted (SIGTERM) in GRPO step" in first_leg, first_leg
  assert not (multi / "final_model").exists()
  # The resumed leg and the single-process run side by side: the two processes spend much of
  # their time waiting on each other (gloo's collectives, process 1's compiles), which the
  # single run fills.
  resumed = _start_pair(multi, _free_port())
  with open(f"{single}.log", "w") as out:
    one = subprocess.Popen([sys.executable, "-m", "grpo_jax.main", f"--workdir={single}",
                            *OVERRIDES], cwd=cli.REPO, env=_env(8), stdout=out,
                           stderr=subprocess.STDOUT, text=True)
  try:
    assert _wait(resumed) == [0, 0], (_log(multi, 0), _log(multi, 1))
    assert one.wait(timeout=600) == 0, Path(f"{single}.log").read_text()[-4000:]
  finally:  # a failed leg leaves no process running on into the next tests
    for p in (*resumed, one):
      if p.poll() is None:
        p.kill()
  return single, multi, first_leg


def test_two_processes_resume_and_train_as_one_process_on_8_devices(tmp_path):
  """The comparison of the module docstring; and only process 0 writes the run's files. (One
  test for both: the runs take minutes, and a fixture shared by two tests is made once per
  pytest-xdist worker that runs one of them.)"""
  single, multi, first_leg = _runs(tmp_path)
  assert "mesh {'data': 1, 'fsdp': 8, 'tensor': 1}" in first_leg
  resumed_leg = _log(multi, 0)
  assert "resumed from step" in resumed_leg, resumed_leg
  a = load_file(str(single / "final_model" / "model.safetensors"))
  b = load_file(str(multi / "final_model" / "model.safetensors"))
  assert a.keys() == b.keys()
  bound = 2 * (SFT_STEPS * SFT_LR + STEPS * LR)
  for name in a:
    np.testing.assert_allclose(b[name], a[name], rtol=0, atol=bound, err_msg=name)

  sa = logging_io.read_jsonl(str(single / "samples.jsonl"))
  sb = logging_io.read_jsonl(str(multi / "samples.jsonl"))
  assert len(sa) == len(sb) > 0
  assert sa == sb  # same prompts in the same order, same completions, rewards and gold answers
  ma = logging_io.read_jsonl(str(single / "metrics.jsonl"))
  mb = logging_io.read_jsonl(str(multi / "metrics.jsonl"))
  assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(STEPS + 1))
  for ra, rb in zip(ma, mb):
    assert ra.keys() == rb.keys(), (ra.keys() ^ rb.keys())
    for key in ra:
      if key.startswith("time/") or key in TIMING_METRICS:  # wall clock
        continue
      # drift/* measure float32 rounding between sampler and train step (~1e-6 here), which
      # the one-process and two-process programs do not share: compared at their noise bound
      # (train_test's 1e-4), not as a signal.
      atol = 1e-4 if key.startswith("drift/") else 1e-7
      np.testing.assert_allclose(rb[key], ra[key], rtol=1e-6, atol=atol, err_msg=key)
    # The throughput counts every process's tokens (not process 0's share): the same tokens as
    # the one process generated, over the run's own time.
    tokens = lambda r: r["sampler/tokens_per_s"] * r["sampler/seconds"]
    if "sampler/tokens_per_s" in ra:
      assert tokens(rb) == pytest.approx(tokens(ra), rel=1e-9) and tokens(ra) > 0
  assert json.loads((multi / "summary.json").read_text()) == json.loads(
      (single / "summary.json").read_text())
  _only_process_0_writes_the_run_files(single, multi)


def _only_process_0_writes_the_run_files(single: Path, multi: Path):
  # Outside checkpoints/ the two-process workdir holds exactly what one process writes: no
  # second metrics, samples or plots. In checkpoints/ each process writes its own shards
  # (orbax's ocdbt.process_<i>), which is what a multi-host checkpoint is.
  def files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if "checkpoints" not in p.relative_to(root).parts)
  assert files(multi) == files(single)
  lines = (multi / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == STEPS + 1
  step_dir = multi / "checkpoints" / str(STEPS)
  assert (step_dir / "state" / "ocdbt.process_1").is_dir()
  listed = (step_dir / "SHA256SUMS").read_text()
  assert "ocdbt.process_1/" in listed  # the checksums cover both processes' shards


def test_gloo_sums_in_another_order(tmp_path):
  """Why the params above are compared to a tolerance: the same psum over 8 devices' shards, in
  one process and in two processes joined by gloo, differs in the last bits."""
  script = tmp_path / "psum.py"
  script.write_text(
      "import sys, jax, numpy as np\n"
      "from grpo_jax import hosts\n"
      "n = int(sys.argv[1])\n"
      "if n > 1:\n"
      "  hosts.initialize(f'localhost:{sys.argv[3]}', n, int(sys.argv[2]))\n"
      "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
      "mesh = Mesh(np.array(jax.devices()), ('b',))\n"
      "x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)\n"
      "x *= np.logspace(0, 6, 8, dtype=np.float32)[:, None]\n"
      "f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, 'b'), mesh=mesh, in_specs=P('b'),\n"
      "                          out_specs=P()))\n"
      "np.save(sys.argv[-1], np.asarray(f(jax.device_put(x, NamedSharding(mesh, P('b'))))))\n")
  one = tmp_path / "one.npy"
  subprocess.run([sys.executable, str(script), "1", "0", "0", str(one)], cwd=cli.REPO,
                 env=_env(8), check=True, timeout=120, capture_output=True)
  port = _free_port()
  two = [subprocess.Popen([sys.executable, str(script), "2", str(i), str(port),
                           str(tmp_path / f"two{i}.npy")], cwd=cli.REPO, env=_env(4),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
         for i in (0, 1)]
  assert [p.wait(timeout=120) for p in two] == [0, 0]
  a, b = np.load(one)[0], np.load(tmp_path / "two0.npy")[0]
  exact = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
  exact = (exact * np.logspace(0, 6, 8, dtype=np.float32)[:, None]).astype(np.float64).sum(0)
  # Both are float32 sums of the same numbers, each within float32 rounding of the exact sum...
  for out in (a, b):
    np.testing.assert_allclose(out, exact, rtol=0, atol=8 * np.finfo(np.float32).eps * 1e6 * 4)
  # ...but not the same sums: the order of the additions differs.
  assert not np.array_equal(a, b)
  np.testing.assert_array_equal(np.load(tmp_path / "two1.npy")[0], b)


def test_settings_a_multi_host_run_cannot_use_are_named():
  from configs import gsm8k, gsm8k_agent
  from grpo_jax import validate
  config = gsm8k.get_config("tiny")
  config.mesh = (1, -1, 1)
  validate.validate_processes(config, 8, 2)  # the test's settings pass
  validate.validate_processes(gsm8k_agent.get_config("tiny"), 1, 1)  # one process: no checks
  cases = [({"mesh": (1, 2, 1)}, "config.mesh: (1, 2, 1) uses 2 of the 8 devices"),
           ({"mesh": (1, 1, 8)}, "config.mesh: (1, 1, 8) splits the batch 1 ways"),
           ({"train.prompts_per_step": 7}, "config.train.prompts_per_step: 7 prompts")]
  for change, message in cases:
    bad = config.copy_and_resolve_references()
    for key, value in change.items():
      section, _, field = key.rpartition(".")
      (bad[section] if section else bad)[field] = value
    with pytest.raises(validate.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
      validate.validate_processes(bad, 8, 2)
  agent = gsm8k_agent.get_config("tiny")
  agent.mesh = (1, -1, 1)
  with pytest.raises(validate.ConfigError, match="config.agent.enabled"):
    validate.validate_processes(agent, 8, 2)


@pytest.mark.parametrize("flags, named", [
    (["--num_processes=2", "--process_id=0"], "--coordinator_address"),
    (["--coordinator_address=localhost:1", "--num_processes=2"], "--process_id"),
    (["--coordinator_address=localhost:1", "--num_processes=2", "--process_id=2"],
     "--process_id=2"),
])
def test_process_flags_that_do_not_fit_are_a_user_error(tmp_path, flags, named):
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k.py:tiny",
                         f"--workdir={tmp_path}", *flags], cwd=cli.REPO, env=_env(1),
                        capture_output=True, text=True, timeout=120)
  cli.assert_user_error(proc, named)
  assert not any(tmp_path.iterdir())  # stopped before anything was written
