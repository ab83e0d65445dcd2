"""The stock-Triton repository (``hift-export --triton-repo``) without a server: its config.pbtxt parses with Triton's
model-config protobuf and matches the manifest, and its graph, driven with ONNX Runtime as Triton's sequence batcher
drives it (zero state at START, each state output fed back as the next request's input, END on the last request),
releases for every chunk what ``VocoderStream.push()`` / ``finish()`` release. On a real tritonserver:
``test_real_triton.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from hift_runtime import open_vocoder, wire
from hift_runtime.manifest import read_manifest

from .conftest import max_abs
from .test_streaming import random_mel

# The repository computes what the runtime computes (the same step graphs; its noise hash is exact integer
# arithmetic): the offline pass's own tolerance for streamed audio.
REPO_TOLERANCE = 1e-6
MAX_CHUNK = 64


@pytest.fixture(scope="module")
def repo(small_artifacts, tmp_path_factory):
    from hift_export.triton_repo import write_triton_repository

    out = tmp_path_factory.mktemp("triton") / "repo"
    write_triton_repository(read_manifest(small_artifacts.out), out, max_streams=4, max_chunk_frames=MAX_CHUNK,
                            log=lambda _: None)
    return out


def _pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _config(path: Path):
    from google.protobuf import text_format

    config = _pb().ModelConfig()
    text_format.Parse(path.read_text(), config)
    return config


class SequenceDriver:
    """The model run with ONNX Runtime as Triton's sequence batcher runs it for one sequence."""

    def __init__(self, repo: Path) -> None:
        config = _config(repo / wire.MODEL_NAME / "config.pbtxt")
        self.session = ort.InferenceSession(str(repo / wire.MODEL_NAME / "1" / "model.onnx"),
                                            providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        dtypes = {_pb().TYPE_FP32: np.float32, _pb().TYPE_FP64: np.float64, _pb().TYPE_INT64: np.int64}
        self.states = [(s.input_name, s.output_name, dtypes[s.data_type], list(s.dims))
                       for s in config.sequence_batching.state]
        self.state: dict[str, np.ndarray] = {}

    def request(self, mel: np.ndarray, start: bool, end: bool) -> np.ndarray:
        if start:
            self.state = {name: np.zeros([1, *dims], dtype) for name, _, dtype, dims in self.states}
        out = dict(zip(self.names, self.session.run(None, {
            wire.MEL: mel[None].astype(np.float32), wire.SEQUENCE_END: np.array([[end]]), **self.state})))
        self.state = {name: out[output] for name, output, _, _ in self.states}
        return out[wire.AUDIO][0]


def test_config_parses_and_matches_the_manifest(repo, small_artifacts):
    manifest = read_manifest(small_artifacts.out)
    step = manifest.step
    config = _config(repo / wire.MODEL_NAME / "config.pbtxt")
    assert config.backend == "onnxruntime" and config.max_batch_size == 1
    assert config.instance_group[0].kind == config.instance_group[0].KIND_AUTO  # loads on a CPU-only Triton too
    batching = config.sequence_batching
    assert batching.HasField("oldest") and batching.oldest.max_candidate_sequences == 4
    assert batching.max_sequence_idle_microseconds > int(config.parameters[wire.PARAM_START_TIMEOUT_US].string_value)
    control = batching.control_input[0]
    assert len(batching.control_input) == 1 and control.name == wire.SEQUENCE_END
    assert control.control[0].kind == control.control[0].CONTROL_SEQUENCE_END
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params == {wire.PARAM_PROTOCOL: wire.SEQUENCE_PROTOCOL, wire.PARAM_SAMPLE_RATE: "24000",
                      wire.PARAM_MAX_CHUNK_FRAMES: str(MAX_CHUNK), wire.PARAM_MAX_STREAMS: "4",
                      wire.PARAM_START_TIMEOUT_US: params[wire.PARAM_START_TIMEOUT_US]}
    # Every cache an implicit state, named, shaped and typed as the manifest's layout, starting at zeros.
    states = {s.input_name: s for s in batching.state}
    types = {"float32": _pb().TYPE_FP32, "float64": _pb().TYPE_FP64}
    for entry in step["generator_caches"] + step["f0_caches"]:
        state = states["cache." + entry["name"]]
        assert state.output_name == "next." + entry["name"] and list(state.dims) == entry["shape"]
        assert state.initial_state[0].zero_data and state.data_type == types[entry["dtype"]]
    # The graph takes exactly the declared input, states and control, and returns the audio and the states.
    session = ort.InferenceSession(str(repo / wire.MODEL_NAME / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    assert {i.name for i in session.get_inputs()} == {wire.MEL, wire.SEQUENCE_END} | set(states)
    assert {o.name for o in session.get_outputs()} == {wire.AUDIO} | {s.output_name for s in batching.state}


@pytest.mark.parametrize("schedule", [[1] * 12 + [30], [3, 1, 40], [8], [2, 2, 1, 59, 64, 17], [24, 24, 24, 8],
                                      [4, 0, 5, 50]], ids=str)
def test_each_request_releases_what_the_stream_releases(repo, small_artifacts, schedule):
    """Ragged chunks (1-frame ones, a first chunk shorter than the held-back frames, a stream of one request, an empty
    chunk): each request's audio is what ``push`` / ``finish`` return for the same chunk, and the whole equals the
    offline pass."""
    vocoder = open_vocoder(small_artifacts.out, device="cpu")
    mel = random_mel(sum(schedule), seed=len(schedule))
    driver, stream, pos = SequenceDriver(repo), vocoder.stream(), 0
    served = []
    for k, size in enumerate(schedule):
        chunk, last = mel[:, pos:pos + size], k == len(schedule) - 1
        pos += size
        served.append(driver.request(chunk, start=k == 0, end=last))
        local = stream.finish(chunk) if last else stream.push(chunk)
        assert served[-1].shape == local.shape and max_abs(served[-1], local) <= REPO_TOLERANCE, k
    assert max_abs(np.concatenate(served), vocoder.vocode(mel)) <= REPO_TOLERANCE


def test_a_chunk_over_the_maximum_is_refused_by_the_graph(repo):
    driver = SequenceDriver(repo)
    with pytest.raises(Exception, match=f"refused: a chunk holds more than {MAX_CHUNK} frames"):
        driver.request(random_mel(MAX_CHUNK + 1), start=True, end=False)


def test_in_graph_noise_equals_the_runtime_table():
    """The noise rows the graph computes from a stream's position (counter-based) are the runtime's NoiseTable rows,
    bit for bit, including past the table's wrap."""
    from onnx import TensorProto, helper

    from hift_export.triton_repo import _Builder, _noise
    from hift_runtime.noise import NoiseTable

    inits: list = []
    b = _Builder("t/", inits)
    noise = _noise(b, "position", "steps", 0, 7_200_000, 9, 480)
    b.nodes.append(helper.make_node("Identity", [noise], ["noise"]))
    graph = helper.make_graph(b.nodes, "noise", [helper.make_tensor_value_info("position", TensorProto.INT64, [1, 1]),
                                                 helper.make_tensor_value_info("steps", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("noise", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    table = NoiseTable.seeded(0, 7_200_000, 9)
    for position in (0, 3, 14_999, 15_000, 123_457):
        rows = session.run(None, {"position": np.array([[position]], np.int64), "steps": np.array([5], np.int64)})[0]
        np.testing.assert_array_equal(rows[0], table.rows(position * 480, 5 * 480), err_msg=str(position))


def test_instances_on_the_listed_gpus_and_settings_checked(small_artifacts, tmp_path):
    from hift_export.triton_repo import _states, config_pbtxt, write_triton_repository
    from hift_runtime.contract import StreamConstants

    manifest = read_manifest(small_artifacts.out)
    constants = StreamConstants.from_manifest(manifest.config, manifest.step)
    states = _states(constants, manifest.step["generator_caches"], manifest.step["f0_caches"])
    config = _pb().ModelConfig()
    from google.protobuf import text_format

    text_format.Parse(config_pbtxt(constants, states, max_streams=2, gpus=[0, 1]), config)
    group = config.instance_group[0]
    assert group.kind == group.KIND_GPU and group.count == 1 and list(group.gpus) == [0, 1]
    with pytest.raises(ValueError, match="below the idle time"):
        write_triton_repository(manifest, tmp_path, idle_us=1_000_000, start_timeout_us=2_000_000)
    with pytest.raises(ValueError, match="at least 1"):
        write_triton_repository(manifest, tmp_path, max_streams=0)
