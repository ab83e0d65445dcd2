"""The neural-source-filter excitation (upstream ``SineGen2(causal=True)`` + ``SourceModuleHnNSF``) with explicit state.

Upstream draws a fixed uniform noise table at construction (not in ``hift.pt``) and integrates the phase from
sample 0 of every call. Here randomness and phase are inputs, so a streaming step reproduces one offline pass:
``noise`` is the slice of the table for the samples being generated, and ``phase_in`` is the carried cumulative
phase (per harmonic, in turns, float64) at the frame before the first frame. Carried unwrapped, a step reproduces
upstream's float32 rounding of the running sum exactly; wrapped into [0, 1) (``sin(2*pi*480*x)`` has period 1/480,
so dropping whole turns is exact in real arithmetic), it is more accurate than upstream on long utterances.

What upstream computes, restated at frame rate (spec §3.2): the 1/480 linear down-sampling reads two samples of the
same frame with weight 0.5 each, and the phase is nearest-upsampled, so the sine of harmonic h is constant over a
frame: ``sin(480 * float32(2*pi*cumsum_j(rad)))`` with ``rad = (f0*h/sr) % 1``. ``rand_ini`` is dropped: it is added
to sample 0 only, which the down-sampling never reads, so it has no effect upstream either.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import HiFTConfig
from .layers import nearest_upsample


class HarmonicSource(nn.Module):
    """Sine + noise excitation merged to one channel by ``tanh(Linear(9 -> 1))``.

    ``forward(f0 [B,T], noise [B, T*spf, 9], phase_in [B, 9] float64)`` returns ``source [B, 1, T*spf]`` and the
    cumulative phase per frame ``[B, T, 9]`` in float64, in turns (what a caller carries into the next step).
    """

    def __init__(self, config: HiFTConfig) -> None:
        super().__init__()
        self.sampling_rate = config.sampling_rate
        self.samples_per_frame = config.samples_per_frame
        self.sine_amp = config.nsf_alpha
        self.noise_std = config.nsf_sigma
        self.voiced_threshold = config.nsf_voiced_threshold
        self.l_linear = nn.Linear(config.num_sines, 1)
        self.register_buffer("harmonics", torch.arange(1, config.num_sines + 1, dtype=torch.float32), persistent=False)
        # A tensor, not a Python number: eager CUDA divides by a number as a multiply by its rounded reciprocal, which
        # moves ``rad`` by an ulp now and then and the phase sum with it (BENCHMARKS.md); a tensor divides exactly.
        self.register_buffer("rate", torch.tensor([float(config.sampling_rate)]), persistent=False)

    def forward(self, f0: torch.Tensor, noise: torch.Tensor, phase_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rad = f0.unsqueeze(-1) * self.harmonics / self.rate  # [B, T, 9]
        rad = rad - torch.floor(rad)  # torch.remainder(rad, 1), exact for rad >= 0 (F0 is |.|)
        # Upstream's CPU cumsum accumulates in float64 and rounds each prefix to float32. Doing the same explicitly
        # keeps exported graphs exact: a float32 CumSum (ONNX Runtime) drifts by ulps of ~56, which 2*pi*480 amplifies.
        # The carried phase enters as the first term of the same sequential float64 sum, so a step that starts
        # from the carried (unwrapped) sum adds in exactly the order of one pass from frame 0.
        terms = torch.cat([phase_in.to(torch.float64).unsqueeze(1), rad.to(torch.float64)], dim=1)
        cum = torch.cumsum(terms, dim=1)[:, 1:]
        # Rounded to the model's precision (float32: upstream's rounding), then float32 ops in upstream's order.
        phase = cum.to(rad.dtype) * 2 * math.pi * self.samples_per_frame
        voiced = (f0 > self.voiced_threshold).float().unsqueeze(-1)  # [B, T, 1]
        sine_waves = torch.sin(phase) * self.sine_amp * voiced
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        # Frame rate -> sample rate. Upstream merges a [B, L, 9] view whose memory is [B, 9, L]; mirror that layout.
        sine_waves = nearest_upsample(sine_waves.transpose(1, 2), self.samples_per_frame)  # [B, 9, L]
        noise_amp = nearest_upsample(noise_amp.transpose(1, 2), self.samples_per_frame)  # [B, 1, L]
        excitation = sine_waves + noise_amp * noise.transpose(1, 2)
        source = torch.tanh(self.l_linear(excitation.transpose(1, 2)))  # [B, L, 1]
        return source.transpose(1, 2), cum
