"""What a server does with a batch of chunk requests, apart from the server that carries them (PyTriton in
:mod:`hift_runtime.server`): a table of open streams keyed by stream id over one :class:`StreamingVocoder`.

A request names its stream, carries a mel chunk and two flags: ``start`` opens the stream (the chunk is its first),
``end`` closes it after the chunk (the reply then holds the held-back tail too). The requests of one batch run
concurrently as tasks of one event loop (its own thread), handed to the vocoder's push scheduler without a thread
per stream (:meth:`~hift_runtime.streaming.VocoderStream.apush`), so they become batched steps; the requests of one
stream run in the order they came, also across batches served at once. A refused request (unknown stream, a chunk after end, a bad mel, a chunk
longer than ``max_chunk_frames``, a bad id, too many open streams) gets its own error message and leaves every
stream's state as it was; the others in its batch are served. An ``end`` request is one unit: its chunk and the
stream's tail are computed together, or (refused, failed) not at all.

Memory is bounded whatever clients send: open streams by ``max_streams`` (the vocoder's), a chunk by
``max_chunk_frames``, an id by :data:`MAX_STREAM_ID_BYTES`, the requests one stream has in flight by
:data:`MAX_REQUESTS_IN_FLIGHT`, each open stream's remembered last reply by one chunk's audio, the final replies of
ended streams by :data:`FINAL_REPLIES_REMEMBERED`, and the ids of closed streams (remembered so that a late chunk is
told "ended" or "expired" rather than "unknown") by :data:`CLOSED_IDS_REMEMBERED`.

Resends: a request may carry its chunk's ``offset`` (the frames of the stream sent before it). A chunk is applied only
at the stream's current frame count; a resend of the last applied chunk (same offset and length: a client that timed
out and retried) gets that chunk's audio again and changes nothing; any other offset is refused with the frame the
server expects. Stream ids are keyed by their exact bytes: an id that is not valid UTF-8 is refused, never merged.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .errors import MelError, OverloadError, StreamError
from .mel_input import validate_mel
from .streaming import StreamingVocoder, VocoderStream

log = logging.getLogger("hift_runtime.serving")
# Ids of closed streams remembered (oldest forgotten first): at most this many ids of at most MAX_STREAM_ID_BYTES.
CLOSED_IDS_REMEMBERED = 16384
MAX_STREAM_ID_BYTES = 256
# Requests of one stream queued or running at once: a client waits for each reply, so a few cover retries and
# pipelining; past this a request is refused at once instead of holding its mel in the server.
MAX_REQUESTS_IN_FLIGHT = 8
# Ended streams whose final reply is kept for a resend of their last request (their audio: one chunk each).
FINAL_REPLIES_REMEMBERED = 256
# The longest chunk a request may carry by default: 1 000 frames are 20 s of audio (320 KB of mel); a push is split
# into bounded steps anyway, this bounds what one request holds in memory and how long it occupies the device.
MAX_CHUNK_FRAMES = 1000


def _refusal(message: str, reason: str) -> StreamError:
    """A refused request's error, with the reason the server's metrics count it under."""
    exc = StreamError(message)
    exc.reason = reason  # type: ignore[attr-defined]
    return exc


def refusal_reason(exc: BaseException) -> str:
    """What a refused request is counted as: overload, bad_mel, bad_id, bad_request (not one row of the wire's
    tensors), bad_offset (a chunk not at the stream's frame count), flood (too many requests of one stream in
    flight), unknown_stream, closed_stream, already_open, stream_state (a call the stream's state does not allow), or
    internal (a backend failure)."""
    if isinstance(exc, OverloadError):
        return "overload"
    if isinstance(exc, MelError):
        return "bad_mel"
    if isinstance(exc, StreamError):
        return getattr(exc, "reason", "stream_state")
    return "internal"


def decode_stream_id(raw: Any) -> str:
    """A stream id as it arrives (bytes) -> the table's key: UTF-8, with undecodable bytes kept as surrogates
    (``surrogateescape``), so two different byte strings never become one key (:func:`check_stream_id` refuses
    them)."""
    return raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else str(raw)


def check_stream_id(stream_id: str) -> None:
    """Refuse an empty id, one that is not valid UTF-8, or one longer than :data:`MAX_STREAM_ID_BYTES` (UTF-8) with
    :class:`StreamError`."""
    if not stream_id:
        raise _refusal("the stream id is empty; send a non-empty id (a UUID, say)", "bad_id")
    try:
        size = len(stream_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise _refusal("the stream id is not valid UTF-8; send a UTF-8 id (a UUID, say)", "bad_id") from None
    if size > MAX_STREAM_ID_BYTES:
        raise _refusal(f"the stream id has {size} bytes, more than {MAX_STREAM_ID_BYTES}; use a shorter id",
                       "bad_id")


def shown_id(stream_id: str) -> str:
    """The id as error messages quote it: cut short, so a message never echoes an oversized id back."""
    return repr(stream_id if len(stream_id) <= 64 else stream_id[:61] + "...")


@dataclass(frozen=True)
class ChunkRequest:
    """One chunk of one stream: ``mel [C, T]`` (or ``[1, C, T]``) natural-log mel frames; ``offset``: the stream's
    frames sent before this chunk (None: not checked); ``problem``: why the request is malformed as it arrived (it
    is then refused with that message, nothing else looked at)."""

    stream_id: str
    mel: np.ndarray
    start: bool = False
    end: bool = False
    offset: int | None = None
    problem: str = ""


@dataclass
class _Applied:
    """The last chunk applied to a stream: where it started, its frames, and the audio its reply carried (a resend of
    it gets that audio again)."""

    offset: int
    frames: int
    audio: np.ndarray


@dataclass(frozen=True)
class ChunkReply:
    """The audio this chunk released (``error`` empty), or why the request was refused (``audio`` empty)."""

    audio: np.ndarray
    error: str = ""


_EMPTY = np.zeros(0, np.float32)


def chunk_request(data: dict[str, Any]) -> ChunkRequest:
    """One wire request's tensors (each with its batch axis; ``offset`` may be absent or None) -> the table's
    request. A request that is not exactly one row carries its refusal (``problem``), so it is refused alone."""
    sid = decode_stream_id(wire.first_value(data[wire.STREAM_ID]))
    start, end = (bool(wire.first_value(data[name])) for name in (wire.START, wire.END))
    offset = data.get(wire.OFFSET)
    rows = {np.shape(value)[0] if np.ndim(value) else 0 for value in data.values() if value is not None}
    problem = "" if rows == {1} else (f"the request carries {max(rows)} rows; send one chunk of one stream per "
                                      f"request (batch size 1)")
    return ChunkRequest(sid, data[wire.MEL][0], start, end,
                        None if offset is None else int(wire.first_value(offset)), problem)


def reply_tensors(reply: ChunkReply, rate: np.ndarray, final: bool = True) -> dict[str, np.ndarray]:
    """One reply's output tensors, each with its batch axis (an empty release is one zero sample and ``samples`` 0:
    some Triton clients cannot carry an empty tensor); ``final``: the request's last response."""
    samples = reply.audio.shape[0]
    audio = reply.audio if samples else np.zeros(1, np.float32)
    return {wire.AUDIO: np.ascontiguousarray(audio[None], np.float32), wire.SAMPLES: np.array([[samples]], np.int64),
            wire.SAMPLE_RATE: rate, wire.ERROR: np.array([[reply.error.encode()]], dtype=object),
            wire.FINAL: np.array([[final]])}


class StreamTable:
    """Open streams by id over one vocoder; :meth:`handle` serves a batch of requests."""

    def __init__(self, vocoder: StreamingVocoder, workers: int = 64, max_chunk_frames: int = MAX_CHUNK_FRAMES) -> None:
        """``workers``: threads for pushes where the vocoder has no batching scheduler (with one, none are used)."""
        if workers < 1 or max_chunk_frames < 1:
            raise ValueError(f"workers and max_chunk_frames must be >= 1, got {workers}, {max_chunk_frames}")
        self.vocoder = vocoder
        self.max_chunk_frames = max_chunk_frames
        self._streams: dict[str, VocoderStream] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._applied: dict[str, _Applied] = {}  # each open stream's last applied chunk (a resend replays it)
        self._final: collections.OrderedDict[str, _Applied] = collections.OrderedDict()  # ended streams' last
        self.resends_replayed = 0
        self._lock = threading.Lock()
        self._next_reap = 0.0
        # Stream id -> [its order lock, requests holding or awaiting it]: the loop's own (touched only there).
        self._order: dict[str, list[Any]] = {}
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hift-stream"))
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="hift-serving-loop", daemon=True)
        self._loop_thread.start()
        # What the server's metrics show (server_metrics.py): refusals by reason, streams expired.
        self.refused: collections.Counter[str] = collections.Counter()
        self.streams_expired = 0

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def handle(self, requests: Sequence[ChunkRequest]) -> list[ChunkReply]:
        """Serve one batch: one reply per request, in order."""
        order = self._by_stream(requests)
        groups = [[requests[i] for i in idx] for idx in order.values()]
        answered = asyncio.run_coroutine_threadsafe(self._serve_groups(groups), self._loop).result()
        replies: list[ChunkReply] = [ChunkReply(_EMPTY)] * len(requests)
        for idx, group_replies in zip(order.values(), answered):
            for i, reply in zip(idx, group_replies):
                replies[i] = reply
        return replies

    def submit(self, requests: Sequence[ChunkRequest], on_reply: Callable[[int, ChunkReply], None],
               on_piece: Callable[[int, np.ndarray], None] | None = None) -> None:
        """Serve one batch without waiting for it: ``on_reply(i, reply)`` for request ``i``, called from the table's
        loop thread as soon as its stream's requests of this batch are done (a server that can answer requests one
        by one takes the next batch meanwhile). ``on_piece(i, audio)``: each step's audio of request ``i`` as soon as
        that step is done (from the thread that runs the steps), before its reply. Order and refusals as
        :meth:`handle`."""
        order = self._by_stream(requests)

        async def serve(idx: list[int]) -> None:
            pieces = None if on_piece is None else [lambda audio, i=i: on_piece(i, audio) for i in idx]
            for i, reply in zip(idx, await self._serve_in_order([requests[i] for i in idx], pieces)):
                try:
                    on_reply(i, reply)
                except Exception:  # noqa: BLE001 - a reply that cannot be sent: that request's loss alone
                    log.exception("stream %s: the reply could not be sent", shown_id(requests[i].stream_id))

        def start() -> None:  # tasks created in batch order: each stream's lock is taken in the order requests came
            for idx in order.values():
                self._loop.create_task(serve(idx))

        self._loop.call_soon_threadsafe(start)

    def close(self) -> None:
        """Stop the table's event loop (after the batches in flight) and its threads."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    # ---- internals (the coroutines run on the table's loop) ---------------------------------------------------------
    def _by_stream(self, requests: Sequence[ChunkRequest]) -> dict[str, list[int]]:
        """A batch's request indices by stream id, in arrival order (idle streams expired first)."""
        self._expire_idle()
        order: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            order.setdefault(request.stream_id, []).append(i)
        if self._loop.is_closed():
            raise RuntimeError("the stream table was closed")
        return order

    async def _serve_groups(self, groups: list[list[ChunkRequest]]) -> list[list[ChunkReply]]:
        return list(await asyncio.gather(*(self._serve_in_order(g) for g in groups)))

    async def _serve_in_order(self, requests: list[ChunkRequest],
                              pieces: list[Callable[[np.ndarray], None]] | None = None) -> list[ChunkReply]:
        """One stream's requests of a batch, in order, after its requests of batches served before (one lock per
        stream id while some request of it is in flight: a stream's calls never overlap)."""
        sid = requests[0].stream_id
        entry = self._order.get(sid)
        if entry is None:
            entry = self._order[sid] = [asyncio.Lock(), 0]
        room = max(0, MAX_REQUESTS_IN_FLIGHT - entry[1])
        admitted, flooded = requests[:room], requests[room:]
        refused = [self._refuse(r, _refusal(f"{MAX_REQUESTS_IN_FLIGHT} requests of this stream are in flight, the "
                                            f"most one stream may have; wait for their replies", "flood"))
                   for r in flooded]
        entry[1] += len(admitted)
        try:
            if not admitted:
                return refused
            async with entry[0]:
                return [await self._serve(r, None if pieces is None else pieces[k])
                        for k, r in enumerate(admitted)] + refused
        finally:
            entry[1] -= len(admitted)
            if entry[1] == 0:
                del self._order[sid]

    async def _serve(self, request: ChunkRequest, on_audio: Callable[[np.ndarray], None] | None = None) -> ChunkReply:
        sid = request.stream_id
        stream = None
        try:
            if request.problem:
                raise _refusal(request.problem, "bad_request")
            check_stream_id(sid)
            replay = self._replay(request)
            if replay is not None:  # a resend of the chunk applied last: its audio again, nothing applied twice
                return ChunkReply(replay)
            found = None if request.start else self._find(sid)  # an unknown or ended stream is said first
            mel = validate_mel(request.mel, self.vocoder.constants.in_channels)  # refused: nothing opened or moved
            if mel.shape[1] > self.max_chunk_frames:
                raise MelError(f"the chunk has {mel.shape[1]} frames, more than this server takes in one request "
                               f"({self.max_chunk_frames}); send it as several chunks")
            expected = 0 if found is None else found.frames_in
            if request.offset is not None and request.offset != expected:
                raise _refusal(f"the chunk's offset is frame {request.offset}, but the stream has {expected} frames "
                               f"(a chunk already applied, or one missing); send the chunk that starts at frame "
                               f"{expected}", "bad_offset")
            stream = self._open(sid) if found is None else found
            try:
                # push + finish as one unit: a failed end request leaves the stream as it was.
                audio = await (stream.afinish(mel, on_audio=on_audio) if request.end
                               else stream.apush(mel, on_audio=on_audio))
            except Exception:
                if request.start:  # the stream was never there: the client may start it again
                    stream.close()
                    self._forget(sid, None)
                raise
            self._remember(sid, _Applied(expected, mel.shape[1], audio), request.end)
            return ChunkReply(audio)
        except (MelError, StreamError, OverloadError) as exc:
            return self._refuse(request, exc)
        except Exception as exc:  # noqa: BLE001 - a backend failure: this request fails, the server goes on
            self._count_refusal("internal")
            log.exception("stream %s: request failed", shown_id(sid))
            return ChunkReply(_EMPTY, f"stream {shown_id(sid)}: internal error: {type(exc).__name__}: {exc}")
        finally:
            if stream is not None and stream.lost:  # its device caches went in a failed step: it leaves the table
                self._forget(sid, "lost its device caches in a failed step and was released; start a new stream")

    def _refuse(self, request: ChunkRequest, exc: BaseException) -> ChunkReply:
        """A refused request's reply (counted by reason); no stream's state was touched."""
        self._count_refusal(refusal_reason(exc))
        overloaded = wire.OVERLOADED if isinstance(exc, OverloadError) else ""
        return ChunkReply(_EMPTY, f"{overloaded}stream {shown_id(request.stream_id)}: {exc}")

    def _replay(self, request: ChunkRequest) -> np.ndarray | None:
        """The audio of the chunk applied last to this stream (open, or ended by it) when ``request`` resends it (the
        same offset and frames, and flags that fit), else None."""
        if request.offset is None:
            return None
        with self._lock:
            applied = self._applied.get(request.stream_id)
            if applied is None and request.end and not request.start:  # a start re-runs: the same audio anew
                applied = self._final.get(request.stream_id)
            if applied is None or (request.start and applied.offset != 0):
                return None
            if (applied.offset, applied.frames) != (request.offset, int(np.shape(request.mel)[-1])):
                return None
            self.resends_replayed += 1
            return applied.audio

    def _remember(self, sid: str, applied: _Applied, ended: bool) -> None:
        """After a chunk was applied: it is the one a resend replays; an end also forgets the open stream."""
        if not ended:
            with self._lock:
                self._applied[sid] = applied
            return
        self._forget(sid, "ended (its last request had end=true); start a new stream")
        with self._lock:
            self._final[sid] = applied
            while len(self._final) > FINAL_REPLIES_REMEMBERED:
                self._final.popitem(last=False)

    def _count_refusal(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1

    def _open(self, sid: str) -> VocoderStream:
        with self._lock:
            if sid in self._streams:
                raise _refusal("start=true for a stream id that is open; end it first or use a new id",
                               "already_open")
            stream = self.vocoder.stream()  # OverloadError at max_streams
            self._streams[sid] = stream
            self._closed.pop(sid, None)
            self._final.pop(sid, None)
            return stream

    def _find(self, sid: str) -> VocoderStream:
        with self._lock:
            stream = self._streams.get(sid)
            if stream is not None:
                return stream
            why = self._closed.get(sid)
        if why is not None:
            raise _refusal(f"the stream {why}", "closed_stream")
        raise _refusal("unknown stream id: send its first chunk with start=true", "unknown_stream")

    def _forget(self, sid: str, why: str | None) -> None:
        with self._lock:
            self._streams.pop(sid, None)
            self._applied.pop(sid, None)
            if why is not None:
                self._closed[sid] = why
                while len(self._closed) > CLOSED_IDS_REMEMBERED:
                    self._closed.popitem(last=False)

    def _expire_idle(self) -> None:
        timeout = self.vocoder.idle_timeout_s
        # Looking at every open stream is O(streams): not on every batch, but often enough for the timeout's scale.
        if timeout is None or time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + min(1.0, timeout / 2)
        self.vocoder.reap()  # streams also expire when another one opens: look at every stream, not the count
        with self._lock:
            expired = [sid for sid, s in self._streams.items() if s.expired]
            self.streams_expired += len(expired)
        for sid in expired:
            self._forget(sid, f"expired after {self.vocoder.idle_timeout_s} s idle and its state was released; "
                              f"start a new stream")
