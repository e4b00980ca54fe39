"""Frozen agent roles (grpo_jax/agent/roles.py): a generator and a verifier that are never
trained. Their tokens stay out of the loss mask, the peek at the verifier's question leaves the
planner's carried cache as it was (the train step still gets the sampler's log-probs), each
role answers as a fresh greedy pass of its params over the compacted conversation would, and
the server roles speak chat messages to an OpenAI-compatible endpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agent_rollout_test import assert_rows_give_sampler_logprobs, tiny_agent_inputs
from fake_chat_server import FakeChatServer
from grpo_jax import sampler as sampler_lib, validate
from grpo_jax.agent import env as env_lib
from grpo_jax.models import qwen


class _ScriptedEnv(env_lib.ToolEnv):
  """A random model writes no tool syntax, so the parse is scripted: an action whose text
  length is a multiple of 4 is the answer, any other a real calculator call. The tokens, the
  cache and the roles are the real ones."""

  def step(self, action_text):
    if len(action_text) % 4 == 0:
      return super().step("<answer>0</answer>")
    return super().step(f"<tool>calculator: {len(action_text)}*7</tool>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """The tiny agent preset's data, tokenizer and a random model; agents built per test."""
  config, cfg, params, rows, tok, sampler = tiny_agent_inputs(
      str(tmp_path_factory.mktemp("roles")), rows=(50, 10), max_turns=3, action_tokens=6,
      observation_tokens=6, generator_tokens=5)
  stop_ids = sampler.stop_ids
  # Fresh greedy passes over whole conversations, for the checks.
  check = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=5, stop_ids=stop_ids,
                              buckets=(128, 256), pad_id=tok.pad_token_id,
                              valid_vocab_size=len(tok))
  return config, cfg, params, rows[:3], tok, sampler, check


def _agent(tiny, server=None, **roles):
  from grpo_jax.agent import rollout as agent_rollout
  config, _, _, _, tok, sampler, _ = tiny
  c = config.copy_and_resolve_references()
  c.agent.update(**roles)
  c.agent.server.update(server or {})
  agent = agent_rollout.Agent(c, tok, sampler)
  agent.new_env = lambda: _ScriptedEnv(agent.tools, c.agent.max_turns, c.agent.user_template)
  return agent


def _conversation(prompt_ids, rec, pieces):
  return list(prompt_ids) + [int(x) for ids, _, _ in rec["pieces"][:pieces] for x in ids]


def _fresh_yes_no(check, params, convs, yes_no):
  c = check.begin({"params": params}, convs, room=0)
  logp = check.next_logprobs({"params": params}, c, yes_no).astype(np.float64)
  return 1.0 / (1.0 + np.exp(logp[:, 1] - logp[:, 0]))


def _greedy(check, params, convs, n):
  out = check.generate({"params": params}, convs, greedy=True)
  return [np.asarray(out.tokens)[i, :min(int(np.asarray(out.lengths)[i]), n)]
          for i in range(len(convs))]


def _check_roles(agent, check, prompts, records, g, role_params):
  """Ends, masks and each role's output against a fresh greedy pass of role_params."""
  a = agent.config.agent
  ends = [r["end"] for r in records]
  assert "verifier" in ends and "answer" in ends, ends  # both ways to stop are exercised
  convs, answers, asked, p_yes = [], [], [], []
  for i, rec in enumerate(records):
    prompt = prompts.ids[i // g]
    # The generator's turn and answer come last, as context: mask 0, after every action.
    turn, answer = rec["pieces"][-2:]
    assert not turn[1] and not answer[1]
    np.testing.assert_array_equal(turn[0], agent.roles.turn_ids(rec, a.generator_prompt))
    convs.append(_conversation(prompt, rec, -1))
    answers.append(answer[0])
    assert rec["answer"] == agent.tokenizer.decode(answer[0], skip_special_tokens=True)
    if rec["end"] == "verifier":  # its last question, after the trajectory's last piece
      asked.append(_conversation(prompt, rec, -2) + agent.roles.turn_ids(rec, a.verifier_prompt))
      p_yes.append(rec["verifier"][-1])
  for i, (got, want) in enumerate(zip(answers, _greedy(check, role_params, convs, 5))):
    np.testing.assert_array_equal(got, want, err_msg=f"generator, row {i}")
  np.testing.assert_allclose(p_yes, _fresh_yes_no(check, role_params, asked, agent.roles.yes_no),
                             atol=1e-4)
  assert min(p_yes) > 0.5
  return asked


def test_frozen_policy_roles_stay_out_of_the_loss_and_leave_the_sampler_logprobs(tiny):
  """The policy as generator and verifier: the verifier's peeks into the carried cache change
  no action's log-prob (the train step's forward over the row still gives the sampler's), the
  trained mask is exactly the actions, and both roles answer as fresh greedy passes would."""
  config, cfg, params, rows, _, _, check = tiny
  agent = _agent(tiny, generator="frozen_policy", verifier="frozen_policy")
  g = 2
  prompts, records, _, _ = agent.run({"params": params}, rows, g, jax.random.key(1))
  _check_roles(agent, check, prompts, records, g, params)
  # No role token is trained, and the rows give the train step the sampler's log-probs.
  assert_rows_give_sampler_logprobs(agent, cfg, params, prompts, rows, records, (128,))
  m = agent.roles.metrics(records)
  assert m["agent/verifier/calls/mean"] > 0 and m["agent/end/verifier_frac"] > 0


def test_reference_roles_use_the_reference_params(tiny):
  """Distinct reference params: the generator's answer and the verifier's P(Yes) are those of
  a fresh greedy pass of the reference over the compacted conversation, not the policy's."""
  config, cfg, params, rows, _, _, check = tiny
  ref = qwen.init_params(cfg, jax.random.key(6), jnp.float32)
  agent = _agent(tiny, generator="reference", verifier="reference")
  g = 2
  with pytest.raises(ValueError, match="ref_params"):
    agent.run({"params": params}, rows, g, jax.random.key(1))
  prompts, records, _, _ = agent.run({"params": params}, rows, g, jax.random.key(1),
                                      ref_vars={"params": ref})
  asked = _check_roles(agent, check, prompts, records, g, ref)
  # A random tied-embedding model's greedy text mostly echoes its input, whatever its weights;
  # the verifier's probabilities tell the two models apart.
  policy_p = _fresh_yes_no(check, params, asked, agent.roles.yes_no)
  assert np.abs(policy_p - [r["verifier"][-1] for r in records if r["end"] == "verifier"]).min() > 1e-3


def test_server_roles_get_the_transcript_as_chat_messages(tiny):
  config, _, params, rows, _, _, _ = tiny
  with FakeChatServer() as server:
    agent = _agent(tiny, generator="server", verifier="server",
                   generator_prompt="Final answer? [reply=<answer>42</answer>]",
                   verifier_prompt="Enough? [reply=Yes, enough]",
                   server=dict(base_url=server.url, model="frozen-7b", max_retries=0))
    from grpo_jax.rewards import build_rewards
    rewards = build_rewards(config.rewards)
    part, _, m, _ = agent.sample({"params": params}, rows, rewards, jax.random.key(2), g=2)
    body = server.bodies[-1]  # the last generator request
    # A server that fails: no answer (scored as ""), the verifier's missing reply is a No.
    down = _agent(tiny, generator="server", verifier="server", generator_prompt="[500]",
                  verifier_prompt="[500]", server=dict(base_url=server.url, max_retries=0))
    part_down, _, m_down, _ = down.sample({"params": params}, rows, rewards, jax.random.key(2), g=2)
  assert part_down.texts == [""] * 6 and m_down["agent/generator/missing"] == 6
  assert m_down["agent/verifier/missing"] > 0 and m_down["agent/end/verifier_frac"] == 0
  assert part.texts == ["<answer>42</answer>"] * 6
  assert m["agent/generator/missing"] == 0 and m["agent/verifier/missing"] == 0
  # The verifier's Yes after a tool call ends a trajectory at once.
  assert m["agent/end/verifier_frac"] + m["agent/end/answer_frac"] == 1.0
  assert body["model"] == "frozen-7b"
  roles = [msg["role"] for msg in body["messages"]]
  assert roles[0] == "user" and roles[1] == "assistant" and roles[-1] == "user"
  assert body["messages"][-1]["content"].endswith("Final answer? [reply=<answer>42</answer>]")
  # A row holds the generator's reply as context only.
  assert part.loss_mask_BC.sum() < (part.lengths_B.sum())


@pytest.mark.parametrize("change, field", [
    (dict(generator="reference"), "agent.generator: 'reference' needs the reference params"),
    (dict(generator="judge"), "agent.generator: unknown generator"),
    (dict(verifier="frozen_policy"), "agent.verifier: 'frozen_policy' ends trajectories"),
    (dict(generator="server", server=dict(base_url="localhost:8000")),
     "agent.server: base_url"),
])
def test_role_config_errors(change, field):
  from configs import gsm8k_agent
  c = gsm8k_agent.get_config("tiny")
  c.loss.beta = 0.0
  c.agent.update(**{k: v for k, v in change.items() if k != "server"})
  if "server" in change:
    c.agent.server.update(change["server"])
  with pytest.raises(validate.ConfigError, match=field.replace("(", r"\(")):
    validate.validate(c, 8)


def test_warm_start_traces_teach_a_local_generator_its_turn(tiny):
  """With a frozen_policy (or reference) generator, each warm-start trace goes on after the
  planner's answer action with the generator's turn (context) and the answer (trained)."""
  from grpo_jax.agent import traces
  config, _, _, rows, tok, _, _ = tiny
  budgets = dict(action_tokens=24, generator_tokens=12)
  plain = traces.examples(_agent(tiny, **budgets), rows)
  agent = _agent(tiny, generator="frozen_policy", **budgets)
  prompts, completions, masks = traces.examples(agent, rows)
  assert prompts == plain[0]
  for before, before_mask, ids, mask in zip(plain[1], plain[2], completions, masks):
    assert ids[:len(before)] == before and mask[:len(before)] == before_mask
    turn = agent.roles.turn_ids({"turns": [("", None)], "stopped": True},
                                config.agent.generator_prompt)
    tail, tail_mask = ids[len(before):], mask[len(before):]
    assert tail[:len(turn)] == turn and tail_mask == [0] * len(turn) + [1] * (len(tail) - len(turn))
    # The generator's answer is the planner's answer action again, stop token included.
    n = len(tail) - len(turn)
    assert tail[len(turn):] == before[-n:] and before_mask[-n:] == [1] * n
