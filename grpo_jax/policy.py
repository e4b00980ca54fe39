"""The policy type: what a run trains, what it keeps frozen, and what its model runs.

Two variants, static and hashable (a field of the jit-static train_step.StepSpec):

    policy.Full()             # full fine-tuning
    policy.Lora(lcfg)         # a lora.LoraConfig: adapters on a frozen base
    policy.of(lcfg_or_None)   # from config.model.lora (trainer.lora_settings)

What each answers, Full | Lora:
  trained (abstract_trainable, trainable_axes, init_trainable): the model's params | the
    adapters alone, fresh from the run's seed (b = 0) or model.lora.init_from's.
  frozen (abstract_frozen, frozen_shardings, make_frozen), in the dtype the step gives
    (train_step.reference_dtype): the reference, kept where β > 0 | the base, always, int8
    projection kernels where lcfg.quantize = 'int8'; with the adapters off it is also the
    reference.
  needs_frozen(reference), applies_frozen: whether the frozen params exist, and whether the
    policy's forward reads them: when β > 0, no | always, yes.
  variables(params, frozen, scale): what model.apply takes in the step: {'params': params} |
    the base with the adapters, b scaled by alpha / r (or scale, a traced hparam).
  is_reference(params, frozen, dtype): a traced bool, the policy computes what the reference
    does: the params equal it in the compute dtype | every b is 0.
  sampled(params, frozen): what a run's sampler runs: {'params': params} | the base with the
    adapters merged into its kernels (lcfg.merge_for_sampling), else `variables` (a sweep's
    members sample `variables`: K adapters beside one base).
  frozen_in_checkpoint: a checkpoint holds the frozen params as its 'ref' | no: the base is
    the starting model, or the warm start's in BASE_DIR.
  members_share_frozen: a sweep's members each have their own reference | share one base.
  exported, save: final_model/ | final_model/ (merged) and final_adapter/ (PEFT's format).

Pytrees are as in grpo_jax.models: params {'embed_tokens': ..., 'layers': {...}, ...}; LoRA
adapters {'layers': {'self_attn': {'q_proj': {'lora_a': [L, D, r], 'lora_b': [L, r, N, H]}}}};
model.apply variables {'params': params} or {'params': base, 'lora': adapters with b scaled}.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from grpo_jax import sharding, storage
from grpo_jax.models import lora as lora_lib, quant, qwen, weights

LORA_INIT_STREAM = 0x10A  # fold_in stream of the seed for the adapters' initialisation


def same_params(params, ref_params, dtype):
  """Whether two params pytrees are equal as the forward uses them (cast to its compute dtype,
  as every parameter is before use): a scalar bool, one compare-and-reduce pass per leaf."""
  eq = jax.tree.map(lambda p, r: jnp.all(p.astype(dtype) == r.astype(dtype)), params, ref_params)
  return jnp.all(jnp.stack(jax.tree.leaves(eq)))


class Policy:
  """What both variants share: how the frozen params are stored, placed and made."""
  applies_frozen: ClassVar[bool]  # whether the policy's forward reads the frozen params
  frozen_in_checkpoint: ClassVar[bool]  # whether a checkpoint holds them (as its 'ref')
  members_share_frozen: ClassVar[bool]  # whether a sweep's members share one copy, unstacked

  def needs_frozen(self, reference: bool) -> bool:
    """Whether the frozen params exist, given whether the loss needs the reference."""
    return self.applies_frozen or reference

  def _frozen_quantized(self) -> str:
    """The frozen base's quant.MODES entry, '' for none."""
    return ""

  def abstract_frozen(self, model_cfg, dtype):
    """ShapeDtypeStructs of the frozen params, stored in dtype (train_step.reference_dtype)."""
    if self._frozen_quantized():
      return quant.abstract(model_cfg, dtype, self._frozen_quantized())
    return qwen.abstract_params(model_cfg, dtype)

  def frozen_shardings(self, model_cfg, dtype, mesh):
    """NamedShardings of the frozen params (abstract_frozen), by the logical-axis rules."""
    mode = self._frozen_quantized()
    axes = quant.logical_axes(model_cfg, mode) if mode else qwen.logical_axes(model_cfg)
    return sharding.param_shardings(axes, self.abstract_frozen(model_cfg, dtype), mesh)

  def make_frozen(self, params, model_cfg, dtype, mesh):
    """The frozen params: a fresh copy of params in dtype, placed by the rules (the caller's
    params may be dropped afterwards); int8 or NF4 projection kernels where the policy says."""
    mode = self._frozen_quantized()

    def make(p):
      p = jax.tree.map(lambda x: x.astype(dtype), p)
      return quant.quantize(p, mode) if mode else p
    plain_sh = sharding.param_shardings(qwen.logical_axes(model_cfg),
                                        qwen.abstract_params(model_cfg, dtype), mesh)
    return jax.jit(make, out_shardings=self.frozen_shardings(model_cfg, dtype, mesh))(
        jax.device_put(params, plain_sh))


@dataclasses.dataclass(frozen=True)
class Full(Policy):
  """Full fine-tuning: the optimizer trains the model's params; the frozen params, kept only
  where the loss needs them (β > 0), are the reference policy."""
  applies_frozen: ClassVar[bool] = False
  frozen_in_checkpoint: ClassVar[bool] = True
  members_share_frozen: ClassVar[bool] = False

  def abstract_trainable(self, model_cfg, dtype):
    return qwen.abstract_params(model_cfg, dtype)

  def trainable_axes(self, model_cfg):
    return qwen.logical_axes(model_cfg)

  def init_trainable(self, params, model_cfg, seed: int, dtype):
    """What the optimizer starts from: the starting params themselves."""
    del model_cfg, seed, dtype
    return params

  def hparams(self) -> dict:
    """The policy's array settings in train_step.hparams: none."""
    return {}

  def variables(self, params, frozen, scale=None) -> dict:
    """The policy's variables for model.apply."""
    del frozen, scale
    return {"params": params}

  def is_reference(self, params, frozen, dtype):
    """A traced bool: the params equal the reference's as the forward (compute dtype) uses
    them, so the policy computes exactly what the reference does."""
    return same_params(params, frozen, dtype)

  def sampled(self, params, frozen):
    """What the sampler runs, as model.apply's variables: the params."""
    del frozen
    return {"params": params}

  def exported(self, params, frozen):
    """What save writes from (gathered first where several processes hold it)."""
    del frozen
    return params

  def save(self, root, exported, model_cfg, *, generation_config, tokenizer, base_model: str):
    """final_model/ under root (a storage path), a transformers checkpoint."""
    del base_model
    with storage.local_dir(root / "final_model", whole=True) as out:
      weights.save_checkpoint(exported, model_cfg, out, generation_config=generation_config,
                              tokenizer=tokenizer)


@dataclasses.dataclass(frozen=True)
class Lora(Policy):
  """LoRA: the optimizer trains adapters (lcfg) on a frozen base, which the forward always
  reads and which with the adapters off is also the reference policy."""
  lcfg: lora_lib.LoraConfig
  applies_frozen: ClassVar[bool] = True
  # The base is the starting model, or the warm start's in BASE_DIR: checkpoints hold the
  # adapters and their moments alone.
  frozen_in_checkpoint: ClassVar[bool] = False
  members_share_frozen: ClassVar[bool] = True

  def abstract_trainable(self, model_cfg, dtype):
    return lora_lib.abstract(model_cfg, self.lcfg, dtype)

  def trainable_axes(self, model_cfg):
    return lora_lib.logical_axes(model_cfg, self.lcfg)

  def init_trainable(self, params, model_cfg, seed: int, dtype):
    """Fresh adapters (PEFT's initialisation from the run's seed, b = 0), or lcfg.init_from's
    PEFT adapter (lora.start_adapters); modules_to_save copies params' modules."""
    if self.lcfg.init_from:
      return lora_lib.start_adapters(self.lcfg, model_cfg, dtype)
    key = jax.random.fold_in(jax.random.key(seed), LORA_INIT_STREAM)
    return lora_lib.init(key, model_cfg, self.lcfg, dtype, params)

  def hparams(self) -> dict:
    """The adapters' scale alpha / r, which a vmapped sweep may vary per member."""
    return {"lora_scale": self.lcfg.scale}

  def _frozen_quantized(self) -> str:
    return "" if self.lcfg.quantize == "none" else self.lcfg.quantize

  def variables(self, params, frozen, scale=None) -> dict:
    """The base (frozen) with the adapters (params) on, b scaled by scale (default alpha / r;
    a traced array in the step, hparams['lora_scale'])."""
    return lora_lib.variables(frozen, params, self.lcfg, scale=scale)

  def is_reference(self, params, frozen, dtype):
    """A traced bool: every b is 0, so each adapted projection adds exact zeros to the base's,
    and each modules_to_save copy equals the base's module in the compute dtype."""
    zero_b = jnp.all(jnp.stack([jnp.all(b == 0) for b in lora_lib.b_factors(params)]))
    saved = lora_lib.SAVED_MODULES
    copies = {m: params[m] for m in saved if m in params}
    if not copies:
      return zero_b
    return zero_b & same_params(copies, {m: frozen[m] for m in copies}, dtype)

  def sampled(self, params, frozen):
    """What the sampler runs, as model.apply's variables: the base with the adapters merged
    into its target kernels (lcfg.merge_for_sampling), or beside them (`variables`, what a
    sweep's members sample: K adapters on one base)."""
    if self.lcfg.merge_for_sampling:
      return {"params": lora_lib.merged_policy(frozen, params, self.lcfg, _merge_fn(self.lcfg))}
    return lora_lib.variables(frozen, params, self.lcfg)

  def exported(self, params, frozen):
    return params, frozen

  def save(self, root, exported, model_cfg, *, generation_config, tokenizer, base_model: str):
    """final_model/ (the base with the adapters merged in) and final_adapter/ (PEFT's format,
    naming base_model as its base)."""
    adapters, base = exported
    with storage.local_dir(root / "final_model", whole=True) as out:
      lora_lib.save_merged(base, adapters, model_cfg, self.lcfg, out,
                           generation_config=generation_config, tokenizer=tokenizer)
    with storage.local_dir(root / "final_adapter", whole=True) as out:
      lora_lib.save_peft(adapters, model_cfg, self.lcfg, out, base_model=base_model)


FULL = Full()


def of(lcfg: lora_lib.LoraConfig | None) -> Policy:
  """The policy of a config's model.lora (lora.LoraConfig.from_config: None at rank 0)."""
  return FULL if lcfg is None else Lora(lcfg)


@functools.lru_cache(maxsize=None)
def _merge_fn(lcfg):
  """merged_kernels jitted with lcfg bound: one compile per LoRA setting and shapes."""
  return jax.jit(functools.partial(lora_lib.merged_kernels, lcfg=lcfg))
