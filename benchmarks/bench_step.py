"""The stateful step graphs against the alternatives, side by side in one run; medians, p95 and ratios. Not a test.

    python benchmarks/bench_step.py --artifacts DIR --out benchmarks/results/NAME.json [--gpu] [--seconds 10]

CPU arms (24-frame chunks, full size, 10 s stream; F0 included):
  step_ort       this runtime: ORT step graphs through the bookkeeping
  step_eager     eager PyTorch, the same step, the same bookkeeping
  window_eager   eager generator decode on the 93-frame window the landed bounded-window runtime ran per push
                 (64 history + 5 held back + 24 new): the work each push did before the step graphs
GPU arms (--gpu; H200; TF32 off unless named):
  parity         ORT CUDA stream vs ORT CPU stream (max abs, SNR)
  push_*         push latency through the runtime: CUDA graphs, TF32 off and on; first chunk; chunk 50 (steps
                 24 + 24 + 2: what the fixed step sizes cost)
  breakdown_*    a push split into F0 step, generator step and bookkeeping
  upstream       upstream token2wav semantics: every chunk re-vocodes all mel so far (eager, unfolded)
  step_eager     eager PyTorch step on CUDA through the bookkeeping
  gen_*          the generator step alone: session.run with NumPy, IO binding on device buffers, CUDA graph replay
  batched        the generator step at B = 1, 8, 64, 256 (CUDA graph replay over device buffers) -> real-time
                 streams per GPU = B * 0.48 s / step time
GFLOP per 24-frame step are counted on the eager step (torch.utils.flop_counter: convolutions and matmuls).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_SECONDS = 24 * 480 / 24000


def stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1e3
    return {"median_ms": round(float(np.median(a)), 3), "p95_ms": round(float(np.percentile(a, 95)), 3),
            "n": int(a.size)}


def synthetic_mel(frames: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (np.cumsum(rng.standard_normal((80, frames)).astype(np.float32) * 0.2, axis=1) * 0.2 - 5).astype(np.float32)


def timed_stream(vocoder, mel: np.ndarray, chunk: int) -> tuple[list[float], float, np.ndarray]:
    """Per-push latencies (the first push first, finish last), total wall, audio."""
    stream = vocoder.stream()
    lat, out = [], []
    started = time.perf_counter()
    for pos in range(0, mel.shape[1], chunk):
        t0 = time.perf_counter()
        out.append(stream.push(mel[:, pos:pos + chunk]))
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out.append(stream.finish())
    lat.append(time.perf_counter() - t0)
    return lat, time.perf_counter() - started, np.concatenate(out)


def stream_arm(vocoder, mel: np.ndarray, chunk: int, repeats: int) -> dict[str, Any]:
    timed_stream(vocoder, mel[:, :120], chunk)  # warm-up
    steady, firsts, walls = [], [], []
    for _ in range(repeats):
        lat, wall, _ = timed_stream(vocoder, mel, chunk)
        firsts.append(lat[0])
        steady += lat[2:-1]
        walls.append(wall)
    seconds = mel.shape[1] * 480 / 24000
    return {"push": stats(steady), "first_push": stats(firsts), "stream_wall_s": round(min(walls), 3),
            "rtf": round(min(walls) / seconds, 4)}


class TimingBackend:
    """Wraps a backend and adds up the wall time of its F0 and generator steps (the rest of a push is bookkeeping)."""

    def __init__(self, backend) -> None:
        self.backend, self.name, self.traits = backend, backend.name, backend.traits
        self.f0_s = self.gen_s = 0.0

    def warmup(self, step_sizes, progress=None) -> None:
        self.backend.warmup(step_sizes, progress)

    def stream_capacity(self) -> int:
        return self.backend.stream_capacity()

    def new_caches(self, kind: str, batch: int = 1):
        return self.backend.new_caches(kind, batch)

    def f0_step(self, *args):
        t0 = time.perf_counter()
        out = self.backend.f0_step(*args)
        self.f0_s += time.perf_counter() - t0
        return out

    def generator_step(self, *args):
        t0 = time.perf_counter()
        out = self.backend.generator_step(*args)
        self.gen_s += time.perf_counter() - t0
        return out


def push_breakdown(vocoder, mel: np.ndarray) -> dict[str, float]:
    """Median push split into F0 step, generator step(s) and bookkeeping (noise rows, slicing, checks)."""
    from hift_runtime.streaming import StreamingVocoder

    timing = TimingBackend(vocoder.backend)
    timed = StreamingVocoder(timing, vocoder.constants, vocoder.noise, step_sizes=vocoder.step_sizes)
    stream = timed.stream()
    stream.push(mel[:, :48])
    rows = []
    for pos in range(48, mel.shape[1] - 24, 24):
        timing.f0_s = timing.gen_s = 0.0
        t0 = time.perf_counter()
        stream.push(mel[:, pos:pos + 24])
        total = time.perf_counter() - t0
        rows.append((total, timing.f0_s, timing.gen_s))
    a = np.median(np.asarray(rows), axis=0) * 1e3
    return {"push_ms": round(float(a[0]), 3), "f0_step_ms": round(float(a[1]), 3),
            "generator_step_ms": round(float(a[2]), 3), "bookkeeping_ms": round(float(a[0] - a[1] - a[2]), 3)}


def f0_on_cuda(artifacts: Path, manifest, ort) -> dict[str, Any]:
    """The float64 F0 step on the CUDA EP vs the CPU EP: time per 24-frame step and equality."""
    path = str(artifacts / "hift_f0_step.onnx")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sessions = {"cpu": ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]),
                "cuda": ort.InferenceSession(path, opts, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])}
    feed = {"mel": synthetic_mel(27)[None]}
    for e in manifest.step["f0_caches"]:
        feed["cache." + e["name"]] = np.random.default_rng(0).random((1, *e["shape"]))
    out, result = {}, {}
    for name, sess in sessions.items():
        for _ in range(5):
            out[name] = sess.run(None, feed)
        lat = []
        for _ in range(50):
            t0 = time.perf_counter()
            sess.run(None, feed)
            lat.append(time.perf_counter() - t0)
        result[name] = stats(lat)
    result["f0_equal"] = bool(np.array_equal(out["cpu"][0], out["cuda"][0]))
    result["f0_max_abs"] = float(np.max(np.abs(out["cpu"][0] - out["cuda"][0])))
    return result


def gflop_per_step(hift, steps: int) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from hift_export.graphs import GeneratorStepGraph
    from hift_export.targets import example_generator_step_inputs

    args = example_generator_step_inputs(hift.config, steps, 1, False)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        GeneratorStepGraph(hift.generator, False)(*args)
    return counter.get_total_flops() / 1e9


def window_eager_arm(hift, mel: np.ndarray, noise, repeats: int = 5) -> dict[str, Any]:
    """The eager generator on the windowed runtime's per-push window (93 frames, finalize=False)."""
    import torch

    n = 93
    f0 = torch.full((1, n), 180.0)
    x = torch.from_numpy(mel[None, :, :n])
    rows = torch.from_numpy(noise.rows(0, n * 480)[None])
    phase = torch.zeros(1, 9, dtype=torch.float64)
    lat = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            hift.generator.decode(x, f0, rows, phase, finalize=False)
            lat.append(time.perf_counter() - t0)
    return {"generator_window": stats(lat[1:])}


def cpu_arms(args, result: dict[str, Any]) -> None:
    import torch

    from hift_torch.eager import torch_vocoder
    from hift_torch.parity import reference_backend
    from hift_runtime import open_vocoder

    vocoder = open_vocoder(args.artifacts, device="cpu")
    hift = reference_backend(vocoder.backend.manifest).hift
    eager = torch_vocoder(hift, noise=vocoder.noise)
    mel = synthetic_mel(int(args.seconds * 50))
    arms = {"step_ort": stream_arm(vocoder, mel, 24, args.repeats),
            "step_eager": stream_arm(eager, mel, 24, 1),
            "window_eager": window_eager_arm(hift, mel, vocoder.noise),
            "breakdown_step_ort": push_breakdown(vocoder, mel)}
    arms["step_ort_generator_frames_per_push"] = 24
    result["cpu"] = arms
    result["gflop_per_24_frame_step"] = round(gflop_per_step(hift, 24), 2)
    result["torch_threads"] = torch.get_num_threads()
    a = arms["step_ort"]["push"]["median_ms"]
    result["cpu_ratios"] = {"step_eager/step_ort": round(arms["step_eager"]["push"]["median_ms"] / a, 2),
                            "window_eager/step_ort": round(arms["window_eager"]["generator_window"]["median_ms"] / a,
                                                           2)}


def upstream_arm(hift_unfolded, f0_module, mel: np.ndarray, chunk: int, noise_table, torch) -> dict[str, Any]:
    """Upstream token2wav: re-run inference(all mel so far) per chunk on the GPU, emit past the offset."""
    dev = torch.device("cuda")
    cfg = hift_unfolded.config
    lat, offset = [], 0
    bounds = list(range(chunk, mel.shape[1], chunk)) + [mel.shape[1]]
    with torch.inference_mode():
        for i, end in enumerate(bounds):
            final = i == len(bounds) - 1
            t0 = time.perf_counter()
            x = torch.from_numpy(mel[None, :, :end]).to(dev)
            f0 = f0_module(x.double(), finalize=final).float()
            if not final:
                x = x[:, :, :-cfg.f0_look_ahead]
            n = f0.shape[1]
            if n >= (1 if final else 6):
                noise = torch.from_numpy(noise_table.rows(0, n * cfg.samples_per_frame)[None]).to(dev)
                audio, _ = hift_unfolded.generator.decode(x, f0, noise, torch.zeros(1, 9, dtype=torch.float64,
                                                                                    device=dev), finalize=final)
                audio[:, offset:].cpu()
                offset = audio.shape[1]
            torch.cuda.synchronize()
            lat.append(time.perf_counter() - t0)
    return {"push": stats(lat[1:-1]), "first_push": stats(lat[:1])}


def generator_alone(artifacts: Path, manifest, batch_sizes: list[int], tf32: bool, ort) -> dict[str, Any]:
    """The generator step of 24 frames: NumPy run, IO binding on device buffers, CUDA graph replay; and batched."""
    from hift_runtime.contract import StreamConstants

    c = StreamConstants.from_manifest(manifest.config, manifest.step)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    cuda = {"device_id": "0", "use_tf32": "1" if tf32 else "0", "cudnn_conv_algo_search": "HEURISTIC"}
    path = str(artifacts / "hift_generator_step.onnx")
    plain = ort.InferenceSession(path, opts, providers=[("CUDAExecutionProvider", cuda)])
    graphs = ort.InferenceSession(path, opts, providers=[("CUDAExecutionProvider", cuda | {"enable_cuda_graph": "1"})])

    def feed(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        f = {"mel": synthetic_mel(28)[None].repeat(batch, 0), "f0": np.full((batch, 25), 180, np.float32),
             "noise": rng.random((batch, 25 * 480, 9), dtype=np.float32),
             "phase_in": np.zeros((batch, 9)), "first": np.zeros((batch, 1), bool)}
        for spec in c.generator_caches:
            f["cache." + spec.name] = np.zeros((batch, *spec.shape), np.float32)
        return f

    def bound(session, batch: int, graph_id: int | None):
        values = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feed(batch).items()}
        binding = session.io_binding()
        for k, v in values.items():
            binding.bind_ortvalue_input(k, v)
        outs = {}
        for o in session.get_outputs():
            shape = [batch] + [d if isinstance(d, int) else 24 * 480 for d in o.shape[1:]]
            outs[o.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float64 if o.type == "tensor(double)"
                                                                      else np.float32, "cuda", 0)
            binding.bind_ortvalue_output(o.name, outs[o.name])
        ro = ort.RunOptions()
        if graph_id is not None:
            ro.add_run_config_entry("gpu_graph_id", str(graph_id))

        def run():
            session.run_with_iobinding(binding, ro)
            binding.synchronize_outputs()
        return run

    def timeit(fn, n: int) -> dict[str, float]:
        for _ in range(5):
            fn()
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - t0)
        return stats(lat)

    f1 = feed(1)
    out: dict[str, Any] = {"numpy_run": timeit(lambda: plain.run(None, f1), 100),
                           "iobinding_device": timeit(bound(plain, 1, None), 100),
                           "cuda_graph_replay": timeit(bound(graphs, 1, 1), 200)}
    batched = {}
    for i, b in enumerate(batch_sizes):
        t = timeit(bound(graphs, b, 10 + i), 30 if b >= 64 else 60)
        batched[str(b)] = {**t, "realtime_streams": round(b * CHUNK_SECONDS / (t["median_ms"] / 1e3), 1)}
    out["batched_cuda_graph"] = batched
    return out


def gpu_arms(args, result: dict[str, Any]) -> None:
    import onnxruntime as ort
    import torch

    from hift_model import load_hift
    from hift_torch.eager import torch_vocoder
    from hift_model.config import HiFTConfig
    from hift_runtime import open_vocoder

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # the CUDA and cuDNN libraries of the pip packages torch brought
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    artifacts = Path(args.artifacts)
    mel = synthetic_mel(int(args.seconds * 50))
    cpu = open_vocoder(artifacts, device="cpu")
    gpu, errors = {}, {}
    for name, precision in (("cuda_graphs", "fp32"), ("cuda_graphs_tf32", "tf32")):
        try:
            t0 = time.perf_counter()
            v = open_vocoder(artifacts, device="cuda", precision=precision, engine="ort")
            v.warmup()
            gpu[name] = (v, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
    result["gpu_open_errors"] = errors
    from hift_runtime.metrics import max_abs, snr_db

    try:
        _, _, b = timed_stream(cpu, mel, 24)
        parity = {}
        for name, (v, _) in gpu.items():
            _, _, a = timed_stream(v, mel, 24)
            parity[name] = {"vs_cpu_max_abs": max_abs(a, b), "vs_cpu_snr_db": round(snr_db(a, b), 1)}
        result["gpu_parity"] = parity
    except Exception as exc:  # noqa: BLE001
        result["gpu_parity"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    arms: dict[str, Any] = {}
    result["gpu"] = arms

    def attempt(name: str, fn) -> None:  # one failing arm must not lose the others' figures
        try:
            arms[name] = fn()
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            arms[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    for name, (v, open_s) in gpu.items():
        attempt(f"push_{name}", lambda v=v, open_s=open_s: {**stream_arm(v, mel, 24, args.repeats),
                                                            "open_and_warmup_s": round(open_s, 2)})
        attempt(f"push_{name}_chunk50", lambda v=v: stream_arm(v, mel, 50, 1))
    for name, (v, _) in gpu.items():
        attempt(f"breakdown_{name}", lambda v=v: push_breakdown(v, mel))
    sizes = [1, 8, 64, 256]
    manifest = cpu.backend.manifest
    attempt("f0_step_cpu_vs_cuda", lambda: f0_on_cuda(artifacts, manifest, ort))
    attempt("generator_step_tf32_off", lambda: generator_alone(artifacts, manifest, sizes, False, ort))
    attempt("generator_step_tf32_on", lambda: generator_alone(artifacts, manifest, sizes, True, ort))
    config = HiFTConfig.from_dict(manifest.config)
    seed = int(manifest.data["weights"]["seed"])

    def eager_arm():
        hift = load_hift(None, config=config, seed=seed, spectral="conv", f0_dtype=torch.float64, device="cuda")
        return stream_arm(torch_vocoder(hift, noise=cpu.noise), mel, 24, 1)

    def upstream():
        unfolded = load_hift(None, config=config, seed=seed, fold=False, f0_dtype=torch.float64, device="cuda")
        return upstream_arm(unfolded, unfolded.f0_predictor.to("cuda"), mel, 24, cpu.noise, torch)

    attempt("step_eager_cuda", eager_arm)
    attempt("upstream_revocode", upstream)
    base = arms.get("push_cuda_graphs", {}).get("push", {}).get("median_ms")
    if base:
        result["gpu_ratios"] = {k: round(arms[k]["push"]["median_ms"] / base, 2)
                                for k in ("push_cuda_graphs_tf32", "step_eager_cuda", "upstream_revocode")
                                if "push" in arms.get(k, {})}
    import subprocess

    try:
        result["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used",
                                           "--format=csv,noheader"], capture_output=True, text=True,
                                          timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        result["device"] = "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gpu", action="store_true", help="GPU arms instead of CPU arms")
    args = p.parse_args()
    import onnxruntime as ort

    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "host": platform.node(), "python": platform.python_version(),
                              "onnxruntime": ort.__version__, "chunk_frames": 24, "seconds": args.seconds,
                              "command": "python benchmarks/bench_step.py " + " ".join(
                                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                  if v not in (False, None))}
    if args.gpu:
        gpu_arms(args, result)
    else:
        cpu_arms(args, result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
