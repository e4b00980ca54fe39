"""Tiny Qwen checkpoints built offline with transformers (random init), for tests; and an
in-memory gs:// store (FakeGCS, use_fake_gcs).

Each kind exercises one switch of the model code: tied vs untied head, Qwen3's q/k norms with
head_dim != hidden / heads, a checkpoint saved in several shards, bidirectional attention
(config.json "is_causal": false, as an embedder such as gte-Qwen2 runs).
"""

from __future__ import annotations

from pathlib import Path

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
REAL_TOKENIZER = SHARED / "qwen2-tokenizer"
GSM8K = SHARED / "gsm8k"

KINDS = ("qwen2_tied", "qwen2_untied", "qwen3", "qwen2_sharded", "qwen2_bidirectional")


def hf_config(kind: str, vocab_size: int = 128):
  import transformers

  common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_theta=10000.0)
  if kind == "qwen3":
    # head_dim 24 != 64 / 4: Qwen3 sets it explicitly.
    return transformers.Qwen3Config(head_dim=24, tie_word_embeddings=False, **common)
  if kind in ("qwen2_tied", "qwen2_sharded"):
    return transformers.Qwen2Config(tie_word_embeddings=True, **common)
  if kind == "qwen2_untied":
    return transformers.Qwen2Config(tie_word_embeddings=False, **common)
  if kind == "qwen2_bidirectional":
    # transformers >= 5.2 builds a bidirectional (padding-only) mask when is_causal is false.
    return transformers.Qwen2Config(tie_word_embeddings=True, is_causal=False, **common)
  raise ValueError(f"unknown fixture kind {kind!r}; known: {KINDS}")


def make_checkpoint(directory, kind: str, vocab_size: int = 128, seed: int = 0,
                    dtype=None) -> Path:
  """Saves a random tiny transformers model of `kind` into directory/kind and returns the path.

  Biases and norm weights are randomised too (transformers inits them to 0 / 1), so a
  mis-mapped bias or norm cannot hide.
  """
  import torch
  import transformers

  torch.manual_seed(seed)
  cfg = hf_config(kind, vocab_size)
  model = transformers.AutoModelForCausalLM.from_config(cfg)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias"):
        p.normal_(0, 0.1)
      elif "norm" in name:
        p.uniform_(0.5, 1.5)
  if dtype is not None:
    model = model.to(dtype)
  out = Path(directory) / kind
  model.save_pretrained(out, max_shard_size="60KB" if kind == "qwen2_sharded" else "2GB")
  model.generation_config.eos_token_id = [vocab_size - 1, vocab_size - 2]
  model.generation_config.save_pretrained(out)
  return out


def hf_model(path):
  import torch
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_model_with_info(path):
  """(model, loading info): transformers' own account of missing and unexpected tensors."""
  import torch
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           output_loading_info=True)


class FakeGCS(MemoryFileSystem):
  """An in-memory object store that fsspec serves for gs://: like Cloud Storage it has no
  append and no rename."""
  protocol = ("gs", "gcs")  # epath asks fsspec for 'gcs'
  store: dict = {}
  pseudo_dirs = [""]

  def mv(self, *args, **kwargs):  # Cloud Storage has no rename
    raise NotImplementedError("no rename on an object store")


def use_fake_gcs(monkeypatch) -> None:
  """gs:// served from an empty FakeGCS for the rest of the test. Every test's store is this
  one class's: etils.epath keeps the first gs:// filesystem a process gets, so another class
  registered later would never be asked (one test then saw another's files)."""
  monkeypatch.setattr(FakeGCS, "store", {})
  monkeypatch.setattr(FakeGCS, "pseudo_dirs", [""])
  for protocol in FakeGCS.protocol:
    fsspec.register_implementation(protocol, FakeGCS, clobber=True)
  FakeGCS.clear_instance_cache()
