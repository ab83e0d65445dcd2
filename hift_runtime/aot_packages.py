"""The compiled engine's step graphs as AOTInductor packages (``CudaOptions(aot_packages=True)``).

With ``torch.compile`` every start re-traces each step graph in dynamo before inductor's on-disk cache can serve it:
on the H200 about two thirds of a warm start (45 s of bytecode tracing with a symbolic batch for five graphs,
BENCHMARKS.md "Where a warm start goes"). Here each step shape is instead exported once (``torch.export``, the batch
dynamic from 2) and compiled ahead of time (``torch._inductor.aoti_compile_and_package``: the same inductor kernels,
a C++ wrapper, the folded weights inside) into a ``.pt2`` package in inductor's cache folder; a later start loads the
packages, with no tracing and no compile. The packages are the engine's cache, not an export artifact: they are
specific to the GPU's architecture and to torch's version, so they are built on the serving machine at its first
start (side by side, :mod:`~hift_runtime.compile_workers`) and named by a hash of everything that shapes them.

A package is the step *after its source* (:meth:`~hift_runtime.compiled.CompiledBackend._after_source`, the source
stays eager for its phase's rounding) with the device cache pool as its first input, written in place by a stream
step; it is loaded ``run_single_threaded`` on CUDA, the runner form that can be captured in a CUDA graph.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class StepProgram(torch.nn.Module):
    """The step after its source as ``torch.export`` takes it: the generator's parameters are the module's (they
    become the package's constants), the cache pool an input (the engine's own pool is passed at every call)."""

    def __init__(self, backend: Any, final: bool) -> None:
        super().__init__()
        self.generator = backend.generator
        self.after_source = backend._after_source  # a bound method: reads self.generator (the same module)
        self.final = final

    def forward(self, pool: torch.Tensor, mel: torch.Tensor, source: torch.Tensor, cum: torch.Tensor,
                phase_in: torch.Tensor, first: torch.Tensor, slots: torch.Tensor,
                frames: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.after_source(self.final, mel, source, cum, phase_in, first, slots, frames, pool=pool)


def package_path(backend: Any, kind: str, size: int) -> Path:
    """Where the package of ``backend``'s step ``kind`` of ``size`` frames lives: inductor's cache folder
    (``TORCHINDUCTOR_CACHE_DIR``), a folder named by a hash of what the package holds (the graph key of
    :func:`~hift_runtime.compile_workers.graphs_key` and the folded weights' sha256, which the package embeds)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from .compile_workers import graphs_key
    from .manifest import FOLDED_WEIGHTS

    weights = backend.manifest.artifact(FOLDED_WEIGHTS)["sha256"]
    key = hashlib.sha256(json.dumps([graphs_key(backend), weights]).encode()).hexdigest()[:24]
    return Path(cache_dir()) / "hift" / f"aoti-{key}" / f"{kind}-{size}.pt2"


def build_package(backend: Any, kind: str, size: int) -> float:
    """Export ``backend``'s step ``kind`` of ``size`` frames and compile it into its package (written whole, then
    renamed: a reader never sees half a package); seconds."""
    started = time.perf_counter()
    path = package_path(backend, kind, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    example = backend._zeros(kind, size, 2)  # (a batch of 1 would specialise: the engine pads a lone row to 2)
    batch = torch.export.Dim("batch", min=2)
    with backend._precision():
        source, cum = backend._source(example[1], example[2], example[3])
        inputs = (backend.generator_pool, example[0], source, cum, *example[3:])
        dynamic = ({}, *({0: batch} for _ in inputs[1:]))
        program = torch.export.export(StepProgram(backend, kind == "final"), inputs, dynamic_shapes=dynamic)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial),
                                                     inductor_configs=backend.inductor_options or {})
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return time.perf_counter() - started


def load_package(backend: Any, kind: str, size: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The package of ``backend``'s step ``kind`` x ``size`` as the engine calls a compiled step after its source
    (``mel, source, cum, phase_in, first, slots[, frames]``; the pool is the engine's)."""
    device = backend.device
    index = -1 if device.type != "cuda" else (device.index if device.index is not None else torch.cuda.current_device())
    runner = torch._inductor.aoti_load_package(str(package_path(backend, kind, size)),
                                               run_single_threaded=device.type == "cuda", device_index=index)

    def call(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(runner(backend.generator_pool, *args))

    return call
