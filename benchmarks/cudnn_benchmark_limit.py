"""What a warmup's captures cost against how cuDNN chooses its algorithms, and how fast the chosen ones run. Not a
test.

A warm start of the compiled engine spends a third or more of its warmup in its captures, and in them in cuDNN's
choice of algorithms for each new shape (BENCHMARKS.md, "Where a warm start goes" and "AOTInductor packages ..."). Each
arm runs in a process of its own (cuDNN's choices are cached per process), warms up an engine (every shape of a warmup
captured) and replays the 24-frame step's and the final step's graphs:

* ``N`` (an integer): the step run eagerly (no compile: the convolutions are cuDNN's either way) under
  ``torch.backends.cudnn.benchmark_limit = N`` (torch's default 10; 0: every algorithm);
* ``heuristic``: the same, eager, with cuDNN's benchmark off (its heuristics' first choice per shape, nothing timed;
  the engine turned it on after the fp32 step ran ~3x slower with it off: whether fp16 and tf32 pay that too);
* ``v7``: the same, eager, under cuDNN's older API (``TORCH_CUDNN_V8_API_DISABLED=1``: a timed search with no
  execution plans to build; whether a torch build still honours it, the arm's timings say);
* ``compiled``: the engine as it starts (torch.compile; a first arm on a fresh cache compiles side by side, later
  ones load inductor's cache);
* ``compiled+heuristic``: the compiled engine with cuDNN's benchmark off;
* ``heuristic-b``, ``compiled+heuristic-b``: the same under cuDNN's heuristic mode B
  (``TORCH_CUDNN_USE_HEURISTIC_MODE_B=1``: its slower, more exact heuristic, where the default is its instant one):
  whether its first choice runs as fast as the benchmark's, with nothing timed at a start.

Any arm may end in ``@N``: the warmup's threads that choose cuDNN's algorithms (``CudaOptions.cudnn_threads``;
default the engine's: one per 8 GiB of free device memory, at most 8, or one for the benchmark in fp32 and tf32).
Since 2026-12-03 every warmup runs the eager step at each generator and final shape in those threads first and
captures each shape in the thread that chose for it (``hift_torch.compiled._ChoosingThreads``); the
``eager+compiled`` arm that measured the idea on one thread (``cudnn-compiled-arms-fp16-h200.json``) is in the
history (commit bcaedf3). The heuristic arms run the engine's ``cudnn_algorithms="heuristics"``, with
``TORCH_CUDNN_USE_HEURISTIC_MODE_B`` set to 0 (instant) or 1 (mode B) for their process.

    python benchmarks/cudnn_benchmark_limit.py --artifacts DIR --precision fp16 --arms 10,heuristic,v7 [--slots 3100] \\
        [--out R.json]
    python benchmarks/cudnn_benchmark_limit.py --artifacts DIR --precision fp16 --arms compiled@8,compiled@1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time

REPLAYS = 30
BATCHES = (2, 64, 256)
ARMS = ("heuristic", "heuristic-b", "v7", "compiled", "compiled+heuristic", "compiled+heuristic-b")


def one_arm(artifacts: str, precision: str, slots: int, arm: str) -> dict:
    """Warm up the arm's engine and time its graphs' replays."""
    import torch

    from engine_start import replay_ms  # (beside this script: its folder is first on the path)
    from hift_torch.compiled import STEP_SIZES, CompiledBackend, warmup_summary
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.contract import StreamConstants

    arm, _, threads = arm.partition("@")
    cudnn_threads = int(threads) if threads else None  # (None: the engine's default)
    compiled = arm.startswith("compiled")
    heuristic = "heuristic" in arm  # (instant or mode B: the variable main() set for this process says which)
    if arm.isdigit():
        torch.backends.cudnn.benchmark_limit = int(arm)
    manifest = read_manifest(artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    noise = NoiseTable.seeded(0, constants.noise_table_length, constants.num_sines)

    result: dict = {"arm": arm, "cudnn_threads": cudnn_threads, "benchmark_limit": torch.backends.cudnn.benchmark_limit,
                    "cudnn_benchmark": not heuristic,
                    "cudnn_v8_api_disabled_env": os.environ.get("TORCH_CUDNN_V8_API_DISABLED"),
                    "cudnn_heuristic_mode_b_env": os.environ.get("TORCH_CUDNN_USE_HEURISTIC_MODE_B"),
                    "cudnn_version": torch.backends.cudnn.version()}
    backend = CompiledBackend(manifest, constants, device="cuda", precision=precision, compile=compiled, slots=slots,
                              final_window=True, cudnn_threads=cudnn_threads,
                              cudnn_algorithms="heuristics" if heuristic else "benchmark")
    backend.use_noise_table(noise)
    said: list[str] = []
    started = time.perf_counter()
    backend.warmup(STEP_SIZES, progress=said.append)
    result["warmup_s"] = round(time.perf_counter() - started, 1)
    result["summary"] = warmup_summary(backend.warmup_seconds, backend.first_call_seconds)
    result["said"] = [m for m in said if "step shapes captured" not in m]
    result["replay_ms_median"] = replay_ms(backend, BATCHES, REPLAYS)
    result["warmup_seconds_by_shape"] = backend.warmup_seconds
    result["max_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 1)  # workspaces included
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--slots", type=int, default=2048, help="the engine's device cache slots (CudaOptions.slots)")
    p.add_argument("--arms", "--limits", dest="arms", default="10,4,2",
                   help="comma-separated, each in a process of its own: N (eager under benchmark limit N), "
                        + ", ".join(ARMS) + " (see above)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", help="a JSON of the results")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(one_arm(args.artifacts, args.precision, args.slots, args.child)), flush=True)
        return
    arms = args.arms.split(",")
    for arm in arms:
        name, at, threads = arm.partition("@")
        if not (name.isdigit() or name in ARMS) or (at and not threads.isdigit()):
            p.error(f"unknown arm {arm!r}: N or one of {', '.join(ARMS)}, each optionally @THREADS")
    result = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/cudnn_benchmark_limit.py " + " ".join(sys.argv[1:]), "runs": []}
    for arm in arms:
        name, at, threads = arm.partition("@")
        env = dict(os.environ, TORCH_CUDNN_V8_API_DISABLED="1") if name == "v7" else None
        if "heuristic" in name:  # mode B or the instant one (torch reads it once, at the first such convolution)
            env = dict(os.environ, TORCH_CUDNN_USE_HEURISTIC_MODE_B="1" if name.endswith("-b") else "0")
        child = ("10" if name == "v7" else name) + at + threads
        done = subprocess.run([sys.executable, __file__, "--artifacts", args.artifacts, "--precision", args.precision,
                               "--slots", str(args.slots), "--child", child],
                              capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"{arm}: failed ({done.stderr.strip().splitlines()[-1:]})", flush=True)
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["arm"] = arm
        result["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "warmup_seconds_by_shape"}), flush=True)
        if args.out:  # after every arm: a run cut short keeps the arms it finished
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
