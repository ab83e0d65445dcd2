"""The exported call signatures: thin ``nn.Module`` wrappers whose ``forward`` is exactly one graph.

Input/output names are defined here once; the exporter writes them into the manifest and the runtime reads them
from there.
"""

from __future__ import annotations

import torch
from torch import nn

from .f0_predictor import CausalF0Predictor
from .generator import CausalHiFTGenerator

GENERATOR_INPUTS = ("mel", "f0", "noise", "phase_in")
GENERATOR_OUTPUTS = ("audio", "phase_out")
F0_INPUTS = ("mel",)
F0_OUTPUTS = ("f0",)


class GeneratorGraph(nn.Module):
    """``(mel [B,80,N], f0 [B,N], noise [B,480N,9], phase_in [B,9] f64) -> (audio, phase_out [B,N,9] f64)``.

    ``finalize=False`` (stream): the last 4 frames are ``conv_pre`` look-ahead, audio is ``480(N-5)`` samples.
    ``finalize=True`` (final): zero look-ahead, audio is ``480N`` samples.
    """

    def __init__(self, generator: CausalHiFTGenerator, finalize: bool) -> None:
        super().__init__()
        if generator.spectral.mode != "conv":
            raise ValueError("export the generator with spectral='conv' (ONNX has no iSTFT; STFT has no CUDA kernel)")
        self.generator = generator
        self.finalize = finalize

    def forward(self, mel: torch.Tensor, f0: torch.Tensor, noise: torch.Tensor,
                phase_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.generator.decode(mel, f0, noise, phase_in, finalize=self.finalize)


class F0Graph(nn.Module):
    """``mel [B,80,T] -> f0 [B,T-3]`` float32 (streaming form; the final form is this on mel + 3 zero frames)."""

    def __init__(self, f0_predictor: CausalF0Predictor) -> None:
        super().__init__()
        self.f0_predictor = f0_predictor

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.f0_predictor(mel, finalize=False).to(torch.float32)
