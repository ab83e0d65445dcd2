"""The Python cost of a push: the step bookkeeping and the batcher over an instant device. Not a test: it reports
figures.

    python benchmarks/host_path.py --artifacts DIR --out R.json [--ks 1,64,256] [--repeats 5]
    python benchmarks/host_path.py --artifacts DIR --out R.json --modes asyncio-loop --sizes compiled-final-window \
        --ks 256,1024   # the compiled engine's host path as its load tests drive it

A stand-in backend returns zeros of the right shapes at once and keeps the generator caches (with the compiled engine's
sizes, the F0 step's too) as an opaque handle (as the CUDA path's device slots do), so what is timed is everything a
push costs in this process besides the device: validation, the mel and F0 bookkeeping, the noise rows, and (``batched``)
the hand-offs between the streams' threads and the batcher. K threads each push 40 chunks of 24 frames as fast as they
can. Pushes per second bound the streams one process can carry whatever the GPU does: a real-time stream pushes 2.08
times a second.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_step import synthetic_mel  # one synthetic mel for every benchmark (same folder)

from hift_runtime.engine import EngineTraits

CHUNK, CHUNKS = 24, 40


class InstantDevice:
    """The CUDA backend's interface with no device time: zeros out, caches as an opaque handle.

    Its outputs are the first rows of one buffer per width, written once (grown to the next power of two of rows when
    a call needs more): a device's outputs arrive as written memory (the copy out of the device, without the GIL),
    while a fresh ``np.zeros`` would be mapped lazily and page-faulted by the first reader (the bookkeeping, holding
    the GIL), and a buffer per exact shape, written at each batch size's first call, was a stand-in thread's
    page-faulting the benchmark invented."""

    name = "instant"
    traits = EngineTraits()

    def __init__(self, constants) -> None:
        self.c = constants
        self._buffers: dict[int, np.ndarray] = {}  # columns -> zeros of at least the rows asked so far

    def _zeros(self, rows: int, columns: int) -> np.ndarray:
        buffer = self._buffers.get(columns)
        if buffer is None or buffer.shape[0] < rows:
            size = 1 << (rows - 1).bit_length()
            buffer = self._buffers[columns] = np.full((size, columns), 0.0, np.float32)  # written
        return buffer[:rows]

    def new_caches(self, kind: str, batch: int = 1) -> Any:
        if kind == "generator" or self.traits.f0_caches_in_place:  # a device slot's handle
            return object()
        return {s.name: s.zeros(batch) for s in self.c.f0_caches}

    def use_noise_table(self, noise) -> None:
        """Called where the device takes noise positions (its traits' ``noise_positions``): nothing to gather."""

    def f0_step(self, mel: np.ndarray, caches: Any) -> tuple[np.ndarray, Any]:
        return self._zeros(mel.shape[0], mel.shape[2] - self.c.f0_look_ahead), caches

    def warmup(self, step_sizes, progress=None) -> None:
        """Nothing to prepare."""

    def stream_capacity(self) -> int:
        return 1 << 20

    def generator_step(self, mel, f0, noise, phase_in, first, caches, final, frames=None):
        """``frames``: a final step in the backend's window (its traits' ``final_window``): ``f0`` is the window's."""
        audio_frames = f0.shape[1] - (0 if final else self.c.source_look_ahead) + (1 if final else 0)
        audio = self._zeros(mel.shape[0], audio_frames * self.c.samples_per_frame)
        return audio, phase_in.copy(), None if final else caches


class InstantPositionsDevice(InstantDevice):
    """The instant device taking each step's first noise row index instead of the rows (as the compiled engine does,
    which keeps the noise table on the GPU): the host path without the 432 KB of noise a 24-frame step gathers."""

    name = "instant-noise-positions"
    traits = EngineTraits(noise_positions=True)


class ModelledDevice(InstantDevice):
    """The instant device, but each call takes (a sleep in the device's own thread, the GIL released, as a GPU call) the
    time a model of the H200 gives it: ``fixed + per_row * B`` ms for a generator step of 24 frames on the batch
    ladder's padded ``B`` (scaled by frames / 24 for other sizes), ``f0_ms`` per F0 call. Its calls are launched and
    waited for apart, as the compiled engine's (``launches_ahead`` with the compiled engine's step sizes). Defaults: the
    plain step graphs' CUDA graph replays in ``gpu-h200-step.json`` (TF32 off: 4.77 ms at B = 1, 50.4 at 64, 163.4 at
    256) and the F0 calls' 1.8 ms at K = 64 in ``load-h200-batched-slots.json``. For trying schedulers without a GPU:
    not a GPU figure."""

    name = "modelled-h200"
    LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __init__(self, constants, fixed_ms: float = 12.7, per_row_ms: float = 0.589, f0_ms: float = 1.8,
                 final_ms: float = 20.0, shared_lock: str | None = None) -> None:
        """``shared_lock``: a file whose lock every call holds while it "runs": processes naming the same file share
        one modelled device, one call at a time (a GPU time-sliced between processes)."""
        super().__init__(constants)
        self.fixed_ms, self.per_row_ms, self.f0_ms, self.final_ms = fixed_ms, per_row_ms, f0_ms, final_ms
        self._lock_file = open(shared_lock, "a") if shared_lock else None  # noqa: SIM115 - held for the device's life
        # The device's timeline: a call launched runs after the ones before it, as on a GPU's stream; the F0 calls
        # on a timeline of their own beside it where the traits say so (``f0_lane``, as the compiled engine's).
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="modelled-device")
        self._f0_device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="modelled-f0-device")
        self._pending: dict[tuple[str, int], concurrent.futures.Future] = {}  # step shape -> its last call

    def _padded(self, rows: int) -> int:
        return next((b for b in self.LADDER if b >= rows), rows)

    def _run(self, ms: float) -> None:
        if self._lock_file is None:
            time.sleep(ms / 1e3)
            return
        import fcntl

        fcntl.flock(self._lock_file, fcntl.LOCK_EX)
        try:
            time.sleep(ms / 1e3)
        finally:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    def _step_ms(self, mel: np.ndarray, f0: np.ndarray, final: bool) -> float:
        if final:
            return self.final_ms
        frames = f0.shape[1] - self.c.source_look_ahead
        b = self._padded(mel.shape[0])
        ms = min(4.77 + (b - 1) * (8.75 - 4.77) / 7, self.fixed_ms + self.per_row_ms * b)  # B < 8: nearer 4.77
        return ms * max(frames, 4) / 24

    def launch_f0_step(self, mel, caches, wait=True):
        return self._launch(("f0", mel.shape[2]), self.f0_ms, super().f0_step(mel, caches), wait)

    def launch_generator_step(self, mel, f0, noise, phase_in, first, caches, final, *frames, wait=True):
        outputs = super().generator_step(mel, f0, noise, phase_in, first, caches, final, *frames)
        return self._launch(("final" if final else "generator", mel.shape[2]), self._step_ms(mel, f0, final), outputs,
                            wait)

    def _launch(self, shape: tuple[str, int], ms: float, outputs: Any, wait: bool) -> _ModelledCall | None:
        """A call on the modelled device's one timeline (its thread: calls run one after another, in launch order),
        with the compiled engine's rule for its pinned buffers: one call pending per step shape (``wait=False``: None
        while the shape's last call runs)."""
        pending = self._pending.get(shape)
        if pending is not None and not pending.done():
            if not wait:
                return None
            pending.result()
        device = self._f0_device if shape[0] == "f0" and self.traits.f0_lane else self._device
        self._pending[shape] = future = device.submit(self._run, ms)
        return _ModelledCall(future, outputs)

    def f0_step(self, mel, caches):
        return self.launch_f0_step(mel, caches).result()

    def generator_step(self, mel, f0, noise, phase_in, first, caches, final, frames=None):
        return self.launch_generator_step(mel, f0, noise, phase_in, first, caches, final,
                                          *([] if frames is None else [frames])).result()


class _ModelledCall:
    """A modelled device's call: its outputs once its time on the device has passed."""

    def __init__(self, future: concurrent.futures.Future, outputs: Any) -> None:
        self._future, self._outputs = future, outputs

    def result(self) -> Any:
        self._future.result()
        return self._outputs


# Step sizes of the stand-in: the ORT engine's, the compiled engine's (hift_torch.compiled: its F0 at every size up to
# 26 frames and past it), or the compiled engine's generator sizes for the F0 too (as before it
# captured its F0 apart). The compiled ones take noise positions, as that engine does (its noise table on the device).
STEP_SIZES = {"ort": ((24, 16, 8, 4, 2, 1), None),
              "compiled": ((25, 24, 8, 4, 1), (100, 74, 50, 38, *range(26, 0, -1))),
              "compiled-f0-split": ((25, 24, 8, 4, 1), None)}
STEP_SIZES["compiled-final-window"] = STEP_SIZES["compiled"]
# The sizes whose stand-in has the final window, sized as the compiled engine sizes it on CUDA (its largest step plus
# the mel look-ahead: a stream's last push is its F0 call and one final call).
FINAL_WINDOW_SIZES = {"compiled-final-window"}


def modelled_vocoder(constants, device: InstantDevice, batched: bool, max_wait_s: float = 0.003,
                     sizes: str = "ort"):
    """A vocoder over a stand-in device, with the scheduler ``open_vocoder`` gives the GPU; ``sizes``: a key of
    :data:`STEP_SIZES`."""
    from hift_runtime.batching import PushScheduler
    from hift_runtime.streaming import StreamingVocoder

    step_sizes, f0_step_sizes = STEP_SIZES[sizes]
    compiled = sizes != "ort"  # the compiled engine's sizes: its caches, both kinds, stay on the device as slots
    device.traits = EngineTraits(
        step_sizes=step_sizes, f0_step_sizes=f0_step_sizes, noise_positions=compiled or device.traits.noise_positions,
        final_window=max(step_sizes) + constants.mel_look_ahead if sizes in FINAL_WINDOW_SIZES else None,
        caches_in_place=compiled, f0_caches_in_place=compiled,
        launches_ahead=compiled and isinstance(device, ModelledDevice),
        f0_lane=compiled and isinstance(device, ModelledDevice))
    vocoder = StreamingVocoder(device, constants, step_sizes=step_sizes)
    if batched:
        vocoder.scheduler = PushScheduler(device, max_batch=256, max_wait_s=max_wait_s,
                                          pushes_in_progress=lambda: vocoder.pushes_in_progress)
    return vocoder


def pushes_per_second(constants, k: int, mode: str, noise_positions: bool = False, sizes: str = "ort") -> float:
    """``mode``: ``threads`` (a thread per stream, no scheduler), ``batched`` (a thread per stream, the scheduler),
    ``asyncio`` (the streams as tasks of one event loop, ``apush`` into the scheduler's thread), ``asyncio-loop`` (the
    same, the scheduler driven by the event loop: ``PushScheduler.attach_loop``, as ``load_test.py --scheduler loop``).
    ``sizes``: a key of :data:`STEP_SIZES`."""
    device = (InstantPositionsDevice if noise_positions else InstantDevice)(constants)
    vocoder = modelled_vocoder(constants, device, mode != "threads", sizes=sizes)
    mel = synthetic_mel(CHUNK * CHUNKS)
    if mode in ("asyncio", "asyncio-loop"):
        import asyncio

        async def astream() -> None:
            s = vocoder.stream()
            for pos in range(0, mel.shape[1], CHUNK):
                await s.apush(mel[:, pos:pos + CHUNK])
            await s.afinish()

        async def run_all() -> float:
            if mode == "asyncio-loop":
                vocoder.scheduler.attach_loop(asyncio.get_running_loop())
            t0 = time.perf_counter()
            await asyncio.gather(*(astream() for _ in range(k)))
            return time.perf_counter() - t0

        wall = asyncio.run(run_all())
        vocoder.close()
        return k * CHUNKS / wall

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
    vocoder.close()
    return k * CHUNKS / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True, help="an export folder (only its manifest is read)")
    p.add_argument("--out", required=True)
    p.add_argument("--ks", default="1,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="threads,batched,asyncio",
                   help="comma-separated: threads (a thread per stream, no scheduler), batched (a thread per stream, "
                        "the scheduler), asyncio (one event loop's tasks, apush into the scheduler), asyncio-loop "
                        "(the same, the scheduler driven by the event loop, as the compiled engine's load tests)")
    p.add_argument("--sizes", choices=sorted(STEP_SIZES), default="ort",
                   help="the stand-in's step sizes: the ORT engine's (default), the compiled engine's, or the "
                        "compiled engine's with its final window (compiled-final-window: its default on CUDA)")
    p.add_argument("--noise-positions", action="store_true",
                   help="the device takes noise positions, not rows (the compiled engine's host path)")
    p.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                   help="tuned: the allocator thresholds hift-serve and hift-vocode set (hift_runtime.process_tuning); "
                        "default: glibc's own (run both to see what they are worth)")
    p.add_argument("--server-heap", action="store_true",
                   help="first open the compiled engine on the CPU (torch, dynamo): the ~300 k long-lived objects a "
                        "GPU server process holds, which every full garbage collection walks")
    p.add_argument("--gc-freeze", choices=("on", "off"), default="on",
                   help="on: freeze the objects alive before the runs and set the young generation's threshold, as "
                        "hift-serve does once warm (hift_runtime.process_tuning.tune_garbage_collector); off: the "
                        "collector's defaults")
    p.add_argument("--gc-young-threshold", type=int, default=None,
                   help="with --gc-freeze on: the young generation's threshold (default: hift-serve's)")
    args = p.parse_args()
    from hift_runtime.process_tuning import (YOUNG_COLLECTION_THRESHOLD, CollectionPauses, keep_freed_memory,
                                             tune_garbage_collector)

    if args.malloc == "tuned" and not keep_freed_memory():
        p.error("--malloc tuned: mallopt is not available here (not glibc, or HIFT_MALLOC_TUNING=0)")
    from hift_runtime.manifest import read_manifest
    from hift_runtime.contract import StreamConstants

    manifest = read_manifest(args.artifacts, verify=None)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    heap = None
    if args.server_heap:
        from hift_runtime import open_vocoder

        heap = open_vocoder(args.artifacts, device="cpu", engine="compiled")  # kept open: its objects stay alive
    if args.gc_freeze == "on":
        tune_garbage_collector(args.gc_young_threshold or YOUNG_COLLECTION_THRESHOLD)
    pauses = CollectionPauses()
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": "python benchmarks/host_path.py " + " ".join(
                                  f"--{k} {v}" for k, v in vars(args).items()), "runs": []}
    for mode in args.modes.split(","):
        for k in [int(x) for x in args.ks.split(",")]:
            pauses.reset()
            rates = [pushes_per_second(constants, k, mode, args.noise_positions, args.sizes)
                     for _ in range(args.repeats)]
            row = {"mode": mode, "k": k, "sizes": args.sizes,
                   "noise": "positions" if args.noise_positions or args.sizes != "ort" else "rows",
                   "malloc": args.malloc, "server_heap": heap is not None, "gc_freeze": args.gc_freeze,
                   "gc_young_threshold": gc.get_threshold()[0],
                   "full_collections": pauses.count, "full_collection_max_ms": round(pauses.max_s * 1e3, 1),
                   "young_collections": pauses.young_count,
                   "young_collection_ms_total": round(pauses.young_total_s * 1e3),
                   "young_collection_max_ms": round(pauses.young_max_s * 1e3, 1),
                   "pushes_per_s_median": round(float(np.median(rates))),
                   "pushes_per_s_p95_low": round(float(np.percentile(rates, 5))),
                   "realtime_streams_bound": round(float(np.median(rates)) / (24000 / (CHUNK * 480)))}
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
