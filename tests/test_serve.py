"""The streaming endpoint: the stream table (any server's logic, no Triton) and a live ``hift-serve`` on localhost
(Triton through PyTriton, reduced config) driven by the client and by ``hift-vocode --server``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from hift_runtime import wire
from hift_runtime.serving import ChunkRequest, StreamTable

from .conftest import ROOT, max_abs, run_in_threads

# Streamed vs one offline pass is exact to float32 rounding (<= 6e-7 over every schedule, test_streaming.py); the
# server adds no arithmetic, so the same bound holds through it.
SERVED_TOLERANCE = 1e-6


def _mel(rng: np.random.Generator, frames: int) -> np.ndarray:
    return (rng.standard_normal((80, frames)) - 4.0).astype(np.float32)


def _chunks(mel: np.ndarray, size: int) -> list[np.ndarray]:
    return [mel[:, i:i + size] for i in range(0, mel.shape[1], size)]


@pytest.fixture(scope="module")
def vocoder(small_artifacts):
    from hift_runtime import open_vocoder

    return open_vocoder(small_artifacts.out, device="cpu", batching=True, max_streams=6, idle_timeout_s=30)


# ---- the stream table ---------------------------------------------------------------------------------------------
def test_table_serves_interleaved_streams_like_offline_and_refuses_bad_requests_alone(vocoder):
    rng = np.random.default_rng(3)
    table = StreamTable(vocoder, workers=8)
    mels = {f"s{i}": _mel(rng, 30 + 11 * i) for i in range(3)}
    chunks = {sid: _chunks(m, 16) for sid, m in mels.items()}
    audio: dict[str, list[np.ndarray]] = {sid: [] for sid in mels}
    for step in range(max(len(c) for c in chunks.values())):
        batch = [ChunkRequest(sid, c[step], start=step == 0, end=step == len(c) - 1)
                 for sid, c in chunks.items() if step < len(c)]
        # Refused requests ride in the same batch: an unknown id, and a NaN chunk of an open stream.
        batch += [ChunkRequest("ghost", mels["s0"][:, :4]), ChunkRequest("s2", np.full((80, 3), np.nan, np.float32))]
        replies = table.handle(batch)
        for request, reply in zip(batch[:-2], replies):
            assert reply.error == "", reply.error
            audio[request.stream_id].append(reply.audio)
        assert "unknown stream id" in replies[-2].error and replies[-2].audio.size == 0
        assert ("non-finite" if step < len(chunks["s2"]) - 1 else "ended") in replies[-1].error
    for sid, mel in mels.items():
        assert max_abs(np.concatenate(audio[sid]), vocoder.vocode(mel)) <= SERVED_TOLERANCE
    # A chunk after end is told so; the table forgot the ended streams.
    reply = table.handle([ChunkRequest("s0", mels["s0"][:, :4])])[0]
    assert "ended" in reply.error and "start a new stream" in reply.error
    assert table.open_streams == 0
    table.close()


def test_table_keeps_each_streams_order_within_one_batch(vocoder):
    rng = np.random.default_rng(4)
    mel = _mel(rng, 40)
    table = StreamTable(vocoder, workers=4)
    parts = _chunks(mel, 10)
    replies = table.handle([ChunkRequest("a", p, start=i == 0, end=i == len(parts) - 1) for i, p in enumerate(parts)])
    assert all(r.error == "" for r in replies)
    assert max_abs(np.concatenate([r.audio for r in replies]), vocoder.vocode(mel)) <= SERVED_TOLERANCE
    table.close()


def test_submitted_batches_answer_each_request_once_in_stream_order(vocoder):
    """``submit`` (the Python-backend front end's path): returns at once; each request is answered by the callback
    exactly once, a stream's chunks in order across batches submitted back to back, a refusal alone."""
    rng = np.random.default_rng(5)
    mels = {sid: _mel(rng, 30) for sid in ("a", "b")}
    parts = {sid: _chunks(m, 10) for sid, m in mels.items()}
    table = StreamTable(vocoder, workers=4)
    answers: dict[tuple[int, int], object] = {}
    done = threading.Semaphore(0)

    def on_reply(batch: int):
        def record(i: int, reply) -> None:
            answers[(batch, i)] = reply
            done.release()
        return record

    batches = [[ChunkRequest(sid, parts[sid][k], start=k == 0, end=k == 2) for sid in ("a", "b")] for k in range(3)]
    batches[1].append(ChunkRequest("nobody", mels["a"][:, :4]))
    for n, batch in enumerate(batches):
        table.submit(batch, on_reply(n))
    for _ in range(sum(len(b) for b in batches)):
        assert done.acquire(timeout=120)
    assert len(answers) == 7 and "unknown stream id" in answers[(1, 2)].error
    for j, sid in enumerate(("a", "b")):
        audio = np.concatenate([answers[(n, j)].audio for n in range(3)])
        assert max_abs(audio, vocoder.vocode(mels[sid])) <= SERVED_TOLERANCE
    table.close()


def test_batches_served_at_once_take_a_streams_requests_one_at_a_time(vocoder):
    """Two Triton instances can hand the table batches with requests of the same stream at once: they wait for each
    other (never refused as overlapping calls) and the stream emits every frame exactly once."""
    rng = np.random.default_rng(5)
    table = StreamTable(vocoder, workers=4)
    mel = _mel(rng, 8 * 20)
    first = table.handle([ChunkRequest("a", mel[:, :8], start=True)])[0]
    assert first.error == ""
    chunks = _chunks(mel[:, 8:], 8)
    barrier = threading.Barrier(2)

    def sender(part):
        barrier.wait()
        return [table.handle([ChunkRequest("a", c)])[0] for c in part]

    replies = run_in_threads(sender, [chunks[0::2], chunks[1::2]])
    assert all(r.error == "" for rs in replies for r in rs), [r.error for rs in replies for r in rs]
    tail = table.handle([ChunkRequest("a", mel[:, :0], end=True)])[0]
    assert tail.error == ""
    total = first.audio.size + sum(r.audio.size for rs in replies for r in rs) + tail.audio.size
    assert total == mel.shape[1] * 480  # every frame's audio exactly once
    assert table.open_streams == 0
    table.close()


def test_table_refuses_starts_over_the_limit_and_a_refused_first_chunk_opens_nothing(vocoder):
    table = StreamTable(vocoder, workers=8)
    mel = np.full((80, 3), -4.0, np.float32)
    assert "channels" in table.handle([ChunkRequest("new", mel[:70], start=True)])[0].error
    assert table.open_streams == 0 and vocoder.open_streams == 0  # the refused first chunk took no slot
    replies = table.handle([ChunkRequest(f"o{i}", mel, start=True) for i in range(8)])
    refused = [r.error for r in replies if r.error]
    assert len(refused) == 8 - vocoder.max_streams
    assert all(e.startswith(wire.OVERLOADED) and "max_streams" in e for e in refused)  # what the client tells apart
    assert "is open" in table.handle([ChunkRequest("o0", mel, start=True)])[0].error
    assert table.open_streams == vocoder.max_streams
    table.handle([ChunkRequest(f"o{i}", mel, end=True) for i in range(8)])
    assert table.open_streams == 0
    table.close()


def test_a_sharded_stream_refused_for_room_starts_on_the_next_server_and_stays_there():
    """A server at its --max-streams refuses a start (nothing opened there): the sharded client starts the stream
    on the next server of its hash order, and every later chunk goes there; other refusals are not retried."""
    from hift_runtime.client import ShardedClient, reply_audio

    class Refused:  # a reply whose error starts with the overload mark
        def as_numpy(self, name):
            return np.array([[f"{wire.OVERLOADED}stream 'x': 2 streams are open".encode()]], dtype=object)

    with pytest.raises(wire.ServerOverloaded):
        reply_audio(Refused())

    class FakeServer:
        def __init__(self, url: str, full: bool) -> None:
            self.url, self.full, self.calls = url, full, []

        def infer(self, stream_id, mel, start, end, offset=None, on_audio=None):
            self.calls.append((stream_id, start, end))
            if self.full and start:
                raise wire.ServerOverloaded(f"{wire.OVERLOADED}stream {stream_id!r}: 2 streams are open, the limit")
            if mel.shape[1] == 0:
                raise wire.ServerError("a refusal of another kind")
            return np.zeros(480 * mel.shape[1], np.float32), 24000

    client = ShardedClient.__new__(ShardedClient)
    client.clients = [FakeServer(f"h{i}:8001", full=False) for i in range(3)]
    order = client.servers_for("s1")
    order[0].full = True
    stream = client.stream("s1")
    assert stream.push(np.zeros((80, 2), np.float32)).shape == (960,)
    assert stream.push(np.zeros((80, 1), np.float32), end=True).shape == (480,)
    assert order[0].calls == [("s1", True, False)]  # refused once, nothing more
    assert order[1].calls == [("s1", True, False), ("s1", False, True)] and order[2].calls == []
    for server in order:
        server.full = True
    with pytest.raises(wire.ServerOverloaded, match="streams are open"):  # every server full: the last refusal
        client.stream("s2").push(np.zeros((80, 1), np.float32))
    for server in order:
        server.full = False
    with pytest.raises(wire.ServerError, match="another kind"):  # not retried elsewhere
        client.stream("s3").push(np.zeros((80, 0), np.float32))

    import asyncio

    from hift_runtime.client import AsyncShardedClient

    class FakeAsyncServer(FakeServer):  # the asyncio client's streams: the same bookkeeping, awaited
        async def infer(self, stream_id, mel, start, end, offset=None, on_audio=None):
            return FakeServer.infer(self, stream_id, mel, start, end, offset)

    aclient = AsyncShardedClient.__new__(AsyncShardedClient)
    aclient.clients = [FakeAsyncServer(f"h{i}:8001", full=False) for i in range(3)]
    aorder = aclient.servers_for("s1")
    aorder[0].full = True
    astream = aclient.stream("s1")
    assert asyncio.run(astream.push(np.zeros((80, 2), np.float32), end=True)).shape == (960,)
    assert aorder[0].calls == [("s1", True, True)] and aorder[1].calls == [("s1", True, True)]


def test_table_expires_idle_streams_with_a_clear_message(small_artifacts):
    from hift_runtime import open_vocoder

    vocoder = open_vocoder(small_artifacts.out, device="cpu", idle_timeout_s=0.05)
    table = StreamTable(vocoder, workers=2)
    mel = np.full((80, 8), -4.0, np.float32)
    assert table.handle([ChunkRequest("idle", mel, start=True)])[0].error == ""
    time.sleep(0.1)
    reply = table.handle([ChunkRequest("idle", mel)])[0]
    assert "expired" in reply.error and table.open_streams == 0
    table.close()


# ---- the live server ------------------------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def server(small_artifacts, tmp_path_factory):
    # A long step-batcher wait so the 8 test clients are seen in shared batches on a busy 2-core machine.
    yield from _live_server(small_artifacts, tmp_path_factory, ["--max-wait-ms", "20"])


@pytest.fixture(scope="module")
def second_server(small_artifacts, tmp_path_factory):
    # Two processes under one supervisor (--processes 2): process 1 on every port + 10; 4 streams a process (a test
    # sends 4 at once to process 0).
    yield from _live_server(small_artifacts, tmp_path_factory, ["--processes", "2", "--max-streams", "8"], processes=2)


def _live_server(small_artifacts, tmp_path_factory, options: list[str], processes: int = 1):
    pytest.importorskip("pytriton", reason="hift-serve needs the [serve] extra (nvidia-pytriton)")
    while True:  # free ports, and free 10 up for each further process too
        http, grpc, metrics, state = _free_ports(4)
        if processes == 1 or _all_free([p + 10 * i for p in (http, grpc, metrics, state) for i in range(1, processes)]):
            break
    if "--max-streams" not in options:  # the default is what this CPU keeps in real time: 1 on a busy 2-core machine
        options = [*options, "--max-streams", "16"]  # and a test opens 8 streams at once
    log = tmp_path_factory.mktemp("serve") / "hift-serve.log"
    cmd = [sys.executable, "-m", "hift_runtime.server", "--artifacts", str(small_artifacts.out), "--device", "cpu",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--state-metrics-port", str(state), "--max-batch", "8",
           *options, "--triton-log", str(log.with_suffix(".triton.log"))]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}  # hift-serve must set it itself
    ready_line = "ready" if processes == 1 else f"ready in {processes} processes"
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    limit_s = 120 * processes  # the processes start one after another
    deadline = time.monotonic() + limit_s
    while ready_line not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert process.poll() is None, log.read_text()[-3000:]
        assert ready_line in log.read_text(), f"hift-serve did not become ready in {limit_s} s: " + log.read_text()[-3000:]
        # The ready line comes only once the model answers ready (the endpoint a load balancer's probe uses).
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/hift_vocoder/ready", timeout=5) as ready:
            assert ready.status == 200
        yield {"grpc": f"127.0.0.1:{grpc}", "http": f"http://127.0.0.1:{http}",
               "metrics": f"http://127.0.0.1:{metrics}/metrics", "state": f"http://127.0.0.1:{state}/metrics",
               "process": process, "log": log,
               "others": [{"grpc": f"127.0.0.1:{grpc + 10 * i}", "metrics": f"http://127.0.0.1:{metrics + 10 * i}/metrics"}
                          for i in range(1, processes)]}
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _all_free(ports: list[int]) -> bool:
    """Whether hift-serve's own busy-port check would pass these ports."""
    from hift_runtime.server_cli import busy_port

    return busy_port("127.0.0.1", {str(port): port for port in ports}) is None


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and 'model="hift_vocoder"' in line)


def test_live_server_streams_8_concurrent_utterances_exactly_in_shared_batches(server, small_artifacts, vocoder):
    from hift_runtime.client import ServerClient

    rng = np.random.default_rng(8)
    mels = [_mel(rng, 40 + 9 * i) for i in range(8)]
    barrier = threading.Barrier(8)

    def run(i: int) -> np.ndarray:
        client = ServerClient(server["grpc"] if i % 2 else server["http"])
        stream = client.stream(f"utt-{i}")
        parts = _chunks(mels[i], 12)
        barrier.wait()
        audio = np.concatenate([stream.push(p, end=k == len(parts) - 1) for k, p in enumerate(parts)])
        client.close()
        return audio

    results = run_in_threads(run, range(8), timeout=300)
    for i, mel in enumerate(mels):
        assert max_abs(results[i], vocoder.vocode(mel)) <= SERVED_TOLERANCE
    metrics = urllib.request.urlopen(server["metrics"], timeout=10).read().decode()
    requests, executions = _metric(metrics, "nv_inference_count"), _metric(metrics, "nv_inference_exec_count")
    assert requests >= sum(len(_chunks(m, 12)) for m in mels)
    assert executions < requests, f"Triton formed no batch larger than 1 ({requests} requests, {executions} runs)"


def _state(server) -> dict[str, float]:
    """The server's own metrics (hift_*), by name and labels."""
    text = urllib.request.urlopen(server["state"], timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("hift_")}


def test_live_server_refuses_bad_requests_clearly_and_keeps_serving(server, vocoder):
    from hift_runtime.client import ServerClient
    from hift_runtime.wire import ServerError

    before = _state(server)
    rng = np.random.default_rng(9)
    client = ServerClient(server["grpc"])
    good, mel = client.stream("good"), _mel(rng, 36)
    pieces = [good.push(mel[:, :12])]
    with pytest.raises(ServerError, match="unknown stream id: send its first chunk with start=true"):
        client.infer("never-started", mel[:, :5], start=False, end=False)
    with pytest.raises(ServerError, match="non-finite values"):
        client.infer("good", np.full((80, 4), np.inf, np.float32), start=False, end=False)
    with pytest.raises(ServerError, match="is open"):
        client.infer("good", mel[:, :4], start=True, end=False)
    with pytest.raises(ServerError, match=r"\[80, T\] with T >= 1"):  # never sent: PyTriton cannot carry T = 0
        client.infer("good", mel[:, :0], start=False, end=False)
    pieces += [good.push(mel[:, 12:24]), good.push(mel[:, 24:], end=True)]
    assert max_abs(np.concatenate(pieces), vocoder.vocode(mel)) <= SERVED_TOLERANCE
    with pytest.raises(ServerError, match="ended"):
        client.infer("good", mel[:, :4], start=False, end=False)
    client.close()
    # The server's own metrics count each refusal under its reason (Prometheus text, beside Triton's endpoint).
    after = _state(server)
    for reason in ("unknown_stream", "bad_mel", "already_open", "closed_stream"):
        key = f'hift_requests_refused_total{{reason="{reason}"}}'
        assert after[key] - before.get(key, 0.0) == 1, (reason, after)
    assert after["hift_open_streams"] == 0 and after["hift_streams_expired_total"] == 0
    assert after[wire.REQUESTS_IN_FLIGHT_METRIC] == 0  # every request answered (hift-serve's stop reads it)
    assert after['hift_step_calls_total{device="0",kind="generator"}'] >= 2
    assert after['hift_step_batches_total{device="0",kind="generator"}'] >= 1
    assert after['hift_step_busy_seconds_total{device="0",kind="generator"}'] > 0
    assert 0 < after['hift_device_busy_share{device="0"}'] <= 1
    assert after["hift_gc_frozen_objects"] > 0  # frozen once warm
    assert after["hift_gc_full_collections_total"] >= 0 and after["hift_gc_full_collection_max_seconds"] >= 0
    with pytest.raises(ServerError, match="cannot reach a server"):
        ServerClient(f"127.0.0.1:{_free_ports(1)[0]}")


def test_hift_vocode_round_trip_through_the_server(server, small_artifacts, tmp_path):
    rng = np.random.default_rng(10)
    mel = _mel(rng, 53)
    np.save(tmp_path / "in.npy", mel)
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "hift_runtime.cli", "--server", server["grpc"], "--mel", str(tmp_path / "in.npy"),
         "--out", str(tmp_path / "out.npy"), "--chunks", "10,20", *extra], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    done = run()
    assert done.returncode == 0, done.stderr
    assert "streamed 4 chunks via" in done.stdout
    local = subprocess.run([sys.executable, "-m", "hift_runtime.cli", "--artifacts", str(small_artifacts.out), "--mel",
                            str(tmp_path / "in.npy"), "--out", str(tmp_path / "local.npy"), "--chunks", "10,20",
                            "--device", "cpu", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    assert max_abs(np.load(tmp_path / "out.npy"), np.load(tmp_path / "local.npy")) <= SERVED_TOLERANCE
    zeros = run("--chunks", "0,24")  # a zero size sends nothing, as in-process
    assert zeros.returncode == 0, zeros.stderr
    bad = subprocess.run([sys.executable, "-m", "hift_runtime.cli", "--server", "ftp://h:1", "--mel",
                          str(tmp_path / "in.npy"), "--out", str(tmp_path / "x.npy")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "HOST:PORT" in bad.stderr
    refused = run("--phase", "wrapped")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "server's settings" in refused.stderr


def test_server_refuses_a_busy_port_in_one_line(small_artifacts):
    pytest.importorskip("pytriton", reason="hift-serve needs the [serve] extra (nvidia-pytriton)")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        http, metrics = _free_ports(2)
        done = subprocess.run([sys.executable, "-m", "hift_runtime.server", "--artifacts", str(small_artifacts.out),
                               "--device", "cpu", "--grpc-port", str(port), "--http-port", str(http),
                               "--metrics-port", str(metrics)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"--grpc-port {port}: cannot listen" in done.stderr


def test_servers_behind_a_sharded_client_keep_each_stream_on_one_server(server, second_server, vocoder, tmp_path):
    """Scaling past one server process: the client picks each stream's server from its id (rendezvous hashing) over
    three processes (a PyTriton server and the two processes of ``--processes 2``); every chunk of a stream reaches
    the process holding its state, and each stream equals the offline pass."""
    from hift_runtime.client import ShardedClient

    targets = [server, second_server, *second_server["others"]]
    urls = [t["grpc"] for t in targets]
    client = ShardedClient(urls)
    ids = [f"shard-{i}" for i in range(24)]
    placed = {sid: client.server_for(sid).url for sid in ids}
    assert set(placed.values()) == set(urls)  # every process gets streams
    assert placed == {sid: ShardedClient(urls[::-1]).server_for(sid).url
                      for sid in ids}  # the same choice whatever the order the addresses are listed in
    rng = np.random.default_rng(16)
    before = [_metric(urllib.request.urlopen(t["metrics"], timeout=10).read().decode(), "nv_inference_count")
              for t in targets]
    chosen = [next(sid for sid in ids if placed[sid] == url) for url in urls] + ids[:3]
    for sid in chosen:
        mel = _mel(rng, 30)
        stream = client.stream(sid)
        parts = _chunks(mel, 12)
        audio = np.concatenate([stream.push(p, end=k == len(parts) - 1) for k, p in enumerate(parts)])
        assert max_abs(audio, vocoder.vocode(mel)) <= SERVED_TOLERANCE, sid
    after = [_metric(urllib.request.urlopen(t["metrics"], timeout=10).read().decode(), "nv_inference_count")
             for t in targets]
    sent = {url: sum(len(_chunks(np.zeros((1, 30)), 12)) for sid in chosen if placed[sid] == url) for url in urls}
    assert [a - b for a, b in zip(after, before)] == [sent[url] for url in urls]
    client.close()
    mel = _mel(rng, 40)  # hift-vocode over the three addresses: the stream goes to the one its id picks
    np.save(tmp_path / "in.npy", mel)
    done = subprocess.run([sys.executable, "-m", "hift_runtime.cli", "--server", ",".join(urls), "--mel",
                           str(tmp_path / "in.npy"), "--out", str(tmp_path / "out.npy"), "--chunks", "12"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "streamed 4 chunks via 127.0.0.1:" in done.stdout, done.stderr
    assert max_abs(np.load(tmp_path / "out.npy"), vocoder.vocode(mel)) <= SERVED_TOLERANCE

    async def through_asyncio() -> list[np.ndarray]:  # the asyncio sharded client, streams as tasks of one loop
        from hift_runtime.client import AsyncShardedClient

        aclient = AsyncShardedClient(urls)

        async def one(sid: str) -> np.ndarray:
            stream = aclient.stream(sid)
            parts = _chunks(mels[sid], 12)
            return np.concatenate([await stream.push(p, end=k == len(parts) - 1) for k, p in enumerate(parts)])

        try:
            return await asyncio.gather(*(one(sid) for sid in mels))
        finally:
            await aclient.close()

    import asyncio

    mels = {f"{sid}-async": _mel(rng, 30) for sid in chosen[:3]}
    for sid, audio in zip(mels, asyncio.run(through_asyncio())):
        assert max_abs(audio, vocoder.vocode(mels[sid])) <= SERVED_TOLERANCE, sid


def test_cosyvoice_tts_through_the_server(server, vocoder):
    """Upstream CosyVoice3's own tts(stream=True) with the vocoder on hift-serve (HiFT apart from the flow): the audio
    equals the in-process offline pass of the same mel, and the stream ends with the tts()."""
    from .test_cosyvoice import UPSTREAM

    if not (UPSTREAM / "run_token2wav.py").is_file():
        pytest.skip(f"upstream CosyVoice's code not found at {UPSTREAM}")
    import torch

    sys.path.insert(0, str(UPSTREAM))
    import run_token2wav as upstream

    from hift_runtime.client import ServerClient
    from hift_runtime.cosyvoice import use_streaming_vocoder

    mel = _mel(np.random.default_rng(54), 300)
    client = ServerClient(server["grpc"])
    model = upstream.CosyVoice3Model(upstream.StubLLM(150), upstream.StubFlow(torch.from_numpy(mel)[None]),
                                     torch.nn.Identity())
    use_streaming_vocoder(model, client)
    audio = torch.cat([out["tts_speech"] for out in model.tts(stream=True)], dim=1)[0].numpy()
    client.close()
    assert max_abs(audio, vocoder.vocode(mel)) <= SERVED_TOLERANCE
    assert _state(server)["hift_open_streams"] == 0


def test_server_stops_cleanly_on_sigterm(server):
    process = server["process"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "hift-serve: stopped" in server["log"].read_text()
    assert "Signal (" not in server["log"].read_text()  # tritonserver's own stop line goes to the Triton log
    port = int(server["grpc"].rsplit(":", 1)[1])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def test_two_processes_stream_exactly_refuse_alone_and_stop_cleanly(second_server, vocoder):
    """``--processes 2``: started one after another; the same wire contract, refusals and server metrics in each
    process; SIGTERM to the supervisor unloads both models and stops both tritonservers, their console lines in their
    logs."""
    from hift_runtime.client import ServerClient
    from hift_runtime.wire import ServerError

    console = second_server["log"].read_text()
    assert "inside Triton's Python backend" in console
    assert console.index("[1] ") > console.index("' ready (")  # process 1 starts once process 0 is ready
    rng = np.random.default_rng(21)
    mels = [_mel(rng, 30 + 7 * i) for i in range(4)]

    def run(i: int) -> np.ndarray:
        client = ServerClient(second_server["grpc"] if i % 2 else second_server["http"])
        stream = client.stream(f"pb-{i}")
        parts = _chunks(mels[i], 12)
        audio = np.concatenate([stream.push(p, end=k == len(parts) - 1) for k, p in enumerate(parts)])
        client.close()
        return audio

    for i, audio in enumerate(run_in_threads(run, range(4), timeout=300)):
        assert max_abs(audio, vocoder.vocode(mels[i])) <= SERVED_TOLERANCE, i
    before = _state(second_server)
    client = ServerClient(second_server["grpc"])
    with pytest.raises(ServerError, match="non-finite values"):
        client.infer("pb-bad", np.full((80, 4), np.nan, np.float32), start=True, end=False)
    client.close()
    after = _state(second_server)
    key = 'hift_requests_refused_total{reason="bad_mel"}'
    assert after[key] - before.get(key, 0.0) == 1 and after["hift_open_streams"] == 0
    process = second_server["process"]
    process.send_signal(signal.SIGTERM)  # the supervisor of --processes 2: both processes stop, cleanly
    assert process.wait(timeout=90) == 0
    console = second_server["log"].read_text()
    assert "[0] hift-serve: stopped" in console and "[1] hift-serve: stopped" in console
    assert "Signal (" not in console


def test_pieces_that_queued_up_for_one_request_go_out_as_one_with_its_final_reply_unless_that_is_an_error():
    """The replier's coalescing (``--audio-pieces`` under load): a request's pieces waiting one after another become
    one piece, in order, joined by its final reply unless that carries an error (then sent after them as it was);
    other requests' replies keep their own order."""
    from hift_runtime.serving import ChunkReply
    from hift_runtime.triton_python import coalesce_pieces

    a, b = object(), object()

    def piece(*values: float) -> ChunkReply:
        return ChunkReply(np.array(values, np.float32))

    queued = [(a, piece(1), False), (b, piece(9), False), (a, piece(2, 3), False), (a, ChunkReply(piece(4).audio,
              ""), True), (b, piece(8), False), (b, ChunkReply(np.zeros(0, np.float32), "refused"), True)]
    out = coalesce_pieces(queued)
    # a's final reply joins its waiting pieces (one response, final); b's carries an error: sent after its pieces.
    assert [(s is a, r.audio.tolist(), r.error, f) for s, r, f in out] == [
        (True, [1.0, 2.0, 3.0, 4.0], "", True), (False, [9.0, 8.0], "", False), (False, [], "refused", True)]
    alone = coalesce_pieces(queued[:1])
    assert alone[0][1] is queued[0][1]  # nothing to join: the reply itself


def test_a_pacer_sends_first_pieces_and_finals_at_once_and_holds_the_rest_until_due():
    """:class:`PiecePacer`: a request's first piece goes at once; later ones wait until ``ahead_s`` before a client
    playing from the first could reach them, then go joined; the final reply carries what is held (after it, when
    the final is an error). The audio and its order are unchanged."""
    from hift_runtime.serving import ChunkReply
    from hift_runtime.triton_python import PiecePacer

    a, b = object(), object()
    pacer = PiecePacer(rate=10, ahead_s=0.5)  # 10 samples a second: a piece of n samples plays n / 10 s

    def piece(start: int, n: int) -> ChunkReply:
        return ChunkReply(np.arange(start, start + n, dtype=np.float32))

    def sent(out):
        return [(s is a, r.audio.tolist(), r.error, f) for s, r, f in out]

    assert sent(pacer.take([(a, piece(0, 20), False)], now=0.0)) == [(True, list(range(20)), "", False)]
    assert pacer.take([(a, piece(20, 5), False)], now=0.1) == []  # due at 0 + 20 / 10 - 0.5 = 1.5
    assert pacer.wait_s(0.1) == pytest.approx(1.4)
    assert pacer.take([(a, piece(25, 5), False)], now=1.0) == []
    assert sent(pacer.take([], now=1.5)) == [(True, list(range(20, 30)), "", False)]
    assert pacer.wait_s(1.5) is None
    assert pacer.take([(a, piece(30, 5), False)], now=1.6) == []  # due at 0 + 30 / 10 - 0.5 = 2.5
    assert sent(pacer.take([(a, piece(35, 3), True)], now=1.7)) == [(True, list(range(30, 38)), "", True)]
    assert sent(pacer.take([(b, piece(0, 10), False), (b, piece(10, 4), False)], now=2.0)) == [
        (False, list(range(10)), "", False)]  # the second held: due at 2 + 10 / 10 - 0.5 = 2.5
    assert sent(pacer.take([(b, ChunkReply(np.zeros(0, np.float32), "refused"), True)], now=2.1)) == [
        (False, [10.0, 11.0, 12.0, 13.0], "", False), (False, [], "refused", True)]
    assert pacer.wait_s(2.1) is None  # every request ended: nothing held, nothing kept


def test_the_async_client_lets_the_server_end_a_pieces_call_before_it_closes():
    """After a decoupled request's last response the asyncio client closes the call's request side and lets the server
    end the call, off the push's path; ``close()`` waits for that before closing the connection (a call cut under
    tritonserver can leave it holding the request, and its stop then waits for it)."""
    import asyncio
    from types import SimpleNamespace

    from hift_runtime import wire
    from hift_runtime.client import AsyncServerClient

    class Response:
        def __init__(self, audio: np.ndarray, final: bool) -> None:
            self.tensors = {wire.AUDIO: audio[None], wire.SAMPLES: np.array([[audio.size]]),
                            wire.SAMPLE_RATE: np.array([[24000]]), wire.ERROR: np.array([[b""]], dtype=object),
                            wire.FINAL: np.array([[final]])}

        def as_numpy(self, name: str) -> np.ndarray:
            return self.tensors[name]

    events: list[str] = []

    class Call:  # a piece, the last response, then the end of the call once the request side is closed
        def __init__(self, requests) -> None:
            self.requests = requests
            self.responses = [Response(np.ones(3, np.float32), False), Response(np.full(2, 2.0, np.float32), True)]

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.responses:
                return self.responses.pop(0), None
            async for _ in self.requests:
                pass
            events.append("call ended")
            raise StopAsyncIteration

    class Connection:
        def stream_infer(self, requests, stream_timeout, headers) -> Call:
            return Call(requests)

        async def close(self) -> None:
            events.append("connection closed")

    async def push_then_close() -> np.ndarray:
        client = AsyncServerClient("127.0.0.1:1")
        client._client = Connection()
        audio, _ = await client._infer_pieces(SimpleNamespace(in_channels=80), "s", np.zeros((80, 10), np.float32),
                                              True, False, 0, None)
        await client.close()
        return audio

    assert asyncio.run(push_then_close()).tolist() == [1, 1, 1, 2, 2]
    assert events == ["call ended", "connection closed"]


def test_an_empty_release_is_reported_as_zero_samples(vocoder):
    from hift_runtime import wire
    from hift_runtime.serving import chunk_request, reply_tensors

    table = StreamTable(vocoder, workers=2)
    one = {wire.STREAM_ID: np.array([[b"e"]], dtype=object), wire.MEL: np.full((1, 80, 1), -4.0, np.float32),
           wire.START: np.array([[True]]), wire.END: np.array([[False]])}
    reply = reply_tensors(table.handle([chunk_request(one)])[0], np.array([[24000]], np.int32))
    assert int(reply[wire.SAMPLES][0, 0]) == 0 and reply[wire.AUDIO].shape == (1, 1)  # 100 ms are held back
    assert reply[wire.ERROR][0, 0] == b""
    table.handle([ChunkRequest("e", np.full((80, 1), -4.0, np.float32), end=True)])
    table.close()


class _FakeTritonClient:
    """A tritonclient stand-in: a ready model whose metadata has no mel input; records its construction."""

    made: list[dict] = []

    def __init__(self, address, **kwargs) -> None:
        _FakeTritonClient.made.append(kwargs)

    def is_model_ready(self, model_name, **kwargs):
        return True

    def get_model_metadata(self, model_name, **kwargs):
        return {"inputs": [{"name": "audio", "shape": [-1]}]}


def test_client_errors_are_server_errors_and_http_keeps_its_timeout(monkeypatch):
    import tritonclient.grpc
    import tritonclient.http

    from hift_runtime.client import ServerClient
    from hift_runtime.wire import ServerError

    with pytest.raises(ServerError, match="HOST:PORT"):
        ServerClient("ftp://h:1")
    for module, url in ((tritonclient.grpc, "h:1"), (tritonclient.http, "http://h:1")):
        monkeypatch.setattr(module, "InferenceServerClient", _FakeTritonClient)
        with pytest.raises(ServerError, match=f"{url}.*not a hift-serve or hift-export --triton-repo model"):
            ServerClient(url, timeout_s=7.5)
    assert _FakeTritonClient.made[-1] == {"connection_timeout": 7.5, "network_timeout": 7.5}



def test_a_model_that_fails_to_load_is_said_in_one_line():
    """The Python-backend front end reads why Triton could not load the model from its log: the runtime's own
    message, without Triton's prefix or the traceback."""
    from hift_runtime.triton_python import load_failure

    line = ('E1202 01:18:56.883575 917 model_lifecycle.cc:642] "failed to load \'hift_vocoder\' version 1: Internal: '
            "ArtifactError: the compiled engine was asked for CUDA, but torch sees no CUDA device; use engine='ort'"
            '\\n\\nAt:\\n  /x/hift_torch/compiled.py(132): __init__\\n"')
    assert load_failure("I... other line\n" + line + "\n", "hift_vocoder") == (
        "ArtifactError: the compiled engine was asked for CUDA, but torch sees no CUDA device; use engine='ort'")
    assert load_failure(line, "other_model") is None


def test_retired_options_are_refused_in_one_line(capsys):
    """hift-serve lists deployer options only (at most 21 with --help: the 19 of the restructure, and --audio-pieces,
    the choice between whole releases for any client and pieces for gRPC streaming ones); the retired experiments'
    flags are unknown options."""
    from hift_runtime.server_cli import parser

    listed = [a for a in parser()._actions if a.help != "==SUPPRESS=="]
    assert len(listed) <= 21, [a.option_strings for a in listed]
    for retired in ("--instances", "--frontend", "--call-lanes", "--step-window", "--cudnn-algorithms"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--artifacts", "a", retired, "2"])
        assert retired in capsys.readouterr().err


def test_each_of_several_processes_gets_its_own_ports_stream_share_and_log():
    """``--processes 3``: process 2 listens 20 above every port, opens at most ceil(100 / 3) streams, logs apart."""
    from hift_runtime.server_cli import parser as _parser
    from hift_runtime.server_processes import process_argv

    argv = ["--artifacts", "a", "--processes", "3", "--max-streams", "100", "--triton-log", "t.log"]
    child = _parser().parse_args(process_argv(_parser().parse_args(argv), argv, 2, 3))
    assert (child.processes, child.http_port, child.grpc_port, child.metrics_port, child.state_metrics_port) == \
        (1, 8020, 8021, 8022, 8023)
    assert child.max_streams == 34 and child.triton_log == "t.log.2" and child.artifacts == "a"
    from hift_runtime.server_processes import ports_of

    ports = ports_of(_parser().parse_args(argv), 3)  # what the busy-port check probes, named as its message says
    assert len(ports) == 12 and ports["--grpc-port + 20 (process 2)"] == 8021 and ports["--http-port"] == 8000


def test_several_processes_stop_together_when_one_cannot_start(small_artifacts, tmp_path):
    """``--processes 2`` over an export whose graph was damaged after it was written: each process says why in one
    line, the supervisor says which stopped first and returns its status."""
    import shutil

    pytest.importorskip("pytriton", reason="hift-serve needs the [serve] extra (nvidia-pytriton)")
    damaged = tmp_path / "damaged"
    shutil.copytree(small_artifacts.out, damaged)
    with open(damaged / "hift_f0_step.onnx", "r+b") as graph:
        graph.truncate(100)
    while True:
        ports = _free_ports(4)
        if _all_free([p + 10 for p in ports]):
            break
    done = subprocess.run([sys.executable, "-m", "hift_runtime.server", "--artifacts", str(damaged), "--device", "cpu",
                           "--processes", "2", *(x for option, port in zip(
                               ("--http-port", "--grpc-port", "--metrics-port", "--state-metrics-port"), ports)
                               for x in (option, str(port)))],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    assert "hift_f0_step.onnx" in done.stdout and done.stdout.startswith("["), done.stdout[-2000:]
    assert done.stderr.count("\n") == 1 and "before every process was ready; stopping the others" in done.stderr


def test_a_missing_export_is_said_before_a_busy_port(tmp_path, capsys):
    """What is wrong with the export is said first (a user fixes that before the ports)."""
    import socket

    pytest.importorskip("pytriton", reason="hift-serve needs the [serve] extra (nvidia-pytriton)")
    from hift_runtime import server

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = server.main(["--artifacts", str(tmp_path / "missing"), "--http-port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        f"hift-serve: error: artifacts folder {str(tmp_path / 'missing')!r} does not exist; run hift-export --out "
        f"{tmp_path / 'missing'} first"]



@pytest.fixture(scope="module")
def pieces_server(small_artifacts, tmp_path_factory):
    yield from _live_server(small_artifacts, tmp_path_factory, ["--audio-pieces"])


def test_a_pieces_server_sends_each_steps_audio_as_it_is_made(pieces_server, vocoder):
    """``--audio-pieces``: a 100-frame chunk (steps of at most 24 frames on the CPU) comes back as several responses,
    its first step's audio at once and the rest paced (:class:`PiecePacer`), joined the release, sync and asyncio
    alike; a resend gets the whole release once more; an HTTP client is refused in one line (decoupled models need
    gRPC streaming)."""
    import asyncio

    from hift_runtime.client import AsyncServerClient, ServerClient
    from hift_runtime.wire import ServerError

    mel = _mel(np.random.default_rng(31), 150)
    want = vocoder.vocode(mel)
    client = ServerClient(pieces_server["grpc"])
    assert client.model.pieces
    stream, pieces = client.stream("pieces-1"), []
    first = stream.push(mel[:, :100], on_audio=pieces.append)
    assert len(pieces) >= 2 and np.array_equal(np.concatenate(pieces), first)  # the first step's, then the rest
    again, _ = client.infer("pieces-1", mel[:, :100], start=True, end=False, offset=0)  # a resend: applied once
    assert np.array_equal(again, first)
    rest = stream.push(mel[:, 100:], end=True, on_audio=pieces.append)
    assert max_abs(np.concatenate([first, rest]), want) <= SERVED_TOLERANCE
    assert max_abs(np.concatenate(pieces), want) <= SERVED_TOLERANCE
    client.close()
    with pytest.raises(ServerError, match="needs gRPC streaming"):
        ServerClient(pieces_server["http"]).stream().push(mel[:, :10])

    async def asynchronously() -> tuple[np.ndarray, list]:
        aclient, got = AsyncServerClient(pieces_server["grpc"]), []
        astream = aclient.stream()
        audio = [await astream.push(mel[:, :100], on_audio=got.append),
                 await astream.push(mel[:, 100:], end=True, on_audio=got.append)]
        await aclient.close()
        return np.concatenate(audio), got

    audio, got = asyncio.run(asynchronously())
    assert len(got) >= 4 and max_abs(audio, want) <= SERVED_TOLERANCE and np.array_equal(np.concatenate(got), audio)


def _ignoring_sigterm() -> subprocess.Popen:
    """A process that ignores SIGTERM (as tritonserver waiting out its exit timeout does), once it says it does."""
    process = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                "signal.SIG_IGN); print('ignoring', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ignoring"
    return process


@pytest.mark.parametrize("in_flight, killed_for_held", [(0, True), (1, False), (None, False)])
def test_a_stopping_tritonserver_whose_model_answered_everything_is_killed_after_the_held_wait(in_flight,
                                                                                             killed_for_held):
    """hift-serve's stop: a tritonserver that does not exit while its model reports no request in flight is killed
    after ``held_s`` (it holds a request whose call a client cut, and would wait out its 30 s exit timeout); while
    requests are in flight, or the model's metrics do not answer (it is unloading), only ``timeout_s`` ends it."""
    from hift_runtime.server import stop_tritonserver

    process = _ignoring_sigterm()
    started = time.monotonic()
    assert stop_tritonserver(process, lambda: in_flight, timeout_s=1.5, held_s=0.4) is killed_for_held
    took = time.monotonic() - started
    assert process.returncode == -signal.SIGKILL
    assert (0.4 <= took < 1.4) if killed_for_held else (1.5 <= took < 3.0)


def test_a_tritonserver_that_exits_on_sigterm_is_left_to_exit():
    from hift_runtime.server import stop_tritonserver

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_tritonserver(process, lambda: 0, timeout_s=10, held_s=5) is False
    assert process.returncode == -signal.SIGTERM
