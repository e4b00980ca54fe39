"""A --main_module wrapper for tests: grpo_jax.main's own flags and main(), but instead of
training, train.run writes the config main built to WORKDIR/parsed_config.json (ConfigDict's
JSON: None is null) and a finished summary.json, and no JAX is set up (grpo_jax.hosts is a
one-process stand-in).

    python -m config_main --config=configs/gsm8k.py:tiny --workdir=DIR [--overrides=FILE]
"""
import os
import sys
import types

import grpo_jax
from grpo_jax import main as grpo_main


def _run(config, workdir):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "parsed_config.json"), "w") as f:
    f.write(config.to_json())
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    f.write('{"eval_accuracy_gain_points": 0.0}')


_train = types.ModuleType("grpo_jax.train")
_train.run = _run
_hosts = types.ModuleType("grpo_jax.hosts")
_hosts.initialize = lambda *args, auto=False: False
_hosts.is_main = lambda: True
for _name, _module in (("train", _train), ("hosts", _hosts)):
  sys.modules[f"grpo_jax.{_name}"] = _module
  setattr(grpo_jax, _name, _module)

if __name__ == "__main__":
  grpo_main.run()
