"""Torch-free runtime of the CosyVoice3 vocoder: NumPy + ONNX Runtime over the exported stateful step graphs, the
stream bookkeeping and scheduler every engine runs behind, the server and its clients. The compiled engine
(``engine="compiled"``, :mod:`hift_torch`) is imported only when asked for."""

from .contract import CacheSpec, StreamConstants
from .engine import EngineTraits, VocoderBackend
from .errors import MelError, OverloadError, StreamError
from .manifest import ArtifactError, Manifest, read_manifest
from .noise import NoiseTable
from .opening import open_vocoder
from .options import CompiledOptions, OrtOptions
from .streaming import StreamingVocoder, VocoderStream

__all__ = ["ArtifactError", "CacheSpec", "CompiledOptions", "EngineTraits", "Manifest", "MelError", "NoiseTable",
           "OrtOptions", "OverloadError", "StreamConstants", "StreamError", "StreamingVocoder", "VocoderBackend",
           "VocoderStream", "open_vocoder", "read_manifest"]
