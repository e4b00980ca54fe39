"""quality reward over HTTP, against a real loopback chat-completions server with faults."""
import json
import threading
import time

import pytest

from grpo_jax import config as config_lib, rewards as rewards_lib
from grpo_jax.rewards import chat_http, quality, scoring
from grpo_jax.rewards.options import HttpOptions, QualityOptions
from fake_chat_server import FakeChatServer

FALLBACK = 0.123


def _reward(url: str, **http_kw) -> quality.QualityReward:
  http = dict(base_url=url, model="judge", timeout_s=2.0, max_retries=2, backoff_s=0.01,
              backoff_max_s=0.05, deadline_s=20.0, max_concurrency=8)
  http.update(http_kw)
  return quality.QualityReward(QualityOptions(fallback=FALLBACK, question_column="", http=HttpOptions(**http)))


def test_grades_become_mean_over_five():
  grades = [(5, 5, 5, 5), (1, 1, 1, 1), (4, 3, 5, 2), (2, 5, 1, 4)]
  completions = [f"answer {i} [score={a},{g},{inf},{c}]" for i, (a, g, inf, c) in enumerate(grades)]
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    r = _reward(server.url, extra_body_json='{"chat_template_kwargs": {"enable_thinking": false}}')
    got = r(["What is 2+2?"] * 4, completions, group_size=2)
    assert server.requests == 4
    body = server.bodies[0]
  assert got == pytest.approx([sum(g) / 4 / 5 for g in grades], abs=1e-12)
  assert min(got) == pytest.approx(0.2) and max(got) == pytest.approx(1.0)
  assert body["model"] == "judge" and body["temperature"] == 0.0
  assert body["chat_template_kwargs"] == {"enable_thinking": False}
  content = body["messages"][-1]["content"]
  assert "What is 2+2?" in content and "answer" in content
  assert r.last_metrics["http_failures"] == 0 and r.last_metrics["fallback_frac"] == 0


def test_faults_get_the_fallback_and_are_counted_with_bounded_retries():
  kinds = ["[flaky=1] [score=5,5,5,5]", "[500]", "[drop]", "[badjson]", "[nochoices]", "[prose]",
           "[score=1,2,3,4]"]
  completions = [f"item {k}" for k in kinds]
  with FakeChatServer(max_requests=100, lifetime_s=30) as server:
    # A generous timeout: client and server share one process (and GIL) on a busy machine, and
    # no reply here should ever count as slow.
    r = _reward(server.url, timeout_s=5.0)
    got = r(["q"] * len(kinds), completions, group_size=1)
    per_prompt = {k: n for k in kinds for p, n in server.per_prompt.items() if k in p}
  assert got == [1.0, FALLBACK, FALLBACK, FALLBACK, FALLBACK, FALLBACK, pytest.approx(0.5)]
  # 1 + max_retries attempts for every retryable failure, never more; one attempt otherwise.
  assert per_prompt == {kinds[0]: 2, "[500]": 3, "[drop]": 3, "[badjson]": 3, "[nochoices]": 3,
                        "[prose]": 1, kinds[-1]: 1}
  m = r.last_metrics
  assert m["http_failures"] == 4 and m["parse_failures"] == 1
  assert m["fallback_frac"] == pytest.approx(5 / 7)
  assert m["http_requests"] == 16 and m["http_retries"] == 9
  assert m["http_error/http_500"] == 4 and m["http_error/bad_json"] == 6 and m["http_error/connection"] == 3
  # Each item without a grade is counted once, by why: its last failed attempt, or its reply.
  assert {k: v for k, v in m.items() if k.startswith("missing/")} == {
      "missing/http_500": 1, "missing/connection": 1, "missing/bad_json": 2, "missing/unparseable": 1}


def test_slow_answers_time_out_with_bounded_retries():
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    r = _reward(server.url, timeout_s=1.0, max_retries=1)
    t0 = time.monotonic()
    got = r(["q"] * 2, ["a [slow=3]", "b [score=5,5,5,5]"], group_size=2)
    elapsed = time.monotonic() - t0
    slow_attempts = sum(n for p, n in server.per_prompt.items() if "[slow=3]" in p)
  assert got == [FALLBACK, 1.0]
  assert slow_attempts == 2 and r.last_metrics["http_error/timeout"] == 2
  assert r.last_metrics["http_failures"] == 1 and r.last_metrics["missing/timeout"] == 1
  assert "timed out" in r.last_problem
  # Two 1 s timeouts and a tiny backoff, not one 3 s reply (let alone two).
  assert elapsed < 2.9


def test_batch_deadline_bounds_the_call():
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    r = _reward(server.url, timeout_s=10.0, deadline_s=1.0)
    t0 = time.monotonic()
    got = r(["q"] * 3, ["a [slow=3]", "b [slow=3]", "c [score=5,5,5,5]"], group_size=3)
    elapsed = time.monotonic() - t0
  assert got == [FALLBACK, FALLBACK, 1.0]
  assert r.last_metrics["deadline_exceeded"] == 2 and r.last_metrics["http_failures"] == 2
  assert r.last_metrics["missing/deadline"] == 2
  assert elapsed < 2.0  # the deadline, not the 3 s replies nor the 10 s timeout


def test_requests_in_flight_at_the_deadline_are_ended():
  """The deadline ends the requests still waiting (a server that trickles bytes, or one that
  answers late, would otherwise hold a thread and a socket per request past the batch)."""
  import threading
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    r = _reward(server.url, timeout_s=10.0, deadline_s=1.0)
    got = r(["q"] * 2, ["a [slow=4]", "b [slow=4]"], group_size=2)
    t0 = time.monotonic()
    while any(t.name == "chat_http" for t in threading.enumerate()) and time.monotonic() - t0 < 2:
      time.sleep(0.05)
    lingering = [t for t in threading.enumerate() if t.name == "chat_http"]
  assert got == [FALLBACK, FALLBACK] and r.last_metrics["missing/deadline"] == 2
  assert not lingering and time.monotonic() - t0 < 1.0  # not at the 4 s replies


def test_cache_and_in_batch_deduplication():
  completions = ["x [score=4,4,4,4]", "y [score=2,2,2,2]", "x [score=4,4,4,4]"]
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    r = _reward(server.url)
    first = r(["q"] * 3, completions, group_size=3)
    assert server.requests == 2  # the duplicate prompt is asked once
    second = r(["q"] * 3, completions, group_size=3)
    assert server.requests == 2  # everything from the cache
    assert r.last_metrics["cache_hits"] == 3 and r.last_metrics["http_requests"] == 0
    # A different model name is a different cache key.
    other = _reward(server.url, model="other-judge")
    other._complete.__self__._cache = r._complete.__self__._cache
    other(["q"], completions[:1], group_size=1)
    assert server.requests == 3
  assert first == second == pytest.approx([0.8, 0.4, 0.8])


def test_concurrency_is_bounded():
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    r = _reward(server.url, max_concurrency=2)
    t0 = time.monotonic()
    got = r(["q"] * 6, [f"{i} [slow=0.2] [score=3,3,3,3]" for i in range(6)], group_size=6)
    elapsed = time.monotonic() - t0
    assert server.peak_in_flight == 2
  assert got == pytest.approx([0.6] * 6)
  assert elapsed >= 0.55  # three waves of two 0.2 s requests


def test_connections_are_kept_alive_across_batches():
  with FakeChatServer(max_requests=50, lifetime_s=30) as server:
    r = _reward(server.url, max_concurrency=4)
    for batch in range(3):
      got = r(["q"] * 8, [f"{batch}.{i} [slow=0.02] [score=4,4,4,4]" for i in range(8)], group_size=8)
      assert got == pytest.approx([0.8] * 8) and r.last_metrics["http_requests"] == 8
    # 24 requests over at most max_concurrency connections: no handshake per request, and no
    # burst of connects at the server each batch.
    assert server.requests == 24 and server.connections <= 4


def test_connections_the_server_closed_are_replaced_without_errors():
  with FakeChatServer(max_requests=50, lifetime_s=30) as server:
    r = _reward(server.url, max_concurrency=2)
    assert r(["q"] * 4, [f"{i} [hangup] [score=5,5,5,5]" for i in range(4)], group_size=4) == [1.0] * 4
    time.sleep(0.2)  # the server's FINs arrive (as after a real server's keep-alive timeout)
    assert r(["q"] * 4, [f"{i} [score=5,5,5,5]" for i in range(4)], group_size=4) == [1.0] * 4
    assert r.last_metrics["http_requests"] == 4 and r.last_metrics["http_retries"] == 0
    assert server.connections >= 4


def test_interrupt_ends_the_wait_on_a_silent_server():
  interrupt = threading.Event()
  with FakeChatServer(max_requests=50, lifetime_s=30, fail_after=0, failure="silent") as server:
    r = quality.QualityReward(QualityOptions(question_column="", http=HttpOptions(
        base_url=server.url, model="judge", timeout_s=30.0, deadline_s=60.0)), interrupt=interrupt)
    timer = threading.Timer(0.5, interrupt.set)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(scoring.Interrupted):
      r(["q"] * 3, ["a", "b", "c"], group_size=3)
    elapsed = time.monotonic() - t0
    assert server.requests == 3  # all three were waiting on the server
    # The threads still blocked on their sockets cannot delay the interpreter's exit.
    assert all(t.daemon for t in threading.enumerate() if t.name == "chat_http")
    with pytest.raises(scoring.Interrupted):  # once set, no new batch starts
      r(["q"], ["d"], group_size=1)
  assert 0.5 <= elapsed < 2.0  # polls every 0.1 s; slack for a busy machine


def test_env_proxy_is_used_only_when_asked(monkeypatch):
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    # The fake server plays a forwarding proxy: scorer.invalid does not resolve, so a grade
    # can only come through it.
    monkeypatch.setenv("http_proxy", server.url.removesuffix("/v1"))
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    via_proxy = _reward("http://scorer.invalid/v1", use_env_proxy=True)
    assert via_proxy(["q"], ["a [score=5,5,5,5]"], group_size=1) == [1.0]
    direct = _reward("http://scorer.invalid/v1", max_retries=0)
    assert direct(["q"], ["b [score=5,5,5,5]"], group_size=1) == [FALLBACK]
    assert server.requests == 1 and direct.last_metrics["missing/connection"] == 1


def test_server_down_never_crashes():
  with FakeChatServer(max_requests=1, lifetime_s=5) as server:
    url = server.url
  # The server has stopped and its port is closed: connections are refused.
  r = _reward(url)
  assert r(["q"] * 2, ["a", "b"], group_size=2) == [FALLBACK, FALLBACK]
  m = r.last_metrics
  assert m["http_failures"] == 2 and m["http_error/refused"] == 6 and m["missing/refused"] == 2
  assert r.last_problem.startswith("no reply (refused 2): ConnectionRefusedError")


def test_metrics_flow_through_score():
  cfg = config_lib.rewards()
  with FakeChatServer(max_requests=20, lifetime_s=30) as server:
    cfg.names, cfg.weights = ("quality", "format"), (0.5, 1.0)
    cfg.quality.http.base_url = server.url
    cfg.quality.http.max_retries = 1
    cfg.quality.http.backoff_s = 0.01
    rewards = rewards_lib.build_rewards(cfg)
    R, metrics = rewards_lib.score(rewards, ["q"] * 4,
                                   ["a [score=5,5,5,5]", "b [500]", "c [score=1,1,1,1]", "d [drop]"],
                                   group_size=2, columns={"answer": ["#### 1"] * 4, "question": ["q"] * 4})
  assert R.shape == (4, 2) and R.dtype.name == "float32"
  assert R[0, 0] == 1.0 and R[2, 0] == pytest.approx(0.2)
  assert json.dumps(R[[1, 3], 0].tolist()) == "[NaN, NaN]"  # fallback None -> NaN
  assert metrics["reward/quality/missing_frac"] == 0.5
  assert metrics["reward/quality/mean"] == pytest.approx(0.6)
  assert metrics["reward/quality/http_failures"] == 2.0
  assert metrics["reward/format/mean"] == pytest.approx(-0.1)


def test_bad_http_settings_name_the_field():
  with pytest.raises(ValueError, match="base_url"):
    HttpOptions(base_url="localhost:8000")
  with pytest.raises(ValueError, match="extra_body_json"):
    HttpOptions(extra_body_json="{nope")
  with pytest.raises(ValueError, match="api_key_env.*GRPO_JAX_TEST_NO_SUCH_KEY"):
    chat_http.ChatClient(HttpOptions(api_key_env="GRPO_JAX_TEST_NO_SUCH_KEY"))


def test_a_client_bug_is_counted_not_raised(monkeypatch):
  client = chat_http.ChatClient(HttpOptions(base_url="http://127.0.0.1:9/v1"))

  def broken(*args):
    raise ZeroDivisionError("bug")

  monkeypatch.setattr(client, "_one", broken)
  results, counts = client.complete([[{"role": "user", "content": "x"}]])
  assert results == [None] and counts["http_error/internal"] == 1 and counts["http_failures"] == 1
