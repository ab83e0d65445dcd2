"""Cross-stream batching: concurrent streams' steps become one batched call of the step graphs.

Each stream's bookkeeping runs in its caller's thread, unchanged (:mod:`hift_runtime.streaming`); its backend calls
come here. A call waits, at most ``max_wait_s``, for calls of the same kind and shape from other streams (the same
step size: streams at different positions batch together, their caches stacked row by row), then one worker thread
runs them as one call of the inner backend and hands each caller its row. Final steps batch too (after split pushes
they all cover the last 4 frames, so streams that end together share one call). A lone stream never waits: the worker
only waits while other streams are inside a push and may still join.

Isolation: a stream's input is validated in its own thread before it reaches the batch, so a bad chunk is refused for
that stream only; an error inside a batched call is raised in every stream of that batch (their state is unchanged:
the bookkeeping commits only after its backend calls succeed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .streaming import VocoderBackend


@dataclass
class _Call:
    key: tuple[Any, ...]
    args: tuple[Any, ...]
    arrived: float
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    """Counters a test or a monitor can read: how many calls ran, in how many batches, the largest batch."""

    calls: int = 0
    batches: int = 0
    max_batch: int = 0
    busy_s: float = 0.0  # time inside the inner backend's calls (the worker's utilisation over a run)
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> [calls, batches, busy seconds]


def _stack(rows: list[Any]) -> Any:
    """Host caches (dicts of arrays) stacked row by row; opaque per-stream handles (device slots) as a list."""
    if not isinstance(rows[0], dict):
        return list(rows)
    return {k: np.concatenate([r[k] for r in rows], axis=0) for k in rows[0]}


def _row(caches: Any, i: int) -> Any:
    if caches is None:
        return None
    if not isinstance(caches, dict):
        return caches[i]
    return {k: v[i:i + 1] for k, v in caches.items()}


class BatchingBackend:
    """A :class:`~hift_runtime.streaming.VocoderBackend` over ``inner`` that gathers concurrent calls into batches."""

    def __init__(self, inner: VocoderBackend, max_batch: int = 256, max_wait_s: float = 0.003,
                 active: Callable[[], int] | None = None) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"max_batch must be >= 1 and max_wait_s >= 0, got {max_batch}, {max_wait_s}")
        self.inner, self.max_batch, self.max_wait_s = inner, max_batch, max_wait_s
        self.name = f"batched({inner.name})"
        self.active = active or (lambda: 1 << 30)  # how many streams may still join a batch (unknown: wait)
        self.stats = BatchStats()
        self._queue: list[_Call] = []  # every waiting call, oldest first
        self._by_key: dict[tuple[Any, ...], list[_Call]] = {}  # the same calls by key, oldest first
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="hift-batcher", daemon=True)
        self._worker.start()

    # ---- the backend interface ---------------------------------------------------------------------------------
    def new_caches(self, kind: str, batch: int = 1) -> Any:
        return self.inner.new_caches(kind, batch)

    def f0_step(self, mel: np.ndarray, caches: dict[str, np.ndarray]) -> tuple[np.ndarray, Any]:
        return self._submit(("f0", mel.shape[2]), (mel, caches))

    def generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                       first: np.ndarray, caches: dict[str, np.ndarray],
                       final: bool) -> tuple[np.ndarray, np.ndarray, Any]:
        return self._submit(("final" if final else "generator", mel.shape[2]),
                            (mel, f0, noise, phase_in, first, caches))

    def warmup(self, step_sizes: tuple[int, ...] | None) -> None:
        prepare = getattr(self.inner, "warmup", None)
        if prepare is not None:
            prepare(step_sizes)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=5)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _submit(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        call = _Call(key, args, time.monotonic())
        with self._cv:
            if self._closed:
                raise RuntimeError("the batching backend is closed")
            self._queue.append(call)
            self._by_key.setdefault(key, []).append(call)
            self._cv.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _take(self) -> list[_Call] | None:
        """The oldest call's group, once it is full, everyone who may join has joined, or its wait is over."""
        with self._cv:
            while True:
                if self._closed and not self._queue:
                    return None
                if self._queue:
                    oldest = self._queue[0]
                    waiting = self._by_key[oldest.key]
                    waited = time.monotonic() - oldest.arrived
                    # Calls of other shapes are waiting too: their streams cannot join this group.
                    could_join = self.active() - len(self._queue)
                    if len(waiting) >= self.max_batch or could_join <= 0 or waited >= self.max_wait_s:
                        group = waiting[: self.max_batch]
                        del waiting[: self.max_batch]
                        if not waiting:
                            del self._by_key[oldest.key]
                        taken = {id(c) for c in group}  # one pass: list.remove per call is quadratic in the batch
                        self._queue = [c for c in self._queue if id(c) not in taken]
                        return group
                    self._cv.wait(timeout=self.max_wait_s - waited)
                else:
                    self._cv.wait()

    def _run(self) -> None:
        while (group := self._take()) is not None:
            self._serve(group)
            del group  # not held while waiting for the next batch: its streams' caches (device slots) go back at once

    def _serve(self, group: list[_Call]) -> None:
        started = time.perf_counter()
        try:
            results = self._call(group)
        except BaseException as exc:  # noqa: BLE001 - handed to every caller of this batch
            for c in group:
                c.error = exc
                c.done.set()
            return
        busy = time.perf_counter() - started
        st = self.stats
        st.busy_s += busy
        st.calls += len(group)
        st.batches += 1
        st.max_batch = max(st.max_batch, len(group))
        kind = st.by_kind.setdefault(group[0].key[0], [0, 0, 0.0])
        kind[0] += len(group)
        kind[1] += 1
        kind[2] = round(kind[2] + busy, 4)
        for c, r in zip(group, results):
            c.result = r
            c.args = ()
            c.done.set()

    def _call(self, group: list[_Call]) -> list[Any]:
        if group[0].key[0] == "f0":
            mel = np.concatenate([c.args[0] for c in group], axis=0)
            f0, nxt = self.inner.f0_step(mel, _stack([c.args[1] for c in group]))
            return [(f0[i:i + 1], _row(nxt, i)) for i in range(len(group))]
        stacked = [np.concatenate([c.args[j] for c in group], axis=0) for j in range(5)]
        audio, phase, nxt = self.inner.generator_step(*stacked, _stack([c.args[5] for c in group]),
                                                      group[0].key[0] == "final")
        return [(audio[i:i + 1], phase[i:i + 1], _row(nxt, i)) for i in range(len(group))]
