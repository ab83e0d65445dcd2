"""One start of the compiled engine, timed line by line: open and warmup (a cold start on a fresh inductor cache, a
warm one after it), then the graphs' replays and a stream against the offline pass. Not a test.

Each progress line of the warmup is printed with the seconds since the start as it comes, so a run cut by a time
limit still says how far it got. Point ``TORCHINDUCTOR_CACHE_DIR`` at an empty folder for a cold start; run again
with the same folder for a warm one::

    TORCHINDUCTOR_CACHE_DIR=/tmp/cache python benchmarks/engine_start.py --artifacts DIR --precision fp16 \\
        --slots 3100 [--cudnn-threads 8] [--cudnn-algorithms heuristics] [--step-window on] \\
        [--warmup-switch-interval-ms off] [--out R.json]
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
    at each of ``batches``, keyed ``kind@frames x batch`` (also ``cudnn_benchmark_limit.py``'s)."""
    import torch

    medians: dict[str, float] = {}
    for kind, size in (("generator", 24), ("final", backend.final_frames)):
        for batch in batches:
            graph = backend._graphs[(kind, size, batch)].graph
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


def interval_s(text: str) -> float | None:
    """``--warmup-switch-interval-ms``: a number of ms, as seconds, or ``off`` (None: the process's own)."""
    if text == "off":
        return None
    try:
        return float(text) / 1e3
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of ms or off, got {text!r}") from None


def main() -> None:
    from hift_runtime import CudaOptions
    from hift_runtime.sessions import CALL_LANES, CUDNN_ALGORITHMS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--slots", type=int, default=2048, help="the engine's device cache slots (CudaOptions.slots)")
    p.add_argument("--cudnn-threads", type=int, default=None,
                   help="CudaOptions.cudnn_threads (default: the engine's, by free device memory)")
    p.add_argument("--cudnn-algorithms", choices=CUDNN_ALGORITHMS, default=None,
                   help="CudaOptions.cudnn_algorithms (default: the precision's)")
    p.add_argument("--step-window", choices=["on", "off"], default=None,
                   help="CudaOptions.step_window: the stream step as one graph of the largest step size (default: the "
                        "precision's)")
    p.add_argument("--call-lanes", type=int, choices=CALL_LANES, default=1,
                   help="CudaOptions.call_lanes: every shape captured once per lane (default 1)")
    p.add_argument("--warmup-switch-interval-ms", dest="warmup_switch_interval_s", type=interval_s, metavar="MS",
                   default=CudaOptions.warmup_switch_interval_s,
                   help="CudaOptions.warmup_switch_interval_s in ms, or off: the process's own, Python's 5 ms "
                        "(default: the engine's, 0.5 ms)")
    p.add_argument("--out", help="a JSON of the results")
    args = p.parse_args()
    started = time.perf_counter()
    lines: list[str] = []  # (kept in the results too: a log cut short by a pipe keeps only its tail)

    def say(message: str) -> None:
        lines.append(f"[{time.perf_counter() - started:6.1f} s] {message}")
        print(lines[-1], flush=True)

    from hift_runtime import open_vocoder
    from hift_torch.compiled import compile_count

    step_window = None if args.step_window is None else args.step_window == "on"
    vocoder = open_vocoder(args.artifacts, device="cuda", engine="compiled", precision=args.precision,
                           cuda=CudaOptions(slots=args.slots, cudnn_threads=args.cudnn_threads,
                                            cudnn_algorithms=args.cudnn_algorithms, step_window=step_window,
                                            call_lanes=args.call_lanes,
                                            warmup_switch_interval_s=args.warmup_switch_interval_s))
    say("opened")
    vocoder.warmup(progress=say)
    backend = vocoder.backend
    result: dict = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "command": "python benchmarks/engine_start.py " + " ".join(sys.argv[1:]),
                    "cudnn_threads": args.cudnn_threads, "cudnn_algorithms": backend.cudnn_algorithms,
                    "step_window": backend.step_window_frames, "call_lanes": backend.call_lanes,
                    "warmup_switch_interval_s": backend.warmup_switch_interval_s,
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
