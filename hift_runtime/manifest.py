"""The artifact manifest: written by ``hift_export``, read (and verified) here. NumPy-free, torch-free.

The manifest is the runtime's only source of configuration: hyper-parameters, the step graphs' cache layout, graph
roles, input/output signatures and the sha256 of every file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 4  # 4: the slot form reads and writes a flat pool element by element (3: + the slot form of the
# generator steps; 2: stateful step graphs; 1: bounded-window graphs)
METADATA_PREFIX = "hift."
# The one dtype table: the manifest spells dtypes as NumPy does; what ONNX Runtime and Triton's configs call them.
DTYPE_NAMES = {"float32": ("float", "TYPE_FP32"), "float64": ("double", "TYPE_FP64"),
               "int64": ("int64", "TYPE_INT64"), "bool": ("bool", "TYPE_BOOL")}


def ort_type(dtype: str) -> str:
    """``"float32"`` -> ``"tensor(float)"``, as ONNX Runtime reports a tensor's type."""
    return f"tensor({DTYPE_NAMES[dtype][0]})" if dtype in DTYPE_NAMES else f"tensor({dtype})"


def triton_type(dtype: str) -> str:
    """``"float32"`` -> ``"TYPE_FP32"``, as a Triton model config spells it."""
    return DTYPE_NAMES[dtype][1]

# Roles of the artifacts (keys of manifest["artifacts"]).
GENERATOR_STEP = "generator_step"
GENERATOR_STEP_FINAL = "generator_step_final"
F0_STEP = "f0_step"
GENERATOR_WEIGHTS = "generator_weights"
# The folded weights of both modules, weights-only torch file: what the compiled engine loads (hift_torch.compiled).
FOLDED_WEIGHTS = "folded_weights"
# The same steps with the caches in a device-resident pool, one row per stream (hift_export/slots.py): the CUDA path.
GENERATOR_STEP_SLOTS = "generator_step_slots"
GENERATOR_STEP_FINAL_SLOTS = "generator_step_final_slots"
SLOT_INPUTS = ("slots", "pool")  # the slot form's inputs beyond the step's own; the stream step also returns:
POOL_OUTPUT = "pool_out"
# What the ONNX Runtime backend loads, and so verifies at open time; TorchScript files are verified on request.
RUNTIME_ROLES = (GENERATOR_STEP, GENERATOR_STEP_FINAL, GENERATOR_STEP_SLOTS, GENERATOR_STEP_FINAL_SLOTS,
                 GENERATOR_WEIGHTS, F0_STEP)


class ArtifactError(RuntimeError):
    """An artifacts folder that cannot be used as it is; the message names the file and the fix."""


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        return self.data["config"]

    @property
    def step(self) -> dict[str, Any]:
        """The step graphs' contract: cache layouts (name, per-stream shape, dtype, initial value)."""
        return self.data["step"]

    def artifact(self, role: str) -> dict[str, Any]:
        try:
            return self.data["artifacts"][role]
        except KeyError:
            raise ArtifactError(f"{self.root / MANIFEST_NAME} lists no '{role}' artifact; re-export with "
                                f"hift-export --formats onnx") from None

    def path(self, role: str) -> Path:
        """``role``'s file: always inside the artifacts folder (:func:`read_manifest` refused any other name)."""
        return self.root / self.artifact(role)["file"]

    def verify(self, role: str) -> None:
        """Check that ``role``'s file exists with the manifest's size and sha256; raise :class:`ArtifactError`."""
        entry, file = self.artifact(role), self.path(role)
        if not file.is_file():
            raise ArtifactError(f"{file} ({role}) is listed in the manifest but missing; re-export or copy the "
                                f"whole folder")
        size = file.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "longer than written: appended to or replaced"
            raise ArtifactError(f"{file} ({role}) has {size} bytes, the manifest says {entry['bytes']}: {what}; "
                                f"re-export")
        digest = sha256_file(file)
        if digest != entry["sha256"]:
            raise ArtifactError(f"{file} ({role}) sha256 {digest[:16]}… does not match the manifest's "
                                f"{entry['sha256'][:16]}…: the file was modified or damaged; re-export")


_CACHE_ENTRY = {"name": str, "shape": [int], "dtype": str}
# The fields a reader of the manifest reads, by type: a dict is a section, ``[T]`` a list of T, a key starting with
# ``?`` optional. ``artifacts`` (role -> entry) is checked on its own.
_SHAPE: dict[str, Any] = {
    "config": {"in_channels": int, "sampling_rate": int,
               "derived": {"samples_per_frame": int, "num_sines": int, "noise_table_length": int}},
    "step": {"mel_look_ahead_frames": int, "source_look_ahead_frames": int, "audio_lag_frames": int,
             "f0_look_ahead_frames": int, "generator_caches": [_CACHE_ENTRY], "f0_caches": [_CACHE_ENTRY],
             "?pool_row_floats": int},
}
_ARTIFACT_ENTRY = {"file": str, "bytes": int, "sha256": str}
_TYPE_NAMES = {int: "an integer", str: "a string", dict: "an object", list: "a list"}


def _shape_problem(value: Any, shape: Any, where: str) -> str | None:
    """Where ``value`` departs from ``shape`` (see :data:`_SHAPE`), as ``"field: what it should be"``; None if not."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{where} must be an object"
        for key, inner in shape.items():
            name = key.lstrip("?")
            if name not in value:
                if key.startswith("?"):
                    continue
                return f"{where}.{name} is missing"
            problem = _shape_problem(value[name], inner, f"{where}.{name}")
            if problem:
                return problem
        return None
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{where} must be a list"
        for i, item in enumerate(value):
            problem = _shape_problem(item, shape[0], f"{where}[{i}]")
            if problem:
                return problem
        return None
    # bool is an int in Python, never one here ("bytes": true is as wrong as "bytes": "26566520").
    if not isinstance(value, shape) or isinstance(value, bool):
        return f"{where} must be {_TYPE_NAMES[shape]}, not {type(value).__name__} {json.dumps(value)[:40]}"
    return None


def contained_file(root: Path, name: str, role: str, manifest_path: Path) -> Path:
    """``root / name`` when that names a file inside ``root`` (links resolved); else :class:`ArtifactError`, before
    anything at that path is touched."""
    pure = Path(name)
    if not name or pure.is_absolute() or ".." in pure.parts:
        raise ArtifactError(f"{manifest_path}: the '{role}' artifact's file {name!r} is not a plain name inside the "
                            f"artifacts folder (absolute paths and '..' are refused); re-export")
    path = root / pure
    if not path.resolve().is_relative_to(root.resolve()):
        raise ArtifactError(f"{manifest_path}: the '{role}' artifact's file {name!r} leads outside the artifacts "
                            f"folder (a link); copy the file itself into the folder or re-export")
    return path


def _check_shape(data: dict[str, Any], path: Path) -> None:
    """Refuse a manifest whose fields a reader reads have the wrong types, naming the first such field."""
    problem = _shape_problem({k: data[k] for k in _SHAPE}, _SHAPE, "manifest")
    if problem is None:
        artifacts = data["artifacts"]
        if not isinstance(artifacts, dict):
            problem = "manifest.artifacts must be an object (role -> file entry)"
        else:
            for role, entry in artifacts.items():
                problem = _shape_problem(entry, _ARTIFACT_ENTRY, f"manifest.artifacts.{role}")
                if problem:
                    break
    if problem:
        raise ArtifactError(f"{path} is malformed: {problem}; re-export")


def read_manifest(root: str | os.PathLike[str], verify: Iterable[str] | str | None = "all") -> Manifest:
    """Read ``root/manifest.json``, check its format version, and the size and sha256 of the files of the roles in
    ``verify`` (``"all"``: every listed file; ``None``: none)."""
    root = Path(root)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ArtifactError(f"artifacts folder {str(root)!r} does not exist; run hift-export --out {root} first")
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: {root} is not an export folder (run hift-export --out {root})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); re-export") from exc
    version = data.get("format_version") if isinstance(data, dict) else None
    if not isinstance(version, int):
        raise ArtifactError(f"{path} has no integer format_version; it was not written by hift-export")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"{path} has format version {version}, newer than this runtime understands "
                            f"({FORMAT_VERSION}); upgrade hift-deploy or re-export with this version")
    if version < FORMAT_VERSION:
        raise ArtifactError(f"{path} has old format version {version} (this runtime reads {FORMAT_VERSION}); re-export")
    for key in ("config", "step", "artifacts"):
        if key not in data:
            raise ArtifactError(f"{path} lacks the '{key}' section; re-export")
    _check_shape(data, path)
    for role, entry in data["artifacts"].items():  # every listed file, verified now or later, stays in the folder
        contained_file(root, entry["file"], role, path)
    manifest = Manifest(root, data)
    for role in (list(data["artifacts"]) if verify == "all" else list(verify or ())):
        manifest.verify(role)
    return manifest
