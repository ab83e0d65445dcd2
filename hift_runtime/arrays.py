"""Array copies that keep the GIL: the host path's joins and copies, as memcpy of their bytes.

NumPy releases the GIL inside nearly every array operation, whatever its size. In a busy process (streams' event
loop, scheduler, device thread) each release hands the GIL to another thread and the caller waits to get it back, up
to Python's switch interval: a copy of a few microseconds becomes a wait of hundreds (BENCHMARKS.md).
A ``bytearray`` join of buffers, or an assignment of one buffer's bytes to another through ``memoryview``, is a
``memcpy`` under the GIL (``np.empty`` only allocates).
"""

from __future__ import annotations

import numpy as np


def byte_view(array: np.ndarray) -> memoryview:
    """``array``'s memory as bytes (C-contiguous, not empty): assigning to a slice of it, or from it, is a memcpy
    under the GIL."""
    return memoryview(array).cast("B")


def concat_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """``np.concatenate(arrays, axis=0)`` (a new array, even of one piece), as one join of their bytes when every
    array is C-contiguous with the same dtype and trailing shape (else NumPy's, which also says what does not fit).
    The result is writable and its memory (a ``bytearray``) holds exactly its values; one join, not a copy per row
    (each NumPy copy would hand the GIL away in a busy process)."""
    first = arrays[0]
    shape, dtype, tail = first.shape, first.dtype, first.shape[1:]
    if first.ndim == 0 or 0 in tail:
        return np.concatenate(arrays, axis=0)
    for a in arrays:  # a batch's rows share one shape: compared whole (a fifth of the time of their tails and flags)
        if a.shape != shape or a.dtype != dtype:
            if not all(a.dtype == dtype and a.shape[1:] == tail for a in arrays):
                return np.concatenate(arrays, axis=0)
            break
    try:
        joined = bytearray().join(arrays)
    except TypeError:  # an array that is not C-contiguous has no plain buffer to join
        return np.concatenate(arrays, axis=0)
    return np.frombuffer(joined, dtype).reshape(-1, *tail)


def contiguous_copy(array: np.ndarray) -> np.ndarray:
    """A writable C-contiguous copy of ``array`` (any strides: a slice of a stream's mel, a row of a batch's audio),
    made under the GIL (``np.ascontiguousarray`` and ``.copy()`` hand it away)."""
    return np.frombuffer(bytearray(memoryview(array)), array.dtype).reshape(array.shape)


def copy_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """A copy of ``array[:rows]`` (``array`` C-contiguous), made under the GIL."""
    out = np.empty((rows, *array.shape[1:]), array.dtype)
    if out.nbytes:
        byte_view(out)[:] = byte_view(array)[:out.nbytes]
    return out
