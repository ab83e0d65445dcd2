"""Folded-weights target: the folded generator and F0 predictor as one weights-only file, what the compiled engine
(``hift_torch.compiled``) loads into fresh modules built from the manifest's config (no ``hift.pt`` needed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hift_runtime.manifest import FOLDED_WEIGHTS

from hift_model.model import HiFT
from .targets import ARTIFACT_FILES


def export_folded_weights(hift: HiFT, staging: Path, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """``{generator: state dict, f0_predictor: state dict}`` of the folded modules, CPU tensors, for
    ``torch.load(..., weights_only=True)``."""
    t0 = time.perf_counter()
    state = {"generator": {k: v.detach().cpu().contiguous() for k, v in hift.generator.state_dict().items()},
             "f0_predictor": {k: v.detach().cpu().contiguous() for k, v in hift.f0_predictor.state_dict().items()}}
    path = staging / ARTIFACT_FILES[FOLDED_WEIGHTS]
    torch.save(state, path)
    log(f"[weights] folded weights for the compiled engine in {time.perf_counter() - t0:.1f} s")
    return {FOLDED_WEIGHTS: {"file": path.name, "format": "torch-weights",
                             "keys": {part: len(values) for part, values in state.items()}}}
