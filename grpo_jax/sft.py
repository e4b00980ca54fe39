"""The supervised warm start (a "cold start" before RL): next-token cross-entropy on reference
completions, the prompt tokens masked out. It is the train step with objective='sft': the same
chunked log-probs, micro-batching, sharding and optimizer code as GRPO, with Adam at sft.lr.

    batch = sft_batch(prompt_ids, completion_ids, pad_id, buckets=(48, 64), multiple=16)
    step = train_step.TrainStep(model_cfg, loss_cfg, sft_optim_config(config), mesh,
                                objective="sft")
    state, metrics, _ = step(state, batch)

A signal (grpo_jax.interrupts) stops it before its next step with its progress saved in the
workdir (checkpoint_dir), from which the next start resumes it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from grpo_jax import checkpoint, data, hosts, progress, storage, train_step
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


CHECKPOINT_DIR = os.path.join(checkpoint.SUBDIR, "warm_start")  # in the workdir


def checkpoint_dir(workdir: str) -> str:
  """<workdir>/checkpoints/warm_start: an interrupted warm start's checkpoint (orbax ignores
  the name beside GRPO's numbered steps). Its step directories are numbered by the steps taken
  in all (retaken steps counted), so each save comes after the one before."""
  return os.fspath(storage.path(workdir) / CHECKPOINT_DIR)


def has_checkpoint(workdir: str) -> bool:
  """An interrupted warm start's finished save is in workdir (its SHA256SUMS written)."""
  d = storage.path(checkpoint_dir(workdir))
  return d.is_dir() and any(p.name.isdigit() and (p / checkpoint.CHECKSUMS_FILE).exists()
                            for p in d.iterdir())


def delete_checkpoint(workdir: str, saving) -> None:
  """Deletes the warm start's checkpoint directory, if there is one, once the save in flight
  of `saving` (the checkpoint.Checkpointer writing GRPO's step 0) is on disk."""
  d = storage.path(checkpoint_dir(workdir))
  if d.exists():
    saving.wait()
    d.rmtree()


@dataclasses.dataclass
class _Progress:
  """Where the warm start is: what its checkpoint holds, so that a resumed warm start takes
  the steps an uninterrupted one takes and stops where it stops."""
  i: int                    # steps counted towards sft.steps (back to a check's after an overshoot)
  taken: int                # steps taken in all
  state: Any                # the train state after them
  acc: float | None         # the last check's accuracy
  every_step: bool          # gone back after an overshoot: checking after every step
  last_check: tuple | None  # (step, state copy, data position), kept while an overshoot can
                            # send the warm start back to it


class Model(NamedTuple):
  """What the warm start needs of a run: its model's config and mesh, its rollout (whose
  sft_examples it trains on, and whose tokenizer pads them) and evaluate(variables, rows), the
  greedy accuracy its stopping rule reads, of what the sampler runs ({'params': params})."""
  cfg: Any
  mesh: Any
  rollout: Any
  evaluate: Callable[[Any, list], float]


def run_sft(config, model: Model, params, rows, eval_rows=(), workdir=None, stop=None):
  """The warm start; deterministic in the seed. Returns the params.

  With sft.target_accuracy > 0 it evaluates greedy accuracy on `eval_rows` every
  sft.eval_every steps and stops at the first evaluation that reaches the target; sft.steps is
  then the most it may take. A fixed step count leaves some seeds' policies too weak for GRPO to
  find any reward (experiments/tiny_seeds.md).

  With sft.overshoot_accuracy > 0 as well, a check that reaches the target and is above that
  accuracy jumped past the target between two checks (a model that learns a format can go from
  under 10% to 80% in ten steps). The warm start then goes back to the previous check (its
  params, optimizer state and data position) and takes those steps again, checking after each
  one, and stops at the first that reaches the target.

  stop (grpo_jax.interrupts.Interrupts): a signal stops it before its next step, with its
  progress saved to checkpoint_dir(workdir) (interrupts.Stopped); a later call with that
  workdir resumes from there (params may then be None: the checkpoint holds them).
  """
  s, tok = config.sft, model.rollout.tokenizer
  max_completion = model.rollout.completion_width
  optim = sft_optim_config(config)
  step = train_step.TrainStep(model.cfg, config.loss, optim, model.mesh, objective="sft")
  order = data.PromptIterator(len(rows), s.batch_size, config.seed + 1)
  target = s.target_accuracy if eval_rows else 0.0
  overshoot = s.overshoot_accuracy if target else 0.0
  p = _restore(workdir, model, optim, overshoot, order) if workdir else None
  if p is None:
    state = train_step.create_train_state(params, model.cfg, optim, model.mesh)
    # The step donates its input state, so the kept state is a copy.
    p = _Progress(0, 0, state, None, False,
                  (0, _copy(state), order.position()) if overshoot else None)
  resumed_at = p.taken
  if stop is not None:
    stop.abortable(None)  # a signal from here on is answered before the next step
  bar = progress.Bar(total=s.steps, desc="sft warm start", initial=p.i,
                     every_s=config.train.progress_every_s, disable=not hosts.is_main())
  while p.i < s.steps:
    if stop is not None and stop.agreed(p.taken % 10 == 0):
      bar.close()
      raise _stopped(stop, p, order, workdir, s.steps, resumed_at)
    batch_rows = [rows[j] for j in order.next_indices()]
    prompts, completions, masks = model.rollout.sft_examples(batch_rows)
    batch = sft_batch(prompts, completions, tok.pad_token_id, buckets=config.data.prompt_buckets,
                      multiple=config.train.pad_multiple, max_completion=max_completion,
                      loss_masks=masks)
    p.state, metrics, _ = step(p.state, batch)
    p.i, p.taken = p.i + 1, p.taken + 1
    if p.i % 10 == 1:  # reading the loss waits for the device; not every step
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}",
                      **({} if p.acc is None else {"val": f"{p.acc:.3f}"}))
    bar.update(1)
    if not target or not (p.every_step or p.i % s.eval_every == 0):
      continue
    p.acc = model.evaluate({"params": p.state["params"]}, eval_rows)
    bar.write(f"grpo_jax: warm start step {p.i}: validation accuracy {p.acc:.1%}")
    if overshoot and p.acc > overshoot and not p.every_step:  # (overshoot > target)
      p.i, state, position = p.last_check
      p.state = _copy(state)  # (the kept one stays whole for a save)
      order.restore(position)
      p.every_step = True
      bar.set_count(p.i)
      bar.write(f"grpo_jax: warm start: {p.acc:.1%} is past sft.overshoot_accuracy "
                f"{overshoot:.0%}; going back to step {p.i} and checking after every step")
      continue
    if p.acc >= target:
      bar.close(stopped="target reached")
      print(f"grpo_jax: warm start reached {p.acc:.1%} on {len(eval_rows)} validation problems "
            f"(target {target:.0%}) after {p.i} steps", flush=True)
      return p.state["params"]
    if overshoot and not p.every_step:
      p.last_check = (p.i, _copy(p.state), order.position())
  bar.close()
  if target:
    # sft.steps < sft.eval_every (a shortened test run) ends before any check: no accuracy.
    measured = (f"validation accuracy {p.acc:.1%}" if p.acc is not None
                else f"no validation check (sft.eval_every={s.eval_every})")
    warn(f"the warm start ended at its limit of {s.steps} steps with {measured}, below its "
         f"target {target:.0%}")
  return p.state["params"]


def _stopped(stop, p: _Progress, order, workdir, steps: int, resumed_at: int):
  """Saves the warm start's progress (unless it made none since its checkpoint) and returns
  the interrupts.Stopped that says so."""
  if p.taken == resumed_at:
    saved = (f"its checkpoint in {checkpoint_dir(workdir)} is kept" if p.taken
             else "nothing was saved (no step taken)")
  else:
    _save(workdir, p, order)
    saved = f"saved it to {checkpoint_dir(workdir)}"
  return stop.stopped(f"in the warm start at step {p.i} of at most {steps}: {saved}; run the "
                      "same command to resume")


def _save(workdir, p: _Progress, order) -> None:
  """The train state (and the last check's, while an overshoot can go back to it), the data
  position and the stopping rule's counts, as checkpoint.Checkpointer saves GRPO's (checksums
  included); the earlier save is deleted once this one is whole."""
  tree, last = {"train": p.state}, None
  if p.last_check is not None:
    step, state, position = p.last_check
    tree["last_check"] = state
    last = {"step": step, "data_position": position}
  counters = {"step": p.i, "accuracy": p.acc, "every_step": p.every_step, "last_check": last}
  with checkpoint.Checkpointer(workdir, max_to_keep=1, async_save=False,
                               subdir=CHECKPOINT_DIR) as ckpt:
    ckpt.save(p.taken, tree, order.position(), counters)


def _restore(workdir, model: Model, optim, overshoot, order) -> _Progress | None:
  """The progress an interrupted warm start saved in workdir (None: none), the data order
  moved to its position."""
  if not has_checkpoint(workdir):
    return None
  abstract = train_step.abstract_state(model.cfg, optim, model.mesh)
  tree = {"train": abstract, **({"last_check": abstract} if overshoot else {})}
  with checkpoint.Checkpointer(workdir, max_to_keep=1, subdir=CHECKPOINT_DIR) as ckpt:
    if not ckpt.all_steps():  # only a save that did not finish
      return None
    r = ckpt.restore(tree)
  c = r.counters
  try:
    order.restore(r.data_position)
    last = c["last_check"]
    if last is not None:
      data.PromptIterator(order.num_rows, order.batch_size, order.seed, last["data_position"])
  except ValueError as e:  # another seed or dataset than the checkpoint's
    raise checkpoint.RestoreError(f"{checkpoint_dir(workdir)}/{r.step}: {e}; run with the "
                                  "config it was saved with, or use a new workdir") from None
  last_check = (None if last is None
                else (last["step"], r.state["last_check"], last["data_position"]))
  print(f"grpo_jax: resumed the warm start from step {c['step']} "
        f"({checkpoint_dir(workdir)}/{r.step})", flush=True)
  return _Progress(c["step"], r.step, r.state["train"], c["accuracy"], c["every_step"],
                   last_check)


def _copy(tree):
  """A copy of a pytree of arrays, on the same devices and shardings."""
  return jax.tree.map(lambda x: x.copy(), tree)
