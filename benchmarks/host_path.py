"""The Python cost of a push: the step bookkeeping and the batcher over an instant device. Not a test: it reports
figures.

    python benchmarks/host_path.py --artifacts DIR --out R.json [--ks 1,64,256] [--repeats 5]

A stand-in backend returns zeros of the right shapes at once and keeps the generator caches as an opaque handle (as
the CUDA path's device slots do), so what is timed is everything a push costs in this process besides the device:
validation, the mel and F0 bookkeeping, the noise rows, and (``batched``) the hand-offs between the streams' threads
and the batcher. K threads each push 40 chunks of 24 frames as fast as they can. Pushes per second bound the streams
one process can carry whatever the GPU does: a real-time stream pushes 2.08 times a second.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_step import synthetic_mel  # one synthetic mel for every benchmark (same folder)

CHUNK, CHUNKS = 24, 40


class InstantDevice:
    """The CUDA backend's interface with no device time: zeros out, caches as an opaque handle."""

    name = "instant"

    def __init__(self, constants) -> None:
        self.c = constants

    def new_caches(self, kind: str, batch: int = 1) -> Any:
        return object() if kind == "generator" else {s.name: s.zeros(batch) for s in self.c.f0_caches}

    def f0_step(self, mel: np.ndarray, caches: Any) -> tuple[np.ndarray, Any]:
        return np.zeros((mel.shape[0], mel.shape[2] - self.c.f0_look_ahead), np.float32), caches

    def generator_step(self, mel, f0, noise, phase_in, first, caches, final):
        frames = f0.shape[1] - (0 if final else self.c.source_look_ahead) + (1 if final else 0)
        audio = np.zeros((mel.shape[0], frames * self.c.samples_per_frame), np.float32)
        return audio, phase_in.copy(), None if final else caches


def pushes_per_second(constants, k: int, batched: bool) -> float:
    from hift_runtime.batching import BatchingBackend
    from hift_runtime.streaming import StreamingVocoder

    vocoder = StreamingVocoder(InstantDevice(constants), constants, step_sizes=(24, 16, 8, 4, 2, 1))
    if batched:
        vocoder.backend = BatchingBackend(vocoder.backend, max_batch=256, max_wait_s=0.003,
                                          active=lambda: vocoder.active_pushes)
    mel = synthetic_mel(CHUNK * CHUNKS)

    def stream() -> None:
        s = vocoder.stream()
        for pos in range(0, mel.shape[1], CHUNK):
            s.push(mel[:, pos:pos + CHUNK])
        s.finish()

    threads = [threading.Thread(target=stream) for _ in range(k)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if batched:
        vocoder.backend.close()
    return k * CHUNKS / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True, help="an export folder (only its manifest is read)")
    p.add_argument("--out", required=True)
    p.add_argument("--ks", default="1,64,256")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from hift_runtime.manifest import read_manifest
    from hift_runtime.streaming import StreamConstants

    manifest = read_manifest(args.artifacts, verify=None)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": "python benchmarks/host_path.py " + " ".join(
                                  f"--{k} {v}" for k, v in vars(args).items()), "runs": []}
    for mode in ("threads", "batched"):
        for k in [int(x) for x in args.ks.split(",")]:
            rates = [pushes_per_second(constants, k, mode == "batched") for _ in range(args.repeats)]
            row = {"mode": mode, "k": k, "pushes_per_s_median": round(float(np.median(rates))),
                   "pushes_per_s_p95_low": round(float(np.percentile(rates, 5))),
                   "realtime_streams_bound": round(float(np.median(rates)) / (24000 / (CHUNK * 480)))}
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
