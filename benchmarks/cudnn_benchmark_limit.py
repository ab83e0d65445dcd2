"""How many algorithms cuDNN's benchmark tries per convolution shape (``torch.backends.cudnn.benchmark_limit``; torch's
default 10) against what a warm start's captures cost and how fast the chosen algorithms run. Not a test.

A warm start of the compiled engine spends about a third of its warmup in cuDNN's benchmark (BENCHMARKS.md, "Where a
warm start goes": ``torch.convolution`` 33 s of own time at each batch size's first run). Here the engine's step runs
eagerly (no compile: the convolutions are cuDNN's either way, and nothing else the limit touches differs), every shape
of a warmup is captured, and the 24-frame step's and the final step's graphs are replayed. Each arm runs in a
process of its own (cuDNN's choices are cached per process): a limit, or ``v7``, cuDNN's older API
(``TORCH_CUDNN_V8_API_DISABLED=1``: a timed search with no execution plans to build; whether a torch build still
honours it, the child's ``cudnn_v8_api_disabled_env`` and timings say)::

    python benchmarks/cudnn_benchmark_limit.py --artifacts DIR --precision fp16 --limits 10,4,2,v7 [--slots 3100] \\
        [--out R.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time

REPLAYS = 30
BATCHES = (2, 64, 256)


def one_limit(artifacts: str, precision: str, slots: int, limit: int) -> dict:
    """Warm up an eager engine under ``limit`` and time its graphs' replays."""
    import torch

    from hift_runtime.compiled import STEP_SIZES, CompiledBackend, warmup_summary
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.streaming import StreamConstants

    torch.backends.cudnn.benchmark_limit = limit
    manifest = read_manifest(artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    backend = CompiledBackend(manifest, constants, device="cuda", precision=precision, compile=False, slots=slots)
    backend.use_noise_table(NoiseTable.seeded(0, constants.noise_table_length, constants.num_sines))
    started = time.perf_counter()
    backend.warmup(STEP_SIZES, progress=lambda msg: None)
    warmup_s = time.perf_counter() - started
    replay_ms: dict[str, float] = {}
    for kind, size in (("generator", max(STEP_SIZES)), ("final", backend.final_frames)):
        for batch in BATCHES:
            graph = backend._graphs[(kind, size, batch)].graph
            times = []
            for _ in range(REPLAYS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            replay_ms[f"{kind}@{size}x{batch}"] = round(statistics.median(times), 3)
    return {"limit": limit, "cudnn_v8_api_disabled_env": os.environ.get("TORCH_CUDNN_V8_API_DISABLED"),
            "cudnn_version": torch.backends.cudnn.version(), "warmup_s": round(warmup_s, 1), "summary": warmup_summary(backend.warmup_seconds),
            "replay_ms_median": replay_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--slots", type=int, default=2048, help="the engine's device cache slots (CudaOptions.slots)")
    p.add_argument("--limits", default="10,4,2",
                   help="benchmark limits, each in a process of its own (0: all; v7: cuDNN's older API, torch's limit)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", help="a JSON of the results")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(one_limit(args.artifacts, args.precision, args.slots, args.child)), flush=True)
        return
    rows = []
    for arm in args.limits.split(","):
        v7 = arm == "v7"
        limit = 10 if v7 else int(arm)
        env = dict(os.environ, TORCH_CUDNN_V8_API_DISABLED="1") if v7 else None
        done = subprocess.run([sys.executable, __file__, "--artifacts", args.artifacts, "--precision", args.precision,
                               "--slots", str(args.slots), "--child", str(limit)], capture_output=True, text=True,
                              env=env)
        if done.returncode != 0:
            print(f"{arm}: failed ({done.stderr.strip().splitlines()[-1:]})", flush=True)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    result = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/cudnn_benchmark_limit.py " + " ".join(sys.argv[1:]), "runs": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
