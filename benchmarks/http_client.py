"""HTTP scorer client benchmark: batch time of grpo_jax.rewards.chat_http against the ideal.

    python benchmarks/http_client.py [--batches 20] [--batch-size 64] [--concurrency 16]
                                     [--latency 0.1]

The fake chat-completions server of tests/fake_chat_server.py runs in a child process on
127.0.0.1 (its own interpreter, so it does not share the client's GIL, as a real server would
not) and answers every request after a fixed `--latency` seconds. Each batch is one
`ChatClient.complete` call with `--batch-size` distinct prompts (the cache cannot help). With
C requests in flight and latency L, a batch of N can take no less than ceil(N / C) * L; the
benchmark prints percentiles of the batch times, their ratio to that ideal, and how many
batches stalled (took more than ideal + 0.5 s). The last line is
`http_client_batch_ratio_p50=<ratio of the median batch time to the ideal>`.

Measured on the 2-core CPU with the defaults (three runs each, before and after alternating):
  before (7af68d8: a connection per request; the server's listen backlog 5):
    p50 1.25-1.34 s, max 2.0-2.2 s; ratio p50 3.1-3.4; 15-18/20 batches stalled; 1-2 retries
  after (keep-alive client; backlog 128 and TCP_NODELAY in the fake server):
    p50 0.413-0.414 s, max 0.42-0.44 s; ratio p50 1.03; 0/20 stalled; no retries
Either fix alone removes the stalls: the new client against the old server gives ratio 1.47
(0 stalled; that server's Nagle delays each kept-alive reply by the client's 40 ms delayed
ACK), the old client against the new server 1.06.
"""

from __future__ import annotations

import argparse
import collections
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batches", type=int, default=20)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--concurrency", type=int, default=16)
  parser.add_argument("--latency", type=float, default=0.1, help="seconds per request")
  parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
  return parser.parse_args()


def serve() -> None:
  """Child process: run the fake server, print its URL, stop when the parent closes stdin."""
  from fake_chat_server import FakeChatServer
  with FakeChatServer(max_requests=1_000_000, lifetime_s=3600) as server:
    print(server.url, flush=True)
    sys.stdin.read()


def percentile(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def main() -> None:
  args = parse_args()
  if args.serve:
    return serve()
  from grpo_jax.rewards import chat_http

  child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
  try:
    url = child.stdout.readline().strip()
    # The client's defaults but no cache; retries and errors are counted and printed, since a
    # failed attempt and its backoff are a stall too.
    client = chat_http.ChatClient(chat_http.HttpOptions(
        base_url=url, model="bench", max_concurrency=args.concurrency, cache_size=0))
    ideal = math.ceil(args.batch_size / args.concurrency) * args.latency
    times, counts = [], collections.Counter()
    for b in range(args.batches + 1):  # batch 0 warms up (imports, first connections)
      batch = [[{"role": "user", "content": f"batch {b} item {i} [slow={args.latency}]"}]
               for i in range(args.batch_size)]
      t0 = time.perf_counter()
      replies, counters = client.complete(batch)
      elapsed = time.perf_counter() - t0
      if b:
        times.append(elapsed)
        counts.update({k: v for k, v in counters.items() if k.startswith("http_") and v})
  finally:
    child.stdin.close()
    child.wait(timeout=30)

  stalled = sum(t > ideal + 0.5 for t in times)
  print(f"{args.batches} batches of {args.batch_size} requests, concurrency {args.concurrency}, "
        f"latency {args.latency * 1e3:.0f} ms: ideal batch {ideal:.3f} s")
  print("batch time  p50 {:.3f} s  p90 {:.3f} s  p99 {:.3f} s  max {:.3f} s  mean {:.3f} s".format(
      percentile(times, 50), percentile(times, 90), percentile(times, 99), max(times),
      sum(times) / len(times)))
  print("ratio to ideal  p50 {:.2f}  p90 {:.2f}  max {:.2f};  stalled batches (> ideal + 0.5 s): "
        "{}/{}".format(percentile(times, 50) / ideal, percentile(times, 90) / ideal,
                       max(times) / ideal, stalled, len(times)))
  print("client counters over all batches:", dict(sorted(counts.items())))
  print(f"http_client_batch_ratio_p50={percentile(times, 50) / ideal:.3f}")


if __name__ == "__main__":
  main()
