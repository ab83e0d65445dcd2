"""ONNX Runtime sessions for an artifacts folder: the F0 step on the CPU EP, the generator steps on the CUDA EP when
usable (else the CPU EP, said in one log line). Every constant and every cache comes from the manifest."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from .manifest import (F0_STEP, FOLDED_WEIGHTS, GENERATOR_STEP, GENERATOR_STEP_FINAL, GENERATOR_STEP_FINAL_SLOTS, GENERATOR_STEP_SLOTS,
                       METADATA_PREFIX, POOL_OUTPUT, RUNTIME_ROLES, ArtifactError,
                       Manifest, ort_type, read_manifest)
from .noise import NoiseTable
from .process_tuning import HANDOFF_SWITCH_INTERVAL_S
from .slots import Slot, SlotPoolFull, SlotRows  # noqa: F401 - SlotPoolFull re-exported
from .contract import CacheSpec, StreamConstants
from .streaming import StreamingVocoder

log = logging.getLogger("hift_runtime")
Device = Literal["auto", "cuda", "cpu"]
DEVICES = ("auto", "cuda", "cpu")
PRECISIONS = ("fp32", "tf32", "fp16")  # the compiled engine's (hift_torch.compiled); ONNX Runtime runs the first two
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
CACHE_PREFIX, NEXT_PREFIX = "cache.", "next."
# ONNX Runtime's own warnings (e.g. "No registered plugin EP device found" for every CUDA session) are not the
# user's concern; errors still surface as exceptions.
ort.set_default_logger_severity(3)
# A shorter ladder for the compiled engine's shorter steps and final step (a stream's first push is 8 + 8 + 4
# frames, its last a final step): every 4x rather than every ~1.5x, 24 captures fewer. Measured on the H200: the warm
# start 87-100 s against 107-113 s, but a load's start burst (every stream's first push at once) pads those steps up
# to 2x: the first chunks' p50 at 2 816-3 072 streams 148-342 ms against 112-176 with every size. Opt-in
# (CudaOptions.short_step_batch_sizes), not the default.
SHORT_STEP_BATCH_SIZES = (2, 8, 32, 128, 256)


@dataclass(frozen=True)
class CudaOptions:
    """CUDA EP settings. TF32 is off by default (parity); HEURISTIC avoids re-benchmarking every new shape.

    ``step_sizes``: a push becomes generator steps of these frame counts, so the GPU sees a few fixed shapes (the
    CUDA EP rebuilds every conv's cuDNN state when a session meets a new shape, ~180 ms on an H200); it must contain 1.
    ``cuda_graphs``: each fixed step size (and batch size) is captured as a CUDA graph by ``warmup()`` (one session,
    one graph per shape, replayed over persistent device buffers); shapes not captured run as ordinary calls.
    Captures happen only inside ``warmup()``, and every call on the CUDA EP, warmup included, runs on one device
    thread, so nothing else runs on the device during a capture.
    """

    device_id: int = 0
    use_tf32: bool = False
    cudnn_conv_algo_search: str = "HEURISTIC"
    step_sizes: tuple[int, ...] = (24, 16, 8, 4, 2, 1)
    cuda_graphs: bool = True
    # The F0 step (float64 inside) on the GPU: bit-identical to the CPU EP's F0 and 2.6x faster per 24-frame step
    # on an H200 (0.50 vs 1.29 ms, benchmarks/results/gpu-h200-step.json); False keeps it on the CPU.
    f0_on_cuda: bool = True
    # Batch sizes captured for cross-stream batching (a batch of B streams runs on the smallest size >= B, padded).
    # (1,) without batching; open_vocoder(..., batching=True) on the GPU uses BATCH_SIZES.
    batch_sizes: tuple[int, ...] = (1,)
    # Device cache slots: one per open stream (0.58 MB each at full size), allocated at open. Raised to fit
    # open_vocoder(max_streams=...); a stream beyond them is refused with OverloadError.
    slots: int = 2048
    # The compiled engine's convolution layout ("channels-first" or "channels-last"); None: the precision's measured
    # best (channels-last in fp16, channels-first in fp32 and tf32: hift_torch.compiled.DEFAULT_CONV_LAYOUT).
    conv_layout: str | None = None
    # How the compiled engine's generator cache rows lie on the device: "channels-first" (the default) or
    # "channels-last" (each cache time-major, for channels-last convolutions: on the H200 0.6-2.3 % off the step at
    # B = 256, none at B = 2).
    cache_layout: str = "channels-first"
    # The compiled engine's first warmup compiles its five step graphs in this many processes side by side (on the
    # H200 a cold start of 240 s against ~425 s in turn); 1: in turn, in this process.
    compile_processes: int = 5
    # The batch sizes the compiled engine captures for the steps a stream meets only at its start and its end (the
    # shorter step sizes, the final step; the 24-frame step keeps every size); None (the default): every size.
    # SHORT_STEP_BATCH_SIZES: a shorter warmup, slower first chunks under load (measured there).
    short_step_batch_sizes: tuple[int, ...] | None = None
    # The compiled engine's final step as one call over a window of the largest step size plus the look-ahead (28
    # frames), so a stream's last push is two calls, not up to five; None (the default): on where CUDA graphs are
    # captured, False: the 4-frame final step after generator steps.
    final_window: bool | None = None
    # Likewise the stream step: one graph of 24 frames for every step up to 24, each row's frames an input (no graphs
    # of 8, 4 and 1 frames: three compiles and ~58 s of captures fewer; a push's generator work one call per 24
    # frames). None (the default): the precision's, DEFAULT_STEP_WINDOW (below), where CUDA graphs are captured: on in
    # fp32 (no device time lost there, a warm start 36 s against 81 s); off in fp16, where its step cost 13-20 % more
    # device time per row on the H200 and carried fewer streams near capacity, and in tf32, where its pushes waited
    # twice as long under load (p95 288 against 154 ms at 1 536 streams) for the same device time.
    step_window: bool | None = None
    # The compiled engine's warmup: threads that choose cuDNN's convolution algorithms side by side (torch keeps the
    # choices per thread, so each also captures the shapes it chose for), while the warmup's thread loads the graphs.
    # None: one per 8 GiB of free device memory, at most DEFAULT_CUDNN_THREADS, or one for cuDNN's benchmark in fp32
    # and tf32 (hift_torch.compiled.cudnn_threads_for_memory, cudnn_threads_at_most). ONNX Runtime chooses its own
    # algorithms and ignores it.
    cudnn_threads: int | None = None
    # How cuDNN chooses the compiled engine's convolution algorithms: "benchmark" (timed per shape at warmup) or
    # "heuristics" (its heuristic mode B, nothing timed); None: the precision's default (DEFAULT_CUDNN_ALGORITHMS,
    # below: mode B in every precision). Ignored by ORT.
    cudnn_algorithms: str | None = None
    # Python's GIL switch interval at most this while the compiled engine's warmup runs (the process's own restored
    # after; None: left as it is). Its choosing threads call the eager step, op by op, while the warmup's thread
    # traces the graphs in pure Python; under Python's default 5 ms a small op took 5.6-8.4 ms beside it, under 0.5 ms
    # 0.73-0.75 ms (benchmarks/gil_handoffs.py, its torch op beside a busy thread, 2 cores). Ignored by ORT.
    warmup_switch_interval_s: float | None = HANDOFF_SWITCH_INTERVAL_S
    # The compiled engine's batched calls at once over its CUDA graphs: 1 (the default), or 2: every shape captured
    # twice with its own pinned buffers, so one call's host part (its rows written in, its outputs copied out) runs
    # while the other's graph replays (hift_torch.compiled.CompiledBackend). On an H200 in fp16 two kept 3 328
    # streams in 2 of 3 runs where one kept 3 072 in 2 of 2, at ~1.7 GB more GPU memory and a higher p95 below
    # capacity (BENCHMARKS.md, "Two call lanes"): so an opt-in. Ignored by ORT.
    call_lanes: int = 1

    def provider_options(self) -> dict[str, str]:
        return {"device_id": str(self.device_id), "use_tf32": "1" if self.use_tf32 else "0",
                "cudnn_conv_algo_search": self.cudnn_conv_algo_search}


# The most threads the compiled engine's warmup chooses cuDNN's algorithms in (CudaOptions.cudnn_threads): eight
# against one, a warm start of 153 s against 198 s on one H200 host (BENCHMARKS.md, "cuDNN's choices in threads").
# Several server processes on one GPU share it (hift-serve --processes N: each process cudnn_threads_at_most // N).
DEFAULT_CUDNN_THREADS = 8
# How cuDNN picks the compiled engine's convolution algorithms (CudaOptions.cudnn_algorithms): "benchmark" (it times
# its candidates per shape at warmup) or "heuristics" (benchmark off; its heuristic mode B, nothing timed). Measured on
# the H200 (BENCHMARKS.md, "cuDNN's heuristic mode B", "A race under mode B" and "fp32's defaults"): in fp32 the
# compiled 24-frame step at 256 streams ran 110.9-111.3 ms on mode B's choices and 111.3-111.7 ms on the benchmark's
# made in one thread (153.1 ms on those made in eight: BENCHMARK_IN_THREADS); a whole warm start 81.2 s against
# 139.4 s (the benchmark's choosing alone took 142 s cold), in half the memory; its full-size streams 110.87-111.74 dB
# from the CPU's (a 20 s stream 111.35 dB; the benchmark's 110.85 and 111.35), so mode B is fp32's default. In
# tf32 ("tf32's start under mode B"): its graphs replayed 43.8 against 38.4-38.7 ms at 256 streams alone, yet under load
# the generator's device time per row was the same (0.177-0.198 against 0.170-0.198 ms) and it kept 1 792 streams in
# both its runs (the benchmark in one thread 1 536 in the same session, 1 792 the last); a start of 123 s cold, 59 s
# warm against 173 s and 146 s, so mode B is tf32's default too. In fp16 ("fp16's start under mode B") its graphs
# were 12-20 % slower alone (24.2-24.5 against 21.3 ms at 256 streams), yet under load the device time per row was the
# same (0.104-0.116 against 0.104-0.138 ms), it kept as many streams in four runs against three (2 560 and 3 072; the
# benchmark 2 560 once), its warm starts took 65-95 s against 104-118 s, its stream 59.0 dB from the CPU (the
# benchmark's 59.0): mode B is fp16's default as well. cuDNN's default, instant heuristic is no choice: fp16's steps
# 3-5x slower at 64-256.
CUDNN_ALGORITHMS = ("benchmark", "heuristics")
DEFAULT_CUDNN_ALGORITHMS = {"fp32": "heuristics", "tf32": "heuristics", "fp16": "heuristics"}
# Where cuDNN's benchmark was measured to choose as well in DEFAULT_CUDNN_THREADS threads as in one (fp16, replays
# within 3 %). In fp32 eight threads chose slower algorithms (above); in tf32 (on request) eight chose graphs as fast
# (39.5 against 38.4 ms at 256 streams) and kept 1 792 streams, but one run each: there it still chooses in one.
BENCHMARK_IN_THREADS = ("fp16",)
# Where the compiled engine's stream step is one graph over its window by default (CudaOptions.step_window; on where
# CUDA graphs are captured). In fp32 it costs no device time (0.564 against 0.570 ms per row of the 24-frame step at
# 768 streams, the same capacity) and halves the start (a warm one 36 s against 81 s); in fp16 it cost 13-20 % per row
# (BENCHMARKS.md, "The stream step in a window"); in tf32 the device time was the same but the pushes waited twice
# as long under load and 1 792 streams were no longer kept (BENCHMARKS.md, "tf32 keeps its graph per step size").
DEFAULT_STEP_WINDOW = {"fp32": True, "tf32": False, "fp16": False}
# Batched calls at once on the compiled engine's captured graphs (CudaOptions.call_lanes): one, or two (one's host part
# beside the other's replay; the scheduler has at most two calls in hand).
CALL_LANES = (1, 2)


def cudnn_threads_at_most(precision: str, cudnn_algorithms: str | None) -> int:
    """The most threads the compiled engine's warmup chooses cuDNN's algorithms in, for ``precision`` and how cuDNN
    chooses (None: the precision's default), where the threads are not set (:data:`BENCHMARK_IN_THREADS`)."""
    algorithms = cudnn_algorithms or DEFAULT_CUDNN_ALGORITHMS.get(precision, "benchmark")
    return DEFAULT_CUDNN_THREADS if algorithms == "heuristics" or precision in BENCHMARK_IN_THREADS else 1


# Slots kept beside max_streams for offline passes (vocode()), which take a slot while they run.
OFFLINE_SLOTS = 4
# The most streams a default (stream_capacity on the CPU) admits, whatever the memory.
MAX_DEFAULT_STREAMS = 4096
# On the CPU the default admits the streams its cores keep in real time: the largest batch (doubling from 1) whose
# step of a typical chunk takes at most this share of the audio it makes (the rest: the host's own work, spread).
REAL_TIME_STEP_FRAMES = 24
REAL_TIME_HEADROOM = 0.5
REAL_TIME_PROBE_BUDGET_S = 5.0  # the measurement stops doubling past this
# Between 32 and 256 in steps of 1.5x rather than 2x: a batch pads to the next size, and at high load a batched
# step costs about in proportion to its padded size.
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def nvidia_driver_present() -> bool:
    """onnxruntime-gpu lists the CUDA EP even where there is no GPU and then logs errors when asked for it."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def visible_gpus() -> list[int]:
    """The CUDA device ids this process sees (``CUDA_VISIBLE_DEVICES`` renumbers them from 0): counted by
    ``nvidia-smi -L``, so no CUDA library is loaded; [] without a driver."""
    import shutil
    import subprocess

    if not nvidia_driver_present() or shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    count = sum(line.startswith("GPU ") for line in listed.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return list(range(count))


def _zero_step_feed(c: StreamConstants, size: int, batch: int, final: bool = False) -> dict[str, np.ndarray]:
    """Zero inputs (the utterance start) of a generator step of ``size`` frames for ``batch`` streams."""
    mel, src = (size, size) if final else (size + c.mel_look_ahead, size + c.source_look_ahead)
    return {"mel": np.zeros((batch, c.in_channels, mel), np.float32), "f0": np.zeros((batch, src), np.float32),
            "noise": np.zeros((batch, src * c.samples_per_frame, c.num_sines), np.float32),
            "phase_in": np.zeros((batch, c.num_sines)), "first": np.ones((batch, 1), bool)}


def _check_signature(session: ort.InferenceSession, entry: dict[str, Any], caches: tuple[CacheSpec, ...],
                     path: Any) -> None:
    """The graph's inputs and outputs are the manifest's, and every cache input/output has the layout's shape."""
    got_in = [(v.name, v.type) for v in session.get_inputs()]
    got_out = [(v.name, v.type) for v in session.get_outputs()]
    want_in = [(v["name"], ort_type(v["dtype"])) for v in entry["inputs"]]
    want_out = [(v["name"], ort_type(v["dtype"])) for v in entry["outputs"]]
    if got_in != want_in or got_out != want_out:
        raise ArtifactError(f"{path}: graph signature inputs {got_in} -> outputs {got_out} differs from the "
                            f"manifest's {want_in} -> {want_out}; the file does not belong to this manifest")
    shapes = {v.name: v.shape[1:] for v in [*session.get_inputs(), *session.get_outputs()]}
    types = dict(got_in + got_out)
    for spec in caches:
        for name in (CACHE_PREFIX + spec.name, NEXT_PREFIX + spec.name):
            if name in shapes and (list(shapes[name]) != list(spec.shape) or types[name] != ort_type(spec.dtype)):
                raise ArtifactError(f"{path}: {name} is {shapes[name]} {types[name]}, the "
                                    f"manifest's cache layout says {list(spec.shape)} {spec.dtype}; re-export")
        if CACHE_PREFIX + spec.name not in shapes:
            raise ArtifactError(f"{path} has no input {CACHE_PREFIX + spec.name} from the manifest's cache layout; "
                                f"the file does not belong to this manifest")


def _check_metadata(session: ort.InferenceSession, manifest: Manifest, path: Any) -> None:
    meta = session.get_modelmeta().custom_metadata_map
    raw = meta.get(METADATA_PREFIX + "config")
    if raw is None:
        raise ArtifactError(f"{path} carries no {METADATA_PREFIX}config metadata: not written by hift-export")
    for key, want in (("config", manifest.config), ("step", manifest.step)):
        if json.loads(meta.get(METADATA_PREFIX + key, "null")) != want:
            what = "config" if key == "config" else "step contract (cache layout)"
            raise ArtifactError(f"{path}: the {what} in the graph's metadata differs from manifest.json's; the "
                                f"folder mixes files of two exports, or the manifest was edited; re-export")


class _StepSession:
    """One step graph: named inputs in, named outputs out; caches as a dict of per-name arrays."""

    def __init__(self, session: ort.InferenceSession, caches: tuple[CacheSpec, ...],
                 options: ort.RunOptions | None = None) -> None:
        self.session = session
        self.caches = caches
        self.options = options
        self.outputs = [o.name for o in session.get_outputs()]
        self.has_next = any(name.startswith(NEXT_PREFIX) for name in self.outputs)

    def run(self, feed: dict[str, np.ndarray], caches: dict[str, np.ndarray]) -> tuple[list[np.ndarray], Any]:
        for spec in self.caches:
            feed[CACHE_PREFIX + spec.name] = caches[spec.name]
        values = self.session.run(self.outputs, feed, self.options)
        lead = [v for name, v in zip(self.outputs, values) if not name.startswith(NEXT_PREFIX)]
        if not self.has_next:
            return lead, None
        nxt = {name[len(NEXT_PREFIX):]: v for name, v in zip(self.outputs, values) if name.startswith(NEXT_PREFIX)}
        return lead, nxt


class SlotPool:
    """Every open stream's generator caches in one device buffer ``[rows, R]`` (``R`` floats a stream), bound to the
    slot-form step graphs as their ``pool`` input and, in place, their ``pool_out`` output. Row 0 is scratch: the
    padding rows of a batch read and write it."""

    def __init__(self, rows: int, row_floats: int, device_id: int) -> None:
        self.free = SlotRows(rows, "CudaOptions(slots=...)")
        self.rows, self.row_floats = rows, row_floats
        self.value = ort.OrtValue.ortvalue_from_shape_and_type([rows, row_floats], np.float32, "cuda", device_id)

    def acquire(self) -> Slot:
        return self.free.acquire()

    @property
    def in_use(self) -> int:
        return self.free.in_use

    def bind(self, binding: Any, device_id: int, write: bool) -> None:
        """Bind the pool (flat, as the slot form takes it) as a graph's ``pool`` input and, when the graph writes it,
        as its ``pool_out`` in place."""
        shape, ptr = [self.rows * self.row_floats], self.value.data_ptr()
        binding.bind_input("pool", "cuda", device_id, np.float32, shape, ptr)
        if write:
            binding.bind_output(POOL_OUTPUT, "cuda", device_id, np.float32, shape, ptr)


def _slots(caches: Any) -> list[Slot]:
    """A step's streams' slots: one :class:`Slot`, or a list of them from the batcher."""
    return caches if isinstance(caches, list) else [caches]


def _slot_indices(caches: Any, batch: int) -> np.ndarray:
    """The pool rows of a step's streams, padded with the scratch row 0 up to ``batch``. (A stream whose step failed
    after writing its row is lost and refused in its own thread: it never reaches a batch.)"""
    slots = _slots(caches)
    index = np.zeros(batch, np.int64)
    index[:len(slots)] = [s.index for s in slots]
    return index


class _CapturedGraph:
    """One step graph at one fixed shape as a CUDA graph: its inputs and outputs live in persistent device buffers (a
    captured graph replays over exactly these addresses). A call copies the inputs in, replays, and copies the
    outputs out (the first ``rows`` of them: the batch is padded); the caller serialises calls."""

    def __init__(self, session: ort.InferenceSession, graph_id: int, feed: dict[str, np.ndarray],
                 outputs: dict[str, tuple[list[int], Any]], device_id: int) -> None:
        self.session, self.batch = session, next(iter(feed.values())).shape[0]
        self.inputs = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", device_id) for k, v in feed.items()}
        self.outputs = {k: ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", device_id)
                        for k, (shape, dtype) in outputs.items()}
        self.binding = session.io_binding()
        for k, v in self.inputs.items():
            self.binding.bind_ortvalue_input(k, v)
        for k, v in self.outputs.items():
            self.binding.bind_ortvalue_output(k, v)
        self.options = ort.RunOptions()
        self.options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.captured = False

    def replay(self, feed: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        for k, v in feed.items():
            self.inputs[k].update_inplace(_pad_rows(v, self.batch))
        self.session.run_with_iobinding(self.binding, self.options)
        return {k: v.numpy()[:rows] for k, v in self.outputs.items()}

    def capture(self, feed: dict[str, np.ndarray]) -> None:
        """Capture on ``feed`` (whole batch): ONNX Runtime runs a graph id normally a few times before capturing."""
        for _ in range(3):
            self.replay(feed, self.batch)
        self.captured = True


class _SlotStep(_CapturedGraph):
    """The slot-form generator step (or final step) of one fixed size and batch as a CUDA graph, the pool bound in
    place: a call copies the step's inputs in (no caches: they stay in the pool) and its audio and phase out."""

    def __init__(self, session: ort.InferenceSession, graph_id: int, size: int, batch: int,
                 constants: StreamConstants, pool: SlotPool, device_id: int, final: bool = False) -> None:
        c = constants
        self.size = size
        frames = size + (c.audio_lag if final else 0)  # a final step also emits the audio held back by the lag
        super().__init__(session, graph_id, {**_zero_step_feed(c, size, batch, final), "slots": np.zeros(batch, np.int64)},
                         {"audio": ([batch, frames * c.samples_per_frame], np.float32),
                          "phase_out": ([batch, c.num_sines], np.float64)}, device_id)
        pool.bind(self.binding, device_id, write=not final)  # a final step leaves the caches: the stream ends

    def run(self, feed: dict[str, np.ndarray], slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self.replay({**feed, "slots": slots}, feed["mel"].shape[0])
        return out["audio"], out["phase_out"]


def _f0_graph(session: ort.InferenceSession, graph_id: int, size: int, batch: int, constants: StreamConstants,
              device_id: int) -> _CapturedGraph:
    """The F0 step of ``size`` frames for ``batch`` streams as a CUDA graph (its small float64 caches travel with
    each call). Captured because an ordinary call rebuilds every convolution's cuDNN state whenever the shape differs
    from the previous call's, which batched F0 steps of changing sizes and batches do almost every time."""
    c = constants
    feed = {"mel": np.zeros((batch, c.in_channels, size + c.f0_look_ahead), np.float32),
            **{CACHE_PREFIX + spec.name: spec.zeros(batch) for spec in c.f0_caches}}
    outputs = {"f0": ([batch, size], np.float32),
               **{NEXT_PREFIX + spec.name: ([batch, *spec.shape], np.dtype(spec.dtype)) for spec in c.f0_caches}}
    return _CapturedGraph(session, graph_id, feed, outputs, device_id)


def _run_slots(session: ort.InferenceSession, feed: dict[str, np.ndarray], slots: np.ndarray, pool: SlotPool,
               device_id: int, options: ort.RunOptions | None) -> tuple[np.ndarray, np.ndarray]:
    """One ordinary (not captured) call of a slot-form graph: inputs from the host, the pool in place."""
    binding = session.io_binding()
    for k, v in {**feed, "slots": slots}.items():
        binding.bind_cpu_input(k, np.ascontiguousarray(v))
    for name in ("audio", "phase_out"):  # bound first: get_outputs() keeps the binding order
        binding.bind_output(name, "cpu")
    pool.bind(binding, device_id, write=any(o.name == POOL_OUTPUT for o in session.get_outputs()))
    session.run_with_iobinding(binding, options)
    audio, phase = binding.get_outputs()[:2]
    return audio.numpy(), phase.numpy()


def _pad_rows(value: np.ndarray, batch: int) -> np.ndarray:
    """``value`` with zero rows appended up to ``batch`` rows (a captured graph has a fixed batch)."""
    value = np.ascontiguousarray(value)
    if value.shape[0] == batch:
        return value
    pad = np.zeros((batch - value.shape[0], *value.shape[1:]), value.dtype)
    return np.concatenate([value, pad])


class OrtBackend:
    """The product backend: ``generator_step`` on the CUDA EP (or the CPU EP), ``f0_step`` beside it (or on the CPU
    EP with ``CudaOptions(f0_on_cuda=False)``)."""

    def __init__(self, manifest: Manifest, constants: StreamConstants, device: Device = "auto",
                 cuda: CudaOptions | None = None, intra_op_threads: int = 0) -> None:
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        self.manifest, self.constants = manifest, constants
        f0_entry = manifest.artifact(F0_STEP)
        mel_in = [v for v in f0_entry["inputs"] if v["name"] == "mel"] + [v for v in f0_entry["outputs"]
                                                                          if v["name"] == "f0"]
        if any(v["dtype"] != "float32" for v in mel_in):
            raise ArtifactError(f"{manifest.path(F0_STEP)}: the F0 graph must take and return float32 (the manifest "
                                f"lists {[(v['name'], v['dtype']) for v in mel_in]}); re-export with hift-export")
        self._cuda = cuda or CudaOptions()
        opts, cpu_opts = ort.SessionOptions(), ort.SessionOptions()
        for o in (opts, cpu_opts):
            o.log_severity_level = 3
            o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            if intra_op_threads:
                o.intra_op_num_threads = intra_op_threads
        providers: list[Any] = [CPU]
        reason = "device='cpu' requested"
        if device in ("auto", "cuda"):
            if not nvidia_driver_present():
                reason = "no NVIDIA driver on this host"
                if device == "cuda":
                    raise ArtifactError(f"device='cuda' requested but there is {reason}")
            elif CUDA in ort.get_available_providers():
                providers = [(CUDA, self._cuda.provider_options()), CPU]
                reason = ""
            else:
                reason = f"this onnxruntime build has no CUDA EP (available: {ort.get_available_providers()})"
                if device == "cuda":
                    raise ArtifactError(f"device='cuda' requested but {reason}; install onnxruntime-gpu "
                                        f"(and not onnxruntime beside it)")
        gen = constants.generator_caches
        if providers[0] != CPU:
            # CUDA sessions compute on the device; their CPU thread pools only run shape arithmetic, and spinning
            # pools (one per session, a thread per core) starve the streams' own threads under load.
            opts.intra_op_num_threads = intra_op_threads or 1
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # Every call on the CUDA EP runs on one thread of ours: ONNX Runtime keeps captured CUDA graphs per calling
        # thread (a replay from another thread captures again, while other threads may be running kernels: the
        # "operation not permitted when stream is capturing" crash), and the graphs' buffers are shared.
        self._device = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hift-cuda")
        self._graphs: dict[tuple[int, int, bool], _SlotStep] = {}  # (step size, batch, final) -> captured graph
        self._graphs_enabled = False
        self._pool: SlotPool | None = None
        self._real_time_streams: int | None = None  # real_time_streams(), measured once
        active = CPU
        if providers[0] != CPU:
            active = self._open_slot_sessions(opts, providers)
            if active != CUDA:
                reason = "CUDA EP could not start (no GPU or driver/CUDA libraries missing)"
                if device == "cuda":
                    raise ArtifactError(f"device='cuda' requested but the {reason}")
                providers = [CPU]
        if active != CUDA:  # the host form: caches are NumPy arrays that travel with each call
            self._gen = {False: _StepSession(self._session(GENERATOR_STEP, cpu_opts, providers, gen), gen),
                         True: _StepSession(self._session(GENERATOR_STEP_FINAL, cpu_opts, providers, gen), gen)}
        f0_providers = providers if active == CUDA and self._cuda.f0_on_cuda else [CPU]
        f0_opts = opts if f0_providers is providers else cpu_opts  # a CPU session keeps its thread pool
        self._f0_graphs: dict[tuple[int, int], _CapturedGraph] = {}  # (step size, batch) -> captured F0 step
        self._f0_graphs_enabled = False
        f0_session = None
        if f0_providers is providers and self._graphs_enabled:
            try:
                f0_session = self._session(F0_STEP, f0_opts, [(CUDA, self._cuda.provider_options()
                                                               | {"enable_cuda_graph": "1"}), CPU], constants.f0_caches)
                self._f0_graphs_enabled = True
            except ArtifactError:  # ordinary calls then: slower under changing shapes, otherwise the same
                log.info("hift_runtime: the F0 step cannot be captured as a CUDA graph here; running it without")
        if f0_session is None:
            f0_session = self._session(F0_STEP, f0_opts, f0_providers, constants.f0_caches)
        self._f0 = _StepSession(f0_session, constants.f0_caches, self._plain if self._f0_graphs_enabled else None)
        self.f0_provider = self._f0.session.get_providers()[0]
        self.generator_provider = active
        self.step_sizes = self._cuda.step_sizes if active == CUDA else None
        self.name = f"ort[{'cuda' if active == CUDA else 'cpu'}]"
        # A GPU that is there but unusable is worth a warning; the ordinary outcomes are INFO (the CLIs print the
        # engine in their own line: backend.name).
        surprising = device == "auto" and active != CUDA and reason.startswith(("CUDA EP could not", "this onnx"))
        log.log(logging.WARNING if surprising else logging.INFO, "hift_runtime: generator on %s%s; F0 on %s", active,
                f" ({reason})" if reason else "", self.f0_provider)

    def _open_slot_sessions(self, opts: ort.SessionOptions, providers: list[Any]) -> str:
        """The slot-form generator sessions and the device pool; returns the provider the step session got."""
        step_providers = providers
        if self._cuda.cuda_graphs:
            step_providers = [(CUDA, self._cuda.provider_options() | {"enable_cuda_graph": "1"}), CPU]
        try:
            step = self._session(GENERATOR_STEP_SLOTS, opts, step_providers, ())
        except ArtifactError:
            if step_providers is providers:
                raise
            log.warning("hift_runtime: the generator step cannot be captured as a CUDA graph here; running it "
                        "without CUDA graphs")
            step_providers = providers
            step = self._session(GENERATOR_STEP_SLOTS, opts, providers, ())
        active = step.get_providers()[0]
        if active != CUDA:
            return active
        self._graphs_enabled = step_providers is not providers
        self._plain = ort.RunOptions()
        if self._graphs_enabled:
            self._plain.add_run_config_entry("gpu_graph_id", "-1")  # ordinary call: no capture, no replay
        self._slot_step = step
        self._slot_final = self._session(GENERATOR_STEP_FINAL_SLOTS, opts, step_providers, ())
        row = int(self.manifest.step["pool_row_floats"])  # the layout's caches of one stream, flattened
        if row != sum(int(np.prod(spec.shape)) for spec in self.constants.generator_caches):
            raise ArtifactError(f"{self.manifest.root}/manifest.json: pool_row_floats {row} is not the sum of the "
                                f"generator cache layout; the manifest was edited; re-export")
        for session in (step, self._slot_final):
            pool = next(v for v in session.get_inputs() if v.name == "pool")
            if len(pool.shape) != 1:  # the row length is in the step contract, checked against the manifest's
                raise ArtifactError(f"{self.manifest.root}: the slot-form graphs take a pool of shape {pool.shape}, "
                                    f"this runtime a flat one (slot form of hift-export >= 2026-11-30); re-export")
        self._pool = SlotPool(self._cuda.slots + 1, row, self._cuda.device_id)
        return active

    def _session(self, role: str, opts: ort.SessionOptions, providers: list[Any],
                 caches: tuple[CacheSpec, ...]) -> ort.InferenceSession:
        path = self.manifest.path(role)
        try:
            session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:  # ORT raises its own exception types for unreadable or invalid models
            raise ArtifactError(f"{path}: ONNX Runtime cannot load it ({str(exc).splitlines()[0][:300]})") from exc
        _check_signature(session, self.manifest.artifact(role), caches, path)
        _check_metadata(session, self.manifest, path)
        return session

    @property
    def slots_in_use(self) -> int:
        return self._pool.in_use if self._pool is not None else 0

    @property
    def caches_in_place(self) -> bool:
        """True on the CUDA EP: a generator step writes the stream's caches in its device slot (a step that ran cannot
        be undone; the bookkeeping loses a stream whose push fails after one)."""
        return self._pool is not None

    def stream_capacity(self) -> int:
        """How many streams this backend holds at once: the device slots (less a few for offline passes beside the
        streams); on the CPU the fewer of what its cores keep in real time (:meth:`real_time_streams`) and a quarter
        of the memory available now, at each stream's host caches and pending mel."""
        if self._pool is not None:
            return max(1, self._pool.rows - 1 - OFFLINE_SLOTS)
        if self.generator_provider != CUDA:
            return min(self.real_time_streams(), self._streams_in_memory())
        return self._streams_in_memory()

    def real_time_streams(self) -> int:
        """How many streams the CPU keeps in real time, measured once (a few seconds): the largest batch, doubling
        from 1, whose F0 and generator steps of :data:`REAL_TIME_STEP_FRAMES` frames take at most
        :data:`REAL_TIME_HEADROOM` of the audio they make; at least 1."""
        if self._real_time_streams is None:
            import time

            c, frames = self.constants, REAL_TIME_STEP_FRAMES
            budget = REAL_TIME_HEADROOM * frames * c.samples_per_frame / c.sample_rate
            best, batch, started = 1, 1, time.perf_counter()
            while batch <= MAX_DEFAULT_STREAMS and time.perf_counter() - started < REAL_TIME_PROBE_BUDGET_S:
                if min(self._time_step(frames, batch) for _ in range(2)) > budget:
                    break
                best, batch = batch, batch * 2
            self._real_time_streams = best
        return self._real_time_streams

    def _time_step(self, frames: int, batch: int) -> float:
        """Seconds of one F0 step and one generator step of ``frames`` frames over ``batch`` zero rows."""
        import time

        c = self.constants
        mel = np.zeros((batch, c.in_channels, frames + c.mel_look_ahead), np.float32)
        f0 = np.zeros((batch, frames + c.source_look_ahead), np.float32)
        noise = np.zeros((batch, f0.shape[1] * c.samples_per_frame, c.num_sines), np.float32)
        phase, first = np.zeros((batch, c.num_sines), np.float64), np.zeros((batch, 1), bool)
        started = time.perf_counter()
        self.f0_step(mel[:, :, :frames + c.f0_look_ahead].copy(), self.new_caches("f0", batch))
        self.generator_step(mel, f0, noise, phase, first, self.new_caches("generator", batch), False)
        return time.perf_counter() - started

    def _streams_in_memory(self) -> int:
        """A quarter of the memory available now, at each stream's host caches and pending mel (at least 16)."""
        per_stream = sum(int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize
                         for spec in (*self.constants.generator_caches, *self.constants.f0_caches))
        per_stream = 2 * per_stream + (1 << 20)  # the caches twice while a step runs, and a chunk of mel and audio
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 8 << 30
        return int(max(16, min(MAX_DEFAULT_STREAMS, available // 4 // per_stream)))

    def new_caches(self, kind: str, batch: int = 1) -> Any:
        """Zero caches: NumPy arrays, or on the CUDA EP for the generator a device :class:`Slot` (its first step
        reads zeros, so a slot needs no clearing)."""
        if kind == "generator" and self._pool is not None:
            if batch != 1:
                raise ValueError("device slots are taken one stream at a time")
            return self._pool.acquire()
        specs = self.constants.generator_caches if kind == "generator" else self.constants.f0_caches
        return {spec.name: spec.zeros(batch) for spec in specs}

    def f0_step(self, mel: np.ndarray, caches: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if self.f0_provider != CUDA:
            (f0,), nxt = self._f0.run({"mel": mel}, caches)
            return f0, nxt
        return self._device.submit(self._f0_step_on_device, mel, caches).result()

    def _f0_step_on_device(self, mel: np.ndarray, caches: dict[str, np.ndarray]) -> tuple[np.ndarray, Any]:
        rows = mel.shape[0]
        batch = next((b for b in self._cuda.batch_sizes if b >= rows), rows)  # the shapes warmup() prepared
        graph = self._f0_graphs.get((mel.shape[2] - self.constants.f0_look_ahead, batch))
        if graph is not None and graph.captured:
            out = graph.replay({"mel": mel, **{CACHE_PREFIX + k: v for k, v in caches.items()}}, rows)
            return out["f0"], {k[len(NEXT_PREFIX):]: v for k, v in out.items() if k.startswith(NEXT_PREFIX)}
        (f0,), nxt = self._f0.run({"mel": _pad_rows(mel, batch)},
                                  {k: _pad_rows(np.asarray(v), batch) for k, v in caches.items()})
        return f0[:rows], {k: v[:rows] for k, v in nxt.items()}

    def generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                       first: np.ndarray, caches: Any, final: bool) -> tuple[np.ndarray, np.ndarray, Any]:
        feed = {"mel": mel, "f0": f0, "noise": noise, "phase_in": phase_in, "first": first}
        if self._pool is None:
            (audio, phase_out), nxt = self._gen[final].run(feed, caches)
            return audio, phase_out, nxt
        audio, phase_out = self._device.submit(self._slot_step_on_device, feed, caches, final).result()
        return audio, phase_out, (None if final else caches)  # the next caches are in the same slots

    def _slot_step_on_device(self, feed: dict[str, np.ndarray], caches: Any,
                             final: bool) -> tuple[np.ndarray, np.ndarray]:
        rows = feed["mel"].shape[0]
        batch = next((b for b in self._cuda.batch_sizes if b >= rows), rows)  # the shapes warmup() prepared
        slots = _slot_indices(caches, batch)
        assert self._pool is not None
        size = feed["f0"].shape[1] - (0 if final else self.constants.source_look_ahead)
        graph = self._graphs.get((size, batch, final))
        if graph is not None and graph.captured:
            return graph.run(feed, slots)
        audio, phase = _run_slots(self._slot_final if final else self._slot_step,
                                  {k: _pad_rows(v, batch) for k, v in feed.items()}, slots,
                                  self._pool, self._cuda.device_id, self._plain)
        return audio[:rows], phase[:rows]

    def warmup(self, step_sizes: tuple[int, ...] | None, progress: Any = None) -> None:
        """Prepare every fixed step size (and batch size) on the CUDA EP: build its cuDNN state and, with
        ``cuda_graphs``, capture its CUDA graph, on the device thread every later call runs on (so nothing else runs
        on the device during a capture). A no-op on the CPU, where nothing is compiled."""
        if self.generator_provider != CUDA or not step_sizes:
            return
        self._device.submit(self._warmup_on_device, step_sizes).result()

    def _warmup_on_device(self, step_sizes: tuple[int, ...]) -> None:
        c = self.constants
        for batch in self._cuda.batch_sizes:
            for size in step_sizes:
                if self.f0_provider == CUDA:
                    self._prepare_f0(size, batch)
                self._prepare(size, batch, final=False)
        # A stream's last step covers 4 frames once pushes split (fewer only for streams shorter than that); streams
        # that end together share it, so it is captured per batch size too (an ordinary call of it costs ~150 ms).
        for size in range(1, c.mel_look_ahead):
            self._prepare(size, 1, final=True, capture=False)
        for batch in self._cuda.batch_sizes:
            self._prepare(c.mel_look_ahead, batch, final=True)

    def _prepare_f0(self, size: int, batch: int) -> None:
        """The F0 step of one shape on the CUDA EP: captured (or, without graphs, run once: each shape's first
        ordinary run is slow)."""
        c = self.constants
        mel = np.zeros((batch, c.in_channels, size + c.f0_look_ahead), np.float32)
        if not self._f0_graphs_enabled:
            self._f0.run({"mel": mel}, self.new_caches("f0", batch))
            return
        if (size, batch) not in self._f0_graphs:
            graph = _f0_graph(self._f0.session, len(self._f0_graphs) + 1, size, batch, c, self._cuda.device_id)
            graph.capture({"mel": mel, **{CACHE_PREFIX + k: v for k, v in self.new_caches("f0", batch).items()}})
            self._f0_graphs[(size, batch)] = graph

    def _prepare(self, size: int, batch: int, final: bool, capture: bool = True) -> None:
        """Build one step shape's cuDNN state and, with CUDA graphs, capture it (on the device thread)."""
        assert self._pool is not None
        feed, scratch = _zero_step_feed(self.constants, size, batch, final), np.zeros(batch, np.int64)
        session = self._slot_final if final else self._slot_step
        if not (self._graphs_enabled and capture):
            _run_slots(session, feed, scratch, self._pool, self._cuda.device_id, self._plain)
        elif (size, batch, final) not in self._graphs:
            graph = _SlotStep(session, len(self._graphs) + 1, size, batch, self.constants, self._pool,
                              self._cuda.device_id, final)
            graph.capture({**feed, "slots": scratch})  # every row reads (and a step writes) the scratch slot
            self._graphs[(size, batch, final)] = graph


ENGINES = ("auto", "ort", "compiled")


def _choose_engine(engine: str, device: str, manifest: Manifest) -> tuple[str, str]:
    """``auto`` -> the compiled engine on a CUDA device when torch with CUDA is importable and the export has its
    weights, else ONNX Runtime; with the reason (said in the CLIs' engine line)."""
    if engine != "auto":
        return engine, f"engine={engine!r} requested"
    if device == "cpu":
        return "ort", "the CPU runs ONNX Runtime"
    if not nvidia_driver_present():
        return "ort", "no NVIDIA driver on this host"
    try:
        import torch
    except ImportError:
        return "ort", "torch is not installed (the compiled engine needs torch with CUDA)"
    if not torch.cuda.is_available():
        return "ort", "this torch has no CUDA device"
    if FOLDED_WEIGHTS not in manifest.data.get("artifacts", {}):
        return "ort", "the export has no folded weights for the compiled engine (re-export with hift-export)"
    return "compiled", "a CUDA device and torch with CUDA"


def open_vocoder(artifacts: str | os.PathLike[str], *, device: Device = "auto",
                 noise_table: str | os.PathLike[str] | None = None, noise_seed: int = 0,
                 cuda: CudaOptions | None = None, verify_hashes: bool = True, intra_op_threads: int = 0,
                 phase: str = "upstream", step_sizes: tuple[int, ...] | None = None, batching: bool | None = None,
                 max_batch: int = 256, max_wait_ms: float = 3.0, max_streams: int | None = None,
                 idle_timeout_s: float | None = None, engine: str = "auto",
                 precision: str = "fp32", devices: Sequence[int] | None = None) -> StreamingVocoder:
    """Open an export folder: verify the files the runtime loads, create the sessions once, return a
    :class:`StreamingVocoder`. Streams created from it share the sessions; each has its own small state.

    ``engine``: ``"auto"`` (the default: the compiled engine on a CUDA device where torch with CUDA is importable,
    else ONNX Runtime; ``vocoder.engine_reason`` says why), ``"ort"`` (ONNX Runtime: the CPU's engine, and the stock
    Triton repository's) or ``"compiled"`` (the step compiled by ``torch.compile``, :mod:`hift_torch.compiled`;
    needs torch; on the CPU it runs the same code eagerly).
    ``precision``: ``"fp32"`` (TF32 off, parity), ``"tf32"``, or ``"fp16"`` (compiled engine only); measured
    distances in BENCHMARKS.md.
    ``step_sizes``: fixed generator step sizes (default: ``cuda.step_sizes`` on the GPU, any size on the CPU).
    ``batching``: gather concurrent streams' steps into batched calls (:mod:`hift_runtime.batching`; default: on
    with a GPU, off on the CPU), at most ``max_batch`` streams a call, waiting at most ``max_wait_ms`` for
    partners (a lone stream never waits). ``max_streams``: open streams at most (:class:`OverloadError` beyond);
    ``idle_timeout_s``: a stream untouched that long is expired and its slot freed.
    ``devices``: CUDA device ids (e.g. ``[0, 1]``): one engine per GPU behind a
    :class:`~hift_runtime.placement.MultiDeviceVocoder`, each new stream on the least-loaded GPU and pinned there;
    ``max_streams`` is then the total (each GPU's slots sized for its share).
    """
    if devices is not None:
        return _open_on_devices(artifacts, list(devices), max_streams=max_streams, device=device, cuda=cuda,
                                noise_table=noise_table, noise_seed=noise_seed, verify_hashes=verify_hashes,
                                intra_op_threads=intra_op_threads, phase=phase, step_sizes=step_sizes,
                                batching=batching, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                idle_timeout_s=idle_timeout_s, engine=engine, precision=precision)
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    manifest = read_manifest(artifacts, verify=None)
    engine, reason = _choose_engine(engine, device, manifest)
    if verify_hashes:
        for role in ((FOLDED_WEIGHTS,) if engine == "compiled" else RUNTIME_ROLES):
            manifest.verify(role)
    try:
        constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{manifest.root}/manifest.json: unreadable step contract ({exc}); re-export") from exc
    cuda = cuda or CudaOptions()
    if max_streams is not None and cuda.slots < max_streams + OFFLINE_SLOTS:  # + offline passes beside the streams
        cuda = dataclasses.replace(cuda, slots=max_streams + OFFLINE_SLOTS)
    if batching is not False and cuda.batch_sizes == (1,):
        cuda = dataclasses.replace(cuda, batch_sizes=tuple(b for b in BATCH_SIZES if b <= max_batch))
    if engine == "compiled":
        backend: Any = _compiled_backend(manifest, constants, device, precision, cuda, max_batch)
        on_gpu = backend.on_cuda
    else:
        if precision == "fp16":
            raise ValueError("precision 'fp16' is the compiled engine's (engine='compiled'); ONNX Runtime runs fp32 "
                             "or tf32")
        if precision == "tf32":
            cuda = dataclasses.replace(cuda, use_tf32=True)
        if cuda.conv_layout is not None or cuda.cache_layout != "channels-first":
            raise ValueError("CudaOptions.conv_layout and cache_layout are the compiled engine's (engine='compiled'); "
                             "ONNX Runtime chooses its own layouts")
        if cuda.short_step_batch_sizes is not None:
            raise ValueError("CudaOptions.short_step_batch_sizes is the compiled engine's (engine='compiled'); "
                             "ONNX Runtime captures CudaOptions.batch_sizes for every step")
        if cuda.final_window or cuda.step_window:
            raise ValueError("CudaOptions.final_window and step_window are the compiled engine's (engine='compiled'); "
                             "ONNX Runtime's steps take any count of frames")
        backend = OrtBackend(manifest, constants, device=device, cuda=cuda, intra_op_threads=intra_op_threads)
        on_gpu = backend.generator_provider == CUDA
    if batching is None:
        batching = on_gpu
    noise = (NoiseTable.from_npy(noise_table, constants.num_sines) if noise_table is not None
             else NoiseTable.seeded(noise_seed, constants.noise_table_length, constants.num_sines))
    vocoder = StreamingVocoder(backend, constants, noise, phase=phase,
                               step_sizes=step_sizes if step_sizes is not None else backend.step_sizes,
                               max_streams=max_streams, idle_timeout_s=idle_timeout_s)
    vocoder.engine_reason = reason
    if batching:
        from .batching import PushScheduler

        vocoder.scheduler = PushScheduler(backend, max_batch=max_batch, max_wait_s=max_wait_ms / 1e3,
                                          pushes_in_progress=lambda: vocoder.pushes_in_progress)
    return vocoder


def _open_on_devices(artifacts: str | os.PathLike[str], devices: list[int], *, max_streams: int | None,
                     device: Device, cuda: CudaOptions | None, **options: Any) -> Any:
    """One vocoder per CUDA device id behind a :class:`~hift_runtime.placement.MultiDeviceVocoder`."""
    from .placement import MultiDeviceVocoder

    if not devices or len(set(devices)) != len(devices) or any(d < 0 for d in devices):
        raise ValueError(f"devices must be distinct CUDA device ids (e.g. [0, 1]), got {devices}")
    if device == "cpu":
        raise ValueError("devices= lists CUDA devices; with device='cpu' leave it out")
    share = None if max_streams is None else -(-max_streams // len(devices))  # each GPU's slots fit its share
    vocoders = [open_vocoder(artifacts, device="cuda", cuda=dataclasses.replace(cuda or CudaOptions(), device_id=d),
                             max_streams=share, **options) for d in devices]
    return MultiDeviceVocoder(vocoders, [f"cuda:{d}" for d in devices], max_streams=max_streams)


def _compiled_backend(manifest: Manifest, constants: StreamConstants, device: str, precision: str,
                      cuda: CudaOptions, max_batch: int) -> Any:
    """The compiled engine (imports torch): on CUDA device ``cuda.device_id`` unless ``device='cpu'``; its own step
    and batch sizes (few compiles), ``cuda.slots`` device cache rows."""
    try:
        from hift_torch.compiled import BATCH_SIZES as COMPILED_BATCH_SIZES, CompiledBackend
    except ImportError as exc:
        raise ArtifactError(f"the compiled engine needs torch ({exc}); install torch, or use engine='ort'") from exc
    if device == "cuda" or (device == "auto" and nvidia_driver_present()):
        target = f"cuda:{cuda.device_id}"
    else:
        target = "cpu"
    batches = tuple(b for b in COMPILED_BATCH_SIZES if b <= max(max_batch, COMPILED_BATCH_SIZES[0]))
    return CompiledBackend(manifest, constants, device=target, precision=precision, batch_sizes=batches,
                           slots=cuda.slots, conv_layout=cuda.conv_layout, cache_layout=cuda.cache_layout,
                           compile_processes=cuda.compile_processes,
                           short_step_batch_sizes=cuda.short_step_batch_sizes, final_window=cuda.final_window,
                           step_window=cuda.step_window, cudnn_threads=cuda.cudnn_threads,
                           cudnn_algorithms=cuda.cudnn_algorithms,
                           warmup_switch_interval_s=cuda.warmup_switch_interval_s, call_lanes=cuda.call_lanes)
