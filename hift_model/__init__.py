"""The CosyVoice3 vocoder in PyTorch: HiFT rebuilt exactly, strict loading of an upstream checkpoint, weight-norm
folding, and the stateful step every engine and the exporter run."""

from .checkpoint import CheckpointError
from .config import COSYVOICE3, HiFTConfig
from .folding import count_weight_norms, expected_weight_norms, fold_weight_norms
from .model import FoldReport, HiFT, load_hift, random_state_dict

__all__ = ["COSYVOICE3", "CheckpointError", "FoldReport", "HiFT", "HiFTConfig", "count_weight_norms",
           "expected_weight_norms", "fold_weight_norms", "load_hift", "random_state_dict"]
