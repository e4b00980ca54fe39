"""The config schema (grpo_jax/config.py): presets unchanged by its move, one home per default,
unknown fields refused by name, and nothing written into a config at run time."""

import json
import os
import subprocess
import sys

import pytest
from ml_collections import config_dict

import config_snapshot
from configs import gsm8k
from grpo_jax import config as config_lib, train, validate
from grpo_jax.models import lora
from grpo_jax.rewards import options as reward_options

SNAPSHOT = config_snapshot.REPO / "tests" / "testdata" / "preset_configs.json"


def test_presets_equal_their_snapshot_from_before_the_schema():
  """Each preset of configs/gsm8k.py and configs/gsm8k_agent.py, field by field (path, declared
  type, value), against what the presets built before the schema existed (config_snapshot)."""
  before = json.loads(SNAPSHOT.read_text())
  now = config_snapshot.snapshot()
  assert sorted(now) == sorted(before)
  for preset in before:
    changed = {k: (before[preset].get(k), now[preset].get(k))
               for k in before[preset].keys() | now[preset].keys()
               if before[preset].get(k) != now[preset].get(k)}
    assert not changed, (preset, changed)


@pytest.mark.parametrize("path,preset", [(path, preset) for path, presets in
                                         config_snapshot.PRESETS.items() for preset in presets])
def test_every_preset_validates_on_its_hardware(path, preset):
  config = config_snapshot.load(path).get_config(preset)
  validate.validate(config, num_devices=config.hardware.devices)


def test_the_lora_block_defaults_to_off_as_documented():
  block = config_lib.defaults().model.lora
  # docs/lora.md, "Settings".
  assert block.to_dict() == dict(rank=0, alpha=32.0, dropout=0.0, quantize="none",
                                 targets=tuple(lora.TARGETS), merge_for_sampling=True,
                                 use_rslora=False, rank_pattern=None, alpha_pattern=None,
                                 layers_to_transform=(), modules_to_save=(), init_from="")
  assert lora.LoraConfig.from_config(block) is None
  block.rank = 8
  assert lora.LoraConfig.from_config(block) == lora.LoraConfig(rank=8, alpha=32.0)


def test_the_new_loss_options_default_to_off_as_documented():
  """docs/loss.md, 'Options from TRL 1.16': TRL's values, except the two that would change a
  run that does not ask for them (rollout correction and bias-corrected KL: off); and every
  preset leaves them alone."""
  block = config_lib.loss()
  assert {k: block[k] for k in config_snapshot.NEW_LOSS_FIELDS} == dict(
      sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
      vespo_k_neg=3.0, vespo_lambda_neg=2.0, rollout_is_correction=False,
      rollout_is_mode="sequence_mask", rollout_is_clip_min=None, rollout_is_clip_max=3.0,
      off_policy_mask_threshold=None, use_bias_correction_kl=False, top_entropy_quantile=1.0,
      entropy_coef=0.0, use_adaptive_entropy=False, entropy_target=0.2, entropy_coef_min=0.0,
      entropy_coef_max=1.0, entropy_coef_delta=0.005, steps_per_generation=1,
      sync_ref_model=False, ref_model_mixup_alpha=0.6, ref_model_sync_steps=512)
  for path, presets in config_snapshot.PRESETS.items():
    for preset in presets:
      loss = config_snapshot.load(path).get_config(preset).loss
      assert all(loss[k] == block[k] for k in config_snapshot.NEW_LOSS_FIELDS), (path, preset)


def test_each_section_has_one_home():
  """The defaults come from the schema's section functions, fresh on every call."""
  c = config_lib.defaults()
  for name in ("model", "data", "sampling", "rewards", "loss", "optim", "train", "sft", "agent",
               "hardware"):
    assert c[name] == getattr(config_lib, name)(), name
  a, b = config_lib.loss(), config_lib.loss()
  a.beta = 0.5
  assert b.beta == 0.0  # no shared mutable default
  # The presets only state choices: a section they leave alone is the schema's.
  tiny = gsm8k.get_config("tiny")
  assert tiny.agent == config_lib.agent() and tiny.model.tiny == config_lib.model().tiny


@pytest.mark.parametrize("field", ["foo", "train.stepz", "rewards.format.corect",
                                   "model.tiny.hidden"])
def test_a_field_the_schema_lacks_is_refused_by_name(field):
  config = gsm8k.get_config("tiny")
  *parents, leaf = field.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = 1
  assert config_lib.unknown_fields(config) == [field]
  with pytest.raises(validate.ConfigError, match=rf"^config\.{field}: no such field"):
    validate.validate(config, num_devices=1)


def test_an_option_that_defaults_to_none_takes_a_command_line_value(tmp_path):
  """rewards.quality.fallback (float | None, default None; docs/rewards.md) through main's flags
  (tests/config_main.py). As a plain None field ml_collections refused any --config value for
  it ("Type NoneType ... is not supported for overriding")."""
  tests = str(config_snapshot.REPO / "tests")
  proc = subprocess.run(
      [sys.executable, "-m", "config_main", "--config=configs/gsm8k.py:tiny",
       f"--workdir={tmp_path}", "--config.rewards.quality.fallback=0.25"],
      cwd=config_snapshot.REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, str(config_snapshot.REPO)])})
  assert proc.returncode == 0, proc.stderr[-2000:]
  parsed = json.loads((tmp_path / "parsed_config.json").read_text())
  assert parsed["rewards"]["quality"]["fallback"] == 0.25
  block = config_lib.defaults().rewards.quality
  assert reward_options.from_config(reward_options.QualityOptions, block, "q").fallback is None
  block.fallback = 0.25
  assert reward_options.from_config(reward_options.QualityOptions, block, "q").fallback == 0.25


def test_one_rule_for_the_sampling_settings():
  """validate checks config.sampling with the sampler's own rules (token_choice.SamplingParams)."""
  for field, value, message in (("temperature", 0.0, "must be a finite number > 0, got 0.0"),
                                ("top_k", -1, "must be an int >= 0"),
                                ("min_p", 1.0, r"must be in \[0, 1\)")):
    config = gsm8k.get_config("tiny")
    config.sampling[field] = value
    with pytest.raises(validate.ConfigError, match=rf"^config\.sampling\.{field}: {message}"):
      validate.validate(config, num_devices=1)


def test_derived_values_are_new_values():
  config = gsm8k.get_config("tiny")
  before = config.to_dict()
  optim = config_lib.optim_settings(config)
  # 400 GRPO steps × μ = 1: the cosine spans the run's 400 optimizer updates.
  assert optim.total_steps == 400 and config.optim.total_steps == 0
  config.loss.num_iterations = 2
  assert config_lib.optim_settings(config).total_steps == 800
  config.loss.steps_per_generation = 4  # μ × S updates a step
  assert config_lib.optim_settings(config).total_steps == 3200
  config.loss.update(num_iterations=1, steps_per_generation=1)
  assert config.to_dict() == before
  assert config_lib.group_size(config) == 8 and config_lib.rows_per_step(config) == 16 * 8


def test_a_run_leaves_its_config_as_it_was(tmp_path):
  """The tiny preset, shortened (a warm start with its accuracy check, cosine GRPO steps with
  dynamic sampling, evals, checkpoints): the ConfigDict after the run equals the one before,
  field by field with types."""
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=200, synthetic_test=16)
  config.sft.update(steps=2, eval_every=1, eval_examples=8, batch_size=8)
  config.train.update(steps=2, prompts_per_step=2, eval_examples=8, eval_batch_size=8,
                      eval_every=1, checkpoint_every=1, tensorboard=False)
  before, fields = config.to_dict(), config_snapshot.leaves(config)
  train.run(config, str(tmp_path))
  assert config.to_dict() == before
  assert config_snapshot.leaves(config) == fields
  assert isinstance(config, config_dict.ConfigDict)
