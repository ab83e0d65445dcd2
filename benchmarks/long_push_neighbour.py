"""A real-time stream beside a long push: how long the real-time stream's 24-frame pushes take alone and while another
stream pushes 1 000-frame chunks back to back, at each CPU step size (``max_step_frames``). Not a test: it reports.

    python benchmarks/long_push_neighbour.py --artifacts DIR --out benchmarks/results/long-push-neighbour-2core.json

The real-time stream sends a chunk every 480 ms (its audio's length) and its push latency is timed; the long stream
starts once the real-time one has been timed alone. Each step size runs in a fresh vocoder (ORT engine, batching on,
as ``hift-serve`` runs it); a long push is also timed alone first (three times), for what the step size costs
per frame.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from hift_runtime import open_vocoder

CHUNK_FRAMES, LONG_FRAMES = 24, 1000


def _mel(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(-5.0, 1.0, (80, frames)).astype(np.float32)


def _real_time_pushes(vocoder, count: int) -> list[float]:
    stream, times = vocoder.stream(), []
    period = CHUNK_FRAMES * vocoder.constants.samples_per_frame / vocoder.constants.sample_rate
    for k in range(count):
        started = time.monotonic()
        stream.push(_mel(CHUNK_FRAMES, k))
        times.append(time.monotonic() - started)
        time.sleep(max(0.0, period - times[-1]))
    stream.close()
    return times[1:]  # the first push is the stream's first (its own shapes)


def _summary(times: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.median(times)) * 1e3, 1), "p95_ms": round(float(np.percentile(times, 95)) * 1e3, 1)}


def measure(artifacts: str, step_frames: int, pushes: int) -> dict:
    with open_vocoder(artifacts, device="cpu", batching=True) as vocoder:
        vocoder.max_step_frames = step_frames
        long_alone = []
        for _ in range(3):
            stream, started = vocoder.stream(), time.monotonic()
            stream.push(_mel(LONG_FRAMES, 99))
            long_alone.append(time.monotonic() - started)
            stream.close()
        alone = _real_time_pushes(vocoder, pushes)
        stop, long_pushes = threading.Event(), []

        def long_stream() -> None:
            stream = vocoder.stream()
            while not stop.is_set():
                started = time.monotonic()
                stream.push(_mel(LONG_FRAMES, 99))
                long_pushes.append(time.monotonic() - started)

        worker = threading.Thread(target=long_stream)
        busy_before, started = vocoder.scheduler.stats.busy_s, time.monotonic()
        worker.start()
        time.sleep(0.3)
        beside = _real_time_pushes(vocoder, pushes)
        stop.set()
        worker.join()
        busy = (vocoder.scheduler.stats.busy_s - busy_before) / (time.monotonic() - started)
    row = {"max_step_frames": step_frames, "alone": _summary(alone), "beside_long_push": _summary(beside),
           "p50_ratio": round(float(np.median(beside) / np.median(alone)), 2),
           "long_push_alone_s_p50": round(float(np.median(long_alone)), 2),
           "long_push_beside_s_p50": round(float(np.median(long_pushes)), 2), "device_busy_share": round(busy, 2)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", required=True, help="an export folder (hift-export --out)")
    parser.add_argument("--steps", default="64,24", help="the max_step_frames to compare, comma-separated")
    parser.add_argument("--pushes", type=int, default=16, help="real-time pushes timed in each phase")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # random mel outside the log-mel range: the cost is the same
    rows = [measure(args.artifacts, int(s), args.pushes) for s in args.steps.split(",")]
    if args.out:
        args.out.write_text(json.dumps({"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                        "cpus": os.cpu_count(), "artifacts": args.artifacts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
