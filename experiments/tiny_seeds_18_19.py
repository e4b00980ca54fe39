"""Seeds 18 and 19 of the tiny preset, after a rerun of seed 2 (tiny_seeds.md, "Over 20 seeds").

    python -m grpo_jax.sweep experiments/tiny_seeds_18_19.py --workdir=runs/tiny_seeds
    python -m grpo_jax.report runs/tiny_seeds
    python experiments/seed_table.py runs/tiny_seeds/seed=*

The same runs, in the same run directories, as those seeds of experiments/tiny_seeds.py, for
when seeds 0-17 were run before: seed 2 first, to check that its held-out accuracy at steps 0
and 400 is still the one recorded (the numerics have not moved since), then 18 and 19.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny", runs=[{"seed": s} for s in (2, 18, 19)])
