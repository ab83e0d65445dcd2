"""Where the compiled engine's warmup goes: ``vocoder.warmup()`` under cProfile, with dynamo's own compile times. Not
a test: it writes what it found. Run it on a warm cache (after a first start, or ``precompile.py``) to see a warm
start's parts: the step graphs loaded from inductor's cache (dynamo's tracing, the cache's loads) and the captures
(cuDNN's benchmark of each batch size's convolutions, then the CUDA graphs).

    python benchmarks/warmup_profile.py --artifacts DIR --precision fp16 [--slots 3100] --out-dir D

Writes ``D/warmup-profile-PRECISION.pstats`` and the top functions by cumulative and by own time as text beside it;
prints the warmup's own summary and ``torch._dynamo.utils.compile_times()``. cProfile slows Python-heavy parts
(dynamo's tracing) more than the device's: compare parts with each other, not with an unprofiled start.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--slots", type=int, default=2048, help="the engine's device cache slots (CudaOptions.slots)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=60, help="functions listed in each text (default 60)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()

    from hift_runtime import CudaOptions, open_vocoder

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    vocoder = open_vocoder(args.artifacts, device=args.device, engine="compiled", precision=args.precision,
                           cuda=CudaOptions(slots=args.slots))
    print(f"open {time.perf_counter() - started:.1f} s", flush=True)
    profile = cProfile.Profile()
    warmup_started = time.perf_counter()
    profile.enable()
    vocoder.warmup(progress=lambda msg: print(msg, flush=True))
    profile.disable()
    print(f"warmup under cProfile {time.perf_counter() - warmup_started:.1f} s, open + warmup "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    stem = out / f"warmup-profile-{args.precision}"
    profile.dump_stats(f"{stem}.pstats")
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(args.top)
        Path(f"{stem}-{key}.txt").write_text(text.getvalue())
    try:
        from torch._dynamo.utils import compile_times

        print(compile_times(repr="str", aggregate=True), flush=True)
    except (ImportError, TypeError) as exc:  # a torch without it, or with another signature
        print(f"dynamo's compile times: not available ({exc})")
    vocoder.close()


if __name__ == "__main__":
    main()
