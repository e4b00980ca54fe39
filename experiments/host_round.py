"""What one sampling round of a vmapped group costs the host, for this checkout and, with
--tree, another one, side by side: encoding the prompts of K = 8 members that drew the same 16
rows (members.encode, rollout.encode_members in an older checkout, or 8 rollout.encode calls
in one without either), and scoring one member's 128 completions (rollout.score_samples:
decoding them and running the run's rewards). A group does both every round while the device
waits, scoring the members one after another.

    PYTHONPATH=$PWD python3 experiments/host_round.py RUN_WORKDIR [--tree=OTHER_CHECKOUT]

RUN_WORKDIR: a finished tiny-preset run with completions in samples.jsonl (for example one made
with --config.train.samples_per_step=128). Its completions fill 16 prompts x G = 8 rows (20
tokens at most, as the sweep's runs sample). Prints medians of 20 rounds of 10 calls each.
Measured in experiments/group_cuts.md ("Both host cuts, measured").
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROUNDS, CALLS, ROWS, WIDTH, K = 20, 10, 128, 20, 8


def _encode_members(rollout, members, rows, config, tok):
  """The call that encodes K members' rows in the checkout imported: members.encode, or
  rollout.encode_members where it is older, or K rollout.encode calls."""
  try:
    from grpo_jax import members as members_lib  # pylint: disable=import-outside-toplevel
    return lambda: members_lib.encode(members, [rows] * K)
  except ImportError:
    pass
  if hasattr(rollout, "encode_members"):
    return lambda: rollout.encode_members(members, [rows] * K)
  return lambda: [rollout.encode(config, tok, rows) for _ in range(K)]


def _time_calls(workdir: str) -> None:
  """In the child: each round's seconds per call of both, printed as a JSON line."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from grpo_jax import rollout, sampler  # pylint: disable=import-outside-toplevel
  from grpo_jax.rewards import build_rewards  # pylint: disable=import-outside-toplevel
  with open(os.path.join(workdir, "config.json")) as f:
    config = ml_collections.ConfigDict(json.load(f))
  tok = transformers.AutoTokenizer.from_pretrained(os.path.join(workdir, "tokenizer"))
  with open(os.path.join(workdir, "samples.jsonl")) as f:
    ids = [tok(json.loads(line)["completion"])["input_ids"][:WIDTH] for line in f]
  with open(os.path.join(workdir, "data", "train.jsonl")) as f:
    rows = [json.loads(line) for _, line in zip(range(ROWS // 8), f)]
  tokens, lengths = np.zeros((ROWS, WIDTH), np.int32), np.zeros(ROWS, np.int32)
  for i in range(ROWS):
    row = ids[i % len(ids)]
    tokens[i, :len(row)], lengths[i] = row, len(row)
  out = sampler.SampleOutput(tokens, lengths, np.zeros(ROWS, bool), None, None, None, {})
  prompts = rollout.encode(config, tok, rows)
  rewards = build_rewards(config.rewards)
  members = [rollout.SingleTurn(config, tok, None)] * K
  calls = {
      "encode": _encode_members(rollout, members, rows, config, tok),
      "score": lambda: rollout.score_samples(config, tok, rows, prompts, out, rewards, 0.0)}
  for call in calls.values():
    call()
  for _ in range(ROUNDS):
    seconds = {}
    for name, call in calls.items():
      t = time.perf_counter()
      for _ in range(CALLS):
        call()
      seconds[name] = (time.perf_counter() - t) / CALLS
    print(json.dumps(seconds), flush=True)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("workdir")
  p.add_argument("--tree", default=None, help="another checkout, timed alternately")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return _time_calls(args.workdir)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  trees = {"this checkout": here, **({"--tree": os.path.abspath(args.tree)} if args.tree else {})}
  procs = {name: subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), args.workdir, "--child"],
      env=dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL, text=True) for name, tree in trees.items()}
  # The children run side by side (a core each on 2 cores): both see the same machine.
  times = {name: [] for name in procs}
  for _ in range(ROUNDS):
    for name, proc in procs.items():
      times[name].append(json.loads(proc.stdout.readline()))
  for name, proc in procs.items():
    proc.wait()
    median = lambda key: 1e3 * statistics.median(t[key] for t in times[name])
    print(f"{name}: encoding {K} members' {ROWS // 8} prompts {median('encode'):.2f} ms, "
          f"scoring one member's {ROWS} completions {median('score'):.2f} ms")


if __name__ == "__main__":
  main()
