"""Loading and exporting Hugging Face checkpoints: round trips, dtypes, and errors that name
the bad file or tensor."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import fixtures
from grpo_jax.models import qwen, weights
from grpo_jax.errors import UserError

VOCAB = 128


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpts")
  return {kind: fixtures.make_checkpoint(root, kind, VOCAB) for kind in fixtures.KINDS}


def _hf_logits(path, tokens):
  with torch.no_grad():
    return fixtures.hf_model(path)(input_ids=torch.tensor(tokens)).logits.numpy()


def _trees_equal(a, b):
  return jax.tree.all(jax.tree.map(
      lambda x, y: x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), a, b))


@pytest.mark.parametrize("kind", ["qwen2_tied", "qwen2_untied", "qwen3", "qwen2_bidirectional"])
def test_export_loads_in_transformers_with_identical_logits(ckpts, kind, tmp_path):
  params, cfg = weights.load_checkpoint(ckpts[kind])
  gen = weights.read_generation_config(ckpts[kind])
  out = weights.save_checkpoint(params, cfg, tmp_path / "export", generation_config=gen)
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 7))
  # Identical logits for the bidirectional kind too: transformers reads is_causal back.
  np.testing.assert_array_equal(_hf_logits(out, tokens), _hf_logits(ckpts[kind], tokens))
  assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [127, 126]
  hf_config = json.loads((out / "config.json").read_text())
  assert hf_config.get("is_causal", True) == (kind != "qwen2_bidirectional")
  # load -> export -> load is bit-identical, and so are the tensors on disk.
  again, cfg2 = weights.load_checkpoint(out)
  assert cfg2 == cfg and _trees_equal(params, again)
  original, exported = load_file(ckpts[kind] / "model.safetensors"), load_file(
      out / "model.safetensors")
  assert set(exported) == set(original)
  for name, t in exported.items():
    np.testing.assert_array_equal(t, original[name])


def test_sharded_checkpoints_load_and_export(ckpts, tmp_path):
  sharded, _ = weights.load_checkpoint(ckpts["qwen2_sharded"])
  out = weights.save_checkpoint(sharded, weights.read_config(ckpts["qwen2_sharded"]),
                                tmp_path / "resharded", max_shard_bytes=40_000)
  index = json.loads((out / weights.INDEX_FILE).read_text())
  assert len(set(index["weight_map"].values())) > 2
  again, _ = weights.load_checkpoint(out)
  assert _trees_equal(sharded, again)
  tokens = np.arange(12).reshape(2, 6)
  np.testing.assert_array_equal(_hf_logits(out, tokens), _hf_logits(ckpts["qwen2_sharded"], tokens))


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_storage_is_cast_to_param_dtype(tmp_path, stored):
  path = fixtures.make_checkpoint(tmp_path, "qwen2_untied", VOCAB, dtype=stored)
  params, _ = weights.load_checkpoint(path, param_dtype=jnp.float32)
  emb = params["embed_tokens"]["embedding"]
  assert emb.dtype == jnp.float32
  ref = fixtures.hf_model(path).model.embed_tokens.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(emb), ref)  # half -> fp32 is exact
  bf16, _ = weights.load_checkpoint(path, param_dtype=jnp.bfloat16)
  assert bf16["lm_head"].dtype == jnp.bfloat16
  # bf16 export keeps bf16 on disk and round-trips bit for bit.
  out = weights.save_checkpoint(bf16, weights.read_config(path), tmp_path / "bf16")
  assert _trees_equal(bf16, weights.load_checkpoint(out, param_dtype=jnp.bfloat16)[0])
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_real_tokenizer_vocab_and_151936_row_embedding(tmp_path):
  """The real Qwen2.5 tokenizer (151,665 ids) with a checkpoint of 151,936 embedding rows."""
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(fixtures.REAL_TOKENIZER)
  assert len(tok) == 151_665
  path = fixtures.make_checkpoint(tmp_path, "qwen2_tied", vocab_size=151_936)
  params, cfg = weights.load_checkpoint(path)
  assert params["embed_tokens"]["embedding"].shape[0] == cfg.vocab_size == 151_936
  text = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}],
                                 add_generation_prompt=True, tokenize=False)
  ids = np.asarray(tok(text).input_ids)[None]
  assert ids.max() < len(tok) and ids[0, 0] == 151644
  model = qwen.Qwen(cfg)
  mask = jnp.ones_like(ids)
  hidden, _ = model.apply({"params": params}, ids, qwen.positions_from_mask(mask), mask)
  ours = np.asarray(model.apply({"params": params}, hidden, method=qwen.Qwen.logits))
  assert ours.shape[-1] == 151_936  # rows past the tokenizer are carried, not dropped
  assert np.abs(ours - _hf_logits(path, ids)).max() <= 1e-4


def test_export_with_tokenizer_is_complete_and_atomic(ckpts, tmp_path):
  """save_checkpoint(tokenizer=...) writes the tokenizer files and chat template beside the
  weights (AutoTokenizer loads the directory alone); a failure keeps the previous export."""
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(fixtures.REAL_TOKENIZER)
  params, cfg = weights.load_checkpoint(ckpts["qwen2_tied"])
  out = weights.save_checkpoint(params, cfg, tmp_path / "export", tokenizer=tok)
  again = AutoTokenizer.from_pretrained(out)
  messages = [{"role": "user", "content": "What is 12 * 7?"}]
  assert again.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
      tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
  assert len(again) == len(tok) and again.eos_token == tok.eos_token
  assert again.pad_token == tok.pad_token
  assert weights.read_config(out) == cfg  # config.json is still ours

  class Broken:
    def save_pretrained(self, directory):
      (Path(directory) / "tokenizer.json").write_text("{")
      raise OSError("disk full")

  with pytest.raises(OSError, match="disk full"):
    weights.save_checkpoint(params, cfg, out, tokenizer=Broken())
  assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template
  assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp dir left behind


# --- errors name the bad file or tensor --------------------------------------------------------

@pytest.fixture
def broken(ckpts, tmp_path):
  path = tmp_path / "broken"
  shutil.copytree(ckpts["qwen2_untied"], path)
  return path


def test_missing_directory_and_files(broken, tmp_path):
  with pytest.raises(UserError, match="does not exist"):
    weights.load_checkpoint(tmp_path / "nowhere")
  (broken / "model.safetensors").unlink()
  with pytest.raises(weights.CheckpointError, match="neither model.safetensors"):
    weights.load_checkpoint(broken)
  (broken / "config.json").unlink()
  with pytest.raises(weights.CheckpointError, match=r"config\.json: missing"):
    weights.load_checkpoint(broken)


def test_missing_shard_file(ckpts, tmp_path):
  path = tmp_path / "sharded"
  shutil.copytree(ckpts["qwen2_sharded"], path)
  (path / "model-00002-of-00006.safetensors").unlink()
  with pytest.raises(weights.CheckpointError, match="model-00002-of-00006.safetensors"):
    weights.load_checkpoint(path)


def test_unknown_architecture(broken):
  cfg = json.loads((broken / "config.json").read_text())
  (broken / "config.json").write_text(json.dumps(cfg | {"model_type": "llama"}))
  with pytest.raises(weights.CheckpointError, match="config.json: unsupported model_type 'llama'"):
    weights.load_checkpoint(broken)


def test_wrong_shape_and_missing_tensor(broken, ckpts, tmp_path):
  tensors = load_file(broken / "model.safetensors")
  name = "model.layers.1.mlp.up_proj.weight"
  wrong = dict(tensors, **{name: tensors[name][:-1]})
  save_file(wrong, broken / "model.safetensors")
  with pytest.raises(weights.CheckpointError, match=rf"{name}.*shape \(95, 64\).*\(96, 64\)"):
    weights.load_checkpoint(broken)
  del wrong[name]
  save_file(wrong, broken / "model.safetensors")
  # The message names the checkpoint: a run loads a policy and a reward model.
  with pytest.raises(weights.CheckpointError,
                     match=rf"broken/model\.safetensors: tensor '{name}' is missing"):
    weights.load_checkpoint(broken)
  sharded = tmp_path / "sharded"
  shutil.copytree(ckpts["qwen2_sharded"], sharded)
  index = json.loads((sharded / weights.INDEX_FILE).read_text())
  del index["weight_map"]["model.norm.weight"]
  (sharded / weights.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(weights.CheckpointError, match=r"sharded/model\.safetensors\.index\.json: "
                     "tensor 'model.norm.weight' is missing"):
    weights.load_checkpoint(sharded)


def _edit_config(path, **fields):
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps(config | fields))


def test_config_errors_name_the_file(broken):
  """QwenConfig's own checks and non-numeric fields come out with config.json's path."""
  original = json.loads((broken / "config.json").read_text())
  for fields, match in (({"num_attention_heads": 3}, "num_heads=3 is not a multiple of"),
                        ({"hidden_size": "64"}, "hidden_size='64' must be a positive integer"),
                        ({"num_key_value_heads": 1.5}, "num_key_value_heads=1.5 must be"),
                        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' must be a number"),
                        ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
                         "rope_parameters.rope_theta='1e4' must be a number")):
    (broken / "config.json").write_text(json.dumps(original | fields))
    with pytest.raises(weights.CheckpointError, match=rf"broken/config\.json: {match}"):
      weights.read_config(broken)


def test_truncated_generation_config_names_the_file(broken):
  (broken / "generation_config.json").write_text("{")
  with pytest.raises(weights.CheckpointError,
                     match=r"broken/generation_config\.json: not valid JSON"):
    weights.read_generation_config(broken)
  (broken / "generation_config.json").write_text("[1]")
  with pytest.raises(weights.CheckpointError, match="generation_config.json: expected a JSON obj"):
    weights.read_generation_config(broken)


def _logits(params, cfg, tokens):
  model, mask = qwen.Qwen(cfg), jnp.ones_like(tokens)
  hidden, _ = model.apply({"params": params}, tokens, qwen.positions_from_mask(mask), mask)
  return np.asarray(model.apply({"params": params}, hidden, method=qwen.Qwen.logits))


def test_rope_scaling_is_read_before_rope_parameters(broken):
  """A config.json with both keys (transformers 5 and our export write rope_parameters; Qwen's
  README adds rope_scaling for long context): transformers reads rope_scaling, and so do we."""
  config = json.loads((broken / "config.json").read_text())
  assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
  _edit_config(broken, rope_scaling={"rope_type": "default", "rope_theta": 500000.0})
  params, cfg = weights.load_checkpoint(broken)
  hf_model = fixtures.hf_model(broken)
  assert cfg.rope_theta == hf_model.config.rope_parameters["rope_theta"] == 500000.0
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
  with torch.no_grad():
    theirs = hf_model(input_ids=torch.tensor(tokens)).logits.numpy()
  assert np.abs(_logits(params, cfg, tokens) - theirs).max() <= 1e-4
  # YaRN there: transformers runs it, we cannot, so the file is refused, naming the field.
  _edit_config(broken, rope_scaling={"type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768})
  assert fixtures.hf_model(broken).config.rope_parameters["rope_type"] == "yarn"
  with pytest.raises(weights.CheckpointError,
                     match=r"broken/config\.json: rope_scaling: rope type 'yarn' is not supported"):
    weights.load_checkpoint(broken)


@pytest.mark.parametrize("dtype,stored", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.int8, "I8")])
def test_quantized_checkpoints_are_refused(broken, dtype, stored):
  """Quantized weights (Qwen's -FP8 releases, compressed-tensors W8A8) need scales this loader
  does not apply: refused by config.json's quantization_config, and tensor by tensor."""
  from safetensors.torch import load_file as torch_load, save_file as torch_save

  tensors = torch_load(broken / "model.safetensors")
  name = "model.layers.0.self_attn.q_proj.weight"
  w = tensors[name]
  scale = w.abs().max() / 100
  tensors[name] = (w / scale).round().to(dtype)
  tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(1, 1)
  torch_save(tensors, broken / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(weights.CheckpointError, match=rf"broken/model\.safetensors: tensor "
                     rf"'{name}' is stored as {stored}; only F32/BF16/F16 load"):
    weights.load_checkpoint(broken)
  _edit_config(broken, quantization_config={"quant_method": "fp8", "fmt": "e4m3"})
  with pytest.raises(weights.CheckpointError, match=r"broken/config\.json: quantization_config "
                     r"\(quant_method='fp8'\) is not supported"):
    weights.load_checkpoint(broken)


def test_tied_config_with_a_different_stored_head_is_refused(ckpts, tmp_path):
  """tie_word_embeddings=true beside a stored lm_head.weight: transformers 5 uses the stored
  head, 4.x and vLLM the embedding. Equal values load; different ones are refused."""
  untied = tmp_path / "untied"
  shutil.copytree(ckpts["qwen2_untied"], untied)
  stored = load_file(untied / "model.safetensors")
  assert not np.array_equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])
  _edit_config(untied, tie_word_embeddings=True)
  with pytest.raises(weights.CheckpointError, match=r"untied/model\.safetensors: tensor "
                     r"'lm_head\.weight' differs.*untied/config\.json sets tie_word_embeddings"):
    weights.load_checkpoint(untied)

  tied = tmp_path / "tied"
  shutil.copytree(ckpts["qwen2_tied"], tied)
  stored = load_file(tied / "model.safetensors")
  assert "lm_head.weight" not in stored
  save_file(stored | {"lm_head.weight": stored["model.embed_tokens.weight"].copy()},
            tied / "model.safetensors", metadata={"format": "pt"})
  params, cfg = weights.load_checkpoint(tied)
  assert cfg.tie_word_embeddings and "lm_head" not in params
  tokens = np.arange(12).reshape(2, 6)
  np.testing.assert_allclose(_logits(params, cfg, tokens), _hf_logits(tied, tokens), atol=1e-4)


def _unexpected_in_transformers(path):
  _, info = fixtures.hf_model_with_info(path)
  return set(info["unexpected_keys"])


def test_tensors_the_config_does_not_use_are_refused(ckpts, tmp_path):
  """A stored tensor the config's model has no place for means config.json describes another
  model than the one stored: transformers lists such tensors as unexpected keys and drops them;
  we refuse the checkpoint, naming the tensor and its file."""
  import transformers

  biased = tmp_path / "biased"  # a qwen3 trained with attention_bias, the field then lost
  config = fixtures.hf_config("qwen3", VOCAB)
  config.attention_bias = True
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(biased)
  _edit_config(biased, attention_bias=False)
  assert "model.layers.0.self_attn.k_proj.bias" in _unexpected_in_transformers(biased)
  with pytest.raises(weights.CheckpointError, match=r"biased/model\.safetensors: tensor "
                     r"'model\.layers\.0\.self_attn\.k_proj\.bias' \(and 7 more\) is not "
                     r"part of the model .*biased/config\.json describes \(qwen3, "
                     r"num_hidden_layers=2\)"):
    weights.load_checkpoint(biased)

  short = tmp_path / "short"  # a 2-layer file whose config.json says 1 layer
  shutil.copytree(ckpts["qwen2_untied"], short)
  config = json.loads((short / "config.json").read_text())
  config.pop("layer_types", None)  # else transformers refuses the mismatch itself
  (short / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
  assert "model.layers.1.mlp.up_proj.weight" in _unexpected_in_transformers(short)
  with pytest.raises(weights.CheckpointError,
                     match=r"tensor 'model\.layers\.1\.input_layernorm\.weight' \(and 11 more"):
    weights.load_checkpoint(short)

  sharded = tmp_path / "sharded"  # an index entry no layer of the config reads
  shutil.copytree(ckpts["qwen2_sharded"], sharded)
  index = json.loads((sharded / weights.INDEX_FILE).read_text())
  index["weight_map"]["model.layers.0.mlp.up_proj.weight_typo"] = "model-00002-of-00006.safetensors"
  (sharded / weights.INDEX_FILE).write_text(json.dumps(index))
  with pytest.raises(weights.CheckpointError, match=r"sharded/model-00002-of-00006\.safetensors: "
                     r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight_typo' is not part"):
    weights.load_checkpoint(sharded)


def test_to_hf_refuses_switches_config_json_cannot_say():
  """config.json carries model_type (and qwen3's attention_bias); transformers derives qk-norm
  and the biases from them, so any other combination would load as a different model."""
  base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8)
  for kw, match in ((dict(model_type="qwen2", qk_norm=True), "qwen2 config must have qk_norm=F"),
                    (dict(model_type="qwen3", qk_norm=False, qkv_bias=False),
                     "qwen3 config must have qk_norm=True"),
                    (dict(model_type="qwen3", qk_norm=True, qkv_bias=True, o_bias=False),
                     "qkv_bias == o_bias"),
                    (dict(model_type="qwen2", qkv_bias=False), "qkv_bias=True and o_bias=False")):
    with pytest.raises(ValueError, match=match):
      qwen.QwenConfig(**base, **kw).to_hf()
  for kw in (dict(), dict(model_type="qwen3", qk_norm=True, qkv_bias=False),
             dict(model_type="qwen3", qk_norm=True, qkv_bias=True, o_bias=True)):
    cfg = qwen.QwenConfig(**base, **kw)
    assert qwen.QwenConfig.from_hf(cfg.to_hf()) == cfg


def test_corrupt_safetensors_header(broken):
  f = broken / "model.safetensors"
  data = bytearray(f.read_bytes())
  data[8:40] = b"{not json at all" + b"\x00" * 16
  f.write_bytes(bytes(data))
  with pytest.raises(weights.CheckpointError, match=r"model\.safetensors"):
    weights.load_checkpoint(broken)


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(UserError, match="not in the local Hugging Face cache.*--local-dir"):
    weights.load_checkpoint("Qwen/definitely-not-cached-model")
