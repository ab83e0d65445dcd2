"""Process lifetimes for ``hift-serve``: what it starts dies with it, a dead model process is noticed, and the temp
folders of a server that was killed are cleaned at the next start.

* :func:`dies_with_parent`: a ``preexec_fn`` that makes the kernel SIGKILL the child when the process that started it
  dies (Linux ``PR_SET_PDEATHSIG``), even by ``kill -9``. ``tritonserver``'s Python-backend stub, in turn, exits when
  ``tritonserver`` is gone (it checks its parent every 300 ms), so the whole tree goes.
* :func:`process_alive`: whether a process that is not our child still runs (a zombie counts as dead).
* :func:`temp_folder` / :func:`remove_stale_folders`: ``hift-serve-*`` folders name their supervisor's pid in
  :data:`OWNER_FILE`; one whose supervisor is gone is removed when the next server starts.
* :func:`stop_signals_recorded` / :func:`stop_processes`: a supervisor's loop sees SIGTERM and Ctrl-C as a request,
  and stops its children in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
OWNER_FILE = "supervisor.pid"
FOLDER_PREFIX = "hift-serve-"


def dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` (None off Linux): the child is killed when this process dies.
    Call it in the thread that stays alive as long as the process (the kernel ties the signal to the forking
    thread): ``hift-serve``'s main thread."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nothing would signal us any more
            os._exit(1)

    return preexec


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie waiting for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie then counts as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def temp_folder() -> Path:
    """A new ``hift-serve-*`` folder in the temp dir, marked with this process's pid; stale ones removed first."""
    remove_stale_folders()
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    return folder


def release_folder(folder: Path) -> None:
    """Keep ``folder`` (a log a message names) but no longer as this server's: never removed as stale."""
    (folder / OWNER_FILE).unlink(missing_ok=True)


def remove_stale_folders(parent: Path | None = None) -> list[Path]:
    """Remove the ``hift-serve-*`` folders whose supervisor no longer runs (it was killed); those removed."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"):
        try:
            owner = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, kept on purpose (a failed start's log), or being written
        if owner != os.getpid() and not process_alive(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


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
