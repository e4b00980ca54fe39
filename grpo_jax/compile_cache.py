"""How grpo_jax compiles: JAX's persistent compilation cache for a run, and the XLA options of its
programs on the CPU.

The cache: compiled programs go to disk, and a later process that needs the same programs (a
resumed run, the next run of a sweep, a re-run of a config) loads them instead of compiling
again.

    path = compile_cache.enable(config.train.compilation_cache)

config.train.compilation_cache:
  None (default)  $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/grpo_jax/xla
                  (~/.cache/grpo_jax/xla)
  a path          that directory (local, or gs://... on a TPU VM: it outlives the VM)
  ""              off: every process compiles everything

Why it is safe to leave on: JAX keys an entry by the program itself, its compile options, the
jax / jaxlib versions and the devices, so a changed config, model, shape or library compiles
anew and never runs a stale program; XLA:CPU refuses an entry built for CPU features this
machine lacks, and an unreadable entry is recompiled with a warning. The numbers are those of
a fresh compile: the same executable is run. What is cached is code that runs, so keep the
directory where only you can write (JAX's own warning). Programs that compile in under
jax_persistent_cache_min_compile_time_secs (JAX's default, 1 s) are not written. A local
directory is capped at MAX_BYTES, least recently used entries going first, unless
JAX_COMPILATION_CACHE_MAX_SIZE sets another cap; a gs:// one is not capped (see enable).

Compiling ahead: `in_background(fn)` runs fn (a `.lower(...).compile()` of a jitted program, on
abstract arguments) in a compile thread (the train step's, or the sampler's: a group's first
step compiles both at once). jax.jit keeps the executable, so the
call that needs it later runs it without compiling, or waits for the compile still under way
(train_step.TrainStep.precompile, members.precompile_generate). XLA compiles without holding
the GIL: the host goes on sampling, scoring or training meanwhile.

The options: `compiler_options(mesh)` goes to every jax.jit of a large program (sampler, train
step, log-prob and reward-model passes). On the CPU it compiles with LLVM at -O1 instead of XLA's
-O3: the matmuls are library calls either way, and what LLVM optimises is the fusions around
them. Measured on benchmarks/trl_step.py's small workload (experiments/speed_history.md):
compiles 10–20% shorter, steps no slower. Results differ from -O3's in the last bits (fused
multiply-adds are formed differently), as between any two compilers. Other platforms get None:
their defaults.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

MAX_BYTES = 8 << 30
CPU_OPTIONS = {"xla_backend_optimization_level": 1}


def resolve(setting: str | None) -> str | None:
  """The cache directory that `setting` (config.train.compilation_cache) means; None: off.

  >>> resolve("")  # off
  >>> resolve("/fast/xla")
  '/fast/xla'
  """
  if setting == "":
    return None
  if setting:
    return setting if "://" in setting else os.path.abspath(os.path.expanduser(setting))
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(base, "grpo_jax", "xla")


def enable(setting: str | None) -> str | None:
  """Points this process's JAX at the cache `setting` means (or turns it off); returns the
  directory. Call it before the run compiles anything; calling it again with another
  directory (several runs in one process) switches the cache over."""
  path = resolve(setting)
  cap = jax.config.jax_compilation_cache_max_size
  if path and not os.environ.get("JAX_COMPILATION_CACHE_MAX_SIZE"):
    # A cap also makes JAX lock a local directory around each read and write, so processes
    # sharing it (a sweep's runs) never read an entry being written. A bucket gets none: JAX
    # would lock it with a file on the local disk (./gs:/BUCKET/...), which no other host
    # sees, and its eviction misreads the bucket's paths (writes failed).
    if "://" in path and cap == MAX_BYTES:
      jax.config.update("jax_compilation_cache_max_size", -1)
    elif "://" not in path and cap == -1:
      jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  if path != jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", path)
    jax_cache.reset_cache()  # the next compile opens the new directory (or none)
  return path


def platform(mesh=None) -> str:
  """The platform ('cpu', 'gpu', 'tpu') of `mesh`'s devices (None: JAX's default devices)."""
  return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def compiler_options(mesh=None) -> dict | None:
  """The `compiler_options` for jax.jit of a program that runs on `mesh`'s devices (None: JAX's
  default devices): CPU_OPTIONS on the CPU, else None."""
  return dict(CPU_OPTIONS) if platform(mesh) == "cpu" else None


def abstract(x, committed: bool | None = None) -> jax.ShapeDtypeStruct:
  """x's shape, dtype and weak type, for `.lower` in the compile thread (which then holds no
  buffer of x's), and its sharding where x is committed to its devices: jit compiles for the
  shardings of committed arrays and for none of uncommitted ones, so only then is the program
  the one a later call with x runs. committed: say so for an x that is itself abstract (an x
  that is a jax.ShapeDtypeStruct already is returned as it is, without committed)."""
  if isinstance(x, jax.ShapeDtypeStruct) and committed is None:
    return x
  committed = x.committed if committed is None else committed
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None,
                              weak_type=getattr(x, "weak_type", False))


def in_background(fn, lane: str = "") -> concurrent.futures.Future:
  """Runs fn() in a compile thread: one a process for each lane ('': the train step's programs,
  'sampler': the sampler's), in which compiles queue in the order given."""
  return _compile_thread(lane).submit(fn)


@functools.cache
def _compile_thread(lane: str) -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix="grpo_jax-compile" + (f"-{lane}" if lane else ""))
