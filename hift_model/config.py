"""The CosyVoice3 vocoder hyper-parameters: the single source of truth for every constant.

Everything else (model shapes, streaming bookkeeping, the manifest the runtime reads) derives from
:class:`HiFTConfig`. This module imports no torch, so tooling can read a config without it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# Upstream's yaml seed: the embedded random-weight default's.
DEFAULT_SEED = 1986


@dataclass(frozen=True)
class HiFTConfig:
    """Hyper-parameters of ``CausalHiFTGenerator`` + ``CausalConvRNNF0Predictor``.

    Defaults are the CosyVoice3 values (upstream ``examples/libritts/cosyvoice3/conf/cosyvoice3.yaml``, ``hift:``).
    Reduced configs (fewer channels) are for tests only; they change tensor shapes, not the algorithm.
    """

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    # Upstream calls F.leaky_relu(x) with the default slope before conv_post (generator.py:702), not lrelu_slope.
    post_lrelu_slope: float = 0.01
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    # F0 predictor (CausalConvRNNF0Predictor)
    f0_cond_channels: int = 512
    f0_num_layers: int = 5
    f0_first_kernel: int = 4
    f0_kernel: int = 3
    # Upstream draws its fixed noise table with 300 s of rows; indices wrap at this length.
    noise_table_seconds: int = 300

    # ---- derived constants -------------------------------------------------------------------------------------
    @property
    def num_sines(self) -> int:
        """Fundamental plus harmonics (9 for CosyVoice3)."""
        return self.nb_harmonics + 1

    @property
    def samples_per_frame(self) -> int:
        """Output samples per mel frame: prod(upsample_rates) * hop_len = 480."""
        return math.prod(self.upsample_rates) * self.hop_len

    @property
    def stft_bins(self) -> int:
        return self.n_fft // 2 + 1

    @property
    def f0_look_ahead(self) -> int:
        """Right padding of condnet[0]: the F0 look-ahead in frames (3)."""
        return self.f0_first_kernel - 1

    @property
    def f0_left_context(self) -> int:
        """Left receptive field of the causal F0 convs in frames (4 layers x (k-1) = 8)."""
        return (self.f0_num_layers - 1) * (self.f0_kernel - 1)

    @property
    def held_back_frames(self) -> int:
        """Frames upstream's non-final call withholds: F0 look-ahead + conv_pre look-ahead + 1 iSTFT frame (8). (The
        step graphs hold back 5: see hift_model/step.py.)"""
        return self.f0_look_ahead + self.conv_pre_look_right + 1

    @property
    def noise_table_length(self) -> int:
        return self.noise_table_seconds * self.sampling_rate

    @property
    def source_down_rates(self) -> tuple[int, ...]:
        """Strides of the source branch per stage: products of the later upsample rates ((15, 3, 1))."""
        return tuple(math.prod(self.upsample_rates[i + 1:]) for i in range(len(self.upsample_rates)))

    def channels(self, stage: int) -> int:
        """Channel width after upsampling stage ``stage`` (256, 128, 64)."""
        return self.base_channels // 2 ** (stage + 1)

    # ---- (de)serialisation: the manifest carries this dict, the runtime reads it back ----------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["derived"] = {
            "num_sines": self.num_sines,
            "samples_per_frame": self.samples_per_frame,
            "stft_bins": self.stft_bins,
            "f0_look_ahead": self.f0_look_ahead,
            "f0_left_context": self.f0_left_context,
            "held_back_frames": self.held_back_frames,
            "noise_table_length": self.noise_table_length,
        }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HiFTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known - {"derived"}
        if unknown:
            raise ValueError(f"unknown HiFTConfig fields {sorted(unknown)}; expected only {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if isinstance(value, list):
                value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
            kwargs[f.name] = value
        return cls(**kwargs)

    def reduced(self, base_channels: int = 64, f0_cond_channels: int = 64) -> "HiFTConfig":
        """A narrow variant for fast tests: same algorithm and streaming constants, fewer channels."""
        return dataclasses.replace(self, base_channels=base_channels, f0_cond_channels=f0_cond_channels)


COSYVOICE3 = HiFTConfig()
