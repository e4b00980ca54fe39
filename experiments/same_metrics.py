"""Whether a change of structure changed any number a run writes: short tiny runs, one run and
vmapped groups, fingerprinted (metrics without timings, samples, the exported weights' bytes).

    python3 experiments/same_metrics.py --out /tmp/before.json      # on the old commit
    python3 experiments/same_metrics.py --against /tmp/before.json  # on the new one

The second call exits 1 and names each differing run, step and key; metric keys the old
records lack (a new diagnostic) are named apart, and every key they have must keep its value. The runs (about 6 minutes
on 2 CPU cores): the tiny preset as one run (K = 1), a K = 4 group of `python -m grpo_jax.train
--spec` (seeds and lrs differ; members in turn, the CPU default), a K = 2 group batched under
jax.vmap (train.members=vmap), and the tiny_lora preset as one run and as a K = 2 group. Every
source of randomness is a function of the seed, so on one machine equal code writes equal
bytes.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from grpo_jax.logging_io import TIMING_METRICS  # noqa: E402  (what measures the machine)
SHORT = {"sft.steps": 10, "train.steps": 4, "train.checkpoint_every": 2,
         "train.prompts_per_step": 4, "train.eval_examples": 8, "train.eval_every": 2,
         "train.tensorboard": False, "data.synthetic_train": 400, "data.synthetic_test": 40,
         "loss.beta": 0.04}
# name -> (preset, [each member's overrides]); one member: python -m grpo_jax.main.
RUNS = {
    "one": ("tiny", [{}]),
    "group4": ("tiny", [{"seed": 0}, {"seed": 1, "optim.lr": 1e-5}, {"seed": 0, "loss.beta": 0.1},
                        {"seed": 2, "loss.epsilon": 0.1}]),
    "group2_vmap": ("tiny", [{"train.members": "vmap"},
                             {"train.members": "vmap", "optim.lr": 1e-5}]),
    "lora_one": ("tiny_lora", [{}]),
    "lora_group2": ("tiny_lora", [{}, {"optim.lr": 1e-5}]),
}
FILES = ("model.safetensors",)


def _env():
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  env.pop("GRPO_JAX_TEST", None)
  return env


def _run(name, preset, members, root) -> list[str]:
  """Runs one entry of RUNS under root; returns its members' workdirs."""
  config = f"configs/gsm8k.py:{preset}"
  workdirs = [os.path.join(root, name, str(k)) for k in range(len(members))]
  if len(members) == 1:
    cmd = [sys.executable, "-m", "grpo_jax.main", f"--config={config}",
           f"--workdir={workdirs[0]}"] + [f"--config.{k}={v}" for k, v in
                                          {**SHORT, **members[0]}.items()]
  else:
    spec = os.path.join(root, f"{name}.json")
    with open(spec, "w") as f:
      json.dump({"config": config, "members": [
          {"workdir": w, "args": {**SHORT, **m}} for w, m in zip(workdirs, members)]}, f)
    cmd = [sys.executable, "-m", "grpo_jax.train", f"--spec={spec}"]
  print(f"same_metrics: {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
  done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
  if done.returncode:
    sys.exit(f"same_metrics: {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  return workdirs


def _records(path, drop_timings: bool) -> list[dict]:
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [_untimed(r) for r in rows] if drop_timings else rows


def _untimed(record: dict) -> dict:
  return {k: v for k, v in record.items() if not k.startswith("time/") and k not in TIMING_METRICS}


def fingerprint(workdir) -> dict:
  """What a run wrote that must not change: its metrics (timings aside), samples and the
  exported model's bytes."""
  out = {"metrics": _records(os.path.join(workdir, "metrics.jsonl"), True),
         "samples": _records(os.path.join(workdir, "samples.jsonl"), False)}
  for name in FILES:
    with open(os.path.join(workdir, "final_model", name), "rb") as f:
      out[name] = hashlib.sha256(f.read()).hexdigest()
  return out


def differences(want, got, where="") -> list[str]:
  if isinstance(want, dict) and isinstance(got, dict):
    keys = sorted(set(want) | set(got))
    return [d for k in keys for d in differences(want.get(k), got.get(k), f"{where}/{k}")]
  if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
    return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{where}[{i}]")]
  return [] if want == got else [f"{where}: {want!r} -> {got!r}"]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", help="write the fingerprints to this JSON")
  parser.add_argument("--against", help="compare with fingerprints written by --out")
  parser.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
  args = parser.parse_args()
  prints = {}
  with tempfile.TemporaryDirectory() as root:
    for name in args.only:
      preset, members = RUNS[name]
      prints[name] = [fingerprint(w) for w in _run(name, preset, members, root)]
  if args.out:
    with open(args.out, "w") as f:
      json.dump(prints, f, indent=1)
  if args.against:
    with open(args.against) as f:
      want = json.load(f)
    for runs in want.values():  # fingerprints written before a timing was left out
      for run in runs:
        run["metrics"] = [_untimed(r) for r in run["metrics"]]
    added = set()  # metric keys the old records lack: new diagnostics, reported apart
    for name, runs in prints.items():
      for w, g in zip(want.get(name, []), runs):
        for rw, rg in zip(w["metrics"], g["metrics"]):
          added |= set(rg) - set(rw)
          for k in set(rg) - set(rw):
            del rg[k]
    diffs = differences({n: want[n] for n in prints}, prints)
    for line in diffs[:40]:
      print(f"same_metrics: differs: {line}")
    print(f"same_metrics: {len(prints)} entries, {len(diffs)} differences"
          + (f"; metric keys added: {', '.join(sorted(added))}" if added else ""))
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
  main()
