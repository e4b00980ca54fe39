"""User errors through the real command: `python -m grpo_jax.main ...` in a subprocess exits with
status 2 and one message naming the bad file, line, field or URL; no traceback.

Each case fails before anything compiles, so a case costs about one JAX import."""

import os
import re
import shutil
import subprocess
import sys
import time


import fixtures
from cli import REPO, assert_user_error

TINY = ["--config=configs/gsm8k.py:tiny", "--config.sft.steps=0", "--config.train.steps=1"]


def run_main(workdir, *flags, env=None):
  # main_test's env keeps the fake-device flags only where a test sets them itself.
  full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
  return subprocess.run([sys.executable, "-m", "grpo_jax.main", *TINY, f"--workdir={workdir}",
                         *flags], cwd=REPO, env=full_env, capture_output=True, text=True,
                        timeout=300)


def test_missing_data_directory(tmp_path):
  proc = run_main(tmp_path / "run", f"--config.data.source={tmp_path}/no_such_gsm8k")
  assert_user_error(proc, "config.data.source", "no_such_gsm8k", "does not exist")


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
  data = tmp_path / "gsm8k"
  data.mkdir()
  lines = (fixtures.GSM8K / "train.jsonl").read_text().splitlines()[:50]
  lines[16] = lines[16].replace('"answer"', '"answer" ', 1)[:-2]  # real row, closing brace lost
  (data / "train.jsonl").write_text("\n".join(lines) + "\n")
  (data / "test.jsonl").write_text((fixtures.GSM8K / "test.jsonl").read_text())
  proc = run_main(tmp_path / "run", f"--config.data.source={data}")
  assert_user_error(proc, "config.data.source", f"{data}/train.jsonl:17", "not valid JSON")
  # datasets' JSON builder logged its own error (its handler and absl's: `E1207 ... json.py:352]
  # Failed to load JSON ...`) and a progress bar before that line; the file is now read first.
  for stray in ("Failed to load JSON", "json.py", "Generating train split"):
    assert stray not in proc.stderr, proc.stderr
  assert not (tmp_path / "run").exists()


def test_relative_checkpoint_path_that_exists_is_local(tmp_path):
  # 'ckpt/qwen' has the shape of a hub id; it exists under the working directory, so it is read
  # as a local checkpoint (this one lacks config.json, which the error names).
  (tmp_path / "ckpt" / "qwen").mkdir(parents=True)
  proc = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", f"--config={REPO}/configs/gsm8k.py:tiny",
       f"--workdir={tmp_path}/run", "--config.sft.steps=0", "--config.model.random_init=False",
       "--config.model.checkpoint=ckpt/qwen"],
      cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
      capture_output=True, text=True,
      timeout=300)
  assert_user_error(proc, "ckpt/qwen/config.json", "missing")


def test_missing_relative_path_fails_fast_offline_and_says_what_to_do(tmp_path):
  # The hub endpoint is a closed local port, and HF_HUB_OFFLINE is unset: the probe finds the hub
  # unreachable and the run fails at once, where the libraries' own retries took 24-47 s.
  env = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}
  start = time.monotonic()
  proc = run_main(tmp_path / "run", "--config.model.random_init=False",
                  "--config.model.checkpoint=models/qwen", env=env)
  elapsed = time.monotonic() - start
  message = assert_user_error(proc, "config.model.checkpoint", "'models/qwen' is not a local path",
                              "--local-dir")
  assert "cannot be reached" in message
  assert elapsed < 60, elapsed  # generous for a loaded CI machine; ~8 s measured when quiet


def test_mesh_that_does_not_divide_the_devices(tmp_path):
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  proc = run_main(tmp_path / "run", "--config.mesh=(1,3,1)", env=env)
  assert_user_error(proc, "config.mesh", "(1, 3, 1) uses 3 of the 8 devices")


def test_bad_field_value_is_named(tmp_path):
  proc = run_main(tmp_path / "run", "--config.sampling.num_generations=1")
  assert_user_error(proc, "config.sampling.num_generations")


def test_unknown_override_and_missing_config_file_are_named(tmp_path):
  proc = run_main(tmp_path / "run", "--config.train.stepz=3")
  assert_user_error(proc, "'stepz'", 'Did you mean "steps"')
  proc = run_main(tmp_path / "run", "--config.foo.bar=1")  # a section the schema lacks
  assert_user_error(proc, "names no config field 'foo'")
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.main", "--config=configs/nope.py:tiny",
                         f"--workdir={tmp_path}/run"], cwd=REPO, capture_output=True, text=True,
                        timeout=300)
  assert_user_error(proc, "--config", "configs/nope.py")
  proc = run_main(tmp_path / "run", "--config=configs/gsm8k.py:tinyy")
  assert_user_error(proc, "unknown preset 'tinyy'")


def test_a_bad_overrides_file_is_named(tmp_path):
  """--overrides=FILE (a sweep's run's overrides as JSON): the file and the key are named."""
  path = tmp_path / "overrides.json"
  for text, named in [('{"train.stepz": 3}', "'train.stepz' names no config field"),
                      ('{"train.steps": "many"}', "train.steps='many' does not fit"),
                      ('["train.steps"]', "must hold a JSON object"),
                      ('{"train.steps": ', "cannot be read as JSON")]:
    path.write_text(text)
    proc = run_main(tmp_path / "run", f"--overrides={path}")
    assert_user_error(proc, f"--overrides={path}", named)
  proc = run_main(tmp_path / "run", f"--overrides={tmp_path}/none.json")
  assert_user_error(proc, "none.json", "cannot be read")


def test_the_python_tool_without_its_sandbox_refuses_to_start(tmp_path):
  """A machine without bubblewrap (a PATH without bwrap): the run stops at start-up with the
  one line naming the missing layer and the way out, before any step."""
  empty = tmp_path / "bin"
  empty.mkdir()
  proc = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", "--config=configs/gsm8k_agent.py:tiny",
       f"--workdir={tmp_path / 'run'}", "--config.agent.tools=('python',)",
       "--config.sft.steps=0", "--config.train.steps=1"],
      cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu", "PATH": str(empty)},
      capture_output=True, text=True, timeout=300)
  assert_user_error(proc, "python tool: no bubblewrap", "agent.sandbox='unsafe'")
  assert not (tmp_path / "run").exists()  # checked before the workdir was made (preflight)


def _help(command, **kwargs):
  """(exit status, stdout, the flag names listed) of `command --help`, run from the repo."""
  proc = subprocess.run([*command, "--help"], cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu",
                        **kwargs.pop("env", {})}, capture_output=True, text=True, timeout=120)
  names = re.findall(r"^  --(?:\[no\])?(\w+):", proc.stdout, flags=re.M)
  return proc.returncode, proc.stdout, names


def test_the_console_script_prints_the_same_help_as_python_m():
  """`grpo-jax --help` runs pyproject's entry point (grpo_jax.main:run) from a launcher module,
  not as __main__; absl's help used to list no flags there."""
  status, text, names = _help([sys.executable, "-m", "grpo_jax.main"])
  assert {"config", "workdir", "overrides", "coordinator_address", "num_processes",
          "process_id", "distributed"} <= set(names), text
  assert "Running it again on the same workdir resumes" in text  # main's docstring
  # What the generated launcher does: import the entry point pyproject names and call it.
  entry = re.search(r'^grpo-jax = "([\w.]+):(\w+)"', (REPO / "pyproject.toml").read_text(),
                    flags=re.M)
  launcher = (f"import sys; from {entry.group(1)} import {entry.group(2)}; "
              f"sys.argv[0] = 'grpo-jax'; sys.exit({entry.group(2)}())")
  got = _help([sys.executable, "-c", launcher])
  assert got[0] == status and got[2] == names, got[1]
  assert got[1].split("\nflags:")[0] == text.split("\nflags:")[0]
  script = shutil.which("grpo-jax")
  if script:  # the installed console script, importing this tree's package
    got = _help([script], env={"PYTHONPATH": str(REPO)})
    assert got[0] == status and got[2] == names, got[1]


def test_bad_logging_settings_and_a_missing_wandb_stop_before_anything_runs(tmp_path):
  proc = run_main(tmp_path / "run", "--config.train.wandb_mode=cloud")
  assert_user_error(proc, "config.train.wandb_mode", "'cloud' is not one of 'online'")
  proc = run_main(tmp_path / "run", "--config.train.wandb_tags=(1,2)")
  assert_user_error(proc, "config.train.wandb_tags", "tuple of strings")
  proc = run_main(tmp_path / "run", "--config.train.wandb_project=")
  assert_user_error(proc, "config.train.wandb_project", "non-empty string")
  proc = run_main(tmp_path / "run", "--config.train.progress_every_s=-1")
  assert_user_error(proc, "config.train.progress_every_s", "seconds >= 0")
  # wandb made unimportable (None in sys.modules), then the command as `python -m` runs it.
  launcher = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv[0] = 'grpo_jax.main'; "
              "runpy.run_module('grpo_jax.main', run_name='__main__')")
  proc = subprocess.run([sys.executable, "-c", launcher, *TINY, f"--workdir={tmp_path}/run",
                         "--config.train.wandb=True"], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert_user_error(proc, "config.train.wandb", 'pip install ".[wandb]"',
                    "--config.train.wandb=False")
  assert not (tmp_path / "run").exists()  # before the workdir, its data or any compile
