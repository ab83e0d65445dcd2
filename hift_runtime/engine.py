"""The engine interface: what an inference engine declares (:class:`EngineTraits`) and does (:class:`VocoderBackend`),
and how a push's steps reach it (:class:`StepCall`, :func:`drive`). The bookkeeping (``streaming.py``) and the
scheduler (``batching.py``) read an engine only through these."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .arrays import concat_rows
from .errors import PushCancelled


@dataclass(frozen=True)
class EngineTraits:
    """What an engine can do, declared once; every field's default is the plain engine (ONNX Runtime on the CPU).

    ``step_sizes``: the generator's fixed step sizes (containing 1, so any count splits); None: a step of any count.
    ``f0_step_sizes``: the F0 step's own fixed sizes; None: the generator's.
    ``step_window`` / ``final_window``: every stream (final) step of up to this many frames is one call of one graph,
    zero past each row's frames, which follow ``final`` as an input ``[B, 1]`` int64; None: no window.
    ``caches_in_place`` / ``f0_caches_in_place``: the generator's (F0 step's) caches live on the device and a step writes
    them in place, so a step that ran cannot be undone.
    ``noise_positions``: given ``use_noise_table(table)`` once, then each row's first sample index ``[B, 1]`` int64
    instead of the noise rows.
    ``calls_from_any_thread``: its calls may come from any thread (they take the engine's own lock).
    ``inline_lone_calls``: a call is short enough (a graph replay) for a quiet lone push to make its calls in the
    scheduling thread.
    ``launches_ahead``: its calls can be launched (:class:`LaunchingBackend`) in one thread and waited for in another,
    so the device runs one call while the host launches the next.
    ``f0_lane``: its F0 calls run beside its generator calls (a timeline of their own on the device, nothing shared
    with the generator's calls), so the scheduler gives them a lane of their own: a push's F0 call waits for no
    generator call.
    """

    step_sizes: tuple[int, ...] | None = None
    f0_step_sizes: tuple[int, ...] | None = None
    step_window: int | None = None
    final_window: int | None = None
    caches_in_place: bool = False
    f0_caches_in_place: bool = False
    noise_positions: bool = False
    calls_from_any_thread: bool = False
    inline_lone_calls: bool = False
    launches_ahead: bool = False
    f0_lane: bool = False


class VocoderBackend(Protocol):
    """What the bookkeeping needs from an inference engine. Arrays are batch-first NumPy; caches are opaque to the
    bookkeeping (an engine may keep them on its device)."""

    name: str
    traits: EngineTraits

    def new_caches(self, kind: str, batch: int = 1) -> Any:
        """Zero caches (the utterance start) of ``kind`` ``"generator"`` or ``"f0"``."""
        ...

    def f0_step(self, mel: np.ndarray, caches: Any) -> tuple[np.ndarray, Any]:
        """``mel [B, 80, c+3]`` float32 -> ``(f0 [B, c] float32, next caches)``."""
        ...

    def generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                       first: np.ndarray, caches: Any, final: bool) -> tuple[np.ndarray, np.ndarray, Any]:
        """One generator step (``hift_model.step``): ``(audio [B, S], phase_out [B, 9] float64, next caches)``; in a
        window (:class:`EngineTraits`) each row's frames follow ``final``, a row's audio is its first
        ``480 frames`` samples (``480 (frames + 1)`` for a final step)."""
        ...

    def warmup(self, step_sizes: tuple[int, ...] | None, progress: Callable[[str], None] | None = None) -> None:
        """Prepare every step shape a stream can meet (compiles, CUDA graphs); a no-op where nothing is prepared."""
        ...

    def stream_capacity(self) -> int:
        """The most streams the engine's memory holds at once."""
        ...


class LaunchedStep(Protocol):
    """A backend call on the device (:class:`LaunchingBackend`)."""

    def result(self) -> Any:
        """Wait for the call and give what the synchronous step gives (from any thread; the first call waits)."""
        ...


class LaunchingBackend(VocoderBackend, Protocol):
    """A backend whose traits declare ``launches_ahead``: each step also as a launch that returns at once."""

    def launch_f0_step(self, mel: np.ndarray, caches: Any, wait: bool = True) -> LaunchedStep | None:
        """:meth:`VocoderBackend.f0_step` on the device; with ``wait=False``, None instead of waiting where the call
        cannot launch before an earlier one is waited for (its buffers hold that one's inputs or outputs)."""
        ...

    def launch_generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                              first: np.ndarray, caches: Any, final: bool, *frames: np.ndarray,
                              wait: bool = True) -> LaunchedStep | None:
        """:meth:`VocoderBackend.generator_step` on the device, as :meth:`launch_f0_step`."""
        ...


def padded_batch(rows: int, ladder: tuple[int, ...]) -> int:
    """The batch a call of ``rows`` streams runs at: the smallest of the prepared ``ladder`` (ascending) that holds
    them, else ``rows`` itself (an uncaptured shape)."""
    return next((b for b in ladder if b >= rows), rows)


def pad_rows(value: np.ndarray, batch: int) -> np.ndarray:
    """``value`` with zero rows appended up to ``batch`` rows, C-contiguous (a captured graph has a fixed batch)."""
    value = np.ascontiguousarray(value)
    if value.shape[0] == batch:
        return value
    return np.concatenate([value, np.zeros((batch - value.shape[0], *value.shape[1:]), value.dtype)])


def split_steps(count: int, sizes: tuple[int, ...] | None, max_size: int | None = None,
                window: int | None = None) -> list[int]:
    """``count`` frames as steps: greedily the largest allowed sizes (``sizes`` must contain 1, so every count
    splits), or with ``sizes=None`` steps of ``max_size`` and one shorter remainder (one step if ``max_size`` is
    None); with a ``window`` (an engine whose one graph takes any step up to that many frames) steps of the window
    and one shorter remainder."""
    if count <= 0:
        return []
    if window is not None:
        return [window] * (count // window) + ([count % window] if count % window else [])
    if sizes is not None and count in sizes:  # the common push (a 24-frame chunk): one step, as the greedy split
        return [count]
    if sizes is None:
        if max_size is None:
            return [count]
        return [max_size] * (count // max_size) + ([count % max_size] if count % max_size else [])
    out = []
    for size in sorted(sizes, reverse=True):
        while count >= size:
            out.append(size)
            count -= size
    return out


class CancelToken:
    """Lets another thread cancel a push in progress (what ``apush`` does when its task is cancelled). A cancelled
    push stops at its next backend call and leaves its stream unchanged, unless it has already written device caches
    in place: then it runs to its end (a step that ran cannot be undone), and the push counts as done."""

    def __init__(self) -> None:
        self._cancelled = threading.Event()
        self._callbacks: list[Any] = []
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Any) -> None:
        """Call ``callback`` when cancelled (at once if it already is)."""
        with self._lock:
            if not self._cancelled.is_set():
                self._callbacks.append(callback)
                return
        callback()


@dataclass(frozen=True)
class StepCall:
    """One backend call a push needs: ``kind`` ``"f0"`` (args of ``f0_step``) or ``"generator"``/``"final"`` (args
    of ``generator_step`` without ``final``; a step in the engine's window has one more, ``frames``, passed after
    ``final``). Calls of the same :attr:`key` from different streams can run as one batched call (their arrays
    are batch-first with one row each)."""

    kind: str
    args: tuple[Any, ...]
    # True for a step on an engine that writes its caches in place: once it ran, the push cannot be undone.
    writes_caches: bool = False
    # Seconds of audio the push has handed to its listener (on_audio) before this call: its playback can wait that
    # long past the push's arrival. None: a push whose audio goes out whole, at its end.
    audio_ahead_s: float | None = None
    # A call of a push longer than one step of the largest size (the scheduler's f0_lane_calls "long" sends only
    # such pushes' F0 calls to the F0 lane: one-step pushes' F0 calls and steps batch in lockstep without it).
    long_push: bool = False
    # Calls of one key batch together: the kind and the step's mel frames (they fix every input's shape). Computed
    # once: the scheduler compares it over every waiting call each time it forms a group.
    key: tuple[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.kind, self.args[0].shape[2]))

    def run(self, backend: VocoderBackend) -> Any:
        if self.kind == "f0":
            return backend.f0_step(*self.args)
        return backend.generator_step(*self.args[:6], self.kind == "final", *self.args[6:])


def drive(steps: Generator[StepCall, Any, np.ndarray], backend: VocoderBackend,
          cancel: CancelToken | None = None) -> np.ndarray:
    """Run a push's steps (``VocoderStream``'s coroutine) one call at a time on ``backend``. Cancelled (``cancel``)
    before a call that writes caches ran, it stops with :class:`PushCancelled`; after, it runs to its end."""
    result, wrote = None, False
    while True:
        try:
            call = steps.send(result)
        except StopIteration as done:
            return done.value
        if cancel is not None and cancel.cancelled and not wrote:
            steps.close()
            raise PushCancelled("the push was cancelled; the stream is unchanged")
        wrote |= call.writes_caches
        result = call.run(backend)


def stack_caches(rows: list[Any]) -> Any:
    """Host caches (dicts of arrays) stacked row by row; opaque per-stream handles (device slots) as a list."""
    if not isinstance(rows[0], dict):
        return list(rows)
    return {k: concat_rows([r[k] for r in rows]) for k in rows[0]}


def cache_row(caches: Any, i: int) -> Any:
    """Row ``i`` of batched caches (a dict of arrays, or a list of per-stream handles)."""
    if caches is None:
        return None
    if not isinstance(caches, dict):
        return caches[i]
    return {k: v[i:i + 1] for k, v in caches.items()}


@dataclass(frozen=True)
class StackedCalls:
    """Calls of one key with their inputs stacked row by row (:func:`stack_calls`): one batched backend call's
    arguments. ``inputs``: the F0 step's ``(mel, caches)``, or the generator step's ``(mel, f0, noise, phase_in,
    first, caches, final[, frames])``."""

    kind: str
    rows: int
    inputs: tuple[Any, ...]


def stack_calls(calls: list[StepCall]) -> StackedCalls:
    """Calls of one key as one batched call's inputs. The rows are stacked as bytes (:func:`~.arrays.concat_rows`):
    ``np.concatenate`` would hand the GIL away for each, in a busy process (BENCHMARKS.md, decision log)."""
    kind = calls[0].kind
    if kind == "f0":
        return StackedCalls(kind, len(calls), (concat_rows([c.args[0] for c in calls]),
                                               stack_caches([c.args[1] for c in calls])))
    stacked = [concat_rows([c.args[j] for c in calls]) for j in range(5)]
    frames = [concat_rows([c.args[6] for c in calls])] if len(calls[0].args) > 6 else []  # a step in a window
    return StackedCalls(kind, len(calls), (*stacked, stack_caches([c.args[5] for c in calls]), kind == "final",
                                           *frames))


def run_stacked(backend: VocoderBackend, stacked: StackedCalls) -> list[Any]:
    """One batched backend call; each stacked call's result (its row)."""
    if stacked.kind == "f0":
        return split_rows(stacked, backend.f0_step(*stacked.inputs))
    return split_rows(stacked, backend.generator_step(*stacked.inputs))


def launch_stacked(backend: LaunchingBackend, stacked: StackedCalls, wait: bool = True) -> LaunchedStep | None:
    """One batched call launched on a backend that ``launches_ahead`` (its result: :func:`split_rows` of it); None
    where ``wait`` is False and it must wait for an earlier call first."""
    if stacked.kind == "f0":
        return backend.launch_f0_step(*stacked.inputs, wait=wait)
    return backend.launch_generator_step(*stacked.inputs, wait=wait)


def split_rows(stacked: StackedCalls, outputs: tuple[Any, ...]) -> list[Any]:
    """A batched call's outputs (what its step gives) as each stacked call's result (its row)."""
    if stacked.kind == "f0":
        f0, nxt = outputs
        return [(f0[i:i + 1], cache_row(nxt, i)) for i in range(stacked.rows)]
    audio, phase, nxt = outputs
    return [(audio[i:i + 1], phase[i:i + 1], cache_row(nxt, i)) for i in range(stacked.rows)]
