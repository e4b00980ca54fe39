"""A stand-in for `python -m grpo_jax.main` in sweep tests: main's flags, main's files
(metrics.jsonl, summary.json, checkpoints/<step>/SHA256SUMS), no JAX, milliseconds a run.

    python -m fake_main --config=configs/gsm8k.py:tiny --workdir=DIR [--config.seed=1 ...]
        [--overrides=FILE]

Each call appends {"args": overrides, "resumed_from": step or None} to DIR/calls.jsonl: the
--config.k=v flags' text, then the --overrides file's JSON values, as main applies them. Step 0's
"state" is the warm start's, a function of the warm-start overrides only; GRPO steps log a
reward of lr * 1000 + seed, so a test can tell which run wrote what. Environment:
FAKE_FAIL (JSON list of run dir names that exit 3), FAKE_WAIT (wait for SIGTERM before GRPO,
then save a checkpoint and a stopped_early summary and exit 143, as main does).
"""
import json
import os
import signal
import sys
import time


def _checkpoint(workdir, step, state):
  d = os.path.join(workdir, "checkpoints", str(step))
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "state"), "w") as f:
    f.write(state)
  with open(os.path.join(d, "SHA256SUMS"), "w") as f:
    f.write("fake\n")


def _latest(workdir):
  d = os.path.join(workdir, "checkpoints")
  steps = [int(n) for n in os.listdir(d) if n.isdigit()] if os.path.isdir(d) else []
  return max(steps) if steps else None


def main(argv):
  # Before calls.jsonl is written: a test that sees the call may send SIGTERM at once.
  stop = {"now": False}
  signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
  flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
  workdir = flags.pop("workdir")
  flags.pop("config")
  args = {k[len("config."):]: v for k, v in flags.items() if k.startswith("config.")}
  if "overrides" in flags:
    with open(flags["overrides"]) as f:
      args.update(json.load(f))
  os.makedirs(workdir, exist_ok=True)
  resumed = _latest(workdir)
  with open(os.path.join(workdir, "calls.jsonl"), "a") as f:
    f.write(json.dumps({"args": args, "resumed_from": resumed}) + "\n")
  print(f"fake_main: {args}", flush=True)
  if os.path.basename(workdir) in json.loads(os.environ.get("FAKE_FAIL", "[]")):
    print("fake_main: boom", file=sys.stderr, flush=True)
    sys.exit(3)
  metrics = os.path.join(workdir, "metrics.jsonl")
  steps, seed = int(args.get("train.steps", 4)), int(args.get("seed", 0))
  lr = float(args.get("optim.lr", 3e-5))
  if resumed is None:
    warm = {k: v for k, v in sorted(args.items()) if k not in ("optim.lr", "train.steps",
                                                                 "optim.schedule")}
    _checkpoint(workdir, 0, json.dumps(warm))
    with open(metrics, "w") as f:
      f.write(json.dumps({"step": 0, "eval/accuracy": 0.1 + 0.01 * seed}) + "\n")
    resumed = 0
  if os.environ.get("FAKE_WAIT"):
    while not stop["now"]:
      time.sleep(0.02)
  records = [json.loads(line) for line in open(metrics) if json.loads(line)["step"] <= resumed]
  done = resumed
  for step in range(resumed + 1, steps + 1):
    if stop["now"]:
      break
    m = {"step": step, "reward/total/mean": lr * 1000 + seed, "loss/kl": 0.0,
         "completion/mean_length": 10.0 + step}
    if step == steps:
      m["eval/accuracy"] = 0.2 + lr * 1000
    records.append(m)
    done = step
  with open(metrics, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  if done > resumed:
    _checkpoint(workdir, done, "grpo")
  evals = [r for r in records if "eval/accuracy" in r]
  summary = {"eval_accuracy_start": evals[0]["eval/accuracy"], "start_step": 0}
  if done >= steps:
    summary.update(eval_accuracy_end=evals[-1]["eval/accuracy"], end_step=evals[-1]["step"],
                   eval_accuracy_gain_points=100 * (evals[-1]["eval/accuracy"]
                                                    - evals[0]["eval/accuracy"]))
  else:
    summary = {"stopped_early": True, "stopped_at_step": done, **summary}
    with open(os.path.join(workdir, "got_sigterm"), "w") as f:
      f.write("1")
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f)
  if done < steps:
    sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
  main(sys.argv[1:])
