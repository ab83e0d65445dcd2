"""Eager PyTorch as a :class:`hift_runtime.streaming.VocoderBackend`: the reference the ORT runtime is checked
against, driven by the very same streaming bookkeeping."""

from __future__ import annotations

import numpy as np
import torch

from hift_runtime.noise import NoiseTable
from hift_runtime.streaming import StreamConstants, StreamingVocoder

from .model import HiFT


class TorchBackend:
    """Folded eager modules. F0 on the CPU in the predictor's precision, the generator on its device."""

    def __init__(self, hift: HiFT) -> None:
        self.hift = hift
        self.name = f"torch[{hift.device.type}]"

    @torch.inference_mode()
    def predict_f0(self, mel: np.ndarray) -> np.ndarray:
        f0 = self.hift.f0_predictor(torch.from_numpy(mel), finalize=False)
        return f0.to(torch.float32).numpy()

    @torch.inference_mode()
    def generate(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                 finalize: bool) -> tuple[np.ndarray, np.ndarray]:
        dev = self.hift.device
        audio, phase = self.hift.generator.decode(
            torch.from_numpy(mel).to(dev), torch.from_numpy(f0).to(dev), torch.from_numpy(noise).to(dev),
            torch.from_numpy(phase_in).to(dev), finalize=finalize)
        return audio.cpu().numpy(), phase.cpu().numpy()


def torch_vocoder(hift: HiFT, noise: NoiseTable | None = None, noise_seed: int = 0,
                  window_frames: int | None = None, phase: str = "upstream") -> StreamingVocoder:
    """A :class:`StreamingVocoder` over eager PyTorch, constants from the model's config (same code path)."""
    return StreamingVocoder(TorchBackend(hift), StreamConstants.from_config(hift.config.to_dict(), window_frames),
                            noise=noise, noise_seed=noise_seed, phase=phase)
