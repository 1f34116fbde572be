"""Bootstrap statistics over problems: resampled means, percentile intervals, paired differences.

Pure numpy. Every report that compares methods on the same problems (Best-of-N, search, the demo)
draws its resamples here, so that their intervals are paired.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def resample_means(values: np.ndarray, n_resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """Bootstrap means over problems: (B,) for a (P,) array, (B, K) for K rows of a (K, P) array.

    Resample b draws P problem indices (`default_rng(seed).integers(0, P, size=(B, P))`, row b),
    the same draws for every call with the same (P, B, seed): intervals of methods on the same
    problems are paired. Drawn 64 resamples at a time as per-problem counts, so memory is
    O(64 x P) whatever B and K (the dense (B, P) matrix is 800 MB at 100k problems).
    """
    v = np.asarray(values, dtype=float)
    rows = v[None, :] if v.ndim == 1 else v
    p = rows.shape[1]
    rng = np.random.default_rng(seed)
    out = np.empty((n_resamples, rows.shape[0]))
    for lo in range(0, n_resamples, 64):
        b = min(64, n_resamples - lo)
        idx = rng.integers(0, p, size=(b, p))
        counts = np.bincount((np.arange(b)[:, None] * p + idx).ravel(), minlength=b * p).reshape(b, p)
        out[lo : lo + b] = counts @ rows.T / p
    return out[:, 0] if v.ndim == 1 else out


def percentile_interval(boot: np.ndarray) -> list[float]:
    """The 95% percentile interval [2.5th, 97.5th] of bootstrap draws."""
    lo, hi = np.percentile(boot, [2.5, 97.5], axis=0)
    return [float(lo), float(hi)]


def paired_bootstrap(acc_a: np.ndarray, acc_b: np.ndarray, n_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Mean per-problem difference a - b with a 95% percentile bootstrap CI over problems.

    Args:
        acc_a, acc_b: (P,) per-problem accuracies of two methods on the same problems.

    Returns:
        {"diff": float, "ci95": [lo, hi]}; a CI above zero means a beats b.
    """
    a, b = np.asarray(acc_a, dtype=float), np.asarray(acc_b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_bootstrap: need two equal-length 1-D arrays, got {a.shape} and {b.shape}")
    d = a - b
    boot = resample_means(d, n_resamples, seed)  # (B,)
    return {"diff": float(d.mean()), "ci95": percentile_interval(boot)}


def bootstrap_mean(acc: Sequence[float], n_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Mean of per-problem values with a 95% percentile bootstrap interval over problems.

    The resamples depend only on (number of problems, n_resamples, seed), so intervals of methods
    on the same problems use the same resamples. `bootstrap_mean([1, 1, 0, 0])["mean"] == 0.5`.
    """
    a = np.asarray(acc, dtype=float)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"bootstrap_mean: need a non-empty 1-D array, got shape {a.shape}")
    lo, hi = np.percentile(resample_means(a, n_resamples, seed), [2.5, 97.5])
    return {"mean": float(a.mean()), "ci95": [float(lo), float(hi)]}
