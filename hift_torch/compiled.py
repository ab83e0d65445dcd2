"""The compiled engine: the step (``hift_model.step``) compiled by ``torch.compile`` (inductor: elementwise chains
fused into Triton kernels, cuDNN convolutions), behind the same bookkeeping and scheduler as the ONNX Runtime engine.

* **Weights**: the folded weights the exporter writes (``hift_folded.pt``, weights only, checked by hash like every
  file), loaded into fresh modules built from the manifest's config: the original ``hift.pt`` is never needed.
* **Caches**: every open stream's generator caches in one device tensor ``[rows, R]`` and its F0 caches (float64)
  in another (a :class:`~.slots.Slot` of each per stream, row 0 scratch for a batch's padding rows), read and written
  in place by the steps; a stream's first step reads zeros instead of its row. Nothing but the mel, F0 values, phase
  and audio crosses the bus (the F0 caches, 32 KB a stream at full size, used to travel both ways with every call).
* **Noise**: the noise table lives on the device; each step gathers its rows from the first row's index (no 432 KB of
  noise per stream-step crosses the bus).
* **CUDA graphs**: at :meth:`warmup`, every (step size, batch size) of the stream step, the final step (a window of
  28 frames, each row's end an input: a stream's last push is its F0 call and one final call) and
  the F0 step (every size up to 24 frames: one F0 call a push) is compiled (one dynamic-batch compile serves all
  sizes; the F0 step runs eagerly), run, and captured (optionally the shorter steps and the final step, which a
  stream meets only at its start and end, at fewer batch sizes: ``short_step_batch_sizes``);
  each graph copies its inputs in from pinned host buffers and its audio and phase out to them (one set per step
  shape, shared by its batch sizes: < 100 MB pinned at full size), so a call is the host's writes into the buffers,
  one replay and one wait. With ``call_lanes=2`` every shape is captured twice, each copy with its own buffers, and
  two calls run at once: one's host part beside the other's replay.
* **Precision** (:data:`PRECISIONS`): ``fp32`` (TF32 off: parity, the default), ``tf32`` (TF32 convolutions and
  matmuls), ``fp16`` (the convolution trunk in half precision; source, STFT, phase and iSTFT head in float32). The F0
  step always runs in the export's F0 precision (float64 by default).
* **Convolution layout** (:data:`DEFAULT_CONV_LAYOUT`): fp16 stores the generator's convolution weights channels-last
  and runs them as 2-D convolutions, so cuDNN's NHWC tensor-core kernels need no transposes around them (21-29 %
  off the fp16 step on the H200); fp32 and tf32 stay channels-first, where channels-last gained nothing or lost.

On the CPU (no compile, or ``compile=True`` for inductor's C++ backend) the same code runs eagerly: that is how CI
checks the engine's pool, noise gather and bookkeeping against the ONNX Runtime engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hift_runtime.arrays import byte_view, copy_rows
from hift_runtime.manifest import FOLDED_WEIGHTS, ArtifactError, Manifest
from hift_runtime.noise import NoiseTable
from hift_runtime.process_tuning import HANDOFF_SWITCH_INTERVAL_S, switch_interval_at_most
from hift_runtime.sessions import (CALL_LANES, CUDNN_ALGORITHMS, DEFAULT_CUDNN_ALGORITHMS, DEFAULT_CUDNN_THREADS,
                       DEFAULT_STEP_WINDOW, OFFLINE_SLOTS, PRECISIONS, cudnn_threads_at_most)
from hift_runtime.slots import SlotRows
from hift_runtime.contract import StreamConstants

log = logging.getLogger("hift_runtime")
DEFAULT_PRECISION = "fp32"
# Batch sizes captured for cross-stream batching (a batch of B streams runs on the smallest size >= B, padded). No
# B = 1: one compile with a dynamic batch serves B >= 2 (dynamo specialises size 1, which would be a compile more);
# a lone stream runs padded to 2.
BATCH_SIZES = (2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
# Each step size is a compile of its own (frame counts are static: with a dynamic frame axis dynamo recompiles at
# every size threshold of the convolutions anyway), so few: a 24-frame chunk stream meets 24, and 8 + 8 + 4 at its
# start; every other count splits into these.
STEP_SIZES = (24, 8, 4, 1)
# The F0 step (eager, float64, ~10 ms a capture) at every size up to 24 frames: a push's F0 is then one call, where
# the generator's sizes would make up to four (a stream's first push: 8 + 8 + 4 + 1), each waiting for a device turn.
F0_STEP_SIZES = tuple(range(24, 0, -1))
# Dynamo keeps this many compiles of one function before it falls back to eager without a word; ours are counted.
RECOMPILE_LIMIT = 64
CONV_LAYOUTS = ("channels-first", "channels-last")
# The generator's convolution layout per precision, as measured on the H200 (benchmarks/profile_compiled.py,
# BENCHMARKS.md). channels-last: each Conv1d weight stored [O, I, 1, K] channels-last, the convolutions 2-D over
# [B, C, 1, T], inductor's layout optimization forced. In fp16, cuDNN's tensor-core kernels are NHWC and transpose NCW
# operands in and out (31 % of the step at B = 256): channels-last makes the step 21 % faster at B = 256, 29 % at
# B = 2. In tf32 the transposes move into inductor's kernels (38.35 against 38.40 ms at B = 256), and fp32 runs NCHW
# FFMA kernels (channels-last 18 % slower): both stay channels-first.
DEFAULT_CONV_LAYOUT = {"fp32": "channels-first", "tf32": "channels-first", "fp16": "channels-last"}
# The warmup's threads that choose cuDNN's convolution algorithms (_ChoosingThreads), where none are set: at most
# DEFAULT_CUDNN_THREADS, and one per CUDNN_THREAD_BYTES of free device memory (on the H200, fp16, eight threads
# reserved 55.9 GiB at most, the slots' pool and the graphs' included: benchmarks/cudnn_benchmark_limit.py, 10@8).
CUDNN_THREAD_BYTES = 8 << 30
# Torch reads it once, at a process's first convolution that cuDNN's heuristics choose for (ATen's ConvUtils.h): the
# engine sets it before its own first one, which is in time unless other convolutions ran before in the process.
HEURISTIC_MODE_B_ENV = "TORCH_CUDNN_USE_HEURISTIC_MODE_B"


def use_heuristic_mode_b() -> bool:
    """Ask torch for cuDNN's heuristic mode B (:data:`HEURISTIC_MODE_B_ENV`), unless the environment says otherwise;
    whether it is asked for."""
    return heuristic_mode_b_asked(os.environ.setdefault(HEURISTIC_MODE_B_ENV, "1"))


def heuristic_mode_b_asked(value: str) -> bool:
    """Whether :data:`HEURISTIC_MODE_B_ENV`'s ``value`` asks for mode B (the words torch's ``check_env`` takes)."""
    return value.strip().lower() in ("1", "on", "true", "yes", "y")


def cudnn_threads_for_memory(free_bytes: int, at_most: int = DEFAULT_CUDNN_THREADS) -> int:
    """The warmup's choosing threads when none are set: one per :data:`CUDNN_THREAD_BYTES` of free device memory, at
    least one, at most ``at_most`` (:func:`~hift_runtime.sessions.cudnn_threads_at_most`)."""
    return max(1, min(at_most, free_bytes // CUDNN_THREAD_BYTES))


def load_folded(manifest: Manifest, device: torch.device) -> tuple[Any, Any]:
    """The generator (``spectral='conv'``, on ``device``) and the F0 predictor (in the export's F0 precision, on
    ``device``) with the exporter's folded weights."""
    from hift_model.config import HiFTConfig
    from hift_model.folding import fold_weight_norms
    from hift_model.model import build_unfolded

    path = manifest.path(FOLDED_WEIGHTS)
    config = HiFTConfig.from_dict(manifest.config)
    generator, predictor = build_unfolded(config, spectral="conv")
    fold_weight_norms(generator)
    fold_weight_norms(predictor)
    f0_dtype = torch.float64 if manifest.data.get("f0_precision", "fp64") == "fp64" else torch.float32
    predictor = predictor.to(f0_dtype)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        generator.load_state_dict(state["generator"], strict=True)
        predictor.load_state_dict(state["f0_predictor"], strict=True)
    except (RuntimeError, KeyError, TypeError, OSError) as exc:
        raise ArtifactError(f"{path}: cannot load the folded weights into the manifest's model "
                            f"({str(exc).splitlines()[0][:300]}); re-export") from exc
    if f0_dtype == torch.float64:
        predictor.impl = "matmul"  # the exported F0 graph's form (same values, same order of operations)
    return generator.to(device).eval().requires_grad_(False), predictor.to(device).eval().requires_grad_(False)


class _Mirrors:
    """Pinned host buffers of one step shape's inputs and outputs, ``rows`` rows each, shared by its graphs of every
    batch size (one call at a time: the backend's lock); a graph of batch ``B`` copies rows ``[0, B)``. Per batch
    size they would pin ~280 MB at full size (the host allocator rounds each to a power of two); shared, ~56 MB of
    buffers (< 100 MB pinned)."""

    def __init__(self, inputs: list[torch.Tensor], outputs: tuple[torch.Tensor, ...], rows: int) -> None:
        self.inputs = [torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True) for t in inputs]
        self.outputs = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True) for t in outputs]
        self.host_in = [t.numpy() for t in self.inputs]
        self.host_out = [t.numpy() for t in self.outputs]
        self.dirty = 0  # rows past which every input row is zero (the buffers start as zeros)

    def write(self, values: list[np.ndarray], rows: int, batch: int) -> None:
        """``values`` into the first ``rows`` rows; rows ``[rows, batch)`` zero (slot 0: the scratch row), since a
        larger call's rows left there would read and write its streams' slots. Copied as bytes, under the GIL: a
        NumPy copy would release it, and in a busy process wait for it again (``benchmarks/gil_handoffs.py``)."""
        upto = min(self.dirty, batch)
        for host, value in zip(self.host_in, values):
            value = np.ascontiguousarray(value, dtype=host.dtype)
            if value.shape != (rows, *host.shape[1:]):
                raise ValueError(f"a step input of shape {value.shape} for {rows} rows of {host.shape[1:]}")
            row = host[0].nbytes
            buffer = byte_view(host)
            buffer[:rows * row] = byte_view(value)
            if rows < upto:
                buffer[rows * row:upto * row] = bytes((upto - rows) * row)
        self.dirty = self.dirty if self.dirty > batch else rows


class _Captured:
    """One call of ``fn`` at one fixed shape as a CUDA graph that copies its inputs in from pinned host buffers
    (:class:`_Mirrors`) and its outputs out to them: a call is the host's writes into the buffers, one replay and one
    wait. (Copied one by one, a call's six inputs and two outputs each released the GIL and took it back: in a busy
    process each take-back waits for another thread.)"""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], example: list[torch.Tensor], pool: Any,
                 mirrors: Callable[[list[torch.Tensor], tuple[torch.Tensor, ...]], _Mirrors]) -> None:
        """``mirrors(inputs, outputs)``: the shape's host buffers (made on its first capture)."""
        # The example tensors themselves become the graph's input buffers: a clone would drop dynamo's dynamic/static
        # marks on them (then B = 2 compiles static, and the next batch size compiles again).
        self.inputs = list(example)
        self.batch = example[0].shape[0]
        # A replay runs on the calling thread's current stream of the graph's device (replay() enters that device);
        # the thread's own current device may be another GPU's, so the waits below name the device.
        self.device = example[0].device
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a few runs before capture (inductor's autotuning, cuDNN's plans)
            for _ in range(2):
                outputs = fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.mirrors = mirrors(self.inputs, outputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            for buffer, host in zip(self.inputs, self.mirrors.inputs):
                buffer.copy_(host[:self.batch], non_blocking=True)
            for host, out in zip(self.mirrors.outputs, fn(*self.inputs)):
                host[:self.batch].copy_(out, non_blocking=True)

    def run(self, values: list[np.ndarray], rows: int) -> list[np.ndarray]:
        """The first ``rows`` rows of the outputs (copies, made under the GIL: the buffers are the next call's) for
        ``values`` of ``rows`` rows each."""
        self.mirrors.write(values, rows, self.batch)
        self.launch().synchronize()
        return self.collect(rows)

    def launch(self) -> torch.cuda.Event:
        """Replay over what the buffers hold (written by the caller); the event that this replay's work is done (a
        wait on it does not wait for work launched after it)."""
        self.graph.replay()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def collect(self, rows: int) -> list[np.ndarray]:
        """The first ``rows`` rows of the outputs the last replay wrote, copied (the buffers are the next call's)."""
        return [copy_rows(out, rows) for out in self.mirrors.host_out]


class _CacheRows:
    """One kind of per-stream caches (the generator's or the F0 step's) on the device: a row of one tensor
    ``[rows, R]`` per slot (row 0 scratch), read as named caches before a step and written back after it.

    ``layout``: how each ``[C, T]`` cache lies in its row: ``"channels-first"`` (C-major, the manifest's order) or
    ``"channels-last"`` (T-major: read, a cache is a ``[B, C, T]`` view with the channels innermost, as the
    channels-last convolutions' activations are, so the step's concatenations of cache and input read both along the
    channels instead of transposing the cache. Measured on the H200: those concatenations, fused with Snake, took
    18.4 ms of the tf32 channels-last step at B = 256 with time-major rows, 20.3 without, 10.7 channels-first; the
    rows' order was not what slowed them)."""

    def __init__(self, specs: tuple[Any, ...], rows: int, dtype: torch.dtype, device: torch.device,
                 layout: str = "channels-first") -> None:
        self.names = [spec.name for spec in specs]
        self.shapes = [tuple(spec.shape) for spec in specs]
        if layout == "channels-last" and any(len(shape) != 2 for shape in self.shapes):
            raise ValueError(f"channels-last cache rows need [C, T] caches, got shapes {self.shapes}")
        self.layout = layout
        self.sizes = [int(np.prod(spec.shape)) for spec in specs]
        self.slots = SlotRows(rows, "slots=...")
        self.pool = torch.zeros(rows, sum(self.sizes), dtype=dtype, device=device)

    def read(self, slots: torch.Tensor, first: torch.Tensor) -> dict[str, torch.Tensor]:
        """The slots' caches, each ``[B, C, T]``; zeros where ``first`` (a stream's start) instead of the row."""
        rows = self.pool.index_select(0, slots)
        rows = torch.where(first, torch.zeros((), dtype=rows.dtype, device=rows.device), rows)
        parts = torch.split(rows, self.sizes, dim=1)
        if self.layout == "channels-last":
            return {name: part.reshape(-1, shape[1], shape[0]).transpose(1, 2)
                    for name, shape, part in zip(self.names, self.shapes, parts)}
        return {name: part.reshape(-1, *shape) for name, shape, part in zip(self.names, self.shapes, parts)}

    def write(self, slots: torch.Tensor, caches: dict[str, torch.Tensor]) -> None:
        """``caches`` (as :meth:`read` gives them, any float dtype) into the slots' rows."""
        batch = slots.shape[0]
        if self.layout == "channels-last":
            pieces = [caches[name].transpose(1, 2).reshape(batch, -1) for name in self.names]
        else:
            pieces = [caches[name].reshape(batch, -1) for name in self.names]
        self.pool.index_copy_(0, slots, torch.cat([piece.to(self.pool.dtype) for piece in pieces], dim=1))


class _ChoosingThreads:
    """Threads that choose cuDNN's convolution algorithms for a warmup's generator and final shapes, each for its
    share, and then capture the shapes it chose for. Torch keeps cuDNN's choices per thread (``thread_local
    BenchmarkCache`` in ATen's ``Conv_v8.cpp``): a capture finds them only in the thread that made them, so the
    choosing can run beside the rest of a start and the captures still find it done. Measured on the H200 (fp16, 55
    shapes; BENCHMARKS.md, "cuDNN's choices in threads"): a first start chooses while its workers compile, and its
    captures took 7.3 s against ~100 s; in a warm start the choosing runs beside the graphs' loads (153 s against 198 s
    with one thread, one host), though cuDNN's choosing itself barely runs side by side (eight threads 96 s, one
    ~106-130 s) and the threads' Python slows the loads. The process-wide switches (TF32, cuDNN's benchmark) are the
    warmup's, held by its thread for all of it; what is per thread (the device, inference mode, a stream) each call
    here enters itself. The F0 step (GEMMs, no cuDNN) runs in the calling thread."""

    def __init__(self, device: torch.device, shapes: list[tuple[str, int, int]], threads: int) -> None:
        # Largest first, dealt round: each thread a like share of the large shapes (their choosing is the longest).
        heavy = sorted((s for s in shapes if s[0] != "f0"), key=lambda s: -s[1] * s[2])
        count = max(1, min(threads, len(heavy)))
        self.owner = {shape: i % count for i, shape in enumerate(heavy)}
        self.groups = [heavy[i::count] for i in range(count)] if heavy else []
        self._device = device
        self._pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"hift-cudnn-{i}")
                       for i in range(len(self.groups))]
        # A stream each: cuDNN times its candidates with events on the current stream, which the threads would
        # otherwise share (the legacy default stream), each timing the others' kernels too.
        self._streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in self._pools]

    def _within(self, thread: int, fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            stream = self._streams[thread]
            if stream is not None:
                torch.cuda.set_device(self._device)  # (per thread in CUDA: a new thread starts on device 0)
                stream.wait_stream(torch.cuda.default_stream(self._device))  # the engine's tensors, made there
            with torch.inference_mode(), torch.cuda.stream(stream):  # (None: no stream, on the CPU)
                return fn()
        return call

    def choose(self, choose_for: Callable[[list[tuple[str, int, int]]], None]) -> list[concurrent.futures.Future]:
        """``choose_for(group)`` started in each thread on its share."""
        return [pool.submit(self._within(i, functools.partial(choose_for, group)))
                for i, (pool, group) in enumerate(zip(self._pools, self.groups))]

    def run(self, shape: tuple[str, int, int], fn: Callable[[], Any]) -> Any:
        """``fn()`` in the thread that chose for ``shape`` (the calling thread for a shape none chose for)."""
        if shape not in self.owner:
            return fn()
        thread = self.owner[shape]
        return self._pools[thread].submit(self._within(thread, fn)).result()

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)


class CompiledBackend:
    """A :class:`~hift_runtime.streaming.VocoderBackend` over the compiled step (see the module docstring).

    ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. ``compile``: compile with ``torch.compile`` (default: on CUDA);
    ``cuda_graphs``: capture at :meth:`warmup` (CUDA only). ``slots``: device cache rows (one per open stream).
    ``conv_layout``: ``"channels-first"`` or ``"channels-last"`` (:data:`CONV_LAYOUTS`); None: the precision's
    measured best (:data:`DEFAULT_CONV_LAYOUT`). ``cache_layout``: how the generator's cache rows lie on the device
    (``"channels-last"``: each cache time-major, for channels-last convolutions; on the H200 0.6 % off the fp16 step
    and 2.3 % off tf32 channels-last at B = 256, none at B = 2: off by default). ``compile_processes``: a first :meth:`warmup` (no marker of a warm
    cache, :mod:`~hift_torch.compile_workers`) compiles its step graphs in this many processes side by side (1: in
    turn, in this process). ``short_step_batch_sizes``: the batch sizes captured for the shorter step sizes and the
    final step (those of ``batch_sizes`` in it, and the largest; None, the default: all of ``batch_sizes``;
    :data:`~hift_runtime.sessions.SHORT_STEP_BATCH_SIZES` is measured there). ``final_window``: the final step as
    one graph over a window of :attr:`final_window_frames` (the largest step size plus the mel look-ahead), each row's
    end an input, instead of a graph of the look-ahead's 4 frames after generator steps (None, the default: on where
    CUDA graphs are captured). ``step_window``: likewise the stream step, one graph of the largest step size for
    every step up to it (each row's frames an input): no graphs of the shorter sizes, a push's generator work one
    call per 24 frames (None, the default: the precision's, :data:`~hift_runtime.sessions.DEFAULT_STEP_WINDOW`, where
    CUDA graphs are captured: on in fp32, a warm start of 36 s against 81 s on the H200 at the same device time per
    row; off in fp16, where its step cost 13-20 % more device time per row and carried fewer streams near the
    device's capacity, and in tf32; BENCHMARKS.md).
    ``cudnn_threads``: the threads that choose cuDNN's convolution algorithms at :meth:`warmup`, side by side, and
    capture the shapes they chose for (:class:`_ChoosingThreads`; None: :func:`cudnn_threads_for_memory`, at most
    :func:`~hift_runtime.sessions.cudnn_threads_at_most`: one for cuDNN's benchmark in fp32 and tf32).
    ``cudnn_algorithms``: how cuDNN chooses them, ``"benchmark"`` or ``"heuristics"`` (its heuristic mode B;
    :data:`CUDNN_ALGORITHMS`; None: the precision's default, :data:`DEFAULT_CUDNN_ALGORITHMS`).
    ``warmup_switch_interval_s``: Python's GIL switch interval at most this while :meth:`warmup` runs, the process's
    own restored after (None: left as it is; :func:`~hift_runtime.process_tuning.switch_interval_at_most`).
    ``call_lanes``: 2 captures every shape twice, each copy with its own pinned buffers, so that two batched calls
    run at once (the scheduler's device thread and one more): one's host part (rows written into its buffers, outputs
    copied out) runs while the other's graph replays, their replays one after the other on the device. Over CUDA
    graphs only (elsewhere 1). Measured under load on the H200, a call's host part was 26-32 % of it (fp16), and
    the device waited through it (BENCHMARKS.md, "fp16 on the GPU at another slot count"). With two lanes fp16 kept
    3 328 streams in 2 of 3 runs (one lane: 3 072 in 2 of 2, 3 328 in none), at ~1.7 GB more device memory, 3-4 s
    more captures and a higher p95 below capacity (BENCHMARKS.md, "Two call lanes"); 1, the default: one call at a
    time.
    """

    caches_in_place = True
    f0_caches_in_place = True
    calls_from_any_thread = True  # its calls hold its own lock (PushScheduler.inline_lone_calls)
    takes_noise_positions = True

    def __init__(self, manifest: Manifest, constants: StreamConstants, device: str = "cuda",
                 precision: str = DEFAULT_PRECISION, compile: bool | None = None, cuda_graphs: bool = True,
                 step_sizes: tuple[int, ...] | None = STEP_SIZES, batch_sizes: tuple[int, ...] = BATCH_SIZES,
                 slots: int = 2048, conv_layout: str | None = None, compile_processes: int = 5,
                 cache_layout: str = "channels-first",
                 short_step_batch_sizes: tuple[int, ...] | None = None, final_window: bool | None = None,
                 step_window: bool | None = None, cudnn_threads: int | None = None,
                 cudnn_algorithms: str | None = None,
                 warmup_switch_interval_s: float | None = HANDOFF_SWITCH_INTERVAL_S, call_lanes: int = 1) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        conv_layout = DEFAULT_CONV_LAYOUT[precision] if conv_layout is None else conv_layout
        if conv_layout not in CONV_LAYOUTS:
            raise ValueError(f"conv_layout must be one of {CONV_LAYOUTS} (or None: the precision's default), "
                             f"got {conv_layout!r}")
        if cache_layout not in CONV_LAYOUTS:
            raise ValueError(f"cache_layout must be one of {CONV_LAYOUTS}, got {cache_layout!r}")
        if cudnn_threads is not None and cudnn_threads < 1:
            raise ValueError(f"cudnn_threads must be at least 1 (the threads that choose cuDNN's algorithms at "
                             f"warmup), got {cudnn_threads}")
        if warmup_switch_interval_s is not None and not warmup_switch_interval_s > 0:
            raise ValueError(f"warmup_switch_interval_s must be a positive number of seconds (or None: the process's "
                             f"own), got {warmup_switch_interval_s!r}")
        if call_lanes not in CALL_LANES:
            raise ValueError(f"call_lanes must be one of {CALL_LANES} (calls at once on the device's captured graphs), "
                             f"got {call_lanes!r}")
        cudnn_algorithms = DEFAULT_CUDNN_ALGORITHMS[precision] if cudnn_algorithms is None else cudnn_algorithms
        if cudnn_algorithms not in CUDNN_ALGORITHMS:
            raise ValueError(f"cudnn_algorithms must be one of {CUDNN_ALGORITHMS} (or None: the precision's default), "
                             f"got {cudnn_algorithms!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ArtifactError("the compiled engine was asked for CUDA, but torch sees no CUDA device (a CPU build "
                                "of torch, or no GPU); use engine='ort' or device='cpu'")
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current device, named (threads
            self.device = torch.device("cuda", torch.cuda.current_device())  # at warmup set it, and need its index)
        if precision != "fp32" and self.device.type != "cuda":
            raise ValueError(f"precision {precision!r} is for CUDA devices; the CPU runs fp32")
        self.manifest, self.constants, self.precision, self.conv_layout = manifest, constants, precision, conv_layout
        self.cache_layout = cache_layout
        self.compile_processes = compile_processes
        self.cudnn_threads = cudnn_threads
        self.cudnn_algorithms = cudnn_algorithms
        self.warmup_switch_interval_s = warmup_switch_interval_s
        self.on_cuda = self.device.type == "cuda"
        # (before the engine's first convolution: torch reads it once)
        self.heuristic_mode_b = self.on_cuda and cudnn_algorithms == "heuristics" and use_heuristic_mode_b()
        self.compiled = self.on_cuda if compile is None else compile
        self.cuda_graphs = cuda_graphs and self.on_cuda
        # A call is a graph replay and its wait (0.2-2 ms): short enough for a quiet lone push's calls to be made in
        # the scheduling thread (PushScheduler.inline_lone_calls); an eager call on the CPU is not.
        self.inline_lone_calls_by_default = self.cuda_graphs
        self.call_lanes = call_lanes if self.cuda_graphs else 1  # (eager calls take the lock: one at a time)
        self.step_sizes = step_sizes if self.on_cuda else None
        # The final step's window (streaming.py: a stream's last push is then two calls): the largest step plus the
        # look-ahead, so any remainder is steps of the largest size and one final call.
        window = self.cuda_graphs and bool(step_sizes) if final_window is None else final_window
        self.final_window_frames: int | None = (max(step_sizes or STEP_SIZES) + constants.mel_look_ahead
                                                if window else None)
        step_window = (self.cuda_graphs and bool(step_sizes) and DEFAULT_STEP_WINDOW[precision]
                       if step_window is None else step_window)
        self.step_window_frames: int | None = max(step_sizes or STEP_SIZES) if step_window else None
        self.f0_step_sizes = F0_STEP_SIZES if self.on_cuda and step_sizes else None
        ladder = set(batch_sizes) | set(BATCH_SIZES)  # (sizes above the scheduler's max_batch are dropped below)
        if short_step_batch_sizes is not None and not set(short_step_batch_sizes) <= ladder:
            raise ValueError(f"short_step_batch_sizes {tuple(short_step_batch_sizes)} must be among the batch sizes "
                             f"the engine captures, {tuple(sorted(ladder))} (or None: all of them)")
        self.batch_sizes = tuple(sorted(set(batch_sizes))) if self.on_cuda else (1,)
        short = self.batch_sizes if short_step_batch_sizes is None else short_step_batch_sizes
        self.short_step_batch_sizes = tuple(sorted({b for b in self.batch_sizes if b in short} |
                                                   {self.batch_sizes[-1]}))
        # Each captured step shape's batch sizes ((kind, frames) -> ladder), set by warmup.
        self._ladders: dict[tuple[str, int], tuple[int, ...]] = {}
        self.name = f"compiled[{self.device.type}:{precision}]" if self.compiled else f"torch[{self.device.type}]"
        self.generator, self.predictor = load_folded(manifest, self.device)
        if conv_layout == "channels-last":
            from hift_model.layers import store_channels_last

            store_channels_last(self.generator)
        self._trunk_dtype = torch.float16 if precision == "fp16" else None
        self._generator_rows = _CacheRows(constants.generator_caches, slots + 1, torch.float32, self.device,
                                          cache_layout)
        self._f0_rows = _CacheRows(constants.f0_caches, slots + 1, next(self.predictor.parameters()).dtype,
                                   self.device)
        # F0 rows handed out and not written yet: their first F0 step reads zeros. (Added to by the thread opening a
        # stream, read and emptied by the one calling the device; a set's add and discard are atomic.)
        self._f0_fresh: set[int] = set()
        self._table: torch.Tensor | None = None
        # One eager call, or one replay's launch, at a time (a replay's wait outside it where there are two lanes).
        self._lock = threading.Lock()
        self._graphs: dict[tuple[str, int, int], _Captured] = {}
        # Lane k's captured graphs (lane 0's are _graphs), each lane with its own pinned buffers; the free lanes.
        self._lane_graphs: list[dict[tuple[str, int, int], _Captured]] = [self._graphs] + [
            {} for _ in range(self.call_lanes - 1)]
        self._free_lanes: queue.SimpleQueue[int] = queue.SimpleQueue()
        for lane in range(self.call_lanes):
            self._free_lanes.put(lane)
        self._mirrors: dict[tuple[str, int, int], _Mirrors] = {}  # (kind, frames, lane) -> its pinned host buffers
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        # Compiled forms are called only at warmup, on the shapes it captures; every other shape (a final step
        # shorter than the look-ahead, an offline pass) runs the same code eagerly: nothing compiles after warmup.
        self._compiled = {"generator": self._step, "final": self._final, "f0": self._f0}
        if self.compiled:
            import torch._dynamo as dynamo

            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
            # Not dynamic=False: it ignores mark_dynamic and compiles every batch size anew (on the H200 the warmup
            # then ran past 5 minutes). Warmup marks the batch dynamic and every other dimension static.
            # Channels-last as measured: inductor's layout optimization forced (it keeps the activations NHWC between
            # the convolutions; left to its heuristics, it decides per graph).
            options = {"force_layout_optimization": True} if conv_layout == "channels-last" else None
            self._compiled["generator"] = functools.partial(self._with_source, torch.compile(self._rest,
                                                                                             options=options))
            self._compiled["final"] = functools.partial(self._with_source, torch.compile(self._final_rest,
                                                                                         options=options))
            # The cache pool's rows dynamic too: the compiled graphs read and write it, and with its rows static each
            # slot count was a graph of its own (on the H200 a warm cache compiled all five anew for 3 100 slots
            # where it had 2 048: BENCHMARKS.md, "fp16's start under mode B"). Dynamic, inductor's cache serves any
            # slot count (benchmarks/slots_cache.py).
            dynamo.maybe_mark_dynamic(self._generator_rows.pool, 0)
        self.compiles_at_warmup: int | None = None
        self.warmup_seconds: dict[str, float] = {}  # "kind:frames x batch" -> seconds of its capture
        self.first_call_seconds: dict[str, float] = {}  # "kind:frames" -> seconds of its compile or its load

    # ---- the functions compiled (pure tensor code) -----------------------------------------------------------------
    def _noise(self, start: torch.Tensor, frames: int) -> torch.Tensor:
        assert self._table is not None
        samples = frames * self.constants.samples_per_frame
        index = (start + torch.arange(samples, device=start.device)) % self._table.shape[0]
        return self._table[index]

    def _source(self, f0: torch.Tensor, start: torch.Tensor, phase_in: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The excitation, always eager (captured in the CUDA graphs all the same): its phase is a float32 sine of
        arguments up to ~1e7 radians, where one ulp of the argument is about a radian, so it must round as eager code
        does. Compiled with the rest (Triton's approximate division, folded constants), the fp32 step was 84 dB from
        the CPU on 3 s streams and 66 dB on a 20 s stream (the error grew with the phase)."""
        return self.generator.m_source(f0, self._noise(start, f0.shape[1]), phase_in)

    def _after_source(self, final: bool, mel: torch.Tensor, source: torch.Tensor, cum: torch.Tensor,
                      phase_in: torch.Tensor, first: torch.Tensor, slots: torch.Tensor,
                      frames: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step after its source (what is compiled): reads the slots' cache rows; a stream step writes them
        back (the final step leaves them: the stream ends). ``frames``: a step in a window, each row's frames."""
        from hift_model.step import generator_step

        caches = self._generator_rows.read(slots, first)
        audio, phase, new = generator_step(self.generator, mel, None, None, phase_in, first, caches, final,
                                           self._trunk_dtype, source=(source, cum), frames=frames)
        if not final:
            self._generator_rows.write(slots, new)
        return audio, phase

    def _rest(self, mel: torch.Tensor, source: torch.Tensor, cum: torch.Tensor, phase_in: torch.Tensor,
              first: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._after_source(False, mel, source, cum, phase_in, first, slots, frames)

    def _final_rest(self, mel: torch.Tensor, source: torch.Tensor, cum: torch.Tensor, phase_in: torch.Tensor,
                    first: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._after_source(True, mel, source, cum, phase_in, first, slots, frames)

    def _step(self, mel: torch.Tensor, f0: torch.Tensor, start: torch.Tensor, phase_in: torch.Tensor,
              first: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rest(mel, *self._source(f0, start, phase_in), phase_in, first, slots, frames)

    def _final(self, mel: torch.Tensor, f0: torch.Tensor, start: torch.Tensor, phase_in: torch.Tensor,
               first: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._final_rest(mel, *self._source(f0, start, phase_in), phase_in, first, slots, frames)

    def _with_source(self, rest: Callable[..., tuple[torch.Tensor, torch.Tensor]], mel: torch.Tensor,
                     f0: torch.Tensor, start: torch.Tensor, phase_in: torch.Tensor, first: torch.Tensor,
                     slots: torch.Tensor, *frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager source, then the compiled ``rest`` (run at warmup, when the CUDA graphs are captured)."""
        source, cum = self._source(f0, start, phase_in)
        args = [mel, source, cum, phase_in, first, slots, *frames]
        _mark_batch_dynamic(args)  # the source's outputs are new tensors: marked as the step's inputs are
        return rest(*args)

    def _f0(self, mel: torch.Tensor, first: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor]:
        """The F0 step reading its caches from the slots' F0 rows (zeros for a fresh row) and writing them back."""
        from hift_model.step import f0_step

        f0, nxt = f0_step(self.predictor, mel, self._f0_rows.read(slots, first), one_gemm=True)
        self._f0_rows.write(slots, nxt)
        return (f0,)

    # ---- the backend protocol ----------------------------------------------------------------------------------------
    def use_noise_table(self, noise: NoiseTable) -> None:
        """Put the whole noise table on the device (259 MB for CosyVoice3's 300 s): steps gather their rows there."""
        table = noise.rows(0, noise.length)
        self._table = torch.from_numpy(table).to(self.device)

    @property
    def slots_in_use(self) -> int:
        """Streams holding device rows (generator or F0: each open stream holds one of each)."""
        return max(self._generator_rows.slots.in_use, self._f0_rows.slots.in_use)

    @property
    def cache_slots(self) -> int:
        """Device cache rows for streams (the constructor's ``slots``; row 0 is scratch)."""
        return self._generator_rows.slots.rows - 1

    def stream_capacity(self) -> int:
        return max(1, self.cache_slots - OFFLINE_SLOTS)

    def new_caches(self, kind: str, batch: int = 1) -> Any:
        if batch != 1:
            raise ValueError("device slots are taken one stream at a time")
        if kind == "generator":
            return self._generator_rows.slots.acquire()
        slot = self._f0_rows.slots.acquire()
        self._f0_fresh.add(slot.index)
        return slot

    @contextlib.contextmanager
    def _precision(self) -> Iterator[None]:
        """The precision's TF32 switches around a call (they are process-wide in torch; fp32 turns them off)."""
        tf32 = self.precision == "tf32"
        matmul = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            # benchmark: cuDNN times its algorithms per shape at warmup (before each capture); off, its heuristics
            # choose (mode B; DEFAULT_CUDNN_ALGORITHMS says what was measured).
            benchmark = self.on_cuda and self.cudnn_algorithms == "benchmark"
            with torch.backends.cudnn.flags(enabled=True, benchmark=benchmark, allow_tf32=tf32), \
                    torch.inference_mode():
                yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = matmul

    def _batch(self, rows: int, kind: str, size: int) -> int:
        """The captured batch size a call of ``rows`` streams of step ``kind`` x ``size`` runs at (padded)."""
        return next((b for b in self._ladders.get((kind, size), self.batch_sizes) if b >= rows), rows)


    def f0_step(self, mel: np.ndarray, caches: Any) -> tuple[np.ndarray, Any]:
        slots = caches if isinstance(caches, list) else [caches]
        rows = mel.shape[0]
        fresh = self._f0_fresh
        values = [mel, np.array([[s.index in fresh] for s in slots]), np.array([s.index for s in slots], np.int64)]
        size = mel.shape[2] - self.constants.f0_look_ahead
        key = ("f0", size, self._batch(rows, "f0", size))
        if key in self._graphs:
            out = self._replay(key, values, rows)
        else:
            with self._lock, self._precision():
                out = [t.cpu().numpy() for t in self._f0(*(torch.from_numpy(v).to(self.device) for v in values))]
        fresh.difference_update(s.index for s in slots)  # written now
        return out[0], caches  # the next caches are in the same slots

    def generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                       first: np.ndarray, caches: Any, final: bool, frames: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray, Any]:
        if self._table is None:
            raise RuntimeError("the compiled engine has no noise table: it is set by StreamingVocoder "
                               "(use_noise_table)")
        slots = caches if isinstance(caches, list) else [caches]
        rows = mel.shape[0]
        values = [mel, f0, noise.reshape(rows, 1).astype(np.int64, copy=False), phase_in, first,
                  np.array([s.index for s in slots], np.int64)]
        if frames is not None:  # a step in a window: each row's frames
            values.append(frames.reshape(rows).astype(np.int64, copy=False))
        size = f0.shape[1] - (0 if final else self.constants.source_look_ahead)
        kind = "final" if final else "generator"
        key = (kind, size, self._batch(rows, kind, size))
        if key in self._graphs:
            audio, phase = self._replay(key, values, rows)
        else:
            with self._lock, self._precision():
                fn = self._final if final else self._step
                audio, phase = (t.cpu().numpy() for t in fn(*(torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
                                                               for v in values)))
        return audio, phase, (None if final else caches)  # the next caches are in the same slots

    def _replay(self, key: tuple[str, int, int], values: list[np.ndarray], rows: int) -> list[np.ndarray]:
        """A call of a captured shape: its graph's outputs' first ``rows`` rows for ``values``. With one lane, the
        whole call under the lock. With two (:attr:`call_lanes`), a free lane's buffers are written outside the lock,
        only the replay's launch is made under it, and the wait is for this replay alone: the other lane's call
        writes its buffers, or copies its outputs out, while this one runs on the device. (A vocoder stream is in one
        call at a time, so no cache row is read by one call and written by the other; both may pad on the scratch
        row.)"""
        if self.call_lanes == 1:
            with self._lock:
                return self._graphs[key].run(values, rows)
        lane = self._free_lanes.get()
        try:
            graph = self._lane_graphs[lane][key]
            graph.mirrors.write(values, rows, graph.batch)
            with self._lock:
                done = graph.launch()
            done.synchronize()
            return graph.collect(rows)
        finally:
            self._free_lanes.put(lane)

    # ---- warmup: compile and capture every shape a stream meets ------------------------------------------------------
    def warmup(self, step_sizes: tuple[int, ...] | None, progress: Callable[[str], None] | None = None) -> None:
        """Compile and capture (CUDA) every shape of :meth:`_capture_plan`. A no-op on the CPU without compile.

        Three things at once, then the captures: :attr:`cudnn_threads` threads run the eager step at every generator
        and final shape, so that cuDNN chooses each convolution's algorithm (by its benchmark or its heuristic mode B:
        :attr:`cudnn_algorithms`; :class:`_ChoosingThreads`); a first start's workers compile the step graphs side
        by side (:mod:`~hift_torch.compile_workers`); and this thread makes each graph's first call (dynamo's load
        of the compile from inductor's cache, or the compile itself), a worker's graph as soon as it is done. Then
        each shape is captured, a generator or final shape in the thread that chose its algorithms (the compiled
        graphs' convolutions are the same cuDNN calls, so they find the choices made), one at a time. All of it under
        a short GIL switch interval (:attr:`warmup_switch_interval_s`): the choosing threads' eager ops each release
        the GIL, and beside the first calls' tracing would wait up to Python's default 5 ms to get it back."""
        if not self.on_cuda or not step_sizes:
            return
        from .compile_workers import compile_units, precompile

        say = progress or (lambda msg: log.info("hift_runtime: %s", msg))
        started = time.perf_counter()
        marker = None
        shapes = self._capture_plan(step_sizes)
        count = self.cudnn_threads
        if count is None:
            at_most = cudnn_threads_at_most(self.precision, self.cudnn_algorithms)
            count = (cudnn_threads_for_memory(torch.cuda.mem_get_info(self.device)[0], at_most)
                     if self.device.type == "cuda" else 1)
        threads = _ChoosingThreads(self.device, shapes if self.cuda_graphs else [], count)
        # (closed, its threads joined, before the switches and the interval they run under are restored)
        with self._lock, self._precision(), switch_interval_at_most(self.warmup_switch_interval_s), \
                contextlib.closing(threads):
            choosing = threads.choose(self._choose_for)
            if threads.groups:
                say(f"warmup: choosing cuDNN's algorithms ({self.cudnn_choice()}) for {len(threads.owner)} step "
                    f"shapes in {len(threads.groups)} threads; the step graphs are loaded (or compiled) meanwhile")

            def first_call(kind: str, size: int) -> None:
                if f"{kind}:{size}" in self.first_call_seconds:
                    return
                seconds = self.compile_shape(kind, size)
                self.first_call_seconds[f"{kind}:{size}"] = round(seconds, 3)
                say(f"warmup: {kind}:{size} ready ({seconds:.0f} s; {time.perf_counter() - started:.0f} s since the "
                    f"start)")

            if self.compiled and self.compile_processes > 1:
                marker = precompile(self, step_sizes, say, when_compiled=first_call)
            for kind, size in compile_units(self.generator_graph_sizes(step_sizes), self.final_frames):
                first_call(kind, size)
            self._await_choices(choosing, threads, started, say)
            for i, (kind, size, batch) in enumerate(shapes):
                if (kind, size, batch) in self._graphs:
                    continue
                shape_started = time.perf_counter()
                fn = self._compiled[kind]
                if self.cuda_graphs:
                    for lane in reversed(range(self.call_lanes)):  # lane 0's last: its presence says "captured"
                        self._lane_graphs[lane][(kind, size, batch)] = threads.run(
                            (kind, size, batch), lambda lane=lane: _Captured(
                                fn, self._example(kind, size, batch), self._graph_pool,
                                functools.partial(self._mirrors_of, kind, size, lane)))
                else:
                    threads.run((kind, size, batch), lambda: fn(*self._example(kind, size, batch)))
                self.warmup_seconds[f"{kind}:{size}x{batch}"] = round(time.perf_counter() - shape_started, 3)
                if kind != "f0" and (batch == self.batch_sizes[0] or i == len(shapes) - 1):
                    say(f"warmup: {i + 1}/{len(shapes)} step shapes captured ({time.perf_counter() - started:.0f} s)")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.compiles_at_warmup = compile_count()
        if marker is not None:
            try:
                marker.touch()  # its folder made by precompile (where it could not be, this fails too)
            except OSError as exc:  # a read-only cache: every start compiles side by side again
                say(f"warmup: cannot mark inductor's cache as warm ({exc})")
        say(warmup_summary(self.warmup_seconds, self.first_call_seconds))

    def _choose_for(self, shapes: list[tuple[str, int, int]]) -> None:
        """The eager step once at each of ``shapes`` (generator and final steps), so that cuDNN chooses each
        convolution's algorithm in this thread (one of :class:`_ChoosingThreads`). Measured on the H200 (fp16,
        one thread): the captures after such a pass 57.3 s against 160.5 s without it, the graphs as fast
        (``benchmarks/cudnn_benchmark_limit.py``)."""
        eager = {"generator": self._step, "final": self._final}
        for kind, size, batch in shapes:
            eager[kind](*self._zeros(kind, size, batch))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # this thread's stream (see compile_shape)

    def cudnn_choice(self) -> str:
        """How cuDNN chooses the convolutions' algorithms here, in words (the warmup says it)."""
        if self.cudnn_algorithms == "benchmark":
            return "its benchmark"
        value = os.environ.get(HEURISTIC_MODE_B_ENV, "")
        if heuristic_mode_b_asked(value):
            return "its heuristic mode B"
        return f"its instant heuristics: {HEURISTIC_MODE_B_ENV}={value!r}"

    def _await_choices(self, choosing: list[concurrent.futures.Future], threads: _ChoosingThreads, started: float,
                       say: Callable[[str], None]) -> None:
        """Wait for the choosing threads; one that failed (out of memory, say) is said: its shapes' captures then
        choose their algorithms themselves, as they would without it."""
        failed = []
        for future, group in zip(choosing, threads.groups):
            exc = future.exception()
            if exc is not None:
                failed.append(f"{len(group)} shapes ({type(exc).__name__}: {exc})")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the eager activations' blocks: the captures allocate from their own pool
        if failed:
            say(f"warmup: cuDNN's algorithms not chosen beforehand for {'; '.join(failed)}; their captures choose them")
        elif threads.groups:
            say(f"warmup: cuDNN's algorithms chosen for {len(threads.owner)} step shapes in {len(threads.groups)} "
                f"threads ({time.perf_counter() - started:.0f} s since the start)")

    def _capture_plan(self, step_sizes: tuple[int, ...]) -> list[tuple[str, int, int]]:
        """Every ``(kind, frames, batch)`` :meth:`warmup` captures, compiles first (the smallest batch of each
        step); sets each step shape's batch sizes (what :meth:`_batch` pads a call to): all of them for the largest
        stream step and the F0 step, ``short_step_batch_sizes`` for the shorter steps and the final step."""
        graphs = self.generator_graph_sizes(step_sizes)
        ladders = {("generator", size): self.short_step_batch_sizes for size in graphs}
        ladders[("generator", max(graphs))] = self.batch_sizes
        ladders[("final", self.final_frames)] = self.short_step_batch_sizes
        ladders.update({("f0", size): self.batch_sizes for size in self.f0_step_sizes or step_sizes})
        self._ladders = ladders
        return [(kind, size, batch) for group in ("generator", "final", "f0") for batch in self.batch_sizes
                for (kind, size), ladder in ladders.items() if kind == group and batch in ladder]

    def generator_graph_sizes(self, step_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The stream step's graphs for ``step_sizes``: the window's alone, or one per size."""
        return (self.step_window_frames,) if self.step_window_frames else tuple(step_sizes)

    @property
    def final_frames(self) -> int:
        """The frames of the final step's graph: the window's, or (without one) the mel look-ahead's."""
        return self.final_window_frames or self.constants.mel_look_ahead

    def compile_shape(self, kind: str, size: int) -> float:
        """Compile the step ``kind`` of ``size`` frames as :meth:`warmup` compiles it (the same inputs, at the
        smallest batch), without capturing: what fills inductor's on-disk cache for a later warmup, or profiles the
        step (``benchmarks/precompile.py``, ``benchmarks/profile_compiled.py``). Seconds."""
        started = time.perf_counter()
        with self._precision():
            self._compiled[kind](*self._example(kind, size, self.batch_sizes[0]))
            if self.device.type == "cuda":
                # The stream, not the device: the choosing threads run meanwhile, and under cuDNN's heuristic mode B
                # something in their convolutions captures a CUDA graph, during which a device-wide synchronize in
                # any thread fails ("operation not permitted when stream is capturing"). Measured on the H200
                # (BENCHMARKS.md, "A race under mode B"): 45 of ~5 650 device-wide synchronizes failed beside mode
                # B's choosing, none of ~11 300 on a stream, none beside the benchmark's.
                torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - started

    def _example(self, kind: str, size: int, batch: int) -> list[torch.Tensor]:
        """:meth:`_zeros`, marked as a compile sees them: the batch dynamic for the generator steps (the F0 step runs
        eagerly)."""
        example = self._zeros(kind, size, batch)
        if kind != "f0":
            _mark_batch_dynamic(example)
        return example

    def _mirrors_of(self, kind: str, size: int, lane: int, inputs: list[torch.Tensor],
                    outputs: tuple[torch.Tensor, ...]) -> _Mirrors:
        """The host buffers shared by one lane's graphs of one step shape (made for the largest batch at its first
        capture)."""
        if (kind, size, lane) not in self._mirrors:
            self._mirrors[(kind, size, lane)] = _Mirrors(inputs, outputs, max(self.batch_sizes))
        return self._mirrors[(kind, size, lane)]

    def _zeros(self, kind: str, size: int, batch: int) -> list[torch.Tensor]:
        """Inputs of a step of ``size`` frames for ``batch`` streams at the utterance start, every row on scratch."""
        c, dev = self.constants, self.device
        if kind == "f0":
            return [torch.zeros(batch, c.in_channels, size + c.f0_look_ahead, device=dev),
                    torch.ones(batch, 1, dtype=torch.bool, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev)]
        final = kind == "final"
        mel, src = (size, size) if final else (size + c.mel_look_ahead, size + c.source_look_ahead)
        windowed = self.final_window_frames if final else self.step_window_frames
        frames = [torch.full((batch,), size, dtype=torch.int64, device=dev)] if windowed else []
        return [torch.zeros(batch, c.in_channels, mel, device=dev), torch.zeros(batch, src, device=dev),
                torch.zeros(batch, 1, dtype=torch.int64, device=dev),
                torch.zeros(batch, c.num_sines, dtype=torch.float64, device=dev),
                torch.ones(batch, 1, dtype=torch.bool, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev),
                *frames]


def warmup_summary(seconds: dict[str, float], first_calls: dict[str, float] | None = None) -> str:
    """Where warmup's time went: the graphs' first calls (compiles or loads), then the captures by kind, by step
    size, by batch size, and the slowest shapes (what to trim)."""
    def by(part: Callable[[str], str]) -> str:
        totals: dict[str, float] = {}
        for shape, s in seconds.items():
            totals[part(shape)] = totals.get(part(shape), 0.0) + s
        return ", ".join(f"{key} {s:.1f}" for key, s in totals.items())

    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:5]
    loads = ""
    if first_calls:
        each = ", ".join(f"{k} {s:.1f}" for k, s in first_calls.items())
        loads = f"first calls {sum(first_calls.values()):.1f} s ({each}); "

    return (f"warmup: {loads}{len(seconds)} shapes captured in {sum(seconds.values()):.1f} s; by kind: "
            f"{by(lambda k: k.split(':')[0])}; by frames: {by(lambda k: k.split(':')[1].split('x')[0])}; by batch: "
            f"{by(lambda k: k.split('x')[1])}; slowest: {', '.join(f'{k} {s:.1f}' for k, s in slowest)}")


def _mark_batch_dynamic(tensors: list[torch.Tensor]) -> None:
    """One compile per step size serves every batch: the batch axis dynamic, every other axis static (a dynamic frame
    axis would recompile at every size threshold of the convolutions)."""
    import torch._dynamo as dynamo

    for tensor in tensors:
        dynamo.maybe_mark_dynamic(tensor, 0)
        for dim in range(1, tensor.dim()):
            dynamo.mark_static(tensor, dim)


def compile_count() -> int:
    """Graphs dynamo has compiled in this process (a compile after warmup shows as a rise)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
