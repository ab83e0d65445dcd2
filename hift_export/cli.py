"""``hift-export``: checkpoint -> artifacts folder. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hift_runtime.argparsing import OneLineArgumentParser

from .checkpoint import CheckpointError
from .config import COSYVOICE3
from .model import DEFAULT_SEED


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="hift-export",
        description="Export the CosyVoice3 HiFT vocoder (generator + F0 predictor) to ONNX and TorchScript.")
    p.add_argument("--checkpoint", help="upstream hift.pt (any accepted key spelling); omit for seeded random "
                                        "weights (a demo, not a trained vocoder)")
    p.add_argument("--out", default="artifacts", help="output folder (default: artifacts/)")
    p.add_argument("--formats", default="onnx,torchscript",
                   help="comma-separated subset of onnx,torchscript (default: both)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, >= 18 (default 18)")
    p.add_argument("--f0-precision", default="fp64", choices=["fp64", "fp32"],
                   help="arithmetic inside the F0 graph (inputs/outputs are float32 either way): fp64 reproduces "
                        "upstream's float64 F0 exactly (default); fp32 is ~20%% faster but length-dependent rounding "
                        "costs ~10 dB of streaming parity")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random default weights")
    p.add_argument("--window-frames", type=int, default=COSYVOICE3.window_frames,
                   help="default streaming window history recorded in the manifest (frames, default 64)")
    p.add_argument("--reduced", action="store_true", help=argparse.SUPPRESS)  # narrow test config
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.window_frames < 1:
        print("hift-export: error: --window-frames must be >= 1", file=sys.stderr)
        return 2
    try:
        from .export import ExportError, export_artifacts

        config = COSYVOICE3.reduced() if args.reduced else COSYVOICE3
        export_artifacts(args.checkpoint, args.out, formats=formats, opset=args.opset, f0_precision=args.f0_precision,
                         config=config, seed=args.seed, window_frames=args.window_frames)
    except (CheckpointError, ExportError, ValueError, OSError) as exc:
        print(f"hift-export: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
