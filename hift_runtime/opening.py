"""``open_vocoder``: an export folder opened on the engine, device and precision asked for (or chosen), behind the
one bookkeeping (:class:`~hift_runtime.streaming.StreamingVocoder`) and, where streams are batched, the one
scheduler. The compiled engine (:mod:`hift_torch.compiled`) is imported here and nowhere else, only when chosen."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from .contract import StreamConstants
from .gpus import nvidia_driver_present
from .manifest import FOLDED_WEIGHTS, RUNTIME_ROLES, ArtifactError, Manifest, read_manifest
from .noise import NoiseTable
from .options import (BATCH_SIZES, DEFAULT_SLOTS, DEVICES, ENGINES, OFFLINE_SLOTS, PRECISIONS, CompiledOptions,
                      EngineOptions, OrtOptions)
from .streaming import StreamingVocoder

COMPILED_ENGINE = "hift_torch.compiled"
PARITY_CHECK = "hift_torch.parity"


def torch_side(module: str, needed_for: str) -> Any:
    """A module of :mod:`hift_torch` (the engines on PyTorch), imported when asked for: the runtime's one way to the
    torch side; one line naming what to install where it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ArtifactError(f"{needed_for} needs torch ({exc}); install the project with its [export] extra "
                            f"(pip install -e '.[export]')") from exc


def compiled_engine_module() -> Any:
    """The compiled engine's module (imports torch)."""
    return torch_side(COMPILED_ENGINE, "the compiled engine (engine='compiled'; engine='ort' does not)")


def choose_engine(engine: str, device: str, manifest: Manifest) -> tuple[str, str]:
    """``auto`` -> the compiled engine on a CUDA device when torch with CUDA is there and the export has its weights,
    else ONNX Runtime; with the reason (said in the CLIs' engine line)."""
    if engine == "compiled" and (device == "cpu" or not nvidia_driver_present()):
        return engine, ("engine='compiled' requested; on the CPU it runs the same step eagerly (torch.compile and "
                        "CUDA graphs are CUDA's; engine='ort' is faster here)")
    if engine != "auto":
        return engine, f"engine={engine!r} requested"
    if device == "cpu":
        return "ort", "the CPU runs ONNX Runtime"
    if not nvidia_driver_present():
        return "ort", "no NVIDIA driver on this host"
    if importlib.util.find_spec("torch") is None:
        return "ort", "torch is not installed (the compiled engine needs torch with CUDA)"
    if not compiled_engine_module().cuda_available():
        return "ort", "this torch has no CUDA device"
    if FOLDED_WEIGHTS not in manifest.data.get("artifacts", {}):
        return "ort", "the export has no folded weights for the compiled engine (re-export with hift-export)"
    return "compiled", "a CUDA device and torch with CUDA"


def _engine_of(engine: str, options: EngineOptions | None) -> str:
    """The engine the options belong to, checked against the one asked for."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if options is None:
        return engine
    own = "compiled" if isinstance(options, CompiledOptions) else "ort" if isinstance(options, OrtOptions) else None
    if own is None:
        raise ValueError(f"options must be OrtOptions or CompiledOptions, got {type(options).__name__}")
    if engine not in ("auto", own):
        raise ValueError(f"{type(options).__name__} are the {own!r} engine's options, but engine={engine!r}; pass "
                         f"that engine's options or leave them out")
    return own


def open_vocoder(artifacts: str | os.PathLike[str], *, engine: str = "auto", device: str = "auto",
                 precision: str = "fp32", options: EngineOptions | None = None, devices: Sequence[int] | None = None,
                 max_streams: int | None = None, idle_timeout_s: float | None = None, batching: bool | None = None,
                 max_batch: int = 256, max_wait_ms: float = 3.0, noise_table: str | os.PathLike[str] | None = None,
                 noise_seed: int = 0, phase: str = "upstream", verify_hashes: bool = True) -> StreamingVocoder:
    """Open an export folder: verify the files the engine loads, load it once, return a
    :class:`~hift_runtime.streaming.StreamingVocoder` whose streams share it (each has its own small state).

    ``engine``: ``"auto"`` (the compiled engine on a CUDA device where torch with CUDA is importable, else ONNX
    Runtime; ``vocoder.engine_reason`` says why), ``"ort"`` or ``"compiled"``; ``options``: that engine's
    :class:`~hift_runtime.options.OrtOptions` or :class:`~hift_runtime.options.CompiledOptions` (they imply the
    engine). ``precision``: ``"fp32"`` (TF32 off: parity), ``"tf32"``, ``"fp16"`` (compiled engine only).
    ``devices``: CUDA device ids, one engine per GPU behind a :class:`~hift_runtime.placement.MultiDeviceVocoder`
    (each new stream on the least-loaded one); ``max_streams``: open streams at most, in all (each stream holds a
    device slot; :class:`~hift_runtime.errors.OverloadError` beyond); ``idle_timeout_s``: a stream untouched that
    long is expired. ``batching``: gather concurrent streams' steps into batched calls of at most ``max_batch``
    streams, waiting at most ``max_wait_ms`` for partners (default: on with a GPU). ``noise_table`` (a ``.npy``) or
    ``noise_seed``: the source's noise; ``phase``: ``"upstream"`` or ``"wrapped"`` (streaming.py).
    """
    engine = _engine_of(engine, options)
    if devices is not None:
        return _open_on_devices(artifacts, list(devices), engine=engine, device=device, precision=precision,
                                options=options, max_streams=max_streams, idle_timeout_s=idle_timeout_s,
                                batching=batching, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                noise_table=noise_table, noise_seed=noise_seed, phase=phase,
                                verify_hashes=verify_hashes)
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    manifest = read_manifest(artifacts, verify=None)
    engine, reason = choose_engine(engine, device, manifest)
    if verify_hashes:
        for role in ((FOLDED_WEIGHTS,) if engine == "compiled" else RUNTIME_ROLES):
            manifest.verify(role)
    try:
        constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{manifest.root}/manifest.json: unreadable step contract ({exc}); re-export") from exc
    slots = DEFAULT_SLOTS if max_streams is None else max_streams + OFFLINE_SLOTS
    backend, on_gpu = _open_backend(engine, manifest, constants, device, precision, options, slots, batching,
                                    max_batch)
    if batching is None:
        batching = on_gpu
    noise = (NoiseTable.from_npy(noise_table, constants.num_sines) if noise_table is not None
             else NoiseTable.seeded(noise_seed, constants.noise_table_length, constants.num_sines))
    vocoder = StreamingVocoder(backend, constants, noise, phase=phase, step_sizes=backend.traits.step_sizes,
                               max_streams=max_streams, idle_timeout_s=idle_timeout_s)
    vocoder.engine_reason = reason
    if batching:
        from .batching import PushScheduler

        vocoder.scheduler = PushScheduler(backend, max_batch=max_batch, max_wait_s=max_wait_ms / 1e3,
                                          pushes_in_progress=lambda: vocoder.pushes_in_progress)
    return vocoder


def _open_backend(engine: str, manifest: Manifest, constants: StreamConstants, device: str, precision: str,
                  options: EngineOptions | None, slots: int, batching: bool | None,
                  max_batch: int) -> tuple[Any, bool]:
    """The chosen engine's backend with ``slots`` device cache rows, and whether it runs on a GPU."""
    if engine == "compiled":
        module = compiled_engine_module()
        opts = options if isinstance(options, CompiledOptions) else CompiledOptions()
        target = "cpu" if device == "cpu" or (device == "auto" and not nvidia_driver_present()) else \
            f"cuda:{opts.device_id}"
        backend = module.CompiledBackend(manifest, constants, device=target, precision=precision, options=opts,
                                         slots=slots, batch_sizes=module.batch_ladder(max_batch))
        return backend, backend.on_cuda
    if precision == "fp16":
        raise ValueError("precision 'fp16' is the compiled engine's (engine='compiled'); ONNX Runtime runs fp32 or "
                         "tf32")
    from .ort_engine import CUDA, OrtBackend

    batches = tuple(b for b in BATCH_SIZES if b <= max_batch) if batching is not False else (1,)
    backend = OrtBackend(manifest, constants, device=device, options=options if isinstance(options, OrtOptions)
                         else OrtOptions(), precision=precision, slots=slots, batch_sizes=batches)
    return backend, backend.generator_provider == CUDA


def _open_on_devices(artifacts: str | os.PathLike[str], devices: list[int], *, max_streams: int | None,
                     device: str, engine: str, options: EngineOptions | None, **rest: Any) -> Any:
    """One vocoder per CUDA device id behind a :class:`~hift_runtime.placement.MultiDeviceVocoder`."""
    from .placement import MultiDeviceVocoder

    if not devices or len(set(devices)) != len(devices) or any(d < 0 for d in devices):
        raise ValueError(f"devices must be distinct CUDA device ids (e.g. [0, 1]), got {devices}")
    if device == "cpu":
        raise ValueError("devices= lists CUDA devices; with device='cpu' leave it out")
    share = None if max_streams is None else -(-max_streams // len(devices))  # each GPU's slots fit its share
    if options is None:  # each GPU's engine needs its device id: the engine chosen once, for all of them
        engine = choose_engine(engine, "cuda", read_manifest(artifacts, verify=None))[0]
        options = CompiledOptions() if engine == "compiled" else OrtOptions()
    vocoders = [open_vocoder(artifacts, device="cuda", engine=engine, max_streams=share,
                             options=dataclasses.replace(options, device_id=d), **rest) for d in devices]
    return MultiDeviceVocoder(vocoders, [f"cuda:{d}" for d in devices], max_streams=max_streams)
