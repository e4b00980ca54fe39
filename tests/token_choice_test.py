"""grpo_jax.token_choice's cuts against transformers' sampling warpers.

`cut_probs` (the cuts computed densely) against TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper and MinPLogitsWarper applied on torch tensors in the order generate applies them,
for every combination of the settings on realistic logit rows: the kept token ids and the
renormalised probabilities. Then the streaming draws of `next_token` (the real chunked, rejection
and tie-fallback paths, on a head that is the identity so the hidden states are the logits)
against `cut_probs`: every drawn token is kept, every likely kept token is drawn, and the draw
counts pass a chi-square goodness-of-fit test (p = 1e-4, fixed seeds).

Compiles are the cost here: the draws run `next_token` on `token_choice.traced` settings (the
numbers as arguments), at the sampler's XLA options, and always on R_DRAWN rows of DRAWS copies,
so that every setting with the same cuts switched on shares one program: 21 compiles in all
(one of them for the settings as constants), where one per setting took 45.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                     TopPLogitsWarper)

import chi2
from grpo_jax import compile_cache, token_choice

V = 200
CHUNK = 64  # 3 chunks of 64 + a rest of 8: the streaming code's two kinds of chunk both run
# The chunkings drawn with: CHUNK (as on a CPU or TPU), and the whole vocabulary in one chunk (as
# on a GPU, sampler.Sampler's default there).
CHUNKS = {"chunked": CHUNK, "one_chunk": V}
DRAWS = 4096  # per row
R_DRAWN = 4  # rows per draw: a test of fewer rows draws them padded with copies of its first
# K = 5: the top-k of the tie tests (_tied_at_k), so that their draws share these programs.
K, P, M = 5, 0.8, 0.05


def _rows():
  """[4, V] logit rows, no two equal: peaked, flat, long-tailed, and two leading tokens (0.45 and
  0.27 of the mass) over a flat tail (the row of test_top_p_is_measured_before_min_p)."""
  rng = np.random.default_rng(0)
  peaked = rng.normal(0.0, 1.5, V)
  peaked[rng.choice(V, 4, replace=False)] = [9.0, 8.2, 7.0, 6.1]
  flat = rng.normal(0.0, 0.4, V)
  long_tail = rng.permutation(-1.1 * np.log(np.arange(1, V + 1)) + rng.normal(0.0, 0.05, V))
  return np.stack([peaked, flat, long_tail, _two_leaders(rng)]).astype(np.float32)


def _two_leaders(rng):
  p = np.full(V, 0.28 / (V - 2))
  p[:2] = 0.45, 0.27
  # A tail of distinct logits: spaced 5e-4 apart, far above float32's resolution.
  return np.log(p) + np.r_[0.0, 0.0, rng.permutation(np.linspace(-0.05, 0.05, V - 2))]


ROWS = _rows()
SETTINGS = [dict(temperature=t, top_k=k, top_p=p, min_p=m)
            for t, k, p, m in itertools.product((0.7, 1.0), (0, K), (1.0, P), (0.0, M))]
NAMES = ["T{temperature}-k{top_k}-p{top_p}-m{min_p}".format(**s) for s in SETTINGS]


def _transformers_probs(logits_RV, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
  """softmax of the scores after transformers' warpers, added in the order and under the
  conditions of GenerationMixin._get_logits_processor (transformers/generation/utils.py):
  temperature, top-k, top-p, min-p."""
  warpers = []
  if temperature != 1.0:
    warpers.append(TemperatureLogitsWarper(temperature))
  if top_k != 0:
    warpers.append(TopKLogitsWarper(top_k))
  if top_p < 1.0:
    warpers.append(TopPLogitsWarper(top_p))
  if min_p > 0.0:  # generate adds it whenever min_p is set; 0 removes nothing
    warpers.append(MinPLogitsWarper(min_p))
  scores = torch.tensor(np.asarray(logits_RV, np.float32))
  for warper in warpers:
    scores = warper(None, scores)
  return torch.softmax(scores, -1).numpy()


def _cut_probs(logits_RV, **settings):
  sp = token_choice.parse_settings(**settings)
  return np.asarray(token_choice.cut_probs(sp, jnp.asarray(logits_RV)))


def _assert_same_cut(got_RV, want_RV):
  for r in range(len(got_RV)):
    np.testing.assert_array_equal(np.flatnonzero(got_RV[r]), np.flatnonzero(want_RV[r]),
                                  err_msg=f"kept ids, row {r}")
  np.testing.assert_allclose(got_RV, want_RV, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("settings", SETTINGS, ids=NAMES)
def test_cut_probs_equal_transformers_warpers(settings):
  assert all(len(np.unique(row)) == V for row in ROWS)  # no ties: no sort-order dependence
  probs = _cut_probs(ROWS, **settings)
  _assert_same_cut(probs, _transformers_probs(ROWS, **settings))
  if settings["top_k"] or settings["top_p"] < 1 or settings["min_p"]:
    assert ((probs > 0).sum(1) < V).any()  # the cuts bite


def _jit_next_token(fn=token_choice.next_token):
  """fn = next_token(sp's program, head, h_BD, keys_B, valid, num_draws, numbers), compiled as
  the sampler compiles it."""
  return jax.jit(fn, static_argnums=(0, 4, 5), compiler_options=compile_cache.compiler_options())


_next_token = _jit_next_token()


def _next_token_traced(next_token, head, h_BD, keys_B, valid, top_p_draws, **settings):
  shape, nums = token_choice.traced(token_choice.parse_settings(**settings))
  return next_token(shape, head, h_BD, keys_B, valid, top_p_draws, nums)


def _padded(rows_RV):
  """[R_DRAWN, V]: the rows, then copies of the first (one program for every test's draws)."""
  return np.concatenate([rows_RV, np.repeat(rows_RV[:1], R_DRAWN - len(rows_RV), 0)])


def _draws_of(rows_RV, draws, seed):
  """(h_BD: `draws` copies of each of the R_DRAWN padded rows, row-major; keys_B)."""
  h_BD = jnp.repeat(jnp.asarray(_padded(rows_RV)), draws, 0)
  return h_BD, jax.random.split(jax.random.key(seed), R_DRAWN * draws)


def _draw(logits_RV, draws=DRAWS, seed=0, top_p_draws=4, chunk=CHUNK, **settings):
  """next_token for `draws` copies of each row: (tokens [R, draws], log-probs [R, draws])."""
  r = logits_RV.shape[0]
  head = token_choice.prepare_head(jnp.eye(V), V, chunk)  # logits = the hidden state
  h_BD, keys_B = _draws_of(logits_RV, draws, seed)
  tok, logp, _, _ = _next_token_traced(_next_token, head, h_BD, keys_B, V, top_p_draws,
                                       **settings)
  return (np.asarray(tok).reshape(R_DRAWN, draws)[:r],
          np.asarray(logp).reshape(R_DRAWN, draws)[:r])


def _check_draws(tokens_RN, probs_RV):
  """Drawn tokens are kept, kept tokens likely to be drawn are drawn, the counts fit."""
  for r, (tokens, probs) in enumerate(zip(tokens_RN, probs_RV)):
    counts = np.bincount(tokens, minlength=V)
    assert (counts[probs == 0] == 0).all(), (r, np.flatnonzero(counts * (probs == 0)))
    likely = probs * len(tokens) > 20  # each unseen with probability < e^-20
    assert (counts[likely] > 0).all(), (r, np.flatnonzero(likely & (counts == 0)))
    assert not chi2.rejects(counts, probs), r


def _min_p_first(logits_RV, temperature, top_k, top_p, min_p):
  """The distribution of the cuts in the wrong order (min-p before top-p, which then measures a
  smaller total): what the draws must be able to tell apart from the right one."""
  l = np.asarray(logits_RV, np.float64) / temperature
  keep = np.ones(l.shape, bool)
  if top_k:
    keep &= l >= np.sort(l, 1)[:, [-top_k]]
  keep &= l >= l.max(1, keepdims=True) + np.log(min_p)
  e = np.exp(l - l.max(1, keepdims=True)) * keep
  above = np.einsum("rij,rj->ri", l[:, None, :] > l[:, :, None], e)
  keep &= above < top_p * e.sum(1, keepdims=True)
  q = np.exp(l - l.max(1, keepdims=True)) * keep
  return q / q.sum(1, keepdims=True)


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("settings", SETTINGS, ids=NAMES)
def test_draws_follow_cut_probs(settings, chunk):
  tokens, logp = _draw(ROWS, chunk=chunk, **settings)
  probs = _cut_probs(ROWS, **settings)
  _check_draws(tokens, probs)
  # Log-probs: log_softmax(logits / T) at the token, before the cuts.
  full = jax.nn.log_softmax(jnp.asarray(ROWS) * (1.0 / settings["temperature"]), -1)
  np.testing.assert_allclose(logp, np.take_along_axis(np.asarray(full), tokens, 1), atol=1e-5)
  if settings["top_p"] < 1 and settings["min_p"]:
    # Power: where the wrong order moves enough mass, these draws reject it.
    wrong = _min_p_first(ROWS, **settings)
    moved = 0.5 * np.abs(wrong - probs).sum(1) > 0.05
    for r in np.flatnonzero(moved):
      assert chi2.rejects(np.bincount(tokens[r], minlength=V), wrong[r]), r
    if not settings["top_k"]:
      assert moved.any()  # the long-tailed row


def test_top_p_is_measured_before_min_p():
  """The leading tokens have 0.45 and 0.27 of the mass: with top_p = 0.5 and min_p = 0.2 both are
  kept (0.45 < 0.5 of the whole, and 0.27 >= 0.2 * 0.45). Applying min-p first would leave only
  their 0.72, of which the first alone is >= 0.5: it would keep the top token only."""
  row = _two_leaders(np.random.default_rng(1))[None].astype(np.float32)
  settings = dict(top_p=0.5, min_p=0.2)
  want = _transformers_probs(row, **settings)
  np.testing.assert_array_equal(np.flatnonzero(want[0]), [0, 1])
  probs = _cut_probs(row, **settings)
  _assert_same_cut(probs, want)
  np.testing.assert_allclose(probs[0, :2], [0.45 / 0.72, 0.27 / 0.72], atol=1e-3)
  tokens, _ = _draw(row, **settings)
  _check_draws(tokens, probs)


@pytest.mark.parametrize("top_p", [1e-4, 0.01])
def test_rows_whose_top_p_redraws_run_out_take_a_kept_token(top_p):
  """Near-equal logits at a tiny top_p: a candidate is accepted with probability about
  |nucleus| / V, so some rows fail every round. They must still draw from the nucleus (the one
  TopPLogitsWarper keeps), never from the rest of the vocabulary, and be counted."""
  v, n = 500, 256
  row = (np.random.default_rng(4).normal(size=v) * 0.1).astype(np.float32)
  kept = np.flatnonzero(_transformers_probs(row[None], top_p=top_p)[0])
  assert 1 <= len(kept) <= 8
  head = token_choice.prepare_head(jnp.eye(v), v, 128)
  tok, _, rounds, fell_back = _next_token_traced(
      _next_token, head, jnp.repeat(jnp.asarray(row)[None], n, 0),
      jax.random.split(jax.random.key(0), n), v, 4, top_p=top_p)
  tok, fell_back = np.asarray(tok), np.asarray(fell_back)
  assert np.isin(tok, kept).all(), np.setdiff1d(tok, kept)
  assert int(rounds) == token_choice.MAX_EXTRA_ROUNDS
  assert fell_back.any()
  assert (tok[fell_back] == row.argmax()).all()  # the top token


# Traced only with _one_ulp_up_in_the_judging_pass in force: the patch is read when a program is
# traced, and jit keeps the program. A function of its own: JAX keeps traces by function, and
# a jit of next_token itself would run _next_token's unpatched ones.
_next_token_one_ulp_up = _jit_next_token(lambda *args: token_choice.next_token(*args))


def _one_ulp_up_in_the_judging_pass(monkeypatch):
  """Makes the pass that measures the mass above each candidate round every logit one ulp up from
  the value the draw pass recorded, as two differently compiled matmuls may. Draw with
  _next_token_one_ulp_up."""
  scan = token_choice._vocab_scan

  def vocab_scan(head, h_BD, inv_temp, body, carry, per_chunk=None):
    if body.__qualname__.startswith("_mass_above_pass"):
      inner = body
      body = lambda c, l_cB, off, x: inner(c, jnp.nextafter(l_cB, jnp.inf), off, x)
    return scan(head, h_BD, inv_temp, body, carry, per_chunk)
  monkeypatch.setattr(token_choice, "_vocab_scan", vocab_scan)


@pytest.mark.parametrize("settings", [dict(top_p=0.5), dict(top_p=P), dict(top_p=P, min_p=M)],
                         ids=["p0.5", "p", "p-m"])
def test_a_candidate_never_counts_its_own_mass_as_above_it(settings, monkeypatch):
  """A candidate is kept iff the mass strictly above it is < top_p: where the judging pass rounds
  its logit above the value it was drawn with, it must not count itself (the two leaders of
  0.45 and 0.27 at top_p = 0.5: the second would be rejected, 0.72 >= 0.5)."""
  _one_ulp_up_in_the_judging_pass(monkeypatch)
  rows = ROWS if settings["top_p"] == P else _two_leaders(np.random.default_rng(1))[None]
  rows = rows.astype(np.float32)
  _check_patched_draws(rows, settings)


def _check_patched_draws(rows_RV, settings):
  """next_token's draws under the patch: few rounds, and they fit the cut probabilities."""
  head = token_choice.prepare_head(jnp.eye(V), V, CHUNK)
  r, n = rows_RV.shape[0], DRAWS
  tok, _, rounds, _ = _next_token_traced(_next_token_one_ulp_up, head, *_draws_of(rows_RV, n, 0),
                                         V, 4, **settings)
  assert int(rounds) < 4  # without the exclusion: every round rejects the top token
  _check_draws(np.asarray(tok).reshape(R_DRAWN, n)[:r], _cut_probs(rows_RV, **settings))


def test_top_k_tie_path_never_counts_a_candidates_own_mass(monkeypatch):
  """The same on the exact path a tie at the k-th value takes (its floor is top-k's)."""
  _one_ulp_up_in_the_judging_pass(monkeypatch)
  _check_patched_draws(_tied_at_k(5), dict(top_k=5, top_p=0.7, min_p=0.1))


def _tied_at_k(k):
  """A row whose k-th largest logit is shared by 4 tokens (ranks k-1 .. k+2, counted from 0):
  the k + 1 best candidates do not decide the top-k cut, so next_token takes its exact path."""
  rng = np.random.default_rng(2)
  row = np.r_[[4.0, 3.2, 2.9, 2.5][:k - 1], np.full(4, 1.0), rng.normal(-3.0, 0.5, V - k - 3)]
  return rng.permutation(row)[None].astype(np.float32)


@pytest.mark.parametrize("settings", [dict(top_k=5), dict(top_k=5, top_p=0.7),
                                      dict(top_k=5, min_p=0.1), dict(top_k=5, top_p=0.7, min_p=0.1),
                                      dict(top_k=5, top_p=0.7, min_p=0.1, temperature=0.7)],
                         ids=["k", "k-p", "k-m", "k-p-m", "T-k-p-m"])
def test_tie_at_top_k_keeps_every_tied_token(settings):
  """transformers' top-k keeps every token tied with the k-th value (it removes only scores < it),
  and so does the sampler; with top-p and min-p too, the sampler's tie path equals transformers.
  (k-p-m: min-p removes the tied tokens, then top-p must still measure the 4 + 4 tokens of the
  top-k set: the 2.9 token is kept; measured after min-p it would not be.)"""
  row = _tied_at_k(5)
  probs = _cut_probs(row, **settings)
  _assert_same_cut(probs, _transformers_probs(row, **settings))
  if set(settings) == {"top_k"}:
    assert (probs > 0).sum() == 8  # 4 above the tie + the 4 tied
  tokens, _ = _draw(row, **settings)
  _check_draws(tokens, probs)


def test_tie_across_the_top_p_boundary_is_kept_whole():
  """The one documented difference: tokens with equal logits that straddle the top-p boundary are
  all kept by the sampler; transformers' top-p keeps only those its sort puts last."""
  rng = np.random.default_rng(3)
  row = rng.permutation(np.r_[2.0, 1.0, 1.0, 1.0, rng.normal(-6.0, 0.5, V - 4)])
  row = row[None].astype(np.float32)
  tied = np.flatnonzero(row[0] == 1.0)
  # The mass above each tied token, e^2, is < 0.6 (e^2 + 3e + a small tail): all three are kept.
  probs = _cut_probs(row, top_p=0.6)
  np.testing.assert_array_equal(np.flatnonzero(probs[0]),
                                np.sort(np.r_[np.flatnonzero(row[0] == 2.0), tied]))
  hf = _transformers_probs(row, top_p=0.6)
  assert set(np.flatnonzero(hf[0])) < set(np.flatnonzero(probs[0]))
  assert set(np.flatnonzero(probs[0])) - set(np.flatnonzero(hf[0])) <= set(tied)
  tokens, _ = _draw(row, top_p=0.6)
  _check_draws(tokens, probs)


def test_uniforms_are_jax_random_uniform_of_each_row_key():
  """_Uniforms draws flat and reshapes (it compiles faster): the numbers must stay those of
  jax.random.uniform(fold_in(row key, round), shape), so that sampled streams do not move."""
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(5))
  uniforms = token_choice._Uniforms(keys, num_chunks=7)
  for round_, shape in ((1, (7, 2, 3)), (4, (1,)), (0, (3, 5))):
    want = np.stack([np.asarray(jax.random.uniform(jax.random.fold_in(k, round_), shape))
                     for k in keys])
    np.testing.assert_array_equal(np.asarray(uniforms(round_, shape)), want)


def test_traced_settings_draw_what_the_settings_as_constants_draw():
  """The draws above run `token_choice.traced` settings (one program per kind of setting); the
  sampler compiles its settings in as constants. Both give the same tokens, log-probs, rounds
  and fallbacks, to the bit (every cut on, on the rows of the tie and top-p tests too)."""
  settings = dict(temperature=0.7, top_k=K, top_p=P, min_p=M)
  sp = token_choice.parse_settings(**settings)
  head = token_choice.prepare_head(jnp.eye(V), V, CHUNK)
  const = jax.jit(lambda h, k: token_choice.next_token(sp, head, h, k, V, 4),
                  compiler_options=compile_cache.compiler_options())
  tied = _tied_at_k(K)
  for rows in (ROWS, tied, _two_leaders(np.random.default_rng(1))[None].astype(np.float32)):
    h_BD, keys_B = _draws_of(rows, DRAWS, 0)
    want = const(h_BD, keys_B)
    got = _next_token_traced(_next_token, head, h_BD, keys_B, V, 4, **settings)
    assert (int(want[2]) > 0) == (rows is tied)  # the tie takes the exact path: a round
    for name, x, y in zip(("tokens", "log-probs", "rounds", "fell back"), got, want):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
