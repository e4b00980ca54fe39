"""The GRPO learning rate with the warm start to 20% and to 40%, on seeds whose GRPO phase
plateaus at lr 3e-5 (tiny_seeds.md, 'Seeds 7-12').

    python -m grpo_jax.sweep experiments/tiny_lr_warm.py --workdir=runs/tiny_lr_warm
    python -m grpo_jax.report runs/tiny_lr_warm

lr 3e-4 decayed to 0 by a cosine over the 400 steps (optim.total_steps must be given: see the
note in tiny_seeds.md). The rate is a GRPO-phase key (sweep.POST_WARM_START): each seed's warm
start runs once per target (runs/tiny_lr_warm/prefixes/).
"""

from grpo_jax import sweep

SEEDS = (8, 10)
LR = {"optim.lr": 3e-4, "optim.schedule": "cosine", "optim.total_steps": 400}


def get_sweep():
  targets = sweep.sweep_axis("sft.target_accuracy", [0.2, 0.4])
  return sweep.Sweep(config="configs/gsm8k.py:tiny",
                     runs=sweep.product(targets, [LR], sweep.sweep_axis("seed", SEEDS)))
