"""Config validation stops an impossible run before anything loads, naming the setting."""

import pytest

from configs import gsm8k
from grpo_jax import config as config_lib, validate


@pytest.mark.parametrize("preset", ["default", "0.5b", "tiny"])
def test_presets_are_valid(preset):
  validate.validate(gsm8k.get_config(preset), num_devices=8)


@pytest.mark.parametrize("field,value,message", [
    ("sampling.num_generations", 1, r"config\.sampling\.num_generations: must be an int >= 2"),
    ("rewards.names", ("math_accuracy", "bleu"), r"config\.rewards\.names: unknown reward 'bleu'"),
    ("rewards.weights", (1.0,), r"config\.rewards\.weights: 1 weights for 2 rewards"),
    ("loss.loss_type", "ppo", r"config\.loss\.loss_type='ppo' is not one of"),
    ("optim.lr", -1.0, r"config\.optim\.lr=-1\.0 must be > 0"),
    ("train.prompts_per_step", 3, r"config\.train\.prompts_per_step: a micro-batch of 6"),
    ("mesh", (1, 3, 1), r"config\.mesh: \(1, 3, 1\) uses 3 of the 8 devices.*\(1, 8, 1\)"),
    ("mesh", (4, 1, 1), None),
    ("train.prompts_per_step", 5, r"config\.train\.prompts_per_step: a micro-batch of 10 .* 8 devices"),
    ("mesh", (2, 8, 1), r"config\.mesh: \(2, 8, 1\) needs 16 devices"),
    ("sampling.top_p", 0.0, r"config\.sampling\.top_p: must be in \(0, 1\]"),
    ("optim.grad_accum_steps", 5, r"config\.optim\.grad_accum_steps: 5 does not divide"),
    ("train.max_missing_reward_steps", -1, r"config\.train\.max_missing_reward_steps: must be an int >= 0"),
    ("sft.overshoot_accuracy", 1.5, r"config\.sft\.overshoot_accuracy: must be 0 \(off\) or in"),
    ("sft.overshoot_accuracy", 0.5, None),
    ("model.lora.rank", -1, r"config\.model\.lora\.rank must be a positive integer, got -1"),
    ("optim.logprob_block_bytes", 2, r"optim\.logprob_block_bytes=2 must be an int >= 4, or 0"),
    ("optim.logprob_block_bytes", 4, None),
    ("train.eval_examples", -5, r"config\.train\.eval_examples: must be an int >= 0"),
    ("train.eval_examples", 5, None),
    # Without {question} every prompt is one text; a lone brace made str.format raise mid-setup.
    ("data.user_template", "Solve it step by step.",
     r"config\.data\.user_template: 'Solve it step by step\.' has no \{question\} placeholder"),
    ("data.user_template", "{question}\nPut it in \\boxed{}.",
     r"config\.data\.user_template: .* cannot be filled with the question alone .*\{\{ or \}\}"),
    ("data.user_template", "{question}\nPut it in \\boxed{{}}.", None),
])
def test_bad_settings_are_named(field, value, message):
  config = gsm8k.get_config("default")
  config.optim.grad_accum_steps = 4  # the messages below count micro-batches of 4
  node, leaf = config, field.split(".")
  for key in leaf[:-1]:
    node = node[key]
  node[leaf[-1]] = value
  if message is None:  # a valid neighbour of the bad settings: the check is not too strict
    validate.validate(config, num_devices=8)
    return
  with pytest.raises(validate.ConfigError, match=message):
    validate.validate(config, num_devices=8)


def test_settings_have_one_home_and_the_cosine_schedule_counts_mu():
  """No loss field shadows a sampling or model one; optim.total_steps counts optimizer updates."""
  config = gsm8k.get_config("tiny")
  assert "temperature" not in config.loss and "valid_vocab_size" not in config.loss
  config.loss.num_iterations = 2
  config.optim.update(schedule="cosine", total_steps=config.train.steps)
  with pytest.raises(validate.ConfigError, match="800 optimizer updates"):
    validate.validate(config, num_devices=1)
  config.optim.total_steps = 2 * config.train.steps
  validate.validate(config, num_devices=1)
  # 0 (the default): the trainer fills in the run's updates, so it validates.
  config.optim.total_steps = 0
  validate.validate(config, num_devices=1)
  # No updates (a warm start alone, train.steps = 0): the schedule is never read, so the
  # preset's cosine must not stop such a run (tests/train_test.py runs one).
  config.train.steps = 0
  validate.validate(config, num_devices=1)
  assert config_lib.cosine_total_steps(config.optim, 0) == config.optim.warmup_steps + 1
  # A run shorter than the warm-up (a preset shortened for a smoke test) ends on the ramp: the
  # derived cosine starts right after the warm-up, so it validates ...
  config.train.steps = 4  # 8 updates (μ = 2)
  config.optim.update(total_steps=0, warmup_steps=10)
  validate.validate(config, num_devices=1)
  assert config_lib.optim_settings(config).total_steps == 11
  assert config_lib.cosine_total_steps(config.optim, 400) == 400
  # ... while a total_steps set by hand that cannot fit its own warm-up is refused, naming it.
  config.optim.total_steps = 8
  with pytest.raises(validate.ConfigError, match="optim.total_steps=8 must exceed"):
    validate.validate(config, num_devices=1)


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    gsm8k.get_config("huge")
