"""ONNX target: the generator step graphs (stream and final, one shared external weights file, for the CUDA EP) and
the F0 step graph (float32 interface, for the CPU EP), with their signatures and metadata."""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hift_runtime.contract import NEXT_PREFIX, cache_io_names
from hift_runtime.manifest import (F0_STEP, FORMAT_VERSION, GENERATOR_STEP, GENERATOR_STEP_FINAL,
                                   GENERATOR_STEP_FINAL_SLOTS, GENERATOR_STEP_SLOTS, GENERATOR_WEIGHTS, METADATA_PREFIX)

from hift_model.config import HiFTConfig
from .graphs import (F0_STEP_INPUTS, F0_STEP_OUTPUTS, GENERATOR_STEP_INPUTS, GENERATOR_STEP_OUTPUTS, F0StepGraph,
                     GeneratorStepGraph)
from hift_model.model import HiFT
from .slots import slotted_model
from hift_model.step import f0_cache_layout, generator_cache_layout
from .targets import ARTIFACT_FILES, ExportError, example_f0_step_inputs, example_generator_step_inputs

# Every op the generator graphs may contain: each has a CUDA EP kernel for the types used here. STFT, DFT and the
# Random* ops are absent on purpose (no CUDA kernel / irreproducible); tests check graphs against this list.
CUDA_OP_ALLOWLIST = frozenset({
    "Add", "Cast", "Clip", "Concat", "Conv", "Cos", "CumSum", "Div", "Exp", "Expand", "Floor", "Gather", "Greater",
    "LeakyRelu", "MatMul", "Min", "Mul", "Pad", "Pow", "Reshape", "Shape", "Sin", "Slice", "Squeeze", "Sub", "Tanh",
    "Transpose", "Unsqueeze", "Where", "Neg", "Identity", "Constant", "ConstantOfShape",
})
# The slot form adds reading and writing the pool rows (hift_export/slots.py).
SLOT_OP_ALLOWLIST = CUDA_OP_ALLOWLIST | {"ScatterND"}
F0_OP_ALLOWLIST = frozenset({"Abs", "Add", "Conv", "Elu", "Gemm", "MatMul", "Pad", "Squeeze", "Transpose",
                             "Unsqueeze", "Concat", "Slice", "Cast", "Shape", "Reshape", "Identity", "Constant",
                             "Gather", "Expand", "Mul", "ConstantOfShape", "Exp", "Greater", "Where", "Sub"})
FORBIDDEN_OPS = frozenset({"STFT", "DFT", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                           "Multinomial", "Bernoulli"})
_MAX_FRAMES = 1 << 20


def value_info(values: Iterable[Any]) -> list[dict[str, Any]]:
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


def _export(module: torch.nn.Module, args: tuple[Any, ...], input_names: Sequence[str],
            output_names: Sequence[str], dynamic_shapes: dict[str, Any], opset: int) -> Any:
    with warnings.catch_warnings():
        # torch.onnx's own notices (renamed shared axes, deprecated pytree APIs, torchvision absent): not the user's.
        warnings.filterwarnings("ignore", message=r".*axis name.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        quiet = logging.getLogger("torch.onnx")
        level, quiet.level = quiet.level, logging.ERROR
        try:
            program = torch.onnx.export(module, args, None, dynamo=True, input_names=list(input_names),
                                        output_names=list(output_names), opset_version=opset,
                                        dynamic_shapes=dynamic_shapes, optimize=True, verbose=False)
        finally:
            quiet.setLevel(level)
    return program.model_proto


def _set_metadata(model: Any, role: str, config: HiFTConfig, extra: dict[str, Any]) -> None:
    entries = {"format_version": FORMAT_VERSION, "role": role, "config": config.to_dict(), **extra}
    del model.metadata_props[:]
    for key, value in entries.items():
        prop = model.metadata_props.add()
        prop.key = METADATA_PREFIX + key
        prop.value = json.dumps(value, sort_keys=True)


def _pin_cache_shapes(model: Any, layout: list[dict[str, Any]]) -> None:
    """Write each cache output's per-stream shape (fixed by construction; the exporter's shape inference leaves some
    as unsimplified expressions) into the graph, so its signature states the layout."""
    fixed = {NEXT_PREFIX + e["name"]: e["shape"] for e in layout}
    for value in model.graph.output:
        if value.name in fixed:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(list(dims)[1:], fixed[value.name]):
                dim.ClearField("dim_param")
                dim.dim_value = size


def check_ops(model: Any, allowlist: frozenset[str], name: str) -> None:
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


GENERATOR_ROLES = (GENERATOR_STEP, GENERATOR_STEP_FINAL, GENERATOR_STEP_SLOTS, GENERATOR_STEP_FINAL_SLOTS)


def export_onnx(hift: HiFT, staging: Path, opset: int, f0_dtype: str, step_contract: dict[str, Any],
                log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Write the step graphs (generator step and final step, plain and slot form; F0 step) into ``staging``; return
    their manifest entries (without hashes)."""
    import onnx

    config = hift.config
    spf = config.samples_per_frame
    gen_layout = generator_cache_layout(config)
    f0_layout = f0_cache_layout(config, f0_dtype)
    cache_in, cache_out = cache_io_names(gen_layout)
    batch = torch.export.Dim("batch", min=1, max=4096)
    protos: dict[str, Any] = {}
    for role, final in ((GENERATOR_STEP, False), (GENERATOR_STEP_FINAL, True)):
        log(f"[onnx] {role}: exporting through torch.export (the slow part: about a minute on 2 cores) ...")
        t0 = time.perf_counter()
        # Non-final: the root dimension is c+1 (f0 and noise); mel has c+4 frames. Final: c frames everywhere.
        frames = torch.export.Dim("steps", min=1 if final else 2, max=_MAX_FRAMES)
        dyn = {"mel": {0: batch, 2: frames if final else frames + 3}, "f0": {0: batch, 1: frames},
               "noise": {0: batch, 1: spf * frames}, "phase_in": {0: batch}, "first": {0: batch},
               "caches": [{0: batch} for _ in gen_layout]}
        args = example_generator_step_inputs(config, 24, 2, final)
        outputs = list(GENERATOR_STEP_OUTPUTS) + ([] if final else cache_out)
        model = _export(GeneratorStepGraph(hift.generator, final).eval(), args, list(GENERATOR_STEP_INPUTS) + cache_in,
                        outputs, dyn, opset)
        check_ops(model, CUDA_OP_ALLOWLIST, role)
        _pin_cache_shapes(model, gen_layout)
        _set_metadata(model, role, config, {"final": final, "step": step_contract,
                                            "execution_provider": "CUDAExecutionProvider"})
        protos[role] = model
        log(f"[onnx] {role}: exported {len(model.graph.node)} nodes in {time.perf_counter() - t0:.1f} s")
    for role, base, final in ((GENERATOR_STEP_SLOTS, GENERATOR_STEP, False),
                              (GENERATOR_STEP_FINAL_SLOTS, GENERATOR_STEP_FINAL, True)):
        model = slotted_model(protos[base], gen_layout, final)  # before the weights go external: a full copy
        check_ops(model, SLOT_OP_ALLOWLIST, role)
        _set_metadata(model, role, config, {"final": final, "step": step_contract,
                                            "execution_provider": "CUDAExecutionProvider"})
        protos[role] = model
    t0 = time.perf_counter()
    f0_in, f0_out = cache_io_names(f0_layout)
    mel_frames = torch.export.Dim("mel_frames", min=config.f0_look_ahead + 1, max=_MAX_FRAMES)
    f0_model = _export(F0StepGraph(hift.f0_predictor, config, f0_dtype).eval(),
                       example_f0_step_inputs(config, 24, 2, f0_dtype), list(F0_STEP_INPUTS) + f0_in,
                       list(F0_STEP_OUTPUTS) + f0_out, {"mel": {0: batch, 2: mel_frames},
                                                         "caches": [{0: batch} for _ in f0_layout]}, opset)
    check_ops(f0_model, F0_OP_ALLOWLIST, F0_STEP)
    _pin_cache_shapes(f0_model, f0_layout)
    _set_metadata(f0_model, F0_STEP, config, {"final": False, "step": step_contract,
                                              "execution_provider": "CPUExecutionProvider"})
    log(f"[onnx] {F0_STEP}: exported {len(f0_model.graph.node)} nodes in {time.perf_counter() - t0:.1f} s")

    gen_paths = {staging / ARTIFACT_FILES[r]: protos[r] for r in GENERATOR_ROLES}
    save_with_shared_weights(gen_paths, staging / ARTIFACT_FILES[GENERATOR_WEIGHTS])
    onnx.save_model(f0_model, str(staging / ARTIFACT_FILES[F0_STEP]))
    entries: dict[str, dict[str, Any]] = {}
    for role, model, provider in ([(r, protos[r], "CUDAExecutionProvider") for r in GENERATOR_ROLES]
                                  + [(F0_STEP, f0_model, "CPUExecutionProvider")]):
        path = staging / ARTIFACT_FILES[role]
        onnx.checker.check_model(str(path))
        entries[role] = {
            "file": path.name, "format": "onnx", "execution_provider": provider,
            "final": role in (GENERATOR_STEP_FINAL, GENERATOR_STEP_FINAL_SLOTS),
            "inputs": value_info(model.graph.input),
            "outputs": value_info(model.graph.output), "nodes": len(model.graph.node), "op_types": op_types(model),
        }
        if role != F0_STEP:
            entries[role]["external_data"] = ARTIFACT_FILES[GENERATOR_WEIGHTS]
    entries[GENERATOR_WEIGHTS] = {"file": ARTIFACT_FILES[GENERATOR_WEIGHTS], "format": "onnx-external-data",
                                  "shared_by": list(GENERATOR_ROLES)}
    log("[onnx] graphs checked (onnx.checker) and written")
    return entries


def onnx_runners(staging: Path) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(generator step runner, F0 step runner) over ONNX Runtime's CPU EP, for the self-check."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    cpu = ["CPUExecutionProvider"]
    gens = {final: ort.InferenceSession(str(staging / ARTIFACT_FILES[GENERATOR_STEP_FINAL if final else GENERATOR_STEP]),
                                        opts, providers=cpu) for final in (False, True)}
    f0 = ort.InferenceSession(str(staging / ARTIFACT_FILES[F0_STEP]), opts, providers=cpu)

    def run_generator(final: bool, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        names = [i.name for i in gens[final].get_inputs()]
        return gens[final].run(None, dict(zip(names, arrays)))

    def run_f0(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        return f0.run(None, dict(zip([i.name for i in f0.get_inputs()], arrays)))

    return run_generator, run_f0
