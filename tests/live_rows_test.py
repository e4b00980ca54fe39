"""The sampler's compacting decode (Sampler compact_rows): finished rows leave the work.

Against the one-width loop (compact_rows=False) on the same key: the same tokens, lengths,
truncation and (within rounding) log-probs, greedy and sampled, rows stopping by a stop id or
by their own budget. Against a NumPy count of the row-steps the level rule computes on
benchmarks/lengths.py's long-tailed lengths: the device computes exactly those, and they waste
at most 15% on finished rows (the one-width loop: about two thirds).
"""
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import config as config_lib, errors, sampler as sampler_lib, sharding, validate
from grpo_jax.models import qwen

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import lengths as lengths_lib  # noqa: E402

STOP = 1


@pytest.fixture(scope="module")
def model():
  cfg = qwen.QwenConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
  params = qwen.init_params(cfg, jax.random.key(0))
  return qwen.build(cfg, dtype=jnp.float32), {"params": params}


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [list(rng.integers(3, 90, size=int(k))) for k in rng.integers(2, 12, size=n)]


def np_row_steps(lengths, widths, c):
  """Row-steps of the level rule: step t runs at the narrowest width that still holds the
  rows live before it (length > t), moving down one width only when the next holds them."""
  total, level, t = 0, 0, 0
  while t < c and (lengths > t).any():
    live = int((lengths > t).sum())
    while level + 1 < len(widths) and live <= widths[level + 1]:
      level += 1
    total += widths[level]
    t += 1
  return total


@pytest.mark.parametrize("settings", [dict(greedy=True), dict(temperature=1.0, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_compacting_decode_gives_the_one_width_loops_rows(model, settings):
  m, params = model
  prompts, g, c = _prompts(8), 4, 48
  budgets = np.minimum(lengths_lib.realistic_lengths(len(prompts) * g, c, median=12), c)
  outs = {}
  for compact in (False, True):
    s = sampler_lib.Sampler(m, max_new_tokens=c, stop_ids=[STOP], buckets=(16,), pad_id=0,
                            compact_rows=compact, compact_ratio=0.6, compact_levels=3)
    outs[compact] = s(params, prompts, num_samples=g, key=jax.random.key(3),
                      row_budgets=budgets, **settings)
  a, b = outs[False], outs[True]
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
  np.testing.assert_array_equal(np.asarray(a.truncated), np.asarray(b.truncated))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=5e-6)
  lengths = np.asarray(a.lengths)
  assert (lengths <= budgets).all() and (lengths < budgets).any() == ("greedy" not in settings)
  # A row cut by its budget is truncated; one that stopped is not.
  np.testing.assert_array_equal(np.asarray(a.truncated),
                                (np.asarray(a.tokens)[np.arange(len(lengths)), lengths - 1]
                                 != STOP))
  assert b.metrics["sampler/row_steps"] < a.metrics["sampler/row_steps"]
  assert a.metrics["sampler/row_steps"] == a.metrics["sampler/decode_steps"] * len(lengths)


def test_realistic_lengths_waste_at_most_15_percent_of_row_steps(model):
  m, params = model
  g, c = 8, 1024
  prompts = _prompts(16, seed=1)
  lengths = lengths_lib.realistic_lengths(len(prompts) * g, c)
  assert np.median(lengths) == 250 and (lengths == c).mean() == pytest.approx(0.05, abs=0.01)
  s = sampler_lib.Sampler(m, max_new_tokens=c, buckets=(16,), pad_id=0, compact_rows=True)
  out = s(params, prompts, num_samples=g, key=jax.random.key(0), row_budgets=lengths)
  np.testing.assert_array_equal(np.asarray(out.lengths), lengths)  # no stop id: the budgets
  row_steps = out.metrics["sampler/row_steps"]
  assert row_steps == np_row_steps(lengths, s.widths(len(lengths)), c)
  waste = out.metrics["sampler/row_steps_wasted"]
  assert waste == pytest.approx(lengths_lib.wasted(lengths, row_steps))
  assert waste <= 0.15, waste
  # The one-width loop computes every row for the longest row's steps.
  assert lengths_lib.wasted(lengths, c * len(lengths)) > 0.6


def test_widths_shrink_by_the_ratio_and_end_at_the_level_count(model):
  m, _ = model
  s = sampler_lib.Sampler(m, max_new_tokens=4, compact_rows=True, compact_ratio=0.5,
                          compact_levels=4)
  assert s.widths(128) == (128, 64, 32, 16)
  assert s.widths(3) == (3, 2, 1)
  assert sampler_lib.Sampler(m, max_new_tokens=4).widths(128)[:3] == (128, 90, 63)


def test_compaction_is_off_on_a_cpu_and_refused_for_a_split_batch(model):
  m, _ = model
  assert not sampler_lib.Sampler(m, max_new_tokens=4).compact_rows  # the CPU default
  mesh = sharding.make_mesh((1, 1, 1))
  assert sampler_lib.Sampler._compacts(None, "gpu", mesh)
  config = config_lib.defaults()
  config.sampling.compact_rows = True
  config.mesh = (2, 1, 1)
  with pytest.raises(errors.UserError, match=r"sampling.compact_rows.*splits it 2 ways"):
    validate.validate(config, num_devices=2)


def test_row_budgets_outside_the_budget_are_refused(model):
  m, params = model
  s = sampler_lib.Sampler(m, max_new_tokens=4, buckets=(16,))
  with pytest.raises(ValueError, match=r"row_budgets must lie in \[0, 4\]"):
    s(params, _prompts(1), num_samples=2, greedy=True, row_budgets=[2, 5])


def _one_width_and_compacting(m, params, budgets, mesh=None, **call):
  """generate's outputs for 4 prompts x 2 rows, one width then compacting (3 widths)."""
  return [sampler_lib.Sampler(m, max_new_tokens=24, stop_ids=[STOP], buckets=(16,), mesh=mesh,
                              compact_rows=compact, compact_levels=3)(
              params, _prompts(4), num_samples=2, row_budgets=budgets, **call)
          for compact in (False, True)]


@pytest.mark.parametrize("run", [dict(decode_attention="pallas"), dict(unroll_decode=True)],
                         ids=["pallas", "unrolled"])
def test_compacting_decode_with_the_other_decode_paths(model, run):
  """The fused decode attention (Pallas's interpreter here) reads the first rows of the cache
  where the compacted rows lie; the unrolled layers write there."""
  m, params = model
  cfg = dataclasses.replace(m.cfg, run=dataclasses.replace(m.cfg.run, **run))
  m = qwen.build(cfg, dtype=jnp.float32)
  budgets = np.random.default_rng(0).integers(1, 24, size=8)
  outs = _one_width_and_compacting(m, params, budgets, greedy=True)
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs),
                             atol=5e-6)


def test_compacting_decode_on_a_tensor_parallel_mesh(model):
  """The batch on one device row-wise, the kv heads split over 2 (tensor): rows move within
  each device's shard of the cache, and the rows are the one-width loop's."""
  m, params = model
  mesh = sharding.make_mesh((1, 1, 2))
  budgets = np.random.default_rng(1).integers(1, 24, size=8)
  outs = _one_width_and_compacting(m, params, budgets, mesh=mesh, key=jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs),
                             atol=5e-6)
  assert outs[1].metrics["sampler/row_steps"] < outs[0].metrics["sampler/row_steps"]
