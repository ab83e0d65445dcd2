"""``hift-serve``: the streaming vocoder behind Triton Inference Server.

Triton gives HTTP, gRPC, the metrics endpoint and health checks; its dynamic batcher groups concurrent streams'
requests, and one Triton batch goes to the stream table, whose streams step together through the runtime's push
scheduler (one batched F0 step and one batched generator step per step size). Stream state stays in the process that
runs the table, keyed by stream id (:mod:`hift_runtime.serving`); the wire contract is :mod:`hift_runtime.wire`.

Front ends: ``python-backend`` (the default: the runtime inside Triton's own Python backend, :mod:`.triton_python`)
and ``pytriton`` (this process binds the table through PyTriton's proxy). ``--processes N`` runs N whole servers
under one supervisor (:mod:`.server_processes`). Needs the ``[serve]`` extra (``nvidia-pytriton``, which ships
``tritonserver`` and its Python backend, and wants numpy < 2).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import wire
from .argparsing import OneLineArgumentParser, gpu_ids
from .manifest import ArtifactError
from .noise import NoiseTableError
from .process_tuning import HANDOFF_SWITCH_INTERVAL_S, keep_freed_memory, tune_garbage_collector
from .serving import MAX_CHUNK_FRAMES, ChunkReply, ChunkRequest, StreamTable, decode_stream_id
from .sessions import CALL_LANES, CUDNN_ALGORITHMS, DEFAULT_STEP_WINDOW, CudaOptions, nvidia_driver_present
from .streaming import StreamingVocoder


def chunk_request(data: dict[str, Any]) -> ChunkRequest:
    """One wire request's tensors (each with its batch axis; ``offset`` may be absent or None) -> the table's
    request. A request that is not exactly one row carries its refusal (``problem``), so it is refused alone."""
    sid = decode_stream_id(wire.first_value(data[wire.STREAM_ID]))
    start, end = (bool(wire.first_value(data[name])) for name in (wire.START, wire.END))
    offset = data.get(wire.OFFSET)
    rows = {np.shape(value)[0] if np.ndim(value) else 0 for value in data.values() if value is not None}
    problem = "" if rows == {1} else (f"the request carries {max(rows)} rows; send one chunk of one stream per "
                                      f"request (batch size 1)")
    return ChunkRequest(sid, data[wire.MEL][0], start, end,
                        None if offset is None else int(wire.first_value(offset)), problem)


def make_infer_func(table: StreamTable, sample_rate: int):
    """The PyTriton inference callable: a list of Triton requests (one Triton batch) -> one reply each."""
    rate = np.array([[sample_rate]], np.int32)

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        replies = table.handle([chunk_request(r.data if hasattr(r, "data") else r) for r in requests])
        return [_reply(reply, rate) for reply in replies]

    return infer


def _reply(reply: ChunkReply, rate: np.ndarray) -> dict[str, np.ndarray]:
    """One reply's output tensors (with their batch axis), as both front ends send them."""
    samples = reply.audio.shape[0]
    audio = reply.audio if samples else np.zeros(1, np.float32)  # PyTriton cannot carry an empty tensor
    return {wire.AUDIO: np.ascontiguousarray(audio[None], np.float32), wire.SAMPLES: np.array([[samples]], np.int64),
            wire.SAMPLE_RATE: rate, wire.ERROR: np.array([[reply.error.encode()]], dtype=object)}


def bind(triton: Any, table: StreamTable, *, in_channels: int, sample_rate: int, max_batch: int,
         max_wait_ms: float, model_name: str = wire.MODEL_NAME, instances: int = 1) -> None:
    """Bind the streaming vocoder to a started-or-not ``pytriton.triton.Triton`` as ``model_name``; ``instances``
    model instances let Triton run several batches at once (their streams still meet in one step batcher)."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

    triton.bind(
        model_name=model_name,
        infer_func=[make_infer_func(table, sample_rate) for _ in range(instances)],
        inputs=[Tensor(name=wire.STREAM_ID, dtype=bytes, shape=(1,)),
                Tensor(name=wire.MEL, dtype=np.float32, shape=(in_channels, -1)),
                Tensor(name=wire.START, dtype=np.bool_, shape=(1,)),
                Tensor(name=wire.END, dtype=np.bool_, shape=(1,)),
                Tensor(name=wire.OFFSET, dtype=np.int64, shape=(1,), optional=True)],
        outputs=[Tensor(name=wire.AUDIO, dtype=np.float32, shape=(-1,)),
                 Tensor(name=wire.SAMPLES, dtype=np.int64, shape=(1,)),
                 Tensor(name=wire.SAMPLE_RATE, dtype=np.int32, shape=(1,)),
                 Tensor(name=wire.ERROR, dtype=bytes, shape=(1,))],
        config=ModelConfig(max_batch_size=max_batch,
                           batcher=DynamicBatcher(max_queue_delay_microseconds=int(max_wait_ms * 1000))),
        strict=False)


def shared_libpython_env(env: MutableMapping[str, str] = os.environ, extra: Sequence[str] = ()) -> None:
    """Triton's Python-backend stub must load this interpreter's own shared libpython (else it loads another one and
    fails in ``multiprocessing``): its folder (then ``extra`` folders) first on ``env``'s ``LD_LIBRARY_PATH``, which
    the server process passes on to the stub."""
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    for folder in reversed([sysconfig.get_config_var("LIBDIR") or "", *extra]):
        if folder and folder not in paths:
            paths.insert(0, folder)
    if paths:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)


# ``--frontend python-backend``: the function Triton's Python-backend model opens the runtime with (None: the
# module's default, this module's open_table); benchmarks/modelled_server.py names a stand-in device's.
PYTHON_BACKEND_OPENER: str | None = None


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="hift-serve", description="Serve the streaming vocoder on Triton Inference Server "
                                                             "(HTTP, gRPC, metrics).")
    p.add_argument("--artifacts", required=True, help="folder written by hift-export")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=int, default=wire.DEFAULT_HTTP_PORT, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=wire.DEFAULT_GRPC_PORT, help="gRPC port (default 8001)")
    p.add_argument("--metrics-port", type=int, default=wire.DEFAULT_METRICS_PORT,
                   help="Triton's Prometheus metrics port (default 8002)")
    p.add_argument("--state-metrics-port", type=int, default=wire.DEFAULT_STATE_METRICS_PORT,
                   help="the server's own metrics (open streams, refusals by reason, expiries, step batches, device "
                        "busy share), Prometheus text at /metrics (default 8003)")
    p.add_argument("--model-name", default=wire.MODEL_NAME, help=f"model name (default {wire.MODEL_NAME})")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="generator device")
    p.add_argument("--gpus", type=gpu_ids, default=None,
                   help="CUDA device ids to serve on, e.g. 0,1: one engine per GPU, each new stream on the "
                        "least-loaded GPU and pinned there (default: every visible GPU)")
    p.add_argument("--engine", choices=["auto", "ort", "compiled"], default="auto",
                   help="auto (default): the compiled engine on a CUDA device when torch with CUDA is installed, "
                        "else ONNX Runtime; ort; compiled (torch.compile, CUDA; compiles at start)")
    p.add_argument("--precision", choices=["fp32", "tf32", "fp16"], default="fp32",
                   help="fp32 (default, TF32 off: parity), tf32, fp16 (compiled engine only); see BENCHMARKS.md")
    p.add_argument("--max-batch", type=int, default=64,
                   help="most requests in one Triton batch, and streams in one batched step (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long Triton's batcher and the step batcher wait for more streams (default 2 ms)")
    p.add_argument("--instances", type=int, default=1,
                   help="model instances: Triton batches executed at once (default 1; pytriton front end only)")
    p.add_argument("--frontend", choices=["python-backend", "pytriton"], default="python-backend",
                   help="python-backend (default): the runtime inside Triton's own Python backend (a generated "
                        "model repository); pytriton: Triton through PyTriton's proxy, a process hop that kept a "
                        "quarter of the streams on an H200 (BENCHMARKS.md)")
    p.add_argument("--processes", type=int, default=1,
                   help="server processes on this machine, each its own Triton and runtime on the same device(s), "
                        "process i on every port + 10 x i; clients shard streams by id over their gRPC addresses "
                        "(default 1; on a GPU with the compiled engine use 2); a process that dies once all were ready is "
                        "started again, its streams lost")
    p.add_argument("--cudnn-threads", type=int, default=None,
                   help="the compiled engine's warmup: threads that choose cuDNN's convolution algorithms (default: "
                        "one per 8 GiB of free GPU memory, at most 8, or 1 where cuDNN's benchmark chooses in fp32 "
                        "and tf32; with --processes N, each process that // N)")
    p.add_argument("--cudnn-algorithms", choices=CUDNN_ALGORITHMS, default=None,
                   help="how cuDNN chooses the compiled engine's convolution algorithms: timed at warmup "
                        "(benchmark) or by its heuristic mode B (heuristics, the default: as fast under load and as "
                        "exact, a warm start of 81 s against 139 s in fp32, 59 s against 146 s in tf32, 65-95 s "
                        "against 104-118 s in fp16)")
    p.add_argument("--step-window", choices=["on", "off"], default=None,
                   help="the compiled engine's stream step as one graph of 24 frames for every step (default: the "
                        f"precision's: on in {', '.join(p for p, on in DEFAULT_STEP_WINDOW.items() if on)}, off in "
                        f"{', '.join(p for p, on in DEFAULT_STEP_WINDOW.items() if not on)}). On, fewer graphs are "
                        "compiled and loaded: "
                        "fp16 on an H200 started in 144 s cold and 52 s warm against 208-247 s and 65-95 s, its step "
                        "~12 %% more device time per stream near capacity (BENCHMARKS.md)")
    p.add_argument("--call-lanes", type=int, choices=CALL_LANES, default=1,
                   help="the compiled engine's batched calls at once over its CUDA graphs (default 1; 2: every shape "
                        "captured twice, one call's host part beside the other's replay, ~1.7 GB more GPU memory in "
                        "fp16). fp16 on an H200 kept 3 328 streams in 2 of 3 runs with 2 where 1 lane kept 3 072 in 2 "
                        "of 2, its p95 higher below capacity (BENCHMARKS.md)")
    p.add_argument("--max-streams", type=int, default=None,
                   help="open streams at most; a start beyond it is refused with an overload message (default: what "
                        "the device holds: its cache slots on the GPU; on the CPU what its cores keep in real time, "
                        "measured at start, within a quarter of the free memory)")
    p.add_argument("--max-chunk-frames", type=int, default=MAX_CHUNK_FRAMES,
                   help=f"the longest chunk one request may carry, in frames (default {MAX_CHUNK_FRAMES}: 20 s)")
    p.add_argument("--idle-timeout-s", type=float, default=60.0,
                   help="a stream idle this long is released (default 60 s)")
    p.add_argument("--noise-seed", type=int, default=0, help="seed of the generated noise table (default 0)")
    p.add_argument("--phase", choices=["upstream", "wrapped"], default="upstream", help="carried phase")
    p.add_argument("--triton-log", help="Triton's own log file (default: a file in the temp folder, path printed)")
    return p


def busy_port(host: str, ports: dict[str, int]) -> str | None:
    """The first of ``ports`` that cannot be bound on ``host`` (Triton would fail on it and PyTriton would wait
    instead of saying so), as a message naming the option; None when all are free."""
    import socket

    for option, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                return f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror}); pick another port"
    return None


def cuda_options(args: argparse.Namespace) -> CudaOptions:
    """The engine's :class:`~hift_runtime.sessions.CudaOptions` from hift-serve's options."""
    return CudaOptions(cudnn_threads=args.cudnn_threads, cudnn_algorithms=args.cudnn_algorithms,
                       step_window=None if args.step_window is None else args.step_window == "on",
                       call_lanes=args.call_lanes)


def open_table(args: argparse.Namespace) -> tuple[StreamingVocoder, StreamTable]:
    from .sessions import open_vocoder

    cuda = cuda_options(args)
    vocoder = open_vocoder(args.artifacts, device=args.device, cuda=cuda, noise_seed=args.noise_seed, phase=args.phase,
                           batching=True, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                           max_streams=args.max_streams, idle_timeout_s=args.idle_timeout_s, engine=args.engine,
                           precision=args.precision, devices=serving_gpus(args.gpus, args.device))
    if vocoder.max_streams is None:  # nothing a client sends may grow the server without bound
        vocoder.max_streams = vocoder.backend.stream_capacity()
    print(f"hift-serve: generator on {vocoder.backend.name} ({vocoder.engine_reason}); preparing every step shape",
          flush=True)
    vocoder.warmup(progress=lambda message: print(f"hift-serve: {message}", flush=True))
    return vocoder, StreamTable(vocoder, workers=args.max_batch, max_chunk_frames=args.max_chunk_frames)


def serving_gpus(option: list[int] | None, device: str) -> list[int] | None:
    """``--gpus``: the listed ids; by default every visible GPU when there are several (None: the one-device path)."""
    from .sessions import visible_gpus

    if option:
        return option
    gpus = visible_gpus() if device != "cpu" else []
    return gpus if len(gpus) > 1 else None


def local_http_url(args: argparse.Namespace) -> str:
    """Triton's HTTP endpoint as this machine reaches it (a wildcard ``--host`` is reached on the loopback)."""
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return f"http://{f'[{local}]' if ':' in local else local}:{args.http_port}"


def ready_line(args: argparse.Namespace, what: str, log_file: Path) -> str:
    """The line printed once the model answers ready: what serves it, and every endpoint."""
    return (f"hift-serve: model {args.model_name!r} ready ({what}): gRPC {args.host}:{args.grpc_port}, HTTP "
            f"{args.host}:{args.http_port}, readiness {local_http_url(args)}/v2/models/{args.model_name}/ready, "
            f"metrics http://{args.host}:{args.metrics_port}/metrics, server state http://{args.host}:"
            f"{args.state_metrics_port}/metrics; Triton log {log_file}")


@contextlib.contextmanager
def stop_signals_recorded() -> Iterator[list[int]]:
    """SIGTERM and Ctrl-C recorded in the list this yields (a supervisor's loop watches it) instead of raising; the
    previous handlers back on exit."""
    stopping: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stopping
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def stop_processes(processes: Sequence[Any], timeout_s: float) -> None:
    """Ask every process still running to stop (SIGTERM), wait up to ``timeout_s`` for each, kill any that would
    not."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_model_ready(url: str, model_name: str, timeout_s: float = 120.0) -> bool:
    """Poll Triton's model-readiness endpoint until the model answers ready (True) or ``timeout_s`` passes."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v2/models/{model_name}/ready", timeout=5) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


class _ConsoleWhileStopping:
    """While the server stops, this process's stdout and stderr (file descriptors, which tritonserver shares) point at
    the Triton log, so tritonserver's own "Signal (N) received." lines go there, not to the console."""

    def __init__(self, log_file: Path) -> None:
        self.log_file, self._saved = log_file, None

    def stop(self, *_: Any) -> None:
        """Signal handler (SIGTERM, SIGINT): stop as Ctrl-C does, the console quiet."""
        if self._saved is None:
            sys.stdout.flush()
            sys.stderr.flush()
            self._saved = [os.dup(1), os.dup(2)]
            with open(self.log_file, "ab") as log:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._saved is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), self._saved):
                os.dup2(copy, fd)
                os.close(copy)
            self._saved = None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if (args.max_batch < 1 or args.max_wait_ms < 0 or args.instances < 1 or args.max_chunk_frames < 1
            or args.processes < 1 or (args.max_streams is not None and args.max_streams < 1)):
        print("hift-serve: error: --max-batch, --instances, --processes, --max-streams and --max-chunk-frames must be "
              ">= 1 and --max-wait-ms >= 0", file=sys.stderr)
        return 2
    try:
        from pytriton.triton import Triton, TritonConfig
    except ImportError as exc:
        print(f"hift-serve: error: PyTriton is not installed ({exc}); install the project with its [serve] extra: "
              f"pip install -e \".[serve]\"", file=sys.stderr)
        return 2
    from .server_processes import ports_of, serve_processes

    busy = busy_port(args.host, ports_of(args, args.processes))  # one process: its four ports as given
    if busy:
        print(f"hift-serve: error: {busy}", file=sys.stderr)
        return 2
    if args.frontend == "python-backend" and args.instances != 1:  # each instance would be a runtime of its own
        print("hift-serve: error: --instances is the pytriton front end's; the python-backend front end (the "
              "default) runs one instance (its batches already pipeline); drop --instances, or add --frontend "
              "pytriton", file=sys.stderr)
        return 2
    if args.processes > 1:
        return serve_processes(args, argv)
    if args.frontend == "python-backend":
        return serve_python_backend(args, argv, PYTHON_BACKEND_OPENER)
    keep_freed_memory()
    try:
        vocoder, table = open_table(args)
    except (ArtifactError, NoiseTableError, OSError, ValueError) as exc:
        print(f"hift-serve: error: {exc}", file=sys.stderr)
        return 2
    tune_garbage_collector()  # warm: what lives now lives as long as the server
    shared_libpython_env()
    sys.setswitchinterval(HANDOFF_SWITCH_INTERVAL_S)
    logging.getLogger("pytriton").setLevel(logging.WARNING)
    log_file = Path(args.triton_log or Path(tempfile.gettempdir()) / f"hift-serve-{os.getpid()}.triton.log")
    config = TritonConfig(http_address=args.host, http_port=args.http_port, grpc_address=args.host,
                          grpc_port=args.grpc_port, metrics_address=args.host, metrics_port=args.metrics_port,
                          log_file=log_file, log_verbose=0, allow_gpu_metrics=nvidia_driver_present())
    # SIGTERM (a service manager, a test) stops the server the way Ctrl-C does.
    console = _ConsoleWhileStopping(log_file)
    signal.signal(signal.SIGTERM, console.stop)
    signal.signal(signal.SIGINT, console.stop)
    constants = vocoder.constants
    http_url = local_http_url(args)
    try:
        # Bound before the server starts, so it loads the model as it comes up; /v2/health/ready can still answer
        # before the model is loaded, so readiness is the model's own endpoint (README: the probe to use).
        from .server_metrics import serve_state_metrics

        state_metrics = serve_state_metrics(table, args.state_metrics_port, args.host)
        triton = Triton(config=config)
        bind(triton, table, in_channels=constants.in_channels, sample_rate=constants.sample_rate,
             max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, model_name=args.model_name,
             instances=args.instances)
        try:
            triton.run()
            if not wait_model_ready(http_url, args.model_name):
                print(f"hift-serve: error: the model did not become ready in 120 s; see the Triton log {log_file}",
                      file=sys.stderr)
                return 1
            print(ready_line(args, f"generator on {vocoder.backend.name}, at most {vocoder.max_streams} streams",
                             log_file), flush=True)
            triton.serve()
        finally:
            triton.stop()
            state_metrics.shutdown()
    except KeyboardInterrupt:
        pass
    finally:
        table.close()
        vocoder.close()
        console.restore()
    print("hift-serve: stopped", flush=True)
    return 0


def serve_python_backend(args: argparse.Namespace, argv: list[str], opener: str | None = None) -> int:
    """``--frontend python-backend``: ``tritonserver`` over a generated repository whose Python-backend model runs
    the runtime (:mod:`.triton_python`); this process supervises it: the ready line once the model answers ready,
    SIGTERM/Ctrl-C passed on, the exit status."""
    import shutil
    import time

    from .manifest import read_manifest
    from .supervision import process_alive, release_folder, temp_folder
    from .triton_python import OPENER, launch, load_failure, model_pid

    opener = opener or OPENER

    try:  # the export's errors said here, in one line, before Triton starts
        manifest = read_manifest(args.artifacts, verify=None)
        in_channels = int(manifest.config["in_channels"])
    except (ArtifactError, OSError, KeyError, ValueError) as exc:
        print(f"hift-serve: error: {exc}", file=sys.stderr)
        return 2
    folder = temp_folder()
    log_file = Path(args.triton_log or folder / "triton.log")
    failed_log: Path | None = None
    http_url = local_http_url(args)
    try:
        with stop_signals_recorded() as stopping:
            try:
                process = launch(args, argv, in_channels, folder, log_file, nvidia_driver_present(), opener)
            except (FileNotFoundError, ImportError, OSError) as exc:
                print(f"hift-serve: error: cannot start tritonserver: {exc}", file=sys.stderr)
                return 2
            announced = False
            dead_model: int | None = None
            while process.poll() is None and not stopping:
                if not announced and wait_model_ready(http_url, args.model_name, timeout_s=0.5):
                    print(ready_line(args, "the runtime inside Triton's Python backend", log_file), flush=True)
                    announced = True
                pid = model_pid(folder)
                if pid is not None and not process_alive(pid) and not stopping:
                    dead_model = pid  # tritonserver would keep answering ready while nothing serves
                    try:  # a model that failed to load takes tritonserver down by itself: its message is better
                        process.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        break
                time.sleep(0.2)
            if process.poll() is not None and not stopping and announced and dead_model is None:
                pid = model_pid(folder)  # Triton may abort on its own once its stub is gone, before we look
                if pid is not None and not process_alive(pid):
                    dead_model = pid
            if dead_model is not None and (announced or process.poll() is None):
                also = "" if process.poll() is None else f" (tritonserver with it, status {process.returncode})"
                if process.poll() is None:
                    process.kill()  # nothing left to unload gracefully: the ports close at once (readiness fails)
                    process.wait()
                print(f"hift-serve: error: the model process (pid {dead_model}, Triton's Python-backend stub) died"
                      f"{also}; "
                      f"the streams it held are lost (their clients cannot reach this server); stopping",
                      file=sys.stderr, flush=True)
                return 1
            if process.poll() is None:  # asked to stop: Triton unloads the model (its finalize) and exits
                stop_processes([process], timeout_s=60)
            elif not stopping:
                text = log_file.read_text(errors="replace") if log_file.is_file() else ""
                why = load_failure(text, args.model_name)
                failed_log = log_file  # kept for the reader
                if why:  # the model's own message (a bad export, no CUDA, ...): what to fix, in one line
                    print(f"hift-serve: error: {why} (tritonserver's log: {log_file})", file=sys.stderr)
                else:
                    print(f"hift-serve: error: tritonserver exited with status {process.returncode}"
                          f"{' before the model was ready' if not announced else ''}; the end of its log "
                          f"({log_file}):\n{text[-2000:]}", file=sys.stderr)
                return 1
    finally:
        if failed_log is not None and not args.triton_log:  # the repository goes; the log the message names stays
            shutil.rmtree(folder / "models", ignore_errors=True)
            shutil.rmtree(folder / "backends", ignore_errors=True)
            release_folder(folder)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print("hift-serve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
