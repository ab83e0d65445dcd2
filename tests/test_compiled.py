"""The compiled engine (``hift_torch.compiled``) on the CPU, reduced model: its slot pool, its noise gather and the
shared bookkeeping and scheduler, run eagerly (CI has no GPU; the compile and CUDA graphs run in test_gpu.py), equal
the ONNX Runtime engine's streams on random schedules, interleaved and batched, with bad chunks and expiry; engine
and precision selection."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from hift_runtime import MelError, StreamError, open_vocoder
from hift_runtime.manifest import ArtifactError

from .conftest import max_abs, run_in_threads
from .test_streaming import random_mel, stream_all

pytest.importorskip("torch")

# The engines run the same step in float32 on the CPU in different op orders (ONNX Runtime's kernels vs torch's):
# measured <= 1.2e-7 apart on the reduced model; the bar is the one every stream-vs-offline test uses.
TOLERANCE = 1e-6


def streamed(vocoder, mel, schedule):
    return np.concatenate(stream_all(vocoder, mel, schedule)[0])


def compiled_vocoder(artifacts, *, batching=False, step_sizes=None, **backend_options):
    """The compiled engine on the CPU with switches a CUDA device sets (its windows) and fixed step sizes, behind the
    bookkeeping (and the scheduler, ``batching``) as ``open_vocoder`` puts it."""
    from hift_runtime.batching import PushScheduler
    from hift_runtime.contract import StreamConstants
    from hift_runtime.manifest import read_manifest
    from hift_runtime.streaming import StreamingVocoder
    from hift_torch.compiled import CompiledBackend

    manifest = read_manifest(artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    backend = CompiledBackend(manifest, constants, device="cpu", **backend_options)
    vocoder = StreamingVocoder(backend, constants, step_sizes=step_sizes)
    if batching:
        vocoder.scheduler = PushScheduler(backend, max_batch=16, max_wait_s=0.005,
                                          pushes_in_progress=lambda: vocoder.pushes_in_progress)
    return vocoder


@pytest.fixture(scope="module")
def ort_cpu(small_artifacts):
    return open_vocoder(small_artifacts.out, device="cpu", engine="ort")


@pytest.fixture(scope="module")
def compiled_cpu(small_artifacts):
    return open_vocoder(small_artifacts.out, device="cpu", engine="compiled", max_streams=24)


def test_compiled_engine_equals_ort_on_random_schedules(ort_cpu, compiled_cpu):
    assert compiled_cpu.backend.name == "torch[cpu]" and compiled_cpu.backend.traits.caches_in_place
    rng = np.random.default_rng(5)
    for i in range(3):
        mel = random_mel(int(rng.integers(5, 140)), seed=i)
        schedule = [int(x) for x in rng.integers(0, 50, 6)]
        assert max_abs(streamed(compiled_cpu, mel, schedule), streamed(ort_cpu, mel, schedule)) <= TOLERANCE
        assert max_abs(compiled_cpu.vocode(mel), ort_cpu.vocode(mel)) <= TOLERANCE
    assert compiled_cpu.backend.slots_in_use == 0  # every slot given back


def test_interleaved_streams_keep_their_own_slots(ort_cpu, compiled_cpu):
    """Three streams pushed in turn from one thread: each stream's caches stay in its own pool row."""
    mels = [random_mel(100, seed=20 + i) for i in range(3)]
    want = [streamed(ort_cpu, m, [17] * 6) for m in mels]
    streams = [compiled_cpu.stream() for _ in mels]
    pieces: list[list[np.ndarray]] = [[] for _ in mels]
    for k in range(0, 100, 17):
        for i, s in enumerate(streams):
            pieces[i].append(s.push(mels[i][:, k:k + 17]))
    for i, s in enumerate(streams):
        pieces[i].append(s.finish())
        assert max_abs(np.concatenate(pieces[i]), want[i]) <= TOLERANCE, i


def test_a_stream_on_a_reused_slot_starts_from_zero_caches(small_artifacts, ort_cpu):
    """The F0 and generator caches live in the slots' device rows: a stream handed the rows another stream just
    wrote reads zeros at its start, not that stream's caches."""
    v = open_vocoder(small_artifacts.out, device="cpu", engine="compiled", max_streams=1)
    first = v.stream()
    rows = first._f0_caches.index, first._gen_caches.index
    first.push(random_mel(60, seed=41))
    first.finish()
    mel = random_mel(70, seed=42)
    second = v.stream()
    assert (second._f0_caches.index, second._gen_caches.index) == rows  # the same rows, written by the first
    got = np.concatenate([second.push(mel[:, :30]), second.push(mel[:, 30:]), second.finish()])
    assert max_abs(got, streamed(ort_cpu, mel, [30, 40])) <= TOLERANCE
    second = None
    assert v.backend.slots_in_use == 0


def test_batched_streams_equal_the_ort_engine_alone(small_artifacts, ort_cpu):
    """Concurrent streams through the scheduler: batched calls gather and scatter several pool rows at once."""
    batched = open_vocoder(small_artifacts.out, device="cpu", engine="compiled", batching=True, max_wait_ms=5)
    rng = np.random.default_rng(9)
    mels = [random_mel(int(rng.integers(10, 120)), seed=30 + i) for i in range(9)]
    schedules = [[int(x) for x in rng.integers(0, 30, 8)] + [500] for _ in range(9)]
    want = [streamed(ort_cpu, m, s) for m, s in zip(mels, schedules)]
    got = run_in_threads(lambda i: streamed(batched, mels[i], schedules[i]), range(9))
    for i in range(9):
        assert max_abs(got[i], want[i]) <= TOLERANCE, i
    assert batched.scheduler.stats.max_batch > 1
    assert batched.backend.slots_in_use == 0
    batched.close()


@pytest.mark.parametrize("final, window, ends", [(True, 28, [1, 13, 28]), (False, 24, [1, 7, 20, 24])])
def test_a_step_in_a_window_equals_the_step_of_each_rows_frames(reduced_config, final, window, ends):
    """``hift_model.step.generator_step(..., frames=...)``: rows ending at ``ends`` frames of one window (zeros past
    each end), at an utterance's start and mid-stream (random caches), each equal to the step of its own frames alone.
    The final step: its audio (the end's reflection, the iSTFT's last frames and envelope follow each row). The stream
    step: its audio, its phase and every cache (each taken at the row's own end, at its stage's rate)."""
    import torch

    from hift_model import load_hift
    from hift_model.step import generator_cache_layout, generator_step

    gen = load_hift(None, config=reduced_config, spectral="conv").generator
    spf, sines = reduced_config.samples_per_frame, reduced_config.num_sines
    look, ahead = (0, 0) if final else (reduced_config.conv_pre_look_right, 1)  # mel and source look-ahead
    torch.manual_seed(0)
    rows = len(ends)
    mel = torch.randn(rows, reduced_config.in_channels, window + look) - 4
    f0 = torch.rand(rows, window + ahead) * 300
    for r, end in enumerate(ends):
        mel[r, :, end + look:] = 0
        f0[r, end + ahead:] = 0
    noise = torch.randn(rows, (window + ahead) * spf, sines)
    phase = torch.rand(rows, sines, dtype=torch.float64)
    for first in (True, False):
        caches = {e["name"]: (torch.zeros if first else torch.randn)(rows, *e["shape"])
                  for e in generator_cache_layout(reduced_config)}
        flags = torch.full((rows, 1), first)
        with torch.no_grad():
            audio, phase_out, new = generator_step(gen, mel, f0, noise, phase, flags, caches, final,
                                                   frames=torch.tensor(ends))
            for r, end in enumerate(ends):
                alone, alone_phase, alone_new = generator_step(
                    gen, mel[r:r + 1, :, :end + look], f0[r:r + 1, :end + ahead],
                    noise[r:r + 1, :(end + ahead) * spf], phase[r:r + 1], flags[r:r + 1],
                    {k: v[r:r + 1] for k, v in caches.items()}, final)
                samples = (end + 1 if final else end) * spf
                assert alone.shape[1] == samples
                assert max_abs(audio[r, :samples].numpy(), alone[0].numpy()) <= TOLERANCE, (first, end)
                if final:
                    continue
                assert torch.equal(phase_out[r], alone_phase[0])
                # Caches are activations up to ~5 here, and the two calls block their convolutions differently: the
                # float32 rounding grows with the values, so it is bounded relative to each cache's peak. Measured
                # <= 5.5e-6 absolute on one Intel VM, 1.3e-5 absolute (3.2e-6 of the peak) on an AMD EPYC one;
                # 1e-5 of the peak leaves 3x (the audio stays within TOLERANCE).
                for name, value in alone_new.items():
                    peak = max(float(value[0].abs().max()), 1.0)
                    assert max_abs(new[name][r].numpy(), value[0].numpy()) <= 1e-5 * peak, (first, end, name)


@pytest.mark.parametrize("step_window", [False, True])
def test_streams_ending_in_the_final_window_equal_the_ort_engine(small_artifacts, ort_cpu, step_window):
    """The compiled engine's final window (on wherever CUDA graphs are captured), and with it the stream step's
    (fp32's on the GPU), batched: streams ending at many remainders (an
    utterance of 1 frame whose first push is its last, a finish longer than the window) equal the ONNX Runtime
    engine's; a last push of up to 24 new frames is one generator call, and with the step window so is every push of
    up to 24."""
    from hift_torch.compiled import STEP_SIZES

    sizes = STEP_SIZES
    windowed = compiled_vocoder(small_artifacts.out, batching=True, step_sizes=sizes, final_window=True,
                                step_window=step_window)
    window = (24 if step_window else 25) + windowed.constants.mel_look_ahead  # the largest step's, plus the look-ahead
    assert windowed.backend.final_window_frames == window and windowed.final_window == window
    assert windowed.step_window == (24 if step_window else None)
    # (frames, pushes before the finish): the finish gets the rest
    cases = [(250, [24] * 10), (1, []), (3, []), (27, []), (28, []), (29, []), (70, []), (52, [24]), (45, [8, 16]),
             (61, [24, 24])]
    mels = [random_mel(frames, seed=60 + i) for i, (frames, _) in enumerate(cases)]

    def run(i):
        mel, pushes = mels[i], cases[i][1]
        stream, pieces, pos = windowed.stream(), [], 0
        for size in pushes:
            pieces.append(stream.push(mel[:, pos:pos + size]))
            pos += size
            if step_window:
                assert stream.stats.generator_calls <= len(pieces)  # one call a push of up to 24 frames
        calls = stream.stats.generator_calls
        pieces.append(stream.finish(mel[:, pos:]))
        return np.concatenate(pieces), stream.stats.generator_calls - calls, mel.shape[1] - pos

    got = run_in_threads(run, range(len(cases)))
    for i, (frames, pushes) in enumerate(cases):
        want = np.concatenate(stream_all(ort_cpu, mels[i], pushes + [frames - sum(pushes)])[0])
        audio, last_calls, last_frames = got[i]
        assert max_abs(audio, want) <= TOLERANCE, cases[i]
        if last_frames <= 24:
            assert last_calls == 1, cases[i]
    assert windowed.scheduler.stats.by_shape[f"final@{window}"][0] == len(cases)
    assert windowed.backend.slots_in_use == 0
    windowed.close()
    if step_window:
        plan = {(kind, size) for kind, size, _ in windowed.backend.capture_plan(sizes) if kind != "f0"}
        assert plan == {("generator", 24), ("final", 28)}  # no graphs of 8, 4 and 1 frames
        return
    with pytest.raises(ValueError, match="final window"):
        compiled_vocoder(small_artifacts.out, step_sizes=(32, 8, 1), final_window=True)


def test_a_bad_chunk_leaves_the_stream_and_its_slot_unchanged(ort_cpu, compiled_cpu):
    mel = random_mel(80, seed=3)
    stream = compiled_cpu.stream()
    out = [stream.push(mel[:, :30])]
    with pytest.raises(MelError, match="non-finite"):
        stream.push(np.full((80, 10), np.inf, np.float32))
    out += [stream.push(mel[:, 30:]), stream.finish()]
    assert max_abs(np.concatenate(out), streamed(ort_cpu, mel, [30, 50])) <= TOLERANCE


def test_an_idle_stream_expires_and_frees_its_slot(small_artifacts):
    import time

    v = open_vocoder(small_artifacts.out, device="cpu", engine="compiled", max_streams=1, idle_timeout_s=0.05)
    abandoned = v.stream()
    abandoned.push(random_mel(20))
    time.sleep(0.1)
    fresh = v.stream()
    with pytest.raises(StreamError, match="expired"):
        abandoned.push(random_mel(5))
    assert np.concatenate([fresh.push(random_mel(10)), fresh.finish()]).shape == (480 * 10,)
    del abandoned
    import gc

    gc.collect()
    fresh = None
    gc.collect()
    assert v.backend.slots_in_use == 0


def test_the_noise_table_on_the_device_is_the_same_table(small_artifacts, tmp_path):
    """A short .npy table (streams wrap around it): the engine's gather by position equals the host rows."""
    table = np.random.default_rng(1).random((7_000, 9), dtype=np.float32)
    np.save(tmp_path / "noise.npy", table)
    with pytest.warns(RuntimeWarning, match="reuse its rows"):
        ort_v = open_vocoder(small_artifacts.out, device="cpu", engine="ort", noise_table=tmp_path / "noise.npy")
        compiled = open_vocoder(small_artifacts.out, device="cpu", engine="compiled",
                                noise_table=tmp_path / "noise.npy")
    mel = random_mel(60, seed=8)
    assert max_abs(streamed(compiled, mel, [24, 24]), streamed(ort_v, mel, [24, 24])) <= TOLERANCE


def test_engine_selection(small_artifacts):
    auto = open_vocoder(small_artifacts.out, device="cpu")
    assert auto.backend.name.startswith("ort") and "CPU" in auto.engine_reason
    with pytest.raises(ValueError, match="engine must be one of"):
        open_vocoder(small_artifacts.out, device="cpu", engine="tensorrt")
    with pytest.raises(ValueError, match="precision must be one of"):
        open_vocoder(small_artifacts.out, device="cpu", precision="bf16")
    with pytest.raises(ValueError, match="fp16' is the compiled engine's"):
        open_vocoder(small_artifacts.out, device="cpu", engine="ort", precision="fp16")
    with pytest.raises(ValueError, match="for CUDA devices"):
        open_vocoder(small_artifacts.out, device="cpu", engine="compiled", precision="fp16")


def test_channels_last_convolutions_stream_as_channels_first(small_artifacts, ort_cpu, monkeypatch):
    """fp16's layout on the GPU (every generator Conv1d weight [O, I, 1, K] channels-last, run as 2-D convolutions),
    run here in fp32: the same streams within the engines' tolerance (another order of summation; measured 1.3e-7
    apart on the reduced model); the F0 predictor keeps its 1-D weights."""
    import torch

    import hift_torch.compiled as compiled
    from hift_model.layers import Conv1d

    monkeypatch.setitem(compiled.CONV_LAYOUT, "fp32", "channels-last")  # the CPU runs fp32 only
    vocoder = open_vocoder(small_artifacts.out, device="cpu", engine="compiled")
    backend = vocoder.backend
    assert backend.conv_layout == "channels-last"
    convs = [m for m in backend.generator.modules() if isinstance(m, Conv1d)]
    assert convs and all(m.weight.dim() == 4 and m.weight.is_contiguous(memory_format=torch.channels_last)
                         for m in convs)
    assert all(m.weight.dim() == 3 for m in backend.predictor.modules() if isinstance(m, Conv1d))
    rng = np.random.default_rng(8)
    for i in range(2):
        mel = random_mel(int(rng.integers(30, 140)), seed=60 + i)
        schedule = [int(x) for x in rng.integers(1, 50, 5)]
        assert max_abs(streamed(vocoder, mel, schedule), streamed(ort_cpu, mel, schedule)) <= TOLERANCE
    assert max_abs(vocoder.vocode(mel), ort_cpu.vocode(mel)) <= TOLERANCE


def test_conv_layout_is_checked(small_artifacts):
    from hift_model.config import HiFTConfig
    from hift_model.layers import store_channels_last
    from hift_model.model import build_unfolded
    from hift_torch.compiled import CONV_LAYOUT

    assert open_vocoder(small_artifacts.out, device="cpu", engine="compiled").backend.conv_layout == \
        CONV_LAYOUT["fp32"] == "channels-first"
    assert CONV_LAYOUT == {"fp32": "channels-first", "tf32": "channels-first", "fp16": "channels-last"}
    generator, _ = build_unfolded(HiFTConfig().reduced(), spectral="conv")  # weight norms not folded
    with pytest.raises(ValueError, match="fold the weight norms"):
        store_channels_last(generator)


def test_every_step_is_captured_at_every_batch_size(compiled_cpu):
    """The warmup's plan (what a CUDA warmup captures; on the CPU nothing is, so its ladder is set by hand): every
    stream step, the final step and the F0 step at every batch size, each step's smallest batch first (its compile);
    a call pads to the next captured batch."""
    from hift_runtime.engine import padded_batch
    from hift_torch.compiled import BATCH_SIZES, CompiledBackend

    backend = CompiledBackend(compiled_cpu.backend.manifest, compiled_cpu.constants, device="cpu")
    backend.batch_sizes = BATCH_SIZES
    backend.f0_step_sizes = (3, 2, 1)
    plan = backend.capture_plan((24, 8, 4, 1))
    per_shape: dict[tuple[str, int], list[int]] = {}
    for kind, size, batch in plan:
        per_shape.setdefault((kind, size), []).append(batch)
    assert set(per_shape) == {("generator", 24), ("generator", 8), ("generator", 4), ("generator", 1), ("final", 4),
                              ("f0", 3), ("f0", 2), ("f0", 1)}
    assert all(batches == list(BATCH_SIZES) for batches in per_shape.values())
    assert plan[0] == ("generator", 24, 2) and plan[-1][0] == "f0"  # the compiles first, each at its smallest batch
    assert (padded_batch(9, BATCH_SIZES), padded_batch(1, BATCH_SIZES), padded_batch(300, BATCH_SIZES)) == (12, 2, 300)


def test_an_export_without_folded_weights_is_refused_by_the_compiled_engine(small_artifacts, tmp_path):
    import json
    import shutil

    folder = tmp_path / "art"
    shutil.copytree(small_artifacts.out, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["artifacts"]["folded_weights"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="folded_weights"):
        open_vocoder(folder, device="cpu", engine="compiled")
    assert open_vocoder(folder, device="cpu").backend.name.startswith("ort")  # auto falls back


def test_tampered_folded_weights_are_refused(small_artifacts, tmp_path):
    import shutil

    folder = tmp_path / "art"
    shutil.copytree(small_artifacts.out, folder)
    with open(folder / "hift_folded.pt", "ab") as fh:
        fh.write(b"x")
    with pytest.raises(ArtifactError, match="hift_folded.pt"):
        open_vocoder(folder, device="cpu", engine="compiled")


def test_a_push_whose_f0_step_wrote_its_device_row_cannot_be_undone(small_artifacts, ort_cpu):
    """The F0 step writes its caches in place: a push cancelled while it runs completes instead of stopping, and a
    push that fails after it loses its stream (its rows are ahead of its bookkeeping), never another."""
    import threading

    from hift_runtime.batching import PushScheduler
    from hift_runtime.engine import CancelToken
    from hift_runtime.streaming import StreamingVocoder

    from .test_hardening import FaultyBackend, InjectedFault

    compiled = open_vocoder(small_artifacts.out, device="cpu", engine="compiled", max_streams=4)
    backend = FaultyBackend(compiled.backend, caches_in_place=True)
    assert compiled.backend.traits.f0_caches_in_place and compiled.backend.traits.noise_positions
    backend.traits = dataclasses.replace(backend.traits, f0_caches_in_place=True, noise_positions=True)
    backend.use_noise_table = compiled.backend.use_noise_table
    vocoder = StreamingVocoder(backend, compiled.constants)
    vocoder.scheduler = PushScheduler(backend, max_batch=4, max_wait_s=0.003)
    mel = random_mel(60, seed=43)
    stream, token, outcome = vocoder.stream(), CancelToken(), []
    backend.hold = {"f0"}
    worker = threading.Thread(target=lambda: outcome.append(stream.push(mel[:, :30], token)))
    worker.start()
    assert backend.held.wait(10)
    token.cancel()
    backend.gate.set()
    worker.join(10)
    assert stream.frames_in == 30 and not stream.lost  # it ran to its end
    backend.hold = set()
    audio = np.concatenate([outcome[0], stream.finish(mel[:, 30:])])
    assert max_abs(audio, streamed(ort_cpu, mel, [30, 30])) <= TOLERANCE

    doomed, other = vocoder.stream(), vocoder.stream()
    backend.fail = {"generator"}
    with pytest.raises(InjectedFault):
        doomed.push(mel[:, :30])  # its F0 step ran, then its generator step failed
    assert doomed.lost
    backend.fail = set()
    with pytest.raises(StreamError, match="lost"):
        doomed.push(mel[:, 30:])
    got = np.concatenate([other.push(mel[:, :30]), other.finish(mel[:, 30:])])
    assert max_abs(got, streamed(ort_cpu, mel, [30, 30])) <= TOLERANCE
    vocoder.close()


def test_shared_host_buffers_give_each_graph_its_rows_then_zeros():
    """The CUDA graphs of one step shape share pinned host buffers (``HostMirrors``, one call at a time): whatever calls
    came before, a graph of batch B reads the call's rows and then zeros (slot 0, the scratch row), never rows a
    larger call left (their slots would be read and written). The buffers' logic, on plain arrays."""
    from hift_torch.capture import HostMirrors

    mirrors = HostMirrors.__new__(HostMirrors)
    mirrors.host_in = [np.zeros((16, 3), np.float32), np.zeros((16, 1), np.int64), np.zeros((16, 1), bool)]
    mirrors.dirty = 0
    rng = np.random.default_rng(0)
    for _ in range(300):
        batch = int(rng.choice([2, 4, 8, 16]))
        rows = int(rng.integers(1, batch + 1))
        values = [rng.random((rows, 3)) + 1, rng.integers(1, 99, (rows, 1)), np.ones((rows, 1), bool)]
        mirrors.write(values, rows, batch)
        for host, value in zip(mirrors.host_in, values):
            assert np.array_equal(host[:rows], value.astype(host.dtype))  # float64 values cast as torch's copy_ did
            assert not host[rows:batch].any()
        assert all(not host[mirrors.dirty:].any() for host in mirrors.host_in)


def test_side_by_side_compiles_report_each_worker_and_survive_a_failed_one():
    """A first warmup's workers: each one's seconds, None for one that failed (said with its error, from the head of
    a traceback's last line, where CUDA says what it tried to allocate: the warmup then compiles that shape itself)."""
    import sys

    from hift_torch.compile_workers import compile_side_by_side

    long_error = ("raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB. ' + "
                  "'Process 1 has 3.29 GiB memory in use. ' * 40)")
    said: list[str] = []
    seconds = compile_side_by_side({"generator:24": [sys.executable, "-c", "pass"],
                                    "final:4": [sys.executable, "-c", "import sys; sys.exit('out of memory')"],
                                    "generator:8": [sys.executable, "-c", long_error]},
                                   2, said.append)
    assert seconds["generator:24"] is not None and seconds["generator:24"] > 0 and seconds["final:4"] is None
    assert any("final:4" in m and "out of memory" in m and "the warmup compiles it" in m for m in said)
    long_said = next(m for m in said if "generator:8" in m)
    assert "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB." in long_said and len(long_said) < 800


def test_a_first_warmup_compiles_side_by_side_once(small_artifacts, tmp_path, monkeypatch):
    """The workers a first warmup runs, end to end on the CPU (where the engine runs the step eagerly): each builds
    the engine and compiles its shape. Two engines starting together compile once (the lock: the second waits, then
    finds the marker); a later start runs none."""
    import torch
    from types import SimpleNamespace

    from hift_torch.compile_workers import precompile
    from hift_runtime.manifest import read_manifest
    from hift_runtime.contract import StreamConstants

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    manifest = read_manifest(small_artifacts.out)
    engine = SimpleNamespace(manifest=manifest, constants=StreamConstants.from_manifest(manifest.config, manifest.step),
                             precision="fp32", cache_slots=8, device=torch.device("cpu"), conv_layout="channels-last",
                             compile_processes=2, final_window_frames=28,
                             final_frames=28, step_window_frames=None, generator_graph_sizes=tuple)
    said: list[str] = []
    # No stream step sizes: the final step's worker alone (its window).
    markers = run_in_threads(lambda _: precompile(engine, (), said.append), range(2), timeout=300)
    assert markers[0] == markers[1] and markers[0].exists()
    assert sum("first start" in m for m in said) == 1, said
    assert sum("final:28 compiled in a process of its own" in m for m in said) == 1, said
    said.clear()
    assert precompile(engine, (), said.append) == markers[0] and said == []


def test_choosing_threads_deal_the_shapes_and_capture_where_they_chose():
    """cuDNN keeps its choices per thread, so each generator or final shape is captured in the thread that chose its
    algorithms; the shapes are dealt round the threads largest first; the F0 step (no cuDNN) stays in the caller."""
    import threading

    import torch

    from hift_torch.cudnn import ChoosingThreads

    shapes = [("generator", 24, 2), ("generator", 24, 256), ("generator", 8, 64), ("final", 28, 2), ("f0", 24, 2)]
    threads = ChoosingThreads(torch.device("cpu"), shapes, 2)
    chose: dict[tuple, str] = {}
    try:
        for future in threads.choose(lambda group: chose.update({s: threading.current_thread().name for s in group})):
            future.result()
        assert threads.groups == [[("generator", 24, 256), ("final", 28, 2)],
                                  [("generator", 8, 64), ("generator", 24, 2)]]
        assert len(set(chose.values())) == 2 and ("f0", 24, 2) not in chose
        for shape in shapes:
            ran = threads.run(shape, lambda: threading.current_thread().name)
            assert ran == chose.get(shape, threading.current_thread().name), shape
    finally:
        threads.close()
    lone = ChoosingThreads(torch.device("cpu"), shapes[:1], 8)  # never more threads than shapes
    lone.close()
    assert len(lone.groups) == 1


def test_a_failed_choosing_thread_is_reported_and_leaves_no_activations_behind():
    """A choosing thread that fails (out of device memory, say) is said in one line, and its error no longer holds
    the failed eager step's tensors: held by its traceback's frames, they stayed allocated through the captures
    (a third hift-serve process on an 80 GB H100 died capturing)."""
    import concurrent.futures
    import weakref

    import torch

    from hift_torch.cudnn import ChoosingThreads, failed_choices

    threads = ChoosingThreads(torch.device("cpu"), [("generator", 24, 2), ("generator", 24, 4)], 2)
    activations: list[weakref.ref] = []

    def choose_for(group: list[tuple[str, int, int]]) -> None:
        held = torch.zeros(1024)
        activations.append(weakref.ref(held))
        if group[0][2] == 4:
            try:
                raise MemoryError("the step's first try")
            except MemoryError:
                raise RuntimeError("CUDA out of memory. Tried to allocate 212.00 MiB.\nthe rest") from None

    try:
        choosing = threads.choose(choose_for)
        concurrent.futures.wait(choosing)
        assert failed_choices(choosing, threads.groups) == (
            "1 step shapes (1 of 2 threads failed; the first: RuntimeError: CUDA out of memory. Tried to allocate "
            "212.00 MiB.)")
        assert len(activations) == 2 and all(ref() is None for ref in activations)
        assert choosing[0].exception().__traceback__ is None
    finally:
        threads.close()


def test_the_choosing_threads_default_to_what_the_device_memory_holds():
    from hift_runtime.options import CompiledOptions
    from hift_torch.cudnn import CUDNN_THREAD_BYTES, cudnn_threads_for_memory

    assert cudnn_threads_for_memory(0) == 1 and cudnn_threads_for_memory(3 * CUDNN_THREAD_BYTES + 1) == 3
    assert cudnn_threads_for_memory(135 << 30) == 8  # an H200's free memory: the default's eight
    assert cudnn_threads_for_memory(135 << 30, at_most=1) == 1
    # An H100's free memory while five compile workers start beside the warmup: room is left for them.
    assert cudnn_threads_for_memory(79 << 30, others_bytes=5 * (5 << 30)) == 6
    assert cudnn_threads_for_memory(10 << 30, others_bytes=25 << 30) == 1
    # tf32 and fp32 steps hold 4-byte activations: half as many threads.
    assert cudnn_threads_for_memory(79 << 30, activation_bytes=4) == 4
    assert cudnn_threads_for_memory(79 << 30, others_bytes=5 * (5 << 30), activation_bytes=4) == 3
    with pytest.raises(ValueError, match="cudnn_threads must be >= 1"):
        CompiledOptions(cudnn_threads=0)


def test_cudnn_chooses_by_its_heuristic_mode_b_unless_the_environment_says_otherwise(compiled_cpu, monkeypatch):
    """cuDNN's heuristic mode B in every precision (as fast under load as its benchmark, a shorter start): the
    variable torch reads set for it unless the environment says otherwise; the choice named in the warmup's words;
    cuDNN's benchmark switch off."""
    import torch

    import hift_torch.compiled as compiled

    manifest, constants = compiled_cpu.backend.manifest, compiled_cpu.constants
    monkeypatch.setenv(compiled.HEURISTIC_MODE_B_ENV, "")  # (recorded, so what the test sets is undone after it)
    monkeypatch.delenv(compiled.HEURISTIC_MODE_B_ENV)
    asked = compiled.CompiledBackend(manifest, constants, device="cpu", compile=False)
    assert not asked.heuristic_mode_b and compiled.HEURISTIC_MODE_B_ENV not in os.environ  # (no cuDNN on the CPU)
    assert compiled.use_heuristic_mode_b() and os.environ[compiled.HEURISTIC_MODE_B_ENV] == "1"
    assert asked.cudnn_choice() == "its heuristic mode B"
    monkeypatch.setenv(compiled.HEURISTIC_MODE_B_ENV, "0")  # the environment's word is kept, and said
    assert not compiled.use_heuristic_mode_b()
    assert asked.cudnn_choice() == f"its instant heuristics: {compiled.HEURISTIC_MODE_B_ENV}='0'"
    asked.on_cuda = True
    with asked.precision_scope():
        assert torch.backends.cudnn.benchmark is False


def test_the_compiled_graphs_take_the_cache_pool_at_any_slot_count(compiled_cpu):
    """The cache pool the compiled graphs read and write has dynamic rows where the engine compiles, so that one
    compile in inductor's cache serves every slot count (static, each slot count compiled anew: BENCHMARKS.md).
    Nothing is marked where the step runs eagerly. (The compile itself is too slow for CI: the GPU test
    test_a_start_at_another_slot_count_loads_its_graphs_from_the_cache runs it.)"""
    from hift_torch.compiled import CompiledBackend

    manifest, constants = compiled_cpu.backend.manifest, compiled_cpu.constants
    compiling = CompiledBackend(manifest, constants, device="cpu", compile=True, slots=8)
    assert compiling._generator_rows.pool._dynamo_weak_dynamic_indices == {0}
    eager = CompiledBackend(manifest, constants, device="cpu", compile=False, slots=8)
    assert not hasattr(eager._generator_rows.pool, "_dynamo_weak_dynamic_indices")


def test_the_step_window_is_fp32s_default_where_cuda_graphs_are_captured(compiled_cpu):
    """The stream step's window: the precision's (on in fp32, off in tf32 and fp16: measured there to cost device
    time per row), and only where CUDA graphs are captured (the CPU runs a graph per step size); an explicit value
    (tests, tools) wins."""
    import hift_torch.compiled as compiled

    assert compiled.STEP_WINDOW == {"fp32": True, "tf32": False, "fp16": False}
    manifest, constants = compiled_cpu.backend.manifest, compiled_cpu.constants
    assert compiled.CompiledBackend(manifest, constants, device="cpu", compile=False).step_window_frames is None
    asked = compiled.CompiledBackend(manifest, constants, device="cpu", compile=False, step_window=True)
    assert asked.step_window_frames == compiled.STEP_WINDOW_FRAMES == 24  # 24-frame chunks unpadded


@pytest.mark.parametrize("fail", [False, True])
def test_warmup_loads_graphs_while_threads_choose_and_captures_in_the_choosers(small_artifacts, monkeypatch, fail):
    """The warmup's order on a stand-in device (the CPU playing CUDA, captures recorded): the choosing threads start,
    the warmup's thread makes each graph's first call meanwhile, then every shape is captured, a generator or final
    shape in the thread that chose for it. A thread whose choosing fails (out of memory) is said; its shapes are
    captured all the same (the captures then choose). All of it under the short GIL switch interval, the process's
    own back after."""
    import sys
    import threading

    import torch

    import hift_torch.compiled as compiled
    from hift_runtime.contract import StreamConstants
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.options import CompiledOptions
    from hift_runtime.process_tuning import HANDOFF_SWITCH_INTERVAL_S

    manifest = read_manifest(small_artifacts.out)
    backend = compiled.CompiledBackend(manifest, StreamConstants.from_manifest(manifest.config, manifest.step),
                                       device="cpu", compile=False, slots=4,
                                       options=CompiledOptions(cudnn_threads=2))
    backend.use_noise_table(NoiseTable.seeded(0, 4096, backend.constants.num_sines))
    backend.on_cuda = backend.cuda_graphs = True  # the warmup's CUDA path, its device calls stood in for below
    events: list[tuple[str, str, tuple]] = []
    real_choose = backend._choose_for

    def choose_for(group):
        events.append(("chose", threading.current_thread().name, tuple(group)))
        intervals.append(sys.getswitchinterval())
        if fail and ("final", backend.final_frames, 1) in group:
            raise RuntimeError("CUDA out of memory")
        real_choose(group)

    def captured(fn, example, pool, mirrors):
        events.append(("captured", threading.current_thread().name, tuple(t.shape for t in example)))
        fn(*example)
        return threading.current_thread().name

    monkeypatch.setattr(backend, "_choose_for", choose_for)
    monkeypatch.setattr(backend, "compile_shape", lambda kind, size: events.append(
        ("first call", threading.current_thread().name, (kind, size))) or intervals.append(sys.getswitchinterval())
        or 0.0)
    monkeypatch.setattr(compiled, "CapturedCall", captured)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    said: list[str] = []
    intervals: list[float] = []
    own = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default
    try:
        backend.warmup((24, 8), progress=said.append)
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(own)
    assert len(intervals) == 2 + 3 and all(i == pytest.approx(HANDOFF_SWITCH_INTERVAL_S) for i in intervals)

    main = threading.current_thread().name
    chose = {shape: name for kind, name, group in events if kind == "chose" for shape in group}
    assert sorted(chose) == [("final", backend.final_frames, 1), ("generator", 8, 1), ("generator", 24, 1)]
    assert len(set(chose.values())) == 2 and main not in chose.values()
    assert [e[2] for e in events if e[0] == "first call"] == [("generator", 24), ("generator", 8),
                                                               ("final", backend.final_frames)]
    assert all(e[1] == main for e in events if e[0] == "first call")
    for shape, graph in backend._graphs.items():
        assert graph == chose.get(shape, main), shape  # captured where chosen; F0 in the warmup's thread
    assert len(backend._graphs) == 3 + 2  # the three steps, F0 at 24 and 8 frames (one batch size on the CPU)
    if fail:
        assert any("not chosen beforehand for 2 step shapes (1 of 2 threads failed; the first: RuntimeError: CUDA "
                   "out of memory); their captures choose them" in m for m in said), said
    else:
        assert any("chosen for 3 step shapes in 2 threads" in m for m in said), said
    assert said[0] == (f"warmup: choosing cuDNN's algorithms ({backend.cudnn_choice()}) for 3 step shapes in 2 threads; "
                       "the step graphs are loaded (or compiled) meanwhile")
    assert "first calls" in said[-1] and backend.first_call_seconds.keys() == {"generator:24", "generator:8",
                                                                               f"final:{backend.final_frames}"}


def test_each_worker_s_graph_is_loaded_as_soon_as_it_is_compiled():
    """A first start loads each worker's graph in the warmup's thread as that worker is done, while the others still
    compile; a load that fails is said (the warmup makes that call again after), and a failed worker's is not made."""
    import sys
    import threading

    from hift_torch.compile_workers import compile_side_by_side

    quick, slow = [sys.executable, "-c", "pass"], [sys.executable, "-c", "import time; time.sleep(2)"]
    said: list[str] = []
    loads: list[tuple[str, str, int]] = []

    def when_compiled(name: str) -> None:
        loads.append((name, threading.current_thread().name, sum("compiled in a process" in m for m in said)))
        if name == "b":
            raise RuntimeError("out of memory")

    seconds = compile_side_by_side({"a": quick, "b": quick, "slow": slow,
                                    "bad": [sys.executable, "-c", "import sys; sys.exit(1)"]}, 4, said.append,
                                   when_compiled=when_compiled)
    assert seconds["bad"] is None and all(seconds[n] is not None for n in ("a", "b", "slow"))
    assert sorted(name for name, _, _ in loads) == ["a", "b", "slow"]
    assert all(thread == threading.current_thread().name for _, thread, _ in loads)
    assert {name: done for name, _, done in loads}["a"] < 3  # before the slow worker was done
    assert any("the first call of b beside the workers failed (RuntimeError: out of memory); the workers go on" in m
               for m in said), said


def test_the_warm_marker_names_what_the_graphs_depend_on(small_artifacts, tmp_path, monkeypatch):
    import torch
    from types import SimpleNamespace

    from hift_torch.compile_workers import warm_marker
    from hift_runtime.manifest import read_manifest

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    base = dict(manifest=read_manifest(small_artifacts.out), precision="fp16", cache_slots=2048,
                device=torch.device("cpu"), conv_layout="channels-last", final_window_frames=28,
                step_window_frames=None)
    marker = warm_marker(SimpleNamespace(**base), (24, 8, 4, 1))
    assert marker.parent == tmp_path / "hift" and marker == warm_marker(SimpleNamespace(**base), (24, 8, 4, 1))
    others = [warm_marker(SimpleNamespace(**{**base, key: value}), (24, 8, 4, 1))
              for key, value in (("precision", "tf32"), ("conv_layout", "channels-first"),
                                 ("final_window_frames", None), ("step_window_frames", 24))]
    others.append(warm_marker(SimpleNamespace(**base), (24, 8)))
    assert len({marker, *others}) == 6
    # not the slots: the graphs take the pool's rows as a dynamic size (one cache for every slot count)
    assert warm_marker(SimpleNamespace(**{**base, "cache_slots": 3100}), (24, 8, 4, 1)) == marker


def test_workers_start_with_a_python_even_inside_an_embedding_process(monkeypatch):
    """In Triton's Python-backend stub sys.executable may name the stub: the workers then use the python3 on PATH."""
    import os
    import sys

    from hift_torch import compile_workers

    assert compile_workers.python_executable() == sys.executable
    monkeypatch.setattr(sys, "executable", "/opt/tritonserver/backends/python/triton_python_backend_stub")
    found = compile_workers.python_executable()
    assert os.path.basename(found).startswith("python") and os.access(found, os.X_OK)


def generator_call_threads(backend) -> list[str]:
    """The names of the threads that make ``backend``'s generator calls from now on, in order (appended as they come)."""
    import threading

    threads: list[str] = []
    step = backend.generator_step

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return step(*args)

    backend.generator_step = recorded
    return threads


def test_inline_lone_calls_run_in_the_scheduling_thread_and_change_no_audio(small_artifacts, ort_cpu):
    """The scheduler's inline_lone_calls over the compiled engine: a quiet lone push's calls run in the scheduling
    thread (the scheduler's own, or the event loop's); every stream equals the ORT engine's, alone and concurrent,
    threaded and loop-driven. (Quiet from the first push on: inline_quiet_s 0, so back-to-back pushes inline too.)"""
    import asyncio
    import threading

    vocoder = open_vocoder(small_artifacts.out, device="cpu", engine="compiled", batching=True, max_wait_ms=5)
    scheduler, backend = vocoder.scheduler, vocoder.backend
    assert not scheduler.inline_lone_calls  # off by default on the CPU (its eager calls are long)
    scheduler.inline_lone_calls, scheduler.inline_quiet_s = True, 0.0
    threads = generator_call_threads(backend)
    mels = [random_mel(90, seed=80 + i) for i in range(5)]
    want = [streamed(ort_cpu, m, [24] * 3 + [500]) for m in mels]
    try:
        assert max_abs(streamed(vocoder, mels[0], [24] * 3 + [500]), want[0]) <= TOLERANCE
        assert threads and set(threads) == {"hift-scheduler"}, threads
        threads.clear()
        got = run_in_threads(lambda i: streamed(vocoder, mels[i], [24] * 3 + [500]), range(1, 5))
        assert all(max_abs(g, w) <= TOLERANCE for g, w in zip(got, want[1:]))

        async def lone() -> np.ndarray:
            scheduler.attach_loop(asyncio.get_running_loop())
            try:
                stream = vocoder.stream()
                pieces = [await stream.apush(mels[0][:, k:k + 24]) for k in range(0, 90, 24)]
                return np.concatenate(pieces + [await stream.afinish()])
            finally:
                scheduler.detach_loop()

        threads.clear()
        assert max_abs(asyncio.run(lone()), want[0]) <= TOLERANCE
        assert set(threads) == {threading.main_thread().name}, threads  # the loop's thread
    finally:
        vocoder.close()
    assert backend.slots_in_use == 0


def test_only_quiet_lone_pushes_are_inlined(small_artifacts):
    """Under load a call made in the scheduling thread would hold up the pushes arriving behind it: a push is
    inlined only if it arrived alone and nothing settled in the inline_quiet_s before it. Back to back, a stream's
    first push is quiet and its next ones are not; the default is the backend's (on for CUDA graphs)."""
    from hift_runtime.batching import PushScheduler
    from hift_runtime.engine import EngineTraits

    vocoder = open_vocoder(small_artifacts.out, device="cpu", engine="compiled", batching=True)
    scheduler, backend = vocoder.scheduler, vocoder.backend
    scheduler.inline_lone_calls, scheduler.inline_quiet_s = True, 60.0
    threads = generator_call_threads(backend)
    try:
        stream = vocoder.stream()
        mel = random_mel(72, seed=5)
        for k in range(0, 72, 24):
            stream.push(mel[:, k:k + 24])
        stream.close()
    finally:
        vocoder.close()
    assert threads[0] == "hift-scheduler" and all(t.startswith("hift-batch-call") for t in threads[1:]), threads

    class ShortCalls:
        traits = EngineTraits(inline_lone_calls=True, calls_from_any_thread=True)

    with_default = PushScheduler(ShortCalls())  # type: ignore[arg-type]
    try:
        assert with_default.inline_lone_calls
    finally:
        with_default.close()


@pytest.mark.parametrize("final", [False, True])
def test_a_padding_row_of_a_window_stays_in_bounds(reduced_config, final):
    """A CUDA graph's padding rows are zeros, their frames 0 among them: the step in a window still indexes inside its
    tensors there (on the GPU an index out of bounds is undefined: garbage or a fault; eager CUDA graphs on an H200
    hit ATen's device assert), and the real rows are the same as beside a full row."""
    import torch

    from hift_model import load_hift
    from hift_model.step import generator_cache_layout, generator_step

    gen = load_hift(None, config=reduced_config, spectral="conv").generator
    spf, sines = reduced_config.samples_per_frame, reduced_config.num_sines
    window = 28 if final else 24
    look, ahead = (0, 0) if final else (reduced_config.conv_pre_look_right, 1)
    torch.manual_seed(1)
    mel = torch.randn(2, reduced_config.in_channels, window + look) - 4
    mel[0] = 0
    f0 = torch.rand(2, window + ahead) * 300
    f0[0] = 0
    noise = torch.randn(2, (window + ahead) * spf, sines)
    phase = torch.zeros(2, sines, dtype=torch.float64)
    caches = {e["name"]: torch.randn(2, *e["shape"]) for e in generator_cache_layout(reduced_config)}
    caches = {k: torch.where(torch.arange(2).reshape(-1, *[1] * (v.dim() - 1)) == 0, 0.0, v) for k, v in caches.items()}
    flags = torch.zeros((2, 1), dtype=torch.bool)
    with torch.no_grad():
        padded = generator_step(gen, mel, f0, noise, phase, flags, caches, final, frames=torch.tensor([0, 7]))
        beside_full = generator_step(gen, mel, f0, noise, phase, flags, caches, final, frames=torch.tensor([window, 7]))
    samples = (8 if final else 7) * spf
    assert torch.equal(padded[0][1, :samples], beside_full[0][1, :samples])
    assert bool(torch.isfinite(padded[0]).all())


def test_an_eager_call_is_not_launched_from_the_scheduling_thread(compiled_cpu):
    """A shape without a captured graph runs eagerly and waits for its outputs: a launch that must not wait
    (``wait=False``, the scheduler's) is refused, so the device thread makes it; waited for, it equals the step."""
    backend = compiled_cpu.backend
    assert not backend.traits.launches_ahead  # no CUDA graphs on the CPU: the scheduler never launches here
    assert not backend.traits.f0_lane  # nor runs F0 calls beside the generator's (no CUDA streams)
    mel = random_mel(8 + backend.constants.f0_look_ahead, seed=3)[None]
    fresh, again = backend.new_caches("f0"), backend.new_caches("f0")  # (their rows go back when collected)
    assert backend.launch_f0_step(mel, fresh, wait=False) is None
    launched = backend.launch_f0_step(mel, fresh)
    assert launched is not None
    f0, caches = launched.result()
    assert caches is fresh and np.array_equal(f0, backend.f0_step(mel, again)[0])


def test_a_first_call_that_fails_beside_the_choosing_threads_is_made_again_after_them():
    """Warmup's first call of a graph runs while cuDNN's choosing threads hold most of the device's memory: one that
    fails there (a warm tf32 start on an H100 died of ``CUDNN_STATUS_INTERNAL_ERROR``) is said and made again once
    the threads are done; without the threads the error is the warmup's."""
    from hift_torch.compiled import first_calls_or_deferred

    calls, said = [], []

    def first_call(kind, size):
        calls.append((kind, size))
        if (kind, size) == ("generator", 8):
            raise RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR\nthe rest")

    units = [("generator", 25), ("generator", 8), ("final", 29)]
    assert first_calls_or_deferred(units, first_call, said.append, beside_threads=True) == [("generator", 8)]
    assert calls == units
    assert said == ["warmup: the first call of generator:8 failed beside cuDNN's choosing threads (RuntimeError: "
                    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR); it is made again once they are done"]
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_INTERNAL_ERROR"):
        first_calls_or_deferred(units, first_call, said.append, beside_threads=False)
