"""The source's fixed noise, read by absolute sample position.

Upstream draws ``sine_waves = torch.rand(1, 300*24000, 9)`` once when the vocoder is built (259 MB, not saved in
``hift.pt``) and reads row ``n`` for output sample ``n``; a stream longer than the table fails upstream. Here a
:class:`NoiseTable` hands out the rows a step needs, wrapping at the table length so long streams keep going.

Two sources:

* :meth:`NoiseTable.seeded`: uniform [0, 1) values from a counter-based hash of (seed, row, column). Any slice is
  computed on demand, so memory is proportional to the window, never to the 259 MB table.
* :meth:`NoiseTable.from_npy`: a table dumped from a live upstream process
  (``model.hift.m_source.l_sin_gen.sine_waves.numpy()``), shape ``(N, 9)`` or ``(1, N, 9)``, memory-mapped.
  With it, the runtime reproduces upstream's noise exactly.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64_inplace(z: np.ndarray, scratch: np.ndarray) -> None:
    """SplitMix64 finaliser of ``z + golden``, in place on a uint64 array (wrapping arithmetic is intended), with
    ``scratch`` (same shape) for the shifts: no temporary arrays (a lone stream hashes ~1.5 blocks of rows a push)."""
    with np.errstate(over="ignore"):
        np.add(z, _GOLDEN, out=z)
        for bits, factor in ((30, _MIX1), (27, _MIX2)):
            np.right_shift(z, np.uint64(bits), out=scratch)
            np.bitwise_xor(z, scratch, out=z)
            np.multiply(z, factor, out=z)
        np.right_shift(z, np.uint64(31), out=scratch)
        np.bitwise_xor(z, scratch, out=z)


# Seeded rows are computed in blocks and the recent blocks kept: every stream reads the same rows at the same
# positions, so concurrent streams (and each stream's re-read look-ahead frame) hash each row once.
_BLOCK_ROWS = 1 << 13
_CACHED_BLOCKS = 256  # 256 blocks x 8192 rows x 9 columns float32 = 75 MB at most


@functools.lru_cache(maxsize=4)
def _counters(size: int) -> np.ndarray:
    """``arange(size)`` as uint64, kept for the few sizes hashed (the block size; read-only)."""
    counters = np.arange(size, dtype=np.uint64)
    counters.flags.writeable = False
    return counters


class NoiseTableError(ValueError):
    """A noise table that cannot be used (missing, wrong shape or dtype, a negative seed)."""


class NoiseTable:
    """Rows of uniform noise ``[length, columns]`` by absolute position, wrapping at ``length``."""

    def __init__(self, length: int, columns: int, *, seed: int | None = None, table: np.ndarray | None = None,
                 source: str = "") -> None:
        if (seed is None) == (table is None):
            raise ValueError("give exactly one of seed= or table=")
        if length <= 0:
            raise NoiseTableError(f"noise table length must be positive, got {length}")
        self.length, self.columns, self.seed, self._table, self.source = length, columns, seed, table, source
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._blocks_lock = threading.Lock()
        self._local = threading.local()  # per-thread hashing scratch

    @classmethod
    def seeded(cls, seed: int, length: int, columns: int) -> "NoiseTable":
        if seed < 0:
            raise NoiseTableError(f"noise seed must be >= 0, got {seed}")
        return cls(length, columns, seed=seed, source=f"seeded({seed})")

    @classmethod
    def from_npy(cls, path: str | os.PathLike[str], columns: int) -> "NoiseTable":
        path = Path(path)
        if not path.is_file():
            raise NoiseTableError(f"noise table {path} does not exist")
        try:
            table = np.load(path, mmap_mode="r")
        except ValueError as exc:
            raise NoiseTableError(f"noise table {path} is not a plain .npy array ({exc})") from exc
        if table.ndim == 3 and table.shape[0] == 1:
            table = table[0]
        if table.ndim != 2 or table.shape[1] != columns:
            raise NoiseTableError(f"noise table {path} has shape {table.shape}; expected (N, {columns}) or (1, N, {columns})"
                             f" (upstream m_source.l_sin_gen.sine_waves)")
        if not np.issubdtype(table.dtype, np.floating):
            raise NoiseTableError(f"noise table {path} has dtype {table.dtype}; expected float32")
        if table.shape[0] == 0:
            raise NoiseTableError(f"noise table {path} has no rows")
        return cls(table.shape[0], columns, table=table, source=str(path))

    def rows(self, start: int, count: int) -> np.ndarray:
        """Rows ``start .. start+count-1`` (modulo the length) as a new float32 ``[count, columns]`` array."""
        if count <= 0:
            return np.zeros((0, self.columns), np.float32)
        first = start % self.length
        if self._table is not None:
            if first + count <= self.length:
                return np.array(self._table[first:first + count], dtype=np.float32)
            index = (first + np.arange(count, dtype=np.int64)) % self.length
            return np.asarray(self._table[index], dtype=np.float32)
        out = np.empty((count, self.columns), np.float32)
        done = 0
        while done < count:  # the needed part of each block, copied once into the caller's own array
            index, offset = divmod(start + done, _BLOCK_ROWS)
            take = min(count - done, _BLOCK_ROWS - offset)
            out[done:done + take] = self._block(index)[offset:offset + take]
            done += take
        return out

    def _block(self, index: int) -> np.ndarray:
        with self._blocks_lock:
            block = self._blocks.get(index)
            if block is not None:
                self._blocks.move_to_end(index)
                return block
        block = self._hash_rows(index * _BLOCK_ROWS, _BLOCK_ROWS)
        with self._blocks_lock:
            self._blocks[index] = block
            while len(self._blocks) > _CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        return block

    def _hash_rows(self, start: int, count: int) -> np.ndarray:
        # The hash of (row, column) is SplitMix64 of row * columns + column + seed * golden, computed in this
        # thread's two scratch arrays (allocating them per block cost as much as the arithmetic).
        first, cols = start % self.length, self.columns
        z, scratch = self._scratch(count * cols)
        with np.errstate(over="ignore"):
            offset = np.uint64(self.seed) * _GOLDEN
            if first + count <= self.length:  # no wrap: the counters are consecutive (no uint64 modulo)
                np.add(_counters(count * cols), np.uint64(first * cols) + offset, out=z)
            else:
                index = (first + np.arange(count, dtype=np.uint64)) % np.uint64(self.length)
                z[:] = (index[:, None] * np.uint64(cols) + np.arange(cols, dtype=np.uint64)[None, :]).ravel()
                np.add(z, offset, out=z)
        _splitmix64_inplace(z, scratch)
        # Top 24 bits -> exactly representable float32 in [0, 1).
        np.right_shift(z, np.uint64(40), out=z)
        out = np.empty((count, cols), np.float32)
        np.multiply(z, 1.0 / (1 << 24), out=out.reshape(-1), casting="unsafe")
        return out

    def _scratch(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Two uint64 arrays of ``size`` for this thread (kept for the block size: one pair per hashing thread)."""
        pair = getattr(self._local, "pair", None)
        if pair is None or pair[0].shape[0] != size:
            pair = (np.empty(size, np.uint64), np.empty(size, np.uint64))
            if size == _BLOCK_ROWS * self.columns:
                self._local.pair = pair
        return pair

    def __repr__(self) -> str:
        return f"NoiseTable({self.source}, length={self.length}, columns={self.columns})"
