"""Writes examples/demo_mel.npy: a deterministic synthetic natural-log mel ([80, 250] float32, 5 s at 50 frames/s)
with formant-like bands, a pitch-like ripple and two pauses. It exists so the main command runs with no inputs."""

from pathlib import Path

import numpy as np


def demo_mel(frames: int = 250, bins: int = 80) -> np.ndarray:
    t = np.arange(frames)[None, :] / 50.0
    f = np.arange(bins)[:, None]
    envelope = -6.5 + 3.0 * np.exp(-((f - 12 - 4 * np.sin(2 * np.pi * 0.7 * t)) / 6.0) ** 2)
    envelope += 2.0 * np.exp(-((f - 35 - 6 * np.sin(2 * np.pi * 0.4 * t)) / 8.0) ** 2)
    envelope += 0.4 * np.cos(2 * np.pi * f / (6 + 2 * np.sin(2 * np.pi * 0.3 * t)))
    speech = ((t % 1.7) < 1.3).astype(np.float64)  # pauses
    mel = np.where(speech > 0, envelope, -11.0 + 0.3 * np.cos(f / 7.0))
    return mel.astype(np.float32)


if __name__ == "__main__":
    out = Path(__file__).with_name("demo_mel.npy")
    np.save(out, demo_mel())
    print(f"wrote {out}")
