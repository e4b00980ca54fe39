"""Several hosts, a fault: SIGTERM reaches one process of a two-process run while both wait on
a silent reward scorer. Every process stops at the same step within seconds, with the step's
checkpoint (before the fix, process 0 gave up alone and the other waited in the gather, or in
its scorer and then the gather, for ever).

Two processes on localhost, two CPU devices each, joined by jax.distributed (as in
tests/multihost_test.py), the tiny preset with the http quality reward on
tests/fake_chat_server.py. About 40-60 s on a shared 2-core CPU.
"""
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import cli
from fake_chat_server import FakeChatServer
from grpo_jax import checkpoint, hosts, logging_io, rollout
from grpo_jax.rewards import Interrupted
from multihost_test import _env, _free_port


def _command(workdir, url, port, pid):
  return [sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k.py:tiny",
          f"--workdir={workdir}", '--config.rewards.names=("math_accuracy","quality")',
          "--config.rewards.weights=(1.0,0.5)", f"--config.rewards.quality.http.base_url={url}",
          "--config.rewards.quality.http.max_retries=0", "--config.sft.steps=0",
          "--config.mesh=(1,-1,1)", "--config.sampling.num_generations=2",
          "--config.sampling.max_new_tokens=6", "--config.train.prompts_per_step=4",
          "--config.train.dynamic_sampling=False", "--config.train.eval_examples=4",
          "--config.train.eval_every=0", "--config.train.tensorboard=False",
          "--config.data.synthetic_train=64", "--config.data.synthetic_test=8",
          f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={pid}"]


def test_sigterm_to_one_host_waiting_on_its_scorer_stops_both_at_the_same_step(tmp_path):
  workdir, port = tmp_path / "run", _free_port()
  logs = [tmp_path / f"process{pid}.log" for pid in (0, 1)]
  # Each process's start-up probe (2 requests) is answered; then every request is read and
  # never answered: both processes wait on their scorer in step 0 (timeout_s is 30 s).
  with FakeChatServer(max_requests=200, lifetime_s=600, fail_after=4, failure="silent") as server:
    procs = [subprocess.Popen(_command(workdir, server.url, port, pid), cwd=cli.REPO,
                              env=dict(_env(2), PYTHONFAULTHANDLER="1"), stdout=open(log, "w"), stderr=subprocess.STDOUT)
             for pid, log in enumerate(logs)]
    read = lambda: [log.read_text()[-3000:] for log in logs]
    try:
      deadline = time.monotonic() + 300
      # 4 probe requests, then step 0's 4 completions per process (2 prompts x G=2 each).
      while (server.requests < 4 + 8 and all(p.poll() is None for p in procs)
             and time.monotonic() < deadline):
        time.sleep(0.05)
      assert all(p.poll() is None for p in procs) and server.requests >= 12, read()
      time.sleep(0.5)
      t0 = time.monotonic()
      procs[0].send_signal(signal.SIGTERM)  # process 1 gets no signal
      saved = None  # when process 0 had saved the step (a save every process takes part in)
      while any(p.poll() is None for p in procs) and time.monotonic() < t0 + 60:
        if saved is None and "dropped the step, saved step 0 to" in logs[0].read_text():
          saved = time.monotonic() - t0
        time.sleep(0.05)
      exited = time.monotonic() - t0
      codes = [p.poll() for p in procs]
    finally:
      for p in procs:
        if p.poll() is None:  # stuck: its threads' Python stacks to its log (faulthandler)
          p.send_signal(signal.SIGABRT)
          try:
            p.wait(timeout=10)
          except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
  out = read()
  # The waits end within a poll on both processes, which agree and save the step together
  # (0.3 s here); the rest is the normal exit (summary, XLA and jax.distributed teardown: 6-15 s
  # on a loaded 2-core CPU). Both exit 143, stopped by a SIGTERM (process 1's came through
  # the shared interrupt), and the shared save says process 1 stopped at the same step.
  assert codes == [143, 143], (codes, exited, out)
  assert saved is not None and saved < 5.0, (saved, out)
  assert exited < 40.0, (exited, out)
  # The interrupted step was dropped on both: the checkpoint is the state before it.
  assert checkpoint.latest_step(str(workdir)) == 0
  assert not (workdir / "final_model").exists()
  assert [r["step"] for r in logging_io.read_jsonl(str(workdir / "metrics.jsonl"))] == [0]


# --- the two parts, each alone --------------------------------------------------------------------

class _Out:  # what sample_and_score reads of a sampler's output
  tokens, lengths, truncated, metrics = [[1, 2]], [2], [False], {}


@pytest.mark.parametrize("mine, others, raised, gathered", [
    (False, False, False, True),   # no one interrupted: the batch is gathered
    (True, True, True, False),     # this process interrupted: it says so, and raises
    (False, True, True, False),    # another one interrupted (this one in the collective)
])
def test_the_processes_agree_before_the_gather(monkeypatch, mine, others, raised, gathered):
  """sample_and_score with 2 processes (faked): every process enters the one agreement, and
  all raise Interrupted when any reward was interrupted, before the gather."""
  said, log = [], []
  monkeypatch.setattr(hosts, "count", lambda: 2)
  monkeypatch.setattr(hosts, "share", lambda n, even=True: slice(0, n))
  monkeypatch.setattr(hosts, "any_", lambda flag: said.append(flag) or flag or others)
  monkeypatch.setattr(rollout, "encode", lambda *a: rollout.Prompts(["p"], [[5]]))

  # This process's rows: 5 tokens, sampled in 0.5 s of the whole program (the gather is faked
  # to return the part as it is, so the batch's tokens are these 5).
  part = types.SimpleNamespace(lengths_B=np.array([2, 3]))

  def score(*a):
    if mine:
      raise Interrupted("waiting on the scorer")
    return part, {}, {"sampler/seconds": 0.5, "sampler/tokens_per_s": 4.0}, (0.0, 0.0)
  monkeypatch.setattr(rollout, "score_samples", score)
  monkeypatch.setattr(rollout, "_gather", lambda part, m, r: log.append(part) or (part, m))
  sampler = types.SimpleNamespace(generate=lambda *a, **kw: _Out())
  config = types.SimpleNamespace(sampling=types.SimpleNamespace(num_generations=1))
  call = lambda: rollout.sample_and_score(config, sampler, None, None, [{}], [], None)
  if raised:
    with pytest.raises(Interrupted):
      call()
  else:
    out = call()
    assert out[0] is part
    assert out[2]["sampler/tokens_per_s"] == 10.0  # the gathered batch's 5 tokens over 0.5 s
  assert said == [mine] and bool(log) == gathered


def test_an_event_set_on_one_process_is_set_on_the_other(tmp_path):
  """hosts.SharedEvents over two real processes (jax.distributed on localhost): process 0 sets
  its event; process 1's is set within a second, with no collective."""
  script = tmp_path / "shared.py"
  script.write_text(
      "import sys, threading, time\n"
      "from grpo_jax import hosts\n"
      "hosts.initialize(f'localhost:{sys.argv[2]}', 2, int(sys.argv[1]))\n"
      "event = threading.Event()\n"
      "shared = hosts.SharedEvents([event], poll_s=0.05)\n"
      "hosts.barrier('both watch')\n"
      "if hosts.index() == 0:\n"
      "  time.sleep(0.5)\n"
      "  event.set()\n"
      "  t0 = time.monotonic()\n"
      "else:\n"
      "  t0 = time.monotonic()\n"
      "  assert event.wait(10), 'not set'\n"
      "  print(f'set after {time.monotonic() - t0:.2f} s', flush=True)\n"
      "hosts.barrier('done')\n"
      "shared.stop()\n")
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port)], cwd=cli.REPO,
                            env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in (0, 1)]
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  waited = float(outs[1].split("set after ")[1].split(" s")[0])
  assert waited < 0.5 + 1.0, outs[1]  # process 0 sets it 0.5 s after the barrier
