"""A stream longer than upstream's 300 s noise table, in 24-frame chunks: memory stays flat, the output stays finite
and continuous across the table's wrap, and the stream matches one offline pass. Too slow for CI at full size;
its output is recorded in benchmarks/results/.

    python benchmarks/long_stream.py --artifacts artifacts --frames 15200 --out benchmarks/results/long_stream.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--frames", type=int, default=15200)
    p.add_argument("--chunk", type=int, default=24)
    p.add_argument("--out")
    args = p.parse_args()
    from hift_runtime import open_vocoder

    vocoder = open_vocoder(args.artifacts, device="cpu")
    spf = vocoder.constants.samples_per_frame
    rng = np.random.default_rng(0)
    walk = np.cumsum(rng.standard_normal((80, args.frames)).astype(np.float32) * 0.15, axis=1)
    mel = (np.tanh(walk / 8) * 3 - 5).astype(np.float32)
    stream = vocoder.stream()
    # Output goes into one preallocated buffer, as a server writes to a socket or file: keeping 600+ small chunk
    # arrays alive fragments the heap and would measure the caller, not the runtime.
    audio = np.empty(args.frames * spf, np.float32)
    filled, rss = 0, {"start": rss_mb()}
    rss_trace: list[tuple[int, float]] = []
    started = time.perf_counter()
    for i, pos in enumerate(range(0, args.frames, args.chunk)):
        piece = stream.push(mel[:, pos:pos + args.chunk])
        audio[filled:filled + piece.shape[0]] = piece
        filled += piece.shape[0]
        if i == (args.frames // args.chunk) // 2:
            rss["middle"] = rss_mb()
        if i % 100 == 0:
            rss_trace.append((i, round(rss_mb(), 1)))
    rss["before_finish"] = rss_mb()  # finish() runs the final graph for the first time: its arena is one-off
    piece = stream.finish()
    audio[filled:filled + piece.shape[0]] = piece
    filled += piece.shape[0]
    stream_s = time.perf_counter() - started
    rss["end"] = rss_mb()
    offline = vocoder.vocode(mel)
    table = vocoder.noise.length
    per_minute = []
    minute = 60 * 24000
    for start in range(0, audio.shape[0], minute):
        a, b = audio[start:start + minute].astype(np.float64), offline[start:start + minute].astype(np.float64)
        err = float(np.sum((a - b) ** 2))
        per_minute.append({"minute": start // minute, "max_abs": float(np.max(np.abs(a - b))),
                           "snr_db": float(10 * np.log10(np.sum(b ** 2) / max(err, 1e-300)))})
    steps = np.abs(np.diff(audio.astype(np.float64)))
    around_wrap = steps[table - 2400: table + 2400] if audio.shape[0] > table + 2400 else np.zeros(1)
    report = {
        "frames": args.frames, "seconds": args.frames * spf / 24000, "chunk": args.chunk,
        "noise_table_rows": table, "weights": vocoder.backend.manifest.data["weights"],
        "config_base_channels": vocoder.backend.manifest.config["base_channels"],
        "length_exact": filled == args.frames * spf, "finite": bool(np.isfinite(audio).all()),
        "rss_mb": rss, "rss_growth_mb": rss["end"] - rss["start"],
        "rss_growth_steady_mb (chunk 100 -> before finish, incl. 27 MB of output buffer pages)":
            rss["before_finish"] - dict(rss_trace)[100],
        "rss_by_chunk": rss_trace,
        "max_mel_cache_frames": stream.stats.max_mel_cache, "stream_wall_s": stream_s,
        "sample_step_max_around_wrap": float(around_wrap.max()), "sample_step_p999_overall": float(
            np.percentile(steps, 99.9)),
        "stream_vs_offline_by_minute": per_minute,
        "command": f"python benchmarks/long_stream.py --artifacts {args.artifacts} --frames {args.frames}",
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
