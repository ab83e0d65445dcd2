"""``hift-serve --processes N``: N server processes on one machine, each a whole ``hift-serve`` (its own Triton and
runtime, sharing the GPU), supervised by this one: one command, one ready line, one SIGTERM.

Why: one server process's requests per second are bounded whatever the cores (Triton's Python-backend stub does its
per-request IPC under the process's GIL, beside the runtime's own Python; BENCHMARKS.md). Several processes multiply
that. A stream's state lives in the process that started it, so clients
shard streams by id over the processes' gRPC addresses (``ShardedClient``, or a load balancer hashing the
``hift-stream-id`` header), as they do over several hosts.

Process ``i`` listens on every port given plus ``i * PORT_STRIDE`` (defaults: 8000-8003, 8010-8013, ...), opens at
most ``ceil(max_streams / N)`` streams, and writes Triton's log to ``--triton-log`` with ``.i`` appended. The
processes start one after another, each once the one before is ready: a warmup sizes its work by the device memory
it finds free (two at once each found all of it and ran an 80 GB GPU out), and the later ones load the first one's
compiles from inductor's cache. A process that dies once all were ready is started again (its streams are
lost; the others' go on); every process, its Triton and its model process die with this supervisor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from typing import Any

from . import wire
from .server_cli import busy_port
from .supervision import dies_with_parent, stop_processes, stop_signals_recorded

PORT_STRIDE = 10
PORT_OPTIONS = ("--grpc-port", "--http-port", "--metrics-port", "--state-metrics-port")


def port_of(args: argparse.Namespace, option: str, i: int) -> int:
    """Process ``i``'s port for ``option`` (one of :data:`PORT_OPTIONS`)."""
    return getattr(args, option[2:].replace("-", "_")) + i * PORT_STRIDE


def process_argv(args: argparse.Namespace, argv: list[str], i: int, processes: int) -> list[str]:
    """Process ``i``'s hift-serve options: the supervisor's, with its own ports, stream share and Triton log (later
    options win in argparse, so they are appended)."""
    own = ["--processes", "1"]
    for option in PORT_OPTIONS:
        own += [option, str(port_of(args, option, i))]
    if args.max_streams is not None:
        own += ["--max-streams", str(-(-args.max_streams // processes))]
    if args.triton_log:
        own += ["--triton-log", f"{args.triton_log}.{i}"]
    return [*argv, *own]


def ports_of(args: argparse.Namespace, processes: int) -> dict[str, int]:
    """Every port the processes will listen on, named by option and process (for the busy-port check)."""
    return {f"{option}{f' + {i * PORT_STRIDE} (process {i})' if i else ''}": port_of(args, option, i)
            for i in range(processes) for option in PORT_OPTIONS}


# A process that dies once every process was ready is started again at most this many times in all (a crash loop
# then stops the server); one that dies before it was ready stops the server at once (its start is broken).
MAX_RESTARTS = 5


def serve_processes(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.processes`` hift-serve processes, each once the one before is ready, relay their lines (prefixed
    ``[i]``), say one ready line once every one is ready, pass SIGTERM/Ctrl-C on. A process that dies after that is
    started again on its own ports (its streams are lost: their clients are refused; the other processes' streams go
    on); one that dies before it was ready stops every process, and its status is returned. Every process dies with
    this supervisor."""
    n = args.processes
    ready = [threading.Event() for _ in range(n)]
    children: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []

    def start(i: int) -> subprocess.Popen:
        ready[i] = threading.Event()
        child = subprocess.Popen([sys.executable, "-m", "hift_runtime.server", *process_argv(args, argv, i, n)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                 start_new_session=True,  # our signals reach them through us, in order
                                 preexec_fn=dies_with_parent())
        relays.append(threading.Thread(target=_relay, args=(child.stdout, i, ready[i]), daemon=True))
        relays[-1].start()
        return child

    try:
        with stop_signals_recorded() as stopping:
            children.append(start(0))
            announced, restarts, status = False, 0, 0
            while not stopping:
                if len(children) < n and ready[len(children) - 1].is_set():
                    children.append(start(len(children)))
                dead = next((i for i, c in enumerate(children) if c.poll() is not None), None)
                if dead is not None:
                    code = children[dead].returncode
                    if not announced or not ready[dead].is_set() or restarts >= MAX_RESTARTS:
                        status = code or 1
                        why = ("before every process was ready" if not announced else
                               "before it was ready again" if not ready[dead].is_set() else
                               f"after {restarts} restarts")
                        print(f"hift-serve: error: process {dead} exited with status {code} {why}; stopping the "
                              f"others", file=sys.stderr, flush=True)
                        break
                    restarts += 1
                    print(f"hift-serve: error: process {dead} exited with status {code}; the streams it held are "
                          f"lost; starting it again (the other processes serve on)", file=sys.stderr, flush=True)
                    ports = {option: port_of(args, option, dead) for option in PORT_OPTIONS}
                    deadline = time.monotonic() + 30  # its tritonserver and model process go with it
                    while busy_port(args.host, ports) and time.monotonic() < deadline and not stopping:
                        time.sleep(0.2)
                    children[dead] = start(dead)
                if not announced and all(e.is_set() for e in ready):
                    print(processes_ready_line(args, n), flush=True)
                    announced = True
                time.sleep(0.2)
            stop_processes(children, timeout_s=90)
            for relay in relays:
                relay.join(timeout=5)
            return status
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()


def _relay(lines: Any, i: int, ready: threading.Event) -> None:
    """Process ``i``'s lines to this process's stdout, prefixed with its number; its ready line sets ``ready``."""
    for line in lines:
        sys.stdout.write(f"[{i}] {line}")
        sys.stdout.flush()
        if "' ready (" in line:  # (after its line: the next process's lines come after it)
            ready.set()


def processes_ready_line(args: argparse.Namespace, n: int) -> str:
    grpc = ", ".join(f"{args.host}:{port_of(args, '--grpc-port', i)}" for i in range(n))
    return (f"hift-serve: model {wire.MODEL_NAME!r} ready in {n} processes: gRPC {grpc} (HTTP, metrics and server "
            f"state at each port + {PORT_STRIDE} x the process number, as in the lines above); every stream must reach the "
            f"process that started it: ShardedClient([...these gRPC addresses...]) or a load balancer hashing the "
            f"'hift-stream-id' header")
