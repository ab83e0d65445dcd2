"""What a deployer chooses when opening a vocoder: the engine, the device, the precision, and each engine's own few
settings (torch-free: the compiled engine's options are read here without importing it)."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cuda", "cpu")
ENGINES = ("auto", "ort", "compiled")
# fp32: TF32 off (parity, the default); tf32: TF32 convolutions and matmuls; fp16: the compiled engine's half-precision
# convolution trunk. Each one's measured distance from fp32 is in BENCHMARKS.md.
PRECISIONS = ("fp32", "tf32", "fp16")
# Device cache slots (one per open stream) when max_streams is not given.
DEFAULT_SLOTS = 2048
# Slots kept beside max_streams for offline passes (vocode()), which take a slot while they run.
OFFLINE_SLOTS = 4
# The most streams a default (a CPU's measured real-time capacity) admits, whatever the memory.
MAX_DEFAULT_STREAMS = 4096
# Batch sizes captured for cross-stream batching on the GPU: every 1.5x between 32 and 256, since a batch pads to
# the next size and a batched step costs about in proportion to its padded size.
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
# The most threads the compiled engine's warmup chooses cuDNN's algorithms in (BENCHMARKS.md, decision log).
MAX_CUDNN_THREADS = 8


@dataclass(frozen=True)
class OrtOptions:
    """The ONNX Runtime engine's settings: the CUDA device, and the CPU threads of each session (0: ONNX Runtime's
    default, one per core)."""

    device_id: int = 0
    intra_op_threads: int = 0

    def __post_init__(self) -> None:
        if self.device_id < 0 or self.intra_op_threads < 0:
            raise ValueError(f"OrtOptions: device_id and intra_op_threads must be >= 0, got {self}")


@dataclass(frozen=True)
class CompiledOptions:
    """The compiled engine's settings: the CUDA device; how many processes a first start compiles its step graphs in,
    side by side (1: in turn, in this process); the threads that choose cuDNN's algorithms at warmup (None: one per
    9 GiB of free device memory at fp16, per 18 GiB at tf32 and fp32, at most :data:`MAX_CUDNN_THREADS`)."""

    device_id: int = 0
    compile_processes: int = 5  # of fp16's and tf32's six default graphs (five stream steps, the final) one waits
    cudnn_threads: int | None = None

    def __post_init__(self) -> None:
        if self.device_id < 0 or self.compile_processes < 1:
            raise ValueError(f"CompiledOptions: device_id must be >= 0 and compile_processes >= 1, got {self}")
        if self.cudnn_threads is not None and self.cudnn_threads < 1:
            raise ValueError(f"CompiledOptions: cudnn_threads must be >= 1 (or None: by free memory), got "
                             f"{self.cudnn_threads}")


EngineOptions = OrtOptions | CompiledOptions
