"""The CosyVoice3 F0 predictor (upstream ``CausalConvRNNF0Predictor``, f0_predictor.py:62-103). No RNN, despite
the name: a look-ahead conv (k=4, 3 future frames), four causal k=3 convs with ELU, and ``|Linear|``.

F0 of frame ``t`` depends on mel frames ``t-8 .. t+3`` only (``config.f0_left_context`` / ``f0_look_ahead``).
``finalize=True`` treats the 3 look-ahead frames past the end as zeros, which is exactly ``finalize=False`` on the mel
with 3 zero frames appended; the F0 graph therefore only needs the streaming form.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import COSYVOICE3, HiFTConfig
from .layers import CausalConv1d, WeightNormAPI, apply_weight_norm


class CausalF0Predictor(nn.Module):
    def __init__(self, config: HiFTConfig = COSYVOICE3, weight_norm_api: WeightNormAPI = "parametrizations") -> None:
        super().__init__()
        c = config
        layers: list[nn.Module] = []
        for i in range(c.f0_num_layers):
            if i == 0:
                conv = CausalConv1d(c.in_channels, c.f0_cond_channels, c.f0_first_kernel, causal_type="right")
            else:
                conv = CausalConv1d(c.f0_cond_channels, c.f0_cond_channels, c.f0_kernel, causal_type="left")
            layers += [apply_weight_norm(conv, weight_norm_api), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(c.f0_cond_channels, 1)

    def forward(self, mel: torch.Tensor, finalize: bool = False) -> torch.Tensor:
        """``mel [B, 80, T]`` -> F0 in Hz ``[B, T]`` (finalize) or ``[B, T-3]`` (the last 3 frames are look-ahead).

        The output has the dtype of the module's parameters (upstream runs it in float64).
        """
        x = mel.to(self.classifier.weight.dtype)
        x = self.condnet[0](x, pad_right=finalize)
        for layer in self.condnet[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))
