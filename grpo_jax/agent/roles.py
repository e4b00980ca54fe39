"""AgentFlow's frozen roles beside the planner: the generator and the verifier (config.agent).

The planner is the policy, the only trained role. When a trajectory ends (the planner's
<answer> action, the verifier's Yes, or out of turns) a frozen generator writes the final
answer, which the outcome reward scores; after every tool observation a verifier is asked
whether the memory suffices to answer, and Yes ends the trajectory. Each role is one of:

  frozen_policy  the policy (what the sampler runs) under stop-gradient: no extra memory, and it
                 runs on the planner's carried KV cache, so nothing is prefilled again.
  reference      the frozen reference params (they exist only when loss.beta > 0), as the
                 sampler's variables ref_vars = {'params': reference}. No cache of the
                 conversation exists for them: the compacted conversation is prefilled afresh
                 each time (a second Sampler whose buckets hold a whole trajectory).
  server         an OpenAI-compatible chat endpoint (agent.server, chat_http.ChatClient) given
                 the transcript as chat messages.

Local roles are deterministic: the generator decodes greedily, and the verifier samples nothing:
Yes when P(Yes) > P(No) at the position after its question (the first tokens of
agent.verifier_yes / verifier_no), as the verifier reward reads its judge. A server's reply is
Yes when it starts with verifier_yes; a missing reply counts as No (go on) and is counted.

The generator's user turn (the last observation, if any, then agent.generator_prompt) and its
answer are in the trajectory row as context with loss mask 0: coming last, they change no
trained token's log-prob. The verifier's question is in neither the row nor the cache
(Sampler.peek). With a frozen generator the planner's own <answer> action is its stop action:
it ends the trajectory, its tokens are trained (the choice of when to stop), but the answer
scored is the generator's, written after it.

The executor (agent.executor, 'none' by default: the planner writes each tool's input itself)
turns a tool action's sub-goal into the tool's input. With one, `<tool>NAME: SUB-GOAL</tool>`
names the tool and says what to do; the executor is shown the conversation with that action,
then a user turn (agent.executor_prompt, {tool}: the tool's name), and writes the input
greedily (at most agent.executor_tokens); the tool runs on what it wrote. Its turn and its
input go into the row with loss mask 0 right after the action, and into the planner's carried
cache (frozen_policy writes there itself; a reference or server executor's tokens are appended
to it), so the planner's next turn sees the command and the row and the cache never differ.

    roles = Roles(config, tokenizer, sampler, turn_format, loop_room)
    conv, commands = roles.execute(params, ref_vars, conv, asked_rows, tools, records, prompt_ids)
    conv = roles.verify(params, ref_vars, conv, asked_rows, records, prompt_ids, active)
    conv = roles.generate(params, ref_vars, conv, records, prompt_ids)
"""
from __future__ import annotations

import time

import numpy as np

from grpo_jax import sampler as sampler_lib
from grpo_jax.rewards import options
from grpo_jax.rewards.chat_http import ChatClient

GENERATORS = ("policy", "frozen_policy", "reference", "server")
VERIFIERS = ("none", "frozen_policy", "reference", "server")
EXECUTORS = ("none", "frozen_policy", "reference", "server")
_REF_BUCKET = 128  # the reference's conversation buckets: each one used compiles once


def server_options(a) -> options.HttpOptions:
  return options.from_config(options.HttpOptions, a.server, "agent.server")


def needs_reference(a) -> bool:
  return "reference" in (a.generator, a.verifier, a.executor)


def _tokens(rec) -> list[int]:
  """A trajectory's compacted tokens so far (after the prompt), as its train row holds them."""
  return [int(x) for ids, _, _ in rec["pieces"] for x in ids]


class Roles:
  """The frozen executor, generator and verifier of an Agent, and what they cost (self.last:
  per run)."""

  def __init__(self, config, tokenizer, sampler, turn_format, loop_room: int, interrupt=None,
               tool_names=()):
    a = config.agent
    self.config, self.tokenizer, self.sampler, self.format = config, tokenizer, sampler, turn_format
    self.generator, self.verifier, self.executor = a.generator, a.verifier, a.executor
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids
    width = turn_format.width(tokenizer, a.observation_tokens)
    # A role's user turn: the latest observation cut to its budget, then the role's prompt.
    self.gen_width = width + len(enc("\n\n" + a.generator_prompt))
    self.ver_width = width + len(enc("\n\n" + a.verifier_prompt))
    # The executor's turn (no observation: it comes right after the action) and its input, in
    # the row and the cache after every tool action.
    self.exe_width = turn_format.width(tokenizer, 0) + max(
        [len(enc(a.executor_prompt.format(tool=name))) for name in tool_names] or [0])
    self.exe_room = 0 if a.executor == "none" else self.exe_width + a.executor_tokens
    loop_room += a.max_turns * self.exe_room
    # Slots the row (and the carried cache) needs beyond the planner's turns, and the slots a
    # peek at the verifier's question needs in the cache only.
    self.row_room = 0 if a.generator == "policy" else self.gen_width + a.generator_tokens
    self.peek_room = self.ver_width if a.verifier == "frozen_policy" else 0
    yes, no = enc(a.verifier_yes), enc(a.verifier_no)
    if a.verifier in ("frozen_policy", "reference") and (not yes or not no or yes[0] == no[0]):
      raise ValueError(f"agent.verifier_yes={a.verifier_yes!r} and verifier_no="
                       f"{a.verifier_no!r} must start with different tokens")
    self.yes_no = (yes[0], no[0]) if yes and no else (0, 0)
    self.client = (ChatClient(server_options(a), interrupt=interrupt)
                   if "server" in (a.generator, a.verifier, a.executor) else None)
    self.ref_sampler = None
    if needs_reference(a):
      # Every conversation fits: a prompt bucket, the planner's turns, one role's turn.
      longest = max(config.data.prompt_buckets) + loop_room + max(
          self.gen_width, self.ver_width, self.exe_width)
      buckets = range(_REF_BUCKET, longest + _REF_BUCKET, _REF_BUCKET)
      self.ref_sampler = sampler_lib.Sampler(
          sampler.model, max_new_tokens=a.generator_tokens, stop_ids=sampler.stop_ids,
          buckets=tuple(buckets), valid_vocab_size=sampler.valid, pad_id=sampler.pad_id,
          mesh=sampler.mesh)
    self.last = {}

  def reset(self) -> None:
    self.last = {"verifier_s": 0.0, "generator_s": 0.0, "executor_s": 0.0,
                 "verifier_missing": 0, "generator_missing": 0, "executor_missing": 0}

  # --- what a role is shown -------------------------------------------------------------------

  def turn_ids(self, rec, prompt: str) -> list[int]:
    """A role's user turn after the trajectory so far, in the chat template: the latest
    observation (if the last action had one) cut to its budget, then `prompt`; it ends with
    the assistant turn opened."""
    obs = rec["turns"][-1][1] or ""
    return self.format.observation_ids(self.tokenizer, obs, rec["stopped"],
                                       self.config.agent.observation_tokens,
                                       suffix=("\n\n" if obs else "") + prompt)

  def executor_turn_ids(self, rec, tool: str) -> list[int]:
    """The executor's user turn right after the action (rec['stopped']: whether that action
    closed its turn), ending with the assistant turn opened."""
    prompt = self.config.agent.executor_prompt.format(tool=tool)
    return self.format.observation_ids(self.tokenizer, "", rec["stopped"], 0, suffix=prompt)

  def messages(self, rec, prompt: str, action: str | None = None) -> list[dict]:
    """The trajectory as chat messages for a server, ending with the user turn of turn_ids;
    with `action`, the trajectory so far, then that action and `prompt` (the executor's)."""
    system = self.config.data.system_prompt
    msgs = [{"role": "system", "content": system}] if system is not None else []
    msgs.append({"role": "user", "content": rec["user"]})
    turns = list(rec["turns"]) + ([(action, None)] if action is not None else [])
    for past, obs in turns[:-1]:
      msgs += [{"role": "assistant", "content": past}, {"role": "user", "content": obs or ""}]
    last, obs = turns[-1]
    msgs += [{"role": "assistant", "content": last},
             {"role": "user", "content": "\n\n".join(x for x in (obs, prompt) if x)}]
    return msgs

  def _conversations(self, records, rows, prompt_ids, turns) -> list[list[int]]:
    """Each row's whole conversation for a fresh prefill (a one-token stand-in elsewhere)."""
    convs = [[self.sampler.pad_id] for _ in records]
    for i in rows:
      convs[i] = list(prompt_ids[i]) + _tokens(records[i]) + list(turns[i])
    return convs

  def _require(self, ref_vars):
    if ref_vars is None:
      raise ValueError("a 'reference' agent role needs ref_params (loss.beta > 0)")

  # --- the roles ------------------------------------------------------------------------------

  def execute(self, params, ref_vars, conv, asked, tools, records, prompt_ids, actions):
    """The executor's input for the tool action of each row in `asked` (tools[i]: the tool it
    names; actions[i]: the action's text; records[i]['pieces'] ends with it). Its turn and its
    input join the row (loss mask 0) and the planner's cache. Returns (conversation,
    {row: the input's text})."""
    a, tok, t0 = self.config.agent, self.tokenizer, time.perf_counter()
    if not asked:
      return conv, {}
    n = len(records)
    turns = [[] for _ in range(n)]
    for i in asked:
      turns[i] = self.executor_turn_ids(records[i], tools[i])
    stopped = {}
    if self.executor == "server":
      replies, _ = self.client.complete([
          self.messages(records[i], a.executor_prompt.format(tool=tools[i]), actions[i])
          for i in asked])
      self.last["executor_missing"] += sum(r is None for r in replies)
      inputs = {i: tok(r or "", add_special_tokens=False).input_ids[:a.executor_tokens]
                for i, r in zip(asked, replies)}
    else:
      if self.executor == "frozen_policy":
        conv = self.sampler.append(params, conv, turns, self.exe_width)
        active = np.zeros(n, bool)
        active[asked] = True
        out, conv = self.sampler.extend(params, conv, None, max_tokens=a.executor_tokens,
                                        active=active, greedy=True)
      else:
        self._require(ref_vars)
        c = self.ref_sampler.begin(ref_vars, self._conversations(records, asked, prompt_ids,
                                                                   turns),
                                   room=a.executor_tokens)
        out, _ = self.ref_sampler.extend(ref_vars, c, None, max_tokens=a.executor_tokens,
                                         greedy=True)
      ids, lengths = np.asarray(out["tokens"]), np.asarray(out["lengths"])
      inputs = {i: ids[i, :lengths[i]] for i in asked}
      stop = set(self.sampler.stop_ids)
      stopped = {i: len(inputs[i]) > 0 and int(inputs[i][-1]) in stop for i in asked}
    if self.executor != "frozen_policy":  # the planner's cache gets what the row gets
      conv = self.sampler.append(params, conv, [list(turns[i]) + list(inputs.get(i, ()))
                                                for i in range(n)],
                                 self.exe_width + a.executor_tokens)
    texts = {}
    for i in asked:
      rec = records[i]
      t = rec["pieces"][-1][2]
      rec["pieces"] += [(np.asarray(turns[i], np.int32), False, t),
                        (np.asarray(inputs[i], np.int32), False, t)]
      rec["stopped"] = stopped.get(i, False)  # how the next observation opens
      texts[i] = tok.decode(inputs[i], skip_special_tokens=True).strip()
      rec["executor"].append((t, texts[i]))
    self.last["executor_s"] += time.perf_counter() - t0
    return conv, texts

  def verify(self, params, ref_vars, conv, asked, records, prompt_ids, active):
    """Asks the verifier about each row in `asked` (its last action was a tool call and it
    goes on); a Yes sets active[i] = False and records[i]['end'] = 'verifier'. Returns the
    conversation (its cache, when the policy peeked, moved to the new buffer)."""
    if not asked:
      return conv
    a, t0 = self.config.agent, time.perf_counter()
    if self.verifier == "server":
      replies, _ = self.client.complete([self.messages(records[i], a.verifier_prompt)
                                         for i in asked])
      self.last["verifier_missing"] += sum(r is None for r in replies)
      p_yes = np.array([float(r is not None and r.strip().lower().startswith(
          a.verifier_yes.lower())) for r in replies])
    else:
      question = [[] for _ in records]
      for i in asked:
        question[i] = self.turn_ids(records[i], a.verifier_prompt)
      if self.verifier == "frozen_policy":
        logp, conv = self.sampler.peek(params, conv, question, self.ver_width, self.yes_no)
      else:
        self._require(ref_vars)
        c = self.ref_sampler.begin(
            ref_vars, self._conversations(records, asked, prompt_ids, question), room=0)
        logp = self.ref_sampler.next_logprobs(ref_vars, c, self.yes_no)
      logp = logp[np.asarray(asked)].astype(np.float64)
      p_yes = 1.0 / (1.0 + np.exp(logp[:, 1] - logp[:, 0]))  # P(Yes) / (P(Yes) + P(No))
    for i, p in zip(asked, p_yes):
      records[i]["verifier"].append(float(p))
      if p > 0.5:
        active[i] = False
        records[i]["end"] = "verifier"
    self.last["verifier_s"] += time.perf_counter() - t0
    return conv

  def generate(self, params, ref_vars, conv, records, prompt_ids):
    """The generator's answer for every trajectory (all have ended): records[i]['answer'] and
    ['generator'] get its text, and its turn and answer join the row with loss mask 0."""
    a, tok, t0 = self.config.agent, self.tokenizer, time.perf_counter()
    n = len(records)
    turns = [self.turn_ids(rec, a.generator_prompt) for rec in records]
    if self.generator == "server":
      replies, _ = self.client.complete([self.messages(rec, a.generator_prompt)
                                         for rec in records])
      self.last["generator_missing"] += sum(r is None for r in replies)
      texts = [r or "" for r in replies]
      answers = [tok(t, add_special_tokens=False).input_ids[:a.generator_tokens] for t in texts]
    else:
      if self.generator == "frozen_policy":
        conv = self.sampler.append(params, conv, turns, self.gen_width)
        out, conv = self.sampler.extend(params, conv, None, max_tokens=a.generator_tokens,
                                        greedy=True)
      else:
        self._require(ref_vars)
        c = self.ref_sampler.begin(
            ref_vars, self._conversations(records, range(n), prompt_ids, turns),
            room=a.generator_tokens)
        out, _ = self.ref_sampler.extend(ref_vars, c, None, max_tokens=a.generator_tokens,
                                         greedy=True)
      ids, lengths = np.asarray(out["tokens"]), np.asarray(out["lengths"])
      answers = [ids[i, :lengths[i]] for i in range(n)]
      texts = tok.batch_decode(answers, skip_special_tokens=True)
    for rec, turn, answer, text in zip(records, turns, answers, texts):
      t = rec["pieces"][-1][2]
      rec["pieces"] += [(np.asarray(turn, np.int32), False, t),
                        (np.asarray(answer, np.int32), False, t)]
      rec["answer"] = rec["generator"] = text
    self.last["generator_s"] += time.perf_counter() - t0
    return conv

  def metrics(self, records) -> dict[str, float]:
    """How trajectories ended and what the roles cost (per trajectory unless a count)."""
    n = len(records)
    m = {f"agent/end/{e}_frac": sum(r["end"] == e for r in records) / n
         for e in ("answer", "verifier", "turns")}
    if self.verifier != "none":
      p = [x for r in records for x in r["verifier"]]
      m.update({"agent/verifier/calls/mean": len(p) / n,
                "agent/verifier/stops/mean": sum(r["end"] == "verifier" for r in records) / n,
                "agent/verifier/p_yes/mean": float(np.mean(p)) if p else 0.0,
                "agent/verifier/missing": self.last["verifier_missing"],
                "time/verifier_s": self.last["verifier_s"]})
    if self.executor != "none":
      calls = [len(r["executor"]) for r in records]
      m.update({"agent/executor/calls/mean": float(np.mean(calls)),
                "agent/executor/missing": self.last["executor_missing"],
                "time/executor_s": self.last["executor_s"]})
    if self.generator != "policy":
      m.update({"agent/generator/answer_tokens/mean": float(np.mean(
                    [len(r["pieces"][-1][0]) for r in records])),
                "agent/generator/missing": self.last["generator_missing"],
                "time/generator_s": self.last["generator_s"]})
    return m
