"""The contract between an export and every engine, read from the manifest: the stream's constants and the cache
layout (torch-free: the exporter writes it, the runtime and the torch engines read it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# A step graph's cache inputs and outputs: these prefixes and the layout's names.
CACHE_PREFIX, NEXT_PREFIX = "cache.", "next."


def cache_io_names(layout: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(input names, output names) of a manifest's cache layout."""
    return [CACHE_PREFIX + e["name"] for e in layout], [NEXT_PREFIX + e["name"] for e in layout]


@dataclass(frozen=True)
class CacheSpec:
    """One cache of a step graph: per-stream shape (no batch axis) and dtype; its initial value is zeros."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> "CacheSpec":
        if entry.get("init", "zeros") != "zeros":
            raise ValueError(f"cache {entry['name']!r} has initial value {entry['init']!r}; this runtime knows 'zeros'")
        return cls(str(entry["name"]), tuple(int(d) for d in entry["shape"]), str(entry["dtype"]))

    def zeros(self, batch: int = 1) -> np.ndarray:
        return np.zeros((batch, *self.shape), np.dtype(self.dtype))


@dataclass(frozen=True)
class StreamConstants:
    """Everything the bookkeeping needs, read from the manifest (config + step contract): never hard-coded here."""

    in_channels: int
    sample_rate: int
    samples_per_frame: int
    f0_look_ahead: int
    mel_look_ahead: int
    source_look_ahead: int
    audio_lag: int
    num_sines: int
    noise_table_length: int
    generator_caches: tuple[CacheSpec, ...]
    f0_caches: tuple[CacheSpec, ...]

    @classmethod
    def from_manifest(cls, config: dict[str, Any], step: dict[str, Any]) -> "StreamConstants":
        d = config["derived"]
        return cls(in_channels=int(config["in_channels"]), sample_rate=int(config["sampling_rate"]),
                   samples_per_frame=int(d["samples_per_frame"]),
                   f0_look_ahead=int(step["f0_look_ahead_frames"]), mel_look_ahead=int(step["mel_look_ahead_frames"]),
                   source_look_ahead=int(step["source_look_ahead_frames"]), audio_lag=int(step["audio_lag_frames"]),
                   num_sines=int(d["num_sines"]), noise_table_length=int(d["noise_table_length"]),
                   generator_caches=tuple(CacheSpec.from_manifest(e) for e in step["generator_caches"]),
                   f0_caches=tuple(CacheSpec.from_manifest(e) for e in step["f0_caches"]))

    def step_frames(self, size: int, final: bool = False) -> tuple[int, int]:
        """``(mel frames, source frames)`` a generator step over ``size`` frames reads: a stream step its mel and
        source look-aheads beyond them, the final step (zero look-ahead, upstream's ``finalize``) none."""
        if final:
            return size, size
        return size + self.mel_look_ahead, size + self.source_look_ahead

    def f0_mel_frames(self, size: int) -> int:
        """The mel frames an F0 step over ``size`` frames reads (its look-ahead beyond them)."""
        return size + self.f0_look_ahead
