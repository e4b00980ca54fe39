"""Flow-GRPO end to end: the default agent preset offline (a tiny random checkpoint with Qwen's
151,936-id vocabulary, the real Qwen2.5 tokenizer and chat template, GSM8K, the sandboxed Python
tool, β > 0, fsdp over 8 devices) runs steps, checkpoints, and resumes bit for bit."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import fixtures
from configs import gsm8k_agent
from grpo_jax import logging_io, train


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return fixtures.make_checkpoint(tmp_path_factory.mktemp("agent_ckpt"), "qwen2_tied",
                                  vocab_size=151936)


def _config(checkpoint, steps):
  c = gsm8k_agent.get_config("default")
  c.model.checkpoint = str(checkpoint)
  c.model.tokenizer = str(fixtures.REAL_TOKENIZER)
  c.data.source = str(fixtures.GSM8K)
  c.data.prompt_buckets = (320, 448)
  c.agent.update(max_turns=2, action_tokens=8, observation_tokens=8)
  c.sampling.num_generations = 2
  c.optim.grad_accum_steps = 1
  c.sft.steps = 0
  c.train.update(steps=steps, prompts_per_step=4, eval_examples=8, eval_batch_size=8,
                 eval_every=0, checkpoint_every=1, samples_per_step=1, tensorboard=False)
  return c


def test_default_agent_preset_runs_checkpoints_and_resumes_bit_for_bit(checkpoint, tmp_path,
                                                                         capsys):
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  train.run(_config(checkpoint, 2), str(straight))
  train.run(_config(checkpoint, 1), str(resumed))
  capsys.readouterr()
  summary = train.run(_config(checkpoint, 2), str(resumed))
  assert "resumed from step 1" in capsys.readouterr().out
  assert summary["end_step"] == 2

  a = load_file(str(straight / "final_model" / "model.safetensors"))
  b = load_file(str(resumed / "final_model" / "model.safetensors"))
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  ma = logging_io.read_jsonl(str(straight / "metrics.jsonl"))
  mb = logging_io.read_jsonl(str(resumed / "metrics.jsonl"))
  assert [r["step"] for r in ma] == [r["step"] for r in mb] == [0, 1, 2]
  for ra, rb in zip(ma[1:], mb[1:]):
    for k in ("loss", "loss/kl", "reward/total/mean", "agent/turns/mean",
              "agent/tool_calls/mean", "tokens/completion"):
      assert ra[k] == rb[k], (k, ra[k], rb[k])
  # Every step ran the multi-turn rollout with the Python tool and the flow_grpo loss.
  last = ma[-1]
  assert 1 <= last["agent/turns/mean"] <= 2
  assert "agent/tool/python/calls" in last and "agent/tool/python/killed" in last
  assert last["loss/kl"] >= 0 and np.isfinite(last["loss"])
  config = json.loads((straight / "config.json").read_text())
  assert config["loss"]["loss_type"] == "flow_grpo" and config["agent"]["tools"] == ["python"]
  samples = (straight / "samples.md").read_text()
  assert "[action 1]" in samples
