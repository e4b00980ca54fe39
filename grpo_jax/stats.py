"""Statistics for sweep reports: intervals over seeds, binomial intervals, paired differences,
and the number of seeds an effect needs. NumPy, scipy's t distribution and the standard library.

    mean_ci([30.0, 34.0, 41.0])                  # (lo, hi): 95% Student-t interval of the mean
    wilson_ci(k=203, n=512)                      # (lo, hi): 95% Wilson interval of 203/512
    paired([55.0, 60.0], [50.0, 57.0])           # the per-seed differences and their interval
    seeds_needed(effect=5.0, std=7.0, paired=False)   # seeds per setting for 80% power

Choices, each the usual one for its question:
  * Mean over seeds: Student's t interval, mean ± t(1 − α/2, n − 1) · s / √n with s the sample
    std (ddof 1). Its coverage holds at the 2-10 seeds a sweep runs (for roughly normal seed
    outcomes), where every bootstrap interval of a mean is far too narrow: it can only resample
    the values the seeds showed (at 2 seeds the BCa interval is at most [min, max], which covers
    the mean half the time; at 3 about 65%, at 5 about 85%). `mean_ci(method='bca')` gives the
    BCa bootstrap (bias-corrected and accelerated; Efron 1987) for many seeds and skewed
    outcomes: 10,000 resamples from a fixed NumPy seed, so it is reproducible to the digit.
  * One run's accuracy: the Wilson score interval of k successes in n eval problems; unlike the
    Wald interval p ± z·sqrt(p(1-p)/n) it stays inside [0, 1] and covers near 0 and 1.
  * Seeds needed: the normal approximation of a two-sided test at level alpha with the given
    power, with Guenther's (1981) correction that makes it match the t-test's sample size to
    within a seed:  paired  n = ((z_a + z_b) σ_d / δ)^2 + z_a^2 / 2,
                    two-sample, per setting  n = 2 ((z_a + z_b) σ / δ)^2 + z_a^2 / 4,
    z_a = Φ^-1(1 - alpha/2), z_b = Φ^-1(power), rounded up, at least 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95
METHODS = ("t", "bca", "percentile")  # mean_ci's intervals of a mean over seeds
RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
POWER = 0.8
_N = NormalDist()


def finite(values: Sequence[float | None]) -> np.ndarray:
  """The finite values as float64, in order (None, NaN and inf dropped)."""
  return np.array([float(x) for x in values if x is not None and math.isfinite(float(x))],
                  dtype=np.float64)


def _sample(values: Sequence[float], confidence: float) -> np.ndarray | None:
  """The finite values (float64) an interval is computed from; None for fewer than two."""
  if not 0 < confidence < 1:
    raise ValueError(f"confidence {confidence!r} must be in (0, 1)")
  x = finite(values)
  return x if len(x) >= 2 else None


def _resample_means(x: np.ndarray, resamples: int, seed: int) -> np.ndarray:
  """Means of `resamples` bootstrap resamples of x (rows drawn with replacement)."""
  idx = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
  return x[idx].mean(axis=1)


def bootstrap_mean_ci(values: Sequence[float], confidence: float = CONFIDENCE,
                      resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED,
                      method: str = "bca") -> tuple[float, float]:
  """The bootstrap interval of the mean of the finite values: method 'bca' or 'percentile'.

  (nan, nan) for fewer than two values; (m, m) when all values are equal (nothing varies)."""
  if method not in ("bca", "percentile"):
    raise ValueError(f"bootstrap method {method!r}: use 'bca' or 'percentile'")
  x = _sample(values, confidence)
  if x is None:
    return math.nan, math.nan
  n, mean = len(x), float(x.mean())
  if np.all(x == x[0]):
    return mean, mean
  means = _resample_means(x, resamples, seed)
  alpha = (1 - confidence) / 2
  if method == "percentile":
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)
  # Bias correction: how far the bootstrap distribution's median sits from the estimate, with
  # resample means equal to it counted half below (as scipy does). With few seeds many
  # resamples are a permutation of the sample, whose mean differs from the sample's only by
  # rounding; counted as above, they pulled the interval down (2 seeds: [min, mean]).
  tie = np.isclose(means, mean, rtol=1e-12, atol=0.0)
  below = float(np.mean((means < mean) & ~tie) + 0.5 * np.mean(tie))
  if below in (0.0, 1.0):
    return float(means.min()), float(means.max())
  z0 = _N.inv_cdf(below)
  # Acceleration from the jackknife: the skew of the leave-one-out means.
  jack = (x.sum() - x) / (n - 1)
  d = jack.mean() - jack
  a = float((d ** 3).sum() / (6 * (d ** 2).sum() ** 1.5))
  levels = []
  for z in (_N.inv_cdf(alpha), _N.inv_cdf(1 - alpha)):
    levels.append(_N.cdf(z0 + (z0 + z) / (1 - a * (z0 + z))))
  lo, hi = np.quantile(means, levels)
  return float(lo), float(hi)


def t_mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
  """Student's t interval of the mean of the finite values: mean ± t(1 − α/2, n − 1) · s / √n.

  (nan, nan) for fewer than two values; (m, m) when all values are equal."""
  x = _sample(values, confidence)
  if x is None:
    return math.nan, math.nan
  n, mean = len(x), float(x.mean())
  half = float(scipy_stats.t.ppf(1 - (1 - confidence) / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
  return mean - half, mean + half


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE,
            method: str = "t") -> tuple[float, float]:
  """The interval of the mean over seeds that reports use: method 't' (default), 'bca' or
  'percentile' (the bootstraps, RESAMPLES resamples from BOOTSTRAP_SEED)."""
  if method not in METHODS:
    raise ValueError(f"interval method {method!r}: use one of {METHODS}")
  if method == "t":
    return t_mean_ci(values, confidence)
  return bootstrap_mean_ci(values, confidence, method=method)


def wilson_ci(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
  """The Wilson score interval of a proportion k / n, as fractions in [0, 1]."""
  if n <= 0 or not 0 <= k <= n:
    raise ValueError(f"wilson_ci: need 0 <= k <= n and n > 0, got k={k}, n={n}")
  z = _N.inv_cdf(1 - (1 - confidence) / 2)
  p = k / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
  # At k = 0 (k = n) the bound is exactly 0 (1); the formula leaves a rounding error there.
  return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def seeds_needed(effect: float, std: float, paired: bool, alpha: float = 1 - CONFIDENCE,
                 power: float = POWER) -> int | None:
  """Seeds (per setting) for a two-sided test at `alpha` to detect a true difference of
  `effect` with probability `power`, when seeds spread by `std` (paired: the std of the
  per-seed differences; two-sample: each setting's std). None when std is unknown or 0."""
  if not effect > 0:
    raise ValueError(f"effect {effect!r} must be > 0")
  if not 0 < power < 1:
    raise ValueError(f"power {power!r} must be in (0, 1)")
  if not math.isfinite(std) or std <= 0:
    return None
  za, zb = _N.inv_cdf(1 - alpha / 2), _N.inv_cdf(power)
  if paired:
    n = ((za + zb) * std / effect) ** 2 + za * za / 2
  else:
    n = 2 * ((za + zb) * std / effect) ** 2 + za * za / 4
  return max(2, math.ceil(n - 1e-9))


@dataclasses.dataclass
class Paired:
  """B − A over the seeds both settings finished."""
  seeds: list                 # the matched seeds, in order
  diffs: np.ndarray           # b[seed] - a[seed]
  mean: float
  std: float                  # sample std (ddof 1) of the differences; nan for one seed
  ci: tuple[float, float]     # interval of the mean difference (mean_ci: Student's t)

  @property
  def excludes_zero(self) -> bool | None:
    lo, hi = self.ci
    if math.isnan(lo):
      return None
    return lo > 0 or hi < 0


def paired(a: dict, b: dict, **ci_kw) -> Paired:
  """The paired difference b − a over the keys (seeds) whose values are finite in both;
  ci_kw go to mean_ci (confidence, method)."""
  seeds = [s for s in a if s in b and all(
      v is not None and math.isfinite(v) for v in (a[s], b[s]))]
  diffs = np.array([b[s] - a[s] for s in seeds], dtype=np.float64)
  n = len(diffs)
  mean = float(diffs.mean()) if n else math.nan
  std = float(diffs.std(ddof=1)) if n > 1 else math.nan
  return Paired(seeds, diffs, mean, std, mean_ci(diffs, **ci_kw))
