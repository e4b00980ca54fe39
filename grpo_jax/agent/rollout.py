"""Batched multi-turn rollouts: all B·G trajectories advance turn by turn in batched sampler calls.

    agent = Agent(config, tokenizer, sampler)
    part, reward_m, agent_m, (t_sample, t_reward) = agent.sample(variables, rows, rewards, key)
    part.train_batch(config, pad_id)  # the train step's rollout layout, + loss_mask_BC, turn_ids_BC

Agent implements grpo_jax.rollout's one rollout interface (sample, evaluate, sft_examples,
batch_layout, completion_width, max_turns), as rollout.SingleTurn does for single turns.

One turn: `Sampler.extend` samples every live row's action (at most agent.action_tokens) from
where its conversation stands; the host decodes the actions and steps each row's environment
(tool calls in a bounded thread pool); `Sampler.append` feeds every row that goes on its
observation as the next user turn (at most agent.observation_tokens, plus the chat template's
turn separators). The KV cache stays on the device between turns: nothing is prefilled twice
(benchmarks/agent_cache.py measures what that saves against re-prefilling each turn).

A trajectory becomes one row of the train batch: the prompt, then its completion = action 1,
observation 1, action 2, ..., the answer, without the cache's holes. loss_mask_BC is 1 on action
tokens only (observations are context: no loss, no KL) and turn_ids_BC numbers the actions, for
loss_type 'flow_grpo'. The outcome reward scores the final action (the one holding
<answer>...</answer>) with the run's reward stack; a trajectory that ran out of turns has no
answer and scores "" (0 for math_accuracy). With a frozen generator or verifier
(config.agent.generator / verifier, grpo_jax.agent.roles) a verifier's Yes after a tool
observation also ends a trajectory, and the generator's answer, written after the last turn
and kept out of the loss mask, is what is scored.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from grpo_jax import config as config_lib, data, rollout
from grpo_jax.agent import env as env_lib
from grpo_jax.agent import roles as roles_lib
from grpo_jax.agent import tools as tools_lib
from grpo_jax.agent import traces as traces_lib
from grpo_jax.rewards import score

_SENTINEL = ("\x01A\x01", "\x01O\x01")


@dataclasses.dataclass(frozen=True)
class TurnFormat:
  """How an observation becomes the next user turn, in the tokenizer's own chat template:
  `before` closes the assistant turn and opens a user turn, `after` closes it and opens the next
  assistant turn. Found once by rendering a conversation with sentinel contents."""
  before: str
  after: str
  stop_text: str  # the assistant turn's closing token, which the action itself ends with

  @staticmethod
  def of(tokenizer) -> TurnFormat:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL[0]},
            {"role": "user", "content": _SENTINEL[1]}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    a, o = text.index(_SENTINEL[0]) + len(_SENTINEL[0]), text.index(_SENTINEL[1])
    return TurnFormat(text[a:o], text[o + len(_SENTINEL[1]):], tokenizer.eos_token or "")

  def observation_ids(self, tokenizer, observation: str, stopped: bool, budget: int,
                      suffix: str = ""):
    """Token ids appended after an action: the separators around the observation, whose own
    tokens are cut to `budget` (then `suffix`: a frozen role's prompt, grpo_jax.agent.roles).
    An action that ended with the stop token has already closed its turn; one cut by its
    token budget gets the closing token here."""
    before = self.before
    if stopped and self.stop_text and before.startswith(self.stop_text):
      before = before[len(self.stop_text):]
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids if s else []
    # The observation is a tool's output, which model code writes: control tokens printed in it
    # ("<|im_end|>\n<|im_start|>assistant") stay text, never a turn boundary.
    observed = (tokenizer(observation, add_special_tokens=False,
                          split_special_tokens=True).input_ids if observation else [])
    return enc(before) + observed[:budget] + enc(suffix) + enc(self.after)

  def width(self, tokenizer, budget: int) -> int:
    enc = lambda s: len(tokenizer(s, add_special_tokens=False).input_ids) if s else 0
    return enc(self.before) + budget + enc(self.after)


def _reference(ref_params):
  """The frozen reference params as the sampler's variables (None: there are none)."""
  return None if ref_params is None else {"params": ref_params}


def texts_of(records) -> dict[str, list[str]]:
  """{'texts': each trajectory's answer ('' where none), 'trajectories': trajectory_text}."""
  return {"texts": [rec["answer"] or "" for rec in records],
          "trajectories": [trajectory_text(r) for r in records]}


def trajectory_text(record) -> str:
  """A trajectory as samples.md shows it: action, observation, ..., one block per turn."""
  lines = []
  commands = dict(record.get("executor", ()))  # turn -> the executor's input
  for t, (action, observation) in enumerate(record["turns"]):
    lines.append(f"[action {t + 1}] {action}")
    if t in commands:
      lines.append(f"[executor {t + 1}] {commands[t]}")
    if observation is not None:
      lines.append(f"[observation {t + 1}] {observation}")
  if record.get("end") == "verifier":
    lines.append("[verifier] Yes")
  if record.get("generator") is not None:
    lines.append(f"[generator] {record['generator']}")
  return "\n".join(lines)


class Agent:
  """The multi-turn rollout of a run (config.agent): prompts, turns, trajectories, metrics."""

  def __init__(self, config, tokenizer, sampler, interrupt=None):
    a = config.agent
    self.config, self.tokenizer, self.sampler = config, tokenizer, sampler
    self.tools = tools_lib.select(tuple(a.tools), timeout_s=a.tool_timeout_s,
                                  sandbox_mode=a.get("sandbox", "strict"))
    self.format = TurnFormat.of(tokenizer)
    self.obs_width = self.format.width(tokenizer, a.observation_tokens)
    # Room after the prompt: every action at its budget, an observation after all but the last.
    room = a.max_turns * a.action_tokens + (a.max_turns - 1) * self.obs_width
    self.roles = roles_lib.Roles(config, tokenizer, sampler, self.format, room, interrupt,
                                 tool_names=tuple(self.tools))
    room += a.max_turns * self.roles.exe_room  # an executor's turn after every tool action
    # The row also holds a frozen generator's turn; the cache also a peek at the verifier's.
    self.room = room + self.roles.row_room
    self.cache_room = self.room + self.roles.peek_room
    self.stop_ids = set(sampler.stop_ids)
    self.completion_width = self.room  # a trajectory's completion: its actions and observations
    self.max_turns = a.max_turns

  def sft_examples(self, rows):
    """The warm start's traces: solutions that call the tools (grpo_jax.agent.traces)."""
    return traces_lib.examples(self, rows)

  def batch_layout(self, rows, num_rewards: int):
    """None: a trajectory's width is known only once it has run, so nothing compiles ahead."""
    del rows, num_rewards

  def new_env(self) -> env_lib.ToolEnv:
    return env_lib.ToolEnv(self.tools, self.config.agent.max_turns,
                           self.config.agent.user_template)

  def prompts(self, rows) -> rollout.Prompts:
    """The first turn: K and the query in the user turn, through the chat template."""
    d = self.config.data
    texts = [data.build_prompt(self.tokenizer, self.new_env().reset(r), d.system_prompt)
             for r in rows]
    return rollout.Prompts(texts, data.encode_prompts(self.tokenizer, texts))

  def run(self, params, rows, g: int, key, *, greedy: bool = False, ref_vars=None):
    """G trajectories per row. Returns (Prompts, per-trajectory records, sampler seconds).
    params: what the sampler runs, model.apply's variables (policy.Policy.sampled); ref_vars:
    the reference's ({'params': reference}), for a 'reference' generator or verifier."""
    a, tok = self.config.agent, self.tokenizer
    prompts = self.prompts(rows)
    n = len(rows) * g
    envs = [self.new_env() for _ in range(n)]
    # end: 'answer' (the planner's), 'verifier' (its Yes) or 'turns' (out of turns).
    records = [{"turns": [], "pieces": [], "info": [], "answer": None, "logp": [],
                "user": e.reset(rows[i // g]), "end": "turns", "verifier": [], "executor": []}
               for i, e in enumerate(envs)]
    prompt_ids = [prompts.ids[i // g] for i in range(n)]
    frozen_generator = self.roles.generator != "policy"
    self.roles.reset()
    active = np.ones(n, bool)
    sample_s = time.perf_counter()
    conv = self.sampler.begin(params, prompts.ids, num_samples=g, room=self.cache_room)
    settings = {"greedy": True} if greedy else {}
    pool = ThreadPoolExecutor(max_workers=a.tool_workers)
    env_s = 0.0
    try:
      for t in range(a.max_turns):
        out, conv = self.sampler.extend(params, conv, jax.random.fold_in(key, t),
                                        max_tokens=a.action_tokens, active=active, **settings)
        ids, lengths, logp = (np.asarray(out["tokens"]), np.asarray(out["lengths"]),
                              np.asarray(out["logprobs"]))
        live = np.flatnonzero(active)
        actions = tok.batch_decode([ids[i, :lengths[i]] for i in live], skip_special_tokens=True)
        for i in live:
          rec = records[i]
          rec["pieces"].append((ids[i, :lengths[i]], True, t))
          rec["logp"].append(logp[i, :lengths[i]])
          rec["stopped"] = lengths[i] > 0 and int(ids[i, lengths[i] - 1]) in self.stop_ids
        commands = actions
        if self.roles.executor != "none":
          conv, commands = self._execute(params, ref_vars, conv, live, actions, records,
                                         prompt_ids)
        t0 = time.perf_counter()
        steps = list(pool.map(lambda ia: envs[ia[0]].step(ia[1]), zip(live, commands)))
        env_s += time.perf_counter() - t0
        for i, action, (observation, done, info) in zip(live, actions, steps):
          rec = records[i]
          rec["info"].append(info)
          if info["kind"] == "answer":
            rec["answer"], rec["end"] = action, "answer"
          if done:
            active[i] = False
          # An ended trajectory's last observation is shown only to a frozen generator.
          shown = not done or (frozen_generator and info["kind"] != "answer")
          rec["turns"].append((action, observation if shown else None))
        if self.roles.verifier != "none":
          asked = [i for i in live if active[i] and records[i]["info"][-1]["kind"] == "tool"]
          conv = self.roles.verify(params, ref_vars, conv, asked, records, prompt_ids, active)
        obs_ids = [[] for _ in range(n)]
        for i in live:
          if active[i]:
            rec = records[i]
            obs_ids[i] = self.format.observation_ids(tok, rec["turns"][-1][1], rec["stopped"],
                                                     a.observation_tokens)
            rec["pieces"].append((np.asarray(obs_ids[i], np.int32), False, t))
        if not active.any():
          break
        conv = self.sampler.append(params, conv, obs_ids, self.obs_width)
      if frozen_generator:
        self.roles.generate(params, ref_vars, conv, records, prompt_ids)
    finally:
      pool.shutdown(wait=False, cancel_futures=True)
    seconds = time.perf_counter() - sample_s
    return prompts, records, seconds, env_s

  parse_action = staticmethod(env_lib.parse_action)

  def _execute(self, params, ref_vars, conv, live, actions, records, prompt_ids):
    """The executor's turn for each live row whose action calls a known tool. Returns
    (conversation, the actions the environments step on: each such call with the executor's
    input in place of the sub-goal)."""
    parsed = {i: self.parse_action(action) for i, action in zip(live, actions)}
    asked = [i for i in live if parsed[i].kind == "tool" and parsed[i].tool in self.tools]
    tools = {i: parsed[i].tool for i in asked}
    conv, inputs = self.roles.execute(params, ref_vars, conv, asked, tools, records,
                                      prompt_ids, dict(zip(live, actions)))
    return conv, [f"<tool>{tools[i]}: {inputs[i]}</tool>" if i in inputs else action
                  for i, action in zip(live, actions)]

  def arrays(self, records) -> dict[str, np.ndarray]:
    """Trajectories compacted to one fixed width W: completion, loss_mask, turn_ids and
    sampler_logp [n, W] (the sampler's log-probs on the policy's action tokens, 0 elsewhere),
    lengths and truncated (no answer) [n]."""
    n, width = len(records), self.room
    comp = np.full((n, width), self.tokenizer.pad_token_id, np.int32)
    loss_mask = np.zeros((n, width), np.int32)
    turn_ids = np.zeros((n, width), np.int32)
    logp = np.zeros((n, width), np.float32)
    lengths = np.zeros(n, np.int32)
    for i, rec in enumerate(records):
      at, actions = 0, iter(rec["logp"])  # one entry per action piece, in order
      for ids, is_action, t in rec["pieces"]:
        comp[i, at:at + len(ids)] = ids
        loss_mask[i, at:at + len(ids)] = int(is_action)
        turn_ids[i, at:at + len(ids)] = t
        if is_action:
          logp[i, at:at + len(ids)] = next(actions)
        at += len(ids)
      lengths[i] = at
    return {"completion": comp, "loss_mask": loss_mask, "turn_ids": turn_ids,
            "sampler_logp": logp, "lengths": lengths,
            "truncated": np.array([rec["answer"] is None for rec in records])}

  def rollouts(self, prompts, rows, records, rewards_BR) -> rollout.Rollouts:
    """Trajectories as rollout.Rollouts rows: completions compacted to one fixed width."""
    return self.rows_of(prompts, rows, self.arrays(records), texts_of(records), rewards_BR)

  def rows_of(self, prompts, rows, arrays, extra, rewards_BR) -> rollout.Rollouts:
    """Trajectories (self.arrays; texts_of: their answers' and trajectories' texts) as
    rollout.Rollouts rows. One step behind (train.off_policy_steps=1) the sampler's log-probs
    are the behaviour policy."""
    behind = bool(self.config.train.off_policy_steps)
    return rollout.Rollouts(list(rows), prompts.texts, prompts.ids, arrays["completion"],
                            arrays["lengths"], arrays["truncated"], extra["texts"], rewards_BR,
                            loss_mask_BC=arrays["loss_mask"], turn_ids_BC=arrays["turn_ids"],
                            trajectories=extra["trajectories"], behind=behind,
                            sampler_logp_BC=arrays["sampler_logp"] if behind else None)

  def sample(self, params, rows, rewards, key, ref_params=None, g=None):
    """rollout.SingleTurn.sample for trajectories: (Rollouts, reward metrics, agent metrics,
    (seconds sampling and stepping environments, seconds scoring)); ref_params feed a
    'reference' role."""
    return self.score_drawn(rows, *self.draw(params, rows, key, ref_params, g), rewards, g)

  def draw(self, params, rows, key, ref_params=None, g=None):
    """sample's first half, the trajectories without their rewards: (Prompts, self.arrays,
    {'texts': answers, 'trajectories': texts}, agent metrics, seconds sampling and stepping
    environments). Host lists and numpy only: grpo_jax.pipeline keeps it in a checkpoint."""
    g = g or config_lib.group_size(self.config)
    prompts, records, sample_s, env_s = self.run(params, rows, g, key,
                                                 ref_vars=_reference(ref_params))
    extra = texts_of(records)
    m = self.metrics(records)
    m.update(self.roles.metrics(records))
    m["time/tool_s"] = env_s
    return prompts, self.arrays(records), extra, m, sample_s

  def score_drawn(self, rows, prompts, arrays, extra, m, sample_s, rewards, g=None):
    """sample's second half: draw's trajectories scored, sample's result."""
    g = g or config_lib.group_size(self.config)
    t1 = time.perf_counter()
    prompt_texts_B = [p for p in prompts.texts for _ in range(g)]
    reward_BR, reward_m = score(rewards, prompt_texts_B, extra["texts"], g,
                                rollout.reward_columns(rows, g))
    part = self.rows_of(prompts, rows, arrays, extra, reward_BR)
    return part, reward_m, m, (sample_s, time.perf_counter() - t1)

  def metrics(self, records) -> dict[str, float]:
    """agent/turns/mean, agent/tool_calls/mean, agent/answered_frac, and per tool its calls,
    errors, timeouts and sandbox kills (per trajectory, summed over the batch for counts)."""
    n = len(records)
    calls = collections.Counter()
    status = collections.Counter()
    for rec in records:
      for info in rec["info"]:
        if info["kind"] == "tool":
          calls[info["tool"]] += 1
          status[(info["tool"], info["status"])] += 1
    m = {"agent/turns/mean": float(np.mean([len(r["info"]) for r in records])),
         "agent/tool_calls/mean": sum(calls.values()) / n,
         "agent/answered_frac": float(np.mean([r["answer"] is not None for r in records])),
         "agent/invalid_actions/mean": sum(i["kind"] == "invalid" for r in records
                                           for i in r["info"]) / n}
    for name in self.tools:
      m[f"agent/tool/{name}/calls"] = calls[name]
      for s in ("error", "timeout", "killed"):
        m[f"agent/tool/{name}/{s}"] = status[(name, s)]
    return m

  def evaluate(self, params, rows, reward, ref_params=None) -> float:
    """Greedy pass@1 on `rows` with the tools: the answer scored by `reward` (math_accuracy).
    A 'reference' role without ref_params (the warm start, before there is a reference) uses
    `params` (what the sampler runs): the reference is what the warm start ends with."""
    bs, correct = self.config.train.eval_batch_size, 0
    ref_vars = _reference(ref_params)
    if ref_params is None and roles_lib.needs_reference(self.config.agent):
      ref_vars = params
    for i in range(0, len(rows), bs):
      chunk = rows[i:i + bs]
      prompts, records, _, _ = self.run(params, chunk, 1, jax.random.key(0), greedy=True,
                                        ref_vars=ref_vars)
      texts = [rec["answer"] or "" for rec in records]
      scores = reward.fn(prompts.texts, texts, group_size=1, **rollout.reward_columns(chunk, 1))
      correct += sum(s == 1.0 for s in scores)
    return correct / max(len(rows), 1)
