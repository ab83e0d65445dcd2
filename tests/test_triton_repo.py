"""The Triton model repository (``hift-export --triton-repo``): every config.pbtxt parses with Triton's model-config
protobuf, and the ONNX models, driven with ONNX Runtime exactly as Triton's sequence batcher drives them (zero state
at START, each state output fed back as the next input, START and END flags, interleaved sequences in one batch),
give the offline pass. No tritonserver with the onnxruntime backend runs here, so this is the whole check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from hift_runtime import open_vocoder
from hift_runtime.batching import PushScheduler
from hift_runtime.manifest import DTYPE_NAMES, read_manifest
from hift_runtime.engine import EngineTraits
from hift_runtime.streaming import StreamingVocoder

from hift_export.targets import STEP_TOLERANCE

from .conftest import max_abs, run_in_threads
from .test_streaming import random_mel, stream_all

# The repository computes what the runtime computes (the same step graphs; its noise hash is exact integer
# arithmetic): the offline pass's own tolerance for streamed audio.
REPO_TOLERANCE = 1e-6
STATE_DTYPES = {triton: np.dtype(name).type for name, (_, triton) in DTYPE_NAMES.items()}  # the one table, read back


@pytest.fixture(scope="module")
def repo(small_artifacts, tmp_path_factory):
    from hift_export.triton_repo import write_triton_repository

    out = tmp_path_factory.mktemp("triton") / "repo"
    write_triton_repository(read_manifest(small_artifacts.out), out, max_batch=8, log=lambda _: None)
    return out


def _pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _config(path: Path):
    from google.protobuf import text_format

    config = _pb().ModelConfig()
    text_format.Parse(path.read_text(), config)
    return config


def test_configs_parse_and_match_the_manifest(repo, small_artifacts):
    manifest = read_manifest(small_artifacts.out)
    step = manifest.step
    gen, f0 = _config(repo / "hift_generator" / "config.pbtxt"), _config(repo / "hift_f0" / "config.pbtxt")
    assert gen.backend == f0.backend == "onnxruntime" and gen.max_batch_size == 8
    assert gen.instance_group[0].kind == gen.instance_group[0].KIND_AUTO  # loads on a CPU-only Triton too
    assert f0.instance_group[0].kind == f0.instance_group[0].KIND_CPU
    assert gen.sequence_batching.HasField("oldest") and f0.sequence_batching.HasField("oldest")
    controls = {c.name: c.control[0].kind for c in gen.sequence_batching.control_input}
    kinds = gen.sequence_batching.control_input[0].control[0]
    assert controls == {"first": kinds.CONTROL_SEQUENCE_START, "end": kinds.CONTROL_SEQUENCE_END}
    # Every cache an implicit state, named, shaped and typed as the manifest's layout, starting at zeros.
    states = {s.input_name: s for s in gen.sequence_batching.state}
    for entry in step["generator_caches"]:
        state = states["cache." + entry["name"]]
        assert state.output_name == "next." + entry["name"] and list(state.dims) == entry["shape"]
        assert state.initial_state[0].zero_data and state.data_type == _pb().TYPE_FP32
    assert set(states) == {"cache." + e["name"] for e in step["generator_caches"]} | {"phase_in", "position"}
    f0_states = {s.input_name: s for s in f0.sequence_batching.state}
    assert {k: list(v.dims) for k, v in f0_states.items()} == {"cache." + e["name"]: e["shape"]
                                                               for e in step["f0_caches"]}
    # The graphs take exactly the declared inputs, states and controls.
    for name, config in (("hift_generator", gen), ("hift_f0", f0)):
        session = ort.InferenceSession(str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        declared = ({i.name for i in config.input} | {s.input_name for s in config.sequence_batching.state}
                    | {c.name for c in config.sequence_batching.control_input})
        assert {i.name for i in session.get_inputs()} == declared, name
        outputs = {o.name for o in session.get_outputs()}
        assert {o.name for o in config.output} | {s.output_name for s in config.sequence_batching.state} == outputs


class _Sequence:
    """One Triton sequence's implicit state, as the server keeps it between requests."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, np.ndarray]] = {"f0": {}, "generator": {}}


class SequenceBatcherEmulator:
    """The runtime's backend interface over the repository's two models, requests batched and states kept the way
    Triton's sequence batcher does: a state starts at zeros with START, each output is the next request's input.

    It also keeps Triton's sequence slots: a START takes one of the model's ``max_candidate_sequences`` (refused here
    when none is free, where Triton would make it wait up to the idle timeout), and the client protocol frees them:
    the stream's last request to *each* model carries END (emulated: a stream's last F0 request is the one whose 3
    look-ahead frames are the zeros of the utterance's end, its last generator request the final step; a real client
    knows its last requests). A START that fails inside the model still opens its sequence (Triton does
    that); the client recovers by sending START again, which the runtime's bookkeeping does by itself (a failed push
    changes nothing, so its retry is again the stream's first request)."""

    name = "triton-repo(emulated)"
    traits = EngineTraits()

    def warmup(self, step_sizes, progress=None) -> None:
        pass

    def stream_capacity(self) -> int:
        return min(self.candidates.values())

    def __init__(self, repo: Path) -> None:
        self.sessions = {kind: ort.InferenceSession(str(repo / model / "1" / "model.onnx"),
                                                    providers=["CPUExecutionProvider"])
                         for kind, model in (("f0", "hift_f0"), ("generator", "hift_generator"))}
        self.states = {kind: {s.input_name: s for s in _config(repo / model / "config.pbtxt").sequence_batching.state}
                       for kind, model in (("f0", "hift_f0"), ("generator", "hift_generator"))}
        self.candidates = {kind: _config(repo / model / "config.pbtxt").sequence_batching.oldest.max_candidate_sequences
                           for kind, model in (("f0", "hift_f0"), ("generator", "hift_generator"))}
        self.open: dict[str, set[int]] = {"f0": set(), "generator": set()}
        self.fail_next_start: str | None = None  # a model whose next START request fails inside ONNX Runtime
        self.requests = 0

    def new_caches(self, kind: str, batch: int = 1):
        return _Sequence()

    def _run(self, kind, feed, sequences, start):
        for seq, fresh in zip(sequences, start):
            if fresh and id(seq) not in self.open[kind]:
                if len(self.open[kind]) >= self.candidates[kind]:
                    raise RuntimeError(f"{kind}: every sequence slot is held; a START would wait for the idle timeout")
                self.open[kind].add(id(seq))
        if self.fail_next_start == kind and any(start):
            self.fail_next_start = None
            raise RuntimeError(f"{kind}: injected failure of a START request (its sequence is open now)")
        for name, state in self.states[kind].items():
            rows = []
            for seq, fresh in zip(sequences, start):
                value = None if fresh else seq.state[kind].get(name)
                if value is None:  # a sequence's first request: the initial state (zeros)
                    value = np.zeros((1, *state.dims), STATE_DTYPES[_pb().DataType.Name(state.data_type)])
                rows.append(value)
            feed[name] = np.concatenate(rows)
        session = self.sessions[kind]
        names = [o.name for o in session.get_outputs()]
        out = dict(zip(names, session.run(names, feed)))
        for i, seq in enumerate(sequences):
            seq.state[kind] = {name: out[state.output_name][i:i + 1] for name, state in self.states[kind].items()}
        self.requests += len(sequences)
        return out

    def f0_step(self, mel, sequences):
        rows = sequences if isinstance(sequences, list) else [sequences]  # the batcher passes a list
        out = self._run("f0", {"mel": mel}, rows, [not s.state["f0"] for s in rows])
        for i, seq in enumerate(rows):
            if not mel[i, :, -3:].any():  # the zero look-ahead of the utterance's end: this request carried END
                self.open["f0"].discard(id(seq))
        return out["f0"], sequences

    def generator_step(self, mel, f0, noise, phase_in, first, sequences, final):
        handles = sequences
        sequences = sequences if isinstance(sequences, list) else [sequences]
        rows = mel.shape[0]
        if final:  # a final request carries zeros where a step has look-ahead (the model reads the first c frames)
            mel = np.concatenate([mel, np.zeros((rows, mel.shape[1], 4), np.float32)], axis=2)
            f0 = np.concatenate([f0, np.zeros((rows, 1), np.float32)], axis=1)
        frames = f0.shape[1] - 1
        out = self._run("generator", {"mel": mel, "f0": f0, "first": first, "end": np.full((rows, 1), final)},
                        sequences, list(first[:, 0]))
        # The runtime's contract: the step's audio including the frame before the utterance on a first step.
        if final:  # the final step carried END: the sequence's slot is free
            for seq in sequences:
                self.open["generator"].discard(id(seq))
        width = 480 * (frames + (1 if final else 0))
        audio = np.zeros((rows, width), np.float32)
        for i in range(rows):
            got = out["audio_out"][i, :int(out["samples"][i, 0])]
            audio[i, width - got.shape[0]:] = got
        return audio, out["phase_state"], None if final else handles


def test_repository_driven_like_the_sequence_batcher_equals_offline(repo, small_artifacts):
    offline = open_vocoder(small_artifacts.out, device="cpu")
    emulator = SequenceBatcherEmulator(repo)
    vocoder = StreamingVocoder(emulator, offline.constants, step_sizes=(24, 16, 8, 4, 2, 1))
    vocoder.scheduler = PushScheduler(emulator, max_batch=8, max_wait_s=0.01,
                                      pushes_in_progress=lambda: vocoder.pushes_in_progress)
    rng = np.random.default_rng(12)
    mels = [random_mel(int(rng.integers(3, 90)), seed=40 + i) for i in range(6)]
    schedules = [[int(x) for x in rng.integers(1, 30, 6)] + [500] for _ in range(6)]
    results = run_in_threads(lambda i: np.concatenate(stream_all(vocoder, mels[i], schedules[i])[0]), range(6))
    for mel, audio in zip(mels, results):
        assert max_abs(audio, offline.vocode(mel)) <= REPO_TOLERANCE
    stats = vocoder.scheduler.stats
    assert stats.max_batch > 1  # interleaved sequences shared requests' batches
    assert emulator.open == {"f0": set(), "generator": set()}  # every sequence was ended on both models


def test_the_client_protocol_ends_both_sequences_and_recovers_from_a_failed_start(repo, small_artifacts):
    from hift_export.triton_repo import SEQUENCE_IDLE_US

    for model in ("hift_f0", "hift_generator"):  # an un-ended sequence cannot hold a slot for a minute
        assert _config(repo / model / "config.pbtxt").sequence_batching.max_sequence_idle_microseconds == \
            SEQUENCE_IDLE_US <= 10_000_000
    offline = open_vocoder(small_artifacts.out, device="cpu")
    emulator = SequenceBatcherEmulator(repo)
    emulator.candidates = {"f0": 2, "generator": 2}
    vocoder = StreamingVocoder(emulator, offline.constants, step_sizes=(24, 16, 8, 4, 2, 1))
    for i in range(5):  # more streams than slots, one after another: each frees its slots at its end
        mel = random_mel(20 + 7 * i, seed=60 + i)
        stream = vocoder.stream()
        if i == 1:  # the stream's very first request fails: nothing advanced anywhere, START again recovers
            emulator.fail_next_start = "f0"
            with pytest.raises(RuntimeError, match="injected failure of a START"):
                stream.push(mel[:, :16])
            assert stream.frames_in == 0
        audio = np.concatenate([stream.push(mel[:, :16]), stream.finish(mel[:, 16:])])  # the retry STARTs again
        assert max_abs(audio, offline.vocode(mel)) <= REPO_TOLERANCE
    assert emulator.open == {"f0": set(), "generator": set()}


def test_in_graph_noise_equals_the_runtime_table(repo):
    """The generator model's noise rows (counter-based, from the position state) are the runtime's NoiseTable rows,
    bit for bit, including past the table's wrap."""
    import onnx
    from onnx import helper

    from hift_runtime.noise import NoiseTable

    model = onnx.load(str(repo / "hift_generator" / "1" / "model.onnx"), load_external_data=False)
    model.graph.output.append(helper.make_tensor_value_info("noise", onnx.TensorProto.FLOAT, None))
    del model.graph.node[[n.output[0] for n in model.graph.node].index("noise") + 1:]
    keep = {"f0", "position"}
    inputs = [i for i in model.graph.input if i.name in keep]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("noise", onnx.TensorProto.FLOAT, None))
    used = {name for node in model.graph.node for name in node.input}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    table = NoiseTable.seeded(0, 7_200_000, 9)
    for position in (0, 3, 14_999, 15_000, 123_457):
        noise = session.run(None, {"f0": np.zeros((1, 5), np.float32),
                                   "position": np.array([[position]], np.int64)})[0]
        np.testing.assert_array_equal(noise[0], table.rows(position * 480, 5 * 480), err_msg=str(position))


def test_a_batch_mixing_ending_and_continuing_rows_equals_each_row_alone(repo):
    """Triton's sequence batcher puts a sequence's END request beside other sequences' steps: each row of such a batch
    is what the same request gives alone (the final step runs for the batch, and is kept only where END is set)."""
    session = ort.InferenceSession(str(repo / "hift_generator" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    states = {s.input_name: s for s in _config(repo / "hift_generator" / "config.pbtxt").sequence_batching.state}
    rng = np.random.default_rng(5)
    feed = {"mel": rng.standard_normal((3, 80, 10)).astype(np.float32) - 5,
            "f0": (rng.random((3, 7)) * 200).astype(np.float32),
            "first": np.array([[False], [True], [False]]), "end": np.array([[True], [False], [False]])}
    for name, state in states.items():
        kind = STATE_DTYPES[_pb().DataType.Name(state.data_type)]
        value = rng.integers(0, 500, (3, *state.dims)) if kind is np.int64 else rng.standard_normal((3, *state.dims))
        feed[name] = (value * (0.05 if kind is np.float32 else 1)).astype(kind)
    names = [o.name for o in session.get_outputs()]
    together = session.run(names, feed)
    for i in range(3):
        alone = session.run(names, {k: v[i:i + 1] for k, v in feed.items()})
        for name, a, b in zip(names, together, alone):
            if name.startswith("next.") and feed["end"][i, 0]:
                continue  # an ended sequence's state is released
            # Batch size changes the convolutions' float32 rounding; with random caches (larger than a stream's)
            # that reaches the exporter's own bound for the step graphs (STEP_TOLERANCE), the audio stays within 1e-6.
            bound = STEP_TOLERANCE if name.startswith("next.") else REPO_TOLERANCE
            np.testing.assert_allclose(a[i:i + 1], b, rtol=0, atol=bound, err_msg=f"{name} row {i}")


def test_generator_instances_on_the_listed_gpus(small_artifacts):
    from google.protobuf import text_format

    from hift_export.triton_repo import config_pbtxt

    layout = read_manifest(small_artifacts.out).step["generator_caches"]
    config = _pb().ModelConfig()
    text_format.Parse(config_pbtxt("hift_generator", layout, generator=True, max_batch=8, in_channels=80, columns=9,
                                   max_queue_delay_us=2000, idle_us=10_000_000, gpus=[0, 1]), config)
    group = config.instance_group[0]
    assert group.kind == group.KIND_GPU and group.count == 1 and list(group.gpus) == [0, 1]
