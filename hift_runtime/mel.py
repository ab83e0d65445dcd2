"""The mel spectrogram CosyVoice3 feeds HiFT, from speech audio: copy synthesis (WAV -> mel -> vocoder -> WAV) for
checking a real ``hift.pt`` by ear or against the original.

Matcha-TTS ``mel_spectrogram`` with CosyVoice3's feature-extractor settings (``cosyvoice3.yaml``): 24 kHz, n_fft =
win = 1920, hop 480, 80 mel bins, fmin 0, fmax None (Nyquist), reflect padding of (n_fft - hop) / 2 = 720 samples on
each side then ``center=False``, periodic Hann window, magnitude ``sqrt(|S|^2 + 1e-9)``, Slaney mel filters as librosa
builds them (``htk=False``, ``norm='slaney'``), natural log of ``clamp(., min=1e-5)``. NumPy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MelSettings:
    sample_rate: int = 24000
    n_fft: int = 1920
    hop: int = 480
    win: int = 1920
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = None


COSYVOICE3_MEL = MelSettings()


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    hz = np.asarray(hz, np.float64)
    f_sp, min_log_hz, min_log_mel, logstep = 200.0 / 3, 1000.0, 15.0, np.log(6.4) / 27.0
    return np.where(hz >= min_log_hz, min_log_mel + np.log(np.maximum(hz, 1e-10) / min_log_hz) / logstep, hz / f_sp)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz, min_log_mel, logstep = 200.0 / 3, 1000.0, 15.0, np.log(6.4) / 27.0
    return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), f_sp * mel)


def slaney_mel_filters(s: MelSettings = COSYVOICE3_MEL) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` float32 triangular filters with Slaney area normalisation (librosa's default)."""
    fmax = s.sample_rate / 2 if s.fmax is None else s.fmax
    fft_freqs = np.linspace(0, s.sample_rate / 2, 1 + s.n_fft // 2)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(s.fmin), _hz_to_mel(fmax), s.n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return weights.astype(np.float32)


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """High-quality resampling (libsoxr) to ``target`` Hz; a no-op at that rate."""
    if rate == target:
        return np.asarray(audio, np.float32)
    import soxr

    return soxr.resample(np.asarray(audio, np.float32), rate, target, quality="HQ").astype(np.float32)


def mel_spectrogram(audio: np.ndarray, s: MelSettings = COSYVOICE3_MEL) -> np.ndarray:
    """Mono audio at ``s.sample_rate`` -> natural-log mel ``[n_mels, frames]`` float32 (480 samples per frame)."""
    y = np.asarray(audio, np.float32).reshape(-1)
    pad = (s.n_fft - s.hop) // 2
    if y.shape[0] <= pad:
        raise ValueError(f"audio of {y.shape[0]} samples is too short for a mel frame (needs > {pad})")
    y = np.pad(y, (pad, pad), mode="reflect")
    frames = 1 + (y.shape[0] - s.n_fft) // s.hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(s.win) / s.win)  # periodic Hann, float64
    if s.win < s.n_fft:  # torch.stft centres a shorter window inside n_fft
        left = (s.n_fft - s.win) // 2
        window = np.pad(window, (left, s.n_fft - s.win - left))
    index = np.arange(s.n_fft)[None, :] + s.hop * np.arange(frames)[:, None]
    spectrum = np.fft.rfft(y[index].astype(np.float64) * window, axis=1)  # [frames, bins], float64
    magnitude = np.sqrt(spectrum.real ** 2 + spectrum.imag ** 2 + 1e-9)
    # Window, FFT and filter sums in float64 (upstream's float32 ones add ~1e-7 of each frame's peak, which the log
    # turns into up to 4e-4 in the quietest bins); the filters are float32, as librosa returns them.
    mel = slaney_mel_filters(s).astype(np.float64) @ magnitude.T
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)
