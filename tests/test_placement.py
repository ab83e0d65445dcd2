"""Several devices behind one vocoder (``hift_runtime.placement``), with two fake devices: two CPU vocoders of the
reduced export. New streams go to the least-loaded device and stay there; placement rebalances after expiry; a
failing device takes no new stream while the other's streams go on; every stream equals its solo run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hift_runtime import OverloadError, open_vocoder
from hift_runtime.placement import AllDevicesFailed, MultiDeviceVocoder

from .conftest import max_abs
from .test_streaming import random_mel

# Each stream against its offline pass: the bar of every stream-vs-offline test (float32 steps of other lengths).
TOLERANCE = 1e-6


def two_devices(artifacts, **options) -> MultiDeviceVocoder:
    vocoders = [open_vocoder(artifacts.out, device="cpu", **options) for _ in range(2)]
    return MultiDeviceVocoder(vocoders, ["fake:0", "fake:1"])


@pytest.fixture(scope="module")
def solo(small_artifacts):
    return open_vocoder(small_artifacts.out, device="cpu")


def test_new_streams_go_to_the_least_loaded_device_and_stay_there(small_artifacts, solo):
    front = two_devices(small_artifacts)
    streams = [front.stream() for _ in range(4)]
    assert [front.device_of(s) for s in streams] == ["fake:0", "fake:1", "fake:0", "fake:1"]
    assert front.open_streams_by_device == {"fake:0": 2, "fake:1": 2}
    mels = [random_mel(40 + 9 * i, seed=70 + i) for i in range(4)]
    pieces: list[list[np.ndarray]] = [[] for _ in streams]
    for pos in range(0, 80, 13):  # interleaved pushes: each runs on its own device's vocoder
        for i, s in enumerate(streams):
            if pos < mels[i].shape[1]:
                pieces[i].append(s.push(mels[i][:, pos:pos + 13]))
    for i, s in enumerate(streams):
        audio = np.concatenate([*pieces[i], s.finish()])
        assert max_abs(audio, solo.vocode(mels[i])) <= TOLERANCE
    assert front.open_streams == 0
    front.close()


def test_placement_rebalances_after_expiry(small_artifacts):
    front = two_devices(small_artifacts, idle_timeout_s=0.3)
    a, b, c = front.stream(), front.stream(), front.stream()
    assert [front.device_of(s) for s in (a, b, c)] == ["fake:0", "fake:1", "fake:0"]
    time.sleep(0.4)
    b.push(random_mel(10, seed=1))  # b (fake:1) stays active; a and c (fake:0) expire at the next placement
    d = front.stream()
    assert a.expired and c.expired and not b.expired
    assert front.device_of(d) == "fake:0" and front.open_streams_by_device == {"fake:0": 1, "fake:1": 1}
    front.close()


def test_a_failing_device_takes_no_new_stream_and_disturbs_no_other(small_artifacts, solo):
    front = two_devices(small_artifacts)
    broken, healthy = front.vocoders
    on_broken, on_healthy = front.stream(), front.stream()
    mel = random_mel(60, seed=80)
    first = on_healthy.push(mel[:, :24])

    def fail(*_args, **_kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    broken.backend.generator_step = fail
    with pytest.raises(RuntimeError, match="illegal memory access"):
        on_broken.push(random_mel(30, seed=81))
    assert front.failed_devices == ["fake:0"]
    later = [front.stream() for _ in range(3)]  # fake:0 has fewer streams, but failed
    assert {front.device_of(s) for s in later} == {"fake:1"}
    audio = np.concatenate([first, on_healthy.push(mel[:, 24:]), on_healthy.finish()])
    assert max_abs(audio, solo.vocode(mel)) <= TOLERANCE
    healthy.backend.generator_step = fail
    with pytest.raises(RuntimeError):
        later[0].push(random_mel(30, seed=82))
    with pytest.raises(AllDevicesFailed, match="every device failed.*fake:0.*fake:1"):
        front.stream()
    front.close()


def test_max_streams_is_the_total_over_devices(small_artifacts):
    front = two_devices(small_artifacts)
    front.max_streams = 3
    held = [front.stream() for _ in range(3)]
    with pytest.raises(OverloadError, match="max_streams=3"):
        front.stream()
    held[0].close()
    assert front.device_of(front.stream()) == "fake:0"  # the freed place, on the device that has room
    front.close()


def test_devices_are_checked(small_artifacts):
    with pytest.raises(ValueError, match="distinct CUDA device ids"):
        open_vocoder(small_artifacts.out, devices=[0, 0])
    with pytest.raises(ValueError, match="device='cpu'"):
        open_vocoder(small_artifacts.out, device="cpu", devices=[0, 1])


def test_hift_serve_gpus_option():
    from hift_runtime.server import serving_gpus

    from hift_runtime.server_cli import parser as _parser

    assert _parser().parse_args(["--artifacts", "x", "--gpus", "0,1"]).gpus == [0, 1]
    assert serving_gpus([1], "cuda") == [1]
    assert serving_gpus(None, "cpu") is None  # the CPU: one device
    with pytest.raises(SystemExit):  # one line on stderr, exit 2
        _parser().parse_args(["--artifacts", "x", "--gpus", "a,b"])
