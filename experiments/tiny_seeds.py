"""The tiny preset as it ships, over seeds 0-4 (tiny_seeds.md).

    python -m grpo_jax.sweep experiments/tiny_seeds.py --workdir=runs/tiny_seeds
    python -m grpo_jax.report runs/tiny_seeds

The seed sets the data, the initial weights and the warm start, so nothing is shared: five
independent runs, about 2.5 minutes each alone on a 2-core CPU.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny", runs=sweep.seeds(5))
