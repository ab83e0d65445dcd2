"""The ONNX Runtime engine over an export's step graphs: the F0 and generator steps on the CUDA EP when usable (else
the CPU EP, said in one log line), every constant and cache from the manifest, every graph checked against it."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from .contract import CACHE_PREFIX, NEXT_PREFIX, CacheSpec, StreamConstants
from .engine import EngineTraits, pad_rows, padded_batch
from .gpus import nvidia_driver_present
from .manifest import (F0_STEP, GENERATOR_STEP, GENERATOR_STEP_FINAL, GENERATOR_STEP_FINAL_SLOTS,
                       GENERATOR_STEP_SLOTS, METADATA_PREFIX, POOL_OUTPUT, ArtifactError, Manifest, ort_type)
from .options import DEFAULT_SLOTS, DEVICES, MAX_DEFAULT_STREAMS, OFFLINE_SLOTS, OrtOptions
from .slots import Slot, SlotRows

log = logging.getLogger("hift_runtime")
Device = Literal["auto", "cuda", "cpu"]
ORT_PRECISIONS = ("fp32", "tf32")
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# A push becomes generator steps of these sizes on the CUDA EP, so the GPU sees a few fixed shapes, each a CUDA graph
# (the CUDA EP rebuilds every convolution's cuDNN state at a new shape); 1 is among them, so any count splits.
ORT_STEP_SIZES = (24, 16, 8, 4, 2, 1)
# On the CPU the default max_streams is what its cores keep in real time: the largest batch (doubling from 1) whose
# step of a typical chunk takes at most this share of the audio it makes (the rest: the host's own work, spread).
REAL_TIME_STEP_FRAMES = 24
REAL_TIME_HEADROOM = 0.5
REAL_TIME_PROBE_BUDGET_S = 5.0  # the measurement stops doubling past this
# ONNX Runtime's own warnings (e.g. "No registered plugin EP device found" for every CUDA session) are not the
# user's concern; errors still surface as exceptions.
ort.set_default_logger_severity(3)


def zero_step_feed(c: StreamConstants, size: int, batch: int, final: bool = False) -> dict[str, np.ndarray]:
    """Zero inputs (the utterance start) of a generator step of ``size`` frames for ``batch`` streams."""
    mel, src = c.step_frames(size, final)
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


class StepSession:
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
        self.free = SlotRows(rows, "max_streams")
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


def slots_of(caches: Any) -> list[Slot]:
    """A step's streams' slots: one :class:`Slot`, or a list of them from the batcher."""
    return caches if isinstance(caches, list) else [caches]


def slot_indices(caches: Any, batch: int) -> np.ndarray:
    """The pool rows of a step's streams, padded with the scratch row 0 up to ``batch``. (A stream whose step failed
    after writing its row is lost and refused in its own thread: it never reaches a batch.)"""
    slots = slots_of(caches)
    index = np.zeros(batch, np.int64)
    index[:len(slots)] = [s.index for s in slots]
    return index


class CapturedGraph:
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
            self.inputs[k].update_inplace(pad_rows(v, self.batch))
        self.session.run_with_iobinding(self.binding, self.options)
        return {k: v.numpy()[:rows] for k, v in self.outputs.items()}

    def capture(self, feed: dict[str, np.ndarray]) -> None:
        """Capture on ``feed`` (whole batch): ONNX Runtime runs a graph id normally a few times before capturing."""
        for _ in range(3):
            self.replay(feed, self.batch)
        self.captured = True


class SlotStep(CapturedGraph):
    """The slot-form generator step (or final step) of one fixed size and batch as a CUDA graph, the pool bound in
    place: a call copies the step's inputs in (no caches: they stay in the pool) and its audio and phase out."""

    def __init__(self, session: ort.InferenceSession, graph_id: int, size: int, batch: int,
                 constants: StreamConstants, pool: SlotPool, device_id: int, final: bool = False) -> None:
        c = constants
        self.size = size
        frames = size + (c.audio_lag if final else 0)  # a final step also emits the audio held back by the lag
        super().__init__(session, graph_id, {**zero_step_feed(c, size, batch, final), "slots": np.zeros(batch, np.int64)},
                         {"audio": ([batch, frames * c.samples_per_frame], np.float32),
                          "phase_out": ([batch, c.num_sines], np.float64)}, device_id)
        pool.bind(self.binding, device_id, write=not final)  # a final step leaves the caches: the stream ends

    def run(self, feed: dict[str, np.ndarray], slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self.replay({**feed, "slots": slots}, feed["mel"].shape[0])
        return out["audio"], out["phase_out"]


def f0_graph(session: ort.InferenceSession, graph_id: int, size: int, batch: int, constants: StreamConstants,
              device_id: int) -> CapturedGraph:
    """The F0 step of ``size`` frames for ``batch`` streams as a CUDA graph (its small float64 caches travel with
    each call). Captured because an ordinary call rebuilds every convolution's cuDNN state whenever the shape differs
    from the previous call's, which batched F0 steps of changing sizes and batches do almost every time."""
    c = constants
    feed = {"mel": np.zeros((batch, c.in_channels, c.f0_mel_frames(size)), np.float32),
            **{CACHE_PREFIX + spec.name: spec.zeros(batch) for spec in c.f0_caches}}
    outputs = {"f0": ([batch, size], np.float32),
               **{NEXT_PREFIX + spec.name: ([batch, *spec.shape], np.dtype(spec.dtype)) for spec in c.f0_caches}}
    return CapturedGraph(session, graph_id, feed, outputs, device_id)


def run_slots(session: ort.InferenceSession, feed: dict[str, np.ndarray], slots: np.ndarray, pool: SlotPool,
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


class OrtBackend:
    """The ONNX Runtime engine: the F0 and generator steps on the CUDA EP (each stream's generator caches in a device
    slot, every step shape captured as a CUDA graph at :meth:`warmup`), or on the CPU EP (caches as NumPy arrays that
    travel with each call). ``slots``: device cache rows (one per open stream); ``batch_sizes``: the batches captured
    for cross-stream batching (a batch of B runs on the smallest size >= B, padded)."""

    def __init__(self, manifest: Manifest, constants: StreamConstants, device: Device = "auto",
                 options: OrtOptions | None = None, precision: str = "fp32", slots: int = DEFAULT_SLOTS,
                 batch_sizes: tuple[int, ...] = (1,)) -> None:
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if precision not in ORT_PRECISIONS:
            raise ValueError(f"precision {precision!r} is the compiled engine's (engine='compiled'); ONNX Runtime runs "
                             f"{' or '.join(ORT_PRECISIONS)}")
        self.manifest, self.constants = manifest, constants
        f0_entry = manifest.artifact(F0_STEP)
        mel_in = [v for v in f0_entry["inputs"] if v["name"] == "mel"] + [v for v in f0_entry["outputs"]
                                                                          if v["name"] == "f0"]
        if any(v["dtype"] != "float32" for v in mel_in):
            raise ArtifactError(f"{manifest.path(F0_STEP)}: the F0 graph must take and return float32 (the manifest "
                                f"lists {[(v['name'], v['dtype']) for v in mel_in]}); re-export with hift-export")
        options = options or OrtOptions()
        self._device_id, self._slots, self._batch_sizes = options.device_id, slots, tuple(batch_sizes)
        self._provider_options = {"device_id": str(options.device_id), "use_tf32": "1" if precision == "tf32" else "0",
                                  "cudnn_conv_algo_search": "HEURISTIC"}  # HEURISTIC: no benchmark per new shape
        intra_op_threads = options.intra_op_threads
        opts, cpu_opts = ort.SessionOptions(), ort.SessionOptions()
        for o in (opts, cpu_opts):
            o.log_severity_level = 3
            o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            if intra_op_threads:
                o.intra_op_num_threads = intra_op_threads
        providers, reason = self._providers(device)
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
        self._graphs: dict[tuple[int, int, bool], SlotStep] = {}  # (step size, batch, final) -> captured graph
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
            self._gen = {False: StepSession(self._session(GENERATOR_STEP, cpu_opts, providers, gen), gen),
                         True: StepSession(self._session(GENERATOR_STEP_FINAL, cpu_opts, providers, gen), gen)}
        self._f0_graphs: dict[tuple[int, int], CapturedGraph] = {}  # (step size, batch) -> captured F0 step
        self._f0_graphs_enabled = False
        self._f0 = self._open_f0_session(opts if active == CUDA else cpu_opts, providers if active == CUDA else [CPU])
        self.f0_provider = self._f0.session.get_providers()[0]
        self.generator_provider = active
        self.traits = EngineTraits(step_sizes=ORT_STEP_SIZES if active == CUDA else None,
                                   caches_in_place=self._pool is not None)
        self.name = f"ort[{'cuda' if active == CUDA else 'cpu'}]"
        # A GPU that is there but unusable is worth a warning; the ordinary outcomes are INFO (the CLIs print the
        # engine in their own line: backend.name).
        surprising = device == "auto" and active != CUDA and reason.startswith(("CUDA EP could not", "this onnx"))
        log.log(logging.WARNING if surprising else logging.INFO, "hift_runtime: generator on %s%s; F0 on %s", active,
                f" ({reason})" if reason else "", self.f0_provider)

    def _providers(self, device: str) -> tuple[list[Any], str]:
        """The generator's execution providers for ``device`` and, where that is the CPU, why (one line); a
        ``device='cuda'`` that cannot be had is refused."""
        if device == "cpu":
            return [CPU], "device='cpu' requested"
        if not nvidia_driver_present():
            reason = "no NVIDIA driver on this host"
            if device == "cuda":
                raise ArtifactError(f"device='cuda' requested but there is {reason}")
            return [CPU], reason
        if CUDA in ort.get_available_providers():
            return [(CUDA, self._provider_options), CPU], ""
        reason = f"this onnxruntime build has no CUDA EP (available: {ort.get_available_providers()})"
        if device == "cuda":
            raise ArtifactError(f"device='cuda' requested but {reason}; install onnxruntime-gpu (and not onnxruntime "
                                f"beside it)")
        return [CPU], reason

    def _open_f0_session(self, opts: ort.SessionOptions, providers: list[Any]) -> StepSession:
        """The F0 step beside the generator: on the CUDA EP as CUDA graphs where the generator's are captured (else
        ordinary calls: slower under changing shapes, otherwise the same), or on the CPU EP."""
        caches = self.constants.f0_caches
        if providers[0] != CPU and self._graphs_enabled:
            try:
                session = self._session(F0_STEP, opts, [(CUDA, self._provider_options | {"enable_cuda_graph": "1"}),
                                                        CPU], caches)
                self._f0_graphs_enabled = True
                return StepSession(session, caches, self._plain)
            except ArtifactError:
                log.info("hift_runtime: the F0 step cannot be captured as a CUDA graph here; running it without")
        return StepSession(self._session(F0_STEP, opts, providers, caches), caches)

    def _open_slot_sessions(self, opts: ort.SessionOptions, providers: list[Any]) -> str:
        """The slot-form generator sessions and the device pool; returns the provider the step session got."""
        step_providers = [(CUDA, self._provider_options | {"enable_cuda_graph": "1"}), CPU]
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
        self._pool = SlotPool(self._slots + 1, row, self._device_id)
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
        batch = padded_batch(rows, self._batch_sizes)  # the shapes warmup() prepared
        graph = self._f0_graphs.get((mel.shape[2] - self.constants.f0_look_ahead, batch))
        if graph is not None and graph.captured:
            out = graph.replay({"mel": mel, **{CACHE_PREFIX + k: v for k, v in caches.items()}}, rows)
            return out["f0"], {k[len(NEXT_PREFIX):]: v for k, v in out.items() if k.startswith(NEXT_PREFIX)}
        (f0,), nxt = self._f0.run({"mel": pad_rows(mel, batch)},
                                  {k: pad_rows(np.asarray(v), batch) for k, v in caches.items()})
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
        batch = padded_batch(rows, self._batch_sizes)  # the shapes warmup() prepared
        slots = slot_indices(caches, batch)
        assert self._pool is not None
        size = feed["f0"].shape[1] - (0 if final else self.constants.source_look_ahead)
        graph = self._graphs.get((size, batch, final))
        if graph is not None and graph.captured:
            return graph.run(feed, slots)
        audio, phase = run_slots(self._slot_final if final else self._slot_step,
                                  {k: pad_rows(v, batch) for k, v in feed.items()}, slots,
                                  self._pool, self._device_id, self._plain)
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
        for batch in self._batch_sizes:
            for size in step_sizes:
                if self.f0_provider == CUDA:
                    self._prepare_f0(size, batch)
                self._prepare(size, batch, final=False)
        # A stream's last step covers 4 frames once pushes split (fewer only for streams shorter than that); streams
        # that end together share it, so it is captured per batch size too (an ordinary call of it costs ~150 ms).
        for size in range(1, c.mel_look_ahead):
            self._prepare(size, 1, final=True, capture=False)
        for batch in self._batch_sizes:
            self._prepare(c.mel_look_ahead, batch, final=True)

    def _prepare_f0(self, size: int, batch: int) -> None:
        """The F0 step of one shape on the CUDA EP: captured (or, without graphs, run once: each shape's first
        ordinary run is slow)."""
        c = self.constants
        mel = np.zeros((batch, c.in_channels, c.f0_mel_frames(size)), np.float32)
        if not self._f0_graphs_enabled:
            self._f0.run({"mel": mel}, self.new_caches("f0", batch))
            return
        if (size, batch) not in self._f0_graphs:
            graph = f0_graph(self._f0.session, len(self._f0_graphs) + 1, size, batch, c, self._device_id)
            graph.capture({"mel": mel, **{CACHE_PREFIX + k: v for k, v in self.new_caches("f0", batch).items()}})
            self._f0_graphs[(size, batch)] = graph

    def _prepare(self, size: int, batch: int, final: bool, capture: bool = True) -> None:
        """Build one step shape's cuDNN state and, with CUDA graphs, capture it (on the device thread)."""
        assert self._pool is not None
        feed, scratch = zero_step_feed(self.constants, size, batch, final), np.zeros(batch, np.int64)
        session = self._slot_final if final else self._slot_step
        if not (self._graphs_enabled and capture):
            run_slots(session, feed, scratch, self._pool, self._device_id, self._plain)
        elif (size, batch, final) not in self._graphs:
            graph = SlotStep(session, len(self._graphs) + 1, size, batch, self.constants, self._pool,
                              self._device_id, final)
            graph.capture({**feed, "slots": scratch})  # every row reads (and a step writes) the scratch slot
            self._graphs[(size, batch, final)] = graph
