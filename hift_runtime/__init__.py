"""Torch-free runtime of the CosyVoice3 vocoder: NumPy + ONNX Runtime, bounded-window streaming."""

from .manifest import ArtifactError, Manifest, read_manifest

__all__ = ["ArtifactError", "Manifest", "read_manifest"]
