"""One compile worker of a first start (:mod:`.compile_workers` starts it): builds the engine's backend as the
starting process has it and compiles one step shape into inductor's on-disk cache."""

from __future__ import annotations

import argparse
import json

from hift_runtime.contract import StreamConstants
from hift_runtime.manifest import read_manifest
from hift_runtime.noise import NoiseTable

from .compiled import CompiledBackend


def compile_one(artifacts: str, precision: str, slots: int, device: str, kind: str, size: int,
                final_window: bool = True, step_window: bool = False) -> float:
    """Build the engine's backend as the parent process has it and compile one step shape; seconds."""
    manifest = read_manifest(artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    backend = CompiledBackend(manifest, constants, device=device, precision=precision, slots=slots,
                              final_window=final_window, step_window=step_window)
    # The noise table is read by the eager source only (outside the compiled part): a short one serves.
    backend.use_noise_table(NoiseTable.seeded(0, 4 * 24 * constants.samples_per_frame, constants.num_sines))
    return backend.compile_shape(kind, size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--final-window", choices=["on", "off"], default="on",
                   help="the final step as the engine's window (CompiledBackend(final_window=...))")
    p.add_argument("--step-window", choices=["on", "off"], default="off",
                   help="the stream step as the engine's window (CompiledBackend(step_window=...))")
    p.add_argument("--shape", required=True, help="KIND:FRAMES, e.g. generator:24 or final:28")
    args = p.parse_args(argv)
    kind, size = args.shape.split(":")
    seconds = compile_one(args.artifacts, args.precision, args.slots, args.device, kind, int(size),
                          args.final_window == "on", args.step_window == "on")
    print(json.dumps({"shape": args.shape, "seconds": round(seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
