"""``hift-serve`` when its own processes die (CPU, reduced model, the default front end): a dead model process stops
the server in one line and readiness with it; ``kill -9`` of hift-serve takes tritonserver and the model along and
the next server starts on the same ports; with ``--processes 2`` a dead process is started again while the other
one's streams go on; a chunk resent after a client timeout is applied once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from hift_runtime.supervision import OWNER_FILE, process_alive

from .conftest import ROOT, max_abs
from .test_serve import SERVED_TOLERANCE, _all_free, _chunks, _free_ports, _mel

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process supervision is Linux's")


def _ports(processes: int = 1) -> list[int]:
    while True:
        ports = _free_ports(4)
        if _all_free([p + 10 * i for p in ports for i in range(1, processes)]):
            return ports


def _start(artifacts: Path, ports: list[int], log: Path, *options: str, opener: str | None = None) -> subprocess.Popen:
    """hift-serve on ``ports``; ``opener``: the model process opens the runtime with this ``module:function``."""
    http, grpc, metrics, state = ports
    launcher = ["-m", "hift_runtime.server"] if opener is None else [
        "-c", f"import sys; from hift_runtime import server; server.PYTHON_BACKEND_OPENER = {opener!r}; "
              f"sys.exit(server.main(sys.argv[1:]))"]
    cmd = [sys.executable, *launcher, "--artifacts", str(artifacts), "--device", "cpu",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--state-metrics-port", str(state), "--max-batch", "8", "--max-streams", "16", *options]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _model_pid(supervisor: int) -> int:
    """The model process (Triton's Python-backend stub) of the hift-serve process ``supervisor``."""
    for folder in Path(tempfile.gettempdir()).glob("hift-serve-*"):
        try:
            if int((folder / OWNER_FILE).read_text()) == supervisor:
                return int((folder / "model.pid").read_text())
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no model pid for hift-serve {supervisor}")


def _ready(http: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/hift_vocoder/ready", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def cpu(small_artifacts):
    from hift_runtime import open_vocoder

    with open_vocoder(small_artifacts.out, device="cpu") as v:
        yield v


def test_killed_server_takes_its_children_along_and_a_dead_model_stops_the_next(small_artifacts, tmp_path, cpu):
    """kill -9 of hift-serve takes its Triton and model along; the next server starts on the same ports (and answers
    a resent chunk from what it made); its model process killed, it stops in one line and its client is told."""
    pytest.importorskip("pytriton", reason="hift-serve needs the [serve] extra (nvidia-pytriton)")
    from hift_runtime.client import ServerClient
    from hift_runtime.wire import ServerError

    ports = _ports()
    first = _start(small_artifacts.out, ports, tmp_path / "first.log")
    try:
        _wait_for(lambda: "ready (" in (tmp_path / "first.log").read_text() or first.poll() is not None, 120,
                  "the first server ready")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-2000:]
        tritonserver, model = _children(first.pid), _model_pid(first.pid)
        assert tritonserver and process_alive(model)
        first.kill()  # kill -9: no handler runs in hift-serve
        first.wait()
        _wait_for(lambda: not any(map(process_alive, [*tritonserver, model])) and _all_free(ports), 15,
                  "tritonserver and the model process gone, every port free")
    finally:
        _stop(first)
    stale = [f for f in Path(tempfile.gettempdir()).glob("hift-serve-*")
             if (f / OWNER_FILE).is_file() and (f / OWNER_FILE).read_text() == str(first.pid)]
    assert stale, "the killed server's folder is expected to be left until the next start"

    second = _start(small_artifacts.out, ports, tmp_path / "second.log")
    try:
        _wait_for(lambda: "ready (" in (tmp_path / "second.log").read_text() or second.poll() is not None, 120,
                  "a server on the same ports ready")
        assert second.poll() is None, (tmp_path / "second.log").read_text()[-2000:]
        assert not any(f.exists() for f in stale), "the stale folder was not removed"
        _resent_chunks_are_applied_once(ports, cpu)
        client = ServerClient(f"127.0.0.1:{ports[1]}")
        mel = _mel(np.random.default_rng(5), 40)
        stream = client.stream("before-the-death")
        stream.push(mel[:, :20])
        os.kill(_model_pid(second.pid), signal.SIGKILL)
        assert second.wait(timeout=15) == 1
        log = (tmp_path / "second.log").read_text()
        errors = [line for line in log.splitlines() if line.startswith("hift-serve: error:")]
        assert len(errors) == 1 and "the model process" in errors[0] and "died" in errors[0], log[-2000:]
        assert not _ready(ports[0]) and _all_free(ports)
        with pytest.raises(ServerError):  # its client is told: the server is gone, not wrong audio
            stream.push(mel[:, 20:], end=True)
    finally:
        _stop(second)


def test_a_model_process_dead_before_ready_stops_the_server_naming_its_log(small_artifacts, tmp_path):
    """The model process dies while it opens the runtime (as a warmup out of device memory can kill it): hift-serve
    stops in one error that says so and names tritonserver's log, which it keeps; nothing is left listening."""
    pytest.importorskip("pytriton", reason="hift-serve needs the [serve] extra (nvidia-pytriton)")
    ports = _ports()
    server = _start(small_artifacts.out, ports, tmp_path / "server.log", opener="tests.dying_opener:die_while_opening")
    try:
        assert server.wait(timeout=120) == 1
    finally:
        _stop(server)
    log = (tmp_path / "server.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("hift-serve: error:")]
    assert len(errors) == 1, log[-3000:]
    assert "the model process" in errors[0] and "died before the model was ready" in errors[0], errors[0]
    assert "streams it held" not in errors[0], errors[0]
    kept = [Path(word.strip("():")) for word in errors[0].split() if word.strip("():").endswith("triton.log")]
    assert kept and kept[0].is_file(), errors[0]  # the log it names is kept for the reader
    assert not _ready(ports[0]) and _all_free(ports)
    shutil.rmtree(kept[0].parent, ignore_errors=True)


def test_a_dead_process_of_several_is_started_again_and_the_other_streams_go_on(small_artifacts, tmp_path, cpu):
    pytest.importorskip("pytriton", reason="hift-serve needs the [serve] extra (nvidia-pytriton)")
    from hift_runtime.client import ServerClient

    ports = _ports(2)
    log = tmp_path / "serve.log"
    supervisor = _start(small_artifacts.out, ports, log, "--processes", "2")
    try:
        _wait_for(lambda: "ready in 2 processes" in log.read_text() or supervisor.poll() is not None, 180,
                  "two processes ready")
        assert supervisor.poll() is None, log.read_text()[-2000:]
        survivor = ServerClient(f"127.0.0.1:{ports[1]}")
        mel = _mel(np.random.default_rng(6), 60)
        parts = _chunks(mel, 20)
        stream = survivor.stream("on-process-0")
        audio = [stream.push(parts[0])]
        children = _children(supervisor.pid)
        dead = next(c for c in children if f"--grpc-port {ports[1] + 10}" in
                    " ".join(Path(f"/proc/{c}/cmdline").read_text().split("\0")))
        its_triton = _children(dead)
        os.kill(dead, signal.SIGKILL)
        _wait_for(lambda: log.read_text().count("' ready (") >= 3 or supervisor.poll() is not None, 120,
                  "process 1 ready again")
        assert supervisor.poll() is None, log.read_text()[-2000:]
        assert "process 1 exited with status -9; the streams it held are lost; starting it again" in log.read_text()
        assert not any(map(process_alive, its_triton))
        audio += [stream.push(parts[1]), stream.push(parts[2], end=True)]  # process 0's stream was not cut
        assert max_abs(np.concatenate(audio), cpu.vocode(mel)) <= SERVED_TOLERANCE
        restarted = ServerClient(f"127.0.0.1:{ports[1] + 10}")
        assert max_abs(restarted.stream("on-process-1").push(mel, end=True), cpu.vocode(mel)) <= SERVED_TOLERANCE
    finally:
        _stop(supervisor)
    assert supervisor.returncode == 0


def _resent_chunks_are_applied_once(ports: list[int], cpu) -> None:
    """Every reply is lost after the server applied the chunk (what a client timeout does): the client resends the
    chunk with its offset, the server answers from what it made, and the stream equals the offline pass."""
    from hift_runtime.client import ServerClient

    client = ServerClient(f"127.0.0.1:{ports[1]}", retries=1)
    send, sent = client._client.infer, []

    def reply_lost(*args, **kwargs):
        sent.append(send(*args, **kwargs))  # the server applied it; its reply never reaches the client
        if len(sent) % 2:
            raise TimeoutError("Deadline Exceeded")
        return sent[-1]

    client._client.infer = reply_lost
    mel = _mel(np.random.default_rng(7), 90)
    stream = client.stream("impatient")
    audio = np.concatenate([stream.push(part, end=k == 2) for k, part in enumerate(_chunks(mel, 30))])
    assert len(sent) == 6 and max_abs(audio, cpu.vocode(mel)) <= SERVED_TOLERANCE
    state = urllib.request.urlopen(f"http://127.0.0.1:{ports[3]}/metrics", timeout=10).read().decode()
    resends = sum(float(line.rsplit(" ", 1)[1]) for line in state.splitlines()
                  if line.startswith("hift_resends_replayed"))
    assert resends == 3
