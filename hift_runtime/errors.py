"""The errors a stream, the vocoder and its scheduler raise (one place, so every layer names them alike)."""


class StreamError(RuntimeError):
    """A call that the stream's state does not allow (push after finish, finish twice)."""


class OverloadError(RuntimeError):
    """No stream can be opened now: ``max_streams`` are open. Finish or drop one, or retry later."""


class MelError(ValueError):
    """A mel chunk of the wrong shape or with non-finite values; the stream is left unchanged."""


class MelTypeError(MelError, TypeError):
    """A mel of a non-float dtype (integer, bool, complex); the stream is left unchanged."""


class SchedulerClosed(RuntimeError):
    """The vocoder's scheduler was closed: no push runs any more."""


class PushCancelled(RuntimeError):
    """A push was cancelled (KeyboardInterrupt in its thread, asyncio cancellation) before it changed anything: the
    stream is as it was before the push, and usable."""
