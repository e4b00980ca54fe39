"""The Flax Qwen forward against transformers (PyTorch, fp32) on tiny random checkpoints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fixtures
from grpo_jax import sampler as sampler_lib, sharding
from grpo_jax.models import qwen, weights

VOCAB = 128


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpts")
  return {kind: fixtures.make_checkpoint(root, kind, VOCAB) for kind in fixtures.KINDS}


def _left_padded_batch(seed=0, batch=4, length=11):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, (batch, length))
  mask = np.ones((batch, length), np.int32)
  for b, pad in enumerate([0, 3, 6, 10][:batch]):  # different prompt lengths, one of length 1
    mask[b, :pad] = 0
    tokens[b, :pad] = 0
  return tokens, mask


def _reference_logits(path, tokens, mask):
  model = fixtures.hf_model(path)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask))
  return out.logits.numpy()


def _our_logits(params, cfg, tokens, mask, dtype=jnp.float32):
  model = qwen.Qwen(cfg, dtype=dtype)

  @jax.jit
  def f(params, tokens, mask):
    hidden, _ = model.apply({"params": params}, tokens, qwen.positions_from_mask(mask), mask)
    return model.apply({"params": params}, hidden, method=qwen.Qwen.logits)

  return np.asarray(f(params, jnp.asarray(tokens), jnp.asarray(mask)))


@pytest.mark.parametrize("kind", fixtures.KINDS)
def test_logits_match_transformers_with_left_padding(checkpoints, kind):
  tokens, mask = _left_padded_batch()
  params, cfg = weights.load_checkpoint(checkpoints[kind])
  ours = _our_logits(params, cfg, tokens, mask)
  ref = _reference_logits(checkpoints[kind], tokens, mask)
  real = mask.astype(bool)
  assert np.abs(ours - ref)[real].max() <= 1e-4
  # Left padding is exact: each row's logits equal those of the same prompt alone, unpadded.
  for b in range(len(tokens)):
    alone = _our_logits(params, cfg, tokens[b:b + 1, real[b]], mask[b:b + 1, real[b]])
    np.testing.assert_allclose(ours[b, real[b]], alone[0], atol=1e-5)


def test_config_switches_follow_the_checkpoint(checkpoints):
  tied = weights.read_config(checkpoints["qwen2_tied"])
  q3 = weights.read_config(checkpoints["qwen3"])
  assert tied.tie_word_embeddings and tied.qkv_bias and not tied.qk_norm
  assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 24 != q3.hidden_size // q3.num_heads
  params, _ = weights.load_checkpoint(checkpoints["qwen2_tied"])
  assert "lm_head" not in params  # the tied head is the embedding


@pytest.mark.parametrize("mesh_shape", [(1, 4, 2), (2, 2, 2)])
@pytest.mark.parametrize("kind", ["qwen2_untied", "qwen3"])
def test_sharded_forward_matches_transformers(checkpoints, kind, mesh_shape):
  mesh = sharding.make_mesh(mesh_shape)
  params, cfg = weights.load_checkpoint(checkpoints[kind], mesh=mesh)
  # The params really are split: over fsdp along 'embed' and over tensor along heads/mlp/vocab.
  up = params["layers"]["mlp"]["up_proj"]["kernel"]
  assert up.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  assert up.addressable_shards[0].data.shape == (cfg.num_layers, 64 // mesh_shape[1],
                                                 96 // mesh_shape[2])
  tokens, mask = _left_padded_batch()
  batch = sharding.batch_sharding(mesh)
  ours = _our_logits(params, cfg, jax.device_put(tokens, batch), jax.device_put(mask, batch))
  ref = _reference_logits(checkpoints[kind], tokens, mask)
  assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4


def test_bf16_params_and_compute(checkpoints):
  """bf16 weights and activations against the fp32 reference.

  Measured on this fixture (logits of std 0.16): max abs error 4.0e-3, about one bf16 step
  (relative 2^-8) of the larger activations, accumulated over 2 layers. The bound is 3x the
  measurement, and the argmax must agree wherever fp32's top two logits are further apart.
  """
  path = checkpoints["qwen2_untied"]
  tokens, mask = _left_padded_batch()
  params, cfg = weights.load_checkpoint(path, param_dtype=jnp.bfloat16)
  assert params["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.bfloat16
  ours = _our_logits(params, cfg, tokens, mask, dtype=jnp.bfloat16)
  ref = _reference_logits(path, tokens, mask)
  real = mask.astype(bool)
  err = np.abs(ours - ref)[real]
  assert err.max() <= 1.2e-2, err.max()
  top2 = np.sort(ref, axis=-1)[..., -2:]
  clear = real & (top2[..., 1] - top2[..., 0] > 1.2e-2)
  np.testing.assert_array_equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_kv_cache_prefill_then_decode_equals_full_forward(checkpoints):
  params, cfg = weights.load_checkpoint(checkpoints["qwen3"])
  model = qwen.Qwen(cfg)
  tokens, mask = _left_padded_batch(seed=1)
  full = _our_logits(params, cfg, tokens, mask)
  prompt_len, total = 7, tokens.shape[1]
  cache = qwen.init_cache(cfg, tokens.shape[0], total)
  slot_mask = jnp.asarray(mask)  # every slot's validity is known up front here
  pos = qwen.positions_from_mask(slot_mask)
  hidden, cache = model.apply({"params": params}, jnp.asarray(tokens[:, :prompt_len]),
                              pos[:, :prompt_len], slot_mask, cache=cache, cache_index=0)
  steps = [hidden]
  for t in range(prompt_len, total):
    hidden, cache = model.apply({"params": params}, jnp.asarray(tokens[:, t:t + 1]),
                                pos[:, t:t + 1], slot_mask, cache=cache, cache_index=t)
    steps.append(hidden)
  logits = np.asarray(model.apply({"params": params}, jnp.concatenate(steps, 1),
                                  method=qwen.Qwen.logits))
  real = mask.astype(bool)
  assert np.abs(logits - full)[real].max() <= 1e-5


def test_packed_prompt_and_completions_equal_the_full_forward(checkpoints):
  """Qwen.packed: a row [prompt, completion 1, ..., completion G] gives each completion's hidden
  states of the full forward over [prompt, completion] (and the prompt's own)."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen3"])
  g, c = 3, 4
  prompts, pmask = _left_padded_batch(seed=2, batch=2, length=7)  # one prompt left-padded by 3
  rng = np.random.default_rng(3)
  comp = rng.integers(1, VOCAB, (2 * g, c))
  cmask = np.ones((2 * g, c), np.int32)
  cmask[1, 2:] = 0  # a completion that ended early (its tail is padding)
  full_tokens = np.concatenate([np.repeat(prompts, g, 0), comp], 1)
  full_mask = np.concatenate([np.repeat(pmask, g, 0), cmask], 1)
  full_pos = qwen.positions_from_mask(jnp.asarray(full_mask))
  want, _ = qwen.Qwen(cfg).apply({"params": params}, full_tokens, full_pos, full_mask)

  pack = lambda x: jnp.concatenate([x[::g, :7], x[:, 7:].reshape(2, g * c)], 1)
  got, _ = qwen.Qwen(cfg, packed=(7, g)).apply(
      {"params": params}, pack(full_tokens), pack(full_pos), (pmask, full_mask))
  real = full_mask.astype(bool)
  np.testing.assert_allclose(np.asarray(got[:, 7:]).reshape(2 * g, c, -1)[real[:, 7:]],
                             np.asarray(want[:, 7:])[real[:, 7:]], atol=2e-6)
  np.testing.assert_allclose(np.asarray(got[:, :7])[pmask.astype(bool)],
                             np.asarray(want[::g, :7])[pmask.astype(bool)], atol=2e-6)
  with pytest.raises(ValueError, match="packed call takes no cache"):
    qwen.Qwen(cfg, packed=(7, g)).apply({"params": params}, pack(full_tokens), pack(full_pos),
                                        (pmask, full_mask), cache=qwen.init_cache(cfg, 2, 40),
                                        cache_index=0)


def test_bidirectional_attention_sees_later_tokens_and_cannot_decode(checkpoints):
  """is_causal=false: changing a row's last token changes its first position's output (it
  never does causally); padding still hides the pad slots; a KV cache is refused."""
  params, cfg = weights.load_checkpoint(checkpoints["qwen2_bidirectional"])
  assert not cfg.is_causal
  causal_cfg = dataclasses.replace(cfg, is_causal=True)
  tokens, mask = _left_padded_batch()
  edited = tokens.copy()
  edited[:, -1] = (edited[:, -1] + 1) % VOCAB
  real = mask.astype(bool)
  first = real.argmax(1)  # each row's first real slot
  rows = np.flatnonzero(first < tokens.shape[1] - 1)  # rows with more than one real token
  for c, sees_later in ((cfg, True), (causal_cfg, False)):
    a, b = _our_logits(params, c, tokens, mask), _our_logits(params, c, edited, mask)
    change = np.abs(a - b)[rows, first[rows]].max(-1)
    if sees_later:
      assert change.min() > 1e-3, change
    else:
      assert change.max() == 0.0, change
  # The bidirectional forward is not the causal one (which transformers' is_causal=false
  # checkpoint would then fail to match in test_logits_match_transformers_with_left_padding).
  diff = np.abs(_our_logits(params, cfg, tokens, mask) - _our_logits(params, causal_cfg, tokens,
                                                                     mask))[real]
  assert diff.max() > 1e-2
  model = qwen.Qwen(cfg)
  with pytest.raises(qwen.BidirectionalDecodeError, match="bidirectional"):
    model.apply({"params": params}, jnp.asarray(tokens), qwen.positions_from_mask(mask),
                jnp.asarray(mask), cache=qwen.init_cache(cfg, len(tokens), tokens.shape[1]),
                cache_index=0)
  with pytest.raises(qwen.BidirectionalDecodeError, match="cannot generate token by token"):
    sampler_lib.Sampler(model, max_new_tokens=4)


@pytest.mark.parametrize("kind", ["qwen2_tied", "qwen3"])
def test_head_dim_missing_from_config_json_follows_transformers(kind, tmp_path):
  """A config.json without head_dim: Qwen3Config defaults it to 128, Qwen2's attention takes
  hidden_size // heads (16 here). The head_dim transformers' attention builds is ours."""
  import json

  import transformers

  hf = fixtures.hf_config(kind).to_dict()
  hf.pop("head_dim", None)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  model = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.from_pretrained(tmp_path))
  attn = model.model.layers[0].self_attn
  assert attn.head_dim == {"qwen2_tied": 16, "qwen3": 128}[kind]
  assert attn.q_proj.weight.shape == (4 * attn.head_dim, 64)
  assert weights.read_config(tmp_path).head_dim == attn.head_dim
  if kind == "qwen3":
    with pytest.raises(ValueError, match="config.json: head_dim=None must be a positive integer"):
      qwen.QwenConfig.from_hf(hf | {"head_dim": None})


def _transformers_error(hf, tmp_path):
  """What transformers says when it builds and runs the model of config.json `hf` (None: it
  runs): the independent judge of whether the config means anything."""
  import json

  import transformers

  (tmp_path / "config.json").write_text(json.dumps(hf))
  try:
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tmp_path))
    with torch.no_grad():
      model(input_ids=torch.zeros((1, 8), dtype=torch.long))
  except Exception as e:  # whatever it raises: the config does not run there
    return f"{type(e).__name__}: {e}"
  return None


@pytest.mark.parametrize("fields,match", [
    # transformers 5's per-layer-type RoPE: read as flat, it gave the default theta, no scaling.
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 5e5,
                                             "factor": 4.0}}},
     r"rope_parameters: RoPE parameters per layer type \(\['full_attention'\]\)"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
     "layer_types entry 'sliding_attention' is not supported"),
    ({"layer_types": ["linear_attention", "full_attention"]},
     "layer_types entry 'linear_attention' is not supported"),
    ({"layer_types": ["full_attention"] * 3},
     r"layer_types=.* must list one entry per layer \(num_hidden_layers=2\)"),
    ({"use_sliding_window": "false"}, "use_sliding_window must be true or false, got 'false'"),
    ({"hidden_size": 60, "head_dim": None}, "head_dim=15 must be even"),  # 60 / 4 heads
])
def test_configs_transformers_cannot_run_are_refused_naming_the_field(fields, match, tmp_path):
  hf = fixtures.hf_config("qwen2_tied").to_dict()
  hf = {k: v for k, v in (hf | fields).items() if v is not None}
  assert _transformers_error(hf, tmp_path) is not None
  with pytest.raises(ValueError, match=f"config.json: {match}"):
    qwen.QwenConfig.from_hf(hf)
  # The same config with only full attention, flat default RoPE and an even head_dim runs in
  # both: the refusal is about the field named, nothing else.
  fine = fixtures.hf_config("qwen2_tied").to_dict()
  assert _transformers_error(fine, tmp_path) is None
  assert qwen.QwenConfig.from_hf(fine).head_dim == 16


def test_config_roundtrip_and_bad_configs():
  cfg = qwen.QwenConfig.from_hf(fixtures.hf_config("qwen3").to_dict())
  assert qwen.QwenConfig.from_hf(cfg.to_hf()) == cfg
  assert cfg.is_causal and "is_causal" not in cfg.to_hf()  # causal exports are unchanged
  bidir = qwen.QwenConfig.from_hf(fixtures.hf_config("qwen2_bidirectional").to_dict())
  assert not bidir.is_causal and bidir.to_hf()["is_causal"] is False
  assert qwen.QwenConfig.from_hf(bidir.to_hf()) == bidir
  with pytest.raises(ValueError, match="is_causal must be true or false"):
    qwen.QwenConfig.from_hf(fixtures.hf_config("qwen2_tied").to_dict() | {"is_causal": "no"})
  with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
    qwen.QwenConfig.from_hf({"model_type": "llama"})
  bad = fixtures.hf_config("qwen2_tied").to_dict() | {"rope_parameters": {"rope_type": "yarn"}}
  with pytest.raises(ValueError, match="rope type 'yarn'"):
    qwen.QwenConfig.from_hf(bad)
  with pytest.raises(ValueError, match="num_kv_heads"):
    qwen.QwenConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=3, num_kv_heads=2, head_dim=4)


def test_abstract_params_and_axes_are_the_inits_own_and_safe_to_edit():
  """abstract_params / logical_axes come from a cache of the init's shapes keyed by (config,
  dtype): they equal a fresh jax.eval_shape of the init for every dtype asked (bf16 between
  two fp32 requests, so a cache that ignored the dtype fails), and a caller that edits what it
  got (quant.logical_axes does) leaves the next caller's tree as it was. That the init is
  traced once is a speed matter and not asserted here."""
  import flax.linen as nn
  cfg = qwen.QwenConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=8)

  def fresh(dtype):
    boxed = jax.eval_shape(lambda k: qwen.Qwen(cfg, param_dtype=dtype).init(
        k, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
        jnp.ones((1, 1), jnp.int32)), jax.random.key(1))
    return nn.unbox(boxed)["params"], nn.get_partition_spec(boxed)["params"]

  shape = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float32):
    want_params, want_axes = fresh(dtype)
    got = qwen.abstract_params(cfg, dtype)
    assert shape(got) == shape(want_params)
    assert qwen.logical_axes(cfg) == want_axes
    got["embed_tokens"]["embedding"] = None
    got.pop("norm")
    axes = qwen.logical_axes(cfg)
    axes["layers"].clear()
  assert shape(qwen.abstract_params(cfg)) == shape(fresh(jnp.float32)[0])
  assert qwen.logical_axes(cfg) == fresh(jnp.float32)[1]
