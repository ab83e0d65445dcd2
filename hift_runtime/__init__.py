"""Torch-free runtime of the CosyVoice3 vocoder: NumPy + ONNX Runtime, bounded-window streaming."""

from .manifest import ArtifactError, Manifest, read_manifest

__all__ = ["ArtifactError", "Manifest", "read_manifest"]
from .noise import NoiseTable
from .streaming import MelError, StreamConstants, StreamError, StreamingVocoder, VocoderBackend, VocoderStream
from .sessions import CudaOptions, OrtBackend, open_vocoder

__all__ += ["CudaOptions", "MelError", "NoiseTable", "OrtBackend", "StreamConstants", "StreamError",
            "StreamingVocoder", "VocoderBackend", "VocoderStream", "open_vocoder"]
