"""The slot form of the generator step graphs: the caches stay on the device, in a pool with one row per stream.

A batched step of streams at different positions needs each stream's caches; moving them across the bus every step
(0.58 MB per stream each way) costs more than the step at large batches. The slot form takes the whole pool instead,
reads the rows of this step's streams and writes their next caches back into the same rows:

* inputs: the step's own inputs (``mel``, ``f0``, ``noise``, ``phase_in``, ``first``), ``slots [B]`` int64 (the
  pool row of each batch row) and ``pool [S * R]`` float32, flat (``S`` rows of ``R`` floats: every cache of a
  stream, flattened in layout order);
* outputs: ``audio``, ``phase_out`` and (stream step only) ``pool_out [S * R]``: the pool with rows ``slots``
  replaced by the next caches. A runtime binds ``pool_out`` to ``pool``'s own buffer (ScatterND updates it in place).

Rows are read and written element by element (indices ``slot * R + 0 .. R-1``), not as whole rows: ONNX Runtime's
CUDA ScatterND gives each index one thread, so a row index would copy a whole cache row serially (BENCHMARKS.md:
the slot forms measured). The pool is flat so that
ScatterND writes the bound output itself (a reshape in between would be a copy of the whole pool).

The utterance start needs no zeroing: rows with ``first`` read zeros instead of their slot (the zero caches of a
stream's start). Built by rewriting the exported step graphs (no second trace); the computation in between is
unchanged, so the slot form equals the plain graphs exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hift_runtime.contract import CACHE_PREFIX, NEXT_PREFIX
from hift_runtime.manifest import POOL_OUTPUT, SLOT_INPUTS

from hift_model.step import pool_row_floats


def slotted_model(model: Any, layout: list[dict[str, Any]], final: bool) -> Any:
    """A copy of a generator step ``model`` (cache inputs, and ``next.*`` outputs unless ``final``) in slot form."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if any(e["dtype"] != "float32" for e in layout):
        raise ValueError("the slot form packs float32 caches")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    cache_inputs = {CACHE_PREFIX + e["name"] for e in layout}
    missing = cache_inputs - {i.name for i in g.input}
    if missing:
        raise ValueError(f"the step graph lacks cache inputs {sorted(missing)[:3]}")
    row = pool_row_floats(layout)
    inputs = [i for i in g.input if i.name not in cache_inputs]
    del g.input[:]
    slots, pool = SLOT_INPUTS
    g.input.extend(inputs + [helper.make_tensor_value_info(slots, TensorProto.INT64, ["batch"]),
                             helper.make_tensor_value_info(pool, TensorProto.FLOAT, ["pool_floats"])])

    def const(name: str, value: np.ndarray) -> str:
        g.initializer.append(numpy_helper.from_array(value, name))
        return name

    zero = const("slot.zero", np.zeros((), np.float32))
    axis1 = const("slot.axis1", np.array([1], np.int64))
    axis2 = const("slot.axis2", np.array([2], np.int64))
    row_floats = const("slot.row_floats", np.array(row, np.int64))
    columns = const("slot.columns", np.arange(row, dtype=np.int64)[None])
    head = [helper.make_node("Unsqueeze", [slots, axis1], ["slot.column"]),
            helper.make_node("Mul", ["slot.column", row_floats], ["slot.start"]),
            # Every float of this step's rows: slot * R + (0 .. R-1), [B, R] (one thread per element below).
            helper.make_node("Add", ["slot.start", columns], ["slot.index"]),
            helper.make_node("Gather", [pool, "slot.index"], ["slot.rows"], axis=0),
            # A stream's first step reads zeros (its start), whatever its slot held before.
            helper.make_node("Where", ["first", zero, "slot.rows"], ["slot.state"])]
    tail, flat_next, offset = [], [], 0
    for e in layout:
        size, name = int(np.prod(e["shape"])), e["name"]
        lo = const(f"slot.lo.{name}", np.array([offset], np.int64))
        hi = const(f"slot.hi.{name}", np.array([offset + size], np.int64))
        shape = const(f"slot.shape.{name}", np.array([-1, *e["shape"]], np.int64))
        head += [helper.make_node("Slice", ["slot.state", lo, hi, axis1], [f"slot.flat.{name}"]),
                 helper.make_node("Reshape", [f"slot.flat.{name}", shape], [CACHE_PREFIX + name])]
        if not final:
            flat = const(f"slot.row.{name}", np.array([-1, size], np.int64))
            tail.append(helper.make_node("Reshape", [NEXT_PREFIX + name, flat], [f"slot.next.{name}"]))
            flat_next.append(f"slot.next.{name}")
        offset += size
    if not final:
        # The CUDA EP captures a Concat of at most 32 inputs in a CUDA graph: concatenate in groups, then the groups.
        groups = [flat_next[i:i + 32] for i in range(0, len(flat_next), 32)]
        for j, group in enumerate(groups):
            tail.append(helper.make_node("Concat", group, [f"slot.next.group{j}"], axis=1))
        tail += [helper.make_node("Concat", [f"slot.next.group{j}" for j in range(len(groups))], ["slot.next"], axis=1),
                 helper.make_node("Unsqueeze", ["slot.index", axis2], ["slot.targets"]),
                 helper.make_node("ScatterND", [pool, "slot.targets", "slot.next"], [POOL_OUTPUT])]
        outputs = [o for o in g.output if not o.name.startswith(NEXT_PREFIX)]
        del g.output[:]
        g.output.extend(outputs + [helper.make_tensor_value_info(POOL_OUTPUT, TensorProto.FLOAT, ["pool_floats"])])
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(head + nodes + tail)
    return out

