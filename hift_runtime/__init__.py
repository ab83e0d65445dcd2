"""Torch-free runtime of the CosyVoice3 vocoder: NumPy + ONNX Runtime, stateful step graphs."""

from .manifest import ArtifactError, Manifest, read_manifest

__all__ = ["ArtifactError", "Manifest", "read_manifest"]
from .noise import NoiseTable
from .streaming import (CacheSpec, MelError, OverloadError, StreamConstants, StreamError, StreamingVocoder,
                        VocoderBackend, VocoderStream)
from .sessions import CudaOptions, OrtBackend, open_vocoder

__all__ += ["CacheSpec", "CudaOptions", "OverloadError", "MelError", "NoiseTable", "OrtBackend", "StreamConstants", "StreamError",
            "StreamingVocoder", "VocoderBackend", "VocoderStream", "open_vocoder"]
