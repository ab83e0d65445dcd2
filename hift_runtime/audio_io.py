"""Reading mels and writing audio: ``.npy``/``.npz`` mels; audio through ``soundfile`` (libsndfile), chosen by the
output's extension."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import numpy as np

# Extension -> (libsndfile format, default subtype). WAV defaults to 24-bit PCM: Python's ``wave`` module and every
# player open it, and its quantisation step (1.2e-7) is below the runtime's own error against upstream (~3e-7), so it
# loses nothing the vocoder computes exactly. FLOAT keeps the float32 samples bit for bit.
AUDIO_FORMATS = {".wav": ("WAV", "PCM_24"), ".flac": ("FLAC", "PCM_24"), ".ogg": ("OGG", "VORBIS")}
SUBTYPES = ("PCM_16", "PCM_24", "FLOAT")


class AudioFormatError(ValueError):
    """An output path or subtype that cannot be written; the message names the fix."""


def read_mel(path: str | os.PathLike[str]) -> np.ndarray:
    """A mel from ``.npy`` or ``.npz`` (key ``mel``, or the only array). Shape is checked by the stream."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"mel file {path} does not exist")
    if path.suffix not in (".npy", ".npz"):
        raise AudioFormatError(f"mel file {path} must be .npy or .npz, not {path.suffix or 'no extension'}")
    if path.stat().st_size == 0:
        raise AudioFormatError(f"mel file {path} is empty; write the mel with numpy.save")
    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        with np.load(path, allow_pickle=False) as data:
            if "mel" in data.files:
                return data["mel"]
            if len(data.files) == 1:
                return data[data.files[0]]
            raise AudioFormatError(f"{path} holds {data.files}; name the mel array 'mel'")
    except (ValueError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError) as exc:
        why = str(exc).splitlines()[0][:200]
        raise AudioFormatError(f"mel file {path} is not a NumPy {path.suffix} array ({why}); write the mel with "
                               f"numpy.save") from exc


def check_audio_path(path: str | os.PathLike[str], subtype: str | None = None) -> None:
    """Refuse an output before any work is done: unknown extension, missing folder, a subtype the format lacks."""
    path = Path(path)
    if path.suffix not in (*AUDIO_FORMATS, ".npy"):
        raise AudioFormatError(f"--out must end in {', '.join(AUDIO_FORMATS)} or .npy, got {path.name!r}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output folder {path.parent} does not exist")
    if subtype is not None:
        if subtype not in SUBTYPES:
            raise AudioFormatError(f"subtype must be one of {SUBTYPES}, got {subtype!r}")
        if path.suffix in (".ogg", ".npy") or (path.suffix == ".flac" and subtype == "FLOAT"):
            raise AudioFormatError(f"{path.suffix} cannot hold subtype {subtype}; use .wav")


def write_audio(path: str | os.PathLike[str], audio: np.ndarray, sample_rate: int, subtype: str | None = None) -> None:
    """Mono audio by extension: ``.wav`` (PCM_24 unless ``subtype``), ``.flac``, ``.ogg``, or ``.npy`` (float32)."""
    path = Path(path)
    check_audio_path(path, subtype)
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    if path.suffix == ".npy":
        np.save(path, audio)
        return
    import soundfile

    fmt, default = AUDIO_FORMATS[path.suffix]
    soundfile.write(str(path), audio, sample_rate, subtype=subtype or default, format=fmt)


def read_audio(path: str | os.PathLike[str]) -> tuple[np.ndarray, int, int]:
    """Mono float32 samples, the sample rate and the file's channel count, of any file libsndfile reads
    (multi-channel input is averaged)."""
    import soundfile

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file {path} does not exist")
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as exc:
        raise AudioFormatError(f"{path} is not an audio file libsndfile can read ({exc})") from exc
    return data.mean(axis=1).astype(np.float32), int(rate), int(data.shape[1])
