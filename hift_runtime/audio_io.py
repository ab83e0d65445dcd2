"""Reading mels and writing audio without extra dependencies (NumPy + the standard library)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

WAVE_FORMAT_PCM = 1
WAVE_FORMAT_IEEE_FLOAT = 3


def read_mel(path: str | os.PathLike[str]) -> np.ndarray:
    """A mel from ``.npy`` or ``.npz`` (key ``mel``, or the only array). Shape is checked by the stream."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"mel file {path} does not exist")
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as data:
            if "mel" in data.files:
                return data["mel"]
            if len(data.files) == 1:
                return data[data.files[0]]
            raise ValueError(f"{path} holds {data.files}; name the mel array 'mel'")
    raise ValueError(f"mel file {path} must be .npy or .npz, not {path.suffix or 'no extension'}")


def write_wav(path: str | os.PathLike[str], audio: np.ndarray, sample_rate: int, pcm16: bool = False) -> None:
    """Mono WAV: IEEE float32 (default, lossless for the vocoder's output) or 16-bit PCM."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if pcm16:
        data = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
        fmt, bits = WAVE_FORMAT_PCM, 16
    else:
        data = audio.astype("<f4").tobytes()
        fmt, bits = WAVE_FORMAT_IEEE_FLOAT, 32
    block = bits // 8
    fmt_chunk = struct.pack("<HHIIHH", fmt, 1, sample_rate, sample_rate * block, block, bits)
    chunks = [b"fmt ", struct.pack("<I", len(fmt_chunk)), fmt_chunk]
    if fmt == WAVE_FORMAT_IEEE_FLOAT:  # non-PCM formats carry a fact chunk with the sample count
        chunks += [b"fact", struct.pack("<II", 4, audio.shape[0])]
    chunks += [b"data", struct.pack("<I", len(data)), data]
    body = b"WAVE" + b"".join(chunks)
    with open(path, "wb") as fh:
        fh.write(b"RIFF" + struct.pack("<I", len(body)) + body)


def read_wav(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Inverse of :func:`write_wav` (mono float32 or int16), for tests and tools."""
    raw = Path(path).read_bytes()
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise ValueError(f"{path} is not a RIFF/WAVE file")
    pos, fmt, rate, bits, data = 12, None, 0, 0, b""
    while pos + 8 <= len(raw):
        cid, size = raw[pos:pos + 4], struct.unpack("<I", raw[pos + 4:pos + 8])[0]
        body = raw[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            fmt, _, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
        elif cid == b"data":
            data = body
        pos += 8 + size + (size & 1)
    if fmt == WAVE_FORMAT_IEEE_FLOAT and bits == 32:
        return np.frombuffer(data, "<f4").astype(np.float32), rate
    if fmt == WAVE_FORMAT_PCM and bits == 16:
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, rate
    raise ValueError(f"{path}: unsupported WAV format {fmt}/{bits} bits")
