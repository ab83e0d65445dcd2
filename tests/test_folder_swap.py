"""The export's folder swap killed at each of its steps (SIGKILL, in a child process): the next export's recovery
leaves ``out`` holding one whole export, old or new, and every file of the user's, and removes the stale folders.
The swap is standard library only, so the child loads it without torch (a second each)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hift_export.folder_swap import recover_stale_siblings, swap_into_place

ROOT = Path(__file__).resolve().parents[1]
EXPORT_NAMES = {"manifest.json", "graph.onnx", "graph.weights"}

CHILD = r"""
import importlib.util, os, shutil, signal, sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("folder_swap", sys.argv[1])
swap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(swap)
kill_at, mode = int(sys.argv[4]), sys.argv[5]
steps = [0]

def killing(fn):
    def step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return step

os.replace, os.link, shutil.rmtree = killing(os.replace), killing(os.link), killing(shutil.rmtree)
swap.exchange = killing(swap.exchange if mode == "exchange" else (lambda a, b: False))
swap.swap_into_place(Path(sys.argv[2]), Path(sys.argv[3]), {"manifest.json", "graph.onnx", "graph.weights"})
"""


def _export(folder: Path, tag: str) -> None:
    """A stand-in export: its files carry ``tag``, its manifest lists them."""
    folder.mkdir()
    for name in ("graph.onnx", "graph.weights"):
        (folder / name).write_text(tag)
    (folder / "manifest.json").write_text(json.dumps({"tag": tag, "artifacts": {
        "g": {"file": "graph.onnx"}, "w": {"file": "graph.weights"}}}))


USER_FILES = {"README.md": "mine", "take1.wav": "audio", "takes/a.wav": "a"}


def _layout(tmp_path: Path) -> tuple[Path, Path]:
    out, staging = tmp_path / "art", tmp_path / ".art.staging-new"
    _export(out, "old")
    _export(staging, "new")
    for name, text in USER_FILES.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    return staging, out


def _assert_whole(out: Path) -> str:
    tag = json.loads((out / "manifest.json").read_text())["tag"]
    assert all((out / name).read_text() == tag for name in ("graph.onnx", "graph.weights")), "a mixed export"
    for name, text in USER_FILES.items():
        assert (out / name).read_text() == text, f"{name} lost"
    return tag


@pytest.mark.parametrize("mode", ["exchange", "rename"])
def test_a_swap_killed_at_any_step_loses_nothing(tmp_path, mode):
    seen = set()
    for kill_at in range(1, 40):
        case = tmp_path / f"{mode}-{kill_at}"
        case.mkdir()
        staging, out = _layout(case)
        done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "hift_export" / "folder_swap.py"),
                               str(staging), str(out), str(kill_at), mode], capture_output=True, text=True)
        assert done.returncode in (0, -9), done.stderr
        recover_stale_siblings(out, EXPORT_NAMES)
        seen.add(_assert_whole(out))
        assert sorted(p.name for p in case.iterdir()) == ["art"], "a stale folder was left"
        if done.returncode == 0:
            break
    else:
        pytest.fail("the swap never ran to its end")
    assert seen == {"old", "new"} and kill_at > 3


def test_stale_folders_of_the_earlier_swap_give_back_the_user_s_files(tmp_path):
    """What the swap before this one left when killed (it moved the user's files into staging, then ``out`` into an
    old folder): ``out`` is put back and the files moved home; a folder holding a different file of a name ``out``
    has is kept."""
    out = tmp_path / "art"
    old = tmp_path / ".art.old-x"
    old.mkdir()
    _export(old / "art", "old")
    staging = tmp_path / ".art.staging-x"
    _export(staging, "new")
    (staging / "README.md").write_text("mine")
    recover_stale_siblings(out, EXPORT_NAMES)
    assert json.loads((out / "manifest.json").read_text())["tag"] == "old"
    assert (out / "README.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    clash = tmp_path / ".art.staging-y"
    clash.mkdir()
    (clash / "README.md").write_text("another")
    assert recover_stale_siblings(out, EXPORT_NAMES) == [clash]
    assert (out / "README.md").read_text() == "mine" and (clash / "README.md").read_text() == "another"


def test_a_swap_into_nothing_and_without_the_exchange(tmp_path, monkeypatch):
    import hift_export.folder_swap as folder_swap

    staging, out = tmp_path / ".art.staging-1", tmp_path / "art"
    _export(staging, "new")
    swap_into_place(staging, out, EXPORT_NAMES)
    assert _export_tag(out) == "new" and not staging.exists()
    monkeypatch.setattr(folder_swap, "exchange", lambda a, b: False)
    (out / "README.md").write_text("mine")
    staging = tmp_path / ".art.staging-2"
    _export(staging, "newer")
    swap_into_place(staging, out, EXPORT_NAMES)
    assert _export_tag(out) == "newer" and (out / "README.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def _export_tag(out: Path) -> str:
    return json.loads((out / "manifest.json").read_text())["tag"]
