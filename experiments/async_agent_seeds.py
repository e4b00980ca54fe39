"""Issue 57's learning check for agents: the tiny agent preset
(configs/gsm8k_agent.py:tiny, Flow-GRPO with the calculator) one step behind
(train.off_policy_steps=1) beside on-policy (0), on seeds 0-2 (6 runs, about 5 minutes each
alone on a 2-core CPU).

    python -m grpo_jax.sweep experiments/async_agent_seeds.py --workdir=runs/async_agent_seeds
    python -m grpo_jax.report runs/async_agent_seeds

The bar (issue 57, item 5): every seed gains >= 20 points of held-out accuracy at 1, with the
paired difference to 0 on the same seed reported with its interval. One step behind, a step's
whole trajectories (turns and tool calls) are sampled before the previous update and only their
rewards are scored on the host thread (grpo_jax.pipeline); the runs are separate processes.

Result (commit 8586bcf, 2026-12-08, 2-core CPU shared with other jobs, 9-20 minutes a run;
async_agent_seeds_report/): every seed gains >= 31.2 points at 1 (44.9 +- 12.2, 95% interval
[14.5, 75.3]) against 42.3 +- 13.5 [8.7, 75.8] at 0; seed by seed 48.6 / 54.9 / 31.2 at 1
against 43.6 / 55.1 / 28.1 at 0. The paired difference +2.7 [-4.0, 9.3] does not exclude 0.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k_agent.py:tiny",
                     runs=sweep.product(sweep.sweep_axis("train.off_policy_steps", [0, 1]),
                                        sweep.seeds(3)))
