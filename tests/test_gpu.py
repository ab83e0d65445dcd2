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
