"""How the compiled engine has cuDNN choose its convolutions' algorithms: its heuristic mode B (nothing timed), in
threads beside the rest of a warmup (:class:`ChoosingThreads`), each capturing the shapes it chose for."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

from hift_runtime.options import MAX_CUDNN_THREADS

# Torch reads it once, at a process's first convolution that cuDNN's heuristics choose for (ATen's ConvUtils.h): the
# engine sets it before its own first one, which is in time unless other convolutions ran before in the process.
HEURISTIC_MODE_B_ENV = "TORCH_CUDNN_USE_HEURISTIC_MODE_B"
# One choosing thread per this much free device memory where the trunk's activations are 2-byte (fp16: each thread
# holds its eager step's activations), twice as much where they are 4-byte (tf32, fp32); BENCHMARKS.md, decision log,
# "room for its trunk's element size".
CUDNN_THREAD_BYTES = 9 << 30


def use_heuristic_mode_b() -> bool:
    """Ask torch for cuDNN's heuristic mode B (:data:`HEURISTIC_MODE_B_ENV`), unless the environment says otherwise;
    whether it is asked for."""
    return heuristic_mode_b_asked(os.environ.setdefault(HEURISTIC_MODE_B_ENV, "1"))


def heuristic_mode_b_asked(value: str) -> bool:
    """Whether :data:`HEURISTIC_MODE_B_ENV`'s ``value`` asks for mode B (the words torch's ``check_env`` takes)."""
    return value.strip().lower() in ("1", "on", "true", "yes", "y")


def cudnn_threads_for_memory(free_bytes: int, at_most: int = MAX_CUDNN_THREADS, others_bytes: int = 0,
                             activation_bytes: int = 2) -> int:
    """The warmup's choosing threads when none are set: one per :data:`CUDNN_THREAD_BYTES` (scaled by the trunk's
    ``activation_bytes`` per element, 2 for fp16, 4 for tf32 and fp32) of the free device memory left once
    ``others_bytes`` (what compile workers beside the warmup will hold) is kept aside, at least one, at most
    ``at_most``."""
    per_thread = CUDNN_THREAD_BYTES * activation_bytes // 2
    return max(1, min(at_most, (free_bytes - others_bytes) // per_thread))


def failed_choices(choosing: list[concurrent.futures.Future], groups: list[list[tuple[str, int, int]]]
                   ) -> str | None:
    """The choosing threads that failed, in one line (their shapes, how many threads, the first error's first line;
    None: none failed). Each error's traceback is dropped here: its frames hold the failed eager step's activations
    (gigabytes, for a thread out of memory), which would otherwise stay allocated through the captures that follow
    and leave them no room."""
    shapes, errors = 0, []
    for future, group in zip(choosing, groups):
        exc = future.exception()
        if exc is not None:
            shapes += len(group)
            errors.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}")
            drop_tracebacks(exc)
    if not errors:
        return None
    return f"{shapes} step shapes ({len(errors)} of {len(groups)} threads failed; the first: {errors[0]})"


def drop_tracebacks(exc: BaseException | None) -> None:
    """Clear the frames of ``exc``'s traceback and of the errors chained to it, and drop the tracebacks."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


class ChoosingThreads:
    """Threads that choose cuDNN's convolution algorithms for a warmup's generator and final shapes, each for its
    share, and then capture the shapes it chose for. Torch keeps cuDNN's choices per thread (``thread_local
    BenchmarkCache`` in ATen's ``Conv_v8.cpp``): a capture finds them only in the thread that made them, so the
    choosing can run beside the rest of a start (the graphs' loads or compiles) and the captures still find it done
    (BENCHMARKS.md, decision log: "cuDNN's choices in threads"). The process-wide switches (TF32) are the warmup's,
    held by its thread for all of it; what is per thread (the device, inference mode, a stream) each call
    here enters itself. The F0 step (GEMMs, no cuDNN) runs in the calling thread."""

    def __init__(self, device: torch.device, shapes: list[tuple[str, int, int]], threads: int) -> None:
        # Largest first, dealt round: each thread a like share of the large shapes (their choosing is the longest).
        heavy = sorted((s for s in shapes if s[0] != "f0"), key=lambda s: -s[1] * s[2])
        count = max(1, min(threads, len(heavy)))
        self.owner = {shape: i % count for i, shape in enumerate(heavy)}
        self.groups = [heavy[i::count] for i in range(count)] if heavy else []
        self._device = device
        self._pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"hift-cudnn-{i}")
                       for i in range(len(self.groups))]
        # A stream each: cuDNN times its candidates with events on the current stream, which the threads would
        # otherwise share (the legacy default stream), each timing the others' kernels too.
        self._streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in self._pools]

    def _within(self, thread: int, fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            stream = self._streams[thread]
            if stream is not None:
                torch.cuda.set_device(self._device)  # (per thread in CUDA: a new thread starts on device 0)
                stream.wait_stream(torch.cuda.default_stream(self._device))  # the engine's tensors, made there
            with torch.inference_mode(), torch.cuda.stream(stream):  # (None: no stream, on the CPU)
                return fn()
        return call

    def choose(self, choose_for: Callable[[list[tuple[str, int, int]]], None]) -> list[concurrent.futures.Future]:
        """``choose_for(group)`` started in each thread on its share."""
        return [pool.submit(self._within(i, functools.partial(choose_for, group)))
                for i, (pool, group) in enumerate(zip(self._pools, self.groups))]

    def run(self, shape: tuple[str, int, int], fn: Callable[[], Any]) -> Any:
        """``fn()`` in the thread that chose for ``shape`` (the calling thread for a shape none chose for)."""
        if shape not in self.owner:
            return fn()
        thread = self.owner[shape]
        return self._pools[thread].submit(self._within(thread, fn)).result()

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
