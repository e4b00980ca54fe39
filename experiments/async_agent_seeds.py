"""Issue 57's learning check for agents, not run yet: the tiny agent preset
(configs/gsm8k_agent.py:tiny, Flow-GRPO with the calculator) one step behind
(train.off_policy_steps=1) beside on-policy (0), on seeds 0-2 (6 runs, about 5 minutes each
alone on a 2-core CPU).

    python -m grpo_jax.sweep experiments/async_agent_seeds.py --workdir=runs/async_agent_seeds
    python -m grpo_jax.report runs/async_agent_seeds

The bar (issue 57, item 5): every seed gains >= 20 points of held-out accuracy at 1, with the
paired difference to 0 on the same seed reported with its interval. One step behind, a step's
whole trajectories (turns and tool calls) are sampled before the previous update and only their
rewards are scored on the host thread (grpo_jax.pipeline); the runs are separate processes.
"""

from grpo_jax import sweep


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k_agent.py:tiny",
                     runs=sweep.product(sweep.sweep_axis("train.off_policy_steps", [0, 1]),
                                        sweep.seeds(3)))
