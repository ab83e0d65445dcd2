"""One start of the compiled engine, timed line by line: open and warmup (a cold start on a fresh inductor cache, a
warm one after it), then the graphs' replays and a stream against the offline pass. Not a test.

Each progress line of the warmup is printed with the seconds since the start as it comes, so a run cut by a time
limit still says how far it got. Point ``TORCHINDUCTOR_CACHE_DIR`` at an empty folder for a cold start; run again
with the same folder for a warm one::

    TORCHINDUCTOR_CACHE_DIR=/tmp/cache python benchmarks/engine_start.py --artifacts DIR --precision fp16 \\
        --max-streams 3100 [--cudnn-threads 8] [--out R.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time

REPLAYS = 30
BATCHES = (2, 64, 256)


def replay_ms(backend, batches: tuple[int, ...] = BATCHES, replays: int = REPLAYS) -> dict[str, float]:
    """The median replay (ms, device synchronized around each) of ``backend``'s captured 24-frame step and final step
    at each of ``batches``, keyed ``kind@frames x batch``."""
    import torch

    medians: dict[str, float] = {}
    for kind, size in (("generator", backend.step_window_frames or 24), ("final", backend.final_frames)):
        for batch in batches:
            graph = backend.captured(kind, size, batch).graph
            times = []
            for _ in range(replays):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            medians[f"{kind}@{size}x{batch}"] = round(statistics.median(times), 3)
    return medians


def stream_vs_offline_db(vocoder, frames: int = 300, chunk: int = 24) -> tuple[float, int]:
    """SNR (dB) of a stream pushed in ``chunk``-frame pieces against the offline pass of the same mel (the stream
    runs the captured graphs, the offline pass the eager step), and the samples compared."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.standard_normal((80, frames)).astype(np.float32) * 1.5 - 5.0
    mel = np.cumsum(base * 0.3, axis=1, dtype=np.float32) / np.sqrt(np.arange(1, frames + 1, dtype=np.float32)) - 5
    stream = vocoder.stream()
    pieces = [stream.push(mel[:, i:i + chunk]) for i in range(0, frames, chunk)]
    pieces.append(stream.finish())
    streamed, offline = np.concatenate(pieces), vocoder.vocode(mel)
    n = min(len(streamed), len(offline))
    error = np.sum((streamed[:n] - offline[:n]) ** 2)
    return float(10 * np.log10(np.sum(offline[:n] ** 2) / max(error, 1e-30))), n


def main() -> None:

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--max-streams", type=int, default=2044, help="the engine's streams (its device cache slots)")
    p.add_argument("--cudnn-threads", type=int, default=None,
                   help="CompiledOptions.cudnn_threads (default: the engine's, by free device memory)")
    p.add_argument("--out", help="a JSON of the results")
    args = p.parse_args()
    started = time.perf_counter()
    lines: list[str] = []  # (kept in the results too: a log cut short by a pipe keeps only its tail)

    def say(message: str) -> None:
        lines.append(f"[{time.perf_counter() - started:6.1f} s] {message}")
        print(lines[-1], flush=True)

    from hift_runtime import CompiledOptions, open_vocoder
    from hift_torch.compiled import compile_count

    vocoder = open_vocoder(args.artifacts, device="cuda", engine="compiled", precision=args.precision,
                           max_streams=args.max_streams, options=CompiledOptions(cudnn_threads=args.cudnn_threads))
    say("opened")
    vocoder.warmup(progress=say)
    backend = vocoder.backend
    result: dict = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "command": "python benchmarks/engine_start.py " + " ".join(sys.argv[1:]),
                    "cudnn_threads": args.cudnn_threads, "cudnn_choice": backend.cudnn_choice(),
                    "step_window": backend.step_window_frames,
                    "open_and_warmup_s": round(time.perf_counter() - started, 1),
                    "first_call_seconds": backend.first_call_seconds, "warmup_seconds": backend.warmup_seconds}
    say("open and warmup done")
    for shape, ms in replay_ms(backend).items():
        result[f"replay_ms {shape}"] = ms
        say(f"replay {shape}: {ms} ms (median of {REPLAYS})")
    result["stream_vs_offline_db"], samples = stream_vs_offline_db(vocoder)
    result["compiles_after_warmup"] = compile_count() - backend.compiles_at_warmup
    say(f"a stream against the offline pass: {result['stream_vs_offline_db']:.1f} dB over {samples} samples; "
        f"compiles after warmup: {result['compiles_after_warmup']}")
    result["lines"] = lines
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
