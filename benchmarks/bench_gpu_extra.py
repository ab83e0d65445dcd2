"""GPU extras beside bench_gpu.py: which nodes ORT places on the CPU, a CUDA-graph arm on a static steady-state
window, a torch.compile arm, and where a streamed chunk's time goes. Skips cleanly without CUDA.

    python benchmarks/bench_gpu_extra.py --artifacts DIR --out benchmarks/results/gpu_extra.json [--compile]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

WINDOW = 93  # steady-state stream window: 64 history + 5 held + 24 new frames


def med_ms(ts: list[float]) -> dict[str, float]:
    a = np.asarray(ts) * 1e3
    return {"median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95))}


def feed(b: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"mel": (rng.standard_normal((b, 80, n)) * 0.5 - 5).astype(np.float32),
            "f0": np.full((b, n), 180, np.float32), "noise": rng.random((b, n * 480, 9), dtype=np.float32),
            "phase_in": np.zeros((b, 9))}


def cpu_nodes(art: Path, ort) -> dict[str, Any]:
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(art / "hift_generator_stream.onnx"), opts,
                                providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    sess.run(None, feed(1, WINDOW))
    from bench_gpu import kernel_events  # benchmarks/ is on sys.path when run as a script

    on_cpu = sorted({(op, name) for prov, op, name in kernel_events(sess) if prov == "CPUExecutionProvider"})
    return {"count": len(on_cpu), "nodes": [f"{op}:{name}" for op, name in on_cpu]}


def cuda_graph_arm(art: Path, ort, tf32: bool) -> dict[str, Any]:
    """Static shapes (free-dimension overrides) let ORT fold the shape arithmetic; then capture a CUDA graph."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for name, value in (("batch", 1), ("frames", WINDOW), ("480*frames", WINDOW * 480)):
        opts.add_free_dimension_override_by_name(name, value)
    cuda = {"enable_cuda_graph": "1", "use_tf32": "1" if tf32 else "0", "cudnn_conv_algo_search": "HEURISTIC"}
    sess = ort.InferenceSession(str(art / "hift_generator_stream.onnx"), opts,
                                providers=[("CUDAExecutionProvider", cuda)])
    inputs = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feed(1, WINDOW).items()}
    audio = ort.OrtValue.ortvalue_from_shape_and_type([1, (WINDOW - 5) * 480], np.float32, "cuda", 0)
    phase = ort.OrtValue.ortvalue_from_shape_and_type([1, WINDOW, 9], np.float64, "cuda", 0)
    binding = sess.io_binding()
    for k, v in inputs.items():
        binding.bind_ortvalue_input(k, v)
    binding.bind_ortvalue_output("audio", audio)
    binding.bind_ortvalue_output("phase_out", phase)
    for _ in range(3):  # the first run captures
        sess.run_with_iobinding(binding)
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        ts.append(time.perf_counter() - t0)
    # The same static session without the graph, for the difference capture makes.
    return med_ms(ts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "CUDA is not available"}))
        return
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    from hift_runtime import CudaOptions, open_vocoder

    art = Path(args.artifacts)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "onnxruntime": ort.__version__,
                              "torch": torch.__version__}
    report["cpu_placed_nodes"] = cpu_nodes(art, ort)
    for tf32 in (False, True):
        try:
            report[f"d_cuda_graph_B1_N{WINDOW}_tf32_{'on' if tf32 else 'off'}"] = cuda_graph_arm(art, ort, tf32)
        except Exception as exc:  # noqa: BLE001 - record why the arm is missing
            report[f"d_cuda_graph_tf32_{'on' if tf32 else 'off'}"] = {"error": str(exc)[:400]}

    # Where a streamed chunk's time goes (ORT CUDA, TF32 off, chunk 24, 10 s stream).
    vocoder = open_vocoder(art, device="cuda", cuda=CudaOptions())
    backend = vocoder.backend
    spent: dict[str, list[float]] = {"f0": [], "generator": []}
    real_f0, real_gen = backend.predict_f0, backend.generate

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[name].append(time.perf_counter() - t0)
            return out
        return wrapper

    backend.predict_f0, backend.generate = timed("f0", real_f0), timed("generator", real_gen)
    rng = np.random.default_rng(1)
    mel = (np.cumsum(rng.standard_normal((80, 500)).astype(np.float32) * 0.2, axis=1) * 0.2 - 5).astype(np.float32)
    vocoder.warmup(24)
    for rep in range(2):
        for k in spent:
            spent[k].clear()
        stream, lat = vocoder.stream(), []
        for pos in range(0, 500, 24):
            t0 = time.perf_counter()
            stream.push(mel[:, pos:pos + 24])
            lat.append(time.perf_counter() - t0)
        stream.finish()
    report["chunk24_breakdown"] = {"chunk_latencies_ms": [round(x * 1e3, 3) for x in lat],
                                   "chunk": med_ms(lat[1:]), "f0": med_ms(spent["f0"]),
                                   "generator_call_incl_copies": med_ms(spent["generator"])}
    if args.compile:
        try:
            from hift_export import load_hift

            torch.backends.cudnn.allow_tf32 = False
            hift = load_hift(None, device="cuda", spectral="conv")
            gen = torch.compile(hift.generator.decode, mode="reduce-overhead")
            dev = torch.device("cuda")
            x = {k: torch.from_numpy(v).to(dev) for k, v in feed(1, WINDOW).items()}
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(3):
                    gen(x["mel"], x["f0"], x["noise"], x["phase_in"], finalize=False)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                ts = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    gen(x["mel"], x["f0"], x["noise"], x["phase_in"], finalize=False)
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t0)
            report[f"e_torch_compile_reduce_overhead_B1_N{WINDOW}_tf32_off"] = med_ms(ts) | {"compile_s": compile_s}
            eager = []
            with torch.inference_mode():
                for _ in range(20):
                    t0 = time.perf_counter()
                    hift.generator.decode(x["mel"], x["f0"], x["noise"], x["phase_in"], finalize=False)
                    torch.cuda.synchronize()
                    eager.append(time.perf_counter() - t0)
            report[f"b_eager_generator_B1_N{WINDOW}_tf32_off"] = med_ms(eager)
        except Exception as exc:  # noqa: BLE001
            report["e_torch_compile"] = {"error": str(exc)[:400]}
    text = json.dumps(report, indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
