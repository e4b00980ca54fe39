"""The tiny preset's GRPO phase on a seed that plateaus (tiny_seeds.md, 'Seeds 7-12'):
GRPO-phase variants from the same warm start.

    python -m grpo_jax.sweep experiments/tiny_plateau.py --workdir=runs/tiny_plateau
    python -m grpo_jax.report runs/tiny_plateau

The optim.* variants are in sweep.POST_WARM_START, so they share each seed's warm start
(runs/tiny_plateau/prefixes/seed=N) and start from copies of its step-0 checkpoint; the
temperature and warm-start variants compute their own.
"""

from grpo_jax import sweep

SEEDS = (11,)
# The preset itself (lr 3e-5 constant) is the seed's run in the 20-seed sweep (tiny_seeds.py):
# runs are deterministic, so it is not repeated here.
VARIANTS = [
    {"optim.lr": 1e-4},                                     # a larger constant rate
    {"optim.lr": 1e-4, "optim.schedule": "cosine", "optim.total_steps": 400},  # decayed to 0
    {"optim.lr": 3e-4, "optim.schedule": "cosine", "optim.total_steps": 400},
    {"sampling.temperature": 0.7},  # samples nearer the greedy answer (its own warm start)
    {"sft.target_accuracy": 0.4},   # a longer warm start (its own)
]


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny",
                     runs=sweep.product(VARIANTS, sweep.sweep_axis("seed", SEEDS)))
