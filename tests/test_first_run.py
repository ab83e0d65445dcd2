"""A new user's first run: copy synthesis from a real WAV, the mel against an independent computation, standard
audio files, one-line errors, a quiet export, and the README's Python snippet."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from hift_runtime.cli import main as vocode_main
from hift_runtime.mel import mel_spectrogram, resample

from .conftest import ROOT, max_abs

SPEECH = ROOT / "examples" / "speech.wav"


def matcha_mel(audio: np.ndarray) -> np.ndarray:
    """The independent computation: Matcha-TTS's mel_spectrogram as upstream runs it, with torch.stft and librosa's
    Slaney filters (CosyVoice3 settings: n_fft = win = 1920, hop 480, 80 bins, fmin 0, fmax None)."""
    import librosa
    import torch

    # In float64: torch's float32 window and FFT are off by ~1e-7 of the frame's peak, which the log turns into up to
    # 4.4e-4 in the quietest bins of a real recording (measured on this clip); the filters and steps are Matcha's.
    basis = torch.from_numpy(librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80, fmin=0, fmax=None)).double()
    y = torch.from_numpy(audio).double()[None]
    y = torch.nn.functional.pad(y.unsqueeze(1), (720, 720), mode="reflect").squeeze(1)
    spec = torch.view_as_real(torch.stft(y, 1920, hop_length=480, win_length=1920,
                                         window=torch.hann_window(1920, dtype=torch.float64),
                                         center=False, pad_mode="reflect", normalized=False, onesided=True,
                                         return_complex=True))
    spec = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(torch.matmul(basis, spec), min=1e-5))[0].float().numpy()


def test_mel_matches_matcha_on_the_committed_clip():
    import soundfile

    audio, rate = soundfile.read(str(SPEECH), dtype="float32")
    assert rate == 22050  # espeak's rate: the demo exercises the resampling too
    audio = resample(audio, rate, 24000)
    ours, theirs = mel_spectrogram(audio), matcha_mel(audio)
    assert ours.shape == theirs.shape == (80, audio.shape[0] // 480)
    assert max_abs(ours, theirs) <= 1e-4, max_abs(ours, theirs)  # measured 9.5e-7


def test_wav_round_trip(small_artifacts, tmp_path, capsys):
    import soundfile

    out = tmp_path / "copy.wav"
    assert vocode_main(["--artifacts", str(small_artifacts.out), "--wav", str(SPEECH), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "RTF" in printed and "generator on ort[cpu]" in printed
    audio, rate = soundfile.read(str(out), dtype="float32")
    frames = int(round(soundfile.info(str(SPEECH)).duration * 24000)) // 480
    assert rate == 24000 and audio.shape == (480 * frames,) and np.isfinite(audio).all()


@pytest.mark.parametrize("extra, message", [
    (["--wav", "/nonexistent.wav"], "audio file /nonexistent.wav does not exist"),
    (["--wav", str(ROOT / "README.md")], "is not an audio file libsndfile can read"),
    (["--mel", str(ROOT / "README.md")], "must be .npy or .npz"),
])
def test_input_errors_are_one_line(small_artifacts, tmp_path, extra, message, capsys):
    code = vocode_main(["--artifacts", str(small_artifacts.out), "--out", str(tmp_path / "a.wav"), *extra])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert message in captured.err and "Traceback" not in captured.err


def test_mel_error_is_one_line_on_stderr_and_nothing_else(small_artifacts, tmp_path, capsys):
    np.save(tmp_path / "mel.npy", np.zeros((81, 10), np.float32))
    code = vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "mel.npy"), "--out",
                        str(tmp_path / "a.wav")])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and captured.err.strip().splitlines() == [
        "hift-vocode: error: mel has 81 channels, the vocoder expects 80 mel bins"]


def test_export_prints_only_its_own_lines(small_artifacts):
    """No torch notices (torchvision absent, deprecations) in hift-export's output: only its own progress lines."""
    lines = [line for line in small_artifacts.output.splitlines() if line.strip()]
    assert len(lines) >= 8 and all(re.match(r"^(\[\w+\]| {7})", line) for line in lines), lines


def test_readme_python_snippet_runs(small_artifacts, tmp_path):
    """The README's API snippet, as written, against an export folder named ``artifacts``."""
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "artifacts").symlink_to(small_artifacts.out)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_stereo_wav_at_another_rate_is_said_in_one_line(small_artifacts, tmp_path, capsys):
    import soundfile

    from hift_runtime.audio_io import read_audio

    mono, rate, _ = read_audio(SPEECH)
    stereo = tmp_path / "stereo.wav"
    soundfile.write(str(stereo), np.stack([mono[:9600], mono[:9600]], axis=1), 44100)
    assert vocode_main(["--artifacts", str(small_artifacts.out), "--wav", str(stereo), "--out",
                        str(tmp_path / "o.npy")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert notes == [f"hift-vocode: note: --wav {stereo}: 2 channels averaged to mono, resampled from 44100 Hz to "
                     f"24000 Hz"]


def test_a_mel_outside_the_log_range_warns_in_one_line(small_artifacts, tmp_path, capsys):
    np.save(tmp_path / "mel.npy", np.full((80, 12), -40.0, np.float32))
    assert vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "mel.npy"), "--out",
                        str(tmp_path / "o.npy"), "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hift-vocode: warning: mel values span [-40.0, -40.0]")


def test_the_export_folder_is_readable_by_other_users(small_artifacts):
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(small_artifacts.out.stat().st_mode) == 0o777 & ~umask  # as a plain mkdir makes it
