"""The supervised warm start (a "cold start" before RL): next-token cross-entropy on reference
completions, the prompt tokens masked out. It is the train step with objective='sft': the same
chunked log-probs, micro-batching, sharding and optimizer code as GRPO, with Adam at sft.lr.

    batch = sft_batch(prompt_ids, completion_ids, pad_id, buckets=(48, 64), multiple=16)
    step = train_step.TrainStep(model_cfg, loss_cfg, sft_optim_config(config), mesh,
                                objective="sft")
    state, metrics, _ = step(state, batch)
"""

from __future__ import annotations

import re
from typing import Sequence

import jax
import numpy as np

from grpo_jax import data, hosts, progress, train_step
from grpo_jax.errors import warn

_CALCULATOR = re.compile(r"<<[^<>]{0,200}>>")


def reference_completion(answer_text: str) -> str:
  """A GSM8K answer as a completion: the calculator annotations (<<6*4=24>>) removed."""
  return _CALCULATOR.sub("", answer_text)


def sft_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              pad_id: int, *, buckets: Sequence[int], multiple: int, max_completion: int,
              loss_masks: Sequence[Sequence[int]] | None = None):
  """The train step's layout: prompts left-padded to a bucket, completions right-padded to the
  longest rounded up to `multiple`; completion_mask_BC marks the tokens trained on: every
  completion token, or where `loss_masks` (one 0/1 list per completion) says so."""
  prompt_BP, pmask_BP = data.pad_to_bucket(prompt_ids, buckets, pad_id)
  longest = max(len(c) for c in completion_ids)
  if longest > max_completion:
    raise ValueError(f"a reference completion has {longest} tokens, more than the completion "
                     f"budget {max_completion} (sampling.max_new_tokens, or an agent's turns)")
  width = data.padded_width(longest, multiple, max_completion)
  completion_BC, cmask_BC = data.pad_right(completion_ids, width, pad_id)
  loss_BC = cmask_BC if loss_masks is None else data.pad_right(loss_masks, width, 0)[0]
  return {"tokens_BS": np.concatenate([prompt_BP, completion_BC], 1),
          "attn_mask_BS": np.concatenate([pmask_BP.astype(np.int32), cmask_BC], 1),
          "completion_mask_BC": loss_BC}


def sft_optim_config(config):
  """Adam at sft.lr (AdamW without decay, clipping or schedule), otherwise the run's optim."""
  optim = config.optim.copy_and_resolve_references()
  optim.update(lr=config.sft.lr, b1=0.9, b2=0.999, weight_decay=0.0, max_grad_norm=0.0,
               schedule="constant", warmup_steps=0, total_steps=0)
  return optim


def run_sft(config, trainer, params, rows, eval_rows=()):
  """The warm start; deterministic in the seed, never checkpointed (it is short).

  With sft.target_accuracy > 0 it evaluates greedy accuracy on `eval_rows` every
  sft.eval_every steps and stops at the first evaluation that reaches the target; sft.steps is
  then the most it may take. A fixed step count leaves some seeds' policies too weak for GRPO to
  find any reward (experiments/tiny_seeds.md).

  With sft.overshoot_accuracy > 0 as well, a check that reaches the target and is above that
  accuracy jumped past the target between two checks (a model that learns a format can go from
  under 10% to 80% in ten steps). The warm start then goes back to the previous check (its
  params, optimizer state and data position) and takes those steps again, checking after each
  one, and stops at the first that reaches the target. Returns the params.
  """
  s, tok = config.sft, trainer.tokenizer
  max_completion = trainer.rollout.completion_width
  optim = sft_optim_config(config)
  step = train_step.TrainStep(trainer.cfg, config.loss, optim, trainer.mesh, objective="sft")
  state = train_step.create_train_state(params, trainer.cfg, optim, trainer.mesh)
  order = data.PromptIterator(len(rows), s.batch_size, config.seed + 1)
  target = s.target_accuracy if eval_rows else 0.0
  overshoot = s.overshoot_accuracy if target else 0.0
  bar = progress.Bar(total=s.steps, desc="sft warm start", every_s=config.train.progress_every_s,
                     disable=not hosts.is_main())
  # The last check's (step, state, data position), kept only while an overshoot can send the
  # warm start back to it. The step donates its input state, so the kept state is a copy.
  last_check = (0, _copy(state), order.position()) if overshoot else None
  every_step = False  # after going back: check after every step
  acc, i = None, 0
  while i < s.steps:
    batch_rows = [rows[j] for j in order.next_indices()]
    prompts, completions, masks = trainer.rollout.sft_examples(batch_rows)
    batch = sft_batch(prompts, completions, tok.pad_token_id, buckets=config.data.prompt_buckets,
                      multiple=config.train.pad_multiple, max_completion=max_completion,
                      loss_masks=masks)
    state, metrics, _ = step(state, batch)
    i += 1
    if i % 10 == 1:  # reading the loss waits for the device; not every step
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                      **({} if acc is None else {"val": f"{acc:.3f}"}))
    bar.update(1)
    if not target or not (every_step or i % s.eval_every == 0):
      continue
    acc = trainer.evaluate(state["params"], eval_rows)
    bar.write(f"grpo_jax: warm start step {i}: validation accuracy {acc:.1%}")
    if overshoot and acc > overshoot and not every_step:  # (overshoot > target)
      i, state, position = last_check
      order.restore(position)
      every_step = True
      bar.set_count(i)
      bar.write(f"grpo_jax: warm start: {acc:.1%} is past sft.overshoot_accuracy "
                f"{overshoot:.0%}; going back to step {i} and checking after every step")
      continue
    if acc >= target:
      bar.close(stopped="target reached")
      print(f"grpo_jax: warm start reached {acc:.1%} on {len(eval_rows)} validation problems "
            f"(target {target:.0%}) after {i} steps", flush=True)
      return state["params"]
    if overshoot and not every_step:
      last_check = (i, _copy(state), order.position())
  bar.close()
  if target:
    # sft.steps < sft.eval_every (a shortened test run) ends before any check: no accuracy.
    measured = (f"validation accuracy {acc:.1%}" if acc is not None
                else f"no validation check (sft.eval_every={s.eval_every})")
    warn(f"the warm start ended at its limit of {s.steps} steps with {measured}, below its "
         f"target {target:.0%}")
  return state["params"]


def _copy(tree):
  """A copy of a pytree of arrays, on the same devices and shardings."""
  return jax.tree.map(lambda x: x.copy(), tree)
