"""Triton target: a model repository for a stock Triton server with the onnxruntime backend (no Python in the loop).

One model, ``hift_vocoder``: one sequence per stream, plain mel chunks in, the audio each chunk releases out, exactly
as ``VocoderStream.push()`` / ``finish()`` return it. Its graph chains, for the request's one stream, the F0 step
(float64 inside, as the export's F0 graph), the source and the generator step, and on ``end`` the final step; the
noise rows are computed in the graph from the stream's position by the same counter-based hash as
``NoiseTable.seeded``. Every cache, the held-back mel frames, the last F0 frame, the float64 phase and the frame count
are Triton implicit ``state`` (zero at a sequence's START, each output fed back as the next request's input), so a
client sends only ``mel [1, 80, T]`` with Triton's START flag on the first request and END on the last.

One request per execution (``max_batch_size: 1``): a request's stream may be at any point of its start (0-4 frames
held), which a batch of equal shapes could not share. The repository's capacity is the sequence batcher's candidate
sequences; the protocol, with what a client sees at the capacity edge, is in the README ("Stock Triton").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hift_runtime import wire
from hift_runtime.contract import StreamConstants, cache_io_names
from hift_runtime.manifest import F0_STEP, GENERATOR_STEP, GENERATOR_STEP_FINAL, Manifest, triton_type

MODEL, MEL, AUDIO, END = wire.MODEL_NAME, wire.MEL, wire.AUDIO, wire.SEQUENCE_END
# Implicit state of the stream beside the step graphs' caches: the last mel frames (the look-ahead not yet used, at
# most ``mel_look_ahead``), the frames received, the F0 of the next generator frame, the source's float64 phase.
STATE_MEL, STATE_FRAMES, STATE_F0, STATE_PHASE = "state.mel", "state.frames", "state.f0", "state.phase"
NEXT_STATE = "next_"  # a state's output: "next_" + its input name
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

# Defaults, each with its reason:
# - streams: what one CPU core pair keeps in real time is about 2 (BENCHMARKS.md); a GPU host sets its own.
DEFAULT_MAX_STREAMS = 8
# - a stream idle this long is released: far above any chunk interval of a live stream (CosyVoice3's longest chunk is
#   4 s of audio), short enough that a client that vanished frees its slot soon.
SEQUENCE_IDLE_US = 30_000_000
# - a START waits at most this long for a free slot (the client sends it as the request's timeout), then Triton answers
#   "timeout of the corresponding sequence has been expired": far below the idle time, so a START that got its slot
#   is never force-ended for idling while it waited.
START_TIMEOUT_US = 2_000_000
# - the longest chunk: CosyVoice3 sends at most 200 frames; hift-serve takes up to 1 000.
MAX_CHUNK_FRAMES = 1000


def _int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (int64 Add/Mul wrap like uint64)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class _Builder:
    """Nodes added to one graph (the model's or a branch's), with unique names under a prefix; constants go to the
    model's initializers (``inits``, shared by every builder: a branch reads the outer scope)."""

    def __init__(self, prefix: str, inits: list[Any]) -> None:
        self.prefix, self.nodes, self.inits, self._n = prefix, [], inits, 0

    def name(self, what: str = "v") -> str:
        self._n += 1
        return f"{self.prefix}{what}{self._n}"

    def const(self, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def i64(self, *values: int) -> str:
        return self.const(np.array(values, np.int64))

    def op(self, op_type: str, inputs: list[str], node_name: str | None = None, **attrs: Any) -> str:
        from onnx import helper

        out = self.name()
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=node_name or self.name("n"), **attrs))
        return out

    def slice(self, x: str, start: str, end: str | None, axis: int) -> str:
        return self.op("Slice", [x, start, end or self.i64(1 << 62), self.i64(axis)])

    def child(self, label: str) -> "_Builder":
        return _Builder(f"{self.name(label)}/", self.inits)


def _noise(b: _Builder, position: str, steps: str, seed: int, length: int, columns: int, spf: int) -> str:
    """Noise rows ``[B, spf * steps, columns]`` of a step of ``steps`` frames (``[1]`` int64) starting at frame
    ``position`` (``[B, 1]`` int64), equal to ``NoiseTable.seeded(seed, length, columns).rows(position * spf, ...)``."""
    from onnx import TensorProto

    count = b.op("Mul", [steps, b.i64(spf)])
    rows = b.op("Range", [b.const(np.array(0, np.int64)), b.op("Squeeze", [count]), b.const(np.array(1, np.int64))])
    absolute = b.op("Add", [b.op("Mul", [position, b.const(np.array(spf, np.int64))]), rows])  # [B, n]
    index = b.op("Mul", [b.op("Mod", [absolute, b.const(np.array(length, np.int64))]),
                         b.const(np.array(columns, np.int64))])
    key = np.array([_int64(c + seed * _GOLDEN) for c in range(columns)], np.int64)
    z = b.op("Add", [b.op("Unsqueeze", [index, b.i64(-1)]), b.const(key)])  # [B, n, cols]

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


class _Weights:
    """The model's initializers from several graphs: a name that holds the same bytes in each is kept once."""

    def __init__(self, inits: list[Any]) -> None:
        self.inits, self._bytes = inits, {}

    def add(self, tensor: Any, prefix: str) -> str:
        import onnx
        from onnx import numpy_helper

        raw = numpy_helper.to_array(tensor).tobytes()
        name = tensor.name
        if name in self._bytes and self._bytes[name] != raw:
            name = prefix + name
        if name not in self._bytes:
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            copy.name = name
            self.inits.append(copy)
            self._bytes[name] = raw
        return name


def _inline(b: _Builder, graph: Any, weights: _Weights, inputs: dict[str, str]) -> dict[str, str]:
    """Append ``graph``'s nodes to ``b``, its inputs read from ``inputs`` (graph input -> value in scope), every other
    value renamed under ``b``'s prefix, its weights kept in the model's initializers. Returns its outputs' values."""
    import onnx

    rename = dict(inputs)
    for tensor in graph.initializer:
        rename[tensor.name] = weights.add(tensor, b.prefix)
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = b.prefix + node.name
        for field in (copy.input, copy.output):
            for k, name in enumerate(field):
                if name:
                    field[k] = rename.setdefault(name, b.prefix + name)
        b.nodes.append(copy)
    return {o.name: rename[o.name] for o in graph.output}


def _if(b: _Builder, cond: str, types: list[int], then: Callable[[_Builder], list[str]],
        otherwise: Callable[[_Builder], list[str]]) -> list[str]:
    """An ONNX ``If`` on ``cond`` (``[1]`` bool) whose branches ``then`` and ``otherwise`` build their outputs (of
    ``types``) with a builder of their own; returns the ``If``'s outputs."""
    from onnx import helper

    branches = []
    for label, build in (("then", then), ("else", otherwise)):
        branch = b.child(label)
        values = [branch.op("Identity", [v]) for v in build(branch)]  # a branch's outputs are made in it
        branches.append(helper.make_graph(branch.nodes, branch.prefix, [], [
            helper.make_tensor_value_info(v, t, None) for v, t in zip(values, types)]))
    outputs = [b.name("if") for _ in types]
    b.nodes.append(helper.make_node("If", [cond], outputs, name=b.name("n"), then_branch=branches[0],
                                    else_branch=branches[1]))
    return outputs


def vocoder_graph(step: Any, final: Any, f0: Any, constants: StreamConstants, gen_layout: list[dict[str, Any]],
                  f0_layout: list[dict[str, Any]], seed: int, max_chunk_frames: int = MAX_CHUNK_FRAMES) -> Any:
    """The ``hift_vocoder`` graph from the export's generator step, final step and F0 step (ModelProtos with their
    weights loaded): one request of one stream, as ``VocoderStream._steps`` computes a push (F0 of the frames that
    became computable, one generator step up to the look-ahead, on ``end`` the final step over the rest)."""
    from onnx import TensorProto as TP, helper

    from hift_runtime.manifest import DTYPE_NAMES

    c = constants
    spf, look, f0_ahead, source_ahead = c.samples_per_frame, c.mel_look_ahead, c.f0_look_ahead, c.source_look_ahead
    onnx_type = {name: helper.np_dtype_to_tensor_dtype(np.dtype(name)) for name in DTYPE_NAMES}
    inits: list[Any] = []
    weights = _Weights(inits)
    b = _Builder("v/", inits)
    zero, big = b.i64(0), b.i64(1 << 62)
    gen_in, gen_next = cache_io_names(gen_layout)
    f0_in, f0_next = cache_io_names(f0_layout)

    # Where the stream stands: n frames received, the generator done up to ``base`` (n less the mel look-ahead), F0 up
    # to ``f0_end``; this request brings ``count`` frames.
    n = b.op("Reshape", [STATE_FRAMES, b.i64(-1)])  # [1]
    mel_shape = b.op("Shape", [MEL])
    count = b.slice(mel_shape, b.i64(2), b.i64(3), 0)
    # A chunk longer than the stated maximum fails here, before anything is computed (Triton keeps the state).
    refused = b.op("Where", [b.op("Greater", [count, b.i64(max_chunk_frames)]), b.i64(2), b.i64(1)])
    check = b.op("Reshape", [zero, refused], node_name=f"refused: a chunk holds more than {max_chunk_frames} frames")
    n_new = b.op("Add", [b.op("Add", [n, count]), check])
    end = b.op("Reshape", [END, b.i64(-1)])
    batch = b.slice(mel_shape, zero, b.i64(1), 0)
    base = b.op("Max", [zero, b.op("Sub", [n, b.i64(look)])])
    mel_cat = b.op("Concat", [STATE_MEL, MEL], axis=2)  # frames [n - look, n_new)
    mel_all = b.slice(mel_cat, b.op("Sub", [b.i64(look), b.op("Sub", [n, base])]), big, 2)  # [base, n_new)
    f0_end = b.op("Max", [zero, b.op("Sub", [n, b.i64(f0_ahead)])])
    target = b.op("Where", [end, n_new, b.op("Sub", [n_new, b.i64(f0_ahead)])])

    def empty_audio(bb: _Builder) -> str:
        return bb.op("ConstantOfShape", [bb.op("Concat", [batch, zero], axis=0)],
                     value=helper.make_tensor("zero", TP.FLOAT, [1], [0.0]))

    def rows(bb: _Builder, value: str, dtype: int) -> str:  # a [1] value as [B, 1]
        return bb.op("Expand", [bb.op("Cast", [bb.op("Unsqueeze", [value, b.i64(0)])], to=dtype),
                                bb.op("Concat", [batch, b.i64(1)], axis=0)])

    def drop_lag(bb: _Builder, audio: str, position: str) -> str:  # the samples before the utterance (first step)
        start = bb.op("Mul", [bb.op("Cast", [bb.op("Equal", [position, zero])], to=TP.INT64), b.i64(c.audio_lag * spf)])
        return bb.slice(audio, start, big, 1)

    # 1. F0 of the frames that became computable (on end all of them, with zero look-ahead).
    def f0_step(bb: _Builder) -> list[str]:
        window = bb.slice(mel_all, bb.op("Sub", [f0_end, base]), big, 2)
        pad = bb.op("Concat", [bb.slice(bb.op("Shape", [window]), zero, b.i64(2), 0),
                               bb.op("Mul", [bb.op("Cast", [end], to=TP.INT64), b.i64(f0_ahead)])], axis=0)
        window = bb.op("Concat", [window, bb.op("ConstantOfShape", [pad], value=helper.make_tensor(
            "zero", TP.FLOAT, [1], [0.0]))], axis=2)
        out = _inline(bb, f0.graph, weights, {"mel": window, **{k: k for k in f0_in}})
        return [out["f0"]] + [out[name] for name in f0_next]

    f0_types = [TP.FLOAT] + [onnx_type[e["dtype"]] for e in f0_layout]
    do_f0 = b.op("Greater", [target, f0_end])
    f0_out = _if(b, do_f0, f0_types, f0_step, lambda bb: [bb.slice(STATE_F0, zero, zero, 1), *f0_in])
    f0_all = b.op("Concat", [b.slice(STATE_F0, zero, b.op("Sub", [f0_end, base]), 1), f0_out[0]], axis=1)
    f0_end = b.op("Where", [do_f0, target, f0_end])

    # 2. One generator step up to where the mel and source look-aheads are known.
    limit = b.op("Min", [b.op("Sub", [n_new, b.i64(look)]), b.op("Sub", [f0_end, b.i64(source_ahead)])])

    def generator_step(bb: _Builder) -> list[str]:
        frames = bb.op("Sub", [limit, base])
        steps = bb.op("Add", [frames, b.i64(source_ahead)])
        out = _inline(bb, step.graph, weights, {
            "mel": bb.slice(mel_all, zero, bb.op("Add", [frames, b.i64(look)]), 2),
            "f0": bb.slice(f0_all, zero, steps, 1),
            "noise": _noise(bb, rows(bb, base, TP.INT64), steps, seed, c.noise_table_length, c.num_sines, spf),
            "phase_in": STATE_PHASE, "first": rows(bb, bb.op("Equal", [base, zero]), TP.BOOL),
            **{k: k for k in gen_in}})
        return [drop_lag(bb, out["audio"], base), out["phase_out"]] + [out[name] for name in gen_next]

    gen_types = [TP.FLOAT, TP.DOUBLE] + [onnx_type[e["dtype"]] for e in gen_layout]
    do_gen = b.op("Greater", [limit, base])
    gen_out = _if(b, do_gen, gen_types, generator_step, lambda bb: [empty_audio(bb), STATE_PHASE, *gen_in])
    position = b.op("Where", [do_gen, limit, base])

    # 3. On end, the final step over the frames left.
    def final_step(bb: _Builder) -> list[str]:
        frames = bb.op("Sub", [n_new, position])
        offset = bb.op("Sub", [position, base])
        out = _inline(bb, final.graph, weights, {
            "mel": bb.slice(mel_all, offset, big, 2), "f0": bb.slice(f0_all, offset, bb.op("Add", [offset, frames]), 1),
            "noise": _noise(bb, rows(bb, position, TP.INT64), frames, seed, c.noise_table_length, c.num_sines, spf),
            "phase_in": gen_out[1], "first": rows(bb, bb.op("Equal", [position, zero]), TP.BOOL),
            **dict(zip(gen_in, gen_out[2:]))})
        return [drop_lag(bb, out["audio"], position)]

    do_final = b.op("And", [end, b.op("Greater", [n_new, position])])
    final_audio = _if(b, do_final, [TP.FLOAT], final_step, lambda bb: [empty_audio(bb)])[0]

    # Outputs: the audio released, the next state (an ended stream's is dropped by Triton).
    outputs = {
        AUDIO: b.op("Concat", [gen_out[0], final_audio], axis=1),
        NEXT_STATE + STATE_MEL: b.slice(mel_cat, b.i64(-look), big, 2),
        NEXT_STATE + STATE_FRAMES: b.op("Reshape", [n_new, b.i64(-1, 1)]),
        NEXT_STATE + STATE_F0: b.slice(b.op("Concat", [STATE_F0, f0_out[0]], axis=1), b.i64(-1), big, 1),
        NEXT_STATE + STATE_PHASE: gen_out[1],
        **dict(zip(gen_next, gen_out[2:])),
        **dict(zip(f0_next, f0_out[1:])),
    }
    for name, value in outputs.items():
        b.nodes.append(helper.make_node("Identity", [value], [name], name=f"out/{name}"))

    def info(name: str, dtype: int, shape: list[Any]) -> Any:
        return helper.make_tensor_value_info(name, dtype, ["batch", *shape])

    states = _states(c, gen_layout, f0_layout)
    graph_inputs = [info(MEL, TP.FLOAT, [c.in_channels, "frames"]), info(END, TP.BOOL, [1])]
    graph_inputs += [info(s["input"], onnx_type[s["dtype"]], s["dims"]) for s in states]
    graph_outputs = [info(AUDIO, TP.FLOAT, ["samples"])]
    graph_outputs += [info(s["output"], onnx_type[s["dtype"]], s["dims"]) for s in states]
    graph = helper.make_graph(b.nodes, MODEL, graph_inputs, graph_outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=list(step.opset_import), ir_version=step.ir_version,
                              producer_name="hift-export")
    helper.set_model_props(model, {wire.PARAM_PROTOCOL: wire.SEQUENCE_PROTOCOL})
    return model


def _states(c: StreamConstants, gen_layout: list[dict[str, Any]], f0_layout: list[dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """Every implicit state of a stream: input and output name, dtype, dims (without the batch axis)."""
    own = [(STATE_MEL, "float32", [c.in_channels, c.mel_look_ahead]), (STATE_FRAMES, "int64", [1]),
           (STATE_F0, "float32", [1]), (STATE_PHASE, "float64", [c.num_sines])]
    states = [{"input": name, "output": NEXT_STATE + name, "dtype": dtype, "dims": dims} for name, dtype, dims in own]
    layout = gen_layout + f0_layout
    return states + [{"input": name, "output": out, "dtype": e["dtype"], "dims": list(e["shape"])}
                     for name, out, e in zip(*cache_io_names(layout), layout)]


def config_pbtxt(constants: StreamConstants, states: list[dict[str, Any]], *, max_streams: int,
                 idle_us: int = SEQUENCE_IDLE_US, start_timeout_us: int = START_TIMEOUT_US,
                 max_chunk_frames: int = MAX_CHUNK_FRAMES, gpus: list[int] | None = None) -> str:
    """``hift_vocoder``'s ``config.pbtxt`` (the tests parse it with Triton's model-config protobuf). ``gpus``: one
    instance on each listed GPU (None: one instance, on a GPU where Triton has one, else on the CPU: ``KIND_AUTO``
    loads on any Triton). Triton's sequence batcher sends every request of a sequence to the instance that took its
    START, so a stream's state stays on one device."""
    instances = f"kind: KIND_GPU count: 1 gpus: {list(gpus)}" if gpus else "kind: KIND_AUTO count: 1"
    # What a client reads (get_model_config): the protocol, the audio's rate, the longest chunk, the capacity, and how
    # long a START may wait for a free stream slot before Triton refuses it.
    params = {wire.PARAM_PROTOCOL: wire.SEQUENCE_PROTOCOL, wire.PARAM_SAMPLE_RATE: constants.sample_rate,
              wire.PARAM_MAX_CHUNK_FRAMES: max_chunk_frames, wire.PARAM_MAX_STREAMS: max_streams,
              wire.PARAM_START_TIMEOUT_US: start_timeout_us}
    lines = [f"name: \"{MODEL}\"", "backend: \"onnxruntime\"", "max_batch_size: 1",
             f"input [{{ name: \"{MEL}\" data_type: TYPE_FP32 dims: [{constants.in_channels}, -1] }}]",
             f"output [{{ name: \"{AUDIO}\" data_type: TYPE_FP32 dims: [-1] }}]",
             f"instance_group [{{ {instances} }}]",
             "parameters [" + ", ".join(f"{{ key: \"{k}\" value: {{ string_value: \"{v}\" }} }}"
                                        for k, v in params.items()) + "]",
             "sequence_batching {",
             f"  max_sequence_idle_microseconds: {idle_us}",
             # Candidate sequences = the capacity: a START past it waits in Triton's backlog for a free slot, at
             # most its request timeout (the protocol's START timeout), then is refused.
             f"  oldest {{ max_candidate_sequences: {max_streams} max_queue_delay_microseconds: 0 }}",
             f"  control_input [{{ name: \"{END}\" control [{{ kind: CONTROL_SEQUENCE_END "
             "bool_false_true: [false, true] }] }]"]
    for s in states:
        kind = triton_type(s["dtype"])
        lines.append(f"  state [{{ input_name: \"{s['input']}\" output_name: \"{s['output']}\" data_type: {kind} "
                     f"dims: {s['dims']} initial_state: {{ data_type: {kind} dims: {s['dims']} zero_data: true "
                     f"name: \"zeros\" }} }}]")
    return "\n".join(lines + ["}"]) + "\n"


def write_triton_repository(manifest: Manifest, out: Path, *, max_streams: int = DEFAULT_MAX_STREAMS,
                            noise_seed: int = 0, idle_us: int = SEQUENCE_IDLE_US,
                            start_timeout_us: int = START_TIMEOUT_US, max_chunk_frames: int = MAX_CHUNK_FRAMES,
                            gpus: list[int] | None = None, log: Callable[[str], None] = print) -> Path:
    """Write the repository into ``out`` (``hift_vocoder/config.pbtxt``, ``hift_vocoder/1/model.onnx`` and its
    ``model.weights``) from an export; returns the model's path."""
    import onnx

    if max_streams < 1:
        raise ValueError(f"max_streams must be at least 1, got {max_streams}")
    if not 0 < start_timeout_us < idle_us:
        raise ValueError(f"the START timeout ({start_timeout_us} us) must be positive and below the idle time "
                         f"({idle_us} us): a START that waited longer would be force-ended as idle")
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    gen_layout, f0_layout = manifest.step["generator_caches"], manifest.step["f0_caches"]
    model = vocoder_graph(onnx.load(str(manifest.path(GENERATOR_STEP))),
                          onnx.load(str(manifest.path(GENERATOR_STEP_FINAL))), onnx.load(str(manifest.path(F0_STEP))),
                          constants, gen_layout, f0_layout, noise_seed, max_chunk_frames)
    folder = out / MODEL / "1"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    for stale in folder.iterdir():
        stale.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.weights")
    onnx.checker.check_model(str(path))
    for file in folder.iterdir():  # readable by a server running as another user (onnx writes 0600)
        file.chmod(0o644)
    (out / MODEL / "config.pbtxt").write_text(config_pbtxt(
        constants, _states(constants, gen_layout, f0_layout), max_streams=max_streams, idle_us=idle_us,
        start_timeout_us=start_timeout_us, max_chunk_frames=max_chunk_frames, gpus=gpus))
    log(f"[triton] {MODEL}: {len(model.graph.node)} nodes, {max_streams} streams -> {out / MODEL}")
    return path
