"""Issue 57's learning check, not run yet: the tiny preset one step behind
(train.off_policy_steps=1) beside on-policy (0), on seeds 0-4 (10 runs, each 2-5 minutes alone
on a 2-core CPU).

    python -m grpo_jax.sweep experiments/async_seeds.py --workdir=runs/async_seeds
    python -m grpo_jax.report runs/async_seeds

The bar (issue 57, item 5): every seed gains >= 20 points of held-out accuracy at 1, with the
paired difference to 0 on the same seed reported with its interval. The runs are separate
processes (the pipelined loop refuses --vmap groups).
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny",
                     runs=sweep.product(sweep.sweep_axis("train.off_policy_steps", [0, 1]),
                                        sweep.seeds(5)))
