"""grpo_jax.sampler against independent references.

Greedy decoding against transformers' generate; log-probs against a full (teacher-forced)
forward's log-softmax; sampling against exact support sets and chi-square goodness-of-fit on a
tiny vocabulary whose head is scaled so that temperature and the cuts change the distribution a
lot. Compilations are counted with jax.monitoring.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import chi2
import fixtures
from grpo_jax import members as members_lib, sampler as sampler_lib
from grpo_jax import sharding
from grpo_jax.models import lora, quant, qwen, weights

VOCAB = 128
VALID = 120  # ids 120..127 play the embedding rows beyond the tokenizer: never sampled
PAD = 0
CHUNK = 32  # 120 valid columns = 3 chunks of 32 + a rest of 24: the streaming code is exercised


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("sampler_ckpts")
  return {kind: fixtures.make_checkpoint(root, kind, VOCAB) for kind in ("qwen2_tied", "qwen3")}


def _prompts(seed=0, lengths=(5, 11, 2, 8)):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, VALID, n).tolist() for n in lengths]


def _full_logits(model, params, tokens_RS, mask_RS):
  hidden, _ = model.apply({"params": params}, tokens_RS, qwen.positions_from_mask(mask_RS),
                          mask_RS)
  return model.apply({"params": params}, hidden, method=qwen.Qwen.logits)


_full_logits_jit = jax.jit(_full_logits, static_argnums=0)


def _teacher_forced(model, params, out, num_samples):
  """fp32 logits [R, C, V] that predicted each completion token, from one full forward."""
  p = out.prompt_tokens.shape[1]
  tokens = np.concatenate([np.repeat(np.asarray(out.prompt_tokens), num_samples, 0),
                           np.asarray(out.tokens)], 1)
  mask = np.concatenate([np.repeat(np.asarray(out.prompt_mask), num_samples, 0),
                         np.ones_like(np.asarray(out.tokens))], 1)
  logits = _full_logits_jit(model, params, jnp.asarray(tokens), jnp.asarray(mask))
  return np.asarray(logits)[:, p - 1:-1]


def _check_logprobs(out, logits_RCV, temperature, valid=VALID):
  """Returned log-probs == log_softmax(logits / T) over the valid vocabulary; 0 past the end."""
  lengths = np.asarray(out.lengths)
  live = np.arange(out.tokens.shape[1])[None] < lengths[:, None]
  ref = jax.nn.log_softmax(jnp.asarray(logits_RCV[..., :valid]) / temperature, -1)
  tokens = np.minimum(np.asarray(out.tokens), valid - 1)
  ref = np.take_along_axis(np.asarray(ref), tokens[..., None], -1)[..., 0]
  got = np.asarray(out.logprobs)
  np.testing.assert_allclose(got[live], ref[live], atol=1e-4, rtol=0)
  assert (got[~live] == 0).all()


# ------------------------------------------------------------------------------------------------
# Greedy decoding against transformers.


def _hf_greedy(path, prompts, new_tokens, stop_ids):
  hf = fixtures.hf_model(path)
  width = max(map(len, prompts))
  ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  with torch.no_grad():
    out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                      max_new_tokens=new_tokens, eos_token_id=list(stop_ids) or None,
                      pad_token_id=PAD)[:, width:].numpy()
  return np.pad(out, ((0, 0), (0, new_tokens - out.shape[1])), constant_values=PAD)


@pytest.fixture(scope="module")
def greedy_cases(checkpoints):
  """Per checkpoint: prompts, stop ids, transformers' tokens, and our output (G = 2)."""
  new_tokens, cases = 12, {}
  for kind, path in checkpoints.items():
    prompts = _prompts()
    free = _hf_greedy(path, prompts, new_tokens, ())
    if kind == "qwen2_tied":
      # Stop on what rows 0 and 2 produce at steps 3 and 6: some rows stop early, others run on.
      stop = (int(free[0, 3]), int(free[2, 6]))
    else:
      # Every row's token at step 2..5 stops it: the while_loop must exit before 12 steps.
      stop = tuple(int(free[r, 2 + r]) for r in range(len(prompts)))
    ref = _hf_greedy(path, prompts, new_tokens, stop)
    params, cfg = weights.load_checkpoint(path)
    sampler = sampler_lib.Sampler(qwen.Qwen(cfg), max_new_tokens=new_tokens, stop_ids=stop,
                                  buckets=(16,), greedy=True, temperature=0.7, pad_id=PAD,
                                  vocab_chunk=CHUNK)
    out = sampler({"params": params}, prompts, num_samples=2)
    cases[kind] = dict(prompts=prompts, stop=stop, ref=ref, out=out, params=params, cfg=cfg,
                       sampler=sampler)
  return cases


@pytest.mark.parametrize("kind", ["qwen2_tied", "qwen3"])
def test_greedy_equals_transformers_generate(greedy_cases, kind):
  case = greedy_cases[kind]
  out, ref, stop = case["out"], case["ref"], case["stop"]
  tokens = np.asarray(out.tokens)
  np.testing.assert_array_equal(tokens[0::2], ref)  # row b*G + g is sample g of prompt b
  np.testing.assert_array_equal(tokens[1::2], ref)
  # lengths / truncated from transformers' output: up to and including the first stop id.
  is_stop = np.isin(ref, stop)
  stopped = is_stop.any(1)
  expect_len = np.where(stopped, is_stop.argmax(1) + 1, ref.shape[1])
  np.testing.assert_array_equal(np.asarray(out.lengths), np.repeat(expect_len, 2))
  np.testing.assert_array_equal(np.asarray(out.truncated), np.repeat(~stopped, 2))
  if kind == "qwen2_tied":
    assert stopped.any() and not stopped.all()  # the case covers both kinds of rows
  else:
    assert stopped.all() and expect_len.max() < ref.shape[1]
    assert out.metrics["sampler/decode_steps"] == expect_len.max()  # exited early


def test_whole_vocabulary_in_one_chunk_equals_transformers_generate(greedy_cases):
  """The head's whole vocabulary in one chunk (the default on a GPU) decodes transformers'
  greedy tokens too, with the chunked head's log-probs."""
  case = greedy_cases["qwen2_tied"]
  sampler = sampler_lib.Sampler(qwen.Qwen(case["cfg"]), max_new_tokens=case["ref"].shape[1],
                                stop_ids=case["stop"], buckets=(16,), greedy=True,
                                temperature=0.7, pad_id=PAD, vocab_chunk=VOCAB)
  out = sampler({"params": case["params"]}, case["prompts"], num_samples=2)
  np.testing.assert_array_equal(np.asarray(out.tokens)[0::2], case["ref"])
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(case["out"].tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(case["out"].logprobs),
                             atol=1e-6)


def test_default_vocab_chunk_is_the_whole_vocabulary_on_a_gpu_only():
  cfg = qwen.QwenConfig(vocab_size=20000, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=8)
  cpu = sampler_lib.Sampler(cfg, max_new_tokens=4, valid_vocab_size=19000)
  assert cpu.vocab_chunk == sampler_lib.VOCAB_CHUNK == 8192
  # Meshes of GPUs and TPUs: only their platform is read when the sampler is built.
  mesh = lambda platform: types.SimpleNamespace(
      devices=np.array([types.SimpleNamespace(platform=platform)]))
  gpu = sampler_lib.Sampler(cfg, max_new_tokens=4, valid_vocab_size=19000, mesh=mesh("gpu"))
  assert gpu.vocab_chunk == 19000
  tpu = sampler_lib.Sampler(cfg, max_new_tokens=4, valid_vocab_size=19000, mesh=mesh("tpu"))
  assert tpu.vocab_chunk == 8192
  assert sampler_lib.Sampler(cfg, max_new_tokens=4, vocab_chunk=64,
                             mesh=mesh("gpu")).vocab_chunk == 64
  # A chunk set by hand: a multiple of 32, or the whole vocabulary (19000 is not a multiple).
  assert sampler_lib.Sampler(cfg, max_new_tokens=4, valid_vocab_size=19000,
                             vocab_chunk=19000).vocab_chunk == 19000
  with pytest.raises(ValueError, match=r"vocab_chunk=100 must be a positive multiple of 32, or "
                                       r"the whole vocabulary \(19000\)"):
    sampler_lib.Sampler(cfg, max_new_tokens=4, valid_vocab_size=19000, vocab_chunk=100)


@pytest.mark.parametrize("kind", ["qwen2_tied", "qwen3"])
def test_greedy_is_argmax_of_full_forward_and_logprobs_match(greedy_cases, kind):
  case = greedy_cases[kind]
  out = case["out"]
  logits = _teacher_forced(case["sampler"].model, case["params"], out, 2)
  live = np.arange(logits.shape[1])[None] < np.asarray(out.lengths)[:, None]
  np.testing.assert_array_equal(logits.argmax(-1)[live], np.asarray(out.tokens)[live])
  assert (np.asarray(out.tokens)[~live] == PAD).all()
  # Greedy reports log-probs at the sampler's temperature (0.7 here); full vocab is valid.
  _check_logprobs(out, logits, 0.7, valid=VOCAB)


def test_sharded_batch_matches_unsharded(greedy_cases):
  """B = 3 on a (2, 2, 2) mesh: padded to 4 rows, split over data × fsdp, same tokens."""
  case = greedy_cases["qwen2_tied"]
  mesh = sharding.make_mesh((2, 2, 2))
  params = jax.device_put(case["params"], sharding.param_shardings(
      qwen.logical_axes(case["cfg"]), qwen.abstract_params(case["cfg"]), mesh))
  sampler = sampler_lib.Sampler(case["cfg"], max_new_tokens=12, stop_ids=case["stop"],
                                buckets=(16,), greedy=True, temperature=0.7, pad_id=PAD,
                                vocab_chunk=CHUNK, mesh=mesh)
  out = sampler({"params": params}, case["prompts"][:3], num_samples=2)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(case["out"].tokens)[:6])
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(case["out"].lengths)[:6])
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(case["out"].logprobs)[:6],
                             atol=1e-5)


@pytest.fixture(scope="module")
def samples():
  """_same_samples' outputs by (model config, mesh shape), shared by the tests that compare
  with the same one: each is sampled (and compiled) once."""
  return {}


@pytest.mark.parametrize("kind", ["qwen2_tied", "qwen3"])
def test_unrolled_decode_equals_transformers_and_the_layer_scan(greedy_cases, samples, kind):
  """cfg.run.unroll_decode (the layers written out in the decode step, on per-layer copies of
  their weights): greedy tokens equal transformers' generate, and sampled tokens and log-probs
  equal the layer scan's on a (2, 2, 2) mesh as well as on one device."""
  case = greedy_cases[kind]
  unrolled = case["cfg"].with_run(unroll_decode=True)
  settings = dict(max_new_tokens=12, stop_ids=case["stop"], buckets=(16,), pad_id=PAD,
                  vocab_chunk=CHUNK)
  greedy = sampler_lib.Sampler(unrolled, greedy=True, temperature=0.7, **settings)
  out = greedy({"params": case["params"]}, case["prompts"], num_samples=2)
  np.testing.assert_array_equal(np.asarray(out.tokens)[0::2], case["ref"])
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(case["out"].lengths))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(case["out"].logprobs),
                             atol=1e-6)
  mesh = sharding.make_mesh((2, 2, 2))
  for params, m in ((case["params"], None), (_sharded(case, mesh), mesh)):
    _same_samples(samples, case, settings, case["cfg"], unrolled, params, m, atol=1e-6)


def _sharded(case, mesh):
  return jax.device_put(case["params"], sharding.param_shardings(
      qwen.logical_axes(case["cfg"]), qwen.abstract_params(case["cfg"]), mesh))


def _same_samples(samples, case, settings, cfg, other, params, mesh, atol):
  """Sampling with model config `other` gives cfg's tokens, and its log-probs within atol
  (`samples`: the fixture; settings and prompts are the case's own, the same in every test)."""
  def sample(c):
    key = (c, None if mesh is None else mesh.devices.shape)
    if key not in samples:
      samples[key] = sampler_lib.Sampler(c, temperature=0.9, mesh=mesh, **settings)(
          {"params": params}, case["prompts"], num_samples=4, key=jax.random.key(3))
    return samples[key]
  outs = [sample(c) for c in (cfg, other)]
  np.testing.assert_array_equal(np.asarray(outs[1].tokens), np.asarray(outs[0].tokens))
  np.testing.assert_allclose(np.asarray(outs[1].logprobs), np.asarray(outs[0].logprobs),
                             atol=atol)
  assert len({tuple(t) for t in np.asarray(outs[0].tokens)}) > 4  # really sampled


def test_pallas_decode_attention_equals_transformers_and_the_einsum(greedy_cases, samples):
  """cfg.run.decode_attention='pallas' (one fused kernel per layer, run here by Pallas's
  interpreter): greedy tokens equal transformers' generate, and sampled tokens and log-probs
  equal the einsum attention's, with the layers scanned and written out, on one device and on
  a (2, 2, 2) mesh (the kernel under shard_map)."""
  case = greedy_cases["qwen2_tied"]
  fused = case["cfg"].with_run(decode_attention="pallas")
  settings = dict(max_new_tokens=12, stop_ids=case["stop"], buckets=(16,), pad_id=PAD,
                  vocab_chunk=CHUNK)
  out = sampler_lib.Sampler(fused, greedy=True, temperature=0.7, **settings)(
      {"params": case["params"]}, case["prompts"], num_samples=2)
  np.testing.assert_array_equal(np.asarray(out.tokens)[0::2], case["ref"])
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(case["out"].lengths))
  mesh = sharding.make_mesh((2, 2, 2))
  for params, m, unroll in ((case["params"], None, False), (case["params"], None, True),
                            (_sharded(case, mesh), mesh, False)):
    _same_samples(samples, case, settings, case["cfg"].with_run(unroll_decode=unroll),
                  fused.with_run(unroll_decode=unroll), params, m, atol=1e-5)


def test_pallas_decode_attention_off_a_gpu_says_what_runs(greedy_cases, capsys):
  cfg = greedy_cases["qwen2_tied"]["cfg"].with_run(decode_attention="pallas")
  sampler_lib.Sampler(cfg, max_new_tokens=3, buckets=(16,), pad_id=PAD)
  err = capsys.readouterr().err
  assert ("grpo_jax: warning: model.decode_attention='pallas' is a GPU kernel; on cpu the decode "
          "step runs Pallas's interpreter (exact, and slow): 'xla' suits it") in err


def test_pallas_decode_attention_names_a_head_dim_it_cannot_take(greedy_cases):
  """Said when the model config is made, before anything is compiled."""
  with pytest.raises(ValueError, match="decode_attention='pallas' needs a head_dim that is a "
                                       "power of two >= 16.*got 24"):
    greedy_cases["qwen3"]["cfg"].with_run(decode_attention="pallas")  # head_dim 24


# ------------------------------------------------------------------------------------------------
# Sampling: exact supports and goodness of fit on a tiny vocabulary.

DRAWS = 2048  # G per prompt; 2 prompts


def _kept_probs(logits_V, temperature, top_k=0, top_p=1.0, min_p=0.0, slack=0.0):
  """NumPy (float64) version of the documented cuts: the renormalised sampling distribution.

  slack > 0 widens every cut a little (a token within rounding of a boundary counts as kept).
  """
  l = np.asarray(logits_V[:VALID], np.float64) / temperature
  keep = np.ones(VALID, bool)
  if top_k:
    keep &= l >= np.sort(l)[-top_k] - slack
  p = np.exp(l - l.max()) * keep
  p /= p.sum()
  if top_p < 1.0:
    above = (p[None, :] > p[:, None]) @ p  # mass strictly more probable than each token
    keep &= above < top_p + slack
  if min_p:
    keep &= p >= min_p * p.max() - slack
  q = np.exp(l - l.max()) * keep
  return q / q.sum()


@pytest.fixture(scope="module")
def peaked(checkpoints):
  """Qwen3 with its head scaled ×15: logits spread over several units, so cuts bite."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen3"])
  params = dict(params, lm_head=params["lm_head"] * 15.0)
  model = qwen.Qwen(cfg)
  prompts = _prompts(seed=3, lengths=(3, 7))
  sampler = sampler_lib.Sampler(model, max_new_tokens=3, buckets=(8,), pad_id=PAD,
                                valid_vocab_size=VALID, vocab_chunk=CHUNK)
  return dict(params=params, model=model, prompts=prompts, sampler=sampler)


SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.3, top_k=5),
    "top_p": dict(top_p=0.6),
    "min_p": dict(min_p=0.1),
    "all_cuts": dict(temperature=0.8, top_k=12, top_p=0.7, min_p=0.05),
    "top_p_redraws": dict(top_p=0.5),  # one draw per round: many rows need several rounds
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampling_supports_fit_and_logprobs(peaked, name):
  settings = SETTINGS[name]
  sampler = peaked["sampler"]
  if name == "top_p_redraws":
    sampler = sampler_lib.Sampler(peaked["model"], max_new_tokens=3, buckets=(8,), pad_id=PAD,
                                  valid_vocab_size=VALID, vocab_chunk=CHUNK, top_p_draws=1)
  out = sampler({"params": peaked["params"]}, peaked["prompts"], num_samples=DRAWS,
                key=jax.random.key(1), **settings)
  if name == "top_p_redraws":
    assert out.metrics["sampler/cut_extra_rounds"] >= 3  # every step redrew some rows
  elif name == "top_k":
    assert out.metrics["sampler/cut_extra_rounds"] == 0  # k + 1 candidates decide it
  temperature = settings.get("temperature", 1.0)
  cuts = {k: v for k, v in settings.items() if k != "temperature"}
  tokens = np.asarray(out.tokens)
  assert tokens.max() < VALID and np.asarray(out.lengths).min() == 3

  logits = _teacher_forced(peaked["model"], peaked["params"], out, DRAWS)
  # Log-probs: the temperature-scaled distribution before the cuts.
  _check_logprobs(out, logits, temperature)
  # Every token of every step lies in its (slightly widened) kept set. Rows with the same
  # prompt and prefix share a context, so each distinct context is checked once.
  prompt_of = np.arange(len(tokens)) // DRAWS
  for c in range(tokens.shape[1]):
    contexts = np.concatenate([prompt_of[:, None], tokens[:, :c]], 1)
    _, first, which = np.unique(contexts, axis=0, return_index=True, return_inverse=True)
    for u, r in enumerate(first):
      q = _kept_probs(logits[r, c], temperature, slack=1e-5, **cuts)
      assert (q[tokens[which.ravel() == u, c]] > 0).all(), (r, c)

  # First token: all G rows of a prompt share one distribution.
  for b in range(len(peaked["prompts"])):
    first = tokens[b * DRAWS:(b + 1) * DRAWS, 0]
    q = _kept_probs(logits[b * DRAWS, 0], temperature, **cuts)
    counts = np.bincount(first, minlength=VOCAB)[:VALID]
    seen, kept = set(np.flatnonzero(counts)), set(np.flatnonzero(q))
    assert seen <= kept
    if cuts:  # exact support: every kept token is likely enough to be seen
      assert (q[q > 0] * DRAWS).min() > 10 and seen == kept, (seen, kept)
      assert len(kept) < VALID / 2  # the cut is not vacuous
    assert not chi2.rejects(counts, q)
    # Power: the same draws reject the distribution a wrong setting would give.
    wrong = (_kept_probs(logits[b * DRAWS, 0], 1.0) if name == "temperature" else
             _kept_probs(logits[b * DRAWS, 0], temperature))
    assert chi2.rejects(counts, wrong)


def test_same_key_same_output_and_rows_independent_of_batch(peaked):
  sampler, params = peaked["sampler"], peaked["params"]
  prompts = _prompts(seed=5, lengths=(4, 6))
  others = _prompts(seed=6, lengths=(8, 2))
  a = sampler({"params": params}, prompts, num_samples=DRAWS, key=jax.random.key(7),
              temperature=0.7)
  b = sampler({"params": params}, prompts, num_samples=DRAWS, key=jax.random.key(7),
              temperature=0.7)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  c = sampler({"params": params}, prompts, num_samples=DRAWS, key=jax.random.key(8),
              temperature=0.7)
  assert (np.asarray(c.tokens) != np.asarray(a.tokens)).any(1).mean() > 0.5
  # Prompt 1 next to a different prompt (and in another batch position) with the same id:
  # its rows are unchanged.
  d = sampler({"params": params}, [prompts[1], others[0]], num_samples=DRAWS, key=jax.random.key(7),
              prompt_ids=[1, 5], temperature=0.7)
  np.testing.assert_array_equal(np.asarray(d.tokens)[:DRAWS], np.asarray(a.tokens)[DRAWS:])
  # The G samples of one prompt differ from each other.
  assert len({tuple(t) for t in np.asarray(a.tokens)[:DRAWS]}) > 100


# ------------------------------------------------------------------------------------------------
# Compilation and input checks.


def test_many_calls_in_one_bucket_compile_once(checkpoints):
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_tied"])
  sampler = sampler_lib.Sampler(cfg, max_new_tokens=4, stop_ids=(VOCAB - 1,), buckets=(8, 16),
                                pad_id=PAD, vocab_chunk=CHUNK)
  keys = list(jax.random.split(jax.random.key(0), 7))  # no eager jax ops while counting
  compiled = []

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(kwargs.get("fun_name"))
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    sampler({"params": params}, _prompts(seed=0, lengths=(9, 3, 12)), num_samples=3, key=keys[6])
    first = list(compiled)
    rng = np.random.default_rng(0)
    for i in range(6):  # lengths 9..16: always the 16 bucket; lists or a padded array
      lengths = rng.integers(9, 17, 3)
      prompts = _prompts(seed=i, lengths=lengths)
      if i % 2:
        out = sampler({"params": params}, prompts, num_samples=3, key=keys[i])
      else:
        width = max(lengths) + 2
        arr = np.array([[PAD] * (width - len(p)) + p for p in prompts])
        mask = (np.arange(width)[None] >= (width - lengths)[:, None]).astype(np.int32)
        out = sampler({"params": params}, arr, mask, num_samples=3, key=keys[i])
      assert out.prompt_tokens.shape == (3, 16)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert sum("prefill" in n for n in first) == 1 and sum("decode" in n for n in first) == 1, first
  assert compiled == first, compiled[len(first):]


@pytest.mark.parametrize("unroll,decode,batched", [(False, "xla", True), (True, "xla", True),
                                                   (False, "pallas", True), (False, "xla", False)])
def test_members_equal_their_own_generate_calls(checkpoints, unroll, decode, batched):
  """members.generate (K runs vmapped, one decode loop for all) gives each member what its own
  generate gives: tokens, lengths, truncation and step counts exactly, log-probs to fp32
  rounding. The members stop at different steps (stop ids cover 40% of the vocabulary, so rows
  stop within a few steps), so a member steps on after its own loop would have ended. With
  cfg.run.unroll_decode too (the members' per-layer copies), with the fused decode attention
  (its kernel under jax.vmap), and with each member's own loop in turn (batched=False)."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_tied"])
  cfg = cfg.with_run(unroll_decode=unroll, decode_attention=decode)
  members = [params] + [jax.tree.map(lambda x, k=k: x * (1.0 + 0.3 * k), params)
                        for k in (1, 2)]
  smp = sampler_lib.Sampler(cfg, max_new_tokens=9, stop_ids=range(1, 49), valid_vocab_size=VALID,
                            pad_id=PAD, buckets=(8, 16), vocab_chunk=CHUNK, temperature=1.5)
  prompts = [_prompts(seed) for seed in (0, 1, 2)]
  keys = [jax.random.key(k) for k in (5, 6, 7)]
  params_K = jax.tree.map(lambda *x: jnp.stack(x), *members)
  got = members_lib.generate(smp, {"params": params_K}, prompts, num_samples=3, keys_K=keys,
                             batched=batched)
  steps = set()
  for p, prompt, key, out in zip(members, prompts, keys, got):
    want = smp.generate({"params": p}, prompt, num_samples=3, key=key)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    np.testing.assert_array_equal(out.lengths, want.lengths)
    np.testing.assert_array_equal(out.truncated, want.truncated)
    np.testing.assert_allclose(out.logprobs, want.logprobs, atol=1e-5, rtol=0)
    for name in ("sampler/decode_steps", "sampler/cut_extra_rounds", "sampler/row_steps"):
      assert out.metrics[name] == want.metrics[name], name
    steps.add(want.metrics["sampler/decode_steps"])
  assert len(steps) > 1, steps  # the members' own loops really end at different steps


@pytest.mark.parametrize("batched", [True, False])
def test_precompiled_members_layout_compiles_once_and_samples_the_same(checkpoints, batched):
  """members.precompile_generate compiles members.generate's two programs for a layout (the
  number of prompts and their bucket) in the background; a call with other prompts of that
  layout waits for them and runs them, compiling nothing more, and gets what a sampler
  compiling on the call gets."""
  from grpo_jax import compile_cache
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_tied"])
  params_K = jax.tree.map(lambda *x: jnp.stack(x), params, jax.tree.map(lambda x: 1.2 * x, params))
  make = lambda: sampler_lib.Sampler(cfg, max_new_tokens=6, stop_ids=(VOCAB - 1,), pad_id=PAD,
                                     buckets=(8, 16), vocab_chunk=CHUNK)
  first = [_prompts(seed, lengths=(3, 9, 5)) for seed in (0, 1)]  # bucket 16, 3 prompts
  later = [_prompts(seed, lengths=(10, 2, 12)) for seed in (2, 3)]
  want = members_lib.generate(make(), {"params": params_K}, later, num_samples=1, greedy=True,
                              batched=batched)
  smp, compiled = make(), []
  listener = lambda name, secs, **_: compiled.append(name)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    members_lib.precompile_generate(smp, {"params": params_K}, first, num_samples=1, greedy=True,
                                    batched=batched)
    members_lib.precompile_generate(smp, {"params": params_K}, later, num_samples=1,
                                    greedy=True, batched=batched)  # the same layout
    # Called at once, while the programs compile: the call waits for them.
    got = members_lib.generate(smp, {"params": params_K}, later, num_samples=1, greedy=True,
                               batched=batched)
    # the sampler's compile thread's queue is done
    compile_cache.in_background(lambda: None, lane="sampler").result()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiled.count("/jax/core/compile/backend_compile_duration") == 2, compiled
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_lora_members_unrolled_equal_the_layer_scan(checkpoints):
  """LoRA members (one shared base, stacked adapters): members.generate with cfg.run.unroll_decode
  gives the layer scan's tokens and log-probs, and so does each member's loop in turn
  (batched=False, the base still one copy)."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen3"])
  lcfg = lora.LoraConfig(rank=4, alpha=8.0)
  adapters = [jax.tree.map(lambda x, k=k: x + 0.2 * jax.random.normal(
                  jax.random.key(k), x.shape, x.dtype), lora.init(jax.random.key(k), cfg, lcfg))
              for k in range(3)]
  variables_K = {"params": params,
                 "lora": jax.tree.map(lambda *x: jnp.stack(x),
                                      *[lora.variables(params, a, lcfg)["lora"] for a in adapters])}
  prompts = [_prompts(seed) for seed in (0, 1, 2)]
  keys = [jax.random.key(k) for k in (5, 6, 7)]
  outs = [members_lib.generate(
              sampler_lib.Sampler(cfg.with_run(unroll_decode=u), max_new_tokens=9,
                                  pad_id=PAD, buckets=(16,), vocab_chunk=CHUNK, temperature=1.5),
              variables_K, prompts, num_samples=3, keys_K=keys, batched=b)
          for u, b in ((False, True), (True, True), (False, False))]
  for scan, *others in zip(*outs):
    for other in others:
      np.testing.assert_array_equal(other.tokens, scan.tokens)
      np.testing.assert_allclose(other.logprobs, scan.logprobs, atol=1e-6, rtol=0)
  assert len({tuple(t) for o in outs[0] for t in np.asarray(o.tokens)}) > 3


@pytest.mark.parametrize("unroll", [False, True])
def test_int8_base_samples_the_train_steps_policy(checkpoints, unroll):
  """bf16 compute on an int8 base (model.lora.quantize='int8'): the decode steps' narrowed
  variables keep kernel_scale in fp32, as qwen._kernel uses it, so the sampler's policy is the
  train step's. The full forward on the decode steps' variables gives the train step's logits
  to the last bit (as for a plain base), and the sampler on the int8 base samples what it
  samples on the dequantized values (q · scale in fp32: quant_test's numbers of the forward)."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen3"])
  qparams = quant.quantize(params)
  model = qwen.Qwen(cfg.with_run(unroll_decode=unroll), dtype=jnp.bfloat16)
  sampler = sampler_lib.Sampler(model, max_new_tokens=8, buckets=(16,), temperature=0.9,
                                pad_id=PAD, vocab_chunk=CHUNK)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, VALID, (4, 12)))
  mask = jnp.ones_like(tokens)
  for base in (params, qparams):
    train = _full_logits_jit(model, base, tokens, mask)
    narrowed = sampler.narrow({"params": base})
    hidden, _ = model.apply(narrowed, tokens, qwen.positions_from_mask(mask), mask)
    np.testing.assert_array_equal(model.apply(narrowed, hidden, method=qwen.Qwen.logits), train)
  assert narrowed["params"]["layers"]["mlp"]["up_proj"]["kernel_scale"].dtype == jnp.float32
  outs = [sampler({"params": p}, _prompts(), num_samples=2, key=jax.random.key(1))
          for p in (qparams, quant.dequantize(qparams))]
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  np.testing.assert_array_equal(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs))


def test_bad_input_gets_a_clear_error(greedy_cases):
  case = greedy_cases["qwen2_tied"]
  sampler, params, cfg = case["sampler"], case["params"], case["cfg"]
  with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
    sampler({"params": params}, [[1, 2], []])
  with pytest.raises(ValueError, match=r"prompts\[0\] has 17 tokens, more than the largest"):
    sampler({"params": params}, [[1] * 17])
  with pytest.raises(ValueError, match="prompts is empty"):
    sampler({"params": params}, [])
  with pytest.raises(ValueError, match=r"outside the vocabulary"):
    sampler({"params": params}, [[1, VOCAB]])
  with pytest.raises(ValueError, match="num_samples=0"):
    sampler({"params": params}, [[1, 2]], num_samples=0)
  with pytest.raises(ValueError, match="left-padded"):
    sampler({"params": params}, np.array([[1, 2, 0]]), np.array([[1, 1, 0]]))
  with pytest.raises(ValueError, match="key is required"):
    sampler({"params": params}, [[1, 2]], greedy=False)
  with pytest.raises(ValueError, match=r"top_p: must be in \(0, 1\].*got 1\.5"):
    sampler({"params": params}, [[1, 2]], top_p=1.5, greedy=False, key=jax.random.key(0))
  for bad in (0, -3):
    with pytest.raises(ValueError, match=f"max_new_tokens={bad}"):
      sampler_lib.Sampler(cfg, max_new_tokens=bad)
  with pytest.raises(ValueError, match=r"temperature: must be a finite number > 0, got -1"):
    sampler_lib.Sampler(cfg, max_new_tokens=2, temperature=-1.0)
  with pytest.raises(ValueError, match="valid_vocab_size=129"):
    sampler_lib.Sampler(cfg, max_new_tokens=2, valid_vocab_size=VOCAB + 1)


@pytest.fixture(scope="module")
def multiturn():
  """A tiny random Qwen (weights ×3, so tokens vary) and two prompts in a bucket of 8."""
  cfg = qwen.QwenConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                        tie_word_embeddings=True, max_position_embeddings=512)
  params = qwen.init_params(cfg, jax.random.key(3), jnp.float32)
  params = jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, params)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 96, n).tolist() for n in (5, 3)]
  return dict(cfg=cfg, params=params, prompts=prompts)


def _turns(s, params, prompts, room):
  """extend 4, append 3, peek 4, extend 5 (sampled): needs room 12, of which the peek's 4 only
  after the append."""
  conv = s.begin({"params": params}, prompts, num_samples=2, room=room)
  first, conv = s.extend({"params": params}, conv, jax.random.key(1), max_tokens=4)
  conv = s.append({"params": params}, conv, [[5, 6], [], [7], [8, 9, 10]], width=3)
  asked, conv = s.peek({"params": params}, conv, [[11, 12, 13], [14], [], [15, 16]], 4, [1, 2])
  second, conv = s.extend({"params": params}, conv, jax.random.key(2), max_tokens=5)
  return [np.asarray(x) for x in (first["tokens"], first["logprobs"], asked, second["tokens"],
                                  second["logprobs"])]


def test_calls_past_the_caches_room_raise_and_calls_within_it_do_not(multiturn):
  """begin(room) sizes the cache to P + room slots; a call that could write past them must say
  so (JAX clamps such writes onto the last slot, corrupting earlier keys and values). Calls that
  fit, to the last slot, give the numbers of a roomier cache."""
  params, prompts = multiturn["params"], multiturn["prompts"]
  s = sampler_lib.Sampler(multiturn["cfg"], max_new_tokens=6, buckets=(8,), pad_id=PAD)
  conv = s.begin({"params": params}, prompts, room=3)
  with pytest.raises(ValueError, match=r"extend\(max_tokens=6\) needs 6 cache slots but the "
                                       r"conversation has 3 left \(capacity 11 "):
    s.extend({"params": params}, conv, jax.random.key(1), max_tokens=6)
  with pytest.raises(ValueError, match=r"append\(width=4\) needs 4 cache slots .* has 3 left"):
    s.append({"params": params}, conv, [[1], [2]], width=4)
  with pytest.raises(ValueError, match=r"append\(width=4\) needs 4 .* has 3 left"):
    s.peek({"params": params}, conv, [[1], [2]], 4, [1])
  _, conv = s.extend({"params": params}, conv, jax.random.key(1), max_tokens=3)  # exactly the room
  with pytest.raises(ValueError, match=r"extend\(max_tokens=1\) needs 1 .* has 0 left"):
    s.extend({"params": params}, conv, jax.random.key(1), max_tokens=1)

  exact, roomy = _turns(s, params, prompts, 12), _turns(s, params, prompts, 30)
  for a, b in zip(exact, roomy):
    np.testing.assert_allclose(a, b, atol=1e-6)
  with pytest.raises(ValueError, match=r"extend\(max_tokens=5\) needs 5 .* has 4 left"):
    _turns(s, params, prompts, 11)


def test_rows_that_stop_early_leave_their_room_to_later_calls(multiturn):
  """The host counts max_tokens per extend; where rows stopped early the device's slot decides."""
  params, prompts = multiturn["params"], multiturn["prompts"]
  s = sampler_lib.Sampler(multiturn["cfg"], max_new_tokens=6, buckets=(8,), pad_id=PAD,
                          stop_ids=range(96))  # every row stops at its first token
  conv = s.begin({"params": params}, prompts, room=4)
  out, conv = s.extend({"params": params}, conv, None, max_tokens=3, greedy=True)
  assert int(out["steps"]) == 1
  # slots 9..11 of 12
  out, conv = s.extend({"params": params}, conv, None, max_tokens=3, greedy=True)
  assert int(out["steps"]) == 1
  with pytest.raises(ValueError, match=r"extend\(max_tokens=3\) needs 3 .* has 2 left"):
    s.extend({"params": params}, conv, None, max_tokens=3, greedy=True)


def test_inactive_rows_are_not_truncated(multiturn):
  """truncated means max_tokens reached without a stop id: a row passed active=False produced
  nothing, so it is not truncated."""
  params, prompts = multiturn["params"], multiturn["prompts"]
  s = sampler_lib.Sampler(multiturn["cfg"], max_new_tokens=3, buckets=(8,), pad_id=PAD)
  conv = s.begin({"params": params}, prompts, room=3)
  out, _ = s.extend({"params": params}, conv, None, max_tokens=3, active=[True, False], greedy=True)
  np.testing.assert_array_equal(np.asarray(out["lengths"]), [3, 0])
  np.testing.assert_array_equal(np.asarray(out["truncated"]), [True, False])
