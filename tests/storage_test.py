"""A gs:// workdir: every file grpo_jax writes there itself goes through etils.epath, checked on
an in-memory object store that fsspec serves for gs:// (the store has no append and no rename,
like Cloud Storage). Each file must come out as the same run writes to a local directory.

Not covered: orbax writes checkpoint arrays through tensorstore's own Cloud Storage driver,
which no fake here reaches; our part of a checkpoint (SHA256SUMS, verify) is covered.
"""
import hashlib
import json

import jax
import numpy as np
import pytest

import fixtures
from configs import gsm8k
from grpo_jax import checkpoint, inputs, logging_io, plots, storage
from grpo_jax.errors import UserError
from grpo_jax.models import qwen, weights


@pytest.fixture
def gcs(monkeypatch):
  fixtures.use_fake_gcs(monkeypatch)
  return "gs://bucket/runs/run"


def _write_logs(workdir):
  """What a run's writers do: two steps, a resume that drops step 2, a third step; summary and
  plot."""
  storage.path(workdir).mkdir(parents=True, exist_ok=True)
  storage.write_text(storage.path(workdir) / "config.json", json.dumps({"loss": {"beta": 0.0}}))
  for resume_step, steps in ((-1, (0, 1, 2)), (1, (2, 3))):
    metrics = logging_io.MetricsWriter(workdir, resume_step=resume_step, tensorboard=False)
    samples = logging_io.SamplesWriter(workdir, resume_step=resume_step)
    for step in steps:
      metrics.write(step, {"reward/total/mean": 0.25 * step + resume_step, "loss": 1.0 / (step + 1),
                           "eval/accuracy": 0.1 * step, "entropy": 2.0, "grad_norm": 0.5})
      samples.write(step, [{"prompt": f"question {step}", "completion": "<answer>4</answer>",
                            "rewards": {"math_accuracy": 1.0}, "gold": "4", "advantage": 0.5}])
    metrics.close()
  logging_io.write_summary(workdir)
  plots.plot_metrics(workdir)


def test_a_gs_workdir_gets_the_files_a_local_one_gets(gcs, tmp_path):
  local = tmp_path / "run"
  _write_logs(str(local))
  _write_logs(gcs)
  names = storage.files(local)
  assert names == storage.files(gcs) == sorted(
      ["config.json", "metrics.jsonl", "samples.jsonl", "samples.md", "summary.json",
       "metrics.png"])
  for name in names:  # with the parts appended to them (train.py leaves samples unclosed)
    assert storage.read_bytes(storage.path(gcs) / name) == (local / name).read_bytes(), name
  for name in ("samples.jsonl", "samples.md"):
    storage.compact(storage.path(gcs) / name)
    assert (storage.path(gcs) / name).read_bytes() == (local / name).read_bytes(), name
  steps = [r["step"] for r in logging_io.read_jsonl(f"{gcs}/metrics.jsonl")]
  assert steps == [0, 1, 2, 3]  # the resume dropped the first step 2, as on a local disk
  assert json.loads((storage.path(gcs) / "summary.json").read_text())["end_step"] == 3
  assert (storage.path(gcs) / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert not any(k.endswith(".tmp") for k in fixtures.FakeGCS.store)


def test_checksums_of_a_step_on_gs(gcs):
  step = storage.path(gcs) / "checkpoints" / "7"
  files = {"state/d/abc": b"\x00\x01" * 100, "meta/metadata": b'{"step": 7}', "_METADATA": b"x"}
  for name, data in files.items():
    (step / name).parent.mkdir(parents=True, exist_ok=True)
    (step / name).write_bytes(data)
  checkpoint.write_checksums(str(step))
  expected = "".join(f"{hashlib.sha256(files[n]).hexdigest()}  {n}\n" for n in sorted(files))
  assert (step / checkpoint.CHECKSUMS_FILE).read_text() == expected  # sha256sum's format
  assert checkpoint.verify(str(step)) is None
  (step / "state/d/abc").write_bytes(b"\x00\x02" * 100)
  assert checkpoint.verify(str(step)) == "state/d/abc does not match its checksum"
  (step / "extra").write_bytes(b"")
  assert checkpoint.verify(str(step)) == "extra is not in its SHA256SUMS"


def test_the_tiny_inputs_and_the_final_model_on_gs(gcs, tmp_path):
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=64, synthetic_test=8)
  rows = inputs.datasets(config, gcs)
  tok, stop = inputs.tokenizer(config, gcs, rows[0])
  # Another process of a multi-host run reads what process 0 wrote.
  again = inputs.datasets(config, gcs, build=False)
  tok2, stop2 = inputs.tokenizer(config, gcs, again[0], build=False)
  assert again == rows and stop2 == stop and tok2.get_vocab() == tok.get_vocab()
  local = tmp_path / "local"
  assert inputs.datasets(config, str(local)) == rows
  for name in storage.files(local / "data"):
    assert (storage.path(gcs) / "data" / name).read_bytes() == (local / "data" / name).read_bytes()

  cfg, _ = inputs.model_config(config, tok)
  params = qwen.init_params(cfg, jax.random.key(0), np.float32)
  with storage.local_dir(storage.path(gcs) / "final_model") as out:
    weights.save_checkpoint(params, cfg, out, tokenizer=tok)
  assert "model.safetensors" in storage.files(storage.path(gcs) / "final_model")
  loaded, cfg2 = weights.load_checkpoint(storage.local_copy(storage.path(gcs) / "final_model"))
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tensorboard_on_gs_without_its_client_library_is_a_user_error(gcs, monkeypatch):
  from tensorboardX import record_writer
  monkeypatch.setattr(record_writer, "GCS_ENABLED", False)
  with pytest.raises(UserError, match="config.train.tensorboard: .*google-cloud-storage"):
    logging_io.MetricsWriter(gcs, tensorboard=True)


def _bytes_written(monkeypatch) -> list[int]:
  """A counter of the bytes written to the in-memory store (every object write goes through
  MemoryFile.write)."""
  from fsspec.implementations import memory
  written = [0]
  write = memory.MemoryFile.write

  def counting(self, data):
    written[0] += len(data)
    return write(self, data)
  monkeypatch.setattr(memory.MemoryFile, "write", counting)
  return written


def test_appends_on_gs_write_bytes_linear_in_the_length(gcs, monkeypatch):
  """Each append is written once as a part, and the rewrites that fold the parts in double in
  size: the bytes written stay within 3 times the file, at 100 or 400 lines alike (the
  whole-file rewrite of every append wrote ~ lines / 2 times the file)."""
  written = _bytes_written(monkeypatch)
  ratios = {}
  for n in (100, 400):
    p = storage.path(gcs) / f"log{n}.jsonl"
    lines = [json.dumps({"step": i, "loss": 1.0 / (i + 1)}) + "\n" for i in range(n)]
    written[0] = 0
    for i, line in enumerate(lines):
      storage.append_text(p, line)
      if i % 37 == 0:  # readers see every line so far, wherever it lives
        assert storage.read_text(p) == "".join(lines[:i + 1])
    size = len("".join(lines))
    assert storage.read_text(p) == "".join(lines)
    assert [r["step"] for r in logging_io.read_jsonl(p)] == list(range(n))
    ratios[n] = written[0] / size
    storage.compact(p)
    assert p.read_text() == "".join(lines)  # the file alone, the parts folded in
    assert storage.files(storage.path(gcs)) == sorted(
        f"log{m}.jsonl" for m in ratios)  # no part is listed as a file
  # Parts once (1x) and rewrites that double (< 2x): at most 3x plus a line, at any length.
  # Rewriting the file at every append wrote 49x at 100 lines and 197x at 400.
  assert ratios[100] <= 3.5 and ratios[400] <= 3.5, ratios


def test_a_rewrite_cut_short_leaves_parts_that_readers_skip(gcs):
  p = storage.path(gcs) / "metrics.jsonl"
  for i in range(3):
    storage.append_text(p, f"line {i}\n")
  assert storage.read_text(p) == "line 0\nline 1\nline 2\n"
  parts = list((storage.path(gcs) / "metrics.jsonl.parts").iterdir())
  assert len(parts) == 1  # 'line 2' waits as a part; the file holds two lines
  # A fold that wrote the file and crashed before removing the parts: they name the old length.
  p.write_bytes(b"line 0\nline 1\nline 2\n")
  assert storage.read_text(p) == "line 0\nline 1\nline 2\n"
  storage.append_text(p, "line 3\n")
  assert storage.read_text(p) == "line 0\nline 1\nline 2\nline 3\n"
  # A whole rewrite (a resume's truncation) to the old length drops the parts first.
  storage.append_text(p, "line 4\n")
  storage.write_text(p, "line 0\nline 1\nline 2\nline 3\n")
  assert storage.read_text(p) == "line 0\nline 1\nline 2\nline 3\n"


def test_a_whole_local_dir_appears_complete_or_not_at_all(tmp_path):
  """local_dir(whole=True): the files appear under p only when the block ends; an exception in
  it (an interrupted export) leaves neither p nor its partial sibling; a later write replaces
  an older p as a whole (no file of the old one left)."""
  p = tmp_path / "final_model"
  with pytest.raises(KeyboardInterrupt):
    with storage.local_dir(p, whole=True) as out:
      (tmp_path / "final_model.partial" / "config.json").write_text("{}")
      assert out == str(tmp_path / "final_model.partial") and not p.exists()
      raise KeyboardInterrupt
  assert sorted(x.name for x in tmp_path.iterdir()) == []
  for files in (("config.json", "old.bin"), ("config.json",)):
    with storage.local_dir(p, whole=True) as out:
      for name in files:
        (tmp_path / "final_model.partial" / name).write_text(name)
    assert sorted(x.name for x in p.iterdir()) == sorted(files)
  assert sorted(x.name for x in tmp_path.iterdir()) == ["final_model"]
