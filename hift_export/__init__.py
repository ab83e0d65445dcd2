"""Torch side of the CosyVoice3 vocoder toolchain: model, strict loading, weight-norm folding, export."""

from .checkpoint import CheckpointError
from .config import COSYVOICE3, HiFTConfig
from .folding import count_weight_norms, expected_weight_norms, fold_weight_norms
from .model import FoldReport, HiFT, load_hift, random_state_dict

__all__ = ["COSYVOICE3", "CheckpointError", "FoldReport", "HiFT", "HiFTConfig", "count_weight_norms",
           "expected_weight_norms", "fold_weight_norms", "load_hift", "random_state_dict"]
