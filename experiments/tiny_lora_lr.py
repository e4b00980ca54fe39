"""Learning rate of the tiny_lora preset: 4 rates, seed 0, as K = 4 LoRA members on one base.

    python -m grpo_jax.sweep experiments/tiny_lora_lr.py --workdir=runs/tiny_lora_lr --vmap
    python -m grpo_jax.report runs/tiny_lora_lr

The rate acts after the warm start only, so the warm start runs once (the prefix,
runs/tiny_lora_lr/prefixes/seed=0, whose base_model/ every run links) and with --vmap the four
runs train four adapters on that one base in one process (docs/lora.md). One seed: a warm start
depends on its seed, and members of a vmapped group must share their base.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny_lora",
                     runs=sweep.sweep_axis("optim.lr", [1e-3, 3e-3, 1e-2, 3e-2]))
