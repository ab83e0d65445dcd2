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


@pytest.mark.parametrize("content, message", [
    (b"", "is empty; write the mel with numpy.save"),
    (b"\x93NUMPY\x01\x00garbage", "is not a NumPy .npy array"),
    (b"not numpy at all", "is not a NumPy .npy array"),
])
def test_an_empty_or_corrupt_mel_file_is_one_line(small_artifacts, tmp_path, content, message, capsys):
    (tmp_path / "e.npy").write_bytes(content)
    code = vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "e.npy"), "--out",
                        str(tmp_path / "x.wav")])
    captured = capsys.readouterr()
    assert code == 2 and len(captured.err.strip().splitlines()) == 1, captured.err
    assert message in captured.err and str(tmp_path / "e.npy") in captured.err and "Traceback" not in captured.err
    assert not (tmp_path / "x.wav").exists()


def test_fp16_on_onnx_runtime_is_one_line(small_artifacts, tmp_path, capsys):
    np.save(tmp_path / "m.npy", np.full((80, 10), -5.0, np.float32))
    code = vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "m.npy"), "--out",
                        str(tmp_path / "x.wav"), "--engine", "ort", "--precision", "fp16"])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.strip().splitlines() == [
        "hift-vocode: error: precision 'fp16' is the compiled engine's (engine='compiled'); ONNX Runtime runs fp32 "
        "or tf32"]


def test_a_whole_file_with_nan_is_named_not_a_chunk(small_artifacts, tmp_path, capsys):
    mel = np.full((80, 120), -5.0, np.float32)
    mel[3, 100] = np.nan
    np.save(tmp_path / "m.npy", mel)
    assert vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "m.npy"), "--out",
                        str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert f"first at bin 3, frame 100 of {tmp_path / 'm.npy'}" in err and "chunk" not in err


def test_one_chunk_is_said_in_the_singular(small_artifacts, tmp_path, capsys):
    np.save(tmp_path / "m.npy", np.full((80, 10), -5.0, np.float32))
    assert vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "m.npy"), "--out",
                        str(tmp_path / "x.wav"), "--chunks", "24"]) == 0
    out = capsys.readouterr().out
    assert "streamed 1 chunk:" in out


def test_the_compiled_engine_on_the_cpu_says_what_it_runs(small_artifacts, tmp_path, capsys):
    pytest.importorskip("torch")
    np.save(tmp_path / "m.npy", np.full((80, 10), -5.0, np.float32))
    assert vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "m.npy"), "--out",
                        str(tmp_path / "x.wav"), "--engine", "compiled", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "generator on torch[cpu] (engine='compiled' requested; on the CPU it runs the same step eagerly" in out


def test_ctrl_c_during_a_vocode_is_one_line_and_leaves_no_output(small_artifacts, tmp_path, monkeypatch, capsys):
    from hift_runtime import cli

    np.save(tmp_path / "m.npy", np.full((80, 200), -5.0, np.float32))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "write_audio", interrupted)
    code = vocode_main(["--artifacts", str(small_artifacts.out), "--mel", str(tmp_path / "m.npy"), "--out",
                        str(tmp_path / "x.wav"), "--quiet"])
    captured = capsys.readouterr()
    assert code == 130 and captured.err.strip().splitlines() == ["hift-vocode: interrupted"]
    assert not (tmp_path / "x.wav").exists()


RUNTIME_ONLY = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] in ('torch', 'tritonclient') else real(name, *a)
sys.modules['torch'] = None
sys.modules['tritonclient'] = None
from {module} import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("module, args, message", [
    ("hift_runtime.cli", ["--server", "localhost:1", "--mel", "M", "--out", "O"], "--server needs tritonclient: pip "
                                                                                   "install -e '.[serve]'"),
    ("hift_runtime.cli", ["--artifacts", "A", "--mel", "M", "--out", "O", "--check"], "--check needs torch"),
    ("hift_export.cli", ["--out", "O"], "the export needs torch: pip install torch==2.13.0 && pip install -e "
                                        "'.[export]'"),
])
def test_a_runtime_only_install_names_the_extra_before_any_work(small_artifacts, tmp_path, module, args, message):
    np.save(tmp_path / "m.npy", np.full((80, 10), -5.0, np.float32))
    args = [{"A": str(small_artifacts.out), "M": str(tmp_path / "m.npy"), "O": str(tmp_path / "x.wav")}.get(a, a)
            for a in args]
    done = subprocess.run([sys.executable, "-c", RUNTIME_ONLY.format(module=module), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
    assert done.stdout == "" and not (tmp_path / "x.wav").exists()  # said before any work
