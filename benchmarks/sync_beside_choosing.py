"""Does anything capture a CUDA graph while a warmup's cuDNN choosing threads run? Not a test.

On the H200 (2026-12-03) the compiled engine's warmup under cuDNN's heuristic mode B failed once with "operation not
permitted when stream is capturing" at a device-wide ``torch.cuda.synchronize`` in the warmup's own thread, while its
choosing threads (``hift_torch.compiled._ChoosingThreads``) ran the eager step. This probes it: each engine warms
up (eagerly: no compile, the convolutions are cuDNN's either way; a short batch ladder) while a probe thread
synchronizes in a loop, from the warmup's start until it says its algorithms are chosen (before its own captures),
and counts the synchronizes that failed. Engines run in order in one process (mode B is read once per process: the
variable is set to 1 at the start, which the benchmark's choices do not read):

* ``--sync device``: ``torch.cuda.synchronize(device)`` (what the warmup's thread did);
* ``--sync stream``: the default stream's ``synchronize()`` (what it does now);
* ``--sync side``: a side stream's.

    python benchmarks/sync_beside_choosing.py --artifacts DIR [--sync device|stream|side] [--engines all|mode-b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

# (engine, precision, cudnn_algorithms, choosing threads), run in this order
ALL_ENGINES = [("mode B @8, first in the process", "fp32", "heuristics", 8),
               ("benchmark @1", "fp32", "benchmark", 1),
               ("benchmark @1, again", "fp32", "benchmark", 1),
               ("mode B @8, after three", "fp32", "heuristics", 8),
               ("benchmark @8 fp32", "fp32", "benchmark", 8),
               ("benchmark @8 fp16", "fp16", "benchmark", 8)]
MODE_B_ENGINES = [("mode B @8, first in the process", "fp32", "heuristics", 8),
                  ("mode B @8, again", "fp32", "heuristics", 8)]


def probe_one(backend, sync: str, step_sizes: tuple[int, ...]) -> dict:
    """``backend``'s warmup beside a probe thread's synchronizes; what failed."""
    import torch

    side = torch.cuda.Stream(backend.device)
    calls = {"device": lambda: torch.cuda.synchronize(backend.device),
             "stream": lambda: torch.cuda.default_stream(backend.device).synchronize(),
             "side": side.synchronize}
    stop, failures, done = threading.Event(), [], [0]
    started = time.perf_counter()

    def probe() -> None:
        while not stop.is_set():
            try:
                calls[sync]()
                done[0] += 1
            except Exception as exc:  # noqa: BLE001 - counted, whatever it is
                failures.append(f"{time.perf_counter() - started:.2f} s {type(exc).__name__}: {str(exc)[:80]}")
            time.sleep(0.002)

    def progress(message: str) -> None:
        if "algorithms chosen" in message or "not chosen" in message:
            stop.set()

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    error = None
    try:
        backend.warmup(step_sizes, progress=progress)
    except Exception as exc:  # noqa: BLE001 - reported
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    stop.set()
    thread.join()
    return {"warmup_s": round(time.perf_counter() - started, 1), "warmup_error": error, "synchronizes_ok": done[0],
            "synchronizes_failed": len(failures), "first_failures": failures[:3]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--sync", default="device", choices=["device", "stream", "side"])
    p.add_argument("--engines", default="all", choices=["all", "mode-b"], help="mode-b: two mode B engines alone")
    p.add_argument("--out", help="a JSON of the results")
    args = p.parse_args()
    from hift_torch.compiled import HEURISTIC_MODE_B_ENV, STEP_SIZES, CompiledBackend

    os.environ.setdefault(HEURISTIC_MODE_B_ENV, "1")  # (torch reads it at its first heuristic convolution)
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.contract import StreamConstants

    manifest = read_manifest(args.artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    noise = NoiseTable.seeded(0, constants.noise_table_length, constants.num_sines)
    kept, runs = [], []  # (the engines stay open: the later ones start beside them, as in one test process)
    for name, precision, algorithms, threads in MODE_B_ENGINES if args.engines == "mode-b" else ALL_ENGINES:
        backend = CompiledBackend(manifest, constants, device="cuda", precision=precision, compile=False, slots=256,
                                  batch_sizes=(2, 8, 64), final_window=True, cudnn_threads=threads,
                                  cudnn_algorithms=algorithms)
        backend.use_noise_table(noise)
        runs.append({"engine": name, "sync": args.sync, **probe_one(backend, args.sync, STEP_SIZES)})
        print(json.dumps(runs[-1]), flush=True)
        kept.append(backend)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
