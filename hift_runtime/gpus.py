"""What GPUs this host has, found without loading any CUDA library."""

from __future__ import annotations

import os
import shutil
import subprocess


def nvidia_driver_present() -> bool:
    """onnxruntime-gpu lists the CUDA EP even where there is no GPU and then logs errors when asked for it."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def visible_gpus() -> list[int]:
    """The CUDA device ids this process sees (``CUDA_VISIBLE_DEVICES`` renumbers them from 0): counted by
    ``nvidia-smi -L``, so no CUDA library is loaded; [] without a driver."""
    if not nvidia_driver_present() or shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    count = sum(line.startswith("GPU ") for line in listed.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return list(range(count))
