"""AgentFlow's executor (grpo_jax/agent/roles.py): a frozen role that turns a tool action's
sub-goal into the tool's input. The tool runs on what the executor wrote, not on the planner's
text; the executor's turn and input sit in the row as context (loss mask 0) and in the
planner's carried cache, so the train step's forward over the row still gives every action the
sampler's log-prob; a local executor writes what a fresh greedy pass of its params over the
conversation writes; a server executor gets the trajectory and the action as chat messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agent_roles_test import _conversation, _greedy, tiny  # noqa: F401 (the fixture)
from agent_rollout_test import assert_rows_give_sampler_logprobs
from fake_chat_server import FakeChatServer
from grpo_jax import sampler as sampler_lib, validate
from grpo_jax.agent import env as env_lib
from grpo_jax.models import qwen


class _RecordingEnv(env_lib.ToolEnv):
  """A random model writes no tool syntax, so the parse is scripted (as _scripted_parse): an
  action whose text length is a multiple of 4 answers, any other calls the calculator with
  its text as the sub-goal. What the environment is asked to run is recorded."""

  def __init__(self, *args, seen):
    super().__init__(*args)
    self.seen = seen

  def step(self, action_text):
    self.seen.append(action_text)
    if not _is_call(action_text):
      return super().step("<answer>0</answer>")
    return super().step(action_text)


def _is_call(text):
  """A call the agent built from an executor's input (a random action text is not one)."""
  return text.startswith("<tool>calculator: ") and text.endswith("</tool>")


def _scripted_parse(text):
  if len(text) % 4 == 0:
    return env_lib.Action("answer")
  return env_lib.Action("tool", "calculator", text)


def _agent(tiny, seen, server=None, **roles):
  from grpo_jax.agent import rollout as agent_rollout
  config, _, _, _, tok, sampler, _ = tiny
  c = config.copy_and_resolve_references()
  c.agent.update(**roles)
  c.agent.server.update(server or {})
  agent = agent_rollout.Agent(c, tok, sampler)
  agent.parse_action = _scripted_parse
  agent.new_env = lambda: _RecordingEnv(agent.tools, c.agent.max_turns, c.agent.user_template,
                                        seen=seen)
  return agent


def _executor_calls(agent, prompts, records, g):
  """(conversation up to the executor's turn, its input ids, the record's text) per call,
  checking where its pieces sit and that they are untrained."""
  calls = []
  for r, rec in enumerate(records):
    texts = dict(rec["executor"])
    k = 0
    for t in range(len(rec["turns"])):
      action = rec["pieces"][k]
      assert action[1] and action[2] == t  # the action, trained
      k += 1
      if t in texts:
        turn, command = rec["pieces"][k], rec["pieces"][k + 1]
        assert not turn[1] and not command[1], (r, t)  # context only
        np.testing.assert_array_equal(
            turn[0], agent.roles.executor_turn_ids({"stopped": _stopped(agent, action[0])},
                                                   "calculator"))
        calls.append((_conversation(prompts.ids[r // g], rec, k + 1), command[0], texts[t]))
        k += 2
      if k < len(rec["pieces"]) and not rec["pieces"][k][1]:
        k += 1  # the observation
  return calls


def _stopped(agent, ids):
  return len(ids) > 0 and int(ids[-1]) in set(agent.sampler.stop_ids)


@pytest.mark.parametrize("role", ["frozen_policy", "reference"])
def test_local_executor_writes_the_tool_input_as_a_fresh_greedy_pass(tiny, role):
  config, cfg, params, rows, tok, sampler, _ = tiny
  check = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=5, stop_ids=sampler.stop_ids,
                              buckets=(128, 256, 384), pad_id=tok.pad_token_id,
                              valid_vocab_size=len(tok))
  seen = []
  agent = _agent(tiny, seen, executor=role, executor_tokens=5)
  ref = qwen.init_params(cfg, jax.random.key(6), jnp.float32) if role == "reference" else None
  g = 2
  prompts, records, _, _ = agent.run({"params": params}, rows, g, jax.random.key(1),
                                      ref_vars=None if ref is None else {"params": ref})
  calls = _executor_calls(agent, prompts, records, g)
  assert len(calls) >= 3, len(calls)
  role_params = params if role == "frozen_policy" else ref
  want = _greedy(check, role_params, [c[0] for c in calls], 5)
  for (_, got, text), w in zip(calls, want):
    np.testing.assert_array_equal(got, w)
    assert text == tok.decode(got, skip_special_tokens=True).strip()
  # The calculator ran the executor's input, never the planner's sub-goal.
  tool_calls = [s for s in seen if _is_call(s)]
  assert sorted(tool_calls) == sorted(f"<tool>calculator: {c[2]}</tool>" for c in calls)
  # The cache held what the row holds: the train step gives every action the sampler's logp.
  assert_rows_give_sampler_logprobs(agent, cfg, params, prompts, rows, records, (128,))
  m = agent.roles.metrics(records)
  assert m["agent/executor/calls/mean"] == len(calls) / len(records)
  text = next(r for r in records if r["executor"])
  from grpo_jax.agent.rollout import trajectory_text
  assert "[executor " in trajectory_text(text)


def test_server_executor_gets_the_action_and_its_reply_is_run(tiny):
  config, cfg, params, rows, _, _, _ = tiny
  seen = []
  with FakeChatServer() as server:
    agent = _agent(tiny, seen, executor="server",
                   executor_prompt="Input for {tool}? [reply=3+4]",
                   server=dict(base_url=server.url, model="exec-7b", max_retries=0))
    prompts, records, _, _ = agent.run({"params": params}, rows, 2, jax.random.key(2))
    body = server.bodies[-1]
  tool_calls = [s for s in seen if _is_call(s)]
  assert tool_calls and set(tool_calls) == {"<tool>calculator: 3+4</tool>"}
  assert all(obs == "7" for r in records for (a, obs), info in zip(r["turns"], r["info"])
             if info["kind"] == "tool" and obs is not None)
  msgs = body["messages"]
  assert body["model"] == "exec-7b" and msgs[-2]["role"] == "assistant"
  assert msgs[-1] == {"role": "user", "content": "Input for calculator? [reply=3+4]"}
  assert_rows_give_sampler_logprobs(agent, cfg, params, prompts, rows, records, (128,))


def test_warm_start_traces_with_an_executor(tiny):
  """The planner's action names the calculation; the executor's turn (context) and the tool's
  input (trained for a local executor) follow it, then the observation."""
  from grpo_jax.agent import traces
  config, _, _, rows, tok, _, _ = tiny
  budgets = dict(action_tokens=24, executor_tokens=12)
  plain = traces.examples(_agent(tiny, [], **budgets), rows)
  agent = _agent(tiny, [], executor="frozen_policy", **budgets)
  prompts, completions, masks = traces.examples(agent, rows)
  assert prompts == plain[0]
  turn = agent.roles.executor_turn_ids({"stopped": True}, "calculator")
  stop = tok.convert_tokens_to_ids(tok.eos_token)
  for row, ids, mask in zip(rows, completions, masks):
    for expr in traces.calls(row["answer"]):
      action = tok(f"<tool>calculator: {expr}</tool>", add_special_tokens=False).input_ids
      command = tok(expr, add_special_tokens=False).input_ids + [stop]
      piece = action + [stop] + turn + command
      at = next(i for i in range(len(ids)) if ids[i:i + len(piece)] == piece)
      assert mask[at:at + len(piece)] == [1] * (len(action) + 1) + [0] * len(turn) + [1] * len(
          command)
  server = traces.examples(_agent(tiny, [], executor="server", **budgets), rows)
  assert [sum(m) for m in server[2]] < [sum(m) for m in masks]  # a server's input: untrained


@pytest.mark.parametrize("change, field", [
    (dict(executor="robot"), "agent.executor: unknown executor"),
    (dict(executor="reference"), "agent.executor: 'reference' needs the reference params"),
    (dict(executor_prompt="Input for {toolname}"), "agent.executor_prompt"),
    (dict(executor_tokens=0), "agent.executor_tokens"),
])
def test_executor_config_errors(change, field):
  from configs import gsm8k_agent
  c = gsm8k_agent.get_config("tiny")
  c.loss.beta = 0.0
  c.agent.update(**change)
  with pytest.raises(validate.ConfigError, match=field):
    validate.validate(c, 8)
