"""A client of ``hift-serve`` (tritonclient): stream a mel through a running server, chunk by chunk.

``ServerClient("localhost:8001")`` speaks gRPC; ``"http://localhost:8000"`` speaks HTTP. One
:class:`RemoteStream` per utterance; its chunks go one at a time (the server orders each stream's requests, and a
client waits for each reply), many streams may run from many threads, one client each.
Every chunk carries its offset in the stream (the wire's idempotency key), so a request that timed out or lost its
connection is sent again, up to ``retries`` times: the server applies each chunk once and answers a resend with the
audio it already made. :class:`AsyncServerClient` does the same for asyncio code (gRPC), many streams as tasks of one
loop.

Both clients stream through either server: ``hift-serve``, or a stock Triton serving the repository that
``hift-export --triton-repo`` writes (one model ``hift_vocoder``, a Triton sequence per stream, every cache implicit
state). They tell them apart from the model's metadata (hift-serve's model has a ``stream_id`` input) and config
(the repository's ``hift_protocol`` parameter): same chunking, output and messages. On a stock Triton a start waits
at most the repository's START timeout for a free stream slot and is then refused as :class:`ServerOverloaded`; a
chunk is not resent there (Triton has no idempotency key: a resend would be applied twice).
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .wire import ServerError, ServerOverloaded


def _parse_url(url: str) -> tuple[str, str]:
    for scheme in ("grpc", "http"):
        if url.startswith(f"{scheme}://"):
            return scheme, url[len(scheme) + 3:]
    if "://" in url:
        raise ServerError(f"server address {url!r}: use HOST:PORT (gRPC), grpc://HOST:PORT or http://HOST:PORT")
    return "grpc", url


HIFT_SERVE, TRITON_SEQUENCE = "hift-serve", "triton-sequence"


@dataclass(frozen=True)
class ServedModel:
    """What a client needs of the model it streams through (read from its metadata and config)."""

    kind: str  # HIFT_SERVE or TRITON_SEQUENCE
    in_channels: int
    pieces: bool = False  # hift-serve --audio-pieces: a decoupled model, several responses a request (gRPC streaming)
    sample_rate: int | None = None  # hift-serve's comes with each reply
    max_chunk_frames: int | None = None
    max_streams: int | None = None
    start_timeout_us: int | None = None


def served_model(url: str, name: str, metadata: dict[str, Any], config: Any) -> ServedModel:
    """The model's kind and constants from ``get_model_metadata`` and ``get_model_config`` (JSON forms; ``config``
    may be a callable that fetches it)."""
    inputs = {i["name"]: i for i in metadata.get("inputs", [])}
    if wire.MEL not in inputs:
        raise ServerError(f"model {name!r} at {url} has no {wire.MEL!r} input: not a hift-serve or "
                          f"hift-export --triton-repo model")
    channels = int(inputs[wire.MEL]["shape"][-2])
    config = config() if callable(config) else config
    config = config.get("config", config)  # gRPC's JSON wraps it
    if wire.STREAM_ID in inputs:
        return ServedModel(HIFT_SERVE, channels,
                           pieces=bool(config.get("model_transaction_policy", {}).get("decoupled", False)))
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    if params.get(wire.PARAM_PROTOCOL) != wire.SEQUENCE_PROTOCOL:
        raise ServerError(f"model {name!r} at {url} speaks neither hift-serve's protocol nor "
                          f"{wire.SEQUENCE_PROTOCOL!r} (its {wire.PARAM_PROTOCOL!r} parameter is "
                          f"{params.get(wire.PARAM_PROTOCOL)!r}); export the repository again with this version")
    return ServedModel(TRITON_SEQUENCE, channels, sample_rate=int(params[wire.PARAM_SAMPLE_RATE]),
                       max_chunk_frames=int(params[wire.PARAM_MAX_CHUNK_FRAMES]),
                       max_streams=int(params[wire.PARAM_MAX_STREAMS]),
                       start_timeout_us=int(params[wire.PARAM_START_TIMEOUT_US]))


def checked_chunk(mel: np.ndarray, in_channels: int) -> np.ndarray:
    """A chunk as the wire carries it (float32, C-contiguous ``[C, T]``, T >= 1); anything else refused here."""
    mel = np.ascontiguousarray(mel, np.float32)
    if mel.ndim != 2 or mel.shape[0] != in_channels or mel.shape[1] < 1:
        raise ServerError(f"a chunk must be [{in_channels}, T] with T >= 1 frames, got {tuple(mel.shape)}")
    return mel


def sequence_request(tc: Any, model: ServedModel, mel: np.ndarray) -> list[Any]:
    """A chunk's request to a stock-Triton model: ``mel [1, C, T]`` alone (START and END travel as Triton's
    sequence flags); a malformed or overlong chunk is refused here."""
    mel = checked_chunk(mel, model.in_channels)
    if model.max_chunk_frames is not None and mel.shape[1] > model.max_chunk_frames:
        raise ServerError(f"the chunk has {mel.shape[1]} frames, more than this server takes in one request "
                          f"({model.max_chunk_frames}); send it as several chunks")
    tensor = tc.InferInput(wire.MEL, [1, *mel.shape], "FP32")
    tensor.set_data_from_numpy(mel[None])
    return [tensor]


def sequence_arguments(model: ServedModel, stream_id: str, start: bool, end: bool) -> dict[str, Any]:
    """The sequence flags of a chunk; a start waits at most the repository's START timeout for a free slot."""
    args: dict[str, Any] = {"sequence_id": stream_id, "sequence_start": start, "sequence_end": end}
    if start and model.start_timeout_us:
        args["timeout"] = model.start_timeout_us
    return args


def sequence_audio(result: Any, model: ServedModel) -> tuple[np.ndarray, int]:
    """``(audio, sample_rate)`` of a stock-Triton reply: its whole ``audio`` is the release."""
    return result.as_numpy(wire.AUDIO).reshape(-1).copy(), int(model.sample_rate or 0)


def sequence_failure(exc: BaseException, url: str, model: ServedModel, start: bool) -> ServerError:
    """A stock Triton's refusal as the client raises it: a START whose wait for a slot ran out is
    :class:`ServerOverloaded` (nothing opened), anything else a :class:`ServerError` with Triton's message."""
    message = _short(exc)
    if start and wire.START_EXPIRED in message:
        return ServerOverloaded(f"{wire.OVERLOADED}the server at {url} holds the {model.max_streams} streams its "
                                f"repository allows and none ended within {model.start_timeout_us / 1e6:g} s; "
                                f"start the stream later or on another server")
    return ServerError(f"{url}: {message}")


class _Pieces:
    """One request's responses from a decoupled hift-serve, as they come: each one's audio handed on once, also
    across a resend (the server answers a resend of the chunk it applied last with its whole release)."""

    def __init__(self, on_audio: Callable[[np.ndarray], None] | None) -> None:
        self.on_audio, self.audio, self.rate, self.got = on_audio, [], 0, 0

    def attempt(self) -> None:
        self._at = 0  # samples this attempt's responses carried so far

    def add(self, result: Any) -> bool:
        """A response; True when it was the request's last."""
        audio, self.rate = reply_audio(result)
        new = audio[max(0, self.got - self._at):]
        self._at += audio.shape[0]
        if new.shape[0]:
            self.got += new.shape[0]
            self.audio.append(new)
            if self.on_audio is not None:
                self.on_audio(new)
        return bool(wire.first_value(result.as_numpy(wire.FINAL)))

    def release(self) -> tuple[np.ndarray, int]:
        return (np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)), self.rate


class ServerClient:
    """A connection to a ``hift-serve`` model or a stock Triton's ``hift_vocoder``; checks at once that the server
    and the model are ready."""

    def __init__(self, url: str, model_name: str = wire.MODEL_NAME, timeout_s: float = 60.0, retries: int = 2) -> None:
        self.url = url
        self.protocol, address = _parse_url(url)
        self.model_name, self.timeout_s, self.retries = model_name, timeout_s, retries
        if self.protocol == "grpc":
            import tritonclient.grpc as tc

            client_args: dict[str, Any] = {}
        else:
            import tritonclient.http as tc

            # The HTTP client takes its timeouts at construction (gRPC per call: _timeout()).
            client_args = {"connection_timeout": timeout_s, "network_timeout": timeout_s}
        self._tc = tc
        try:
            self._client = tc.InferenceServerClient(address, **client_args)
            ready = self._client.is_model_ready(model_name, **self._timeout())
        except Exception as exc:  # noqa: BLE001 - connection refused, DNS, TLS: one clear line
            raise ServerError(f"cannot reach a server at {url} ({self.protocol}): {_short(exc)}; is hift-serve "
                              f"running there?") from None
        if not ready:
            raise ServerError(f"the server at {url} has no ready model {model_name!r}")
        self.model = self._served_model()
        self.in_channels = self.model.in_channels

    def _served_model(self) -> ServedModel:
        json = {"as_json": True} if self.protocol == "grpc" else {}
        try:
            meta = self._client.get_model_metadata(self.model_name, **json, **self._timeout())
            return served_model(self.url, self.model_name, meta,
                                lambda: self._client.get_model_config(self.model_name, **json, **self._timeout()))
        except ServerError:
            raise
        except Exception as exc:  # noqa: BLE001 - a transport or Triton error
            raise ServerError(f"{self.url}: cannot read the model's metadata: {_short(exc)}") from None

    def stream(self, stream_id: str | None = None) -> "RemoteStream":
        return RemoteStream(self, stream_id or uuid.uuid4().hex)

    def infer(self, stream_id: str, mel: np.ndarray, start: bool, end: bool, offset: int | None = None,
              on_audio: Callable[[np.ndarray], None] | None = None) -> tuple[np.ndarray, int]:
        """One chunk: ``(audio, sample_rate)``; raises :class:`ServerError` with the server's message if refused. With
        ``offset`` (the stream's frames sent before this chunk) a transport failure is retried up to ``retries``
        times: the server applies the chunk once (hift-serve; a stock Triton's chunk is sent once). ``on_audio``:
        each piece of the release as it arrives (from a ``--audio-pieces`` server each step's audio, else the whole
        release at once)."""
        if self.model.kind == TRITON_SEQUENCE:
            request = sequence_request(self._tc, self.model, mel)
            try:
                result = self._client.infer(self.model_name, request, headers={wire.STREAM_HEADER: stream_id},
                                            **sequence_arguments(self.model, stream_id, start, end), **self._timeout())
            except Exception as exc:  # noqa: BLE001 - a transport or Triton error
                raise sequence_failure(exc, self.url, self.model, start) from None
            return _handed(*sequence_audio(result, self.model), on_audio)
        inputs = request_inputs(self._tc, self.in_channels, stream_id, mel, start, end, offset)
        if self.model.pieces:
            return self._infer_pieces(inputs, stream_id, offset, on_audio)
        for _ in range(1 + (self.retries if offset is not None else 0)):
            try:
                # The id also travels as a header, so a load balancer in front of several servers can pin a stream.
                result = self._client.infer(self.model_name, inputs, headers={wire.STREAM_HEADER: stream_id},
                                            **self._timeout())
                break
            except Exception as exc:  # noqa: BLE001 - a transport or Triton error
                failure = exc
        else:
            raise ServerError(f"{self.url}: {_short(failure)}") from None
        return _handed(*reply_audio(result), on_audio)

    def _infer_pieces(self, inputs: list[Any], stream_id: str, offset: int | None,
                      on_audio: Callable[[np.ndarray], None] | None) -> tuple[np.ndarray, int]:
        """A chunk through a decoupled server: one gRPC stream for the request, its responses as they come."""
        if self.protocol != "grpc":
            raise ServerError(f"the server at {self.url} sends audio as it is made (hift-serve --audio-pieces), which "
                              f"needs gRPC streaming: use its gRPC address (HOST:PORT)")
        pieces = _Pieces(on_audio)
        for _ in range(1 + (self.retries if offset is not None else 0)):
            responses: queue.SimpleQueue = queue.SimpleQueue()
            pieces.attempt()
            try:
                self._client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                          stream_timeout=self.timeout_s, headers={wire.STREAM_HEADER: stream_id})
                try:
                    self._client.async_stream_infer(self.model_name, inputs)
                    while True:
                        result, error = responses.get(timeout=self.timeout_s)
                        if error is not None:
                            raise error
                        if pieces.add(result):
                            return pieces.release()
                finally:
                    self._client.stop_stream()
            except ServerError:
                raise
            except Exception as exc:  # noqa: BLE001 - a transport or Triton error, or no response in time
                failure = exc
        raise ServerError(f"{self.url}: {_short(failure) if str(failure) else 'no response in time'}") from None

    def _timeout(self) -> dict[str, Any]:
        """Per-call timeout arguments: gRPC takes one per call; HTTP has its own from construction."""
        return {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}

    def close(self) -> None:
        self._client.close()


def rendezvous_order(urls: list[str], stream_id: str) -> list[int]:
    """The indices of ``urls`` in the order a stream tries them: the highest hash of address and id first (the same
    order in every client, from the id alone; a server added or removed moves only the streams it gains or loses)."""
    import hashlib

    return sorted(range(len(urls)), key=lambda i: hashlib.blake2b(f"{urls[i]}\0{stream_id}".encode(),
                                                                  digest_size=8).digest(), reverse=True)


class _Shards:
    """What both sharded clients share: the servers, and the order a stream tries them in."""

    clients: list[Any]

    @staticmethod
    def _distinct(urls: list[str]) -> list[str]:
        if not urls or len(set(urls)) != len(urls):
            raise ServerError(f"a sharded client needs distinct server addresses, got {urls}")
        return urls

    def servers_for(self, stream_id: str) -> list[Any]:
        """The servers in the order ``stream_id`` tries them (:func:`rendezvous_order`)."""
        return [self.clients[i] for i in rendezvous_order([c.url for c in self.clients], stream_id)]

    def server_for(self, stream_id: str) -> Any:
        """The server that serves ``stream_id`` when it has room."""
        return self.servers_for(stream_id)[0]


class ShardedClient(_Shards):
    """Several ``hift-serve`` servers behind one client (servers on several hosts, or one per GPU): each stream goes
    to the server its id picks by rendezvous hashing, so every chunk of it reaches the server that holds its state.
    Every client computes the same choice from the ids alone (no shared table); a server added or removed moves only
    the streams it gains or loses. A proxy in front of the servers does the same with the ``hift-stream-id`` header
    (``wire.STREAM_HEADER``) as its affinity key. A server that refuses a stream's start for want of room
    (:class:`ServerOverloaded`, at its ``--max-streams``) passes it to the next server in the stream's hash order."""

    def __init__(self, urls: list[str], model_name: str = wire.MODEL_NAME, timeout_s: float = 60.0,
                 retries: int = 2) -> None:
        self.clients = [ServerClient(url, model_name, timeout_s, retries) for url in self._distinct(urls)]

    @property
    def in_channels(self) -> int:
        """The mel bins the servers take (every server serves the same export)."""
        return self.clients[0].in_channels

    def stream(self, stream_id: str | None = None) -> "RemoteStream":
        sid = stream_id or uuid.uuid4().hex
        first, *others = self.servers_for(sid)
        return RemoteStream(first, sid, others)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class _StreamState:
    """A remote stream's bookkeeping, sync or async alike: started, ended, and the servers left to start on."""

    def __init__(self, client: Any, stream_id: str, fallbacks: list[Any] | None = None) -> None:
        self.client, self.stream_id = client, stream_id
        self._fallbacks = list(fallbacks or [])  # servers to start on if ``client`` has no room (sharded clients)
        self._started = self._ended = False
        self.frames_sent = 0  # the next chunk's offset: frames the server has applied
        self.sample_rate: int | None = None

    def _check_open(self) -> None:
        if self._ended:
            raise ServerError(f"stream {self.stream_id!r}: push after end=true; open a new stream")

    def _next_server(self) -> bool:
        """After a start refused for room: move to the next server, if any (the refused start opened nothing)."""
        if self._started or not self._fallbacks:
            return False
        self.client = self._fallbacks.pop(0)
        return True

    def _pushed(self, end: bool, frames: int) -> None:
        self.frames_sent += frames
        self._fallbacks = []
        self._started = True
        self._ended = end


class RemoteStream(_StreamState):
    """One utterance on the server: ``push(chunk)`` returns the audio it released; ``push(last, end=True)`` also
    returns the held-back tail and closes the stream."""

    def push(self, mel: np.ndarray, end: bool = False,
             on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """``on_audio``: each piece of the release as it arrives (see :meth:`ServerClient.infer`)."""
        self._check_open()
        while True:
            try:
                audio, self.sample_rate = self.client.infer(self.stream_id, mel, start=not self._started, end=end,
                                                            offset=self.frames_sent, on_audio=on_audio)
                break
            except ServerOverloaded:
                if not self._next_server():
                    raise
        self._pushed(end, np.shape(mel)[-1])
        return audio


def request_inputs(tc: Any, in_channels: int, stream_id: str, mel: np.ndarray, start: bool, end: bool,
                   offset: int | None = None) -> list[Any]:
    """One chunk's request tensors (``tc``: ``tritonclient.grpc`` or ``.http``); a malformed chunk is refused here."""
    mel = checked_chunk(mel, in_channels)
    values = {wire.STREAM_ID: np.array([[stream_id.encode()]], dtype=object), wire.MEL: mel[None],
              wire.START: np.array([[start]]), wire.END: np.array([[end]])}
    types = {wire.STREAM_ID: "BYTES", wire.MEL: "FP32", wire.START: "BOOL", wire.END: "BOOL", wire.OFFSET: "INT64"}
    if offset is not None:
        values[wire.OFFSET] = np.array([[offset]], np.int64)
    inputs = []
    for name, value in values.items():
        tensor = tc.InferInput(name, list(value.shape), types[name])
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def reply_audio(result: Any) -> tuple[np.ndarray, int]:
    """``(audio, sample_rate)`` of a reply, or :class:`ServerError` with the server's message if it was refused."""
    error = wire.first_value(result.as_numpy(wire.ERROR))
    if error:
        message = error.decode() if isinstance(error, bytes) else str(error)
        raise (ServerOverloaded if message.startswith(wire.OVERLOADED) else ServerError)(message)
    samples = int(wire.first_value(result.as_numpy(wire.SAMPLES)))
    rate = int(wire.first_value(result.as_numpy(wire.SAMPLE_RATE)))
    return result.as_numpy(wire.AUDIO).reshape(-1)[:samples].copy(), rate


async def _call_ended(responses: Any, wait_s: float = 5.0) -> None:
    """Wait (at most ``wait_s``) for the server to end a decoupled request's gRPC call once its last response came and
    the request side is closed. A call closed under the server instead (the connection closed at once) can leave
    tritonserver holding the request: its stop then waits for it (hift-serve gives up on it after 5 s, another
    server may wait out its exit timeout)."""
    import asyncio

    async def drain() -> None:
        async for _ in responses:
            pass

    try:
        await asyncio.wait_for(drain(), wait_s)
    except Exception:  # noqa: BLE001 - the audio is in hand; a call that ends badly or late costs it nothing
        pass


class AsyncServerClient:
    """The gRPC client for asyncio code (``tritonclient.grpc.aio``): ``await client.stream().push(chunk, end=...)``;
    many streams as tasks of one event loop, no thread each. Create and use it inside the running loop."""

    def __init__(self, url: str, model_name: str = wire.MODEL_NAME, timeout_s: float = 60.0, retries: int = 2) -> None:
        scheme, address = _parse_url(url)
        if scheme != "grpc":
            raise ServerError(f"server address {url!r}: the asyncio client speaks gRPC (HOST:PORT or grpc://...)")
        import tritonclient.grpc as tc
        import tritonclient.grpc.aio as aio

        self.url, self.model_name, self.timeout_s, self.retries, self._tc = url, model_name, timeout_s, retries, tc
        self._client = aio.InferenceServerClient(address)
        self._endings: set[Any] = set()  # decoupled calls whose last response came, until the server ends them
        # Read from the model's metadata and config at the first chunk (created in a loop, it awaits nothing before).
        self.model: ServedModel | None = None
        self.in_channels: int | None = None

    async def _served_model(self) -> ServedModel:
        if self.model is None:
            try:
                meta = await self._client.get_model_metadata(self.model_name, as_json=True)
                config = await self._client.get_model_config(self.model_name, as_json=True)
            except Exception as exc:  # noqa: BLE001 - a transport or Triton error
                raise ServerError(f"{self.url}: cannot read the model's metadata: {_short(exc)}") from None
            self.model = served_model(self.url, self.model_name, meta, config)
            self.in_channels = self.model.in_channels
        return self.model

    async def infer(self, stream_id: str, mel: np.ndarray, start: bool, end: bool, offset: int | None = None,
                    on_audio: Callable[[np.ndarray], None] | None = None) -> tuple[np.ndarray, int]:
        """One chunk, as :meth:`ServerClient.infer` (retried the same way)."""
        model = await self._served_model()
        if model.kind == TRITON_SEQUENCE:
            request = sequence_request(self._tc, model, mel)
            try:
                result = await self._client.infer(self.model_name, request, headers={wire.STREAM_HEADER: stream_id},
                                                  client_timeout=self.timeout_s,
                                                  **sequence_arguments(model, stream_id, start, end))
            except Exception as exc:  # noqa: BLE001 - a transport or Triton error
                raise sequence_failure(exc, self.url, model, start) from None
            return _handed(*sequence_audio(result, model), on_audio)
        if model.pieces:
            return await self._infer_pieces(model, stream_id, mel, start, end, offset, on_audio)
        for _ in range(1 + (self.retries if offset is not None else 0)):
            try:
                inputs = request_inputs(self._tc, model.in_channels, stream_id, mel, start, end, offset)
                result = await self._client.infer(self.model_name, inputs, headers={wire.STREAM_HEADER: stream_id},
                                                  client_timeout=self.timeout_s)
                break
            except ServerError:
                raise
            except Exception as exc:  # noqa: BLE001 - a transport or Triton error
                failure = exc
        else:
            raise ServerError(f"{self.url}: {_short(failure)}") from None
        return _handed(*reply_audio(result), on_audio)

    async def _infer_pieces(self, model: ServedModel, stream_id: str, mel: np.ndarray, start: bool, end: bool,
                            offset: int | None, on_audio: Callable[[np.ndarray], None] | None) -> tuple[np.ndarray, int]:
        """A chunk through a decoupled server: one gRPC stream for the request, its responses as they come (the
        request side stays open until the last, so the server never sees the stream half-closed early; then it
        closes, and the server ends the call: :func:`_call_ended`)."""
        import asyncio

        inputs = request_inputs(self._tc, model.in_channels, stream_id, mel, start, end, offset)
        pieces = _Pieces(on_audio)
        for _ in range(1 + (self.retries if offset is not None else 0)):
            done = asyncio.Event()

            async def request() -> Any:
                yield {"model_name": self.model_name, "inputs": inputs}
                await done.wait()

            pieces.attempt()
            try:
                responses = self._client.stream_infer(request(), stream_timeout=self.timeout_s,
                                                      headers={wire.STREAM_HEADER: stream_id})
                try:
                    async for result, error in responses:
                        if error is not None:
                            raise error
                        if pieces.add(result):
                            break
                    else:
                        raise ServerError(f"{self.url}: the response stream ended before the request's last response")
                finally:
                    done.set()
                ending = asyncio.ensure_future(_call_ended(responses))  # off the push's path; close() waits for it
                self._endings.add(ending)
                ending.add_done_callback(self._endings.discard)
                return pieces.release()
            except ServerError:
                raise
            except Exception as exc:  # noqa: BLE001 - a transport or Triton error
                failure = exc
        raise ServerError(f"{self.url}: {_short(failure)}") from None

    def stream(self, stream_id: str | None = None) -> "AsyncRemoteStream":
        return AsyncRemoteStream(self, stream_id or uuid.uuid4().hex)

    async def close(self) -> None:
        """Close the connection, once the server has ended the calls whose last response came (each waited for at
        most :func:`_call_ended`'s ``wait_s``)."""
        import asyncio

        if self._endings:
            await asyncio.wait(set(self._endings))
        await self._client.close()


class AsyncShardedClient(_Shards):
    """:class:`ShardedClient` for asyncio (gRPC): ``await client.stream().push(chunk, end=...)``, each stream on the
    server its id picks, a start refused for room passed to the next. Create and use it inside the running loop."""

    def __init__(self, urls: list[str], model_name: str = wire.MODEL_NAME, timeout_s: float = 60.0,
                 retries: int = 2) -> None:
        self.clients = [AsyncServerClient(url, model_name, timeout_s, retries=retries) for url in self._distinct(urls)]

    def stream(self, stream_id: str | None = None) -> "AsyncRemoteStream":
        sid = stream_id or uuid.uuid4().hex
        first, *others = self.servers_for(sid)
        return AsyncRemoteStream(first, sid, others)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


class AsyncRemoteStream(_StreamState):
    """:class:`RemoteStream` for asyncio: ``await push(chunk)``, ``await push(last, end=True)``."""

    async def push(self, mel: np.ndarray, end: bool = False,
                   on_audio: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        self._check_open()
        while True:
            try:
                audio, self.sample_rate = await self.client.infer(self.stream_id, mel, start=not self._started,
                                                                  end=end, offset=self.frames_sent,
                                                                  on_audio=on_audio)
                break
            except ServerOverloaded:
                if not self._next_server():
                    raise
        self._pushed(end, np.shape(mel)[-1])
        return audio


def _handed(audio: np.ndarray, rate: int, on_audio: Callable[[np.ndarray], None] | None) -> tuple[np.ndarray, int]:
    """A whole release, also handed to ``on_audio`` (a server that does not send pieces)."""
    if on_audio is not None and audio.shape[0]:
        on_audio(audio)
    return audio, rate


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
