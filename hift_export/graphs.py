"""The exported call signatures: thin ``nn.Module`` wrappers whose ``forward`` is exactly one graph.

Input/output names are defined here once; the exporter writes them into the manifest and the runtime reads them from
there. Caches travel as one flat list in the order of their layout (:mod:`hift_model.step`); in a graph each cache is
an input ``cache.NAME`` and an output ``next.NAME`` of the same shape.
"""

from __future__ import annotations

import torch
from torch import nn

from hift_model.config import HiFTConfig
from hift_model.f0_predictor import CausalF0Predictor
from hift_model.generator import CausalHiFTGenerator
from hift_model.step import f0_cache_layout, f0_step, generator_cache_layout, generator_step

GENERATOR_STEP_INPUTS = ("mel", "f0", "noise", "phase_in", "first")
GENERATOR_STEP_OUTPUTS = ("audio", "phase_out")
F0_STEP_INPUTS = ("mel",)
F0_STEP_OUTPUTS = ("f0",)


class GeneratorStepGraph(nn.Module):
    """``generator_step`` with the caches as a flat list; the final step returns no caches."""

    def __init__(self, generator: CausalHiFTGenerator, final: bool) -> None:
        super().__init__()
        if generator.spectral.mode != "conv":
            raise ValueError("export the generator with spectral='conv' (ONNX has no iSTFT; STFT has no CUDA kernel)")
        self.generator, self.final = generator, final
        self.names = [e["name"] for e in generator_cache_layout(generator.config)]

    def forward(self, mel: torch.Tensor, f0: torch.Tensor, noise: torch.Tensor, phase_in: torch.Tensor,
                first: torch.Tensor, caches: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        audio, phase_out, new = generator_step(self.generator, mel, f0, noise, phase_in, first,
                                               dict(zip(self.names, caches)), self.final)
        if self.final:
            return audio, phase_out
        return (audio, phase_out, *[new[n] for n in self.names])


class F0StepGraph(nn.Module):
    """``f0_step`` with the caches as a flat list: ``(mel, caches) -> (f0 float32, *next caches)``."""

    def __init__(self, predictor: CausalF0Predictor, config: HiFTConfig, dtype: str) -> None:
        super().__init__()
        self.predictor = predictor
        self.names = [e["name"] for e in f0_cache_layout(config, dtype)]

    def forward(self, mel: torch.Tensor, caches: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        f0, new = f0_step(self.predictor, mel, dict(zip(self.names, caches)))
        return (f0, *[new[n] for n in self.names])
