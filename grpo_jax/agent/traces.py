"""Warm-start traces that call the tools, from GSM8K-schema answers.

A GSM8K answer marks each calculation as <<expr=result>>; each becomes one tool call, and the
final answer one last action:

    calls("47 + 31 = <<47+31=78>>78\\n78 - 5 = <<78-5=73>>73\\n#### 73") -> ["47+31", "78-5"]
    turns: <tool>calculator: 47+31</tool> | 78 | <tool>calculator: 78-5</tool> | 73
           | <answer>73</answer>

The observations are what the tool itself returns for the call (the same text a rollout would
show), and only the action tokens are trained on, as in Flow-GRPO. With a local frozen
generator (agent.generator 'frozen_policy' or 'reference': the policy's weights, or the
reference the warm start becomes), the answer action is followed by the generator's turn, as a
rollout adds it, and the generator's answer is trained on too: the warm start teaches the
weights every role they play; GRPO later trains only the planner. With an executor
(agent.executor), each call's action names the calculation as its sub-goal,
`<tool>calculator: 47+31</tool>`, and the executor's turn follows with the tool's input
(`47+31`; for python `print(47+31)`); a local executor's input is trained on too.
"""
from __future__ import annotations

import re

from grpo_jax import data

_ANNOTATION = re.compile(r"<<([^<>=]{1,200})=([^<>]{0,200})>>")


def calls(answer_text: str) -> list[str]:
  return [m.group(1).strip() for m in _ANNOTATION.finditer(answer_text)]


def tool_argument(tool: str, expression: str) -> str:
  """The argument of one calculation's call: the expression, or for python, code printing it."""
  return expression if tool == "calculator" else f"print({expression})"


def turns(agent, row) -> list[tuple[str, tuple[str, str] | None, str | None]] | None:
  """[(action, (tool, executor's input) or None, observation), ..., (answer action, None,
  None)], or None when the trace would need more than agent.max_turns actions."""
  exprs = calls(row["answer"])
  if len(exprs) + 1 > agent.config.agent.max_turns:
    return None
  tool = next(t for t in ("calculator", "python") if t in agent.tools)
  executor = agent.config.agent.executor != "none"
  out = []
  for expr in exprs:
    argument = tool_argument(tool, expr)
    out.append((f"<tool>{tool}: {expr if executor else argument}</tool>",
                (tool, argument) if executor else None, agent.tools[tool](argument).text))
  out.append((f"<answer>{data.gold_answer(row['answer'])}</answer>", None, None))
  return out


def examples(agent, rows):
  """(prompt ids, completion ids, loss masks) for sft.sft_batch; rows whose trace needs more
  turns than agent.max_turns, or an action longer than agent.action_tokens, are left out."""
  tok, a = agent.tokenizer, agent.config.agent
  stop = tok.convert_tokens_to_ids(tok.eos_token)
  generator = a.generator in ("frozen_policy", "reference")
  executor_trained = int(a.executor in ("frozen_policy", "reference"))
  kept, completions, masks = [], [], []
  for row in rows:
    trace = turns(agent, row)
    if trace is None:
      continue
    ids, mask = [], []
    for action, command, observation in trace:
      action_ids = tok(action, add_special_tokens=False).input_ids + [stop]
      if len(action_ids) > a.action_tokens:
        break
      ids += action_ids
      mask += [1] * len(action_ids)
      if command is not None:
        tool, argument = command
        turn = agent.roles.executor_turn_ids({"stopped": True}, tool)
        input_ids = tok(argument, add_special_tokens=False).input_ids + [stop]
        if len(input_ids) > a.executor_tokens:
          break
        ids += turn + input_ids
        mask += [0] * len(turn) + [executor_trained] * len(input_ids)
      if observation is not None:
        obs = agent.format.observation_ids(tok, observation, True, a.observation_tokens)
        ids += obs
        mask += [0] * len(obs)
    else:
      if generator:
        turn = agent.roles.turn_ids({"turns": [(action, None)], "stopped": True},
                                    a.generator_prompt)
        if len(action_ids) > a.generator_tokens:
          continue
        ids += turn + action_ids
        mask += [0] * len(turn) + [1] * len(action_ids)
      kept.append(row)
      completions.append(ids)
      masks.append(mask)
  if not kept:
    raise ValueError("no warm-start trace fits agent.max_turns and agent.action_tokens")
  return agent.prompts(kept).ids, completions, masks
