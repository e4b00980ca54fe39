"""One short device run that decides the fast path: each decode option checked, then timed.

    python benchmarks/gpu_decide.py --dir /tmp/decide      # a GPU: 0.5b and 1.5b, <= 5 min
    python benchmarks/gpu_decide.py --smoke                # the same code on the CPU, toy shape

One process, JAX's persistent compile cache on (--dir/xla: a rerun loads what the first run
compiled). At each size (Qwen2.5 shapes, random weights, fp32 params, bf16 compute, 16 prompts
of a 192-token bucket x G = 8 = 128 rows; smoke: 2 layers x 64, 2 x 2 rows):

  check    each candidate's first CHECK_TOKENS sampled tokens (same keys, temperature 1) and
           their log-probs against the XLA path's on this device: it passes when >= 90% of rows
           draw the same tokens and the log-probs of the tokens both drew differ by <= 0.05
           (bf16 rounding; a wrong kernel is off by far more). One that fails is reported and
           not timed.
  decode   ms per decode step: prefill, then NEW_TOKENS steps of every row (no stop id), the
           fastest of 2 calls after the one that compiles; its fraction of the HBM roofline
           (gpu_step.decode_bytes over the datasheet bandwidth).
  lengths  the realistic workload: benchmarks/lengths.py's long-tailed lengths (median 250, 5%
           at max_new_tokens = 1024) as each row's budget, the default path and the other
           setting of sampling.compact_rows: useful tokens/s (tokens before each row's end) and
           the share of row-steps spent on finished rows.
  update   the train step (reference forward, policy forward + backward, AdamW; beta = 0.04)
           on one rollout-shaped batch, the median of 2 after the compile: seconds, MFU (the
           analytic FLOPs of trl_step.step_flops over the datasheet's dense bf16 peak), and
           the device's peak memory.
  step     sample (prefill + decode of the winner, at NEW_TOKENS) + update: the GRPO step
           without rewards.

Candidates: `xla` (the layer scan, the grouped einsum: today's default), `unroll`
(model.unroll_decode), `pallas` (model.decode_attention), `unroll+pallas`, and
`no_command_buffers` (XLA's GPU command buffers off: a GPU only). The winner per size is the
fastest that passed. TRL's step, the peer, is benchmarks/gpu_step.py's: `--trl` runs it first,
in its own process (PyTorch and JAX never share the GPU), with gradient checkpointing, within
--trl_s; its closing lines (`gpu_step_speedup_vs_trl` needs both sides: the grpo_jax step here
is the update + sample above) go into the JSON.

Writes --dir/decide.json and --dir/decide.md (device, JAX version, commit, the tables), prints
where the time went, and ends with `decode_row_steps_wasted=F` (the realistic workload on the
default path of the largest size) and `decide_wall_s=S`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_step  # noqa: E402  (puts the repository on sys.path)
import lengths as lengths_lib  # noqa: E402
import trl_step  # noqa: E402

PROMPTS, G, NEW_TOKENS, BUCKET, LONG = 16, 8, 256, 192, 1024
SMOKE = dict(prompts=2, g=2, new_tokens=8, bucket=16, long=32)
CHECK_TOKENS = 16
CANDIDATES = {  # name: (qwen.RunOptions changes, jax.jit compiler options)
    "xla": ({}, None),
    "unroll": ({"unroll_decode": True}, None),
    "pallas": ({"decode_attention": "pallas"}, None),
    "unroll+pallas": ({"unroll_decode": True, "decode_attention": "pallas"}, None),
    "no_command_buffers": ({}, {"xla_gpu_enable_command_buffer": ""}),
}
GPU_ONLY = {"no_command_buffers"}


class Clock:
  """Seconds per part of the run, for the closing 'where the time went'."""

  def __init__(self):
    self.parts, self.start = {}, time.perf_counter()

  def part(self, name, fn):
    t = time.perf_counter()
    try:
      return fn()
    finally:
      self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t

  def wall(self) -> float:
    return time.perf_counter() - self.start


def workload(smoke: bool) -> dict:
  if smoke:
    return dict(SMOKE)
  return dict(prompts=PROMPTS, g=G, new_tokens=NEW_TOKENS, bucket=BUCKET, long=LONG)


def model_cfg(size: str, run: dict):
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  m = gpu_step.SIZES[size]
  return qwen.QwenConfig(vocab_size=151_936, hidden_size=m["hidden"], intermediate_size=m["mlp"],
                         num_layers=m["layers"], num_heads=m["heads"],
                         num_kv_heads=m["kv_heads"], head_dim=m["hidden"] // m["heads"],
                         tie_word_embeddings=True, qkv_bias=True, rope_theta=1e6,
                         run=qwen.RunOptions(**run))


def prompts_of(w: dict, seed: int = 0) -> list[list[int]]:
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  low = max(1, w["bucket"] * 5 // 8)
  return [list(rng.integers(1000, 100_000, size=int(n)))
          for n in rng.integers(low, w["bucket"] + 1, size=w["prompts"])]


def sampler_for(cfg, w, max_new_tokens, compiler_options=None, **kwargs):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from grpo_jax import sampler as sampler_lib  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  return sampler_lib.Sampler(qwen.build(cfg, dtype=jnp.bfloat16), max_new_tokens=max_new_tokens,
                             buckets=(w["bucket"],), valid_vocab_size=151_665, pad_id=0,
                             compiler_options=compiler_options, **kwargs)


def check(out, ref) -> tuple[bool, str]:
  """(passed, what was found) for a candidate's first tokens against the XLA path's."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  a, b = np.asarray(out.tokens), np.asarray(ref.tokens)
  same_rows = float((a == b).all(1).mean())
  agree = np.cumprod(a == b, axis=1).astype(bool)  # tokens both drew, before any divergence
  dlogp = float(np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs))[agree].max())
  ok = same_rows >= 0.9 and dlogp <= 0.05
  return ok, f"{same_rows:.0%} of rows the same, log-probs within {dlogp:.2g}"


def time_decode(sampler, params, prompts, w, key) -> dict:
  """Compile, then the fastest of 2 calls: prefill and decode seconds, ms per decode step."""
  import jax  # pylint: disable=import-outside-toplevel
  t = time.perf_counter()
  sampler(params, prompts, num_samples=w["g"], key=key)
  first = time.perf_counter() - t
  runs = [sampler(params, prompts, num_samples=w["g"], key=jax.random.fold_in(key, i)).metrics
          for i in range(2)]
  best = min(runs, key=lambda m: m["sampler/seconds"])
  decode_s = best["sampler/seconds"] - best["sampler/prefill_seconds"]
  return {"compile_s": first - best["sampler/seconds"], "prefill_s": best["sampler/prefill_seconds"],
          "decode_s": decode_s, "ms_per_step": 1e3 * decode_s / best["sampler/decode_steps"]}


def decode_options(size, w, params, prompts, platform, candidates, clock) -> dict:
  """Each candidate checked against the XLA path, then timed; {name: figures or error}."""
  import jax  # pylint: disable=import-outside-toplevel
  key = jax.random.key(1)
  ref = clock.part(f"{size} check", lambda: sampler_for(
      model_cfg(size, {}), w, CHECK_TOKENS)(params, prompts, num_samples=w["g"], key=key))
  out = {}
  for name, (run, opts) in CANDIDATES.items():
    if name not in candidates:
      continue
    if name in GPU_ONLY and platform != "gpu":
      out[name] = {"skipped": "a GPU option"}
      continue
    cfg = model_cfg(size, run)
    try:
      got = clock.part(f"{size} check", lambda: sampler_for(cfg, w, CHECK_TOKENS, opts)(
          params, prompts, num_samples=w["g"], key=key))
      ok, found = (True, "the reference") if name == "xla" else check(got, ref)
      if not ok:
        out[name] = {"failed": found}
        print(f"  {size} {name}: FAILED the check ({found}); not timed", flush=True)
        continue
      figures = clock.part(f"{size} decode", lambda: time_decode(
          sampler_for(cfg, w, w["new_tokens"], opts), params, prompts, w, key))
    except Exception as e:  # noqa: BLE001 - a candidate that does not build is reported
      out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
      print(f"  {size} {name}: ERROR {out[name]['error']}", flush=True)
      continue
    out[name] = dict(figures, check=found)
    print(f"  {size} {name}: {figures['ms_per_step']:.2f} ms/step ({found}; compile "
          f"{figures['compile_s']:.1f} s)", flush=True)
  return out


def realistic(size, w, params, prompts, winner_run, clock) -> dict:
  """The long-tailed workload on the default path and with the other compact_rows setting."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  rows = len(prompts) * w["g"]
  budgets = lengths_lib.realistic_lengths(rows, w["long"], median=w["long"] * 250 / LONG)
  cfg = model_cfg(size, winner_run)
  default = sampler_for(cfg, w, w["long"])
  out = {}
  for label, compact in (("default", None), ("other", not default.compact_rows)):
    sampler = default if compact is None else sampler_for(cfg, w, w["long"], compact_rows=compact)
    call = lambda i: sampler(params, prompts, num_samples=w["g"], key=jax.random.key(i),
                             row_budgets=budgets)
    clock.part(f"{size} lengths", lambda: call(0))  # compiles
    m = clock.part(f"{size} lengths", lambda: call(1)).metrics
    useful = int(np.sum(budgets))
    out[label] = {"compact_rows": sampler.compact_rows, "seconds": m["sampler/seconds"],
                  "useful_tokens_per_s": useful / m["sampler/seconds"],
                  "row_steps_wasted": m["sampler/row_steps_wasted"]}
    print(f"  {size} lengths, compact_rows={sampler.compact_rows} ({label}): "
          f"{out[label]['useful_tokens_per_s']:.0f} useful tokens/s, "
          f"{m['sampler/row_steps_wasted']:.1%} of row-steps on finished rows", flush=True)
  return out


def update(size, w, params, clock) -> dict:
  """The train step on one batch of the rollout's layout: seconds, MFU, peak memory."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from grpo_jax import config as config_lib, sharding, train_step  # pylint: disable=C0415
  config = config_lib.defaults()
  config.loss.beta = 0.04
  config.optim.remat = gpu_step.SIZES[size]["remat"]
  optim = config_lib.optim_settings(config)
  cfg, mesh = model_cfg(size, {}), sharding.make_mesh((1, 1, 1))
  rows, prompts, c = w["prompts"] * w["g"], w["prompts"], w["new_tokens"]
  step = train_step.TrainStep(cfg, config.loss, optim, mesh, valid_vocab_size=151_665,
                              max_completion_length=c, group_size=w["g"],
                              reward_weights=(1.0,))
  rng = np.random.default_rng(0)
  batch = {"prompt_NP": rng.integers(1000, 100_000, (prompts, w["bucket"]), dtype=np.int32),
           "prompt_mask_NP": np.ones((prompts, w["bucket"]), np.int32),
           "completion_BC": rng.integers(1000, 100_000, (rows, c), dtype=np.int32),
           "lengths_B": np.full((rows,), c, np.int32),
           "rewards_BR": rng.standard_normal((rows, 1)).astype(np.float32)}
  state = train_step.create_train_state(params["params"], cfg, optim, mesh)
  ref = train_step.reference_params(params["params"], cfg, optim, mesh)
  # One ulp away from the policy, as on every step after a run's first: the reference forward
  # runs (the step skips it while the policy is the reference).
  ref = jax.tree.map(lambda x: jnp.nextafter(x, jnp.inf).astype(x.dtype), ref)
  times = []
  for _ in range(3):  # the first compiles
    t = time.perf_counter()
    state, metrics, *_ = clock.part(f"{size} update", lambda: jax.block_until_ready(
        step(state, batch, ref)))
    times.append(time.perf_counter() - t)
  seconds = statistics.median(times[1:])
  spec = dict(gpu_step.SIZES[size], vocab=151_936, valid_vocab=151_665, bucket=w["bucket"],
              new_tokens=c)
  flops = _flops(spec, w)
  _, peak_tflops = gpu_step.datasheet(jax.devices()[0].device_kind)
  stats = jax.devices()[0].memory_stats() or {}
  return {"seconds": seconds, "compile_s": times[0] - seconds, "flops": flops["update"],
          "mfu": flops["update"] / seconds / (peak_tflops * 1e12) if peak_tflops else None,
          "peak_memory_gb": stats.get("peak_bytes_in_use", 0) / 1e9 or None,
          "loss_finite": bool(np.isfinite(float(metrics["loss/policy"])))}


def _flops(spec, w) -> dict:
  saved = trl_step.NUM_PROMPTS, trl_step.G
  trl_step.NUM_PROMPTS, trl_step.G = w["prompts"], w["g"]
  try:
    f = trl_step.step_flops(spec, w["new_tokens"])
  finally:
    trl_step.NUM_PROMPTS, trl_step.G = saved
  return {"update": f["reference"] + f["policy"], "sample": f["sample"]}


def run_size(size, w, platform, candidates, clock) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from grpo_jax.models import qwen  # pylint: disable=import-outside-toplevel
  print(f"== {size}", flush=True)
  params = clock.part(f"{size} init", lambda: {"params": jax.jit(
      lambda k: qwen.init_params(model_cfg(size, {}), k))(jax.random.key(0))})
  prompts = prompts_of(w)
  options = decode_options(size, w, params, prompts, platform, ["xla"] + candidates, clock)
  timed = {n: o for n, o in options.items() if "ms_per_step" in o}
  winner = min(timed, key=lambda n: timed[n]["ms_per_step"])
  spec = dict(gpu_step.SIZES[size], vocab=151_936, valid_vocab=151_665)
  rows = len(prompts) * w["g"]
  bytes_ = gpu_step.decode_bytes(spec, rows, w["bucket"], w["new_tokens"])
  tbps, _ = gpu_step.datasheet(jax.devices()[0].device_kind)
  floor_ms = (1e3 * (bytes_["weights"] + bytes_["kv_cache"] + bytes_["logits"]) / (tbps * 1e12)
              if tbps else None)
  for o in timed.values():
    o["roofline"] = floor_ms / o["ms_per_step"] if floor_ms else None
  lengths = realistic(size, w, params, prompts, CANDIDATES[winner][0], clock)
  upd = update(size, w, params, clock)
  sample_s = timed[winner]["prefill_s"] + timed[winner]["decode_s"]
  return {"winner": winner, "options": options, "roofline_ms": floor_ms, "lengths": lengths,
          "update": upd, "step_s": sample_s + upd["seconds"]}


def markdown(result: dict) -> str:
  lines = [f"# gpu_decide: {result['device']}, JAX {result['jax']}, commit {result['commit']}, "
           f"{result['date']}", "", f"`{result['command']}`", ""]
  for size, r in result["sizes"].items():
    lines += [f"## {size}: winner `{r['winner']}`, step (sample + update) {r['step_s']:.2f} s", "",
              "| option | ms / decode step | of HBM roofline | compile s | check |",
              "| --- | --- | --- | --- | --- |"]
    for name, o in r["options"].items():
      if "ms_per_step" in o:
        roof = f"{o['roofline']:.0%}" if o.get("roofline") else "n/a"
        lines.append(f"| {name} | {o['ms_per_step']:.2f} | {roof} | {o['compile_s']:.1f} | "
                     f"{o['check']} |")
      else:
        lines.append(f"| {name} | - | - | - | {next(iter(o.values()))} |")
    u = r["update"]
    mfu = f"{u['mfu']:.0%}" if u["mfu"] else "n/a"
    peak = f"{u['peak_memory_gb']:.1f} GB" if u["peak_memory_gb"] else "n/a"
    lines += ["", f"Update: {u['seconds']:.2f} s, MFU {mfu} (datasheet bf16), peak memory {peak}.",
              "", "| realistic lengths | compact_rows | useful tokens/s | row-steps wasted |",
              "| --- | --- | --- | --- |"]
    for label, x in r["lengths"].items():
      lines.append(f"| {label} | {x['compact_rows']} | {x['useful_tokens_per_s']:.0f} | "
                   f"{x['row_steps_wasted']:.1%} |")
    lines.append("")
  return "\n".join(lines)


def trl(args, out_dir) -> dict:
  """TRL's GRPOTrainer at the first size (gradient checkpointing on, as fits 80 GB), through
  benchmarks/gpu_step.py in its own process, within --trl_s: its closing lines."""
  size = "0.5b" if not args.smoke else "smoke"
  cmd = [sys.executable, str(Path(__file__).with_name("gpu_step.py")), "--sides", "trl",
         "--sizes", args.sizes.split(",")[0], "--remat", "0.5b,1.5b", "--budget_s",
         str(args.trl_s), "--dir", str(out_dir / "trl"), "--tokenizer", args.tokenizer,
         "--gsm8k", args.gsm8k] + ["--smoke"] * args.smoke
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.trl_s + 60,
                          check=False)
    lines = done.stdout.strip().splitlines()[-12:]
  except subprocess.TimeoutExpired:
    lines = [f"TRL {size}: no result within {args.trl_s + 60:.0f} s"]
  print("\n".join(["TRL (benchmarks/gpu_step.py --sides trl):"] + lines), flush=True)
  log = out_dir / "trl" / "logs" / f"{args.sizes.split(',')[0] if not args.smoke else 'smoke'}_trl.log"
  found = [json.loads(x[len(gpu_step.RESULT):]) for x in
           (log.read_text(errors="replace").splitlines() if log.exists() else [])
           if x.startswith(gpu_step.RESULT)]
  steps = [st["step_s"] for st in (found[-1].get("steps", []) if found else [])]
  return {"size": size, "step_s": steps[-1] if steps else None, "lines": lines}


def commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="0.5b,1.5b", help="comma-separated, of 0.5b, 1.5b")
  p.add_argument("--dir", default=None, help="outputs and the compile cache (default: a "
                 "temporary directory)")
  p.add_argument("--smoke", action="store_true", help="CPU, toy shape")
  p.add_argument("--candidates", default=",".join(c for c in CANDIDATES if c != "xla"),
                 help="comma-separated, of " + ", ".join(CANDIDATES) + " (xla always runs)")
  p.add_argument("--trl", action="store_true", help="then TRL's step (benchmarks/gpu_step.py)")
  p.add_argument("--trl_s", type=float, default=90.0, help="TRL's budget (run first)")
  p.add_argument("--tokenizer", default=str(trl_step.QWEN_TOKENIZER), help="for --trl")
  p.add_argument("--gsm8k", default=str(trl_step.GSM8K), help="for --trl")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  clock = Clock()
  if args.smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
  out_dir = Path(args.dir or tempfile.mkdtemp(prefix="gpu_decide_"))
  out_dir.mkdir(parents=True, exist_ok=True)
  import jax  # pylint: disable=import-outside-toplevel
  from grpo_jax import compile_cache  # pylint: disable=import-outside-toplevel
  compile_cache.enable(str(out_dir / "xla"))
  if args.trl:  # before this process takes the GPU: TRL's process gets all of it
    peer_run = clock.part("trl", lambda: trl(args, out_dir))
  dev = jax.devices()[0]
  sizes = ["smoke"] if args.smoke else args.sizes.split(",")
  candidates = [c for c in args.candidates.split(",") if c and c != "xla"]
  unknown = sorted(set(candidates) - set(CANDIDATES))
  if unknown:
    sys.exit(f"gpu_decide.py: unknown --candidates {unknown}; known: {', '.join(CANDIDATES)}")
  w = workload(args.smoke)
  result = {"device": f"{dev.platform}: {dev.device_kind}", "jax": jax.__version__,
            "commit": commit(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python benchmarks/gpu_decide.py"] + (argv or sys.argv[1:])),
            "workload": w, "sizes": {}}
  if args.trl:
    result["trl"] = peer_run
  for size in sizes:
    result["sizes"][size] = run_size(size, w, dev.platform, candidates, clock)
  peer = result.get("trl") or {}
  if peer.get("step_s") and peer["size"] in result["sizes"]:
    ratio = peer["step_s"] / result["sizes"][peer["size"]]["step_s"]
    result["speedup_vs_trl"] = ratio
    print(f"speedup_vs_trl[{peer['size']}]={ratio:.2f} (TRL's measured step over sample + "
          "update here)")
  result["parts_s"] = clock.parts
  (out_dir / "decide.json").write_text(json.dumps(result, indent=1, default=str))
  (out_dir / "decide.md").write_text(markdown(result))
  print(markdown(result))
  print("where the time went: " + ", ".join(f"{k} {v:.1f} s" for k, v in clock.parts.items()))
  print(f"wrote {out_dir / 'decide.json'} and {out_dir / 'decide.md'}")
  last = result["sizes"][sizes[-1]]["lengths"]["default"]
  print(f"decode_row_steps_wasted={last['row_steps_wasted']:.3f}")
  print(f"decide_wall_s={clock.wall():.1f}")
  return result


if __name__ == "__main__":
  main()
