"""The CosyVoice3 F0 predictor (upstream ``CausalConvRNNF0Predictor``, f0_predictor.py:62-103). No RNN, despite
the name: a look-ahead conv (k=4, 3 future frames), four causal k=3 convs with ELU, and ``|Linear|``.

F0 of frame ``t`` depends on mel frames ``t-8 .. t+3`` only (``config.f0_left_context`` / ``f0_look_ahead``).
``finalize=True`` treats the 3 look-ahead frames past the end as zeros, which is exactly ``finalize=False`` on the mel
with 3 zero frames appended; the F0 graph therefore only needs the streaming form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

        # "torch": nn.Conv1d + nn.ELU. "matmul": the same convolutions as shifted-slice concatenation + MatMul and
        # ELU as Where(x > 0, x, exp(x) - 1), which ONNX Runtime runs in float64 on the CPU (it has no float64 Conv
        # or Elu kernel). Equal to "torch" within 1e-11 Hz in float64.
        self.impl = "torch"

    def forward(self, mel: torch.Tensor, finalize: bool = False) -> torch.Tensor:
        """``mel [B, 80, T]`` -> F0 in Hz ``[B, T]`` (finalize) or ``[B, T-3]`` (the last 3 frames are look-ahead).

        The output has the dtype of the module's parameters (upstream runs it in float64).
        """
        x = mel.to(self.classifier.weight.dtype)
        for i, layer in enumerate(self.condnet):
            if self.impl == "torch":
                x = layer(x, pad_right=finalize) if i == 0 else layer(x)
            elif isinstance(layer, CausalConv1d):
                x = _conv_as_matmul(layer, x, pad_right=finalize if i == 0 else True)
            else:  # ELU(alpha=1)
                x = torch.where(x > 0, x, torch.exp(x) - 1)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


def _conv_as_matmul(conv: CausalConv1d, x: torch.Tensor, pad_right: bool) -> torch.Tensor:
    """``conv(x)`` computed as ``W[Co, K*Ci] @ stack_k(x[:, :, k:k+T])`` (same padding semantics as ``conv``)."""
    pad = conv.causal_padding
    if conv.causal_type == "left":
        x = F.pad(x, (pad, 0))
    elif pad_right:
        x = F.pad(x, (0, pad))
    return matmul_conv(conv, x)


def matmul_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """An unpadded conv of ``x`` as shifted-slice concatenation + MatMul (ORT runs MatMul in float64 on the CPU)."""
    k = conv.kernel_size[0]
    steps = x.shape[2] - (k - 1) * conv.dilation[0]
    taps = [x[:, :, j * conv.dilation[0]: j * conv.dilation[0] + steps] for j in range(k)]
    weight = conv.weight.permute(0, 2, 1).reshape(conv.out_channels, k * conv.in_channels)
    return torch.matmul(weight, torch.cat(taps, dim=1)) + conv.bias.unsqueeze(-1)
