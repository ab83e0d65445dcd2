"""An ArgumentParser whose errors are one line on stderr (exit 2), like every other error of the CLIs."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def gpu_ids(text: str) -> list[int]:
    """An argparse ``type`` for a list of CUDA device ids, ``"0,1"`` -> ``[0, 1]``."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CUDA device ids such as 0,1") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CUDA device ids such as 0,1")
    return ids


def positive_int(text: str) -> int:
    """An argparse ``type`` for a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return value
