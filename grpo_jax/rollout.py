"""Rollouts: prompts → G sampled completions each → rewards, and the batch the train step takes.

    single = SingleTurn(config, tokenizer, sampler)       # or grpo_jax.agent.rollout.Agent
    part, reward_m, sampler_m, (t_sample, t_reward) = single.sample(variables, rows, rewards, key)
    rollout_batch = part.train_batch(config, pad_id)
    accuracy = single.evaluate(variables, eval_rows, accuracy_reward(config))

The one rollout interface (SingleTurn here, the multi-turn Agent in grpo_jax.agent.rollout),
where `variables` is what the sampler runs, model.apply's variables (policy.Policy.sampled:
{'params': params}, or a LoRA policy's), and ref_params the frozen reference params:
  sample(variables, rows, rewards, key, ref_params=None) -> (Rollouts, reward metrics, sampler
      or agent metrics, (seconds sampling, seconds scoring))
  evaluate(variables, rows, reward, ref_params=None) -> greedy pass@1
  sft_examples(rows) -> (prompt ids, completion ids, loss masks or None): the warm start's data
  batch_layout(rows, num_rewards) -> the likely train batch's layout, or None
  completion_width, max_turns: what the train step's spec takes from it

Host side only: strings (templating, decoding, reward parsing) live here; the device sees the
padded integer arrays of `Rollouts.device_batch`, uploaded once.

With several processes (grpo_jax.hosts), each samples and scores its own share of the rows, and
`sample_and_score` returns the whole batch's Rollouts on every process.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from grpo_jax import config as config_lib, data, grpo, hosts, sft
from grpo_jax.rewards import Interrupted, build_rewards, merge_metrics, score


@dataclasses.dataclass
class Prompts:
  """One batch of prompts: the chat-templated texts and their token ids (unpadded: the sampler
  and Rollouts.device_batch pad them, both with data.pad_to_bucket)."""
  texts: list[str]
  ids: list[list[int]]


def prompt_settings(config) -> tuple:
  """What prompt_texts reads of a run's config: runs that agree on it and on their tokenizer
  and rows have the same Prompts."""
  return config.data.system_prompt, config.data.user_template


def prompt_texts(config, tokenizer, rows) -> list[str]:
  system_prompt, user_template = prompt_settings(config)
  return [data.build_prompt(tokenizer, r["question"], system_prompt, user_template)
          for r in rows]


def reward_columns(rows, g):
  """The dataset columns rewards see, each row repeated for its G completions."""
  return {"answer": [r["answer"] for r in rows for _ in range(g)],
          "question": [r["question"] for r in rows for _ in range(g)]}


def encode(config, tokenizer, rows) -> Prompts:
  texts = prompt_texts(config, tokenizer, rows)
  return Prompts(texts, data.encode_prompts(tokenizer, texts))


@dataclasses.dataclass
class Rollouts:
  """G sampled completions per prompt and their rewards, group-major (rows [p·G, (p+1)·G) are
  prompt p's). `pool` concatenates rounds; `take` keeps whole groups, in the order given.
  Multi-turn rollouts (grpo_jax.agent) add a loss mask (actions 1, observations 0), each
  token's turn, and each trajectory's text."""
  rows: list[dict]                # per prompt: the dataset row
  prompts: list[str]              # per prompt: chat-templated text
  prompt_ids: list[list[int]]     # per prompt: token ids, unpadded
  completion_ids_BC: np.ndarray   # per completion from here on
  lengths_B: np.ndarray
  truncated_B: np.ndarray
  texts: list[str]
  reward_BR: np.ndarray
  loss_mask_BC: np.ndarray | None = None
  turn_ids_BC: np.ndarray | None = None
  trajectories: list[str] | None = None
  # The sampler's log-prob of each sampled token (0 past lengths): the train step's drift/*
  # metrics and rollout correction compare it with its own. None from multi-turn rollouts.
  sampler_logp_BC: np.ndarray | None = None
  # True one step behind (train.off_policy_steps=1): the sampler's log-probs are also the
  # update's behaviour policy, the train batch's old_logp_BC.
  behind: bool = False

  PER_PROMPT = ("rows", "prompts", "prompt_ids")
  WHOLE = ("behind",)  # of the batch, not per row: pool and take keep it

  @staticmethod
  def pool(parts: list[Rollouts]) -> Rollouts:
    def join(values):
      if values[0] is None or isinstance(values[0], bool):  # WHOLE: the first part's
        return values[0]
      return sum(values, []) if isinstance(values[0], list) else np.concatenate(values)
    return Rollouts(*[join([getattr(p, f.name) for p in parts])
                      for f in dataclasses.fields(Rollouts)])

  def take(self, groups, g: int) -> Rollouts:
    rows_B = [p * g + j for p in groups for j in range(g)]

    def pick(name):
      value, index = getattr(self, name), groups if name in self.PER_PROMPT else rows_B
      if value is None or name in self.WHOLE:
        return value
      return [value[i] for i in index] if isinstance(value, list) else value[index]
    return Rollouts(*[pick(f.name) for f in dataclasses.fields(Rollouts)])

  def device_batch(self, pad_id: int, *, buckets, multiple: int,
                   with_truncated: bool) -> dict[str, np.ndarray]:
    """The train step's rollout layout (train_step.py), padded to this batch's real lengths:
    prompts to the smallest bucket that holds the longest, completions to the longest rounded
    up to `multiple` (a completion row never needs more than its sampled width)."""
    prompt_NP, pmask_NP = data.pad_to_bucket(self.prompt_ids, buckets, pad_id)
    c = data.padded_width(int(self.lengths_B.max()), multiple, self.completion_ids_BC.shape[1])
    batch = {  # each prompt once, for its group: the step repeats it where rows need it
        "prompt_NP": prompt_NP,
        "prompt_mask_NP": pmask_NP.astype(np.int32),
        "completion_BC": np.ascontiguousarray(self.completion_ids_BC[:, :c], np.int32),
        "lengths_B": self.lengths_B.astype(np.int32),
        "rewards_BR": self.reward_BR.astype(np.float32),
    }
    if with_truncated:
      batch["truncated_B"] = self.truncated_B.astype(bool)
    if self.loss_mask_BC is not None:
      batch["loss_mask_BC"] = np.ascontiguousarray(self.loss_mask_BC[:, :c], np.int32)
      batch["turn_ids_BC"] = np.ascontiguousarray(self.turn_ids_BC[:, :c], np.int32)
    if self.sampler_logp_BC is not None:
      batch["sampler_logp_BC"] = np.ascontiguousarray(self.sampler_logp_BC[:, :c], np.float32)
    if self.behind:
      batch["old_logp_BC"] = batch["sampler_logp_BC"]
    return batch

  def train_batch(self, config, pad_id: int) -> dict[str, np.ndarray]:
    """device_batch with a run's settings: data.prompt_buckets, train.pad_multiple,
    loss.mask_truncated_completions."""
    return self.device_batch(pad_id, buckets=config.data.prompt_buckets,
                             multiple=config.train.pad_multiple,
                             with_truncated=config.loss.mask_truncated_completions)


class SingleTurn:
  """The single-turn rollout: G completions per prompt from one prefill (the module docstring
  lists the interface it shares with grpo_jax.agent.rollout.Agent)."""

  max_turns = None  # one turn: flow_grpo's per-turn weights do not apply

  def __init__(self, config, tokenizer, sampler):
    self.config, self.tokenizer, self.sampler = config, tokenizer, sampler
    self.completion_width = config.sampling.max_new_tokens

  def sample(self, params, rows, rewards, key, ref_params=None):
    del ref_params  # single-turn rollouts have no frozen role
    return sample_and_score(self.config, self.sampler, self.tokenizer, params, rows, rewards,
                            key)

  def evaluate(self, params, rows, reward, ref_params=None) -> float:
    del ref_params
    return evaluate(self.config, self.sampler, self.tokenizer, params, rows, reward)

  def sft_examples(self, rows):
    """(prompt ids, completion ids, None): the reference solutions, every token trained on."""
    tok = self.tokenizer
    prompts = data.encode_prompts(tok, prompt_texts(self.config, tok, rows))
    stop = tok.convert_tokens_to_ids(tok.eos_token)
    completions = [tok(sft.reference_completion(r["answer"]), add_special_tokens=False).input_ids
                   + [stop] for r in rows]
    return prompts, completions, None

  def batch_layout(self, rows, num_rewards: int):
    return batch_layout(self.config, self.tokenizer, rows, num_rewards)


def batch_layout(config, tokenizer, rows, num_rewards: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The layout (shapes, dtypes) of the train batch that single-turn rollouts of `rows` give
  when their longest completion runs to sampling.max_new_tokens: what a run's first step
  compiles for while it samples (train_step.TrainStep.precompile)."""
  prompts, g = encode(config, tokenizer, rows), config_lib.group_size(config)
  b, width = len(rows) * g, config.sampling.max_new_tokens
  longest = Rollouts(rows, prompts.texts, prompts.ids, np.zeros((b, width), np.int32),
                     np.full(b, width), np.ones(b, bool), [""] * b,
                     np.zeros((b, num_rewards), np.float32),
                     sampler_logp_BC=np.zeros((b, width), np.float32))
  batch = longest.train_batch(config, tokenizer.pad_token_id)
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}


def sample_and_score(config, sampler, tokenizer, params, rows, rewards, key):
  """Samples G completions for each row and scores them. Returns (Rollouts, reward metrics,
  sampler metrics, (seconds sampling, seconds scoring))."""
  t0 = time.perf_counter()
  mine = hosts.share(len(rows))  # all rows with one process
  rows = rows[mine]
  prompts = encode(config, tokenizer, rows)
  out = sampler.generate(params, prompts.ids, num_samples=config_lib.group_size(config),
                         key=key, prompt_ids=np.arange(mine.start, mine.stop))
  if hosts.count() == 1:
    return score_samples(config, tokenizer, rows, prompts, out, rewards, t0)
  # A reward interrupted on one process (SIGTERM while it waited on its scorer) must not leave
  # the others waiting in the gather: every process says whether it was, and all raise.
  # (hosts.SharedEvents, set up by the loop, interrupts a process still waiting on its own
  # scorer, so it gets here within a poll.)
  interrupted = None
  try:
    part, reward_m, sampler_m, times = score_samples(config, tokenizer, rows, prompts, out,
                                                     rewards, t0)
  except Interrupted as e:
    interrupted = e
  if hosts.any_(interrupted is not None):
    raise interrupted or Interrupted("another process's reward was interrupted")
  part, reward_m = _gather(part, reward_m, rewards)
  # The sampler counted this process's rows over the whole program's time: the rate is all
  # processes' tokens over that time.
  tokens = float(np.sum(part.lengths_B))
  sampler_m = dict(sampler_m, **{"sampler/tokens_per_s": tokens / sampler_m["sampler/seconds"]})
  if sampler_m.get("sampler/row_steps"):  # the program's row-steps cover every process's rows
    sampler_m["sampler/row_steps_wasted"] = 1.0 - tokens / sampler_m["sampler/row_steps"]
  return part, reward_m, sampler_m, times


def _gather(part: Rollouts, reward_m, rewards):
  """Every process's Rollouts joined in process order, on every process, with the reward
  metrics of the whole batch. The arrays travel as arrays, the strings as JSON."""
  arrays = [f.name for f in dataclasses.fields(Rollouts)
            if isinstance(getattr(part, f.name), np.ndarray)]
  texts = hosts.gather_json({f.name: getattr(part, f.name) for f in dataclasses.fields(Rollouts)
                             if f.name not in arrays})
  gathered = {name: hosts.gather(getattr(part, name)) for name in arrays}
  n = len(part.lengths_B)
  parts = [Rollouts(**t, **{k: v[i * n:(i + 1) * n] for k, v in gathered.items()})
           for i, t in enumerate(texts)]
  whole = Rollouts.pool(parts)
  return whole, merge_metrics(rewards, whole.reward_BR, hosts.gather_json(reward_m))


def score_samples(config, tokenizer, rows, prompts, out, rewards, t0):
  """sample_and_score's second half: the sampler's output (anything with tokens, lengths,
  truncated, metrics) decoded and scored; t0 is when sampling began."""
  g = config_lib.group_size(config)
  completion_ids, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  t1 = time.perf_counter()
  texts = tokenizer.batch_decode([ids[:n] for ids, n in zip(completion_ids, lengths)],
                                 skip_special_tokens=True)
  prompt_texts_B = [p for p in prompts.texts for _ in range(g)]
  reward_BR, reward_metrics = score(rewards, prompt_texts_B, texts, g, reward_columns(rows, g))
  part = Rollouts(list(rows), prompts.texts, prompts.ids, completion_ids, lengths,
                  np.asarray(out.truncated), texts, reward_BR,
                  sampler_logp_BC=np.asarray(out.logprobs, np.float32),
                  behind=bool(config.train.off_policy_steps))
  return part, reward_metrics, out.metrics, (t1 - t0, time.perf_counter() - t1)


# One compiled program each, not ~20 eager ops each compiled on first use (~0.5 s) and
# dispatched every round.
_informative_groups = jax.jit(grpo.informative_groups, static_argnums=(1, 3))
_weighted_total = jax.jit(grpo.weighted_total, static_argnums=(3,))


class Collection:
  """The rollouts of one GRPO step, gathered in rounds: while wants_round(), the caller samples
  and scores train.prompts_per_step rows with round_key(key) (sample_and_score, or the agent's)
  and add()s them; result() gives (Rollouts of the batch, metrics). A state machine, so that a
  caller can drive several at once (train.Trainer.group_step samples a round for every member
  of a sweep that wants one).

  With train.dynamic_sampling (DAPO), groups whose G rewards are all equal (zero advantage:
  they teach nothing) are set aside and further prompts sampled, up to
  train.max_sampling_rounds rounds in all; a batch still short of prompts_per_step informative
  groups is completed with set-aside groups, so the train step's row count never changes.
  Reward and completion metrics describe the first round, an unbiased sample of the policy.
  """

  def __init__(self, config):
    cfg = self.config = config
    self.g, self.n = config_lib.group_size(cfg), cfg.train.prompts_per_step
    self.weights_R = np.asarray(cfg.rewards.weights, np.float32)
    self.rounds = cfg.train.max_sampling_rounds if cfg.train.dynamic_sampling else 1
    self.m = {"time/sample_s": 0.0, "time/reward_s": 0.0}
    self.parts, self.informative, self.done = [], [], False

  def wants_round(self) -> bool:
    return not self.done

  def round_key(self, key):
    """The key of the next round: the step's key, then fold_in(key, r)."""
    r = len(self.parts)
    return key if r == 0 else jax.random.fold_in(key, r)

  def add(self, part, part_metrics, sampler_metrics, times):
    cfg, m = self.config, self.m
    t_sample, t_reward = times
    m["time/sample_s"] += t_sample
    m["time/reward_s"] += t_reward
    if not self.parts:
      m.update(part_metrics)
      m.update(sampler_metrics)
    self.parts.append(part)
    if not cfg.train.dynamic_sampling:  # one round; informative groups are not needed
      self.done = True
      return
    self.informative.append(np.asarray(_informative_groups(
        part.reward_BR, self.g, self.weights_R, cfg.loss.reward_aggregation)))
    self.done = (len(self.parts) >= self.rounds
                 or np.concatenate(self.informative).sum() >= self.n)

  def result(self):
    cfg, m, g, n = self.config, self.m, self.g, self.n
    first, pool = self.parts[0], Rollouts.pool(self.parts)
    if cfg.train.dynamic_sampling:
      informative = np.concatenate(self.informative)
      m["sampling/rounds"] = len(self.parts)
      m["sampling/informative_frac_first_round"] = float(informative[:n].mean())
      m["sampling/filled_groups"] = int(max(0, n - informative.sum()))
      order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])
      pool = pool.take(order[:n], g)
    # The weighted total the advantages see (a missing component counts as its group's mean),
    # over the rows with any reward.
    present = ~np.all(np.isnan(first.reward_BR), axis=1)
    total = np.asarray(_weighted_total(first.reward_BR, ~np.isnan(first.reward_BR),
                                       self.weights_R, g))[present]
    m.update({
        "reward/total/mean": float(total.mean()) if total.size else float("nan"),
        "reward/total/std": float(total.std()) if total.size else float("nan"),
        "completion/mean_length": float(first.lengths_B.mean()),
        "completion/max_length": int(first.lengths_B.max()),
        "completion/truncated_frac": float(first.truncated_B.mean()),
    })
    return pool, m


def accuracy_reward(config):
  """The run's math_accuracy reward (its configured options), whether or not it is trained on."""
  cfg = config.rewards.copy_and_resolve_references()
  cfg.names, cfg.weights = ("math_accuracy",), (1.0,)
  return build_rewards(cfg)[0]


def evaluate(config, sampler, tokenizer, params, rows, reward=None) -> float:
  """Greedy pass@1 on `rows`, scored by the run's math_accuracy reward."""
  reward = reward or accuracy_reward(config)
  correct = 0
  bs = config.train.eval_batch_size
  for i in range(0, len(rows), bs):
    chunk = rows[i:i + bs]
    # With several processes each takes a share; a process left without a row decodes a copy
    # of the first and counts nothing.
    mine = chunk[hosts.share(len(chunk), even=False)]
    prompts = encode(config, tokenizer, mine or chunk[:1])
    out = sampler.generate(params, prompts.ids, num_samples=1, greedy=True)
    ids, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = tokenizer.batch_decode([t[:n] for t, n in zip(ids, lengths)],
                                   skip_special_tokens=True)
    scores = reward.fn(prompts.texts, texts, group_size=1, **reward_columns(mine or chunk[:1], 1))
    correct += sum(s == 1.0 for s in scores) if mine else 0
  return int(hosts.gather(np.asarray([correct])).sum()) / max(len(rows), 1)
