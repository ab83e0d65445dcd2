"""Probe: what a change of window length costs the CUDA EP generator, and what avoids it.

    python benchmarks/probe_shapes.py --artifacts DIR --out results.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

SHAPES = [21, 45, 69, 93, 93, 93, 93]


def feed(n):
    rng = np.random.default_rng(n)
    return {"mel": (rng.standard_normal((1, 80, n)) * 0.5 - 5).astype(np.float32),
            "f0": np.full((1, n), 180, np.float32), "noise": rng.random((1, n * 480, 9), dtype=np.float32),
            "phase_in": np.zeros((1, 9))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--artifacts", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import onnxruntime as ort

    ort.preload_dlls()
    path = str(Path(args.artifacts) / "hift_generator_stream.onnx")
    feeds = {n: feed(n) for n in set(SHAPES)}

    def session(**cuda):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        return ort.InferenceSession(path, opts, providers=[("CUDAExecutionProvider", cuda)])

    def loop(get_session):
        out = []
        for _ in range(3):
            row = []
            for n in SHAPES:
                s = get_session(n)
                t0 = time.perf_counter()
                s.run(None, feeds[n])
                row.append(round((time.perf_counter() - t0) * 1e3, 2))
            out.append(row)
        return out

    results = {"shapes": SHAPES}
    for name, opts in (("heuristic", {"cudnn_conv_algo_search": "HEURISTIC"}),
                       ("default", {"cudnn_conv_algo_search": "DEFAULT"}),
                       ("heuristic_pad_nc1d", {"cudnn_conv_algo_search": "HEURISTIC", "cudnn_conv1d_pad_to_nc1d": "1"}),
                       ("exhaustive", {"cudnn_conv_algo_search": "EXHAUSTIVE"})):
        s = session(**opts)
        results[name] = loop(lambda n, s=s: s)
    per_shape = {}
    results["session_per_shape_heuristic"] = loop(
        lambda n: per_shape.setdefault(n, session(cudnn_conv_algo_search="HEURISTIC")))
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
