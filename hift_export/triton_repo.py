"""Triton target: a model repository for a stock Triton server with the onnxruntime backend (no Python in the loop).

Two sequence models, both with Triton's ``sequence_batching`` (the ``oldest`` strategy) and every cache an implicit
``state`` (zero at a sequence's start, each step's output fed back as the next step's input):

* ``hift_f0`` (CPU): the F0 step graph as exported: ``mel [80, c+3]`` -> ``f0 [c]``; states: its 4 float64 caches.
* ``hift_generator`` (GPU): the generator step and the final step in one graph. Inputs ``mel [80, c+4]`` and
  ``f0 [c+1]``; ``START`` drives the step's ``first`` input and ``END`` switches the row to the final step (which reads
  the first ``c`` frames: a final request carries zeros as look-ahead). The noise rows are computed in the graph from
  a position state, by the same counter-based hash as ``NoiseTable.seeded`` (SplitMix64 in int64/uint64 ops), so a
  client sends no noise. States: the 82 caches, the float64 phase, the position (frames done). Outputs: ``audio
  [480(c+1)]`` whose first ``samples`` values are this request's audio (the samples before the utterance are already
  dropped on the first step).

A client drives them as the runtime's bookkeeping drives its backend (``hift_runtime/streaming.py``): F0 steps on the
mel with its look-ahead, generator steps on the mel and F0 with theirs. The final step runs, for the whole batch, only
when some row of it ends (an ``If`` over the batch), and is kept where ``END`` is set.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hift_runtime.manifest import F0_STEP, GENERATOR_STEP, GENERATOR_STEP_FINAL, Manifest, triton_type

F0_MODEL, GENERATOR_MODEL = "hift_f0", "hift_generator"
POSITION, POSITION_OUT, SAMPLES, END = "position", "position_out", "samples", "end"
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (int64 Add/Mul wrap like uint64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class _Builder:
    """Nodes and initializers added to a graph, with unique names under a prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.nodes, self.inits, self._n = prefix, [], [], 0

    def const(self, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self._n += 1
        name = f"{self.prefix}c{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        from onnx import helper

        self._n += 1
        out = f"{self.prefix}v{self._n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{self.prefix}n{self._n}", **attrs))
        return out


def _noise(b: _Builder, position: str, steps: str, seed: int, length: int, columns: int, spf: int) -> str:
    """Noise rows ``[B, spf * steps, columns]`` of a step of ``steps`` frames (``[1]`` int64) starting at frame
    ``position`` (``[B, 1]`` int64), equal to ``NoiseTable.seeded(seed, length, columns).rows(position * spf, ...)``."""
    from onnx import TensorProto

    count = b.op("Mul", [steps, b.const(np.array([spf], np.int64))])
    rows = b.op("Range", [b.const(np.array(0, np.int64)), b.op("Squeeze", [count]), b.const(np.array(1, np.int64))])
    absolute = b.op("Add", [b.op("Mul", [position, b.const(np.array(spf, np.int64))]), rows])  # [B, n]
    index = b.op("Mul", [b.op("Mod", [absolute, b.const(np.array(length, np.int64))]),
                         b.const(np.array(columns, np.int64))])
    key = np.array([_int64(c + seed * _GOLDEN) for c in range(columns)], np.int64)
    z = b.op("Add", [b.op("Unsqueeze", [index, b.const(np.array([-1], np.int64))]), b.const(key)])  # [B, n, cols]

    def shift_xor(x: str, bits: int) -> str:
        shifted = b.op("BitShift", [b.op("Cast", [x], to=TensorProto.UINT64), b.const(np.array(bits, np.uint64))],
                       direction="RIGHT")
        return b.op("BitwiseXor", [x, b.op("Cast", [shifted], to=TensorProto.INT64)])

    z = b.op("Add", [z, b.const(np.array(_int64(_GOLDEN), np.int64))])
    z = b.op("Mul", [shift_xor(z, 30), b.const(np.array(_int64(_MIX1), np.int64))])
    z = b.op("Mul", [shift_xor(z, 27), b.const(np.array(_int64(_MIX2), np.int64))])
    z = shift_xor(z, 31)
    top = b.op("BitShift", [b.op("Cast", [z], to=TensorProto.UINT64), b.const(np.array(40, np.uint64))],
               direction="RIGHT")
    return b.op("Mul", [b.op("Cast", [top], to=TensorProto.FLOAT), b.const(np.array(1.0 / (1 << 24), np.float32))])


def _slice_to(b: _Builder, x: str, end: str, axis: int) -> str:
    return b.op("Slice", [x, b.const(np.array([0], np.int64)), end, b.const(np.array([axis], np.int64))])


def sequence_generator(step: Any, final: Any, spf: int, seed: int, length: int, columns: int) -> Any:
    """The ``hift_generator`` graph: ``step`` and ``final`` (ModelProtos with their weights loaded) in one graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(step)
    g = model.graph
    b = _Builder("seq/")
    inputs = {i.name: i for i in g.input}
    # The step's own noise and the final step's inputs are computed here; position is a new state input.
    del g.input[:]
    g.input.extend([v for name, v in inputs.items() if name != "noise"]
                   + [helper.make_tensor_value_info(END, TensorProto.BOOL, ["batch", 1]),
                      helper.make_tensor_value_info(POSITION, TensorProto.INT64, ["batch", 1])])
    steps = b.op("Gather", [b.op("Shape", ["f0"]), b.const(np.array([1], np.int64))], axis=0)  # [1]: c + 1
    noise = _noise(b, POSITION, steps, seed, length, columns, spf)
    b.nodes.append(helper.make_node("Identity", [noise], ["noise"], name="seq/noise"))  # what the step's nodes read
    frames = b.op("Sub", [steps, b.const(np.array([1], np.int64))])  # [1]: c
    head = list(b.nodes)
    b.nodes.clear()
    # The final step's inputs: its c frames of mel, F0 and noise (a final request's look-ahead is ignored).
    final_in = {"mel": _slice_to(b, "mel", frames, 2), "f0": _slice_to(b, "f0", frames, 1),
                "noise": _slice_to(b, noise, b.op("Mul", [frames, b.const(np.array([spf], np.int64))]), 1)}
    # The final graph's nodes, renamed so they cannot collide; its weights are the step's (same names, same bytes).
    known = {t.name: t for t in g.initializer}
    rename: dict[str, str] = {name: final_in.get(name, name) for name in (i.name for i in final.graph.input)}
    for t in final.graph.initializer:
        same = t.name in known and numpy_helper.to_array(known[t.name]).tobytes() == numpy_helper.to_array(t).tobytes()
        rename[t.name] = t.name if same else "final/" + t.name
        if not same:
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.name = rename[t.name]
            g.initializer.append(copy)
    final_nodes = []
    for node in final.graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = "final/" + node.name
        for field in (copy.input, copy.output):
            for k, name in enumerate(field):
                if name:
                    field[k] = rename.setdefault(name, "final/" + name)
        final_nodes.append(copy)
    # One frame of zeros per row: the step's audio padded to the final step's length, and the fill after a shift.
    batch = b.op("Slice", [b.op("Shape", ["mel"]), b.const(np.array([0], np.int64)), b.const(np.array([1], np.int64))])
    zeros = b.op("ConstantOfShape", [b.op("Concat", [batch, b.const(np.array([spf], np.int64))], axis=0)],
                 value=numpy_helper.from_array(np.zeros(1, np.float32)))
    padded = b.op("Concat", ["audio", zeros], axis=1)
    # The final step runs only when some row of the batch ends (an If over the batch); otherwise its outputs are the
    # step's, padded (no row reads them then).
    any_end = b.op("Cast", [b.op("ReduceMax", [b.op("Cast", [END], to=TensorProto.INT64)], keepdims=0)],
                   to=TensorProto.BOOL)
    # Only the audio comes from the If: the final step's phase_out is the step's (both add the same frames' phase
    # from the same phase_in), and an ended sequence's state is released anyway.
    then_graph = helper.make_graph(
        final_nodes + [helper.make_node("Identity", [rename["audio"]], ["final.audio"])],
        "final_step", [], [helper.make_tensor_value_info("final.audio", TensorProto.FLOAT, None)])
    else_graph = helper.make_graph(
        [helper.make_node("Identity", [padded], ["skip.audio"])],
        "no_final_step", [], [helper.make_tensor_value_info("skip.audio", TensorProto.FLOAT, None)])
    final_audio = "seq/final_audio"
    b.nodes.append(helper.make_node("If", [any_end], [final_audio], name="seq/final_if",
                                    then_branch=then_graph, else_branch=else_graph))
    # Outputs: the row's audio (padded to c+1 frames), with the samples before the utterance dropped on its first
    # step, the final step's where END; how many samples are real.
    lag = b.const(np.array([spf], np.int64))
    big = b.const(np.array([1 << 62], np.int64))
    ax1 = b.const(np.array([1], np.int64))

    def drop_first(audio: str) -> str:
        shifted = b.op("Concat", [b.op("Slice", [audio, lag, big, ax1]), zeros], axis=1)
        return b.op("Where", ["first", shifted, audio])

    stream_audio = drop_first(padded)
    audio = b.op("Where", [END, drop_first(final_audio), stream_audio])
    per_frame = b.const(np.array(spf, np.int64))
    samples = b.op("Sub", [b.op("Add", [b.op("Mul", [frames, per_frame]),
                                        b.op("Mul", [b.op("Cast", [END], to=TensorProto.INT64), per_frame])]),
                           b.op("Mul", [b.op("Cast", ["first"], to=TensorProto.INT64), per_frame])])
    position_out = b.op("Add", [POSITION, frames])
    tail = list(b.nodes)
    tail += [helper.make_node("Identity", [audio], ["audio_out"]), helper.make_node("Identity", [samples], [SAMPLES]),
             helper.make_node("Identity", ["phase_out"], ["phase_state"]),
             helper.make_node("Identity", [position_out], [POSITION_OUT])]
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(b.inits)
    outputs = {o.name: o for o in g.output}
    del g.output[:]
    g.output.extend([helper.make_tensor_value_info("audio_out", TensorProto.FLOAT, ["batch", "samples_padded"]),
                     helper.make_tensor_value_info(SAMPLES, TensorProto.INT64, ["batch", 1]),
                     helper.make_tensor_value_info("phase_state", TensorProto.DOUBLE, ["batch", columns]),
                     helper.make_tensor_value_info(POSITION_OUT, TensorProto.INT64, ["batch", 1])]
                    + [o for name, o in outputs.items() if name.startswith("next.")])
    del g.value_info[:]
    return model


def _state(input_name: str, output_name: str, dtype: str, dims: list[int]) -> str:
    return (f"  state [{{ input_name: \"{input_name}\" output_name: \"{output_name}\" data_type: {triton_type(dtype)} "
            f"dims: {dims} initial_state: {{ data_type: {triton_type(dtype)} dims: {dims} zero_data: true "
            f"name: \"zeros\" }} }}]\n")


def config_pbtxt(model: str, layout: list[dict[str, Any]], *, generator: bool, max_batch: int, in_channels: int,
                 columns: int, max_queue_delay_us: int, idle_us: int, gpus: list[int] | None = None) -> str:
    """The ``config.pbtxt`` of one model (parsed by the tests with Triton's model-config protobuf). ``gpus``: one
    generator instance on each listed GPU (None: one instance, on a GPU where Triton has one, else on the CPU:
    ``KIND_AUTO`` loads on any Triton). Triton's sequence batcher routes every request of a sequence to the instance
    that took its START, so a stream's implicit state (its caches) stays on one device."""
    instances = f"kind: KIND_GPU count: 1 gpus: {list(gpus)}" if gpus else "kind: KIND_AUTO count: 1"
    lines = [f"name: \"{model}\"", "backend: \"onnxruntime\"", f"max_batch_size: {max_batch}"]
    if generator:
        lines += [f"input [{{ name: \"mel\" data_type: TYPE_FP32 dims: [{in_channels}, -1] }}, "
                  f"{{ name: \"f0\" data_type: TYPE_FP32 dims: [-1] }}]",
                  "output [{ name: \"audio_out\" data_type: TYPE_FP32 dims: [-1] }, "
                  f"{{ name: \"{SAMPLES}\" data_type: TYPE_INT64 dims: [1] }}]",
                  f"instance_group [{{ {instances} }}]"]
    else:
        lines += [f"input [{{ name: \"mel\" data_type: TYPE_FP32 dims: [{in_channels}, -1] }}]",
                  "output [{ name: \"f0\" data_type: TYPE_FP32 dims: [-1] }]",
                  "instance_group [{ kind: KIND_CPU count: 1 }]"]
    seq = [f"sequence_batching {{\n  max_sequence_idle_microseconds: {idle_us}\n",
           f"  oldest {{ max_candidate_sequences: {4 * max_batch} "
           f"max_queue_delay_microseconds: {max_queue_delay_us} }}\n"]
    if generator:
        seq.append("  control_input [{ name: \"first\" control [{ kind: CONTROL_SEQUENCE_START "
                   "bool_false_true: [false, true] }] }, { name: \"end\" control [{ kind: CONTROL_SEQUENCE_END "
                   "bool_false_true: [false, true] }] }]\n")
        seq.append(_state("phase_in", "phase_state", "float64", [columns]))
        seq.append(_state(POSITION, POSITION_OUT, "int64", [1]))
    for e in layout:
        seq.append(_state("cache." + e["name"], "next." + e["name"], e["dtype"], list(e["shape"])))
    seq.append("}")
    return "\n".join(lines) + "\n" + "".join(seq) + "\n"


# A sequence idle this long is released by Triton. Short on purpose: a sequence a client never ENDs holds one of the
# model's candidate slots until then, and a START that finds every slot held waits that long (60 s stalled a busy
# server for a minute with 256 un-ended F0 sequences).
SEQUENCE_IDLE_US = 10_000_000


def write_triton_repository(manifest: Manifest, out: Path, *, max_batch: int = 64, noise_seed: int = 0,
                            max_queue_delay_us: int = 2000, idle_us: int = SEQUENCE_IDLE_US,
                            gpus: list[int] | None = None, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Write the repository into ``out`` (``<model>/config.pbtxt``, ``<model>/1/model.onnx``) from an export;
    ``gpus``: the GPUs the generator model gets an instance on (see :func:`config_pbtxt`)."""
    import onnx

    config, step = manifest.config, manifest.step
    derived = config["derived"]
    spf, columns, length = (int(derived["samples_per_frame"]), int(derived["num_sines"]),
                            int(derived["noise_table_length"]))
    generator = sequence_generator(onnx.load(str(manifest.path(GENERATOR_STEP))),
                                   onnx.load(str(manifest.path(GENERATOR_STEP_FINAL))), spf, noise_seed, length,
                                   columns)
    f0 = onnx.load(str(manifest.path(F0_STEP)))
    paths = {}
    for name, model, layout, is_gen in ((GENERATOR_MODEL, generator, step["generator_caches"], True),
                                        (F0_MODEL, f0, step["f0_caches"], False)):
        folder = out / name / "1"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "model.onnx"
        onnx.save_model(model, str(path), save_as_external_data=is_gen, location="model.weights" if is_gen else None)
        for file in folder.iterdir():  # readable by a server running as another user (onnx writes 0600)
            file.chmod(0o644)
        (out / name / "config.pbtxt").write_text(config_pbtxt(
            name, layout, generator=is_gen, max_batch=max_batch, in_channels=int(config["in_channels"]),
            columns=columns, max_queue_delay_us=max_queue_delay_us, idle_us=idle_us, gpus=gpus))
        paths[name] = path
        log(f"[triton] {name}: {len(model.graph.node)} nodes -> {out / name}")
    return paths
