"""Completion lengths as a real GSM8K run sees them, for the decode benchmarks and their tests.

    lengths = realistic_lengths(128, max_new_tokens=1024)   # [128] ints in [1, 1024]

A long tail: log-normal with a median of `median` tokens and `at_budget` of the rows reaching
max_new_tokens (instruct models answer in a few hundred tokens; a few ramble to the budget).
The rows take the distribution's quantiles at (i + 0.5) / n, so every draw of n rows has the
same lengths and exactly round(at_budget * n) rows at the budget; `seed` shuffles which row
gets which. The sampler is handed them as row_budgets: each row decodes exactly its length.
"""
from __future__ import annotations

import math
import statistics

import numpy as np


def realistic_lengths(n: int, max_new_tokens: int = 1024, median: float = 250.0,
                      at_budget: float = 0.05, seed: int = 0) -> np.ndarray:
  # sigma puts the (1 - at_budget) quantile at max_new_tokens.
  z = statistics.NormalDist().inv_cdf(1.0 - at_budget)
  sigma = math.log(max_new_tokens / median) / z
  q = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
  out = np.array([median * math.exp(sigma * x) for x in q])
  out = np.clip(np.round(out), 1, max_new_tokens).astype(np.int64)
  return np.random.default_rng(seed).permutation(out)


def wasted(lengths, row_steps: int) -> float:
  """The share of the decode's row-steps spent on rows already finished."""
  return 1.0 - float(np.sum(lengths)) / row_steps
