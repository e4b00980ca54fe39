"""Multi-turn sampling with the KV cache carried across turns, against re-reading the whole
conversation: the carried cache (with the holes rows leave after stopping early) must give the
same next turn as a fresh prefill of the compacted conversation, and the same log-probs as the
train step's forward over the trajectory row the rollout builds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import sampler as sampler_lib
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


def _sampler(stop_ids=(), **kw):
  return sampler_lib.Sampler(CFG, max_new_tokens=6, stop_ids=stop_ids, buckets=(8, 16, 32, 64),
                             pad_id=PAD, **kw)


def test_carried_cache_equals_reprefilling_the_conversation(params):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, VOCAB, n).tolist() for n in (5, 3)]
  g, turns, action = 2, 3, 6
  # Stop ids taken from the greedy continuations, so rows stop early and leave holes.
  probe = np.asarray(_sampler().generate(params, prompts, greedy=True).tokens)
  s = _sampler(stop_ids=[int(probe[0, 2]), int(probe[1, 1])])
  conv = s.begin(params, prompts, num_samples=g, room=turns * (action + 5))
  history = [list(prompts[i // g]) for i in range(len(prompts) * g)]
  key, early = jax.random.key(0), 0
  for t in range(turns):
    out, conv = s.extend(params, conv, key, max_tokens=action, greedy=True)
    tokens, lengths = np.asarray(out["tokens"]), np.asarray(out["lengths"])
    early += int((lengths < action).sum())
    # The same turn from scratch: every row's whole conversation as a fresh prompt.
    for r, h in enumerate(history):
      ref = s.generate(params, [h], num_samples=1, greedy=True)
      n = int(np.asarray(ref.lengths)[0])
      want = np.asarray(ref.tokens)[0, :min(n, action)]
      np.testing.assert_array_equal(tokens[r, :lengths[r]], want, err_msg=f"turn {t} row {r}")
      np.testing.assert_allclose(np.asarray(out["logprobs"])[r, :lengths[r]],
                                 np.asarray(ref.logprobs)[0, :len(want)], atol=2e-5, rtol=0)
      h.extend(tokens[r, :lengths[r]].tolist())
    # Observations of different lengths, one of them empty.
    obs = [rng.integers(1, VOCAB, n).tolist() for n in (3, 0, 5, 1)]
    conv = s.append(params, conv, obs, width=5)
    for h, o in zip(history, obs):
      h.extend(o)
  assert early >= 2, "no row stopped early: the test would not exercise the cache's holes"
