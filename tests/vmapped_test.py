"""A vmapped sweep's member k equals the separate run with its settings (train.run_group).

The separate run is train.run (what `python -m grpo_jax.main` runs) on the tiny preset, cut to
a 20-step warm start and 3 GRPO steps with β > 0; the group of two members starts from its
step-0 checkpoint (the sweep's prefix mechanism). One member has the separate run's settings,
the other another lr, β, ε, ε_high and reward weight. About 90-120 s on a shared 2-core CPU.

On a CPU (train.members 'auto': each member's programs in turn) a member is its separate run
bit for bit, and the first test asserts that. Batched under jax.vmap (train.members 'vmap', the
default off the CPU; the failing-member test runs it) it is not bitwise: XLA emits other kernels
for a matmul or reduction with the leading K axis, and the train step's float32 results move by
an ulp or so (the sampler's do not: its output at equal params is bitwise, which is why the
samples are equal). Adam turns such a difference in a near-zero gradient into up to lr per
element and update, so the tolerances there are: metrics within 1e-6 + 2e-3·|x|, params within
2·lr·steps. The largest difference seen is 2e-6 relative (loss and KL at step 3). In these runs
GRPO step 1 has all advantages 0 while the policy is the reference: its gradient is exactly 0
(train_step takes the policy's log-probs as the reference's), so no member moves there; before
that, its rounding noise was a whole gradient, and differences reached 5e-4.
"""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from grpo_jax import (logging_io, members as members_lib, policy, prepare, runs as runs_lib,
                      start as start_lib, sweep, sweep_runner, train, train_step,
                      trainer as trainer_lib, workdir_files)

FIXED = {"sft.steps": 20, "sft.target_accuracy": 0.0, "train.steps": 3,
         "train.eval_examples": 16, "train.eval_every": 2, "train.checkpoint_every": 2,
         "train.tensorboard": False, "loss.beta": 0.04,
         "optim.warmup_steps": 0}  # each member's own rate from step 1 (checked below)
SEPARATE = {**FIXED, "optim.lr": 1e-4, "loss.epsilon_high": 0.28}
OTHER = {**FIXED, "optim.lr": 1e-5, "loss.beta": 0.1, "loss.epsilon": 0.1,
         "rewards.weights": (2.0,)}
RTOL, ATOL = 2e-3, 1e-6


def _config(args):
  c = sweep.load_config("configs/gsm8k.py:tiny")
  sweep.apply_overrides(c, args)
  return c


def _metrics_match(sep, member):
  """The member's metrics are its separate run's (timings aside) within RTOL/ATOL, step for
  step; returns both runs' records."""
  want, got = (logging_io.read_jsonl(os.path.join(d, "metrics.jsonl")) for d in (sep, member))
  assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]
  for w, g in zip(want, got):
    assert set(w) == set(g)
    for k in set(w) - set(logging_io.TIMING_METRICS):
      assert g[k] == pytest.approx(w[k], rel=RTOL, abs=ATOL), (w["step"], k)
  return want, got


def test_member_equals_its_separate_run(tmp_path, monkeypatch):
  sep, a, b = (str(tmp_path / n) for n in ("separate", "other", "member"))
  train.run(_config(SEPARATE), sep)
  for d in (a, b):
    os.makedirs(d)
    sweep_runner.start_from_prefix(sep, d)  # as `sweep --vmap` hands each member its prefix
  # The group's evals (steps 2 and 3) run programs compiled in the background while it
  # trained: during them this thread compiles nothing, and loads nothing from the persistent
  # cache either.
  during_evals, compiles = [], []

  def count(event, *_, **kw):
    if event in ("/jax/core/compile/backend_compile_duration",
                 "/jax/compilation_cache/cache_hits"):
      compiles.append((threading.current_thread().name, kw.get("fun_name")))
  evaluate_group = members_lib.evaluate

  def counted(*args):
    before = len(compiles)
    try:
      return evaluate_group(*args)
    finally:
      during_evals.append([c for c in compiles[before:] if c[0] == "MainThread"])
  monkeypatch.setattr(members_lib, "evaluate", counted)
  jax.monitoring.register_event_listener(count)
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    train.run_group([_config(OTHER), _config(SEPARATE)], [a, b])
  finally:
    jax.monitoring.unregister_event_listener(count)
    jax.monitoring.unregister_event_duration_listener(count)
  assert during_evals == [[], []], during_evals
  # The members' decode loop compiled twice (sampling, then the evals' greedy settings), both
  # in the sampler's compile thread: the first from the group's start, on the stacked params'
  # spec (members.stacked_spec), before anything was sampled.
  assert [c for c in compiles if c[1] == "jit(_decode_members_in_turn_impl)"] == [
      ("grpo_jax-compile-sampler_0", "jit(_decode_members_in_turn_impl)")] * 2, compiles
  # The members' train program compiled once, ahead, for the stacked states' placement
  # (members_lib.stacked_spec, before they were stacked): every step ran that executable.
  assert [c for c in compiles if c[1] == "jit(traced)"] == [
      ("grpo_jax-compile_0", "jit(traced)")], compiles

  want, got = _metrics_match(sep, b)
  assert "eval/accuracy" in got[2] and "eval/accuracy" in got[3]
  read = lambda d, f: open(os.path.join(d, f)).read()
  assert read(b, "samples.md") == read(sep, "samples.md")
  assert read(b, "summary.json") == read(sep, "summary.json")
  p_sep, p_b = (load_file(os.path.join(d, "final_model", "model.safetensors")) for d in (sep, b))
  # On a CPU the members run in turn (train.members 'auto'): each member's sampling and step
  # are its own run's programs, and the member is its separate run to the bit.
  for w, g in zip(want, got):
    assert {k: g[k] for k in w if k not in logging_io.TIMING_METRICS} == {
        k: w[k] for k in w if k not in logging_io.TIMING_METRICS}, w["step"]
  assert all(np.array_equal(p_sep[k], p_b[k]) for k in p_sep)
  assert sorted(os.listdir(os.path.join(b, "checkpoints"))) == ["0", "2", "3"]

  # The other member ran its own settings in the same program. Step 1 moves no one (all
  # advantages 0, policy = reference), so the KL first shows its lr and β at step 3.
  other = logging_io.read_jsonl(os.path.join(a, "metrics.jsonl"))
  assert other[1]["lr"] == pytest.approx(1e-5) and got[1]["lr"] == pytest.approx(1e-4)
  assert other[1]["grad_norm"] == got[1]["grad_norm"] == 0.0
  assert other[3]["loss/kl"] != pytest.approx(got[3]["loss/kl"], rel=0.5)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 2, 2)])
def test_a_program_compiled_for_stacked_spec_runs_on_the_stacked_states(mesh_shape):
  """members_lib.stacked_spec describes members_lib.stack's output before it exists (what a group's train
  program compiles ahead for): the members' leaves stacked as np.stack stacks them, placed as
  the spec says, so that the program compiled for the spec runs on them without compiling."""
  from grpo_jax import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(mesh_shape)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor"))
  rng = np.random.default_rng(0)
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # (One device: a leaf placed on the device itself, as jax.device_put(x, device) places it.)
  step_at = jax.devices()[0] if mesh.size == 1 else whole
  members = [{"w": jax.device_put(rng.normal(size=(4, 6)).astype(np.float32), split),
              "step": jax.device_put(np.int32(k), step_at),
              "lr": np.float32(10.0 ** -k)} for k in range(3)]  # a host leaf too
  spec = members_lib.stacked_spec(members)
  double = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t))
  double.lower(spec).compile()
  compiles = []

  def count(event, *_, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(kw.get("fun_name"))
  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    stacked = members_lib.stack(members)
    jax.block_until_ready(stacked)
    before = list(compiles)
    doubled = double(stacked)
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert compiles == before, compiles  # the call ran the executable compiled for the spec
  for name in ("w", "step", "lr"):
    want = np.stack([np.asarray(m[name]) for m in members])
    np.testing.assert_array_equal(np.asarray(stacked[name]), want)
    np.testing.assert_array_equal(np.asarray(doubled[name]), want * 2)
    assert (spec[name].shape, spec[name].dtype) == (want.shape, want.dtype), name
  assert stacked["w"].sharding == spec["w"].sharding
  assert stacked["w"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert stacked["step"].sharding == spec["step"].sharding
  assert spec["lr"].sharding is None  # a host leaf: placed by the program


def test_settings_that_change_the_program_are_rejected(monkeypatch):
  base = _config(FIXED)
  with pytest.raises(members_lib.VmapError, match=r"config\.sampling\.temperature differs"):
    members_lib.check_vmappable([base, _config({**FIXED, "sampling.temperature": 0.7})])
  with pytest.raises(members_lib.VmapError, match=r"config\.train\.prompts_per_step differs"):
    members_lib.check_vmappable([base, _config({**FIXED, "train.prompts_per_step": 8})])
  with pytest.raises(members_lib.VmapError, match=r"config\.loss\.beta is 0 for some"):
    members_lib.check_vmappable([base, _config({**FIXED, "loss.beta": 0.0})])
  members_lib.check_vmappable([base, _config(OTHER), _config({**FIXED, "seed": 3})])
  # Several processes: members.generate samples each process's rows as if they were all.
  monkeypatch.setattr(members_lib.hosts, "count", lambda: 2)
  with pytest.raises(members_lib.VmapError, match=r"runs in one process, and this is one of 2"):
    members_lib.check_vmappable([base, _config(OTHER)])
  members_lib.check_vmappable([base])  # one run: several processes share it (grpo_jax/hosts.py)
  # What members vary enters the program as arrays, formed in float64 and rounded once, as a
  # separate run's Python constants are (1.0 - epsilon folded, then float32).
  hp = [train_step.hparams(c.loss, c.optim, c.rewards.weights) for c in (base, _config(OTHER))]
  assert [float(h["clip_low"]) for h in hp] == [np.float32(1.0 - 0.2), np.float32(1.0 - 0.1)]
  assert [float(h["clip_high"]) for h in hp] == [np.float32(1.0 + 0.2)] * 2
  assert [float(h["lr"]) for h in hp] == [np.float32(base.optim.lr), np.float32(1e-5)]
  assert [h["reward_weights"].tolist() for h in hp] == [[1.0], [2.0]]


def test_the_runner_groups_what_one_program_can_run():
  runs = sweep.plan(sweep.Sweep(
      config="configs/gsm8k.py:tiny", fixed={"train.steps": 3},
      runs=sweep.product(sweep.sweep_axis("optim.lr", [1e-5, 1e-4]), sweep.seeds(2))
      + [{"sampling.temperature": 0.7}, {"loss.beta": 0.04}, {"loss.beta": 0.1}]),
      min_shared=1)
  groups = sweep.vmap_groups([r for r in runs if r.kind == "run"],
                             sweep.load_config("configs/gsm8k.py:tiny"))
  names = sorted(sorted(r.name for r in g) for g in groups)
  assert names == [["loss.beta=0.04", "loss.beta=0.1"],
                   ["optim.lr=0.0001,seed=0", "optim.lr=0.0001,seed=1", "optim.lr=1e-05,seed=0",
                    "optim.lr=1e-05,seed=1"],
                   ["sampling.temperature=0.7"]]


def test_a_rerun_groups_only_members_that_resume_from_the_same_step(tmp_path):
  """One member failed alone at step ~60 (checkpoints 0, 50); the other two went on to 200
  (keep_checkpoints=3 left 100, 150, 200). A rerun groups the two at 200 and runs the third
  alone, and start_lib.start resumes each unit: one group would have needed step 50 from all."""
  import jax
  import jax.numpy as jnp
  from types import SimpleNamespace as NS
  from grpo_jax import checkpoint
  state = {"train": {"x": jnp.arange(4.0)}}
  pos = {"epoch": 0, "index": 0, "num_rows": 10, "seed": 0}
  steps = {"failed": (0, 50), "ahead": (0, 50, 100, 150, 200), "also_ahead": (0, 100, 200),
           "fresh": ()}
  for name, saves in steps.items():
    os.makedirs(tmp_path / name)
    with checkpoint.Checkpointer(str(tmp_path / name), max_to_keep=3) as c:
      for step in saves:
        c.save(step, {"train": {"x": state["train"]["x"] + step}}, pos)
        c.wait()
  s = sweep.Sweep("configs/gsm8k.py:tiny", [{}], fixed={})
  runs = [sweep.Run(name=n, overrides={}, args={}) for n in steps]
  runner = sweep_runner.Runner(s, runs, str(tmp_path), vmap_groups=[runs])
  units = runner._units(runs)
  assert sorted(sorted(r.name for r in runner._members(u)) for u in units) == [
      ["ahead", "also_ahead"], ["failed"], ["fresh"]]
  assert [isinstance(u, sweep_runner.Group) for u in units] == [False, True, False]

  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = {"train": {"x": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sh)}}
  trainer = NS(abstract_checkpoint=lambda: abstract, policy_type=policy.FULL)
  config = NS(train=NS(prompts_per_step=2, steps=200), seed=0, loss=None)
  for u, want in zip(units[:2], (50, 200)):
    members = [NS(workdir=runner.run_dir(r), config=config,
                  setup=NS(train_rows=[0] * 10, previous_config=None))
               for r in runner._members(u)]
    start, states, _ = start_lib.start(members, [trainer] * len(members))
    assert start == want
    for st in states:
      np.testing.assert_array_equal(np.asarray(st["x"]), np.arange(4.0) + want)
  # Grouped as before (all four), the group cannot start.
  members = [NS(workdir=runner.run_dir(r)) for r in runs[:2]]
  with pytest.raises(members_lib.VmapError, match="no checkpoint at step 50"):
    start_lib.start(members, [trainer] * 2)


def test_a_group_resumes_below_a_members_damaged_latest_step(tmp_path, capsys):
  """Two members with checkpoints at steps 1 and 2; the second's step 2 is damaged (a file's
  bytes changed after its checksums). The group resumes both at step 1, as a single run of the
  damaged member would; restoring step 2 from it failed the whole group."""
  import jax
  import jax.numpy as jnp
  from types import SimpleNamespace as NS
  from grpo_jax import checkpoint
  pos = {"epoch": 0, "index": 0, "num_rows": 10, "seed": 0}
  for name in ("a", "b"):
    with checkpoint.Checkpointer(str(tmp_path / name)) as c:
      for step in (1, 2):
        c.save(step, {"train": {"x": jnp.arange(4.0) + step}}, pos)
        c.wait()
  step2 = tmp_path / "b" / "checkpoints" / "2"
  victim = max((p for p in step2.rglob("*") if p.is_file() and p.name != "SHA256SUMS"),
               key=lambda p: p.stat().st_size)
  victim.write_bytes(b"\0" + victim.read_bytes()[1:])
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = {"train": {"x": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sh)}}
  trainer = NS(abstract_checkpoint=lambda: abstract, policy_type=policy.FULL)
  config = NS(train=NS(prompts_per_step=2, steps=2), seed=0, loss=None)
  members = [NS(workdir=str(tmp_path / n), config=config,
                setup=NS(train_rows=[0] * 10, previous_config=None))
             for n in ("a", "b")]
  start, states, _ = start_lib.start(members, [trainer] * 2)
  assert start == 1
  for st in states:
    np.testing.assert_array_equal(np.asarray(st["x"]), np.arange(4.0) + 1)
  assert f"checkpoint step 2 in {tmp_path / 'b' / 'checkpoints'} is unusable" in capsys.readouterr().err


def test_each_member_samples_and_scores_with_its_own_tokenizer(tmp_path, monkeypatch):
  """Members of a group have their own tokenizers (the tiny preset learns its BPE from each
  run's problems): members.sample encodes each member's prompts and decodes its completions with
  that member's tokenizer, never the first member's. The sampler is a stand-in that checks the
  prompts it gets and returns each member the ids of one known answer in its own tokenizer."""
  from grpo_jax import inputs, members, rollout, sampler as sampler_lib
  from grpo_jax.rewards import build_rewards
  configs, toks, rows = [], [], []
  for seed in (0, 1):
    c = _config({"seed": seed, "data.synthetic_train": 2000, "data.synthetic_test": 10,
                 "sampling.num_generations": 2})
    train_rows, _ = inputs.datasets(c, str(tmp_path / str(seed)))
    tok, _ = inputs.tokenizer(c, str(tmp_path / str(seed)), train_rows)
    configs.append(c), toks.append(tok), rows.append(train_rows[:2])
  # An answer that member 1's first problem counts right, after its question's words, which
  # the two tokenizers number differently (the same merges, learnt in another order).
  answer = rows[1][0]["answer"].split("####")[-1].strip()
  text = f"{rows[1][0]['question']} <answer>{answer}</answer>"
  ids = [t(text, add_special_tokens=False).input_ids for t in toks]
  assert ids[0] != ids[1], text  # the two tokenizers really differ on this text

  def stand_in(sampler, params_K, prompts_K, *, num_samples, keys_K=None, greedy=False,
               batched=True):
    for c, tok, r, got in zip(configs, toks, rows, prompts_K):
      assert [list(p) for p in got] == rollout.encode(c, tok, r).ids
    outs = []
    for member_ids in ids:
      tokens = np.asarray([member_ids] * (2 * num_samples), np.int32)
      lengths = np.full(2 * num_samples, len(member_ids), np.int32)
      outs.append(sampler_lib.SampleOutput(tokens, lengths, np.zeros(len(tokens), bool),
                                           None, None, None, {}))
    return outs

  monkeypatch.setattr(members, "generate", stand_in)
  singles = [rollout.SingleTurn(c, t, None) for c, t in zip(configs, toks)]
  rewards = [build_rewards(c.rewards) for c in configs]
  parts = members.sample(singles, None, rows, rewards, [None, None])
  for (part, _, _, _), tok in zip(parts, toks):
    assert part.texts == [tok.decode(ids[toks.index(tok)], skip_special_tokens=True)] * 4
  # Member 1's first prompt asks for answers[0]: its own decoding of its own ids scores 1.
  assert parts[1][0].reward_BR[0, 0] == 1.0


def test_members_that_draw_the_same_rows_encode_them_once(tmp_path, monkeypatch):
  """A sweep's members from one seed draw the same rows each round: members.encode runs the chat
  template and the tokenizer once for them, and each member gets what its own encode gives.
  Members with other rows, another tokenizer or another user template are encoded apart."""
  from grpo_jax import inputs, members as members_lib, rollout
  c = _config({"data.synthetic_train": 2000, "data.synthetic_test": 10})
  train_rows, _ = inputs.datasets(c, str(tmp_path / "a"))
  tok, _ = inputs.tokenizer(c, str(tmp_path / "a"), train_rows)
  other_tok, _ = inputs.tokenizer(c, str(tmp_path / "b"), train_rows)  # the same, another object
  templated = _config({"data.user_template": "Solve: {question}"})
  same, other = train_rows[:4], train_rows[4:8]
  members = [(c, tok, same), (c, tok, same), (c, tok, None), (c, tok, other),
             (c, other_tok, same), (templated, tok, same), (c, tok, same)]
  want = [None if r is None else rollout.encode(m, t, r) for m, t, r in members]
  calls = []
  encode = rollout.encode
  monkeypatch.setattr(rollout, "encode", lambda *a: calls.append(a) or encode(*a))
  got = members_lib.encode([rollout.SingleTurn(m, t, None) for m, t, _ in members],
                           [r for _, _, r in members])
  assert got == want
  assert got[0] is got[1] is got[6]  # one encode for the three
  assert len(calls) == 4  # same (x3), other rows, other tokenizer, other template
  assert got[5].texts != got[0].texts and all("Solve: " in t for t in got[5].texts)


def test_a_failing_member_is_recorded_as_failed_and_its_group_goes_on(tmp_path, monkeypatch):
  """A member whose steps are all non-finite (NaN reward weights in its train step's hparams:
  NaN advantages, NaN loss, so train_step skips every step) fails at step 1 with
  train.max_bad_steps=1, as its separate run would (TooManyBadSteps), while the other member
  runs to the end with its separate run's numbers (the tolerances above). Two members, the
  first failing: from step 2 on the group samples for the second only, and the first trains
  on its batch, thrown away. The NaN enters the program through Trainer.hparams, since
  validate refuses a NaN rewards.weights in a config."""
  fixed = {**FIXED, "loss.beta": 0.0, "train.max_bad_steps": 1, "train.checkpoint_every": 1,
           "train.keep_checkpoints": 10,
           # Batched, as off the CPU: the tests above run the CPU's default, each member in turn.
           "train.members": "vmap"}
  good = {**fixed, "optim.lr": 1e-4}
  bad_config = _config(good)  # told apart by identity: its hparams get NaN reward weights
  real_hparams = trainer_lib.Trainer.hparams

  def hparams(self, config):
    hp = real_hparams(self, config)
    if config is bad_config:
      hp = dict(hp, reward_weights=np.full_like(hp["reward_weights"], np.nan))
    return hp
  monkeypatch.setattr(trainer_lib.Trainer, "hparams", hparams)
  sep, a, b = (str(tmp_path / n) for n in ("separate", "bad", "good"))
  train.run(_config(good), sep)
  for d in (a, b):
    os.makedirs(d)
    sweep_runner.start_from_prefix(sep, d)
  summaries = train.run_group([bad_config, _config(good)], [a, b])
  assert "TooManyBadSteps" not in summaries[1] and "eval_accuracy_gain_points" in summaries[1]
  assert "1 consecutive non-finite steps up to step 1" in summaries[0]["failed"]

  # The good member: every file of a finished run, its numbers its separate run's.
  want, got = _metrics_match(sep, b)
  read = lambda d, f: open(os.path.join(d, f)).read()
  assert read(b, "samples.md") == read(sep, "samples.md")
  assert read(b, "summary.json") == read(sep, "summary.json")
  assert os.path.isfile(os.path.join(b, "final_model", "model.safetensors"))
  assert sorted(os.listdir(os.path.join(b, "checkpoints"))) == ["0", "1", "2", "3"]
  assert not os.path.exists(os.path.join(b, workdir_files.FAILURE_FILE))

  # The failed member: what its separate run leaves (no metrics for the step that failed, no
  # checkpoint after the last good one, no summary or model) and the failure record.
  assert [r["step"] for r in logging_io.read_jsonl(os.path.join(a, "metrics.jsonl"))] == [0]
  assert sorted(os.listdir(os.path.join(a, "checkpoints"))) == ["0"]
  assert not os.path.exists(os.path.join(a, "summary.json"))
  assert not os.path.exists(os.path.join(a, "final_model"))
  record = json.loads(read(a, workdir_files.FAILURE_FILE))
  assert (record["error"], record["step"]) == ("TooManyBadSteps", 1)

  # The sweep runner's verdict on the group's exit (status 0): failed with the reason, and done.
  s = sweep.Sweep("configs/gsm8k.py:tiny", [{}], fixed={})
  runs = [sweep.Run(name=n, overrides={}, args={}) for n in ("bad", "good")]
  runner = sweep_runner.Runner(s, runs, str(tmp_path))
  verdicts = []
  for r in runs:
    runner.records[r.dir]["attempts"].append({"started": "now"})
    verdicts.append(runner._finish(r, 0, time.monotonic()))
  assert verdicts[1] == ("done", None)
  assert verdicts[0][0] == "failed"
  assert verdicts[0][1].startswith("TooManyBadSteps at step 1: ")
  assert "consecutive non-finite steps" in verdicts[0][1]

  # Run again (as the sweep does with an unfinished member): the record goes when it starts.
  with pytest.raises(runs_lib.TooManyBadSteps):
    train.run(bad_config, a)
  assert not os.path.exists(os.path.join(a, workdir_files.FAILURE_FILE))


def test_a_member_whose_reward_goes_missing_fails_alone(tmp_path, monkeypatch):
  """The other way a member fails alone: its reward returns None (could not score) for every
  completion, and with train.max_missing_reward_steps=1 its reward health raises
  MissingRewardsError at step 1. As its separate run, it logs that step and saves its
  checkpoint, then stops; the other member (the first here) runs to the end."""
  from grpo_jax.rewards import Reward
  real_setup = prepare.setup

  def setup(config, workdir, shared=None):  # the second member's reward never scores
    s = real_setup(config, workdir, shared)
    if workdir.endswith("silent"):
      s.rewards = [Reward(r.name, r.weight, lambda p, c, **kw: [None] * len(c))
                   for r in s.rewards]
    return s
  monkeypatch.setattr(prepare, "setup", setup)
  fixed = {"sft.steps": 0, "train.steps": 2, "train.eval_examples": 8, "train.eval_every": 0,
           "train.checkpoint_every": 1, "train.keep_checkpoints": 10,
           "train.tensorboard": False, "train.max_missing_reward_steps": 1}
  a, b = str(tmp_path / "fine"), str(tmp_path / "silent")
  summaries = train.run_group([_config({**fixed, "optim.lr": 1e-4}),
                               _config({**fixed, "optim.lr": 1e-5})], [a, b])
  assert "eval_accuracy_gain_points" in summaries[0]
  assert "missing" in summaries[1]["failed"]
  steps = lambda d: [r["step"] for r in logging_io.read_jsonl(os.path.join(d, "metrics.jsonl"))]
  assert steps(a) == [0, 1, 2] and steps(b) == [0, 1]
  assert sorted(os.listdir(os.path.join(a, "checkpoints"))) == ["0", "1", "2"]
  assert sorted(os.listdir(os.path.join(b, "checkpoints"))) == ["0", "1"]
  assert os.path.isfile(os.path.join(a, "final_model", "model.safetensors"))
  assert os.path.isfile(os.path.join(a, "summary.json"))
  assert not os.path.exists(os.path.join(b, "summary.json"))
  assert not os.path.exists(os.path.join(b, "final_model"))
  record = json.loads(open(os.path.join(b, workdir_files.FAILURE_FILE)).read())
  assert (record["error"], record["step"]) == ("MissingRewardsError", 1)
  assert sweep_runner.failure(b).startswith("MissingRewardsError at step 1: ")
  assert sweep_runner.failure(a) is None and sweep_runner.summary_complete(a)
