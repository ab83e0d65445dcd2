"""Checkpoint -> deployable artifacts: the orchestrator over one module per target.

Load once (fresh instances, strict, folded), then each target builds, exports and self-checks its files in a staging
folder beside ``out`` (:mod:`~hift_export.onnx_export`, :mod:`~hift_export.torchscript_export`); then the manifest is
written and the whole folder swapped into place, so a reader sees the old export or the new one, never a mix.

Artifacts (file names in :data:`hift_export.targets.ARTIFACT_FILES`):

* ``hift_generator_step.onnx`` / ``hift_generator_step_final.onnx``: the generator step (source, STFT, decoder,
  iSTFT, every cache) and its final form, FP32, dynamic batch and frames, for the CUDA EP; one shared external
  weights file, ``hift_generator.weights``.
* ``hift_f0_step.onnx``: the F0 step, float32 in and out (float64 inside by default), for the CPU EP.
* ``*.ts``: traced and frozen TorchScript of the same three graphs.
* ``manifest.json``: config, the step contract (cache layouts), signatures, fold counts, versions, hashes, and the
  export's own parity figures. The same config and step contract are in each ONNX model's ``metadata_props``.

The offline pass is the final step over the whole mel from the utterance start (zero caches), so there is no separate
offline graph; the eager ``decode`` stays the independent reference in the tests.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hift_runtime.manifest import FORMAT_VERSION, MANIFEST_NAME, sha256_file

from hift_model.config import COSYVOICE3, HiFTConfig
from .folder_swap import listed_files, recover_stale_siblings, sibling, swap_into_place
from .graphs import F0_STEP_INPUTS, GENERATOR_STEP_INPUTS
from hift_model.config import DEFAULT_SEED
from hift_model.model import CheckpointSource, load_hift
from .onnx_export import export_onnx, onnx_runners
from hift_model.step import F0_PRECISIONS, dtype_name, step_contract
from .targets import ARTIFACT_FILES, STEP_TOLERANCE, ExportError, check_against_eager, judge
from .torchscript_export import export_torchscript, torchscript_runners
from .weights_export import export_folded_weights

# "weights": the folded weights as a weights-only torch file, for the compiled engine (hift_torch.compiled).
FORMATS = ("onnx", "torchscript", "weights")
DEFAULT_F0_PRECISION = "fp64"
# Published vocoder checkpoints by sha256: the export says which one it was given.
KNOWN_CHECKPOINTS = {
    "b279d7641eb97ae55b3b540cfba4f953c26492a2df758328a89a4d007ab87a65":
        "CosyVoice3's hift.pt (FunAudioLLM/Fun-CosyVoice3-0.5B-2512)",
}
MIN_OPSET = 18

__all__ = ["ARTIFACT_FILES", "DEFAULT_F0_PRECISION", "ExportError", "ExportResult", "F0_PRECISIONS", "FORMATS",
           "export_artifacts"]


@dataclass
class ExportResult:
    out: Path
    manifest: dict[str, Any]
    seconds: float
    files: dict[str, int] = field(default_factory=dict)


def _log_default(msg: str) -> None:
    print(msg, flush=True)


def _tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "absent"
    return versions


def export_names() -> set[str]:
    """The names an export writes into its folder (everything else there is the user's)."""
    return set(ARTIFACT_FILES.values()) | {MANIFEST_NAME}


def export_artifacts(checkpoint: CheckpointSource | None = None, out: str | os.PathLike[str] = "artifacts",
                     formats: Sequence[str] = FORMATS, opset: int = MIN_OPSET, f0_precision: str = DEFAULT_F0_PRECISION,
                     config: HiFTConfig = COSYVOICE3, seed: int = DEFAULT_SEED,
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
            known = KNOWN_CHECKPOINTS.get(weights_info["sha256"])
            if known:
                weights_info["known_as"] = known
                log(f"[load] recognised: {known}")
    # A fresh instance, loaded once, folded once (on the CPU: the graphs carry CPU-folded FP32 weights).
    hift = load_hift(checkpoint, config=config, spectral="conv", seed=seed, f0_dtype=F0_PRECISIONS[f0_precision])
    if f0_precision == "fp64":
        hift.f0_predictor.impl = "matmul"  # ORT has no float64 Conv/Elu kernels; MatMul/Exp/Where it has
    log(f"[fold] {hift.fold_report}")
    f0_dtype = dtype_name(F0_PRECISIONS[f0_precision])  # the F0 caches' dtype
    contract = step_contract(config, f0_dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    recover_stale_siblings(out, export_names(), log=log)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder; choose another --out")
    staging = sibling(out, "staging")
    try:
        artifacts: dict[str, dict[str, Any]] = {}
        figures: dict[str, dict[str, float]] = {}
        leads = {"generator": len(GENERATOR_STEP_INPUTS), "f0": len(F0_STEP_INPUTS)}
        if "onnx" in formats:
            artifacts.update(export_onnx(hift, staging, opset, f0_dtype, contract, log))
            figures["onnx_cpu"] = check_against_eager(hift, f0_dtype, *onnx_runners(staging))
            log("[check] ONNX Runtime CPU vs eager step: " + _fmt(figures["onnx_cpu"]))
            judge(figures["onnx_cpu"], "ONNX step graphs")
        if "torchscript" in formats:
            artifacts.update(export_torchscript(hift, staging, f0_dtype, log))
            figures["torchscript"] = check_against_eager(hift, f0_dtype, *torchscript_runners(staging, leads))
            log("[check] TorchScript vs eager step: " + _fmt(figures["torchscript"]))
            judge(figures["torchscript"], "TorchScript step graphs")
        if "weights" in formats:
            artifacts.update(export_folded_weights(hift, staging, log))
        for entry in artifacts.values():
            path = staging / entry["file"]
            entry["bytes"] = path.stat().st_size
            entry["sha256"] = sha256_file(path)
        manifest = {
            "format_version": FORMAT_VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "weights": weights_info,
            "config": config.to_dict(),
            "step": contract,
            "fold_counts": dataclasses.asdict(hift.fold_report),
            "opset": opset,
            "f0_precision": f0_precision,
            "artifacts": artifacts,
            "parity": {"tolerance": STEP_TOLERANCE, **figures},
            "versions": _tool_versions(),
        }
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        swap_into_place(staging, out, export_names() | listed_files(out))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # an unfinished export; after the swap it holds the old one
        raise
    seconds = time.perf_counter() - started
    files = {entry["file"]: entry["bytes"] for entry in artifacts.values()}
    log(f"[done] {len(files)} files in {out} ({sum(files.values()) / 1e6:.1f} MB) in {seconds:.1f} s; {hift.fold_report}")
    for name, size in files.items():
        log(f"       {name:32s} {size / 1e6:8.2f} MB")
    return ExportResult(out, manifest, seconds, files)


def _fmt(figures: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2e}" for k, v in figures.items())
