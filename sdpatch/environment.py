"""Probing the environment a measurement ran in: library versions, the device's name, the GPU and
its driver, and what ``sdpatch info`` shows. ``generate``, ``multi`` and ``compare`` record it
from here."""

from __future__ import annotations

import platform
import subprocess
from typing import Any

import torch

from sdpatch.attention import backend_status


def device_name(device: torch.device) -> str:
    """The GPU's name, or what kind of device it is."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU, {torch.get_num_threads()} threads"
    return device.type.upper()


def versions() -> dict[str, str | None]:
    """Versions of the libraries that a measurement depends on (None: not installed)."""
    import diffusers
    import transformers

    try:
        import triton

        triton_version: str | None = triton.__version__
    except Exception:  # noqa: BLE001 (a broken triton install is as good as none)
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }


def environment() -> dict[str, Any]:
    """What ``sdpatch info`` shows: versions, GPUs, and each backend's availability here."""
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": props.name, "memory_bytes": props.total_memory})
    device = torch.device("cuda") if gpus else torch.device("cpu")
    status = backend_status(device)
    return {
        "versions": versions(),
        "gpus": gpus,
        "backends_device": str(device),
        "backends": {name: {"available": ok, "reason": why} for name, (ok, why) in status.items()},
    }



def device_environment(device: torch.device) -> dict[str, Any]:
    """Versions, and the GPU with its driver when the run is on CUDA."""
    env: dict[str, Any] = {**versions(), "gpu": None, "gpu_memory_bytes": None, "driver": None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            compute_capability=f"{props.major}.{props.minor}",
            driver=_driver_version(device),
        )
    return env


def _driver_version(device: torch.device) -> str | None:
    """The NVIDIA driver's version, from NVML or nvidia-smi (torch does not expose it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 (no NVML: try nvidia-smi)
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index or 0}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
