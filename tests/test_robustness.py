"""Issue 5: bad input, damaged artifacts, concurrent streams."""

from __future__ import annotations

import json
import shutil
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from hift_runtime import ArtifactError, MelError, StreamError, open_vocoder
from hift_runtime.manifest import F0_STEP, GENERATOR_STEP, MANIFEST_NAME

from .conftest import run_in_threads
from .test_streaming import random_mel, stream_all


@pytest.fixture(scope="module")
def vocoder(small_artifacts):
    return open_vocoder(small_artifacts.out, device="cpu")


@pytest.fixture()
def artifacts_copy(small_artifacts, tmp_path):
    out = tmp_path / "artifacts"
    shutil.copytree(small_artifacts.out, out)
    return out


# ---- bad input to a stream -----------------------------------------------------------------------------------------
BAD_CHUNKS = {
    "rank1": (np.zeros(80, np.float32), MelError, "must be"),
    "rank4": (np.zeros((1, 1, 80, 5), np.float32), MelError, "must be"),
    "81_bins": (np.zeros((81, 5), np.float32), MelError, "81 channels"),
    "transposed": (np.zeros((5, 80), np.float32), MelError, "transpose"),
    "batch2": (np.zeros((2, 80, 5), np.float32), MelError, "batch size 2"),
    "int": (np.zeros((80, 5), np.int32), MelError, "dtype int32"),
    "bool": (np.zeros((80, 5), bool), MelError, "dtype bool"),
    "nan": (np.full((80, 5), np.nan, np.float32), MelError, "non-finite"),
    "inf": (np.concatenate([np.zeros((80, 4)), np.full((80, 1), -np.inf)], 1).astype(np.float32), MelError,
            "frame 4"),
}


@pytest.mark.parametrize("case", list(BAD_CHUNKS))
def test_rejected_chunk_leaves_the_stream_unchanged(vocoder, case):
    bad, exc, message = BAD_CHUNKS[case]
    mel = random_mel(70, 9)
    clean = vocoder.stream()
    expected = [clean.push(mel[:, :30]), clean.push(mel[:, 30:]), clean.finish()]
    stream = vocoder.stream()
    got = [stream.push(mel[:, :30])]
    with pytest.raises(exc, match=message):
        stream.push(bad)
    got += [stream.push(mel[:, 30:]), stream.finish()]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_accepted_layouts_and_dtypes(vocoder):
    mel = random_mel(40, 2)
    ref = np.concatenate([vocoder.stream().push(mel), ])
    variants = {
        "batched": mel[None],
        "float64": mel.astype(np.float64),
        "fortran": np.asfortranarray(mel),
        "strided": np.repeat(mel, 2, axis=1)[:, ::2],
        "readonly": mel.copy(),
    }
    variants["readonly"].setflags(write=False)
    for name, variant in variants.items():
        np.testing.assert_array_equal(vocoder.stream().push(variant), ref, err_msg=name)
    half = mel.astype(np.float16)  # converted to float32, exactly as the caller's own conversion would
    np.testing.assert_array_equal(vocoder.stream().push(half), vocoder.stream().push(half.astype(np.float32)))


def test_out_of_range_mel_warns_once(vocoder):
    stream = vocoder.stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream.push(np.full((80, 10), 40.0, np.float32))
        stream.push(np.full((80, 10), 40.0, np.float32))
    assert len([w for w in caught if "log mel" in str(w.message) or "natural-log" in str(w.message)]) == 1


def test_push_after_finish_and_finish_twice(vocoder):
    stream = vocoder.stream()
    stream.push(random_mel(10))
    stream.finish()
    with pytest.raises(StreamError, match="after finish"):
        stream.push(random_mel(10))
    with pytest.raises(StreamError, match="twice"):
        stream.finish()


def test_empty_stream(vocoder):
    assert vocoder.stream().finish().shape == (0,)


# ---- damaged artifacts ---------------------------------------------------------------------------------------------
def _manifest(out):
    return json.loads((out / MANIFEST_NAME).read_text())


def _write_manifest(out, data):
    (out / MANIFEST_NAME).write_text(json.dumps(data))


def test_missing_folder_and_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        open_vocoder(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        open_vocoder(tmp_path)


def test_missing_file(artifacts_copy):
    (artifacts_copy / "hift_f0_step.onnx").unlink()
    with pytest.raises(ArtifactError, match="hift_f0_step.onnx.*missing"):
        open_vocoder(artifacts_copy)


@pytest.mark.parametrize("how", ["truncated", "longer", "tampered"])
def test_damaged_graph(artifacts_copy, how):
    path = artifacts_copy / "hift_generator.weights"
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
        match = "hift_generator.weights.*truncated"
    elif how == "longer":
        path.write_bytes(bytes(data) + b"\0" * 16)
        match = "hift_generator.weights.*longer than written"
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        match = "hift_generator.weights.*sha256"
    with pytest.raises(ArtifactError, match=match):
        open_vocoder(artifacts_copy)


def _newer_format(data):
    data["format_version"] = 99


def _renamed_input(data):
    data["artifacts"][GENERATOR_STEP]["inputs"][0]["name"] = "spectrogram"


def _float64_f0(data):
    data["artifacts"][F0_STEP]["inputs"][0]["dtype"] = "float64"


def _cache_shape(data):
    data["step"]["generator_caches"][0]["shape"][1] += 1


def _cache_init(data):
    data["step"]["generator_caches"][3]["init"] = "ones"


def _other_config(data):
    data["config"]["nsf_alpha"] = 0.2


@pytest.mark.parametrize("edit, match", [
    (_newer_format, "format version 99, newer"),
    (_renamed_input, "hift_generator_step.onnx: graph signature"),
    (_float64_f0, "hift_f0_step.onnx: the F0 graph must take and return float32"),
    (_other_config, "differs from manifest.json"),  # graphs from another export
    (_cache_shape, r"cache.ups.0 is \[\d+, 15\] .*the manifest's cache layout says \[\d+, 16\]"),
    (_cache_init, "initial value 'ones'"),
], ids=["newer_format_version", "signature_mismatch", "f0_not_float32", "mixed_exports", "cache_shape",
        "cache_init"])
def test_manifest_mismatches_are_refused(artifacts_copy, edit, match):
    data = _manifest(artifacts_copy)
    edit(data)
    _write_manifest(artifacts_copy, data)
    with pytest.raises(ArtifactError, match=match):
        open_vocoder(artifacts_copy)


def test_vocode_cli_on_damaged_artifacts_is_one_line(artifacts_copy, tmp_path, capsys):
    from hift_runtime.cli import main

    (artifacts_copy / "hift_f0_step.onnx").write_bytes(b"garbage")
    np.save(tmp_path / "mel.npy", random_mel(20))
    code = main(["--artifacts", str(artifacts_copy), "--mel", str(tmp_path / "mel.npy"), "--out",
                 str(tmp_path / "a.wav"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "hift_f0_step.onnx" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _bytes_as_string(data):
    data["artifacts"][GENERATOR_STEP]["bytes"] = str(data["artifacts"][GENERATOR_STEP]["bytes"])


def _artifacts_as_list(data):
    data["artifacts"] = []


def _bytes_as_bool(data):
    data["artifacts"][F0_STEP]["bytes"] = True


def _channels_as_float(data):
    data["config"]["in_channels"] = 80.0


def _caches_as_object(data):
    data["step"]["generator_caches"] = {}


def _cache_shape_of_strings(data):
    data["step"]["f0_caches"][0]["shape"] = ["80", 8]


@pytest.mark.parametrize("edit, field", [
    (_bytes_as_string, f"manifest.artifacts.{GENERATOR_STEP}.bytes must be an integer, not str"),
    (_artifacts_as_list, "manifest.artifacts must be an object"),
    (_bytes_as_bool, f"manifest.artifacts.{F0_STEP}.bytes must be an integer, not bool"),
    (_channels_as_float, "manifest.config.in_channels must be an integer, not float"),
    (_caches_as_object, "manifest.step.generator_caches must be a list"),
    (_cache_shape_of_strings, "manifest.step.f0_caches[0].shape[0] must be an integer, not str"),
], ids=["bytes_string", "artifacts_list", "bytes_bool", "channels_float", "caches_object", "shape_strings"])
def test_a_malformed_manifest_is_one_refusal_naming_the_field(artifacts_copy, edit, field):
    data = _manifest(artifacts_copy)
    edit(data)
    _write_manifest(artifacts_copy, data)
    with pytest.raises(ArtifactError) as refused:
        open_vocoder(artifacts_copy)
    assert field in str(refused.value) and len(str(refused.value).splitlines()) == 1


def _point_at(data, role, name):
    data["artifacts"][role]["file"] = name


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../../etc/passwd", "sub/../../outside.onnx", ""],
                         ids=["absolute", "dotdot", "dotdot_inside", "empty"])
@pytest.mark.parametrize("role", [F0_STEP, "ts_f0_step"])
def test_a_manifest_naming_a_file_outside_the_folder_is_refused_before_reading_it(artifacts_copy, monkeypatch, role,
                                                                                 name):
    data = _manifest(artifacts_copy)
    if role not in data["artifacts"]:
        pytest.skip(f"no {role} in this export")
    _point_at(data, role, name)
    _write_manifest(artifacts_copy, data)
    touched = []
    real_stat = Path.stat
    monkeypatch.setattr(Path, "stat", lambda self, *a, **k: (touched.append(str(self)), real_stat(self, *a, **k))[1])
    with pytest.raises(ArtifactError, match="not a plain name inside the artifacts folder"):
        open_vocoder(artifacts_copy)
    assert not [t for t in touched if "passwd" in t or "outside" in t], touched


def test_a_link_leading_outside_the_folder_is_refused_even_with_a_matching_digest(artifacts_copy, tmp_path):
    from hift_runtime.manifest import sha256_file

    outside = tmp_path / "outside.onnx"
    shutil.copy(artifacts_copy / "hift_f0_step.onnx", outside)
    (artifacts_copy / "hift_f0_step.onnx").unlink()
    (artifacts_copy / "hift_f0_step.onnx").symlink_to(outside)
    data = _manifest(artifacts_copy)
    assert data["artifacts"][F0_STEP]["sha256"] == sha256_file(outside)  # size and digest match: still refused
    with pytest.raises(ArtifactError, match="leads outside the artifacts folder"):
        open_vocoder(artifacts_copy)


def test_hift_vocode_on_a_malformed_manifest_exits_2_in_one_line(artifacts_copy, tmp_path, capsys):
    from hift_runtime.cli import main

    data = _manifest(artifacts_copy)
    _bytes_as_string(data)
    _write_manifest(artifacts_copy, data)
    np.save(tmp_path / "mel.npy", random_mel(20))
    code = main(["--artifacts", str(artifacts_copy), "--mel", str(tmp_path / "mel.npy"), "--out",
                 str(tmp_path / "a.wav"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "bytes must be an integer" in err and len(err.strip().splitlines()) == 1


# ---- load ----------------------------------------------------------------------------------------------------------
def test_concurrent_streams_are_independent(vocoder):
    """16 streams pushed from 4 threads over one opened runtime: each bitwise equal to the same stream run alone."""
    mels = [random_mel(60 + 7 * i, seed=100 + i) for i in range(16)]
    schedules = [[5 + (i % 4) * 6] * 20 for i in range(16)]

    def run(mel, schedule):
        return np.concatenate(stream_all(vocoder, mel, schedule)[0])

    alone = [run(m, s) for m, s in zip(mels, schedules)]
    per_thread = run_in_threads(lambda k: {i: run(mels[i], schedules[i]) for i in range(k, 16, 4)}, range(4))
    results = {i: audio for part in per_thread for i, audio in part.items()}
    for i in range(16):
        np.testing.assert_array_equal(results[i], alone[i], err_msg=f"stream {i}")


def test_one_stream_from_many_threads_is_serialised(vocoder):
    """Calls on one stream from several threads are serialised by its lock: every frame is stepped exactly once and
    the total length is exact (the order of the pieces is the callers' business)."""
    stream = vocoder.stream()
    mel = random_mel(200, 21)
    pieces: list[np.ndarray] = []

    def worker(offset):
        for pos in range(offset, 200, 20):
            pieces.append(stream.push(mel[:, pos:pos + 10]))

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pieces.append(stream.finish())
    assert sum(p.shape[0] for p in pieces) == 480 * 200
    assert stream.stats.generator_frames == stream.stats.f0_frames == 200


def test_sessions_are_bounded_whatever_the_workload(small_artifacts, monkeypatch):
    """The runtime builds its sessions once at open (F0 step, generator step, final step): no workload adds any
    (the landed per-shape pool built one per recurring window length: 151 over 200 utterances)."""
    import onnxruntime as ort

    import hift_runtime.ort_engine as ort_engine

    built = []
    real = ort.InferenceSession

    def counting(*args, **kwargs):
        built.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ort_engine.ort, "InferenceSession", counting)
    v = open_vocoder(small_artifacts.out, device="cpu")
    assert len(built) == 3
    rng = np.random.default_rng(5)
    for i in range(40):
        frames = int(rng.integers(1, 120))
        stream = v.stream()
        mel = random_mel(frames, i)
        for pos in range(0, frames, 24):
            stream.push(mel[:, pos:pos + 24])
        stream.finish()
    v.warmup()
    assert len(built) == 3


def test_runtime_verifies_what_it_loads(artifacts_copy):
    """Open time hashes the files the runtime loads; the TorchScript files only on request."""
    from hift_runtime import read_manifest

    (artifacts_copy / "hift_generator_step.ts").unlink()
    open_vocoder(artifacts_copy, device="cpu")  # the runtime never loads .ts files
    with pytest.raises(ArtifactError, match="hift_generator_step.ts.*missing"):
        read_manifest(artifacts_copy, verify="all")


def test_short_noise_table_says_it_wraps_early(small_artifacts, tmp_path):
    np.save(tmp_path / "noise.npy", np.random.default_rng(0).random((4800, 9), dtype=np.float32))
    with pytest.warns(RuntimeWarning, match="4800 rows, the model's has 7200000.*reuse its rows earlier"):
        open_vocoder(small_artifacts.out, device="cpu", noise_table=tmp_path / "noise.npy")
