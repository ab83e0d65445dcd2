"""A hift-serve opener whose model process dies while it opens (tests/test_server_faults.py): the stub is killed
before the model is ready, as a warmup out of device memory can kill it."""

from __future__ import annotations

import os
import signal
from typing import Any


def die_while_opening(args: Any) -> None:
    print("dying_opener: the model process kills itself while it opens", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
