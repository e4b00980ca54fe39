"""Tokenizers: load a real one (local dir or hub id), find its stop ids, or build a tiny one offline.

The tiny tokenizer is byte-level with no merges, so every UTF-8 string round-trips and token id
== byte value for ids 0..255; Qwen's special tokens follow at 256.. . It exists so the offline
`tiny` preset and the tests need nothing from the hub.

    tok = load_tokenizer("../shared/qwen2-tokenizer")
    stop_ids(tok, "../shared/qwen2-tokenizer")   # -> [151645, 151643]
    valid_vocab_size(tok)                        # -> 151665 (< 151936 embedding rows)
"""
from __future__ import annotations

import importlib
import json
import os
from typing import Iterable, Sequence

from huggingface_hub import errors as hf_errors
import huggingface_hub
import tokenizers
from tokenizers import decoders, models, pre_tokenizers
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from grpo_jax import hub

# Special tokens in Qwen2.5's order; the tiny tokenizer gives them ids 256, 257, 258.
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Reasoning/answer tags as ordinary added tokens (special=False) so that decoding with
# skip_special_tokens=True keeps them in the text the format reward parses.
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# ChatML like Qwen's, but with no default system turn: the tiny model's context is short, so a
# prompt with no system message stays just the user turn.
TINY_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def load_tokenizer(name_or_path: str,
                   field: str = "config.model.tokenizer") -> transformers.PreTrainedTokenizerBase:
  """Loads a tokenizer from a local directory or a hub id (see grpo_jax.hub for the rule).

  A local directory whose tokenizer_config.json names a class of _DIRECT (every Qwen
  checkpoint's Qwen2Tokenizer, or the tokenizers backend a tiny tokenizer is saved as) is loaded
  with that class itself: the class AutoTokenizer would pick, so the same tokenizer, and the same
  tokenizer_class in an exported checkpoint. AutoTokenizer imports transformers' model registry,
  and with it PyTorch where that is installed (about 2 s of every run's start-up); it loads any
  other directory, and hub ids, where it downloads what it needs.
  """
  local = hub.local_path(name_or_path, field)
  if local is not None:
    return _tokenizer_class(local).from_pretrained(local)
  hub.prepare()
  try:
    return transformers.AutoTokenizer.from_pretrained(name_or_path)
  except OSError as e:
    raise hub.unavailable(name_or_path, field, "tokenizer", e) from e


# tokenizer_config.json's tokenizer_class -> (module, class) to load it with, for directories
# that hold a tokenizer.json.
_DIRECT = {"Qwen2Tokenizer": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
           "TokenizersBackend": ("transformers", "PreTrainedTokenizerFast"),
           "PreTrainedTokenizerFast": ("transformers", "PreTrainedTokenizerFast")}


def _tokenizer_class(local: str):
  """The class that loads the tokenizer directory `local`: its tokenizer_class's, where _DIRECT
  names it and a tokenizer.json is there, else AutoTokenizer."""
  try:
    with open(os.path.join(local, "tokenizer_config.json")) as f:
      name = json.load(f).get("tokenizer_class")
  except (OSError, ValueError, AttributeError):
    name = None
  if name not in _DIRECT or not os.path.isfile(os.path.join(local, "tokenizer.json")):
    return transformers.AutoTokenizer
  module, attr = _DIRECT[name]
  return getattr(importlib.import_module(module), attr)


def _generation_config_path(name_or_path: str) -> str | None:
  local = hub.local_path(name_or_path, "tokenizer")
  if local is not None:
    path = os.path.join(local, "generation_config.json")
    return path if os.path.isfile(path) else None
  hub.prepare()
  try:
    return huggingface_hub.hf_hub_download(name_or_path, "generation_config.json")
  except (OSError, hf_errors.EntryNotFoundError):
    return None  # Not cached / offline / the repo has none: fall back to the tokenizer's eos.


def stop_ids(tokenizer, name_or_path: str) -> list[int]:
  """Token ids that end a completion: generation_config.json's eos_token_id, else tokenizer eos.

  Qwen2.5-Instruct's generation config lists [151645 <|im_end|>, 151643 <|endoftext|>]; the order
  of the file is kept and duplicates dropped.
  """
  ids = []
  path = _generation_config_path(name_or_path)
  if path is not None:
    with open(path) as f:
      eos = json.load(f).get("eos_token_id")
    if isinstance(eos, int):
      eos = [eos]
    if eos is not None and not (isinstance(eos, list) and all(isinstance(i, int) for i in eos)):
      raise ValueError(f"{path}: field eos_token_id must be an int or a list of ints, got {eos!r}")
    ids = list(eos or [])
  if not ids and tokenizer.eos_token_id is not None:
    ids = [tokenizer.eos_token_id]
  if not ids:
    raise ValueError(f"tokenizer {name_or_path!r} has no eos token and no generation_config.json "
                     "eos_token_id: cannot tell when a completion ends")
  return list(dict.fromkeys(ids))


def valid_vocab_size(tokenizer) -> int:
  """Number of ids the tokenizer can produce; embedding rows at or above it must never be sampled.

  Qwen2.5: 151665 ids against 151936 embedding rows (rows padded for hardware efficiency).
  """
  return len(tokenizer)


def build_tiny_tokenizer(out_dir: str, corpus: Iterable[str] | None = None,
                         vocab_size: int = 512, extra_tags: Sequence[str] = ()) -> str:
  """Builds a small tokenizer with Qwen's special tokens and a ChatML template into out_dir.

  Without a corpus: byte-level with no merges (263 ids, token id b is byte b). With a corpus:
  byte-level BPE merges learnt from it up to `vocab_size` (frequent words become one token,
  so prompts are several times shorter), digits always split one per token as in Qwen, so
  arithmetic stays digit by digit. Both round-trip every UTF-8 string.
  Returns out_dir, loadable with `load_tokenizer(out_dir)` / AutoTokenizer.from_pretrained.
  """
  if corpus is None:
    # Same byte -> printable-char map as GPT-2/Qwen, so token id b is byte b.
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting is needed when there are no merges.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  else:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(
      [tokenizers.AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t in TAG_TOKENS + tuple(extra_tags)])

  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
      clean_up_tokenization_spaces=False, model_max_length=1 << 20)
  fast.chat_template = TINY_CHAT_TEMPLATE
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(out_dir)
  stop = [fast.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": stop, "pad_token_id": fast.pad_token_id,
               "bos_token_id": fast.convert_tokens_to_ids("<|endoftext|>")}, f, indent=2)
  return out_dir

