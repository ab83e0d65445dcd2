"""The compiled engine's first start: its step graphs compiled in processes side by side, into inductor's on-disk
cache, before :meth:`~hift_torch.compiled.CompiledBackend.warmup` loads them from it.

Compiled in turn, the step graphs take most of a cold start; side by side in processes they take about the longest
one's time (BENCHMARKS.md, decision log). A compile's cache entry is keyed by its graph and its inputs' shapes, so a
worker builds the same backend as the engine (precision, device cache slots, windows) and compiles its shape as
warmup would (:meth:`~hift_torch.compiled.CompiledBackend.compile_shape`). Meanwhile the starting process does what
needs no compiled graph (its threads choose cuDNN's algorithms for the shapes it will capture), and loads each
worker's graph from the cache as soon as that worker is done, while the others still compile.

Once a warmup has finished, a marker in inductor's cache folder (:func:`warm_marker`) says the cache holds this
engine's graphs: later starts skip the workers (they would only load the cache a second time). Side by side is an
optimisation only: a worker that fails is reported and its shape compiled by the warmup itself. Each worker holds a
CUDA context, the model and the device cache pool (1.2 GB at 2 048 slots) while it compiles: on a small GPU, set
``CompiledOptions(compile_processes=1)`` (in turn, in the process).

One worker (what the engine runs, :mod:`.compile_worker`; not a user command)::

    python -m hift_torch.compile_worker --artifacts DIR --precision fp16 --slots 2048 --device cuda:0 \\
        --final-window on --step-window off --shape generator:24
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Device memory one worker is given room for at warmup (a worker was seen holding 3.05 GiB: its CUDA context, the
# model, the cache pool at 2 048 slots), so the starting process's cuDNN threads leave it free.
WORKER_DEVICE_BYTES = 5 << 30

# Source files whose code shapes the compiled graphs: a change in them makes the marker stale (inductor's own keys
# change with the graphs; the marker must not claim a warm cache that no longer matches).
_GRAPH_SOURCES = ("hift_model/step.py", "hift_model/layers.py", "hift_model/generator.py",
                  "hift_model/spectral_ops.py", "hift_torch/compiled.py", "hift_torch/capture.py")


def python_executable() -> str:
    """This interpreter, to start a worker with; inside a process that embeds Python (Triton's Python-backend stub,
    where ``sys.executable`` may name the stub binary) the ``python3`` on ``PATH`` (hift-serve puts its own first)."""
    if sys.executable and Path(sys.executable).name.startswith("python"):
        return sys.executable
    return shutil.which("python3") or sys.executable


def compile_units(step_sizes: tuple[int, ...], final_frames: int) -> list[tuple[str, int]]:
    """The engine's compiles, one a unit: the stream step at each of ``step_sizes``, the final step (its frames: the
    engine's ``final_frames``)."""
    return [("generator", size) for size in step_sizes] + [("final", final_frames)]


def worker_command(backend: Any, kind: str, size: int) -> list[str]:
    """The command that compiles ``backend``'s step ``kind`` of ``size`` frames into the cache, in a new process."""
    return [python_executable(), "-m", "hift_torch.compile_worker", "--artifacts", str(backend.manifest.root),
            "--precision", backend.precision, "--slots", str(backend.cache_slots), "--device", str(backend.device),
            "--final-window", "on" if backend.final_window_frames else "off",
            "--step-window", "on" if backend.step_window_frames else "off", "--shape", f"{kind}:{size}"]


def error_line(stderr: str, limit: int = 600) -> str:
    """A failed process's error, from a traceback's last unindented line (``Type: message``) on, at most ``limit``
    characters: the head of a long message says what ran out (CUDA's "Tried to allocate ..."), its tail does not."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    unindented = [line for line in lines if not line[0].isspace() and not line.startswith("Traceback")]
    line = (unindented or lines or ["no error output"])[-1]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def compile_side_by_side(commands: dict[str, list[str]], processes: int, say: Callable[[str], None],
                         timeout_s: float = 1800.0, when_compiled: Callable[[str], None] | None = None
                         ) -> dict[str, float | None]:
    """Run each command (a worker) in a process of its own, at most ``processes`` at a time; the seconds each took,
    None for one that failed (said with its error line, :func:`error_line`: the warmup then compiles that shape itself).
    ``when_compiled(name)`` runs in the calling thread as each worker succeeds, while the others go on (what it
    raises is said, not raised: loading a graph early is an optimisation of the start, not part of it)."""
    started = time.perf_counter()

    def run(name: str) -> float | None:
        t0 = time.perf_counter()
        try:
            done = subprocess.run(commands[name], capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            say(f"warmup: compiling {name} in a process of its own failed ({exc}); the warmup compiles it")
            return None
        if done.returncode != 0:
            say(f"warmup: compiling {name} in a process of its own failed (exit {done.returncode}: "
                f"{error_line(done.stderr)}); the warmup compiles it")
            return None
        seconds = time.perf_counter() - t0
        say(f"warmup: {name} compiled in a process of its own ({seconds:.0f} s; "
            f"{time.perf_counter() - started:.0f} s since the first)")
        return seconds

    with concurrent.futures.ThreadPoolExecutor(max(1, processes)) as pool:
        futures = {pool.submit(run, name): name for name in commands}
        for future in concurrent.futures.as_completed(futures):
            if when_compiled is not None and future.result() is not None:
                try:
                    when_compiled(futures[future])
                except Exception as exc:  # noqa: BLE001 - reported; the warmup makes the call again after
                    say(f"warmup: the first call of {futures[future]} beside the workers failed "
                        f"({type(exc).__name__}: {exc}); the workers go on")
        return {name: future.result() for future, name in futures.items()}


def precompile(backend: Any, step_sizes: tuple[int, ...], say: Callable[[str], None],
               when_compiled: Callable[[str, int], None] | None = None) -> Path:
    """Unless the marker says the cache is warm: ``backend``'s step graphs (the stream step at ``step_sizes``, the
    final step) compiled side by side in ``backend.compile_processes`` workers, the marker written when all of them
    succeeded; ``when_compiled(kind, size)`` (the warmup's first call of that graph: dynamo's load of it) runs in
    this thread as each worker is done. Under a lock in the cache folder: of several processes starting at once
    (``hift-serve --processes``), one compiles, the others wait and then find the marker. The marker's path (the
    warmup writes it too, at its end)."""
    import fcntl

    marker = warm_marker(backend, step_sizes)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        lock = open(marker.parent / "compile.lock", "a")  # noqa: SIM115 - held across the compiles
    except OSError as exc:
        say(f"warmup: inductor's cache folder is not writable ({exc}): compiling in turn")
        return marker
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return marker
        units = compile_units(backend.generator_graph_sizes(step_sizes), backend.final_frames)
        say(f"warmup: a first start: compiling {len(units)} step graphs in {backend.compile_processes} processes "
            f"side by side into inductor's cache (minutes)")
        named = {f"{kind}:{size}": (kind, size) for kind, size in units}
        seconds = compile_side_by_side({name: worker_command(backend, *unit) for name, unit in named.items()},
                                       backend.compile_processes, say,
                                       when_compiled=None if when_compiled is None else
                                       lambda name: when_compiled(*named[name]))
        if all(value is not None for value in seconds.values()):
            marker.touch()
    return marker


def compiles_side_by_side(backend: Any) -> bool:
    """Whether ``backend``'s warmup compiles its step graphs in worker processes (unless the cache is warm)."""
    return bool(backend.compiled) and backend.compile_processes > 1


def workers_device_bytes(backend: Any, step_sizes: tuple[int, ...]) -> int:
    """The device memory a start's compile workers will hold beside its warmup: none where the marker says the cache
    is warm or the engine compiles in turn, else :data:`WORKER_DEVICE_BYTES` for each worker running at once."""
    if not compiles_side_by_side(backend) or warm_marker(backend, step_sizes).exists():
        return 0
    units = len(compile_units(backend.generator_graph_sizes(step_sizes), backend.final_frames))
    return min(units, backend.compile_processes) * WORKER_DEVICE_BYTES


def warm_marker(backend: Any, step_sizes: tuple[int, ...]) -> Path:
    """The file whose presence says inductor's cache holds ``backend``'s compiled graphs (written after a warmup):
    in inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``), named by a hash of what the graphs depend on (torch's
    version, the device's architecture, the precision, layout and step sizes, the model's config and step contract,
    the code that builds the graphs). Not the cache slots: the graphs take the pool's rows as a dynamic size, so one
    cache serves every slot count."""
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(__file__).resolve().parent.parent
    code = hashlib.sha256()
    for name in _GRAPH_SOURCES:
        path = root / name
        code.update(path.read_bytes() if path.exists() else name.encode())
    device = backend.device
    arch = torch.cuda.get_device_capability(device) if device.type == "cuda" else "cpu"
    what = {"torch": torch.__version__, "arch": str(arch), "precision": backend.precision,
            "conv_layout": backend.conv_layout,
            "step_sizes": list(step_sizes), "final_window": backend.final_window_frames,
            "step_window": backend.step_window_frames,
            "config": backend.manifest.config, "step": backend.manifest.step, "code": code.hexdigest()}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return Path(cache_dir()) / "hift" / f"compiled-{key}.warm"
