"""Several devices behind one vocoder: each new stream placed on the least-loaded device, pinned there.

A :class:`MultiDeviceVocoder` holds one :class:`~hift_runtime.streaming.StreamingVocoder` per device (each with its
own engine: sessions or compiled step, slot pool, CUDA graphs, scheduler). :meth:`MultiDeviceVocoder.stream` picks
the device with the fewest open streams (ties: the first listed) and returns that device's own
:class:`~hift_runtime.streaming.VocoderStream`, so every later push of the stream runs where its caches live: nothing
here copies the stream logic, and a push never passes through this object.

A device whose backend call failed (``StreamingVocoder.failure``) takes no new stream; its open streams go on as
they can, and the other devices are not disturbed. Capacity and ``max_streams`` are the sums over the devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .contract import StreamConstants
from .errors import OverloadError
from .streaming import StreamingVocoder, VocoderStream


class AllDevicesFailed(OverloadError):
    """Every device of a multi-device vocoder failed: no new stream can be placed."""


class _Engines:
    """What the CLIs read from ``vocoder.backend``: a name for all the devices, and their summed capacity."""

    def __init__(self, vocoders: Sequence[StreamingVocoder], names: Sequence[str]) -> None:
        self._vocoders, self._names = vocoders, names

    @property
    def name(self) -> str:
        return f"{self._vocoders[0].backend.name} on {len(self._names)} devices ({', '.join(self._names)})"

    def stream_capacity(self) -> int:
        return sum(v.backend.stream_capacity() for v in self._vocoders)


class MultiDeviceVocoder:
    """One front over a vocoder per device (see the module docstring). ``names``: how messages name the devices
    (e.g. ``cuda:0``); ``max_streams``: open streams over all devices at most (None: each device's own limit)."""

    def __init__(self, vocoders: Sequence[StreamingVocoder], names: Sequence[str] | None = None,
                 max_streams: int | None = None) -> None:
        if not vocoders:
            raise ValueError("a multi-device vocoder needs at least one device")
        self.vocoders = list(vocoders)
        self.names = list(names) if names is not None else [f"device {i}" for i in range(len(self.vocoders))]
        if len(self.names) != len(self.vocoders):
            raise ValueError(f"{len(self.names)} names for {len(self.vocoders)} devices")
        first = self.vocoders[0]
        self.constants: StreamConstants = first.constants
        self.idle_timeout_s = first.idle_timeout_s
        self.engine_reason = first.engine_reason
        self.backend = _Engines(self.vocoders, self.names)
        self.max_streams = max_streams
        self._placing = threading.Lock()  # one placement at a time: the counts it compares stay true

    # ---- placement -----------------------------------------------------------------------------------------------
    def stream(self) -> VocoderStream:
        """A new stream on the least-loaded working device. :class:`OverloadError` when ``max_streams`` streams are
        open over all devices or every working device is full; :class:`AllDevicesFailed` when none works."""
        with self._placing:
            self.reap()
            if self.max_streams is not None and self.open_streams >= self.max_streams:
                raise OverloadError(f"{self.open_streams} streams are open on {len(self.vocoders)} devices, the limit "
                                    f"(max_streams={self.max_streams}); finish or drop a stream, or retry later")
            working = [v for v in self.vocoders if v.failure is None]
            if not working:
                raise AllDevicesFailed(f"every device failed ({self._failures()}); restart the vocoder")
            for vocoder in sorted(working, key=lambda v: v.open_streams):  # stable: ties go to the first listed
                try:
                    return vocoder.stream()
                except OverloadError:  # this device is full: the next least-loaded one
                    continue
            raise OverloadError(f"every working device is full ({self.open_streams} streams open); finish or drop a "
                                f"stream, or retry later")

    def device_of(self, stream: VocoderStream) -> str:
        """The name of the device a stream was placed on."""
        for name, vocoder in zip(self.names, self.vocoders):
            if stream._v is vocoder:
                return name
        raise ValueError("the stream is not one of this vocoder's")

    def _failures(self) -> str:
        return "; ".join(f"{n}: {type(v.failure).__name__}: {v.failure}" for n, v in zip(self.names, self.vocoders)
                         if v.failure is not None)

    # ---- what a StreamingVocoder offers, over every device ------------------------------------------------------------
    @property
    def open_streams(self) -> int:
        return sum(v.open_streams for v in self.vocoders)

    @property
    def open_streams_by_device(self) -> dict[str, int]:
        return {n: v.open_streams for n, v in zip(self.names, self.vocoders)}

    @property
    def failed_devices(self) -> list[str]:
        return [n for n, v in zip(self.names, self.vocoders) if v.failure is not None]

    @property
    def pushes_in_progress(self) -> int:
        return sum(v.pushes_in_progress for v in self.vocoders)

    def reap(self) -> int:
        return sum(v.reap() for v in self.vocoders)

    def warmup(self, progress: Callable[[str], None] | None = None) -> None:
        for name, vocoder in zip(self.names, self.vocoders):
            vocoder.warmup(progress=None if progress is None else (lambda m, n=name: progress(f"{n}: {m}")))

    def vocode(self, mel: np.ndarray) -> np.ndarray:
        """One offline pass, on the least-loaded working device."""
        working = [v for v in self.vocoders if v.failure is None] or self.vocoders
        return min(working, key=lambda v: v.open_streams).vocode(mel)

    def close(self) -> None:
        for vocoder in self.vocoders:
            vocoder.close()

    def __getattr__(self, name: str) -> Any:  # settings every device shares (phase_mode, step_sizes, noise, ...)
        if name.startswith("_") or name == "vocoders":
            raise AttributeError(name)
        return getattr(self.vocoders[0], name)
