"""What a NumPy call costs a thread of a busy process: the host path's operations timed alone and beside threads that
keep the GIL busy (as the event loop, the scheduler and the device thread do at load). Not a test: it reports.

    python benchmarks/gil_handoffs.py --out benchmarks/results/gil-handoffs-2core.json [--busy 0,2] [--batch 225]

NumPy releases the GIL inside most array operations, whatever their size; with other threads waiting for it, each
release hands the GIL over and the caller waits to get it back (up to Python's switch interval, 0.5 ms here as in
hift-serve). An operation of microseconds then costs a hand-off: the stacking of a batch's rows (one release per row)
is where a batched call's host time goes. ``bytes.join`` and ``hift_runtime.arrays`` copy under the GIL. torch's ops
release the GIL too: the compiled engine's warmup, whose choosing threads run the eager step beside dynamo's tracing
(pure Python, as the busy threads here), runs under a short interval for that reason
(``CudaOptions.warmup_switch_interval_s``; compare ``--switch-interval-ms 5``, Python's default).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hift_runtime.arrays import concat_rows, copy_rows


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _per_call_us(fn: Callable[[], object], seconds: float) -> float:
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e6


def operations(batch: int) -> dict[str, Callable[[], object]]:
    """The host path's kinds of operation, at a 24-frame push's sizes (80 mel bins, 11 520 samples)."""
    rng = np.random.default_rng(0)
    buffer = rng.random((80, 250), dtype=np.float32)
    history = rng.random((80, 5), dtype=np.float32)
    chunk = np.ascontiguousarray(buffer[:, :24])
    audio = rng.random((1, 11520), dtype=np.float32)
    rows = [rng.random((1, 80, 28), dtype=np.float32) for _ in range(batch)]  # a batch's mel windows
    import torch  # (the compiled engine's warmup: its choosing threads run the eager step, op by op)

    torch.set_num_threads(1)
    signal, weight = torch.zeros(1, 8, 16), torch.zeros(8, 8, 3)
    return {
        "a small torch op (conv1d 8 x 16, as a warmup's eager step makes hundreds)":
            lambda: torch.nn.functional.conv1d(signal, weight, padding=1),
        "concatenate a push's mel history and chunk": lambda: np.concatenate([history, chunk], axis=1),
        "contiguous copy of a chunk (80 x 24)": lambda: np.ascontiguousarray(buffer[:, 10:34]),
        "min of a chunk": lambda: chunk.min(),
        "copy of a step's audio (11 520)": lambda: audio.copy(),
        "copy of 400 values": lambda: audio[0, :400].copy(),
        "tobytes of a step's audio": lambda: audio.tobytes(),
        f"np.concatenate of {batch} rows (a batched call's mel)": lambda: np.concatenate(rows),
        f"bytes.join of {batch} rows, then frombuffer": lambda: np.frombuffer(b"".join(rows), np.float32),
        f"arrays.concat_rows of {batch} rows (what the scheduler does)": lambda: concat_rows(rows),
        "arrays.copy_rows of a step's audio (the compiled engine's copy out)": lambda: copy_rows(audio, 1),
        "arrays.concat_rows of a push's emitted audio (one piece)": lambda: concat_rows([audio[0]]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--busy", default="0,2", help="busy threads beside the timed one, comma-separated (default 0,2)")
    p.add_argument("--batch", type=int, default=225, help="rows of the batched stacking (default 225)")
    p.add_argument("--seconds", type=float, default=0.5, help="timing per operation and setting (default 0.5)")
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="Python's GIL switch interval (0.5)")
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    ops = operations(args.batch)
    result: dict[str, object] = {"command": "python benchmarks/gil_handoffs.py " + " ".join(sys.argv[1:]),
                                 "numpy": np.__version__, "python": sys.version.split()[0],
                                 "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                 "switch_interval_ms": args.switch_interval_ms, "us_per_call": {}}
    for busy in (int(x) for x in args.busy.split(",")):
        stop = threading.Event()
        threads = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        timed = {name: round(_per_call_us(fn, args.seconds), 1) for name, fn in ops.items()}
        stop.set()
        for t in threads:
            t.join()
        result["us_per_call"][f"{busy} busy threads"] = timed  # type: ignore[index]
        print(f"{busy} busy threads:", json.dumps(timed, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
