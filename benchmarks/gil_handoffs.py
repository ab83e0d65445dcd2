"""What a host-path copy costs the thread that makes it, alone and beside busy Python threads: a NumPy copy hands the
GIL away and waits up to the switch interval to get it back; a copy of bytes under the GIL (``hift_runtime.arrays``)
does not. Microseconds per call, medians of repeated batches.

    python benchmarks/gil_handoffs.py --out benchmarks/results/gil-handoffs-2core-contiguous-copy.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hift_runtime.arrays import concat_rows, contiguous_copy

SWITCH_INTERVAL_S = 0.0005  # what load_test.py and hift-serve run under (--switch-interval-ms 0.5)


def cases() -> dict[str, Callable[[], np.ndarray]]:
    """The per-step copies of a stream's push (a 24-frame step over a 200-frame chunk's mel)."""
    rng = np.random.default_rng(0)
    mel = rng.random((80, 204), dtype=np.float32)
    audio = rng.random((88, 24 * 480), dtype=np.float32)  # a batched call's audio; a stream's piece is one row
    piece = audio[5, 480:]
    group_mel = [rng.random((1, 80, 27), dtype=np.float32) for _ in range(60)]  # a generator call's stacked inputs
    group_index = [np.array([[i]], np.int64) for i in range(60)]
    return {
        "np.ascontiguousarray of a step's mel window (80 x 28)": lambda: np.ascontiguousarray(mel[None, :, 30:58]),
        "arrays.contiguous_copy of a step's mel window (80 x 28)": lambda: contiguous_copy(mel[None, :, 30:58]),
        "ndarray.copy of a step's audio piece (11 040)": piece.copy,
        "arrays.contiguous_copy of a step's audio piece (11 040)": lambda: contiguous_copy(piece),
        "arrays.concat_rows of a push's emitted audio (one piece)": lambda: concat_rows([piece]),
        "arrays.concat_rows of a 60-stream group's mel rows (60 x 80 x 27)": lambda: concat_rows(group_mel),
        "arrays.concat_rows of a 60-stream group's noise positions (60 x 1 int64)": lambda: concat_rows(group_index),
    }


def per_call_us(fn: Callable[[], np.ndarray], calls: int = 400, batches: int = 7) -> float:
    times = []
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return round(float(np.median(times)), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the result JSON")
    p.add_argument("--busy-threads", default="0,1,2", help="busy Python threads beside the copies, comma-separated")
    args = p.parse_args()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    result: dict = {"command": "python benchmarks/gil_handoffs.py " + " ".join(sys.argv[1:]), "numpy": np.__version__,
                    "python": platform.python_version(), "switch_interval_ms": SWITCH_INTERVAL_S * 1e3,
                    "us_per_call": {}}
    for busy in (int(x) for x in args.busy_threads.split(",")):
        stop = threading.Event()

        def spin() -> None:
            x = 0
            while not stop.is_set():
                for i in range(1000):
                    x += i

        threads = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
        for t in threads:
            t.start()
        try:
            result["us_per_call"][f"{busy} busy threads"] = {name: per_call_us(fn) for name, fn in cases().items()}
        finally:
            stop.set()
            for t in threads:
                t.join()
        print(json.dumps(result["us_per_call"][f"{busy} busy threads"]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
