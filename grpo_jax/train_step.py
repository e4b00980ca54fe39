"""The GRPO train step: state, optimizer, one jitted and sharded `(state, batch) → (state, metrics)`.

The batch dict the training loop builds (B = prompts × G completions, group-major rows;
S = P + C; C is the fixed max_completion_length, never trimmed, since dr_grpo divides by it):

  tokens_BS            int32    prompt left-padded to P, then the completion right-padded to C
  attn_mask_BS         int32    1 on real prompt and completion tokens (pads 0)
  completion_mask_BC   int32    1 on completion tokens that count: up to and including EOS
  advantages_B         float32  from grpo.group_advantages
  old_logp_BC          float32  optional; required when loss.num_iterations > 1: the log-probs
                                of the params before the first of the μ updates (logprob_fn)
  ref_logp_BC          float32  required iff loss.beta > 0 (logprob_fn on the reference params;
                                with β = 0 the reference forward is never run)
  truncated_B          bool     optional; required if loss.mask_truncated_completions
  num_loss_tokens      float32  optional scalar, dapo only: loss tokens in the whole generation
                                batch when it spans several optimizer steps (default: this
                                batch's), counted with grpo.loss_mask(...).sum()

Example (B=2, P=3, C=4; 0 is the pad id, 9 the EOS):
  tokens_BS          [[0, 5, 6, 7, 8, 9, 0],  [4, 5, 6, 7, 7, 7, 7]]
  attn_mask_BS       [[0, 1, 1, 1, 1, 1, 0],  [1, 1, 1, 1, 1, 1, 1]]
  completion_mask_BC [[1, 1, 0, 0],           [1, 1, 1, 1]]      truncated_B [False, True]

The state is a plain dict {'step': int32 scalar, 'params': ..., 'opt_state': ...}, so
checkpoint.py saves it as is. The step runs grad_accum_steps micro-batches in a scan, summing
gradients of losses that are already normalised over the whole step (see grpo.py), so the
result does not depend on the micro-batching. A step whose loss or gradient is not finite
leaves the state unchanged and reports `step/skipped`=1.

    step = make_train_step(model_cfg, loss_cfg, optim_cfg, mesh)
    logprob_fn = make_logprob_fn(model_cfg, loss_cfg, optim_cfg, mesh)
    state = create_train_state(params, model_cfg, optim_cfg, mesh)
    for it in range(loss_cfg.num_iterations):      # μ updates on one generation batch
      state, metrics = step(state, batch)
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import config_dict

from grpo_jax import grpo, sharding
from grpo_jax.models import qwen

SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16")
REQUIRED_KEYS = ("tokens_BS", "attn_mask_BS", "completion_mask_BC", "advantages_B")
OPTIONAL_KEYS = ("old_logp_BC", "ref_logp_BC", "truncated_B", "num_loss_tokens")


def default_optim_config() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      lr=1e-6,
      warmup_steps=0,          # linear from 0 to lr over these steps
      schedule="constant",     # after warmup: 'constant' or 'cosine' (to 0 at total_steps)
      total_steps=0,           # needed by 'cosine'; the loop may fill it in
      weight_decay=0.0,        # AdamW, on kernels and embeddings only (not norms, biases)
      b1=0.9,
      b2=0.99,
      max_grad_norm=1.0,       # global-norm clipping; 0 disables it
      grad_accum_steps=1,      # micro-batches per optimizer step
      param_dtype="float32",   # dtype the params and optimizer moments are stored in
      compute_dtype="bfloat16",  # dtype of the forward/backward matmuls
      remat=True,              # rematerialise each decoder layer in the backward pass
  ))


def validate_optim_config(cfg) -> None:
  """Raises ValueError naming the first bad setting of an optimizer config."""
  if not cfg.lr > 0:
    raise ValueError(f"optim.lr={cfg.lr!r} must be > 0")
  for name in ("warmup_steps", "total_steps"):
    if not (isinstance(cfg[name], int) and cfg[name] >= 0):
      raise ValueError(f"optim.{name}={cfg[name]!r} must be an int >= 0")
  if cfg.schedule not in SCHEDULES:
    raise ValueError(f"optim.schedule={cfg.schedule!r} is not one of {SCHEDULES}")
  if cfg.schedule == "cosine" and not cfg.total_steps > cfg.warmup_steps:
    raise ValueError(f"optim.total_steps={cfg.total_steps!r} must exceed optim.warmup_steps="
                     f"{cfg.warmup_steps} for the cosine schedule")
  if not cfg.weight_decay >= 0:
    raise ValueError(f"optim.weight_decay={cfg.weight_decay!r} must be >= 0")
  for name in ("b1", "b2"):
    if not 0 <= cfg[name] < 1:
      raise ValueError(f"optim.{name}={cfg[name]!r} must be in [0, 1)")
  if not cfg.max_grad_norm >= 0:
    raise ValueError(f"optim.max_grad_norm={cfg.max_grad_norm!r} must be >= 0 (0 disables)")
  if not (isinstance(cfg.grad_accum_steps, int) and cfg.grad_accum_steps >= 1):
    raise ValueError(f"optim.grad_accum_steps={cfg.grad_accum_steps!r} must be an int >= 1")
  for name in ("param_dtype", "compute_dtype"):
    if cfg[name] not in DTYPES:
      raise ValueError(f"optim.{name}={cfg[name]!r} is not one of {DTYPES}")


def learning_rate_schedule(cfg) -> optax.Schedule:
  """Linear warmup from 0, then constant or cosine decay to 0 at total_steps."""
  warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.lr)
  else:
    after = optax.cosine_decay_schedule(cfg.lr, cfg.total_steps - cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def decay_mask(params):
  """Weight decay on matrices (kernels, embedding, lm_head), not on norm weights or biases."""
  def one(path, _):
    return getattr(path[-1], "key", None) in ("kernel", "embedding", "lm_head")
  return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg) -> optax.GradientTransformation:
  validate_optim_config(cfg)
  adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                      weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.max_grad_norm:
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
  return adamw


# ------------------------------------------------------------------------------------------------
# State and shardings.


def abstract_state(model_cfg, optim_cfg, mesh=None):
  """ShapeDtypeStructs of the train state (with shardings if a mesh is given); no allocation."""
  dtype = jnp.dtype(optim_cfg.param_dtype)
  params = qwen.abstract_params(model_cfg, dtype)
  opt_state = jax.eval_shape(make_optimizer(optim_cfg).init, params)
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": opt_state}
  if mesh is None:
    return state
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      state_shardings(model_cfg, optim_cfg, mesh))


def state_shardings(model_cfg, optim_cfg, mesh):
  """NamedShardings of the state: params by the logical-axis rules, optimizer moments alike."""
  params = qwen.abstract_params(model_cfg, jnp.dtype(optim_cfg.param_dtype))
  param_sh = sharding.param_shardings(qwen.logical_axes(model_cfg), params, mesh)
  optimizer = make_optimizer(optim_cfg)
  opt_sh = optax.tree_map_params(
      optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), param_sh,
      transform_non_params=lambda _: sharding.replicated(mesh))
  return {"step": sharding.replicated(mesh), "params": param_sh, "opt_state": opt_sh}


def create_train_state(params, model_cfg, optim_cfg, mesh):
  """The initial state from a params pytree: cast to param_dtype, placed by the rules."""
  sh = state_shardings(model_cfg, optim_cfg, mesh)
  dtype = jnp.dtype(optim_cfg.param_dtype)
  # device_put may hand back the caller's own buffers (e.g. as one shard of a replicated leaf);
  # the jitted cast makes fresh ones, so donating the state never deletes the caller's params
  # (which are often the reference params too).
  params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
                   out_shardings=sh["params"])(jax.device_put(params, sh["params"]))
  opt_state = jax.jit(make_optimizer(optim_cfg).init, out_shardings=sh["opt_state"])(params)
  return {"step": jax.device_put(jnp.zeros((), jnp.int32), sh["step"]), "params": params,
          "opt_state": opt_state}


def _shape(x) -> tuple[int, ...]:
  return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)  # arrays or ShapeDtypeStructs


def batch_shardings(batch, mesh):
  """Row-indexed arrays split over (data, fsdp); scalars replicated."""
  return {k: NamedSharding(mesh, P(sharding.BATCH_AXES) if _shape(v) else P())
          for k, v in batch.items()}


def check_batch(batch, loss_cfg, optim_cfg, mesh) -> None:
  """Host-side checks, before anything is donated: a bad batch raises and the state survives."""
  missing = [k for k in REQUIRED_KEYS if k not in batch]
  unknown = [k for k in batch if k not in REQUIRED_KEYS + OPTIONAL_KEYS]
  if missing or unknown:
    raise ValueError(f"batch is missing {missing} / has unknown keys {unknown}")
  B, S = _shape(batch["tokens_BS"])
  C = _shape(batch["completion_mask_BC"])[-1]
  expect = {"attn_mask_BS": (B, S), "completion_mask_BC": (B, C), "advantages_B": (B,),
            "old_logp_BC": (B, C), "ref_logp_BC": (B, C), "truncated_B": (B,),
            "num_loss_tokens": ()}
  for k, shape in expect.items():
    if k in batch and _shape(batch[k]) != shape:
      raise ValueError(f"batch['{k}'] has shape {_shape(batch[k])}, expected {shape} "
                       f"(B={B}, S={S}, C={C})")
  if not C < S:
    raise ValueError(f"completion length C={C} must be shorter than tokens_BS length S={S}")
  if not jnp.issubdtype(batch["tokens_BS"].dtype, jnp.integer):
    raise ValueError(f"batch['tokens_BS'] must be integer, got {batch['tokens_BS'].dtype}")
  if grpo.needs_reference(loss_cfg) != ("ref_logp_BC" in batch):
    raise ValueError(f"loss.beta={loss_cfg.beta}: batch['ref_logp_BC'] must be given iff "
                     "beta > 0 (with beta = 0 the reference forward is skipped)")
  if loss_cfg.num_iterations > 1 and "old_logp_BC" not in batch:
    raise ValueError(f"loss.num_iterations={loss_cfg.num_iterations} > 1 needs "
                     "batch['old_logp_BC'] (logprob_fn on the params before the first update)")
  if loss_cfg.mask_truncated_completions and "truncated_B" not in batch:
    raise ValueError("loss.mask_truncated_completions=True needs batch['truncated_B']")
  if "num_loss_tokens" in batch and loss_cfg.loss_type != "dapo":
    raise ValueError(f"batch['num_loss_tokens'] is only used by loss.loss_type='dapo', "
                     f"not {loss_cfg.loss_type!r}")
  n_batch_dev = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES]))
  accum = optim_cfg.grad_accum_steps
  if B % accum or (B // accum) % n_batch_dev:
    raise ValueError(f"batch of {B} rows must split into optim.grad_accum_steps={accum} "
                     f"micro-batches each divisible by the data×fsdp={n_batch_dev} devices")


# ------------------------------------------------------------------------------------------------
# Forward to completion log-probs.


def _model(model_cfg, optim_cfg, mesh):
  # The residual stream is pinned to the batch split (see qwen.Qwen.act_sharding).
  return qwen.Qwen(model_cfg, dtype=jnp.dtype(optim_cfg.compute_dtype),
                   param_dtype=jnp.dtype(optim_cfg.param_dtype), remat=optim_cfg.remat,
                   act_sharding=NamedSharding(mesh, P(sharding.BATCH_AXES)))


def completion_logprobs(model, model_cfg, loss_cfg, params, tokens_BS, attn_mask_BS, C, mesh):
  """Per-token log-probs and entropies of the last C tokens: ([B, C], [B, C]) fp32.

  The forward runs over S − 1 positions: position t's hidden state predicts token t + 1, so the
  completion's C tokens are predicted from positions P − 1 … S − 2.
  """
  positions_BS = qwen.positions_from_mask(attn_mask_BS)
  hidden_BTD, _ = model.apply({"params": params}, tokens_BS[:, :-1], positions_BS[:, :-1],
                              attn_mask_BS[:, :-1])
  head_DV = qwen.head_kernel(params, model_cfg).astype(model.dtype)
  if loss_cfg.get("valid_vocab_size"):
    # Embedding rows past the tokenizer are never sampled; leaving them out of the softmax
    # makes these log-probs those of the distribution the sampler drew from.
    head_DV = head_DV[:, :loss_cfg.valid_vocab_size]
  return grpo.token_logprobs(hidden_BTD[:, -C:], head_DV, tokens_BS[:, -C:],
                             temperature=loss_cfg.temperature,
                             chunk_size=loss_cfg.logprob_chunk_size)


def _split_micro(x, accum, mesh):
  """[B, ...] → [accum, B/accum, ...], micro-batch a = rows a, a + accum, …: each micro-batch
  keeps rows on every device of the contiguous batch split, so no resharding is needed."""
  x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, sharding.BATCH_AXES)))


def make_logprob_fn(model_cfg, loss_cfg, optim_cfg, mesh):
  """Jitted (params, tokens_BS, attn_mask_BS, C) → logp_BC for old / reference log-probs.

  Forward only, in grad_accum_steps micro-batches (the same memory plan as the train step).
  Never call it on the reference params when loss.beta == 0 (grpo.needs_reference).
  """
  grpo.validate_loss_config(loss_cfg)
  validate_optim_config(optim_cfg)
  model = _model(model_cfg, optim_cfg, mesh)
  accum = optim_cfg.grad_accum_steps
  param_sh = state_shardings(model_cfg, optim_cfg, mesh)["params"]
  row_sh = NamedSharding(mesh, P(sharding.BATCH_AXES))

  def fn(params, tokens_BS, attn_mask_BS, C):
    def one(xs):
      return completion_logprobs(model, model_cfg, loss_cfg, params, *xs, C, mesh)[0]
    micro = (_split_micro(tokens_BS, accum, mesh), _split_micro(attn_mask_BS, accum, mesh))
    logp_ABC = jax.lax.map(one, micro)
    return logp_ABC.swapaxes(0, 1).reshape(tokens_BS.shape[0], C)

  return jax.jit(fn, in_shardings=(param_sh, row_sh, row_sh), out_shardings=row_sh,
                 static_argnums=3)


# ------------------------------------------------------------------------------------------------
# The step.


_METRIC_IDENTITY = {"ratio/min": jnp.inf, "ratio/max": -jnp.inf}


def _metric_merge(a, b):
  """Accumulates loss_terms sums across micro-batches: min/max for the ratio range, else sum."""
  return {k: jnp.minimum(a[k], b[k]) if k == "ratio/min" else
          jnp.maximum(a[k], b[k]) if k == "ratio/max" else a[k] + b[k] for k in a}


def loss_and_grads(params, batch, *, model, model_cfg, loss_cfg, optim_cfg, mesh, param_sh):
  """Gradients of the step's loss, summed over grad_accum_steps micro-batches.

  Returns (grads, sums, step_tokens): `sums` holds grpo.loss_terms' sums (plus 'loss' and
  'entropy/sum') accumulated over the micro-batches; step_tokens counts the loss tokens.
  """
  accum = optim_cfg.grad_accum_steps
  B, C = batch["completion_mask_BC"].shape
  mask_BC = grpo.loss_mask(batch["completion_mask_BC"], batch.get("truncated_B"),
                           loss_cfg.mask_truncated_completions)
  step_tokens = mask_BC.sum()
  norm_tokens = step_tokens  # bnpo, and dapo when the generation batch is this step's batch
  if loss_cfg.loss_type == "dapo" and "num_loss_tokens" in batch:
    norm_tokens = jnp.asarray(batch["num_loss_tokens"], jnp.float32)

  per_row = {k: batch[k] for k in ("tokens_BS", "attn_mask_BS", "advantages_B", "old_logp_BC",
                                   "ref_logp_BC") if k in batch}
  per_row["mask_BC"] = mask_BC
  micro = jax.tree.map(lambda x: _split_micro(x, accum, mesh), per_row)

  def loss_fn(p, mb):
    logp_BC, entropy_BC = completion_logprobs(model, model_cfg, loss_cfg, p, mb["tokens_BS"],
                                              mb["attn_mask_BS"], C, mesh)
    weights_BC = grpo.token_weights(mb["mask_BC"], loss_cfg.loss_type, num_sequences=B,
                                    num_tokens=norm_tokens)
    loss, sums = grpo.loss_terms(logp_BC, mb.get("old_logp_BC"), mb.get("ref_logp_BC"),
                                 mb["advantages_B"], mb["mask_BC"], weights_BC, loss_cfg)
    sums["loss"] = jax.lax.stop_gradient(loss)
    sums["entropy/sum"] = jnp.sum(entropy_BC * mb["mask_BC"])
    return loss, sums

  grad_fn = jax.grad(loss_fn, has_aux=True)
  constrain = lambda g: jax.lax.with_sharding_constraint(g, param_sh)
  if accum == 1:
    grads, sums = grad_fn(params, jax.tree.map(lambda x: x[0], micro))
    return constrain(grads), sums, step_tokens

  # One traced copy of the backward pass: scan from zero gradients and identity metric sums.
  grads0, sums0 = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
  grads0 = constrain(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), grads0))
  sums0 = {k: jnp.full(v.shape, _METRIC_IDENTITY.get(k, 0), v.dtype) for k, v in sums0.items()}

  def body(carry, mb):
    g_acc, s_acc = carry
    g, s = grad_fn(params, mb)
    return (constrain(jax.tree.map(jnp.add, g_acc, g)), _metric_merge(s_acc, s)), None
  (grads, sums), _ = jax.lax.scan(body, (grads0, sums0), micro)
  return grads, sums, step_tokens


def _train_step(state, batch, *, grad_fn, optimizer, optim_cfg):
  params = state["params"]
  grads, sums, step_tokens = grad_fn(params, batch)
  B = batch["completion_mask_BC"].shape[0]
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = optimizer.update(grads, state["opt_state"], params)
  new_params = optax.apply_updates(params, updates)
  ok = jnp.isfinite(grad_norm) & jnp.isfinite(sums["loss"])
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
  new_state = {"step": state["step"] + ok.astype(jnp.int32),
               "params": keep(new_params, params),
               "opt_state": keep(opt_state, state["opt_state"])}

  adv_B = batch["advantages_B"].astype(jnp.float32)
  metrics = grpo.finalize_metrics(sums, step_tokens)
  metrics.update({
      "loss": sums["loss"],
      "entropy": sums["entropy/sum"] / jnp.maximum(step_tokens, 1.0),
      "grad_norm": grad_norm,
      "lr": learning_rate_schedule(optim_cfg)(state["step"]),
      "step/skipped": 1.0 - ok.astype(jnp.float32),
      "advantages/mean": adv_B.mean(), "advantages/std": adv_B.std(),
      "advantages/min": adv_B.min(), "advantages/max": adv_B.max(),
      "tokens/completion": step_tokens,
      "tokens/completion_per_seq": step_tokens / B,
      "tokens/total": batch["attn_mask_BS"].astype(jnp.float32).sum(),
  })
  return new_state, metrics


class TrainStep:
  """`step(state, batch) → (state, metrics)`; jitted with explicit shardings, state donated.

  One compilation per batch layout (which optional keys are present, and the shapes).
  `step.jitted(batch)` gives the jax.jit object, e.g. for `.lower(state, batch).compile()`.
  """

  def __init__(self, model_cfg, loss_cfg, optim_cfg, mesh):
    grpo.validate_loss_config(loss_cfg)
    validate_optim_config(optim_cfg)
    self.model_cfg, self.loss_cfg, self.optim_cfg, self.mesh = (model_cfg, loss_cfg, optim_cfg,
                                                                mesh)
    self.state_sh = state_shardings(model_cfg, optim_cfg, mesh)
    self._loss_and_grads = functools.partial(
        loss_and_grads, model=_model(model_cfg, optim_cfg, mesh), model_cfg=model_cfg,
        loss_cfg=loss_cfg, optim_cfg=optim_cfg, mesh=mesh, param_sh=self.state_sh["params"])
    self._fn = functools.partial(_train_step, grad_fn=self._loss_and_grads,
                                 optimizer=make_optimizer(optim_cfg), optim_cfg=optim_cfg)
    self._jitted = {}

  def jitted(self, batch):
    check_batch(batch, self.loss_cfg, self.optim_cfg, self.mesh)
    key = tuple(sorted(batch))
    if key not in self._jitted:
      metrics_sh = sharding.replicated(self.mesh)
      self._jitted[key] = jax.jit(
          lambda state, batch: self._fn(state, batch),
          in_shardings=(self.state_sh, batch_shardings(batch, self.mesh)),
          out_shardings=(self.state_sh, metrics_sh), donate_argnums=0)
    return self._jitted[key]

  def __call__(self, state, batch) -> tuple[dict, dict[str, Any]]:
    return self.jitted(batch)(state, batch)


def make_grad_fn(model_cfg, loss_cfg, optim_cfg, mesh, batch):
  """Jitted (params, batch) → (loss, grads) of the train step, for tests and diagnostics."""
  step = TrainStep(model_cfg, loss_cfg, optim_cfg, mesh)
  check_batch(batch, loss_cfg, optim_cfg, mesh)

  def fn(params, batch):
    grads, sums, _ = step._loss_and_grads(params, batch)
    return sums["loss"], grads
  param_sh = step.state_sh["params"]
  return jax.jit(fn, in_shardings=(param_sh, batch_shardings(batch, mesh)),
                 out_shardings=(sharding.replicated(mesh), param_sh))


def make_train_step(model_cfg, loss_cfg, optim_cfg, mesh) -> TrainStep:
  return TrainStep(model_cfg, loss_cfg, optim_cfg, mesh)
