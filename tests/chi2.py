"""Pearson chi-square goodness of fit of draw counts against a distribution, at p = 1e-4."""

import math

import numpy as np


def critical(df, z=3.719):
  """Wilson-Hilferty chi-square quantile; z = 3.719 is the normal quantile of p = 1e-4."""
  a = 2.0 / (9.0 * df)
  return df * (1.0 - a + z * math.sqrt(a)) ** 3


def rejects(counts, probs):
  """True if `counts` (draws per outcome) do not fit `probs`: any draw of a probability-0 outcome,
  or the statistic over bins with expectation >= 5 (the rest merged into one) above critical."""
  n = counts.sum()
  expected = probs * n
  if (counts[probs == 0] > 0).any():
    return True
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  if len(obs) < 2:  # one outcome: nothing left to test
    return False
  stat = ((obs - exp) ** 2 / exp).sum()
  return stat > critical(len(obs) - 1)
