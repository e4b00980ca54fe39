"""qwen.attend against two references: the dense einsum the model used first, and JAX's own
jax.nn.dot_product_attention (XLA kernel), which the model used in between.

`einsum_attend` below is the first implementation, kept verbatim as the reference (keys and
values [B, K, S, H], fp32 scores, the most negative finite fp32 on masked slots). The model is
compared with it in fp32 on CPU in the three places attention runs: a prefill into the KV cache
and decode steps from it, the plain forward, and the packed training forward (a prompt followed
by its G completions). The transformers parity tests stay in qwen_test.py.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import qwen

CFG = qwen.QwenConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=10000.0)
TOL = 1e-5


def einsum_attend(q_BTNH, k_BKSH, v_BKSH, attn_mask_BS, start, causal=True):
  b, t, n, h = q_BTNH.shape
  kh, s = k_BKSH.shape[1], k_BKSH.shape[2]
  q = q_BTNH.reshape(b, t, kh, n // kh, h)
  scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k_BKSH,
                      preferred_element_type=jnp.float32) * (h ** -0.5)
  visible_BTS = jnp.broadcast_to(attn_mask_BS[:, None, :] > 0, (b, t, s))
  if causal:
    q_slot = start + jnp.arange(t)
    visible_BTS = visible_BTS & (jnp.arange(s)[None, :] <= q_slot[:, None])[None]
  scores = jnp.where(visible_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BKSH.dtype)
  out_BKGTH = jnp.einsum("BKGTS,BKSH->BKGTH", probs, v_BKSH)
  return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def reference_attend(q_BTNH, k, v, attn_mask_BS, start, causal=True, implementation=None, *,
                     heads_first=False):
  """qwen.attend's signature over the einsum reference (which wants heads before slots)."""
  del implementation
  if not heads_first:
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  return einsum_attend(q_BTNH, k, v, attn_mask_BS, start, causal)


def _qkv(b, t, s, n=6, k=2, h=16, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32)
  values = jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32)
  mask = np.ones((b, s), np.int32)
  for row, pad in enumerate([0, 2, 5, s - 1][:b]):  # left padding, one row with a single slot
    mask[row, :pad] = 0
  return q, keys, values, jnp.asarray(mask)


# (T, S, start, causal): a prefill / training forward (queries fill the slots from 0), a decode
# step and an appended turn at a traced slot, a static offset (the packed completions), and a
# bidirectional model.
CASES = {"prefill": (9, 9, 0, True), "decode": (1, 12, "traced 7", True),
         "append": (3, 12, "traced 5", True), "offset": (4, 10, 6, True),
         "bidirectional": (9, 9, 0, False)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attend_matches_the_einsum_reference(case):
  t, s, start, causal = CASES[case]
  q, k, v, mask = _qkv(4, t, s)
  if isinstance(start, str):  # a cache_index: a traced int32, as Qwen passes it
    slot = jnp.int32(int(start.split()[1]))
    got = jax.jit(lambda q, k, v, m, i: qwen.attend(q, k, v, m, i, causal))(q, k, v, mask, slot)
    want = jax.jit(lambda q, k, v, m, i: reference_attend(q, k, v, m, i, causal))(
        q, k, v, mask, slot)
  else:
    got = qwen.attend(q, k, v, mask, start, causal)
    want = reference_attend(q, k, v, mask, start, causal)
  assert got.shape == q.shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_attend_matches_jax_dot_product_attention(case):
  """Against JAX's kernel with the same rule as an explicit [B, 1, T, S] mask, on the queries
  at real slots (a query that sees no key is a pad, whose output is never read); with the keys
  in the cache's [B, K, S, H] layout (heads_first) too."""
  t, s, start, causal = CASES[case]
  q, k, v, mask = _qkv(4, t, s, seed=3)
  slot = int(start.split()[1]) if isinstance(start, str) else start
  visible = np.asarray(mask)[:, None, None, :] > 0
  if causal:
    visible = visible & (np.arange(s)[None, :] <= slot + np.arange(t)[:, None])
  want = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(visible), implementation="xla")
  real_rows = np.asarray(mask)[:, slot:slot + t].astype(bool) if causal else np.ones((4, t), bool)
  heads_first = lambda a: a.transpose(0, 2, 1, 3)
  for got in (qwen.attend(q, k, v, mask, start if isinstance(start, int) else jnp.int32(slot),
                          causal),
              qwen.attend(q, heads_first(k), heads_first(v), mask, jnp.int32(slot), causal,
                          heads_first=True) if causal else None):
    if got is None:
      continue
    np.testing.assert_allclose(np.asarray(got)[real_rows], np.asarray(want)[real_rows],
                               atol=TOL, rtol=0)


def test_update_slice_under_vmap_is_the_batched_write():
  """qwen.update_slice (the KV cache write) under jax.vmap equals the vmapped
  dynamic_update_slice, and while the start indices are shared it is no scatter (JAX's own
  batching of dynamic_update_slice gives one, which XLA:CPU ran as a select over the whole
  cache)."""
  rng = np.random.default_rng(4)
  cache = jnp.asarray(rng.standard_normal((3, 2, 4, 2, 6, 5)), jnp.float32)  # [M, L, B, K, S, H]
  new = jnp.asarray(rng.standard_normal((3, 1, 4, 2, 1, 5)), jnp.float32)
  starts = lambda layer, slot: tuple(jnp.int32(i) for i in (layer, 0, 0, slot, 0))
  plain = jax.vmap(jax.lax.dynamic_update_slice, in_axes=(0, 0, None))
  ours = jax.jit(jax.vmap(qwen.update_slice, in_axes=(0, 0, None)))
  np.testing.assert_array_equal(np.asarray(ours(cache, new, starts(1, 3))),
                                np.asarray(plain(cache, new, starts(1, 3))))
  jaxpr = lambda f: str(jax.make_jaxpr(jax.vmap(f, in_axes=(0, 0, None)))(cache, new,
                                                                         starts(1, 3)))
  assert "scatter" in jaxpr(jax.lax.dynamic_update_slice)  # what update_slice avoids
  assert "scatter" not in jaxpr(qwen.update_slice)
  # An update shared by the members, and start indices that differ per member.
  shared = jax.vmap(qwen.update_slice, in_axes=(0, None, None))(cache, new[0], starts(0, 5))
  np.testing.assert_array_equal(np.asarray(shared), np.asarray(
      jax.vmap(jax.lax.dynamic_update_slice, in_axes=(0, None, None))(cache, new[0],
                                                                      starts(0, 5))))
  slots = jnp.asarray([0, 2, 5], jnp.int32)
  per_member = lambda f: jax.vmap(lambda c, u, s: f(c, u, (jnp.int32(1), jnp.int32(0),
                                                           jnp.int32(0), s, jnp.int32(0))))
  np.testing.assert_array_equal(
      np.asarray(per_member(qwen.update_slice)(cache, new, slots)),
      np.asarray(per_member(jax.lax.dynamic_update_slice)(cache, new, slots)))


@pytest.mark.parametrize("t, s, start", [(9, 9, 0), (8, 8, 0), (3, 12, 9), (4, 11, 7)])
def test_cudnn_padding_to_even_lengths_changes_nothing(t, s, start):
  """cuDNN trains with a bias only at even T and S, so qwen pads odd ones. The padding runs here
  through the XLA kernel: outputs and gradients equal the unpadded attention's."""
  q, k, v, mask = _qkv(4, t, s, seed=1)

  def padded(q, k, v):
    visible = (mask > 0)[:, None, None, :] & (jnp.arange(s)[None, :] <= start + jnp.arange(t)[:,
                                                                                           None])
    return qwen._cudnn_attend(q, k, v, jnp.broadcast_to(visible, (4, 1, t, s)),
                              start == 0 and t == s, implementation="xla")

  plain = lambda q, k, v: reference_attend(q, k, v, mask, start)
  # A query that sees no key (a left-pad slot) averages every slot, the padded one too: its
  # output is never used, so only the queries at real slots (which see themselves) count.
  real_rows = np.asarray(mask)[:, start:start + t].astype(bool)
  # Each side compiled whole (eagerly, every op of the forward and backward was a compile).
  np.testing.assert_allclose(np.asarray(jax.jit(padded)(q, k, v))[real_rows],
                             np.asarray(jax.jit(plain)(q, k, v))[real_rows], atol=TOL, rtol=0)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.where(real_rows[:, :, None, None], f(q, k, v), 0)
                                           * jnp.cos(q))
  for g_pad, g_ref in zip(jax.jit(jax.grad(loss(padded), (0, 1, 2)))(q, k, v),
                          jax.jit(jax.grad(loss(plain), (0, 1, 2)))(q, k, v)):
    np.testing.assert_allclose(np.asarray(g_pad), np.asarray(g_ref), atol=TOL, rtol=0)


def test_backward_keeps_q_k_v_not_the_scores(capsys):
  """The gradient of attend saves its inputs and the boolean mask, never a [.., T, S] float
  array (scores or probabilities): the backward recomputes them (qwen.attend's checkpoint)."""
  from jax import ad_checkpoint
  q, k, v, mask = _qkv(2, 5, 7)
  ad_checkpoint.print_saved_residuals(lambda q, k, v: qwen.attend(q, k, v, mask, 2).sum(), q, k,
                                      v)
  saved = capsys.readouterr().out.strip().splitlines()
  assert len(saved) == 4, saved
  assert all(line.startswith(("f32[2,5,6,16]", "f32[2,7,2,16]", "bool[2,1,5,7]"))
             for line in saved), saved


@pytest.fixture(scope="module")
def params():
  return qwen.init_params(CFG, jax.random.key(0))


def _left_padded(seed, batch, length):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, CFG.vocab_size, (batch, length))
  mask = np.ones((batch, length), np.int32)
  for b, pad in enumerate([0, 3, 5, length - 1][:batch]):
    mask[b, :pad] = 0
    tokens[b, :pad] = 0
  return jnp.asarray(tokens), jnp.asarray(mask)


def _both(monkeypatch, fn):
  """fn() under qwen.attend and under the einsum reference."""
  got = fn()
  with monkeypatch.context() as m:
    m.setattr(qwen, "attend", reference_attend)
    want = fn()
  return got, want


def _force_layout(monkeypatch, heads_major):
  """Every platform's scores in one layout of q: the CPU runs the tokens' order by default
  (qwen.scores_einsum), so the heads' order (every other platform's) is tested here through
  this."""
  if heads_major is not None:
    layout = qwen.scores_einsum
    monkeypatch.setattr(qwen, "scores_einsum",
                        lambda q, k, *, kv, heads_major: layout(q, k, kv=kv, heads_major=True))


@pytest.mark.parametrize("heads_major", [None, True])
def test_forward_prefill_and_decode_match_the_einsum_reference(params, monkeypatch, heads_major):
  _force_layout(monkeypatch, heads_major)
  model = qwen.Qwen(CFG)
  tokens, mask = _left_padded(0, 4, 12)
  pos = qwen.positions_from_mask(mask)
  prompt = 7

  def run():  # each call compiled whole (traced under the attention run() is called with)
    full, _ = jax.jit(model.apply)({"params": params}, tokens, pos, mask)
    step = jax.jit(lambda c, tok, p, i: model.apply({"params": params}, tok, p, mask, c, i))
    hidden, cache = jax.jit(model.apply, static_argnums=5)(
        {"params": params}, tokens[:, :prompt], pos[:, :prompt], mask[:, :prompt],
        qwen.init_cache(CFG, 4, prompt), 0)
    # The prefill filled a prompt-sized cache; decode from a 12-slot copy of it, one token at a
    # time at a traced slot, as the sampler does.
    cache = jax.tree.map(lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, 12 - prompt), (0, 0))), cache)
    steps = [hidden]
    for t in range(prompt, 12):
      hidden, cache = step(cache, tokens[:, t:t + 1], pos[:, t:t + 1], jnp.int32(t))
      steps.append(hidden)
    return full, jnp.concatenate(steps, 1), cache

  (full, decoded, cache), (full_ref, decoded_ref, cache_ref) = _both(monkeypatch, run)
  real = np.asarray(mask).astype(bool)
  np.testing.assert_allclose(np.asarray(full)[real], np.asarray(full_ref)[real], atol=TOL,
                             rtol=0)
  np.testing.assert_allclose(np.asarray(decoded)[real], np.asarray(decoded_ref)[real], atol=TOL,
                             rtol=0)
  np.testing.assert_allclose(np.asarray(decoded)[real], np.asarray(full)[real], atol=TOL, rtol=0)
  for name in ("k", "v"):
    np.testing.assert_allclose(np.asarray(cache[name]), np.asarray(cache_ref[name]), atol=TOL,
                               rtol=0)


@pytest.mark.parametrize("heads_major", [None, True])
def test_packed_training_forward_and_gradient_match_the_einsum_reference(params, monkeypatch,
                                                                          heads_major):
  """The packed forward of qwen.Qwen.packed with its two masks (the prompt's, and the
  completions' over [prompt, completion]; one completion ended early), and its gradient."""
  _force_layout(monkeypatch, heads_major)
  g, c, p = 3, 5, 7
  prompts, pmask = _left_padded(1, 2, p)
  rng = np.random.default_rng(2)
  comp = jnp.asarray(rng.integers(1, CFG.vocab_size, (2 * g, c)))
  cmask = np.ones((2 * g, c), np.int32)
  cmask[1, 3:] = 0
  full_tokens = jnp.concatenate([jnp.repeat(prompts, g, 0), comp], 1)
  full_mask = jnp.concatenate([jnp.repeat(pmask, g, 0), jnp.asarray(cmask)], 1)
  full_pos = qwen.positions_from_mask(full_mask)
  pack = lambda x: jnp.concatenate([x[::g, :p], x[:, p:].reshape(2, g * c)], 1)
  model = qwen.Qwen(CFG, packed=(p, g))
  weight = jnp.asarray(rng.standard_normal((2, p + g * c, CFG.hidden_size)), jnp.float32)

  def run():
    def loss(params):
      hidden, _ = model.apply({"params": params}, pack(full_tokens), pack(full_pos),
                              (pmask, full_mask))
      return jnp.sum(hidden * weight), hidden
    (_, hidden), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return hidden, grads

  (hidden, grads), (hidden_ref, grads_ref) = _both(monkeypatch, run)
  real = np.concatenate([np.asarray(pmask), np.asarray(full_mask)[:, p:].reshape(2, -1)], 1)
  np.testing.assert_allclose(np.asarray(hidden)[real.astype(bool)],
                             np.asarray(hidden_ref)[real.astype(bool)], atol=TOL, rtol=0)
  # The gradients reach 1e2 here, so fp32 rounding differs in absolute terms: each leaf agrees
  # to TOL relative to its largest entry (measured: under 5e-7).
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= TOL * np.abs(b).max()


@pytest.mark.parametrize("kv", ["BSKH", "BKSH"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scores_einsum_layouts_agree_with_numpy(kv, dtype):
  """Both layouts of q give q·k per kv head and query head, and the same gradients of q and k,
  against NumPy in float64 (to the dtype's rounding)."""
  rng = np.random.default_rng(3)
  b, t, kh, g, h, s = 2, 5, 2, 3, 16, 7
  q = rng.normal(size=(b, t, kh, g, h))
  k_bskh = rng.normal(size=(b, s, kh, h))
  k = k_bskh if kv == "BSKH" else k_bskh.transpose(0, 2, 1, 3)
  ct = rng.normal(size=(b, kh, g, t, s))  # a cotangent for the scores
  want = np.einsum("btkgh,bskh->bkgts", q, k_bskh)
  want_dq = np.einsum("bkgts,bskh->btkgh", ct, k_bskh)
  want_dk = np.einsum("bkgts,btkgh->bskh", ct, q)
  want_dk = want_dk if kv == "BSKH" else want_dk.transpose(0, 2, 1, 3)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2 * np.abs(want).max()
  for heads_major in (False, True):
    fn = lambda q, k: qwen.scores_einsum(q, k, kv=kv, heads_major=heads_major)
    got, vjp = jax.vjp(fn, jnp.asarray(q, dtype), jnp.asarray(k, dtype))
    dq, dk = vjp(jnp.asarray(ct, jnp.float32))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=tol, rtol=0)
    for a, w in ((dq, want_dq), (dk, want_dk)):
      scale = 1e-5 if dtype == jnp.float32 else 3e-2
      np.testing.assert_allclose(np.asarray(a, np.float64), w, atol=scale * np.abs(w).max(),
                                 rtol=0)


def test_attention_setting_is_checked():
  with pytest.raises(ValueError, match="attention='flash' is not one of"):
    CFG.with_run(attention="flash")
  assert "attention" not in CFG.with_run(attention="xla").to_hf()
  q, k, v, mask = _qkv(2, 4, 4)
  with pytest.raises(ValueError, match="attention='cudnn' needs bf16 or fp16 compute"):
    qwen.attend(q, k, v, mask, 0, True, "cudnn")
  # A decode step (one query) runs XLA's kernel under 'cudnn' too: it runs here, on CPU.
  q1 = q[:, :1].astype(jnp.bfloat16)
  kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(qwen.attend(q1, kb, vb, mask, jnp.int32(3), True, "cudnn"), np.float32),
      np.asarray(qwen.attend(q1, kb, vb, mask, jnp.int32(3), True, None), np.float32))
  # 'xla' is the same kernel as JAX's default today.
  np.testing.assert_array_equal(np.asarray(qwen.attend(q, k, v, mask, 0, True, "xla")),
                                np.asarray(qwen.attend(q, k, v, mask, 0, True, None)))


def test_config_model_attention_reaches_the_model_config():
  from configs import gsm8k
  from grpo_jax import inputs, validate
  config = gsm8k.get_config("tiny")
  tokenizer = list(range(config.model.tiny.vocab_size))  # model_config needs only its length
  assert inputs.model_config(config, tokenizer)[0].run.attention is None
  config.model.attention = "cudnn"
  assert inputs.model_config(config, tokenizer)[0].run.attention == "cudnn"
  config.model.attention = "flash"
  with pytest.raises(validate.ConfigError, match="config.model.attention='flash' is not one of"):
    inputs.model_config(config, tokenizer)
