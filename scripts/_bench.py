"""Helpers shared by the GPU benchmark scripts: UNet inputs, timing, peak memory, environment."""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    """One attention shape the kernel scripts measure: (B, H, Nq, Nk, D), forward or backward."""

    name: str
    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    dtype: str = "fp16"
    backward: bool = False
    sdpatch_backend: str = "triton"


def unet_inputs(unet, batch: int, size: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random UNet call arguments for a batch at an image side of ``size`` pixels."""
    g = torch.Generator("cuda").manual_seed(seed)
    cfg = unet.config
    lat = size // 8
    kw = dict(
        sample=torch.randn(batch, cfg.in_channels, lat, lat, device="cuda", dtype=dtype, generator=g),
        timestep=torch.full((batch,), 500, device="cuda"),
        encoder_hidden_states=torch.randn(batch, 77, cfg.cross_attention_dim, device="cuda", dtype=dtype, generator=g),
    )
    if cfg.addition_embed_type == "text_time":  # SDXL's added conditions
        kw["added_cond_kwargs"] = dict(
            text_embeds=torch.randn(batch, 1280, device="cuda", dtype=dtype, generator=g),
            time_ids=torch.tensor([[size, size, 0, 0, size, size]] * batch, device="cuda", dtype=dtype),
        )
    return kw


def make_mask(kind: str | None, B: int, Nq: int, Nk: int, dtype: torch.dtype, device: str = "cuda") -> torch.Tensor | None:
    """Test masks, 4-D as the kernels take them: bool (B, 1, Nq, Nk) with row 0 fully masked,
    additive (1, 1, Nq, Nk), or diffusers' (B, 1, 1, Nk) encoder padding mask."""
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, Nq, Nk, device=device) > 0.3
        m[:, :, 0] = False
        return m
    if kind == "additive":
        return torch.randn(1, 1, Nq, Nk, device=device, dtype=dtype)
    a = torch.zeros(B, 1, 1, Nk, device=device, dtype=dtype)
    a[..., Nk // 2 :] = -10000.0
    return a


def peak_over(fn) -> tuple[object, int]:
    """Run ``fn``; return its result and the peak bytes allocated beyond what was live before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def median_ms(fn, reps: int = 5) -> float:
    """Median wall time of ``fn`` in ms, timed with CUDA events after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def environment() -> dict:
    import diffusers
    import triton

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        driver = smi.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        driver = None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "diffusers": diffusers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
