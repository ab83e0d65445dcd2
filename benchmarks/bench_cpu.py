"""CPU benchmark: per-chunk latency of the ORT runtime vs eager PyTorch through the same streaming bookkeeping, and
incremental vs whole-window F0. Not a test: it reports medians and ratios measured in one run.

    python benchmarks/bench_cpu.py --artifacts artifacts [--seconds 10] [--chunk 24] [--out benchmarks/results/x.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def percentile(values, q):
    return float(np.percentile(np.asarray(values) * 1e3, q))


def time_stream(vocoder, mel, chunk):
    stream = vocoder.stream()
    lat = []
    for pos in range(0, mel.shape[1], chunk):
        t0 = time.perf_counter()
        stream.push(mel[:, pos:pos + chunk])
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    stream.finish()
    lat.append(time.perf_counter() - t0)
    return lat


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--chunk", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()

    import onnxruntime as ort
    import torch

    from hift_export.backend import torch_vocoder
    from hift_export.parity import reference_backend
    from hift_runtime import open_vocoder

    vocoder = open_vocoder(args.artifacts, device="cpu")
    c = vocoder.constants
    eager = torch_vocoder(reference_backend(vocoder.backend.manifest).hift, noise=vocoder.noise)
    frames = int(args.seconds * 50)
    rng = np.random.default_rng(0)
    mel = (np.cumsum(rng.standard_normal((80, frames)).astype(np.float32) * 0.2, axis=1) * 0.2 - 5).astype(np.float32)
    time_stream(vocoder, mel[:, :60], args.chunk)  # warm-up
    results = {}
    for name, v in (("ort_cpu", vocoder), ("eager_torch_cpu", eager)):
        runs = [time_stream(v, mel, args.chunk) for _ in range(args.repeats)]
        lat = [x for run in runs for x in run[1:-1]]  # steady-state chunks
        totals = [sum(run) for run in runs]
        results[name] = {"chunk_median_ms": percentile(lat, 50), "chunk_p95_ms": percentile(lat, 95),
                         "first_chunk_ms": float(np.median([run[0] for run in runs]) * 1e3),
                         "total_s": float(np.median(totals)),
                         "rtf": float(np.median(totals) / (frames / 50))}
    # F0: incremental (chunk + 8 left context) vs the whole window (window + look-ahead + margin + chunk).
    f0 = vocoder.backend.f0_session
    inc, whole = args.chunk + c.f0_left_context, c.window_frames + 8 + args.chunk + c.f0_left_context
    f0_times = {}
    for label, n in (("incremental", inc), ("whole_window", whole)):
        x = mel[None, :, :n].copy()
        for _ in range(3):
            f0.run(None, {"mel": x})
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            f0.run(None, {"mel": x})
            ts.append(time.perf_counter() - t0)
        f0_times[label] = {"frames": n, "median_ms": percentile(ts, 50)}
    report = {
        "date": dt.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count()},
        "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "workload": {"seconds": args.seconds, "chunk_frames": args.chunk, "window_frames": c.window_frames,
                     "f0_precision": vocoder.backend.manifest.data.get("f0_precision")},
        "arms": results,
        "ratios": {"eager_over_ort_chunk_median": results["eager_torch_cpu"]["chunk_median_ms"]
                   / results["ort_cpu"]["chunk_median_ms"]},
        "f0": f0_times | {"whole_over_incremental": f0_times["whole_window"]["median_ms"]
                          / f0_times["incremental"]["median_ms"]},
        "command": "python benchmarks/bench_cpu.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
