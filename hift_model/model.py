"""The vocoder as a pair of modules: build fresh instances, load a checkpoint strictly, fold, run.

``load_hift`` is the only way the toolchain obtains a model: a fresh generator and a fresh F0 predictor every time,
strict load of both halves before anything is folded, then the generator folded on its device and the F0 predictor
folded on the CPU in its own precision: ``f0_dtype`` (float32 unless asked; float64 is what upstream computes and
what the exported F0 graph computes by default, ``hift-export --f0-precision fp64``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint import CheckpointError, F0_PREFIX, load_strict, normalize_keys, read_checkpoint, split_f0
from .config import COSYVOICE3, DEFAULT_SEED, HiFTConfig
from .f0_predictor import CausalF0Predictor
from .folding import expected_weight_norms, fold_weight_norms
from .generator import CausalHiFTGenerator
from .layers import WeightNormAPI
from .spectral_ops import SpectralMode

CheckpointSource = str | os.PathLike[str] | Mapping[str, Any]


@dataclass(frozen=True)
class FoldReport:
    generator: int
    f0_predictor: int

    def __str__(self) -> str:
        return f"folded {self.generator} generator / {self.f0_predictor} F0 weight norms"


@dataclass
class HiFT:
    """A loaded vocoder: generator (on its device) and F0 predictor (on the CPU)."""

    generator: CausalHiFTGenerator
    f0_predictor: CausalF0Predictor
    config: HiFTConfig
    fold_report: FoldReport | None

    @property
    def device(self) -> torch.device:
        return self.generator.conv_post.bias.device

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """F0 in float32 on the generator's device; computed on the CPU in the predictor's precision."""
        f0 = self.f0_predictor(mel.detach().to("cpu"), finalize=finalize)
        return f0.to(device=self.device, dtype=torch.float32)

    def inference(self, mel: torch.Tensor, noise: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Upstream ``CausalHiFTGenerator.inference`` (one pass from frame 0) -> ``(audio, f0)``.

        ``noise`` is upstream's noise table from absolute sample 0: ``[N, 9]`` or ``[1, N, 9]``, N >= the samples.
        """
        f0 = self.predict_f0(mel, finalize)
        if not finalize:
            mel = mel[:, :, : -self.config.f0_look_ahead]
        samples = f0.shape[1] * self.config.samples_per_frame
        table = noise.reshape(-1, self.config.num_sines)
        if table.shape[0] < samples:
            raise ValueError(f"noise table has {table.shape[0]} rows, the pass needs {samples}")
        batch = mel.shape[0]
        noise_slice = table[:samples].to(self.device).unsqueeze(0).expand(batch, -1, -1)
        phase_in = torch.zeros(batch, self.config.num_sines, dtype=torch.float64, device=self.device)
        audio, _ = self.generator.decode(mel.to(self.device), f0, noise_slice, phase_in, finalize=finalize)
        return audio, f0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Upstream layout: generator keys plus the F0 predictor's under ``f0_predictor.``."""
        out = dict(self.generator.state_dict())
        out.update({F0_PREFIX + k: v for k, v in self.f0_predictor.state_dict().items()})
        return out


def build_unfolded(config: HiFTConfig = COSYVOICE3, weight_norm_api: WeightNormAPI = "parametrizations",
                   spectral: SpectralMode = "torch") -> tuple[CausalHiFTGenerator, CausalF0Predictor]:
    """Fresh, randomly initialised, weight-normed modules."""
    return CausalHiFTGenerator(config, weight_norm_api, spectral), CausalF0Predictor(config, weight_norm_api)


def random_state_dict(config: HiFTConfig = COSYVOICE3, seed: int = DEFAULT_SEED) -> dict[str, torch.Tensor]:
    """Seeded random weights in the upstream ``hift.pt`` layout (328 keys for CosyVoice3).

    The F0 head is rescaled so the predicted F0 has a median of 200 Hz on a synthetic mel (untrained weights
    otherwise give F0 below the 10 Hz voicing threshold everywhere, which silences the sine source).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generator, f0 = build_unfolded(config)
        mel = torch.randn(1, config.in_channels, 64) * 2.0 - 5.0
    with torch.no_grad():
        median = f0(mel, finalize=True).median().clamp_min(1e-6)
        f0.classifier.weight.mul_(200.0 / median)
        f0.classifier.bias.mul_(200.0 / median)
    out = dict(generator.state_dict())
    out.update({F0_PREFIX + k: v for k, v in f0.state_dict().items()})
    return {k: v.detach().clone() for k, v in out.items()}


def load_hift(checkpoint: CheckpointSource | None = None, *, config: HiFTConfig = COSYVOICE3,
              device: str | torch.device = "cpu", f0_dtype: torch.dtype = torch.float32,
              weight_norm_api: WeightNormAPI = "parametrizations", spectral: SpectralMode = "torch",
              fold: bool = True, seed: int = DEFAULT_SEED) -> HiFT:
    """Strict load into fresh instances, then (by default) fold: generator on ``device``, F0 on the CPU.

    ``checkpoint=None`` loads :func:`random_state_dict` (the embedded default).
    """
    if f0_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"f0_dtype must be torch.float32 or torch.float64, not {f0_dtype}")
    state = random_state_dict(config, seed) if checkpoint is None else read_checkpoint(checkpoint)
    gen_state, f0_state = split_f0(normalize_keys(state, weight_norm_api))
    generator, f0 = build_unfolded(config, weight_norm_api, spectral)
    f0 = f0.to(f0_dtype)  # upstream casts g and v to float64 and recomputes the weight from them
    load_strict(generator, gen_state, "generator")
    load_strict(f0, f0_state, "F0 predictor")
    report = None
    if fold:
        generator = generator.to(device)
        report = FoldReport(fold_weight_norms(generator), fold_weight_norms(f0))
        want = expected_weight_norms(config)
        if (report.generator, report.f0_predictor) != want:
            raise CheckpointError(
                f"{report}, expected {want[0]} / {want[1]} for this config: the modules were built from a config "
                f"that does not match the CosyVoice3 layout")
    else:
        generator = generator.to(device)
    # An inference model: every parameter frozen (inputs can still take gradients).
    return HiFT(generator.eval().requires_grad_(False), f0.eval().requires_grad_(False), config, report)
