"""An experiment for the compiled engine's cold start: its five step compiles (the stream step at each step size and
the final step), each in a process of its own, side by side, into inductor's on-disk cache; a warmup after it then
loads every compile from the cache. Not a test, and not in the engine yet: it reports the wall time of the parallel
compiles (compare with ``load_test.py``'s ``open_and_warmup_s`` cold and warm, run after this in the same cache).

    python benchmarks/precompile.py --artifacts DIR --precision tf32 [--slots 3100] [--workers 5] [--out R.json]

The cache key of a compile holds the graph and its inputs' shapes, so every setting that shapes them must be the
engine's: the precision, the device cache slots (``--slots``, ``CudaOptions.slots``: the cache pool is an input) and
the step sizes (the engine's ``STEP_SIZES``). Set ``TORCHINDUCTOR_CACHE_DIR`` the same for this and the engine, or
leave both at inductor's default.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def compile_one(artifacts: str, precision: str, slots: int, device: str, kind: str, size: int,
                conv_layout: str | None = None) -> float:
    """Compile one step shape as the engine's warmup compiles it (``CompiledBackend.compile_shape``); seconds.
    ``conv_layout``: the engine's (None: the precision's)."""
    from hift_runtime.compiled import CompiledBackend
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.streaming import StreamConstants

    manifest = read_manifest(artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    backend = CompiledBackend(manifest, constants, device=device, precision=precision, slots=slots,
                              compile=True, conv_layout=conv_layout)
    # The noise table is read by the eager source only (outside the compiled part): a short one serves.
    backend.use_noise_table(NoiseTable.seeded(0, 4 * 24 * constants.samples_per_frame, constants.num_sines))
    return backend.compile_shape(kind, size)


def shapes(artifacts: str) -> list[tuple[str, int]]:
    """The compiled engine's compile units: the stream step at each of its step sizes, the final step."""
    from hift_runtime.compiled import STEP_SIZES
    from hift_runtime.manifest import read_manifest
    from hift_runtime.streaming import StreamConstants

    manifest = read_manifest(artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    return [("generator", size) for size in STEP_SIZES] + [("final", constants.mel_look_ahead)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--slots", type=int, default=2048, help="the engine's device cache slots (CudaOptions.slots)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (inductor's C++ backend: to try it)")
    p.add_argument("--workers", type=int, default=5, help="compiles side by side (default: all five)")
    p.add_argument("--shapes", help="only these, e.g. generator:24,final:4 (default: the engine's five)")
    p.add_argument("--conv-layout", choices=["channels-first", "channels-last"], default=None,
                   help="the engine's convolution layout (default: the precision's; as the engine's must be)")
    p.add_argument("--out", help="a JSON of the wall times")
    p.add_argument("--one", help=argparse.SUPPRESS)  # KIND:SIZE: this process compiles that shape only
    args = p.parse_args()
    if args.one:
        kind, size = args.one.split(":")
        print(json.dumps({"shape": args.one, "seconds": round(compile_one(
            args.artifacts, args.precision, args.slots, args.device, kind, int(size), args.conv_layout), 1)}),
              flush=True)
        return

    def run(shape: tuple[str, int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        command = [sys.executable, __file__, "--artifacts", args.artifacts, "--precision", args.precision,
                   "--slots", str(args.slots), "--device", args.device, "--one", f"{shape[0]}:{shape[1]}"]
        command += ["--conv-layout", args.conv_layout] if args.conv_layout else []
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode != 0:
            raise RuntimeError(f"compiling {shape} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["process_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        return row

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        todo = ([(k, int(n)) for k, n in (item.split(":") for item in args.shapes.split(","))] if args.shapes
                else shapes(args.artifacts))
        rows = list(pool.map(run, todo))
    result = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/precompile.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "one"),
              "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(inductor's default)"),
              "wall_s": round(time.perf_counter() - started, 1), "compiles": rows}
    print(json.dumps({k: result[k] for k in ("wall_s", "cache_dir")}), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
