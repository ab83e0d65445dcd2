"""The exporter's folded weights (``hift_folded.pt``, weights only, checked by hash like every file) loaded into fresh
modules built from the manifest's config: the compiled engine never needs the original ``hift.pt``."""

from __future__ import annotations

from typing import Any

import torch

from hift_model.config import HiFTConfig
from hift_model.folding import fold_weight_norms
from hift_model.model import build_unfolded
from hift_runtime.manifest import FOLDED_WEIGHTS, ArtifactError, Manifest


def load_folded(manifest: Manifest, device: torch.device) -> tuple[Any, Any]:
    """The generator (``spectral='conv'``, on ``device``) and the F0 predictor (in the export's F0 precision, on
    ``device``) with the exporter's folded weights."""
    path = manifest.path(FOLDED_WEIGHTS)
    config = HiFTConfig.from_dict(manifest.config)
    generator, predictor = build_unfolded(config, spectral="conv")
    fold_weight_norms(generator)
    fold_weight_norms(predictor)
    f0_dtype = torch.float64 if manifest.data.get("f0_precision", "fp64") == "fp64" else torch.float32
    predictor = predictor.to(f0_dtype)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        generator.load_state_dict(state["generator"], strict=True)
        predictor.load_state_dict(state["f0_predictor"], strict=True)
    except (RuntimeError, KeyError, TypeError, OSError) as exc:
        raise ArtifactError(f"{path}: cannot load the folded weights into the manifest's model "
                            f"({str(exc).splitlines()[0][:300]}); re-export") from exc
    if f0_dtype == torch.float64:
        predictor.impl = "matmul"  # the exported F0 graph's form (same values, same order of operations)
    return generator.to(device).eval().requires_grad_(False), predictor.to(device).eval().requires_grad_(False)
