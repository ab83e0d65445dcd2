"""Folding weight norm into plain conv weights, once, after a strict load.

``W = torch._weight_norm(v, g, dim)`` is exactly what both torch weight-norm APIs compute on every forward (the fused
kernel is not bit-identical to ``g*v/||v||``), so folded and unfolded models give identical outputs. Fold where the
weights will run: CPU and CUDA folds differ by ~3e-8.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from .config import HiFTConfig


def _legacy_hook(module: nn.Module):
    for hook in module._forward_pre_hooks.values():
        if type(hook).__name__ == "WeightNorm" and getattr(hook, "name", None) == "weight":
            return hook
    return None


def _is_weight_normed(module: nn.Module) -> bool:
    return parametrize.is_parametrized(module, "weight") or _legacy_hook(module) is not None


def count_weight_norms(module: nn.Module) -> int:
    """Weight-normalised layers in ``module`` (either API)."""
    return sum(1 for m in module.modules() if _is_weight_normed(m))


def expected_weight_norms(config: HiFTConfig) -> tuple[int, int]:
    """(generator, F0 predictor) weight-norm counts implied by the config: 77 and 5 for CosyVoice3."""
    generator = (1 + len(config.upsample_rates) + 1
                 + sum(2 * len(d) for d in config.source_resblock_dilation_sizes)
                 + len(config.upsample_rates) * sum(2 * len(d) for d in config.resblock_dilation_sizes))
    return generator, config.f0_num_layers


def fold_weight_norms(module: nn.Module) -> int:
    """Replace every weight-norm parametrisation/hook by a frozen plain ``nn.Parameter``; return how many.

    Runs outside inference mode and autograd whatever the caller's mode, so the folded weights are ordinary tensors
    (usable for backward w.r.t. inputs, tracing and export). A second call finds nothing and returns 0.
    """
    folded = 0
    with torch.inference_mode(False), torch.no_grad():
        for m in list(module.modules()):
            if parametrize.is_parametrized(m, "weight"):
                g = m.parametrizations.weight.original0
                v = m.parametrizations.weight.original1
                dim = getattr(m.parametrizations.weight[0], "dim", 0)
                weight = torch._weight_norm(v.clone(), g.clone(), dim)
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
            else:
                hook = _legacy_hook(m)
                if hook is None:
                    continue
                weight = torch._weight_norm(getattr(m, "weight_v").clone(), getattr(m, "weight_g").clone(), hook.dim)
                nn.utils.remove_weight_norm(m)
            del m.weight
            m.weight = nn.Parameter(weight, requires_grad=False)
            folded += 1
    return folded
