"""One step behind (train.off_policy_steps=1): a run's next rollouts are sampled before this
step's update, and its rewards are scored on a host thread while the device works.

    pipe = pipeline.Pipeline(run, trainer, start)     # one run (K = 1), single-turn or agent
    group, metrics_K, samples_K = pipe.step(group, step, steps)
    pipe.held                                         # the Flight a checkpoint of now includes
    pipe.close()

Step t (0-based; S = sampling on the device, R = scoring on the host, U = the update):

    main thread:    S[t+1] with the params before U[t] ──> wait for R[t] ──> U[t] ──> metrics
    scoring thread: R[t] (since S[t] ended) ──────────────> R[t+1] (during U[t] and S[t+2])

So the device runs S[t+1], U[t], S[t+2], ... back to back while the host scores (a judge over
HTTP, embeddings, tools), and a step takes about max(S + U, R) instead of S + R + U. Step t's
batch was sampled with the params before U[t-1]: one update stale (async/staleness 1); the
first step of a process with no batch in flight samples its own, with the params it then
updates (staleness 0). Nothing is sampled from older params. The update takes the sampler's
log-probs as the behaviour policy (batch['old_logp_BC']): the loss's clipped ratio
π_θ / π_sampler corrects for the staleness (docs/loss.md, "One step behind"); clip/region_frac
and ratio/mean, min, max show how much it corrects.

Every random draw is the sequential loop's: step t's rollouts use fold_in(key(seed), t) and the
data order's next rows, so the batch in flight is a function of the checkpointed state. A
checkpoint of step t holds the batch drawn for step t + 1 (Flight.to_json: its tokens,
log-probs and rows; the data position saved beside it is past them) and a resume scores it
again, so a resumed run is bitwise the uninterrupted one. With dynamic sampling the flight is a
step's first round; its further rounds are sampled after it is scored, with the params the
update starts from. The scoring thread's errors reach the main thread when it
waits for them: a failing scorer stops the run as in the sequential loop, and a signal
(rewards.Interrupted) drops the step as it does there.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from grpo_jax import config as config_lib, members as members_lib, rollout, sharding

# The sampler's per-row arrays a Flight keeps, and their dtypes (an agent's: its trajectories,
# agent.rollout.Agent.arrays).
ARRAYS = {"tokens": np.int32, "lengths": np.int32, "truncated": np.bool_,
          "logprobs": np.float32, "completion": np.int32, "loss_mask": np.int32,
          "turn_ids": np.int32, "sampler_logp": np.float32}
SAMPLED = ("tokens", "lengths", "truncated", "logprobs")  # a single-turn round's


@dataclasses.dataclass
class Flight:
  """The first round of one step's rollouts, sampled and maybe not yet scored (B = prompts × G
  rows): arrays tokens [B, C], lengths [B], truncated [B], logprobs [B, C] (host numpy); the
  rows' dataset indices; the sampler's metrics and seconds; whether the params that sampled it
  are older than those it updates (staleness 0 or 1). An agent's (agent.enabled): its
  trajectories' arrays (Agent.arrays), and in `extra` their answers' and trajectories' texts."""
  step: int
  staleness: int
  indices: list
  arrays: dict
  metrics: dict
  sample_s: float
  prompts: rollout.Prompts | None = None  # rebuilt from the rows after a resume
  scored: concurrent.futures.Future | None = None
  extra: dict | None = None  # JSON: an agent's texts

  def to_json(self) -> dict:
    """What a checkpoint keeps: the arrays' bytes in base64 (exact), the rest as is."""
    arrays = {name: {"shape": list(a.shape), "data": base64.b64encode(
        np.ascontiguousarray(a, ARRAYS[name]).tobytes()).decode()}
              for name, a in self.arrays.items()}
    return {"step": self.step, "staleness": self.staleness, "indices": self.indices,
            "arrays": arrays, "metrics": self.metrics, "sample_s": self.sample_s,
            "extra": self.extra}

  @staticmethod
  def from_json(d: dict) -> Flight:
    arrays = {name: np.frombuffer(base64.b64decode(a["data"]), ARRAYS[name]).reshape(a["shape"])
              for name, a in d["arrays"].items()}
    return Flight(int(d["step"]), int(d["staleness"]), [int(i) for i in d["indices"]], arrays,
                  dict(d["metrics"]), float(d["sample_s"]), extra=d.get("extra"))


class Pipeline:
  """The pipelined steps of one run: the Flight in hand and the scoring thread."""

  def __init__(self, run, trainer, start: int, sample_mesh=None):
    """start: the step the run resumes from (its checkpoint's batch in flight is start's).
    sample_mesh (train.sample_devices): the devices a step's first round is sampled on, apart
    from the train mesh; None: the trainer's sampler, on the train mesh."""
    self.run, self.trainer = run, trainer
    self.config = trainer.config
    self.sample_mesh = sample_mesh
    self.sampler = trainer.sampler if sample_mesh is None else trainer.sampler_on(sample_mesh)
    self.transfer_s = 0.0  # this step's param copies to the sampling mesh
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo_jax-score")
    self.held = None  # the Flight of the next step to train (what a checkpoint includes)
    if run.in_flight is not None and int(run.in_flight["step"]) == start:
      self.held = Flight.from_json(run.in_flight)

  def in_flight(self) -> dict | None:
    """The checkpoint's part: the batch sampled for the next step, or None."""
    return None if self.held is None else self.held.to_json()

  def step(self, group, step: int, steps: int):
    """GRPO step step + 1 (members.group_step's result for this run): samples step + 1's
    first round (unless step + 1 is the last), then trains on step's rollouts."""
    flight = self.held
    if flight is None or flight.step != step:  # nothing in flight: sample it now, on-policy
      flight = self.held = self._draw(group, step, staleness=0)
    self._score(flight)
    ahead = self._draw(group, step + 1, staleness=1) if step + 1 < steps else None
    if ahead is not None:
      self._score(ahead)
    result, wait_s = _wait(flight)
    pool, m = self._collect(group, step, result)
    t0 = time.perf_counter()
    batch = pool.train_batch(self.config, self.trainer.tokenizer.pad_token_id)
    group, ms, samples = members_lib.update([self.trainer], group, [pool], [m], [batch],
                                            [self.run.setup.rewards], t0)
    ms[0].update({"async/staleness": flight.staleness, "time/reward_wait_s": wait_s})
    if self.sample_mesh is not None:
      ms[0]["time/param_transfer_s"], self.transfer_s = self.transfer_s, 0.0
    self.held = ahead
    return group, ms, samples

  def _collect(self, group, step: int, first):
    """The step's Collection from its flight's scored round; dynamic sampling's further rounds
    are sampled and scored here, with the params the update starts from (staleness 0 rows)."""
    t, coll = self.trainer, rollout.Collection(self.config)
    coll.add(*first)
    key = jax.random.fold_in(jax.random.key(self.config.seed), step)
    while coll.wants_round():
      coll.add(*t.rollout.sample(t.policy(group.state["params"], group.ref),
                                 self.run.next_rows(), self.run.setup.rewards,
                                 coll.round_key(key), ref_params=group.ref))
    return coll.result()

  def _draw(self, group, step: int, staleness: int) -> Flight:
    """Samples step's first round with the group's params as they are now (blocks until the
    device is done: the params may be donated to the update next)."""
    c, t = self.config, self.trainer
    indices = [int(i) for i in self.run.it.next_indices()]
    rows = [self.run.setup.train_rows[i] for i in indices]
    if t.step_fn.num_traces == 0:  # the first update compiles while this samples
      members_lib.compile_ahead([t], group, [rows], len(self.run.setup.rewards),
                                behaviour_logp=True)
    t0 = time.perf_counter()
    key = jax.random.fold_in(jax.random.key(c.seed), step)  # the sequential loop's round key
    variables = t.policy(group.state["params"], group.ref)
    if c.agent.enabled:  # whole trajectories: the tool calls run here, between the turns
      prompts, arrays, extra, m, sample_s = t.rollout.draw(variables, rows, key, group.ref)
      return Flight(step, staleness, indices, arrays, m, sample_s, prompts, extra=extra)
    prompts = rollout.encode(c, t.tokenizer, rows)
    if self.sample_mesh is not None:
      t1 = time.perf_counter()
      variables = move(variables, self.sample_mesh)
      self.transfer_s += time.perf_counter() - t1
    out = self.sampler.generate(variables, prompts.ids,
                                     num_samples=config_lib.group_size(c), key=key,
                                     prompt_ids=np.arange(len(rows)))
    arrays = {name: np.asarray(getattr(out, name), ARRAYS[name]) for name in SAMPLED}
    return Flight(step, staleness, indices, arrays, dict(out.metrics),
                  time.perf_counter() - t0, prompts)

  def _score(self, flight: Flight) -> None:
    """Starts scoring the flight on the scoring thread (once)."""
    if flight.scored is not None:
      return
    c, t, setup = self.config, self.trainer, self.run.setup
    rows = [setup.train_rows[i] for i in flight.indices]
    # Encoded here: the main thread's tokenizer calls never overlap the thread's encoding.
    if c.agent.enabled:
      prompts = flight.prompts or t.rollout.prompts(rows)
      flight.scored = self.pool.submit(t.rollout.score_drawn, rows, prompts, flight.arrays,
                                       flight.extra, flight.metrics, flight.sample_s,
                                       setup.rewards)
      return
    prompts = flight.prompts or rollout.encode(c, t.tokenizer, rows)

    def score():
      out = _Sampled(**flight.arrays, metrics=flight.metrics)
      part, reward_m, sampler_m, (_, reward_s) = rollout.score_samples(
          c, t.tokenizer, rows, prompts, out, setup.rewards, time.perf_counter())
      return part, reward_m, sampler_m, (flight.sample_s, reward_s)
    flight.scored = self.pool.submit(score)

  def close(self) -> None:
    """Ends the scoring thread: a scoring still under way (the loop stopped on an error or a
    signal) is told to give up, as a signal tells it (rewards.Interrupted)."""
    if self.held is not None and self.held.scored is not None and not self.held.scored.done():
      self.run.setup.interrupt.set()
    self.pool.shutdown(wait=True, cancel_futures=True)


def move(variables, mesh):
  """The sampled variables (on the train mesh) copied to the sampling mesh, once the copy is
  done (the next update may donate the originals)."""
  return jax.block_until_ready(jax.device_put(variables, sharding.moved_shardings(variables,
                                                                                   mesh)))


def _wait(flight: Flight):
  """(the flight's scored rollouts, seconds waited); raises the scorer's errors (Interrupted:
  a signal)."""
  t0 = time.perf_counter()
  result = flight.scored.result()
  return result, time.perf_counter() - t0


@dataclasses.dataclass
class _Sampled:
  """What rollout.score_samples reads of a sampler's output."""
  tokens: np.ndarray
  lengths: np.ndarray
  truncated: np.ndarray
  logprobs: np.ndarray
  metrics: dict
