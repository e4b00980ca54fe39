"""Test session set-up: 8 fake CPU devices so sharding is exercised without accelerators, and
one persistent compilation cache for the whole session (grpo_jax.compile_cache).

The cache: the end-to-end tests start the tiny preset in many processes (runs, kills, resumes,
sweeps, two hosts), and each compiled the same programs again. They share one directory, made
fresh for the session, so nothing is carried over from an earlier one, and removed at its end.
Programs that compile in 0.5 s or more are written: the train steps, prefills, decode loops and
inits that the runs share. The eager operations (thousands of one-op programs, a few tens of
milliseconds each) are not: a process keeps its own in memory, and writing them cost more than
it saved. Each write under the cap scans the whole directory (JAX's LRU eviction reads every
entry's size and access time), so the suite's writes cost time quadratic in their number: with
every program written (about 3,000 entries by the middle of a run), five lora_train_test tests
took 79 s of CPU against 59 s with this threshold (the same pre-filled directory).
"""
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Made by the first process to load this file (the controller; its pytest-xdist workers and
# every subprocess inherit the variable) and removed by it at the end.
_OWNED = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWNED:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="grpo_jax_test_xla_")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# A cap makes JAX lock the directory around reads and writes (processes share it).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))


def pytest_sessionfinish(session):
  if _OWNED and not hasattr(session.config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
