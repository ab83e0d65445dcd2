"""Every graph of an export, and of its stock-Triton repository, loads on the lowest ONNX Runtime the project claims
(pyproject: onnxruntime-gpu>=1.19: 1.19.2 is what the oldest supported Triton, r24.10, bundles), and the F0 step runs
there as on the current one.

ORT's optimizer fused a Transpose feeding the float64 MatMul into com.microsoft.FusedMatMul, which has no float64
kernel before ORT 1.26: the graph did not load there. `.ci/run` installs onnxruntime 1.19.2 into a folder of its own
(never beside onnxruntime-gpu) and names it in HIFT_OLDEST_ORT; elsewhere the run on it is skipped, and what any
version can check still runs: ORT's own optimized graph holds no contrib op in float64."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from hift_runtime.manifest import F0_STEP, read_manifest

OLDEST_ORT = os.environ.get("HIFT_OLDEST_ORT", "")
_RUN_F0 = """
import sys, numpy as np, onnxruntime as ort
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
feed = {"mel": np.load(sys.argv[2])}
for i in s.get_inputs()[1:]:
    feed[i.name] = np.zeros([2, *i.shape[1:]], np.float64)
np.save(sys.argv[3], s.run(None, feed)[0])
print(ort.__version__)
"""


def test_optimized_f0_graph_has_no_float64_contrib_op(small_artifacts, tmp_path):
    import onnx

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "f0.optimized.onnx")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(read_manifest(small_artifacts.out).path(F0_STEP)), options,
                         providers=["CPUExecutionProvider"])
    fused = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node if n.domain]
    assert fused == [], fused


@pytest.mark.skipif(not OLDEST_ORT, reason="HIFT_OLDEST_ORT (a folder holding onnxruntime 1.19.2) is not set")
def test_f0_graph_runs_on_the_oldest_claimed_onnxruntime(small_artifacts, tmp_path):
    path = str(read_manifest(small_artifacts.out).path(F0_STEP))
    mel = (np.random.default_rng(0).standard_normal((2, 80, 27)) - 4).astype(np.float32)
    np.save(tmp_path / "mel.npy", mel)
    env = {**os.environ, "PYTHONPATH": OLDEST_ORT}
    done = subprocess.run([sys.executable, "-c", _RUN_F0, path, str(tmp_path / "mel.npy"), str(tmp_path / "f0.npy")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("1.19")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = {"mel": mel, **{i.name: np.zeros([2, *i.shape[1:]], np.float64) for i in session.get_inputs()[1:]}}
    np.testing.assert_array_equal(np.load(tmp_path / "f0.npy"), session.run(None, feed)[0])


_LOAD_ALL = """
import sys, onnxruntime as ort
for path in sys.argv[1:]:
    ort.InferenceSession(path, providers=["CPUExecutionProvider"])
print(ort.__version__)
"""


@pytest.mark.skipif(not OLDEST_ORT, reason="HIFT_OLDEST_ORT (a folder holding onnxruntime 1.19.2) is not set")
def test_every_graph_and_the_triton_model_load_on_the_oldest_claimed_onnxruntime(small_artifacts, tmp_path):
    from pathlib import Path

    from hift_export.triton_repo import write_triton_repository

    write_triton_repository(read_manifest(small_artifacts.out), tmp_path / "repo", noise_seed=0, gpus=None,
                            log=lambda _: None)
    graphs = sorted(str(p) for p in Path(small_artifacts.out).glob("*.onnx"))
    graphs += sorted(str(p) for p in (tmp_path / "repo").glob("*/1/model.onnx"))
    assert len(graphs) == 6  # the export's five graphs and the repository's model
    env = {**os.environ, "PYTHONPATH": OLDEST_ORT}
    done = subprocess.run([sys.executable, "-c", _LOAD_ALL, *graphs], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("1.19")
