"""The runtime inside Triton's own Python backend: the model repository ``hift-serve`` writes, the ``tritonserver``
(the one PyTriton ships) it launches over it, and the model class Triton runs (:class:`TritonPythonModel`): Triton
hands each batch to the stream table in the model process itself, no process hop between them (BENCHMARKS.md,
decision log: the PyTriton proxy front end it replaced). ``hift-serve`` supervises the model process (ready line,
SIGTERM, exit status).
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import wire
from .arrays import concat_rows
from .serving import ChunkReply, chunk_request, reply_tensors
from .supervision import dies_with_parent

log = logging.getLogger("hift_runtime.triton_python")
# What opens the runtime and its stream table from hift-serve's parsed options (``hift_runtime.server.open_table``).
OPENER = "hift_runtime.server:open_table"

MODEL_PY = """# Written by hift-serve (hift_runtime.triton_python): Triton's Python backend loads this file.
import sys

sys.path[:0] = {paths!r}
from hift_runtime.triton_python import TritonPythonModel  # noqa: E402,F401  (the class Triton looks up)
"""


def coalesce_pieces(replies: list[tuple[Any, ChunkReply, bool]]) -> list[tuple[Any, ChunkReply, bool]]:
    """Replies waiting to be sent, as ``(sender, reply, final)``, with each request's pieces that queued up one after
    another joined into one piece, and its final reply joined to them unless it carries an error (sent after them, as
    it is): fewer round trips to tritonserver under load, the same audio in the same order for each request."""
    out: list[list[Any]] = []  # [sender, audio pieces, final, reply]
    open_piece: dict[int, list[Any]] = {}  # a request's piece still taking the pieces after it
    for sender, reply, final in replies:
        entry = open_piece.get(id(sender))
        if entry is not None and not (final and reply.error):
            entry[1].append(reply.audio)
            if final:  # the request's last response, carrying the pieces that waited with it
                entry[2] = True
                del open_piece[id(sender)]
            continue
        entry = [sender, [reply.audio], final, reply]
        out.append(entry)
        if final:
            open_piece.pop(id(sender), None)
        else:
            open_piece[id(sender)] = entry
    return [(sender, reply if len(audio) == 1 else ChunkReply(concat_rows(audio)), final)
            for sender, audio, final, reply in out]


# With --audio-pieces, a request's pieces after its first are sent joined this long before a client playing from the
# first could reach them: fewer sends (BENCHMARKS.md, decision log), yet within a chunk's first-audio bound.
PIECES_AHEAD_S = 0.150


class PiecePacer:
    """Holds a request's pieces after its first until ``ahead_s`` before a client that starts playing at the first
    one could reach them, then sends them joined: fewer sends for a long chunk, whose steps run faster than real
    time. The first piece and the final reply go at once (the final carrying what is held). Keyed by sender; a
    request's state ends with its final reply. Not thread-safe: one replier thread's."""

    def __init__(self, rate: int, ahead_s: float) -> None:
        self.rate, self.ahead_s = rate, ahead_s
        self._requests: dict[int, list[Any]] = {}  # id(sender) -> [sender, first sent at, samples sent, held audio]
        # (due, id(sender)) of requests holding audio, due first: a wake looks at what is due, not at every request.
        # An entry whose request ended, or sent its held audio since, is stale and skipped.
        self._due_first: list[tuple[float, int]] = []

    def take(self, replies: list[tuple[Any, ChunkReply, bool]], now: float) -> list[tuple[Any, ChunkReply, bool]]:
        """What to send now of ``replies`` (in a lane's order, already joined by :func:`coalesce_pieces`) and of
        what is held and due."""
        out: list[tuple[Any, ChunkReply, bool]] = []
        for sender, reply, final in replies:
            state = self._requests.get(id(sender))
            if final:
                held = self._requests.pop(id(sender))[3] if state is not None else []
                if held and reply.error:
                    out.append((sender, ChunkReply(concat_rows(held)), False))
                elif held:
                    reply = ChunkReply(concat_rows([*held, reply.audio]))
                out.append((sender, reply, True))
            elif state is None:
                self._requests[id(sender)] = [sender, now, reply.audio.shape[0], []]
                out.append((sender, reply, False))
            else:
                if not state[3]:
                    heapq.heappush(self._due_first, (self._due(state), id(sender)))
                state[3].append(reply.audio)
        while self._due_first and self._due_first[0][0] <= now:
            due, key = heapq.heappop(self._due_first)
            state = self._requests.get(key)
            if state is not None and state[3] and self._due(state) == due:
                audio = concat_rows(state[3])
                state[2], state[3] = state[2] + audio.shape[0], []
                out.append((state[0], ChunkReply(audio), False))
        return out

    def wait_s(self, now: float) -> float | None:
        """How long until held pieces are due (None: nothing held)."""
        while self._due_first:
            due, key = self._due_first[0]
            state = self._requests.get(key)
            if state is not None and state[3] and self._due(state) == due:
                return max(0.0, due - now)
            heapq.heappop(self._due_first)
        return None

    def _due(self, state: list[Any]) -> float:
        return state[1] + state[2] / self.rate - self.ahead_s


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


def _tensor(name: str, dtype: str, dims: list[int], ragged: bool = False, optional: bool = False) -> str:
    extra = (" allow_ragged_batch: true" if ragged else "") + (" optional: true" if optional else "")
    return f'  {{ name: "{name}" data_type: {dtype} dims: {dims}{extra} }}'


def model_config(model_name: str, *, in_channels: int, max_batch: int, argv: list[str],
                 opener: str = OPENER, pid_file: str = "", decoupled: bool = False) -> str:
    """The model's ``config.pbtxt``: the wire contract's tensors (:mod:`.wire`), Triton's dynamic batcher, one
    instance (one runtime: its streams' state lives in it), hift-serve's options for the model to open with, and
    the function that opens it (``module:function``; a benchmark's stand-in device names its own), and the file the
    model writes its process id into (hift-serve watches that process); ``decoupled``: several responses a request
    (``--audio-pieces``). Triton's
    batcher takes what is queued without waiting (``--max-wait-ms`` is the step batcher's, in the options)."""
    inputs = [_tensor(wire.STREAM_ID, "TYPE_STRING", [1]),
              _tensor(wire.MEL, "TYPE_FP32", [in_channels, -1], ragged=True),  # chunks of any length in one batch
              _tensor(wire.START, "TYPE_BOOL", [1]), _tensor(wire.END, "TYPE_BOOL", [1]),
              _tensor(wire.OFFSET, "TYPE_INT64", [1], optional=True)]
    outputs = [_tensor(wire.AUDIO, "TYPE_FP32", [-1]), _tensor(wire.SAMPLES, "TYPE_INT64", [1]),
               _tensor(wire.SAMPLE_RATE, "TYPE_INT32", [1]), _tensor(wire.ERROR, "TYPE_STRING", [1]),
               _tensor(wire.FINAL, "TYPE_BOOL", [1])]
    return "\n".join([
        f'name: "{model_name}"', 'backend: "python"', f"max_batch_size: {max_batch}",
        # Triton's batcher does not wait: the one instance is busy while a batch steps, and the requests that arrive
        # meanwhile are the next batch (a wait would only delay a lone stream).
        "dynamic_batching { max_queue_delay_microseconds: 0 }",
        "input [", ",\n".join(inputs), "]", "output [", ",\n".join(outputs), "]",
        "instance_group [ { count: 1 kind: KIND_CPU } ]",
        *(["model_transaction_policy { decoupled: true }"] if decoupled else []),
        f"parameters {{ key: \"hift_serve_argv\" value: {{ string_value: {json.dumps(json.dumps(argv))} }} }}",
        f"parameters {{ key: \"hift_serve_opener\" value: {{ string_value: {json.dumps(opener)} }} }}",
        f"parameters {{ key: \"hift_serve_pid_file\" value: {{ string_value: {json.dumps(pid_file)} }} }}", ""])


def write_repository(folder: Path, model_name: str, *, in_channels: int, max_batch: int, argv: list[str],
                     opener: str = OPENER, pid_file: str = "", decoupled: bool = False) -> Path:
    """``folder/<model_name>/{config.pbtxt, 1/model.py}``; returns ``folder``."""
    model = folder / model_name
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(model_config(model_name, in_channels=in_channels, max_batch=max_batch,
                                                     argv=argv, opener=opener, pid_file=pid_file,
                                                     decoupled=decoupled))
    # This interpreter's import path (its venv's site-packages, PYTHONPATH): the stub embeds the same Python but not
    # necessarily the same environment.
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [package_root, *(p for p in sys.path if p and p != package_root and os.path.isdir(p))]
    (model / "1" / "model.py").write_text(MODEL_PY.format(paths=paths))
    return folder


def tritonserver_files(folder: Path) -> tuple[Path, Path, Path]:
    """The ``tritonserver`` binary PyTriton ships, a backends folder holding its Python backend with the stub for
    this interpreter's Python (written into ``folder``), and its bundled libraries' folder."""
    import pytriton

    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"PyTriton has no Python-backend stub for Python {version} ({stub}); use "
                                f"a Python it ships a stub for (a separate venv for the server)")
    backends = folder / "backends"
    shutil.copytree(root / "backends" / "python", backends / "python", dirs_exist_ok=True)
    shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    return root / "bin" / "tritonserver", backends, libs


def launch(args: Any, argv: list[str], in_channels: int, folder: Path, log_file: Path,
           allow_gpu_metrics: bool, opener: str = OPENER) -> subprocess.Popen:
    """Start ``tritonserver`` over a repository written into ``folder``; its own log goes to ``log_file``, and of
    what it and the model print, hift-serve's lines (warmup progress) to this process's stdout, the rest (Triton's
    own console lines) to ``log_file`` (:func:`relay_console`). It dies with this process (and its model process
    with it); the model process writes its id into :func:`model_pid_file`."""
    binary, backends, libs = tritonserver_files(folder)
    repository = write_repository(folder / "models", wire.MODEL_NAME, in_channels=in_channels,
                                  max_batch=args.max_batch, argv=argv, opener=opener,
                                  pid_file=str(model_pid_file(folder)), decoupled=args.audio_pieces)
    env = dict(os.environ)
    shared_libpython_env(env, [str(libs)])
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [str(binary), f"--model-repository={repository}", f"--backend-directory={backends}",
           f"--http-address={args.host}", f"--http-port={args.http_port}", f"--grpc-address={args.host}",
           f"--grpc-port={args.grpc_port}", f"--metrics-address={args.host}", f"--metrics-port={args.metrics_port}",
           f"--allow-gpu-metrics={'true' if allow_gpu_metrics else 'false'}", f"--log-file={log_file}",
           "--exit-on-error=true", "--strict-readiness=true",
           # The model's warmup (compiling, capturing) can take minutes: Triton must not give up on it.
           "--backend-config=python,stub-timeout-seconds=3600"]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True, preexec_fn=dies_with_parent())
    threading.Thread(target=relay_console, args=(process.stdout, log_file), name="tritonserver-console",
                     daemon=True).start()
    return process


def model_pid_file(folder: Path) -> Path:
    """Where the model process (Triton's Python-backend stub) writes its process id as it starts."""
    return folder / "model.pid"


def model_pid(folder: Path) -> int | None:
    """The model process's id, once it has written it."""
    try:
        return int(model_pid_file(folder).read_text())
    except (OSError, ValueError):
        return None


def relay_console(lines: Any, log_file: Path) -> None:
    """hift-serve's own lines (the model's ``hift-serve: ...``) to stdout, every other line to the Triton log."""
    for line in lines:
        if line.startswith("hift-serve"):
            sys.stdout.write(line)
            sys.stdout.flush()
        else:
            with open(log_file, "a") as log:
                log.write(line)


def load_failure(log_text: str, model_name: str) -> str | None:
    """Why Triton could not load the model, from its log (the model's own exception message, without Triton's
    prefix and the traceback), or None when the log does not say."""
    marker = f"failed to load '{model_name}' version 1: "
    for line in log_text.splitlines():
        if marker in line:
            why = line.split(marker, 1)[1].split("\\n\\nAt:", 1)[0].split("\\n", 1)[0].rstrip('"')
            return why.removeprefix("Internal: ")
    return None


def _input(pb: Any, request: Any, name: str) -> np.ndarray | None:
    """A request's input as NumPy (None: an optional input the client did not send)."""
    tensor = pb.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class TritonPythonModel:
    """Triton's Python-backend model (the class ``model.py`` exposes): opens the runtime as hift-serve would (its
    options travel in the config's ``hift_serve_argv``), serves each Triton batch through the stream table."""

    def initialize(self, args: dict[str, str]) -> None:
        import importlib

        import triton_python_backend_utils  # present inside Triton's Python backend only

        from .process_tuning import HANDOFF_SWITCH_INTERVAL_S, keep_freed_memory, tune_garbage_collector
        from .server_cli import parser
        from .server_metrics import serve_state_metrics

        self._pb = triton_python_backend_utils
        sys.setswitchinterval(HANDOFF_SWITCH_INTERVAL_S)
        keep_freed_memory()
        parameters = json.loads(args["model_config"])["parameters"]
        pid_file = parameters.get("hift_serve_pid_file", {}).get("string_value")
        if pid_file:  # first: hift-serve watches this process from its start (warmup included)
            Path(pid_file).write_text(str(os.getpid()))
        options = parser().parse_args(json.loads(parameters["hift_serve_argv"]["string_value"]))
        module, function = parameters["hift_serve_opener"]["string_value"].split(":")
        self.vocoder, self.table = getattr(importlib.import_module(module), function)(options)
        tune_garbage_collector()  # warm: what lives now lives as long as the model
        # Requests handed to this model and those sent their final reply (each written by one thread only).
        self.requests_received = self.requests_answered = 0
        self.state_metrics = serve_state_metrics(self.table, options.state_metrics_port, options.host,
                                                 lambda: self.requests_received - self.requests_answered)
        self.rate = np.array([[self.vocoder.constants.sample_rate]], np.int32)
        self.pieces = options.audio_pieces
        # One replier thread sends every reply, so a request's replies go out in order.
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._replier = threading.Thread(target=self._send_replies, name="hift-replies", daemon=True)
        self._replier.start()

    def execute(self, requests: list[Any]) -> None:
        """Hand the batch to the stream table and return: each request is answered through its response sender when
        its push is done, so Triton gives this instance the next batch while this one steps (batches pipeline in
        one runtime, as the in-process scheduler's pushes do)."""
        pb = self._pb
        chunks = [chunk_request({name: _input(pb, r, name) for name in wire.INPUTS}) for r in requests]
        senders = [r.get_response_sender() for r in requests]
        self.requests_received += len(requests)
        replies = self._replies
        if not self.pieces:
            self.table.submit(chunks, lambda i, reply: replies.put((senders[i], reply, True)))
            return None
        sent = [0] * len(requests)  # samples each request's pieces carried: its final reply carries the rest

        def piece(i: int, audio: np.ndarray) -> None:
            sent[i] += audio.shape[0]
            replies.put((senders[i], ChunkReply(audio), False))

        def reply(i: int, done: ChunkReply) -> None:
            replies.put((senders[i], ChunkReply(done.audio[sent[i]:], done.error), True))

        self.table.submit(chunks, reply, piece)
        return None

    def _send_replies(self) -> None:
        """The replier thread, sending the replies: a send is a blocking round trip to tritonserver, kept off the
        table's event loop (on it, sends took a fifth of the stub's time at K = 384 on two cores and stalled the
        pushes behind them). What queued up while it sent goes out together, each request's waiting pieces as one
        (:func:`coalesce_pieces`); a request's pieces after its first wait until they are due (:class:`PiecePacer`,
        :data:`PIECES_AHEAD_S`)."""
        pb, lane = self._pb, self._replies
        pacer = PiecePacer(int(self.rate[0, 0]), PIECES_AHEAD_S) if self.pieces else None
        stopping = False
        while not stopping:
            try:
                item = lane.get(timeout=pacer.wait_s(time.monotonic()) if pacer is not None else None)
            except queue.Empty:  # held pieces are due
                item = ()
            if item is None:
                break
            items = [item] if item else []
            while True:
                try:
                    item = lane.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                items.append(item)
            replies = coalesce_pieces(items)
            if pacer is not None:
                replies = pacer.take(replies, time.monotonic())
            for sender, reply, final in replies:
                try:
                    sender.send(pb.InferenceResponse(output_tensors=[
                        pb.Tensor(name, value) for name, value in reply_tensors(reply, self.rate, final).items()]),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
                except Exception:  # noqa: BLE001 - that request's loss alone (its client times out)
                    log.exception("a reply could not be sent")
                self.requests_answered += final

    def finalize(self) -> None:
        self._replies.put(None)
        self._replier.join(timeout=30)
        self.state_metrics.shutdown()
        self.table.close()
        self.vocoder.close()
