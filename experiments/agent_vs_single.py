"""Flow-GRPO against single-turn GRPO on the tiny agent task (agent_vs_single.md).

    python -m grpo_jax.sweep experiments/agent_vs_single.py --workdir=runs/agent_vs_single
    python -m grpo_jax.report runs/agent_vs_single

The same problems (three 3-digit operands, + and -), model, warm-start rule (until 20% greedy
accuracy on 256 validation problems, at most 1,000 steps) and number of GRPO steps; only the
rollout differs. Single-turn: one completion per sample, the warm start on the reference
solutions (the arithmetic written out), loss 'grpo'. Flow-GRPO: the calculator, the warm start
on traces that call it, loss 'flow_grpo'. Seeds 0-4 each, the same seeds in both arms, so
the report pairs them: its 'Paired differences' table gives single-turn − Flow-GRPO (B − A in
sweep order) seed by seed, with a BCa bootstrap interval of the mean difference
(docs/report.md). Ten runs of 10-14 minutes each on a 2-core CPU, about two hours in all
(agent_vs_single.md has seeds 0-2).
"""

from grpo_jax import sweep

SINGLE_TURN = {"agent.enabled": False, "loss.loss_type": "grpo",
               "sampling.max_new_tokens": 48}


def get_sweep():
  variants = [{}, SINGLE_TURN]
  return sweep.Sweep(config="configs/gsm8k_agent.py:tiny",
                     runs=sweep.product(variants, sweep.seeds(5)))
