"""``hift-serve``: the streaming vocoder behind Triton Inference Server.

Triton gives HTTP, gRPC, the metrics endpoint and health checks; its dynamic batcher groups concurrent streams'
requests, and one Triton batch goes to the stream table, whose streams step together through the runtime's push
scheduler. The runtime runs inside Triton's own Python backend (:mod:`.triton_python`), in the model process
``tritonserver`` starts; this process supervises it. Stream state stays in the process that runs the table, keyed by
stream id (:mod:`hift_runtime.serving`); the wire contract is :mod:`hift_runtime.wire`. ``--processes N`` runs N
whole servers under one supervisor (:mod:`.server_processes`). Needs the ``[serve]`` extra (``nvidia-pytriton``,
which ships ``tritonserver`` and its Python backend, and wants numpy < 2).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import wire
from .gpus import nvidia_driver_present, visible_gpus
from .manifest import ArtifactError
from .opening import open_vocoder
from .server_cli import busy_port, invalid, local_http_url, local_url, parser
from .serving import StreamTable
from .streaming import StreamingVocoder

# What Triton's load failure says when the model process died without raising (killed, out of memory).
STUB_UNHEALTHY = "is not healthy"
# The function Triton's Python-backend model opens the runtime with (None: the module's default, this module's
# open_table); benchmarks/modelled_server.py names a stand-in device's.
PYTHON_BACKEND_OPENER: str | None = None
# How long a stopping tritonserver may wait while its model has no request left to answer (its normal unload and
# exit took ~2.5 s on 2 cores), before it is taken for a request held after its client cut the call, and killed.
HELD_REQUEST_S = 5.0


def open_table(args: argparse.Namespace) -> tuple[StreamingVocoder, StreamTable]:
    """The vocoder and its stream table from hift-serve's options, warmed up (what the model process runs)."""
    vocoder = open_vocoder(args.artifacts, device=args.device, engine=args.engine, precision=args.precision,
                           devices=serving_gpus(args.gpus, args.device), max_streams=args.max_streams,
                           idle_timeout_s=args.idle_timeout_s, batching=True, max_batch=args.max_batch,
                           max_wait_ms=args.max_wait_ms, noise_seed=args.noise_seed, phase=args.phase)
    if vocoder.max_streams is None:  # nothing a client sends may grow the server without bound
        vocoder.max_streams = vocoder.backend.stream_capacity()
    print(f"hift-serve: generator on {vocoder.backend.name} ({vocoder.engine_reason}); preparing every step shape",
          flush=True)
    vocoder.warmup(progress=lambda message: print(f"hift-serve: {message}", flush=True))
    return vocoder, StreamTable(vocoder, workers=args.max_batch, max_chunk_frames=args.max_chunk_frames)


def serving_gpus(option: list[int] | None, device: str) -> list[int] | None:
    """``--gpus``: the listed ids; by default every visible GPU when there are several (None: the one-device path)."""
    if option:
        return option
    gpus = visible_gpus() if device != "cpu" else []
    return gpus if len(gpus) > 1 else None


def ready_line(args: argparse.Namespace, what: str, log_file: Path) -> str:
    """The line printed once the model answers ready: what serves it, and every endpoint."""
    return (f"hift-serve: model {wire.MODEL_NAME!r} ready ({what}): gRPC {args.host}:{args.grpc_port}, HTTP "
            f"{args.host}:{args.http_port}, readiness {local_http_url(args)}/v2/models/{wire.MODEL_NAME}/ready, "
            f"metrics http://{args.host}:{args.metrics_port}/metrics, server state http://{args.host}:"
            f"{args.state_metrics_port}/metrics; Triton log {log_file}")


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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    problem = invalid(args)
    if problem:
        print(f"hift-serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        import pytriton  # noqa: F401 - ships the tritonserver and Python backend this server runs
    except ImportError as exc:
        print(f"hift-serve: error: PyTriton is not installed ({exc}); install the project with its [serve] extra: "
              f"pip install -e \".[serve]\"", file=sys.stderr)
        return 2
    from .manifest import read_manifest
    from .server_processes import ports_of, serve_processes

    try:  # the export's errors first, in one line, before the ports or Triton
        in_channels = int(read_manifest(args.artifacts, verify=None).config["in_channels"])
    except (ArtifactError, OSError, KeyError, ValueError) as exc:
        print(f"hift-serve: error: {exc}", file=sys.stderr)
        return 2
    busy = busy_port(args.host, ports_of(args, args.processes))  # one process: its four ports as given
    if busy:
        print(f"hift-serve: error: {busy}", file=sys.stderr)
        return 2
    if args.processes > 1:
        return serve_processes(args, argv)
    return serve_python_backend(args, argv, in_channels, PYTHON_BACKEND_OPENER)


def serve_python_backend(args: argparse.Namespace, argv: list[str], in_channels: int,
                         opener: str | None = None) -> int:
    """``tritonserver`` over a generated repository whose Python-backend model runs the runtime
    (:mod:`.triton_python`); this process supervises it: the ready line once the model answers ready, SIGTERM/Ctrl-C
    passed on, a dead model process noticed, the exit status."""
    import shutil

    from .supervision import release_folder, stop_signals_recorded, temp_folder
    from .triton_python import OPENER, launch, load_failure

    opener = opener or OPENER
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
            announced, dead_model = _watch(process, folder, stopping, lambda: print(
                ready_line(args, "the runtime inside Triton's Python backend", log_file), flush=True),
                lambda: wait_model_ready(http_url, wire.MODEL_NAME, timeout_s=0.5))
            if dead_model is not None and (announced or process.poll() is None):
                also = "" if process.poll() is None else f" (tritonserver with it, status {process.returncode})"
                if process.poll() is None:
                    process.kill()  # nothing left to unload gracefully: the ports close at once (readiness fails)
                    process.wait()
                if announced:
                    print(f"hift-serve: error: the model process (pid {dead_model}, Triton's Python-backend stub) "
                          f"died{also}; the streams it held are lost (their clients cannot reach this server); "
                          f"stopping", file=sys.stderr, flush=True)
                    return 1
                failed_log = log_file  # kept for the reader
                print(died_before_ready(dead_model, log_file), file=sys.stderr, flush=True)
                return 1
            if process.poll() is None:  # asked to stop: Triton unloads the model (its finalize) and exits
                state_url = f"{local_url(args, args.state_metrics_port)}/metrics"
                if stop_tritonserver(process, lambda: requests_in_flight(state_url)):
                    print(f"hift-serve: tritonserver waited for a request its model had answered (a client closed "
                          f"the request's gRPC call under it); stopped it after {HELD_REQUEST_S:g} s instead of its "
                          f"30 s exit timeout", file=sys.stderr, flush=True)
            elif not stopping:
                text = log_file.read_text(errors="replace") if log_file.is_file() else ""
                why = load_failure(text, wire.MODEL_NAME)
                failed_log = log_file  # kept for the reader
                killed = dead_model is not None and (why is None or STUB_UNHEALTHY in why)
                if killed:  # it did not raise: it was killed (out of memory, a signal), and Triton gave it up
                    print(died_before_ready(dead_model, log_file, why), file=sys.stderr)
                elif why:  # the model's own message (a bad export, no CUDA, ...): what to fix, in one line
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




def stop_tritonserver(process: subprocess.Popen, in_flight: Callable[[], int | None], timeout_s: float = 60.0,
                      held_s: float = HELD_REQUEST_S) -> bool:
    """Stop ``tritonserver`` (SIGTERM: it waits for its requests, unloads the model, exits); killed after
    ``timeout_s``, or once its model has answered every request it was handed (``in_flight()`` 0; None: unknown) for
    ``held_s``: Triton then holds a request whose gRPC call a client closed after its last response, and would wait
    out its exit timeout (its model's finalize is not run in either case). True where it was killed for that."""
    import time

    process.terminate()
    started, answered_since, held = time.monotonic(), None, False
    while process.poll() is None and not held and time.monotonic() - started <= timeout_s:
        now = time.monotonic()
        answered_since = (now if answered_since is None else answered_since) if in_flight() == 0 else None
        held = answered_since is not None and now - answered_since >= held_s
        if not held:
            time.sleep(0.2)
    if process.poll() is None:
        process.kill()
    process.wait()
    return held


def requests_in_flight(metrics_url: str) -> int | None:
    """The model's requests not yet sent their final reply, from its state metrics (None: they do not answer)."""
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url, timeout=0.5) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException, UnicodeDecodeError):  # unloading: the endpoint is going away
        return None
    for line in text.splitlines():
        if line.startswith(wire.REQUESTS_IN_FLIGHT_METRIC + " "):
            return int(float(line.split()[1]))
    return None


def died_before_ready(pid: int, log_file: Path, triton_says: str | None = None) -> str:
    """The one-line error for a model process that died before its model was ready without raising an error (killed
    or crashed): what Triton said, and its log (kept)."""
    return (f"hift-serve: error: the model process (pid {pid}, Triton's Python-backend stub) died before the model "
            f"was ready, while it opened the export or warmed up, without an error of its own (killed or crashed, as "
            f"when memory runs out){f'; Triton: {triton_says}' if triton_says else ''} (tritonserver's log: {log_file})")


def _watch(process: subprocess.Popen, folder: Path, stopping: list[int], announce: Callable[[], None],
           model_ready: Callable[[], bool]) -> tuple[bool, int | None]:
    """Watch ``tritonserver`` until it exits, a stop is asked, or its model process dies: ``announce()`` once the
    model answers ready; whether it did, and the pid of a model process found dead (None: none)."""
    import time

    from .supervision import process_alive
    from .triton_python import model_pid

    announced, dead_model = False, None
    while process.poll() is None and not stopping:
        if not announced and model_ready():
            announce()
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
    return announced, dead_model


if __name__ == "__main__":
    sys.exit(main())
