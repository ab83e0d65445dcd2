"""Cross-stream batching: whole pushes handed to one scheduler thread, which drives every stream's bookkeeping and
runs their steps as batched calls of the step graphs.

A push is the stream's bookkeeping written once as a coroutine (:meth:`~hift_runtime.streaming.VocoderStream._steps`:
it yields each backend call it needs and is sent the result). The stream's thread validates its chunk, hands the
coroutine over (one hand-off in, one out, however many steps the push has) and waits. The scheduler thread keeps
every push in hand at its next call and, whenever the device is free, runs one group as one batched call: the
calls of the same kind and shape as the oldest waiting push's (streams at different positions batch together; the
step size fixes the shapes). While that call runs on the device, the scheduler hands out the previous call's results,
advances those pushes to their next calls and takes in new pushes, so the device waits for Python only when there is
nothing to run. The group grows with the load by itself: every push that arrives while a call runs can join the next.

A lone push never waits. When the device is idle, a group smaller than ``max_batch`` waits at most ``max_wait_s``, and
only while streams are inside a push but not yet handed over (they may join).

Isolation: a stream's chunk is validated in its own thread before it is handed over, so a bad chunk is refused for
that stream only; an error inside a batched call is raised in every push of that call (their streams' state is
unchanged: the bookkeeping commits only after all its calls succeeded).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .streaming import StepCall, VocoderBackend


@dataclass
class BatchStats:
    """Counters a test or a monitor can read: how many calls ran, in how many batches, the largest batch."""

    calls: int = 0
    batches: int = 0
    max_batch: int = 0
    busy_s: float = 0.0  # time inside the backend's calls (the device's utilisation over a run)
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> [calls, batches, busy seconds]


@dataclass(eq=False)
class _Push:
    steps: Generator[StepCall, Any, np.ndarray]
    arrived: float
    call: StepCall | None = None
    since: float = 0.0  # when its current call became ready
    done: threading.Event = field(default_factory=threading.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class _Flight:
    """A batched call on the device: its pushes, and the future of their results (one per push)."""

    group: list[_Push]
    future: concurrent.futures.Future[tuple[list[Any], float]]


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


def run_batched(backend: VocoderBackend, calls: list[StepCall]) -> list[Any]:
    """Calls of one key as one batched backend call; each call's result (its row)."""
    kind = calls[0].kind
    if kind == "f0":
        mel = np.concatenate([c.args[0] for c in calls], axis=0)
        f0, nxt = backend.f0_step(mel, _stack([c.args[1] for c in calls]))
        return [(f0[i:i + 1], _row(nxt, i)) for i in range(len(calls))]
    stacked = [np.concatenate([c.args[j] for c in calls], axis=0) for j in range(5)]
    audio, phase, nxt = backend.generator_step(*stacked, _stack([c.args[5] for c in calls]), kind == "final")
    return [(audio[i:i + 1], phase[i:i + 1], _row(nxt, i)) for i in range(len(calls))]


class PushScheduler:
    """Runs pushes (step coroutines) of many streams on ``backend``, batching their calls across streams."""

    def __init__(self, backend: VocoderBackend, max_batch: int = 256, max_wait_s: float = 0.003,
                 active: Callable[[], int] | None = None) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"max_batch must be >= 1 and max_wait_s >= 0, got {max_batch}, {max_wait_s}")
        self.backend, self.max_batch, self.max_wait_s = backend, max_batch, max_wait_s
        self.active = active or (lambda: 0)  # streams inside a push (handed over or not); unknown: never wait
        self.stats = BatchStats()
        self._arrivals: list[_Push] = []
        self._inside = 0  # pushes handed over and not yet done
        self._cv = threading.Condition()
        self._closed = False
        # The batched calls run here, so the scheduler thread keeps Python work going while the device computes.
        self._device = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hift-batch-call")
        self._thread = threading.Thread(target=self._loop, name="hift-scheduler", daemon=True)
        self._thread.start()

    def run(self, steps: Generator[StepCall, Any, np.ndarray]) -> np.ndarray:
        """Run one push to its end (from the stream's thread); its result, or its error raised here."""
        push = _Push(steps, time.monotonic())
        with self._cv:
            if self._closed:
                steps.close()
                raise RuntimeError("the vocoder's scheduler is closed")
            self._arrivals.append(push)
            self._inside += 1
            self._cv.notify()
        push.done.wait()
        if push.error is not None:
            raise push.error
        assert push.result is not None
        return push.result

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self._device.shutdown(wait=True)

    # ---- the scheduler thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        ready: list[_Push] = []  # pushes whose next call waits for the device
        flight: _Flight | None = None
        while True:
            with self._cv:
                while True:
                    landed = flight is not None and flight.future.done()
                    if self._arrivals or landed:
                        break
                    if self._closed and flight is None:
                        for p in ready:
                            self._fail(p, RuntimeError("the vocoder's scheduler was closed during this push"))
                        return
                    if flight is None and ready:
                        wait = self._partner_wait(self._group_of(ready))
                        if wait <= 0:
                            break
                        self._cv.wait(wait)
                    else:
                        self._cv.wait()
                arrivals, self._arrivals = self._arrivals, []
            for p in arrivals:
                self._advance(p, None, ready)
            if flight is not None and flight.future.done():
                landed_flight, flight = flight, None
                # The next call goes to the device before this one's results are handed out.
                flight = self._launch_if_due(ready)
                self._land(landed_flight, ready)
                del landed_flight  # its results hold device slots: not kept while waiting for the next call
            if flight is None:
                flight = self._launch_if_due(ready)

    def _partner_wait(self, group: list[_Push]) -> float:
        """How much longer the next group (:meth:`_group_of`) waits for partners: > 0 only while streams inside a
        push have not been handed over yet and its oldest call has waited less than ``max_wait_s``."""
        if len(group) >= self.max_batch or self.active() <= self._inside:
            return 0.0
        return self.max_wait_s - (time.monotonic() - group[0].since)

    def _group_of(self, ready: list[_Push]) -> list[_Push]:
        """The oldest push's call and every ready call of the same key, oldest push first."""
        oldest = min(ready, key=lambda p: p.arrived)
        key = oldest.call.key  # type: ignore[union-attr]
        return sorted((p for p in ready if p.call.key == key), key=lambda p: p.arrived)  # type: ignore[union-attr]

    def _launch_if_due(self, ready: list[_Push]) -> _Flight | None:
        """The next batched call, unless nothing is ready or its group still waits for partners (the loop then
        waits, at most until the partner wait is over)."""
        if not ready:
            return None
        group = self._group_of(ready)  # computed once: it is sorted over every ready push
        if self._partner_wait(group) > 0:
            return None
        group = group[: self.max_batch]
        taken = set(map(id, group))
        ready[:] = [p for p in ready if id(p) not in taken]
        calls = [p.call for p in group]
        future = self._device.submit(self._timed_call, calls)
        future.add_done_callback(self._notify)
        return _Flight(group, future)

    def _timed_call(self, calls: list[StepCall]) -> tuple[list[Any], float]:
        started = time.perf_counter()
        results = run_batched(self.backend, calls)
        return results, time.perf_counter() - started

    def _notify(self, _future: Any) -> None:
        with self._cv:
            self._cv.notify()

    def _land(self, flight: _Flight, ready: list[_Push]) -> None:
        try:
            results, busy = flight.future.result()
        except BaseException as exc:  # noqa: BLE001 - raised in every push of this call
            for p in flight.group:
                self._fail(p, exc)
            return
        st = self.stats
        kind_name = flight.group[0].call.kind  # type: ignore[union-attr]
        st.busy_s += busy
        st.calls += len(flight.group)
        st.batches += 1
        st.max_batch = max(st.max_batch, len(flight.group))
        kind = st.by_kind.setdefault(kind_name, [0, 0, 0.0])
        kind[0] += len(flight.group)
        kind[1] += 1
        kind[2] = round(kind[2] + busy, 4)
        for p, result in zip(flight.group, results):
            self._advance(p, result, ready)

    def _advance(self, push: _Push, value: Any, ready: list[_Push]) -> None:
        """Send a call's result into the push; it stops at its next call (ready) or ends."""
        push.call = None  # not kept while the push computes its next call: its slots go back once it ends
        try:
            push.call = push.steps.send(value)
        except StopIteration as stop:
            push.result = stop.value
            self._finish(push)
        except BaseException as exc:  # noqa: BLE001 - the push's own error, raised in its stream's thread
            push.error = exc
            self._finish(push)
        else:
            push.since = time.monotonic()
            ready.append(push)

    def _fail(self, push: _Push, exc: BaseException) -> None:
        push.steps.close()
        push.error = exc
        self._finish(push)

    def _finish(self, push: _Push) -> None:
        with self._cv:
            self._inside -= 1
        push.done.set()
