"""Step time one step behind (train.off_policy_steps=1) beside on-policy (0), on the CPU, with a
local HTTP judge that answers each request after a fixed delay.

    python3 benchmarks/async_step.py [--steps=12] [--delay_s=0.3] [--workdir=DIR]
    python3 benchmarks/async_step.py --sample_devices=4     # 8 host devices, split meshes

The tiny preset (random init, no warm start, one sampling round a step) is trained twice in this
process, once at each setting, with rewards math_accuracy + quality, the quality reward's judge
being a server here that sleeps --delay_s before each reply (its requests go out together: one
batch takes about delay_s). Phases, timed by wrapping the functions that run them:
  S  sample (sampler.Sampler.generate, the device)   R  score (rollout.score_samples, the host)
  U  update (members.update: the train step and its metrics, the device)
Prints each setting's median step time (time/step_s, the first 2 steps left out: compiles), the
medians of the phases, a timeline of 2 steps of each (one row per thread, seconds from the
window's start), the bounds, and last `async_step_speedup=X` (step time at 0 / at 1).

Bounds: on one device S and U share it, so a pipelined step takes at least max(S + U, R):
bound = (S + R + U) / max(S + U, R). The issue's three-phase bound, (S + R + U) / max(S, R, U),
assumes S and U on separate devices (split meshes), and is printed beside it.

--sample_devices=N (placement and transfers, not speed: host devices share the CPU's cores):
8 host CPU devices (--xla_force_host_platform_device_count=8), the mesh (1, 8 - N, 1). At 0
one mesh over the first 8 - N devices samples and trains; at 1 (train.sample_devices=N) the
first N devices sample and the last 8 - N train, and T (pipeline.move: the params' copy to the
sampling devices after each update) is a phase of its own, its median printed and logged as
time/param_transfer_s.
"""
from __future__ import annotations

import argparse
import http.server
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


DEVICES = 8  # host devices of a --sample_devices run


class Judge:
  """An OpenAI-compatible chat server on 127.0.0.1 that grades every request 3/5 after
  delay_s (a thread per request, so a batch sent at once takes about delay_s)."""

  def __init__(self, delay_s: float):
    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"
      disable_nagle_algorithm = True

      def log_message(self, *args):
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(delay_s)
        grade = json.dumps({"accuracy": 3, "grammar": 3, "informativeness": 3, "coherence": 3})
        payload = json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                              "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                  "role": "assistant", "content": grade}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.server.daemon_threads = True
    self.server.request_queue_size = 256
    threading.Thread(target=self.server.serve_forever, daemon=True).start()
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

  def stop(self):
    self.server.shutdown()


class Phases:
  """(phase, thread, start, end) of each call of the wrapped functions, perf_counter seconds."""

  def __init__(self):
    self.calls, self.lock = [], threading.Lock()

  def wrap(self, owner, name, phase, only=lambda *a, **k: True):
    real = getattr(owner, name)

    def timed(*args, **kw):
      if not only(*args, **kw):
        return real(*args, **kw)
      t0 = time.perf_counter()
      try:
        return real(*args, **kw)
      finally:
        with self.lock:
          self.calls.append((phase, threading.current_thread().name, t0, time.perf_counter()))
    setattr(owner, name, timed)


def config(steps: int, off_policy_steps: int, url: str, sample_devices: int = 0):
  from configs import gsm8k
  c = gsm8k.get_config("tiny")
  c.data.synthetic_train, c.data.synthetic_test = 400, 8
  c.sft.steps = 0
  c.rewards.names, c.rewards.weights = ("math_accuracy", "quality"), (1.0, 0.5)
  c.rewards.quality.http.update(base_url=url, max_retries=0, cache_size=0, max_concurrency=64)
  c.train.update(steps=steps, prompts_per_step=4, eval_examples=4, eval_batch_size=4,
                 eval_every=0, checkpoint_every=1000, tensorboard=False, dynamic_sampling=False,
                 off_policy_steps=off_policy_steps)
  if sample_devices:
    c.mesh = (1, DEVICES - sample_devices, 1)
    c.train.sample_devices = sample_devices if off_policy_steps else 0
  return c


def run(c, workdir: str):
  """One run of config c; returns its metrics records of steps 3.. (the first 2: compiles)."""
  from grpo_jax import logging_io, train
  train.run(c, workdir)
  return logging_io.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[3:]


def phase_medians(calls) -> dict:
  return {p: statistics.median(e - s for q, _, s, e in calls if q == p) for p in "SRU"}


def timeline(calls, width: int = 72) -> list[str]:
  """Rows of the last calls' spans (one row per thread), `width` characters wide."""
  start, end = min(s for _, _, s, _ in calls), max(e for _, _, _, e in calls)
  scale = width / max(end - start, 1e-9)
  rows = {}
  # T (a transfer of a millisecond or so) is drawn last: it shows as at least one character.
  for p, thread, s, e in sorted(calls, key=lambda c: (c[0] == "T", c[2])):
    row = rows.setdefault(thread, [" "] * width)
    a, b = int((s - start) * scale), max(int((s - start) * scale) + 1, int((e - start) * scale))
    for i in range(a, min(b, width)):
      row[i] = p
  out = [f"  {'':>16} 0{'':{max(width - 8, 0)}}{end - start:6.2f}s"]
  return out + [f"  {t[:16]:>16} {''.join(r)}" for t, r in rows.items()]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--delay_s", type=float, default=0.3)
  ap.add_argument("--workdir", default=None, help="default: a temporary directory")
  ap.add_argument("--sample_devices", type=int, default=0,
                  help=f"> 0: {DEVICES} host devices, this many sampling apart at 1")
  args = ap.parse_args(argv)
  if args.sample_devices:  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from grpo_jax import members, pipeline, rollout, sampler
  phases = Phases()
  phases.wrap(sampler.Sampler, "generate", "S", only=lambda *a, **k: not k.get("greedy"))
  phases.wrap(rollout, "score_samples", "R")
  phases.wrap(members, "update", "U")
  phases.wrap(pipeline, "move", "T")
  judge = Judge(args.delay_s)
  root = args.workdir or tempfile.mkdtemp(prefix="async_step_")
  results = {}
  try:
    for n in (0, 1):
      phases.calls = []
      records = run(config(args.steps, n, judge.url, args.sample_devices),
                    os.path.join(root, f"off_policy_{n}"))
      results[n] = (statistics.median(r["time/step_s"] for r in records), list(phases.calls),
                    records)
  finally:
    judge.stop()
  med = phase_medians(results[0][1])
  s, r, u = med["S"], med["R"], med["U"]
  print(f"phases at off_policy_steps=0 (medians): S sample {s:.3f}s, R score {r:.3f}s, "
        f"U update {u:.3f}s")
  for n in (0, 1):
    t_steps, calls, records = results[n]
    print(f"off_policy_steps={n}: step {t_steps:.3f}s (median of steps 3..{args.steps})")
    if args.sample_devices and n:
      print(f"  train.sample_devices={args.sample_devices}: sampling on devices "
            f"0-{args.sample_devices - 1}, training on {args.sample_devices}-{DEVICES - 1}; "
            f"param transfer (time/param_transfer_s, median of steps 3..{args.steps - 1}): "
            f"{statistics.median(r['time/param_transfer_s'] for r in records[:-1]):.4f}s")
    print(f"  timeline of its last 2 steps (S sample, R score, U update, T param transfer; a "
          f"row per thread):")
    last = [c for c in calls if c[0] == "U"][-2:]
    window = [c for c in calls if c[3] > last[0][2] - (s + r + u) and c[2] <= last[-1][3]]
    print("\n".join(timeline(window)))
  bound = (s + r + u) / max(s + u, r)
  print(f"bound (one device: S and U share it) = (S+R+U)/max(S+U, R) = {bound:.2f}; "
        f"0.9 x bound = {0.9 * bound:.2f}")
  print(f"three-phase bound (S, R, U each on its own) = (S+R+U)/max(S, R, U) = "
        f"{(s + r + u) / max(s, r, u):.2f}")
  print(f"async_step_speedup={results[0][0] / results[1][0]:.2f}")


if __name__ == "__main__":
  main()
