"""inputs.datasets / inputs.tokenizer with `shared`: a group's members build their common
data and tokenizer once, and each workdir still gets the files its own build writes."""
import os

from configs import gsm8k
from grpo_jax import inputs, storage, synthetic, tokenizer as tokenizer_lib


def _config(seed=0):
  config = gsm8k.get_config("tiny")
  config.data.update(synthetic_train=64, synthetic_test=8)
  config.seed = seed
  return config


def _files(directory):
  return {name: open(os.path.join(directory, name), "rb").read()
          for name in storage.files(directory)}


def test_members_with_the_same_data_build_it_once_and_get_a_builds_files(tmp_path,
                                                                         monkeypatch):
  builds = {"data": 0, "tokenizer": 0}
  write_splits, build_tiny = synthetic.write_splits, tokenizer_lib.build_tiny_tokenizer

  def count(kind, fn):
    def counted(*args, **kwargs):
      builds[kind] += 1
      return fn(*args, **kwargs)
    return counted
  monkeypatch.setattr(synthetic, "write_splits", count("data", write_splits))
  monkeypatch.setattr(tokenizer_lib, "build_tiny_tokenizer", count("tokenizer", build_tiny))

  # Each member alone, as separate runs build them.
  alone = {}
  for name, seed in (("a", 0), ("b", 1)):
    rows = inputs.datasets(_config(seed), str(tmp_path / "alone" / name))
    alone[name] = rows, inputs.tokenizer(_config(seed), str(tmp_path / "alone" / name), rows[0])
  assert builds == {"data": 2, "tokenizer": 2}

  shared = {}
  got = {}
  for name, seed in (("m0", 0), ("m1", 0), ("m2", 1)):
    rows = inputs.datasets(_config(seed), str(tmp_path / name), shared=shared)
    got[name] = rows, inputs.tokenizer(_config(seed), str(tmp_path / name), rows[0],
                                       shared=shared)
  # m1 has m0's settings: nothing built again; m2's seed gives other problems: built.
  assert builds == {"data": 4, "tokenizer": 4}
  for name, like in (("m0", "a"), ("m1", "a"), ("m2", "b")):
    rows, (tok, stop_ids) = got[name]
    want_rows, (want_tok, want_stop) = alone[like]
    assert rows == want_rows
    assert tok.get_vocab() == want_tok.get_vocab() and stop_ids == want_stop
    for sub in ("data", "tokenizer"):
      assert _files(tmp_path / name / sub) == _files(tmp_path / "alone" / like / sub), (name, sub)
  assert got["m0"][0] != got["m2"][0]
  # The members hold their own lists: one member's slicing is not another's.
  got["m1"][0][0].pop()
  assert got["m0"][0][0] == alone["a"][0][0]
