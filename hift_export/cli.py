"""``hift-export``: checkpoint -> artifacts folder. Errors are one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hift_model.config import DEFAULT_SEED
from hift_runtime.argparsing import OneLineArgumentParser, gpu_ids, positive_int

from .triton_repo import DEFAULT_MAX_STREAMS


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="hift-export",
        description="Export the CosyVoice3 HiFT vocoder (generator + F0 predictor) to ONNX, TorchScript and the "
                    "compiled engine's folded weights.")
    p.add_argument("--checkpoint", help="upstream hift.pt (any accepted key spelling); omit for seeded random "
                                        "weights (a demo, not a trained vocoder)")
    p.add_argument("--out", default="artifacts", help="output folder (default: artifacts/)")
    p.add_argument("--formats", default="onnx,torchscript,weights",
                   help="comma-separated subset of onnx,torchscript,weights (default: all; weights = the folded "
                        "weights the compiled engine loads)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset, >= 18 (default 18)")
    p.add_argument("--f0-precision", default="fp64", choices=["fp64", "fp32"],
                   help="arithmetic inside the F0 graph (inputs/outputs are float32 either way): fp64 reproduces "
                        "upstream's float64 F0 exactly (default); fp32 is ~20%% faster but its length-dependent "
                        "rounding makes streamed audio differ from one pass by ~1e-3 (50 dB)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random default weights")
    p.add_argument("--triton-repo", help="also write a model repository for a stock Triton server (onnxruntime "
                                         "backend; one model, hift_vocoder, a Triton sequence per stream) into this "
                                         "folder")
    p.add_argument("--triton-max-streams", type=positive_int, default=DEFAULT_MAX_STREAMS,
                   help=f"streams the repository holds at once: more wait for a free one at most the START timeout, "
                        f"then are refused; set it to what the host keeps in real time (default {DEFAULT_MAX_STREAMS})")
    p.add_argument("--triton-gpus", type=gpu_ids, default=None,
                   help="GPU ids the Triton model gets one instance on, e.g. 0,1 (default: one instance, on a GPU "
                        "where Triton has one, else on the CPU); a stream stays on the instance that took its start")
    p.add_argument("--noise-seed", type=int, default=0,
                   help="seed of the noise the Triton model computes in-graph (default 0, as the runtime's)")
    p.add_argument("--reduced", action="store_true", help=argparse.SUPPRESS)  # narrow test config
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import importlib.util

    args = _parser().parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if importlib.util.find_spec("torch") is None:
        print("hift-export: error: the export needs torch: pip install torch==2.13.0 && pip install -e '.[export]'",
              file=sys.stderr)
        return 2
    from hift_model.checkpoint import CheckpointError
    from hift_model.config import COSYVOICE3

    from .export import ExportError

    try:
        from .export import export_artifacts

        config = COSYVOICE3.reduced() if args.reduced else COSYVOICE3
        if "onnx" not in formats and args.triton_repo:
            raise ValueError("--triton-repo needs the onnx format (it is built from the ONNX step graphs)")
        export_artifacts(args.checkpoint, args.out, formats=formats, opset=args.opset, f0_precision=args.f0_precision,
                         config=config, seed=args.seed)
        if args.triton_repo:
            from pathlib import Path

            from hift_runtime.manifest import read_manifest

            from .triton_repo import write_triton_repository

            write_triton_repository(read_manifest(args.out), Path(args.triton_repo),
                                    max_streams=args.triton_max_streams, noise_seed=args.noise_seed,
                                    gpus=args.triton_gpus)
    except (CheckpointError, ExportError, ValueError, OSError) as exc:
        print(f"hift-export: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
