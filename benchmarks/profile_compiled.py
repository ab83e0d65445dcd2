"""Where the compiled engine's device time goes, kernel by kernel: the generator step (stream step) and the F0 step,
per precision, step size and batch size, through ``torch.profiler``. Not a test: it reports figures.

    python benchmarks/profile_compiled.py --artifacts DIR --out R.json [--precisions tf32,fp16,fp32]
        [--batches 2,256] [--frames 24,8,4,1]
        [--variants default,max-autotune,coordinate-descent]
        [--budget-s 500]

Each (precision, variant, step size) compiles the step once (batch dynamic, as the engine does), then calls it
``--runs`` times per batch size as ordinary launches (a CUDA-graph replay runs the same kernels without the launch
gaps) and sums the kernels' device time by family: inductor's fused Triton kernels, cuDNN's layout transposes
(NCHW <-> NHWC around its tensor-core kernels), convolutions (cuDNN / CUTLASS), and the rest (the eager source's
copies, gathers and elementwise ops); every kernel is listed. Per stream-step and per
stream-frame = a step's kernel time / batch (/ frames): what bounds capacity once the host path is out of the way (at
100 % device one GPU carries 20 ms / per-stream-frame ms real-time streams, before the F0 and final steps).

Variants: ``default`` (the engine as it ships: the precision's convolution layout), ``max-autotune`` (inductor's
``max_autotune``: Triton templates for the convolutions and matmuls benchmarked against cuDNN at compile time) and
``coordinate-descent`` (inductor's ``coordinate_descent_tuning``: each fused Triton kernel's block sizes tuned at
compile time; the fused kernels are most of fp16's step). Each variant's audio is
compared with the first variant's on the same inputs (``vs_default``). The JSON is rewritten after each (precision,
variant), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any

# Checked in this order: inductor names a fused kernel after the ops it holds ("triton_poi_fused_add_convolution_3"
# is the bias add after a convolution), and cuDNN's layout transposes around an NHWC kernel are a family of their own.
FAMILIES = (
    ("triton (fused)", ("triton_",)),
    ("layout transpose (cuDNN)", ("nchwtonhwc", "nhwctonchw")),
    ("convolution", ("conv", "cudnn", "xmma", "implicit", "cutlass", "gemm", "dgrad", "wgrad", "winograd", "fft",
                     "precomputed", "sm90_", "sm80_", "nhwc", "nchw")),
    ("copy / index", ("copy", "index", "gather", "scatter", "memcpy", "memset", "fill", "cat")),
)


# A variant's inductor options (the engine's own layout for the precision).
VARIANTS: dict[str, dict[str, Any]] = {"default": {}, "max-autotune": {"max_autotune": True},
                                       "coordinate-descent": {"coordinate_descent_tuning": True}}


def family(kernel: str) -> str:
    name = kernel.lower()
    for label, marks in FAMILIES:
        if any(m in name for m in marks):
            return label
    return "other"


def profile_calls(fn: Any, args: list[Any], runs: int, cuda: bool = True) -> dict[str, Any]:
    """Kernel device time of ``runs`` calls of ``fn(*args)``, per call: in all, by family and kernel by kernel; plus
    the wall time per call measured apart from the profiler. (``cuda=False``: CPU ops instead, to try the script.)"""
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
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"kernel_ms": round(total, 4), "kernels_per_call": round(sum(c for _, c in kernels.values()), 1),
            "wall_ms_median": round(statistics.median(walls), 4),
            "by_family": {k: {"ms": round(v["ms"], 4), "share": round(v["ms"] / total, 3) if total else 0.0,
                              "kernels": round(v["kernels"], 1)}
                          for k, v in sorted(by_family.items(), key=lambda kv: -kv[1]["ms"])},
            "kernels": [{"kernel": name[:160], "family": family(name), "ms": round(ms, 4), "count": round(count, 1)}
                        for name, (ms, count) in ranked]}


def profile_shape(backend: Any, frames: int, batch: int, runs: int, cuda: bool, reference: list[Any]
                  ) -> dict[str, Any]:
    """The generator and F0 steps of ``frames`` x ``batch`` profiled; the audio compared with ``reference[0]`` (the
    first variant's, which an empty ``reference`` receives)."""
    import torch

    gen = backend.zero_inputs("generator", frames, batch)
    torch.manual_seed(batch)
    gen[0].copy_(torch.randn(gen[0].shape) * 2.0 - 5.0)
    gen[1].fill_(200.0)
    # Every row reads zero caches (first) and writes the scratch row: each call is the same step.
    audio = backend.compiled_step("generator")(*gen)[0].float().cpu()
    row = profile_calls(backend.compiled_step("generator"), gen, runs, cuda)
    if reference:
        error = (audio - reference[0]).abs().max().item()
        noise = (audio - reference[0]).square().sum().clamp_min(1e-30)
        row["vs_default"] = {"max_abs": error,
                             "snr_db": round(10 * torch.log10(reference[0].square().sum() / noise).item(), 1)}
    else:
        reference.append(audio)
    row["kernel_ms_per_stream_step"] = round(row["kernel_ms"] / batch, 4)
    row["kernel_ms_per_stream_frame"] = round(row["kernel_ms"] / batch / frames, 5)
    f0 = backend.zero_inputs("f0", frames, batch)
    f0[0].copy_(torch.randn(f0[0].shape) * 2.0 - 5.0)
    return {"generator": row, "f0": profile_calls(backend.compiled_step("f0"), f0, runs, cuda)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--precisions", default="tf32,fp16,fp32")
    p.add_argument("--batches", default="2,256")
    p.add_argument("--frames", default="24", help="step sizes in frames, each a compile of its own (e.g. 24,8,4,1)")
    p.add_argument("--variants", default="default")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (fp32, uncompiled: to try the script)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new (precision, variant) after this")
    args = p.parse_args()

    import torch
    import torch._inductor.config as inductor_config

    from hift_torch.compiled import CompiledBackend
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.contract import StreamConstants

    started = time.perf_counter()
    cuda = args.device != "cpu"
    manifest = read_manifest(args.artifacts)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": "python benchmarks/profile_compiled.py " + " ".join(
                                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                              "torch": torch.__version__, "runs": {},
                              "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    noise = NoiseTable.seeded(0, constants.noise_table_length, constants.num_sines)
    references: dict[tuple[str, str], list[Any]] = {}  # the first variant's audio per (precision, shape)
    frame_sizes = [int(f) for f in str(args.frames).split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for precision in args.precisions.split(","):
        for variant in args.variants.split(","):
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                result["runs"][f"{precision}/{variant}"] = {"skipped": "over --budget-s"}
                continue
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
            options = VARIANTS[variant]
            # Dynamo keeps a function's compiled code for the process: without a reset a variant would rerun the
            # first variant's kernels (no compile, the same audio).
            torch._dynamo.reset()
            backend = CompiledBackend(manifest, constants, device=args.device, precision=precision,
                                      slots=max(batches) + 8, batch_sizes=tuple(batches),
                                      step_sizes=tuple(frame_sizes))
            backend.use_noise_table(noise)
            run: dict[str, Any] = {"conv_layout": backend.conv_layout}
            # The variant's inductor options are read when the step compiles: its first call, in this block.
            with inductor_config.patch(options), backend.precision_scope():
                for frames in frame_sizes:
                    run[f"compile_s_{frames}"] = round(backend.compile_shape("generator", frames), 1)
                    for batch in batches:
                        shape = f"{frames}x{batch}"
                        run[shape] = profile_shape(backend, frames, batch, args.runs, cuda,
                                                   references.setdefault((precision, shape), []))
                        row = run[shape]["generator"]
                        print(precision, variant, shape, json.dumps({k: row[k] for k in (
                            "kernel_ms", "wall_ms_median", "kernel_ms_per_stream_step", "vs_default")
                            if k in row}), json.dumps(row["by_family"]), "f0", run[shape]["f0"]["kernel_ms"],
                              flush=True)
            result["runs"][f"{precision}/{variant}"] = run
            del backend
            if cuda:
                torch.cuda.empty_cache()
            out.write_text(json.dumps(result, indent=2) + "\n")
    result["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
