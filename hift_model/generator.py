"""The CosyVoice3 HiFT generator (upstream ``CausalHiFTGenerator``, generator.py:572-726) without its F0 predictor.

State-dict keys and shapes are upstream's (311 keys; the F0 predictor's 17 live in :mod:`hift_model.f0_predictor`
and join under ``f0_predictor.`` to make the 328 of ``hift.pt``). The one entry point is :meth:`decode`, which takes
the F0, the noise slice and the carried phase explicitly (see :mod:`hift_model.source`).

Call semantics (upstream ``inference(finalize=...)`` after its F0 step), for ``N`` frames of mel and F0:

* ``finalize=True``: ``conv_pre`` looks ahead into 4 zero frames; the output is ``N * 480`` samples.
* ``finalize=False``: the last 4 frames are real ``conv_pre`` look-ahead; 480 source STFT frames and the last 480
  samples are cut; the output is ``(N - 5) * 480`` samples (needs ``N >= 5``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import COSYVOICE3, HiFTConfig
from .layers import (CausalConv1d, CausalConv1dDownSample, CausalConv1dUpsample, ResBlock, WeightNormAPI,
                     apply_weight_norm)
from .source import HarmonicSource
from .spectral_ops import SpectralMode, SpectralOps, reflect_pad


class CausalHiFTGenerator(nn.Module):
    def __init__(self, config: HiFTConfig = COSYVOICE3, weight_norm_api: WeightNormAPI = "parametrizations",
                 spectral: SpectralMode = "torch") -> None:
        super().__init__()
        self.config = config
        c = config
        bins2 = 2 * c.stft_bins
        self.m_source = HarmonicSource(c)
        self.conv_pre = apply_weight_norm(
            CausalConv1d(c.in_channels, c.base_channels, c.conv_pre_look_right + 1, causal_type="right"),
            weight_norm_api)
        self.ups = nn.ModuleList(
            apply_weight_norm(CausalConv1dUpsample(c.base_channels // 2 ** i, c.channels(i), k, u), weight_norm_api)
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)))
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(c.source_down_rates, c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes)):
            if u == 1:
                self.source_downs.append(CausalConv1d(bins2, c.channels(i), 1, causal_type="left"))
            else:
                self.source_downs.append(CausalConv1dDownSample(bins2, c.channels(i), u * 2, u))
            self.source_resblocks.append(ResBlock(c.channels(i), k, d, weight_norm_api))
        self.resblocks = nn.ModuleList(
            ResBlock(c.channels(i), k, d, weight_norm_api)
            for i in range(len(c.upsample_rates))
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
        self.conv_post = apply_weight_norm(CausalConv1d(c.channels(len(c.upsample_rates) - 1), bins2, 7), weight_norm_api)
        self.spectral = SpectralOps(c.n_fft, c.hop_len, spectral)
        self.num_kernels = len(c.resblock_kernel_sizes)
        # Non-final calls cut the source STFT frames and audio samples that depend on frames past the look-ahead.
        self.stft_trim = math.prod(c.upsample_rates) * c.conv_pre_look_right
        self.audio_trim = c.samples_per_frame

    def decode(self, mel: torch.Tensor, f0: torch.Tensor, noise: torch.Tensor, phase_in: torch.Tensor,
               finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``mel [B,80,N]``, ``f0 [B,N]``, ``noise [B,480N,9]``, ``phase_in [B,9]`` (float64, turns) ->
        ``audio [B, 480N or 480(N-5)]``, cumulative phase ``[B, N, 9]`` (float64, turns)."""
        c = self.config
        source, phase = self.m_source(f0, noise, phase_in)
        s_stft = self.spectral.stft(source)
        x = self.conv_pre(mel, pad_right=finalize)
        if not finalize:
            s_stft = s_stft[:, :, : -self.stft_trim]
        last = len(self.ups) - 1
        for i, up in enumerate(self.ups):
            x = F.leaky_relu(x, c.lrelu_slope)
            x = up(x)
            if i == last:
                x = reflect_pad(x, 1, 0)  # upstream nn.ReflectionPad1d((1, 0)) after the last upsample
            si = self.source_resblocks[i](self.source_downs[i](s_stft))
            x = x + si
            xs = self.resblocks[i * self.num_kernels](x)
            for j in range(1, self.num_kernels):
                xs = xs + self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        x = F.leaky_relu(x, c.post_lrelu_slope)
        x = self.conv_post(x)
        magnitude = torch.exp(x[:, : c.stft_bins, :])
        phase_head = torch.sin(x[:, c.stft_bins:, :])  # upstream: "actually, sin is redundancy"
        audio = self.spectral.istft(magnitude, phase_head)
        if not finalize:
            audio = audio[:, : -self.audio_trim]
        return torch.clamp(audio, -c.audio_limit, c.audio_limit), phase

    def forward(self, mel: torch.Tensor, f0: torch.Tensor, noise: torch.Tensor, phase_in: torch.Tensor,
                finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode(mel, f0, noise, phase_in, finalize)
