"""Config validation stops an impossible run before anything loads, naming the setting."""

import pytest

from configs import gsm8k, gsm8k_agent
from grpo_jax import config as config_lib, data, validate


@pytest.mark.parametrize("preset", ["default", "0.5b", "tiny"])
def test_presets_are_valid(preset):
  validate.validate(gsm8k.get_config(preset), num_devices=8)


@pytest.mark.parametrize("field,value,message", [
    ("sampling.num_generations", 1, r"config\.sampling\.num_generations: must be an int >= 2"),
    ("rewards.names", ("math_accuracy", "bleu"), r"config\.rewards\.names: unknown reward 'bleu'"),
    ("rewards.weights", (1.0,), r"config\.rewards\.weights: 1 weights for 2 rewards"),
    ("loss.loss_type", "ppo", r"config\.loss\.loss_type='ppo' is not one of"),
    ("optim.lr", -1.0, r"config\.optim\.lr=-1\.0 must be finite and > 0"),
    # inf times an Adam moment of 0 is NaN: the first update made every such param NaN.
    ("optim.lr", float("inf"), r"config\.optim\.lr=inf must be finite and > 0"),
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
    # prepare.setup keeps eval_rows[:eval_examples]: -1 would drop the last problem unreported.
    ("train.eval_examples", -1, r"config\.train\.eval_examples: must be an int >= 0"),
    ("train.samples_per_step", -1, r"config\.train\.samples_per_step: must be >= 0"),
    ("seed", -1, r"config\.seed: must be >= 0"),  # numpy.random.default_rng refuses it
    # logits / inf are all 0: every token equally likely, and the log-probs trained on too.
    ("sampling.temperature", float("inf"), r"config\.sampling\.temperature: must be a finite"),
    ("loss.beta", float("inf"), r"config\.loss\.beta=inf must be finite and >= 0"),
    # A NaN weight made every total reward, and so every advantage, NaN.
    ("rewards.weights", (1.0, float("nan")),
     r"config\.rewards\.weights: weight of 'format' must be a finite number, got nan"),
    ("train.members", "pmap", r"config\.train\.members: 'pmap' is not one of 'auto', 'vmap'"),
    ("train.members", "map", None),
    ("loss.rollout_is_mode", "token", r"config\.loss\.rollout_is_mode='token' is not one of"),
    ("loss.top_entropy_quantile", 0.2, None),
    ("loss.sync_ref_model", True, None),  # the preset's beta is 0.001
    ("loss.ref_model_mixup_alpha", 0.0, r"^config\.loss\.ref_model_mixup_alpha=0\.0 must be in "
     r"\(0, 1\]"),
    ("loss.ref_model_mixup_alpha", 1.0, None),
    ("loss.ref_model_sync_steps", 0, r"^config\.loss\.ref_model_sync_steps=0 must be an int >= 1"),
    ("loss.steps_per_generation", 0, r"^config\.loss\.steps_per_generation=0 must be an int >= 1"),
    ("loss.steps_per_generation", 5, r"^config\.loss\.steps_per_generation: 5 updates per "
     r"generation batch each take whole groups: it must divide train\.prompts_per_step=96$"),
    ("loss.steps_per_generation", 4, None),  # 24 prompts an update: 4 micro-batches of 6 × 8
    ("loss.steps_per_generation", 32, r"^config\.train\.prompts_per_step: a micro-batch of 6 "),
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


@pytest.mark.parametrize("template", [
    "{question}", "Q: {question}\nA:", "{question} {{not a field}}", "no question here",
    "{Question}", "{question} {answer}", "{} {question}", "{question", "", "{{question}}"])
def test_validate_accepts_a_template_exactly_when_its_prompts_hold_the_question(template):
  """The independent reading of data.user_template: data.build_prompt, on two questions, builds
  without an error and tells them apart. Without {question} every prompt of the run was one text
  and validation said nothing."""
  try:
    works = (data.build_prompt(_Chat(), "Q1", None, template)
             != data.build_prompt(_Chat(), "Q2", None, template))
  except (KeyError, IndexError, ValueError):
    works = False
  config = gsm8k.get_config("tiny")
  config.data.user_template = template
  if works:
    validate.validate(config, num_devices=1)
  else:
    with pytest.raises(validate.ConfigError,
                       match=r"^config\.data\.user_template: "
                             r".*(has no \{question\}|cannot be filled)"):
      validate.validate(config, num_devices=1)


def test_the_agent_template_is_checked_against_the_fields_its_environment_fills():
  agent = gsm8k_agent.get_config("tiny")
  validate.validate(agent, num_devices=1)
  agent.agent.user_template = "{tools}\n{question}\n{answer}"  # agent/env.py fills no {answer}
  with pytest.raises(validate.ConfigError, match=r"config\.agent\.user_template: .*cannot be "
                     r"filled .*its placeholders are \{question\}, \{tools\}, \{tool_names\}"):
    validate.validate(agent, num_devices=1)


def test_the_rollout_correction_needs_single_turn_rollouts():
  """Agent rollouts carry no sampler log-probs: the correction would have nothing to read."""
  agent = gsm8k_agent.get_config("tiny")
  agent.loss.rollout_is_correction = True
  with pytest.raises(validate.ConfigError, match=r"config\.loss\.rollout_is_correction: multi-"
                     r"turn agent rollouts do not carry the sampler's log-probs"):
    validate.validate(agent, num_devices=1)
  agent.loss.rollout_is_correction = False
  validate.validate(agent, num_devices=1)


class _Chat:
  """A tokenizer's chat template, as text: the user turn's content alone."""

  def apply_chat_template(self, messages, **kwargs):
    return messages[-1]["content"]


@pytest.mark.parametrize("value,message", [
    (32, None),  # 32 / 4 micro-batches = 8 rows, one per device
    (30, r"config\.sft\.batch_size: 30 examples do not split into optim\.grad_accum_steps=4"),
    (36, r"config\.sft\.batch_size: 36 examples .* divisible by the 8 devices"),
    (0, r"config\.sft\.batch_size: must be >= 1"),
])
def test_the_warm_start_batch_splits_like_a_grpo_batch(value, message):
  """The warm start's step keeps optim.grad_accum_steps and the mesh (sft.sft_optim_config), so
  its batch must split into micro-batches that divide over the devices; validation said nothing
  and the run stopped with a traceback at its first warm-start step, after loading the model."""
  config = gsm8k.get_config("default")
  config.optim.grad_accum_steps = 4
  config.sft.update(steps=100, batch_size=value)
  if message is None:
    validate.validate(config, num_devices=8)
  else:
    with pytest.raises(validate.ConfigError, match=message):
      validate.validate(config, num_devices=8)
  config.sft.update(steps=0, batch_size=30)  # no warm start: its batch is never used
  validate.validate(config, num_devices=8)
  config.sft.update(steps=100, batch_size=32, lr=-1e-3)
  with pytest.raises(validate.ConfigError, match=r"config\.sft\.lr: must be finite and > 0"):
    validate.validate(config, num_devices=8)
  config.sft.lr = float("inf")
  with pytest.raises(validate.ConfigError, match=r"config\.sft\.lr: must be finite and > 0"):
    validate.validate(config, num_devices=8)


@pytest.mark.parametrize("args,message", [
    ({"train.steps": None}, r"config\.train\.steps: must be of type int, got None$"),
    ({"optim.lr": None}, r"config\.optim\.lr: must be of type float, got None$"),
    ({"sampling.max_new_tokens": None}, r"config\.sampling\.max_new_tokens: must be of type int"),
    ({"train.dynamic_sampling": None}, r"config\.train\.dynamic_sampling: must be of type bool"),
    ({"train.steps": True}, r"config\.train\.steps: must be of type int, got True$"),
    ({"train": {"steps": 3}}, r"config\.train\.checkpoint_every: missing"),
    ({"data.system_prompt": None, "loss.delta": None, "optim.lr": 1}, None),
])
def test_values_an_override_carries_are_checked_against_the_schema(args, message):
  """--overrides (and a sweep's runs) carry None, which ml_collections lets into any field, and
  True, which it takes for an int: validate names the field instead of failing in arithmetic
  (TypeError) or reading None as False. None stays valid where the schema's default is None."""
  config = gsm8k.get_config("tiny")
  config_lib.apply_overrides(config, args)
  if message is None:
    validate.validate(config, num_devices=1)
    assert config.optim.lr == 1.0 and config.data.system_prompt is None
    return
  with pytest.raises(validate.ConfigError, match=message):
    validate.validate(config, num_devices=1)


@pytest.mark.parametrize("path,preset", [
    (path, preset) for path, presets in (
        ("configs/gsm8k.py", ("default", "0.5b", "tiny", "tiny_lora", *gsm8k.LORA_PRESETS)),
        ("configs/gsm8k_agent.py", ("default", "tiny"))) for preset in presets])
def test_every_preset_validates_on_the_devices_it_declares(path, preset):
  config = (gsm8k_agent if "agent" in path else gsm8k).get_config(preset)
  validate.validate(config, num_devices=config.hardware.devices)


def test_a_reference_that_follows_the_policy_is_refused_where_it_cannot_mean_anything():
  """loss.sync_ref_model: LoRA's reference is its frozen base; an agent's 'reference' role plays
  the frozen reference. Each is one line naming the setting."""
  config = gsm8k.get_config("tiny")  # beta 0: no reference is held
  config.loss.sync_ref_model = True
  with pytest.raises(validate.ConfigError, match=r"^config\.loss\.sync_ref_model=True with "
                     r"loss\.beta=0: no reference is held \(beta = 0 skips it\)"):
    validate.validate(config, num_devices=1)
  config = gsm8k.get_config("tiny_lora")  # beta 0.01 against the base
  config.loss.sync_ref_model = True
  with pytest.raises(validate.ConfigError, match=r"^config\.loss\.sync_ref_model: True with "
                     r"LoRA \(model\.lora\.rank=8\): its reference is the frozen base"):
    validate.validate(config, num_devices=1)
  config.model.lora.rank = 0
  validate.validate(config, num_devices=1)
  agent = gsm8k_agent.get_config("tiny")
  agent.loss.update(beta=0.01, sync_ref_model=True)
  validate.validate(agent, num_devices=1)
  agent.agent.generator = "reference"
  with pytest.raises(validate.ConfigError, match=r"^config\.agent\.generator: 'reference' plays "
                     r"the frozen reference, and loss\.sync_ref_model=True"):
    validate.validate(agent, num_devices=1)


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


def test_members_run_in_turn_on_a_cpu_and_batched_elsewhere():
  config = gsm8k.get_config("tiny")
  assert [config_lib.members_batched(config, p) for p in ("cpu", "gpu", "tpu")] == [
      False, True, True]
  for setting, want in (("vmap", True), ("map", False)):
    config.train.members = setting
    assert {config_lib.members_batched(config, p) for p in ("cpu", "gpu")} == {want}
