"""Issue 57's learning check: the tiny preset one step behind
(train.off_policy_steps=1) beside on-policy (0), on seeds 0-4 (10 runs, each 2-5 minutes alone
on a 2-core CPU).

    python -m grpo_jax.sweep experiments/async_seeds.py --workdir=runs/async_seeds
    python -m grpo_jax.report runs/async_seeds

The bar (issue 57, item 5): every seed gains >= 20 points of held-out accuracy at 1, with the
paired difference to 0 on the same seed reported with its interval. The runs are separate
processes (the pipelined loop refuses --vmap groups).

Result (commit dc2a12b, 2026-12-07, 2-core CPU shared with other jobs; async_seeds_report/):
every seed gains >= 49.6 points at 1 (57.2 +- 6.8, 95% interval [48.8, 65.7]) against
53.7 +- 9.5 [41.9, 65.5] at 0; the paired difference +3.5 [-1.2, 8.3] does not exclude 0.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny",
                     runs=sweep.product(sweep.sweep_axis("train.off_policy_steps", [0, 1]),
                                        sweep.seeds(5)))
