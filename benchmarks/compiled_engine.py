"""The compiled engine at one precision: start-up, distance from the CPU EP, batched step time, recompiles. Not a test.

    python benchmarks/compiled_engine.py --artifacts DIR --precision fp32 --out benchmarks/results/NAME.json \
        [--cudnn-algorithms heuristics]

* ``open_s`` / ``warmup_s``: open (weights, noise table, pool) and warmup (compile + capture every shape); run it
  twice in fresh processes to see inductor's on-disk cache (cold, then warm).
* Distance from the CPU EP (ONNX Runtime, CPU, offline pass), in SNR dB, max abs and log-spectral distance:
  ``--streams`` (64) concurrent streams of 3 s (24-frame chunks, batched; 8 of them against the CPU) and one
  ``--long-seconds`` stream; each concurrent stream also against its own solo run on the engine.
* ``robust``: streams of random mels spanning the accepted log-mel range (-30 .. 15): any NaN/Inf in the audio.
* ``step_ms``: the captured 24-frame generator step alone at B = 1, 64, 256 (median and p95 of replays, inputs
  copied in and audio copied out as a call does) -> real-time streams' worth = B x 0.48 s / step time.
* ``compiles_after_warmup``: dynamo compiles during everything above (0 expected).

``--group DIR --parties N``: N of these run side by side (one per precision, their cold compiles overlapping on the
CPU); each waits for the others (at most 5 minutes) before timing, and times under a lock in DIR, one at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from bench_step import stats, synthetic_mel

CHUNK = 24


def stream_audio(vocoder, mel: np.ndarray) -> np.ndarray:
    s = vocoder.stream()
    pieces = [s.push(mel[:, p:p + CHUNK]) for p in range(0, mel.shape[1], CHUNK)]
    return np.concatenate([*pieces, s.finish()])


def distances(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    from hift_runtime.metrics import log_spectral_distance_db, max_abs, snr_db

    return {"snr_db": round(snr_db(got, want), 2), "max_abs": float(f"{max_abs(got, want):.3g}"),
            "lsd_db": round(log_spectral_distance_db(got, want), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--out", required=True)
    p.add_argument("--long-seconds", type=float, default=30.0)
    p.add_argument("--streams", type=int, default=64, help="concurrent 3 s streams, each against its solo run")
    p.add_argument("--max-batch", type=int, default=256, help="largest batch captured (default 256)")
    p.add_argument("--group", help="a folder shared by runs side by side: timings wait for all, then one at a time")
    p.add_argument("--parties", type=int, default=1, help="how many runs share --group")
    args = p.parse_args()
    import os

    import torch

    if args.parties > 1:  # side-by-side runs: CPU threads shared out (oversubscribed OpenMP slowed the CPU reference
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.parties))  # past 2 minutes on the H200 host)
    from hift_runtime import open_vocoder
    from hift_torch.compiled import compile_count

    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": "python benchmarks/compiled_engine.py " + " ".join(
                                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                              "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                              "precision": args.precision}
    t0 = time.perf_counter()
    vocoder = open_vocoder(args.artifacts, device="cuda", engine="compiled", precision=args.precision,
                           batching=True, max_wait_ms=3, max_batch=args.max_batch)
    result["open_s"] = round(time.perf_counter() - t0, 1)
    result["cudnn_choice"] = vocoder.backend.cudnn_choice()
    result["step_window_frames"] = vocoder.backend.step_window_frames
    print("opened in", result["open_s"], "s", flush=True)
    t0 = time.perf_counter()
    vocoder.warmup(progress=lambda m: print(m, flush=True))
    result["warmup_s"] = round(time.perf_counter() - t0, 1)
    result["compiles_at_warmup"] = vocoder.backend.compiles_at_warmup
    result["warmup_seconds_by_shape"] = vocoder.backend.warmup_seconds
    print(json.dumps(result), flush=True)
    # The reference: the CPU EP where the export has ONNX graphs, else the same step eagerly on the CPU (equal to the
    # CPU EP within 1.2e-7 on the reduced model, tests/test_compiled.py).
    try:
        cpu = open_vocoder(args.artifacts, device="cpu", engine="ort")
    except Exception:  # noqa: BLE001 - a weights-only export
        cpu = open_vocoder(args.artifacts, device="cpu", engine="compiled")
    result["reference"] = cpu.backend.name

    mels = [synthetic_mel(150, seed=100 + i) for i in range(args.streams)]
    got: list[np.ndarray] = [np.zeros(0)] * len(mels)

    def one(i: int) -> None:
        got[i] = stream_audio(vocoder, mels[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(mels))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("concurrent streams done", flush=True)
    solo = [stream_audio(vocoder, m) for m in mels]
    want = [cpu.vocode(m) for m in mels[:8]]  # the CPU reference for 8 of them (CPU time)
    print("reference computed", flush=True)
    result["concurrent_vs_cpu_ep"] = [distances(g, w) for g, w in zip(got, want)]
    result["concurrent_streams"] = len(mels)
    result["concurrent_vs_solo_max_abs"] = max(float(np.abs(g - s).max()) for g, s in zip(got, solo))
    result["compiles_after_warmup_so_far"] = compile_count() - (vocoder.backend.compiles_at_warmup or 0)
    long_mel = synthetic_mel(int(args.long_seconds * 50), seed=5)
    result["long_stream_vs_cpu_ep"] = distances(stream_audio(vocoder, long_mel), cpu.vocode(long_mel))
    print(json.dumps(result), flush=True)

    rng = np.random.default_rng(0)
    bad = 0
    for i in range(6):
        mel = rng.uniform(-30, 15, (80, 150)).astype(np.float32) if i % 2 else \
            np.full((80, 150), [-30.0, 15.0][i % 3 == 0], np.float32)
        bad += int(not np.isfinite(stream_audio(vocoder, mel)).all())
    result["robust_streams_with_nan_or_inf"] = bad

    backend = vocoder.backend
    c = vocoder.constants
    timings = {}
    with _exclusive(args.group, args.parties, args.precision):
        _time_steps(backend, c, timings)
    result["step_ms_24_frames"] = timings
    result["compiles_after_warmup"] = compile_count() - (backend.compiles_at_warmup or 0)
    result["slots_in_use_at_end"] = backend.slots_in_use
    vocoder.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


@contextlib.contextmanager
def _exclusive(group: str | None, parties: int, name: str) -> Iterator[None]:
    """Wait until ``parties`` runs reached this point (or 5 minutes), then hold ``group``'s lock."""
    if not group:
        yield
        return
    import fcntl

    folder = Path(group)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"arrived.{name}").touch()
    deadline = time.monotonic() + 300
    while len(list(folder.glob("arrived.*"))) < parties and time.monotonic() < deadline:
        time.sleep(1)
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _time_steps(backend, c, timings: dict[str, Any]) -> None:
    for batch in (2, 64, 256):
        size = backend.step_window_frames or 24
        graph = backend.captured("generator", size, batch)
        if graph is None:
            continue
        values = [t.cpu().numpy() for t in backend.zero_inputs("generator", size, batch)]
        values[0] -= 5  # a quiet mel, a voiced F0
        values[1] += 200.0
        times = []
        with backend.precision_scope():
            for _ in range(30):
                s0 = time.perf_counter()
                graph.run(values, batch)
                times.append(time.perf_counter() - s0)
        row = stats(times[5:])
        row["realtime_streams"] = round(batch * 0.48 / (row["median_ms"] / 1e3))
        timings[str(batch)] = row


if __name__ == "__main__":
    main()
