"""A client for OpenAI-compatible chat-completions servers (vLLM, SGLang, ...).

Built for reward scoring inside a training loop, where the scorer is a remote dependency that
may be slow or down. `ChatClient.complete` never raises for network or server trouble: an item
that cannot be answered comes back as None and is counted (by the reason its last attempt
failed), so the caller applies its fallback. It raises `Interrupted` only when the caller's
`interrupt` event is set (the trainer's SIGTERM handler), within ~0.1 s.

Time is bounded for any input: each HTTP attempt has a socket timeout, attempts per item are
capped (1 + max_retries, exponential backoff with jitter), and the whole batch has a deadline
after which unfinished items are given up. Requests run on daemon threads, so one stuck on a
silent server delays neither the return of `complete` nor the interpreter's exit.

Connections are kept alive and reused across requests and batches (at most max_concurrency
idle ones are kept). Opening one per request cost a TCP (or TLS) handshake each time and
sent max_concurrency simultaneous connects at the server every batch: past a small listen
backlog (Python's http.server has 5) the kernel drops them and the client's SYN is resent
only after ~1 s, which stalled batches at concurrency 16 (benchmarks/http_client.py).

  client = ChatClient(HttpOptions(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-32B"))
  texts, counters = client.complete([[{"role": "user", "content": "2+2?"}]])
"""
from __future__ import annotations

import base64
import collections
import http.client
import json
import os
import random
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence

# HttpOptions is the options block rewards.quality.http; callers reach it here too, beside its client.
from grpo_jax.rewards.options import HttpOptions, json_object
from grpo_jax.rewards.scoring import Interrupted

Messages = Sequence[dict]
# Statuses worth another attempt: timeouts, rate limits and server-side errors.
_RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_POLL_S = 0.1  # how often a waiting batch looks at the interrupt event


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

  def __init__(self, kind: str, retry: bool, detail: str = ""):
    super().__init__(kind)
    self.kind, self.retry, self.detail = kind, retry, detail or kind


def _failure(e: BaseException) -> _Failure:
  """The failure kind of an exception raised while talking to the server."""
  detail = f"{type(e).__name__}: {e}"
  if isinstance(e, TimeoutError):  # socket.timeout is TimeoutError
    return _Failure("timeout", True, detail)
  if isinstance(e, ConnectionRefusedError):
    return _Failure("refused", True, detail)
  # Resets, drops, DNS and TLS errors, and http.client's protocol errors (RemoteDisconnected,
  # BadStatusLine, ...).
  return _Failure("connection", True, detail)


def _abort(conn: http.client.HTTPConnection) -> None:
  """Ends a request another thread is waiting on: shutdown wakes its blocked read (close alone
  does not), which then fails and closes the connection."""
  sock = conn.sock
  if sock is not None:
    try:
      sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass


def _dropped(conn: http.client.HTTPConnection) -> bool:
  """An idle keep-alive connection that is readable was closed by the server (or is out of step)."""
  if conn.sock is None:
    return True
  with selectors.DefaultSelector() as sel:
    sel.register(conn.sock, selectors.EVENT_READ)
    return bool(sel.select(0))


class ChatClient:
  """Chat-completions client: keep-alive connections, retries, a batch deadline and an LRU cache.

  `interrupt`: an Event that, once set, makes `complete` raise `Interrupted` (the caller stops).
  After each `complete`, `last_error` describes its latest failed attempt ('' if none failed).
  """

  def __init__(self, opts: HttpOptions, interrupt: threading.Event | None = None):
    self.opts = opts
    self._interrupt = interrupt or threading.Event()
    self._extra = json_object(opts.extra_body_json, "extra_body_json")
    self._cache = _LRU(opts.cache_size)
    url = urllib.parse.urlsplit(opts.base_url.rstrip("/") + "/chat/completions")
    self._https = url.scheme == "https"
    self._host, self._port = url.hostname, url.port or (443 if self._https else 80)
    self._path = urllib.parse.urlunsplit(("", "", url.path, url.query, ""))
    self._headers = {"Content-Type": "application/json"}
    if opts.api_key_env:
      key = os.environ.get(opts.api_key_env)
      if not key:
        raise ValueError(f"api_key_env: environment variable {opts.api_key_env!r} is not set")
      self._headers["Authorization"] = f"Bearer {key}"
    self._proxy, self._tunnel_headers = None, {}
    if opts.use_env_proxy and not urllib.request.proxy_bypass(url.netloc):
      proxy = urllib.request.getproxies().get(url.scheme)
      if proxy:
        self._proxy = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        auth = {}
        if self._proxy.username:
          creds = f"{urllib.parse.unquote(self._proxy.username)}:{urllib.parse.unquote(self._proxy.password or '')}"
          auth["Proxy-Authorization"] = "Basic " + base64.b64encode(creds.encode()).decode()
        if self._https:
          self._tunnel_headers = auth  # sent with CONNECT, the TLS session goes through
        else:
          self._path = urllib.parse.urlunsplit(url)  # a forwarding proxy wants the absolute URL
          self._headers.update(auth)
    self._idle: list[http.client.HTTPConnection] = []  # keep-alive connections, newest last
    self._idle_lock = threading.Lock()
    self.last_error = ""

  def _cache_key(self, messages: Messages) -> tuple[str, str]:
    return (self.opts.model, json.dumps(list(messages), sort_keys=True, ensure_ascii=True))

  def _connection(self, timeout: float) -> http.client.HTTPConnection:
    """An idle keep-alive connection, or a new one (it connects on its first request)."""
    with self._idle_lock:
      while self._idle:
        conn = self._idle.pop()
        if not _dropped(conn):
          conn.timeout = timeout
          conn.sock.settimeout(timeout)
          return conn
        conn.close()
    host, port = ((self._proxy.hostname, self._proxy.port or 80) if self._proxy
                  else (self._host, self._port))
    if self._https:
      conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl.create_default_context())
      if self._proxy:
        conn.set_tunnel(self._host, self._port, headers=self._tunnel_headers)
      return conn
    return http.client.HTTPConnection(host, port, timeout=timeout)

  def _keep(self, conn: http.client.HTTPConnection) -> None:
    with self._idle_lock:
      if conn.sock is not None and len(self._idle) < self.opts.max_concurrency:
        self._idle.append(conn)
        return
    conn.close()

  def _attempt(self, body: bytes, timeout: float, inflight: set, lock: threading.Lock) -> str:
    conn = self._connection(timeout)
    with lock:
      inflight.add(conn)  # complete() cuts it at the batch deadline
    try:
      conn.request("POST", self._path, body, self._headers)
      resp = conn.getresponse()
      raw = resp.read(self.opts.max_response_bytes + 1)
    except Exception as e:  # socket and protocol errors: the connection is in an unknown state
      conn.close()
      raise _failure(e) from None
    finally:
      with lock:
        inflight.discard(conn)
    # Reusable only when the whole body was read and the server keeps the connection open.
    if resp.isclosed() and not resp.will_close:
      self._keep(conn)
    else:
      conn.close()
    if not 200 <= resp.status < 300:
      text = raw[:300].decode("utf-8", "replace")
      raise _Failure(f"http_{resp.status}", resp.status in _RETRY_STATUSES, f"HTTP {resp.status}: {text}")
    if len(raw) > self.opts.max_response_bytes:
      raise _Failure("too_large", False, f"reply over max_response_bytes={self.opts.max_response_bytes}")
    try:
      content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
      content = None
    if not isinstance(content, str):
      text = raw[:300].decode("utf-8", "replace")
      raise _Failure("bad_json", True, f"no choices[0].message.content in the reply: {text}")
    return content

  def _one(self, messages: Messages, deadline: float, stop: threading.Event, counts: collections.Counter,
           lock: threading.Lock, failed_as: list, errors: list, inflight: set) -> str | None:
    """One item's answer, or None; `failed_as[0]` gets the kind of its latest failed attempt,
    `errors` (the batch's) its detail."""
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
        # Up to a second past the deadline, so that an attempt the deadline cuts short is
        # counted by complete() as deadline_exceeded, never as the server's timeout.
        return self._attempt(body, min(self.opts.timeout_s, remaining + 1.0), inflight, lock)
      except _Failure as f:
        with lock:
          counts[f"http_error/{f.kind}"] += 1
          failed_as[0] = f.kind
          errors.append(f.detail)
        if not f.retry:
          return None
      wait = min(self.opts.backoff_max_s, self.opts.backoff_s * 2 ** attempt) * random.uniform(0.5, 1.0)
      if attempt < self.opts.max_retries and stop.wait(min(wait, max(deadline - time.monotonic(), 0))):
        return None
    return None

  def complete(self, batch: Sequence[Messages]) -> tuple[list[str | None], dict[str, float]]:
    """One answer per conversation (None where none could be had) and counters for this batch.

    Counters: http_requests, http_retries, http_failures (items without an answer),
    cache_hits, deadline_exceeded (items still unanswered at the deadline),
    http_error/<kind> per failed attempt (timeout, refused, connection, bad_json, http_500, ...)
    and missing/<kind> per item without an answer: the kind of its latest failed attempt, or
    'deadline' if none had failed yet. Raises Interrupted once the interrupt event is set.
    """
    if self._interrupt.is_set():
      raise Interrupted("chat_http: interrupted before the batch started")
    counts: collections.Counter = collections.Counter()
    lock, stop, finished = threading.Lock(), threading.Event(), threading.Event()
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
    errors: list[str] = []  # this batch's failed attempts (a late thread of an earlier batch
    inflight: set = set()   # writes its own list, never this one); its open requests
    deadline = time.monotonic() + self.opts.deadline_s
    queue = collections.deque(todo)
    answers: dict[tuple, str | None] = {}
    failed_as = {key: ["deadline"] for key in todo}

    def worker():
      while True:
        with lock:
          if not queue or stop.is_set():
            return
          key = queue.popleft()
        try:
          answer = self._one(batch[todo[key][0]], deadline, stop, counts, lock, failed_as[key],
                             errors, inflight)
        except Exception:  # a bug in this client must not stop training: count it, fall back
          answer = None
          with lock:
            counts["http_error/internal"] += 1
            failed_as[key][0] = "internal"
        with lock:
          answers[key] = answer
          if len(answers) == len(todo):
            finished.set()

    for _ in range(min(self.opts.max_concurrency, len(todo))):
      threading.Thread(target=worker, name="chat_http", daemon=True).start()
    try:
      while todo and not finished.wait(min(_POLL_S, max(deadline - time.monotonic(), 0))):
        if self._interrupt.is_set():
          raise Interrupted(f"chat_http: interrupted with {len(todo) - len(answers)} of {len(todo)} requests unanswered")
        if time.monotonic() >= deadline:
          break
    finally:
      stop.set()  # no new attempts
      with lock:  # what the batch got by now; then no request stays in flight (a server
        answers = dict(answers)  # trickling bytes would hold its thread and socket for good)
        counts = collections.Counter(counts)
        kinds = {key: failed_as[key][0] for key in todo}
        self.last_error = errors[-1] if errors else ""
        for conn in inflight:
          _abort(conn)
    for key, idx in todo.items():
      answer = answers.get(key)
      if key not in answers:
        counts["deadline_exceeded"] += len(idx)
      if answer is None:
        counts[f"missing/{kinds[key]}"] += len(idx)
        continue
      self._cache.put(key, answer)
      for i in idx:
        results[i] = answer
    counts["http_failures"] = sum(r is None for r in results)
    for k in ("http_requests", "http_retries", "cache_hits", "deadline_exceeded"):
      counts.setdefault(k, 0)
    return results, {k: float(v) for k, v in counts.items()}
