"""An ArgumentParser whose errors are one line on stderr (exit 2), like every other error of the CLIs."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)
