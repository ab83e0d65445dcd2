"""Putting a finished export in place of the old one as one atomic step, and recovering from an export that was
killed during it. Standard library only.

The new export is built in a staging folder beside ``out``. Files in ``out`` that no export wrote (a README, the
user's audio) are hard-linked into staging (copied where links are impossible), never moved; then staging and ``out``
change places in one ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+ on most local filesystems): a reader sees the old
folder or the new one, and at no moment no folder. Where the exchange is not available, ``out`` is renamed aside and
staging renamed in; a kill between the two leaves no ``out``, which the next export puts back first.

:func:`recover_stale_siblings` runs before each export: a staging or old folder a killed export left beside ``out``
is removed once every file in it that the export did not write is also in ``out`` (the same file, or moved back
there); one holding a different file of the same name is kept, and said.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

RENAME_EXCHANGE = 2
AT_FDCWD = -100


def sibling(out: Path, kind: str) -> Path:
    """A new folder beside ``out`` (``.NAME.KIND-*``), with the mode a plain ``mkdir`` gives (mkdtemp's 0700 would
    keep a server running as another user from reading the artifacts once swapped in)."""
    folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    return folder


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step; False (nothing done) where the kernel or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:  # a C library older than glibc 2.28
        return False
    if rename(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _link(source: Path, target: Path) -> None:
    """``source`` appears at ``target`` too (files hard-linked, folders rebuilt of linked files), ``source`` left."""
    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, target, symlinks=True, copy_function=link_or_copy)
    elif source.is_symlink():
        os.symlink(os.readlink(source), target)
    else:
        link_or_copy(str(source), str(target))


def swap_into_place(staging: Path, out: Path, export_names: set[str]) -> None:
    """Make the finished export in ``staging`` the folder ``out``. Items of ``out`` not named in ``export_names``
    (the user's) stay in ``out`` and are linked into the new folder; the old export's files go."""
    if not out.exists():
        os.replace(staging, out)
        return
    if not out.is_dir():
        raise NotADirectoryError(f"--out {out} exists and is not a folder")
    for item in out.iterdir():
        if item.name not in export_names and not os.path.lexists(staging / item.name):
            _link(item, staging / item.name)
    if exchange(staging, out):
        old = staging  # it holds the old export now
    else:
        old = sibling(out, "old")
        os.replace(out, old / out.name)
        os.replace(staging, out)
    recover_stale_siblings(out, export_names, [old])


def listed_files(folder: Path, manifest_name: str = "manifest.json") -> set[str]:
    """The file names ``folder``'s manifest lists (an export's own files); empty when it has none readable."""
    import json

    try:
        return {str(entry["file"]) for entry in json.loads((folder / manifest_name).read_text())["artifacts"].values()}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return set()


def _rescue(item: Path, target: Path, moved: list[Path]) -> bool:
    """Make sure ``item`` (in a folder about to go) is in ``out`` at ``target``: it is there already (the same file,
    or a folder holding all of its files so), or it is moved there now. False when ``target`` holds something else."""
    if not os.path.lexists(target):
        os.replace(item, target)
        moved.append(target)
        return True
    if item.is_dir() and not item.is_symlink() and target.is_dir():
        return all([_rescue(child, target / child.name, moved) for child in item.iterdir()])
    try:
        return os.path.samefile(item, target) or (item.is_symlink() and os.readlink(item) == os.readlink(target))
    except OSError:
        return False


def recover_stale_siblings(out: Path, export_names: set[str], siblings: Iterable[Path] | None = None,
                           log: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Clean up after an export that was killed beside ``out``: put a missing ``out`` back from the old export set
    aside, move back into ``out`` any of the user's files found only in a stale folder, then remove each stale
    folder that holds nothing else. Returns the folders kept (they hold a different file of a name ``out`` has)."""
    if siblings is None:
        siblings = sorted([*out.parent.glob(f".{out.name}.staging-*"), *out.parent.glob(f".{out.name}.old-*")])
    siblings = list(siblings)
    if not os.path.lexists(out):
        for folder in siblings:
            if folder.name.startswith(f".{out.name}.old-") and (folder / out.name).is_dir():
                os.replace(folder / out.name, out)
                log(f"[recover] {out} put back from {folder} (an export was killed while swapping folders)")
                break
    kept = []
    for folder in siblings:
        root = folder / out.name if (folder / out.name).is_dir() else folder
        moved: list[Path] = []
        names = export_names | listed_files(root)
        # Without an out to move them into, nothing in a stale folder is removed.
        safe = out.is_dir() and all([_rescue(item, out / item.name, moved) for item in list(root.iterdir())
                                     if item.name not in names])
        for path in moved:
            log(f"[recover] {path} moved back from {folder} (an export was killed while swapping folders)")
        if safe:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            kept.append(folder)
            log(f"[recover] kept {folder}: it holds files that differ from those of the same names in {out}; "
                f"move what you need, then delete it")
    return kept
