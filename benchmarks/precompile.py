"""The compiled engine's side-by-side compiles alone (what its first ``warmup()`` runs before loading them from
inductor's cache, :mod:`hift_torch.compile_workers`), timed apart: the stream step at each step size and the final
step, each in a process of its own. Not a test: it reports the wall time (compare with ``load_test.py``'s
``open_and_warmup_s`` run after it in the same cache).

    python benchmarks/precompile.py --artifacts DIR --precision tf32 [--slots 3100] [--workers 5] [--out R.json]

The cache key of a compile holds the graph and its inputs' shapes, so every setting that shapes them must be the
engine's: the precision, the convolution layout and the step sizes (the engine's ``STEP_SIZES``). The device cache
slots (``--slots``, ``CudaOptions.slots``) need not be: the cache pool's rows are dynamic (``slots_cache.py``).
Set ``TORCHINDUCTOR_CACHE_DIR`` the same for this and the engine, or leave both at inductor's default.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--slots", type=int, default=2048, help="the engine's device cache slots (CudaOptions.slots)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (eager: to try the script)")
    p.add_argument("--workers", type=int, default=5, help="compiles side by side (default: all five)")
    p.add_argument("--shapes", help="only these, e.g. generator:24,final:4 (default: the engine's five)")
    p.add_argument("--conv-layout", choices=["channels-first", "channels-last"], default=None,
                   help="the engine's convolution layout (default: the precision's; as the engine's must be)")
    p.add_argument("--cache-layout", choices=["channels-first", "channels-last"], default="channels-first",
                   help="the engine's cache rows (CudaOptions.cache_layout)")
    p.add_argument("--out", help="a JSON of the wall times")
    args = p.parse_args()

    from hift_torch.compile_workers import compile_side_by_side, compile_units, worker_command
    from hift_torch.compiled import DEFAULT_CONV_LAYOUT, STEP_SIZES
    from hift_runtime.manifest import read_manifest
    from hift_runtime.contract import StreamConstants

    manifest = read_manifest(args.artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    units = ([(k, int(n)) for k, n in (item.split(":") for item in args.shapes.split(","))] if args.shapes
             else compile_units(STEP_SIZES, constants.mel_look_ahead))
    # What worker_command reads of a backend, without building one here (no device memory in this process).
    engine = SimpleNamespace(manifest=manifest, precision=args.precision, cache_slots=args.slots, device=args.device,
                             conv_layout=args.conv_layout or DEFAULT_CONV_LAYOUT[args.precision],
                             cache_layout=args.cache_layout)
    started = time.perf_counter()
    seconds = compile_side_by_side({f"{k}:{n}": worker_command(engine, k, n) for k, n in units}, args.workers,
                                   lambda msg: print(msg, flush=True))
    result = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/precompile.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(inductor's default)"),
              "wall_s": round(time.perf_counter() - started, 1),
              "process_s": {k: None if v is None else round(v, 1) for k, v in seconds.items()}}
    print(json.dumps({k: result[k] for k in ("wall_s", "cache_dir")}), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
