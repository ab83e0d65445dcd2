"""The vocoder inside upstream CosyVoice3's own ``tts()`` (``hift_runtime.cosyvoice``): upstream's real code from
``../shared/upstream-cosyvoice`` (its ``CosyVoice3Model.tts()`` with a stub LLM and a stub flow that returns slices of
a given mel), the adapter's audio against this runtime's offline pass and against upstream's own streaming output."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from hift_runtime import open_vocoder
from hift_runtime.cosyvoice import use_streaming_vocoder

from .conftest import FIXTURES, REQUIRE_FIXTURES, ROOT, max_abs, needs_fixtures, run_in_threads, snr_db

UPSTREAM = FIXTURES.parent / "upstream-cosyvoice"
if not (UPSTREAM / "run_token2wav.py").is_file():
    if REQUIRE_FIXTURES:
        raise RuntimeError(f"HIFT_REQUIRE_FIXTURES is set but upstream's code is missing: {UPSTREAM}")
    pytest.skip(f"upstream CosyVoice's code not found at {UPSTREAM} (../shared/upstream-cosyvoice beside the "
                f"checkout)", allow_module_level=True)
torch = pytest.importorskip("torch")
sys.path.insert(0, str(UPSTREAM))
import run_token2wav as upstream  # noqa: E402  (upstream's runner: its stubs, its model classes)

# A stream vs the offline pass of the same mel: the bar every streaming test uses.
TOLERANCE = 1e-6
# Against upstream's own streaming output (its eager HiFT re-run over the whole mel at every chunk, with the same
# noise table): float32 arithmetic of two implementations, measured 2.7e-7 on the offline pass at 121 dB.
UPSTREAM_TOLERANCE = 2e-6


def demo_mel(frames: int) -> np.ndarray:
    return upstream.load_mel(str(ROOT / "examples" / "demo_mel.npy"), frames)


def tts(vocoder, mel: np.ndarray, stream: bool, speed: float = 1.0) -> tuple[np.ndarray, list[int]]:
    """Upstream's ``tts()`` over ``mel`` (its stub LLM yields one token per 2 frames, its stub flow returns the mel's
    slices) with the adapter in HiFT's place; the audio and the mel frames of each chunk the vocoder was given."""
    model = upstream.CosyVoice3Model(upstream.StubLLM(mel.shape[1] // 2), upstream.StubFlow(torch.from_numpy(mel)[None]),
                                     torch.nn.Identity())
    use_streaming_vocoder(model, vocoder)
    chunks = [out["tts_speech"] for out in model.tts(stream=stream, speed=speed)]
    assert all(c.dtype == torch.float32 and c.shape[0] == 1 for c in chunks)
    return torch.cat(chunks, dim=1)[0].numpy(), [call["mel"] for call in model.flow.calls]


@pytest.fixture(scope="module")
def small_vocoder(small_artifacts):
    """The reduced export: the bookkeeping under upstream's tts() is the same at any width (the full-size one, and
    upstream's own HiFT, in the comparison with upstream's output below)."""
    return open_vocoder(small_artifacts.out, device="cpu", idle_timeout_s=30)


@pytest.mark.parametrize("frames", [250, 300, 1000])
def test_streaming_tts_equals_the_offline_pass_at_upstreams_schedule(small_vocoder, frames):
    mel = demo_mel(frames)
    audio, flow_mel = tts(small_vocoder, mel, stream=True)
    offline = small_vocoder.vocode(mel)
    assert audio.shape == offline.shape == (480 * frames,)
    assert max_abs(audio, offline) <= TOLERANCE
    chunks = np.diff([0, *flow_mel]).tolist()  # the mel each token2wav call added: upstream's hop schedule
    assert sum(chunks) == frames and chunks[:2] == [50, 100], chunks
    if frames == 1000:
        assert chunks == [50, 100, 200, 200, 200, 200, 50], chunks
    assert small_vocoder.open_streams == 0  # the last chunk finished the stream


def test_non_streaming_tts_and_speed(small_vocoder):
    mel = demo_mel(300)
    audio, _ = tts(small_vocoder, mel, stream=False)
    assert max_abs(audio, small_vocoder.vocode(mel)) <= TOLERANCE
    slower, _ = tts(small_vocoder, mel, stream=False, speed=0.5)
    stretched = torch.nn.functional.interpolate(torch.from_numpy(mel)[None], size=600, mode="linear")[0].numpy()
    assert max_abs(slower, small_vocoder.vocode(stretched)) <= TOLERANCE  # upstream's interpolation, then HiFT
    assert small_vocoder.open_streams == 0


@needs_fixtures
def test_streaming_tts_equals_upstreams_own_streaming_with_its_noise_table(full_artifacts, tmp_path):
    """Upstream's HiFT built and loaded by upstream's code (seed 1986: its noise table), run by its own tts(stream=
    True); this runtime with that noise table in the same tts()."""
    import warnings

    from .conftest import CHECKPOINT

    mel = demo_mel(300)
    hift = upstream.build_upstream_hift(1986)
    upstream.load_with_upstream(hift, str(CHECKPOINT), torch.from_numpy(mel)[None])
    theirs = upstream.run_upstream_tts(hift, torch.from_numpy(mel)[None], 150, stream=True)
    theirs = torch.cat(theirs["chunks"], dim=1)[0].numpy()
    rows = 480 * (mel.shape[1] + 8)
    np.save(tmp_path / "noise.npy", hift.m_source.l_sin_gen.sine_waves[0, :rows].numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the table's first rows only: this stream never wraps
        ours_vocoder = open_vocoder(full_artifacts.out, device="cpu", noise_table=tmp_path / "noise.npy")
    ours, _ = tts(ours_vocoder, mel, stream=True)
    assert ours.shape == theirs.shape
    assert max_abs(ours, theirs) <= UPSTREAM_TOLERANCE and snr_db(ours, theirs) >= 110


def test_four_concurrent_tts_calls_each_get_their_own_stream(small_vocoder):
    mels = [demo_mel(200 + 50 * i) * (1.0 + 0.01 * i) for i in range(4)]
    got = run_in_threads(lambda i: tts(small_vocoder, mels[i], stream=True)[0], range(4), timeout=300)
    for mel, audio in zip(mels, got):
        assert max_abs(audio, small_vocoder.vocode(mel)) <= TOLERANCE
    assert small_vocoder.open_streams == 0


def test_an_abandoned_tts_leaves_no_stream_past_the_idle_timeout(small_artifacts):
    import time

    vocoder = open_vocoder(small_artifacts.out, device="cpu")
    mel = demo_mel(400)
    model = upstream.CosyVoice3Model(upstream.StubLLM(200), upstream.StubFlow(torch.from_numpy(mel)[None]),
                                     torch.nn.Identity())
    use_streaming_vocoder(model, vocoder, idle_timeout_s=0.3)
    assert vocoder.idle_timeout_s == 0.3  # (it had none)
    speech = model.tts(stream=True)
    next(speech)
    speech.close()  # the caller stops listening after the first chunk
    assert vocoder.open_streams == 1
    time.sleep(0.5)
    assert vocoder.reap() == 1 and vocoder.open_streams == 0


def test_streaming_speed_is_refused_as_upstream_refuses_it():
    from types import SimpleNamespace

    class Flow:
        token_mel_ratio = 2

        def inference(self, **kwargs):
            return torch.zeros(1, 80, 10), None

    model = SimpleNamespace(flow=Flow(), fp16=False, device=torch.device("cpu"), hift_cache_dict={})
    use_streaming_vocoder(model, SimpleNamespace(constants=None, idle_timeout_s=1.0, stream=threading.Lock))
    with pytest.raises(ValueError, match="non-streaming tts"):
        model.token2wav(torch.zeros(1, 5), torch.zeros(1, 0), torch.zeros(1, 0, 80), torch.zeros(0, 192), 0, "u",
                        stream=True, finalize=False, speed=1.5)
