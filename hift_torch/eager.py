"""Eager PyTorch as a :class:`hift_runtime.engine.VocoderBackend`: the reference the ORT runtime is checked
against, driven by the very same streaming bookkeeping and the very same step (:mod:`hift_model.step`)."""

from __future__ import annotations

import numpy as np
import torch

from hift_model.model import HiFT
from hift_model.step import dtype_name, f0_step, generator_step, step_contract, zero_caches
from hift_runtime.contract import StreamConstants
from hift_runtime.engine import EngineTraits
from hift_runtime.noise import NoiseTable
from hift_runtime.streaming import StreamingVocoder


class TorchBackend:
    """Folded eager modules. F0 on the CPU in the predictor's precision, the generator on its device; caches stay
    there as tensors."""

    traits = EngineTraits()

    def __init__(self, hift: HiFT) -> None:
        if hift.generator.spectral.mode != "conv":
            raise ValueError("the step needs the generator built with spectral='conv' (load_hift(..., spectral='conv'))")
        self.hift = hift
        self.name = f"torch[{hift.device.type}]"
        self.contract = step_contract(hift.config, dtype_name(hift.f0_predictor.classifier.weight.dtype))

    def new_caches(self, kind: str, batch: int = 1) -> dict[str, torch.Tensor]:
        if kind == "generator":
            return zero_caches(self.contract["generator_caches"], batch, self.hift.device)
        return zero_caches(self.contract["f0_caches"], batch)

    @torch.inference_mode()
    def f0_step(self, mel: np.ndarray, caches: dict[str, torch.Tensor]) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        f0, nxt = f0_step(self.hift.f0_predictor, torch.from_numpy(mel), _tensors(caches, torch.device("cpu")))
        return f0.numpy(), nxt

    @torch.inference_mode()
    def generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                       first: np.ndarray, caches: dict[str, torch.Tensor],
                       final: bool) -> tuple[np.ndarray, np.ndarray, dict[str, torch.Tensor]]:
        dev = self.hift.device
        audio, phase, nxt = generator_step(
            self.hift.generator, torch.from_numpy(mel).to(dev), torch.from_numpy(f0).to(dev),
            torch.from_numpy(noise).to(dev), torch.from_numpy(phase_in).to(dev), torch.from_numpy(first).to(dev),
            _tensors(caches, dev), final)
        return audio.cpu().numpy(), phase.cpu().numpy(), nxt

    def warmup(self, step_sizes: tuple[int, ...] | None, progress: object = None) -> None:
        """Nothing to prepare: eager."""

    def stream_capacity(self) -> int:
        return 1 << 20  # host memory only: no device slots


def _tensors(caches: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """Caches as tensors on ``device`` (another backend's NumPy caches are accepted: the parity replay uses that)."""
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)).to(device)
            for k, v in caches.items()}


def torch_vocoder(hift: HiFT, noise: NoiseTable | None = None, noise_seed: int = 0, phase: str = "upstream",
                  step_sizes: tuple[int, ...] | None = None) -> StreamingVocoder:
    """A :class:`StreamingVocoder` over eager PyTorch, constants from the model's config (same code path)."""
    backend = TorchBackend(hift)
    return StreamingVocoder(backend, StreamConstants.from_manifest(hift.config.to_dict(), backend.contract),
                            noise=noise, noise_seed=noise_seed, phase=phase, step_sizes=step_sizes)
