"""The supervised warm start: batch layout and loss against transformers' cross-entropy."""

import numpy as np
import optax
import torch

import fixtures
from grpo_jax import sft
from grpo_jax.models import qwen, weights


def test_reference_completion_strips_calculator_annotations():
  gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
  assert sft.reference_completion(gsm8k) == "Natalia sold 48/2 = 24 clips in May.\n#### 72"


def test_batch_layout():
  tokens, mask, loss_mask = sft.sft_batch([[5, 6], [7]], [[8, 9], [3, 4, 2]], 6, pad_id=0)
  np.testing.assert_array_equal(tokens, [[0, 0, 5, 6, 8, 9], [0, 0, 7, 3, 4, 2]])
  np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
  np.testing.assert_array_equal(loss_mask, [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]])


def test_sft_loss_equals_transformers_cross_entropy(tmp_path):
  path = fixtures.make_checkpoint(tmp_path, "qwen2_untied", 128)
  params, cfg = weights.load_checkpoint(path)
  prompts, completions = [[5, 6, 7], [9]], [[10, 11], [12, 13, 14, 15]]
  tokens, mask, loss_mask = sft.sft_batch(prompts, completions, 8, pad_id=0)
  # Plain SGD with lr 1 makes the update equal to minus the gradient, so the step's loss output
  # can be checked and the update compared with torch's gradient.
  step = sft.make_sft_step(qwen.Qwen(cfg), cfg, optax.sgd(1.0))
  new_params, _, loss = step(params, optax.sgd(1.0).init(params), tokens, mask, loss_mask)

  model = fixtures.hf_model(path)
  logits = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask)).logits
  logp = torch.log_softmax(logits[:, :-1], -1).gather(
      -1, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None])[..., 0]
  w = torch.tensor(loss_mask[:, 1:], dtype=torch.float32)
  ref_loss = -(logp * w).sum() / w.sum()
  np.testing.assert_allclose(float(loss), ref_loss.item(), rtol=1e-5)
  ref_loss.backward()
  grad = model.model.embed_tokens.weight.grad.numpy()
  update = np.asarray(params["embed_tokens"]["embedding"] - new_params["embed_tokens"]["embedding"])
  np.testing.assert_allclose(update, grad, atol=1e-6)
