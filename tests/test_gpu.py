"""The CUDA EP path. GPU tests skip cleanly where there is no NVIDIA GPU (CI never has one); the recorded H200
results are in benchmarks/results/ and BENCHMARKS.md. The refusals run everywhere."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from hift_runtime import ArtifactError, CudaOptions, open_vocoder
from hift_runtime.sessions import _nvidia_driver_present

from .conftest import max_abs, snr_db
from .test_streaming import random_mel, stream_all

HAS_GPU = _nvidia_driver_present() and "CUDAExecutionProvider" in ort.get_available_providers()
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU / CUDA EP on this host")]


@pytest.mark.skipif(HAS_GPU, reason="this host has a GPU")
def test_cuda_requested_without_gpu_is_refused(small_artifacts):
    with pytest.raises(ArtifactError, match="device='cuda' requested but"):
        open_vocoder(small_artifacts.out, device="cuda")


def test_unknown_device_is_refused(small_artifacts):
    with pytest.raises(ValueError, match="device must be one of"):
        open_vocoder(small_artifacts.out, device="gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU / CUDA EP on this host")
def test_cuda_stream_matches_cpu(small_artifacts):
    cpu = open_vocoder(small_artifacts.out, device="cpu")
    gpu = open_vocoder(small_artifacts.out, device="cuda", cuda=CudaOptions())
    assert gpu.backend.generator_provider == "CUDAExecutionProvider"
    gpu.warmup()
    mel = random_mel(200, 5)
    a = np.concatenate(stream_all(gpu, mel, [24] * 9)[0])
    b = np.concatenate(stream_all(cpu, mel, [24] * 9)[0])
    # Bars from the H200 measurement at full size (benchmarks/results/gpu-h200-step.json), with a 5x margin.
    assert max_abs(a, b) <= 2e-6 and snr_db(a, b) >= 105


def test_gpu_helpers_on_the_cpu():
    """The CUDA path's host-side helpers, which CI can run: packed caches (one buffer, named views), batch padding,
    and the step split every push goes through."""
    from hift_runtime.sessions import PackedCaches, _pad_rows
    from hift_runtime.streaming import CacheSpec, split_steps

    specs = (CacheSpec("a", (2, 3), "float32"), CacheSpec("b", (4, 1), "float32"))
    packed = PackedCaches(specs)
    packed["b"][...] = 1.0
    assert packed.buffer.shape == (10,) and packed["a"].shape == (1, 2, 3) and packed.buffer[6:].tolist() == [1.0] * 4
    again = PackedCaches(specs, packed.buffer.copy())
    assert np.array_equal(again["b"], packed["b"])
    padded = _pad_rows(np.ones((3, 2), np.float32), 8)
    assert padded.shape == (8, 2) and padded[:3].all() and not padded[3:].any()
    assert _pad_rows(padded, 8) is padded or np.array_equal(_pad_rows(padded, 8), padded)
    sizes = (24, 16, 8, 4, 2, 1)
    for count in range(0, 200):
        steps = split_steps(count, sizes)
        assert sum(steps) == count and all(s in sizes for s in steps)
    assert split_steps(50, sizes) == [24, 24, 2] and split_steps(20, sizes) == [16, 4] and split_steps(7, None) == [7]
