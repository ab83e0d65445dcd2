"""Device cache slots: one row of an engine's cache pool per open stream, handed out and taken back.

Every engine that keeps the generator caches on its device (the ONNX Runtime slot form, the compiled engine) holds
them in one buffer ``[rows, R]``; this module only does the bookkeeping of its rows. Row 0 is scratch: the padding
rows of a batch read and write it, so it is never handed out.
"""

from __future__ import annotations

import threading
import weakref

from .errors import OverloadError


class SlotPoolFull(OverloadError):
    """Every device cache slot is taken: as many streams are open as the pool has rows."""


class Slot:
    """One stream's generator caches on the device: a row of the pool, given back when the stream lets go of it
    (finished, expired, lost or dropped: the slot object is collected)."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index


class SlotRows:
    """The free rows of a pool of ``rows`` rows (row 0 is scratch, never handed out)."""

    def __init__(self, rows: int, hint: str) -> None:
        if rows < 2:
            raise ValueError(f"a slot pool needs at least 2 rows (one scratch), got {rows}")
        self.rows = rows
        self._hint = hint  # how to get more slots, in the words of the engine's options
        self._free = list(range(rows - 1, 0, -1))
        self._lock = threading.Lock()

    def acquire(self) -> Slot:
        with self._lock:
            if not self._free:
                raise SlotPoolFull(f"all {self.rows - 1} device cache slots are in use (one per open stream); finish "
                                   f"streams, or open the vocoder with more ({self._hint} or max_streams)")
            slot = Slot(self._free.pop())
        weakref.finalize(slot, self._release, slot.index)
        return slot

    def _release(self, index: int) -> None:
        with self._lock:
            self._free.append(index)

    @property
    def in_use(self) -> int:
        return self.rows - 1 - len(self._free)
