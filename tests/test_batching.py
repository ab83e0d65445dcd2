"""Cross-stream batching, backpressure and isolation (CPU, reduced model; the GPU load test is a benchmark)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest

from hift_runtime import MelError, OverloadError, StreamError, open_vocoder
from hift_runtime.batching import SchedulerClosed

from .conftest import holds_just_its_values, max_abs, run_in_threads
from .test_hardening import FaultyBackend
from .test_streaming import random_mel, stream_all


def run_stream(vocoder, mel, schedule, delay=0.0):
    time.sleep(delay)  # a random start time
    return np.concatenate(stream_all(vocoder, mel, schedule)[0])


@pytest.fixture(scope="module")
def alone(small_artifacts):
    return open_vocoder(small_artifacts.out, device="cpu")


@pytest.mark.parametrize("n", [1, 3, 17])
def test_concurrent_streams_through_the_batcher_equal_each_alone(small_artifacts, alone, n, request):
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=5)
    request.addfinalizer(batched.close)  # its scheduler's threads end with the test
    rng = np.random.default_rng(n)
    mels = [random_mel(int(rng.integers(10, 130)), seed=i) for i in range(n)]
    schedules = [[int(x) for x in rng.integers(0, 30, 10)] + [500] for _ in range(n)]
    delays = rng.random(n) * 0.05  # random start times, so streams sit at different positions and finish interleaved
    expected = [run_stream(alone, m, s) for m, s in zip(mels, schedules)]
    results = run_in_threads(lambda i: run_stream(batched, mels[i], schedules[i], delays[i]), range(n))
    for i in range(n):
        # Measured <= 3.3e-7: batched convolutions round like B = 1 up to float32 noise.
        assert max_abs(results[i], expected[i]) <= 1e-6, i
    stats = batched.scheduler.stats
    assert stats.calls >= n
    if n == 17:
        assert stats.max_batch > 1 and stats.batches < stats.calls  # steps of different streams did share calls
    assert batched.open_streams == 0


def streams_equal_alone(batched, alone, seed: int, n: int) -> None:
    """``n`` streams of random chunks, started at random times on ``batched``, each equal to its run on ``alone``."""
    rng = np.random.default_rng(seed)
    mels = [random_mel(int(rng.integers(40, 90)), seed=10 * seed + i) for i in range(n)]
    schedules = [[int(x) for x in rng.integers(1, 30, 5)] + [500] for _ in range(n)]
    delays = rng.random(n) * 0.02
    expected = [run_stream(alone, m, s) for m, s in zip(mels, schedules)]
    results = run_in_threads(lambda i: run_stream(batched, mels[i], schedules[i], delays[i]), range(n))
    for i in range(n):
        assert max_abs(results[i], expected[i]) <= 1e-6, i  # as above: float32 noise of batched convolutions


def test_calls_queued_behind_the_device_keep_every_stream_exact(small_artifacts, alone):
    """A group ready when a call lands starts behind the next one, on the device thread's queue (no scheduler wake-up
    between them); the streams still equal their solo runs."""
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=2)
    batched.scheduler.backend = slow = FaultyBackend(batched.scheduler.backend)
    slow.delay = 0.004  # a device call long enough for groups to form behind it
    batched.scheduler.queue_behind = 1  # any group (the default: a quarter of max_batch)
    streams_equal_alone(batched, alone, seed=5, n=6)
    assert batched.scheduler.stats.queued > 0
    assert batched.open_streams == 0
    batched.close()


class _LaunchingStandIn:
    """A backend that ``launches_ahead``, over a real one: each launch runs the inner call on a stand-in device (one
    thread, ``delay`` s a call, in launch order) and returns at once; a call's buffers are its kind's (the compiled
    engine's are its shape's), so a launch with ``wait=False`` while its kind's last call is not done is refused
    (None), as the compiled engine's are. ``f0_lane``: the F0 calls on a stand-in timeline of their own, beside the
    generator's; ``overlaps`` counts the calls that started while a call of the other lane ran."""

    def __init__(self, inner, delay: float, f0_lane: bool = False) -> None:
        import concurrent.futures

        self.inner, self.name, self.delay = inner, "launching", delay
        self.traits = dataclasses.replace(inner.traits, launches_ahead=True, f0_lane=f0_lane)
        self._device = concurrent.futures.ThreadPoolExecutor(1)
        self._f0_device = concurrent.futures.ThreadPoolExecutor(1) if f0_lane else self._device
        self._pending: dict[str, Any] = {}
        self.launch_threads: set[str] = set()
        self.refused = 0
        self._running: dict[str, int] = {"f0": 0, "steps": 0}
        self._inner_lock = threading.Lock()  # the inner (CPU) engine's calls one at a time; the delays overlap
        self.overlaps = 0

    def new_caches(self, kind, batch=1):
        return self.inner.new_caches(kind, batch)

    def _launch(self, key, call, wait):
        pending = self._pending.get(key)
        if pending is not None and not pending.done():
            if not wait:
                self.refused += 1
                return None
            pending.result()
        self.launch_threads.add(threading.current_thread().name)

        lane = "f0" if key == "f0" else "steps"

        def on_device():
            with self._inner_lock:
                self._running[lane] += 1
                self.overlaps += self._running["steps" if lane == "f0" else "f0"] > 0
            time.sleep(self.delay)
            try:
                with self._inner_lock:
                    return call()
            finally:
                with self._inner_lock:
                    self._running[lane] -= 1

        device = self._f0_device if lane == "f0" else self._device
        self._pending[key] = future = device.submit(on_device)
        return future  # a Future's result() is a LaunchedStep's

    def launch_f0_step(self, mel, caches, wait=True):
        return self._launch("f0", lambda: self.inner.f0_step(mel, caches), wait)

    def launch_generator_step(self, mel, f0, noise, phase_in, first, caches, final, *frames, wait=True):
        return self._launch("final" if final else "generator", lambda: self.inner.generator_step(
            mel, f0, noise, phase_in, first, caches, final, *frames), wait)

    def f0_step(self, mel, caches):
        return self.launch_f0_step(mel, caches).result()

    def generator_step(self, *args):
        return self.launch_generator_step(*args).result()


def test_calls_launched_ahead_by_the_scheduler_keep_every_stream_exact(small_artifacts, alone):
    """Over an engine that launches ahead, the scheduler launches each call itself, the ones behind a call still on
    the device included, and the device thread only waits for them; a launch its engine refuses (its buffers still
    an earlier call's) is made by the device thread once that call is done. The streams equal their solo runs."""
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=2)
    scheduler = batched.scheduler
    scheduler.backend = device = _LaunchingStandIn(scheduler.backend, delay=0.004)
    scheduler.launches_ahead, scheduler.queue_behind = True, 1
    try:
        streams_equal_alone(batched, alone, seed=8, n=8)
    finally:
        batched.close()
    assert scheduler.stats.launched_ahead > 0 and device.refused > 0
    assert {"hift-scheduler", "hift-batch-call_0"} <= device.launch_threads
    assert batched.open_streams == 0


def test_f0_calls_in_a_lane_of_their_own_run_beside_the_generators_and_keep_every_stream_exact(small_artifacts,
                                                                                                 alone):
    """Over an engine whose F0 calls run beside its generator calls (``f0_lane``), the scheduler keeps them in a lane
    of their own: an F0 group goes to the device while a generator group is on it. The streams equal their solo
    runs."""
    from hift_runtime.batching import PushScheduler

    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=2)
    batched.scheduler.close()
    device = _LaunchingStandIn(batched.backend, delay=0.004, f0_lane=True)
    batched.scheduler = scheduler = PushScheduler(device, max_batch=256, max_wait_s=0.002,
                                                  pushes_in_progress=lambda: batched.pushes_in_progress)
    try:
        streams_equal_alone(batched, alone, seed=9, n=8)
    finally:
        batched.close()
    assert device.overlaps > 0
    assert scheduler.stats.by_kind["f0"][0] > 0 and scheduler.stats.by_kind["generator"][0] > 0
    assert batched.open_streams == 0


@pytest.mark.parametrize("calls", ["long", "none"])
def test_f0_lane_calls_long_or_none_keep_the_other_f0_calls_in_the_main_lane(alone, calls):
    """``f0_lane_calls`` (a measurement's switch), over an engine with an F0 lane and fixed step sizes: "long" sends
    the F0 calls of a push longer than one step of the largest size to the F0 lane and keeps a one-step push's in the
    main lane, between the generator's calls; "none" keeps every call in the main lane. The streams equal their solo
    runs either way."""
    from hift_runtime.batching import PushScheduler
    from hift_runtime.streaming import StreamingVocoder

    device = _LaunchingStandIn(alone.backend, delay=0.003, f0_lane=True)
    sizes = (24, 8, 4, 1)
    reference = StreamingVocoder(alone.backend, alone.constants, step_sizes=sizes)
    mels = [random_mel(200, seed=70 + i) for i in range(4)]
    for chunk, in_f0_lane in ((24, False), (100, calls == "long")):
        vocoder = StreamingVocoder(device, alone.constants, step_sizes=sizes)
        vocoder.scheduler = scheduler = PushScheduler(device, max_batch=256, max_wait_s=0.002,
                                                      pushes_in_progress=lambda: vocoder.pushes_in_progress)
        assert scheduler.f0_lane_calls == "all" and scheduler.lanes == 2
        scheduler.f0_lane_calls = calls
        try:
            results = run_in_threads(lambda i: run_stream(vocoder, mels[i], [chunk] * 10), range(len(mels)))
        finally:
            scheduler.close()
        for mel, result in zip(mels, results):
            assert max_abs(result, run_stream(reference, mel, [chunk] * 10)) <= 1e-6  # batched float32 noise
        stats = scheduler.stats
        assert stats.by_kind["f0"][0] > 0
        # The main lane's time is every call's, unless some F0 call ran in the F0 lane.
        assert (stats.main_lane_busy_s < stats.busy_s) == in_f0_lane, chunk
        assert vocoder.open_streams == 0


def test_an_idle_generator_lane_holds_a_small_group_while_an_f0_call_is_on_the_device():
    """The generator lane's hold: with every push handed over, a generator group of fewer than
    ``generator_hold_below`` streams waits while an F0 call is on the device, at most ``generator_hold_s`` after its
    oldest call was ready; a full enough group, an F0 group, or a generator group with no F0 call on the device starts
    at once."""
    from types import SimpleNamespace

    from hift_runtime.batching import PushScheduler
    from hift_runtime.engine import EngineTraits

    scheduler = PushScheduler(SimpleNamespace(traits=EngineTraits(f0_lane=True)), max_wait_s=0.003)
    try:
        generator_lane, f0_lane = scheduler._lanes
        now = time.monotonic()
        small = [SimpleNamespace(call_ready_at=now)] * (scheduler.generator_hold_below - 1)
        full_enough = [SimpleNamespace(call_ready_at=now)] * scheduler.generator_hold_below
        assert scheduler._partner_wait(small, generator_lane) <= 0  # no F0 call on the device: nothing to wait for
        f0_lane.flights.append(object())
        assert 0 < scheduler._partner_wait(small, generator_lane) <= scheduler.generator_hold_s
        assert scheduler._partner_wait(full_enough, generator_lane) <= 0
        assert scheduler._partner_wait(small, f0_lane) <= 0
        waited = [SimpleNamespace(call_ready_at=now - scheduler.generator_hold_s)]
        assert scheduler._partner_wait(waited, generator_lane) <= 0  # bounded: the hold is over
        f0_lane.flights.clear()
    finally:
        scheduler.close()


def test_an_event_loop_drives_both_lanes_and_keeps_every_stream_exact(small_artifacts, alone):
    """attach_loop() over an engine with an F0 lane: the loop's thread lands each lane's calls and starts the next
    ones; asyncio streams equal their solo runs."""
    from hift_runtime.batching import PushScheduler

    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=2)
    batched.scheduler.close()
    device = _LaunchingStandIn(batched.backend, delay=0.003, f0_lane=True)
    batched.scheduler = scheduler = PushScheduler(device, max_batch=256, max_wait_s=0.002,
                                                  pushes_in_progress=lambda: batched.pushes_in_progress)
    assert scheduler.lanes == 2
    mels = [random_mel(60, seed=90 + i) for i in range(8)]
    expected = [run_stream(alone, m, [20] * 3) for m in mels]

    async def one(i, mel):
        await asyncio.sleep(0.004 * i)  # staggered: one stream's F0 call meets another's generator call
        stream = batched.stream()
        pieces = [await stream.apush(mel[:, k:k + 20]) for k in range(0, 60, 20)]
        pieces.append(await stream.afinish())
        return np.concatenate(pieces)

    async def main():
        scheduler.attach_loop(asyncio.get_running_loop())
        try:
            return await asyncio.gather(*(one(i, m) for i, m in enumerate(mels)))
        finally:
            scheduler.detach_loop()

    try:
        got = asyncio.run(main())
    finally:
        batched.close()
    for g, w in zip(got, expected):
        assert max_abs(g, w) <= 1e-6  # as above: float32 noise of batched convolutions
    assert device.overlaps > 0 and batched.open_streams == 0


def test_a_bad_chunk_is_refused_for_its_stream_only(small_artifacts, alone, request):
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=20)
    request.addfinalizer(batched.close)
    mels = [random_mel(90, seed=40 + i) for i in range(4)]
    expected = [run_stream(alone, m, [30] * 3) for m in mels]
    results, refused = {}, []
    barrier = threading.Barrier(4)

    def worker(i):
        stream = batched.stream()
        out = []
        for k in range(3):
            barrier.wait()
            if i == 2 and k == 1:
                try:
                    stream.push(np.full((80, 30), np.nan, np.float32))
                except MelError as exc:
                    refused.append(str(exc))
            out.append(stream.push(mels[i][:, 30 * k:30 * (k + 1)]))
        out.append(stream.finish())
        results[i] = np.concatenate(out)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(refused) == 1 and "non-finite" in refused[0]
    for i in range(4):
        assert max_abs(results[i], expected[i]) <= 1e-6, i


def test_a_lone_stream_does_not_wait_for_partners(small_artifacts):
    mel = random_mel(100, 3)
    with open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=500) as batched:
        t0 = time.perf_counter()
        run_stream(batched, mel, [25] * 4)
    # 5 calls; had any waited for the 500 ms budget, this would take >= 2.5 s.
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(SchedulerClosed):  # the with block closed the vocoder
        batched.stream().push(mel[:, :25])


def test_stream_limit_refuses_then_frees(small_artifacts):
    v = open_vocoder(small_artifacts.out, device="cpu", max_streams=2)
    a, b = v.stream(), v.stream()
    with pytest.raises(OverloadError, match="2 streams are open, the limit"):
        v.stream()
    a.push(random_mel(10))
    a.finish()
    c = v.stream()  # a finished stream frees its slot
    del b, c  # dropped streams free theirs too
    v.stream()


def test_idle_streams_expire_and_free_their_slot(small_artifacts):
    v = open_vocoder(small_artifacts.out, device="cpu", max_streams=1, idle_timeout_s=0.05)
    abandoned = v.stream()
    abandoned.push(random_mel(20))
    time.sleep(0.1)
    fresh = v.stream()  # expires the abandoned one instead of refusing
    assert v.open_streams == 1
    with pytest.raises(StreamError, match="expired after 0.05 s idle"):
        abandoned.push(random_mel(5))
    assert np.concatenate([fresh.push(random_mel(10)), fresh.finish()]).shape == (480 * 10,)


def test_asyncio_streams_batch_and_equal_alone(small_artifacts, alone):
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=5)
    mels = [random_mel(60, seed=60 + i) for i in range(12)]
    expected = [run_stream(alone, m, [20] * 3) for m in mels]
    threads = []

    async def one(mel):
        stream = batched.stream()
        pieces = []
        for k in range(0, 60, 20):
            pieces.append(await stream.apush(mel[:, k:k + 20]))
            threads.append(threading.active_count())
        pieces.append(await stream.afinish())
        return np.concatenate(pieces)

    async def main():
        return await asyncio.gather(*(one(m) for m in mels))

    before = threading.active_count()
    for got, want in zip(asyncio.run(main()), expected):
        assert max_abs(got, want) <= 1e-6
    assert max(threads) <= before + 1  # + the call thread (started at the first call): no thread per push
    assert batched.scheduler.stats.max_batch > 1
    batched.close()


def test_a_scheduler_driven_by_the_event_loop_keeps_every_stream_exact(small_artifacts, alone):
    """attach_loop(): the loop's thread schedules (no scheduler thread). Asyncio streams batch and equal their solo
    runs, a push from another thread is handed to the loop, a cancelled apush leaves its stream usable, a blocking
    push() in the loop itself is refused, and detach_loop() gives the scheduling back to a thread."""
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=5)
    scheduler = batched.scheduler
    mels = [random_mel(60, seed=70 + i) for i in range(10)]
    expected = [run_stream(alone, m, [20] * 3) for m in mels]

    async def one(mel):
        stream = batched.stream()
        pieces = [await stream.apush(mel[:, k:k + 20]) for k in range(0, 60, 20)]
        pieces.append(await stream.afinish())
        return np.concatenate(pieces)

    async def main():
        loop = asyncio.get_running_loop()
        scheduler.attach_loop(loop)
        assert not scheduler._thread.is_alive()
        try:
            from_thread = loop.run_in_executor(None, run_stream, batched, mels[-1], [20] * 3)
            got = await asyncio.gather(*(one(m) for m in mels[:-1]), from_thread)
            # A cancelled push: the stream is unchanged or the push completed, and the stream goes on.
            stream = batched.stream()
            task = asyncio.ensure_future(stream.apush(mels[0][:, :20]))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            with pytest.raises(RuntimeError, match="would block it"):
                batched.stream().push(mels[0][:, :20])
            stream.close()
            return got
        finally:
            scheduler.detach_loop()

    for got, want in zip(asyncio.run(main()), expected):
        assert max_abs(got, want) <= 1e-6  # as above: float32 noise of batched convolutions
    assert scheduler.stats.max_batch > 1
    assert scheduler._thread.is_alive()  # detached: a thread schedules again
    assert max_abs(run_stream(batched, mels[0], [20] * 3), expected[0]) <= 1e-6
    batched.close()


def test_closing_a_loop_driven_scheduler_fails_its_waiting_pushes(small_artifacts):
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=5)
    batched.scheduler.backend = slow = FaultyBackend(batched.scheduler.backend)
    slow.delay = 0.05

    async def main():
        batched.scheduler.attach_loop(asyncio.get_running_loop())
        streams = [batched.stream() for _ in range(4)]
        tasks = [asyncio.ensure_future(s.apush(random_mel(30, seed=90 + i))) for i, s in enumerate(streams)]
        await asyncio.sleep(0.01)
        batched.close()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert all(isinstance(o, SchedulerClosed) or isinstance(o, np.ndarray) for o in outcomes), outcomes
    assert any(isinstance(o, SchedulerClosed) for o in outcomes)


def test_a_vocoder_outlives_the_event_loop_that_drove_its_scheduler(small_artifacts, alone):
    """asyncio.run() over, its loop closed without detach_loop(): close() still closes (it raised "Event loop is
    closed" from the loop's own thread), and before that a push from a thread, and apush from another loop, are
    scheduled by a thread again."""
    mel = random_mel(60, seed=95)
    for push_after in (False, True):
        batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=5)

        async def main():
            batched.scheduler.attach_loop(asyncio.get_running_loop())
            stream = batched.stream()
            return np.concatenate([await stream.apush(mel[:, :30]), await stream.afinish(mel[:, 30:])])

        assert max_abs(asyncio.run(main()), run_stream(alone, mel, [30, 30])) <= 1e-6
        if push_after:
            assert max_abs(run_stream(batched, mel, [30, 30]), run_stream(alone, mel, [30, 30])) <= 1e-6

            async def later():  # another loop, not attached: a scheduler thread serves it
                stream = batched.stream()
                return np.concatenate([await stream.apush(mel[:, :30]), await stream.afinish(mel[:, 30:])])

            assert max_abs(asyncio.run(later()), run_stream(alone, mel, [30, 30])) <= 1e-6
        batched.close()
        with pytest.raises(SchedulerClosed):
            run_stream(batched, mel, [30, 30])


def test_an_overlapping_async_call_on_one_stream_is_refused(small_artifacts, alone):
    batched = open_vocoder(small_artifacts.out, device="cpu", batching=True, max_wait_ms=5)
    mel = random_mel(60, seed=70)

    async def main():
        stream = batched.stream()
        first = asyncio.ensure_future(stream.apush(mel[:, :30]))
        await asyncio.sleep(0)  # the first call holds the stream
        with pytest.raises(StreamError, match="another call on this stream is in progress"):
            await stream.apush(mel[:, :30])
        return np.concatenate([await first, await stream.afinish(mel[:, 30:])])

    assert max_abs(asyncio.run(main()), alone.vocode(mel)) <= 1e-6
    batched.close()


class _FailingOnce:
    """A backend that fails its next generator call once asked to (a device error in the middle of a batch)."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.fail_next, self.barrier = inner, "failing-once", False, None
        self.traits = inner.traits

    def new_caches(self, kind, batch=1):
        return self.inner.new_caches(kind, batch)

    def f0_step(self, mel, caches):
        return self.inner.f0_step(mel, caches)

    def generator_step(self, *args):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost (test)")
        return self.inner.generator_step(*args)


def test_a_failed_batched_call_fails_its_pushes_and_leaves_their_streams_unchanged(small_artifacts, alone):
    """An error inside a batched call is raised in every push of that call; their streams' state is unchanged, so
    the same chunk pushed again continues exactly, and the scheduler goes on serving."""
    from hift_runtime.batching import PushScheduler
    from hift_runtime.streaming import StreamingVocoder

    backend = _FailingOnce(alone.backend)
    vocoder = StreamingVocoder(backend, alone.constants)
    vocoder.scheduler = PushScheduler(backend, max_batch=8, max_wait_s=0.2,
                                      pushes_in_progress=lambda: vocoder.pushes_in_progress)
    mels = [random_mel(60, seed=70 + i) for i in range(3)]
    streams = [vocoder.stream() for _ in mels]
    heads = [s.push(m[:, :20]) for s, m in zip(streams, mels)]
    backend.fail_next = True
    _second_chunks_fail_some_and_change_nothing(alone, streams, mels, heads, "device lost")
    vocoder.close()


def test_a_group_whose_inputs_cannot_be_stacked_fails_its_pushes_alone(small_artifacts, alone, monkeypatch):
    """A group's inputs are stacked in the scheduling thread, off the device thread: an error there fails that
    group's pushes as an error inside the call would, their streams unchanged, and the scheduler goes on serving."""
    import hift_runtime.batching as batching
    from hift_runtime.streaming import StreamingVocoder

    stack_calls, armed = batching.stack_calls, [False]

    def stack_or_fail(calls):
        if armed[0] and calls[0].kind == "generator":
            armed[0] = False
            raise RuntimeError("rows do not fit (test)")
        return stack_calls(calls)

    monkeypatch.setattr(batching, "stack_calls", stack_or_fail)
    vocoder = StreamingVocoder(alone.backend, alone.constants)
    vocoder.scheduler = batching.PushScheduler(alone.backend, max_batch=8, max_wait_s=0.2,
                                               pushes_in_progress=lambda: vocoder.pushes_in_progress)
    mels = [random_mel(60, seed=80 + i) for i in range(3)]
    streams = [vocoder.stream() for _ in mels]
    heads = [s.push(m[:, :20]) for s, m in zip(streams, mels)]
    armed[0] = True
    _second_chunks_fail_some_and_change_nothing(alone, streams, mels, heads, "rows do not fit")
    vocoder.close()


def _second_chunks_fail_some_and_change_nothing(alone, streams, mels, heads, message):
    """Each stream's frames 20-40 pushed at once from threads: some pushes fail with ``message``; a failed push
    changed nothing (pushed again, every stream continues exactly as alone)."""
    seconds = run_in_threads(lambda i: _push_or_error(streams[i], mels[i][:, 20:40]), range(len(streams)))
    failed = [i for i, r in enumerate(seconds) if isinstance(r, RuntimeError)]
    assert failed and all(message in str(seconds[i]) for i in failed)
    for i, s in enumerate(streams):
        second = s.push(mels[i][:, 20:40]) if i in failed else seconds[i]
        out = np.concatenate([heads[i], second, s.push(mels[i][:, 40:]), s.finish()])
        assert max_abs(out, run_stream(alone, mels[i], [20, 20, 20])) <= 1e-6, i


def _push_or_error(stream, chunk):
    try:
        return stream.push(chunk)
    except RuntimeError as exc:
        return exc


def test_rows_joined_as_bytes_equal_numpy_and_are_new_arrays():
    """The host path's copies under the GIL (arrays.py) give what np.concatenate gives, as arrays of their own; what
    they cannot copy that way (mixed dtypes, non-contiguous rows, mismatched shapes) goes to NumPy, which also
    raises for a shape that does not fit."""
    from hift_runtime.arrays import concat_rows, contiguous_copy, copy_rows

    rng = np.random.default_rng(0)
    rows = [rng.random((n, 3, 4), dtype=np.float32) for n in (1, 2, 0, 5)]
    for pieces in (rows, rows[:1], [np.arange(7.0)[2:], np.zeros(0)], [rows[0], rows[1].astype(np.float64)],
                   [rows[1][:, :, ::2], rows[3][:, :, :2]]):
        joined = concat_rows(pieces)
        assert joined.dtype == np.concatenate(pieces).dtype and np.array_equal(joined, np.concatenate(pieces))
        assert holds_just_its_values(joined) and joined.flags.writeable
        assert all(not np.shares_memory(joined, p) for p in pieces)
    with pytest.raises(ValueError):
        concat_rows([rows[0], rng.random((1, 3, 5), dtype=np.float32)])
    table = rng.random((8, 6))
    part = copy_rows(table, 3)
    assert np.array_equal(part, table[:3]) and holds_just_its_values(part)
    assert np.array_equal(copy_rows(table[0], 4), table[0, :4])
    for view in (table[None, :, 1:4], table[2, 1:], table[::-1, ::2], table[:0]):  # a step's window, a piece
        copied = contiguous_copy(view)
        assert np.array_equal(copied, view) and copied.flags.c_contiguous and copied.flags.writeable
        assert copied.dtype == view.dtype and holds_just_its_values(copied) and not np.shares_memory(copied, table)


def test_audio_goes_out_as_each_step_is_done(small_artifacts, alone):
    """``on_audio`` gets each step's audio during the push (a 100-frame chunk on the CPU: steps of at most 24 frames),
    the pieces join to the push's release, in process with and without the batching scheduler and from asyncio
    (``apieces``); the stream is exact."""
    import asyncio

    mel = random_mel(230, seed=33)
    want = alone.vocode(mel)
    for vocoder in (alone, open_vocoder(small_artifacts.out, device="cpu", batching=True)):
        stream, got = vocoder.stream(), []
        for part, final in ((mel[:, :50], False), (mel[:, 50:150], False), (mel[:, 150:], True)):
            pieces: list = []
            release = (stream.finish if final else stream.push)(part, on_audio=pieces.append)
            assert len(pieces) >= (2 if part.shape[1] > 24 else 1) and all(p.size for p in pieces)
            assert np.array_equal(np.concatenate(pieces), release)
            got.append(release)
        assert max_abs(np.concatenate(got), want) <= 1e-6

        async def pieces_of() -> list:
            stream, out = vocoder.stream(), []
            for part, final in ((mel[:, :100], False), (mel[:, 100:], True)):
                async for piece in stream.apieces(part, final=final):
                    out.append(piece)
            return out

        pieces = asyncio.run(pieces_of())
        assert len(pieces) > 4 and max_abs(np.concatenate(pieces), want) <= 1e-6
        if vocoder is not alone:
            vocoder.close()


def test_a_push_that_fails_after_its_audio_went_out_loses_its_stream(alone):
    """Audio handed out cannot be taken back: a push failing after a piece went out (a device error, or the
    callback's own error) loses its stream, where one failing before any did leaves it unchanged; the callback's error
    does not mark the vocoder failed."""
    from hift_runtime.streaming import StreamingVocoder

    backend = _FailingOnce(alone.backend)
    vocoder = StreamingVocoder(backend, alone.constants)
    mel = random_mel(120, seed=34)
    stream = vocoder.stream()
    stream.push(mel[:, :30])
    pieces: list = []

    def fail_after_the_first(piece):
        pieces.append(piece)
        backend.fail_next = True  # the push's next generator step fails

    with pytest.raises(RuntimeError, match="device lost"):
        stream.push(mel[:, 30:90], on_audio=fail_after_the_first)
    assert pieces and stream.lost
    with pytest.raises(StreamError, match="lost"):
        stream.push(mel[:, 90:])
    vocoder.failure = None
    other = vocoder.stream()

    def broken(piece):
        raise ValueError("player gone")

    with pytest.raises(StreamError, match="on_audio callback raised ValueError: player gone"):
        other.push(mel[:, :60], on_audio=broken)
    assert other.lost and vocoder.failure is None


def test_a_long_chunks_f0_calls_are_made_as_its_steps_need_them(alone):
    """A 100-frame push's first audio waits for the F0 its first step reads, not for the chunk's whole F0: its F0
    calls come between its generator steps (the same calls, so the same audio)."""
    from hift_runtime.streaming import StreamingVocoder

    calls: list[str] = []

    class Recording(_FailingOnce):
        def f0_step(self, mel, caches):
            calls.append("f0")
            return super().f0_step(mel, caches)

        def generator_step(self, *args):
            calls.append("generator")
            return super().generator_step(*args)

    vocoder = StreamingVocoder(Recording(alone.backend), alone.constants)
    mel = random_mel(130, seed=35)
    stream = vocoder.stream()
    out = [stream.push(mel[:, :30])]
    calls.clear()
    out.append(stream.push(mel[:, 30:130]))
    assert calls[:2] == ["f0", "generator"] and calls.count("f0") > 1
    assert calls.index("generator") < len(calls) - calls[::-1].index("f0") - 1  # an F0 call after a step
    out.append(stream.finish())
    assert max_abs(np.concatenate(out), alone.vocode(mel)) <= 1e-6


def test_a_push_with_a_listener_tells_the_scheduler_how_much_audio_it_handed_out(alone, monkeypatch):
    """Each call of a push with ``on_audio`` carries the seconds of audio the push handed out before it (what its
    listener can play while the call waits); a push without a listener carries None (its audio goes out at its end)."""
    from hift_runtime.engine import StepCall

    seen: list = []
    run = StepCall.run
    monkeypatch.setattr(StepCall, "run", lambda self, backend: (seen.append(self.audio_ahead_s), run(self, backend))[1])
    mel = random_mel(130, seed=36)
    stream = alone.stream()
    stream.push(mel[:, :30])
    assert seen and all(a is None for a in seen)
    seen.clear()
    pieces: list = []
    stream.push(mel[:, 30:130], on_audio=pieces.append)
    handed = np.cumsum([0] + [p.shape[0] for p in pieces]) / alone.constants.sample_rate
    assert seen[0] == 0.0 and len(pieces) > 2
    assert set(seen) <= set(handed.tolist()) and seen == sorted(seen) and seen[-1] > 0


def test_calls_of_pushes_whose_listeners_have_audio_wait_for_those_that_have_none():
    """The scheduler runs the call due first: a push's arrival plus the audio it has handed to its listener, or for a
    push without a listener, when its call became ready. A push 0.5 s of audio ahead waits for a fresh push that
    arrived after it and for a whole push."""
    from hift_runtime.batching import PushScheduler
    from hift_runtime.engine import EngineTraits, StepCall

    class Gated:
        name, traits = "gated", EngineTraits()

        def __init__(self) -> None:
            self.entered, self.gate, self.order = threading.Event(), threading.Event(), []

        def f0_step(self, mel, caches):
            self.order.append(mel.shape[2])
            self.entered.set()
            self.gate.wait(10)
            return np.zeros((mel.shape[0], 1), np.float32), caches

    def one_call(frames, ahead):
        yield StepCall("f0", (np.zeros((1, 2, frames), np.float32), None), audio_ahead_s=ahead)
        return np.zeros(1, np.float32)

    backend = Gated()
    scheduler = PushScheduler(backend, max_batch=256)  # nothing queues behind the gated call (queue_behind 64)
    threads = [threading.Thread(target=scheduler.run, args=(one_call(10, None),))]
    threads[0].start()
    assert backend.entered.wait(10)
    for frames, ahead in ((11, 0.5), (12, 0.0), (13, None)):  # arriving in this order, 20 ms apart
        threads.append(threading.Thread(target=scheduler.run, args=(one_call(frames, ahead),)))
        threads[-1].start()
        time.sleep(0.02)
    backend.gate.set()
    for t in threads:
        t.join(10)
    scheduler.close()
    assert backend.order == [10, 12, 13, 11]
