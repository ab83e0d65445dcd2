"""Process-wide settings for a process that runs many streams: its allocator and its garbage collector.

**The allocator** (:func:`keep_freed_memory`). Every push allocates short-lived arrays of 40 KB to a few MB (a step's
audio, a batch's stacked mel and outputs). glibc gives freed memory at a heap's top back to the kernel past its trim
threshold (128 KB) and serves large allocations with fresh mappings, so the next push page-faults the same pages in
again, most of it while holding the GIL (``benchmarks/host_path.py``; BENCHMARKS.md). The cost: a process keeps up
to the trim threshold of freed memory per allocator arena instead of returning it (its peak stays its peak).

**The garbage collector** (:func:`tune_garbage_collector`). A process with torch and a compiled engine holds ~300 k
objects that live as long as it does; each full (generation 2) collection walks them all while holding the GIL,
stalling every stream for ~100 ms (``benchmarks/host_path.py --server-heap``; BENCHMARKS.md). Frozen after warmup,
they are never walked again. And the young generation is collected every 10 000 new container objects instead of
700: with a thousand streams in flight, each young collection found their live coroutines and arrays and promoted
them towards the full collections. Objects created later are collected as before, less often.

Applied by the entry points that run streams (``hift-serve`` in each of its processes, the benchmarks; ``hift-vocode``
the allocator's only), not by importing the library: an embedding application owns its process.
``HIFT_MALLOC_TUNING=0`` and ``HIFT_GC_TUNING=0`` turn them off.

**The GIL's switch interval** (:data:`HANDOFF_SWITCH_INTERVAL_S`, :func:`switch_interval_at_most`). A thread that
calls into NumPy or torch releases the GIL inside the call; beside a thread running pure Python it then waits for the
GIL back up to Python's switch interval, 5 ms by default: a call of microseconds becomes one of milliseconds
(BENCHMARKS.md). ``hift-serve`` serves with a short interval; the compiled engine's warmup, whose
threads call the eager step while dynamo traces in another, runs under one.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("hift_runtime")

# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# 32 MiB is glibc's largest mmap threshold on 64-bit hosts (a larger value is refused): a 256-stream batch's arrays
# (2-12 MB) come from the heap and are reused. 256 MiB of freed memory kept per arena before it is trimmed.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
MALLOC_ENV_SWITCH = "HIFT_MALLOC_TUNING"
GC_ENV_SWITCH = "HIFT_GC_TUNING"
# Container objects allocated (net) between young collections; Python's default is 700.
YOUNG_COLLECTION_THRESHOLD = 10_000
# A process's threads hand work to each other (a server's request threads, the streams' event loop, the push
# scheduler, the device thread; a warmup's choosing threads beside dynamo's tracing): a short GIL switch interval
# keeps each hand-off from waiting up to Python's default 5 ms. Set by hift-serve's processes and, for its
# own length, by the compiled engine's warmup.
HANDOFF_SWITCH_INTERVAL_S = 0.0005


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring). True when applied; False
    where the C library is not glibc, or ``HIFT_MALLOC_TUNING=0``."""
    if os.environ.get(MALLOC_ENV_SWITCH, "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not applied:
        log.warning("hift_runtime: mallopt refused the allocator thresholds; freed memory is given back as before")
    return applied


@contextlib.contextmanager
def switch_interval_at_most(seconds: float | None) -> Iterator[None]:
    """Python's GIL switch interval at most ``seconds`` inside the block, the process's own restored after. None, or
    a process whose interval is already as short: nothing changed. (The interval is process-wide: a thread that sets
    another meanwhile has it overwritten at the block's end.)"""
    previous = sys.getswitchinterval()
    if seconds is None or previous <= seconds:
        yield
        return
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def tune_garbage_collector(young_threshold: int = YOUNG_COLLECTION_THRESHOLD) -> bool:
    """Collect, move every object alive now to the collector's permanent generation (``gc.freeze``), and collect the
    young generation every ``young_threshold`` new objects: call it once the engine is warm, before serving. True when
    applied; False with ``HIFT_GC_TUNING=0``."""
    if os.environ.get(GC_ENV_SWITCH, "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *gc.get_threshold()[1:])
    return True


class CollectionPauses:
    """Times every garbage collection of this process from its creation; each holds the GIL throughout, so its length
    is a stall of every stream. Full (generation 2) ones: ``count``, ``total_s``, ``max_s``; young ones (generations 0
    and 1): ``young_count``, ``young_total_s``, ``young_max_s``. :meth:`reset` starts over (a benchmark's run)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = 0.0
        self.reset()
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        with self._lock:
            self.count, self.total_s, self.max_s = 0, 0.0, 0.0
            self.young_count, self.young_total_s, self.young_max_s = 0, 0.0, 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        with self._lock:
            if info["generation"] == 2:
                self.count += 1
                self.total_s += pause
                self.max_s = max(self.max_s, pause)
            else:
                self.young_count += 1
                self.young_total_s += pause
                self.young_max_s = max(self.young_max_s, pause)
