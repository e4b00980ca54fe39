"""Learning rate of the tiny preset over seeds: 3 rates × seeds 0-2, 200 GRPO steps each.

    python -m grpo_jax.sweep experiments/tiny_lr.py --workdir=runs/tiny_lr
    python -m grpo_jax.report runs/tiny_lr

The rate acts after the warm start only (sweep.POST_WARM_START), so each seed's warm start runs
once (runs/tiny_lr/prefixes/seed=N) and its three rates start from copies of its step-0
checkpoint. Results and the choice they support: tiny_lr_sweep.md. Those were measured with the
preset's constant schedule; the preset now decays its rate by a cosine over the run
(tiny_seeds.md, "Seeds 7-12"), which these runs inherit, over their 200 steps.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(
      config="configs/gsm8k.py:tiny",
      fixed={"train.steps": 200},
      runs=sweep.product(sweep.sweep_axis("optim.lr", [1e-5, 3e-5, 1e-4]), sweep.seeds(3)))
