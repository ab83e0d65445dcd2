"""Checkpoint -> deployable artifacts: ONNX graphs, TorchScript traces, manifest; then a self-check.

Artifacts (file names in ``ARTIFACT_FILES``):

* ``hift_generator_stream.onnx`` / ``hift_generator_final.onnx``: the generator (source, STFT, decoder, iSTFT
  all inside) in its two call semantics, FP32, dynamic batch and frames, meant for the CUDA EP. Both graphs read
  their weights from one shared external-data file, ``hift_generator.weights``, so the pair costs one copy.
* ``hift_f0.onnx``: the F0 predictor, FP32, streaming form, meant for the CPU EP.
* ``*.ts``: traced + frozen TorchScript of the same three calls (``torch.jit.load`` alone loads them).
* ``manifest.json``: config, streaming constants, signatures, fold counts, versions, hashes, parity figures.
  The same config and constants are in each ONNX model's ``metadata_props``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hift_runtime.manifest import (F0, FORMAT_VERSION, GENERATOR_FINAL, GENERATOR_STREAM, GENERATOR_WEIGHTS,
                                   MANIFEST_NAME, METADATA_PREFIX, sha256_file)

from .config import COSYVOICE3, HiFTConfig
from .graphs import F0_INPUTS, F0_OUTPUTS, GENERATOR_INPUTS, GENERATOR_OUTPUTS, F0Graph, GeneratorGraph
from .model import DEFAULT_SEED, CheckpointSource, HiFT, load_hift

FORMATS = ("onnx", "torchscript")
# F0 graph precision: float32 inputs and outputs either way. "fp64" computes inside in float64 like upstream
# (bit-exact F0 on the fixture); "fp32" uses float32 Conv, ~20 % faster but its rounding depends on the input
# length (incremental F0 then differs from whole-utterance F0 by ~3e-3 Hz, which the phase integral turns into
# ~1e-3 of audio, 50 dB). See README "Precision".
F0_PRECISIONS = {"fp64": torch.float64, "fp32": torch.float32}
DEFAULT_F0_PRECISION = "fp64"
MIN_OPSET = 18
ARTIFACT_FILES = {
    GENERATOR_STREAM: "hift_generator_stream.onnx",
    GENERATOR_FINAL: "hift_generator_final.onnx",
    GENERATOR_WEIGHTS: "hift_generator.weights",
    F0: "hift_f0.onnx",
    "ts_" + GENERATOR_STREAM: "hift_generator_stream.ts",
    "ts_" + GENERATOR_FINAL: "hift_generator_final.ts",
    "ts_" + F0: "hift_f0.ts",
}
# Every op the generator graphs may contain: each has a CUDA EP kernel for the types used here. STFT, DFT and the
# Random* ops are absent on purpose (no CUDA kernel / irreproducible); tests check graphs against this list.
CUDA_OP_ALLOWLIST = frozenset({
    "Add", "Cast", "Clip", "Concat", "Conv", "ConvTranspose", "Cos", "CumSum", "Div", "Exp", "Expand", "Floor",
    "Gather", "Greater", "LeakyRelu", "MatMul", "Mul", "Pow", "Reshape", "Shape", "Sin", "Slice", "Squeeze", "Sub",
    "Tanh", "Transpose", "Unsqueeze", "Where", "Neg", "Identity", "Constant", "ConstantOfShape",
})
F0_OP_ALLOWLIST = frozenset({"Abs", "Add", "Conv", "Elu", "Gemm", "MatMul", "Pad", "Squeeze", "Transpose",
                             "Unsqueeze", "Concat", "Slice", "Cast", "Shape", "Reshape", "Identity", "Constant",
                             "Gather", "Expand", "Mul", "ConstantOfShape", "Exp", "Greater", "Where", "Sub"})
FORBIDDEN_OPS = frozenset({"STFT", "DFT", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                           "Multinomial", "Bernoulli"})
# Self-check tolerances (measured on the fixture checkpoint, CPU EP; see README "Precision"):
# generator audio max abs diff observed <= 2e-7, F0 relative to max |F0| observed <= 2e-7.
AUDIO_TOLERANCE = 1e-5
F0_RELATIVE_TOLERANCE = 1e-5
_MAX_FRAMES = 1 << 20


class ExportError(RuntimeError):
    """The export could not produce correct artifacts; nothing was written to the output folder."""


@dataclass
class ExportResult:
    out: Path
    manifest: dict[str, Any]
    seconds: float
    files: dict[str, int] = field(default_factory=dict)


def _log_default(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------------------------------
def _example_generator_inputs(config: HiFTConfig, frames: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    spf = config.samples_per_frame
    mel = torch.randn(batch, config.in_channels, frames, generator=gen) * 2.0 - 5.0
    f0 = torch.rand(batch, frames, generator=gen) * 400.0
    f0[:, ::7] = 0.0  # some unvoiced frames
    noise = torch.rand(batch, frames * spf, config.num_sines, generator=gen)
    phase_in = torch.rand(batch, config.num_sines, generator=gen, dtype=torch.float64) * 50.0
    return mel, f0, noise, phase_in


def _value_info(values: Iterable[Any]) -> list[dict[str, Any]]:
    import onnx

    out = []
    for v in values:
        t = v.type.tensor_type
        out.append({
            "name": v.name,
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
            "shape": [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim],
        })
    return out


def op_types(model: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


def _export_onnx(module: torch.nn.Module, args: tuple[torch.Tensor, ...], input_names: Sequence[str],
                 output_names: Sequence[str], dynamic_shapes: dict[str, Any], opset: int) -> Any:
    with warnings.catch_warnings():
        # torch.onnx's own notices about renamed shared axes and deprecated pytree APIs: not the user's concern.
        warnings.filterwarnings("ignore", message=r".*axis name.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        program = torch.onnx.export(module, args, None, dynamo=True, input_names=list(input_names),
                                    output_names=list(output_names), opset_version=opset,
                                    dynamic_shapes=dynamic_shapes, optimize=True, verbose=False)
    return program.model_proto


def _set_metadata(model: Any, role: str, config: HiFTConfig, extra: dict[str, Any]) -> None:
    entries = {
        "format_version": FORMAT_VERSION,
        "role": role,
        "config": config.to_dict(),
        **extra,
    }
    del model.metadata_props[:]
    for key, value in entries.items():
        prop = model.metadata_props.add()
        prop.key = METADATA_PREFIX + key
        prop.value = json.dumps(value, sort_keys=True)


def _check_ops(model: Any, allowlist: frozenset[str], name: str) -> None:
    ops = set(op_types(model))
    forbidden = ops & FORBIDDEN_OPS
    if forbidden:
        raise ExportError(f"{name} contains {sorted(forbidden)}: no CUDA kernel or random; export with spectral='conv'")
    unknown = ops - allowlist
    if unknown:
        raise ExportError(f"{name} contains ops outside the allowlist {sorted(unknown)}; check their CUDA EP "
                          f"support and add them to the allowlist deliberately")


def save_with_shared_weights(models: dict[Path, Any], weights: Path, min_bytes: int = 1024) -> None:
    """Save several ModelProtos whose large initializers live once in one external-data file.

    Initializers with the same name must hold the same bytes in every model (they come from one folded module);
    anything else is an export bug and raises.
    """
    import onnx
    from onnx import numpy_helper

    offsets: dict[str, tuple[int, int, bytes]] = {}
    with open(weights, "wb") as fh:
        for model in models.values():
            for tensor in model.graph.initializer:
                raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
                if len(raw) < min_bytes:
                    continue
                if tensor.name in offsets:
                    offset, length, first = offsets[tensor.name]
                    if first != raw:
                        raise ExportError(f"initializer {tensor.name} differs between generator graphs")
                else:
                    offset = fh.tell()
                    pad = (-offset) % 64  # keep each tensor 64-byte aligned for memory mapping
                    fh.write(b"\0" * pad)
                    offset += pad
                    fh.write(raw)
                    length = len(raw)
                    offsets[tensor.name] = (offset, length, raw)
                for fld in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
                    tensor.ClearField(fld)
                del tensor.external_data[:]
                for key, value in (("location", weights.name), ("offset", str(offset)), ("length", str(length))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
                tensor.data_location = onnx.TensorProto.EXTERNAL
    for path, model in models.items():
        onnx.save_model(model, str(path))


# --------------------------------------------------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------------------------------------------------
def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ExportError(f"shape mismatch in self-check: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def check_against_eager(hift: HiFT, run_generator: Callable[[bool, tuple[np.ndarray, ...]], tuple[np.ndarray, ...]],
                        run_f0: Callable[[np.ndarray], np.ndarray], frames: Sequence[int] = (9, 40),
                        batch: int = 2) -> dict[str, float]:
    """Max abs differences of a backend (ORT or TorchScript) against the eager folded modules on random inputs."""
    figures = {"generator_stream_audio": 0.0, "generator_final_audio": 0.0, "generator_phase": 0.0,
               "f0_relative": 0.0}
    with torch.inference_mode():
        for n in frames:
            args = _example_generator_inputs(hift.config, n, batch, seed=n)
            arrays = tuple(a.numpy() for a in args)
            for finalize in (False, True):
                ref_audio, ref_phase = GeneratorGraph(hift.generator, finalize)(*args)
                audio, phase = run_generator(finalize, arrays)
                key = "generator_final_audio" if finalize else "generator_stream_audio"
                figures[key] = max(figures[key], _max_abs(audio, ref_audio.numpy()))
                figures["generator_phase"] = max(figures["generator_phase"], _max_abs(phase, ref_phase.numpy()))
            mel = arrays[0]
            ref_f0 = F0Graph(hift.f0_predictor)(args[0]).numpy()
            f0 = run_f0(mel)
            scale = max(float(np.max(np.abs(ref_f0))), 1e-6)
            figures["f0_relative"] = max(figures["f0_relative"], _max_abs(f0, ref_f0) / scale)
    return figures


def _judge(figures: dict[str, float], what: str) -> None:
    bad = {k: v for k, v in figures.items()
           if (k == "f0_relative" and v > F0_RELATIVE_TOLERANCE) or (k != "f0_relative" and v > AUDIO_TOLERANCE)}
    if bad:
        raise ExportError(f"{what} does not match the eager model: {bad} (tolerances: audio {AUDIO_TOLERANCE}, "
                          f"F0 relative {F0_RELATIVE_TOLERANCE})")


# --------------------------------------------------------------------------------------------------------------------
# The export
# --------------------------------------------------------------------------------------------------------------------
def _tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "absent"
    return versions


def export_artifacts(checkpoint: CheckpointSource | None = None, out: str | os.PathLike[str] = "artifacts",
                     formats: Sequence[str] = FORMATS, opset: int = MIN_OPSET, f0_precision: str = DEFAULT_F0_PRECISION,
                     config: HiFTConfig = COSYVOICE3, seed: int = DEFAULT_SEED, window_frames: int | None = None,
                     log: Callable[[str], None] = _log_default) -> ExportResult:
    """Export ``checkpoint`` (``None``: seeded random weights) into ``out``; see the module docstring."""
    started = time.perf_counter()
    formats = tuple(dict.fromkeys(formats))
    if not formats or set(formats) - set(FORMATS):
        raise ValueError(f"formats must be a non-empty subset of {FORMATS}, got {list(formats)}")
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset} is too old: the exporter's op library needs >= {MIN_OPSET}")
    if f0_precision not in F0_PRECISIONS:
        raise ValueError(f"F0 graph precision {f0_precision!r} is not one of {tuple(F0_PRECISIONS)}")
    if window_frames is not None:
        import dataclasses
        config = dataclasses.replace(config, window_frames=window_frames)
    out = Path(out)

    if checkpoint is None:
        log(f"[load] no checkpoint given: using SEEDED RANDOM weights (seed {seed}) in the upstream layout - "
            f"this is a demo vocoder, not a trained one")
        weights_info: dict[str, Any] = {"source": "seeded-random", "seed": seed, "trained": False}
    else:
        desc = "<in-memory state dict>" if not isinstance(checkpoint, (str, os.PathLike)) else os.fspath(checkpoint)
        log(f"[load] {desc}")
        weights_info = {"source": "checkpoint", "path": desc}
        if isinstance(checkpoint, (str, os.PathLike)) and os.path.isfile(checkpoint):
            weights_info["sha256"] = sha256_file(checkpoint)
    # A fresh instance, loaded once, folded once (on the CPU: the ONNX graphs carry CPU-folded FP32 weights).
    hift = load_hift(checkpoint, config=config, spectral="conv", seed=seed, f0_dtype=F0_PRECISIONS[f0_precision])
    if f0_precision == "fp64":
        hift.f0_predictor.impl = "matmul"  # ORT has no float64 Conv/Elu kernels; MatMul/Exp/Where it has
    log(f"[fold] {hift.fold_report}")

    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hift-export-", dir=out))
    try:
        artifacts: dict[str, dict[str, Any]] = {}
        figures: dict[str, dict[str, float]] = {}
        streaming = {
            "window_frames": config.window_frames,
            "samples_per_frame": config.samples_per_frame,
            "f0_look_ahead": config.f0_look_ahead,
            "f0_left_context": config.f0_left_context,
            "conv_pre_look_ahead": config.conv_pre_look_right,
            "held_back_frames": config.held_back_frames,
            "num_sines": config.num_sines,
            "noise_table_length": config.noise_table_length,
            "min_stream_window_frames": config.conv_pre_look_right + 2,
            "f0_final": "f0 graph on mel with f0_look_ahead zero frames appended",
        }
        if "onnx" in formats:
            artifacts.update(_export_onnx_artifacts(hift, staging, opset, streaming, f0_precision, log))
            figures["onnx_cpu"] = _self_check_onnx(hift, staging, log)
        if "torchscript" in formats:
            artifacts.update(_export_torchscript(hift, staging, log))
            figures["torchscript"] = _self_check_torchscript(hift, staging, log)
        for role, entry in artifacts.items():
            path = staging / entry["file"]
            entry["bytes"] = path.stat().st_size
            entry["sha256"] = sha256_file(path)
        manifest = {
            "format_version": FORMAT_VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "weights": weights_info,
            "config": config.to_dict(),
            "streaming": streaming,
            "fold_counts": {"generator": hift.fold_report.generator, "f0_predictor": hift.fold_report.f0_predictor},
            "opset": opset,
            "f0_precision": f0_precision,
            "artifacts": artifacts,
            "parity": {"tolerances": {"audio_max_abs": AUDIO_TOLERANCE, "f0_relative": F0_RELATIVE_TOLERANCE},
                       **figures},
            "versions": _tool_versions(),
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        # Move into place only once everything is written and checked; the manifest last.
        for entry in artifacts.values():
            os.replace(staging / entry["file"], out / entry["file"])
        os.replace(staging / MANIFEST_NAME, out / MANIFEST_NAME)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.perf_counter() - started
    files = {entry["file"]: entry["bytes"] for entry in artifacts.values()}
    log(f"[done] {len(files)} files in {out} ({sum(files.values()) / 1e6:.1f} MB) in {seconds:.1f} s; {hift.fold_report}")
    for name, size in files.items():
        log(f"       {name:32s} {size / 1e6:8.2f} MB")
    for what, fig in figures.items():
        log(f"       parity {what}: " + ", ".join(f"{k} {v:.2e}" for k, v in fig.items()))
    return ExportResult(out, manifest, seconds, files)


def _graph_dims(config: HiFTConfig) -> tuple[Any, Any, Any]:
    batch = torch.export.Dim("batch", min=1, max=4096)
    stream_frames = torch.export.Dim("frames", min=config.conv_pre_look_right + 2, max=_MAX_FRAMES)
    final_frames = torch.export.Dim("frames", min=1, max=_MAX_FRAMES)
    return batch, stream_frames, final_frames


def _export_onnx_artifacts(hift: HiFT, staging: Path, opset: int, streaming: dict[str, Any], f0_precision: str,
                           log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    import onnx

    config = hift.config
    spf = config.samples_per_frame
    batch, stream_frames, final_frames = _graph_dims(config)
    protos: dict[str, Any] = {}
    for role, finalize, frames in ((GENERATOR_STREAM, False, stream_frames), (GENERATOR_FINAL, True, final_frames)):
        t0 = time.perf_counter()
        args = _example_generator_inputs(config, 24, 2)
        dyn = {"mel": {0: batch, 2: frames}, "f0": {0: batch, 1: frames}, "noise": {0: batch, 1: spf * frames},
               "phase_in": {0: batch}}
        model = _export_onnx(GeneratorGraph(hift.generator, finalize).eval(), args, GENERATOR_INPUTS, GENERATOR_OUTPUTS,
                             dyn, opset)
        _check_ops(model, CUDA_OP_ALLOWLIST, role)
        _set_metadata(model, role, config, {"finalize": finalize, "streaming": streaming,
                                            "execution_provider": "CUDAExecutionProvider"})
        protos[role] = model
        log(f"[onnx] {role}: traced {len(model.graph.node)} nodes in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    f0_frames = torch.export.Dim("frames", min=config.f0_look_ahead + 1, max=_MAX_FRAMES)
    mel = _example_generator_inputs(config, 24, 2)[0]
    f0_model = _export_onnx(F0Graph(hift.f0_predictor).eval(), (mel,), F0_INPUTS, F0_OUTPUTS,
                            {"mel": {0: batch, 2: f0_frames}}, opset)
    _check_ops(f0_model, F0_OP_ALLOWLIST, "f0")
    _set_metadata(f0_model, F0, config, {"finalize": False, "streaming": streaming, "precision": f0_precision,
                                         "execution_provider": "CPUExecutionProvider"})
    log(f"[onnx] f0: traced {len(f0_model.graph.node)} nodes in {time.perf_counter() - t0:.1f} s")

    entries: dict[str, dict[str, Any]] = {}
    gen_paths = {staging / ARTIFACT_FILES[r]: protos[r] for r in (GENERATOR_STREAM, GENERATOR_FINAL)}
    save_with_shared_weights(gen_paths, staging / ARTIFACT_FILES[GENERATOR_WEIGHTS])
    onnx.save_model(f0_model, str(staging / ARTIFACT_FILES[F0]))
    for role, model, provider in ((GENERATOR_STREAM, protos[GENERATOR_STREAM], "CUDAExecutionProvider"),
                                  (GENERATOR_FINAL, protos[GENERATOR_FINAL], "CUDAExecutionProvider"),
                                  (F0, f0_model, "CPUExecutionProvider")):
        path = staging / ARTIFACT_FILES[role]
        onnx.checker.check_model(str(path))
        entries[role] = {
            "file": path.name, "format": "onnx", "execution_provider": provider,
            "precision": f0_precision if role == F0 else "fp32", "io_dtype": "float32",
            "finalize": role == GENERATOR_FINAL, "inputs": _value_info(model.graph.input),
            "outputs": _value_info(model.graph.output), "nodes": len(model.graph.node), "op_types": op_types(model),
        }
        if role != F0:
            entries[role]["external_data"] = ARTIFACT_FILES[GENERATOR_WEIGHTS]
        log(f"[onnx] {path.name}: checked (onnx.checker), written")
    entries[GENERATOR_WEIGHTS] = {"file": ARTIFACT_FILES[GENERATOR_WEIGHTS], "format": "onnx-external-data",
                                  "shared_by": [GENERATOR_STREAM, GENERATOR_FINAL]}
    return entries


def _self_check_onnx(hift: HiFT, staging: Path, log: Callable[[str], None]) -> dict[str, float]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    gens = {fin: ort.InferenceSession(str(staging / ARTIFACT_FILES[GENERATOR_FINAL if fin else GENERATOR_STREAM]),
                                      opts, providers=providers) for fin in (False, True)}
    f0_sess = ort.InferenceSession(str(staging / ARTIFACT_FILES[F0]), opts, providers=providers)

    def run_generator(finalize: bool, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        return tuple(gens[finalize].run(list(GENERATOR_OUTPUTS), dict(zip(GENERATOR_INPUTS, arrays))))

    figures = check_against_eager(hift, run_generator, lambda mel: f0_sess.run(None, {"mel": mel})[0])
    log("[check] ONNX Runtime CPU vs eager: " + ", ".join(f"{k} {v:.2e}" for k, v in figures.items()))
    _judge(figures, "ONNX graphs")
    return figures


def _export_torchscript(hift: HiFT, staging: Path, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    with torch.inference_mode(False), torch.no_grad():
        for role, finalize in ((GENERATOR_STREAM, False), (GENERATOR_FINAL, True)):
            t0 = time.perf_counter()
            args = _example_generator_inputs(hift.config, 24, 2)
            traced = torch.jit.trace(GeneratorGraph(hift.generator, finalize).eval(), args, check_trace=False)
            path = staging / ARTIFACT_FILES["ts_" + role]
            torch.jit.save(torch.jit.freeze(traced), str(path))
            entries["ts_" + role] = {"file": path.name, "format": "torchscript", "finalize": finalize,
                                     "inputs": list(GENERATOR_INPUTS), "outputs": list(GENERATOR_OUTPUTS)}
            log(f"[torchscript] {path.name}: traced and frozen in {time.perf_counter() - t0:.1f} s")
        mel = _example_generator_inputs(hift.config, 24, 2)[0]
        traced = torch.jit.trace(F0Graph(hift.f0_predictor).eval(), (mel,), check_trace=False)
        path = staging / ARTIFACT_FILES["ts_" + F0]
        torch.jit.save(torch.jit.freeze(traced), str(path))
        entries["ts_" + F0] = {"file": path.name, "format": "torchscript", "finalize": False,
                               "inputs": list(F0_INPUTS), "outputs": list(F0_OUTPUTS)}
        log(f"[torchscript] {path.name}: traced and frozen")
    return entries


def _self_check_torchscript(hift: HiFT, staging: Path, log: Callable[[str], None]) -> dict[str, float]:
    gens = {fin: torch.jit.load(str(staging / ARTIFACT_FILES["ts_" + (GENERATOR_FINAL if fin else GENERATOR_STREAM)]))
            for fin in (False, True)}
    f0_mod = torch.jit.load(str(staging / ARTIFACT_FILES["ts_" + F0]))

    def run_generator(finalize: bool, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        return tuple(t.numpy() for t in gens[finalize](*(torch.from_numpy(a) for a in arrays)))

    with torch.inference_mode():
        figures = check_against_eager(hift, run_generator, lambda mel: f0_mod(torch.from_numpy(mel)).numpy())
    log("[check] TorchScript vs eager: " + ", ".join(f"{k} {v:.2e}" for k, v in figures.items()))
    _judge(figures, "TorchScript modules")
    return figures
