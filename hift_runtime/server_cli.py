"""``hift-serve``'s options: the parser (what a deployer sets), their checks, and the lines and addresses derived
from them; read by the supervisor, each server process and the model inside Triton alike."""

from __future__ import annotations

import argparse
import socket

from . import wire
from .argparsing import OneLineArgumentParser, gpu_ids
from .options import DEVICES, ENGINES, PRECISIONS
from .serving import MAX_CHUNK_FRAMES


def parser() -> argparse.ArgumentParser:
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
    p.add_argument("--device", choices=DEVICES, default="auto", help="generator device (default auto)")
    p.add_argument("--gpus", type=gpu_ids, default=None,
                   help="CUDA device ids to serve on, e.g. 0,1: one engine per GPU, each new stream on the "
                        "least-loaded GPU and pinned there (default: every visible GPU)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default): the compiled engine on a CUDA device when torch with CUDA is installed, "
                        "else ONNX Runtime; ort; compiled (torch.compile and CUDA graphs; compiles at start)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default, TF32 off: parity), tf32, fp16 (compiled engine only); their distances and "
                        "capacities in BENCHMARKS.md")
    p.add_argument("--max-batch", type=int, default=64,
                   help="most requests in one Triton batch, and streams in one batched step (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=2.0,
                   help="how long the step batcher waits for more streams (default 2 ms)")
    p.add_argument("--processes", type=int, default=1,
                   help="server processes on this machine, each its own Triton and runtime on the same device(s), "
                        "process i on every port + 10 x i; clients shard streams by id over their gRPC addresses "
                        "(default 1; on a GPU with the compiled engine use 3); a process that dies once all were "
                        "ready is started again, its streams lost")
    p.add_argument("--max-streams", type=int, default=None,
                   help="open streams at most; a start beyond it is refused with an overload message (default: what "
                        "the device holds: its cache slots on the GPU; on the CPU what its cores keep in real time, "
                        "measured at start, within a quarter of the free memory)")
    p.add_argument("--max-chunk-frames", type=int, default=MAX_CHUNK_FRAMES,
                   help=f"the longest chunk one request may carry, in frames (default {MAX_CHUNK_FRAMES}: 20 s)")
    p.add_argument("--idle-timeout-s", type=float, default=60.0,
                   help="a stream idle this long is released (default 60 s)")
    p.add_argument("--noise-seed", type=int, default=0, help="seed of the generated noise table (default 0)")
    p.add_argument("--phase", choices=["upstream", "wrapped"], default="upstream",
                   help="carried phase: upstream (default, bit-faithful) or wrapped (more accurate on long streams)")
    p.add_argument("--audio-pieces", action="store_true",
                   help="answer each chunk with each step's audio as soon as it is made (a decoupled model: "
                        "gRPC streaming clients only; HTTP clients are refused)")
    p.add_argument("--triton-log", help="Triton's own log file (default: a file in the temp folder, path printed)")
    return p


def invalid(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed options' values, in one line; None when nothing is."""
    if (args.max_batch < 1 or args.max_wait_ms < 0 or args.max_chunk_frames < 1 or args.processes < 1
            or (args.max_streams is not None and args.max_streams < 1)):
        return "--max-batch, --processes, --max-streams and --max-chunk-frames must be >= 1, --max-wait-ms >= 0"
    return None


def busy_port(host: str, ports: dict[str, int]) -> str | None:
    """The first of ``ports`` that cannot be bound on ``host`` (Triton would fail on it later and less clearly), as a
    message naming the option; None when all are free."""
    for option, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                return f"{option} {port}: cannot listen on {host}:{port} ({exc.strerror}); pick another port"
    return None


def local_url(args: argparse.Namespace, port: int) -> str:
    """An HTTP endpoint of this server on ``port`` as this machine reaches it (a wildcard ``--host`` is reached on
    the loopback)."""
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return f"http://{f'[{local}]' if ':' in local else local}:{port}"


def local_http_url(args: argparse.Namespace) -> str:
    """Triton's HTTP endpoint as this machine reaches it."""
    return local_url(args, args.http_port)
