"""This vocoder inside CosyVoice3's own pipeline: :func:`use_streaming_vocoder` replaces an upstream
``CosyVoice3Model``'s ``token2wav`` with one that keeps a stream per ``tts()`` call and pushes only each call's new
mel frames, where upstream re-vocodes the whole mel so far at every chunk.

Upstream's ``token2wav(token, ..., token_offset, uuid, stream, finalize, speed)`` runs the flow on the whole token
prefix, keeps the mel from ``token_offset`` on, appends it to the mel of the earlier calls and runs HiFT over all of
it. Here the flow runs exactly as upstream runs it, and the new frames go to the stream of ``uuid``: ``push`` while
``finalize`` is false, ``finish`` with the last frames; the audio returned is what that push released, as the float32
tensor ``[1, S]`` upstream returns. ``tts()`` itself (its threads, its chunk schedule, its ``hift_cache_dict``
bookkeeping) is upstream's, unchanged. Imports torch (it runs inside a CosyVoice3 process); the rest of the runtime
does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# A tts() abandoned mid-way (its generator closed) leaves its stream open; an in-process vocoder without an idle
# timeout is given this one, so such a stream is released after it.
DEFAULT_IDLE_TIMEOUT_S = 60.0


class _LocalStream:
    """A stream of an in-process vocoder (``open_vocoder``)."""

    def __init__(self, vocoder: Any) -> None:
        self.stream = vocoder.stream()

    def push(self, mel: np.ndarray, final: bool) -> np.ndarray:
        return self.stream.finish(mel) if final else self.stream.push(mel)

    def close(self) -> None:
        self.stream.close()


class _RemoteStream:
    """A stream of a server (``ServerClient``, ``ShardedClient``). A request carries at least one frame, so the last
    frame of each push is held back and sent with the next (the last request then always has one to carry)."""

    def __init__(self, client: Any) -> None:
        self.stream = client.stream()
        self.held: np.ndarray | None = None

    def push(self, mel: np.ndarray, final: bool) -> np.ndarray:
        data = mel if self.held is None else np.concatenate([self.held, mel], axis=1)
        if data.shape[1] == 0:
            return np.zeros(0, np.float32)
        if final:
            self.held = None
            return self.stream.push(data, end=True)
        self.held = data[:, -1:]
        if data.shape[1] == 1:
            return np.zeros(0, np.float32)
        return self.stream.push(np.ascontiguousarray(data[:, :-1]))

    def close(self) -> None:
        """Nothing to send: the server releases a stream left unended after its idle timeout."""


def use_streaming_vocoder(model: Any, vocoder: Any, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> Any:
    """Put ``vocoder`` in ``model``'s place of HiFT: ``model`` is an upstream ``CosyVoice3Model`` (what
    ``AutoModel(...).model`` holds), ``vocoder`` an in-process ``StreamingVocoder`` (``open_vocoder(...)``) or a
    client of a running server (``ServerClient(...)``, ``ShardedClient(...)``). Only this instance's ``token2wav``
    is replaced; streaming and non-streaming ``tts()`` both work, concurrent ``tts()`` calls each get their own
    stream. ``speed != 1.0`` interpolates the mel as upstream does (non-streaming only; upstream refuses it while
    streaming, and so does this). An in-process vocoder without an idle timeout is given ``idle_timeout_s``. Returns
    ``model``."""
    import torch
    import torch.nn.functional as F

    remote = not hasattr(vocoder, "constants")  # the clients carry no model constants
    if not remote and getattr(vocoder, "idle_timeout_s", None) is None:
        vocoder.idle_timeout_s = idle_timeout_s
    ratio = model.flow.token_mel_ratio

    def token2wav(token: Any, prompt_token: Any, prompt_feat: Any, embedding: Any, token_offset: int, uuid: str,
                  stream: bool = False, finalize: bool = False, speed: float = 1.0) -> Any:
        with torch.amp.autocast("cuda", enabled=bool(model.fp16)):  # (upstream's autocast around the flow)
            tts_mel, _ = model.flow.inference(
                token=token.to(model.device, dtype=torch.int32),
                token_len=torch.tensor([token.shape[1]], dtype=torch.int32).to(model.device),
                prompt_token=prompt_token.to(model.device),
                prompt_token_len=torch.tensor([prompt_token.shape[1]], dtype=torch.int32).to(model.device),
                prompt_feat=prompt_feat.to(model.device),
                prompt_feat_len=torch.tensor([prompt_feat.shape[1]], dtype=torch.int32).to(model.device),
                embedding=embedding.to(model.device), streaming=stream, finalize=finalize)
        tts_mel = tts_mel[:, :, token_offset * ratio:]
        if speed != 1.0:
            if token_offset != 0 or not finalize:
                raise ValueError("speed != 1.0 is for non-streaming tts() only (upstream's rule: the mel is "
                                 "interpolated as a whole)")
            tts_mel = F.interpolate(tts_mel, size=int(tts_mel.shape[2] / speed), mode="linear")
        state = model.hift_cache_dict.get(uuid)
        if state is None:  # this tts()'s first chunk (tts() pops the entry when it ends)
            state = {"stream": _RemoteStream(vocoder) if remote else _LocalStream(vocoder)}
            model.hift_cache_dict[uuid] = state
        mel = np.ascontiguousarray(tts_mel[0].detach().float().cpu().numpy())
        try:
            audio = state["stream"].push(mel, final=bool(finalize))
        except BaseException:
            state["stream"].close()  # a failed push: the stream goes (its slot freed), the error is tts()'s
            raise
        return torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))[None]

    model.token2wav = token2wav
    return model
