"""The stream table against what a hostile or unlucky client sends (CPU, reduced model): ids that are not UTF-8,
requests of several rows, resent chunks, floods of one stream, an id one byte too long."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hift_runtime import open_vocoder, wire
from hift_runtime.serving import chunk_request
from hift_runtime.serving import MAX_REQUESTS_IN_FLIGHT, MAX_STREAM_ID_BYTES, ChunkRequest, StreamTable

from .conftest import max_abs

SERVED_TOLERANCE = 1e-6  # a stream through the table vs the offline pass (test_serve.py)


@pytest.fixture(scope="module")
def vocoder(small_artifacts):
    with open_vocoder(small_artifacts.out, device="cpu", batching=True) as v:
        yield v


@pytest.fixture
def table(vocoder):
    table = StreamTable(vocoder)
    yield table
    table.close()


def _mel(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(-4, 1.5, (80, frames)).astype(np.float32)


def _wire(sid: bytes, mel: np.ndarray, start: bool, end: bool, offset: int | None = None) -> ChunkRequest:
    """A request as the server decodes it from the wire's tensors (batch axis first)."""
    data = {wire.STREAM_ID: np.array([[sid]], dtype=object), wire.MEL: mel[None],
            wire.START: np.array([[start]]), wire.END: np.array([[end]])}
    if offset is not None:
        data[wire.OFFSET] = np.array([[offset]], np.int64)
    return chunk_request(data)


def test_ids_that_differ_only_in_invalid_utf8_never_reach_one_stream(table):
    first, other = b"\xff\x01", b"\xfe\x01"
    mel = _mel(8)
    opened, ended = table.handle([_wire(first, mel, True, False), _wire(other, mel, False, True)])
    assert "not valid UTF-8" in opened.error and "not valid UTF-8" in ended.error
    assert table.open_streams == 0 and table.refused["bad_id"] == 2
    assert chunk_request({wire.STREAM_ID: np.array([[first]], dtype=object), wire.MEL: mel[None],
                          wire.START: np.array([[True]]), wire.END: np.array([[False]])}).stream_id != \
        chunk_request({wire.STREAM_ID: np.array([[other]], dtype=object), wire.MEL: mel[None],
                       wire.START: np.array([[True]]), wire.END: np.array([[False]])}).stream_id


def test_a_request_of_two_rows_is_refused_whole(table):
    mel = np.stack([_mel(8), _mel(8, 1)])
    request = chunk_request({wire.STREAM_ID: np.array([[b"B1"], [b"B2"]], dtype=object), wire.MEL: mel,
                             wire.START: np.array([[True], [True]]), wire.END: np.array([[False], [False]])})
    (reply,) = table.handle([request])
    assert "carries 2 rows" in reply.error and reply.audio.size == 0
    assert table.open_streams == 0 and table.refused["bad_request"] == 1


def test_an_id_of_the_limit_is_taken_and_one_byte_more_is_refused(table):
    at_limit, over = "x" * MAX_STREAM_ID_BYTES, "y" * (MAX_STREAM_ID_BYTES + 1)
    ok, refused = table.handle([ChunkRequest(at_limit, _mel(4), True, True), ChunkRequest(over, _mel(4), True, True)])
    assert ok.error == "" and f"{MAX_STREAM_ID_BYTES + 1} bytes" in refused.error


def test_a_resent_chunk_is_answered_again_and_applied_once(table, vocoder):
    """A client that timed out resends its chunk with the same offset: the same audio comes back and the stream has
    the chunk once; another offset is refused naming the frame expected; a resent end returns the final reply."""
    mel = _mel(60, 3)
    parts, offsets = [mel[:, :20], mel[:, 20:44], mel[:, 44:]], [0, 20, 44]
    out = []
    (first,) = table.handle([_wire(b"s", parts[0], True, False, 0)])
    out.append(first.audio)
    (again,) = table.handle([_wire(b"s", parts[0], True, False, 0)])  # a resent start: not "already open"
    assert again.error == "" and np.array_equal(again.audio, first.audio)
    (second,) = table.handle([_wire(b"s", parts[1], False, False, offsets[1])])
    (resent,) = table.handle([_wire(b"s", parts[1], False, False, offsets[1])])
    assert resent.error == "" and np.array_equal(resent.audio, second.audio)
    out.append(second.audio)
    (stale,) = table.handle([_wire(b"s", parts[0], False, False, 0)])
    (gap,) = table.handle([_wire(b"s", parts[2], False, False, 50)])
    assert "stream has 44 frames" in stale.error and "stream has 44 frames" in gap.error
    assert table.refused["bad_offset"] == 2
    (last,) = table.handle([_wire(b"s", parts[2], False, True, offsets[2])])
    (last_again,) = table.handle([_wire(b"s", parts[2], False, True, offsets[2])])
    assert last_again.error == "" and np.array_equal(last_again.audio, last.audio)
    out.append(last.audio)
    assert max_abs(np.concatenate(out), vocoder.vocode(mel)) <= SERVED_TOLERANCE
    assert table.resends_replayed == 3 and table.open_streams == 0


def test_a_flood_of_one_stream_is_refused_past_its_bound_and_memory_stays_flat(vocoder):
    """Every request beyond MAX_REQUESTS_IN_FLIGHT of one stream is refused at once: what the table holds of a
    stream does not grow with what its client sends."""
    table = StreamTable(vocoder)
    try:
        mel = _mel(24)
        (opened,) = table.handle([ChunkRequest("f", mel, True, False)])
        assert opened.error == ""
        flood = [ChunkRequest("f", mel) for _ in range(4 * MAX_REQUESTS_IN_FLIGHT)]
        held: list[int] = []

        async def watch() -> None:  # the requests the table holds for the stream, seen from its own loop
            for _ in range(200):
                entry = table._order.get("f")
                held.append(0 if entry is None else entry[1])
                await asyncio.sleep(0.001)

        watching = asyncio.run_coroutine_threadsafe(watch(), table._loop)
        replies = table.handle(flood)
        watching.result(timeout=30)
        refused = [r for r in replies if r.error]
        assert len(refused) == len(flood) - MAX_REQUESTS_IN_FLIGHT
        assert all("in flight" in r.error for r in refused) and table.refused["flood"] == len(refused)
        assert max(held) <= MAX_REQUESTS_IN_FLIGHT
        again = table.handle(flood)  # a second flood: the same bound, the stream still served
        assert sum(not r.error for r in again) == MAX_REQUESTS_IN_FLIGHT
    finally:
        table.close()
