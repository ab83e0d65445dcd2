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


def log_spectral_distance_db(estimate: np.ndarray, reference: np.ndarray, n_fft: int = 1024, hop: int = 256) -> float:
    """Log-spectral distance in dB: per frame the RMS over bins of ``20 log10(|E| / |R|)`` (Hann STFT, magnitudes
    floored at 1e-5 of the reference's largest), averaged over frames. 0 for equal signals; a spectral view beside
    SNR (it weighs quiet bands as much as loud ones)."""
    if estimate.shape != reference.shape:
        raise ValueError(f"log_spectral_distance_db of arrays of different shapes {estimate.shape}, {reference.shape}")
    if reference.shape[0] < n_fft:
        return 0.0 if np.array_equal(estimate, reference) else float("nan")
    window = np.hanning(n_fft)

    def spectrum(x: np.ndarray) -> np.ndarray:
        frames = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), n_fft)[::hop]
        return np.abs(np.fft.rfft(frames * window, axis=1))

    e, r = spectrum(estimate), spectrum(reference)
    floor = max(float(r.max()), 1e-12) * 1e-5
    diff = 20 * np.log10(np.maximum(e, floor) / np.maximum(r, floor))
    return float(np.mean(np.sqrt(np.mean(diff ** 2, axis=1))))
