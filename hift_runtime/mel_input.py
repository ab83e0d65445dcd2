"""A mel chunk as the vocoder takes it: ``[C, T]`` (or ``[1, C, T]``) finite real floats, converted to float32."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import MelError, MelTypeError

# Outside this range the input is almost certainly not upstream's natural-log mel (log(clamp(., 1e-5)) >= -11.5).
LOG_MEL_RANGE = (-30.0, 15.0)


def validate_mel(mel: Any, channels: int, whole: str | None = None) -> np.ndarray:
    """``[C, T]`` or ``[1, C, T]`` real floats -> contiguous float32 ``[C, T]``; raise :class:`MelError` otherwise.

    float64/float16 input is converted to float32 (what the graphs compute in); integer, bool and complex arrays
    are refused (a mel is never integer; an integer array is almost certainly the wrong input). ``whole``: the name of
    a whole mel (a file) the errors speak of, instead of a stream's chunk.
    """
    return validate_mel_range(mel, channels, whole)[0]


def validate_mel_range(mel: Any, channels: int, whole: str | None = None) -> tuple[np.ndarray, float, float]:
    """:func:`validate_mel`, and the chunk's smallest and largest value (0, 0 when empty)."""
    if not isinstance(mel, np.ndarray):
        try:
            mel = np.asarray(mel)
        except Exception as exc:  # noqa: BLE001 - anything that is not array-like
            raise MelError(f"mel must be a NumPy array, got {type(mel).__name__}") from exc
    if mel.ndim == 3:
        if mel.shape[0] != 1:
            raise MelError(f"mel has batch size {mel.shape[0]}; a stream takes one utterance: [{channels}, T] or "
                           f"[1, {channels}, T]")
        mel = mel[0]
    if mel.ndim != 2:
        raise MelError(f"mel must be [{channels}, T] or [1, {channels}, T], got shape {tuple(mel.shape)}")
    if mel.shape[0] != channels:
        hint = " (is it [T, C]? transpose it)" if mel.shape[1] == channels else ""
        raise MelError(f"mel has {mel.shape[0]} channels, the vocoder expects {channels} mel bins{hint}")
    if mel.dtype != np.float32 and not np.issubdtype(mel.dtype, np.floating):  # float32 first: the common case
        raise MelTypeError(f"mel has dtype {mel.dtype}; expected float32 (float64/float16 are converted)")
    mel = np.ascontiguousarray(mel, dtype=np.float32)
    if mel.size == 0:
        return mel, 0.0, 0.0
    # min and max carry any NaN or Inf (two reductions, also what the range warning needs, instead of isfinite's
    # array and its all(): the per-push cost counts at thousands of pushes a second).
    lo, hi = float(mel.min()), float(mel.max())
    if not math.isfinite(lo + hi):
        bad = np.argwhere(~np.isfinite(mel))
        where = f"of {whole}" if whole else "of this chunk; the stream is unchanged"
        raise MelError(f"mel has {bad.shape[0]} non-finite values (NaN/Inf), first at bin {bad[0][0]}, frame "
                       f"{bad[0][1]} {where}")
    return mel, lo, hi
