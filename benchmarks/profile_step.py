"""Where a generator step's time goes, op type by op type: the plain step graph (caches as inputs) against its slot
form (caches in a device pool), through ONNX Runtime's profiler. Not a test: it reports figures.

    python benchmarks/profile_step.py --artifacts DIR --out R.json [--device cuda] [--batch 1] [--frames 24]

Both graphs run as ordinary calls (a CUDA-graph replay hides its nodes from the profiler) on the same inputs, zero
caches, ``--runs`` times after one warm call; per op type: total kernel microseconds per run and node count, plus
each form's wall time per call. Ordinary calls carry a host cost per node that a CUDA graph does not: to compare the
forms as they run in the runtime, replay them (``benchmarks/slot_forms.py``), which is what located the slot form's
former extra cost (ScatterND writing whole rows with one thread per row; BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def profile(session_path: Path, feed: dict[str, np.ndarray], providers: list[Any], runs: int) -> dict[str, Any]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.enable_profiling = True
    opts.profile_file_prefix = str(Path(tempfile.mkdtemp()) / session_path.stem)
    session = ort.InferenceSession(str(session_path), opts, providers=providers)
    session.run(None, feed)  # builds each shape's kernels; its events are dropped below
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feed)
        walls.append((time.perf_counter() - t0) * 1e3)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs_seen = [e for e in events if e.get("name") == "model_run"]
    first_end = runs_seen[0]["ts"] + runs_seen[0]["dur"] if runs_seen else 0
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    nodes: dict[str, set[str]] = collections.defaultdict(set)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first_end:
            op = e.get("args", {}).get("op_name", "?")
            by_op[op][0] += e["dur"] / runs
            nodes[op].add(e["name"])
    top = sorted(by_op.items(), key=lambda kv: -kv[1][0])
    return {"wall_ms_median": round(float(np.median(walls)), 3),
            "kernel_us_per_run": round(sum(v[0] for v in by_op.values()), 1),
            "providers": session.get_providers(),
            "by_op": {op: {"us_per_run": round(v[0], 1), "nodes": len(nodes[op])} for op, v in top}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--pool-rows", type=int, default=2049)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    import onnxruntime as ort

    from hift_runtime.manifest import GENERATOR_STEP, GENERATOR_STEP_SLOTS, read_manifest
    from hift_runtime.sessions import _zero_step_feed
    from hift_runtime.contract import StreamConstants

    if args.device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    manifest = read_manifest(args.artifacts, verify=None)
    c = StreamConstants.from_manifest(manifest.config, manifest.step)
    feed = _zero_step_feed(c, args.frames, args.batch)
    feed["mel"] -= 5.0  # a quiet log-mel, not zeros
    feed["f0"] += 120.0
    providers = [("CUDAExecutionProvider", {"use_tf32": "0", "cudnn_conv_algo_search": "HEURISTIC"}),
                 "CPUExecutionProvider"] if args.device == "cuda" else ["CPUExecutionProvider"]
    caches = {"cache." + spec.name: spec.zeros(args.batch) for spec in c.generator_caches}
    row = sum(int(np.prod(spec.shape)) for spec in c.generator_caches)
    slots = {"slots": np.arange(1, args.batch + 1, dtype=np.int64),
             "pool": np.zeros(max(args.pool_rows, args.batch + 1) * row, np.float32)}  # flat, as the slot form takes it
    result = {"command": "python benchmarks/profile_step.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                        for k, v in vars(args).items()),
              "onnxruntime": ort.__version__,
              "plain": profile(manifest.path(GENERATOR_STEP), {**feed, **caches}, providers, args.runs),
              "slots": profile(manifest.path(GENERATOR_STEP_SLOTS), {**feed, **slots}, providers, args.runs)}
    plain, slot = result["plain"]["by_op"], result["slots"]["by_op"]
    us = lambda table, op: table.get(op, {}).get("us_per_run", 0)  # noqa: E731
    result["slots_minus_plain_us"] = {op: round(us(slot, op) - us(plain, op), 1)
                                      for op in sorted(set(plain) | set(slot))}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for form in ("plain", "slots"):
        r = result[form]
        print(f"{form}: {r['wall_ms_median']} ms per call, {r['kernel_us_per_run']} us of kernels; top:",
              list(r["by_op"].items())[:6])
    print("slots - plain, us per run:", {k: v for k, v in result["slots_minus_plain_us"].items() if abs(v) > 20})


if __name__ == "__main__":
    main()
