"""The stock-Triton repository on a real tritonserver: Triton 2.51 (r24.10) with its onnxruntime backend, built
against ONNX Runtime 1.19.2 by ``../shared/tools/real-triton/build.sh`` into ``REAL_TRITON_HOME`` (``.ci/run`` builds
it). The repositories are written by ``hift-export --triton-repo`` (the reduced export's) and by ``write_triton_repository``
unchanged; the clients are the project's own. Skipped where no such build is named.

Untested here: a GPU Triton (none is available); the repository's ``KIND_AUTO`` instance would take a GPU there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from hift_runtime import open_vocoder, wire
from hift_runtime.manifest import read_manifest

from .conftest import FIXTURES, max_abs, run_in_threads
from .test_serve import _free_ports
from .test_streaming import random_mel

HOME = os.environ.get("REAL_TRITON_HOME", "")
SERVE = FIXTURES.parent / "tools" / "real-triton" / "serve.sh"
pytestmark = pytest.mark.skipif(
    not HOME or not os.path.isfile(os.path.join(HOME, "backends", "onnxruntime", "libtriton_onnxruntime.so"))
    or not SERVE.is_file(), reason="no real tritonserver build (REAL_TRITON_HOME, ../shared/tools/real-triton)")

STREAMS, IDLE_S, START_TIMEOUT_S, MAX_CHUNK = 8, 3.0, 0.5, 64
TOLERANCE = 1e-6  # the offline pass's own tolerance for streamed audio (test_triton_repo.py)


@contextlib.contextmanager
def served(repo, log):
    """A real tritonserver on ``repo``; yields its gRPC address and its HTTP URL."""
    http, grpc, metrics = _free_ports(3)
    started = subprocess.run(["bash", str(SERVE), str(repo), str(http), str(grpc), str(metrics), str(log)],
                             env={**os.environ, "WAIT_READY": "120"}, capture_output=True, text=True, timeout=180)
    pid = int(started.stdout.strip().splitlines()[0]) if started.stdout.strip() else None
    try:
        assert started.returncode == 0, (started.stderr + log.read_text(errors="replace"))[-3000:]
        yield f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}"
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            for _ in range(200):  # it unloads the model and exits within its 15 s exit timeout
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)


@pytest.fixture(scope="module")
def triton(small_artifacts, tmp_path_factory):
    """A real tritonserver on a repository with short timings for these tests (8 streams, 3 s idle time, 0.5 s START
    timeout, 64-frame chunks); yields ``(grpc address, log path, HTTP URL)``."""
    from hift_export.triton_repo import write_triton_repository

    folder = tmp_path_factory.mktemp("real-triton")
    write_triton_repository(read_manifest(small_artifacts.out), folder / "repo", max_streams=STREAMS,
                            idle_us=int(IDLE_S * 1e6), start_timeout_us=int(START_TIMEOUT_S * 1e6),
                            max_chunk_frames=MAX_CHUNK, log=lambda _: None)
    with served(folder / "repo", folder / "triton.log") as (address, http):
        yield address, folder / "triton.log", http


@pytest.fixture(scope="module")
def local(small_artifacts):
    return open_vocoder(small_artifacts.out, device="cpu")


def _client(triton):
    from hift_runtime.client import ServerClient

    return ServerClient(triton[0])


def _raw(triton, stream_id, mel, start=False, end=False, dtype="FP32"):
    """A request as any tritonclient user sends it (no checks of ours on the way)."""
    import tritonclient.grpc as g

    tensor = g.InferInput(wire.MEL, [1, *mel.shape], dtype)
    tensor.set_data_from_numpy(mel[None])
    return g.InferenceServerClient(triton[0]).infer(wire.MODEL_NAME, [tensor], sequence_id=stream_id,
                                                    sequence_start=start, sequence_end=end)


def test_the_exported_repository_serves_hift_vocode_exactly(small_artifacts, local, tmp_path):
    """``hift-export --triton-repo``'s repository (the reduced export's, written by the CLI), unchanged, on a Triton
    without GPUs; ``hift-vocode --server`` streams through it what it makes in process."""
    from hift_runtime.cli import main

    mel = random_mel(230, seed=4)
    np.save(tmp_path / "mel.npy", mel)
    log = tmp_path / "triton.log"
    with served(small_artifacts.out.parent / "triton-repo", log) as (address, _):
        assert "hift_vocoder_0_0 (CPU device 0)" in log.read_text(errors="replace")
        assert main(["--mel", str(tmp_path / "mel.npy"), "--server", address, "--chunks", "50,100,200",
                     "--out", str(tmp_path / "served.npy")]) == 0
    assert max_abs(np.load(tmp_path / "served.npy").reshape(-1), local.vocode(mel)) <= TOLERANCE


def test_the_clients_tell_the_stock_model_apart(triton, local):
    """gRPC and HTTP alike: the client reads the stock model's constants from its config and streams exactly."""
    from hift_runtime.client import TRITON_SEQUENCE, ServerClient

    mel = random_mel(60, seed=12)
    for url in (triton[0], triton[2]):
        client = ServerClient(url)
        model = client.model
        assert model.kind == TRITON_SEQUENCE and model.max_streams == STREAMS and model.sample_rate == 24000
        stream = client.stream()
        audio = np.concatenate([stream.push(mel[:, :25]), stream.push(mel[:, 25:], end=True)])
        assert max_abs(audio, local.vocode(mel)) <= TOLERANCE, url


def test_eight_concurrent_ragged_streams_equal_the_in_process_stream(triton, local):
    """Each request's audio is what the in-process stream's push/finish returns for the same chunk; the whole stream
    equals the offline pass with the same noise seed."""
    rng = np.random.default_rng(3)
    mels = [random_mel(int(rng.integers(40, 160)), seed=80 + i) for i in range(STREAMS)]

    def run(i: int) -> None:
        mel, client = mels[i], _client(triton)
        remote, stream, pos = client.stream(), local.stream(), 0
        while pos < mel.shape[1]:
            size = int(np.random.default_rng(i * 100 + pos).integers(1, 40))
            chunk, last = mel[:, pos:pos + size], pos + size >= mel.shape[1]
            got = remote.push(chunk, end=last)
            want = stream.finish(chunk) if last else stream.push(chunk)
            assert got.shape == want.shape and max_abs(got, want) <= TOLERANCE, (i, pos)
            pos += size
        client.close()

    run_in_threads(run, range(STREAMS), timeout=120)
    client = _client(triton)
    remote, mel = client.stream(), random_mel(100, seed=79)
    audio = np.concatenate([remote.push(mel[:, :50]), remote.push(mel[:, 50:], end=True)])
    assert max_abs(audio, local.vocode(mel)) <= TOLERANCE


def test_start_and_end_in_one_request(triton, local):
    mel = random_mel(37, seed=5)
    audio = _client(triton).stream().push(mel, end=True)
    assert audio.shape == (37 * 480,) and max_abs(audio, local.vocode(mel)) <= TOLERANCE


def test_a_refused_request_leaves_its_stream_intact(triton, local):
    """A wrong shape, a wrong dtype and an overlong chunk are refused, each in one message naming it; the stream then
    goes on as if they had never been sent."""
    from tritonclient.utils import InferenceServerException

    mel = random_mel(90, seed=6)
    client = _client(triton)
    stream = client.stream()
    first = stream.push(mel[:, :30])
    sid = stream.stream_id
    with pytest.raises(InferenceServerException, match="unexpected shape for input 'mel'"):
        _raw(triton, sid, np.zeros((79, 5), np.float32))
    with pytest.raises(InferenceServerException, match="inference input 'mel' data-type is 'FP64', but model "
                                                       "'hift_vocoder' expects 'FP32'"):
        _raw(triton, sid, np.zeros((80, 5), np.float64), dtype="FP64")
    with pytest.raises(InferenceServerException, match=f"refused: a chunk holds more than {MAX_CHUNK} frames"):
        _raw(triton, sid, np.zeros((80, MAX_CHUNK + 1), np.float32))
    rest = stream.push(mel[:, 30:], end=True)
    assert max_abs(np.concatenate([first, rest]), local.vocode(mel)) <= TOLERANCE


def test_end_without_start_is_refused(triton):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="must specify the START flag on the first request"):
        _raw(triton, "never-started", random_mel(10), end=True)


def test_the_capacity_edge_refuses_a_start_within_the_start_timeout(triton, local):
    """With every stream slot held, the next start is refused as overloaded after the START timeout (nothing
    opened); once a stream ends, a start gets its slot at once."""
    from hift_runtime.client import ServerOverloaded

    client = _client(triton)
    holders = [client.stream() for _ in range(STREAMS)]
    for h in holders:
        h.push(random_mel(10))
    t0 = time.perf_counter()
    with pytest.raises(ServerOverloaded, match=f"holds the {STREAMS} streams its repository allows"):
        client.stream().push(random_mel(10))
    waited = time.perf_counter() - t0
    assert START_TIMEOUT_S * 0.9 <= waited <= START_TIMEOUT_S + 1.5
    holders.pop().push(random_mel(5), end=True)
    mel = random_mel(20, seed=9)  # a start that found no free slot within the START timeout would be refused here
    assert max_abs(client.stream().push(mel, end=True), local.vocode(mel)) <= TOLERANCE
    for h in holders:
        h.push(random_mel(5), end=True)


def test_a_stream_never_ended_expires_and_its_slot_is_reused(triton):
    from hift_runtime.client import ServerError

    client = _client(triton)
    abandoned = [client.stream() for _ in range(STREAMS)]
    for s in abandoned:
        s.push(random_mel(10))
    time.sleep(IDLE_S + 1.0)  # Triton's reaper releases them after the idle time
    fresh = [client.stream() for _ in range(STREAMS)]
    for s in fresh:  # each start gets a released slot (one that waited past the START timeout would be refused)
        s.push(random_mel(10))
    with pytest.raises(ServerError, match="must specify the START flag"):
        abandoned[0].push(random_mel(5), end=True)
    for s in fresh:
        s.push(random_mel(5), end=True)


def test_a_start_that_waited_in_the_backlog_then_keeps_real_time_pace(triton, local):
    """A start that found every slot held waits in Triton's backlog until one frees (within the START timeout); the
    stream then sends at real-time pace for longer than the idle time and is never force-ended."""
    from hift_runtime.client import ServerError

    client = _client(triton)
    holders = [client.stream() for _ in range(STREAMS)]
    for h in holders:
        h.push(random_mel(10))
    freeing = threading.Timer(START_TIMEOUT_S / 2, lambda: holders[0].push(random_mel(5), end=True))
    freeing.start()
    mel = random_mel(24 * 8, seed=10)
    stream, pieces = client.stream(), []
    t0 = time.perf_counter()
    pieces.append(stream.push(mel[:, :24]))
    assert time.perf_counter() - t0 >= START_TIMEOUT_S / 2 * 0.9  # it waited for the slot
    freeing.join()
    for k in range(1, 8):  # 24 frames every 0.48 s: 3.4 s, past the 3 s idle time counted from the start's arrival
        time.sleep(0.48)
        pieces.append(stream.push(mel[:, 24 * k:24 * (k + 1)], end=k == 7))
    assert max_abs(np.concatenate(pieces), local.vocode(mel)) <= TOLERANCE
    for h in holders[1:]:  # silent for longer than the idle time meanwhile: released by Triton
        with pytest.raises(ServerError, match="must specify the START flag"):
            h.push(random_mel(5), end=True)
