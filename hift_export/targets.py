"""What every export target shares: file names, example inputs, and the self-check against the eager step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hift_runtime.manifest import (F0_STEP, FOLDED_WEIGHTS, GENERATOR_STEP, GENERATOR_STEP_FINAL, GENERATOR_STEP_FINAL_SLOTS,
                                   GENERATOR_STEP_SLOTS, GENERATOR_WEIGHTS)
from hift_runtime.metrics import max_abs

from hift_model.config import HiFTConfig
from .graphs import F0StepGraph, GeneratorStepGraph
from hift_model.model import HiFT
from hift_model.step import DTYPES, f0_cache_layout, generator_cache_layout

ARTIFACT_FILES = {
    GENERATOR_STEP: "hift_generator_step.onnx",
    GENERATOR_STEP_FINAL: "hift_generator_step_final.onnx",
    GENERATOR_STEP_SLOTS: "hift_generator_step_slots.onnx",
    GENERATOR_STEP_FINAL_SLOTS: "hift_generator_step_final_slots.onnx",
    GENERATOR_WEIGHTS: "hift_generator.weights",
    F0_STEP: "hift_f0_step.onnx",
    FOLDED_WEIGHTS: "hift_folded.pt",
    "ts_" + GENERATOR_STEP: "hift_generator_step.ts",
    "ts_" + GENERATOR_STEP_FINAL: "hift_generator_step_final.ts",
    "ts_" + F0_STEP: "hift_f0_step.ts",
}
# Self-check bound for the exported graphs against the eager step, same inputs and caches (audio, phase, caches).
# Audio and phase absolute; caches relative to their own scale (at least 1): with random caches some activations reach
# ~1e2, where float32 rounding alone is ~1e-5 absolute (1.2e-5 seen on the reduced model, ORT 1.31, torch 2.13).
# Measured on the fixture checkpoint, CPU EP: <= 7e-6; F0 in float64 is exact.
STEP_TOLERANCE = 1e-5


class ExportError(RuntimeError):
    """The export could not produce correct artifacts; the output folder was left as it was."""


def example_generator_step_inputs(config: HiFTConfig, steps: int, batch: int, final: bool,
                                  seed: int = 0) -> tuple[Any, ...]:
    """Random inputs of a generator step of ``steps`` frames, with non-zero caches and mixed ``first`` flags."""
    gen = torch.Generator().manual_seed(seed)
    spf, look = config.samples_per_frame, config.conv_pre_look_right
    mel_frames, src_frames = (steps, steps) if final else (steps + look, steps + 1)
    mel = torch.randn(batch, config.in_channels, mel_frames, generator=gen) * 2.0 - 5.0
    f0 = torch.rand(batch, src_frames, generator=gen) * 400.0
    f0[:, ::7] = 0.0  # some unvoiced frames
    noise = torch.rand(batch, src_frames * spf, config.num_sines, generator=gen)
    phase_in = torch.rand(batch, config.num_sines, generator=gen, dtype=torch.float64) * 50.0
    first = (torch.arange(batch) % 2 == 0).reshape(batch, 1)
    caches = [torch.randn(batch, *e["shape"], generator=gen, dtype=DTYPES[e["dtype"]]) * 0.1
              for e in generator_cache_layout(config)]
    return mel, f0, noise, phase_in, first, caches


def example_f0_step_inputs(config: HiFTConfig, steps: int, batch: int, dtype: str, seed: int = 0) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    mel = torch.randn(batch, config.in_channels, steps + config.f0_look_ahead, generator=gen) * 2.0 - 5.0
    caches = [torch.randn(batch, *e["shape"], generator=gen, dtype=DTYPES[e["dtype"]]) * 0.5
              for e in f0_cache_layout(config, dtype)]
    return mel, caches


def flat_arrays(args: tuple[Any, ...]) -> list[np.ndarray]:
    """A graph wrapper's arguments (caches as one list) as the flat list of arrays its exported graph takes."""
    out: list[np.ndarray] = []
    for a in args:
        out.extend(x.numpy() for x in a) if isinstance(a, list) else out.append(a.numpy())
    return out


def _max_abs(a: np.ndarray, b: np.ndarray, what: str) -> float:
    try:
        return max_abs(a, b)
    except ValueError:
        raise ExportError(f"self-check: {what} has shape {a.shape}, the eager step gives {b.shape}") from None


def _scale(reference: np.ndarray) -> float:
    """A tensor's scale for a relative error: its largest magnitude, at least 1 (an absolute error below that)."""
    return max(float(np.max(np.abs(reference))) if reference.size else 0.0, 1.0)


def check_against_eager(hift: HiFT, f0_dtype: str, run_generator: Callable[[bool, list[np.ndarray]], Sequence[Any]],
                        run_f0: Callable[[list[np.ndarray]], Sequence[Any]], steps: Sequence[int] = (1, 9),
                        batch: int = 2) -> dict[str, float]:
    """Max abs differences of a target's step graphs from the eager step, same inputs and caches."""
    figures = {"generator_step": 0.0, "generator_step_final": 0.0, "generator_caches": 0.0, "f0_step": 0.0,
               "f0_caches": 0.0}
    with torch.inference_mode():
        for c in steps:
            for final in (False, True):
                args = example_generator_step_inputs(hift.config, c, batch, final, seed=c)
                want = [t.numpy() for t in GeneratorStepGraph(hift.generator, final)(*args)]
                got = [np.asarray(g) for g in run_generator(final, flat_arrays(args))]
                key = "generator_step_final" if final else "generator_step"
                figures[key] = max(figures[key], _max_abs(got[0], want[0], key))
                for g, w in zip(got[2:], want[2:]):  # relative to the cache's scale: activations reach ~1e2
                    figures["generator_caches"] = max(figures["generator_caches"],
                                                      _max_abs(g, w, "a cache") / _scale(w))
                if not np.array_equal(got[1], want[1]):  # the float64 running phase sum is exact
                    raise ExportError(f"self-check: {key} phase_out differs from the eager step")
            args = example_f0_step_inputs(hift.config, c, batch, f0_dtype, seed=c)
            want = [t.numpy() for t in F0StepGraph(hift.f0_predictor, hift.config, f0_dtype)(*args)]
            got = [np.asarray(g) for g in run_f0(flat_arrays(args))]
            figures["f0_step"] = max(figures["f0_step"], _max_abs(got[0], want[0], "f0") / max(
                float(np.max(np.abs(want[0]))), 1e-6))
            for g, w in zip(got[1:], want[1:]):
                figures["f0_caches"] = max(figures["f0_caches"], _max_abs(g, w, "an F0 cache"))
    return figures


def judge(figures: dict[str, float], what: str) -> None:
    bad = {k: v for k, v in figures.items() if v > STEP_TOLERANCE}
    if bad:
        raise ExportError(f"{what} do not match the eager step: {bad} (tolerance {STEP_TOLERANCE})")
