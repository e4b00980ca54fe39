"""GSM8K-style problems → chat prompts → left-padded token buckets, in a resumable order.

Rows are plain dicts in GSM8K's schema, whatever the source's field names were:

    rows = load_rows("../shared/gsm8k", split="test")   # or "openai/gsm8k", config_name="main"
    rows[0]  # {"question": "Janet’s ducks lay 16 eggs ...", "answer": "... #### 18"}
    gold_answer(rows[0]["answer"])  # -> "18"

    it = PromptIterator(len(rows), batch_size=8, seed=0)
    batch = [rows[i] for i in it.next_indices()]
    saved = it.position()                 # {"epoch": 0, "index": 8, "num_rows": 1319, "seed": 0}
    ids = [tokenizer(build_prompt(tokenizer, r["question"]), add_special_tokens=False).input_ids
           for r in batch]
    tokens_BP, mask_BP = pad_to_bucket(ids, buckets=(128, 256), pad_id=tokenizer.pad_token_id)
"""
from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
import re
from collections.abc import Sequence

import numpy as np

from grpo_jax import hub
from grpo_jax.errors import UserError

_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# "#### 1,080" -> "1080"; GSM8K gold answers are integers, possibly negative, with commas.
# Commas only as thousands separators: "1,2" or "0,5" is no number the math reward reads, and
# loading it would leave every completion of that problem unscored.
_GOLD_RE = re.compile(r"####\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s*$")


def gold_answer(answer_text: str) -> str:
  """The number after GSM8K's final '#### ', thousands separators removed: '... #### 1,080' ->
  '1080'. Raises on anything else after '####' (the math reward would score none of it)."""
  match = _GOLD_RE.search(answer_text)
  if match is None:
    tail = answer_text[-60:]
    raise ValueError(f"answer does not end in '#### <number>': ...{tail!r}")
  return match.group(1).replace(",", "")


def _local_files(source: str, split: str, field: str) -> list[str] | None:
  """Files for a local source (a file, a glob, or a directory holding `<split>.<ext>`); None for
  a hub id (see grpo_jax.hub for the rule)."""
  if glob.has_magic(source):
    files = sorted(glob.glob(os.path.expanduser(source)))
    if not files:
      raise UserError(f"{field}: no data file matches {source!r}")
    return files
  path = hub.local_path(source, field)
  if path is None and source.endswith(tuple(_LOCAL_BUILDERS)):
    raise UserError(f"{field}: data file {source!r} does not exist")
  if path is None:
    return None  # a hub id
  if os.path.isfile(path):
    return [path]
  found = [os.path.join(path, split + ext) for ext in _LOCAL_BUILDERS
           if os.path.isfile(os.path.join(path, split + ext))]
  if not found:
    raise UserError(f"{field}: data directory {source!r} has no {split}.json, {split}.jsonl or "
                    f"{split}.parquet")
  return found[:1]


def _read_jsonl(files: Sequence[str], field: str) -> tuple[list[dict], list[str]]:
  """The JSON objects of JSON-lines files, in order, and their columns (every key, first seen
  first). A line that is not a JSON object is a UserError naming the file and the line."""
  rows, columns = [], {}
  for path in files:
    with open(path, "rb") as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except ValueError as e:  # not JSON, or not UTF-8
          raise UserError(f"{field}: cannot read {path}:{number}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
          raise UserError(f"{field}: cannot read {path}:{number}: expected a JSON object, got "
                          f"{type(row).__name__}")
        rows.append(row)
        columns.update(dict.fromkeys(row))
  return rows, list(columns)


@contextlib.contextmanager
def _quiet(datasets):
  """datasets without its log records and progress bars, for local files (read in about a
  second): a file it cannot read raises, which load_rows turns into one line, and its own
  record (printed by its handler and again by absl's, as `E1207 ... json.py:352] Failed to load
  JSON ...`) would only precede that line."""
  logger = datasets.utils.logging.get_logger("datasets")
  level, bars = logger.level, datasets.utils.logging.is_progress_bar_enabled()
  logger.setLevel(logging.CRITICAL + 1)
  datasets.utils.logging.disable_progress_bar()
  try:
    yield
  finally:
    logger.setLevel(level)
    if bars:
      datasets.utils.logging.enable_progress_bar()


def _blank(path: str) -> bool:
  """True for a file holding nothing but whitespace."""
  with open(path, "rb") as f:
    while chunk := f.read(1 << 16):
      if chunk.strip():
        return False
  return True


def _read_with_datasets(source: str, files: Sequence[str] | None, split: str,
                        config_name: str | None, cache_dir: str | None, field: str,
                        keep: Sequence[str]) -> tuple[list[dict], list[str]]:
  """A .json or .parquet file's rows (files), or a hub data set's split (files None), read by
  datasets, with only the columns of `keep` it has; and all its columns."""
  import datasets  # Heavy import, only needed here.

  if files is not None:
    try:
      with _quiet(datasets):
        ds = datasets.load_dataset(_LOCAL_BUILDERS[os.path.splitext(files[0])[1]],
                                   data_files=list(files), split="train", cache_dir=cache_dir)
    except datasets.exceptions.DatasetGenerationError as e:
      raise UserError(f"{field}: cannot read {', '.join(files)}: {e.__cause__ or e}") from e
  else:
    hub.prepare()
    try:
      ds = datasets.load_dataset(source, config_name, split=split, cache_dir=cache_dir)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
      raise hub.unavailable(source, field, "data set", e) from e
  columns = list(ds.column_names)
  return ds.select_columns([c for c in dict.fromkeys(keep) if c in columns]).to_list(), columns


def load_rows(source: str, split: str = "train", *, config_name: str | None = None,
              question_field: str = "question", answer_field: str = "answer",
              cache_dir: str | None = None,
              field: str = "config.data.source") -> list[dict[str, str]]:
  """Loads problems as [{"question": ..., "answer": ...}] from local files or the hub.

  source: a .json/.jsonl/.parquet file or glob, a directory with `<split>.jsonl` (etc.), or a hub
  id such as "openai/gsm8k" (with config_name="main"). Every answer must end in '#### N'.
  Bad data raises UserError naming the file and line or row; `field` names the setting.
  """
  files = _local_files(source, split, field)
  if files is not None:
    ext = os.path.splitext(files[0])[1]
    if ext not in _LOCAL_BUILDERS:
      raise UserError(f"{field}: data file {files[0]!r}: expected .json, .jsonl or .parquet")
    if all(_blank(path) for path in files):  # datasets would raise a bare StopIteration
      raise UserError(f"{field}: {', '.join(files)}: no rows (the file is empty)")
  if files is not None and all(path.endswith(".jsonl") for path in files):
    # Read here: datasets would parse them into an Arrow cache on disk first, which with its
    # import costs every run's start-up about 2 s for the same rows.
    table, columns = _read_jsonl(files, field)
  else:
    table, columns = _read_with_datasets(source, files, split, config_name, cache_dir, field,
                                         (question_field, answer_field))
  where = ", ".join(files) if files is not None else f"{source} [{split}]"
  for name in (question_field, answer_field):
    if name not in columns:
      raise UserError(f"{where}: field {name!r} is missing (columns: {columns}); set "
                      "config.data.question_field / answer_field to match the data")
  rows = [{"question": row.get(question_field), "answer": row.get(answer_field)}
          for row in table]
  if not rows:
    raise UserError(f"{field}: {where}: no rows")
  for i, row in enumerate(rows):
    for key, name in (("question", question_field), ("answer", answer_field)):
      if not isinstance(row[key], str):
        raise UserError(f"{where}: row {i}, field {name!r} is {row[key]!r}, not a string")
    try:
      gold_answer(row["answer"])
    except ValueError as e:
      raise UserError(f"{where}: row {i}, field {answer_field!r}: {e}") from None
  return rows


def load_train_eval(source: str, train_split: str, eval_split: str,
                    **kw) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
  """(train rows, eval rows): load_rows of each split (kw as load_rows takes them).

  A file or glob source holds one split whatever the split's name: read for two different
  splits it would give the training problems as the held-out ones. That is refused.
  """
  field = kw.get("field", "config.data.source")
  if train_split != eval_split:
    files = _local_files(source, train_split, field)
    if files is not None and files == _local_files(source, eval_split, field):
      raise UserError(f"{field}: {source!r} is a data file (or glob), which holds one split: the "
                      f"train split {train_split!r} and the eval split {eval_split!r} would both "
                      "be its rows, and the held-out accuracy would be measured on training "
                      f"problems; use a directory holding {train_split}.jsonl and "
                      f"{eval_split}.jsonl (or .json, .parquet)")
  return load_rows(source, train_split, **kw), load_rows(source, eval_split, **kw)


_QUESTION_MARK = "<<the question>>"  # what check_user_template fills {question} with


def check_user_template(template: object, setting: str = "data.user_template",
                        **fields: str) -> None:
  """The user turn's rule: a str whose placeholders are {question} and `fields` alone (an
  agent's fills {tools} and {tool_names} too) and that holds {question}, so every prompt holds
  its own question. ValueError naming `setting` (a literal brace is written {{ or }})."""
  if not isinstance(template, str):
    raise ValueError(f"{setting}: must be a str with a {{question}} placeholder, got {template!r}")
  try:
    filled = template.format(question=_QUESTION_MARK, **fields)
  except (KeyError, IndexError, ValueError, AttributeError) as e:
    names = "".join(f", {{{name}}}" for name in fields)
    raise ValueError(f"{setting}: {template!r} cannot be filled with the question alone "
                     f"({type(e).__name__}: {e}); its placeholders are {{question}}{names}, and "
                     "a literal brace is written {{ or }}") from None
  if _QUESTION_MARK not in filled:
    raise ValueError(f"{setting}: {template!r} has no {{question}} placeholder: every prompt "
                     "would be the same text, without its question")


def build_prompt(tokenizer, question: str, system_prompt: str | None = None,
                 user_template: str = "{question}") -> str:
  """The chat-templated prompt text, ending with the assistant turn's header.

  system_prompt=None leaves the system turn to the template (Qwen2.5 inserts its default one).
  """
  messages = [{"role": "user", "content": user_template.format(question=question)}]
  if system_prompt is not None:
    messages.insert(0, {"role": "system", "content": system_prompt})
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_prompts(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
  # The chat template already holds every special token; the tokenizer must not add a BOS.
  return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=False).input_ids]


def pad_to_bucket(ids_list: Sequence[Sequence[int]], buckets: Sequence[int],
                  pad_id: int, longest: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads prompts to the smallest bucket that holds the longest one (or `longest` tokens,
  if more: the processes of a multi-host run pad their shares to one common bucket).

  Left padding puts every prompt's last token in the last column, so decoding starts at the same
  position for all rows. A fixed set of buckets bounds the number of compiled shapes.

    pad_to_bucket([[5, 6, 7], [8]], buckets=(4, 8), pad_id=0)
    -> tokens_BP [[0, 5, 6, 7], [0, 0, 0, 8]] (int32), mask_BP [[0, 1, 1, 1], [0, 0, 0, 1]] (bool)
  """
  if not ids_list:
    raise ValueError("pad_to_bucket: no prompts")
  length = bucket_length(max(longest, *(len(ids) for ids in ids_list)), buckets)
  tokens_BP = np.full((len(ids_list), length), pad_id, dtype=np.int32)
  mask_BP = np.zeros((len(ids_list), length), dtype=bool)
  for row, ids in enumerate(ids_list):
    if len(ids):
      tokens_BP[row, length - len(ids):] = ids
      mask_BP[row, length - len(ids):] = True
  return tokens_BP, mask_BP


class PromptIterator:
  """Row indices in a shuffled order, fresh each epoch, resumable from `position()`.

  Epoch e's order is a permutation seeded by (seed, e), so it depends only on the seed and the
  epoch: a restored position replays exactly the batches an uninterrupted run would have seen.
  A batch that runs past the end of an epoch is completed from the next epoch's order, so every
  row is seen once per epoch and every batch is full.
  """

  def __init__(self, num_rows: int, batch_size: int, seed: int, position: dict | None = None):
    if num_rows <= 0:
      raise ValueError(f"PromptIterator: the dataset is empty (num_rows={num_rows})")
    if batch_size <= 0:
      raise ValueError(f"PromptIterator: prompts_per_step must be positive, got {batch_size}")
    self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
    self._epoch, self._index = 0, 0
    self._order = self._permutation(0)
    if position is not None:
      self.restore(position)

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

  def position(self) -> dict[str, int]:
    """JSON-able; num_rows and seed ride along so a resume on other data fails loudly."""
    return {"epoch": self._epoch, "index": self._index, "num_rows": self.num_rows,
            "seed": self.seed}

  def restore(self, position: dict) -> None:
    for key in ("num_rows", "seed"):
      if position.get(key) != getattr(self, key):
        raise ValueError(f"data position was saved with {key}={position.get(key)!r}, but this "
                         f"run has {key}={getattr(self, key)!r}: resuming would change the data")
    epoch, index = int(position["epoch"]), int(position["index"])
    if epoch < 0 or not 0 <= index < self.num_rows:
      raise ValueError(f"data position {position} is out of range for {self.num_rows} rows")
    self._epoch, self._index = epoch, index
    self._order = self._permutation(epoch)

  def peek_indices(self) -> np.ndarray:
    """The indices next_indices returns next, without moving on."""
    return copy.copy(self).next_indices()  # (next_indices rebinds the order, never edits it)

  def next_indices(self) -> np.ndarray:
    """The next batch_size row indices (int64 array)."""
    out = []
    while len(out) < self.batch_size:
      take = min(self.batch_size - len(out), self.num_rows - self._index)
      out.extend(self._order[self._index:self._index + take])
      self._index += take
      if self._index == self.num_rows:
        self._epoch, self._index = self._epoch + 1, 0
        self._order = self._permutation(self._epoch)
    return np.asarray(out, dtype=np.int64)


def bucket_length(longest: int, buckets: Sequence[int]) -> int:
  """The smallest bucket that holds `longest` tokens."""
  fitting = [b for b in sorted(buckets) if b >= longest]
  if not fitting:
    raise ValueError(f"a prompt has {longest} tokens, more than the largest prompt bucket "
                     f"{max(buckets)} (buckets: {sorted(buckets)}); raise the buckets or "
                     "filter long prompts")
  return fitting[0]


def pad_right(ids_list: Sequence[Sequence[int]], length: int,
              pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads completions to `length`: (tokens [B, length] int32, mask [B, length] int32).

    pad_right([[5, 6], [7]], 3, pad_id=0) -> [[5, 6, 0], [7, 0, 0]], [[1, 1, 0], [1, 0, 0]]
  """
  tokens = np.full((len(ids_list), length), pad_id, np.int32)
  mask = np.zeros((len(ids_list), length), np.int32)
  for row, ids in enumerate(ids_list):
    if len(ids) > length:
      raise ValueError(f"row {row} has {len(ids)} tokens, more than the width {length}")
    tokens[row, :len(ids)], mask[row, :len(ids)] = ids, 1
  return tokens, mask


def padded_width(longest: int, multiple: int, cap: int) -> int:
  """The batch's width: its longest row rounded up to a multiple, at most cap (and >= 1).

  Fine widths keep padding small while bounding the compiled shapes to cap / multiple.
  """
  return min(cap, max(1, -(-longest // multiple) * multiple))
