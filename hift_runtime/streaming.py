"""Streaming the CosyVoice3 vocoder through its stateful step graphs, written once and driven by any
:class:`VocoderBackend` (ONNX Runtime, or eager PyTorch in ``hift_torch.eager``).

Each layer's left context is a cache carried from step to step, so a push computes only the new frames and the output
equals one offline ``finalize=True`` pass (see ``hift_model/step.py`` for the step's contract). Frame bookkeeping
(absolute mel frames; ``spf`` = 480 samples per frame; every constant read from the manifest):

* **F0 step.** F0 of frame ``t`` reads mel ``t-8 .. t+3``. With ``n`` frames received, F0 is known for frames
  ``< n-3``; a push runs the F0 step on the mel of the newly computable frames plus their 3 look-ahead frames (as
  steps of ``step_sizes``, like the generator). Each frame's F0 is computed once; on finish the look-ahead is 3 zero
  frames (upstream's ``finalize=True``).
* **Generator steps.** A step over frames ``[a, a+c)`` reads mel up to ``a+c+4`` (``conv_pre``'s look-ahead) and the
  source of frame ``a+c``, so with ``n`` frames received the generator advances to ``n-4`` and the audio, which lags
  one frame, is final up to frame ``n-5``: 100 ms held back (upstream's scheme holds back 160 ms; the audio is the
  same). A push becomes steps of the sizes in ``step_sizes`` (fixed shapes for CUDA graphs), or steps of at most
  ``max_step_frames`` (a step's memory grows with its length, so a long chunk never becomes one huge step).
* **Phase.** The source's running phase sum is float64 and carried between steps. ``phase="upstream"`` (default)
  carries it unwrapped, so every step adds in exactly the order of one pass from frame 0 (upstream's rounding).
  ``phase="wrapped"`` drops whole turns (exact in real arithmetic: ``sin(2*pi*480*x)`` has period 1/480), which keeps
  the float32 rounding at small magnitudes: more accurate than upstream on long streams, not bit-faithful to it.
* **Noise.** Rows of the :class:`~hift_runtime.noise.NoiseTable` by absolute sample (or, for a backend that holds
  the table on its device, the first row's index).
* **Finish.** The final step covers the remaining frames with zero look-ahead and emits everything held back. On a
  backend with a final *window* (its traits' ``final_window``: the compiled engine on CUDA) it is one call for up to
  that many frames, so a stream's last push is two calls (F0, final) instead of up to five.

Totals: exactly ``480 * frames`` samples. A stream's state is bounded: the caches (fixed size), at most
``4 + pending`` mel frames and F0 values, the phase.

A push is all or nothing: the bookkeeping computes into locals and commits once every call has succeeded, so a failed
or cancelled push leaves its stream as it was. One exception: a backend that keeps the caches on its device and
writes them in place (``caches_in_place`` for the generator's, ``f0_caches_in_place`` for the F0 step's) cannot undo
a step that ran; a push that fails after such a step marks its stream *lost* (its next call raises
:class:`StreamError`), and a cancelled one runs to its end instead of stopping.

**Audio as it is made.** ``push(mel, on_audio=callback)`` (likewise ``finish``, ``apush``, ``afinish``) also hands each
step's audio to ``callback`` as soon as that step is done, so playback can start on a chunk's first step; the call
still returns the whole release (the pieces joined). ``async for piece in stream.apieces(mel)`` is the same for
asyncio code. Audio that went out cannot be taken back: a push that fails (or is cancelled) after its first piece
went out loses its stream.

Thread safety: a :class:`StreamingVocoder` (and its backend's sessions) may serve many streams from many threads;
calls on one :class:`VocoderStream` are serialised by its lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import concat_rows, contiguous_copy
from .contract import StreamConstants
from .engine import CancelToken, StepCall, VocoderBackend, drive, split_steps
from .errors import OverloadError, PushCancelled, SchedulerClosed, StreamError
from .mel_input import LOG_MEL_RANGE, validate_mel, validate_mel_range
from .noise import NoiseTable

PHASE_MODES = ("upstream", "wrapped")
# Without fixed step sizes (the CPU), a push's steps are at most this long: a step's activations grow with its length,
# and a neighbour's call waits for at most one step; 24 frames (a real-time chunk's) cost no more per frame than 64
# and let a long push's steps batch with real-time ones (BENCHMARKS.md, "a long push beside a real-time stream").
MAX_STEP_FRAMES = 24


def _padded(frames: np.ndarray, length: int) -> np.ndarray:
    """``frames`` (time last) zero-padded to ``length`` along time, C-contiguous."""
    out = np.zeros((*frames.shape[:-1], length), np.float32)
    out[..., :frames.shape[-1]] = frames
    return out


@dataclass
class StreamStats:
    """Counters a test or a monitor can read."""

    frames_in: int = 0
    samples_out: int = 0
    f0_frames: int = 0  # F0 values computed: each frame exactly once
    f0_calls: int = 0
    generator_calls: int = 0
    generator_frames: int = 0  # frames the generator computed: each exactly once
    max_mel_cache: int = 0
    max_step_frames: int = 0


class StreamingVocoder:
    """Shared part: backend, constants, noise table, step policy. Creates :class:`VocoderStream` objects and
    offline passes."""

    def __init__(self, backend: VocoderBackend, constants: StreamConstants, noise: NoiseTable | None = None,
                 noise_seed: int = 0, phase: str = "upstream", step_sizes: tuple[int, ...] | None = None,
                 max_streams: int | None = None, idle_timeout_s: float | None = None,
                 max_step_frames: int = MAX_STEP_FRAMES) -> None:
        step_sizes = _checked_options(phase, step_sizes, max_streams, idle_timeout_s, max_step_frames)
        self.phase_mode = phase
        self.step_sizes = step_sizes
        # The F0 steps' sizes: the backend's own where it prepares F0 shapes apart (the compiled engine captures its
        # cheap F0 step at every size up to one step's F0, 26 frames, so a push's F0 is one call, not up to four:
        # each call of a push waits for a device turn under load), else the generator's.
        traits = backend.traits
        f0_sizes = traits.f0_step_sizes
        self.f0_step_sizes = step_sizes if step_sizes is None or f0_sizes is None else tuple(sorted(f0_sizes,
                                                                                                 reverse=True))
        self.max_step_frames = max_step_frames
        # A backend whose final step takes any count of frames up to this many as one call (a fixed window, each
        # row's end an input): a stream's last push is then its F0 call and one final call, where the generator's
        # sizes would make up to five calls in turn (F0, 8 + 1 + 1 frames, the final step), each waiting for a device
        # turn under load. Longer remainders go first as steps of the largest size, so the window must exceed it by
        # the mel look-ahead (those steps need it).
        self.final_window = traits.final_window
        # Likewise for the stream step (fp32's default on the GPU: a faster start; in fp16 more device time per row,
        # BENCHMARKS.md): every generator step of up to this many frames is one call of one graph, so a push is its
        # F0 call and one generator call per this many frames.
        self.step_window = traits.step_window
        # The size of the steps that reach a final window's start (None: sizes unbounded, any count is one step).
        self.steps_before_final_window = self.step_window or (step_sizes[0] if step_sizes else None)
        largest = self.steps_before_final_window
        if self.final_window is not None and largest is not None and \
                self.final_window < largest + constants.mel_look_ahead - 1:
            raise ValueError(f"the backend's final window ({self.final_window} frames) must be at least the largest "
                             f"stream step plus the mel look-ahead less one ({largest} + {constants.mel_look_ahead} "
                             f"- 1)")
        self.max_streams, self.idle_timeout_s = max_streams, idle_timeout_s
        # Open streams (weak: a stream its caller dropped frees its slot) and how many are inside a push right now
        # (a batching scheduler waits for partners only while some may still come).
        self._streams: weakref.WeakSet[VocoderStream] = weakref.WeakSet()
        self._registry = threading.Lock()
        self._pushes_in_progress = 0
        self.backend = backend
        # Set by open_vocoder(batching=...): pushes then run through it, batched with other streams' (batching.py).
        self.scheduler: Any = None
        self.engine_reason = ""  # why open_vocoder(engine="auto") chose this backend (the CLIs print it)
        # The first error a backend call raised (a device that fails): a multi-device front places no new stream
        # here once it is set (placement.py); the streams already here go on as they can.
        self.failure: BaseException | None = None
        self.constants = constants
        self.noise = noise if noise is not None else NoiseTable.seeded(noise_seed, constants.noise_table_length,
                                                                       constants.num_sines)
        if self.noise.columns != constants.num_sines:
            raise ValueError(f"noise table has {self.noise.columns} columns, the model needs {constants.num_sines}")
        if traits.noise_positions:
            backend.use_noise_table(self.noise)  # it gathers each step's rows on its device
        if self.noise.length < constants.noise_table_length:
            warnings.warn(f"noise table {self.noise.source} has {self.noise.length} rows, the model's has "
                          f"{constants.noise_table_length}: streams longer than {self.noise.length} samples reuse its rows "
                          f"earlier than upstream would", RuntimeWarning, stacklevel=2)

    def stream(self) -> "VocoderStream":
        """A new stream. With ``max_streams``, raises :class:`OverloadError` when that many are open (after
        expiring the ones idle longer than ``idle_timeout_s``)."""
        with self._registry:
            self._reap_locked()
            if self.max_streams is not None and len(self._streams) >= self.max_streams:
                raise OverloadError(f"{len(self._streams)} streams are open, the limit (max_streams="
                                    f"{self.max_streams}); finish or drop a stream, or retry later")
            stream = VocoderStream(self)
            self._streams.add(stream)
            return stream

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def pushes_in_progress(self) -> int:
        """Streams inside a push right now (validated, running, or waiting for the scheduler)."""
        return self._pushes_in_progress

    def reap(self) -> int:
        """Expire the streams idle longer than ``idle_timeout_s`` (their state is dropped, their slot freed);
        return how many."""
        with self._registry:
            return self._reap_locked()

    def _reap_locked(self) -> int:
        if self.idle_timeout_s is None:
            return 0
        now, expired = time.monotonic(), 0
        for stream in list(self._streams):
            if now - stream.idle_since > self.idle_timeout_s and stream._expire():
                self._streams.discard(stream)
                expired += 1
        return expired

    def _unregister(self, stream: "VocoderStream") -> None:
        with self._registry:
            self._streams.discard(stream)

    @contextlib.contextmanager
    def _pushing(self) -> Iterator[None]:
        with self._registry:
            self._pushes_in_progress += 1
        try:
            yield
        finally:
            with self._registry:
                self._pushes_in_progress -= 1

    def warmup(self, progress: Any = None) -> None:
        """Prepare every step shape a stream can meet (compiles, CUDA graphs, cuDNN state) before the first request;
        ``progress(message)`` is told how far it got (the compiled engine's warmup takes minutes cold). A no-op on
        backends that compile nothing."""
        self.backend.warmup(self.step_sizes, progress)

    def close(self) -> None:
        """Stop the batching scheduler's threads: every push waiting in it fails at once with a clear error (a push
        whose call is on the device gets its answer first); nothing to do without one."""
        if self.scheduler is not None:
            self.scheduler.close()

    def __enter__(self) -> "StreamingVocoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def vocode(self, mel: np.ndarray) -> np.ndarray:
        """One offline ``finalize=True`` pass over the whole mel: one F0 step, one generator step and the final step
        from the start (the reference a stream equals; its memory grows with the mel's length, a stream's does not)."""
        mel = validate_mel(mel, self.constants.in_channels)
        if mel.shape[1] == 0:
            return np.zeros(0, np.float32)
        # Not a registered stream: no slot, no limit. Unbounded steps: one pass, as upstream computes it.
        return VocoderStream(self, one_pass=True)._advance(mel, final=True)

def _checked_options(phase: str, step_sizes: tuple[int, ...] | None, max_streams: int | None,
                     idle_timeout_s: float | None, max_step_frames: int) -> tuple[int, ...] | None:
    """:class:`StreamingVocoder`'s options checked (one line naming the bad one); the step sizes sorted, largest
    first."""
    if phase not in PHASE_MODES:
        raise ValueError(f"phase must be one of {PHASE_MODES}, got {phase!r}")
    if step_sizes is not None:
        step_sizes = tuple(sorted({int(s) for s in step_sizes}, reverse=True))
        if not step_sizes or 1 not in step_sizes or step_sizes[-1] < 1:
            raise ValueError(f"step_sizes must be positive and include 1 (so any push splits), got {step_sizes}")
    if max_streams is not None and max_streams < 1:
        raise ValueError(f"max_streams must be >= 1 (or None: no limit), got {max_streams}")
    if idle_timeout_s is not None and idle_timeout_s <= 0:
        raise ValueError(f"idle_timeout_s must be > 0 (or None: never), got {idle_timeout_s}")
    if max_step_frames < 1:
        raise ValueError(f"max_step_frames must be >= 1, got {max_step_frames}")
    return step_sizes


class VocoderStream:
    """One utterance: ``push(mel_chunk) -> samples``, then ``finish() -> the held-back tail`` (or ``finish(last_chunk)``:
    the last chunk and the tail as one all-or-nothing call)."""

    def __init__(self, vocoder: StreamingVocoder, one_pass: bool = False) -> None:
        self._v = vocoder
        c = self._c = vocoder.constants
        # Steps without fixed sizes are at most this long; unbounded for the offline pass (one step, as upstream).
        self._max_step = None if one_pass else vocoder.max_step_frames
        traits = vocoder.backend.traits
        self._in_place, self._f0_in_place = traits.caches_in_place, traits.f0_caches_in_place
        self._noise_positions = traits.noise_positions
        self._lock = threading.Lock()
        self._frames_in = 0
        self._position = 0  # frames the generator has computed; mel and F0 are kept from here on
        self._mel = np.zeros((c.in_channels, 0), np.float32)  # frames [position, frames_in)
        self._f0 = np.zeros(0, np.float32)  # frames [position, position + len)
        self._phase = np.zeros((1, c.num_sines), np.float64)  # running phase sum at frame position - 1 (turns)
        self._f0_caches = vocoder.backend.new_caches("f0")
        self._gen_caches = vocoder.backend.new_caches("generator")
        self._closed_as: str | None = None  # None while open; then "finished", "expired", "lost" or "closed"
        self._caches_written = False  # a push in progress wrote in-place caches it has not committed yet
        self._audio_out = False  # a push in progress handed audio to its on_audio callback
        self._warned_range = False
        self.idle_since = time.monotonic()  # the end of the last call (idle expiry counts from here)
        self.stats = StreamStats()

    # ---- read-only views ---------------------------------------------------------------------------------------
    @property
    def frames_in(self) -> int:
        return self._frames_in

    @property
    def finished(self) -> bool:
        return self._closed_as == "finished"

    @property
    def expired(self) -> bool:
        """True once the stream was idle longer than ``idle_timeout_s`` and its state was released."""
        return self._closed_as == "expired"

    @property
    def lost(self) -> bool:
        """True once a failed step may have written this stream's device caches: its state was released."""
        return self._closed_as == "lost"

    @property
    def closed_as(self) -> str | None:
        """Why the stream takes no more calls: ``"finished"``, ``"expired"``, ``"lost"``, ``"closed"``; None while it
        is open."""
        return self._closed_as

    @property
    def mel_cache_frames(self) -> int:
        return self._mel.shape[1]

    # ---- the calls ----------------------------------------------------------------------------------------------
    def push(self, mel: Any, cancel: CancelToken | None = None,
             on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Append a chunk; return the audio it releases. Refused (bad mel, closed stream), failed or cancelled, the
        stream is as it was (see the module docstring for device caches). ``on_audio``: called with each step's
        audio (float32 ``[n]``, n > 0) as soon as that step is done, from the thread that runs the steps (keep it
        short); the pieces join to the returned release."""
        return self._call("push()", mel, final=False, cancel=cancel, on_audio=on_audio)

    def finish(self, mel: Any = None, cancel: CancelToken | None = None,
               on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """End the stream: the last chunk ``mel`` (optional) and everything held back, as one all-or-nothing call."""
        return self._call("finish()", mel, final=True, cancel=cancel, on_audio=on_audio)

    async def apieces(self, mel: Any, final: bool = False) -> AsyncIterator[np.ndarray]:
        """``apush`` (``afinish`` with ``final``) as an async iterator over its release, each step's audio as soon as
        that step is done. Leaving the loop early cancels the push (and, once audio went out, loses the stream)."""
        import asyncio

        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()
        done = object()
        task = asyncio.ensure_future(self._acall("apieces()", mel, final,
                                                 lambda piece: loop.call_soon_threadsafe(pieces.put_nowait, piece)))
        # Queued after every piece: the pieces were handed to the loop before the push returned.
        task.add_done_callback(lambda _: pieces.put_nowait(done))
        try:
            while (piece := await pieces.get()) is not done:
                yield piece
            await task  # the push's error, if it failed
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def apush(self, mel: Any, on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """``push`` from asyncio. With a batching scheduler the push is handed to it from the event loop's thread (no
        thread per push or per stream: thousands of streams can run as tasks of one loop); without one it runs in a
        worker thread. Cancelling the task cancels the push (the stream is then unchanged, or the push completed:
        never half of it). Calls on one stream must not overlap: a second one while one is in flight is refused."""
        return await self._acall("apush()", mel, final=False, on_audio=on_audio)

    async def afinish(self, mel: Any = None, on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        return await self._acall("afinish()", mel, final=True, on_audio=on_audio)

    async def _acall(self, name: str, mel: Any, final: bool,
                     on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        import asyncio

        scheduler = self._v.scheduler
        if scheduler is None:  # no scheduler: the steps run on the backend in a worker thread
            token = CancelToken()
            task = asyncio.ensure_future(asyncio.to_thread(self._call, name, mel, final, token, on_audio))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                token.cancel()
                # The push settles (stops, or runs to its end) before the cancellation goes on.
                with contextlib.suppress(BaseException):
                    await asyncio.wait([task])
                raise
        # The stream's lock is held across the await (released by this task, in the loop's thread); blocking on it
        # would block the loop, so an overlapping call is refused instead.
        if not self._lock.acquire(blocking=False):
            raise StreamError(f"{name} while another call on this stream is in progress; await it first")
        try:
            chunk = self._accept(name, mel, final)
            if chunk is None:
                return np.zeros(0, np.float32)
            with self._v._pushing():
                try:
                    out = await scheduler.arun(self._steps(chunk, final, on_audio), on_cancelled=self._push_failed)
                except asyncio.CancelledError:
                    raise  # told to _push_failed (by arun) once the push settled, unless it completed
                except BaseException as exc:
                    self._push_failed(exc)
                    raise
            if final:
                self._v._unregister(self)
            return out
        finally:
            self.idle_since = time.monotonic()
            self._lock.release()

    def _call(self, name: str, mel: Any, final: bool, cancel: CancelToken | None,
              on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        with self._lock:
            try:
                chunk = self._accept(name, mel, final)
                if chunk is None:
                    return np.zeros(0, np.float32)
                with self._v._pushing():
                    out = self._advance(chunk, final=final, cancel=cancel, on_audio=on_audio)
                if final:
                    self._v._unregister(self)
                return out
            finally:
                self.idle_since = time.monotonic()

    def _accept(self, name: str, mel: Any, final: bool) -> np.ndarray | None:
        """The call's chunk, validated (a refusal raises here, before anything changes); None: nothing to do."""
        if final and self._closed_as == "finished":
            raise StreamError(f"{name} called twice: the stream is already closed")
        self._check_open(name)
        if mel is None:
            chunk, lo, hi = np.zeros((self._c.in_channels, 0), np.float32), 0.0, 0.0
        else:
            chunk, lo, hi = validate_mel_range(mel, self._c.in_channels)
        if not self._warned_range and (lo < LOG_MEL_RANGE[0] or hi > LOG_MEL_RANGE[1]):
            self._warned_range = True
            warnings.warn(f"mel values span [{lo:.1f}, {hi:.1f}], outside the natural-log mel range "
                          f"{LOG_MEL_RANGE} the vocoder was trained on (linear or dB mel?)", RuntimeWarning,
                          stacklevel=4)
        if chunk.shape[1] == 0 and not final:
            return None
        return chunk

    def close(self) -> None:
        """Drop the stream without finishing it: its state (and device slot) is released at once; later calls raise
        :class:`StreamError`. A no-op on a stream already closed."""
        with self._lock:
            if self._closed_as is None:
                self._release("closed")
        self._v._unregister(self)

    def _check_open(self, call: str) -> None:
        if self._closed_as == "expired":
            raise StreamError(f"{call} on a stream that expired after {self._v.idle_timeout_s} s idle; its state was "
                              f"released: open a new stream")
        if self._closed_as == "lost":
            raise StreamError(f"{call} on a stream whose device caches were lost in a failed step; its state was "
                              f"released: open a new stream")
        if self._closed_as == "finished":
            raise StreamError(f"{call} after finish(): the stream is closed; open a new stream")
        if self._closed_as == "closed":
            raise StreamError(f"{call} after close(): the stream is closed; open a new stream")

    def _expire(self) -> bool:
        """Drop the state of an idle stream; False when a call holds it (it is not idle then)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._closed_as is None:
                self._release("expired")
            return True
        finally:
            self._lock.release()

    def _release(self, why: str) -> None:
        """Close the stream as ``why`` and drop its state (device caches go back to the backend)."""
        self._closed_as = why
        self._mel = self._f0 = self._gen_caches = self._f0_caches = None  # type: ignore[assignment]

    # ---- internals ----------------------------------------------------------------------------------------------
    def _advance(self, chunk: np.ndarray, final: bool, cancel: CancelToken | None = None,
                 on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Run the steps the new frames allow: through the vocoder's scheduler (which batches them with other
        streams' steps), or straight on its backend. A push that fails after it wrote in-place caches loses the
        stream (those caches are ahead of its bookkeeping)."""
        scheduler = self._v.scheduler
        steps = self._steps(chunk, final, on_audio)
        try:
            if scheduler is not None:
                return scheduler.run(steps, cancel)
            return drive(steps, self._v.backend, cancel)
        except BaseException as exc:
            self._push_failed(exc)
            raise

    def _push_failed(self, exc: BaseException) -> None:
        """After a push that did not complete: a cancelled one changed nothing; one that failed after it wrote
        in-place caches, or after audio went out, loses the stream; a backend's error marks the vocoder failed (for
        placement)."""
        if isinstance(exc, PushCancelled) and not self._audio_out:  # cancelled before any call that writes caches
            self._caches_written = False
            return
        if isinstance(exc, Exception) and not isinstance(exc, SchedulerClosed | PushCancelled | StreamError) \
                and self._v.failure is None:
            self._v.failure = exc  # a backend call failed (input errors are refused before _advance)
        if self._caches_written or self._audio_out:  # what went out cannot be taken back: a retry would repeat it
            self._caches_written = self._audio_out = False
            self._release("lost")
            self._v._unregister(self)

    def _generator_call(self, kind: str, mel: np.ndarray, f0: np.ndarray, position: int, frames: int,
                        phase: np.ndarray, caches: Any, window: int | None = None,
                        audio_ahead_s: float | None = None) -> StepCall:
        """A generator (or final) step of ``frames`` frames from ``position``: its noise rows and ``first`` flag are
        the position's. ``window``: the backend's window for this kind of step; mel and F0 (look-aheads included) are
        padded with zeros to it, and the step's own frames go after ``final`` (the caller trims the audio).
        ``audio_ahead_s``: the push's audio handed out so far (:class:`StepCall`)."""
        c = self._c
        spf = c.samples_per_frame
        mel_ahead, source_ahead = (0, 0) if kind == "final" else (c.mel_look_ahead, c.source_look_ahead)
        if window is not None:
            mel, f0 = _padded(mel, window + mel_ahead), _padded(f0, window + source_ahead)
        if self._noise_positions:  # the backend reads the noise table itself: its first row's index is enough
            noise = np.array([[position * spf]], np.int64)
        else:
            noise = self._v.noise.rows(position * spf, ((window or frames) + source_ahead) * spf)[None]
        writes = self._in_place and kind == "generator"  # a final step leaves the caches: the stream ends
        if writes:
            self._caches_written = True  # until the commit, a failure (not a cancellation) loses the stream
        # Every array C-contiguous: a batched call stacks them as bytes (arrays.concat_rows). Copies under the GIL
        # (arrays.contiguous_copy): each NumPy copy would hand it away, two or three times a step.
        args = (contiguous_copy(mel[None]) if window is None else mel[None], f0[None], noise, phase,
                np.array([[position == 0]]), caches)
        return StepCall(kind, args if window is None else (*args, np.array([[frames]], np.int64)), writes,
                        audio_ahead_s)

    def _hand_out(self, piece: np.ndarray, on_audio: Callable[[np.ndarray], None] | None) -> None:
        """A step's audio to the push's ``on_audio`` (a copy: the caller may keep it); until the commit, a failure
        then loses the stream."""
        if on_audio is not None and piece.shape[0]:
            self._audio_out = True
            try:
                on_audio(contiguous_copy(piece))
            except Exception as exc:  # the caller's code, not the backend's: the vocoder stays healthy
                raise StreamError(f"the on_audio callback raised {type(exc).__name__}: {exc}; the stream is lost, "
                                  f"open a new one") from exc

    def _emitted(self, audio: np.ndarray, position: int) -> np.ndarray:
        """A step's audio row, without the samples before the utterance on its first step (the audio lags)."""
        return audio[0, self._c.audio_lag * self._c.samples_per_frame if position == 0 else 0:]

    def _steps(self, chunk: np.ndarray, final: bool, on_audio: Callable[[np.ndarray], None] | None = None
               ) -> Generator[StepCall, Any, np.ndarray]:
        """The push as a coroutine: it yields each backend call it needs (:class:`StepCall`), is sent the call's
        result, and returns the emitted audio. Everything is computed into locals; the stream's state changes only
        once every call has succeeded (an error thrown in, or the coroutine closed, leaves it as it was)."""
        c = self._c
        sizes, f0_sizes, max_step = self._v.step_sizes, self._v.f0_step_sizes, self._max_step
        base = self._position
        mel = np.concatenate([self._mel, chunk], axis=1) if chunk.shape[1] else self._mel
        n = self._frames_in + chunk.shape[1]
        f0, f0_caches = self._f0, self._f0_caches
        f0_end = base + f0.shape[0]

        # The generator's steps: up to where mel look-ahead and source look-ahead are known; on finish, one final
        # step (in a final window, the steps only reach the window's start, in steps of the largest size).
        target = n if final else n - c.f0_look_ahead
        position, f0_target = base, max(f0_end, target)  # F0 is known this far once the push's F0 calls are made
        limit = min(n - c.mel_look_ahead, f0_target - c.source_look_ahead)
        window, step_window = (self._v.final_window if final else None), self._v.step_window
        if window is not None:
            unit = self._v.steps_before_final_window or 1
            limit = position + max(0, -(-(n - position - window) // unit) * unit)
        step_plan = split_steps(limit - position, sizes, max_step, step_window)

        # 1. F0 of the frames that became computable (all remaining ones, with zero look-ahead, on finish): its calls
        # are planned here and made as the generator's steps need them, so a step's audio goes out after the F0 it
        # reads, not after a long chunk's whole F0 (the same calls in the same order: the same values). On an engine
        # with F0 sizes past one step's F0, a call that large would hold back the push's first audio: the first call
        # is one step's F0 (what the largest step reads, where the push has that much: the first calls of every
        # push then share one shape and batch together under load, an utterance's first or not), and the rest
        # follows in as few calls as the sizes allow (a 200-frame chunk's F0 in three calls, not eight).
        f0_sizes_left = split_steps(target - f0_end, f0_sizes, max_step) if target > f0_end else []
        one_step = self._v.steps_before_final_window
        one_step_f0 = None if one_step is None else one_step + c.source_look_ahead
        if step_plan and one_step_f0 is not None and f0_sizes_left and f0_sizes is not None and \
                one_step_f0 in f0_sizes and f0_sizes_left[0] > one_step_f0:
            first_need = min(target, max(position + step_plan[0] + c.source_look_ahead, f0_end + one_step_f0))
            f0_sizes_left = split_steps(first_need - f0_end, f0_sizes, max_step) + \
                split_steps(target - first_need, f0_sizes, max_step)
        f0_window = mel[:, f0_end - base:]  # frames [f0_end, target + look-ahead)
        if final and f0_sizes_left:
            f0_window = np.concatenate([f0_window, np.zeros((c.in_channels, c.f0_look_ahead), np.float32)], axis=1)
        f0_known, f0_calls = f0_end, 0  # F0 is known for frames [base, f0_known)
        long_push = limit - position > (one_step or 0)  # (StepCall.long_push)
        # The audio handed to on_audio so far, in seconds: how long the push's later calls can wait (the scheduler
        # runs the calls whose listeners' playback runs dry first). None: the audio goes out whole at the end.
        ahead: float | None = None if on_audio is None else 0.0

        def f0_up_to(frame: int) -> Generator[StepCall, Any, None]:
            """The planned F0 calls until F0 is known up to ``frame`` (all of them past ``target``)."""
            nonlocal f0, f0_caches, f0_known, f0_calls
            new = []
            while f0_known < frame and f0_calls < len(f0_sizes_left):
                size, at = f0_sizes_left[f0_calls], f0_known - f0_end
                if self._f0_in_place:
                    self._caches_written = True  # as for the generator's steps (_generator_call)
                out, f0_caches = yield StepCall(
                    "f0", (contiguous_copy(f0_window[None, :, at:at + size + c.f0_look_ahead]), f0_caches),
                    self._f0_in_place, ahead, long_push)
                new.append(out[0])
                f0_known += size
                f0_calls += 1
            if new:
                f0 = concat_rows([f0, *new])

        # 2. The generator's steps, then on finish the final step.
        phase, caches = self._phase, self._gen_caches
        pieces, steps = [], []
        for size in step_plan:
            yield from f0_up_to(position + size + c.source_look_ahead)
            i = position - base
            audio, phase, caches = yield self._generator_call(
                "generator", mel[:, i: i + size + c.mel_look_ahead], f0[i: i + size + c.source_look_ahead],
                position, size, phase, caches, step_window, ahead)
            if step_window is not None:  # the window's padding
                audio = audio[:, :size * c.samples_per_frame]
            if self._v.phase_mode == "wrapped":
                phase = phase - np.floor(phase)
            pieces.append(self._emitted(audio, position))
            self._hand_out(pieces[-1], on_audio)
            if ahead is not None:
                ahead += pieces[-1].shape[0] / c.sample_rate
            steps.append(size)
            position += size
        yield from f0_up_to(f0_target)  # the rest: F0 is kept for the next push's steps
        if final and n > position:
            i = position - base
            frames = n - position
            # (In a window, zeros past the utterance's end are finalize's look-ahead.)
            audio, _, _ = yield self._generator_call("final", mel[:, i:], f0[i:], position, frames, phase, caches,
                                                     window, ahead)
            if window is not None:  # the window's padding
                audio = audio[:, :(frames + 1) * c.samples_per_frame]
            pieces.append(self._emitted(audio, position))
            self._hand_out(pieces[-1], on_audio)
            steps.append(n - position)
            position = n
        # A copy, not views: a view would keep each step's output buffer alive for as long as the caller keeps it.
        # Joined as bytes: a NumPy copy would hand the GIL away in a busy process (arrays.py).
        emitted = concat_rows(pieces) if pieces else np.zeros(0, np.float32)
        expected = (n if final else max(0, position - c.audio_lag)) * c.samples_per_frame - self.stats.samples_out
        if emitted.shape[0] != expected:
            raise RuntimeError(f"backend {self._v.backend.name} returned {emitted.shape[0]} samples for steps {steps}; "
                               f"expected {expected}")

        # 3. Commit.
        st = self.stats
        st.max_mel_cache = max(st.max_mel_cache, mel.shape[1])
        self._frames_in, self._position = n, position
        self._mel, self._f0 = mel[:, position - base:], f0[position - base:]
        self._phase, self._gen_caches, self._f0_caches = phase, caches, f0_caches
        self._caches_written = self._audio_out = False
        st.frames_in = n
        st.samples_out += emitted.shape[0]
        st.f0_frames = f0_target
        st.f0_calls += f0_calls
        st.generator_calls += len(steps)
        st.generator_frames += sum(steps)
        st.max_step_frames = max([st.max_step_frames, *steps])
        if final:
            self._release("finished")
            self._mel = np.zeros((c.in_channels, 0), np.float32)
        return emitted
