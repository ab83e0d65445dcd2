"""TorchScript target: traced and frozen step graphs (``torch.jit.load`` alone runs them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hift_runtime.manifest import F0_STEP, GENERATOR_STEP, GENERATOR_STEP_FINAL

from .graphs import F0StepGraph, GeneratorStepGraph
from hift_model.model import HiFT
from .targets import ARTIFACT_FILES, example_f0_step_inputs, example_generator_step_inputs


def export_torchscript(hift: HiFT, staging: Path, f0_dtype: str, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with torch.inference_mode(False), torch.no_grad():
        for role, final in ((GENERATOR_STEP, False), (GENERATOR_STEP_FINAL, True)):
            args = example_generator_step_inputs(hift.config, 24, 2, final)
            traced = torch.jit.trace(GeneratorStepGraph(hift.generator, final).eval(), args, check_trace=False)
            path = staging / ARTIFACT_FILES["ts_" + role]
            torch.jit.save(torch.jit.freeze(traced), str(path))
            entries["ts_" + role] = {"file": path.name, "format": "torchscript", "final": final}
        args = example_f0_step_inputs(hift.config, 24, 2, f0_dtype)
        traced = torch.jit.trace(F0StepGraph(hift.f0_predictor, hift.config, f0_dtype).eval(), args,
                                 check_trace=False)
        path = staging / ARTIFACT_FILES["ts_" + F0_STEP]
        torch.jit.save(torch.jit.freeze(traced), str(path))
        entries["ts_" + F0_STEP] = {"file": path.name, "format": "torchscript", "final": False}
    log(f"[torchscript] 3 step graphs traced and frozen in {time.perf_counter() - t0:.1f} s")
    return entries


def torchscript_runners(staging: Path, names: dict[str, int]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(generator step runner, F0 step runner) over the saved TorchScript files, for the self-check. ``names`` gives
    the number of leading non-cache inputs of each (the rest are caches, passed as one list)."""
    gens = {final: torch.jit.load(str(staging / ARTIFACT_FILES["ts_" + (GENERATOR_STEP_FINAL if final else
                                                                         GENERATOR_STEP)])) for final in (False, True)}
    f0 = torch.jit.load(str(staging / ARTIFACT_FILES["ts_" + F0_STEP]))

    def split(arrays: Sequence[np.ndarray], lead: int) -> list[Any]:
        tensors = [torch.from_numpy(a) for a in arrays]
        return [*tensors[:lead], tensors[lead:]]

    def run_generator(final: bool, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            return [t.numpy() for t in gens[final](*split(arrays, names["generator"]))]

    def run_f0(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            return [t.numpy() for t in f0(*split(arrays, names["f0"]))]

    return run_generator, run_f0
