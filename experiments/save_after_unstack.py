"""Does a checkpoint save wait for the program that took the member's state out of the group?

    PYTHONPATH=. python3 experiments/save_after_unstack.py

The tiny preset's model, built as a run builds it (its data, tokenizer, model config and initial
params, in a temporary workdir), and 8 train states from it (each member's params shifted by its
index), stacked with members_lib.stack. For each member, 3 rounds of: (a) members_lib.unstack then the save
at once, (b) members_lib.unstack, jax.block_until_ready, then the save, timed apart, (c) the
leaf-by-leaf slices the group took before members_lib.unstack was compiled, then the save. A save
holds what the loop's save holds (the train state; the tiny preset's β = 0 keeps no reference).
Prints the medians.
"""
import os
import shutil
import statistics
import tempfile
import time

import jax

from configs import gsm8k
from grpo_jax import checkpoint, config as config_lib, inputs, members as members_lib, sharding, train_step

config = gsm8k.get_config("tiny")
root = tempfile.mkdtemp()
try:
  rows, _ = inputs.datasets(config, root)
  tokenizer, _ = inputs.tokenizer(config, root, rows)
  cfg, _ = inputs.model_config(config, tokenizer)
  mesh = sharding.make_mesh(tuple(config.mesh))
  optim = config_lib.optim_settings(config)
  params = inputs.initial_params(config, cfg, mesh)
  states = [train_step.create_train_state(jax.tree.map(lambda x, i=i: x + i, params), cfg, optim,
                                          mesh) for i in range(8)]
  group = jax.block_until_ready(members_lib.stack(states))
  times = {name: [] for name in ("a: unstack + save", "b: unstack, waited", "b: save",
                                 "c: slices", "c: save")}
  for rep in range(3):
    for mode in "abc":
      for k in range(8):
        ckpt = checkpoint.Checkpointer(os.path.join(root, "runs", f"{mode}{rep}_{k}"))
        t0 = time.perf_counter()
        state = (jax.tree.map(lambda x, k=k: x[k], group) if mode == "c"
                 else members_lib.unstack(group, k))
        if mode == "b":
          jax.block_until_ready(state)
        t1 = time.perf_counter()
        ckpt.save(1, {"train": state}, {"index": 0})
        t2 = time.perf_counter()
        ckpt.close()
        if mode == "a":
          times["a: unstack + save"].append(t2 - t0)
        else:
          times[f"{mode}: {'slices' if mode == 'c' else 'unstack, waited'}"].append(t1 - t0)
          times[f"{mode}: save"].append(t2 - t1)
finally:
  shutil.rmtree(root)
print(f"model {cfg.num_layers}x{cfg.hidden_size}, vocabulary {cfg.vocab_size}")
for name, values in times.items():
  print(f"{name:22s} median {statistics.median(values) * 1e3:6.1f} ms  ({len(values)} calls)")
