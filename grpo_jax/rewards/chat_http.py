"""A client for OpenAI-compatible chat-completions servers (vLLM, SGLang, ...).

Built for reward scoring inside a training loop, where the scorer is a remote dependency that
may be slow or down. `ChatClient.complete` never raises for network or server trouble: an item
that cannot be answered comes back as None and is counted, so the caller applies its fallback.

Time is bounded for any input: each HTTP attempt has a socket timeout, attempts per item are
capped (1 + max_retries, exponential backoff with jitter), and the whole batch has a deadline
after which unfinished items are given up (their threads stop at their next socket timeout,
so interpreter exit may wait up to timeout_s for them).

  client = ChatClient(HttpOptions(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-32B"))
  texts, counters = client.complete([[{"role": "user", "content": "2+2?"}]])
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from grpo_jax.rewards import options

Messages = Sequence[dict]
# Statuses worth another attempt: timeouts, rate limits and server-side errors.
_RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclasses.dataclass(frozen=True)
class HttpOptions:
  base_url: str = "http://127.0.0.1:8000/v1"  # the server's OpenAI root; /chat/completions is appended
  model: str = "Qwen/Qwen3-32B"
  api_key_env: str = ""  # name of an environment variable holding the key (never the key itself)
  max_concurrency: int = 16
  timeout_s: float = 120.0  # per attempt (socket timeout)
  max_retries: int = 3
  backoff_s: float = 1.0  # first retry waits ~backoff_s, doubling up to backoff_max_s
  backoff_max_s: float = 16.0
  deadline_s: float = 900.0  # the whole batch; items unfinished by then fail
  max_tokens: int = 512
  temperature: float = 0.0
  # JSON merged into every request body. The default turns Qwen3's thinking off on vLLM/SGLang
  # (a grade needs no chain of thought, and thinking would blow max_tokens); templates of other
  # models ignore it.
  extra_body_json: str = '{"chat_template_kwargs": {"enable_thinking": false}}'
  cache_size: int = 200_000  # entries; 0 disables the cache
  max_response_bytes: int = 1 << 20
  use_env_proxy: bool = False  # loopback scorers must not be sent through an HTTP proxy

  def __post_init__(self):
    options.check(self.base_url.startswith(("http://", "https://")), "base_url", f"must be an http(s) URL, got {self.base_url!r}")
    options.check(bool(self.model), "model", "must name the served model")
    for f in ("max_concurrency", "max_response_bytes"):
      options.check(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
    for f in ("max_retries", "cache_size", "max_tokens"):
      options.check(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f, "must be an int >= 0")
    for f in ("timeout_s", "deadline_s"):
      options.check(getattr(self, f) > 0, f, "must be > 0")
    for f in ("backoff_s", "backoff_max_s"):
      options.check(getattr(self, f) >= 0, f, "must be >= 0")
    if self.extra_body_json:
      try:
        extra = json.loads(self.extra_body_json)
      except json.JSONDecodeError as e:
        raise ValueError(f"extra_body_json: not valid JSON ({e})") from e
      options.check(isinstance(extra, dict), "extra_body_json", "must be a JSON object")


class _LRU:
  def __init__(self, size: int):
    self._size, self._data, self._lock = size, collections.OrderedDict(), threading.Lock()

  def get(self, key):
    with self._lock:
      if key in self._data:
        self._data.move_to_end(key)
        return self._data[key]
    return None

  def put(self, key, value) -> None:
    if self._size == 0:
      return
    with self._lock:
      self._data[key] = value
      self._data.move_to_end(key)
      while len(self._data) > self._size:
        self._data.popitem(last=False)


class _Failure(Exception):
  """One failed attempt; `retry` says whether another attempt may succeed."""

  def __init__(self, kind: str, retry: bool):
    super().__init__(kind)
    self.kind, self.retry = kind, retry


class ChatClient:
  """Thread-pooled chat-completions client with retries, a batch deadline and an LRU cache."""

  def __init__(self, opts: HttpOptions):
    self.opts = opts
    self._url = opts.base_url.rstrip("/") + "/chat/completions"
    self._extra = json.loads(opts.extra_body_json) if opts.extra_body_json else {}
    self._cache = _LRU(opts.cache_size)
    handlers = [] if opts.use_env_proxy else [urllib.request.ProxyHandler({})]
    self._opener = urllib.request.build_opener(*handlers)
    self._headers = {"Content-Type": "application/json"}
    if opts.api_key_env:
      key = os.environ.get(opts.api_key_env)
      if not key:
        raise ValueError(f"api_key_env: environment variable {opts.api_key_env!r} is not set")
      self._headers["Authorization"] = f"Bearer {key}"

  def _cache_key(self, messages: Messages) -> tuple[str, str]:
    return (self.opts.model, json.dumps(list(messages), sort_keys=True, ensure_ascii=True))

  def _attempt(self, body: bytes, timeout: float) -> str:
    req = urllib.request.Request(self._url, data=body, headers=self._headers, method="POST")
    try:
      with self._opener.open(req, timeout=timeout) as resp:
        raw = resp.read(self.opts.max_response_bytes + 1)
    except urllib.error.HTTPError as e:
      e.close()
      raise _Failure(f"http_{e.code}", e.code in _RETRY_STATUSES) from None
    except (TimeoutError, OSError) as e:  # socket timeouts, refused/reset/dropped connections
      raise _Failure("timeout" if "timed out" in str(e) else "connection", True) from None
    except Exception:  # http.client protocol errors (RemoteDisconnected, BadStatusLine, ...)
      raise _Failure("connection", True) from None
    if len(raw) > self.opts.max_response_bytes:
      raise _Failure("too_large", False)
    try:
      content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
      raise _Failure("bad_json", True) from None
    if not isinstance(content, str):
      raise _Failure("bad_json", True)
    return content

  def _one(self, messages: Messages, deadline: float, stop: threading.Event, counts: collections.Counter,
           lock: threading.Lock) -> str | None:
    body = json.dumps({
        **self._extra, "model": self.opts.model, "messages": list(messages),
        "max_tokens": self.opts.max_tokens, "temperature": self.opts.temperature,
    }, ensure_ascii=True).encode()
    for attempt in range(self.opts.max_retries + 1):
      remaining = deadline - time.monotonic()
      if stop.is_set() or remaining <= 0:
        return None
      with lock:
        counts["http_requests"] += 1
        counts["http_retries"] += attempt > 0
      try:
        return self._attempt(body, min(self.opts.timeout_s, remaining))
      except _Failure as f:
        with lock:
          counts[f"http_error/{f.kind}"] += 1
        if not f.retry:
          return None
      wait = min(self.opts.backoff_max_s, self.opts.backoff_s * 2 ** attempt) * random.uniform(0.5, 1.0)
      if attempt < self.opts.max_retries and stop.wait(min(wait, max(deadline - time.monotonic(), 0))):
        return None
    return None

  def complete(self, batch: Sequence[Messages]) -> tuple[list[str | None], dict[str, float]]:
    """One answer per conversation (None where none could be had) and counters for this batch.

    Counters: http_requests, http_retries, http_failures (items without an answer),
    cache_hits, deadline_exceeded (items still unanswered at the deadline), and
    http_error/<kind> per failed attempt (timeout, connection, bad_json, http_500, ...).
    """
    counts: collections.Counter = collections.Counter()
    lock, stop = threading.Lock(), threading.Event()
    results: list[str | None] = [None] * len(batch)
    todo: dict[tuple, list[int]] = {}
    for i, messages in enumerate(batch):
      key = self._cache_key(messages)
      hit = self._cache.get(key)
      if hit is not None:
        results[i] = hit
        counts["cache_hits"] += 1
      else:
        todo.setdefault(key, []).append(i)  # identical prompts in a batch are asked once
    deadline = time.monotonic() + self.opts.deadline_s
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.opts.max_concurrency,
                                                 thread_name_prefix="chat_http")
    try:
      futures = {pool.submit(self._one, batch[idx[0]], deadline, stop, counts, lock): key
                 for key, idx in todo.items()}
      done, not_done = concurrent.futures.wait(futures, timeout=max(deadline - time.monotonic(), 0))
      stop.set()
      counts["deadline_exceeded"] += sum(len(todo[futures[f]]) for f in not_done)
      for f in done:
        try:
          answer = f.result()
        except Exception:  # a bug in this client must not stop training: count it, fall back
          counts["http_error/internal"] += 1
          answer = None
        if answer is not None:
          self._cache.put(futures[f], answer)
          for i in todo[futures[f]]:
            results[i] = answer
    finally:
      stop.set()
      pool.shutdown(wait=False, cancel_futures=True)
    counts["http_failures"] = sum(r is None for r in results)
    for k in ("http_requests", "http_retries", "cache_hits", "deadline_exceeded"):
      counts.setdefault(k, 0)
    return results, {k: float(v) for k, v in counts.items()}
