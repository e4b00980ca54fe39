"""Every error before compute, through the real command: a run that cannot work stops with one
line (status 2) before it compiles, and leaves its workdir as it found it: absent when it was
absent (parents included), byte for byte when it existed. Most cases fail before JAX starts;
the costliest (a missing checkpoint) builds the tiny data and tokenizer first, ~10 s.

Also the rule tables' own cases in process: a field the user set that the config never reads."""

import os
import re
import subprocess
import sys

import pytest

from cli import REPO, assert_user_error, env
from configs import gsm8k
from grpo_jax import preflight
from grpo_jax.errors import UserError

TINY = ["--config=configs/gsm8k.py:tiny", "--config.sft.steps=0", "--config.train.steps=1"]


def run_main(workdir, *flags, hide=()):
  """main in a subprocess; `hide`: modules made unimportable in it, as if not installed."""
  code = ("import runpy, sys\n"
          f"for m in {list(hide)!r}: sys.modules[m] = None\n"
          "sys.argv[0] = 'grpo_jax.main'\n"
          "runpy.run_module('grpo_jax.main', run_name='__main__', alter_sys=True)\n")
  return subprocess.run([sys.executable, "-c", code, *TINY, f"--workdir={workdir}", *flags],
                        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


def snapshot(root) -> dict:
  """{relative path: bytes, or None for a directory} of everything under root."""
  out = {}
  for d, dirs, names in os.walk(root):
    for n in dirs:
      out[os.path.relpath(os.path.join(d, n), root)] = None
    for n in names:
      with open(os.path.join(d, n), "rb") as f:
        out[os.path.relpath(os.path.join(d, n), root)] = f.read()
  return out


def existing_workdir(tmp_path):
  """A workdir with files of its own (as an earlier run's, or the user's)."""
  root = tmp_path / "existing"
  (root / "notes").mkdir(parents=True)
  (root / "notes" / "plan.txt").write_text("lr sweep next\n")
  (root / "metrics.jsonl").write_bytes(b'{"step": 0, "loss": 1.5}\n')
  return root


def bad_checkpoint(tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir(exist_ok=True)
  return ["--config.model.random_init=False", f"--config.model.checkpoint={ckpt}"]


def weightless_checkpoint(tmp_path):
  """A checkpoint directory with a real config.json and no weight files."""
  import fixtures  # pylint: disable=import-outside-toplevel
  ckpt = tmp_path / "weightless"
  fixtures.hf_config("qwen2_tied", vocab_size=512).save_pretrained(ckpt)
  return ["--config.model.random_init=False", f"--config.model.checkpoint={ckpt}"]


CASES = {
    # name: (flags given the tmp_path, modules hidden, what the line names)
    "wandb missing": (lambda t: ["--config.train.wandb=True"], ["wandb"],
                      ["config.train.wandb=True", 'pip install ".[wandb]"']),
    "tensorboardX missing": (lambda t: [], ["tensorboardX"],
                             ["config.train.tensorboard=True", "tensorboardX"]),
    "dead checkpoint": (lambda t: [f"--config.model.checkpoint={t}"], [],
                        ["--config.model.checkpoint is set", "model.random_init=True"]),
    "bad data": (lambda t: [f"--config.data.source={t}/no_such"], [],
                 ["config.data.source", "does not exist"]),
    # Built first: the synthetic data and the tiny tokenizer, into the workdir.
    "missing checkpoint": (bad_checkpoint, [], ["ckpt/config.json", "missing"]),
    # Its weights would be loaded after the first compile: checked in setup.
    "checkpoint without weights": (weightless_checkpoint, [],
                                   ["weightless: neither model.safetensors nor"]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_start_that_fails_leaves_no_new_workdir(tmp_path, case):
  flags, hide, named = CASES[case]
  workdir = tmp_path / "new" / "runs" / "tiny"  # its parents are made too, and removed
  assert_user_error(run_main(workdir, *flags(tmp_path), hide=hide), *named)
  assert not (tmp_path / "new").exists(), snapshot(tmp_path / "new")


@pytest.mark.parametrize("case", ["wandb missing", "missing checkpoint"])
def test_a_start_that_fails_leaves_an_existing_workdir_byte_identical(tmp_path, case):
  flags, hide, named = CASES[case]
  workdir = existing_workdir(tmp_path)
  before = snapshot(workdir)
  assert_user_error(run_main(workdir, *flags(tmp_path), hide=hide), *named)
  assert snapshot(workdir) == before


def test_a_gs_workdir_without_gcsfs_is_named(tmp_path):
  proc = run_main("gs://bucket/runs/tiny", hide=["gcsfs", "tensorflow"])
  assert_user_error(proc, "--workdir=gs://bucket/runs/tiny", "gcsfs", "pip install gcsfs")


def test_a_workdir_that_is_a_file_is_named_and_kept(tmp_path):
  path = tmp_path / "run"
  path.write_bytes(b"not a directory\n")
  assert_user_error(run_main(path), f"--workdir={path}", "is a file, not a directory")
  assert path.read_bytes() == b"not a directory\n"
  assert_user_error(run_main(path / "sub"), f"{path} is a file, so no directory can be made")
  assert path.read_bytes() == b"not a directory\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: no unwritable directory")
def test_an_unwritable_workdir_is_named(tmp_path):
  parent = tmp_path / "ro"
  parent.mkdir()
  parent.chmod(0o500)
  try:
    assert_user_error(run_main(parent / "run"), f"{parent}, where it would be made,",
                      "not writable")
    assert os.listdir(parent) == []
  finally:
    parent.chmod(0o700)


def test_an_unwritable_workdir_is_named_in_process(tmp_path, monkeypatch):
  """What the subprocess case checks where the tests run as a user who can write anything:
  the check asks os.access about the directory that exists (the workdir or its parent)."""
  asked = []
  monkeypatch.setattr(os, "access", lambda p, mode: asked.append((p, mode)) or False)
  with pytest.raises(UserError, match=re.escape(
      f"--workdir={tmp_path}/a/b: {tmp_path}, where it would be made, is not writable by this "
      "user")):
    preflight.check_workdir(os.fspath(tmp_path / "a" / "b"))
  assert asked == [(os.fspath(tmp_path), os.W_OK | os.X_OK)]


# --- a field set on the command line that the config never reads --------------------------------

def _fields_error(config, *keys):
  try:
    preflight.check_fields(config, {k: f"--config.{k}" for k in keys})
  except UserError as e:
    return str(e)
  return None


@pytest.mark.parametrize("key, why", [
    ("model.checkpoint", "model.random_init=True, which builds random weights and never reads "
                         "model.checkpoint"),
    ("model.lora.alpha", "model.lora.rank=0, which turns LoRA off and never reads "
                         "model.lora.alpha"),
    ("sft.lr", "sft.steps=0, which turns the warm start off and never reads sft.lr"),
    ("agent.max_turns", "agent.enabled=False (single-turn rollouts), which never reads "
                        "agent.max_turns"),
    ("loss.sapo_temperature_neg", "a loss.loss_type other than 'sapo', and only sapo reads "
                                  "loss.sapo_temperature_neg"),
    ("loss.vespo_k_pos", "a loss.loss_type other than 'vespo', and only vespo reads "
                         "loss.vespo_k_pos"),
    ("loss.ref_model_sync_steps", "loss.sync_ref_model=False (the reference stays frozen), "
                                  "which never reads loss.ref_model_sync_steps"),
])
def test_a_set_field_the_tiny_preset_never_reads_is_refused(key, why):
  config = gsm8k.get_config("tiny")
  config.sft.steps = 0
  message = _fields_error(config, key)
  assert message == f"--config.{key} is set but the config has {why}; drop one of the two"


def test_fields_the_config_reads_pass():
  tiny = gsm8k.get_config("tiny")  # sft.steps 1000, random_init, synthetic data, rank 0
  # The preset's own values never count: only what the user set.
  assert _fields_error(tiny) is None
  # Read under the preset's settings, or the switch itself.
  assert _fields_error(tiny, "sft.lr", "model.tiny.hidden_size", "model.tiny.vocab_size",
                       "data.synthetic_train", "model.lora.rank", "agent.enabled") is None
  full = gsm8k.get_config()  # a checkpoint, hub data, no warm start
  assert _fields_error(full, "model.checkpoint") is None
  assert "model.random_init=False" in _fields_error(full, "model.tiny.hidden_size")
  assert "data.synthetic_train is never read" in _fields_error(full, "data.synthetic_train")
  full.model.lora.rank, full.agent.enabled = 8, True
  assert _fields_error(full, "model.lora.alpha", "agent.max_turns") is None
  full.loss.loss_type = "sapo"
  assert _fields_error(full, "loss.sapo_temperature_pos", "loss.loss_type") is None
  assert "only vespo reads loss.vespo_lambda_neg" in _fields_error(full, "loss.vespo_lambda_neg")
  full.loss.sync_ref_model = True
  assert _fields_error(full, "loss.ref_model_mixup_alpha", "loss.ref_model_sync_steps",
                       "loss.sync_ref_model") is None


def test_an_overrides_file_key_is_named_as_such(tmp_path):
  path = tmp_path / "o.json"
  path.write_text('{"model.lora.alpha": 16.0}')
  proc = run_main(tmp_path / "run", f"--overrides={path}")
  assert_user_error(proc, f"model.lora.alpha in --overrides={path} is set but", "rank=0")
  assert not (tmp_path / "run").exists()
