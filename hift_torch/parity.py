"""Parity of the ORT runtime against eager PyTorch, through the same streaming bookkeeping.

Two comparisons per chunk:

* **step by step**: every step the ORT stream runs is replayed on the eager step with identical inputs and caches
  (same mel, F0, noise, carried phase): F0 relative to max |F0|, audio max abs, next caches (scale-relative);
* **end to end**: an independent eager stream (its own F0, its own carried phase): max abs and SNR per chunk.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hift_model.checkpoint import CheckpointError
from hift_model.config import HiFTConfig
from hift_model.model import load_hift
from hift_model.step import F0_PRECISIONS
from hift_runtime.engine import EngineTraits, VocoderBackend
from hift_runtime.manifest import Manifest, sha256_file
from hift_runtime.metrics import max_abs, snr_db
from hift_runtime.streaming import StreamingVocoder

from .eager import TorchBackend, torch_vocoder

# Tolerances (issue 4): stage F0 within 1e-5 of max |F0|, stage audio 1e-5 max abs, end to end >= 60 dB.
STAGE_F0_RELATIVE = 1e-5
STAGE_AUDIO = 1e-5
END_TO_END_SNR_DB = 60.0


def _numpy(caches: Any) -> dict[str, np.ndarray]:
    return {k: (v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)) for k, v in caches.items()}


class ReplayingBackend:
    """Runs ``primary`` and replays each step on ``reference`` with the same inputs and the same caches, recording
    the differences of the outputs and of the next caches."""

    def __init__(self, primary: VocoderBackend, reference: VocoderBackend) -> None:
        self.primary, self.reference = primary, reference
        self.name = f"{primary.name}+replay({reference.name})"
        self.traits = EngineTraits(step_sizes=primary.traits.step_sizes, caches_in_place=primary.traits.caches_in_place)
        self.f0_relative: list[float] = []
        self.audio_max_abs: list[float] = []
        self.cache_error: list[float] = []

    def new_caches(self, kind: str, batch: int = 1) -> Any:
        return self.primary.new_caches(kind, batch)

    def warmup(self, step_sizes: tuple[int, ...] | None, progress: Any = None) -> None:
        self.primary.warmup(step_sizes, progress)

    def stream_capacity(self) -> int:
        return self.primary.stream_capacity()

    def _compare_caches(self, ours: Any, theirs: Any) -> None:
        if ours is not None:
            a, b = _numpy(ours), _numpy(theirs)
            # Relative to each cache's scale where it exceeds 1 (resblock caches reach ~100, where a float32 ulp is 8e-6).
            self.cache_error.append(max((max_abs(a[k], b[k]) / max(1.0, float(np.max(np.abs(b[k])))) for k in a),
                                          default=0.0))

    def f0_step(self, mel: np.ndarray, caches: Any) -> tuple[np.ndarray, Any]:
        out, nxt = self.primary.f0_step(mel, caches)
        ref, ref_nxt = self.reference.f0_step(mel, _numpy(caches))
        self.f0_relative.append(max_abs(out, ref) / max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-6))
        self._compare_caches(nxt, ref_nxt)
        return out, nxt

    def generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                       first: np.ndarray, caches: Any, final: bool) -> tuple[np.ndarray, np.ndarray, Any]:
        audio, phase, nxt = self.primary.generator_step(mel, f0, noise, phase_in, first, caches, final)
        ref_audio, _, ref_nxt = self.reference.generator_step(mel, f0, noise, phase_in, first, _numpy(caches), final)
        self.audio_max_abs.append(max_abs(audio, ref_audio))
        self._compare_caches(nxt, ref_nxt)
        return audio, phase, nxt


@dataclass
class ChunkParity:
    index: int
    frames: int
    samples: int
    max_abs: float
    snr_db: float


@dataclass
class ParityReport:
    backend: str
    reference: str
    frames: int
    schedule: list[int]
    chunks: list[ChunkParity] = field(default_factory=list)
    stage_f0_relative_max: float = 0.0
    stage_audio_max_abs: float = 0.0
    stage_cache_error: float = 0.0
    end_to_end_max_abs: float = 0.0
    end_to_end_snr_db: float = 0.0
    tolerances: dict[str, float] = field(default_factory=lambda: {
        "stage_f0_relative": STAGE_F0_RELATIVE, "stage_audio_max_abs": STAGE_AUDIO, "stage_cache_error": STAGE_AUDIO,
        "end_to_end_snr_db": END_TO_END_SNR_DB})
    passed: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def reference_backend(manifest: Manifest, checkpoint: str | os.PathLike[str] | None = None,
                      device: str = "cpu") -> TorchBackend:
    """Eager model of the weights the manifest was exported from (checked by sha256), F0 in the graph's precision."""
    weights = manifest.data["weights"]
    config = HiFTConfig.from_dict(manifest.config)
    f0_dtype = F0_PRECISIONS[manifest.data["f0_precision"]]
    if weights["source"] == "seeded-random" and checkpoint is None:
        hift = load_hift(None, config=config, seed=int(weights["seed"]), f0_dtype=f0_dtype, device=device,
                         spectral="conv")
    else:
        path = checkpoint if checkpoint is not None else weights.get("path")
        if path is None or not Path(path).is_file():
            raise CheckpointError(f"the reference needs the checkpoint the artifacts came from ({path!r}); pass "
                                    f"--checkpoint PATH")
        if "sha256" in weights and sha256_file(path) != weights["sha256"]:
            raise CheckpointError(f"checkpoint {path} is not the one these artifacts were exported from (sha256 differs)")
        hift = load_hift(str(path), config=config, f0_dtype=f0_dtype, device=device, spectral="conv")
    return TorchBackend(hift)


def run_parity(vocoder: StreamingVocoder, reference: TorchBackend, mel: np.ndarray,
               schedule: Sequence[int]) -> tuple[ParityReport, np.ndarray, np.ndarray]:
    """Stream ``mel`` with ``schedule`` through ``vocoder`` (replayed on ``reference``) and through an independent
    eager stream; return the report and both waveforms."""
    replay = ReplayingBackend(vocoder.backend, reference)
    primary = StreamingVocoder(replay, vocoder.constants, vocoder.noise, phase=vocoder.phase_mode,
                               step_sizes=vocoder.step_sizes)
    eager = torch_vocoder(reference.hift, noise=vocoder.noise, phase=vocoder.phase_mode,
                          step_sizes=vocoder.step_sizes)
    streams = primary.stream(), eager.stream()
    report = ParityReport(backend=vocoder.backend.name, reference=reference.name, frames=int(mel.shape[-1]),
                          schedule=list(schedule))
    outs: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    pos = 0
    chunks = list(schedule) + [None]  # None: finish()
    for i, size in enumerate(chunks):
        pieces = []
        for stream, out in zip(streams, outs):
            piece = stream.finish() if size is None else stream.push(mel[..., pos:pos + size])
            out.append(piece)
            pieces.append(piece)
        if size is not None:
            pos += size
        report.chunks.append(ChunkParity(i, 0 if size is None else size, int(pieces[0].shape[0]),
                                         max_abs(pieces[0], pieces[1]), snr_db(pieces[0], pieces[1])))
    a, b = np.concatenate(outs[0]), np.concatenate(outs[1])
    report.stage_f0_relative_max = max(replay.f0_relative, default=0.0)
    report.stage_audio_max_abs = max(replay.audio_max_abs, default=0.0)
    report.stage_cache_error = max(replay.cache_error, default=0.0)
    report.end_to_end_max_abs = max_abs(a, b)
    report.end_to_end_snr_db = snr_db(a, b)
    report.passed = (report.stage_f0_relative_max <= STAGE_F0_RELATIVE and report.stage_audio_max_abs <= STAGE_AUDIO
                     and report.stage_cache_error <= STAGE_AUDIO and report.end_to_end_snr_db >= END_TO_END_SNR_DB)
    return report, a, b


def plot_parity(report: ParityReport, ours: np.ndarray, reference: np.ndarray, path: str | os.PathLike[str],
                sample_rate: int) -> None:
    """A figure a reviewer can read alone: both waveforms, their difference, each chunk's largest difference against
    the stage tolerance, and the verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    verdict = "PASS" if report.passed else "FAIL"
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), constrained_layout=True)
    fig.suptitle(f"hift-vocode --check: {verdict}  ({report.backend} against {report.reference}, {report.frames} "
                 f"frames in {len(report.chunks)} pushes)", color="C2" if report.passed else "C3", fontsize=12)
    t = np.arange(ours.shape[0]) / sample_rate
    axes[0].plot(t, reference, lw=0.6, label=report.reference)
    axes[0].plot(t, ours, lw=0.6, alpha=0.7, label=report.backend)
    axes[0].set(title="waveforms", xlabel="time (s)", ylabel="amplitude")
    axes[0].legend(loc="upper right")
    axes[1].plot(t, ours.astype(np.float64) - reference, lw=0.6, color="C3")
    axes[1].set(title=f"difference: max abs {report.end_to_end_max_abs:.2e}, SNR {report.end_to_end_snr_db:.1f} dB "
                      f"(bound >= {END_TO_END_SNR_DB:g} dB)", xlabel="time (s)", ylabel="ours - reference")
    idx = [c.index + 1 for c in report.chunks]
    floor = STAGE_AUDIO * 1e-6  # a difference of exactly 0 drawn at the floor, not off the chart
    axes[2].bar(idx, [max(c.max_abs, floor) for c in report.chunks], color="C2", width=0.8)
    axes[2].axhline(STAGE_AUDIO, color="C3", ls="--", lw=1, label=f"tolerance {STAGE_AUDIO:g}")
    axes[2].set_yscale("log")
    axes[2].set_ylim(floor, max(STAGE_AUDIO * 10, max((c.max_abs for c in report.chunks), default=0) * 2))
    axes[2].set(title="largest difference in each push's audio (the last: finish)", xlabel="push",
                ylabel="max abs difference")
    axes[2].set_xticks(idx if len(idx) <= 30 else idx[::max(1, len(idx) // 15)])
    axes[2].legend(loc="upper right")
    fig.savefig(path, dpi=90)
    plt.close(fig)
