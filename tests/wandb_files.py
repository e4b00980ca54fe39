"""Reading back what wandb wrote for an offline run (WORKDIR/wandb/offline-run-*/run-ID.wandb):
wandb 0.31 has no Python reader of its own, so the framing is parsed here and each record decoded
with wandb's own protobuf schema."""

import glob
import json
import os
import struct
import zlib


def records(run_dir):
  """The records of an offline run's .wandb file, decoded with wandb's own protobuf schema
  (wandb.proto.wandb_internal_pb2.Record). The file: a 7-byte header (':W&B', magic 0xBEE1,
  version), then LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header (CRC32 of
  the type byte and the bytes, uint16 length, type 1 full / 2 first / 3 middle / 4 last) and
  its bytes."""
  from wandb.proto import wandb_internal_pb2
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  data = open(path, "rb").read()
  assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
  records, pos, parts, block = [], 7, b"", 32768
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if kind == 0:  # zero padding at the end of the file
      break
    chunk = data[pos + 7:pos + 7 + length]
    assert crc == zlib.crc32(bytes([kind]) + chunk), f"{path}: bad chunk at byte {pos}"
    parts += chunk
    pos += 7 + length
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(parts))
      parts = b""
  return records


def history(records):
  """{step: {key: value}} of the history records (a nested key, as an image's fields are
  logged, becomes a dict), and the run's config {key: value} (the run record's and updates)."""
  history, config = {}, {}
  for r in records:
    if r.HasField("history"):
      row = history.setdefault(r.history.step.num, {})
      for item in r.history.item:
        *parents, leaf = [item.key] if item.key else list(item.nested_key)
        if parents[:1] == ["_"] or leaf.startswith("_step") or leaf in ("_runtime", "_timestamp"):
          continue
        node = row
        for part in parents:
          node = node.setdefault(part, {})
        node[leaf] = json.loads(item.value_json)
    for update in ([r.run.config] if r.HasField("run") else []) + (
        [r.config] if r.HasField("config") else []):
      config.update({item.key: json.loads(item.value_json) for item in update.update})
  return history, config
