"""``hift-vocode``: mel -> 24 kHz audio with the streaming runtime. Errors are one line on stderr, exit code 2;
a failed ``--check`` exits 1."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .argparsing import OneLineArgumentParser
from .audio_io import SUBTYPES, AudioFormatError, check_audio_path, read_mel, write_audio
from .errors import MelError, StreamError
from .manifest import ArtifactError
from .mel_input import validate_mel
from .noise import NoiseTableError
from .opening import PARITY_CHECK, torch_side
from .options import ENGINES, PRECISIONS
from .process_tuning import keep_freed_memory
from .streaming import StreamingVocoder
from .wire import ServerError


class UsageError(ValueError):
    """A command-line value that cannot be used; the message names the option."""


def parse_schedule(text: str) -> list[int]:
    """``"24"`` (fixed size) or ``"30,60,120,90"`` (a schedule; its last size repeats until the mel is consumed)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--chunks must be an integer or a comma-separated list of integers, got {text!r}") from None
    if not sizes or any(s < 0 for s in sizes) or sizes[-1] == 0:
        raise UsageError(f"--chunks sizes must be >= 0 and the last one > 0, got {text!r}")
    return sizes


def chunk_sizes(schedule: Sequence[int], frames: int) -> list[int]:
    """The chunks a schedule cuts ``frames`` into. Zero sizes in the schedule send nothing (in-process and through a
    server alike: a server request carries at least one frame)."""
    out, pos, i = [], 0, 0
    while pos < frames:
        size = min(schedule[min(i, len(schedule) - 1)], frames - pos)
        if size:
            out.append(size)
        pos += size
        i += 1
    return out


def _chunks_with_progress(mel: np.ndarray, sizes: Sequence[int], quiet: bool) -> Iterator[tuple[np.ndarray, bool]]:
    """``(chunk, is_last)`` for each size, with a progress bar on stderr (in-process and through a server alike)."""
    from tqdm import tqdm

    pos = 0
    with tqdm(total=mel.shape[1], unit="frame", disable=quiet, leave=False, file=sys.stderr,
              desc="hift-vocode") as progress:
        for i, size in enumerate(sizes):
            yield mel[:, pos:pos + size], i == len(sizes) - 1
            pos += size
            progress.update(size)


def _stream(vocoder: StreamingVocoder, mel: np.ndarray, sizes: Sequence[int], quiet: bool) -> Iterator[np.ndarray]:
    stream = vocoder.stream()
    for chunk, _ in _chunks_with_progress(mel, sizes, quiet):
        yield stream.push(chunk)
    yield stream.finish()


def _wav_mel(path: str, say: Any = print) -> np.ndarray:
    from .audio_io import read_audio
    from .mel import COSYVOICE3_MEL, mel_spectrogram, resample

    audio, rate, channels = read_audio(path)
    changes = ([f"{channels} channels averaged to mono"] if channels > 1 else []) + (
        [f"resampled from {rate} Hz to {COSYVOICE3_MEL.sample_rate} Hz"] if rate != COSYVOICE3_MEL.sample_rate else [])
    if changes:
        say(f"hift-vocode: note: --wav {path}: {', '.join(changes)}", flush=True)
    try:
        return mel_spectrogram(resample(audio, rate, COSYVOICE3_MEL.sample_rate))
    except ValueError as exc:  # too short for one frame
        raise UsageError(f"--wav {path}: {exc}") from exc


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="hift-vocode", description="Vocode a mel with the exported CosyVoice3 HiFT.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--artifacts", help="folder written by hift-export (vocode in this process)")
    where.add_argument("--server", help="a running hift-serve: HOST:PORT (gRPC), grpc://HOST:PORT or "
                                        "http://HOST:PORT (stream the chunks through it); several, comma-separated "
                                        "(hift-serve --processes, several hosts): the stream goes to the one its id "
                                        "picks (ShardedClient)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--mel", help="input mel, .npy or .npz ([80, T] or [1, 80, T] natural-log mel)")
    source.add_argument("--wav", help="input speech (any format libsndfile reads, any rate and channel count: "
                                      "several channels are averaged to mono and other rates resampled to 24 kHz, "
                                      "each said in one line); its CosyVoice3 mel is vocoded (copy synthesis)")
    p.add_argument("--out", required=True, help="output audio by extension: .wav (24-bit PCM unless --subtype), "
                                                ".flac, .ogg, or .npy (float32 samples)")
    p.add_argument("--subtype", choices=SUBTYPES, help="sample format of .wav/.flac (default PCM_24)")
    p.add_argument("--chunks", default="24", help="chunk size in frames, or a schedule like 30,60,120,90 "
                                                  "(its last size repeats; default 24)")
    p.add_argument("--offline", action="store_true", help="one offline pass instead of streaming")
    p.add_argument("--noise-table", help="upstream noise table dumped to .npy, shape (N, 9) or (1, N, 9)")
    p.add_argument("--noise-seed", type=int, help="seed of the generated noise table (default 0)")
    p.add_argument("--phase", choices=["upstream", "wrapped"],
                   help="carried phase: upstream rounding (default) or wrapped (more accurate on long streams)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], help="generator device (default auto)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default): the compiled engine on a CUDA device when torch with CUDA is installed, "
                        "else ONNX Runtime; ort; compiled (torch.compile and CUDA graphs on CUDA; on the CPU the "
                        "same step eagerly, slower than ort)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default, TF32 off: parity), tf32, fp16 (compiled engine only); see BENCHMARKS.md")
    p.add_argument("--check", action="store_true",
                   help="also run eager PyTorch through the same bookkeeping and compare (needs the [export] extra)")
    p.add_argument("--checkpoint", help="checkpoint for --check when the manifest's path is not available")
    p.add_argument("--report", help="--check JSON report path (default: OUT with .parity.json)")
    p.add_argument("--plot", help="--check PNG plot path (default: OUT with .parity.png)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return p


def _one_line_warnings() -> None:
    """Warnings as one ``hift-vocode: warning: ...`` line on stderr (not Python's two lines with a source line)."""
    import warnings

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"hift-vocode: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:  # no output file is written before the audio is whole
        print("hift-vocode: interrupted", file=sys.stderr)
        return 130


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _needs(args: argparse.Namespace) -> None:
    """What the run needs and a runtime-only install lacks, said before any work, with the extra to install."""
    import importlib.util

    if args.server and importlib.util.find_spec("tritonclient") is None:
        raise UsageError("--server needs tritonclient: pip install -e '.[serve]' (or pip install "
                         "'tritonclient[grpc,http]')")
    if args.check:
        try:
            torch_side(PARITY_CHECK, "--check")
        except ArtifactError as exc:
            raise UsageError(str(exc)) from exc


def _run(args: argparse.Namespace) -> int:
    say = (lambda *a, **k: None) if args.quiet else print
    _one_line_warnings()
    keep_freed_memory()
    out = Path(args.out)
    try:
        check_audio_path(out, args.subtype)
        schedule = parse_schedule(args.chunks)
        _needs(args)
        if args.server:
            return _via_server(args, schedule, out, say)
        from .opening import open_vocoder

        # One stream: no batching; warmup() captures the few step shapes it meets (a no-op on the CPU).
        vocoder = open_vocoder(args.artifacts, device=args.device or "auto", noise_table=args.noise_table,
                               noise_seed=args.noise_seed or 0, phase=args.phase or "upstream", batching=False,
                               engine=args.engine, precision=args.precision)
        vocoder.warmup(progress=lambda message: say(f"hift-vocode: {message}", flush=True))
        mel = validate_mel(read_mel(args.mel) if args.mel else _wav_mel(args.wav, say),
                           vocoder.constants.in_channels, whole=args.mel or f"the mel of {args.wav}")
        sizes = chunk_sizes(schedule, mel.shape[1])
        sample_rate = vocoder.constants.sample_rate
        say(f"hift-vocode: generator on {vocoder.backend.name} ({vocoder.engine_reason}); {mel.shape[1]} frames "
            f"({mel.shape[1] * vocoder.constants.samples_per_frame / sample_rate:.2f} s of audio)", flush=True)
        started = time.perf_counter()
        if args.offline:
            audio = vocoder.vocode(mel)
            mode = "offline"
        else:
            audio = np.concatenate(list(_stream(vocoder, mel, sizes, quiet=args.quiet)))
            mode = f"streamed {_plural(len(sizes), 'chunk')}"
        wall = time.perf_counter() - started
        write_audio(out, audio, sample_rate, args.subtype)
        seconds = audio.shape[0] / sample_rate
        say(f"hift-vocode: {mode}: {seconds:.2f} s of audio in {wall:.2f} s (RTF {wall / max(seconds, 1e-9):.3f}) "
            f"-> {out}")
        if args.check:
            return _check(args, vocoder, mel, sizes, out, sample_rate, say)
    except (ArtifactError, MelError, StreamError, UsageError, AudioFormatError, NoiseTableError, ServerError,
            OSError, ValueError) as exc:  # (ValueError: an option the engine refuses, said in its own words)
        print(f"hift-vocode: error: {exc}", file=sys.stderr)
        return 2
    return 0


# Settings of the server's vocoder (hift-serve takes them), not of a client.
_SERVER_SIDE = {"offline": "--offline", "noise_table": "--noise-table", "noise_seed": "--noise-seed",
                "phase": "--phase", "device": "--device", "check": "--check"}


def _via_server(args: argparse.Namespace, schedule: Sequence[int], out: Path, say) -> int:
    """Stream the mel through a running hift-serve; the same chunks, output and messages as in-process."""
    given = [flag for key, flag in _SERVER_SIDE.items() if getattr(args, key) not in (None, False)]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be used with --server: they are the server's settings "
                         f"(see hift-serve --help)")
    from .client import ServerClient, ShardedClient

    urls = [url.strip() for url in args.server.split(",") if url.strip()]
    if not urls:
        raise UsageError("--server names no address: give HOST:PORT (several comma-separated)")
    client: ServerClient | ShardedClient = ServerClient(urls[0]) if len(urls) == 1 else ShardedClient(urls)
    try:
        mel = validate_mel(read_mel(args.mel) if args.mel else _wav_mel(args.wav, say), client.in_channels,
                           whole=args.mel or f"the mel of {args.wav}")
        if mel.shape[1] == 0:
            raise UsageError("the mel has no frames: nothing to send")
        sizes = chunk_sizes(schedule, mel.shape[1])
        say(f"hift-vocode: streaming {mel.shape[1]} frames in {_plural(len(sizes), 'chunk')} through {args.server}",
            flush=True)
        stream = client.stream()
        started = time.perf_counter()
        pieces = [stream.push(chunk, end=last) for chunk, last in _chunks_with_progress(mel, sizes, args.quiet)]
        wall = time.perf_counter() - started
    finally:
        client.close()
    audio = np.concatenate(pieces)
    sample_rate = int(stream.sample_rate)
    write_audio(out, audio, sample_rate, args.subtype)
    seconds = audio.shape[0] / sample_rate
    say(f"hift-vocode: streamed {_plural(len(sizes), 'chunk')} via {stream.client.url}: {seconds:.2f} s of audio in "
        f"{wall:.2f} s (RTF {wall / max(seconds, 1e-9):.3f}) -> {out}")
    return 0


def _check(args: argparse.Namespace, vocoder: StreamingVocoder, mel: np.ndarray, sizes: Sequence[int], out: Path,
           sample_rate: int, say) -> int:
    try:
        parity = torch_side(PARITY_CHECK, "--check")
    except ArtifactError as exc:
        raise UsageError(str(exc)) from exc
    CheckpointError, plot_parity, reference_backend, run_parity = (  # noqa: N806 - the module's names
        parity.CheckpointError, parity.plot_parity, parity.reference_backend, parity.run_parity)
    say("hift-vocode --check: loading the eager reference and replaying every step on it ...", flush=True)
    try:
        reference = reference_backend(vocoder.backend.manifest, args.checkpoint)  # type: ignore[attr-defined]
    except CheckpointError as exc:
        raise UsageError(f"--check: {exc}") from exc
    report, ours, theirs = run_parity(vocoder, reference, mel, sizes)
    report_path = Path(args.report) if args.report else out.with_suffix(".parity.json")
    plot_path = Path(args.plot) if args.plot else out.with_suffix(".parity.png")
    report_path.write_text(report.to_json())
    plot_parity(report, ours, theirs, plot_path, sample_rate)
    verdict = "PASS" if report.passed else "FAIL"
    say(f"hift-vocode --check: {verdict}: stage F0 rel {report.stage_f0_relative_max:.2e}, stage audio "
        f"{report.stage_audio_max_abs:.2e}, end-to-end max abs {report.end_to_end_max_abs:.2e} / "
        f"{report.end_to_end_snr_db:.1f} dB -> {report_path}, {plot_path}")
    say(json.dumps({"per_chunk_max_abs": [round(c.max_abs, 9) for c in report.chunks]}))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
