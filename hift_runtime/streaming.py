"""Bounded-window streaming of the CosyVoice3 vocoder, written once and driven by any :class:`VocoderBackend`.

Frame bookkeeping (absolute mel frames; ``spf`` = 480 samples per frame, ``LA`` = 3 F0 look-ahead, ``LEFT`` = 8 F0
left context, ``LOOK`` = 4 ``conv_pre`` look-ahead, ``W`` = window history):

* **Incremental F0.** F0 of frame ``t`` depends on mel ``t-8 .. t+3`` only. With ``n`` frames received, F0 is known
  for frames ``< n-3``; each push runs the F0 graph on ``mel[f0_end-8 : n]`` (``chunk + 11`` frames), keeps only the
  new frames, and never recomputes a kept value. The cost per chunk does not depend on ``W``.
* **Generator window.** The generator's left receptive field is ~30 frames, so a window that starts ``W >= 64``
  frames before the first new output frame reproduces the offline pass. A stream call on the window
  ``[w, f0_end)`` yields audio for frames ``[w, f0_end-5)``; frames already emitted are dropped.
* **Phase.** The source integrates ``f0*h/sr`` over frames in float64 and rounds the running sum to float32 before
  ``sin(2*pi*480*x)``, as upstream's CPU cumsum does. The window's sum starts from the carried float64 sum at frame
  ``w-1`` and the generator returns the per-frame sums to carry forward. ``phase="upstream"`` (default) carries the
  unwrapped sum: every window then rounds exactly like one pass from frame 0 (upstream's offline and streaming
  output). ``phase="wrapped"`` drops whole turns (exact in real arithmetic: ``sin(2*pi*480*x)`` has period 1/480),
  which keeps the float32 rounding at small magnitudes: more accurate than upstream on long utterances, where
  upstream's float32 sum drifts (~0.2 rad at 30 s for the 9th harmonic), but no longer bit-faithful to it.
* **Noise.** Rows ``[480 w, 480 f0_end)`` of the :class:`~hift_runtime.noise.NoiseTable`, by absolute sample.
* **Finish.** F0 of the last 3 frames uses zero look-ahead (the F0 graph on mel + 3 zero frames, exactly upstream's
  ``finalize=True``); the final generator call covers ``[w, n)`` and emits everything still held back.

Totals: ``480 * frames`` samples, equal to one offline ``finalize=True`` pass up to float rounding. The mel cache
holds at most ``max(W + 8, 11) + chunk`` frames.

Thread safety: a :class:`StreamingVocoder` (and its backend's sessions) may serve many streams from many threads;
one :class:`VocoderStream` must be driven by one thread at a time (calls on a stream are serialised by its lock).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .noise import NoiseTable

# Outside this range the input is almost certainly not upstream's natural-log mel (log(clamp(., 1e-5)) >= -11.5).
LOG_MEL_RANGE = (-30.0, 15.0)


class StreamError(RuntimeError):
    """A call that the stream's state does not allow (push after finish, finish twice)."""


class MelError(ValueError):
    """A mel chunk of the wrong shape or with non-finite values; the stream is left unchanged."""


class VocoderBackend(Protocol):
    """What the bookkeeping needs from an inference engine (NumPy in, NumPy out, float32)."""

    name: str

    def predict_f0(self, mel: np.ndarray) -> np.ndarray:
        """``[B, 80, T] -> [B, T - f0_look_ahead]``: streaming form, the last frames are look-ahead."""
        ...

    def generate(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                 finalize: bool) -> tuple[np.ndarray, np.ndarray]:
        """Generator graph: ``(audio [B, S], phase_out [B, N, 9])`` (see ``hift_export.graphs``)."""
        ...


@dataclass(frozen=True)
class StreamConstants:
    """Everything the bookkeeping needs, read from the manifest (or a config dict): never hard-coded here."""

    in_channels: int
    samples_per_frame: int
    f0_look_ahead: int
    f0_left_context: int
    conv_pre_look_ahead: int
    num_sines: int
    noise_table_length: int
    window_frames: int

    @classmethod
    def from_config(cls, config: dict[str, Any], window_frames: int | None = None) -> "StreamConstants":
        d = config["derived"]
        return cls(in_channels=int(config["in_channels"]), samples_per_frame=int(d["samples_per_frame"]),
                   f0_look_ahead=int(d["f0_look_ahead"]), f0_left_context=int(d["f0_left_context"]),
                   conv_pre_look_ahead=int(config["conv_pre_look_right"]), num_sines=int(d["num_sines"]),
                   noise_table_length=int(d["noise_table_length"]),
                   window_frames=int(config["window_frames"] if window_frames is None else window_frames))

    @property
    def stream_emit_lag(self) -> int:
        """Frames with known F0 that a stream call cannot emit yet: conv_pre look-ahead + 1 iSTFT frame (5)."""
        return self.conv_pre_look_ahead + 1


@dataclass
class StreamStats:
    """Counters a test or a monitor can read."""

    frames_in: int = 0
    samples_out: int = 0
    f0_frames: int = 0  # F0 values computed and kept: each frame exactly once
    f0_calls: int = 0
    generator_calls: int = 0
    max_mel_cache: int = 0
    max_f0_input_frames: int = 0  # the largest F0 graph input: new frames + left context (+ look-ahead zeros)
    max_window_frames: int = 0  # the largest generator window


PHASE_MODES = ("upstream", "wrapped")


class StreamingVocoder:
    """Shared part: backend, constants, noise table. Creates :class:`VocoderStream` objects and offline passes."""

    def __init__(self, backend: VocoderBackend, constants: StreamConstants, noise: NoiseTable | None = None,
                 noise_seed: int = 0, phase: str = "upstream") -> None:
        if constants.window_frames < 1:
            raise ValueError(f"window_frames must be >= 1, got {constants.window_frames}")
        if phase not in PHASE_MODES:
            raise ValueError(f"phase must be one of {PHASE_MODES}, got {phase!r}")
        self.phase_mode = phase
        self.backend = backend
        self.constants = constants
        self.noise = noise if noise is not None else NoiseTable.seeded(noise_seed, constants.noise_table_length,
                                                                       constants.num_sines)
        if self.noise.columns != constants.num_sines:
            raise ValueError(f"noise table has {self.noise.columns} columns, the model needs {constants.num_sines}")

    def stream(self) -> "VocoderStream":
        return VocoderStream(self)

    def warmup(self, chunk_frames: int = 24, streams: int = 2) -> None:
        """Run ``streams`` silent streams of ``chunk_frames``-frame chunks through the backend, so that the window
        lengths a real stream of that chunk size meets (first chunks, steady state, finish) are prepared before
        the first user request (on the CUDA EP: their dedicated sessions exist and cuDNN state is built)."""
        c = self.constants
        frames = (c.window_frames // max(chunk_frames, 1) + 4) * chunk_frames
        mel = np.full((c.in_channels, frames), -11.5, np.float32)
        for _ in range(streams):
            stream = self.stream()
            for pos in range(0, frames, chunk_frames):
                stream.push(mel[:, pos:pos + chunk_frames])
            stream.finish()

    def vocode(self, mel: np.ndarray) -> np.ndarray:
        """One offline ``finalize=True`` pass over the whole mel (upstream non-streaming ``inference``)."""
        c = self.constants
        mel = validate_mel(mel, c.in_channels)
        frames = mel.shape[1]
        if frames == 0:
            return np.zeros(0, np.float32)
        padded = np.concatenate([mel, np.zeros((c.in_channels, c.f0_look_ahead), np.float32)], axis=1)
        f0 = self.backend.predict_f0(padded[None])
        noise = self.noise.rows(0, frames * c.samples_per_frame)[None]
        phase_in = np.zeros((1, c.num_sines), np.float64)
        audio, _ = self.backend.generate(mel[None], f0, noise, phase_in, True)
        return audio[0]


def validate_mel(mel: Any, channels: int) -> np.ndarray:
    """``[C, T]`` or ``[1, C, T]`` real floats -> contiguous float32 ``[C, T]``; raise :class:`MelError` otherwise.

    float64/float16 input is converted to float32 (what the graphs compute in); integer, bool and complex arrays
    are refused (a mel is never integer; an integer array is almost certainly the wrong input).
    """
    if not isinstance(mel, np.ndarray):
        try:
            mel = np.asarray(mel)
        except Exception as exc:  # noqa: BLE001 - anything that is not array-like
            raise MelError(f"mel must be a NumPy array, got {type(mel).__name__}") from exc
    if mel.ndim == 3:
        if mel.shape[0] != 1:
            raise MelError(f"mel has batch size {mel.shape[0]}; a stream takes one utterance: [{channels}, T] or "
                           f"[1, {channels}, T]")
        mel = mel[0]
    if mel.ndim != 2:
        raise MelError(f"mel must be [{channels}, T] or [1, {channels}, T], got shape {tuple(mel.shape)}")
    if mel.shape[0] != channels:
        hint = " (is it [T, C]? transpose it)" if mel.shape[1] == channels else ""
        raise MelError(f"mel has {mel.shape[0]} channels, the vocoder expects {channels} mel bins{hint}")
    if not (np.issubdtype(mel.dtype, np.floating)):
        raise TypeError(f"mel has dtype {mel.dtype}; expected float32 (float64/float16 are converted)")
    mel = np.ascontiguousarray(mel, dtype=np.float32)
    finite = np.isfinite(mel)
    if not finite.all():
        bad = np.argwhere(~finite)
        raise MelError(f"mel has {bad.shape[0]} non-finite values (NaN/Inf), first at bin {bad[0][0]}, frame "
                       f"{bad[0][1]} of this chunk; the stream is unchanged")
    return mel


class VocoderStream:
    """One utterance: ``push(mel_chunk) -> samples``, then ``finish() -> the held-back tail``."""

    def __init__(self, vocoder: StreamingVocoder) -> None:
        self._v = vocoder
        c = vocoder.constants
        self._c = c
        self._lock = threading.Lock()
        self._mel = np.zeros((c.in_channels, 0), np.float32)  # absolute frames [mel_start, frames_in)
        self._mel_start = 0
        self._f0 = np.zeros(0, np.float32)  # absolute frames [f0_start, f0_end)
        self._f0_start = 0
        self._noise = np.zeros((0, c.num_sines), np.float32)  # noise rows of frames [noise_start, ...)
        self._noise_start = 0
        self._emitted = 0  # frames whose audio was returned
        self._phase = np.zeros(c.num_sines, np.float64)  # carried phase sum (turns) at frame window_start-1
        self._phase_frame = 0  # the window start the carried phase belongs to
        self._finished = False
        self._warned_range = False
        self.stats = StreamStats()

    # ---- read-only views ---------------------------------------------------------------------------------------
    @property
    def frames_in(self) -> int:
        return self._mel_start + self._mel.shape[1]

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def mel_cache_frames(self) -> int:
        return self._mel.shape[1]

    # ---- the two calls ----------------------------------------------------------------------------------------
    def push(self, mel: Any) -> np.ndarray:
        with self._lock:
            if self._finished:
                raise StreamError("push() after finish(): the stream is closed; open a new stream")
            chunk = validate_mel(mel, self._c.in_channels)
            self._warn_range(chunk)
            if chunk.shape[1] == 0:
                return np.zeros(0, np.float32)
            return self._step(chunk, finalize=False)

    def finish(self) -> np.ndarray:
        with self._lock:
            if self._finished:
                raise StreamError("finish() called twice: the stream is already closed")
            out = self._step(np.zeros((self._c.in_channels, 0), np.float32), finalize=True)
            return out

    # ---- internals ----------------------------------------------------------------------------------------------
    def _warn_range(self, chunk: np.ndarray) -> None:
        if self._warned_range or chunk.size == 0:
            return
        lo, hi = float(chunk.min()), float(chunk.max())
        if lo < LOG_MEL_RANGE[0] or hi > LOG_MEL_RANGE[1]:
            self._warned_range = True
            warnings.warn(f"mel values span [{lo:.1f}, {hi:.1f}], outside the natural-log mel range "
                          f"{LOG_MEL_RANGE} the vocoder was trained on (linear or dB mel?)", RuntimeWarning,
                          stacklevel=3)

    def _step(self, chunk: np.ndarray, finalize: bool) -> np.ndarray:
        """Compute everything into locals; commit state only once every backend call has succeeded."""
        c, backend = self._c, self._v.backend
        spf = c.samples_per_frame
        mel = np.concatenate([self._mel, chunk], axis=1) if chunk.shape[1] else self._mel
        mel_start = self._mel_start
        n = mel_start + mel.shape[1]
        f0, f0_start = self._f0, self._f0_start
        f0_end = f0_start + f0.shape[0]

        # 1. F0 for the frames that became computable (all remaining ones when finalizing).
        target = n if finalize else n - c.f0_look_ahead
        f0_calls, f0_inputs = 0, []
        if target > f0_end:
            start = max(0, f0_end - c.f0_left_context)
            window = mel[:, start - mel_start:]
            if finalize:
                window = np.concatenate([window, np.zeros((c.in_channels, c.f0_look_ahead), np.float32)], axis=1)
            out = backend.predict_f0(window[None])[0]
            f0 = np.concatenate([f0, out[f0_end - start:]])
            f0_calls, f0_inputs = 1, [window.shape[1]]
            f0_end = target

        # 2. Generator over the bounded window, emitting the frames that became final.
        emit_end = n if finalize else f0_end - c.stream_emit_lag
        audio = np.zeros(0, np.float32)
        phase, phase_frame = self._phase, self._phase_frame
        noise = self._noise
        win_frames: list[int] = []
        if emit_end > self._emitted:
            w = max(0, self._emitted - c.window_frames)
            if w != phase_frame:  # the carry is stored for exactly this window start by the previous call
                raise RuntimeError(f"internal error: carried phase belongs to frame {phase_frame}, window starts at {w}")
            frames = f0_end - w
            # Noise rows are drawn once per frame and kept with the window (a seeded table hashes on demand).
            noise_end = self._noise_start + self._noise.shape[0] // spf
            if f0_end > noise_end:
                new_rows = self._v.noise.rows(noise_end * spf, (f0_end - noise_end) * spf)
                noise = np.concatenate([self._noise, new_rows]) if self._noise.size else new_rows
            else:
                noise = self._noise
            window_noise = noise[(w - self._noise_start) * spf: (f0_end - self._noise_start) * spf]
            out_audio, phase_out = backend.generate(
                mel[None, :, w - mel_start: f0_end - mel_start], f0[None, w - f0_start: f0_end - f0_start],
                window_noise[None], phase[None], finalize)
            # A copy, not a view: a view would keep the whole window's output alive for as long as the caller
            # keeps this chunk (measured: +290 MB RSS over a 300 s stream whose chunks were kept).
            audio = np.array(out_audio[0, (self._emitted - w) * spf:], dtype=np.float32, copy=True)
            expected = (emit_end - self._emitted) * spf
            if audio.shape[0] != expected:
                raise RuntimeError(f"backend {backend.name} returned {audio.shape[0] + (self._emitted - w) * spf} "
                                   f"samples for a {frames}-frame window; expected {expected} new samples")
            win_frames = [frames]
            next_w = max(0, emit_end - c.window_frames)
            if next_w > w:
                phase = np.array(phase_out[0, next_w - 1 - w], dtype=np.float64)
                if self._v.phase_mode == "wrapped":
                    phase -= np.floor(phase)
                phase_frame = next_w
        else:
            emit_end = self._emitted

        # 3. Commit, then drop what no later call needs.
        self._emitted = emit_end
        self._phase, self._phase_frame = phase, phase_frame
        keep_gen = max(0, emit_end - c.window_frames)
        keep_mel = min(keep_gen, max(0, f0_end - c.f0_left_context))
        self._mel = mel[:, keep_mel - mel_start:]
        self._mel_start = keep_mel
        self._f0 = f0[keep_gen - f0_start:]
        self._f0_start = keep_gen
        self._noise = noise[(keep_gen - self._noise_start) * spf:]
        self._noise_start = keep_gen
        st = self.stats
        st.frames_in = n
        st.samples_out += audio.shape[0]
        st.f0_frames = f0_end
        st.f0_calls += f0_calls
        st.max_f0_input_frames = max([st.max_f0_input_frames, *f0_inputs])
        st.generator_calls += len(win_frames)
        st.max_window_frames = max([st.max_window_frames, *win_frames])
        st.max_mel_cache = max(st.max_mel_cache, mel.shape[1])
        if finalize:
            self._finished = True
            self._mel = np.zeros((c.in_channels, 0), np.float32)
            self._f0 = np.zeros(0, np.float32)
            self._noise = np.zeros((0, c.num_sines), np.float32)
        return audio
