"""Flow-GRPO against single-turn GRPO on the tiny agent task, and the tiny agent preset over
ten seeds (agent_vs_single.md, agent_seeds.md).

    python -m grpo_jax.sweep experiments/agent_vs_single.py --workdir=runs/agent_vs_single --parallel=2
    python -m grpo_jax.report runs/agent_vs_single

The same problems (three 3-digit operands, + and -), model, warm-start rule (until 20% greedy
accuracy on 256 validation problems, at most 1,000 steps) and number of GRPO steps; only the
rollout differs. Flow-GRPO (configs/gsm8k_agent.py:tiny as it is): the calculator, the warm
start on traces that call it, loss 'flow_grpo', seeds 0-9 (the preset's ten-seed table).
Single-turn (listed first: the slower runs): one completion per sample, the warm start on the
reference solutions (the arithmetic written out), loss 'grpo', seeds 0-4. The report pairs the five common seeds: its
'Paired differences' table gives Flow-GRPO - single-turn (B - A in sweep order) seed by seed,
with the Student-t interval of the mean difference (docs/report.md). Fifteen runs, about 90
minutes in all on a 2-core CPU, two at a time.
"""

from grpo_jax import sweep

SINGLE_TURN = {"agent.enabled": False, "loss.loss_type": "grpo",
               "sampling.max_new_tokens": 48}


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k_agent.py:tiny",
                     runs=sweep.product([SINGLE_TURN], sweep.seeds(5)) + sweep.seeds(10))
