"""The CosyVoice3 vocoder in PyTorch: HiFT rebuilt exactly, strict loading of an upstream checkpoint, weight-norm
folding, and the stateful step every engine and the exporter run. ``hift_model.config`` imports no torch; the names
below are imported (with torch) when first used."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"CheckpointError": "checkpoint", "COSYVOICE3": "config", "HiFTConfig": "config",
          "count_weight_norms": "folding", "expected_weight_norms": "folding", "fold_weight_norms": "folding",
          "FoldReport": "model", "HiFT": "model", "load_hift": "model", "random_state_dict": "model"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hift_model' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
