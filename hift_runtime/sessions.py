"""ONNX Runtime sessions for an artifacts folder: the F0 graph on the CPU EP, the generator on the CUDA EP when
usable (else the CPU EP, said in one log line). Every constant comes from the manifest."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from .manifest import (F0, GENERATOR_FINAL, GENERATOR_STREAM, METADATA_PREFIX, ArtifactError, Manifest,
                       read_manifest)
from .noise import NoiseTable
from .streaming import StreamConstants, StreamingVocoder

log = logging.getLogger("hift_runtime")
Device = Literal["auto", "cuda", "cpu"]
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class CudaOptions:
    """CUDA EP settings. TF32 is off by default (parity); HEURISTIC avoids re-benchmarking every new shape.

    ``shape_sessions``: the CUDA EP rebuilds every conv's cuDNN state whenever a session sees a window length other
    than its previous one (~180 ms on an H200 for this graph, measured: benchmarks/results/gpu-h200-shape-probe.json).
    Window lengths recur (a stream's first chunks, the steady state), so a length seen twice gets a session of its
    own, up to this many per graph (each holds one 70 MB copy of the weights on the device); other lengths share
    one session. 0 disables the pool.
    """

    device_id: int = 0
    use_tf32: bool = False
    cudnn_conv_algo_search: str = "HEURISTIC"
    shape_sessions: int = 8
    # Dedicated sessions fixed to their shape and replayed as CUDA graphs (measured 5.3 vs 6.6 ms per window on an
    # H200, BENCHMARKS.md arm d). Off by default until it has run in more places than one benchmark.
    cuda_graphs: bool = False

    def provider_options(self) -> dict[str, str]:
        return {"device_id": str(self.device_id), "use_tf32": "1" if self.use_tf32 else "0",
                "cudnn_conv_algo_search": self.cudnn_conv_algo_search}


def _nvidia_driver_present() -> bool:
    """onnxruntime-gpu lists the CUDA EP even where there is no GPU and then logs errors when asked for it."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def _check_signature(session: ort.InferenceSession, entry: dict[str, Any], path: os.PathLike[str] | str) -> None:
    def sig(values: Any) -> list[tuple[str, str]]:
        return [(v.name, v.type) for v in values]

    def ort_type(dtype: str) -> str:  # manifest spells NumPy dtypes; ORT spells ONNX element types
        return f"tensor({ {'float32': 'float', 'float64': 'double'}.get(dtype, dtype)})"

    want_in = [(v["name"], ort_type(v["dtype"])) for v in entry["inputs"]]
    want_out = [(v["name"], ort_type(v["dtype"])) for v in entry["outputs"]]
    got_in, got_out = sig(session.get_inputs()), sig(session.get_outputs())
    if got_in != want_in or got_out != want_out:
        raise ArtifactError(f"{path}: graph signature inputs {got_in} -> outputs {got_out} differs from the "
                            f"manifest's {want_in} -> {want_out}; the file does not belong to this manifest")


def _check_metadata(session: ort.InferenceSession, manifest: Manifest, path: Any) -> None:
    meta = session.get_modelmeta().custom_metadata_map
    raw = meta.get(METADATA_PREFIX + "config")
    if raw is None:
        raise ArtifactError(f"{path} carries no {METADATA_PREFIX}config metadata: not written by hift-export")
    if json.loads(raw) != manifest.config:
        raise ArtifactError(f"{path}: the config in the graph's metadata differs from manifest.json; the folder mixes "
                            f"files of two exports; re-export")


class _BoundRunner:
    """A dynamic-shape CUDA session run with IO binding: one host->device copy per input, outputs on the device
    copied back once."""

    def __init__(self, session: ort.InferenceSession, device_id: int) -> None:
        self.session, self.device_id = session, device_id

    def run(self, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        binding = self.session.io_binding()
        for name, value in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for out in self.session.get_outputs():
            binding.bind_output(out.name, "cuda", self.device_id)
        self.session.run_with_iobinding(binding)
        audio, phase = binding.copy_outputs_to_cpu()
        return audio, phase


class _GraphRunner:
    """A session fixed to one input shape (free-dimension overrides fold the shape arithmetic onto the device) and
    replayed as a CUDA graph over persistent device buffers. Calls are serialised: the buffers are shared."""

    def __init__(self, make_session: Any, entry: dict[str, Any], feed: dict[str, np.ndarray], device_id: int,
                 output_shapes: dict[str, tuple[int, ...]]) -> None:
        overrides: dict[str, int] = {}
        for spec in entry["inputs"]:
            for dim, size in zip(spec["shape"], feed[spec["name"]].shape):
                if isinstance(dim, str):
                    overrides[dim] = int(size)
        self.session = make_session(overrides)
        self._lock = threading.Lock()
        self._inputs = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", device_id)
                        for k, v in feed.items()}
        dtypes = {o["name"]: np.dtype(o["dtype"]) for o in entry["outputs"]}
        self._outputs = {k: ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtypes[k], "cuda", device_id)
                         for k, shape in output_shapes.items()}
        self._binding = self.session.io_binding()
        for k, v in self._inputs.items():
            self._binding.bind_ortvalue_input(k, v)
        for k, v in self._outputs.items():
            self._binding.bind_ortvalue_output(k, v)

    def run(self, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            for k, v in feed.items():
                self._inputs[k].update_inplace(np.ascontiguousarray(v))
            self.session.run_with_iobinding(self._binding)
            return self._outputs["audio"].numpy(), self._outputs["phase_out"].numpy()


class _ShapeSessionPool:
    """One shared runner plus dedicated runners for recurring input shapes (LRU-bounded)."""

    def __init__(self, shared: Any, make_dedicated: Any, limit: int, promote_after: int = 2) -> None:
        self.shared, self._make, self._limit, self._promote_after = shared, make_dedicated, limit, promote_after
        self._runners: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._seen: Counter[tuple[int, ...]] = Counter()
        self._lock = threading.Lock()

    def get(self, feed: dict[str, np.ndarray]) -> Any:
        shape = tuple(feed["mel"].shape)
        if self._limit <= 0:
            return self.shared
        with self._lock:
            runner = self._runners.get(shape)
            if runner is not None:
                self._runners.move_to_end(shape)
                return runner
            self._seen[shape] += 1
            if self._seen[shape] < self._promote_after:
                return self.shared
            if len(self._runners) >= self._limit:
                self._runners.popitem(last=False)
            runner = self._runners[shape] = self._make(feed)
            return runner

    @property
    def dedicated(self) -> int:
        return len(self._runners)


class OrtBackend:
    """The product backend: ``predict_f0`` on the CPU EP, ``generate`` on the CUDA EP (or CPU)."""

    def __init__(self, manifest: Manifest, device: Device = "auto", cuda: CudaOptions | None = None,
                 intra_op_threads: int = 0) -> None:
        self.manifest = manifest
        f0_entry = manifest.artifact(F0)
        if any(v["dtype"] != "float32" for v in f0_entry["inputs"] + f0_entry["outputs"]):
            raise ArtifactError(f"{manifest.path(F0)}: the F0 graph must take and return float32 (the manifest lists "
                                f"{[(v['name'], v['dtype']) for v in f0_entry['inputs'] + f0_entry['outputs']]}); "
                                f"re-export with hift-export")
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads:
            opts.intra_op_num_threads = intra_op_threads
        self.f0_session = self._session(F0, opts, [CPU])
        providers: list[Any] = [CPU]
        reason = "device='cpu' requested"
        if device in ("auto", "cuda"):
            if not _nvidia_driver_present():
                reason = "no NVIDIA driver on this host"
                if device == "cuda":
                    raise ArtifactError(f"device='cuda' requested but there is {reason}")
            elif CUDA in ort.get_available_providers():
                providers = [(CUDA, (cuda or CudaOptions()).provider_options()), CPU]
                reason = ""
            else:
                reason = f"this onnxruntime build has no CUDA EP (available: {ort.get_available_providers()})"
                if device == "cuda":
                    raise ArtifactError(f"device='cuda' requested but {reason}; install onnxruntime-gpu "
                                        f"(and not onnxruntime beside it)")
        self.generator_sessions = {False: self._session(GENERATOR_STREAM, opts, providers),
                                   True: self._session(GENERATOR_FINAL, opts, providers)}
        active = self.generator_sessions[False].get_providers()[0]
        self._pools: dict[bool, _ShapeSessionPool] = {}
        if active == CUDA:
            options = cuda or CudaOptions()
            for finalize, role in ((False, GENERATOR_STREAM), (True, GENERATOR_FINAL)):
                shared = _BoundRunner(self.generator_sessions[finalize], options.device_id)
                self._pools[finalize] = _ShapeSessionPool(
                    shared, lambda feed, role=role, finalize=finalize: self._dedicated(role, finalize, feed, opts,
                                                                                      options),
                    options.shape_sessions)
        if providers[0] != CPU and active != CUDA:
            reason = "CUDA EP could not start (no GPU or driver/CUDA libraries missing); see ONNX Runtime's log"
            if device == "cuda":
                raise ArtifactError(f"device='cuda' requested but the {reason}")
        self.generator_provider = active
        self.device_id = (cuda or CudaOptions()).device_id
        self.name = f"ort[{'cuda' if active == CUDA else 'cpu'}]"
        log.info("hift_runtime: generator on %s%s; F0 on %s", active, f" ({reason})" if reason else "", CPU)

    def _session(self, role: str, opts: ort.SessionOptions, providers: list[Any]) -> ort.InferenceSession:
        path = self.manifest.path(role)
        try:
            session = ort.InferenceSession(str(path), opts, providers=providers)
        except Exception as exc:  # ORT raises its own exception types for unreadable or invalid models
            raise ArtifactError(f"{path}: ONNX Runtime cannot load it ({str(exc).splitlines()[0][:300]})") from exc
        _check_signature(session, self.manifest.artifact(role), path)
        _check_metadata(session, self.manifest, path)
        return session

    def _dedicated(self, role: str, finalize: bool, feed: dict[str, np.ndarray], base: ort.SessionOptions,
                   options: CudaOptions) -> Any:
        provider = [(CUDA, options.provider_options()), CPU]
        if not options.cuda_graphs:
            return _BoundRunner(self._session(role, base, provider), options.device_id)
        c = self.manifest.config["derived"]
        batch, _, frames = feed["mel"].shape
        samples = c["samples_per_frame"] * (frames if finalize else frames - int(self.manifest.config[
            "conv_pre_look_right"]) - 1)

        def make_session(overrides: dict[str, int]) -> ort.InferenceSession:
            opts = ort.SessionOptions()
            opts.log_severity_level = base.log_severity_level
            for name, value in overrides.items():
                opts.add_free_dimension_override_by_name(name, value)
            graph_provider = [(CUDA, options.provider_options() | {"enable_cuda_graph": "1"})]
            return self._session(role, opts, graph_provider)

        return _GraphRunner(make_session, self.manifest.artifact(role), feed, options.device_id,
                            {"audio": (batch, samples), "phase_out": (batch, frames, c["num_sines"])})

    def predict_f0(self, mel: np.ndarray) -> np.ndarray:
        return self.f0_session.run(None, {"mel": mel})[0]

    def generate(self, mel: np.ndarray, f0: np.ndarray, noise: np.ndarray, phase_in: np.ndarray,
                 finalize: bool) -> tuple[np.ndarray, np.ndarray]:
        feed = {"mel": mel, "f0": f0, "noise": noise, "phase_in": phase_in}
        if self.generator_provider != CUDA:
            session = self.generator_sessions[finalize]
            audio, phase = session.run(None, feed)
            return audio, phase
        return self._pools[finalize].get(feed).run(feed)


def open_vocoder(artifacts: str | os.PathLike[str], *, device: Device = "auto", window_frames: int | None = None,
                 noise_table: str | os.PathLike[str] | None = None, noise_seed: int = 0,
                 cuda: CudaOptions | None = None, verify_hashes: bool = True,
                 intra_op_threads: int = 0, phase: str = "upstream") -> StreamingVocoder:
    """Open an export folder: verify it, create the sessions once, return a :class:`StreamingVocoder`.

    Streams created from it share the sessions; each has its own small state.
    """
    manifest = read_manifest(artifacts, verify_hashes=verify_hashes)
    backend = OrtBackend(manifest, device=device, cuda=cuda, intra_op_threads=intra_op_threads)
    constants = StreamConstants.from_config(manifest.config,
                                            window_frames if window_frames is not None
                                            else manifest.streaming["window_frames"])
    noise = (NoiseTable.from_npy(noise_table, constants.num_sines) if noise_table is not None
             else NoiseTable.seeded(noise_seed, constants.noise_table_length, constants.num_sines))
    return StreamingVocoder(backend, constants, noise, phase=phase)
