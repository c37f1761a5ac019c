"""Helpers the test modules share: the attention error budget and inputs, and the CLI's invocation.

Test modules import this (pytest puts tests/ on the path, as for ``arch``), never each other.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

# Error budget, ||out - ref|| / ||ref||, stated once.
RTOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-10}
DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_qkv(B, H, Nq, Nk, D, dtype, layout="contiguous", seed=0):
    """Random q, k, v in a given memory layout: the views diffusers and users hand over."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        if layout == "bnhd":  # diffusers: (B, N, H*D) viewed and transposed to (B, H, N, D)
            return torch.randn(B, n, H, D, generator=g).to(dtype).transpose(1, 2)
        if layout == "sliced":  # a slice of a wider head dim and every other head: no unit strides left
            return torch.randn(B, 2 * H, n, D + 3, generator=g).to(dtype)[:, ::2, :, 1 : D + 1]
        return torch.randn(B, H, n, D, generator=g).to(dtype)

    return rand(Nq), rand(Nk), rand(Nk)


def make_mask(kind, B, H, Nq, Nk, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "bool":  # broadcast over heads; keep ~70%; one row fully masked
        m = torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
        m[:, :, 0, :] = False
        return m
    if kind == "additive":  # a (Nq, Nk) bias broadcast over batch and heads, with some -inf
        a = torch.randn(Nq, Nk, generator=g)
        a[torch.rand(Nq, Nk, generator=g) > 0.8] = float("-inf")
        return a.to(dtype)
    if kind == "padding":  # diffusers' encoder mask: (B, 1, 1, Nk) additive, last keys dropped
        a = torch.zeros(B, 1, 1, Nk)
        a[..., Nk // 2 :] = -10000.0
        return a.to(dtype)
    raise ValueError(kind)


def case(B, H, Nq, Nk, D, dtype, mask="none", layout="contiguous"):
    """An attention test case as a ``pytest.param`` with a readable id, e.g. B1-H2-N97x77-D40-fp16-padding-bnhd."""
    cid = f"B{B}-H{H}-N{Nq}" + (f"x{Nk}" if Nk != Nq else "") + f"-D{D}-{dtype}"
    cid += "" if mask == "none" else f"-{mask}"
    cid += "" if layout == "contiguous" else f"-{layout}"
    return pytest.param(B, H, Nq, Nk, D, DT[dtype], mask, layout, id=cid)


# The CLI's quickest real run: the tiny model on the CPU.
FAST = ["--height", "64", "--width", "64", "--steps", "2", "--device", "cpu"]


def invoke(*args: str):
    """The CLI through typer's runner, in this process."""
    from sdpatch.cli import app  # imported by the tests that run it, not by every user of this module

    return CliRunner().invoke(app, list(args))


def console_script() -> str:
    """The installed ``sdpatch`` script of this interpreter's environment."""
    beside = Path(sys.executable).parent / "sdpatch"
    script = str(beside) if beside.exists() else shutil.which("sdpatch")
    if script is None:
        pytest.fail("the sdpatch console script is not installed: run `pip install -e .`")
    return script
