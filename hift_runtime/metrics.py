"""The two figures every comparison in this project reports: largest absolute difference and SNR (NumPy only)."""

from __future__ import annotations

import numpy as np


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference of two arrays of the same shape (a shape mismatch is an error, never broadcast)."""
    if a.shape != b.shape:
        raise ValueError(f"max_abs of arrays of different shapes {a.shape} and {b.shape}")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def snr_db(estimate: np.ndarray, reference: np.ndarray) -> float:
    """``10 log10(|reference|^2 / |estimate - reference|^2)``; +inf when they are equal."""
    ref = reference.astype(np.float64)
    err = estimate.astype(np.float64) - ref
    signal = float(np.sum(ref ** 2))
    if signal == 0.0:
        return float("inf") if not np.any(err) else float("-inf")
    return float(10 * np.log10(signal / max(float(np.sum(err ** 2)), 1e-300)))
