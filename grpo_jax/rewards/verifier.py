"""`verifier` (GenRM): a judge model's probability that the response is correct.

Range: [0, 1]. The judge sees the question and the response, is asked "Is the answer correct
(Yes/No)?" (the `template`, wrapped in its chat template with the assistant turn opened), and
the reward is read from its next-token distribution in one batched forward, no generation:
  raw:          P(Yes)                         = softmax(logits)[yes]
  renormalize:  P(Yes) / (P(Yes) + P(No))      = sigmoid(logit_yes - logit_no)
The softmax is over the model's full vocabulary, as transformers computes it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from grpo_jax.rewards import frozen_model, text
from grpo_jax.rewards.model_options import VerifierOptions


class VerifierReward:
  def __init__(self, opts: VerifierOptions):
    self.opts = opts
    self.model = frozen_model.FrozenModel.from_options(opts, "rewards.verifier.checkpoint")
    self.yes_id = self.model.single_token_id(opts.yes_token, "rewards.verifier.yes_token")
    self.no_id = self.model.single_token_id(opts.no_token, "rewards.verifier.no_token")
    self._template_kwargs = json.loads(opts.chat_template_kwargs_json) if opts.chat_template_kwargs_json else {}
    self.last_metrics: dict[str, float] = {}
    self.source = f"judge checkpoint {opts.checkpoint}"  # named in messages (health.py)

  def prompt_ids(self, question: str, response: str) -> list[int]:
    """The judge's input tokens for one pair, cut in the middle to max_tokens."""
    content = self.opts.template.format(question=question, response=response)
    tok = self.model.tokenizer
    if self.opts.use_chat_template:
      prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True, **self._template_kwargs)
    else:
      prompt = content
    # Cap characters first so tokenising megabytes of model output stays cheap.
    prompt = text.middle_truncate(prompt, 16 * self.opts.max_tokens)
    return frozen_model.middle_cut(tok(prompt, add_special_tokens=False).input_ids, self.opts.max_tokens)

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float | None]:
    completions = text.clean_all(completions, field="completions")
    col = self.opts.question_column
    if col:
      if col not in columns:
        raise ValueError(f"rewards.verifier.question_column={col!r} is not among the dataset columns "
                         f"{sorted(k for k in columns if k != 'group_size')}")
      questions = text.clean_all(columns[col], field=col)
    else:
      questions = text.clean_all(prompts, field="prompts")
    if len(questions) != len(completions):
      raise ValueError(f"verifier: {len(questions)} questions but {len(completions)} completions")
    ids = [self.prompt_ids(q, c) for q, c in zip(questions, completions)]
    logp_N2 = self.model.next_token_logprobs(ids, [self.yes_id, self.no_id]).astype(np.float64)
    if self.opts.renormalize:
      p = 1.0 / (1.0 + np.exp(logp_N2[:, 1] - logp_N2[:, 0]))
    else:
      p = np.exp(logp_N2[:, 0])
    self.last_metrics = {"p_yes_no_mass": float(np.exp(logp_N2).sum(1).mean()) if len(ids) else 0.0}
    return [float(v) for v in p]
