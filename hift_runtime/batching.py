"""Cross-stream batching: whole pushes handed to one scheduler thread, which drives every stream's bookkeeping and
runs their steps as batched calls of the step graphs.

A push is the stream's bookkeeping written once as a coroutine (:meth:`~hift_runtime.streaming.VocoderStream._steps`:
it yields each backend call it needs and is sent the result). The stream's thread validates its chunk, hands the
coroutine over (one hand-off in, one out, however many steps the push has) and waits. The scheduler thread keeps
every push in hand at its next call and, whenever the device is free, runs one group as one batched call: the
calls of the same kind and shape as the call due first (streams at different positions batch together; the step size
fixes the shapes). A call is due when it became ready, counted per call, not per push, so a long push takes its turn
step by step between other streams' calls and never holds the device for its whole length; a push that hands its
audio to a listener as each step is done (``on_audio``) is due at its arrival plus the audio it has handed out, so
while that audio plays, the calls of pushes whose listeners have nothing yet go first (an utterance's first audio,
a chunk's first piece). While that call runs on the device, the scheduler hands out the previous call's results,
advances those pushes to their next calls and takes in new pushes, so the device waits for Python only when there is
nothing to run. The group grows with the load by itself: every push that arrives while a call runs can join the next.
The scheduler stacks a group's inputs as it launches it, so the device thread only makes calls and the device waits
for no stacking between two of them. On an engine that ``launches_ahead`` the scheduler launches the call itself
(host writes and replay), the one behind a call still on the device included, and the device thread only waits for
each call and hands its results on: the device runs one call while the host launches the next. On an engine whose
F0 calls run beside its generator calls (``f0_lane``: the compiled engine's F0 graphs replay on a CUDA stream of
their own) the F0 calls are a second lane, with its own waiting calls, its own call on the device and its own device
thread: a push's F0 call (an utterance's first audio waits for one) never waits for a generator call.

An application whose streams are tasks of one event loop can let that loop's thread do the scheduling instead
(:meth:`PushScheduler.attach_loop`): one thread fewer trading the GIL at every NumPy call.

A lone push never waits. When the device is idle, a group smaller than ``max_batch`` waits at most ``max_wait_s``, and
only while streams are inside a push but not yet handed over (they may join). With an F0 lane, an idle generator lane
also holds a group of fewer than ``generator_hold_below`` streams while an F0 call is on the device, at most
``generator_hold_s`` after its oldest call was ready: the pushes of that F0 call join it a moment later, where
otherwise each small group takes a generator turn of its own. A quiet lone push (nothing else in hand,
nothing settled in the 20 ms before it arrived) over a backend whose calls are short runs its calls in the
scheduling thread itself, without the device thread's hand-offs (``inline_lone_calls``).

Isolation: a stream's chunk is validated in its own thread before it is handed over, so a bad chunk is refused for
that stream only; an error inside a batched call is raised in every push of that call and no other (their streams'
state is unchanged: the bookkeeping commits only after all its calls succeeded).

Cancellation: a push whose waiting thread is interrupted (KeyboardInterrupt) or whose :class:`CancelToken` is
cancelled stops at its next call and leaves its stream unchanged, unless a call that wrote device caches in place
already ran: then it runs to its end. Either way the waiting thread returns only once the push has settled, so a retry
never overlaps it. ``close()`` fails every push still waiting with a clear error, at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engine import (CancelToken, LaunchedStep, StackedCalls, StepCall, VocoderBackend, launch_stacked, run_stacked,
                     split_rows, stack_calls)
from .errors import PushCancelled, SchedulerClosed

__all__ = ["BatchStats", "PushScheduler", "SchedulerClosed"]


@dataclass
class BatchStats:
    """Counters a test or a monitor can read: how many calls ran, in how many batches, the largest batch. Seconds are
    kept unrounded (a report rounds them)."""

    calls: int = 0
    batches: int = 0
    max_batch: int = 0
    busy_s: float = 0.0  # time inside the backend's calls (the device's utilisation over a run; two at once overlap)
    # Of it, the main lane's (the generator's calls, and the F0 calls where they share its lane): where F0 calls run
    # beside it (EngineTraits.f0_lane) the two overlap, and this share is the one that bounds the device.
    main_lane_busy_s: float = 0.0
    queued: int = 0  # batches started behind another still on the device (no scheduler wake-up between the two)
    launched_ahead: int = 0  # of those, launched by the scheduler while the other was on the device (launches_ahead)
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> [calls, batches, busy seconds]
    # The same by step shape, "kind@mel frames" (the step's frames plus its look-ahead): what each step size costs
    # the device, e.g. a stream's short edge steps against its full ones.
    by_shape: dict[str, list[float]] = field(default_factory=dict)
    # By step shape, how many batches had each size (at most max_batch sizes a shape): whether the calls are few and
    # full, or many and small (each call's fixed cost paid again).
    batch_sizes: dict[str, dict[int, int]] = field(default_factory=dict)


@dataclass(eq=False)
class _Push:
    steps: Generator[StepCall, Any, np.ndarray]
    handed_over_at: float
    call: StepCall | None = None
    call_ready_at: float = 0.0  # when its current call became ready: the partner wait counts from here
    # When its current call is due: the push's arrival plus the audio it has handed to its listener (its playback
    # lasts that long), or for a push whose audio goes out whole, when the call became ready. Orders the calls.
    due_at: float = 0.0
    wrote_caches: bool = False  # a call of it that writes device caches in place has run: it cannot be undone
    ready_seq: int = -1  # its entry in the ready calls' heap while its call waits there (-1: not waiting)
    quiet: bool = False  # it arrived alone, after the scheduler had been empty a while (inline_quiet_s)
    cancelled: bool = False
    settled: bool = False  # set once, by _finish under the scheduler's lock
    # A thread waiting for it (run()); asyncio pushes are told through on_done instead, and an Event each (a lock,
    # a condition) cost ~4 % of the GIL's time at a thousand streams.
    waiter: threading.Event | None = None
    result: np.ndarray | None = None
    error: BaseException | None = None
    on_done: Callable[[], None] | None = None  # told once the push settled (from whichever thread settled it)


@dataclass(eq=False)
class _Flight:
    """A batched call on the device: its pushes, and the future of their results (one per push)."""

    group: list[_Push]
    future: concurrent.futures.Future[tuple[list[Any], float]]


@dataclass(eq=False)
class _Lane:
    """One timeline of the device: the calls waiting for it, its calls on the device (the first) and queued behind, the
    thread that waits for them, and when that thread handed out its last call's results. An engine whose F0 calls run
    beside its generator's (``EngineTraits.f0_lane``) has a lane for them; every other call is the main lane's."""

    ready: _ReadyCalls
    flights: collections.deque[_Flight]
    device: concurrent.futures.ThreadPoolExecutor
    free_at: float = 0.0

    def landed(self) -> bool:
        return bool(self.flights) and self.flights[0].future.done()


class PushScheduler:
    """Runs pushes (step coroutines) of many streams on ``backend``, batching their calls across streams.

    ``pushes_in_progress``: how many streams are inside a push (handed over or not yet); the scheduler waits for
    partners only while some have not been handed over. Unknown (None): it never waits.
    """

    def __init__(self, backend: VocoderBackend, max_batch: int = 256, max_wait_s: float = 0.003,
                 pushes_in_progress: Callable[[], int] | None = None) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"max_batch must be >= 1 and max_wait_s >= 0, got {max_batch}, {max_wait_s}")
        self.backend, self.max_batch, self.max_wait_s = backend, max_batch, max_wait_s
        # The smallest group queued behind a call on the device (see _launch_due): a quarter of a full batch.
        self.queue_behind = max(1, max_batch // 4)
        # The F0 lane's landing pushes join a small generator group instead of each taking a turn: a generator call
        # costs mostly its fixed time at small batches (BENCHMARKS.md, "the generator lane's hold").
        self.generator_hold_s, self.generator_hold_below = 0.0015, 32
        # Which F0 calls go to the F0 lane where the engine has one: "all" (the default), "long" (a long push's only,
        # StepCall.long_push) or "none" (each takes its turn between the generator's calls). A switch while the lane's
        # cost at 24-frame chunks is measured (BENCHMARKS.md, "tf32 2 048, and the 24-frame schedule again"); set it
        # while no push is in hand.
        self.f0_lane_calls = "all"
        # A quiet lone push's calls made in the scheduling thread itself (the device idle, nothing settled in the
        # last inline_quiet_s): no device-thread hand-offs, two a call (BENCHMARKS.md, "a lone push"). Under load a
        # call made here would hold the thread that groups the next pushes; only on an engine that declares it.
        self.inline_lone_calls = backend.traits.inline_lone_calls
        self.inline_quiet_s = 0.02
        self._last_settled_at = -math.inf
        self.pushes_in_progress = pushes_in_progress or (lambda: 0)
        self.stats = BatchStats()
        self._arrivals: list[_Push] = []
        self._cancellations: list[_Push] = []
        self._handed_over: set[_Push] = set()  # pushes handed over and not yet done (what close() fails if it must)
        self._cv = threading.Condition()
        self._closing = False
        self._wakers: weakref.WeakKeyDictionary[Any, _LoopWaker] = weakref.WeakKeyDictionary()  # one per loop
        self.launches_ahead = backend.traits.launches_ahead
        # The batched calls run in each lane's device thread, so the scheduler thread keeps Python work going while
        # the device computes. An F0 call waits for no generator call where the engine runs them side by side.
        names = ("hift-batch-call", "hift-f0-call")[:1 + backend.traits.f0_lane]
        self._lanes = [_Lane(_ReadyCalls(), collections.deque(),
                             concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name))
                       for name in names]
        # Who runs the scheduling: this scheduler's own thread (None), or an event loop (attach_loop) in its thread.
        self._driver: Any = None
        self._driver_thread = 0
        self._kicked = False  # a _tick is scheduled on the driving loop (touched in its thread only)
        self._timer: Any = None  # the partner wait's timer on the driving loop
        self._closed = threading.Event()  # the driving loop has failed what close() left it
        self._thread = threading.Thread(target=self._loop, name="hift-scheduler", daemon=True)
        self._thread.start()

    @property
    def lanes(self) -> int:
        """The device's timelines it keeps calls in: 2 where the engine runs its F0 calls beside its generator calls
        (``EngineTraits.f0_lane``), else 1."""
        return len(self._lanes)

    def _submit(self, steps: Generator[StepCall, Any, np.ndarray], on_done: Callable[[], None] | None = None,
                waiter: threading.Event | None = None) -> _Push:
        push = _Push(steps, time.monotonic(), on_done=on_done, waiter=waiter)
        with self._cv:
            if self._closing:
                steps.close()
                raise SchedulerClosed("the vocoder's scheduler is closed (vocoder.close() was called)")
            if self._driver is not None and self._driver.is_closed():
                if self._handed_over:  # they cannot settle any more: close() fails them
                    steps.close()
                    raise SchedulerClosed("the event loop driving the vocoder's scheduler closed with pushes in "
                                          "it; close the vocoder and open a new one")
                self._detach()  # nothing was left in it: a scheduler thread takes over
            push.quiet = not self._handed_over and push.handed_over_at - self._last_settled_at >= self.inline_quiet_s
            self._arrivals.append(push)
            self._handed_over.add(push)
            self._wake()
        return push

    def _wake(self) -> None:
        """Tell whoever schedules that something arrived (under ``_cv``)."""
        if self._driver is None:
            self._cv.notify()
        elif threading.get_ident() == self._driver_thread:
            self._kick()
        else:
            self._kick_threadsafe()

    async def arun(self, steps: Generator[StepCall, Any, np.ndarray],
                   on_cancelled: Callable[[BaseException], None] | None = None) -> np.ndarray:
        """:meth:`run` for asyncio: no thread per push. The scheduler thread tells the event loop of settled pushes in
        bulk (one loop wake-up for every push a batched call settles). Cancelling the awaiting task cancels the
        push; the cancellation goes on only once the push has settled (a retry cannot overlap it), after
        ``on_cancelled(its error)`` if it stopped or failed rather than running to its end."""
        import asyncio

        loop = asyncio.get_running_loop()
        waker = self._waker(loop)
        settled = loop.create_future()

        def on_done() -> None:
            if loop is self._driver and threading.get_ident() == self._driver_thread:
                if not settled.done():  # settled in this loop's thread: no wake-up through its self-pipe
                    settled.set_result(None)
            else:
                waker.resolve(settled)

        push = self._submit(steps, on_done)
        try:
            await asyncio.shield(settled)
        except asyncio.CancelledError:
            self._cancel(push)
            while not settled.done():  # through further cancellations
                try:
                    await asyncio.wait([settled])
                except asyncio.CancelledError:
                    pass
            if on_cancelled is not None and push.error is not None:
                on_cancelled(push.error)
            raise
        return _outcome(push)

    def _waker(self, loop: Any) -> "_LoopWaker":
        with self._cv:
            waker = self._wakers.get(loop)
            if waker is None:
                waker = self._wakers[loop] = _LoopWaker(loop)
            return waker

    def run(self, steps: Generator[StepCall, Any, np.ndarray], cancel: CancelToken | None = None) -> np.ndarray:
        """Run one push to its end (from the stream's thread); its result, or its error raised here. Interrupted
        (KeyboardInterrupt) or cancelled, the push is cancelled and this returns only once it has settled."""
        driver = self._driver
        if driver is not None and threading.get_ident() == self._driver_thread and not driver.is_closed():
            steps.close()
            raise RuntimeError("push()/finish() in the event loop that drives the scheduler would block it; use "
                               "apush()/afinish()")
        done = threading.Event()
        push = self._submit(steps, waiter=done)
        if cancel is not None:
            cancel.on_cancel(lambda: self._cancel(push))
        try:
            if threading.current_thread() is threading.main_thread():
                # Timed waits in the main thread: an untimed one may sleep through Ctrl-C until the push ends (the
                # signal handler runs only when the wait returns). Other threads get no signals: they wait untimed
                # (a thousand streams' threads polling would cost the GIL ten thousand wake-ups a second).
                while not done.wait(0.1):
                    pass
            else:
                done.wait()
        except BaseException:
            self._cancel(push)
            _wait_settled(done)
            raise
        return _outcome(push)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop: every push still waiting fails at once with :class:`SchedulerClosed`; a call on the device is
        waited for (at most ``timeout_s``), then its pushes fail too. No push is left waiting."""
        with self._cv:
            self._closing = True
            self._wake()
        if self._driver is not None and threading.get_ident() != self._driver_thread and \
                not self._driver.is_closed():
            self._closed.wait(timeout_s)  # the loop fails what it holds (a call on the device answered first)
        self._thread.join(timeout=timeout_s)
        with self._cv:  # the loop did not end in time (a call hangs on the device): fail what it still holds
            leftovers = list(self._handed_over)
        for p in leftovers:
            self._fail(p, SchedulerClosed("the vocoder's scheduler was closed (vocoder.close()) while this push waited "
                                          "for the device"), close_steps=False)
        for lane in self._lanes:
            lane.device.shutdown(wait=False)

    # ---- who schedules: the scheduler's own thread, or an event loop ----------------------------------------------
    def attach_loop(self, loop: Any) -> None:
        """Schedule from ``loop``'s thread instead of this scheduler's own (call it from inside the running loop,
        before its first push): for an application whose streams are tasks of one event loop. The event loop's
        thread then advances the pushes between its tasks, and no scheduler thread takes the GIL from it (in a busy
        process every NumPy call hands the GIL to the other thread and waits for it back; BENCHMARKS.md, "the
        scheduler in the event loop's thread"). Pushes from other threads (``push()``) and other loops still work,
        handed to this loop. :meth:`detach_loop` gives the scheduling back to a thread."""
        import asyncio

        if asyncio.get_running_loop() is not loop:
            raise RuntimeError("attach_loop(loop) must be called from inside that running loop")
        with self._cv:
            if self._closing:
                raise SchedulerClosed("the vocoder's scheduler is closed (vocoder.close() was called)")
            if self._handed_over:
                raise RuntimeError("attach_loop() while pushes are in flight: attach before the first push")
            self._driver, self._driver_thread = loop, threading.get_ident()
            self._cv.notify()  # the scheduler thread ends
        self._thread.join()

    def detach_loop(self) -> None:
        """Back to a scheduler thread of its own (before the attached loop closes, once its pushes are done)."""
        with self._cv:
            if self._driver is None:
                return
            if threading.get_ident() != self._driver_thread and not self._driver.is_closed():
                raise RuntimeError("detach_loop() from outside the running loop that drives the scheduler")
            if self._handed_over:
                raise RuntimeError("detach_loop() while pushes are in flight: await them first")
            self._detach()

    def _detach(self) -> None:
        """(Under ``_cv``, nothing handed over.) The scheduling back to a thread of its own."""
        if self._timer is not None and not self._driver.is_closed():
            self._timer.cancel()
        self._driver, self._driver_thread, self._kicked, self._timer = None, 0, False, None
        self._thread = threading.Thread(target=self._loop, name="hift-scheduler", daemon=True)
        self._thread.start()

    # ---- scheduling: one step, driven by the scheduler thread or by an event loop ------------------------------
    def _loop(self) -> None:
        """The scheduler thread: waits for something to do, then steps; ends when closed or a loop takes over."""
        while True:
            with self._cv:
                while True:
                    if self._driver is not None:
                        return  # attach_loop(): nothing is in flight
                    if self._arrivals or self._cancellations or self._landed():
                        break
                    if self._closing:
                        break
                    wait = self._idle_lanes_wait()
                    if wait is not None and wait <= 0:
                        break
                    self._cv.wait(wait)
                taken = self._take()
            if self._step(*taken):
                return

    def _kick(self) -> None:
        """A :meth:`_tick` soon, on the driving loop (from its thread; nothing once that loop is closed: close() and
        _submit() deal with what it left)."""
        if self._driver is not None and not self._kicked and not self._driver.is_closed():
            self._kicked = True
            self._driver.call_soon(self._tick)

    def _kick_threadsafe(self) -> None:
        """A :meth:`_tick` on the driving loop, from another thread (straight to the tick: one loop wake-up, not a
        kick and then a tick; a tick with nothing to do costs nothing)."""
        try:
            self._driver.call_soon_threadsafe(self._tick)
        except (RuntimeError, AttributeError):  # the loop is closed: close() or detach_loop() is for the caller
            pass

    def _tick(self) -> None:
        """The driving loop's step (as the scheduler thread's), then a timer for a group waiting for partners."""
        self._kicked = False
        if self._driver is None:  # scheduled before detach_loop(): the scheduler thread has it now
            return
        while True:  # a step lands one call; the one queued behind it may have finished too (its wake-up spent)
            with self._cv:
                taken = self._take()
            if self._step(*taken):
                self._closed.set()
                return
            if not self._landed():
                break
        if self._timer is None:
            wait = self._idle_lanes_wait()
            if wait is not None and wait > 0:
                self._timer = self._driver.call_later(wait, self._partner_timer)

    def _partner_timer(self) -> None:
        self._timer = None
        self._kick()

    def _landed(self) -> bool:
        """Whether a lane's call on the device is done (its results wait to be handed out)."""
        return any(lane.landed() for lane in self._lanes)

    def _idle_lanes_wait(self) -> float | None:
        """How long until a lane with nothing on the device starts its next group (0 or less: now); None where no
        idle lane has a call waiting."""
        waits = [self._partner_wait(self._group_of(lane.ready), lane) for lane in self._lanes
                 if not lane.flights and lane.ready]
        return min(waits) if waits else None

    def _lane_of(self, push: _Push) -> _Lane:
        """The lane of the push's current call: the F0 lane's, where there is one, for an F0 call (of a long push
        only, with ``f0_lane_calls`` "long"; none with "none")."""
        lanes, call, calls = self._lanes, push.call, self.f0_lane_calls
        beside = (len(lanes) > 1 and call.kind == "f0"  # type: ignore[union-attr]
                  and (calls == "all" or calls == "long" and call.long_push))  # type: ignore[union-attr]
        return lanes[1] if beside else lanes[0]

    def _take(self) -> tuple[list[_Push], list[_Push], bool]:
        """(Under ``_cv``.) The arrivals and cancellations so far, handed from the lists others append to, and
        whether the scheduler is closing: what one :meth:`_step` works on."""
        arrivals, self._arrivals = self._arrivals, []
        cancellations, self._cancellations = self._cancellations, []
        return arrivals, cancellations, self._closing

    def _step(self, arrivals: list[_Push], cancellations: list[_Push], closing: bool) -> bool:
        """Take in arrivals and cancellations, hand out a landed call's results, start the calls due. True once
        closed (every push it held failed)."""
        lanes = self._lanes
        if closing:
            closed = SchedulerClosed("the vocoder's scheduler was closed (vocoder.close()) during this push")
            for p in arrivals:
                self._fail(p, closed)
            self._fail_waiting(closed)
            for lane in lanes:
                while lane.flights:  # each one's answer first (close() stops waiting after its timeout)
                    flight = lane.flights.popleft()
                    flight.future.exception()
                    self._land(flight, lane)
            self._fail_waiting(closed)
            return True
        for p in arrivals:
            self._send(p, None)
        for p in cancellations:
            if p.ready_seq >= 0 and not p.wrote_caches:  # waiting for the device, and undoable
                self._lane_of(p).ready.remove(p)
                self._send(p, None)  # stops it: cancelled
        for lane in lanes:
            if lane.landed():
                landed_flight = lane.flights.popleft()
                # The next calls go to the device before this one's results are handed out.
                self._launch_due(lane)
                self._land(landed_flight, lane)
                del landed_flight  # its results hold device slots: not kept while waiting for the next call
        for lane in lanes:
            if not lane.flights:
                self._launch_due(lane)
        return False

    def _fail_waiting(self, exc: BaseException) -> None:
        for lane in self._lanes:
            for p in lane.ready:
                self._fail(p, exc)
            lane.ready.clear()

    def _launch_due(self, lane: _Lane) -> None:
        """Start the next batched calls that are due (called when the device is idle or a call has landed): with the
        device idle, a group as soon as one is ready (and done waiting for partners); behind a call on the device,
        one more, only of ``queue_behind`` calls or more. Queued, it starts the moment the device is free instead of
        after this thread has woken up for the landed call and formed it (else the device idles meanwhile under load);
        a smaller group waits for the landed call's pushes, which may join it."""
        flights = lane.flights
        while len(flights) < 2:
            inline = (not flights and self.inline_lone_calls and len(self._handed_over) == 1
                      and self.backend.traits.calls_from_any_thread)
            flight = self._launch_if_due(lane, self.queue_behind if flights else 1, inline)
            if flight is None:
                return
            self.stats.queued += bool(flights)
            flights.append(flight)

    def _cancel(self, push: _Push) -> None:
        with self._cv:
            push.cancelled = True
            self._cancellations.append(push)
            self._wake()

    def _partner_wait(self, group: list[_Push], lane: _Lane) -> float:
        """How much longer the next group (:meth:`_group_of`) of ``lane`` waits for partners: > 0 only while its
        oldest call has waited less than ``max_wait_s`` with streams inside a push not handed over yet, or less than
        ``generator_hold_s`` in the generator lane, under ``generator_hold_below`` streams, with an F0 call on the
        device."""
        if len(group) >= self.max_batch:
            return 0.0
        wait = self.max_wait_s if self.pushes_in_progress() > len(self._handed_over) else 0.0
        if (self.generator_hold_s > wait and len(group) < self.generator_hold_below and len(self._lanes) > 1
                and lane is self._lanes[0] and self._lanes[1].flights):
            wait = self.generator_hold_s
        if wait <= 0:
            return 0.0
        return wait - (time.monotonic() - min(p.call_ready_at for p in group))

    def _group_of(self, ready: _ReadyCalls) -> list[_Push]:
        """The call due first and every ready call of the same key; past ``max_batch`` of them, the earliest due
        first. Due per call, so one stream's long push cannot keep other streams' calls of other shapes waiting; and a
        push that has handed audio to its listener lets calls whose listeners have none yet go first, for as long as
        that audio plays."""
        group = ready.first_group()
        if len(group) > self.max_batch:
            group.sort(key=_due_at)
        return group

    def _launch_if_due(self, lane: _Lane, min_group: int = 1, inline: bool = False) -> _Flight | None:
        """The next batched call, unless nothing is ready, its group is smaller than ``min_group`` or still waits for
        partners (the loop then waits, at most until the partner wait is over). ``inline``: a call of one quiet push
        runs here, in the scheduling thread, and comes back landed (see ``inline_lone_calls``)."""
        ready = lane.ready
        if not ready:
            return None
        group = self._group_of(ready)
        if len(group) < min_group or self._partner_wait(group, lane) > 0:
            return None
        group = group[: self.max_batch]
        ready.take(group)
        calls = [p.call for p in group]
        for p in group:
            p.wrote_caches |= p.call.writes_caches  # type: ignore[union-attr]
        if inline and len(group) == 1 and group[0].quiet:
            future: concurrent.futures.Future[tuple[list[Any], float]] = concurrent.futures.Future()
            try:
                future.set_result(self._timed_call(stack_calls(calls)))
            except BaseException as exc:  # noqa: BLE001 - as the device thread's future would hold it
                future.set_exception(exc)
            return _Flight(group, future)
        # Stacked (and, where the engine launches ahead, launched) here, off the device thread: its time between two
        # calls is time the device waits.
        try:
            stacked = stack_calls(calls)
            launched_at, behind, launched = time.perf_counter(), bool(lane.flights), None
            if self.launches_ahead:
                launched = launch_stacked(self.backend, stacked, wait=False)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - the group's failure, as the device thread's future would hold it
            future = concurrent.futures.Future()
            future.set_exception(exc)
            future.add_done_callback(self._notify)
            return _Flight(group, future)
        if self.launches_ahead:
            self.stats.launched_ahead += launched is not None and behind
            future = lane.device.submit(self._timed_result, lane, stacked, launched, launched_at)
        else:
            future = lane.device.submit(self._timed_call, stacked)
        future.add_done_callback(self._notify)
        return _Flight(group, future)

    def _timed_call(self, stacked: StackedCalls) -> tuple[list[Any], float]:
        started = time.perf_counter()
        results = run_stacked(self.backend, stacked)
        return results, time.perf_counter() - started

    def _timed_result(self, lane: _Lane, stacked: StackedCalls, launched: LaunchedStep | None,
                      launched_at: float) -> tuple[list[Any], float]:
        """(The lane's device thread.) A call the scheduler launched, waited for (or launched here: its buffers held
        an earlier call's when the scheduler tried); its time counted from its launch or the lane's previous call's
        end, the later (the calls overlap)."""
        if launched is None:
            launched_at = time.perf_counter()
            launched = launch_stacked(self.backend, stacked)  # type: ignore[arg-type]
            assert launched is not None
        results = split_rows(stacked, launched.result())
        started, lane.free_at = max(launched_at, lane.free_at), time.perf_counter()
        return results, lane.free_at - started

    def _notify(self, _future: Any) -> None:
        with self._cv:
            self._wake()

    def _land(self, flight: _Flight, lane: _Lane) -> None:
        try:
            results, busy = flight.future.result()
        except BaseException as exc:  # noqa: BLE001 - raised in every push of this call, and no other
            for p in flight.group:
                self._fail(p, exc)
            return
        st = self.stats
        kind_name, mel_frames = flight.group[0].call.key  # type: ignore[union-attr]
        shape, size = f"{kind_name}@{mel_frames}", len(flight.group)
        st.busy_s += busy
        if lane is self._lanes[0]:
            st.main_lane_busy_s += busy
        st.calls += size
        st.batches += 1
        st.max_batch = max(st.max_batch, size)
        for counter in (st.by_kind.setdefault(kind_name, [0, 0, 0.0]), st.by_shape.setdefault(shape, [0, 0, 0.0])):
            counter[0] += size
            counter[1] += 1
            counter[2] += busy
        sizes = st.batch_sizes.setdefault(shape, {})
        sizes[size] = sizes.get(size, 0) + 1
        for p, result in zip(flight.group, results):
            self._send(p, result)

    def _send(self, push: _Push, value: Any) -> None:
        """Send a call's result into the push; it stops at its next call (ready) or ends. A cancelled push that has
        written no device caches is stopped here instead (its stream unchanged)."""
        if push.settled:  # failed by close() while its call was on the device
            return
        push.call = None  # not kept while the push computes its next call: its slots go back once it ends
        if push.cancelled and not push.wrote_caches:
            self._fail(push, PushCancelled("the push was cancelled; the stream is unchanged"))
            return
        try:
            push.call = push.steps.send(value)
        except StopIteration as stop:
            push.result = stop.value
            self._finish(push)
        except BaseException as exc:  # noqa: BLE001 - the push's own error, raised in its stream's thread
            push.error = exc
            self._finish(push)
        else:
            push.call_ready_at = time.monotonic()
            ahead = push.call.audio_ahead_s
            push.due_at = push.call_ready_at if ahead is None else push.handed_over_at + ahead
            self._lane_of(push).ready.add(push)

    def _fail(self, push: _Push, exc: BaseException, close_steps: bool = True) -> None:
        if push.settled:
            return
        if close_steps:  # not from close()'s thread: the loop may still hold the coroutine
            push.steps.close()
        push.error = exc
        self._finish(push)

    def _finish(self, push: _Push) -> None:
        with self._cv:
            if push.settled:
                return
            self._handed_over.discard(push)
            self._last_settled_at = time.monotonic()
            push.settled = True
            if push.waiter is not None:
                push.waiter.set()
        if push.on_done is not None:
            push.on_done()


class _ReadyCalls:
    """The pushes whose next call waits for the device: bucketed by their call's key, with a heap of their due times
    (stale entries dropped as they surface), so the group due first is found without a pass over every waiting call
    (with thousands of streams, passes at every call took a fifth of the scheduling thread). Stale entries, at most
    4 x the waiting pushes + 64, keep their pushes until dropped (emptying them instead was slower: list entries). A
    push's call must not change while it is here."""

    # One count for every instance: a push moves between lanes, and an entry it left in another lane's heap must not
    # match its entry here.
    _seq = itertools.count()

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, int], dict[_Push, None]] = {}  # insertion-ordered sets
        self._heap: list[tuple[float, int, _Push]] = []  # (due_at, ready_seq, push); unique seqs: pushes never compared
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Any:
        return iter([p for bucket in self._by_key.values() for p in bucket])  # a copy: callers may remove meanwhile

    def add(self, push: _Push) -> None:
        self._by_key.setdefault(push.call.key, {})[push] = None  # type: ignore[union-attr]
        self._count += 1
        push.ready_seq = next(self._seq)
        heapq.heappush(self._heap, (push.due_at, push.ready_seq, push))
        if len(self._heap) > 4 * self._count + 64:  # taken pushes' entries, deep in the heap: dropped at once
            self._heap = [(p.due_at, p.ready_seq, p) for bucket in self._by_key.values() for p in bucket]
            heapq.heapify(self._heap)

    def remove(self, push: _Push) -> None:
        key = push.call.key  # type: ignore[union-attr]
        bucket = self._by_key[key]
        del bucket[push]
        if not bucket:
            del self._by_key[key]
        self._count -= 1
        push.ready_seq = -1

    def take(self, pushes: list[_Push]) -> None:
        for p in pushes:
            self.remove(p)

    def clear(self) -> None:
        for bucket in self._by_key.values():
            for p in bucket:
                p.ready_seq = -1
        self._by_key.clear()
        self._heap.clear()
        self._count = 0

    def first_group(self) -> list[_Push]:
        """Every waiting push whose call has the key of the call due first (at least one push must wait)."""
        heap = self._heap
        while heap[0][2].ready_seq != heap[0][1]:  # taken (or taken and back with a new entry) since it was pushed
            heapq.heappop(heap)
        return list(self._by_key[heap[0][2].call.key])  # type: ignore[union-attr]


class _LoopWaker:
    """Settled pushes handed to one asyncio event loop in bulk: the first one of a burst schedules one callback on the
    loop (a wake-up through its self-pipe); the rest of the burst joins it."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[Any] = []

    def resolve(self, future: Any) -> None:
        with self._lock:
            self._pending.append(future)
            first = len(self._pending) == 1
        if first:
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop was closed: nobody awaits these any more
                with self._lock:
                    self._pending.clear()

    def _drain(self) -> None:
        with self._lock:
            futures, self._pending = self._pending, []
        for future in futures:
            if not future.done():
                future.set_result(None)


def _due_at(push: _Push) -> float:
    return push.due_at


def _outcome(push: _Push) -> np.ndarray:
    """A settled push's result, or its error raised."""
    if push.error is not None:
        raise push.error
    assert push.result is not None
    return push.result


def _wait_settled(done: threading.Event) -> None:
    """Wait for a cancelled push to settle (at most one device call away), through further interrupts."""
    while not done.is_set():
        try:
            done.wait(0.05)
        except KeyboardInterrupt:
            pass
