"""The streaming endpoint's wire contract, shared by ``hift-serve`` and its client (no server imports here).

One request = one chunk of one stream (Triton batch axis first, batch size 1 per request):

* ``stream_id`` BYTES ``[1]``: the stream's id (any UTF-8 string, unique among open streams);
* ``mel`` FP32 ``[80, T]``, ``T >= 1``: natural-log mel frames (PyTriton cannot carry a zero-length tensor, so the
  ``end`` flag travels with the last chunk);
* ``start`` BOOL ``[1]``: this chunk opens the stream; ``end`` BOOL ``[1]``: the stream ends after it;
* ``offset`` INT64 ``[1]`` (optional; the clients always send it): the stream's frames sent before this chunk, the
  chunk's idempotency key. The server applies a chunk only at the stream's frame count; a resend of the chunk it
  applied last (a retry after a timeout: same offset, same frames) gets that chunk's audio again and applies nothing;
  any other offset is refused, naming the frame expected. Without it a resend is applied again.

A request is one row (batch size 1): one with more rows is refused as a whole. A stream id that is not valid UTF-8
is refused; ids are compared as bytes. A stream may have at most 8 requests in flight (queued or running); more are
refused at once.

Reply: ``audio`` FP32 ``[N]`` whose first ``samples`` (INT64 ``[1]``) values are the audio this chunk released (an
empty release comes back as one padding sample with ``samples = 0``), ``sample_rate`` INT32 ``[1]``, ``error``
BYTES ``[1]``: empty, or why the request was refused (the runtime's message; every stream's state is unchanged), and
``final`` BOOL ``[1]``: the request's last response. A server started with ``--audio-pieces`` is a decoupled model
(gRPC streaming only): it answers a request with one response per step's audio as soon as the step is done, then a
``final`` one with the rest (the audio of all of them joined is the release); a resend of the chunk applied last
gets its whole release in one final response.
Refusals travel in ``error`` because a Python-backend model can only fail a whole batch, which would fail the other
streams' requests batched with it; the client raises them as :class:`ServerError`. A start refused because the
server holds its ``--max-streams`` begins with :data:`OVERLOADED` (the client raises :class:`ServerOverloaded`: the
stream opened nothing, and may start on another server).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MODEL_NAME = "hift_vocoder"
# The client also sends the stream id as this request header (HTTP header / gRPC metadata): what a load balancer in
# front of several servers hashes to keep a stream on the server that holds its state.
STREAM_HEADER = "hift-stream-id"
STREAM_ID, MEL, START, END, OFFSET = "stream_id", "mel", "start", "end", "offset"
INPUTS = (STREAM_ID, MEL, START, END, OFFSET)
AUDIO, SAMPLES, SAMPLE_RATE, ERROR, FINAL = "audio", "samples", "sample_rate", "error", "final"
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT = 8000, 8001, 8002
DEFAULT_STATE_METRICS_PORT = 8003  # hift-serve's own metrics, beside Triton's (server_metrics.py)
# Of those, the model's requests not yet sent their final reply (hift-serve's stop reads it).
REQUESTS_IN_FLIGHT_METRIC = "hift_requests_in_flight"


# The stock-Triton repository (``hift-export --triton-repo``): one model of this name too, a Triton sequence per
# stream; its config's parameters tell the clients which protocol it speaks and the constants they need.
SEQUENCE_PROTOCOL = "hift-sequence-1"
PARAM_PROTOCOL, PARAM_SAMPLE_RATE, PARAM_MAX_CHUNK_FRAMES = "hift_protocol", "sample_rate", "max_chunk_frames"
PARAM_MAX_STREAMS, PARAM_START_TIMEOUT_US = "max_streams", "start_timeout_us"
SEQUENCE_END = "end"  # its CONTROL_SEQUENCE_END input
# Triton's answer to a START that waited in the sequence batcher's backlog for its whole request timeout.
START_EXPIRED = "timeout of the corresponding sequence has been expired"


# The start of a refusal for want of room (``OverloadError`` in the server): nothing was opened.
OVERLOADED = "overloaded: "


class ServerError(RuntimeError):
    """The server refused a request (its message says why) or could not be reached."""


class ServerOverloaded(ServerError):
    """The server refused a stream's start: it holds as many streams as it may (``--max-streams``). Nothing was
    opened there; start the stream on another server or retry later."""


def first_value(tensor: Any) -> Any:
    """The single value of a ``[1]`` tensor as it arrives (with its batch axis: ``[1, 1]``)."""
    return np.asarray(tensor).reshape(-1)[0]
