"""Seed 8 of the tiny preset at 914abf2, which lost ground (18.6% -> 14.3%; tiny_seeds.md,
"914abf2"): GRPO-phase variants from its own warm start, and a longer warm start.

    python -m grpo_jax.sweep experiments/tiny_seed8.py --workdir=runs/tiny_seed8 --parallel=2
    python -m grpo_jax.report runs/tiny_seed8

The optim.* variants share the seed's warm start (sweep.POST_WARM_START); the preset itself is
seed 8's run in the 20-seed sweep (runs are deterministic), so it is not repeated here.
"""

from grpo_jax import sweep

VARIANTS = [
    {"optim.warmup_steps": 50},     # the same cosine, reached linearly over 50 steps
    {"optim.warmup_steps": 100},
    {"optim.lr": 1.5e-4},           # half the rate
    {"sft.target_accuracy": 0.3},   # a longer warm start (its own)
]


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny",
                     runs=sweep.product(VARIANTS, sweep.sweep_axis("seed", (8,))))
