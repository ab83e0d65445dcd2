"""The stock-Triton repository on a real tritonserver: Triton 2.51 (r24.10) with its onnxruntime backend, built
against ONNX Runtime 1.19.2 by ``../shared/tools/real-triton/build.sh`` into ``REAL_TRITON_HOME`` (``.ci/run`` builds
it). Skipped where no such build is named."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import pytest

from hift_runtime.manifest import read_manifest

from .conftest import FIXTURES
from .test_serve import _free_ports

HOME = os.environ.get("REAL_TRITON_HOME", "")
SERVE = FIXTURES.parent / "tools" / "real-triton" / "serve.sh"
pytestmark = pytest.mark.skipif(
    not HOME or not os.path.isfile(os.path.join(HOME, "backends", "onnxruntime", "libtriton_onnxruntime.so"))
    or not SERVE.is_file(), reason="no real tritonserver build (REAL_TRITON_HOME, ../shared/tools/real-triton)")


def test_the_repository_loads_as_written_on_a_cpu_only_triton(small_artifacts, tmp_path):
    """``hift-export --triton-repo``'s repository, unchanged, on a Triton without GPUs: both models ready."""
    from hift_export.triton_repo import write_triton_repository

    write_triton_repository(read_manifest(small_artifacts.out), tmp_path / "repo", max_batch=8, noise_seed=0,
                            gpus=None, log=lambda _: None)
    http, grpc, metrics = _free_ports(3)
    log = tmp_path / "triton.log"
    started = subprocess.run(["bash", str(SERVE), str(tmp_path / "repo"), str(http), str(grpc), str(metrics), str(log)],
                             env={**os.environ, "WAIT_READY": "120"}, capture_output=True, text=True, timeout=180)
    pid = int(started.stdout.strip().splitlines()[0]) if started.stdout.strip() else None
    try:
        assert started.returncode == 0, (started.stderr + log.read_text(errors="replace"))[-3000:]
        for model in ("hift_f0", "hift_generator"):
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{model}/ready", timeout=10) as ready:
                assert ready.status == 200, model
        assert "hift_generator_0_0 (CPU device 0)" in log.read_text(errors="replace")
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            for _ in range(200):  # it unloads the models and exits within its 15 s exit timeout
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
