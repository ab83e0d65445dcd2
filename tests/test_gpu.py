"""The CUDA EP path. GPU tests skip cleanly where there is no NVIDIA GPU (CI never has one); the recorded H200
results are in benchmarks/results/ and BENCHMARKS.md. The refusals run everywhere."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from hift_runtime import ArtifactError, CompiledOptions, OverloadError, open_vocoder
from hift_runtime.engine import pad_rows
from hift_runtime.gpus import nvidia_driver_present
from hift_runtime.slots import SlotPoolFull

from .conftest import max_abs, run_in_threads, snr_db
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
    gpu = open_vocoder(small_artifacts.out, device="cuda", batching=False, engine="ort")
    assert gpu.backend.generator_provider == "CUDAExecutionProvider"
    gpu.warmup()
    mel = random_mel(200, 5)
    a = np.concatenate(stream_all(gpu, mel, [24] * 9)[0])
    b = np.concatenate(stream_all(cpu, mel, [24] * 9)[0])
    # Bars from the H200 measurement at full size (benchmarks/results/gpu-h200-step.json), with a 5x margin.
    assert max_abs(a, b) <= 2e-6 and snr_db(a, b) >= 105


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no NVIDIA GPU / CUDA EP on this host")
def test_cuda_concurrent_streams_in_device_slots_match_cpu(small_artifacts):
    """17 streams from 17 threads through the default GPU runtime (batching, CUDA graphs, caches in device slots):
    each equals its CPU stream, nothing crashes while graphs replay under concurrency (the captures all happen in
    warmup(), on the device thread), and every slot is given back."""
    cpu = open_vocoder(small_artifacts.out, device="cpu")
    gpu = open_vocoder(small_artifacts.out, device="cuda", max_wait_ms=5, engine="ort")
    gpu.warmup()
    rng = np.random.default_rng(17)
    mels = [random_mel(int(rng.integers(10, 160)), seed=i) for i in range(17)]
    schedules = [[int(x) for x in rng.integers(0, 40, 8)] + [500] for _ in range(17)]
    expected = [np.concatenate(stream_all(cpu, m, s)[0]) for m, s in zip(mels, schedules)]
    results = run_in_threads(lambda i: np.concatenate(stream_all(gpu, mels[i], schedules[i])[0]), range(17))
    for i in range(17):
        assert max_abs(results[i], expected[i]) <= 2e-6, i
    assert gpu.scheduler.stats.max_batch > 1
    import gc

    gc.collect()
    assert gpu.backend.slots_in_use == 0


def test_gpu_helpers_on_the_cpu():
    """The CUDA path's host-side helpers, which CI can run: batch padding, slot indices and the step split every push
    goes through."""
    _pad_rows = pad_rows
    from hift_runtime.ort_engine import slot_indices as _slot_indices
    from hift_runtime.slots import Slot
    from hift_runtime.engine import split_steps

    padded = _pad_rows(np.ones((3, 2), np.float32), 8)
    assert padded.shape == (8, 2) and padded[:3].all() and not padded[3:].any()
    assert _pad_rows(padded, 8) is padded or np.array_equal(_pad_rows(padded, 8), padded)
    assert _slot_indices([Slot(5), Slot(2)], 4).tolist() == [5, 2, 0, 0]  # padding rows use the scratch row
    assert _slot_indices(Slot(7), 1).tolist() == [7]
    sizes = (24, 16, 8, 4, 2, 1)
    for count in range(0, 200):
        steps = split_steps(count, sizes)
        assert sum(steps) == count and all(s in sizes for s in steps)
    assert split_steps(50, sizes) == [24, 24, 2] and split_steps(20, sizes) == [16, 4] and split_steps(7, None) == [7]
    assert split_steps(150, None, 64) == [64, 64, 22] and split_steps(128, None, 64) == [64, 64]


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

    def bind_output(self, name, device, device_id=0, dtype=None, shape=None, ptr=None):
        self.outputs[name] = None if ptr is None else _view_at(ptr, dtype, shape)  # None: host, allocated by run

    def bind_cpu_input(self, name, value):
        self.inputs[name] = value

    def get_outputs(self):
        return [_FakeDeviceValue(v) for v in self.outputs.values()]


class _FakeGraphSession:
    """Runs the real CPU session over whatever the binding points at, writing into the bound output buffers."""

    def __init__(self, session) -> None:
        self.session = session

    def io_binding(self):
        return _FakeBinding()

    def get_outputs(self):
        return self.session.get_outputs()

    def run_with_iobinding(self, binding, options=None):
        names = [o.name for o in self.session.get_outputs()]
        for name, value in zip(names, self.session.run(names, dict(binding.inputs))):
            if binding.outputs[name] is None:
                binding.outputs[name] = value
            else:
                binding.outputs[name][...] = value


def _on_fake_device(small_artifacts, monkeypatch, role):
    """The CUDA path's device buffers as NumPy arrays (``_FakeDeviceValue``), a CPU vocoder for reference values, and
    the graph of ``role`` as a CPU session behind the fake binding."""
    import hift_runtime.ort_engine as ort_engine
    from hift_runtime.manifest import read_manifest

    monkeypatch.setattr(ort_engine.ort, "OrtValue", _FakeDeviceValue)
    cpu = open_vocoder(small_artifacts.out, device="cpu")
    session = ort.InferenceSession(str(read_manifest(small_artifacts.out).path(role)), providers=["CPUExecutionProvider"])
    return cpu, session


@pytest.mark.parametrize("rows, batch", [(1, 1), (3, 4)])
def test_slot_steps_on_the_cpu(small_artifacts, monkeypatch, rows, batch):
    """The CUDA path's slot form, run over CPU sessions through fake device buffers: the captured-graph runner and
    the ordinary call read each stream's caches from its pool row (zeros where ``first``), write the next caches back
    into that row, leave every other stream's row alone, and return what the plain step returns, bit for bit."""
    import hift_runtime.ort_engine as ort_engine
    from hift_runtime.manifest import GENERATOR_STEP_SLOTS

    cpu, slot_session = _on_fake_device(small_artifacts, monkeypatch, GENERATOR_STEP_SLOTS)
    c, plain = cpu.constants, cpu.backend._gen[False]
    sizes = [int(np.prod(spec.shape)) for spec in c.generator_caches]
    rng = np.random.default_rng(rows)
    pool = ort_engine.SlotPool(6, sum(sizes), 0)
    held = [pool.acquire() for _ in range(rows)]
    assert pool.in_use == rows and 0 not in [s.index for s in held]
    feed = {"mel": rng.standard_normal((rows, 80, 11)).astype(np.float32) - 5,
            "f0": (rng.random((rows, 8)) * 300).astype(np.float32),
            "noise": rng.random((rows, 8 * 480, 9), dtype=np.float32), "phase_in": rng.random((rows, 9)),
            "first": np.array([[i % 2 == 1] for i in range(rows)])}
    slots = ort_engine.slot_indices(held if rows > 1 else held[0], batch)
    for runner in ("graph", "ordinary"):
        pool.value.array[...] = (rng.standard_normal(pool.value.array.shape) * 0.1).astype(np.float32)
        before = pool.value.array.copy()
        caches, offset = {}, 0
        for spec, size in zip(c.generator_caches, sizes):
            rows_ = before[slots[:rows], offset:offset + size].reshape(rows, *spec.shape).copy()
            rows_[feed["first"][:, 0]] = 0.0  # a stream's first step starts from zero caches
            caches[spec.name] = rows_
            offset += size
        if runner == "graph":
            step = ort_engine.SlotStep(_FakeGraphSession(slot_session), 1, 7, batch, c, pool, 0)
            audio, phase = step.run(dict(feed), slots)
        else:
            padded = {k: pad_rows(v, batch) for k, v in feed.items()}
            audio, phase = ort_engine.run_slots(_FakeGraphSession(slot_session), padded, slots, pool, 0, None)
            audio, phase = audio[:rows], phase[:rows]
        (want_audio, want_phase), want_next = plain.run(dict(feed), caches)
        assert audio.shape == want_audio.shape == (rows, 7 * 480)
        np.testing.assert_array_equal(audio, want_audio)
        np.testing.assert_array_equal(phase, want_phase)
        after = pool.value.array
        written = np.concatenate([want_next[spec.name].reshape(rows, -1) for spec in c.generator_caches], axis=1)
        np.testing.assert_array_equal(after[slots[:rows]], written)
        untouched = [r for r in range(1, pool.rows) if r not in slots]
        np.testing.assert_array_equal(after[untouched], before[untouched])
    index = held[0].index
    del held  # a stream that lets go of its slot gives it back
    assert pool.in_use == 0 and index in pool.free._free
    many = [pool.acquire() for _ in range(pool.rows - 1)]
    with pytest.raises(SlotPoolFull, match="device cache slots are in use"):
        pool.acquire()
    assert isinstance(SlotPoolFull("x"), OverloadError) and len(many) == 5


def test_final_slot_step_graph_runner_on_the_cpu(small_artifacts, monkeypatch):
    """The captured final step (what streams ending together share): read from the streams' pool rows, the plain
    final step's audio bit for bit (the held-back audio included), and the pool left as it was."""
    import hift_runtime.ort_engine as ort_engine
    from hift_runtime.manifest import GENERATOR_STEP_FINAL_SLOTS

    cpu, final_session = _on_fake_device(small_artifacts, monkeypatch, GENERATOR_STEP_FINAL_SLOTS)
    c, plain = cpu.constants, cpu.backend._gen[True]
    sizes = [int(np.prod(spec.shape)) for spec in c.generator_caches]
    rng = np.random.default_rng(9)
    pool = ort_engine.SlotPool(5, sum(sizes), 0)
    held = [pool.acquire() for _ in range(3)]
    pool.value.array[...] = (rng.standard_normal(pool.value.array.shape) * 0.1).astype(np.float32)
    before = pool.value.array.copy()
    size, rows, batch = c.mel_look_ahead, 3, 4
    feed = {"mel": rng.standard_normal((rows, 80, size)).astype(np.float32) - 5,
            "f0": (rng.random((rows, size)) * 300).astype(np.float32),
            "noise": rng.random((rows, size * 480, 9), dtype=np.float32), "phase_in": rng.random((rows, 9)),
            "first": np.zeros((rows, 1), bool)}
    slots = ort_engine.slot_indices(held, batch)
    caches, offset = {}, 0
    for spec, n in zip(c.generator_caches, sizes):
        caches[spec.name] = before[slots[:rows], offset:offset + n].reshape(rows, *spec.shape).copy()
        offset += n
    step = ort_engine.SlotStep(_FakeGraphSession(final_session), 1, size, batch, c, pool, 0, final=True)
    audio, phase = step.run(dict(feed), slots)
    (want_audio, want_phase), _ = plain.run(dict(feed), caches)
    assert audio.shape == want_audio.shape == (rows, (size + c.audio_lag) * 480)
    np.testing.assert_array_equal(audio, want_audio)
    np.testing.assert_array_equal(phase, want_phase)
    np.testing.assert_array_equal(pool.value.array, before)


def test_f0_graph_runner_on_the_cpu(small_artifacts, monkeypatch):
    """The captured F0 step (its float64 caches travel with each call, the batch padded): the ordinary F0 step's
    values bit for bit, for the real rows."""
    import hift_runtime.ort_engine as ort_engine
    from hift_runtime.manifest import F0_STEP

    cpu, f0_session = _on_fake_device(small_artifacts, monkeypatch, F0_STEP)
    c = cpu.constants
    rng = np.random.default_rng(4)
    rows, size = 3, 8
    mel = rng.standard_normal((rows, 80, size + c.f0_look_ahead)).astype(np.float32) - 5
    caches = {spec.name: rng.standard_normal((rows, *spec.shape)).astype(spec.dtype) for spec in c.f0_caches}
    graph = ort_engine.f0_graph(_FakeGraphSession(f0_session), 1, size, 4, c, 0)
    graph.capture({name: np.zeros_like(value.array) for name, value in graph.inputs.items()})  # what warmup() does
    assert graph.captured
    out = graph.replay({"mel": mel, **{"cache." + k: v for k, v in caches.items()}}, rows)
    want_f0, want_next = cpu.backend.f0_step(mel, caches)
    np.testing.assert_array_equal(out["f0"], want_f0)
    for name, value in want_next.items():
        np.testing.assert_array_equal(out["next." + name], value)


def test_the_backend_replays_a_captured_f0_graph(small_artifacts, monkeypatch):
    """A batched F0 call whose (size, padded batch) was captured replays that graph (not the slower ordinary call)."""

    import hift_runtime.ort_engine as ort_engine
    from hift_runtime.manifest import F0_STEP

    cpu, f0_session = _on_fake_device(small_artifacts, monkeypatch, F0_STEP)
    backend, c = cpu.backend, cpu.constants
    graph = ort_engine.f0_graph(_FakeGraphSession(f0_session), 1, 8, 4, c, 0)
    graph.capture({name: np.zeros_like(value.array) for name, value in graph.inputs.items()})
    replays = []
    replay = graph.replay
    monkeypatch.setattr(graph, "replay", lambda *a: replays.append(a) or replay(*a))
    backend._f0_graphs[(8, 4)] = graph
    backend._batch_sizes = (1, 2, 4)
    rng = np.random.default_rng(6)
    mel = rng.standard_normal((3, 80, 8 + c.f0_look_ahead)).astype(np.float32) - 5
    caches = {spec.name: rng.standard_normal((3, *spec.shape)).astype(spec.dtype) for spec in c.f0_caches}
    f0, _ = backend._f0_step_on_device(mel, caches)
    assert len(replays) == 1 and f0.shape == (3, 8)
    np.testing.assert_array_equal(f0, backend.f0_step(mel, caches)[0])


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def compiled_gpu(small_artifacts):
    vocoder = open_vocoder(small_artifacts.out, device="cuda", engine="compiled", max_wait_ms=5)
    vocoder.warmup()
    yield vocoder
    vocoder.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch here")
def test_compiled_streams_match_the_cpu_ep(small_artifacts, compiled_gpu):
    """The compiled engine (torch.compile, CUDA graphs, device slot pool) at fp32 and its defaults (cuDNN's heuristic
    mode B, the step window): each stream equals the CPU EP's stream within the ORT CUDA EP's bar, and 64 concurrent
    streams each equal their solo run on the engine (the solo runs' quiet pushes made in the scheduling thread:
    inline_lone_calls is on over CUDA graphs). The concurrent streams queue any group behind the call on the device
    (queue_behind 1), launched by the scheduler while the call ahead of them is still on the device; their F0 calls run
    beside the generator calls (the F0 lane)."""
    from hift_torch.compiled import compile_count

    assert compiled_gpu.backend.name == "compiled[cuda:fp32]"
    assert compiled_gpu.backend.cudnn_choice() == "its heuristic mode B" and compiled_gpu.backend.step_window_frames == 24
    assert compiled_gpu.scheduler.inline_lone_calls
    cpu = open_vocoder(small_artifacts.out, device="cpu")
    rng = np.random.default_rng(64)
    mels = [random_mel(int(rng.integers(10, 160)), seed=i) for i in range(64)]
    schedules = [[int(x) for x in rng.integers(0, 40, 8)] + [500] for _ in range(64)]
    scheduler = compiled_gpu.scheduler
    queue_behind, scheduler.queue_behind = scheduler.queue_behind, 1
    queued, launched_ahead = scheduler.stats.queued, scheduler.stats.launched_ahead
    try:
        concurrent = run_in_threads(lambda i: np.concatenate(stream_all(compiled_gpu, mels[i], schedules[i])[0]),
                                    range(64))
    finally:
        scheduler.queue_behind = queue_behind
    assert scheduler.stats.queued > queued
    assert compiled_gpu.backend.traits.launches_ahead and scheduler.stats.launched_ahead > launched_ahead
    assert compiled_gpu.backend.traits.f0_lane and scheduler.lanes == 2  # F0 calls beside the generator's
    for i in range(0, 64, 8):
        want = np.concatenate(stream_all(cpu, mels[i], schedules[i])[0])
        assert max_abs(concurrent[i], want) <= 2e-6 and snr_db(concurrent[i], want) >= 105, i
    for i in range(64):
        solo = np.concatenate(stream_all(compiled_gpu, mels[i], schedules[i])[0])
        assert max_abs(concurrent[i], solo) <= 2e-6, i
    assert compiled_gpu.scheduler.stats.max_batch > 1
    assert compile_count() == compiled_gpu.backend.compiles_at_warmup  # nothing compiled after warmup
    import gc

    gc.collect()
    assert compiled_gpu.backend.slots_in_use == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch here")
def test_a_warmed_cache_is_marked_and_a_second_start_runs_no_workers(small_artifacts, compiled_gpu):
    """After the first warmup (side by side, or in turn where a worker failed) the marker says the cache is warm; a
    second engine of the same settings starts without workers and compiles nothing new (loads from the cache)."""
    from hift_torch.compile_workers import warm_marker

    backend = compiled_gpu.backend
    assert warm_marker(backend, backend.step_sizes).exists()
    said: list[str] = []
    again = open_vocoder(small_artifacts.out, device="cuda", engine="compiled", max_wait_ms=5)
    try:
        again.warmup(progress=said.append)
        assert not any("first start" in m or "process of its own" in m for m in said), said
    finally:
        again.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch here")
def test_a_start_at_another_slot_count_loads_its_graphs_from_the_cache(small_artifacts, compiled_gpu):
    """The device cache pool's rows are dynamic in the compiled graphs: an engine of 64 slots (the first has 2 048)
    finds the warm marker (no workers), loads every graph from inductor's cache (no miss) and streams as the
    first."""
    from torch._dynamo.utils import counters

    misses = counters["inductor"]["fxgraph_cache_miss"]
    other = open_vocoder(small_artifacts.out, device="cuda", engine="compiled", max_wait_ms=5,
                         max_streams=60, options=CompiledOptions(compile_processes=1))
    try:
        assert other.backend.cache_slots == 64 != compiled_gpu.backend.cache_slots
        said: list[str] = []
        other.warmup(progress=said.append)
        assert not any("first start" in m or "process of its own" in m for m in said), said
        # (no hit need show: in this process dynamo may reuse the first engine's frames, the pool's size unguarded)
        assert counters["inductor"]["fxgraph_cache_miss"] == misses
        mel = random_mel(100, seed=7)
        got = np.concatenate(stream_all(other, mel, [24] * 4 + [500])[0])
        want = np.concatenate(stream_all(compiled_gpu, mel, [24] * 4 + [500])[0])
        assert max_abs(got, want) <= 2e-6
    finally:
        other.close()


def _each_concurrent_stream_equals(vocoder, reference, count: int, seed: int, mel_seed: int,
                                   lengths: tuple[int, int], pushes: tuple[int, int]) -> None:
    """``count`` streams (mels of ``lengths`` frames, 8 pushes of ``pushes`` frames and a finish) run at once on
    ``vocoder``, each equal to ``reference``'s stream of the same mel and schedule within 2e-6 (the CUDA EP's bar)."""
    rng = np.random.default_rng(seed)
    mels = [random_mel(int(rng.integers(*lengths)), seed=mel_seed + i) for i in range(count)]
    schedules = [[int(x) for x in rng.integers(*pushes, 8)] + [500] for _ in range(count)]
    got = run_in_threads(lambda i: np.concatenate(stream_all(vocoder, mels[i], schedules[i])[0]), range(count))
    for i in range(count):
        want = np.concatenate(stream_all(reference, mels[i], schedules[i])[0])
        assert max_abs(got[i], want) <= 2e-6, i


# Each precision's bound vs the CPU (issue 20; BENCHMARKS.md, H200 on 2026-12-01/02: tf32 60.8-62.7 dB, fp16
# 57.7-58.7 dB on 3-20 s streams of the full-size model, fp16 channels-last 59.0 dB on a 10 s stream): a few dB of
# margin under those figures. This test runs the reduced model, not yet on a GPU (written after the device time ran
# out): its first GPU run confirms the margin.
PRECISION_BOUND_DB = {"tf32": 58.0, "fp16": 52.0}


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch here")
@pytest.mark.parametrize("precision", sorted(PRECISION_BOUND_DB))
def test_compiled_faster_precisions_stay_within_their_bounds(small_artifacts, precision):
    """tf32 and fp16: each stream within its precision's measured distance of the CPU's, finite on inputs across
    the accepted log-mel range (-30 .. 15), nothing compiled after warmup, every slot returned."""
    from hift_torch.compiled import compile_count

    from hift_torch.compiled import CONV_LAYOUT

    vocoder = open_vocoder(small_artifacts.out, device="cuda", engine="compiled", precision=precision, max_wait_ms=5)
    vocoder.warmup()
    assert vocoder.backend.conv_layout == CONV_LAYOUT[precision]  # fp16: channels-last
    try:
        cpu = open_vocoder(small_artifacts.out, device="cpu")
        mels = [random_mel(150, seed=40 + i) for i in range(4)]
        streams = run_in_threads(lambda i: np.concatenate(stream_all(vocoder, mels[i], [24] * 6 + [500])[0]),
                                 range(4))
        for mel, audio in zip(mels, streams):
            assert snr_db(audio, cpu.vocode(mel)) >= PRECISION_BOUND_DB[precision]
        rng = np.random.default_rng(3)
        for mel in (rng.uniform(-30, 15, (80, 96)).astype(np.float32), np.full((80, 96), 15.0, np.float32)):
            assert np.isfinite(np.concatenate(stream_all(vocoder, mel, [24] * 4 + [500])[0])).all()
        assert compile_count() == vocoder.backend.compiles_at_warmup
    finally:
        vocoder.close()
    import gc

    gc.collect()
    assert vocoder.backend.slots_in_use == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch here")
def test_eager_step_graphs_index_in_bounds_on_padded_batches(small_artifacts, monkeypatch):
    """The step captured eagerly (``compile=False``: no inductor, seconds to warm) in CUDA graphs, in both windows. ATen's gathers assert on an index out of bounds where inductor's graphs would read undefined memory
    without a word, so this is the check that a padding row (zeros: frames 0, slot 0) stays in bounds. On the H200 it
    hit that assert before the step clamped a padding row's frames. 24 concurrent streams, batches of every size,
    each equal to the CPU EP's stream."""
    import functools

    from hift_torch import compiled

    monkeypatch.setattr(compiled, "CompiledBackend", functools.partial(compiled.CompiledBackend, compile=False,
                                                                       step_window=True))
    vocoder = open_vocoder(small_artifacts.out, device="cuda", engine="compiled", max_batch=16, max_wait_ms=5,
                           max_streams=124, options=CompiledOptions(cudnn_threads=2))
    try:
        vocoder.warmup()
        assert not vocoder.backend.compiled and vocoder.backend.step_window_frames == 24
        assert vocoder.backend._graphs  # captured
        cpu = open_vocoder(small_artifacts.out, device="cpu")
        _each_concurrent_stream_equals(vocoder, cpu, 24, seed=67, mel_seed=300, lengths=(10, 200), pushes=(1, 30))
        assert vocoder.scheduler.stats.max_batch > 1
    finally:
        vocoder.close()
