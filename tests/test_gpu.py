"""The CUDA EP path. GPU tests skip cleanly where there is no NVIDIA GPU (CI never has one); the recorded H200
results are in benchmarks/results/ and BENCHMARKS.md. The refusals run everywhere."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from hift_runtime import ArtifactError, CudaOptions, open_vocoder
from hift_runtime.sessions import nvidia_driver_present

from .conftest import max_abs, snr_db
from .test_streaming import random_mel, stream_all

HAS_GPU = nvidia_driver_present() and "CUDAExecutionProvider" in ort.get_available_providers()
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


class _FakeDeviceValue:
    """An OrtValue stand-in whose "device" memory is a NumPy array (so the CUDA path's buffers can run on the CPU)."""

    buffers: list[np.ndarray] = []

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        _FakeDeviceValue.buffers.append(array)

    @classmethod
    def ortvalue_from_numpy(cls, value, device, device_id):
        return cls(np.array(value, copy=True))

    @classmethod
    def ortvalue_from_shape_and_type(cls, shape, dtype, device, device_id):
        return cls(np.zeros(shape, dtype))

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def update_inplace(self, value) -> None:
        self.array[...] = np.asarray(value).reshape(self.array.shape)

    def numpy(self) -> np.ndarray:
        return self.array.copy()


def _view_at(ptr: int, dtype, shape) -> np.ndarray:
    """The part of a fake device buffer that a raw pointer + shape binds (what the CUDA EP would read or write)."""
    for array in _FakeDeviceValue.buffers:
        flat = array.reshape(-1)
        start = array.ctypes.data
        if start <= ptr < start + flat.nbytes:
            offset = (ptr - start) // flat.itemsize
            return flat[offset:offset + int(np.prod(shape))].reshape(shape)
    raise AssertionError("pointer outside every buffer")


class _FakeBinding:
    def __init__(self) -> None:
        self.inputs: dict[str, np.ndarray] = {}
        self.outputs: dict[str, np.ndarray] = {}

    def bind_ortvalue_input(self, name, value):
        self.inputs[name] = value.array

    def bind_ortvalue_output(self, name, value):
        self.outputs[name] = value.array

    def bind_input(self, name, device, device_id, dtype, shape, ptr):
        self.inputs[name] = _view_at(ptr, dtype, shape)

    def bind_output(self, name, device, device_id, dtype, shape, ptr):
        self.outputs[name] = _view_at(ptr, dtype, shape)


class _FakeGraphSession:
    """Runs the real CPU session over whatever the binding points at, writing into the bound output buffers."""

    def __init__(self, session) -> None:
        self.session = session

    def io_binding(self):
        return _FakeBinding()

    def run_with_iobinding(self, binding, options=None):
        names = [o.name for o in self.session.get_outputs()]
        for name, value in zip(names, self.session.run(names, dict(binding.inputs))):
            binding.outputs[name][...] = value


@pytest.mark.parametrize("rows, batch", [(1, 1), (3, 4)])
def test_graph_step_buffers_on_the_cpu(small_artifacts, monkeypatch, rows, batch):
    """The CUDA-graph runner's buffers, packed-cache offsets and row padding, run over the CPU session: its rows
    equal the same session run directly (the batched layout is what the GPU load test could not check)."""
    import hift_runtime.sessions as sessions

    monkeypatch.setattr(sessions.ort, "OrtValue", _FakeDeviceValue)
    cpu = open_vocoder(small_artifacts.out, device="cpu")
    backend, c = cpu.backend, cpu.constants
    plain = backend._gen[False]
    graph = sessions._GraphStep(_FakeGraphSession(plain.session), 1, 7, batch, c, 0)
    rng = np.random.default_rng(rows)
    feed = {"mel": rng.standard_normal((rows, 80, 11)).astype(np.float32) - 5,
            "f0": (rng.random((rows, 8)) * 300).astype(np.float32),
            "noise": rng.random((rows, 8 * 480, 9), dtype=np.float32), "phase_in": rng.random((rows, 9)),
            "first": np.array([[i % 2 == 0] for i in range(rows)])}
    caches = {spec.name: (rng.standard_normal((rows, *spec.shape)) * 0.1).astype(np.float32)
              for spec in c.generator_caches}
    if rows == 1:
        caches = sessions.PackedCaches(c.generator_caches, np.concatenate([v.reshape(-1) for v in caches.values()]))
    (audio, phase), nxt = graph.run(dict(feed), caches)
    (want_audio, want_phase), want_next = plain.run(dict(feed), dict(caches))
    assert audio.shape == want_audio.shape == (rows, 7 * 480)
    np.testing.assert_array_equal(audio, want_audio)
    np.testing.assert_array_equal(phase, want_phase)
    for spec in c.generator_caches:
        np.testing.assert_array_equal(nxt[spec.name], want_next[spec.name], err_msg=spec.name)
