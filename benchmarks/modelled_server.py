"""``hift-serve`` over a stand-in device (``host_path.py``'s instant device, or its modelled H200): what the served
path costs the host (Triton, PyTriton's proxy hop, the stream table, the scheduler) on any machine, GPU or not.
Not a product command; ``load_test.py --served-device-model`` starts it as its served config.

    python benchmarks/modelled_server.py --device-model modelled --step-ms 3.3,0.43,0.8,4 -- <hift-serve options>

``--step-ms FIXED,PER_ROW,F0,FINAL``: the modelled device's step time, ``FIXED + PER_ROW x B`` ms for a 24-frame
generator step of B streams, ``F0`` ms per F0 call, ``FINAL`` ms per final step (default: the ORT engine's figures,
see ``host_path.ModelledDevice``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from host_path import STEP_SIZES, InstantDevice, ModelledDevice, modelled_vocoder  # same folder

import hift_runtime.server as server
from hift_runtime.manifest import read_manifest
from hift_runtime.serving import ChunkReply, ChunkRequest, StreamTable
from hift_runtime.contract import StreamConstants


def stand_in_device(constants: StreamConstants, model: str, step_ms: str | None) -> InstantDevice:
    """``HIFT_SHARED_DEVICE`` (a file): the modelled device is shared with every process naming the same file."""
    if model == "instant":
        return InstantDevice(constants)
    shared = os.environ.get("HIFT_SHARED_DEVICE") or None
    if not step_ms:
        return ModelledDevice(constants, shared_lock=shared)
    fixed, per_row, f0, final = (float(x) for x in step_ms.split(","))
    return ModelledDevice(constants, fixed_ms=fixed, per_row_ms=per_row, f0_ms=f0, final_ms=final, shared_lock=shared)


def stand_in_vocoder(artifacts: str, model: str, step_ms: str | None, max_wait_s: float, sizes: str = "ort") -> Any:
    """A batching vocoder with the export's constants over a stand-in device (``model``: instant or modelled;
    ``sizes``: whose step sizes, ``host_path.STEP_SIZES``)."""
    manifest = read_manifest(artifacts, verify=None)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    return modelled_vocoder(constants, stand_in_device(constants, model, step_ms), batched=True, max_wait_s=max_wait_s,
                            sizes=sizes)


class EchoTable:
    """No runtime at all: each chunk answered at once with silence of its length (``--device-model echo``). What the
    front end and Triton alone carry, measured with the same clients."""

    def __init__(self, vocoder: Any) -> None:
        self.vocoder, self.samples_per_frame = vocoder, vocoder.constants.samples_per_frame
        self.open_streams = self.streams_expired = 0
        self.refused: dict[str, int] = {}

    def handle(self, chunks: list[ChunkRequest]) -> list[ChunkReply]:
        return [ChunkReply(np.zeros(c.mel.shape[-1] * self.samples_per_frame, np.float32)) for c in chunks]

    def submit(self, chunks: list[ChunkRequest], reply: Callable[[int, ChunkReply], None]) -> None:
        for i, answer in enumerate(self.handle(chunks)):
            reply(i, answer)

    def close(self) -> None:
        pass


def open_stand_in_table(args: argparse.Namespace) -> tuple[Any, Any]:
    """hift-serve's ``open_table`` over the stand-in device named by ``HIFT_STAND_IN`` (``MODEL;STEP_MS;SIZES``; set by
    :func:`main`, inherited by Triton's Python-backend stub when the front end is ``python-backend``)."""
    model, step_ms, sizes = (os.environ.get("HIFT_STAND_IN", "modelled") + ";;").split(";")[:3]
    vocoder = stand_in_vocoder(args.artifacts, "instant" if model == "echo" else model, step_ms or None,
                               args.max_wait_ms / 1e3, sizes or "ort")
    vocoder.max_streams = args.max_streams or 4096
    if model == "echo":
        print("hift-serve: no runtime (an echo: benchmarks/modelled_server.py)", flush=True)
        return vocoder, EchoTable(vocoder)
    print(f"hift-serve: generator on {vocoder.backend.name} (a stand-in device: benchmarks/modelled_server.py)",
          flush=True)
    return vocoder, StreamTable(vocoder, workers=args.max_batch, max_chunk_frames=args.max_chunk_frames)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-model", choices=["instant", "modelled", "echo"], default="modelled",
                   help="instant or modelled: hift-serve's runtime over that device; echo: no runtime at all")
    p.add_argument("--step-ms", help="FIXED,PER_ROW,F0,FINAL (ms) of the modelled device")
    p.add_argument("--step-sizes", choices=sorted(STEP_SIZES), default="ort",
                   help="whose step sizes (and noise form) the stand-in has: the ORT engine's or the compiled engine's")
    ours, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    os.environ["HIFT_STAND_IN"] = f"{ours.device_model};{ours.step_ms or ''};{ours.step_sizes}"
    server.PYTHON_BACKEND_OPENER = "modelled_server:open_stand_in_table"  # the Python backend's stub imports it
    return server.main(rest)


if __name__ == "__main__":
    sys.exit(main())
