"""Shared fixtures. Exports run once per session: the fixture checkpoint at full size (what users ship) and a
reduced-width config (same algorithm, 8x fewer channels) for properties that do not need the 20 M-parameter model."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"
SPEC = ROOT.parent / "shared" / "spec"
CHECKPOINT = FIXTURES / "cv3_hift_random.pt"
REFERENCE = FIXTURES / "cv3_reference.npz"

HAVE_FIXTURES = CHECKPOINT.is_file() and REFERENCE.is_file()
# CI sets this: there a missing fixture is a failure, not a skip (every upstream-parity test would vanish silently).
REQUIRE_FIXTURES = os.environ.get("HIFT_REQUIRE_FIXTURES", "") not in ("", "0")
needs_fixtures = pytest.mark.skipif(
    not HAVE_FIXTURES,
    reason=f"upstream fixtures not found at {FIXTURES} (they live in ../shared/fixtures beside the checkout)")

from hift_runtime.metrics import max_abs, snr_db  # noqa: E402,F401 - one max_abs (shape-checked), one SNR


def holds_just_its_values(array: np.ndarray) -> bool:
    """The memory under ``array`` (its base's base..., an array or a bytearray) is exactly its own values: keeping
    it alive keeps nothing else alive (a view would pin a whole step buffer)."""
    root = array
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    return memoryview(root).nbytes == array.nbytes


def run_in_threads(work, args, timeout: float | None = None) -> list:
    """``work(arg)`` for each of ``args``, each in a thread of its own, all at once; the results in order. The first
    error any thread raised is raised here (after every thread ended), so a failing worker fails the test."""

    results: list = [None] * len(args)
    errors: list[BaseException] = []

    def call(i, arg):
        try:
            results[i] = work(arg)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i, arg)) for i, arg in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return results


def pytest_configure(config) -> None:
    import tempfile

    if _is_controller(config):  # the run's exports folder, which ``-n`` workers inherit
        os.environ[_RUN_DIR_ENV] = tempfile.mkdtemp(prefix="hift-test-exports-")
        if getattr(config.option, "numprocesses", None):
            # Each worker takes a core: torch's threads, one a core in every worker, would oversubscribe them.
            os.environ.setdefault("OMP_NUM_THREADS", "1")
    if REQUIRE_FIXTURES and not HAVE_FIXTURES:
        raise pytest.UsageError(f"HIFT_REQUIRE_FIXTURES is set but the upstream fixtures are missing: {CHECKPOINT} "
                                f"and {REFERENCE} must exist (../shared/fixtures beside the checkout)")



@pytest.fixture(scope="session")
def reference() -> dict[str, np.ndarray]:
    if not REFERENCE.is_file():
        pytest.skip(f"{REFERENCE} not found")
    with np.load(REFERENCE) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="session")
def reduced_config():
    from hift_model.config import COSYVOICE3

    return COSYVOICE3.reduced()


# The exports run once per test run, in background processes, into a folder every pytest process of the run shares
# (with ``-n`` the workers ask for them, the first starts each and every one waits for its rc file): WHICH/artifacts,
# WHICH.log, WHICH.rc once it ended, WHICH.pid (the process group) once started.
_RUN_DIR_ENV = "HIFT_TEST_EXPORTS"
_EXPORTS_LOCK = threading.Lock()  # the full-size export may be started from a thread
_EXPORTS_CLOSED = threading.Event()  # set at the session's end: no export starts after it
_EXPORT_ARGS = {"small": ["--reduced"], "full": ["--checkpoint", str(CHECKPOINT)]}
# Set when both exports are needed: a test that has to wait for the reduced export starts the full-size one at once
# (the tests then hold no core: the two exports take one each).
_FULL_WHEN_WAITED = threading.Event()
_STARTED: list = []  # the export processes this process started


def _is_controller(config) -> bool:
    """This process runs the session (a plain run, or the controller of ``-n`` workers), not a worker of it."""
    return not hasattr(config, "workerinput")


def _run_dir() -> Path:
    return Path(os.environ[_RUN_DIR_ENV])


def _exports_needed(item) -> int:
    """0: the test needs no export; 1: the reduced one; 2: the full-size one."""
    names = list(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)  # a test parametrized by export asks for it by name (``which``)
    if callspec is not None and callspec.params.get("which") in _EXPORT_ARGS:
        names.append(f"{callspec.params['which']}_artifacts")
    return 2 if "full_artifacts" in names else 1 if "small_artifacts" in names else 0


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that need no export first (they run while the reduced export does), those on the full-size export
    last (it runs beside the others); the order is otherwise kept."""
    items.sort(key=_exports_needed)


def pytest_collection_finish(session) -> None:
    """Start the exports the collected tests need in background processes as soon as the tests are known. The reduced
    export runs first, beside the tests that need no export; the full-size one starts when it ends, beside the tests
    on the reduced one, or earlier, once a test waits for the reduced one (each export is one busy thread: side by
    side at the start they left the tests nothing to run, one after the other each has a core of its own)."""
    if session.config.option.collectonly:
        return
    ranks = {_exports_needed(item) for item in session.items}
    needed = {which for which, rank in (("small", 1), ("full", 2))
              if rank in ranks and (which == "small" or HAVE_FIXTURES)}
    if needed == {"small", "full"}:
        _start_export("small", threads=1)
        _FULL_WHEN_WAITED.set()

        def full_after_small() -> None:
            _wait_for_export("small")
            _start_export("full", threads=1)

        threading.Thread(target=full_after_small, daemon=True).start()
    else:
        for which in needed:
            _start_export(which)


def pytest_sessionfinish(session) -> None:
    """No export starts after this. The run's controller stops an export no test waited for (the run stopped early, or
    its tests were deselected), so none outlives pytest, and removes the exports (a worker leaves them: another may
    still be testing them)."""
    import shutil
    import signal

    with _EXPORTS_LOCK:
        _EXPORTS_CLOSED.set()
    if not _is_controller(session.config) or _RUN_DIR_ENV not in os.environ:
        return
    for pid_file in _run_dir().glob("*.pid"):
        if pid_file.with_suffix(".rc").exists():
            continue  # ended: its group id may belong to another process by now
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(_run_dir(), ignore_errors=True)


def _start_export(which: str, threads: int | None = None) -> None:
    """Start the export in a process group of its own, unless a process of this run started it already."""
    import fcntl
    import subprocess
    import sys

    run_dir = _run_dir()
    with _EXPORTS_LOCK, open(run_dir / f"{which}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process of the run starts it
        if _EXPORTS_CLOSED.is_set() or (run_dir / f"{which}.pid").exists():
            return
        out = run_dir / which / "artifacts"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
        # The reduced export also writes the stock-Triton repository, as a user asks for it (test_real_triton.py).
        repo = ["--triton-repo", str(out.parent / "triton-repo"), "--triton-max-streams", "4"] if which == "small" else []
        command = [sys.executable, "-m", "hift_export.cli", *_EXPORT_ARGS[which], *repo, "--out", str(out)]
        # The shell writes the exit status once the export ended; WHICH.rc appears whole (renamed into place).
        script = '"$@" > "$0.log" 2>&1; echo $? > "$0.rc.tmp" && mv "$0.rc.tmp" "$0.rc"'
        process = subprocess.Popen(["sh", "-c", script, str(run_dir / which), *command], cwd=ROOT, env=env,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        (run_dir / f"{which}.pid").write_text(str(process.pid))
        _STARTED.append(process)  # reaped when it ends, not warned about as garbage while it runs


def _wait_for_export(which: str, timeout_s: float = 1800) -> int:
    """The export's exit status, once it ended."""
    import time

    rc_file = _run_dir() / f"{which}.rc"
    deadline = time.monotonic() + timeout_s
    while not rc_file.exists():
        assert time.monotonic() < deadline, f"the {which} export did not end in {timeout_s} s"
        time.sleep(0.2)
    return int(rc_file.read_text())


def _finished_export(which: str):
    """The export, run through the CLI as a user runs it (``output`` keeps what it printed)."""
    import json
    from types import SimpleNamespace

    _start_export(which)
    run_dir = _run_dir()
    if which == "small" and _FULL_WHEN_WAITED.is_set() and not (run_dir / "small.rc").exists():
        _start_export("full", threads=1)
    returncode = _wait_for_export(which)
    output = (run_dir / f"{which}.log").read_text()
    assert returncode == 0, output[-3000:]
    out = run_dir / which / "artifacts"
    return SimpleNamespace(out=out, manifest=json.loads((out / "manifest.json").read_text()), output=output)


@pytest.fixture(scope="session")
def small_artifacts():
    """Seeded random weights, reduced width: ONNX + TorchScript + manifest."""
    return _finished_export("small")


@pytest.fixture(scope="session")
def small_hift(reduced_config):
    from hift_model import load_hift

    return load_hift(None, config=reduced_config)


@pytest.fixture(scope="session")
def full_artifacts():
    """The fixture checkpoint exported at full size (every format: its TorchScript and manifest are tested too)."""
    if not CHECKPOINT.is_file():
        pytest.skip(f"{CHECKPOINT} not found")
    return _finished_export("full")


@pytest.fixture(scope="session")
def fixture_hift():
    if not CHECKPOINT.is_file():
        pytest.skip(f"{CHECKPOINT} not found")
    from hift_model import load_hift

    return load_hift(str(CHECKPOINT))


@pytest.fixture(scope="session")
def fixture_noise_npy(tmp_path_factory, reference):
    path = tmp_path_factory.mktemp("noise") / "fixture_noise.npy"
    np.save(path, reference["noise"])
    return path
