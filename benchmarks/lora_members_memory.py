"""Peak memory of K LoRA members on one shared base against one run, from the compiler.

    python3 benchmarks/lora_members_memory.py                     # K = 8, 1.5b_lora's shape
    python3 benchmarks/lora_members_memory.py --member_accum=8    # each member in 8 micro-batches
    python3 benchmarks/lora_members_memory.py --members=map       # the members in turn
    python3 benchmarks/lora_members_memory.py --num_layers=2      # 2 of 28 layers: fast

AOT-compiles (abstract inputs, nothing allocated, one CPU device) the train-step program of the
`configs/gsm8k.py:1.5b_lora` preset (Qwen2.5-1.5B, bf16 frozen base, rank-16 adapters on the
seven projections, β > 0) for one micro-batch's rows of a run (its rows per step / its
grad_accum_steps: one group of G = 8), twice:

  K = 1   `TrainStep.program(batch, True)`: one run's state (adapters + AdamW moments), the base,
          its batch;
  K       `members.train_program(step, batch_K, True, batched)`: the same train_step under
          jax.vmap, the members' states, hparams and batches stacked on a leading K axis, the
          base unstacked (one copy, in_axes None), as `python -m grpo_jax.sweep --vmap` runs
          LoRA members with train.members 'vmap' (the default off the CPU); with
          --members=map each member's step in turn under jax.lax.map ('map', the default on a
          CPU).

With --member_accum=m each member splits its rows into m micro-batches (the K program only; the
K = 1 baseline keeps the preset's micro-batch), trading steps of the accumulation loop for
activation memory. Prints each peak (arguments + outputs − aliased + temporaries, as
benchmarks/memory.py) and `lora_members_memory_ratio=<K peak / K=1 peak>`.

Compiled, as benchmarks/memory.py compiles LoRA presets, without XLA:CPU's
while-loop-invariant-code-motion (it would hoist fp32 copies of the bf16 base out of the layer
loop, a CPU-only cost that is the same for K = 1 and K = 8 and would flatter the ratio);
--hoist_converts keeps the pass.

--one_predicate is a diagnostic: train_step skips the reference forward while the policy is the
reference ("this member's b are all 0"). Under jax.vmap a per-member predicate would turn that
lax.cond into a select with every operand batched, the shared base among them (K copies of its
layers in temporaries: 42.4 GB at K = 8 here); train_step therefore branches on all members at
once (members.py's StepSpec.cond: lax.pmin over the members' axis). The flag replaces the predicate by one constant False
(train_step._policy_is_reference patched in this process): its figure should equal the
default's.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LICM = "while-loop-invariant-code-motion"
GB = 1e9


def _memory_module():
  """benchmarks/memory.py, loaded once per process (it defines absl flags) as memory_bench."""
  if "memory_bench" not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        "memory_bench", os.path.join(ROOT, "benchmarks", "memory.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["memory_bench"] = mod
  return sys.modules["memory_bench"]


def _stacked(tree, k):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((k,) + tuple(x.shape), x.dtype), tree)


def _plain(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def measure(preset: str, k: int, member_accum: int, prompt_len: int = 0,
            one_predicate: bool = False, batched: bool = True,
            num_layers: int = 0) -> list[dict]:
  """[one run, K members]: each a dict of k, accum, peak (bytes), line (its breakdown),
  analysis (compiled.memory_analysis()) and the bytes of one member's base, state, batch and
  hparams, for the preset's micro-batch shape (num_layers > 0: the model cut to that many
  layers, the same widths)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, ROOT)
  memory = _memory_module()  # its import sets the fake device count; the backend starts below
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from configs import gsm8k  # pylint: disable=import-outside-toplevel
  from grpo_jax import config as config_lib, members, policy as policy_lib, sharding, train_step, trainer as trainer_lib  # pylint: disable=C0415

  if one_predicate:
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    train_step._policy_is_reference = lambda *_: jnp.bool_(False)  # pylint: disable=W0212
  config = gsm8k.get_config(preset)
  lcfg = trainer_lib.lora_settings(config)
  policy = policy_lib.of(lcfg)
  if lcfg is None:
    raise SystemExit(f"lora_members_memory.py: preset {preset!r} has no model.lora")
  g = config_lib.group_size(config)
  rows = config.train.prompts_per_step * g // config.optim.grad_accum_steps  # one micro-batch
  if rows % g:
    raise SystemExit(f"lora_members_memory.py: {preset}'s micro-batch of {rows} rows is not "
                     f"whole groups of {g}")
  cfg, valid = memory.model_config(config)
  if num_layers:
    import dataclasses  # pylint: disable=import-outside-toplevel
    cfg = dataclasses.replace(cfg, num_layers=num_layers)
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  p = prompt_len or max(config.data.prompt_buckets)
  c = config.sampling.max_new_tokens
  out = []
  for kk, accum in ((None, 1), (k, member_accum)):
    config.train.prompts_per_step = rows // g
    config.optim.grad_accum_steps = accum
    optim = config_lib.optim_settings(config)
    step = train_step.TrainStep(
        cfg, config.loss, optim, mesh, temperature=config.sampling.temperature,
        valid_vocab_size=valid, max_completion_length=c, group_size=g,
        reward_weights=config.rewards.weights, policy=policy)
    state = train_step.abstract_state(cfg, optim, mesh, policy)
    base = train_step.abstract_reference(cfg, optim, mesh, policy)
    batch = memory.rollout_batch(config, rows, p, c, mesh)
    hp = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                      step.hparams)
    if kk is None:
      lowered = step.program(batch, True).lower(state, hp, base, batch)
    else:
      batch_k = _stacked(batch, kk)
      lowered = members.train_program(step, batch_k, True, batched).lower(
          _stacked(state, kk), _stacked(hp, kk), _plain(base), batch_k)
    compiled = lowered.compile()
    peak, line = memory.peak_bytes(compiled)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    r = dict(k=kk or 1, accum=accum, peak=peak, analysis=compiled.memory_analysis(),
             base=nbytes(base), state=nbytes(state), batch=nbytes(batch), hparams=nbytes(hp))
    r["line"] = (f"  K={r['k']}: {rows} rows × ({p} + {c}) tokens per member in {accum} "
                 f"micro-batch(es); base {r['base'] / GB:.2f} GB once, state (adapters + AdamW) "
                 f"{r['state'] / GB:.2f} GB per member: {line}")
    out.append(r)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="1.5b_lora", help="a LoRA preset of configs/gsm8k.py")
  parser.add_argument("--k", type=int, default=8, help="members")
  parser.add_argument("--member_accum", type=int, default=1,
                      help="micro-batches each member's rows are split into (K program only)")
  parser.add_argument("--prompt_len", type=int, default=0,
                      help="prompt width; 0 = the largest of data.prompt_buckets")
  parser.add_argument("--num_layers", type=int, default=0,
                      help="cut the model to this many layers (same widths; compiles in under "
                           "a minute on a CPU); 0 = the preset's")
  parser.add_argument("--members", default="vmap", choices=("vmap", "map"),
                      help="the K program's train.members: batched, or each member in turn")
  parser.add_argument("--one_predicate", action="store_true",
                      help="diagnostic: one constant reference predicate (see the docstring)")
  parser.add_argument("--hoist_converts", action="store_true",
                      help="keep XLA:CPU's loop-invariant code motion (see the docstring)")
  a = parser.parse_args()
  if a.k < 2:
    parser.error("--k must be at least 2")
  if not a.hoist_converts:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_disable_hlo_passes={LICM}"
  one, many = measure(a.preset, a.k, a.member_accum, a.prompt_len, a.one_predicate,
                      a.members == "vmap", a.num_layers)
  print(f"{a.preset}{f' cut to {a.num_layers} layers' if a.num_layers else ''}, K={a.k} LoRA members ({a.members}) on one base against one run "
        f"({'with' if a.hoist_converts else 'without'} XLA:CPU's {LICM}"
        f"{'; one constant reference predicate' if a.one_predicate else ''}):")
  print(one["line"] + "\n" + many["line"])
  temps = many["analysis"].temp_size_in_bytes, one["analysis"].temp_size_in_bytes
  print(f"  temporaries (activations, gradients, AdamW's update): {temps[0] / GB:.2f} GB for "
        f"K={a.k} against {temps[1] / GB:.2f} GB, {temps[0] / temps[1]:.2f}x")
  print(f"lora_members_memory_ratio={many['peak'] / one['peak']:.2f}")


if __name__ == "__main__":
  main()
