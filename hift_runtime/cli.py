"""``hift-vocode``: mel -> 24 kHz audio with the streaming runtime. Errors are one line on stderr, exit code 2;
a failed ``--check`` exits 1."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .argparsing import OneLineArgumentParser
from .audio_io import read_mel, write_wav
from .manifest import ArtifactError
from .streaming import MelError, StreamError, StreamingVocoder, validate_mel


def parse_schedule(text: str) -> list[int]:
    """``"24"`` (fixed size) or ``"30,60,120,90"`` (a schedule; its last size repeats until the mel is consumed)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--chunks must be an integer or a comma-separated list of integers, got {text!r}") from None
    if not sizes or any(s < 0 for s in sizes) or sizes[-1] == 0:
        raise ValueError(f"--chunks sizes must be >= 0 and the last one > 0, got {text!r}")
    return sizes


def chunk_sizes(schedule: Sequence[int], frames: int) -> list[int]:
    out, pos, i = [], 0, 0
    while pos < frames:
        size = min(schedule[min(i, len(schedule) - 1)], frames - pos)
        out.append(size)
        pos += size
        i += 1
    return out


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled and total > 0, 0

    def update(self, n: int) -> None:
        if not self.enabled:
            return
        self.done += n
        filled = int(30 * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} frames")
        sys.stderr.flush()
        if self.done >= self.total:
            sys.stderr.write("\n")


def _stream(vocoder: StreamingVocoder, mel: np.ndarray, sizes: Sequence[int], progress: _Progress) -> Iterator[np.ndarray]:
    stream = vocoder.stream()
    pos = 0
    for size in sizes:
        yield stream.push(mel[:, pos:pos + size])
        pos += size
        progress.update(size)
    yield stream.finish()


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="hift-vocode", description="Vocode a mel with the exported CosyVoice3 HiFT.")
    p.add_argument("--artifacts", required=True, help="folder written by hift-export")
    p.add_argument("--mel", required=True, help="input mel, .npy or .npz ([80, T] or [1, 80, T] natural-log mel)")
    p.add_argument("--out", required=True, help="output .wav (24 kHz) or .npy (float32 samples)")
    p.add_argument("--chunks", default="24", help="chunk size in frames, or a schedule like 30,60,120,90 "
                                                  "(its last size repeats; default 24)")
    p.add_argument("--offline", action="store_true", help="one offline pass instead of streaming")
    p.add_argument("--noise-table", help="upstream noise table dumped to .npy, shape (N, 9) or (1, N, 9)")
    p.add_argument("--noise-seed", type=int, default=0, help="seed of the generated noise table (default 0)")
    p.add_argument("--window-frames", type=int, help="window history in frames (default: the manifest's, 64)")
    p.add_argument("--phase", choices=["upstream", "wrapped"], default="upstream",
                   help="carried phase: upstream rounding (default) or wrapped (more accurate on long streams)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="generator device")
    p.add_argument("--pcm16", action="store_true", help="write 16-bit PCM WAV instead of float32")
    p.add_argument("--check", action="store_true",
                   help="also run eager PyTorch through the same bookkeeping and compare (needs torch + hift_export)")
    p.add_argument("--checkpoint", help="checkpoint for --check when the manifest's path is not available")
    p.add_argument("--report", help="--check JSON report path (default: OUT with .parity.json)")
    p.add_argument("--plot", help="--check PNG plot path (default: OUT with .parity.png)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log line")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    try:
        if out.suffix not in (".wav", ".npy"):
            raise ValueError(f"--out must end in .wav or .npy, got {out.name!r}")
        if not out.parent.is_dir():
            raise FileNotFoundError(f"output folder {out.parent} does not exist")
        from .sessions import open_vocoder

        schedule = parse_schedule(args.chunks)
        vocoder = open_vocoder(args.artifacts, device=args.device, window_frames=args.window_frames,
                               noise_table=args.noise_table, noise_seed=args.noise_seed, phase=args.phase)
        mel = validate_mel(read_mel(args.mel), vocoder.constants.in_channels)
        sizes = chunk_sizes(schedule, mel.shape[1])
        spf = vocoder.constants.samples_per_frame
        sample_rate = int(vocoder.backend.manifest.config["sampling_rate"])  # type: ignore[attr-defined]
        started = time.perf_counter()
        if args.offline:
            audio = vocoder.vocode(mel)
            mode = "offline"
        else:
            progress = _Progress(mel.shape[1], enabled=not args.quiet and len(sizes) > 20)
            audio = np.concatenate(list(_stream(vocoder, mel, sizes, progress)))
            mode = f"streamed {len(sizes)} chunks"
        wall = time.perf_counter() - started
        assert audio.shape[0] == spf * mel.shape[1]
        if out.suffix == ".wav":
            write_wav(out, audio, sample_rate, pcm16=args.pcm16)
        else:
            np.save(out, audio.astype(np.float32))
        seconds = audio.shape[0] / sample_rate
        print(f"hift-vocode: {mode}: {mel.shape[1]} frames -> {seconds:.2f} s of audio in {wall:.2f} s "
              f"(RTF {wall / max(seconds, 1e-9):.3f}, {vocoder.backend.name}) -> {out}")
        if args.check:
            return _check(args, vocoder, mel, sizes, out, sample_rate)
    except (ArtifactError, MelError, StreamError, ValueError, TypeError, OSError) as exc:
        print(f"hift-vocode: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _check(args: argparse.Namespace, vocoder: StreamingVocoder, mel: np.ndarray, sizes: Sequence[int], out: Path,
           sample_rate: int) -> int:
    try:
        from hift_export.parity import plot_parity, reference_backend, run_parity
    except ImportError as exc:
        raise ValueError(f"--check needs torch and hift_export ({exc}); install the project with its [export] "
                         f"extra") from exc
    reference = reference_backend(vocoder.backend.manifest, args.checkpoint)  # type: ignore[attr-defined]
    report, ours, theirs = run_parity(vocoder, reference, mel, sizes)
    report_path = Path(args.report) if args.report else out.with_suffix(".parity.json")
    plot_path = Path(args.plot) if args.plot else out.with_suffix(".parity.png")
    report_path.write_text(report.to_json())
    plot_parity(report, ours, theirs, plot_path, sample_rate)
    verdict = "PASS" if report.passed else "FAIL"
    print(f"hift-vocode --check: {verdict}: stage F0 rel {report.stage_f0_relative_max:.2e}, stage audio "
          f"{report.stage_audio_max_abs:.2e}, end-to-end max abs {report.end_to_end_max_abs:.2e} / "
          f"{report.end_to_end_snr_db:.1f} dB -> {report_path}, {plot_path}")
    print(json.dumps({"per_chunk_max_abs": [round(c.max_abs, 9) for c in report.chunks]}))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
