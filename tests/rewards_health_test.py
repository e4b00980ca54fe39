"""Rewards fail loudly: the start-up probe, the per-step watch on missing scores, and SIGTERM
during a wait on a silent scorer, down to the real command line."""
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import cli
import fixtures
from configs import gsm8k
from fake_chat_server import FakeChatServer
from grpo_jax import checkpoint, logging_io, tokenizer as tokenizer_lib, train
from grpo_jax.rewards import MissingRewardsError, Reward, RewardHealth, probe, quality
from grpo_jax.rewards.options import HttpOptions, QualityOptions

REPO = cli.REPO


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]  # nothing listens once the socket is closed: refused


def _quality(url: str, **http_kw) -> Reward:
  http = HttpOptions(base_url=url, model="judge", max_retries=0, **http_kw)
  return Reward("quality", 0.5, quality.QualityReward(QualityOptions(question_column="", http=http)))


# --- the probe ---------------------------------------------------------------------------------

def test_probe_passes_a_working_scorer_and_skips_pure_rewards():
  with FakeChatServer(max_requests=10, lifetime_s=30) as server:
    math_reward = Reward("math_accuracy", 1.0, lambda p, c, **kw: [None] * len(c))  # never asked
    probe([math_reward, _quality(server.url)], ["q1", "q2"], ["a", "b"], {}, allow_missing=False)
    assert server.requests == 2


def test_probe_names_the_reward_the_url_and_why():
  url = f"http://127.0.0.1:{_closed_port()}/v1"
  with pytest.raises(MissingRewardsError, match=rf"rewards\.quality: .*{url} .*refused.*allow_missing"):
    probe([_quality(url)], ["q"] * 2, ["a", "b"], {}, allow_missing=False)
  with FakeChatServer(max_requests=10, lifetime_s=30) as server:
    with pytest.raises(MissingRewardsError, match=r"not a JSON grade: .*four out of five"):
      probe([_quality(server.url)], ["q"] * 2, ["a [prose]", "b [prose]"], {}, allow_missing=False)
    # A fallback value stands in for the grade: still a failed probe.
    fallback = Reward("quality", 1.0, quality.QualityReward(QualityOptions(
        fallback=0.5, question_column="", http=HttpOptions(base_url=server.url, max_retries=0))))
    with pytest.raises(MissingRewardsError, match=r"http_500 2.*HTTP 500"):
      probe([fallback], ["q"] * 2, ["a [500]", "b [500]"], {}, allow_missing=False)


def test_allow_missing_turns_the_probe_into_a_warning():
  lines = []
  probe([_quality(f"http://127.0.0.1:{_closed_port()}/v1")], ["q"] * 2, ["a", "b"], {},
        allow_missing=True, log=lines.append)
  assert len(lines) == 1 and "warning" in lines[0] and "refused" in lines[0]


# --- the per-step watch ------------------------------------------------------------------------

def _metrics(missing_frac, **reasons):
  return {"reward/quality/missing_frac": missing_frac, "reward/math_accuracy/missing_frac": 0.0,
          **{f"reward/quality/missing/{k}": v for k, v in reasons.items()}}


def test_health_warns_on_bad_steps_and_stops_after_n_in_a_row():
  rewards = [Reward("math_accuracy", 1.0, None), _quality("http://scorer:8000/v1")]
  lines = []
  health = RewardHealth(rewards, max_steps=3, log=lines.append)
  health.update(1, _metrics(0.5, timeout=3, refused=5))
  health.update(2, _metrics(0.49))  # under half: the streak starts again
  assert len(lines) == 1
  assert "'quality' missing on 50% of completions at step 1 from http://scorer:8000/v1" in lines[0]
  assert "(refused 5, timeout 3)" in lines[0] and "[1/3 bad steps in a row]" in lines[0]
  health.update(3, _metrics(1.0, http_503=8))
  health.update(4, _metrics(1.0, http_503=8))
  with pytest.raises(MissingRewardsError, match=r"'quality' missing on 100% .* step 5 .*http_503 8.*3 steps in a row"):
    health.update(5, _metrics(1.0, http_503=8))
  assert len(lines) == 4
  # Quality with a fallback is never NaN, but its fallback_frac says how often it stood in.
  health = RewardHealth(rewards, max_steps=1, log=lines.append)
  with pytest.raises(MissingRewardsError, match="deadline_s"):
    health.update(1, {"reward/quality/missing_frac": 0.0, "reward/quality/fallback_frac": 0.75,
                      "reward/quality/missing/deadline": 6})


def test_health_with_max_steps_0_only_warns():
  lines = []
  health = RewardHealth([Reward("verifier", 1.0, None)], max_steps=0, log=lines.append)
  for step in range(10):
    health.update(step, {"reward/verifier/missing_frac": 1.0})
  assert len(lines) == 10 and "no reason given" in lines[0] and "[10 bad steps in a row]" in lines[-1]


# --- the trainer -------------------------------------------------------------------------------

def _tiny_config(**train_kw):
  config = gsm8k.get_config("tiny")
  config.data.synthetic_train, config.data.synthetic_test = 64, 8
  config.sampling.num_generations = 2
  config.sampling.max_new_tokens = 6
  config.sft.steps = 0
  config.mesh = (1, 1, 1)  # one of the fake devices: less to compile
  # One sampling round per step: the scorer request counts below assume it.
  config.train.update(steps=5, prompts_per_step=4, eval_examples=4, eval_batch_size=4, eval_every=0,
                      checkpoint_every=100, tensorboard=False, dynamic_sampling=False, **train_kw)
  return config


def test_an_unparseable_local_judge_stops_the_run_at_start_up(tmp_path):
  tok = tokenizer_lib.build_tiny_tokenizer(str(tmp_path / "tok"))
  judge = fixtures.make_checkpoint(tmp_path, "qwen2_tied", vocab_size=272)
  config = _tiny_config()
  config.rewards.names, config.rewards.weights = ("math_accuracy", "quality"), (1.0, 0.5)
  config.rewards.quality.backend = "local"
  config.rewards.quality.local.update(checkpoint=str(judge), tokenizer=tok, dtype="float32",
                                      batch_size=2, max_prompt_tokens=64, max_new_tokens=4)
  # A random tiny model never writes a JSON grade.
  with pytest.raises(MissingRewardsError, match=rf"rewards\.quality: .*local judge {judge} .*not a JSON grade"):
    train.run(config, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before the model was built


@pytest.mark.parametrize("off_policy_steps", [0, 1])
def test_a_scorer_that_breaks_mid_run_stops_it_after_n_steps_with_a_checkpoint(tmp_path, capsys,
                                                                              off_policy_steps):
  config = _tiny_config(max_missing_reward_steps=3, off_policy_steps=off_policy_steps)
  config.rewards.names, config.rewards.weights = ("math_accuracy", "quality"), (1.0, 0.5)
  # The probe's two requests are answered; every later one gets HTTP 500.
  with FakeChatServer(max_requests=100, lifetime_s=300, fail_after=2) as server:
    config.rewards.quality.http.update(base_url=server.url, max_retries=0)
    with pytest.raises(MissingRewardsError, match=rf"'quality' missing on 100% .* step 3 from {server.url}"
                                                  r" .*http_500 8.*3 steps in a row.*saved"):
      train.run(config, str(tmp_path))
    # One step behind, step 4's batch is sampled before step 3 stops the run: its scoring may
    # have sent its requests too.
    assert server.requests in ((2 + 3 * 8, 2 + 4 * 8) if off_policy_steps else (2 + 3 * 8,))
  warnings = [l for l in capsys.readouterr().err.splitlines() if "warning: reward 'quality'" in l]
  assert len(warnings) == 3 and "[3/3 bad steps in a row]" in warnings[-1]
  assert checkpoint.latest_step(str(tmp_path)) == 3
  records = logging_io.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["reward/quality/missing_frac"] for r in records[1:]] == [1.0, 1.0, 1.0]
  assert [r["reward/quality/missing/http_500"] for r in records[1:]] == [8.0, 8.0, 8.0]


# --- the real command --------------------------------------------------------------------------

def _command(workdir, url, *extra):
  return [sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k.py:tiny", f"--workdir={workdir}",
          '--config.rewards.names=("math_accuracy","quality")', "--config.rewards.weights=(1.0,0.5)",
          f"--config.rewards.quality.http.base_url={url}", "--config.sft.steps=0",
          "--config.train.prompts_per_step=4", "--config.train.eval_examples=4",
          "--config.train.eval_every=0", "--config.train.tensorboard=False",
          "--config.data.synthetic_train=64", "--config.data.synthetic_test=8", *extra]


def test_cli_exits_2_naming_the_reward_and_url_when_the_scorer_is_unreachable(tmp_path):
  url = f"http://127.0.0.1:{_closed_port()}/v1"
  done = subprocess.run(_command(tmp_path, url, "--config.rewards.quality.http.backoff_s=0.05"),
                        cwd=REPO, env=cli.env(), capture_output=True, text=True, timeout=300)
  message = cli.assert_user_error(done, "rewards.quality: ", url)
  assert message.startswith("grpo_jax: error: rewards.quality: ")
  assert "refused" in done.stderr and "allow_missing" in done.stderr


@pytest.mark.parametrize("off_policy_steps", [0, 1])
def test_cli_sigterm_during_a_wait_on_a_silent_scorer_exits_within_5_s(tmp_path, off_policy_steps):
  # Answers the probe, then reads every request and never answers (until the test ends). One
  # step behind, the wait is the main thread's on the scoring thread's (pipeline.Pipeline).
  with FakeChatServer(max_requests=100, lifetime_s=600, fail_after=2, failure="silent") as server:
    # Its own compilation cache, as every run here gets at its first test: a process exits
    # only once a compile in flight ends (the train step's, started ahead at the loop's start),
    # and a cache that holds all but one program would leave that one compiling at the signal.
    proc = subprocess.Popen(_command(tmp_path / "run", server.url,
                                     f"--config.train.off_policy_steps={off_policy_steps}"),
                            cwd=REPO, env=cli.env(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []  # (arrival time, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), l) for l in proc.stdout))
    reader.start()
    try:
      deadline = time.monotonic() + 300
      while server.requests <= 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
      assert proc.poll() is None and server.requests > 2, "".join(l for _, l in lines)[-3000:]
      time.sleep(0.5)  # well inside the first step's wait (timeout_s is 30)
      t0 = time.monotonic()
      proc.send_signal(signal.SIGTERM)
      proc.wait(timeout=60)
      exited = time.monotonic() - t0
    finally:
      if proc.poll() is None:
        proc.kill()
      reader.join(timeout=10)
  out = "".join(l for _, l in lines)
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
  saved = [t - t0 for t, l in lines
           if "grpo_jax: interrupted (SIGTERM) in GRPO step 1 of" in l
           and "waiting on a reward's scorer: dropped the step, saved step 0 to" in l]
  # The wait ends at once (it polls every 0.1 s); the rest is the run's normal exit (summary,
  # plots, XLA teardown: ~3 s here).
  assert saved and saved[0] < 2.0, (saved, out[-3000:])
  assert exited < 5.0, (exited, out[-3000:])
  # The interrupted step was dropped: the checkpoint is the state before it, and resuming
  # starts again at step 0 with the same prompts.
  assert checkpoint.latest_step(str(tmp_path / "run")) == 0
  assert not (tmp_path / "run" / "final_model").exists()
  assert [r["step"] for r in logging_io.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == [0]
