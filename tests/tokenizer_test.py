"""Tokenizer loading, stop ids and the tiny offline tokenizer, against the real Qwen2.5 tokenizer."""
import json
import pathlib

import pytest

from grpo_jax import tokenizer as tokenizer_lib
from grpo_jax.errors import UserError

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"
QWEN_DIR = str(SHARED / "qwen2-tokenizer")


@pytest.fixture(scope="module")
def qwen():
  return tokenizer_lib.load_tokenizer(QWEN_DIR)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  return tokenizer_lib.build_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny_tok")))


def test_real_tokenizer_documented_ids(qwen):
  # Ids stated in ../shared/qwen2-tokenizer/README.md.
  assert qwen("Hello world").input_ids == [9707, 1879]
  text = qwen.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                  add_generation_prompt=True, tokenize=False)
  ids = qwen(text, add_special_tokens=False).input_ids
  assert ids[:7] == [151644, 8948, 198, 2610, 525, 1207, 16948]
  # <|im_start|>assistant\n closes the prompt: 151644 'assistant'(77091) '\n'(198).
  assert ids[-3:] == [151644, 77091, 198]


def test_real_tokenizer_stop_ids_and_vocab(qwen):
  assert tokenizer_lib.stop_ids(qwen, QWEN_DIR) == [151645, 151643]
  assert qwen.convert_ids_to_tokens([151645, 151643]) == ["<|im_end|>", "<|endoftext|>"]
  assert tokenizer_lib.valid_vocab_size(qwen) == 151665
  # The last valid id is a real token; the next one (an embedding pad row) is not.
  assert qwen.convert_ids_to_tokens(151664) is not None
  assert qwen.convert_ids_to_tokens(151665) is None


def test_stop_ids_fall_back_to_tokenizer_eos(qwen, tmp_path):
  # A local dir with no generation_config.json: the tokenizer's eos (<|im_end|>) is used.
  assert tokenizer_lib.stop_ids(qwen, str(tmp_path)) == [151645]
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
  assert tokenizer_lib.stop_ids(qwen, str(tmp_path)) == [151643]
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
  with pytest.raises(ValueError, match="generation_config.json.*eos_token_id"):
    tokenizer_lib.stop_ids(qwen, str(tmp_path))


@pytest.mark.parametrize("tokenizer_class", ["Qwen2Tokenizer", "TokenizersBackend"])
def test_qwen_tokenizers_load_as_autotokenizer_loads_them(tokenizer_class, tmp_path):
  """load_tokenizer loads the class tokenizer_config.json names without AutoTokenizer (a Qwen
  checkpoint's Qwen2Tokenizer, as on the hub, or the tokenizers backend ../shared's was saved
  with): the class AutoTokenizer picks, the same ids, texts, special tokens and chat template on
  every GSM8K test problem and answer, and the same tokenizer_config.json when saved (as an
  exported final_model/ holds it)."""
  import shutil
  import transformers
  hub_like = tmp_path / "qwen"
  shutil.copytree(QWEN_DIR, hub_like)
  config = json.loads((hub_like / "tokenizer_config.json").read_text())
  config["tokenizer_class"] = tokenizer_class
  (hub_like / "tokenizer_config.json").write_text(json.dumps(config))
  auto = transformers.AutoTokenizer.from_pretrained(str(hub_like))
  ours = tokenizer_lib.load_tokenizer(str(hub_like))
  assert type(ours) is type(auto) and type(auto).__name__ == tokenizer_class
  for tok, where in ((ours, tmp_path / "ours"), (auto, tmp_path / "auto")):
    tok.save_pretrained(where)
  assert json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text()) == json.loads(
      (tmp_path / "auto" / "tokenizer_config.json").read_text())
  assert len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
  assert (ours.eos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
  rows = [json.loads(line) for line in (SHARED / "gsm8k" / "test.jsonl").open()]
  texts = [r["question"] for r in rows] + [r["answer"] for r in rows]
  texts += ["<think>2 + 2</think>\n<answer>4</answer>", "  x\r\n\tÉ\u0301 日本語 🙂"]
  assert ours(texts).input_ids == auto(texts).input_ids
  ids = ours(texts).input_ids
  assert ours.batch_decode(ids, skip_special_tokens=True) == auto.batch_decode(
      ids, skip_special_tokens=True)
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
  assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
      auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))


def test_missing_tokenizer_errors_name_it(tmp_path):
  with pytest.raises(UserError, match="no_such_tok' does not exist"):
    tokenizer_lib.load_tokenizer(str(tmp_path / "no_such_tok"))
  # conftest sets HF_HUB_OFFLINE=1: an uncached hub id must say to pass a local path.
  with pytest.raises(UserError, match=r"'grpo-jax-test/not-a-repo' is not a local path.*--local-dir"):
    tokenizer_lib.load_tokenizer("grpo-jax-test/not-a-repo")


def test_tiny_tokenizer_round_trips_gsm8k(tiny_dir):
  tok = tokenizer_lib.load_tokenizer(tiny_dir)
  rows = [json.loads(line) for line in (SHARED / "gsm8k" / "test.jsonl").open()]
  assert len(rows) == 1319
  for row in rows:
    for text in (row["question"], row["answer"]):
      ids = tok(text, add_special_tokens=False).input_ids
      assert max(ids) < 256  # plain text never produces special ids
      assert tok.decode(ids) == text
  # Byte-level: ASCII characters are one token each, id == byte value.
  assert tok("Ab 7+").input_ids == [65, 98, 32, 55, 43]


def test_tiny_tokenizer_specials_template_and_stops(tiny_dir):
  tok = tokenizer_lib.load_tokenizer(tiny_dir)
  end, start, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  assert (end, start, im_end) == (256, 257, 258)
  assert tokenizer_lib.stop_ids(tok, tiny_dir) == [258, 256]
  assert tok.pad_token_id == 256 and tok.eos_token_id == 258
  assert tokenizer_lib.valid_vocab_size(tok) == 263
  text = tok.apply_chat_template([{"role": "user", "content": "1+2?"}],
                                 add_generation_prompt=True, tokenize=False)
  assert text == "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
  ids = tok(text, add_special_tokens=False).input_ids
  assert ids == [257, *b"user\n1+2?", 258, 10, 257, *b"assistant\n"]
  with_system = tok.apply_chat_template(
      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
      add_generation_prompt=False, tokenize=False)
  assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
  # Tags are single tokens that survive skip_special_tokens; ChatML markers do not.
  tagged = "<|im_start|><think>4</think><answer>4</answer><|im_end|>"
  ids = tok(tagged, add_special_tokens=False).input_ids
  assert ids == [257, 259, ord("4"), 260, 261, ord("4"), 262, 258]
  assert tok.decode(ids, skip_special_tokens=True) == "<think>4</think><answer>4</answer>"
