"""The agent's environment: a query, a toolset K and the memory M of one trajectory.

    env = ToolEnv(tools.select(("calculator",)), max_turns=4)
    first = env.reset({"question": "Mia has 347 pens ...", "answer": "... #### 480"})
    obs, done, info = env.step("<tool>calculator: 347+289</tool>")   # -> "636", False, {...}
    obs, done, info = env.step("<answer>480</answer>")               # -> "", True, {...}

An action is the planner's text for one turn: free text (a sub-goal), then either one tool call
`<tool>NAME: ARGUMENT</tool>` or the final answer `<answer>...</answer>`. The memory M is the
conversation so far: each observation is appended as the next user turn, and the sampler keeps
every earlier turn in its KV cache (grpo_jax.agent.rollout), so the planner sees q, K and M at
every turn without the prompt being rebuilt. The trajectory ends at the answer, or after
max_turns actions without one (then it has no answer and earns no outcome reward).
"""
from __future__ import annotations

import dataclasses
import re

_TOOL_CALL = re.compile(r"<tool>\s*([A-Za-z_][\w-]*)\s*:(.*?)</tool>", re.S)
_ANSWER = re.compile(r"<answer>.*?</answer>", re.S)


@dataclasses.dataclass(frozen=True)
class Action:
  kind: str        # 'tool', 'answer' or 'invalid'
  tool: str = ""   # for 'tool'
  argument: str = ""


def parse_action(text: str) -> Action:
  """The first tool call or answer in the action text, whichever comes first.

  >>> parse_action("add them <tool>calculator: 3+4</tool>")
  Action(kind='tool', tool='calculator', argument='3+4')
  """
  call, answer = _TOOL_CALL.search(text), _ANSWER.search(text)
  if answer and (call is None or answer.start() < call.start()):
    return Action("answer")
  if call:
    return Action("tool", call.group(1), call.group(2).strip())
  return Action("invalid")


def toolset_text(tools) -> str:
  """K as the prompt shows it: each tool's description, one per line."""
  return "\n".join(t.description for t in tools.values())


class ToolEnv:
  """reset(example) -> the first user turn; step(action_text) -> (observation, done, info).

  info: {'kind': 'tool' | 'answer' | 'invalid', 'tool': name or '', 'status': the tool's status
  ('ok', 'error', 'timeout', 'killed') or '', 'seconds': tool time}.
  """

  def __init__(self, tools, max_turns: int, user_template: str = "{tools}\n\n{question}"):
    if max_turns < 1:
      raise ValueError(f"agent.max_turns={max_turns} must be >= 1")
    self.tools, self.max_turns, self.user_template = dict(tools), max_turns, user_template
    self.turns = 0

  def reset(self, example) -> str:
    self.turns = 0
    return self.user_template.format(tools=toolset_text(self.tools),
                                     tool_names=", ".join(self.tools),
                                     question=example["question"])

  def step(self, action_text: str) -> tuple[str, bool, dict]:
    self.turns += 1
    action = parse_action(action_text)
    info = {"kind": action.kind, "tool": action.tool, "status": "", "seconds": 0.0}
    if action.kind == "answer":
      return "", True, info
    if action.kind == "invalid":
      observation = "error: no <tool>NAME: ARGUMENT</tool> call and no <answer></answer>"
    elif action.tool not in self.tools:
      info["status"] = "error"
      observation = f"error: unknown tool {action.tool!r}; tools: {', '.join(self.tools)}"
    else:
      result = self.tools[action.tool](action.argument)
      info.update(status=result.status, seconds=result.seconds)
      observation = result.text
    return observation, self.turns >= self.max_turns, info
