"""The compiled engine's device state and captured calls: every stream's caches as rows of one device tensor
(:class:`CacheRows`), and a step shape as a CUDA graph that copies its inputs in from pinned host buffers and its
outputs out to them (:class:`CapturedCall` over :class:`HostMirrors`), launched and waited for apart
(:class:`LaunchedCall`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hift_runtime.arrays import byte_view, copy_rows
from hift_runtime.slots import SlotRows


class HostMirrors:
    """Pinned host buffers of one step shape's inputs and outputs, ``rows`` rows each, shared by its graphs of every
    batch size (one call at a time: a launch over them waits for the call pending on them, ``pending``); a graph of
    batch ``B`` copies rows ``[0, B)``. Per batch size they would pin ~280 MB at full size (the host allocator rounds
    each to a power of two); shared, ~56 MB of buffers (< 100 MB pinned)."""

    def __init__(self, inputs: list[torch.Tensor], outputs: tuple[torch.Tensor, ...], rows: int) -> None:
        self.inputs = [torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True) for t in inputs]
        self.outputs = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True) for t in outputs]
        self.host_in = [t.numpy() for t in self.inputs]
        self.host_out = [t.numpy() for t in self.outputs]
        self.dirty = 0  # rows past which every input row is zero (the buffers start as zeros)
        # The call launched over these buffers and not yet waited for: its outputs land here, and the next call's
        # inputs may be written only once its own were read (both known once it is done).
        self.pending: LaunchedCall | None = None

    def write(self, values: list[np.ndarray], rows: int, batch: int) -> None:
        """``values`` into the first ``rows`` rows; rows ``[rows, batch)`` zero (slot 0: the scratch row), since a
        larger call's rows left there would read and write its streams' slots. Copied as bytes, under the GIL: a
        NumPy copy would release it, and in a busy process wait for it again (BENCHMARKS.md, decision log)."""
        upto = min(self.dirty, batch)
        for host, value in zip(self.host_in, values):
            value = np.ascontiguousarray(value, dtype=host.dtype)
            if value.shape != (rows, *host.shape[1:]):
                raise ValueError(f"a step input of shape {value.shape} for {rows} rows of {host.shape[1:]}")
            row = host[0].nbytes
            buffer = byte_view(host)
            buffer[:rows * row] = byte_view(value)
            if rows < upto:
                buffer[rows * row:upto * row] = bytes((upto - rows) * row)
        self.dirty = self.dirty if self.dirty > batch else rows


class CapturedCall:
    """One call of ``fn`` at one fixed shape as a CUDA graph that copies its inputs in from pinned host buffers
    (:class:`HostMirrors`) and its outputs out to them: a call is the host's writes into the buffers, one replay and one
    wait. (Copied one by one, a call's six inputs and two outputs each released the GIL and took it back: in a busy
    process each take-back waits for another thread.)"""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], example: list[torch.Tensor], pool: Any,
                 mirrors: Callable[[list[torch.Tensor], tuple[torch.Tensor, ...]], HostMirrors]) -> None:
        """``mirrors(inputs, outputs)``: the shape's host buffers (made on its first capture)."""
        # The example tensors themselves become the graph's input buffers: a clone would drop dynamo's dynamic/static
        # marks on them (then B = 2 compiles static, and the next batch size compiles again).
        self.inputs = list(example)
        self.batch = example[0].shape[0]
        # A replay runs on the calling thread's current stream of the graph's device (replay() enters that device);
        # the thread's own current device may be another GPU's, so the waits below name the device.
        self.device = example[0].device
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a few runs before capture (inductor's autotuning, cuDNN's plans)
            for _ in range(2):
                outputs = fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.mirrors = mirrors(self.inputs, outputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            for buffer, host in zip(self.inputs, self.mirrors.inputs):
                buffer.copy_(host[:self.batch], non_blocking=True)
            for host, out in zip(self.mirrors.outputs, fn(*self.inputs)):
                host[:self.batch].copy_(out, non_blocking=True)

    def launch(self, values: list[np.ndarray], rows: int, lock: threading.Lock, wait: bool) -> LaunchedCall | None:
        """The call launched on the calling thread's stream (``lock``, the engine's, held). A call still pending on
        the same buffers is waited for first; or, with ``wait`` False, nothing is launched (None) unless it is
        done."""
        mirrors = self.mirrors
        if mirrors.pending is not None:
            if not wait and not mirrors.pending.done.query():
                return None
            mirrors.pending.result_held()
        mirrors.write(values, rows, self.batch)
        self.graph.replay()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        mirrors.pending = LaunchedCall(mirrors, rows, done, lock)
        return mirrors.pending


class LaunchedCall:
    """A captured call on the device: :meth:`result` waits for it and gives copies of its outputs' first ``rows``
    rows (made under the GIL: the buffers are the next call's)."""

    def __init__(self, mirrors: HostMirrors, rows: int, done: torch.cuda.Event, lock: threading.Lock) -> None:
        self._mirrors, self._rows, self._lock = mirrors, rows, lock
        self.done = done  # recorded after its replay
        self._outputs: list[np.ndarray] | None = None

    def result(self) -> list[np.ndarray]:
        """The outputs, from any thread: the wait without the engine's lock (launches go on meanwhile), the copies
        with it."""
        if self._outputs is None:
            self.done.synchronize()
            with self._lock:
                return self.result_held()
        return self._outputs

    def result_held(self) -> list[np.ndarray]:
        """:meth:`result` with the engine's lock held."""
        if self._outputs is None:
            mirrors = self._mirrors
            self.done.synchronize()
            self._outputs = [copy_rows(out, self._rows) for out in mirrors.host_out]
            mirrors.pending = None
        return self._outputs


class FinishedCall:
    """A call already done (an eager one): :class:`LaunchedCall`'s interface over its outputs."""

    def __init__(self, outputs: list[np.ndarray]) -> None:
        self._outputs = outputs

    def result(self) -> list[np.ndarray]:
        return self._outputs

    result_held = result


class LaunchedStep:
    """A step's call on the device, as the engine's step gives it: ``convert`` of the call's outputs."""

    def __init__(self, call: LaunchedCall | FinishedCall, convert: Callable[[list[np.ndarray]], Any]) -> None:
        self._call, self._convert = call, convert

    def result(self) -> Any:
        return self._convert(self._call.result())


class CacheRows:
    """One kind of per-stream caches (the generator's or the F0 step's) on the device: a row of one tensor
    ``[rows, R]`` per slot (row 0 scratch), read as named caches before a step and written back after it.

    """

    def __init__(self, specs: tuple[Any, ...], rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.names = [spec.name for spec in specs]
        self.shapes = [tuple(spec.shape) for spec in specs]
        self.sizes = [int(np.prod(spec.shape)) for spec in specs]
        self.slots = SlotRows(rows, "slots=...")
        self.pool = torch.zeros(rows, sum(self.sizes), dtype=dtype, device=device)

    def read(self, slots: torch.Tensor, first: torch.Tensor) -> dict[str, torch.Tensor]:
        """The slots' caches, each ``[B, C, T]``; zeros where ``first`` (a stream's start) instead of the row."""
        rows = self.pool.index_select(0, slots)
        rows = torch.where(first, torch.zeros((), dtype=rows.dtype, device=rows.device), rows)
        parts = torch.split(rows, self.sizes, dim=1)
        return {name: part.reshape(-1, *shape) for name, shape, part in zip(self.names, self.shapes, parts)}

    def write(self, slots: torch.Tensor, caches: dict[str, torch.Tensor]) -> None:
        """``caches`` (as :meth:`read` gives them, any float dtype) into the slots' rows."""
        batch = slots.shape[0]
        pieces = [caches[name].reshape(batch, -1) for name in self.names]
        self.pool.index_copy_(0, slots, torch.cat([piece.to(self.pool.dtype) for piece in pieces], dim=1))
