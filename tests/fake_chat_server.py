"""A real HTTP server on 127.0.0.1 that speaks OpenAI chat-completions, with scripted faults.

The behaviour for a request is chosen by markers in its last user message, so a test states
what each item should suffer:
  [score=a,g,i,c]   reply with that JSON grade (default: 3,3,3,3)
  [reply=TEXT]      reply with TEXT itself (up to the next ']'): an agent role's answer
  [slow=S]          sleep S seconds before replying (peak_in_flight counts concurrent sleepers)
  [500]             always answer HTTP 500
  [flaky=N]         answer HTTP 500 to the first N requests for this prompt, then normally
  [drop]            close the connection without any response
  [badjson]         200 with a body that is not JSON
  [nochoices]       200 with valid JSON lacking 'choices'
  [prose]           200 whose message content is not a grade
  [hangup]          reply normally, then close the kept-alive connection without notice
A scorer that breaks mid-run: after `fail_after` requests every request gets `failure`:
'500' (HTTP 500) or 'silent' (read, never answered until the server stops).
The server is bounded: it refuses (drops) requests beyond max_requests and shuts itself down
after lifetime_s even if a test forgets to stop it. `connections` counts accepted connections.
"""
from __future__ import annotations

import collections
import http.server
import json
import re
import sys
import threading
import time

_SCORE_RE = re.compile(r"\[score=(\d),(\d),(\d),(\d)\]")
_SLOW_RE = re.compile(r"\[slow=([\d.]+)\]")
_FLAKY_RE = re.compile(r"\[flaky=(\d+)\]")
_REPLY_RE = re.compile(r"\[reply=([^\]]*)\]")


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  # socketserver's default backlog of 5 overflows when 16 clients connect at once, and the
  # kernel then drops connects that are retried only after ~1 s; real servers (uvicorn) use 2048.
  request_queue_size = 128

  def handle_error(self, request, client_address):
    # A client that timed out and left makes the late reply fail: expected, not worth a trace.
    if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
      super().handle_error(request, client_address)


class FakeChatServer:
  def __init__(self, max_requests: int = 500, lifetime_s: float = 60.0,
               fail_after: int | None = None, failure: str = "500"):
    assert failure in ("500", "silent"), failure
    self.max_requests, self.fail_after, self.failure = max_requests, fail_after, failure
    self.connections = 0
    self.released = threading.Event()  # set by stop(): silent handlers return
    self.lock = threading.Lock()
    self.requests = 0
    self.per_prompt = collections.Counter()
    self.bodies: list[dict] = []
    self.in_flight = 0
    self.peak_in_flight = 0
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"
      # Headers and body go out in two writes; with Nagle's algorithm the body waits for the
      # client's (delayed, up to 40 ms) ACK of the headers on a keep-alive connection. Real
      # servers set TCP_NODELAY too.
      disable_nagle_algorithm = True

      def log_message(self, *args):  # keep test output clean
        pass

      def setup(self):
        super().setup()
        with server.lock:
          server.connections += 1

      def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        prompt = body["messages"][-1]["content"]
        with server.lock:
          server.requests += 1
          over = server.requests > server.max_requests
          broken = server.fail_after is not None and server.requests > server.fail_after
          server.per_prompt[prompt] += 1
          seen = server.per_prompt[prompt]
          server.bodies.append(body)
        if broken and server.failure == "silent":
          server.released.wait()
          self.close_connection = True
          return
        if over or "[drop]" in prompt or not self.path.endswith("/v1/chat/completions"):
          self.close_connection = True
          self.connection.close()  # no status line at all: the client sees a dropped connection
          return
        m = _SLOW_RE.search(prompt)
        if m:
          # Counted only while sleeping, before any reply is sent: a client cannot have moved on
          # to its next request while this one is still counted.
          with server.lock:
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
          time.sleep(float(m.group(1)))
          with server.lock:
            server.in_flight -= 1
        flaky = _FLAKY_RE.search(prompt)
        if broken or "[500]" in prompt or (flaky and seen <= int(flaky.group(1))):
          return self._send(500, b'{"error": "internal"}')
        if "[badjson]" in prompt:
          return self._send(200, b'{"choices": [{"message": {"content": "trunc')
        if "[nochoices]" in prompt:
          return self._send(200, b'{"object": "chat.completion"}')
        if "[prose]" in prompt:
          content = "This response is quite good, I would say four out of five."
        elif _REPLY_RE.search(prompt):
          content = _REPLY_RE.search(prompt).group(1)
        else:
          m = _SCORE_RE.search(prompt)
          a, g, i, c = (int(x) for x in m.groups()) if m else (3, 3, 3, 3)
          content = json.dumps({"accuracy": a, "grammar": g, "informativeness": i, "coherence": c})
        self._send(200, json.dumps({
            "id": "x", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
        }).encode())
        if "[hangup]" in prompt:
          self.close_connection = True

      def _send(self, status: int, payload: bytes):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    self.httpd = _Server(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
    self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                    daemon=True)
    self._timer = threading.Timer(lifetime_s, self.stop)
    self._timer.daemon = True
    self._stopped = False

  def __enter__(self) -> "FakeChatServer":
    self._thread.start()
    self._timer.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

  def stop(self) -> None:
    with self.lock:
      if self._stopped:
        return
      self._stopped = True
    self._timer.cancel()
    self.released.set()
    if self._thread.is_alive():  # shutdown() would wait forever on a server never started
      self.httpd.shutdown()
    self.httpd.server_close()
