"""Where a lone stream's push goes on the compiled engine: the device's replays, the host's copies around them, the
stream's bookkeeping, and the scheduler's hand-offs, each timed apart on the same warmed engine. Not a test: it
reports figures (issue 20's target for a lone push is 3 ms in tf32 / fp16, 4 ms in fp32).

    python benchmarks/lone_push.py --artifacts DIR --precision tf32 [--pushes 200] [--conv-layout channels-last]
        [--cache-layout channels-last] [--cudnn-algorithms heuristics] [--step-window on]
        [--out R.json]

Only the 24-frame stream step, the final step and the F0 steps at B = 2 (a lone push runs padded to 2) are compiled
and captured, so the warmup is two compiles. Medians and p95 in ms, each over ``--pushes`` calls:

* ``replay_generator`` / ``replay_f0``: one CUDA-graph replay and the wait, device buffers only (the device's time
  plus the launch and the wake-up);
* ``call_generator`` / ``call_f0``: the backend's call as the scheduler makes it (host buffers written, replay, wait,
  outputs copied);
* ``push_direct``: ``stream.push`` of a 24-frame chunk with no scheduler (the stream's bookkeeping, the noise rows,
  both calls in the caller's thread);
* ``push_thread``: the same through the scheduler thread (the runtime's default);
* ``apush_loop``: ``await stream.apush`` with the scheduler driven by the event loop (``--scheduler loop``);
* ``*_inline``: the same with the scheduler's ``inline_lone_calls`` on (a quiet lone push's calls made in the
  scheduling thread, without the device thread's hand-offs; the engine's default on CUDA), the others with it off.
  Back to back, a push is not quiet (the one before settled just now): those arms set ``inline_quiet_s`` to 0;
* ``*_paced``: the same at real-time pace (a push every 480 ms, as a live stream pushes), where the GPU idles between
  pushes (clocks down, caches cold).

Then ``parity``: one ``--parity-seconds`` stream in 24-frame pushes against the fp32 step's offline pass on the CPU
(eager torch): SNR, largest difference and log-spectral distance (the precision's and layout's distance, full model).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def summary(ms: list[float]) -> dict[str, float]:
    """Median and nearest-rank p95 (at 20 and 300 samples the 19th and 285th)."""
    ordered = sorted(ms)
    return {"p50": round(statistics.median(ordered), 3),
            "p95": round(ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)], 3), "n": len(ordered)}


def timed(fn: Callable[[], Any], runs: int, pace_s: float = 0.0) -> dict[str, float]:
    """``fn()`` ``runs`` times (after 3 unmeasured), each call started ``pace_s`` after the previous one started."""
    for _ in range(3):
        fn()
    ms = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
        if pace_s:
            time.sleep(max(0.0, pace_s - (time.perf_counter() - t0)))
    return summary(ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--pushes", type=int, default=200)
    p.add_argument("--paced", type=int, default=20, help="pushes at real-time pace (480 ms apart) per arm")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (eager fp32, no graphs: to try the script)")
    p.add_argument("--parity-seconds", type=float, default=10.0, help="the parity stream's length (0: none)")
    p.add_argument("--out")
    args = p.parse_args()

    import torch

    from hift_runtime import open_vocoder

    started = time.perf_counter()
    cuda = args.device != "cpu"
    vocoder = open_vocoder(args.artifacts, device=args.device, engine="compiled", precision=args.precision,
                           max_batch=2, batching=True)
    backend = vocoder.backend
    backend.warmup((24,), progress=lambda msg: print(msg, flush=True))
    warmup_s = time.perf_counter() - started
    c = vocoder.constants
    pace = 24 * c.samples_per_frame / c.sample_rate  # a 24-frame chunk's audio: 0.48 s

    def replay(kind: str) -> Callable[[], None]:
        graph = backend.captured(kind, 24, 2)

        def run() -> None:
            graph.graph.replay()
            torch.cuda.current_stream().synchronize()
        return run

    def call(kind: str) -> Callable[[], Any]:
        graph = backend.captured(kind, 24, 2)
        values = [t[:1].cpu().numpy() for t in backend.zero_inputs(kind, 24, 2)]
        return lambda: graph.run(values, 1)

    rows: dict[str, Any] = {}
    for kind in ("generator", "f0") if cuda else ():
        rows[f"replay_{kind}"] = timed(replay(kind), args.pushes)
        fn = call(kind)
        with backend.precision_scope():
            rows[f"call_{kind}"] = timed(fn, args.pushes)
    rng = np.random.default_rng(0)
    mel = (rng.standard_normal((c.in_channels, 24 * (max(args.pushes, args.paced) + 8))) * 2.0 - 5.0
           ).astype(np.float32)

    def chunks(runs: int) -> Any:
        """24-frame chunks for 3 unmeasured pushes and ``runs`` measured ones (and one to spare)."""
        return iter(np.split(mel[:, :24 * (runs + 4)], runs + 4, axis=1))

    def push_arm(paced: bool) -> dict[str, float]:
        """A new stream's ``push`` timed, back to back or at real-time pace."""
        runs = args.paced if paced else args.pushes
        stream, pieces = vocoder.stream(), chunks(runs)
        try:
            return timed(lambda: stream.push(next(pieces)), runs, pace if paced else 0.0)
        finally:
            stream.close()

    scheduler = vocoder.scheduler
    vocoder.scheduler = None
    rows["push_direct"], rows["push_direct_paced"] = push_arm(False), push_arm(True)
    vocoder.scheduler = scheduler
    default_inline, default_quiet_s = scheduler.inline_lone_calls, scheduler.inline_quiet_s

    def inline_arms(name: str, back_to_back: Callable[[], dict[str, float]],
                    paced: Callable[[], dict[str, float]]) -> None:
        """``name`` and ``name_paced``, then ``name_inline`` and ``name_inline_paced``: the scheduler's
        inline_lone_calls off, then on."""
        for inline in (False, True):
            arm = name + ("_inline" if inline else "")
            scheduler.inline_lone_calls, scheduler.inline_quiet_s = inline, 0.0  # back to back: every push inlined
            rows[arm] = back_to_back()
            scheduler.inline_quiet_s = default_quiet_s  # paced: quiet as a real-time stream's pushes are
            rows[arm + "_paced"] = paced()
        scheduler.inline_lone_calls = default_inline

    inline_arms("push_thread", lambda: push_arm(False), lambda: push_arm(True))

    async def loop_arm(runs: int, pace_s: float) -> dict[str, float]:
        scheduler.attach_loop(asyncio.get_running_loop())
        try:
            stream, pieces = vocoder.stream(), chunks(runs)
            for _ in range(3):
                await stream.apush(next(pieces))
            ms = []
            for _ in range(runs):
                t0 = time.perf_counter()
                await stream.apush(next(pieces))
                ms.append((time.perf_counter() - t0) * 1e3)
                if pace_s:
                    await asyncio.sleep(max(0.0, pace_s - (time.perf_counter() - t0)))
            stream.close()
            return summary(ms)
        finally:
            scheduler.detach_loop()

    inline_arms("apush_loop", lambda: asyncio.run(loop_arm(args.pushes, 0.0)),
                lambda: asyncio.run(loop_arm(args.paced, pace)))
    parity = None
    if args.parity_seconds:
        from hift_runtime.metrics import log_spectral_distance_db, max_abs, snr_db

        frames = int(args.parity_seconds * c.sample_rate / c.samples_per_frame)
        mel = (rng.standard_normal((c.in_channels, frames)) * 2.0 - 5.0).astype(np.float32)
        stream = vocoder.stream()
        audio = np.concatenate([stream.push(mel[:, k:k + 24]) for k in range(0, frames, 24)] + [stream.finish()])
        reference = open_vocoder(args.artifacts, device="cpu", engine="compiled").vocode(mel)
        parity = {"seconds": args.parity_seconds, "snr_db": round(snr_db(audio, reference), 2),
                  "max_abs": max_abs(audio, reference),
                  "log_spectral_distance_db": round(log_spectral_distance_db(audio, reference), 4)}
        print("parity vs the CPU's fp32 offline pass:", json.dumps(parity), flush=True)
    result = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/lone_push.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "conv_layout": backend.conv_layout,
              "cudnn_algorithms": backend.cudnn_algorithms,
              "step_window_frames": backend.step_window_frames, "open_and_warmup_s": round(warmup_s, 1), "ms": rows,
              "parity_vs_cpu_fp32": parity}
    for name, row in rows.items():
        print(f"{name:24s} p50 {row['p50']:7.3f}  p95 {row['p95']:7.3f}  (n={row['n']})", flush=True)
    vocoder.close()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
