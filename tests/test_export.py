"""Issue 3: the exporter's artifacts, their parity with the eager modules, and the export CLI."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from hift_export import load_hift
from hift_export.cli import main as export_main
from hift_export.export import (ARTIFACT_FILES, CUDA_OP_ALLOWLIST, F0_OP_ALLOWLIST, FORBIDDEN_OPS,
                                _example_generator_inputs, op_types)
from hift_export.graphs import F0Graph, GeneratorGraph
from hift_runtime.manifest import F0, GENERATOR_FINAL, GENERATOR_STREAM, MANIFEST_NAME, sha256_file

from .conftest import CHECKPOINT, max_abs, needs_fixtures
from .test_model import legacy_spelling, prefixed

ONNX_ROLES = (GENERATOR_STREAM, GENERATOR_FINAL, F0)


def _sessions(out):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return {role: ort.InferenceSession(str(out / ARTIFACT_FILES[role]), opts, providers=["CPUExecutionProvider"])
            for role in ONNX_ROLES}


def _torchscript(out):
    return {role: torch.jit.load(str(out / ARTIFACT_FILES["ts_" + role])) for role in ONNX_ROLES}


def _eager_f0_module(hift, manifest):
    if manifest["f0_precision"] == "fp64":
        f0 = load_hift(None if manifest["weights"]["source"] != "checkpoint" else str(CHECKPOINT),
                       config=hift.config, f0_dtype=torch.float64).f0_predictor
        f0.impl = "matmul"
        return f0
    return hift.f0_predictor


# ---- manifest and files --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["small", "full"])
def test_manifest(which, request):
    result = request.getfixturevalue(f"{which}_artifacts")
    out, manifest = result.out, json.loads((result.out / MANIFEST_NAME).read_text())
    assert manifest["fold_counts"] == {"generator": 77, "f0_predictor": 5}
    assert manifest["opset"] >= 18 and manifest["format_version"] == 1
    for role, entry in manifest["artifacts"].items():
        path = out / entry["file"]
        assert path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"], role
    assert set(manifest["artifacts"]) == set(ARTIFACT_FILES)
    if which == "full":
        assert manifest["weights"]["sha256"] == sha256_file(CHECKPOINT)
    else:
        assert manifest["weights"] == {"source": "seeded-random", "seed": 1986, "trained": False}
    for key in ("torch", "onnx", "onnxscript", "onnxruntime"):
        assert manifest["versions"][key]
    for role in ONNX_ROLES:
        model = onnx.load(str(out / ARTIFACT_FILES[role]), load_external_data=False)
        meta = {p.key: json.loads(p.value) for p in model.metadata_props}
        assert meta["hift.config"] == manifest["config"] and meta["hift.role"] == role
        assert meta["hift.streaming"] == manifest["streaming"]
    # Both generator graphs share one weights file: no second copy of the 70 MB.
    assert manifest["artifacts"][GENERATOR_STREAM]["external_data"] == ARTIFACT_FILES["generator_weights"]
    # The export checked itself and wrote its figures down.
    for what in ("onnx_cpu", "torchscript"):
        figures = manifest["parity"][what]
        assert figures["generator_stream_audio"] <= 1e-5 and figures["f0_relative"] <= 1e-5


@pytest.mark.parametrize("which", ["small", "full"])
def test_graph_ops(which, request):
    out = request.getfixturevalue(f"{which}_artifacts").out
    for role in (GENERATOR_STREAM, GENERATOR_FINAL):
        ops = set(op_types(onnx.load(str(out / ARTIFACT_FILES[role]), load_external_data=False)))
        assert ops <= CUDA_OP_ALLOWLIST, ops - CUDA_OP_ALLOWLIST
        assert not ops & FORBIDDEN_OPS and "STFT" not in ops and "DFT" not in ops
    f0 = onnx.load(str(out / ARTIFACT_FILES[F0]))
    assert set(op_types(f0)) <= F0_OP_ALLOWLIST and not set(op_types(f0)) & FORBIDDEN_OPS
    for value in list(f0.graph.input) + list(f0.graph.output):
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT, value.name


@needs_fixtures
@pytest.mark.parametrize("spelling", ["legacy", "prefixed"])
def test_every_key_spelling_gives_the_exported_weights(full_artifacts, spelling):
    """The graphs' weights equal the weights loaded from each spelling (bitwise)."""
    state = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)
    state = legacy_spelling(state) if spelling == "legacy" else prefixed(state)
    hift = load_hift(state, spectral="conv")
    weights = {k: v.numpy() for k, v in hift.generator.state_dict().items()}
    model = onnx.load(str(full_artifacts.out / ARTIFACT_FILES[GENERATOR_STREAM]))  # external data resolved
    checked = 0
    for init in model.graph.initializer:
        name = init.name.removeprefix("generator.")
        if name in weights:
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(init),
                                          weights[name])
            checked += 1
    assert checked >= 160  # the weight and bias of all 80 convs (Snake alphas are folded into 1/alpha)


# ---- graph parity --------------------------------------------------------------------------------------------------
def _check_generator_parity(out, hift, frames, batch, seed):
    sessions, scripted = _sessions(out), _torchscript(out)
    args = _example_generator_inputs(hift.config, frames, batch, seed=seed)
    feed = dict(zip(("mel", "f0", "noise", "phase_in"), (a.numpy() for a in args)))
    figures = {}
    with torch.inference_mode():
        for role, finalize in ((GENERATOR_STREAM, False), (GENERATOR_FINAL, True)):
            ref_audio, ref_phase = GeneratorGraph(hift.generator, finalize)(*args)
            ort_audio, ort_phase = sessions[role].run(None, feed)
            ts_audio, ts_phase = scripted[role](*args)
            spf = hift.config.samples_per_frame
            assert ort_audio.shape == (batch, spf * (frames if finalize else frames - 5))
            figures[role] = (max_abs(ort_audio, ref_audio.numpy()), max_abs(ts_audio.numpy(), ref_audio.numpy()))
            # Generator audio <= 1e-5 (measured <= 4e-7 for ORT CPU, <= 2e-7 TorchScript).
            assert figures[role][0] <= 1e-5 and figures[role][1] <= 1e-5, figures
            assert ort_phase.dtype == np.float64
            np.testing.assert_array_equal(ort_phase, ref_phase.numpy())  # float64 running sum: exact
    return figures


def _check_f0_parity(out, f0_module, frames, batch, seed):
    sessions, scripted = _sessions(out), _torchscript(out)
    mel = torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed)) * 2 - 5
    with torch.inference_mode():
        ref = F0Graph(f0_module)(mel).numpy()
        scale = float(np.max(np.abs(ref)))
        for got in (sessions[F0].run(None, {"mel": mel.numpy()})[0], scripted[F0](mel).numpy()):
            assert got.dtype == np.float32 and got.shape == (batch, frames - 3)
            # F0 within 1e-5 of max |F0| (measured: 0 in float64, 3.7e-6 with --f0-precision fp32).
            assert max_abs(got, ref) <= 1e-5 * scale


@pytest.mark.parametrize("frames", [9, 57, 300])
@pytest.mark.parametrize("batch", [1, 3])
def test_small_graphs_match_eager(small_artifacts, frames, batch, reduced_config):
    hift = load_hift(None, config=reduced_config, spectral="conv")
    _check_generator_parity(small_artifacts.out, hift, frames, batch, seed=frames * 10 + batch)
    _check_f0_parity(small_artifacts.out, _eager_f0_module(hift, small_artifacts.manifest), frames, batch, seed=frames)


@needs_fixtures
@pytest.mark.parametrize("frames, batch", [(9, 1), (9, 3), (57, 1)])
def test_full_graphs_match_eager(full_artifacts, frames, batch):
    hift = load_hift(str(CHECKPOINT), spectral="conv")
    _check_generator_parity(full_artifacts.out, hift, frames, batch, seed=frames + batch)
    _check_f0_parity(full_artifacts.out, _eager_f0_module(hift, full_artifacts.manifest), frames, batch, seed=frames)


@needs_fixtures
def test_full_graphs_on_fixture_reproduce_upstream(full_artifacts, reference):
    """Fixture mel, fixture noise: the F0 graph gives upstream's float64 F0, the generator upstream's audio."""
    sessions = _sessions(full_artifacts.out)
    mel = reference["mel"]
    f0 = sessions[F0].run(None, {"mel": np.concatenate([mel, np.zeros((1, 80, 3), np.float32)], axis=2)})[0]
    assert max_abs(f0, reference["f0_fp64"]) <= 1e-3  # measured 0.0 (float64 inside the graph, like upstream)
    feed = {"mel": mel, "f0": f0, "noise": reference["noise"], "phase_in": np.zeros((1, 9), np.float64)}
    audio, _ = sessions[GENERATOR_FINAL].run(None, feed)
    assert max_abs(audio, reference["audio_fp64f0"]) <= 2e-5  # measured 6.6e-7
    feed["f0"] = reference["f0_fp32"]
    audio32, _ = sessions[GENERATOR_FINAL].run(None, feed)
    assert max_abs(audio32, reference["audio_fp32f0"]) <= 2e-5  # measured 7e-7


# ---- CLI -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--opset", "12"], "opset 12 is too old"),
    (["--formats", "tflite"], "formats must be"),
    (["--checkpoint", "/nonexistent/hift.pt"], "does not exist"),
    (["--window-frames", "0"], "--window-frames must be >= 1"),
])
def test_export_cli_errors_are_one_line(argv, message, tmp_path, capsys):
    code = export_main(argv + ["--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_failed_export_leaves_no_partial_artifacts(tmp_path, reduced_config):
    from hift_export import CheckpointError
    from hift_export.export import export_artifacts
    from hift_export.model import random_state_dict

    bad = random_state_dict(reduced_config)
    del bad["conv_post.bias"]
    out = tmp_path / "out"
    with pytest.raises(CheckpointError):
        export_artifacts(bad, out, config=reduced_config)
    assert not out.exists() or list(out.iterdir()) == []
