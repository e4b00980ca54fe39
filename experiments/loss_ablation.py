"""Issue 56's ablation: every single-turn loss type of grpo_jax.grpo on the tiny preset, five
seeds each, the seeds of a loss run as one vmapped group (members in turn on a CPU, batched on
an accelerator; docs/sweeps.md). flow_grpo is left out: it is the multi-turn agents' loss, and with
one turn per row it is exactly grpo (grpo_jax/grpo.py).

    python -m grpo_jax.sweep experiments/loss_ablation.py --workdir=runs/loss_ablation --vmap
    python -m grpo_jax.report runs/loss_ablation

45 runs after 5 shared warm starts: about an hour alone on a 2-core CPU. The report gives each
loss's held-out gain and its steps to half that gain (evaluated every 50 steps here, against the
preset's 100), mean ± std with 95% intervals over the seeds, the paired differences between
losses on the same seeds, and the curves with their bands (plots/eval_accuracy.png).

GSPO is the grpo loss with sequence-level importance ratios; LUSPO is GSPO's sequence loss
scaled by length, so it runs at the sequence level too (grpo_jax warns otherwise, as TRL does).
"""

from grpo_jax import sweep

LOSSES = (
    {"loss.loss_type": "grpo"},
    {"loss.loss_type": "bnpo"},
    {"loss.loss_type": "dr_grpo"},
    {"loss.loss_type": "dapo"},
    {"loss.loss_type": "grpo", "loss.importance_sampling_level": "sequence"},  # GSPO
    {"loss.loss_type": "cispo"},
    {"loss.loss_type": "sapo"},
    {"loss.loss_type": "luspo", "loss.importance_sampling_level": "sequence"},
    {"loss.loss_type": "vespo"},
)


def get_sweep():
  return sweep.Sweep(config="configs/gsm8k.py:tiny",
                     runs=sweep.product(list(LOSSES), sweep.seeds(5)),
                     fixed={"train.eval_every": 50})
