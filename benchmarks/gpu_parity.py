"""Where a GPU's distance from the CPU comes from, stage by stage, with every step eager (no compile). Not a test.

    python benchmarks/gpu_parity.py --artifacts DIR --out benchmarks/results/NAME.json [--seconds 20]

DIR: any export with the folded weights (``hift-export --formats weights``). On one synthetic mel:

* ``f0``: the F0 step (float64 inside) on the GPU against the CPU on the same mel: float32 values that differ;
* ``source``: the excitation on both devices from the same F0: the float64 phase sums, the float32 values they round
  to (a differing one moves that frame's sine), the source's SNR;
* ``stream_*``: a whole stream (24-frame pushes) on the GPU's eager engine against the CPU's offline pass, as it
  runs and with the CPU's F0 step swapped in.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_step import synthetic_mel
from compiled_engine import distances, stream_audio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=20.0, help="the long stream's length (default 20 s)")
    p.add_argument("--device", default="cuda", help="the device compared with the CPU (default cuda)")
    args = p.parse_args()
    from hift_runtime import open_vocoder

    cpu = open_vocoder(args.artifacts, device="cpu", engine="compiled")
    # No warmup(): every step of the GPU's engine runs eagerly (the compiled rest equals it within ~1e-7).
    gpu = open_vocoder(args.artifacts, device=args.device, engine="compiled", batching=False)
    bc, bg = cpu.backend, gpu.backend
    frames = int(args.seconds * 50)
    mel = synthetic_mel(frames, seed=5)
    out: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "command": "python benchmarks/gpu_parity.py " + " ".join(
                               f"--{k} {v}" for k, v in vars(args).items()),
                           "torch": torch.__version__, "seconds": args.seconds}
    f0_cpu, _ = bc.f0_step(mel[None], bc.new_caches("f0", 1))
    f0_gpu, _ = bg.f0_step(mel[None], bg.new_caches("f0", 1))
    out["f0"] = {"frames": int(f0_cpu.size), "max_abs": float(np.abs(f0_cpu - f0_gpu).max()),
                 "float32_values_differing": int((f0_cpu != f0_gpu).sum())}

    usable = (f0_cpu.shape[1] // 24) * 24
    f0 = torch.from_numpy(np.ascontiguousarray(f0_cpu[:, :usable]))
    c = gpu.constants
    noise = torch.zeros(1, usable * c.samples_per_frame, c.num_sines)
    phase_in = torch.zeros(1, c.num_sines, dtype=torch.float64)
    dev = bg.device
    with torch.inference_mode():
        src_cpu, cum_cpu = bc.generator.m_source(f0, noise, phase_in)
        src_gpu, cum_gpu = (t.cpu() for t in bg.generator.m_source(f0.to(dev), noise.to(dev), phase_in.to(dev)))
    out["source"] = {"phase_sum_max_abs_turns": float((cum_cpu - cum_gpu).abs().max()),
                     "phase_sum_float32_values_differing": int((cum_cpu.float() != cum_gpu.float()).sum()),
                     "phase_sum_values": int(cum_cpu.numel()),
                     "vs_cpu": distances(src_gpu.numpy().ravel(), src_cpu.numpy().ravel())}
    print(json.dumps(out), flush=True)

    want = cpu.vocode(mel)
    out["stream_vs_cpu"] = distances(stream_audio(gpu, mel), want)
    bg.f0_step = bc.f0_step  # the CPU's F0 in the GPU's stream: what the F0 step contributes
    out["stream_with_cpu_f0_vs_cpu"] = distances(stream_audio(gpu, mel), want)
    gpu.close()
    cpu.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
