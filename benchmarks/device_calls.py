"""What one batched call costs on the device thread of the GPU runtime, per kind and batch size: the slot-form
generator step (24 frames), the final step (4 frames) and the F0 step, through the runtime's own objects after
``warmup()``. Not a test: it reports figures.

    python benchmarks/device_calls.py --artifacts DIR --out R.json [--batches 1,8,64,256] [--tf32]

Per batch size: the whole call as the scheduler pays it (inputs copied in, the captured graph replayed, audio and
phase copied out) and the bare replay of the captured graph (device buffers only), medians and p95 over ``--runs``
calls. These are the fixed and per-row costs that decide how large the batches must be for a given load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


def timed(fn, runs: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    lat = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(float(np.median(lat)), 3), "p95_ms": round(float(np.percentile(lat, 95)), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    from hift_runtime import CudaOptions, open_vocoder
    from hift_runtime.sessions import _zero_step_feed

    t0 = time.perf_counter()
    vocoder = open_vocoder(args.artifacts, device="cuda", cuda=CudaOptions(use_tf32=args.tf32), batching=True,
                           engine="ort")
    vocoder.warmup()
    warmup_s = time.perf_counter() - t0
    backend, c = vocoder.backend, vocoder.constants
    on_device = lambda fn, *a: backend._device.submit(fn, *a).result()  # noqa: E731 - every CUDA call runs there
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "onnxruntime": ort.__version__, "tf32": args.tf32,
                              "command": "python benchmarks/device_calls.py " + " ".join(
                                  f"--{k} {v}" for k, v in vars(args).items()),
                              "cuda_graphs_enabled": backend._graphs_enabled, "captured_graphs": len(backend._graphs),
                              "open_and_warmup_s": round(warmup_s, 1), "by_batch": {}}
    for batch in [int(b) for b in args.batches.split(",")]:
        row: dict[str, Any] = {}
        slots = np.arange(1, batch + 1, dtype=np.int64)
        for name, size, final in (("generator_24", 24, False), ("final_4", c.mel_look_ahead, True)):
            feed = _zero_step_feed(c, size, batch, final)
            feed["mel"] -= 5.0
            feed["f0"] += 180.0
            feed["noise"][...] = rng.random(feed["noise"].shape, dtype=np.float32)
            feed["first"][...] = False
            graph = backend._graphs.get((size, batch, final))
            if graph is None:
                row[name] = "not captured"
                continue

            def replay(g=graph):
                g.session.run_with_iobinding(g.binding, g.options)
                g.binding.synchronize_outputs()

            row[name] = {"whole_call": timed(lambda: on_device(graph.run, dict(feed), slots), args.runs),
                         "bare_replay": timed(lambda: on_device(replay), args.runs)}
        mel = rng.standard_normal((batch, c.in_channels, 24 + c.f0_look_ahead)).astype(np.float32) - 5
        caches = backend.new_caches("f0", batch)
        row["f0_24"] = {"whole_call": timed(lambda: backend.f0_step(mel, caches), args.runs)}
        result["by_batch"][str(batch)] = row
        print(batch, json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    vocoder.close()


if __name__ == "__main__":
    main()
