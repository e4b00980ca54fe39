"""The supervised warm start: batch layout and loss against transformers' cross-entropy."""

import jax
import numpy as np
import pytest
import torch

import fixtures
from grpo_jax import config as config_lib, sft, sharding, train_step
from grpo_jax.models import weights


def test_reference_completion_strips_calculator_annotations():
  gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
  assert sft.reference_completion(gsm8k) == "Natalia sold 48/2 = 24 clips in May.\n#### 72"


def test_batch_layout():
  """The train step's layout: prompts left-padded to a bucket, completions right-padded to the
  longest rounded up to the multiple."""
  batch = sft.sft_batch([[5, 6], [7]], [[8, 9], [3, 4, 2]], pad_id=0, buckets=(3, 4), multiple=2,
                        max_completion=8)
  np.testing.assert_array_equal(batch["tokens_BS"], [[0, 5, 6, 8, 9, 0, 0], [0, 0, 7, 3, 4, 2, 0]])
  np.testing.assert_array_equal(batch["attn_mask_BS"],
                                [[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0]])
  np.testing.assert_array_equal(batch["completion_mask_BC"], [[1, 1, 0, 0], [1, 1, 1, 0]])
  with pytest.raises(ValueError, match="completion budget 2"):
    sft.sft_batch([[5]], [[8, 9, 1]], pad_id=0, buckets=(3,), multiple=2, max_completion=2)
  # An agent's traces train on their actions only: the observations' tokens are masked out.
  batch = sft.sft_batch([[5, 6], [7]], [[8, 9], [3, 4, 2]], pad_id=0, buckets=(3, 4), multiple=2,
                        max_completion=8, loss_masks=[[1, 0], [1, 0, 1]])
  np.testing.assert_array_equal(batch["completion_mask_BC"], [[1, 0, 0, 0], [1, 0, 1, 0]])
  np.testing.assert_array_equal(batch["attn_mask_BS"],
                                [[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0]])


def test_sft_loss_equals_transformers_cross_entropy(tmp_path):
  """The warm start is the shared train step with objective='sft': its loss and gradient equal
  transformers' cross-entropy of the completion tokens."""
  path = fixtures.make_checkpoint(tmp_path, "qwen2_untied", 128)
  params, cfg = weights.load_checkpoint(path)
  prompts, completions = [[5, 6, 7], [9]], [[10, 11], [12, 13, 14, 15]]
  batch = sft.sft_batch(prompts, completions, pad_id=0, buckets=(3,), multiple=1,
                        max_completion=4)
  # max_grad_norm=0: AdamW's first moment after one step is (1 − b1)·grad, read back below.
  optim = config_lib.optim()
  optim.update(lr=1e-3, max_grad_norm=0.0, compute_dtype="float32", grad_accum_steps=1)
  mesh = sharding.make_mesh((1, 1, 1))
  step = train_step.TrainStep(cfg, config_lib.loss(), optim, mesh, objective="sft")
  state, metrics, _ = step(train_step.create_train_state(params, cfg, optim, mesh), batch)

  tokens = batch["tokens_BS"]
  model = fixtures.hf_model(path)
  logits = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(batch["attn_mask_BS"])).logits
  logp = torch.log_softmax(logits[:, :-1], -1).gather(
      -1, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None])[..., 0]
  w = torch.zeros(logp.shape)
  w[:, -4:] = torch.tensor(batch["completion_mask_BC"], dtype=torch.float32)
  ref_loss = -(logp * w).sum() / w.sum()
  np.testing.assert_allclose(float(metrics["loss"]), ref_loss.item(), rtol=1e-5)
  ref_loss.backward()
  grad = model.model.embed_tokens.weight.grad.numpy()
  mu = [s.mu for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda s: hasattr(s, "mu"))
        if hasattr(s, "mu")][0]
  np.testing.assert_allclose(np.asarray(mu["embed_tokens"]["embedding"]) / 0.1, grad, atol=1e-6)
