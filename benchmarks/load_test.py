"""Load test: K concurrent synthetic streams arriving over time, each pushing 24-frame chunks at real-time pace
(one every 480 ms), through one opened runtime. Not a test: it reports figures per K.

    python benchmarks/load_test.py --artifacts DIR --out benchmarks/results/NAME.json [--seconds 6]
        [--ks 1,16,64,...] [--configs batched,batched_tf32,per_stream] [--clients threads|asyncio]
        [--max-streams N]   # a ramp past capacity: streams past N are refused (counted), the rest keep time
        [--repeats R]       # each K R times in a row: p95_by_k gives each K's median, range and runs kept
        [--schedule cosyvoice3]   # two utterances a stream slot in CosyVoice3's chunks (50, 100, then 200 frames)

Per K: push latency p50/p95/p99 (from each push's due time to its return, so falling behind counts), the same
pushes timed from the call (``push_call_*``: the client's own lateness in starting a push left out, e.g. an event
loop's timer waking up late), first-chunk latency, throughput (audio seconds produced per wall second), the share of
the run's wall time inside the engine's calls (``calls_busy_share``: the device's busy share as the scheduler sees
it; served, the servers' schedulers, read from their state metrics), GPU memory. The bound is p95 <= 240 ms (half a chunk);
the ramp goes on past a miss (larger batches can catch up) and stops at a collapse (p95 > 2.4 s) or an error.
Configs: ``batched`` (the default on the GPU: cross-stream batching + CUDA graphs per step size
and batch), ``batched_tf32`` (the same with TF32), ``per_stream`` (no batching: each stream's step is its own B = 1
call, the landed path's shape), ``served`` (the ``batched`` runtime behind ``hift-serve``, started by this script on
free localhost ports; each stream is a gRPC client stream, its last chunk carrying ``end``; the Triton batcher and
the step batcher wait ``--served-wait-ms``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_step import synthetic_mel  # one synthetic mel for every benchmark (same folder)
from host_path import STEP_SIZES  # the stand-in devices' step sizes (same folder)

CHUNK = 24
PERIOD_S = CHUNK * 480 / 24000
P95_BOUND_MS = 240.0
UTTERANCE_FIRST_BOUND_MS = 150.0  # an utterance's time to first audio (CosyVoice3's schedule)
HELD_BACK_FRAMES = 5  # audio_lag + mel_look_ahead of the export's step contract: audio a push cannot release yet
# What the runtime's OverloadError says, in-process and through the server's ``error`` alike (streaming.py).
OVERLOAD_MESSAGE = "the limit (max_streams="


def gpu_memory_mb() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return float("nan")


class _LocalStream:
    """An in-process stream with the remote stream's call: ``push(chunk, end)``."""

    def __init__(self, vocoder) -> None:
        self._s = vocoder.stream()

    def push(self, mel: np.ndarray, end: bool = False) -> np.ndarray:
        out = self._s.push(mel)
        return np.concatenate([out, self._s.finish()]) if end else out


class _ServerUrls:
    """The servers' gRPC addresses and the server each stream goes to (its id ``load-i`` hashed over the servers, as
    :class:`~hift_runtime.client.ShardedClient` does): what a client process needs of the served config."""

    def __init__(self, grpc_urls: list[str]) -> None:
        self.grpc_urls = grpc_urls

    def server_of(self, i: int) -> int:
        from hift_runtime.client import rendezvous_order

        return rendezvous_order(self.grpc_urls, f"load-{i}")[0]


class _Served(_ServerUrls):
    """``hift-serve`` in ``processes`` child processes (one runtime each, sharing the device) and a few gRPC clients
    per server (a channel serves many threads); each stream goes to the server its id picks, as
    :class:`~hift_runtime.client.ShardedClient` does."""

    def __init__(self, artifacts: str, device: str, max_batch: int, wait_ms: float, log: Path,
                 engine: str = "ort", precision: str = "fp32",
                 stand_in: list[str] | None = None, max_streams: int | None = None,
                 processes: int = 1, pieces: bool = False) -> None:
        """``stand_in``: options of ``modelled_server.py`` (hift-serve over a stand-in device) instead of the real
        server over the export's engine. ``max_streams``: each process's ``--max-streams``. ``pieces``: hift-serve
        ``--audio-pieces``."""
        import socket
        import sys

        from hift_runtime.client import ServerClient

        self.log = log
        env = dict(os.environ)
        if stand_in and processes > 1:  # the processes share one modelled device, as they would share the GPU
            env["HIFT_SHARED_DEVICE"] = str(log.with_suffix(".device-lock"))
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.metrics_urls: list[str] = []
        self.state_urls: list[str] = []
        self.grpc_urls: list[str] = []
        deadline = time.monotonic() + 900  # a cold compile of the compiled engine takes minutes
        # One after another, as hift-serve --processes N starts them: each warmup finds the device memory the ones
        # before left free.
        for n in range(processes):
            ports = []
            for _ in range(4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    ports.append(s.getsockname()[1])
            server_log = log if n == 0 else log.with_suffix(f".{n}.log")
            self.logs.append(server_log)
            self.processes.append(subprocess.Popen(
                [sys.executable, *([str(Path(__file__).with_name("modelled_server.py")), *stand_in, "--"] if stand_in
                                   else ["-m", "hift_runtime.server"]), "--artifacts", artifacts, "--device", device,
                 "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                 "--max-batch", str(max_batch), "--max-wait-ms", str(wait_ms),
                 "--engine", engine, "--precision", precision, "--state-metrics-port", str(ports[3]),
                 *(["--max-streams", str(max_streams)] if max_streams else []),
                 *(["--audio-pieces"] if pieces else [])],
                stdout=server_log.open("w"), stderr=subprocess.STDOUT, env=env))
            self.metrics_urls.append(f"http://127.0.0.1:{ports[2]}/metrics")
            self.state_urls.append(f"http://127.0.0.1:{ports[3]}/metrics")
            self.grpc_urls.append(f"127.0.0.1:{ports[1]}")
            while "' ready (" not in server_log.read_text():  # hift-serve's "model 'hift' ready (...)" line
                if self.processes[-1].poll() is not None or time.monotonic() > deadline:
                    self.close()  # none left holding its ports
                    raise RuntimeError("hift-serve did not start: " + server_log.read_text()[-2000:])
                time.sleep(0.5)
        self.clients = [[ServerClient(url) for _ in range(16)] for url in self.grpc_urls]
        self.backend = None

    def stream(self, i: int):
        pool = self.clients[self.server_of(i)]
        return pool[i % len(pool)].stream(f"load-{i}-{time.monotonic_ns()}")

    def batches(self) -> dict[str, float]:
        """Triton's counters so far (summed over its models and the servers): inferences, executions (batches),
        successful requests, and the microseconds requests spent queued and computing."""
        import urllib.request

        total: dict[str, float] = {}
        for url in self.metrics_urls:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            get = lambda name: sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()  # noqa: E731
                                   if x.startswith(name + "{"))
            for key, name in (("requests", "nv_inference_count"), ("executions", "nv_inference_exec_count"),
                              ("successes", "nv_inference_request_success"),
                              ("queue_us", "nv_inference_queue_duration_us"),
                              ("compute_us", "nv_inference_compute_infer_duration_us")):
                total[key] = total.get(key, 0.0) + get(name)
        return total

    def _state(self) -> list[dict[str, float]]:
        """Each server's state metrics (hift-serve --state-metrics-port): sample name with its labels -> value."""
        import urllib.request

        return [dict((name, float(value)) for name, _, value in (line.rpartition(" ") for line in
                     urllib.request.urlopen(url, timeout=10).read().decode().splitlines())
                     if name and not name.startswith("#")) for url in self.state_urls]

    def full_collections(self) -> tuple[float, float]:
        """The servers' full garbage collections so far (summed) and the longest (ms), from their state metrics."""
        states = self._state()
        return (sum(s.get("hift_gc_full_collections_total", 0.0) for s in states),
                max((s.get("hift_gc_full_collection_max_seconds", 0.0) * 1e3 for s in states), default=0.0))

    def scheduler_counters(self) -> dict[str, Any]:
        """The servers' schedulers so far, summed over the servers (their state metrics), as :func:`_counters` gives
        an in-process scheduler's: calls, batches and busy seconds by kind; also the batches queued behind another
        and the largest batch. With several processes on one device their calls overlap in time: the busy seconds'
        sum can pass the wall time."""
        by_kind: dict[str, list[float]] = {}
        queued, largest = 0.0, 0.0
        for state in self._state():
            for name, value in state.items():
                metric, _, labels = name.partition("{")
                column = {"hift_step_calls_total": 0, "hift_step_batches_total": 1,
                          "hift_step_busy_seconds_total": 2}.get(metric)
                if column is not None:
                    kind = labels.split('kind="', 1)[1].split('"', 1)[0]
                    by_kind.setdefault(kind, [0.0, 0.0, 0.0])[column] += value
                elif metric == "hift_step_batches_queued_total":
                    queued += value
                elif metric == "hift_step_batch_max":
                    largest = max(largest, value)
        return {"by_kind": by_kind, "queued": queued, "max_batch": largest}

    def close(self) -> None:
        for pool in getattr(self, "clients", []):
            for c in pool:
                c.close()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=60)


def triton_this_run(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What Triton's counters say of one run: the batches it formed and the time a request waited in its queue."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"requests": d["requests"], "batches": d["executions"],
            "mean_batch": round(d["requests"] / d["executions"], 2) if d["executions"] else 0.0,
            "mean_queue_ms": round(d["queue_us"] / d["successes"] / 1e3, 3) if d["successes"] else 0.0,
            "mean_compute_ms": round(d["compute_us"] / d["successes"] / 1e3, 3) if d["successes"] else 0.0}


def _counters(vocoder) -> dict[str, dict[str, Any]] | None:
    """The scheduler's calls/batches/busy seconds by kind and by step shape ("kind@mel frames"), and its batches by
    size for each shape, copied (a later run must not change a reported row)."""
    if isinstance(vocoder, _Served):
        counters = vocoder.scheduler_counters()
        return {"by_kind": counters["by_kind"]}
    stats = getattr(getattr(vocoder, "scheduler", None), "stats", None)
    if stats is None:
        return None
    return {"by_kind": {kind: list(v) for kind, v in stats.by_kind.items()},
            "by_shape": {shape: list(v) for shape, v in getattr(stats, "by_shape", {}).items()},
            "batch_sizes": {shape: dict(v) for shape, v in getattr(stats, "batch_sizes", {}).items()}}


BATCH_SIZE_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)


def batches_by_size(before: dict[str, dict[int, int]], after: dict[str, dict[int, int]]) -> dict[str, dict[str, int]]:
    """This run's batches of each step shape by size, binned ("<=8": sizes 5 to 8; past the last bin, its own)."""
    binned: dict[str, dict[str, int]] = {}
    for shape, sizes in after.items():
        row: dict[str, int] = {}
        for size, count in sorted(sizes.items()):
            count -= before.get(shape, {}).get(size, 0)
            if count:
                label = f"<={next((b for b in BATCH_SIZE_BINS if b >= size), size)}"
                row[label] = row.get(label, 0) + count
        if row:
            binned[shape] = row
    return binned


def _counted_since(before: dict[str, dict[str, Any]] | None, after: dict[str, dict[str, Any]] | None
                   ) -> dict[str, dict[str, Any]] | None:
    """What :func:`_counters` counted between ``before`` and ``after``: this run's calls, batches and busy seconds,
    and its batches by size (``batches_by_size``)."""
    if before is None or after is None:
        return None
    counted: dict[str, Any] = {f"calls_batches_busy_s_{group}": {
        key: [round(v - w, 4) for v, w in zip(counts, before[group].get(key, [0, 0, 0.0]))]
        for key, counts in after[group].items()} for group in after if group != "batch_sizes"}
    if "batch_sizes" in after:
        counted["batches_by_size"] = batches_by_size(before.get("batch_sizes", {}), after["batch_sizes"])
    return counted


# CosyVoice3's tts(stream=True): a hop of 25 tokens doubling to 100, two mel frames a token; the last chunk the rest.
COSYVOICE3_CHUNKS = (50, 100, 200)
FRAME_S = 480 / 24000


def stream_plan(schedule: str, frames: int) -> tuple[list[tuple[int, int, bool, float, int]], float]:
    """The pushes of one stream slot: ``(position, frames, ends an utterance, due offset s, utterance)`` each, and the
    slot's span in seconds (what its arrivals spread over). ``schedule``: ``"24"``, one utterance of ``frames`` in
    24-frame chunks, one every 480 ms; ``"cosyvoice3"``, two utterances of ``frames`` back to back in CosyVoice3's
    chunks, each due when real-time playback of the audio before it (from its utterance's start) needs it."""
    if schedule == "24":
        return [(pos, min(CHUNK, frames - pos), pos + CHUNK >= frames, j * PERIOD_S, 0)
                for j, pos in enumerate(range(0, frames, CHUNK))], PERIOD_S
    plan = []
    for utterance in range(2):
        pos, j = 0, 0
        while pos < frames:
            size = min(COSYVOICE3_CHUNKS[min(j, len(COSYVOICE3_CHUNKS) - 1)], frames - pos)
            plan.append((pos, size, pos + size >= frames, (utterance * frames + pos) * FRAME_S, utterance))
            pos, j = pos + size, j + 1
    return plan, frames * FRAME_S


@dataclasses.dataclass
class _Records:
    """What one run's streams recorded (in seconds), merged over the client processes that ran them."""

    lat: list[float] = dataclasses.field(default_factory=list)
    call_lat: list[float] = dataclasses.field(default_factory=list)  # the same pushes from the call
    by_index: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # push index -> latencies
    first: list[float] = dataclasses.field(default_factory=list)
    chunk_firsts: list[float] = dataclasses.field(default_factory=list)  # each push's first audio, from its due time
    lateness: list[float] = dataclasses.field(default_factory=list)  # each push's latest piece against playback
    utterance_firsts: list[float] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    refused: int = 0  # streams refused at their start with the overload message (--max-streams): not errors

    def merge(self, other: "_Records") -> None:
        for name in ("lat", "call_lat", "first", "chunk_firsts", "lateness", "utterance_firsts", "errors"):
            getattr(self, name).extend(getattr(other, name))
        for j, values in other.by_index.items():
            self.by_index.setdefault(j, []).extend(values)
        self.refused += other.refused


class ClientProcesses:
    """``count`` client processes for the served config (spawned: gRPC does not survive a fork), started and their
    imports done before a run, so that its streams start on time; :meth:`run` deals a run's streams out to them."""

    def __init__(self, count: int) -> None:
        import concurrent.futures
        import multiprocessing

        self.count = count
        self.pool = concurrent.futures.ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"))
        for ready in [self.pool.submit(_client_ready, 0.5) for _ in range(count)]:
            ready.result()

    def run(self, grpc_urls: list[str], k: int, start: float, seconds: float, schedule: str) -> "_Records":
        """Streams ``0..k-1`` dealt out in turn, each process's share as tasks of its own event loop; their records
        merged."""
        rec = _Records()
        for share in [self.pool.submit(_client_share, grpc_urls, k, range(n, k, self.count), start, seconds,
                                       schedule) for n in range(self.count)]:
            rec.merge(share.result())
        return rec

    def close(self) -> None:
        self.pool.shutdown()


def _client_ready(linger_s: float) -> None:
    import hift_runtime.client  # noqa: F401 - the gRPC client's imports, before the first run

    time.sleep(linger_s)  # each worker takes one


def _client_share(grpc_urls: list[str], k: int, indices: range, start: float, seconds: float,
                  schedule: str) -> "_Records":
    """A client process's share of a served run: streams ``indices`` of ``k``, as tasks of its own event loop."""
    return drive_streams(_ServerUrls(grpc_urls), k, indices, start, seconds, schedule, "asyncio")


def drive_streams(vocoder: Any, k: int, indices: Any, start: float, seconds: float, schedule: str,
                  clients: str = "threads", loop_scheduler: bool = False) -> _Records:
    """Streams ``indices`` of ``k`` (stream ``i`` arrives ``i / k`` of a slot's span after ``start``, a monotonic
    time), as :func:`run_k` describes, through ``vocoder`` (in process, or the servers)."""
    frames = int(seconds * 50)
    plan, span_s = stream_plan(schedule, frames)
    rec = _Records()
    mel = synthetic_mel(frames)
    lock = threading.Lock()

    def record(took: list[float], calls: list[float], firsts: list[float] | None = None,
               late: list[float] | None = None) -> None:
        """One stream's push latencies: its first push's apart (the first-chunk latency), the rest by index; and the
        same pushes timed from the call itself (``calls``: without the client's own lateness in starting it);
        ``firsts``/``late``: each push's first audio and playback lateness, where pieces were timed."""
        starts = [i for i, step in enumerate(plan) if i == 0 or plan[i - 1][2]]
        firsts = firsts or took
        with lock:
            rec.utterance_firsts.extend(firsts[i] for i in starts)
            rec.chunk_firsts.extend(firsts)
            rec.lateness.extend(late or [])
            rec.first.append(took[0])
            rec.lat.extend(took[1:])
            rec.call_lat.extend(calls[1:])
            for j, t in enumerate(took[1:], start=1):
                rec.by_index.setdefault(j, []).append(t)

    def failed(exc: Exception) -> None:
        with lock:
            if OVERLOAD_MESSAGE in str(exc):
                rec.refused += 1
            else:
                rec.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    def stream(i: int) -> None:
        t0 = start + span_s * i / k  # arrivals spread over one chunk period (24) or one utterance (cosyvoice3)
        try:
            time.sleep(max(0.0, t0 - time.monotonic()))
            took, calls = [], []
            for pos, size, end, offset, _ in plan:
                if pos == 0:
                    s = vocoder.stream(i) if isinstance(vocoder, _ServerUrls) else _LocalStream(vocoder)
                due = t0 + offset
                time.sleep(max(0.0, due - time.monotonic()))
                called = time.monotonic()
                s.push(mel[:, pos:pos + size], end=end)  # an utterance's last push ends its stream
                took.append(time.monotonic() - due)
                calls.append(time.monotonic() - called)
            record(took, calls)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            failed(exc)

    async def astream(i: int, aclients: list | None) -> None:
        """The same stream as a task of one event loop: ``apush``/``afinish`` in-process, or through the server with
        the asyncio gRPC client (``aclients``)."""
        import asyncio

        t0 = start + span_s * i / k
        try:
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))

            def opened() -> Any:
                if aclients is not None:
                    pool = aclients[vocoder.server_of(i)]
                    return pool[i % len(pool)].stream(f"load-{i}-{time.monotonic_ns()}").push
                s = vocoder.stream()
                return lambda chunk, end, on_audio=None: (s.afinish(chunk, on_audio=on_audio) if end
                                                          else s.apush(chunk, on_audio=on_audio))

            took, calls, firsts, late = [], [], [], []
            played_from, played = 0.0, 0  # the utterance's playback clock: its start, samples before
            for pos, size, end, offset, _ in plan:
                if pos == 0:
                    push, played_from, played = opened(), 0.0, 0
                    buffered = t0 + offset + HELD_BACK_FRAMES * FRAME_S + P95_BOUND_MS / 1e3
                due = t0 + offset
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                called = time.monotonic()
                pieces: list[tuple[float, int]] = []
                if schedule == "cosyvoice3":  # served: pieces where the server sends them, else the whole release
                    out = await push(mel[:, pos:pos + size], end=end,
                                     on_audio=lambda a, pieces=pieces: pieces.append((time.monotonic(), a.shape[0])))
                else:
                    out = await push(mel[:, pos:pos + size], end=end)
                done = time.monotonic()
                took.append(done - due)
                calls.append(done - called)
                pieces = pieces or [(done, int(np.shape(out)[0]))]
                firsts.append(pieces[0][0] - due)
                worst = -1e9
                for at, samples in pieces:
                    played_from = played_from or max(at, buffered)
                    worst = max(worst, at - (played_from + played / 24000))
                    played += samples
                late.append(worst)
            record(took, calls, firsts, late)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            failed(exc)

    if clients == "asyncio":
        import asyncio

        async def run_all() -> None:
            served = isinstance(vocoder, _ServerUrls)
            scheduler = None if served or not loop_scheduler else getattr(vocoder, "scheduler", None)
            if served:
                from hift_runtime.client import AsyncServerClient

                # Created in the running loop: a few per server.
                aclients = [[AsyncServerClient(url) for _ in range(4)] for url in vocoder.grpc_urls]
            if scheduler is not None:
                scheduler.attach_loop(asyncio.get_running_loop())
            try:
                await asyncio.gather(*(astream(i, aclients if served else None) for i in indices))
            finally:
                if served:
                    await asyncio.gather(*(c.close() for pool in aclients for c in pool))
                if scheduler is not None:
                    scheduler.detach_loop()

        asyncio.run(run_all())
    else:
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in indices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return rec


def run_k(vocoder, k: int, seconds: float, clients: str = "threads", collections: Any = None,
          loop_scheduler: bool = False, schedule: str = "24",
          client_processes: ClientProcesses | None = None) -> dict[str, Any]:
    """``clients``: ``threads`` (a thread per stream, ``push``) or ``asyncio`` (a task per stream on one event loop,
    no thread per stream: ``apush`` in-process, :class:`~hift_runtime.client.AsyncServerClient` served).
    ``collections``: this process's garbage-collection timer, reported for in-process runs. ``loop_scheduler``:
    in-process asyncio runs schedule from their event loop's thread (``PushScheduler.attach_loop``). ``schedule``:
    :func:`stream_plan`'s. In-process asyncio pushes hand out each step's audio as it is done (``on_audio``): a chunk's
    first audio is its first piece (elsewhere its whole release, at the push's return), an utterance's first audio its
    first chunk's. Playback of an utterance starts at its first audio, but not before the frames no vocoder can
    release yet (``audio_lag + mel_look_ahead``) plus the chunk bound (``P95_BOUND_MS``) have passed from its start (a
    player's jitter buffer: with chunks due as playback reaches their mel, a chunk's audio is needed that much after
    it is due); a piece that arrives after playback reached its first sample is a stall (its lateness is reported).
    ``client_processes``: served, the asyncio streams dealt out to these (:class:`ClientProcesses`)."""
    frames = int(seconds * 50)
    before = _counters(vocoder)
    stats = getattr(getattr(vocoder, "scheduler", None), "stats", None)  # the same object over the run

    def queued_and_largest() -> tuple[float, float]:  # batches started behind another so far, the largest batch
        if isinstance(vocoder, _Served):
            counters = vocoder.scheduler_counters()
            return counters["queued"], counters["max_batch"]
        return getattr(stats, "queued", 0), getattr(stats, "max_batch", 1)

    queued_before = queued_and_largest()[0]
    launched_before = getattr(stats, "launched_ahead", 0)
    triton_before = vocoder.batches() if isinstance(vocoder, _Served) else None
    collections_before = vocoder.full_collections()[0] if isinstance(vocoder, _Served) else 0.0
    if collections is not None:  # this process's garbage collections (hift_runtime.process_tuning.CollectionPauses)
        collections.reset()
    if client_processes is None:
        start = time.monotonic() + 0.3
        rec = drive_streams(vocoder, k, range(k), start, seconds, schedule, clients, loop_scheduler)
    else:  # a second for the processes to receive their shares before the first arrival
        start = time.monotonic() + 1.0
        rec = client_processes.run(vocoder.grpc_urls, k, start, seconds, schedule)
    wall = time.monotonic() - start
    lat, call_lat, by_index, first = rec.lat, rec.call_lat, rec.by_index, rec.first
    chunk_firsts, lateness, utterance_firsts, errors = rec.chunk_firsts, rec.lateness, rec.utterance_firsts, rec.errors
    a = np.asarray(lat) * 1e3 if lat else np.asarray([np.nan])
    f = np.asarray(first) * 1e3 if first else np.asarray([np.nan])
    c = np.asarray(call_lat) * 1e3 if call_lat else np.asarray([np.nan])
    after = _counters(vocoder)
    queued_after, largest = queued_and_largest()
    this_run = _counted_since(before, after)  # the counters run over the vocoder's life
    # The time inside the engine's calls over the run's wall time: the device's busy share as the scheduler sees it
    # (a call's host writes and wait included; calls queued behind one another overlap).
    busy_s = sum(v[2] for v in this_run["calls_batches_busy_s_by_kind"].values()) if this_run else None
    # The generator's calls alone (the main lane): where the F0 calls run beside them (f0_lane), the share that bounds.
    steps_busy_s = sum(v[2] for kind, v in this_run["calls_batches_busy_s_by_kind"].items()
                       if kind != "f0") if this_run else None
    served = vocoder.batches() if isinstance(vocoder, _Served) else None
    # Full garbage collections (each a stall of every stream of its process): this run's count; the longest of this
    # run in process, since the servers started when served.
    full, longest_ms = (vocoder.full_collections() if isinstance(vocoder, _Served)
                        else (collections.count, collections.max_s * 1e3) if collections is not None else (0, 0.0))
    return {"k": k, "push_p50_ms": round(float(np.percentile(a, 50)), 2),
            "push_p95_ms": round(float(np.percentile(a, 95)), 2), "push_p99_ms": round(float(np.percentile(a, 99)), 2),
            "push_call_p50_ms": round(float(np.percentile(c, 50)), 2),
            "push_call_p95_ms": round(float(np.percentile(c, 95)), 2),
            "first_chunk_p50_ms": round(float(np.percentile(f, 50)), 2),
            "first_chunk_p95_ms": round(float(np.percentile(f, 95)), 2),
            "throughput_audio_s_per_s": round(len(first) * frames * (2 if schedule == "cosyvoice3" else 1) * FRAME_S
                                              / wall, 1),
            "wall_s": round(wall, 2),
            **({"calls_busy_s": round(busy_s, 2), "calls_busy_share": round(busy_s / wall, 3),
                "generator_calls_busy_share": round(steps_busy_s / wall, 3)} if busy_s is not None else {}),
            **({"utterance_first_audio_p50_ms": round(float(np.percentile(utterance_firsts, 50)) * 1e3, 2),
                "utterance_first_audio_p95_ms": round(float(np.percentile(utterance_firsts, 95)) * 1e3, 2),
                "chunk_first_audio_p50_ms": round(float(np.percentile(chunk_firsts, 50)) * 1e3, 2),
                "chunk_first_audio_p95_ms": round(float(np.percentile(chunk_firsts, 95)) * 1e3, 2)}
               if schedule == "cosyvoice3" and utterance_firsts else {}),
            **({"stalled_chunks": int(sum(x > 0 for x in lateness)), "chunks_timed": len(lateness),
                "playback_lateness_p99_ms": round(float(np.percentile(lateness, 99)) * 1e3, 2)} if lateness else {}),
            "errors": len(errors), "first_error": errors[0] if errors else None,
            "refused_streams": rec.refused, "streams_served": len(first),
            "gpu_memory_mb": gpu_memory_mb(), "max_batch": largest,
            "queued_batches": queued_after - queued_before,  # started behind another on the device
            # of those, launched by the scheduler while the call ahead ran (in process only)
            "launched_ahead_batches": getattr(stats, "launched_ahead", 0) - launched_before if stats else None,
            "gc_full_collections": full - collections_before, "gc_full_collection_max_ms": round(longest_ms, 1),
            **({"batcher_this_run": this_run} if this_run is not None else {}),
            **({"triton_total": served, "triton_this_run": triton_this_run(triton_before or {}, served)}
               if served else {}),
            "push_p95_ms_by_index": [round(float(np.percentile(by_index[j], 95)) * 1e3, 1) for j in sorted(by_index)],
            **({"each_push_ms": [round(x, 1) for x in a.tolist()]} if k == 1 else {})}


def plot(result: dict[str, Any], png: Path) -> None:
    """Push p50/p95 and throughput against K, one line per config, the p95 bound marked: the picture an operator
    reads (written beside the JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, cfg) in enumerate(result["configs"].items()):
        runs = cfg["runs"]
        if not runs:
            continue
        ks = [r["k"] for r in runs]
        color = f"C{i}"
        label = f"{name} ({cfg['engine']})" if cfg.get("engine") else name
        lat.plot(ks, [r["push_p95_ms"] for r in runs], "o-", color=color, label=f"{label} p95")
        lat.plot(ks, [r["push_p50_ms"] for r in runs], "s--", color=color, alpha=0.6, label=f"{label} p50")
        thr.plot(ks, [r["throughput_audio_s_per_s"] for r in runs], "o-", color=color, label=label)
    top = max((r["k"] for c in result["configs"].values() for r in c["runs"]), default=1)
    lat.axhline(result.get("p95_bound_ms", P95_BOUND_MS), color="k", lw=1, ls=":", label="p95 bound")
    lat.set(xscale="log", yscale="log", xlabel="concurrent streams K", ylabel="push latency (ms)",
            title="push latency (from due time)")
    thr.plot([0, top], [0, top], color="k", lw=1, ls=":", label="real time (= K)")
    thr.set(xlabel="concurrent streams K", ylabel="audio seconds per second", title="throughput")
    if len(result["configs"]) > 3:  # many lines: the legends below the plots, not over them
        lat.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
        thr.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15))
        fig.set_size_inches(12, 4.2 + 0.16 * len(result["configs"]) * 2)
    else:
        lat.legend(fontsize=7)
        thr.legend(fontsize=7)
    when = f"{result['when']}, " if "when" in result else ""
    fig.suptitle(f"{png.stem}  ({when}{result.get('seconds_per_stream', '?')} s streams)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def parity_vs_cpu(vocoder, artifacts: str, streams: int = 4, frames: int = 100) -> float:
    """The runtime under test streams a few concurrent utterances; the largest difference from the CPU EP's offline
    pass of each (so a figure never comes from a runtime that computes the wrong audio)."""
    from hift_runtime import open_vocoder

    try:
        cpu = open_vocoder(artifacts, device="cpu", batching=False, engine="ort")
    except Exception:  # noqa: BLE001 - a weights-only export: the same step eagerly on the CPU
        cpu = open_vocoder(artifacts, device="cpu", batching=False, engine="compiled")
    mels = [synthetic_mel(frames, seed=7 + i) for i in range(streams)]
    got: list[np.ndarray] = [np.zeros(0)] * streams

    def one(i: int) -> None:
        s = _LocalStream(vocoder)
        pieces = [s.push(mels[i][:, p:p + CHUNK], end=p + CHUNK >= frames) for p in range(0, frames, CHUNK)]
        got[i] = np.concatenate(pieces)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(float(np.abs(g - cpu.vocode(m)).max()) for g, m in zip(got, mels))


def kept(row: dict[str, Any]) -> bool:
    """A run within the bounds and without errors: at 24-frame chunks p95 push <= P95_BOUND_MS; at CosyVoice3's a
    chunk's first audio p95 <= P95_BOUND_MS, an utterance's p95 <= UTTERANCE_FIRST_BOUND_MS, no stall at p99."""
    if "chunk_first_audio_p95_ms" in row:
        return (row["chunk_first_audio_p95_ms"] <= P95_BOUND_MS and not row["errors"]
                and row["utterance_first_audio_p95_ms"] <= UTTERANCE_FIRST_BOUND_MS
                and row.get("playback_lateness_p99_ms", 0.0) <= 0.0)
    return row["push_p95_ms"] <= P95_BOUND_MS and not row["errors"]


def bounded_p95_ms(row: dict[str, Any]) -> float:
    """The p95 the bound applies to: a chunk's first audio at CosyVoice3's chunks (a whole push may take longer while
    its first pieces play), else the whole push."""
    return row.get("chunk_first_audio_p95_ms", row["push_p95_ms"])


def p95_by_k(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each K's runs summed up: how many, the median of the p95 the bound applies to (:func:`bounded_p95_ms`) and its
    range, and how many kept the bounds (no errors)."""
    by_k: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_k.setdefault(row["k"], []).append(row)
    return {str(k): {"runs": len(runs), "median_ms": round(float(np.median([bounded_p95_ms(r) for r in runs])), 2),
                     "min_ms": min(bounded_p95_ms(r) for r in runs), "max_ms": max(bounded_p95_ms(r) for r in runs),
                     "kept_runs": sum(kept(r) for r in runs)}
            for k, runs in by_k.items()}


def main() -> None:
    from hift_runtime.argparsing import gpu_ids

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=False, help="the export to load (required unless --plot-only)")
    p.add_argument("--out", required=False, help="the result JSON (a PNG of it is written beside it)")
    p.add_argument("--plot-only", nargs="+", metavar="JSON", help="only draw the PNG beside each recorded result")
    p.add_argument("--combine", metavar="PNG", help="with --plot-only: every result's configs in this one picture")
    p.add_argument("--seconds", type=float, default=6.0, help="utterance length per stream (default 6 s)")
    p.add_argument("--schedule", choices=["24", "cosyvoice3"], default="24",
                   help="24 (default): 24-frame chunks at real-time pace; cosyvoice3: two utterances a stream slot "
                        "in CosyVoice3's chunks (50, 100, then 200 frames), each due when playback needs it")
    p.add_argument("--ks", default="1,16,64,128,256,384,512,768,1024,1536")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each K this many times in a row (on the H200 the p95 at one K spread 182-783 ms from "
                        "run to run); each run is a row, and p95_by_k sums them up (median, range, runs kept)")
    p.add_argument("--configs", default="batched,batched_tf32,per_stream")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (to try the script)")
    p.add_argument("--engine", default="ort", choices=["ort", "compiled"],
                   help="engine of the in-process configs (batched, per_stream) and of the served one (default ort)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16"],
                   help="precision of the in-process configs (batched_tf32 is ort at tf32)")
    p.add_argument("--gpus", type=gpu_ids, default=None,
                   help="CUDA device ids of the in-process configs, e.g. 0,1: one engine per GPU, streams placed on "
                        "the least-loaded (default: one device)")
    p.add_argument("--clients", default="threads", choices=["threads", "asyncio"],
                   help="the streams: a thread each (push), or tasks of one event loop (apush in-process; the asyncio "
                        "gRPC client, AsyncServerClient, for the served config)")
    p.add_argument("--warm-stream", action="store_true", help="run one stream after warmup() before measuring")
    p.add_argument("--switch-interval-ms", default=None,
                   help="Python's GIL switch interval during the runs (default: Python's 5 ms; hift-serve sets "
                        "0.5). Several, comma-separated (e.g. 5,0.5): each K runs under each, one after the other, "
                        "recorded as a config each (NAME@si=MS)")
    p.add_argument("--queue-behind", default=None,
                   help="the scheduler's queue_behind (the smallest group queued behind a call on the device; "
                        "in-process configs). Several, comma-separated (e.g. 64,1000000: the second never queues): each K runs "
                        "under each, recorded as NAME@qb=N")
    p.add_argument("--scheduler", default="thread",
                   help="who schedules in-process asyncio runs: thread (the scheduler's own thread, the default) or "
                        "loop (their event loop's thread: PushScheduler.attach_loop). Both, comma-separated "
                        "(thread,loop): each K runs under each, recorded as NAME@sched=loop")
    p.add_argument("--f0-lane", default=None,
                   help="the scheduler's f0_lane_calls (in-process configs over an engine with an F0 lane): on (every "
                        "F0 call in the lane, the default), long (a long push's only) or off (F0 calls take their "
                        "turns between the generator's); several, comma-separated (on,long): each K runs under each, "
                        "recorded as NAME@f0-lane=VALUE")
    p.add_argument("--cudnn-threads", type=int, default=None,
                   help="threads the compiled engine's warmup chooses cuDNN's algorithms in (CompiledOptions.cudnn_threads; "
                        "default: the engine's)")
    p.add_argument("--compiled-step-sizes", default=None,
                   help="the compiled engine's generator step sizes, comma-separated, 1 among them (in process; "
                        "default: the engine's): a measurement of another set before it becomes the default or is "
                        "dropped")
    p.add_argument("--inline-lone-calls", choices=["on", "off"], default=None,
                   help="the scheduler's inline_lone_calls (in process: a quiet lone push's calls in the scheduling "
                        "thread; default: the engine's, on for the compiled engine's CUDA graphs)")
    p.add_argument("--max-streams", type=int, default=None,
                   help="open streams at most (in-process configs and hift-serve --max-streams): a ramp past it shows "
                        "new streams refused with the overload message while the open ones keep real time")
    p.add_argument("--served-max-batch", type=int, default=256, help="hift-serve --max-batch (served config)")
    p.add_argument("--served-wait-ms", type=float, default=2.0,
                   help="hift-serve --max-wait-ms (served config; also the modelled configs' step batcher wait)")
    p.add_argument("--served-audio-pieces", action="store_true",
                   help="hift-serve --audio-pieces (served config): each step's audio as it is made, timed as in process")
    p.add_argument("--served-processes", type=int, default=1,
                   help="hift-serve processes sharing the device (served config): each stream goes to the one its id "
                        "picks, as ShardedClient does; --max-streams is shared out among them (default 1)")
    p.add_argument("--served-client-processes", type=int, default=1,
                   help="client processes of the served config with --clients asyncio, each an event loop driving "
                        "its share of the streams (one loop alone is the bound past ~1 000 streams; default 1)")
    p.add_argument("--served-device-model", choices=["instant", "modelled", "echo"],
                   help="the served config over a stand-in device (modelled_server.py), any host: its host cost; "
                        "echo: no runtime at all (Triton and the front end alone)")
    p.add_argument("--modelled-step-sizes", choices=sorted(STEP_SIZES), default="ort",
                   help="step sizes of the modelled configs and a served stand-in: the ORT engine's (default), the "
                        "compiled engine's (F0 at every size up to one step's F0 and past it, noise positions), or its "
                        "generator sizes for the F0 too")
    p.add_argument("--step-ms", help="FIXED,PER_ROW,F0,FINAL ms of the modelled device (modelled configs, "
                                     "--served-device-model modelled); default: the ORT engine's H200 figures")
    args = p.parse_args()
    if args.plot_only:
        results = {Path(path): json.loads(Path(path).read_text()) for path in args.plot_only}
        if args.combine:  # every config of every result in one picture, named by its file
            merged = {"configs": {f"{path.stem}: {name}": cfg for path, r in results.items()
                                  for name, cfg in r["configs"].items()},
                      "seconds_per_stream": "/".join(sorted({str(r.get("seconds_per_stream")) for r in
                                                             results.values()}))}
            plot(merged, Path(args.combine))
        else:
            for path, r in results.items():
                plot(r, path.with_suffix(".png"))
        return
    if not args.artifacts or not args.out:
        p.error("--artifacts and --out are required (unless --plot-only)")
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    from hift_runtime import CompiledOptions, open_vocoder
    from hift_runtime.process_tuning import CollectionPauses, keep_freed_memory, tune_garbage_collector

    collections = CollectionPauses()

    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "onnxruntime": ort.__version__, "seconds_per_stream": args.seconds,
                              "chunk_frames": CHUNK, "p95_bound_ms": P95_BOUND_MS, "command": "python "
                              "benchmarks/load_test.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
                              "configs": {}}
    ks = [int(x) for x in args.ks.split(",")]
    keep_freed_memory()  # as hift-serve's processes do: in-process and served alike
    intervals_ms = [float(x) for x in args.switch_interval_ms.split(",")] if args.switch_interval_ms else [None]
    queue_behinds = [int(x) for x in args.queue_behind.split(",")] if args.queue_behind else [None]
    drivers = args.scheduler.split(",")
    if not set(drivers) <= {"thread", "loop"}:
        p.error(f"--scheduler takes thread, loop or both, got {args.scheduler!r}")
    if "loop" in drivers and args.clients != "asyncio":
        p.error("--scheduler loop schedules from the clients' event loop: it needs --clients asyncio")
    # Each K runs under every (switch interval, queue_behind, scheduler) variant, one after the other, on the same
    # open vocoder.
    lane_calls = {"on": "all", "long": "long", "off": "none"}
    if args.f0_lane and (not set(args.f0_lane.split(",")) <= set(lane_calls) or "served" in args.configs.split(",")):
        p.error("--f0-lane takes on, long, off or several of them, for the in-process configs (hift-serve runs the "
                "engine's defaults)")
    f0_lanes = args.f0_lane.split(",") if args.f0_lane else [None]
    variants = [(ms, qb, d, lane) for ms in intervals_ms for qb in queue_behinds for d in drivers for lane in f0_lanes]
    if args.served_client_processes > 1 and (args.clients != "asyncio" or "served" not in args.configs.split(",")):
        p.error("--served-client-processes deals the served config's streams to asyncio clients: it needs "
                "--configs served and --clients asyncio")
    if args.compiled_step_sizes:
        if args.engine != "compiled" or "served" in args.configs.split(","):
            p.error("--compiled-step-sizes is for the compiled engine in process")
        from hift_torch.compiled import CompiledBackend

        # open_vocoder builds the backend with its default sizes: the measured set replaces that default here.
        sizes = tuple(int(x) for x in args.compiled_step_sizes.split(","))
        CompiledBackend.__init__.__kwdefaults__["step_sizes"] = sizes
    if args.cudnn_threads and (args.engine != "compiled" or "served" in args.configs):
        p.error("--cudnn-threads is for the compiled engine in process (hift-serve runs the engine's defaults)")
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        if name == "served":
            stand_in = None if not args.served_device_model else [
                "--device-model", args.served_device_model, "--step-sizes", args.modelled_step_sizes,
                *(["--step-ms", args.step_ms] if args.step_ms else [])]
            vocoder = _Served(args.artifacts, args.device, args.served_max_batch, args.served_wait_ms,
                              Path(args.out).with_suffix(".served.log"), args.engine, args.precision, stand_in,
                              args.max_streams and -(-args.max_streams // args.served_processes),
                              args.served_processes, args.served_audio_pieces)
        elif name.startswith("modelled"):  # the scheduler over a modelled H200 (host_path.ModelledDevice), any host
            from modelled_server import stand_in_vocoder

            vocoder = stand_in_vocoder(args.artifacts, "instant" if name == "modelled_instant" else "modelled",
                                       args.step_ms, args.served_wait_ms / 1e3, args.modelled_step_sizes)
        else:
            batching = {"batched": True, "batched_tf32": True, "per_stream": False}[name]
            engine = args.engine if name in ("batched", "per_stream") else "ort"
            precision = "tf32" if name == "batched_tf32" else args.precision
            options = CompiledOptions(cudnn_threads=args.cudnn_threads) if engine == "compiled" else None
            vocoder = open_vocoder(args.artifacts, device=args.device, engine=engine, precision=precision,
                                   options=options, batching=batching, devices=args.gpus,
                                   max_streams=args.max_streams)
            vocoder.warmup(progress=lambda msg: print(name, msg, flush=True))
        ready_s = round(time.perf_counter() - t0, 1)  # opened and warmed up: the start-up (no parity check in it)
        if args.inline_lone_calls and getattr(vocoder, "scheduler", None) is not None:
            vocoder.scheduler.inline_lone_calls = args.inline_lone_calls == "on"
        parity = None if name == "served" or name.startswith("modelled") else parity_vs_cpu(vocoder, args.artifacts)
        print(name, "largest difference from the CPU EP's offline pass:", parity, flush=True)
        if args.max_streams and name != "served":
            vocoder.max_streams = args.max_streams
        warm_stream_s = None
        if args.warm_stream:
            # One stream through every shape a stream meets, after warmup(): what warmup() leaves unprepared shows
            # here and not in the K = 1 figures (see BENCHMARKS.md).
            t1 = time.perf_counter()
            run_k(vocoder, 1, args.seconds)
            warm_stream_s = round(time.perf_counter() - t1, 2)
        if name != "served":
            tune_garbage_collector()  # as hift-serve does once warm
        # One record per variant (the same open vocoder): NAME, or NAME@si=MS / @qb=N / @sched=D / @f0-lane=L,
        # joined by commas, for each axis with several values.
        def key_of(ms: float | None, qb: int | None, driver: str, lane: str | None) -> str:
            parts = (([f"si={ms:g}"] if len(intervals_ms) > 1 else []) + ([f"qb={qb}"] if len(queue_behinds) > 1 else [])
                     + ([f"f0-lane={lane}"] if len(f0_lanes) > 1 else [])
                     + ([f"sched={driver}"] if len(drivers) > 1 else []))
            return f"{name}@{','.join(parts)}" if parts else name

        # A served config schedules inside its servers (hift-serve's scheduler thread): no loop-driven variant.
        keys = {v: key_of(*v) for v in variants if name != "served" or v[2] == "thread"}
        rows_of: dict[tuple[float | None, int | None, str, str | None], list[dict[str, Any]]] = {v: [] for v in keys}
        backend = getattr(vocoder, "backend", None)
        for (ms, qb, driver, lane), key in keys.items():
            result["configs"][key] = {"open_and_warmup_s": ready_s,
                                      "inline_lone_calls": getattr(getattr(vocoder, "scheduler", None),
                                                                   "inline_lone_calls", None),
                                      "warm_stream_s": warm_stream_s, "parity_max_abs_vs_cpu": parity,
                                      "switch_interval_ms": ms, "queue_behind": qb,
                                      "f0_lane_calls": getattr(getattr(vocoder, "scheduler", None),
                                                               "f0_lane_calls", None) if lane is None
                                      else lane_calls[lane],
                                      "loop_scheduler": driver == "loop",  # asyncio clients, in process
                                      "traits": (dataclasses.asdict(backend.traits)
                                                 if backend is not None and hasattr(backend, "traits") else None),
                                      "cudnn_threads": args.cudnn_threads,
                                      "engine": (f"hift-serve --engine {args.engine} --precision {args.precision}"
                                                 + (f" x {args.served_processes} processes" if args.served_processes > 1 else "")
                                                 + (f"; {args.served_client_processes} client processes"
                                                    if args.served_client_processes > 1 else "")
                                                 if name == "served" else
                                                 getattr(backend, "name", name)),
                                      "gpu_memory_after_warmup_mb": gpu_memory_mb(), "runs": rows_of[(ms, qb, driver, lane)],
                                      "warmup_seconds_by_shape": getattr(backend, "warmup_seconds", None)}
        client_processes = (ClientProcesses(args.served_client_processes) if name == "served"
                            and args.clients == "asyncio" and args.served_client_processes > 1 else None)
        try:
            for k in [k for k in ks for _ in range(args.repeats)]:
                ended = 0
                for (ms, qb, driver, lane), key in keys.items():
                    if ms is not None:
                        sys.setswitchinterval(ms / 1e3)
                    if qb is not None and getattr(vocoder, "scheduler", None) is not None:
                        vocoder.scheduler.queue_behind = qb
                    if lane is not None and getattr(vocoder, "scheduler", None) is not None:
                        vocoder.scheduler.f0_lane_calls = lane_calls[lane]
                    row = run_k(vocoder, k, args.seconds, args.clients, collections, driver == "loop", args.schedule,
                                client_processes)
                    rows_of[(ms, qb, driver, lane)].append(row)
                    print(key, json.dumps(row), flush=True)
                    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
                    # A miss does not end the ramp: a batching runtime can keep up better at larger K (bigger
                    # batches). A collapse (p95 past 10x the bound) or an error does, once every interval had one.
                    ended += bounded_p95_ms(row) > 10 * P95_BOUND_MS or bool(row["errors"])
                if ended == len(keys):
                    break
        finally:  # a served config's server never outlives the script
            if client_processes is not None:
                client_processes.close()
            vocoder.close()
            gc.unfreeze()  # this config's objects become collectable again
        for v, key in keys.items():  # streams served within the bound (past --max-streams, not the refused ones)
            served = [r["streams_served"] for r in rows_of[v] if kept(r)]
            result["configs"][key]["max_realtime_streams_at_p95_bound"] = max(served, default=0)
            result["configs"][key]["p95_by_k"] = p95_by_k(rows_of[v])
        del vocoder
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
