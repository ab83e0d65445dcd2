"""The stock-Triton repository served by a real tritonserver, against the same export in process (ONNX Runtime, CPU).

Two parts, each on a repository written by ``write_triton_repository`` (what ``hift-export --triton-repo`` calls) and
served by ``serve.sh`` of a real-Triton build (``--triton-home``, the ``REAL_TRITON_HOME`` of the tests):

* **throughput**: 1 and 8 concurrent streams, each a ``--seconds`` utterance in 24-frame chunks sent back to back
  (each chunk after the previous reply); audio seconds made per wall second, chunk latency median and p95, served
  against in-process (``open_vocoder(engine="ort", device="cpu")``, its batching scheduler), and their ratio;
* **real time**: ``--streams`` clients (asyncio, one ``AsyncServerClient``), their starts spread over one
  utterance, each chunk sent when real-time playback of the audio before it needs it (or at its previous reply if
  later), against a repository of ``--capacity`` streams: how many were accepted, refused at the START timeout
  (overloaded) and lost after they started (must be 0), and the accepted streams' chunk latency from due time.

Each part reports the server's CPU busy share (its process's CPU time over wall time and cores).

    python benchmarks/triton_served.py --artifacts DIR --triton-home PREFIX --out R.json [--capacity 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hift_runtime import open_vocoder  # noqa: E402
from hift_runtime.client import AsyncServerClient, ServerClient, ServerOverloaded  # noqa: E402
from hift_runtime.manifest import read_manifest  # noqa: E402

CHUNK = 24


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Server:
    """A real tritonserver on a fresh repository of ``capacity`` streams; stopped on exit."""

    def __init__(self, artifacts: str, home: str, serve: Path, capacity: int) -> None:
        from hift_export.triton_repo import write_triton_repository

        self.folder = Path(tempfile.mkdtemp(prefix="hift-triton-bench-"))
        write_triton_repository(read_manifest(artifacts), self.folder / "repo", max_streams=capacity,
                                log=lambda _: None)
        http, grpc, metrics = free_ports(3)
        done = subprocess.run(["bash", str(serve), str(self.folder / "repo"), str(http), str(grpc), str(metrics),
                               str(self.folder / "triton.log")], env={**os.environ, "REAL_TRITON_HOME": home,
                                                                       "WAIT_READY": "300"},
                              capture_output=True, text=True, timeout=400)
        if done.returncode != 0:
            raise SystemExit(f"tritonserver did not start: {done.stderr[-2000:]}")
        self.pid = int(done.stdout.split()[0])
        self.url = f"127.0.0.1:{grpc}"

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGTERM)
        for _ in range(300):
            try:
                os.kill(self.pid, 0)
            except OSError:
                break
            time.sleep(0.1)


def mel_of(frames: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((80, frames)) * 1.5 - 5).astype(np.float32)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values) * 1e3
    return {"median_ms": round(float(np.median(a)), 1), "p95_ms": round(float(np.percentile(a, 95)), 1),
            "max_ms": round(float(a.max()), 1), "count": len(values)}


def throughput(make_stream, streams: int, frames: int, spf: int, rate: int, busy=None) -> dict:
    """``streams`` threads, each a ``frames`` utterance in 24-frame chunks back to back."""
    latencies: list[float] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        mel, stream, own = mel_of(frames, i), make_stream(), []
        for pos in range(0, frames, CHUNK):
            t = time.perf_counter()
            stream(mel[:, pos:pos + CHUNK], pos + CHUNK >= frames)
            own.append(time.perf_counter() - t)
        with lock:
            latencies.extend(own)

    cpu0 = busy() if busy else None
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out = {"streams": streams, "wall_s": round(wall, 2),
           "audio_s_per_s": round(streams * frames * spf / rate / wall, 2), "chunk": summary(latencies)}
    if busy:
        out["server_busy_share"] = round((busy() - cpu0) / wall / os.cpu_count(), 2)
    return out


async def realtime(url: str, streams: int, frames: int, spf: int, rate: int) -> dict:
    """``streams`` real-time clients, their starts spread over one utterance. A stream plays from its first reply
    on; its chunk k >= 1 is sent (k - 1) chunks after that (or at the previous reply, if later), as a TTS producing mel
    in real time sends it; it stalls when a reply comes after playback reached the audio it releases."""
    client = AsyncServerClient(url)
    chunk_s, frame_s = CHUNK * spf / rate, spf / rate
    utterance_s = frames * spf / rate
    results = {"accepted": 0, "overloaded": 0, "lost": 0, "stalls": 0, "errors": []}
    latencies: list[float] = []
    first_audio: list[float] = []
    t0 = time.perf_counter() + 0.5

    async def one(i: int) -> None:
        start = t0 + i * utterance_s / streams
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        mel, stream = mel_of(frames, i), client.stream()
        played_from = sent = start
        for k, pos in enumerate(range(0, frames, CHUNK)):
            if k:
                sent = max(time.perf_counter(), played_from + (k - 1) * chunk_s)
                await asyncio.sleep(max(0.0, sent - time.perf_counter()))
            try:
                await stream.push(mel[:, pos:pos + CHUNK], end=pos + CHUNK >= frames)
            except ServerOverloaded:
                results["overloaded"] += 1
                return
            except Exception as exc:  # noqa: BLE001 - a stream lost after it started
                results["lost"] += 1
                results["errors"].append(str(exc)[:200])
                return
            now = time.perf_counter()
            if k == 0:
                results["accepted"] += 1
                played_from = now
                first_audio.append(now - start)
                continue
            latencies.append(now - sent)
            # Playback reaches this chunk's first sample after the audio released before it (8 frames held back).
            results["stalls"] += now > played_from + (pos - 8) * frame_s

    await asyncio.gather(*(one(i) for i in range(streams)))
    await client.close()
    results["first_audio"] = summary(first_audio)
    results["chunk_latency"] = summary(latencies)
    results["errors"] = results["errors"][:5]
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--triton-home", required=True, help="a real-Triton build (build.sh's PREFIX)")
    p.add_argument("--serve", default=str(ROOT.parent / "shared" / "tools" / "real-triton" / "serve.sh"))
    p.add_argument("--seconds", type=float, default=5.0, help="utterance length (default 5)")
    p.add_argument("--streams", default="2,256", help="real-time runs: clients in each (default 2,256)")
    p.add_argument("--capacity", type=int, default=2, help="the real-time run's repository capacity (default 2)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    manifest = read_manifest(args.artifacts)
    spf, rate = 480, int(manifest.config["sampling_rate"])
    frames = int(args.seconds * rate / spf) // CHUNK * CHUNK
    report: dict = {"machine": f"{platform.node()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
                    "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "utterance_frames": frames,
                    "chunk_frames": CHUNK}
    if not args.skip_throughput:
        vocoder = open_vocoder(args.artifacts, engine="ort", device="cpu")
        vocoder.vocode(mel_of(48, 0))  # warm

        def local_stream():
            stream = vocoder.stream()
            return lambda mel, end: stream.finish(mel) if end else stream.push(mel)

        report["in_process"] = [throughput(local_stream, n, frames, spf, rate) for n in (1, 8)]
        vocoder.close()
        with Server(args.artifacts, args.triton_home, Path(args.serve), 8) as server:
            def served_stream():
                stream = ServerClient(server.url).stream()
                return lambda mel, end: stream.push(mel, end=end)

            served_stream()(mel_of(48, 0), True)  # warm
            report["served"] = [throughput(served_stream, n, frames, spf, rate, server.cpu_seconds) for n in (1, 8)]
        report["served_over_in_process"] = [round(s["audio_s_per_s"] / i["audio_s_per_s"], 2)
                                            for s, i in zip(report["served"], report["in_process"])]
        print(json.dumps({k: report[k] for k in ("in_process", "served", "served_over_in_process")}, indent=1))
    report["realtime"] = []
    with Server(args.artifacts, args.triton_home, Path(args.serve), args.capacity) as server:
        for streams in (int(x) for x in args.streams.split(",")):
            cpu0, t = server.cpu_seconds(), time.perf_counter()
            run = asyncio.run(realtime(server.url, streams, frames, spf, rate))
            run["server_busy_share"] = round((server.cpu_seconds() - cpu0) / (time.perf_counter() - t)
                                             / os.cpu_count(), 2)
            run.update(streams=streams, capacity=args.capacity)
            report["realtime"].append(run)
            print(json.dumps(run, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
