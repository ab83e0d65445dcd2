"""The exporter: artifacts, the step graphs against the eager step, the folder swap, and the export CLI."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from hift_model import load_hift
from hift_export.cli import main as export_main
from hift_export.graphs import F0StepGraph, GeneratorStepGraph
from hift_export.onnx_export import op_types
from hift_model.step import f0_cache_layout, generator_cache_layout
from hift_export.targets import (ARTIFACT_FILES, example_f0_step_inputs, example_generator_step_inputs,
                                 flat_arrays)
from hift_runtime.manifest import (F0_STEP, FORMAT_VERSION, GENERATOR_STEP, GENERATOR_STEP_FINAL,
                                   GENERATOR_STEP_FINAL_SLOTS, GENERATOR_STEP_SLOTS, GENERATOR_WEIGHTS, MANIFEST_NAME,
                                   sha256_file)

from .conftest import CHECKPOINT, max_abs, needs_fixtures
from .test_model import legacy_spelling, prefixed

ONNX_ROLES = (GENERATOR_STEP, GENERATOR_STEP_FINAL, F0_STEP)
SLOT_ROLES = (GENERATOR_STEP_SLOTS, GENERATOR_STEP_FINAL_SLOTS)  # rewritten from the generator graphs: ONNX only


def _sessions(out):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return {role: ort.InferenceSession(str(out / ARTIFACT_FILES[role]), opts, providers=["CPUExecutionProvider"])
            for role in ONNX_ROLES}


def _eager(hift, f0_precision):
    """The eager modules the graphs must equal: the F0 predictor in the graph's precision and form."""
    if f0_precision == "fp64":
        hift.f0_predictor.impl = "matmul"
    return hift


# ---- manifest and files --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["small", "full"])
def test_manifest(which, request):
    result = request.getfixturevalue(f"{which}_artifacts")
    out, manifest = result.out, json.loads((result.out / MANIFEST_NAME).read_text())
    assert manifest["fold_counts"] == {"generator": 77, "f0_predictor": 5}
    assert manifest["opset"] >= 18 and manifest["format_version"] == FORMAT_VERSION
    assert set(manifest["artifacts"]) == set(ARTIFACT_FILES)
    assert sorted(p.name for p in out.iterdir()) == sorted([*ARTIFACT_FILES.values(), MANIFEST_NAME])
    for role, entry in manifest["artifacts"].items():
        path = out / entry["file"]
        assert path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"], role
    if which == "full":
        assert manifest["weights"]["sha256"] == sha256_file(CHECKPOINT)
    else:
        assert manifest["weights"] == {"source": "seeded-random", "seed": 1986, "trained": False}
    for key in ("torch", "onnx", "onnxscript", "onnxruntime"):
        assert manifest["versions"][key]
    for role in (*ONNX_ROLES, *SLOT_ROLES):
        model = onnx.load(str(out / ARTIFACT_FILES[role]), load_external_data=False)
        meta = {p.key: json.loads(p.value) for p in model.metadata_props}
        assert meta["hift.config"] == manifest["config"] and meta["hift.role"] == role
        assert meta["hift.step"] == manifest["step"]
    # Every generator graph shares one weights file: no second copy of the 70 MB.
    for role in (GENERATOR_STEP, GENERATOR_STEP_FINAL, *SLOT_ROLES):
        assert manifest["artifacts"][role]["external_data"] == ARTIFACT_FILES[GENERATOR_WEIGHTS]


@pytest.mark.parametrize("which", ["small", "full"])
def test_cache_layout_in_manifest_and_graphs(which, request):
    """Every cache is a named input with a same-shaped output, per-stream shape and dtype as the manifest says,
    zero initial value; the layout is derived from the config (independently recomputed here)."""
    result = request.getfixturevalue(f"{which}_artifacts")
    manifest = result.manifest
    from hift_model.config import HiFTConfig

    config = HiFTConfig.from_dict(manifest["config"])
    gen, f0 = manifest["step"]["generator_caches"], manifest["step"]["f0_caches"]
    assert gen == generator_cache_layout(config) and f0 == f0_cache_layout(config, "float64")
    assert all(e["init"] == "zeros" for e in gen + f0)
    # Independent arithmetic for CosyVoice3's widths: ups caches k-1 at their input rate, a resblock conv (k-1)*d.
    shapes = {e["name"]: e["shape"] for e in gen}
    base = config.base_channels
    assert shapes["ups.0"] == [base, 15] and shapes["ups.2"] == [base // 4, 6]
    assert shapes["resblocks.2.2.conv1"] == [base // 2, 50] and shapes["source_resblocks.2.2.conv1"] == [base // 8, 50]
    assert shapes["source_downs.0"] == [18, 14] and shapes["source_downs.1"] == [18, 2] and "source_downs.2" not in shapes
    assert shapes["istft_tail"] == [1, 12] and shapes["audio_delay"] == [1, 472] and shapes["reflect"] == [base // 8, 1]
    if which == "full":
        # 144 332 floats per stream for the generator (0.58 MB; 1 000 streams hold 0.58 GB of device memory).
        assert sum(int(np.prod(s)) for s in shapes.values()) == 144_332
    sessions = _sessions(result.out)
    for role, layout in ((GENERATOR_STEP, gen), (F0_STEP, f0)):
        inputs = {i.name: i for i in sessions[role].get_inputs()}
        outputs = {o.name: o for o in sessions[role].get_outputs()}
        for e in layout:
            assert inputs["cache." + e["name"]].shape[1:] == e["shape"]
            assert outputs["next." + e["name"]].shape[1:] == e["shape"]
    assert not [o.name for o in sessions[GENERATOR_STEP_FINAL].get_outputs() if o.name.startswith("next.")]


@pytest.mark.parametrize("which", ["small", "full"])
def test_graph_ops(which, request):
    out = request.getfixturevalue(f"{which}_artifacts").out
    no_cuda_kernel_or_random = {"STFT", "DFT", "RandomNormal", "RandomNormalLike", "RandomUniform",
                                "RandomUniformLike", "Multinomial", "Bernoulli", "Loop", "If", "Scan"}
    for role in (*ONNX_ROLES, *SLOT_ROLES):
        ops = set(op_types(onnx.load(str(out / ARTIFACT_FILES[role]), load_external_data=False)))
        assert not ops & no_cuda_kernel_or_random, (role, ops & no_cuda_kernel_or_random)
    f0 = onnx.load(str(out / ARTIFACT_FILES[F0_STEP]))
    # float64 inside, float32 at the interface; ORT has no float64 Conv/Elu, so the F0 graph must not use them.
    assert not {"Conv", "Elu"} & set(op_types(f0))
    for value in f0.graph.input[:1]:
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert f0.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


@needs_fixtures
@pytest.mark.parametrize("spelling", ["legacy", "prefixed"])
def test_every_key_spelling_gives_the_exported_weights(full_artifacts, spelling):
    """The graphs' weights equal the weights loaded from each spelling (bitwise)."""
    state = torch.load(CHECKPOINT, map_location="cpu", weights_only=True)
    state = legacy_spelling(state) if spelling == "legacy" else prefixed(state)
    hift = load_hift(state, spectral="conv")
    weights = {k: v.numpy() for k, v in hift.generator.state_dict().items()}
    model = onnx.load(str(full_artifacts.out / ARTIFACT_FILES[GENERATOR_STEP]))  # external data resolved
    checked = 0
    for init in model.graph.initializer:
        name = init.name.removeprefix("generator.")
        if name in weights:
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), weights[name])
            checked += 1
    assert checked >= 160  # the weight and bias of all 80 convs (Snake alphas are folded into 1/alpha)


# ---- step graphs vs the eager step, same inputs and caches -----------------------------------------------------------
def _check_step_graphs(out, hift, steps, batch, seed):
    sessions = _sessions(out)
    scripted = {role: torch.jit.load(str(out / ARTIFACT_FILES["ts_" + role])) for role in ONNX_ROLES}
    with torch.inference_mode():
        for role, final in ((GENERATOR_STEP, False), (GENERATOR_STEP_FINAL, True)):
            args = example_generator_step_inputs(hift.config, steps, batch, final, seed=seed)
            want = [t.numpy() for t in GeneratorStepGraph(hift.generator, final)(*args)]
            names = [i.name for i in sessions[role].get_inputs()]
            got = sessions[role].run(None, dict(zip(names, flat_arrays(args))))
            ts = [t.numpy() for t in scripted[role](*args)]
            assert got[0].shape == (batch, 480 * (steps + 1 if final else steps))
            # Audio: measured <= 2e-7 (ORT CPU), 0 (TorchScript). Caches: relative to each cache's scale, as the
            # exporter's self-check: <= 2.2e-6 of it measured (ORT 1.31 CPU, torch 2.13; 1.2e-5 absolute on caches
            # up to ~6), float32 rounding accumulated over a conv's taps.
            assert max_abs(got[0], want[0]) <= 1e-6 and max_abs(ts[0], want[0]) <= 1e-6
            np.testing.assert_array_equal(got[1], want[1])  # the float64 running phase: exact
            for g, t, w in zip(got[2:], ts[2:], want[2:]):
                assert max_abs(g, w) <= 1e-5 * max(1.0, float(np.max(np.abs(w)))) and max_abs(t, w) <= 1e-6
        args = example_f0_step_inputs(hift.config, steps, batch, "float64", seed=seed)
        want = [t.numpy() for t in F0StepGraph(hift.f0_predictor, hift.config, "float64")(*args)]
        names = [i.name for i in sessions[F0_STEP].get_inputs()]
        got = sessions[F0_STEP].run(None, dict(zip(names, flat_arrays(args))))
        assert got[0].dtype == np.float32 and got[0].shape == (batch, steps)
        np.testing.assert_array_equal(got[0], want[0])  # float64 inside both: the same F0, bit for bit
        for g, w in zip(got[1:], want[1:]):
            assert max_abs(g, w) <= 1e-12  # float64 caches (MatMul summation order only)


@pytest.mark.parametrize("steps, batch", [(1, 1), (9, 3), (40, 2)])
def test_small_step_graphs_match_eager(small_artifacts, reduced_config, steps, batch):
    hift = _eager(load_hift(None, config=reduced_config, spectral="conv", f0_dtype=torch.float64), "fp64")
    _check_step_graphs(small_artifacts.out, hift, steps, batch, seed=steps * 10 + batch)


@needs_fixtures
@pytest.mark.parametrize("steps, batch", [(1, 2), (24, 1)])
def test_full_step_graphs_match_eager(full_artifacts, steps, batch):
    hift = _eager(load_hift(str(CHECKPOINT), spectral="conv", f0_dtype=torch.float64), "fp64")
    _check_step_graphs(full_artifacts.out, hift, steps, batch, seed=steps + batch)


@needs_fixtures
def test_full_graphs_on_fixture_reproduce_upstream(full_artifacts, reference):
    """Fixture mel and noise from the utterance start (zero caches, ``first``): the F0 step gives upstream's float64
    F0 bit for bit, the final step over all frames (one offline pass) upstream's audio."""
    sessions = _sessions(full_artifacts.out)
    mel = reference["mel"]
    feed = {"mel": np.concatenate([mel, np.zeros((1, 80, 3), np.float32)], axis=2)}
    for i in sessions[F0_STEP].get_inputs()[1:]:
        feed[i.name] = np.zeros([1, *i.shape[1:]], np.float64)
    f0 = sessions[F0_STEP].run(None, feed)[0]
    np.testing.assert_array_equal(f0, reference["f0_fp64"])
    final = sessions[GENERATOR_STEP_FINAL]
    feed = {"mel": mel, "f0": f0, "noise": reference["noise"], "phase_in": np.zeros((1, 9), np.float64),
            "first": np.array([[True]])}
    for i in final.get_inputs()[5:]:
        feed[i.name] = np.zeros([1, *i.shape[1:]], np.float32)
    audio = final.run(None, feed)[0][:, 480:]  # the first 480 samples of a first step precede the utterance
    assert max_abs(audio, reference["audio_fp64f0"]) <= 1e-6  # measured 1.2e-7
    feed["f0"] = reference["f0_fp32"]
    audio32 = final.run(None, feed)[0][:, 480:]
    assert max_abs(audio32, reference["audio_fp32f0"]) <= 1e-6  # measured 1.5e-7


# ---- the folder swap ----------------------------------------------------------------------------------------------
def test_export_replaces_the_whole_folder(small_artifacts, tmp_path):
    """The swap leaves no file of the earlier export (e.g. .ts after an ONNX-only export), keeps files no export
    wrote, and an export's start removes the staging folders of an export that was killed."""
    import shutil

    from hift_export.export import export_names
    from hift_export.folder_swap import recover_stale_siblings, swap_into_place

    out = tmp_path / "artifacts"
    shutil.copytree(small_artifacts.out, out)
    (out / "README.md").write_text("mine")
    staging = tmp_path / ".artifacts.staging-new"
    staging.mkdir()
    onnx_only = [ARTIFACT_FILES[r] for r in (*ONNX_ROLES, *SLOT_ROLES, GENERATOR_WEIGHTS)] + [MANIFEST_NAME]
    for name in onnx_only:
        shutil.copy(small_artifacts.out / name, staging / name)
    swap_into_place(staging, out, export_names())
    assert sorted(p.name for p in out.iterdir()) == sorted(onnx_only + ["README.md"])
    assert (out / "README.md").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["artifacts"]  # no staging or old folder left
    (tmp_path / ".artifacts.staging-killed").mkdir()
    (tmp_path / ".artifacts.old-killed").mkdir()
    recover_stale_siblings(out, export_names())
    assert [p.name for p in tmp_path.iterdir()] == ["artifacts"]


def test_failed_export_leaves_the_earlier_export(small_artifacts, tmp_path, reduced_config):
    import shutil

    from hift_model import CheckpointError
    from hift_export.export import export_artifacts
    from hift_model.model import random_state_dict

    out = tmp_path / "artifacts"
    shutil.copytree(small_artifacts.out, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = random_state_dict(reduced_config)
    del bad["conv_post.bias"]
    with pytest.raises(CheckpointError):
        export_artifacts(bad, out, config=reduced_config)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["artifacts"]


# ---- CLI -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--opset", "12"], "opset 12 is too old"),
    (["--formats", "tflite"], "formats must be"),
    (["--checkpoint", "/nonexistent/hift.pt"], "does not exist"),
])
def test_export_cli_errors_are_one_line(argv, message, tmp_path, capsys):
    code = export_main(argv + ["--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
