"""Sweeps: expansion and names, the warm-start allow-list against the optimizer and the config,
and the runner (skip, resume, a failure, Ctrl-C) on tests/fake_main.py, a stand-in for main that
writes main's files in milliseconds."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cli import REPO
from grpo_jax import config as config_lib, report, sweep, sweep_runner, train_step

TESTS = os.path.dirname(os.path.abspath(__file__))
TINY = "configs/gsm8k.py:tiny"


# --- sweeps as data -----------------------------------------------------------------------------

def test_product_zip_seeds():
  lrs = sweep.sweep_axis("optim.lr", [1e-5, 3e-5])
  assert sweep.product(lrs, sweep.seeds(2)) == [
      {"optim.lr": 1e-5, "seed": 0}, {"optim.lr": 1e-5, "seed": 1},
      {"optim.lr": 3e-5, "seed": 0}, {"optim.lr": 3e-5, "seed": 1}]
  assert sweep.zip_(lrs, sweep.sweep_axis("optim.b2", [0.9, 0.99])) == [
      {"optim.lr": 1e-5, "optim.b2": 0.9}, {"optim.lr": 3e-5, "optim.b2": 0.99}]
  assert sweep.seeds(2, start=5) == [{"seed": 5}, {"seed": 6}]
  assert sweep.product(sweep.fixed("train.steps", 9), sweep.seeds(1)) == [
      {"train.steps": 9, "seed": 0}]
  with pytest.raises(ValueError, match="one length"):
    sweep.zip_(lrs, sweep.seeds(3))
  with pytest.raises(ValueError, match="'seed' is set by two axes"):
    sweep.product(sweep.seeds(2), sweep.seeds(2))


def test_run_names_are_sorted_readable_and_filesystem_safe():
  assert sweep.run_name({"seed": 1, "optim.lr": 3e-5}) == "optim.lr=3e-05,seed=1"
  assert sweep.run_name({}) == "base"
  assert sweep.run_name({"rewards.names": ("math_accuracy", "format")}) == (
      "rewards.names=math_accuracy+format")
  assert sweep.run_name({"data.source": "../x/y z"}) == "data.source=.._x_y_z"
  long = sweep.run_name({f"k{i}": "v" * 30 for i in range(10)})
  assert len(long) == 200 and long != sweep.run_name({f"k{i}": "v" * 31 for i in range(10)})
  assert sweep.cli_value(3e-5) == "3e-05" and sweep.cli_value(("a", "b")) == "('a', 'b')"
  with pytest.raises(sweep.SweepError, match="same name"):
    sweep.plan(sweep.Sweep(TINY, [{"x": "a/b"}, {"x": "a_b"}]))


def test_numpy_scalars_in_axes_are_the_python_numbers_they_hold():
  """np.logspace gives np.float64: its repr 'np.float64(1e-05)' named the run and reached main
  as text main could not parse; a run's values are Python numbers from the axis on."""
  lrs = np.logspace(-5, -3, 3)  # 9.999999999999999e-06, 0.0001, 0.001
  runs = sweep.product(sweep.sweep_axis("optim.lr", lrs), sweep.sweep_axis("seed", np.arange(2)))
  assert runs[0] == {"optim.lr": float(lrs[0]), "seed": 0}
  assert [type(v) for v in runs[-1].values()] == [float, int]
  assert [r.name for r in sweep.plan(sweep.Sweep(TINY, runs))][-3:] == [
      "optim.lr=0.0001,seed=1", "optim.lr=0.001,seed=0", "optim.lr=0.001,seed=1"]
  assert sweep.fixed("train.steps", np.int64(3)) == [{"train.steps": 3}]
  assert sweep.cli_value(np.float64(1e-4)) == "0.0001"
  # Hand-listed runs and fixed values too: plan takes them as Python numbers.
  (r,) = sweep.plan(sweep.Sweep(TINY, [{"optim.lr": np.float32(0.5)}],
                                fixed={"train.steps": np.int64(4)}))
  assert r.name == "optim.lr=0.5" and r.args == {"train.steps": 4, "optim.lr": 0.5}
  assert type(r.args["train.steps"]) is int and type(r.args["optim.lr"]) is float


def test_prefix_names_stay_apart_where_a_file_name_merges_their_values(tmp_path, fake_env):
  """'Be brief!' and 'Be brief?' both sanitise to 'Be_brief_': each prefix name ends in a hash
  of its own warm-start part, so neither group starts from the other's warm start."""
  s = sweep.Sweep(TINY, sweep.zip_(sweep.sweep_axis("data.system_prompt", ["Be brief!",
                                                                           "Be brief?"]),
                                   sweep.sweep_axis("optim.lr", [1e-4, 3e-4])))
  runs = sweep.plan(s, min_shared=1)
  prefixes = [r for r in runs if r.kind == "prefix"]
  assert len({p.name for p in prefixes}) == 2
  assert all(p.name.startswith("data.system_prompt=Be_brief_,") for p in prefixes)
  assert [p.args["data.system_prompt"] for p in prefixes] == ["Be brief!", "Be brief?"]
  members = [r for r in runs if r.kind == "run"]
  assert [r.prefix for r in members] == [p.name for p in prefixes]
  # On fake_main, whose step-0 state is its warm-start args: each run starts from its own.
  assert sweep_runner.Runner(s, runs, tmp_path, main_module="fake_main").run() == 0
  for r in members:
    state = json.loads((tmp_path / r.name / "checkpoints/0/state").read_text())
    assert state == {"data.system_prompt": r.overrides["data.system_prompt"]}, r.name
  # Stable: the same name on every plan (a rerun finds the prefix it made).
  assert [p.name for p in sweep.plan(s, min_shared=1) if p.kind == "prefix"] == [
      p.name for p in prefixes]
  # A name that sanitising did not change stays as it was.
  assert [r.name for r in sweep.plan(sweep.Sweep(TINY, sweep.seeds(1)), min_shared=1)] == [
      "seed=0", "seed=0"]
  # One name without a replaced character: refused, not merged.
  with pytest.raises(sweep.SweepError, match="same prefix name 'data.system_prompt=1'"):
    sweep.plan(sweep.Sweep(TINY, [{"data.system_prompt": 1, "optim.lr": 1.0},
                                  {"data.system_prompt": "1", "optim.lr": 2.0}]), min_shared=1)


def test_vmap_groups_keep_lora_runs_with_seeded_bases_apart():
  """A LoRA run's frozen base comes from its seed when it has a warm start or random weights
  (members.shared_base refuses such a group): one group per seed. tiny_lora has both."""
  s = sweep.load_sweep(os.path.join(REPO, "experiments/tiny_lora_seeds.py"))
  s.runs = sweep.product(sweep.sweep_axis("optim.lr", [1e-3, 3e-3]), s.runs)
  runs = [r for r in sweep.plan(s, min_shared=1) if r.kind == "run"]
  groups = sweep.vmap_groups(runs, sweep.load_config(s.config))
  assert [[r.name for r in g] for g in groups] == [
      [f"optim.lr=0.001,seed={i}", f"optim.lr=0.003,seed={i}"] for i in range(5)]
  # A base from a checkpoint, no warm start: the same for every seed, one group.
  fixed = {"sft.steps": 0, "model.random_init": False, "model.checkpoint": "ckpt"}
  s = sweep.Sweep("configs/gsm8k.py:tiny_lora", sweep.seeds(3), fixed=fixed)
  assert len(sweep.vmap_groups(sweep.plan(s), sweep.load_config(s.config))) == 1
  # Full fine-tuning: seeds share a group whatever the warm start.
  s = sweep.Sweep(TINY, sweep.seeds(3))
  assert len(sweep.vmap_groups(sweep.plan(s), sweep.load_config(TINY))) == 1


def test_plan_shares_a_warm_start_only_across_post_warm_start_keys():
  runs = sweep.plan(sweep.load_sweep(os.path.join(REPO, "experiments/tiny_lr.py")))
  prefixes = [r for r in runs if r.kind == "prefix"]
  assert [p.name for p in prefixes] == ["seed=0", "seed=1", "seed=2"]
  assert prefixes[1].args == {"seed": 1, **sweep.PREFIX_OVERRIDES}  # train.steps=200 dropped
  members = [r for r in runs if r.kind == "run"]
  assert len(members) == 9 and {r.prefix for r in members} == {"seed=0", "seed=1", "seed=2"}
  assert members[0].dir == "optim.lr=1e-05,seed=0" and prefixes[0].dir == "prefixes/seed=0"
  assert members[0].args == {"train.steps": 200, "optim.lr": 1e-5, "seed": 0}
  # The seed and the warm start's own settings are not shared; a lone run has no prefix.
  assert all(r.kind == "run" and r.prefix is None for r in sweep.plan(
      sweep.load_sweep(os.path.join(REPO, "experiments/tiny_seeds.py"))))
  mixed = sweep.plan(sweep.Sweep(TINY, [{"optim.lr": 1.0}, {"optim.lr": 2.0},
                                        {"optim.lr": 1.0, "sft.lr": 0.1}]))
  assert [(r.dir, r.prefix) for r in mixed] == [
      ("prefixes/base", None), ("optim.lr=1.0", "base"), ("optim.lr=2.0", "base"),
      ("optim.lr=1.0,sft.lr=0.1", None)]
  assert all(r.prefix is None for r in sweep.plan(sweep.Sweep(TINY, [{"optim.lr": 1.0},
                                                                     {"optim.lr": 2.0}]),
                                                  share_prefix=False))


def test_overrides_are_checked_against_the_config():
  config = sweep.load_config(TINY)
  for name in ("tiny_lr.py", "tiny_seeds.py"):
    sweep.check_overrides(config, sweep.plan(sweep.load_sweep(
        os.path.join(REPO, "experiments", name))))
  for key in sweep.POST_WARM_START:  # a renamed field would otherwise just never match
    node = config
    for part in key.split("."):
      node = node[part]
  with pytest.raises(sweep.SweepError, match="optim.lrr=0.1 names no config field"):
    sweep.check_overrides(config, sweep.plan(sweep.Sweep(TINY, [{"optim.lrr": 0.1}])))
  with pytest.raises(sweep.SweepError, match="train.steps='many' does not fit"):
    sweep.check_overrides(config, sweep.plan(sweep.Sweep(TINY, [{"train.steps": "many"}])))


def test_step0_optimizer_state_does_not_depend_on_the_shared_optim_keys():
  """What makes optim.* post-warm-start: a member's step-0 state is the prefix's. Values are
  changed one key at a time from the tiny preset's; max_grad_norm=0 changes the structure,
  which is why it is not on the list."""
  config = sweep.load_config(TINY)
  base = config_lib.optim_settings(config)  # what the trainer runs (cosine's total_steps filled)
  # The schedule changed from whichever the preset uses to the other one.
  schedule = ({"schedule": "constant", "total_steps": 0} if base.schedule == "cosine"
              else {"schedule": "cosine", "total_steps": 100})
  params = {"w": jnp.ones((3, 2)), "norm": jnp.ones((2,))}
  init = lambda cfg: jax.tree.flatten(train_step.make_optimizer(cfg).init(params))
  leaves, treedef = init(base)
  changes = [{"lr": 1e-2}, {"b1": 0.5}, {"b2": 0.5}, {"weight_decay": 0.1},
             {"warmup_steps": 7}, schedule]
  assert {f"optim.{k}" for c in changes for k in c} == {
      k for k in sweep.POST_WARM_START if k.startswith("optim.")}
  for change in changes:
    cfg = base.copy_and_resolve_references()
    cfg.update(change)
    other, other_def = init(cfg)
    assert other_def == treedef, change
    assert all((a == b).all() for a, b in zip(leaves, other)), change
  cfg = base.copy_and_resolve_references()
  cfg.max_grad_norm = 0.0
  assert init(cfg)[1] != treedef


# --- the runner on a fake main ------------------------------------------------------------------

@pytest.fixture
def fake_env(monkeypatch):
  monkeypatch.setattr(sweep_runner, "POLL_S", 0.02)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, str(REPO)]))
  monkeypatch.chdir(REPO)
  monkeypatch.delenv("FAKE_FAIL", raising=False)
  monkeypatch.delenv("FAKE_WAIT", raising=False)


def _run(workdir, s, parallel=2):
  runner = sweep_runner.Runner(s, sweep.plan(s), workdir, parallel=parallel,
                               main_module="fake_main")
  return runner.run(), runner


def _calls(path):
  p = os.path.join(path, "calls.jsonl")
  return [json.loads(line) for line in open(p)] if os.path.exists(p) else []


LR_SEEDS = sweep.Sweep(TINY, sweep.product(sweep.sweep_axis("optim.lr", [1e-3, 2e-3]),
                                           sweep.seeds(2)), fixed={"train.steps": 3})


def test_sweep_runs_prefixes_then_members_from_their_step0(tmp_path, fake_env):
  code, runner = _run(tmp_path, LR_SEEDS)
  assert code == 0
  index = json.load(open(tmp_path / "sweep.json"))
  assert [(r["dir"], r["status"]) for r in index["runs"]] == [
      ("prefixes/seed=0", "done"), ("prefixes/seed=1", "done"),
      ("optim.lr=0.001,seed=0", "done"), ("optim.lr=0.001,seed=1", "done"),
      ("optim.lr=0.002,seed=0", "done"), ("optim.lr=0.002,seed=1", "done")]
  prefix = _calls(tmp_path / "prefixes/seed=1")
  assert prefix == [{"args": {"seed": 1, "train.steps": 0, "optim.schedule": "constant"},
                     "resumed_from": None}]
  member = tmp_path / "optim.lr=0.002,seed=1"
  assert _calls(member) == [{"args": {"train.steps": 3, "optim.lr": 0.002, "seed": 1},
                             "resumed_from": 0}]
  # Its step 0 is the prefix's: the warm-start state and the step-0 eval line.
  assert (member / "checkpoints/0/state").read_text() == json.dumps({"seed": 1})
  assert json.loads((member / "metrics.jsonl").read_text().splitlines()[0]) == {
      "step": 0, "eval/accuracy": 0.11}
  rec = json.load(open(member / "sweep_run.json"))
  assert rec["status"] == "done" and rec["returncode"] == 0 and rec["prefix"] == "seed=1"
  assert rec["overrides"] == {"optim.lr": 0.002, "seed": 1} and len(rec["attempts"]) == 1
  assert "fake_main: {" in (member / "log.txt").read_text()
  # Run again: everything is finished, nothing is launched.
  code, _ = _run(tmp_path, LR_SEEDS)
  assert code == 0 and len(_calls(member)) == 1 and len(_calls(tmp_path / "prefixes/seed=0")) == 1


def test_overrides_reach_main_as_values_not_flag_text(tmp_path, fake_env, capsys):
  """None and numpy scalars through the runner's own command and main's flags and main()
  (tests/config_main.py: main whose train.run writes the config it was given). As
  --config.k=v text a placeholder got the string 'None' (a system turn saying "None"),
  loss.delta=None and np.float64 stopped main at flag parsing."""
  s = sweep.Sweep(TINY, [{"data.system_prompt": None, "seed": 0},
                         {"loss.delta": None, "seed": 1},
                         {"optim.lr": np.float64(3e-4), "seed": np.int64(2)}],
                  fixed={"model.attention": None})
  runner = sweep_runner.Runner(s, sweep.plan(s), tmp_path, main_module="config_main")
  runner.print_plan()
  plan = capsys.readouterr().out
  assert (f"--overrides={tmp_path}/data.system_prompt=None,seed=0/sweep_overrides.json"
          in plan)
  assert 'overrides: {"model.attention": null, "data.system_prompt": null, "seed": 0}' in plan
  assert runner.run() == 0
  parsed = {r.name: json.load(open(tmp_path / r.name / "parsed_config.json")) for r in runner.runs}
  base = sweep.load_config(TINY)
  assert base.data.system_prompt is None and base.loss.delta is None  # what None is for
  p = parsed["data.system_prompt=None,seed=0"]
  assert p["data"]["system_prompt"] is None and p["model"]["attention"] is None
  assert parsed["loss.delta=None,seed=1"]["loss"]["delta"] is None
  p = parsed["optim.lr=0.0003,seed=2"]
  assert (p["optim"]["lr"], p["seed"], p["loss"]["delta"]) == (3e-4, 2, None)


def test_a_vmapped_member_is_charged_its_share_of_the_group_wall_time(tmp_path, fake_env,
                                                                      monkeypatch):
  """K members share one process: each member's wall_s is the group's time / K (the group's
  own time in group_wall_s); the report's wall column reads it."""
  s = sweep.Sweep(TINY, sweep.seeds(2), fixed={"train.steps": 3})
  runs = sweep.plan(s, min_shared=1)
  groups = sweep.vmap_groups([r for r in runs if r.kind == "run"], sweep.load_config(TINY))
  assert [len(g) for g in groups] == [2]
  # The group's process: 2 s asleep, then each member's finished summary.
  script = ("import json, sys, time\ntime.sleep(2)\nfor d in sys.argv[1:]:\n"
            "  json.dump({'eval_accuracy_gain_points': 1.0}, open(d + '/summary.json', 'w'))\n")
  real = sweep_runner.Runner.command
  monkeypatch.setattr(sweep_runner.Runner, "command", lambda self, r: (
      [sys.executable, "-c", script, *(self.run_dir(m) for m in r.members)]
      if isinstance(r, sweep_runner.Group) else real(self, r)))
  runner = sweep_runner.Runner(s, runs, tmp_path, main_module="fake_main", vmap_groups=groups)
  assert runner.run() == 0
  index = {r["dir"]: r for r in json.load(open(tmp_path / "sweep.json"))["runs"]}
  for name in ("seed=0", "seed=1"):
    (attempt,) = json.load(open(tmp_path / name / "sweep_run.json"))["attempts"]
    group_wall = attempt["group_wall_s"]
    assert group_wall >= 2.0
    assert attempt["wall_s"] == pytest.approx(group_wall / 2, abs=0.051)
    assert index[name]["wall_s"] == attempt["wall_s"]
  walls = {r.dir: r.wall_s for r in report.load_runs(str(tmp_path))}
  assert walls == {n: index[n]["wall_s"] for n in ("seed=0", "seed=1")}


def test_vmap_with_a_main_module_is_refused(tmp_path, capsys):
  """Groups run grpo_jax.train, not the wrapper: refused in one line, not silently ignored."""
  sweep_file = tmp_path / "s.py"
  sweep_file.write_text("from grpo_jax import sweep\n"
                        "def get_sweep():\n"
                        "  return sweep.Sweep('configs/gsm8k.py:tiny', sweep.seeds(2))\n")
  with pytest.raises(SystemExit) as e:
    sweep.main([str(sweep_file), f"--workdir={tmp_path}/w", "--vmap", "--dry_run",
                "--main_module=fake_main"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert "--vmap" in err and "--main_module=fake_main" in err


def test_a_lora_prefix_hands_over_its_base_too(tmp_path):
  """A LoRA run's checkpoints hold the adapters only; its warm-started base is base_model/
  (workdir_files.BASE_DIR), which a member started from the prefix needs to resume: linked, not copied."""
  prefix, run = tmp_path / "prefix", tmp_path / "run"
  (prefix / "checkpoints/0").mkdir(parents=True)
  (prefix / "checkpoints/0/SHA256SUMS").write_text("sums")
  (prefix / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n')
  (prefix / "base_model").mkdir()
  (prefix / "base_model/model.safetensors").write_bytes(b"weights")
  run.mkdir()
  assert sweep_runner.start_from_prefix(str(prefix), str(run))
  assert (run / "base_model/model.safetensors").read_bytes() == b"weights"
  assert os.path.samefile(run / "base_model/model.safetensors",
                          prefix / "base_model/model.safetensors")
  assert (run / "checkpoints/0/SHA256SUMS").read_text() == "sums"
  # A prefix without one (full fine-tuning) gives none.
  other = tmp_path / "other"
  other.mkdir()
  (prefix / "base_model/model.safetensors").unlink()
  (prefix / "base_model").rmdir()
  assert sweep_runner.start_from_prefix(str(prefix), str(other))
  assert not (other / "base_model").exists()


def test_a_failed_run_is_recorded_the_sweep_goes_on_and_a_rerun_redoes_only_it(
    tmp_path, fake_env, monkeypatch):
  monkeypatch.setenv("FAKE_FAIL", json.dumps(["optim.lr=0.001,seed=1"]))
  code, _ = _run(tmp_path, LR_SEEDS, parallel=1)
  assert code == 1
  failed = tmp_path / "optim.lr=0.001,seed=1"
  rec = json.load(open(failed / "sweep_run.json"))
  assert (rec["status"], rec["returncode"], rec["reason"]) == ("failed", 3, "exit code 3")
  assert rec["log"] == str(failed / "log.txt") and "fake_main: boom" in (
      failed / "log.txt").read_text()
  statuses = {r["dir"]: r["status"] for r in json.load(open(tmp_path / "sweep.json"))["runs"]}
  assert sum(s == "done" for s in statuses.values()) == 5  # 2 prefixes, 3 runs
  monkeypatch.delenv("FAKE_FAIL")
  code, _ = _run(tmp_path, LR_SEEDS)
  assert code == 0
  assert [c["resumed_from"] for c in _calls(failed)] == [0, 0]  # from the copied step 0
  for other in ("optim.lr=0.001,seed=0", "optim.lr=0.002,seed=1", "prefixes/seed=0"):
    assert len(_calls(tmp_path / other)) == 1, other


def test_a_rerun_that_fails_early_reports_its_own_exit_not_an_earlier_failure(
    tmp_path, fake_env, monkeypatch):
  """A run that failed alone in a --vmap group left failed.json (TooManyBadSteps at step 1).
  Its rerun exits 3 before training would remove that record (as a crash in setup or a kill
  while compiling does): the sweep reports this attempt's exit, as for any failed run."""
  s = sweep.Sweep(TINY, sweep.seeds(1), fixed={"train.steps": 3})
  run_dir = tmp_path / "seed=0"
  run_dir.mkdir()
  (run_dir / sweep_runner.FAILURE_FILE).write_text(json.dumps(
      {"error": "TooManyBadSteps", "message": "5 consecutive non-finite steps", "step": 1}))
  monkeypatch.setenv("FAKE_FAIL", json.dumps(["seed=0"]))
  code, _ = _run(tmp_path, s)
  assert code == 1
  rec = json.load(open(run_dir / "sweep_run.json"))
  assert (rec["status"], rec["returncode"], rec["reason"]) == ("failed", 3, "exit code 3")
  assert not (run_dir / sweep_runner.FAILURE_FILE).exists()


def test_a_failed_prefix_fails_its_members_only(tmp_path, fake_env, monkeypatch):
  monkeypatch.setenv("FAKE_FAIL", json.dumps(["seed=0"]))
  code, _ = _run(tmp_path, LR_SEEDS)
  assert code == 1
  statuses = {r["dir"]: r["status"] for r in json.load(open(tmp_path / "sweep.json"))["runs"]}
  assert statuses == {"prefixes/seed=0": "failed", "prefixes/seed=1": "done",
                      "optim.lr=0.001,seed=0": "failed", "optim.lr=0.002,seed=0": "failed",
                      "optim.lr=0.001,seed=1": "done", "optim.lr=0.002,seed=1": "done"}
  assert not _calls(tmp_path / "optim.lr=0.001,seed=0")


def test_unfinished_runs_resume_and_changed_settings_are_refused(tmp_path, fake_env):
  s = sweep.Sweep(TINY, sweep.seeds(2), fixed={"train.steps": 3})
  assert _run(tmp_path, s)[0] == 0
  # Seed 1 as a SIGTERM from elsewhere (a preemption) leaves it: checkpoint 2, no gain.
  run = tmp_path / "seed=1"
  (run / "summary.json").write_text(json.dumps({"stopped_early": True, "stopped_at_step": 2,
                                                "eval_accuracy_start": 0.11}))
  os.rename(run / "checkpoints/3", run / "checkpoints/2")
  assert _run(tmp_path, s)[0] == 0
  assert [c["resumed_from"] for c in _calls(run)] == [None, 2]
  assert len(_calls(tmp_path / "seed=0")) == 1
  with pytest.raises(sweep.SweepError, match="seed=0 was run with --config=.* use another"):
    _run(tmp_path, sweep.Sweep(TINY, sweep.seeds(2), fixed={"train.steps": 4}))


def test_ctrl_c_stops_runs_with_sigterm_and_a_rerun_finishes(tmp_path):
  """The real command: SIGINT to the sweep alone (the runs are in their own process group, as
  a terminal's Ctrl-C would leave them), SIGTERM to each run, exit 130; then a rerun."""
  sweep_file = tmp_path / "s.py"
  sweep_file.write_text(
      "from grpo_jax import sweep\n"
      "def get_sweep():\n"
      "  return sweep.Sweep('configs/gsm8k.py:tiny', sweep.seeds(3), "
      "fixed={'train.steps': 3})\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, str(REPO)]), FAKE_WAIT="1")
  cmd = [sys.executable, "-m", "grpo_jax.sweep", str(sweep_file), f"--workdir={tmp_path}/w",
         "--parallel=2", "--main_module=fake_main"]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + 60
  while len([d for d in ("seed=0", "seed=1") if _calls(tmp_path / "w" / d)]) < 2:
    assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 130, out
  assert "run the same command to finish" in out
  for d in ("seed=0", "seed=1"):
    assert (tmp_path / "w" / d / "got_sigterm").exists(), d
    rec = json.load(open(tmp_path / "w" / d / "sweep_run.json"))
    assert (rec["status"], rec["returncode"]) == ("interrupted", 143), rec
  assert not (tmp_path / "w" / "seed=2").exists()  # never started
  del env["FAKE_WAIT"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert [c["resumed_from"] for c in _calls(tmp_path / "w" / "seed=0")] == [None, 0]
  assert [c["resumed_from"] for c in _calls(tmp_path / "w" / "seed=2")] == [None]


def _waiting_fake_sweep(tmp_path, seeds: int, parallel: int = 1):
  """(command, env, workdir) of a sweep over `seeds` tiny runs of fake_main, each of which
  waits (FAKE_WAIT) until it is signalled."""
  sweep_file = tmp_path / "s.py"
  sweep_file.write_text(
      "from grpo_jax import sweep\n"
      "def get_sweep():\n"
      f"  return sweep.Sweep('configs/gsm8k.py:tiny', sweep.seeds({seeds}), "
      "fixed={'train.steps': 3})\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, str(REPO)]), FAKE_WAIT="1")
  workdir = tmp_path / "w"
  cmd = [sys.executable, "-m", "grpo_jax.sweep", str(sweep_file), f"--workdir={workdir}",
         *([f"--parallel={parallel}"] if parallel > 1 else []), "--main_module=fake_main"]
  return cmd, env, workdir


def test_a_run_stopped_by_a_sigterm_of_its_own_is_interrupted_not_failed(tmp_path):
  """A preemption's SIGTERM that reaches one run alone (not through the sweep): the run saves
  and exits 143, and the sweep records it as interrupted (resumable), exits 130 with the line
  that says to rerun, and the rerun resumes it from its checkpoint."""
  cmd, env, workdir = _waiting_fake_sweep(tmp_path, seeds=1)
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 60
    while not _calls(workdir / "seed=0"):
      assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
      time.sleep(0.05)
    [run] = _processes_with(f"--workdir={workdir}/seed=0")
    os.kill(run, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 130, out
  assert "run the same command to finish" in out and "FAILED" not in out, out
  rec = json.load(open(workdir / "seed=0" / "sweep_run.json"))
  assert (rec["status"], rec["returncode"]) == ("interrupted", 143), rec
  assert "stopped by SIGTERM" in rec["reason"], rec
  del env["FAKE_WAIT"]
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stdout + done.stderr
  assert [c["resumed_from"] for c in _calls(workdir / "seed=0")] == [None, 0]


def _processes_with(text: str) -> list[int]:
  """Live processes whose command line contains `text`."""
  pids = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
      with open(f"/proc/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if text in cmdline and state != "Z":
      pids.append(int(pid))
  return pids


def test_runs_die_with_a_sigkilled_sweep(tmp_path):
  """SIGKILL to the sweep (no handler can run): the kernel's parent-death signal kills its
  runs, which would otherwise wait forever (FAKE_WAIT) as orphans."""
  cmd, env, workdir = _waiting_fake_sweep(tmp_path, seeds=2, parallel=2)
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 60
    while len([d for d in ("seed=0", "seed=1") if _calls(workdir / d)]) < 2:
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.05)
    runs = _processes_with(f"--workdir={workdir}/seed=")
    assert len(runs) == 2, runs  # both runs are waiting, exec'd in place by the wrapper
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while _processes_with(f"--workdir={workdir}/seed=") and time.monotonic() < deadline:
      time.sleep(0.05)
    assert _processes_with(f"--workdir={workdir}/seed=") == [], "runs outlived the sweep"
  finally:
    proc.kill()
    for pid in _processes_with(f"--workdir={workdir}/seed="):
      os.kill(pid, signal.SIGKILL)


def test_die_with_parent_does_not_start_a_program_whose_parent_is_gone():
  p = subprocess.run([sys.executable, "-m", "grpo_jax.die_with_parent", "1", "/bin/echo",
                      "started"], cwd=REPO, capture_output=True, text=True, timeout=30,
                     check=False)
  assert p.returncode == 1 and "the parent 1 is gone" in p.stderr and "started" not in p.stdout
  p = subprocess.run([sys.executable, "-m", "grpo_jax.die_with_parent", str(os.getpid()),
                      "echo", "started"], cwd=REPO, capture_output=True, text=True, timeout=30,
                     check=False)
  assert (p.returncode, p.stdout) == (0, "started\n")
