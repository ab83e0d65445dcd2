"""STFT / iSTFT of the HiFT source and head, in two interchangeable forms.

* ``"torch"``: ``torch.stft`` / ``torch.istft`` exactly as upstream calls them (the faithful eager reference).
* ``"conv"``: the same transforms built from a strided Conv1d (windowed DFT rows) and a ConvTranspose1d (windowed
  inverse basis, overlap-add) divided by the squared-window envelope. Every op has an ONNX Runtime CUDA kernel; ONNX
  has no ISTFT and its STFT runs on the CPU only. The two forms agree to float rounding (~1e-7 relative).

Both use upstream's window: scipy's periodic Hann computed in float64 and cast to float32, which differs from
``torch.hann_window`` by 1 ulp in some entries.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SpectralMode = Literal["torch", "conv"]
SPECTRAL_MODES: tuple[str, ...] = ("torch", "conv")


def scipy_hann_window(n_fft: int) -> torch.Tensor:
    """``scipy.signal.get_window('hann', n_fft, fftbins=True).astype(np.float32)`` without scipy."""
    n = np.arange(n_fft, dtype=np.float64)
    return torch.from_numpy((0.5 - 0.5 * np.cos(2.0 * math.pi * n / n_fft)).astype(np.float32))


def reflect_pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Reflection padding of the last axis as Slice + Flip + Concat (portable to every ONNX backend)."""
    parts = []
    if left:
        parts.append(torch.flip(x[..., 1:left + 1], dims=[-1]))
    parts.append(x)
    if right:
        parts.append(torch.flip(x[..., -right - 1:-1], dims=[-1]))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else x


def _dft_basis(n_fft: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``2*pi*k*n/n_fft`` for the one-sided bins, float64 ``[bins, n_fft]``."""
    k = np.arange(n_fft // 2 + 1, dtype=np.float64)[:, None]
    n = np.arange(n_fft, dtype=np.float64)[None, :]
    angle = 2.0 * math.pi * k * n / n_fft
    return np.cos(angle), np.sin(angle)


def overlap_add(taps: torch.Tensor, hop: int) -> torch.Tensor:
    """Overlap-add of frames given tap by tap: ``taps [B, n, F]`` (tap ``i`` of frame ``t`` lands on sample
    ``hop*t + i``; ``n`` a multiple of ``hop``) -> ``[B, 1, hop*(F-1) + n]``, what ``conv_transpose1d`` with stride
    ``hop`` sums. Shifted adds of ``n/hop`` slices: elementwise, so a compiler fuses it (cuDNN ran the transposed
    convolution as a slow backward-data kernel of its own)."""
    per_frame, frames = taps.shape[1] // hop, taps.shape[2]
    parts = taps.reshape(-1, per_frame, hop, frames)  # tap j*hop + r of frame t: [B, j, r, t]
    out = F.pad(parts[:, 0], (0, per_frame - 1))
    for j in range(1, per_frame):
        out = out + F.pad(parts[:, j], (j, per_frame - 1 - j))  # [B, hop, F + per_frame - 1]
    return out.transpose(1, 2).reshape(-1, 1, hop * (frames + per_frame - 1))


class SpectralOps(nn.Module):
    """Forward STFT of the source (``[B, 1, L] -> [B, 2*bins, L/hop+1]``, real bins then imaginary bins) and the
    iSTFT head (magnitude, phase ``[B, bins, F] -> [B, hop*(F-1)]``), centred like ``torch.stft(center=True)``."""

    def __init__(self, n_fft: int, hop: int, mode: SpectralMode = "torch") -> None:
        super().__init__()
        if mode not in SPECTRAL_MODES:
            raise ValueError(f"unknown spectral mode {mode!r}; expected one of {SPECTRAL_MODES}")
        self.n_fft, self.hop, self.mode = n_fft, hop, mode
        window = scipy_hann_window(n_fft)
        w = window.double().numpy()
        cos, sin = _dft_basis(n_fft)
        # Forward rows: w[n]cos(wkn) (real) and -w[n]sin(wkn) (imag), as torch.stft's FFT computes them.
        stft_kernel = np.concatenate([cos * w, -sin * w], axis=0)[:, None, :]
        # Inverse rows: one-sided irfft weights (1 for DC and Nyquist, 2 otherwise, /n_fft) times the window.
        scale = np.full((n_fft // 2 + 1, 1), 2.0 / n_fft)
        scale[0] = scale[-1] = 1.0 / n_fft
        istft_kernel = np.concatenate([cos * scale * w, -sin * scale * w], axis=0)[:, None, :]
        # Constants, not parameters: they are derived, never loaded from a checkpoint (not in the state_dict).
        self.register_buffer("window", window, persistent=False)
        self.register_buffer("stft_kernel", torch.from_numpy(stft_kernel.astype(np.float32)), persistent=False)
        self.register_buffer("istft_kernel", torch.from_numpy(istft_kernel.astype(np.float32)), persistent=False)
        self.register_buffer("window_sq", (window.double() ** 2).float().view(1, 1, n_fft), persistent=False)
        # The same two kernels as per-tap weights of a 1x1 convolution (tap n of frame t lands on sample hop*t + n):
        # the stateful step's iSTFT as a forward convolution and an overlap-add (:func:`overlap_add`).
        self.register_buffer("istft_taps", self.istft_kernel[:, 0, :].t().contiguous()[:, :, None], persistent=False)
        self.register_buffer("window_sq_taps", self.window_sq.view(1, n_fft, 1), persistent=False)

    def stft(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, 1, L]`` -> ``[B, 2*bins, L//hop + 1]``."""
        if self.mode == "torch":
            spec = torch.stft(x.squeeze(1), self.n_fft, self.hop, self.n_fft, window=self.window, return_complex=True)
            spec = torch.view_as_real(spec)
            return torch.cat([spec[..., 0], spec[..., 1]], dim=1)
        half = self.n_fft // 2
        return F.conv1d(reflect_pad(x, half, half), self.stft_kernel, stride=self.hop)

    def istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """Upstream ``_istft``: clip the magnitude at 100, build ``mag*(cos p + i sin p)``, inverse, centre trim."""
        magnitude = torch.clip(magnitude, max=1e2)
        real = magnitude * torch.cos(phase)
        imag = magnitude * torch.sin(phase)
        if self.mode == "torch":
            return torch.istft(torch.complex(real, imag), self.n_fft, self.hop, self.n_fft, window=self.window)
        frames = torch.cat([real, imag], dim=1)
        y = F.conv_transpose1d(frames, self.istft_kernel, stride=self.hop)
        # Sum of squared windows under each sample (torch.istft's normalisation); only the edges differ from 1.5.
        envelope = F.conv_transpose1d(torch.ones_like(real[:1, :1, :]), self.window_sq, stride=self.hop)
        half = self.n_fft // 2
        return y[:, 0, half:-half] / envelope[0, 0, half:-half]
