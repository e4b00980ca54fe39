"""The tiny LoRA preset (configs/gsm8k.py:tiny_lora) over seeds 0-4.

    python -m grpo_jax.sweep experiments/tiny_lora_seeds.py --workdir=runs/tiny_lora_seeds
    python -m grpo_jax.report runs/tiny_lora_seeds

tiny's warm start (the whole model, to 20% validation accuracy), then GRPO trains rank-8
adapters on all seven projections of the warm-started base, with a KL term to it (β = 0.01).
Five independent runs, 3-5 minutes each alone on a 2-core CPU. The bar (issue 31): each seed
gains >= 20 points of held-out accuracy, in <= 10 minutes a run.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny_lora", runs=sweep.seeds(5))
