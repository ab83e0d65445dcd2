"""Where the compiled engine's device time goes, kernel by kernel: the generator step (stream step, 24 frames) and the
F0 step, per precision and batch size, through ``torch.profiler``. Not a test: it reports figures.

    python benchmarks/profile_compiled.py --artifacts DIR --out R.json [--precisions tf32,fp16,fp32]
        [--batches 2,256] [--frames 24] [--variants default,max-autotune] [--budget-s 500]

Each (precision, variant) compiles the step once (batch dynamic, as the engine does), then calls it ``--runs`` times
per batch size as ordinary launches (a CUDA-graph replay runs the same kernels without the launch gaps) and sums the
kernels' device time by family: convolutions (cuDNN / CUTLASS: forward, and ``dgrad`` for the transposed ones),
inductor's fused Triton kernels, and the rest (the eager source's copies, gathers and elementwise ops). Per stream-step
= a step's kernel time / batch: what bounds capacity once the host path is out of the way (real-time streams at 100 %
device = 0.48 s x batch / kernel time of a 24-frame step, before the F0 step and the final steps).

Variants: ``default`` (the engine as it ships), ``max-autotune`` (inductor's ``max_autotune``: Triton templates for
the convolutions and matmuls benchmarked against cuDNN at compile time; much longer compiles). The JSON is rewritten
after each (precision, variant), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any

FAMILIES = (
    ("convolution", ("conv", "cudnn", "xmma", "implicit", "cutlass", "gemm", "dgrad", "wgrad", "winograd", "fft",
                     "precomputed", "sm90_", "sm80_", "nhwc", "nchw")),
    ("triton (fused)", ("triton_",)),
    ("copy / index", ("copy", "index", "gather", "scatter", "memcpy", "memset", "fill", "cat")),
)


def family(kernel: str) -> str:
    name = kernel.lower()
    for label, marks in FAMILIES:
        if any(m in name for m in marks):
            return label
    return "other"


def profile_calls(fn: Any, args: list[Any], runs: int, cuda: bool = True) -> dict[str, Any]:
    """Kernel device time of ``runs`` calls of ``fn(*args)``: by family and the top kernels, per call; plus the wall
    time per call measured apart from the profiler. (``cuda=False``: CPU ops instead of kernels, to try the script.)"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):
        fn(*args)
    sync()
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            fn(*args)
        sync()
    kernels: dict[str, list[float]] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) if cuda else event.self_cpu_time_total
        if us is None:
            us = event.self_cuda_time_total
        if us <= 0:
            continue
        kernels[event.key] = [us / runs / 1e3, event.count / runs]
    by_family: dict[str, dict[str, float]] = {}
    for name, (ms, count) in kernels.items():
        row = by_family.setdefault(family(name), {"ms": 0.0, "kernels": 0.0})
        row["ms"] += ms
        row["kernels"] += count
    total = sum(ms for ms, _ in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]
    return {"kernel_ms": round(total, 4), "kernels_per_call": round(sum(c for _, c in kernels.values()), 1),
            "wall_ms_median": round(statistics.median(walls), 4),
            "by_family": {k: {"ms": round(v["ms"], 4), "share": round(v["ms"] / total, 3) if total else 0.0,
                              "kernels": round(v["kernels"], 1)}
                          for k, v in sorted(by_family.items(), key=lambda kv: -kv[1]["ms"])},
            "top": [{"kernel": name[:140], "ms": round(ms, 4), "count": round(count, 1)} for name, (ms, count) in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--precisions", default="tf32,fp16,fp32")
    p.add_argument("--batches", default="2,256")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--variants", default="default")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (fp32, uncompiled: to try the script)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new (precision, variant) after this")
    args = p.parse_args()

    import torch
    import torch._inductor.config as inductor_config

    from hift_runtime.compiled import CompiledBackend, _mark_batch_dynamic
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.streaming import StreamConstants

    started = time.perf_counter()
    cuda = args.device != "cpu"
    manifest = read_manifest(args.artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": "python benchmarks/profile_compiled.py " + " ".join(
                                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                              "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "runs": {}}
    noise = NoiseTable.seeded(0, constants.noise_table_length, constants.num_sines)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for precision in args.precisions.split(","):
        for variant in args.variants.split(","):
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                result["runs"][f"{precision}/{variant}"] = {"skipped": "over --budget-s"}
                continue
            inductor_config.max_autotune = variant == "max-autotune"
            backend = CompiledBackend(manifest, constants, device=args.device, precision=precision,
                                      step_sizes=(args.frames,), batch_sizes=tuple(batches), slots=max(batches) + 8)
            backend.use_noise_table(noise)
            run: dict[str, Any] = {}
            with backend._precision():
                t0 = time.perf_counter()
                example = backend._zeros("generator", args.frames, batches[0])
                _mark_batch_dynamic(example)
                backend._compiled["generator"](*example)
                if cuda:
                    torch.cuda.synchronize()
                run["compile_s"] = round(time.perf_counter() - t0, 1)
                for batch in batches:
                    gen = backend._zeros("generator", args.frames, batch)
                    gen[0].normal_(-5.0, 2.0)
                    gen[1].fill_(200.0)
                    row = profile_calls(backend._compiled["generator"], gen, args.runs, cuda)
                    row["kernel_ms_per_stream_step"] = round(row["kernel_ms"] / batch, 4)
                    row["streams_at_full_device"] = round(batch * args.frames * 0.02 / (row["kernel_ms"] / 1e3))
                    f0 = backend._zeros("f0", args.frames, batch)
                    f0[0].normal_(-5.0, 2.0)
                    f0_row = profile_calls(backend._compiled["f0"], f0, args.runs, cuda)
                    run[str(batch)] = {"generator": row, "f0": f0_row}
                    print(precision, variant, batch, json.dumps({k: row[k] for k in (
                        "kernel_ms", "wall_ms_median", "kernel_ms_per_stream_step", "streams_at_full_device")}),
                          json.dumps(row["by_family"]), "f0", f0_row["kernel_ms"], flush=True)
            result["runs"][f"{precision}/{variant}"] = run
            del backend
            if cuda:
                torch.cuda.empty_cache()
            out.write_text(json.dumps(result, indent=2) + "\n")
    result["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
