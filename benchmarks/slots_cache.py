"""Whether inductor's on-disk cache serves the compiled step at another slot count: one process per slot count, in
turn, on one fresh cache folder, each compiling the step of ``--shape`` (its first call, as warmup's) and checking it
against the eager step on random inputs (the audio, the phase and the cache rows it writes). Not a test: a first
process should miss the cache and compile; each later one, at other slots, should hit it and only load.

    python benchmarks/slots_cache.py --artifacts DIR [--device cuda] [--precision fp16] [--slots 2048,3100,64] \\
        [--shape generator:24] [--out R.json]

The engine marks the cache pool's rows dynamic (``hift_torch.compiled.CompiledBackend``); ``--static-pool`` drops
that mark in every process, to show the cache as it was (one compile per slot count).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> dict:
    """One slot count: build the engine, make the step's first call (a compile or a load), compare it with eager."""
    import torch
    from torch._dynamo.utils import counters

    from hift_torch.compiled import CompiledBackend, _mark_batch_dynamic
    from hift_runtime.manifest import read_manifest
    from hift_runtime.noise import NoiseTable
    from hift_runtime.contract import StreamConstants

    manifest = read_manifest(args.artifacts)
    c = StreamConstants.from_manifest(manifest.config, manifest.step)
    backend = CompiledBackend(manifest, c, device=args.device, precision=args.precision, compile=True,
                              cuda_graphs=False, slots=args.child)
    if args.static_pool:
        backend._generator_rows.pool = backend._generator_rows.pool.clone()  # unmarked: as before the engine's mark
    backend.use_noise_table(NoiseTable.seeded(0, 4 * 24 * c.samples_per_frame, c.num_sines))
    kind, size = args.shape.split(":")
    size = int(size)
    g = torch.Generator().manual_seed(0)
    pool = backend._generator_rows.pool
    pool.copy_(torch.randn(pool.shape, generator=g).to(pool.device) * 0.1)
    before = pool.clone()
    batch = 3
    inputs = backend._zeros(kind, size, batch)
    mel, f0, noise, phase, first, slots = inputs[:6]
    mel.copy_(torch.randn(mel.shape, generator=g))
    f0.copy_(torch.rand(f0.shape, generator=g) * 300 + 100)  # Hz
    noise.copy_(torch.randint(0, 1000, noise.shape, generator=g))
    phase.copy_(torch.rand(phase.shape, generator=g, dtype=torch.float64))
    first.copy_(torch.tensor([[True], [False], [False]]))
    slots.copy_(torch.randperm(args.child, generator=g)[:batch] + 1)  # row 0 is scratch
    _mark_batch_dynamic(inputs)
    eager = backend._final if kind == "final" else backend._step
    with backend._precision():
        started = time.perf_counter()
        compiled_out = backend._compiled[kind](*inputs)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        seconds = time.perf_counter() - started
        compiled_pool = pool.clone()
        pool.copy_(before)
        eager_out = eager(*inputs)
    return {"slots": args.child, "first_call_s": round(seconds, 1),
            "fxgraph": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")},
            "graphs": counters["stats"]["unique_graphs"],
            "max_abs_vs_eager": max(float((a.double() - b.double()).abs().max())
                                    for a, b in zip(compiled_out, eager_out)),
            "pool_max_abs_vs_eager": float((compiled_pool.double() - pool.double()).abs().max()),
            "rows_written": int((compiled_pool != before).any(dim=1).sum())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifacts", required=True,
                   help="an export with the folded weights (hift-export --formats weights)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16"])
    p.add_argument("--slots", default="16,64", help="the slot counts, one process each, in turn (default 16,64)")
    p.add_argument("--shape", default="generator:24", help="the step compiled: generator:N or final:N")
    p.add_argument("--static-pool", action="store_true", help="the pool's rows static, as before (to compare)")
    p.add_argument("--cache-dir", help="inductor's cache folder (default: a fresh temporary one)")
    p.add_argument("--out", help="a JSON of the results")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args)), flush=True)
        return
    cache = args.cache_dir or tempfile.mkdtemp(prefix="hift-slots-cache-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    runs = []
    for slots in (int(n) for n in args.slots.split(",")):
        command = [sys.executable, __file__, "--artifacts", args.artifacts, "--device", args.device, "--precision",
                   args.precision, "--shape", args.shape, "--child", str(slots)]
        command += ["--static-pool"] if args.static_pool else []
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"slots {slots}: the process failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    result = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/slots_cache.py " + " ".join(sys.argv[1:]),
              "cache_dir": cache, "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
