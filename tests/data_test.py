"""GSM8K loading, prompts, bucketing and resumable order, on the real ../shared/gsm8k files."""
import json
import pathlib
from fractions import Fraction

import numpy as np
import pytest

from grpo_jax import data
from grpo_jax import tokenizer as tokenizer_lib
from grpo_jax.errors import UserError

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"
GSM8K = SHARED / "gsm8k"


def _read_jsonl(path):
  return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("hf_datasets_cache"))


@pytest.mark.parametrize("split,num_rows", [("train", 7473), ("test", 1319)])
def test_real_gsm8k_loads_whole_and_every_gold_answer_parses(split, num_rows, cache_dir):
  rows = data.load_rows(str(GSM8K), split=split, cache_dir=cache_dir)
  reference = _read_jsonl(GSM8K / f"{split}.jsonl")
  assert len(rows) == num_rows == len(reference)
  assert rows == [{"question": r["question"], "answer": r["answer"]} for r in reference]
  for row in reference:
    # Independent parse: the text after the last '####', commas dropped.
    expected = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    gold = data.gold_answer(row["answer"])
    assert gold == expected
    assert float(gold) == float(expected)


def test_jsonl_files_read_as_datasets_json_builder_reads_them(tmp_path, cache_dir):
  """JSON-lines files are read without datasets: the same rows, in the same order, as its
  json builder gives, for the real splits, a glob of two files, and a file where some rows
  have a key the others lack (None there, as an Arrow column holds it)."""
  import datasets
  lines = (GSM8K / "test.jsonl").read_text().splitlines()[:30]
  (tmp_path / "a.jsonl").write_text("\n".join(lines[:20]) + "\n\n")
  (tmp_path / "b.jsonl").write_text("\n".join(lines[20:]) + "\n")
  mixed = [dict(json.loads(line), **({"source": "mine"} if i % 3 else {}))
           for i, line in enumerate(lines)]
  (tmp_path / "mixed").mkdir()
  (tmp_path / "mixed" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
  for files in ([str(GSM8K / "train.jsonl")], [str(GSM8K / "test.jsonl")],
                [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")],
                [str(tmp_path / "mixed" / "c.jsonl")]):
    ours, columns = data._read_jsonl(files, "config.data.source")
    theirs = datasets.load_dataset("json", data_files=files, split="train", cache_dir=cache_dir)
    assert columns == theirs.column_names
    assert [{k: r.get(k) for k in columns} for r in ours] == theirs.to_list()
  assert data.load_rows(str(tmp_path / "*.jsonl"), cache_dir=cache_dir) == [
      {"question": r["question"], "answer": r["answer"]} for r in map(json.loads, lines)]


def test_gold_answer_examples_and_error():
  assert data.gold_answer("48+24 = <<48+24=72>>72 clips.\n#### 72") == "72"
  assert data.gold_answer("so\n#### 1,080") == "1080"
  assert data.gold_answer("#### -3") == "-3"
  assert data.gold_answer("#### 2.5\n") == "2.5"
  with pytest.raises(ValueError, match="####"):
    data.gold_answer("The answer is 7.")


@pytest.mark.parametrize("answer", ["#### 72", "#### 1,080", "#### -3", "#### 2.5", "#### 1,234,567",
                                    "#### 1,2", "#### 0,5", "#### 1,00", "#### 12,34", "#### 5.",
                                    "#### $5", "#### 1/2"])
def test_a_gold_answer_loads_exactly_when_the_math_reward_reads_it_alike(answer):
  """One rule for a gold answer: data loads it if and only if math_accuracy parses it, to the
  same value ('0,5' once loaded as 5, and every completion of it went unscored)."""
  from grpo_jax.rewards import math_accuracy
  value = math_accuracy.gold_value(answer)
  if answer in ("#### $5", "#### 1/2", "#### 5."):  # the reward reads these; data keeps to numbers
    assert value is not None
    with pytest.raises(ValueError):
      data.gold_answer(answer)
    return
  try:
    loaded = data.gold_answer(answer)
  except ValueError:
    assert value is None, answer
  else:
    assert value is not None and Fraction(loaded) == value, answer


def test_file_path_custom_fields_and_parquet(tmp_path, cache_dir):
  reference = _read_jsonl(GSM8K / "test.jsonl")[:20]
  path = tmp_path / "mine.jsonl"
  path.write_text("".join(json.dumps({"problem": r["question"], "solution": r["answer"]}) + "\n"
                          for r in reference))
  rows = data.load_rows(str(path), question_field="problem", answer_field="solution",
                        cache_dir=cache_dir)
  assert rows == reference

  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(reference), tmp_path / "test.parquet")
  assert data.load_rows(str(tmp_path / "test.parquet"), cache_dir=cache_dir) == reference


def test_bad_input_errors_name_file_and_field(tmp_path, cache_dir):
  path = tmp_path / "renamed.jsonl"
  path.write_text(json.dumps({"problem": "1+1?", "answer": "#### 2"}) + "\n")
  with pytest.raises(UserError, match=r"renamed\.jsonl.*'question' is missing.*problem"):
    data.load_rows(str(path), cache_dir=cache_dir)

  path = tmp_path / "noanswer.jsonl"
  path.write_text(json.dumps({"question": "a", "answer": "#### 2"}) + "\n"
                  + json.dumps({"question": "b", "answer": "two"}) + "\n")
  with pytest.raises(UserError, match=r"noanswer\.jsonl: row 1, field 'answer'"):
    data.load_rows(str(path), cache_dir=cache_dir)

  with pytest.raises(UserError, match="has no validation.json"):
    data.load_rows(str(GSM8K), split="validation", cache_dir=cache_dir)
  with pytest.raises(UserError, match="nothere"):
    data.load_rows(str(tmp_path / "nothere.jsonl"), cache_dir=cache_dir)
  with pytest.raises(UserError, match="config.data.source: .*no_dir' does not exist"):
    data.load_rows(str(tmp_path / "no_dir"), cache_dir=cache_dir)
  # conftest sets HF_HUB_OFFLINE=1: a hub id that is not cached says so and names itself.
  with pytest.raises(UserError, match="'grpo-jax-test/no-such-dataset'.*local path.*hf download"):
    data.load_rows("grpo-jax-test/no-such-dataset", config_name="main", cache_dir=cache_dir)


def test_a_file_source_is_refused_for_two_splits(tmp_path):
  """A file or glob holds one split: read as both the train and the eval split, the held-out
  accuracy would be measured on the training problems. A directory gives each its own file."""
  from grpo_jax import config as config_lib, inputs
  reference = _read_jsonl(GSM8K / "train.jsonl")[:12]
  for name, part in (("train.jsonl", reference[:8]), ("test.jsonl", reference[8:])):
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
  config = config_lib.defaults()
  for source in (tmp_path / "train.jsonl", tmp_path / "*.jsonl"):
    config.data.source = str(source)
    with pytest.raises(UserError, match=r"config\.data\.source: .* holds one split: the train "
                       r"split 'train' and the eval split 'test' would both be its rows"):
      inputs.datasets(config, str(tmp_path / "run"))
  config.data.source = str(tmp_path)
  train, held_out = inputs.datasets(config, str(tmp_path / "run"))
  expected = [{"question": r["question"], "answer": r["answer"]} for r in reference]
  assert train == expected[:8] and held_out == expected[8:]


def test_an_empty_data_file_is_named(tmp_path, cache_dir):
  """An empty split is an error naming its file (datasets raised a bare StopIteration)."""
  for text in ("", "\n\n"):
    (tmp_path / "test.jsonl").write_text(text)
    with pytest.raises(UserError, match=r"config\.data\.source: .*test\.jsonl: no rows"):
      data.load_rows(str(tmp_path), split="test", cache_dir=cache_dir)


def test_malformed_jsonl_line_is_named(tmp_path, cache_dir):
  lines = (GSM8K / "train.jsonl").read_text().splitlines()[:5]
  lines[3] = lines[3][:-7]  # a real row, cut short
  (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(UserError, match=r"train\.jsonl:4: not valid JSON"):
    data.load_rows(str(tmp_path), cache_dir=cache_dir)


def test_existing_relative_path_is_local_and_missing_one_is_named(tmp_path, monkeypatch,
                                                                  cache_dir):
  (tmp_path / "my" / "gsm").mkdir(parents=True)
  (tmp_path / "my" / "gsm" / "test.jsonl").write_text(
      (GSM8K / "test.jsonl").read_text().splitlines()[0] + "\n")
  monkeypatch.chdir(tmp_path)
  # 'my/gsm' has the shape of a hub id; it exists, so it is local.
  assert len(data.load_rows("my/gsm", split="test", cache_dir=cache_dir)) == 1
  with pytest.raises(UserError, match=r"config.data.source: 'my/gsm2/' does not exist"):
    data.load_rows("my/gsm2/", split="test", cache_dir=cache_dir)


def test_prompts_with_real_tokenizer():
  tok = tokenizer_lib.load_tokenizer(str(SHARED / "qwen2-tokenizer"))
  q = "Natalia sold clips to 48 of her friends in April."
  default = data.build_prompt(tok, q)
  assert default == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                     f"helpful assistant.<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                     "<|im_start|>assistant\n")
  custom = data.build_prompt(tok, q, system_prompt="Reason step by step.",
                             user_template="Q: {question}\nA:")
  assert custom == ("<|im_start|>system\nReason step by step.<|im_end|>\n"
                    f"<|im_start|>user\nQ: {q}\nA:<|im_end|>\n<|im_start|>assistant\n")
  ids = data.encode_prompts(tok, [default, custom])
  # README-documented start of a default-system prompt; no BOS is prepended.
  assert ids[0][:7] == [151644, 8948, 198, 2610, 525, 1207, 16948]
  assert ids[1][:3] == [151644, 8948, 198]
  assert ids[0][-3:] == ids[1][-3:] == [151644, 77091, 198]


def test_pad_to_bucket_left_pads_to_smallest_fitting_bucket():
  rng = np.random.default_rng(0)
  ids_list = [list(rng.integers(1, 100, size=n)) for n in (3, 9, 1, 7)]
  tokens, mask = data.pad_to_bucket(ids_list, buckets=(16, 8, 32), pad_id=0)
  assert tokens.shape == mask.shape == (4, 16) and tokens.dtype == np.int32
  for row, ids in enumerate(ids_list):
    expected = [0] * (16 - len(ids)) + ids
    assert tokens[row].tolist() == expected
    assert mask[row].tolist() == [False] * (16 - len(ids)) + [True] * len(ids)
  tokens, _ = data.pad_to_bucket([[1, 2, 3, 4, 5, 6, 7, 8]], buckets=(16, 8, 32), pad_id=-1)
  assert tokens.shape == (1, 8)
  with pytest.raises(ValueError, match="prompt has 33 tokens.*largest prompt bucket 32"):
    data.pad_to_bucket([[1] * 33, [1]], buckets=(16, 32), pad_id=0)


def test_iterator_epochs_are_permutations_and_seeded():
  it = data.PromptIterator(num_rows=10, batch_size=4, seed=3)
  batches = [it.next_indices() for _ in range(5)]  # 20 indices = 2 epochs exactly
  flat = np.concatenate(batches)
  assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
  assert not np.array_equal(flat[:10], flat[10:])  # reshuffled each epoch
  assert it.position() == {"epoch": 2, "index": 0, "num_rows": 10, "seed": 3}
  again = data.PromptIterator(num_rows=10, batch_size=4, seed=3)
  assert np.array_equal(np.concatenate([again.next_indices() for _ in range(5)]), flat)
  other = data.PromptIterator(num_rows=10, batch_size=4, seed=4)
  assert not np.array_equal(np.concatenate([other.next_indices() for _ in range(5)]), flat)


def test_peek_shows_the_next_batch_without_moving_on_also_across_an_epoch():
  it = data.PromptIterator(num_rows=10, batch_size=4, seed=3)
  straight = data.PromptIterator(num_rows=10, batch_size=4, seed=3)
  for _ in range(5):  # batch 3 (indices 8-11) straddles epochs 0 and 1
    position = it.position()
    peeked = it.peek_indices()
    assert it.position() == position
    assert np.array_equal(peeked, it.next_indices())
    assert np.array_equal(peeked, straight.next_indices())


@pytest.mark.parametrize("steps_before_save", [3, 467, 468])  # mid-epoch, at and past a boundary
def test_resume_reproduces_batch_order_on_real_train_size(steps_before_save):
  num_rows, batch = 7473, 16  # 7473 = 467*16 + 1: batch 468 straddles epochs 0 and 1
  straight = data.PromptIterator(num_rows, batch, seed=0)
  expected = [straight.next_indices() for _ in range(steps_before_save + 30)]

  first = data.PromptIterator(num_rows, batch, seed=0)
  for _ in range(steps_before_save):
    first.next_indices()
  saved = json.loads(json.dumps(first.position()))  # as a checkpoint stores it
  resumed = data.PromptIterator(num_rows, batch, seed=0, position=saved)
  for step in range(30):
    assert np.array_equal(resumed.next_indices(), expected[steps_before_save + step])

  with pytest.raises(ValueError, match="num_rows=7473.*num_rows=1319"):
    data.PromptIterator(1319, batch, seed=0, position=saved)
  with pytest.raises(ValueError, match="seed"):
    data.PromptIterator(num_rows, batch, seed=1, position=saved)
