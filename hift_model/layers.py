"""Building blocks of the causal HiFT generator (upstream ``cosyvoice/transformer/convolution.py``,
``activation.py`` and ``hifigan/generator.py: ResBlock``), written so that they export cleanly.

Paddings are explicit ``F.pad`` zeros (never a cache tensor), nearest upsampling is ``expand + flatten`` (bit-identical
to ``nn.Upsample(mode='nearest')`` for integer factors, and a plain Expand/Reshape in ONNX).
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

WeightNormAPI = Literal["parametrizations", "legacy"]
WEIGHT_NORM_APIS: tuple[str, ...] = ("parametrizations", "legacy")


def apply_weight_norm(module: nn.Module, api: WeightNormAPI) -> nn.Module:
    """Weight-normalise ``module.weight`` (dim 0) with the chosen torch API, as upstream does."""
    if api == "parametrizations":
        return nn.utils.parametrizations.weight_norm(module)
    if api == "legacy":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the legacy API; upstream still falls back to it
            return nn.utils.weight_norm(module)
    raise ValueError(f"unknown weight-norm API {api!r}; expected one of {WEIGHT_NORM_APIS}")


def nearest_upsample(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``nn.Upsample(scale_factor=factor, mode='nearest')`` on ``[B, C, T]``: each step repeated ``factor`` times."""
    batch, channels, steps = x.shape
    # Explicit sizes: with ``expand(-1, ..)`` + ``flatten`` the ONNX optimizer pins the batch axis to 1.
    return x.unsqueeze(-1).expand(batch, channels, steps, factor).reshape(batch, channels, steps * factor)


class Conv1d(nn.Conv1d):
    """``nn.Conv1d`` (no padding of its own: the subclasses pad explicitly) whose weight may be stored 2-D
    channels-last by :func:`store_channels_last`: ``[O, I, 1, K]`` in NHWC memory order. It then runs as a 2-D
    convolution over ``[B, C, 1, T]``, so that under a compiler's layout optimization cuDNN's tensor-core kernels
    (NHWC) get their layout directly instead of transposing every operand in and out (the compiled engine's fp16
    form; same values, a different order of summation). :meth:`convolve` is the bare convolution."""

    def convolve(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of ``x`` ``[B, C, T]`` without the subclass's causal padding."""
        return self._conv_forward(x, self.weight, self.bias)

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 (torch's signature)
                      bias: torch.Tensor | None) -> torch.Tensor:
        if weight.dim() != 4:
            return super()._conv_forward(input, weight, bias)
        y = F.conv2d(input.unsqueeze(2), weight, bias, stride=(1, self.stride[0]), padding=(0, self.padding[0]),
                     dilation=(1, self.dilation[0]), groups=self.groups)
        return y.squeeze(2)


def store_channels_last(module: nn.Module) -> int:
    """Every :class:`Conv1d` weight under ``module`` stored as ``[O, I, 1, K]`` in channels-last memory order (see
    :class:`Conv1d`), in place; the number converted. Weight norms must be folded first (a parametrised weight is
    recomputed at each call, in the 1-D layout)."""
    count = 0
    for name, conv in module.named_modules():
        if not isinstance(conv, Conv1d) or conv.weight.dim() == 4:
            continue
        if nn.utils.parametrize.is_parametrized(conv) or hasattr(conv, "weight_g"):
            raise ValueError(f"{name}: fold the weight norms before storing the weights channels-last")
        weight = conv.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)
        conv.weight = nn.Parameter(weight, requires_grad=conv.weight.requires_grad)
        count += 1
    return count


class CausalConv1d(Conv1d):
    """Stride-1 conv with causal left zero padding (``'left'``) or look-ahead (``'right'``).

    ``causal_padding = (k-1)*d`` for odd ``k`` and ``k-1`` for even ``k`` with ``d=1`` (upstream formula). A ``'right'``
    conv sees frames ``t .. t+k-1``: with ``pad_right=True`` the look-ahead is zeros (upstream ``finalize=True``),
    otherwise the caller's input already ends with the real look-ahead frames and the output is shorter by
    ``causal_padding``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 causal_type: Literal["left", "right"] = "left") -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=1, dilation=dilation, padding=0)
        self.causal_padding = int((kernel_size * dilation - dilation) / 2) * 2 + (kernel_size + 1) % 2
        self.causal_type = causal_type

    def forward(self, x: torch.Tensor, pad_right: bool = True) -> torch.Tensor:  # type: ignore[override]
        if self.causal_type == "left":
            x = F.pad(x, (self.causal_padding, 0))
        elif pad_right:
            x = F.pad(x, (0, self.causal_padding))
        return super().forward(x)


class CausalConv1dDownSample(Conv1d):
    """Strided conv preceded by ``stride-1`` left zeros (upstream ``CausalConv1dDownSample``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        self.causal_padding = stride - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class CausalConv1dUpsample(Conv1d):
    """Nearest ``×stride`` upsampling, ``k-1`` left zeros, then a stride-1 conv. Not a ConvTranspose1d."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0)
        self.upsample_factor = stride
        self.causal_padding = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = nearest_upsample(x, self.upsample_factor)
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class Snake(nn.Module):
    """Snake activation with a linear (not log-scale) alpha: ``x + 1/(a+1e-9) * sin(a x)^2``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ResBlock(nn.Module):
    """Causal HiFi-GAN residual block with Snake activations (upstream ``ResBlock(causal=True)``)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...], api: WeightNormAPI) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            apply_weight_norm(CausalConv1d(channels, channels, kernel_size, dilation=d), api) for d in dilations)
        self.convs2 = nn.ModuleList(
            apply_weight_norm(CausalConv1d(channels, channels, kernel_size, dilation=1), api) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            xt = conv2(act2(conv1(act1(x))))
            x = xt + x
        return x
