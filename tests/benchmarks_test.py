"""Benchmarks' set-up, checked without running them: benchmarks/sweep.py's commands (each arm's
own fresh compilation cache), benchmarks/lora_decode.py's timed step (the KV cache written in
place), benchmarks/trl_step.py's reference params (stored as a run stores them) and the config
it gives TRL (forced length in the generator's own field, no old-log-prob forward), and that
benchmarks/group_phases.py times functions that exist."""
import importlib
import importlib.util
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import compile_cache, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _load(name, path):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_sweep_gives_each_arm_a_fresh_compilation_cache(tmp_path):
  """Every command sweep.py builds names its arm's compilation cache once: the K separate runs
  one directory, the vmapped group's members another, the prefix a third, all under the
  sweep's workdir (which main empties), none of them the user's default cache."""
  bench = _load("sweep_benchmark", "sweep.py")
  workdir = str(tmp_path / "bench")
  runs = bench.plan("configs/gsm8k.py:tiny", workdir, k=3, steps=2, lora=False)
  flag = "--config.train.compilation_cache="

  def cache_of(cmd):
    found = [x[len(flag):] for x in cmd if x.startswith(flag)]
    assert len(found) == 1, cmd
    return found[0]

  prefix = cache_of(runs["prefix"])
  separate = {cache_of(cmd) for _, cmd in runs["separate"]}
  members = runs["group"]["members"]
  vmapped = {m["args"]["train.compilation_cache"] for m in members}
  assert len(runs["separate"]) == len(members) == 3
  assert len(separate) == len(vmapped) == 1, (separate, vmapped)
  dirs = {prefix, *separate, *vmapped}
  assert len(dirs) == 3, dirs  # one per arm
  assert dirs == set(runs["caches"].values())
  default = compile_cache.resolve(None)
  for d in dirs:
    assert os.path.dirname(os.path.dirname(d)) == workdir, d
    assert not os.path.exists(d) and d != default
    assert compile_cache.resolve(d) == d  # as the run's config reads it back
  # The group's members differ only where a vmapped group may.
  keys = set().union(*(m["args"] for m in members))
  differ = {key for key in keys if len({repr(m["args"].get(key)) for m in members}) > 1}
  assert differ == {"optim.lr"} and differ <= set(sweep.VMAP_VARIABLE)
  # --members reaches the group's members only (a separate run has no group).
  runs = bench.plan("configs/gsm8k.py:tiny", workdir, k=3, steps=2, lora=False, members="map")
  assert {m["args"]["train.members"] for m in runs["group"]["members"]} == {"map"}
  assert not any("train.members" in x for _, cmd in runs["separate"] for x in cmd)


@pytest.fixture
def own_flags():
  """The test's benchmark imported with absl's flag registry as a fresh process has it, then
  the registry put back. lora_decode.py imports lora_memory.py, whose --prompt_len
  benchmarks/memory.py (memory_test.py) defines too: in one process, whichever came second
  raised DuplicateFlagError. The flags defined before (absl's own aside) are set aside and
  re-registered after; the test's flags and its benchmarks/ modules are removed."""
  from absl import flags
  registry = flags.FLAGS
  earlier = {f.name: f for module, defined in registry.flags_by_module_dict().items()
             if not module.startswith("absl.") for f in defined}
  for name in earlier:
    delattr(registry, name)
  names, modules = set(registry), set(sys.modules)
  yield
  for name in set(registry) - names:
    if name in registry:  # a short name goes with its flag
      delattr(registry, name)
  for flag in earlier.values():
    flags.DEFINE_flag(flag, registry)
  bench_dir = os.path.join(ROOT, "benchmarks")
  for name in set(sys.modules) - modules:
    if os.path.dirname(getattr(sys.modules[name], "__file__", None) or "") == bench_dir:
      del sys.modules[name]


def test_group_phases_names_functions_the_loop_has():
  """Every phase group_phases.py wraps is a function of grpo_jax: a rename fails here, not
  in the benchmark's run on a lent machine."""
  phases = _load("group_phases", "group_phases.py").PHASES
  assert ("grpo_jax.members", "group_step") in phases
  for module_name, name in phases:
    owner = importlib.import_module(module_name)
    for part in name.split("."):
      owner = getattr(owner, part)
    assert callable(owner), (module_name, name)


def test_lora_decode_step_updates_the_cache_in_place(own_flags):
  """lora_decode.py's timed step, compiled at a tiny shape: the whole KV cache is aliased to
  the step's output (donated, written in place), so no step copies it."""
  lora_decode = _load("lora_decode", "lora_decode.py")
  from grpo_jax.models import qwen
  cfg = qwen.QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e6)
  rows, slots = 4, 16
  model = qwen.Qwen(cfg, dtype=jnp.float32, param_dtype=jnp.float32)
  params = qwen.init_params(cfg, jax.random.key(0), param_dtype=jnp.float32)
  cache = qwen.init_cache(cfg, rows, slots, jnp.float32)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  assert cache_bytes == 2 * 2 * rows * 2 * slots * 8 * 4  # k and v, [L, R, K, S, H] fp32
  step = lora_decode.decode_step(model, rows, slots)
  tokens = jnp.zeros((rows, 1), jnp.int32)
  compiled = step.lower({"params": params}, cache, tokens, slots - 1).compile()
  assert compiled.memory_analysis().alias_size_in_bytes == cache_bytes
  hidden, new = step({"params": params}, cache, tokens, slots - 1)
  assert hidden.shape == (rows, 1, cfg.hidden_size)
  assert all(x.is_deleted() for x in jax.tree.leaves(cache))  # donated
  assert float(jnp.abs(new["k"][:, :, :, slots - 1]).max()) > 0  # the step's slot written


def test_trl_step_reference_is_stored_as_a_run_stores_it(tmp_path):
  """trl_step.benchmark_reference (gpu_step.py's reference too) with fp32 params and bf16
  compute, as gpu_step.py runs: bf16 leaves of the params' shapes (a run's reference, not fp32),
  each element one bf16 ulp above the policy's bf16 value, so the step's reference forward runs."""
  import trl_step
  from configs import gsm8k
  from grpo_jax import policy, sharding, tokenizer as tokenizer_lib, train_step, trainer as trainer_lib
  from grpo_jax.models import qwen
  c = gsm8k.get_config("default")
  c.optim.param_dtype, c.optim.compute_dtype = "float32", "bfloat16"
  c.loss.beta, c.mesh = 0.04, (1, 1, 1)
  cfg = qwen.QwenConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e6)
  mesh = sharding.make_mesh((1, 1, 1))
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_lib.build_tiny_tokenizer(str(tmp_path)))
  trainer = trainer_lib.Trainer(c, cfg, mesh, tokenizer, [])
  params = qwen.init_params(cfg, jax.random.key(0), param_dtype=jnp.float32)
  ref = trl_step.benchmark_reference(trainer, params)
  flat_p, flat_r = jax.tree.leaves(params), jax.tree.leaves(ref)
  assert jax.tree.structure(ref) == jax.tree.structure(params)
  for p, r in zip(flat_p, flat_r):
    assert r.dtype == jnp.bfloat16 and r.shape == p.shape, (r.dtype, r.shape)
    p16 = np.asarray(p.astype(jnp.bfloat16)).astype(np.float64)
    r16 = np.asarray(r).astype(np.float64)
    assert np.all(r16 > p16)
    # One ulp: nothing representable in bf16 lies strictly between the two.
    mid = np.asarray(jnp.asarray((p16 + r16) / 2, jnp.float32).astype(jnp.bfloat16))
    assert np.all((mid.astype(np.float64) == p16) | (mid.astype(np.float64) == r16))
  assert not bool(policy.same_params(params, ref, jnp.bfloat16))


def _trl_config(monkeypatch, tmp_path, vllm):
  """The GRPOConfig keywords trl_step.run_trl passes for a forced-length run (as gpu_step.py
  runs it), through a stand-in trl module (trl is benchmark-only) that stops at GRPOTrainer."""
  import trl_step
  captured = {}

  class Stop(Exception):
    pass

  def trainer(**_):
    raise Stop

  fake = types.ModuleType("trl")
  fake.GRPOConfig = lambda **kw: captured.update(kw) or types.SimpleNamespace(**kw)
  fake.GRPOTrainer = trainer
  monkeypatch.setitem(sys.modules, "trl", fake)
  spec = dict(user_template="{question}", system_prompt=None, new_tokens=7,
              rows=[{"question": "1 + 1?", "answer": "#### 2"}] * 4, model=str(tmp_path / "m"),
              tokenizer=str(trl_step.QWEN_TOKENIZER), num_steps=1, compute_dtype="bfloat16",
              remat=False, vllm=vllm, trl_gpu=False)
  with pytest.raises(Stop):
    trl_step.run_trl(spec, True, {})
  return captured


def test_trl_forced_length_reaches_its_generator_by_the_generators_name(monkeypatch, tmp_path):
  """Forced length asks for exactly C = 7 new tokens in the generator's own field: transformers'
  GenerationConfig reads min_new_tokens; vLLM's SamplingParams (vllm/sampling_params.py, a
  msgspec.Struct: an unknown keyword is a TypeError) has min_tokens and no min_new_tokens."""
  import transformers
  kw = _trl_config(monkeypatch, tmp_path, vllm=False)
  gen = transformers.GenerationConfig(**kw["generation_kwargs"])
  assert (gen.min_new_tokens, kw["max_completion_length"]) == (7, 7), kw["generation_kwargs"]
  kw = _trl_config(monkeypatch, tmp_path, vllm=True)
  assert kw["use_vllm"] and kw["generation_kwargs"] == {"min_tokens": 7}, kw["generation_kwargs"]


def test_trl_runs_no_old_logprob_forward_with_or_without_vllm(monkeypatch, tmp_path):
  """grpo_jax runs no forward for old log-probs (μ = 1); TRL 1.16 runs one every step when
  gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0 or (use_vllm and
  vllm_importance_sampling_correction), that correction True by default (grpo_trainer.py,
  grpo_config.py). Neither holds for the config run_trl builds, with vLLM or without."""
  for vllm in (False, True):
    kw = _trl_config(monkeypatch, tmp_path, vllm)
    every = kw["steps_per_generation"] * kw["num_iterations"]
    old = kw["gradient_accumulation_steps"] % every != 0 or (
        kw["use_vllm"] and kw.get("vllm_importance_sampling_correction", True))
    assert not old, (vllm, kw)


def test_async_step_judge_grades_after_its_delay_and_its_phases_exist():
  """benchmarks/async_step.py's judge answers the quality reward, each batch after delay_s, and
  the functions it times are the ones the loop calls (a rename fails here)."""
  import time
  from grpo_jax import members, rollout, sampler
  from grpo_jax.rewards import quality
  from grpo_jax.rewards.options import HttpOptions, QualityOptions
  bench = _load("async_step", "async_step.py")
  for owner, name in ((sampler.Sampler, "generate"), (rollout, "score_samples"),
                      (members, "update")):
    assert callable(getattr(owner, name)), name
  judge = bench.Judge(0.3)
  try:
    reward = quality.QualityReward(QualityOptions(question_column="", http=HttpOptions(
        base_url=judge.url, model="judge", max_retries=0, cache_size=0, max_concurrency=8)))
    t0 = time.perf_counter()
    scores = reward(["q"] * 8, [f"answer {i}" for i in range(8)])
    took = time.perf_counter() - t0
  finally:
    judge.stop()
  assert scores == [scores[0]] * 8 and scores[0] is not None  # every grade 3/5, parsed
  assert 0.3 <= took < 1.5, took  # the 8 requests wait together: one delay, not eight
  # The timeline puts each phase on its thread's row, in time order.
  rows = bench.timeline([("S", "main", 0.0, 1.0), ("R", "score", 1.0, 2.0),
                         ("U", "main", 1.0, 2.0)], width=4)
  assert rows[1].endswith("SSUU") and rows[2].endswith("  RR")
