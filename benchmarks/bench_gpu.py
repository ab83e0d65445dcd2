"""GPU parity and speed: ORT CUDA EP vs eager PyTorch, side by side in one run. Skips cleanly without CUDA.

    python benchmarks/bench_gpu.py --artifacts DIR --out benchmarks/results/gpu.json [--compile]

Arms (per-chunk latency of the vocoder, F0 included):
  a   upstream-style eager: weight norms not folded, every chunk re-vocodes all mel so far (token2wav semantics),
      F0 in float64 on the GPU
  b   eager PyTorch, folded, bounded window (our bookkeeping, TorchBackend, F0 on the CPU in float64)
  c   this runtime: ORT CUDA EP generator (TF32 off, HEURISTIC, IO binding) + ORT CPU F0, bounded window
  c'  the same with TF32 on
  d   (c) with each recurring window length in its own static-shape session replayed as a CUDA graph
      (CudaOptions(cuda_graphs=True)); d' with TF32 on
  e   torch.compile(mode="reduce-overhead") of the folded eager generator, bounded window (with --compile)
Batched: the generator graph on B = 1, 8, 64 steady-state windows per call -> real-time streams per GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np


def ms_stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1e3
    return {"median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95)), "n": int(a.size)}


def synthetic_mel(frames: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (np.cumsum(rng.standard_normal((80, frames)).astype(np.float32) * 0.2, axis=1) * 0.2 - 5).astype(np.float32)


def gpu_memory_mb() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.strip().splitlines()[0])
    except Exception:  # noqa: BLE001 - informational only
        return float("nan")


def run_stream(vocoder, mel: np.ndarray, chunk: int, sync=None) -> tuple[list[float], np.ndarray]:
    stream = vocoder.stream()
    lat, out = [], []
    for pos in range(0, mel.shape[1], chunk):
        t0 = time.perf_counter()
        out.append(stream.push(mel[:, pos:pos + chunk]))
        if sync:
            sync()
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out.append(stream.finish())
    lat.append(time.perf_counter() - t0)
    return lat, np.concatenate(out)


def upstream_stream(hift_unfolded, f0_gpu, mel: np.ndarray, chunk: int, noise_table, torch) -> list[float]:
    """Upstream token2wav: re-run inference(all mel so far, finalize) per chunk, emit past the offset."""
    dev = torch.device("cuda")
    cfg = hift_unfolded.config
    lat, offset = [], 0
    bounds = list(range(chunk, mel.shape[1], chunk)) + [mel.shape[1]]
    with torch.inference_mode():
        for i, end in enumerate(bounds):
            final = i == len(bounds) - 1
            t0 = time.perf_counter()
            x = torch.from_numpy(mel[None, :, :end]).to(dev)
            f0 = f0_gpu(x.double(), finalize=final).float()
            if not final:
                x = x[:, :, :-cfg.f0_look_ahead]
            n = f0.shape[1]
            if n >= (1 if final else 6):
                noise = torch.from_numpy(noise_table.rows(0, n * cfg.samples_per_frame)[None]).to(dev)
                audio, _ = hift_unfolded.generator.decode(x, f0, noise, torch.zeros(1, 9, dtype=torch.float64,
                                                                                    device=dev), finalize=final)
                audio = audio[:, offset:]
                offset += audio.shape[1]
                audio.cpu()
            torch.cuda.synchronize()
            lat.append(time.perf_counter() - t0)
    return lat


def kernel_events(session) -> list[tuple[str, str, str]]:
    """(provider, op type, node name) of every kernel a profiled session ran; ends and deletes the profile."""
    path = Path(session.end_profiling())
    events = json.loads(path.read_text())
    path.unlink(missing_ok=True)
    return [(e.get("args", {}).get("provider", "?"), e.get("args", {}).get("op_name", "?"),
             e["name"].removesuffix("_kernel_time"))
            for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]


def placement(artifacts: Path, out_dir: Path, ort, cuda_opts) -> dict[str, Any]:
    """Where every generator node runs: session profiling + the optimized graph's Memcpy count."""
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = str(out_dir / "ort_profile")
    opts.optimized_model_filepath = str(out_dir / "optimized_stream.onnx")
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(artifacts / "hift_generator_stream.onnx"), opts,
                                providers=[("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"])
    n = 93
    feed = {"mel": synthetic_mel(n)[None], "f0": np.full((1, n), 180, np.float32),
            "noise": np.random.rand(1, n * 480, 9).astype(np.float32), "phase_in": np.zeros((1, 9))}
    for _ in range(3):
        sess.run(None, feed)
    providers: dict[str, int] = {}
    for prov, _op, _name in kernel_events(sess):
        providers[prov] = providers.get(prov, 0) + 1
    import onnx

    optimized = onnx.load(str(out_dir / "optimized_stream.onnx"), load_external_data=False)
    memcpy = sum(1 for node in optimized.graph.node if node.op_type.startswith("Memcpy"))
    return {"kernel_events_by_provider (3 runs)": providers, "memcpy_nodes_in_optimized_graph": memcpy,
            "optimized_nodes": len(optimized.graph.node)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--long-seconds", type=float, default=60.0)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "CUDA is not available"}))
        return
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    from hift_export import load_hift
    from hift_export.backend import TorchBackend
    from hift_export.parity import max_abs, snr_db
    from hift_runtime import CudaOptions, open_vocoder
    from hift_runtime.streaming import StreamingVocoder

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    art = Path(args.artifacts)
    out_dir = Path(args.out).parent
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "onnxruntime": ort.__version__,
                     "python": platform.python_version()},
        "command": f"python benchmarks/bench_gpu.py --artifacts {args.artifacts} --out {args.out}"
                   + (" --compile" if args.compile else ""),
    }
    manifest = json.loads((art / "manifest.json").read_text())
    seed = manifest["weights"].get("seed", 1986)
    vocoders = {
        "c_ort_cuda_tf32_off": open_vocoder(art, device="cuda", cuda=CudaOptions(use_tf32=False)),
        "c2_ort_cuda_tf32_on": open_vocoder(art, device="cuda", cuda=CudaOptions(use_tf32=True)),
        "d_ort_cuda_graphs_tf32_off": open_vocoder(art, device="cuda", cuda=CudaOptions(cuda_graphs=True)),
        "d2_ort_cuda_graphs_tf32_on": open_vocoder(art, device="cuda", cuda=CudaOptions(cuda_graphs=True,
                                                                                        use_tf32=True)),
    }
    ort_cpu = open_vocoder(art, device="cpu")
    noise = ort_cpu.noise
    hift_gpu = load_hift(None, seed=seed, device="cuda", f0_dtype=torch.float64)
    eager = StreamingVocoder(TorchBackend(hift_gpu), ort_cpu.constants, noise)

    # ---- parity per chunk: ORT CUDA vs eager CUDA vs ORT CPU, same stream -------------------------------------
    mel = synthetic_mel(200, seed=1)
    outs = {}
    vocoders["d_ort_cuda_graphs_tf32_off"].warmup(24)  # so the parity stream runs on the captured graphs
    for name, v in (("ort_cuda", vocoders["c_ort_cuda_tf32_off"]), ("eager_cuda", eager), ("ort_cpu", ort_cpu),
                    ("ort_cuda_graphs", vocoders["d_ort_cuda_graphs_tf32_off"])):
        chunks = []
        s = v.stream()
        for pos in range(0, 200, 24):
            chunks.append(s.push(mel[:, pos:pos + 24]))
        chunks.append(s.finish())
        outs[name] = chunks
    parity = {}
    for other in ("eager_cuda", "ort_cpu", "ort_cuda_graphs"):
        per_chunk = [max_abs(a, b) for a, b in zip(outs["ort_cuda"], outs[other])]
        a, b = np.concatenate(outs["ort_cuda"]), np.concatenate(outs[other])
        parity[f"ort_cuda_vs_{other}"] = {"max_abs": max_abs(a, b), "snr_db": snr_db(a, b),
                                          "per_chunk_max_abs": per_chunk}
    a, b = np.concatenate(outs["eager_cuda"]), np.concatenate(outs["ort_cpu"])
    parity["eager_cuda_vs_ort_cpu"] = {"max_abs": max_abs(a, b), "snr_db": snr_db(a, b)}
    report["parity"] = parity
    report["placement"] = placement(art, out_dir, ort, CudaOptions().provider_options())

    # ---- per-chunk latency -------------------------------------------------------------------------------------
    sync = torch.cuda.synchronize
    hift_unfolded = load_hift(None, seed=seed, device="cuda", fold=False)
    f0_gpu = load_hift(None, seed=seed, f0_dtype=torch.float64, fold=False).f0_predictor.to("cuda")
    arms: dict[str, Any] = {}
    for chunk in (24, 50):
        mel10 = synthetic_mel(500, seed=chunk)
        results: dict[str, Any] = {}
        for name, v in list(vocoders.items()) + [("b_eager_folded_window", eager)]:
            v.warmup(chunk)  # the window lengths a stream of this chunk size meets (dedicated sessions on CUDA)
            run_stream(v, mel10[:, :150], chunk, sync)
            lat, _ = run_stream(v, mel10, chunk, sync)
            results[name] = {"chunk": ms_stats(lat[1:-1]), "first_chunk_ms": lat[0] * 1e3,
                             "total_10s_stream_s": sum(lat), "rtf": sum(lat) / 10.0}
        upstream_stream(hift_unfolded, f0_gpu, mel10[:, :150], chunk, noise, torch)
        lat = upstream_stream(hift_unfolded, f0_gpu, mel10, chunk, noise, torch)
        results["a_upstream_revocode"] = {"chunk": ms_stats(lat[1:-1]), "first_chunk_ms": lat[0] * 1e3,
                                          "total_10s_stream_s": sum(lat), "rtf": sum(lat) / 10.0}
        if args.compile and chunk == 24:
            try:
                t0 = time.perf_counter()
                compiled = load_hift(None, seed=seed, device="cuda", f0_dtype=torch.float64, spectral="conv")
                compiled.generator.decode = torch.compile(compiled.generator.decode, mode="reduce-overhead")
                cv = StreamingVocoder(TorchBackend(compiled), ort_cpu.constants, noise)
                run_stream(cv, mel10[:, :200], chunk, sync)
                compile_s = time.perf_counter() - t0
                lat, _ = run_stream(cv, mel10, chunk, sync)
                results["e_torch_compile_reduce_overhead"] = {"chunk": ms_stats(lat[1:-1]), "compile_s": compile_s,
                                                              "total_10s_stream_s": sum(lat)}
            except Exception as exc:  # noqa: BLE001 - record why the arm is missing
                results["e_torch_compile_reduce_overhead"] = {"error": str(exc)[:300]}
        c = results["c_ort_cuda_tf32_off"]["chunk"]["median_ms"]
        d = results["d_ort_cuda_graphs_tf32_off"]["chunk"]["median_ms"]
        results["ratios"] = {"a_over_c": results["a_upstream_revocode"]["chunk"]["median_ms"] / c,
                             "b_over_c": results["b_eager_folded_window"]["chunk"]["median_ms"] / c,
                             "a_over_d": results["a_upstream_revocode"]["chunk"]["median_ms"] / d,
                             "b_over_d": results["b_eager_folded_window"]["chunk"]["median_ms"] / d}
        arms[f"chunk{chunk}_window64"] = results
    report["per_chunk"] = arms

    # ---- a 60 s stream in total: upstream re-vocoding vs this runtime ------------------------------------------
    frames = int(args.long_seconds * 50)
    mel60 = synthetic_mel(frames, seed=60)
    vocoders["c_ort_cuda_tf32_off"].warmup(24)
    lat_c, _ = run_stream(vocoders["c_ort_cuda_tf32_off"], mel60, 24, sync)
    lat_d, _ = run_stream(vocoders["d_ort_cuda_graphs_tf32_off"], mel60, 24, sync)
    lat_a = upstream_stream(hift_unfolded, f0_gpu, mel60, 24, noise, torch)
    report["long_stream"] = {"seconds": args.long_seconds, "chunk": 24, "a_total_s": sum(lat_a),
                             "c_total_s": sum(lat_c), "a_over_c": sum(lat_a) / sum(lat_c),
                             "d_total_s": sum(lat_d), "a_over_d": sum(lat_a) / sum(lat_d)}

    # ---- batched windows: generator graph only, steady-state window (64 + 5 + 24 = 93 frames) ------------------
    batched = {}
    n = 93
    for name, v in vocoders.items():
        if name.startswith("d"):
            continue  # the batched figures are per call of the dynamic graph
        backend = v.backend
        batched[name] = {}
        for b in (1, 8, 64):
            feed = (np.repeat(synthetic_mel(n)[None], b, 0), np.full((b, n), 180, np.float32),
                    np.random.rand(b, n * 480, 9).astype(np.float32), np.zeros((b, 9)))
            for _ in range(3):
                backend.generate(*feed, False)
            ts = []
            for _ in range(10 if b < 64 else 5):
                t0 = time.perf_counter()
                backend.generate(*feed, False)
                ts.append(time.perf_counter() - t0)
            med = float(np.median(ts))
            batched[name][f"B{b}"] = {"call_ms": med * 1e3, "realtime_streams": b * 0.48 / med}
    report["batched_generator"] = batched
    report["gpu_memory_used_mb"] = gpu_memory_mb()
    report["torch_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    text = json.dumps(report, indent=2)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
