"""The compiled engine: the step (``hift_model.step``) compiled by ``torch.compile`` (inductor: elementwise chains
fused into Triton kernels, cuDNN convolutions), behind the same bookkeeping and scheduler as the ONNX Runtime engine.

* **Weights**: the exporter's folded weights (:mod:`.weights`); the original ``hift.pt`` is never needed.
* **Caches**: every open stream's generator caches in one device tensor and its F0 caches (float64) in another, a row
  of each per stream (row 0 scratch for a batch's padding rows), read and written in place by the steps
  (:class:`~.capture.CacheRows`); only the mel, F0 values, phase and audio cross the bus.
* **Noise**: the noise table lives on the device; each step gathers its rows from the first row's index.
* **CUDA graphs**: :meth:`CompiledBackend.warmup` compiles, runs and captures every shape a stream meets: the stream
  step (at each of :data:`STEP_SIZES`, or in fp32 one window of 24 frames for all of them), the final step (a window
  of the largest step plus the mel look-ahead, 29 frames, 28 in fp32: a stream's last push is one F0 call and one
  final call) and the F0 step (every size up to one step's F0, 26 frames, 25 in fp32, and past it), each at every
  batch size; a call is the host's writes into pinned buffers and one replay, launched (``launch_*_step``), then
  one wait, which may come from another thread: the scheduler launches the next call while the device still runs the
  one before. The F0 graphs replay on a CUDA stream of their own, from a memory pool of their own, so a push's F0
  call runs beside the generator call on the device instead of waiting for it (``EngineTraits.f0_lane``).
* **Precision** (``fp32``: TF32 off, parity; ``tf32``; ``fp16``: the convolution trunk in half precision, the source,
  STFT, phase and iSTFT head in float32). The F0 step runs in the export's F0 precision (float64 by default).

On the CPU (no compile) the same code runs eagerly: that is how CI checks the engine's slots, noise gather and
bookkeeping against the ONNX Runtime engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hift_model.layers import store_channels_last
from hift_model.step import f0_step, generator_step
from hift_runtime.contract import StreamConstants
from hift_runtime.engine import EngineTraits, padded_batch
from hift_runtime.manifest import ArtifactError, Manifest
from hift_runtime.noise import NoiseTable
from hift_runtime.options import OFFLINE_SLOTS, PRECISIONS, CompiledOptions
from hift_runtime.process_tuning import HANDOFF_SWITCH_INTERVAL_S, switch_interval_at_most

from .capture import CacheRows, CapturedCall, FinishedCall, HostMirrors, LaunchedCall, LaunchedStep
from .compile_workers import compile_units, compiles_side_by_side, precompile, workers_device_bytes
from .cudnn import (HEURISTIC_MODE_B_ENV, ChoosingThreads, cudnn_threads_for_memory, failed_choices,
                    heuristic_mode_b_asked, use_heuristic_mode_b)
from .weights import load_folded

log = logging.getLogger("hift_runtime")
# Batch sizes captured for cross-stream batching: every 1.5x from 4, since a call pads to the next and costs about in
# proportion to its padded size (CosyVoice3's chunks batch 10-60 streams a call: BENCHMARKS.md, decision log). No
# B = 1: one compile with a dynamic batch serves B >= 2 (dynamo specialises size 1, which would be a compile more); a
# lone stream runs padded to 2.
BATCH_SIZES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Each step size is a compile of its own (a dynamic frame axis recompiles at every size threshold of the
# convolutions anyway), so few: a 24-frame chunk stream meets 24, and 8 + 8 + 4 at its start; CosyVoice3's 100- and
# 200-frame chunks are whole 25-frame steps (4 and 8 calls, where 24-frame steps leave an 8- or 4-frame call more).
STEP_SIZES = (25, 24, 8, 4, 1)
# Dynamo keeps this many compiles of one function before it falls back to eager without a word; ours are counted.
RECOMPILE_LIMIT = 64
# The F0 step's sizes past one step's F0 (the largest step plus its source look-ahead): after a push's first F0 call
# (one step's F0), the rest goes in as few calls as these allow (of CosyVoice3's 100- and 200-frame chunks: 100 less
# one step's F0, and 100 more). At most 100: the F0 step costs about a fifth of the generator's per frame
# (BENCHMARKS.md), so one call holds the device no longer than a 24-frame generator batch of the same streams.
F0_SIZES_PAST_THE_STEP = (38, 50, 100)
# The stream step's window where there is one (fp32): 24-frame chunks in one call each, unpadded.
STEP_WINDOW_FRAMES = 24
# The generator's convolution layout per precision (BENCHMARKS.md, decision log: channels-last is fp16's only).
CONV_LAYOUT = {"fp32": "channels-first", "tf32": "channels-first", "fp16": "channels-last"}
# Where the stream step is one graph over its window (BENCHMARKS.md, decision log: fp32 only).
STEP_WINDOW = {"fp32": True, "tf32": False, "fp16": False}


def cuda_available() -> bool:
    """Whether this torch sees a CUDA device (the engine's ``auto`` choice asks)."""
    return torch.cuda.is_available()


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """The batch sizes captured for a scheduler that batches at most ``max_batch`` streams."""
    return tuple(b for b in BATCH_SIZES if b <= max(max_batch, BATCH_SIZES[0]))


class CompiledBackend:
    """A :class:`~hift_runtime.engine.VocoderBackend` over the compiled step (see the module docstring).

    ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``; ``options``: the deployer's
    :class:`~hift_runtime.options.CompiledOptions`; ``slots``: device cache rows (one per open stream);
    ``batch_sizes``: those captured. The rest is for tests and tools: ``compile`` (default: on CUDA), ``cuda_graphs``,
    ``step_sizes``, and ``final_window`` / ``step_window`` (None: on where CUDA graphs are captured, the stream
    step's window per :data:`STEP_WINDOW`).
    """

    def __init__(self, manifest: Manifest, constants: StreamConstants, device: str = "cuda", precision: str = "fp32",
                 options: CompiledOptions | None = None, slots: int = 2048,
                 batch_sizes: tuple[int, ...] = BATCH_SIZES, *, compile: bool | None = None, cuda_graphs: bool = True,
                 step_sizes: tuple[int, ...] | None = STEP_SIZES, final_window: bool | None = None,
                 step_window: bool | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        options = options or CompiledOptions()
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ArtifactError("the compiled engine was asked for CUDA, but torch sees no CUDA device (a CPU build "
                                "of torch, or no GPU); use engine='ort' or device='cpu'")
        if self.device.type == "cuda" and self.device.index is None:  # the current device, named (warmup's threads
            self.device = torch.device("cuda", torch.cuda.current_device())  # set it, and need its index)
        if precision != "fp32" and self.device.type != "cuda":
            raise ValueError(f"precision {precision!r} is for CUDA devices; the CPU runs fp32")
        self.manifest, self.constants, self.precision = manifest, constants, precision
        self.conv_layout = CONV_LAYOUT[precision]
        self.compile_processes, self.cudnn_threads = options.compile_processes, options.cudnn_threads
        self.on_cuda = self.device.type == "cuda"
        self.heuristic_mode_b = self.on_cuda and use_heuristic_mode_b()  # before the engine's first convolution
        self.compiled = self.on_cuda if compile is None else compile
        self.cuda_graphs = cuda_graphs and self.on_cuda
        self.step_sizes = step_sizes if self.on_cuda else None
        step_window = self.cuda_graphs and bool(step_sizes) and STEP_WINDOW[precision] if step_window is None \
            else step_window
        self.step_window_frames = STEP_WINDOW_FRAMES if step_window else None
        # The largest stream step: the window's, where every stream step is one graph of it.
        largest = self.step_window_frames or max(step_sizes or STEP_SIZES)
        final_window = self.cuda_graphs and bool(step_sizes) if final_window is None else final_window
        self.final_window_frames = largest + constants.mel_look_ahead if final_window else None
        # The F0 step (eager, float64, cheap to capture) at every size up to the largest step plus its source
        # look-ahead, so a step's F0 is one call and an utterance's first step (which reads one frame's F0 beyond it)
        # waits for one F0 call, not two; and at the sizes past it, for the rest of a long push's F0.
        one_step_f0 = largest + constants.source_look_ahead
        past = (*F0_SIZES_PAST_THE_STEP, max(F0_SIZES_PAST_THE_STEP) - one_step_f0)  # a 100-frame chunk: two calls
        self.f0_step_sizes = tuple(sorted({*range(1, one_step_f0 + 1), *past}, reverse=True)) \
            if self.on_cuda and step_sizes else None
        self.batch_sizes = tuple(sorted(set(batch_sizes))) if self.on_cuda else (1,)
        # A call is a graph replay and its wait: short enough for a quiet lone push's calls to be made in the
        # scheduling thread; an eager call on the CPU is not. Every call takes this engine's own lock. A replay is
        # launched and waited for apart (BENCHMARKS.md, decision log: "the scheduler launches each call").
        self.traits = EngineTraits(step_sizes=self.step_sizes, f0_step_sizes=self.f0_step_sizes,
                                   step_window=self.step_window_frames, final_window=self.final_window_frames,
                                   caches_in_place=True, f0_caches_in_place=True, noise_positions=True,
                                   calls_from_any_thread=True, inline_lone_calls=self.cuda_graphs,
                                   launches_ahead=self.cuda_graphs, f0_lane=self.cuda_graphs)
        self.name = f"compiled[{self.device.type}:{precision}]" if self.compiled else f"torch[{self.device.type}]"
        self.generator, self.predictor = load_folded(manifest, self.device)
        if self.conv_layout == "channels-last":
            store_channels_last(self.generator)
        self._trunk_dtype = torch.float16 if precision == "fp16" else None
        self._generator_rows = CacheRows(constants.generator_caches, slots + 1, torch.float32, self.device)
        self._f0_rows = CacheRows(constants.f0_caches, slots + 1, next(self.predictor.parameters()).dtype,
                                  self.device)
        # F0 rows handed out and not written yet: their first F0 step reads zeros. (Added to by the thread opening a
        # stream, read and emptied by the one calling the device; a set's add and discard are atomic.)
        self._f0_fresh: set[int] = set()
        self._table: torch.Tensor | None = None
        self._lock = threading.Lock()  # one eager call, or one replay, at a time
        self._graphs: dict[tuple[str, int, int], CapturedCall] = {}
        self._mirrors: dict[tuple[str, int], HostMirrors] = {}  # (kind, frames) -> its pinned host buffers
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        # The F0 graphs replay on a stream of their own, beside the generator's (``f0_lane``): their own memory pool,
        # since graphs of one pool may share their intermediates' memory and so must never run at once.
        self._f0_graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._f0_stream = torch.cuda.Stream(self.device) if self.cuda_graphs else None
        self._compiled = self._compiled_forms() if self.compiled else {"generator": self._step, "final": self._final,
                                                                       "f0": self._f0}
        self.compiles_at_warmup: int | None = None
        self.warmup_seconds: dict[str, float] = {}  # "kind:frames x batch" -> seconds of its capture
        self.first_call_seconds: dict[str, float] = {}  # "kind:frames" -> seconds of its compile or its load

    def _compiled_forms(self) -> dict[str, Callable[..., tuple[torch.Tensor, ...]]]:
        """The steps as warmup compiles them: the eager source, then the rest under ``torch.compile``; the F0 step
        eager. They are called only at warmup, on the shapes it captures; every other shape (a final step shorter
        than the look-ahead, an offline pass) runs the same code eagerly: nothing compiles after warmup."""
        import torch._dynamo as dynamo

        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
        # Not dynamic=False: it ignores mark_dynamic and compiles every batch size anew. Warmup marks the batch
        # dynamic and every other dimension static. Channels-last keeps the activations NHWC between the
        # convolutions only with inductor's layout optimization forced.
        options = {"force_layout_optimization": True} if self.conv_layout == "channels-last" else None
        # The pool's rows dynamic too, so one compile (and inductor's cache) serves any slot count.
        dynamo.maybe_mark_dynamic(self._generator_rows.pool, 0)
        return {"generator": functools.partial(self._with_source, torch.compile(self._rest, options=options)),
                "final": functools.partial(self._with_source, torch.compile(self._final_rest, options=options)),
                "f0": self._f0}

    # ---- the functions compiled (pure tensor code) -----------------------------------------------------------------
    def _noise(self, start: torch.Tensor, frames: int) -> torch.Tensor:
        assert self._table is not None
        samples = frames * self.constants.samples_per_frame
        index = (start + torch.arange(samples, device=start.device)) % self._table.shape[0]
        return self._table[index]

    def _source(self, f0: torch.Tensor, start: torch.Tensor, phase_in: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The excitation, always eager (captured in the CUDA graphs all the same): its phase is a float32 sine of
        arguments up to ~1e7 radians, where one ulp is about a radian, so it must round as eager code does (compiled,
        the fp32 stream drifted from the CPU as its phase grew)."""
        return self.generator.m_source(f0, self._noise(start, f0.shape[1]), phase_in)

    def _after_source(self, final: bool, mel: torch.Tensor, source: torch.Tensor, cum: torch.Tensor,
                      phase_in: torch.Tensor, first: torch.Tensor, slots: torch.Tensor,
                      frames: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step after its source (what is compiled): reads the slots' cache rows; a stream step writes them
        back (the final step leaves them: the stream ends). ``frames``: a step in a window, each row's frames."""
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
        mark_batch_dynamic(args)  # the source's outputs are new tensors: marked as the step's inputs are
        return rest(*args)

    def _f0(self, mel: torch.Tensor, first: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor]:
        """The F0 step reading its caches from the slots' F0 rows (zeros for a fresh row) and writing them back."""
        f0, nxt = f0_step(self.predictor, mel, self._f0_rows.read(slots, first), one_gemm=True)
        self._f0_rows.write(slots, nxt)
        return (f0,)

    # ---- the backend protocol ----------------------------------------------------------------------------------------
    def use_noise_table(self, noise: NoiseTable) -> None:
        """Put the whole noise table on the device: steps gather their rows there."""
        self._table = torch.from_numpy(noise.rows(0, noise.length)).to(self.device)

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
    def precision_scope(self) -> Iterator[None]:
        """The precision's TF32 switches around a call (they are process-wide in torch; fp32 turns them off); cuDNN's
        benchmark off: its heuristics (mode B) choose."""
        tf32 = self.precision == "tf32"
        matmul = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            with torch.backends.cudnn.flags(enabled=True, benchmark=False, allow_tf32=tf32), torch.inference_mode():
                yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = matmul

    def f0_step(self, mel: np.ndarray, caches: Any) -> tuple[np.ndarray, Any]:
        launched = self.launch_f0_step(mel, caches)
        assert launched is not None
        return launched.result()

    def launch_f0_step(self, mel: np.ndarray, caches: Any, wait: bool = True) -> LaunchedStep | None:
        slots = caches if isinstance(caches, list) else [caches]
        rows = mel.shape[0]
        fresh = self._f0_fresh
        values = [mel, np.array([[s.index in fresh] for s in slots]), np.array([s.index for s in slots], np.int64)]
        size = mel.shape[2] - self.constants.f0_look_ahead
        launched = self._launch("f0", size, values, rows, self._f0, wait)
        if launched is None:
            return None
        fresh.difference_update(s.index for s in slots)  # written by this call, which is ahead of any later one
        return LaunchedStep(launched, lambda out: (out[0], caches))  # the next caches are in the same slots

    def generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                       first: np.ndarray, caches: Any, final: bool, frames: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray, Any]:
        launched = self.launch_generator_step(mel, f0, noise, phase_in, first, caches, final,
                                              *([] if frames is None else [frames]))
        assert launched is not None
        return launched.result()

    def launch_generator_step(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                              first: np.ndarray, caches: Any, final: bool, *frames: np.ndarray,
                              wait: bool = True) -> LaunchedStep | None:
        if self._table is None:
            raise RuntimeError("the compiled engine has no noise table: it is set by StreamingVocoder "
                               "(use_noise_table)")
        slots = caches if isinstance(caches, list) else [caches]
        rows = mel.shape[0]
        values = [mel, f0, noise.reshape(rows, 1).astype(np.int64, copy=False), phase_in, first,
                  np.array([s.index for s in slots], np.int64)]
        values += [f.reshape(rows).astype(np.int64, copy=False) for f in frames]  # a step in a window: its frames
        size = f0.shape[1] - (0 if final else self.constants.source_look_ahead)
        kind = "final" if final else "generator"
        launched = self._launch(kind, size, values, rows, self._final if final else self._step, wait)
        if launched is None:
            return None
        return LaunchedStep(launched, lambda out: (out[0], out[1], None if final else caches))

    def captured(self, kind: str, size: int, batch: int) -> CapturedCall | None:
        """The CUDA graph warmup captured for step ``kind`` x ``size`` frames at ``batch`` streams (None: not captured)."""
        return self._graphs.get((kind, size, batch))

    def compiled_step(self, kind: str) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The step ``kind`` (``"generator"``, ``"final"``, ``"f0"``) as warmup compiles it, taking
        :meth:`zero_inputs`-shaped tensors (what a profiler times)."""
        return self._compiled[kind]

    def _launch(self, kind: str, size: int, values: list[np.ndarray], rows: int,
                eager: Callable[..., tuple[torch.Tensor, ...]], wait: bool) -> LaunchedCall | FinishedCall | None:
        """A call of step ``kind`` x ``size`` over ``rows`` streams: its captured graph's replay where warmup
        captured the shape (padded to the batch it was captured at), launched; else the eager step, done here. None
        where ``wait`` is False and the call would wait: the graph's buffers still hold an earlier call's (see
        :meth:`CapturedCall.launch`), or the shape is eager (its call waits for its outputs)."""
        with self._lock:
            graph = self._graphs.get((kind, size, padded_batch(rows, self.batch_sizes)))
            if graph is not None:
                lane = torch.cuda.stream(self._f0_stream) if kind == "f0" and self._f0_stream is not None \
                    else contextlib.nullcontext()  # F0 graphs on their own stream (f0_lane)
                with lane:
                    return graph.launch(values, rows, self._lock, wait)
            if not wait:
                return None
            with self.precision_scope():
                tensors = (torch.from_numpy(np.ascontiguousarray(v)).to(self.device) for v in values)
                return FinishedCall([t.cpu().numpy() for t in eager(*tensors)])

    # ---- warmup: compile and capture every shape a stream meets ------------------------------------------------------
    def warmup(self, step_sizes: tuple[int, ...] | None, progress: Callable[[str], None] | None = None) -> None:
        """Compile and capture (CUDA) every shape of :meth:`capture_plan`. A no-op on the CPU.

        Three things at once, then the captures: threads run the eager step at every generator and final shape, so
        that cuDNN chooses each convolution's algorithm (:class:`~.cudnn.ChoosingThreads`); a first start's workers
        compile the step graphs side by side (:mod:`.compile_workers`); and this thread makes each graph's first call
        (dynamo's load of the compile from inductor's cache, or the compile itself). Then each shape is captured in
        the thread that chose its algorithms. All of it under a short GIL switch interval: the choosing threads'
        eager ops each release the GIL and would otherwise wait up to Python's default 5 ms to get it back."""
        if not self.on_cuda or not step_sizes:
            return
        say = progress or (lambda msg: log.info("hift_runtime: %s", msg))
        started = time.perf_counter()
        marker = None
        shapes = self.capture_plan(step_sizes)
        count = self.cudnn_threads or cudnn_threads_for_memory(
            torch.cuda.mem_get_info(self.device)[0], others_bytes=workers_device_bytes(self, step_sizes),
            activation_bytes=(self._trunk_dtype or torch.float32).itemsize)
        threads = ChoosingThreads(self.device, shapes if self.cuda_graphs else [], count)
        # (closed, its threads joined, before the switches and the interval they run under are restored)
        with self._lock, self.precision_scope(), switch_interval_at_most(HANDOFF_SWITCH_INTERVAL_S), \
                contextlib.closing(threads):
            choosing = threads.choose(self._choose_for)
            if threads.groups:
                say(f"warmup: choosing cuDNN's algorithms ({self.cudnn_choice()}) for {len(threads.owner)} step "
                    f"shapes in {len(threads.groups)} threads; the step graphs are loaded (or compiled) meanwhile")

            def first_call(kind: str, size: int) -> None:
                if f"{kind}:{size}" not in self.first_call_seconds:
                    seconds = self.compile_shape(kind, size)
                    self.first_call_seconds[f"{kind}:{size}"] = round(seconds, 3)
                    say(f"warmup: {kind}:{size} ready ({seconds:.0f} s; {time.perf_counter() - started:.0f} s since "
                        f"the start)")

            if compiles_side_by_side(self):
                marker = precompile(self, step_sizes, say, when_compiled=first_call)
            again = first_calls_or_deferred(compile_units(self.generator_graph_sizes(step_sizes), self.final_frames),
                                            first_call, say, beside_threads=bool(threads.groups))
            self._await_choices(choosing, threads, started, say)
            for kind, size in again:
                first_call(kind, size)
            self._capture(shapes, threads, started, say)
        self.compiles_at_warmup = compile_count()
        if marker is not None:
            try:
                marker.touch()  # its folder made by precompile (where it could not be, this fails too)
            except OSError as exc:  # a read-only cache: every start compiles side by side again
                say(f"warmup: cannot mark inductor's cache as warm ({exc})")
        say(warmup_summary(self.warmup_seconds, self.first_call_seconds))

    def _capture(self, shapes: list[tuple[str, int, int]], threads: ChoosingThreads, started: float,
                 say: Callable[[str], None]) -> None:
        """Capture each shape (or, without CUDA graphs, run it once) in the thread that chose its algorithms."""
        for i, (kind, size, batch) in enumerate(shapes):
            if (kind, size, batch) in self._graphs:
                continue
            shape_started = time.perf_counter()
            fn = self._compiled[kind]
            if self.cuda_graphs:
                pool = self._f0_graph_pool if kind == "f0" else self._graph_pool
                self._graphs[(kind, size, batch)] = threads.run((kind, size, batch), lambda: CapturedCall(
                    fn, self._example(kind, size, batch), pool, functools.partial(self._mirrors_of, kind, size)))
            else:
                threads.run((kind, size, batch), lambda: fn(*self._example(kind, size, batch)))
            self.warmup_seconds[f"{kind}:{size}x{batch}"] = round(time.perf_counter() - shape_started, 3)
            if kind != "f0" and (batch == self.batch_sizes[0] or i == len(shapes) - 1):
                say(f"warmup: {i + 1}/{len(shapes)} step shapes captured ({time.perf_counter() - started:.0f} s)")
        torch.cuda.synchronize(self.device)

    def _choose_for(self, shapes: list[tuple[str, int, int]]) -> None:
        """The eager step once at each of ``shapes`` (generator and final steps), so that cuDNN chooses each
        convolution's algorithm in this thread (one of :class:`~.cudnn.ChoosingThreads`)."""
        eager = {"generator": self._step, "final": self._final}
        for kind, size, batch in shapes:
            eager[kind](*self.zero_inputs(kind, size, batch))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # this thread's stream (see compile_shape)

    def cudnn_choice(self) -> str:
        """How cuDNN chooses the convolutions' algorithms here, in words (the warmup says it)."""
        value = os.environ.get(HEURISTIC_MODE_B_ENV, "")
        if heuristic_mode_b_asked(value):
            return "its heuristic mode B"
        return f"its instant heuristics: {HEURISTIC_MODE_B_ENV}={value!r}"

    def _await_choices(self, choosing: list[concurrent.futures.Future], threads: ChoosingThreads, started: float,
                       say: Callable[[str], None]) -> None:
        """Wait for the choosing threads; one that failed (out of memory, say) is said: its shapes' captures then
        choose their algorithms themselves, as they would without it."""
        failed = failed_choices(choosing, threads.groups)  # (their tracebacks dropped: see there)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the eager activations' blocks: the captures allocate from their own pool
        if failed:
            say(f"warmup: cuDNN's algorithms not chosen beforehand for {failed}; their captures choose them")
        elif threads.groups:
            say(f"warmup: cuDNN's algorithms chosen for {len(threads.owner)} step shapes in {len(threads.groups)} "
                f"threads ({time.perf_counter() - started:.0f} s since the start)")

    def capture_plan(self, step_sizes: tuple[int, ...]) -> list[tuple[str, int, int]]:
        """Every ``(kind, frames, batch)`` :meth:`warmup` captures, the smallest batch of each step first (its
        compile): the stream step's graphs, the final step's, the F0 step at each of its sizes, at every batch."""
        units = [("generator", size) for size in self.generator_graph_sizes(step_sizes)]
        units += [("final", self.final_frames)] + [("f0", size) for size in self.f0_step_sizes or step_sizes]
        return [(kind, size, batch) for group in ("generator", "final", "f0") for batch in self.batch_sizes
                for kind, size in units if kind == group]

    def generator_graph_sizes(self, step_sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The stream step's graphs for ``step_sizes``: the window's alone, or one per size."""
        return (self.step_window_frames,) if self.step_window_frames else tuple(step_sizes)

    @property
    def final_frames(self) -> int:
        """The frames of the final step's graph: the window's, or (without one) the mel look-ahead's."""
        return self.final_window_frames or self.constants.mel_look_ahead

    def compile_shape(self, kind: str, size: int) -> float:
        """Compile the step ``kind`` of ``size`` frames as :meth:`warmup` compiles it (the same inputs, at the
        smallest batch), without capturing: what fills inductor's on-disk cache for a later warmup. Seconds."""
        started = time.perf_counter()
        with self.precision_scope():
            self._compiled[kind](*self._example(kind, size, self.batch_sizes[0]))
            if self.device.type == "cuda":
                # The stream, not the device: a device-wide synchronize fails while a choosing thread's convolution
                # captures a graph under mode B (BENCHMARKS.md, decision log: "a race under mode B").
                torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - started

    def _example(self, kind: str, size: int, batch: int) -> list[torch.Tensor]:
        """:meth:`zero_inputs`, marked as a compile sees them: the batch dynamic for the generator steps (the F0 step runs
        eagerly)."""
        example = self.zero_inputs(kind, size, batch)
        if kind != "f0":
            mark_batch_dynamic(example)
        return example

    def _mirrors_of(self, kind: str, size: int, inputs: list[torch.Tensor],
                    outputs: tuple[torch.Tensor, ...]) -> HostMirrors:
        """The host buffers shared by the graphs of one step shape (made for the largest batch at its first
        capture)."""
        if (kind, size) not in self._mirrors:
            self._mirrors[(kind, size)] = HostMirrors(inputs, outputs, max(self.batch_sizes))
        return self._mirrors[(kind, size)]

    def zero_inputs(self, kind: str, size: int, batch: int) -> list[torch.Tensor]:
        """Inputs of a step of ``size`` frames for ``batch`` streams at the utterance start, every row on scratch."""
        c, dev = self.constants, self.device
        if kind == "f0":
            return [torch.zeros(batch, c.in_channels, c.f0_mel_frames(size), device=dev),
                    torch.ones(batch, 1, dtype=torch.bool, device=dev), torch.zeros(batch, dtype=torch.int64, device=dev)]
        final = kind == "final"
        mel, src = c.step_frames(size, final)
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


def first_calls_or_deferred(units: list[tuple[str, int]], first_call: Callable[[str, int], None],
                            say: Callable[[str], None], beside_threads: bool) -> list[tuple[str, int]]:
    """Each ``(kind, size)``'s first call; the units whose first call failed with a ``RuntimeError`` while cuDNN's
    choosing threads run beside (``beside_threads``), said and returned, to be made again once those threads are done:
    with the threads holding most of the device's memory, cuDNN can fail inside (a warm tf32 start on an H100 died of
    ``CUDNN_STATUS_INTERNAL_ERROR`` there). Without the threads, the error is raised."""
    again = []
    for kind, size in units:
        try:
            first_call(kind, size)
        except RuntimeError as exc:
            if not beside_threads:
                raise
            say(f"warmup: the first call of {kind}:{size} failed beside cuDNN's choosing threads "
                f"({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}); it is made again once they "
                "are done")
            again.append((kind, size))
    return again


def mark_batch_dynamic(tensors: list[torch.Tensor]) -> None:
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
