"""Multi-turn sampling with the KV cache carried across turns, against re-reading the whole
conversation: the carried cache (with the holes rows leave after stopping early) must give the
same next turn as a fresh prefill of the compacted conversation, and the same log-probs as the
train step's forward over the trajectory row the rollout builds."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import config as config_lib, sampler as sampler_lib
from grpo_jax.models import qwen

VOCAB, PAD = 96, 0
CFG = qwen.QwenConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                      tie_word_embeddings=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def params():
  p = qwen.init_params(CFG, jax.random.key(3), jnp.float32)
  # A larger head scale gives peaked distributions: no near-ties to flip a greedy argmax.
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


def _sampler(stop_ids=(), cfg=CFG, **kw):
  return sampler_lib.Sampler(cfg, max_new_tokens=6, stop_ids=stop_ids, buckets=(8, 16, 32, 64),
                             pad_id=PAD, **kw)


@pytest.mark.parametrize("decode_attention", ["xla", "pallas"])
def test_carried_cache_equals_reprefilling_the_conversation(params, decode_attention):
  """With either decode attention: the fused kernel (run here by Pallas's interpreter) reads the
  carried cache's holes through its mask."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (5, 3)]
  g, turns, action = 2, 3, 6
  # Stop ids taken from the greedy continuations, so rows stop early and leave holes.
  probe = np.asarray(_sampler().generate({"params": params}, prompts, greedy=True).tokens)
  cfg = CFG.with_run(decode_attention=decode_attention)
  s = _sampler(stop_ids=[int(probe[0, 2]), int(probe[1, 1])], cfg=cfg)
  conv = s.begin({"params": params}, prompts, num_samples=g, room=turns * (action + 5))
  history = [list(prompts[i // g]) for i in range(len(prompts) * g)]
  key, early = jax.random.key(0), 0
  for t in range(turns):
    out, conv = s.extend({"params": params}, conv, key, max_tokens=action, greedy=True)
    tokens, lengths = np.asarray(out["tokens"]), np.asarray(out["lengths"])
    early += int((lengths < action).sum())
    # The same turn from scratch: every row's whole conversation as a fresh prompt.
    for r, h in enumerate(history):
      ref = s.generate({"params": params}, [h], num_samples=1, greedy=True)
      n = int(np.asarray(ref.lengths)[0])
      want = np.asarray(ref.tokens)[0, :min(n, action)]
      np.testing.assert_array_equal(tokens[r, :lengths[r]], want, err_msg=f"turn {t} row {r}")
      np.testing.assert_allclose(np.asarray(out["logprobs"])[r, :lengths[r]],
                                 np.asarray(ref.logprobs)[0, :len(want)], atol=2e-5, rtol=0)
      h.extend(tokens[r, :lengths[r]].tolist())
    # Observations of different lengths, one of them empty.
    obs = [rng.integers(1, VOCAB, n).tolist() for n in (3, 0, 5, 1)]
    conv = s.append({"params": params}, conv, obs, width=5)
    for h, o in zip(history, obs):
      h.extend(o)
  assert early >= 2, "no row stopped early: the test would not exercise the cache's holes"


def tiny_agent_inputs(workdir, rows, **agent):
  """The tiny agent preset (agent settings overridden) with rows = (train, test) synthetic
  problems: (config, model config, random params, train rows, tokenizer, its Sampler)."""
  from configs import gsm8k_agent
  from grpo_jax import inputs

  config = gsm8k_agent.get_config("tiny")
  config.agent.update(**agent)
  config.data.synthetic_train, config.data.synthetic_test = rows
  train_rows, _ = inputs.datasets(config, workdir)
  tok, stop_ids = inputs.tokenizer(config, workdir, train_rows)
  cfg, _ = inputs.model_config(config, tok)
  params = qwen.init_params(cfg, jax.random.key(0), jnp.float32)
  s = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=8, stop_ids=stop_ids,
                          buckets=config.data.prompt_buckets, pad_id=tok.pad_token_id,
                          valid_vocab_size=len(tok))
  return config, cfg, params, train_rows, tok, s


@pytest.fixture(scope="module")
def tiny_agent(tmp_path_factory):
  """The tiny agent preset's pieces: data, tokenizer, a random model and its Agent."""
  from grpo_jax.agent import rollout as agent_rollout

  config, cfg, params, train_rows, tok, s = tiny_agent_inputs(
      str(tmp_path_factory.mktemp("agent")), rows=(200, 20), max_turns=3)
  return config, cfg, params, train_rows, agent_rollout.Agent(config, tok, s)


def test_trajectory_rows_give_the_sampler_logprobs_to_the_train_step(tiny_agent):
  """The compacted trajectory row (no holes, observations in between) is what the sampler saw:
  the train step's log-probs of its action tokens equal the sampler's, turn by turn."""
  config, cfg, params, rows, agent = tiny_agent
  g = 2
  prompts, records, _, _ = agent.run({"params": params}, rows[:4], g, jax.random.key(7))
  batch = assert_rows_give_sampler_logprobs(agent, cfg, params, prompts, rows[:4], records,
                                            config.data.prompt_buckets)
  c = batch["completion_BC"].shape[1]
  for r, rec in enumerate(records):
    mask = batch["loss_mask_BC"][r].astype(bool)
    # The observations between the actions are exactly the tokens the sampler was fed.
    pieces = [ids for ids, is_action, _ in rec["pieces"] if not is_action]
    fed = batch["completion_BC"][r][~mask[:c] & (np.arange(c) < batch["lengths_B"][r])]
    np.testing.assert_array_equal(fed, np.concatenate(pieces) if pieces else fed[:0])


def assert_rows_give_sampler_logprobs(agent, cfg, params, prompts, rows, records, buckets):
  """The trajectories' train rows: every action token's log-prob from the train step's forward
  equals the sampler's, turn by turn, and only action tokens are trained. Returns the batch."""
  from grpo_jax import sharding, train_step

  part = agent.rollouts(prompts, rows, records, np.zeros((len(records), 1), np.float32))
  batch = part.device_batch(agent.tokenizer.pad_token_id, buckets=buckets, multiple=16,
                            with_truncated=False)
  c = batch["completion_BC"].shape[1]
  g = len(batch["lengths_B"]) // len(batch["prompt_NP"])  # the rollout's prompts, once a group
  tokens = np.concatenate([np.repeat(batch["prompt_NP"], g, 0), batch["completion_BC"]], 1)
  attn = np.concatenate([np.repeat(batch["prompt_mask_NP"], g, 0),
                         (np.arange(c)[None] < batch["lengths_B"][:, None]).astype(np.int32)], 1)
  optim = config_lib.optim()
  optim.compute_dtype, optim.remat = "float32", False
  fn = train_step.make_logprob_fn(cfg, optim, sharding.make_mesh((1, 1, 1)),
                                  valid_vocab_size=len(agent.tokenizer))
  logp = np.asarray(fn(params, tokens, attn, c))
  for r, rec in enumerate(records):
    mask, turns = batch["loss_mask_BC"][r].astype(bool), batch["turn_ids_BC"][r]
    assert mask.sum() == sum(len(x) for x in rec["logp"])
    for t, sampled in enumerate(rec["logp"]):
      np.testing.assert_allclose(logp[r][mask & (turns == t)], sampled, atol=5e-5, rtol=0,
                                 err_msg=f"row {r} turn {t}")
  return batch
