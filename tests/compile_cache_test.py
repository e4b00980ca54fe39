"""The persistent compilation cache: which directory a setting means, and that a program
compiled once is loaded from it by a later compile (the same numbers), and not when it is off;
and the XLA options of CPU programs (LLVM -O1), read by XLA and computing what NumPy does."""
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fixtures
from grpo_jax import compile_cache, sharding


def test_settings_name_the_directory(monkeypatch, tmp_path):
  assert compile_cache.resolve("") is None
  assert compile_cache.resolve("gs://bucket/xla") == "gs://bucket/xla"
  monkeypatch.setenv("HOME", str(tmp_path))
  assert compile_cache.resolve("~/xla") == str(tmp_path / "xla")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/from/env")
  assert compile_cache.resolve(None) == "/from/env"
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.resolve(None) == str(tmp_path / "xdg" / "grpo_jax" / "xla")
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert compile_cache.resolve(None) == str(tmp_path / ".cache" / "grpo_jax" / "xla")


@pytest.fixture
def hits():
  """Counts the persistent cache's hits while the test runs."""
  seen = []

  def listener(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      seen.append(event)
  jax.monitoring.register_event_listener(listener)
  yield seen
  jax.monitoring.unregister_event_listener(listener)


@pytest.fixture
def restore_session_cache():
  """Lets the test write programs of any compile time and change the cache's settings, and
  puts back the session's cache (conftest) afterwards."""
  max_size = jax.config.jax_compilation_cache_max_size
  min_time = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # this small program too
  yield
  jax.config.update("jax_compilation_cache_max_size", max_size)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
  compile_cache.enable(None)  # the session's directory (conftest's JAX_COMPILATION_CACHE_DIR)


def _program(x):
  for i in range(4):
    x = jnp.tanh(x @ x.T * (0.1 + i)) + jnp.cumsum(x, axis=0)
  return x


def test_a_compiled_program_is_loaded_by_the_next_compile(tmp_path, hits,
                                                         restore_session_cache, monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
  jax.config.update("jax_compilation_cache_max_size", -1)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(24, 24)), jnp.float32)
  assert compile_cache.enable(str(tmp_path / "xla")) == str(tmp_path / "xla")
  # No cap was set: enable sets one (LRU eviction, and the lock that readers and writers take).
  assert jax.config.jax_compilation_cache_max_size == compile_cache.MAX_BYTES
  fresh = np.asarray(jax.jit(_program)(x))
  entries = set(os.listdir(tmp_path / "xla"))
  assert any(name.startswith("jit__program") for name in entries), entries
  assert not hits

  jax.clear_caches()  # as a new process: nothing compiled in memory
  loaded = np.asarray(jax.jit(_program)(x))
  assert len(hits) == 1
  np.testing.assert_array_equal(loaded, fresh)

  compile_cache.enable("")  # off: compiled again, nothing read or written
  jax.clear_caches()
  np.testing.assert_array_equal(np.asarray(jax.jit(_program)(x)), fresh)
  np.asarray(jax.jit(lambda y: _program(y) * 2)(x))
  assert len(hits) == 1
  assert set(os.listdir(tmp_path / "xla")) == entries


def test_a_bucket_cache_writes_every_program_there_and_nothing_on_the_local_disk(
    tmp_path, restore_session_cache, monkeypatch):
  fixtures.use_fake_gcs(monkeypatch)
  monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
  monkeypatch.chdir(tmp_path)
  jax.config.update("jax_compilation_cache_max_size", -1)
  compile_cache.enable(str(tmp_path / "xla"))  # a local directory first: capped
  assert jax.config.jax_compilation_cache_max_size == compile_cache.MAX_BYTES
  assert compile_cache.enable("gs://bucket/xla") == "gs://bucket/xla"
  x = jnp.asarray(np.random.default_rng(2).normal(size=(24, 24)), jnp.float32)
  jax.clear_caches()  # compiled again, not taken from memory
  jax.jit(_program)(x).block_until_ready()
  jax.jit(lambda y: _program(y) - 1)(x).block_until_ready()
  cached = [k for k in fixtures.FakeGCS.store if k.endswith("-cache")]
  assert any("jit__program" in k for k in cached) and any("jit__lambda" in k for k in cached), (
      cached)
  assert os.listdir(tmp_path) == []  # no lock file under ./gs:/


def test_cpu_programs_compile_at_llvm_o1_and_other_platforms_keep_their_defaults():
  opts = compile_cache.compiler_options(sharding.make_mesh((1, 2, 1)))
  assert opts == {"xla_backend_optimization_level": 1} == compile_cache.compiler_options()
  gpu_mesh = SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")], dtype=object))
  assert compile_cache.compiler_options(gpu_mesh) is None
  # XLA checks option names (a misspelt one fails the compile), so this one is read; its
  # program computes what NumPy does.
  x = np.random.default_rng(1).normal(size=(24, 24)).astype(np.float32)
  ref = x.astype(np.float64)
  for i in range(4):
    ref = np.tanh(ref @ ref.T * (0.1 + i)) + np.cumsum(ref, axis=0)
  np.testing.assert_allclose(jax.jit(_program, compiler_options=opts)(x), ref, rtol=1e-4,
                             atol=1e-4)
  with pytest.raises(Exception, match="No such compile option"):
    jax.jit(_program, compiler_options={"xla_backend_optimisation_level": 1})(x)
