"""LoRA adapters (grpo_jax.models.lora) against independent references: the base model bit for
bit at b = 0, finite differences for the adapters' gradients, the parameter count by formula and
by peft, peft's LoRA on the transformers model (logits and greedy generation), transformers
loading the merged checkpoint, and one device against fsdp / tensor meshes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fixtures
from grpo_jax import sharding
from grpo_jax.models import lora, qwen, weights

VOCAB = 128
ALL = tuple(lora.TARGETS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpts")
  return {kind: fixtures.make_checkpoint(root, kind, VOCAB)
          for kind in ("qwen2_untied", "qwen2_tied", "qwen3")}


def _batch(seed=0, batch=3, length=9):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (batch, length))
  mask = np.ones((batch, length), np.int32)
  for b, pad in enumerate([(0, 2, 5)[b % 3] for b in range(batch)]):  # left padding, 3 lengths
    mask[b, :pad] = 0
    tokens[b, :pad] = 0
  return jnp.asarray(tokens), jnp.asarray(mask)


def _logits_fn(model, lcfg):
  def f(params, adapters, tokens, mask):
    variables = lora.variables(params, adapters, lcfg)
    hidden, _ = model.apply(variables, tokens, qwen.positions_from_mask(mask), mask)
    return model.apply(variables, hidden, method=qwen.Qwen.logits)
  return f


def _trained_like(adapters, seed, std):
  """Adapters with b (and a) moved off their init, as training would leave them. (NumPy's
  generator, in float64, then each leaf's dtype: an eager jax.random.normal per leaf shape was
  a compile each, 6 s of this file's first call.)"""
  leaves, tree = jax.tree.flatten(adapters)
  rng = np.random.default_rng(seed)
  moved = [np.asarray(x, np.float64) + std * rng.standard_normal(x.shape) for x in leaves]
  return tree.unflatten([jnp.asarray(m, x.dtype) for m, x in zip(moved, leaves)])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_zero_b_gives_the_base_model_bit_for_bit(checkpoints, dtype):
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_untied"], param_dtype=dtype)
  lcfg = lora.LoraConfig(rank=4, alpha=8)
  adapters = lora.init(jax.random.key(0), cfg, lcfg)
  assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(adapters)
             if x.shape[-1] == lcfg.rank)  # a is random: only b = 0 keeps the model
  f = jax.jit(_logits_fn(qwen.Qwen(cfg, dtype=dtype), lcfg))
  tokens, mask = _batch()
  base = np.asarray(f(params, None, tokens, mask))
  adapted = np.asarray(f(params, adapters, tokens, mask))
  np.testing.assert_array_equal(adapted, base)


def test_init_follows_peft_defaults():
  cfg = qwen.QwenConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=12)
  adapters = lora.init(jax.random.key(1), cfg, lora.LoraConfig(rank=8, alpha=16))
  for t, (parent, _) in lora.TARGETS.items():
    a = np.asarray(adapters["layers"][parent][t]["lora_a"])
    b = np.asarray(adapters["layers"][parent][t]["lora_b"])
    fan_in = {"o_proj": 4 * 12, "down_proj": 80}.get(t, 48)
    bound = 1 / np.sqrt(fan_in)  # torch kaiming_uniform_(a=sqrt(5)) on lora_A's [r, in]
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.9 * bound, t
    assert abs(a.std() - bound / np.sqrt(3)) < 0.15 * bound / np.sqrt(3), t  # U(-c, c): c/√3
    assert not b.any(), t


def test_bf16_adapters_are_scaled_by_the_exact_alpha_over_r():
  """alpha 16, rank 6 (alpha / r = 2.6667; 2.671875 in bf16) on bf16 adapters, as
  optim.param_dtype='bfloat16' makes them: the delta the forward adds (qwen.project's low-rank
  path on x = the identity, fp32 compute) is NumPy's float64 (alpha / r)·a·b to fp32 rounding,
  and the scaled b that bf16 compute reads is float64 (alpha / r)·b rounded once to bf16. (A
  bf16 tolerance on the delta would not do: bf16(16 / 6) is off by 2^-9, one bf16 rounding.)"""
  cfg = qwen.QwenConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=12)
  lcfg = lora.LoraConfig(rank=6, alpha=16)
  adapters = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                          _trained_like(lora.init(jax.random.key(0), cfg, lcfg), 1, 0.3))
  a, b = (adapters["layers"]["self_attn"]["q_proj"][k][0] for k in ("lora_a", "lora_b"))
  b_scaled = lora.variables(None, adapters, lcfg)["lora"]["layers"]["self_attn"]["q_proj"][
      "lora_b"][0]
  want = 16 / 6 * np.einsum("dr,rnh->dnh", np.asarray(a, np.float64), np.asarray(b, np.float64))
  eye = jnp.eye(48, dtype=jnp.float32)
  delta = qwen.project("BD,DnH->BnH", eye, jnp.zeros((48, 4, 12)), (a, b_scaled))
  np.testing.assert_allclose(np.asarray(delta, np.float64), want, rtol=1e-5,
                             atol=1e-6 * np.abs(want).max())
  np.testing.assert_array_equal(b_scaled.astype(jnp.bfloat16),
                                (16 / 6 * np.asarray(b, np.float64)).astype(jnp.bfloat16))


def _loss(model, lcfg, tokens, mask):
  """A smooth scalar of the logits: the mean log-prob of the next tokens."""
  f = _logits_fn(model, lcfg)

  def loss(adapters, params):
    logp = jax.nn.log_softmax(f(params, adapters, tokens, mask)[:, :-1], axis=-1)
    tok = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = mask[:, 1:].astype(logp.dtype)
    return (tok * w).sum() / w.sum()
  return loss


def test_adapter_gradients_match_finite_differences():
  with jax.enable_x64(True):
    cfg = qwen.QwenConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
    params = qwen.init_params(cfg, jax.random.key(0), param_dtype=jnp.float64)
    params = jax.tree.map(lambda x: x * 8 if x.ndim > 2 else x, params)  # away from linear
    lcfg = lora.LoraConfig(rank=3, alpha=5)
    adapters = _trained_like(lora.init(jax.random.key(1), cfg, lcfg, jnp.float64), 2, 0.3)
    tokens, mask = _batch(1)
    model = qwen.Qwen(cfg, dtype=jnp.float64, param_dtype=jnp.float64)

    @jax.jit
    def loss(adapters, params):
      # Logits in float64 here (Qwen.logits returns fp32, whose rounding of a loss near 5 would
      # swamp the differences). The model's norms and softmax still round to fp32 inside, a
      # noise of ~1e-8 in the loss: hence steps of 1e-2 and 2e-2, combined (Richardson) so
      # that the curvature's h² error cancels too.
      hidden, _ = model.apply(lora.variables(params, adapters, lcfg), tokens,
                              qwen.positions_from_mask(mask), mask)
      logp = jax.nn.log_softmax((hidden @ qwen.head_kernel(params, cfg))[:, :-1], axis=-1)
      tok = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      w = mask[:, 1:].astype(logp.dtype)
      return (tok * w).sum() / w.sum()

    grads = jax.jit(jax.grad(loss))(adapters, params)
    assert loss(adapters, params).dtype == jnp.float64
    leaves, tree = jax.tree.flatten(adapters)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]]
    rng = np.random.default_rng(0)
    checked = 0
    for i, (x, g) in enumerate(zip(leaves, jax.tree.leaves(grads))):
      g = np.asarray(g)
      # Along a random unit direction of this leaf, and along its largest-gradient entry.
      one = np.zeros(x.shape)
      one[np.unravel_index(np.abs(g).argmax(), x.shape)] = 1
      for v in (rng.normal(size=x.shape), one):
        v = v / np.linalg.norm(v)
        shift = lambda s: tree.unflatten(
            [y + s * v if j == i else y for j, y in enumerate(leaves)])
        central = lambda h: (float(loss(shift(h), params)) - float(loss(shift(-h), params))) / (
            2 * h)
        fd = (4 * central(1e-2) - central(2e-2)) / 3
        an = float((g * v).sum())
        assert abs(an) > 1e-4, names[i]  # a gradient that says something
        assert abs(fd - an) <= 1e-5 + 1e-3 * abs(an), (names[i], fd, an)
        checked += 1
    assert checked == 2 * 2 * len(lora.TARGETS)


def test_b_zero_gives_zero_gradient_for_a_and_remat_changes_nothing():
  cfg = qwen.QwenConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8)
  params = qwen.init_params(cfg, jax.random.key(0))
  lcfg = lora.LoraConfig(rank=2, alpha=4, targets=("k_proj", "o_proj", "up_proj"))
  adapters = lora.init(jax.random.key(1), cfg, lcfg)
  tokens, mask = _batch(2)
  # Each gradient compiled whole (eagerly, every op of the forward and backward was a compile).
  grad = lambda model: jax.jit(jax.grad(_loss(model, lcfg, tokens, mask)))
  grads = grad(qwen.Qwen(cfg))(adapters, params)
  for t in lcfg.targets:
    g = grads["layers"][lora.TARGETS[t][0]][t]
    assert not np.asarray(g["lora_a"]).any(), t  # d/da of (x·a)·b at b = 0
    assert np.abs(np.asarray(g["lora_b"])).max() > 1e-6, t
  moved = _trained_like(adapters, 3, 0.2)
  plain = grad(qwen.Qwen(cfg))(moved, params)
  remat = grad(qwen.Qwen(cfg, remat=True))(moved, params)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), plain, remat)


def test_kv_cache_decode_and_packed_groups_carry_the_adapters(checkpoints):
  """The sampler's path (prefill, then one token at a time into the KV cache) and the train
  step's (Qwen.packed: a prompt once, then its G completions) give the adapted full forward."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen3"])
  lcfg = lora.LoraConfig(rank=3, alpha=6)
  adapters = _trained_like(lora.init(jax.random.key(0), cfg, lcfg), 1, 0.3)
  variables = lora.variables(params, adapters, lcfg)
  model = qwen.Qwen(cfg)
  tokens, mask = _batch(7, batch=3, length=10)
  pos = qwen.positions_from_mask(mask)
  want, _ = model.apply(variables, tokens, pos, mask)
  base, _ = model.apply(lora.variables(params, None, lcfg), tokens, pos, mask)
  real = np.asarray(mask).astype(bool)
  assert np.abs(np.asarray(want - base))[real].max() > 0.05

  p = 6
  cache = qwen.init_cache(cfg, 3, 10)
  hidden, cache = model.apply(variables, tokens[:, :p], pos[:, :p], mask, cache=cache,
                              cache_index=0)
  steps = [hidden]
  for t in range(p, 10):
    hidden, cache = model.apply(variables, tokens[:, t:t + 1], pos[:, t:t + 1], mask,
                                cache=cache, cache_index=t)
    steps.append(hidden)
  # Both fp32 paths sit up to ~2.5e-5 from this model's float64 forward (hidden states up to
  # 3.9; measured with the full forward in float64: full 2.2e-5, cache 9.9e-6 with
  # jax.nn.dot_product_attention; 1.9e-5 and 2.5e-5 with the earlier einsum attention), so they
  # agree with each other to within the sum of their errors, not to 1e-5. A dropped adapter
  # moves them by > 0.05 (above).
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1))[real],
                             np.asarray(want)[real], atol=5e-5)

  # Packed: rows 0..2 as the G = 3 completions (4 tokens each) of prompt row 0's first 6 tokens.
  g, c = 3, 4
  full_tokens = jnp.concatenate([jnp.repeat(tokens[:1, :p], g, 0), tokens[:, p:]], 1)
  full_mask = jnp.concatenate([jnp.repeat(mask[:1, :p], g, 0), jnp.ones((g, c), jnp.int32)], 1)
  full_pos = qwen.positions_from_mask(full_mask)
  want_full, _ = model.apply(variables, full_tokens, full_pos, full_mask)
  pack = lambda x: jnp.concatenate([x[:1, :p], x[:, p:].reshape(1, g * c)], 1)
  got, _ = qwen.Qwen(cfg, packed=(p, g)).apply(variables, pack(full_tokens), pack(full_pos),
                                                (mask[:1, :p], full_mask))
  # Hidden states of order 1 summed in another order: fp32 rounding, as for the cache above.
  np.testing.assert_allclose(np.asarray(got[:, p:]).reshape(g, c, -1),
                             np.asarray(want_full[:, p:]), atol=1e-5)


def _expected_count(cfg, lcfg):
  """rank × (in_features + out_features) per target and layer, from the transformers shapes."""
  d, i, q, kv = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                 cfg.num_kv_heads * cfg.head_dim)
  features = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}
  return cfg.num_layers * sum(lcfg.rank * sum(features[t]) for t in lcfg.targets)


@pytest.mark.parametrize("lcfg", [lora.LoraConfig(rank=8, alpha=16),
                                  lora.LoraConfig(rank=3, alpha=1, targets=("q_proj", "v_proj")),
                                  lora.LoraConfig(rank=5, alpha=5, targets=("o_proj", "down_proj"))])
def test_trainable_count_is_rank_times_in_plus_out(checkpoints, lcfg):
  import peft

  path = checkpoints["qwen3"]  # head_dim 24 != 64 / 4: q's out and o's in are 96, not 64
  cfg = weights.read_config(path)
  count = lora.num_trainable(lora.abstract(cfg, lcfg))
  assert count == _expected_count(cfg, lcfg)
  # Real sizes: Qwen2.5-1.5B, rank 16 on all seven projections.
  big = qwen.QwenConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                        num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128)
  all16 = lora.LoraConfig(rank=16, alpha=32)
  assert lora.num_trainable(lora.abstract(big, all16)) == _expected_count(big, all16) == 18464768
  # peft's own count on the transformers model.
  model = peft.get_peft_model(fixtures.hf_model(path), peft.LoraConfig(
      r=lcfg.rank, lora_alpha=lcfg.alpha, target_modules=list(lcfg.targets)))
  trainable, _ = model.get_nb_trainable_parameters()
  assert count == trainable


def _greedy(f, params, adapters, prompt, steps):
  """argmax of the full forward, one token at a time, in a buffer of the final length (causal:
  the zeros after position t do not change its logits), so the forward compiles once."""
  p = prompt.shape[1]
  tokens = jnp.pad(jnp.asarray(prompt), ((0, 0), (0, steps)))
  for t in range(p, p + steps):
    logits = f(params, adapters, tokens, jnp.ones_like(tokens))
    tokens = tokens.at[:, t].set(jnp.argmax(logits[:, t - 1], -1))
  return np.asarray(tokens)


@pytest.mark.parametrize("kind,lcfg", [
    ("qwen2_untied", lora.LoraConfig(rank=4, alpha=8)),
    ("qwen3", lora.LoraConfig(rank=3, alpha=5, targets=("q_proj", "o_proj", "down_proj"))),
    ("qwen2_tied", lora.LoraConfig(rank=2, alpha=2, targets=("v_proj", "gate_proj", "up_proj"))),
])
def test_peft_loads_the_adapter_and_the_merged_export_loads_in_transformers(
    checkpoints, kind, lcfg, tmp_path):
  import peft

  path = checkpoints[kind]
  params, cfg = weights.load_checkpoint(path)
  adapters = _trained_like(lora.init(jax.random.key(0), cfg, lcfg), 1, 0.3)
  f = jax.jit(_logits_fn(qwen.Qwen(cfg), lcfg))
  tokens, mask = _batch(3)
  ours = np.asarray(f(params, adapters, tokens, mask))
  real = np.asarray(mask).astype(bool)
  base = np.asarray(f(params, None, tokens, mask))
  assert np.abs(ours - base)[real].max() > 0.05  # the adapters matter

  out = lora.save_peft(adapters, cfg, lcfg, tmp_path / "adapter", base_model=str(path))
  model = peft.PeftModel.from_pretrained(fixtures.hf_model(path), out).eval()
  assert sorted(model.peft_config["default"].target_modules) == sorted(lcfg.targets)
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(np.asarray(tokens)),
                   attention_mask=torch.tensor(np.asarray(mask))).logits.numpy()
  assert np.abs(ours - theirs)[real].max() <= 1e-4

  prompt = np.asarray(tokens[:1, :])  # the unpadded row, twice with a different last token
  prompt = np.concatenate([prompt, prompt], 0)
  prompt[1, -1] = (prompt[1, -1] + 1) % VOCAB
  want = _greedy(f, params, adapters, prompt, 12)
  model.generation_config.eos_token_id = None  # run all 12 steps on both sides
  with torch.no_grad():
    got = model.generate(input_ids=torch.tensor(prompt), attention_mask=torch.ones_like(
        torch.tensor(prompt)), do_sample=False, max_new_tokens=12, pad_token_id=0).numpy()
  np.testing.assert_array_equal(want, got)

  merged_dir = lora.save_merged(params, adapters, cfg, lcfg, tmp_path / "merged")
  with torch.no_grad():
    merged = fixtures.hf_model(merged_dir)(input_ids=torch.tensor(np.asarray(tokens)),
                                           attention_mask=torch.tensor(np.asarray(mask)))
  assert np.abs(ours - merged.logits.numpy())[real].max() <= 1e-4
  reloaded, _ = weights.load_checkpoint(merged_dir)
  again = np.asarray(f(reloaded, None, tokens, mask))
  assert np.abs(ours - again)[real].max() <= 1e-4


@pytest.mark.parametrize("kind,targets", [("qwen3", ALL), ("qwen2_tied", ("k_proj", "o_proj"))])
def test_an_adapter_peft_saved_loads_with_peft_logits(checkpoints, kind, targets, tmp_path):
  import peft

  path = checkpoints[kind]
  torch.manual_seed(0)
  model = peft.get_peft_model(fixtures.hf_model(path), peft.LoraConfig(
      r=3, lora_alpha=7, target_modules=list(targets)))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.normal_(0, 0.3)  # PEFT starts b at 0: move it, as training would
  model.save_pretrained(tmp_path / "peft")
  model.eval()
  tokens, mask = _batch(6)
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(np.asarray(tokens)),
                   attention_mask=torch.tensor(np.asarray(mask))).logits.numpy()

  params, cfg = weights.load_checkpoint(path)
  adapters, lcfg = lora.load_peft(tmp_path / "peft", cfg)
  assert (lcfg.rank, lcfg.alpha, sorted(lcfg.targets)) == (3, 7, sorted(targets))
  ours = np.asarray(jax.jit(_logits_fn(qwen.Qwen(cfg), lcfg))(params, adapters, tokens, mask))
  real = np.asarray(mask).astype(bool)
  assert np.abs(ours - theirs)[real].max() <= 1e-4
  # Saved again, the tensors are PEFT's own, name for name and bit for bit.
  from safetensors.numpy import load_file
  again = lora.save_peft(adapters, cfg, lcfg, tmp_path / "again")
  want, got = load_file(tmp_path / "peft" / lora.WEIGHTS_FILE), load_file(again / lora.WEIGHTS_FILE)
  assert sorted(want) == sorted(got)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])


def test_load_peft_refuses_what_the_model_does_not_compute(checkpoints, tmp_path):
  import json

  params, cfg = weights.load_checkpoint(checkpoints["qwen2_untied"])
  lcfg = lora.LoraConfig(rank=2, alpha=4, targets=("q_proj",))
  out = lora.save_peft(lora.init(jax.random.key(0), cfg, lcfg), cfg, lcfg, tmp_path / "a")
  config = json.loads((out / lora.CONFIG_FILE).read_text())
  for field, value, match in (("use_dora", True, "use_dora=True"),
                              ("layers_pattern", "blocks", "layers_pattern='blocks'"),
                              ("layers_to_transform", [5], "layer 5 does not exist"),
                              ("peft_type", "IA3", "peft_type='IA3'"),
                              ("target_modules", ["lm_head"], "model.lora.targets"),
                              ("r", 3, "has shape \\(2, 64\\); r=3")):
    (out / lora.CONFIG_FILE).write_text(json.dumps({**config, field: value}))
    with pytest.raises(weights.CheckpointError, match=match):
      lora.load_peft(out, cfg)
  (out / lora.WEIGHTS_FILE).unlink()
  with pytest.raises(weights.CheckpointError, match="adapter_model.safetensors: missing"):
    lora.load_peft(out, cfg)


def test_save_peft_refuses_adapters_its_config_does_not_describe(checkpoints, tmp_path):
  """Adapters on q_proj and v_proj saved with targets ('q_proj',) would give a file whose
  v_proj tensors PEFT skips without a word (a different model); a rank other than lcfg.rank
  would fail only in PEFT. Both stop with a line, and nothing is written."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_untied"])
  lcfg = lora.LoraConfig(rank=2, alpha=4, targets=("q_proj", "v_proj"))
  adapters = lora.init(jax.random.key(0), cfg, lcfg)
  fewer = dataclasses.replace(lcfg, targets=("q_proj",))
  with pytest.raises(ValueError, match=r"hold \['v_proj'\], which model.lora.targets "
                                       r"\['q_proj'\] does not name"):
    lora.save_peft(adapters, cfg, fewer, tmp_path / "a")
  with pytest.raises(ValueError, match="the adapters' q_proj has rank 2, model.lora.rank is 3"):
    lora.save_peft(adapters, cfg, dataclasses.replace(lcfg, rank=3), tmp_path / "a")
  assert not (tmp_path / "a").exists()
  assert (lora.save_peft(adapters, cfg, lcfg, tmp_path / "a") / lora.WEIGHTS_FILE).is_file()


@pytest.mark.parametrize("field,value,extra_tensor", [
    ("lora_bias", True, "q_proj.lora_B.bias"),
    ("trainable_token_indices", [3, 5], "token_adapter.trainable_tokens_delta"),
    ("alora_invocation_tokens", [7], None),
    ("layer_replication", [[0, 2], [1, 2]], None),
    ("exclude_modules", ["model.layers.1.self_attn.q_proj"], None),
    ("init_lora_weights", "olora", None),
])
def test_load_peft_refuses_peft_variants_it_does_not_compute(checkpoints, tmp_path, field, value,
                                                             extra_tensor):
  """Adapters PEFT builds with a variant of plain LoRA (a B bias, token deltas, invocation-gated,
  replicated layers, modules left out, a rewritten base) compute something else: load_peft
  refuses the field, and with the field reset, names the variant's own tensors."""
  import json
  import peft
  from safetensors.numpy import load_file

  path = checkpoints["qwen3"]
  torch.manual_seed(0)
  model = peft.get_peft_model(fixtures.hf_model(path), peft.LoraConfig(
      r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], **{field: value}))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name or "trainable_tokens" in name:
        p.normal_(0, 0.3)
  model.save_pretrained(tmp_path / "peft")
  config_file = tmp_path / "peft" / lora.CONFIG_FILE
  config = json.loads(config_file.read_text())
  assert config[field] == value  # PEFT wrote the variant where load_peft looks for it
  params, cfg = weights.load_checkpoint(path)
  with pytest.raises(weights.CheckpointError,
                     match=rf"peft/adapter_config\.json: {field}=.*not supported"):
    lora.load_peft(tmp_path / "peft", cfg)
  if extra_tensor is None:
    return
  saved = load_file(tmp_path / "peft" / lora.WEIGHTS_FILE)
  assert any(name.endswith(extra_tensor) for name in saved)
  config_file.write_text(json.dumps({**config, field: None}))
  with pytest.raises(weights.CheckpointError, match=rf"peft/adapter_model\.safetensors: tensor "
                     rf"'[^']*{extra_tensor}' \(\d+ such\) is not a lora_A/lora_B"):
    lora.load_peft(tmp_path / "peft", cfg)


def test_load_peft_refuses_tensors_of_targets_it_was_not_told(checkpoints, tmp_path):
  import json

  _, cfg = weights.load_checkpoint(checkpoints["qwen2_untied"])
  lcfg = lora.LoraConfig(rank=2, alpha=4, targets=("q_proj", "v_proj"))
  out = lora.save_peft(lora.init(jax.random.key(0), cfg, lcfg), cfg, lcfg, tmp_path / "a")
  config = json.loads((out / lora.CONFIG_FILE).read_text())
  (out / lora.CONFIG_FILE).write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
  with pytest.raises(weights.CheckpointError, match=r"tensor 'base_model\.model\.model\.layers"
                     r"\.0\.self_attn\.v_proj\.lora_A\.weight' \(4 such\)"):
    lora.load_peft(out, cfg)


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 2, 4), (2, 2, 2)])
def test_sharded_adapters_give_the_one_device_forward_and_gradients(checkpoints, mesh_shape):
  path = checkpoints["qwen2_untied"]
  params, cfg = weights.load_checkpoint(path)
  lcfg = lora.LoraConfig(rank=4, alpha=8)
  adapters = _trained_like(lora.init(jax.random.key(0), cfg, lcfg), 1, 0.2)
  tokens, mask = _batch(4, batch=8)

  loss = _loss(qwen.Qwen(cfg), lcfg, tokens, mask)
  step = jax.jit(jax.value_and_grad(loss))
  logits = jax.jit(_logits_fn(qwen.Qwen(cfg), lcfg))
  want_loss, want_grads = step(adapters, params)
  want_logits = logits(params, adapters, tokens, mask)

  mesh = sharding.make_mesh(mesh_shape)
  p_sh = sharding.param_shardings(qwen.logical_axes(cfg), qwen.abstract_params(cfg), mesh)
  a_sh = sharding.param_shardings(lora.logical_axes(cfg, lcfg), lora.abstract(cfg, lcfg), mesh)
  s_params, s_adapters = jax.device_put(params, p_sh), jax.device_put(adapters, a_sh)
  fsdp, tensor = mesh_shape[1], mesh_shape[2]
  q = s_adapters["layers"]["self_attn"]["q_proj"]
  assert q["lora_a"].addressable_shards[0].data.shape == (cfg.num_layers, 64 // fsdp, 4)
  assert q["lora_b"].addressable_shards[0].data.shape == (cfg.num_layers, 4, 4 // tensor,
                                                          cfg.head_dim)
  down = s_adapters["layers"]["mlp"]["down_proj"]
  assert down["lora_a"].addressable_shards[0].data.shape == (cfg.num_layers, 96 // tensor, 4)
  assert down["lora_b"].addressable_shards[0].data.shape == (cfg.num_layers, 4, 64 // fsdp)

  batch = sharding.batch_sharding(mesh)
  s_tokens, s_mask = jax.device_put(tokens, batch), jax.device_put(mask, batch)
  s_loss_fn = _loss(qwen.Qwen(cfg), lcfg, s_tokens, s_mask)
  got_loss, got_grads = jax.jit(jax.value_and_grad(s_loss_fn), out_shardings=(None, a_sh))(
      s_adapters, s_params)
  got_logits = logits(s_params, s_adapters, s_tokens, s_mask)
  np.testing.assert_allclose(got_logits, want_logits, atol=2e-5)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5 * scale), got_grads,
               want_grads)
  assert got_grads["layers"]["mlp"]["down_proj"]["lora_b"].sharding == a_sh["layers"]["mlp"][
      "down_proj"]["lora_b"]


def test_bad_settings_name_the_field():
  with pytest.raises(ValueError, match="model.lora.rank"):
    lora.LoraConfig(rank=0, alpha=1)
  with pytest.raises(ValueError, match="model.lora.alpha"):
    lora.LoraConfig(rank=4, alpha=0)
  with pytest.raises(ValueError, match="model.lora.targets.*qkv_proj"):
    lora.LoraConfig(rank=4, alpha=8, targets=("q_proj", "qkv_proj"))
  with pytest.raises(ValueError, match="model.lora.dropout"):
    lora.LoraConfig(rank=4, alpha=8, dropout=0.05)
  with pytest.raises(ValueError, match="unknown field.*'r'"):
    lora.LoraConfig.from_config({"rank": 4, "alpha": 8, "r": 4})
  assert lora.LoraConfig.from_config({"rank": 0, "alpha": 8}) is None
  assert lora.LoraConfig.from_config(
      {"rank": 4, "alpha": 8, "targets": ["q_proj"]}).targets == ("q_proj",)
  assert dataclasses.replace(lora.LoraConfig(rank=4, alpha=6), rank=2).scale == 3.0


def test_vmapped_members_share_one_base():
  """K adapters with a leading K axis, vmapped over one unbatched base (a LoRA sweep), each with
  its own alpha / r: every member's loss and gradients are those of its own plain run."""
  cfg = qwen.QwenConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8)
  params = qwen.init_params(cfg, jax.random.key(0))
  lcfg = lora.LoraConfig(rank=2, alpha=4)
  members = [_trained_like(lora.init(jax.random.key(k), cfg, lcfg), 10 + k, 0.2) for k in range(3)]
  scales = jnp.array([0.5, 2.0, 3.0])
  tokens, mask = _batch(5)
  model = qwen.Qwen(cfg)

  def loss(adapters, scale):
    variables = lora.variables(params, adapters, lcfg, scale=scale)
    hidden, _ = model.apply(variables, tokens, qwen.positions_from_mask(mask), mask)
    logp = jax.nn.log_softmax(model.apply(variables, hidden, method=qwen.Qwen.logits), -1)
    return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean()

  stacked = jax.tree.map(lambda *x: jnp.stack(x), *members)
  values, grads = jax.jit(jax.vmap(jax.value_and_grad(loss)))(stacked, scales)
  for k, member in enumerate(members):
    value, grad = jax.jit(jax.value_and_grad(loss))(member, scales[k])
    np.testing.assert_allclose(values[k], value, rtol=1e-6)
    # Batched and plain matmuls round differently: to 1e-5 of each gradient's scale.
    jax.tree.map(lambda x, y: np.testing.assert_allclose(
        x[k], y, rtol=1e-5, atol=1e-5 * float(jnp.abs(y).max())), grads, grad)
  # The scale is alpha / r by default.
  assert float(loss(members[0], None)) == float(loss(members[0], lcfg.scale))


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_merged_policy_computes_the_adapted_model_and_shares_the_base(checkpoints, quantize):
  """What the sampler runs with merge_for_sampling: W + (alpha / r)·a·b in the targets gives the
  unmerged adapted logits (fp32: within rounding); every other leaf, biases included, is the
  base's own array; an int8 base keeps its untargeted projections int8."""
  from grpo_jax.models import quant  # pylint: disable=import-outside-toplevel
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_untied"])
  base = quant.quantize(params) if quantize == "int8" else params
  lcfg = lora.LoraConfig(rank=4, alpha=8, targets=("q_proj", "up_proj", "down_proj"),
                         quantize=quantize)
  adapters = _trained_like(lora.init(jax.random.key(0), cfg, lcfg), 2, 0.2)
  merged = lora.merged_policy(base, adapters, lcfg, jax.jit(
      lambda p, a: lora.merged_kernels(p, a, lcfg)))
  # The default (eager) merge is the same computation as the jitted one the trainer passes.
  eager = lora.merged_policy(base, adapters, lcfg)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(merged)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  attn = merged["layers"]["self_attn"]
  assert attn["q_proj"]["bias"] is base["layers"]["self_attn"]["q_proj"]["bias"]
  assert merged["embed_tokens"]["embedding"] is base["embed_tokens"]["embedding"]
  assert set(attn["q_proj"]) == {"kernel", "bias"}
  assert attn["k_proj"] is not base["layers"]["self_attn"]["k_proj"]  # a new dict ...
  for name, leaf in attn["k_proj"].items():  # ... holding the base's arrays
    assert leaf is base["layers"]["self_attn"]["k_proj"][name]
  if quantize == "int8":
    assert attn["k_proj"]["kernel_q"].dtype == jnp.int8
  # By hand for one target: the base kernel (dequantized) plus scale · a·b over the rank.
  node = base["layers"]["mlp"]["up_proj"]
  w = (node["kernel_q"].astype(np.float32) * np.asarray(node["kernel_scale"])[:, None, :]
       if quantize == "int8" else np.asarray(node["kernel"]))
  ab = adapters["layers"]["mlp"]["up_proj"]
  want = w + lcfg.scale * np.einsum("lir,lro->lio", ab["lora_a"], ab["lora_b"])
  np.testing.assert_allclose(np.asarray(merged["layers"]["mlp"]["up_proj"]["kernel"]), want,
                             rtol=1e-6, atol=1e-6)

  f = jax.jit(_logits_fn(qwen.Qwen(cfg), lcfg))
  tokens, mask = _batch(3)
  real = np.asarray(mask).astype(bool)
  unmerged = np.asarray(f(base, adapters, tokens, mask))
  assert np.abs(unmerged - np.asarray(f(base, None, tokens, mask)))[real].max() > 0.05
  np.testing.assert_allclose(np.asarray(f(merged, None, tokens, mask))[real], unmerged[real],
                             atol=2e-5)


# --- PEFT's LoraConfig options: rsLoRA, rank / alpha patterns, layers, full module paths --------

OPTION_CASES = {  # name: (fixture kind, peft.LoraConfig's keyword arguments)
    "rslora": ("qwen2_untied", dict(r=4, lora_alpha=8, use_rslora=True, target_modules=ALL)),
    "patterns": ("qwen3", dict(r=4, lora_alpha=8, target_modules=ALL, rank_pattern={
        "down_proj": 2, "model.layers.1.self_attn.q_proj": 6}, alpha_pattern={"v_proj": 3.0})),
    "patterns_rslora": ("qwen2_untied", dict(r=3, lora_alpha=6, use_rslora=True,
                                             target_modules=ALL, rank_pattern={"mlp.gate_proj": 5},
                                             alpha_pattern={"layers.0.self_attn.o_proj": 2.0})),
    "layers": ("qwen2_untied", dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj",
                                                                       "down_proj"],
                                    layers_to_transform=[1])),
    "full_paths": ("qwen3", dict(r=2, lora_alpha=4, target_modules=[
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.up_proj", "model.layers.0.mlp.down_proj"])),
    "modules_to_save": ("qwen2_untied", dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                             modules_to_save=["embed_tokens", "lm_head"])),
}


def _ours(kw) -> lora.LoraConfig:
  """The LoraConfig of peft.LoraConfig keyword arguments."""
  return lora.LoraConfig(rank=kw["r"], alpha=kw["lora_alpha"], targets=tuple(kw["target_modules"]),
                         use_rslora=kw.get("use_rslora", False),
                         rank_pattern=kw.get("rank_pattern"), alpha_pattern=kw.get("alpha_pattern"),
                         layers_to_transform=tuple(kw.get("layers_to_transform", ())),
                         modules_to_save=tuple(kw.get("modules_to_save", ())))


def _peft_modules(model, cfg):
  """{(target, layer): (r, scaling)} of the LoRA layers peft built, (0, 0.0) where none."""
  out = {}
  for t in lora.TARGETS:
    for i in range(cfg.num_layers):
      m = model.base_model.model.get_submodule(lora.module_path(i, t))
      out[t, i] = (m.r["default"], m.scaling["default"]) if hasattr(m, "r") else (0, 0.0)
  return out


def _layout_modules(lcfg, cfg):
  lay = lora.layout(lcfg, cfg.num_layers)
  none = ((0,) * cfg.num_layers, (0.0,) * cfg.num_layers)
  return {(t, i): (lay.get(t, none)[0][i], lay.get(t, none)[1][i])
          for t in lora.TARGETS for i in range(cfg.num_layers)}


def _peft_logits(model, tokens, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(np.asarray(tokens)),
                 attention_mask=torch.tensor(np.asarray(mask))).logits.numpy()


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_peft_options_train_export_and_load_with_peft_logits(checkpoints, case, tmp_path):
  """Each option as grpo_jax trains it (adapters moved off their init, padding included) and
  exports it: peft builds the same modules with the same ranks and scalings from our
  adapter_config.json and computes our logits. And as peft trains it: load_peft reads peft's
  save_pretrained into the same layout, with peft's logits."""
  import peft

  kind, kw = OPTION_CASES[case]
  params, cfg = weights.load_checkpoint(checkpoints[kind])
  lcfg = _ours(kw)
  f = jax.jit(_logits_fn(qwen.Qwen(cfg), lcfg))
  tokens, mask = _batch(4)
  real = np.asarray(mask).astype(bool)

  adapters = _trained_like(lora.init(jax.random.key(0), cfg, lcfg, params=params), 1, 0.3)
  ours = np.asarray(f(params, adapters, tokens, mask))
  assert np.abs(ours - np.asarray(f(params, None, tokens, mask)))[real].max() > 0.05
  out = lora.save_peft(adapters, cfg, lcfg, tmp_path / "ours")
  model = peft.PeftModel.from_pretrained(fixtures.hf_model(checkpoints[kind]), out).eval()
  assert _peft_modules(model, cfg) == _layout_modules(lcfg, cfg)
  assert np.abs(ours - _peft_logits(model, tokens, mask))[real].max() <= 1e-4

  torch.manual_seed(0)
  theirs_model = peft.get_peft_model(fixtures.hf_model(checkpoints[kind]),
                                     peft.LoraConfig(**kw)).eval()
  assert _peft_modules(theirs_model, cfg) == _layout_modules(lcfg, cfg)
  with torch.no_grad():
    for name, p in theirs_model.named_parameters():
      if "lora_B" in name or "modules_to_save" in name:  # trained: B, and the modules' copies
        p.add_(0.3 * torch.randn_like(p))
  theirs_model.save_pretrained(tmp_path / "peft")
  loaded, loaded_cfg = lora.load_peft(tmp_path / "peft", cfg)
  assert lora.layout(loaded_cfg, cfg.num_layers) == lora.layout(lcfg, cfg.num_layers)
  got = np.asarray(jax.jit(_logits_fn(qwen.Qwen(cfg), loaded_cfg))(params, loaded, tokens, mask))
  assert np.abs(got - _peft_logits(theirs_model, tokens, mask))[real].max() <= 1e-4


def test_padding_of_smaller_ranks_never_trains(checkpoints):
  """A layer whose module has a smaller rank than its target's largest, or none, keeps zero
  columns of a and rows of b (init), and their gradients are exactly zero, so no optimizer moves
  them; the adapted model's logits ignore whatever they hold."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_untied"])
  lcfg = _ours(OPTION_CASES["patterns_rslora"][1])
  lcfg = dataclasses.replace(lcfg, layers_to_transform=(1,))  # gate_proj: layer 1 only
  adapters = lora.init(jax.random.key(0), cfg, lcfg)
  a = np.asarray(adapters["layers"]["mlp"]["gate_proj"]["lora_a"])  # [L, D, 5]
  assert not a[0].any() and np.abs(a[1]).min() > 0
  assert not np.asarray(adapters["layers"]["self_attn"]["q_proj"]["lora_a"])[0].any()
  tokens, mask = _batch(5)
  moved = _trained_like(adapters, 2, 0.3)
  grads = jax.jit(jax.grad(_loss(qwen.Qwen(cfg), lcfg, tokens, mask)))(moved, params)
  g = grads["layers"]["mlp"]["gate_proj"]
  assert not np.asarray(g["lora_a"])[0].any() and not np.asarray(g["lora_b"])[0].any()
  assert np.abs(np.asarray(g["lora_b"])[1]).max() > 1e-6
  # The padding of `moved` holds noise; zeroed, the logits are the same to the bit.
  rel = lora._relative_scales(lcfg, cfg.num_layers)  # pylint: disable=protected-access
  cleaned = jax.tree.map(lambda x: x, moved)
  for t, (parent, n_in) in lora.TARGETS.items():
    on = jnp.asarray(rel[t] > 0)  # [L, R]
    node = cleaned["layers"][parent][t]
    node["lora_a"] = node["lora_a"] * on.reshape(on.shape[0], *([1] * n_in), -1)
    node["lora_b"] = node["lora_b"] * on.reshape(*on.shape, *([1] * (node["lora_b"].ndim - 2)))
  f = jax.jit(_logits_fn(qwen.Qwen(cfg), lcfg))
  np.testing.assert_array_equal(np.asarray(f(params, moved, tokens, mask)),
                                np.asarray(f(params, cleaned, tokens, mask)))


def test_a_two_layer_all_linear_peft_adapter_with_full_paths_loads(checkpoints, tmp_path):
  """peft's target_modules='all-linear' on a 2-layer model saves its 14 modules as full paths
  (peft shortens the list to names only from 20 modules up): load_peft reads it with peft's
  logits, and save_peft writes it back so that peft builds the same modules again."""
  import json
  import peft

  path = checkpoints["qwen2_untied"]
  torch.manual_seed(1)
  model = peft.get_peft_model(fixtures.hf_model(path), peft.LoraConfig(
      r=2, lora_alpha=3, target_modules="all-linear")).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_B" in name:
        p.normal_(0, 0.3)
  model.save_pretrained(tmp_path / "peft")
  saved = json.loads((tmp_path / "peft" / lora.CONFIG_FILE).read_text())["target_modules"]
  assert len(saved) == 14 and all(t.startswith("model.layers.") for t in saved)
  params, cfg = weights.load_checkpoint(path)
  adapters, lcfg = lora.load_peft(tmp_path / "peft", cfg)
  tokens, mask = _batch(6)
  real = np.asarray(mask).astype(bool)
  ours = np.asarray(jax.jit(_logits_fn(qwen.Qwen(cfg), lcfg))(params, adapters, tokens, mask))
  assert np.abs(ours - _peft_logits(model, tokens, mask))[real].max() <= 1e-4
  again = peft.PeftModel.from_pretrained(
      fixtures.hf_model(path), lora.save_peft(adapters, cfg, lcfg, tmp_path / "again")).eval()
  assert _peft_modules(again, cfg) == _peft_modules(model, cfg)
  assert np.abs(ours - _peft_logits(again, tokens, mask))[real].max() <= 1e-4


def test_modules_to_save_train_copies_and_leave_the_reference_alone(checkpoints):
  """modules_to_save: fresh copies equal the base's modules (the policy is the reference: is
  reference true), a moved copy changes the policy but not the reference (adapters off), its
  gradient is the full model's gradient of that module at the same weights, and a tied model is
  refused with a line naming the field."""
  from grpo_jax import policy as policy_lib
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_untied"])
  lcfg = lora.LoraConfig(rank=2, alpha=4, targets=("q_proj",),
                         modules_to_save=("model.embed_tokens", "lm_head"))
  assert lcfg.modules_to_save == ("embed_tokens", "lm_head")
  pol = policy_lib.Lora(lcfg)
  fresh = pol.init_trainable(params, cfg, 0, jnp.float32)
  np.testing.assert_array_equal(fresh["lm_head"], params["lm_head"])
  assert bool(pol.is_reference(fresh, params, jnp.float32))
  moved = dict(fresh, lm_head=fresh["lm_head"] + 0.1)
  assert not bool(pol.is_reference(moved, params, jnp.float32))
  tokens, mask = _batch(2)
  grads = jax.jit(jax.grad(_loss(qwen.Qwen(cfg), lcfg, tokens, mask)))(fresh, params)
  full = jax.jit(jax.grad(lambda p: _loss(qwen.Qwen(cfg), lcfg, tokens, mask)(None, p)))(params)
  for m in ("embed_tokens", "lm_head"):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7),
                 grads[m], full[m])
  assert np.abs(np.asarray(grads["lm_head"])).max() > 1e-6
  _, tied = weights.load_checkpoint(checkpoints["qwen2_tied"])
  with pytest.raises(ValueError, match="model.lora.modules_to_save.*tie_word_embeddings"):
    lora.init(jax.random.key(0), tied, lcfg, params=params)
