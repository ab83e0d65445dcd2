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
# The folded weights of both modules, weights-only torch file: what the compiled engine loads (hift_runtime.compiled).
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
    manifest = Manifest(root, data)
    for role in (list(data["artifacts"]) if verify == "all" else list(verify or ())):
        manifest.verify(role)
    return manifest
