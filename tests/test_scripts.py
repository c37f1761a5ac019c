"""The GPU scripts' own logic, on the CPU through the Triton interpreter: a script that breaks should
break here, not on a lent GPU (a 2-D mask once stopped scripts/sanitize_kernels.py there)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from _bench import Case, as_config, case_inputs  # noqa: E402
import probe_exp16  # noqa: E402
import probe_ws  # noqa: E402
import sanitize_kernels  # noqa: E402
import sweep_configs  # noqa: E402

from sdpatch.kernels.flash_bwd import flash_attn_bwd  # noqa: E402
from sdpatch.reference import attention_ref  # noqa: E402
from test_attention import RTOL, rel_err  # noqa: E402

SMALL_TILE = (16, 16, 4, 1)


def test_sanitize_script_checks_every_shape_and_tile():
    """The very launches compute-sanitizer watches on the GPU, each checked against float64."""
    assert sanitize_kernels.main("cpu") == 0


@pytest.mark.parametrize(
    "case",
    [
        sweep_configs.Case("fwd-D80", 1, 2, 33, 64, 80),
        sweep_configs.Case("fwd-x77-D40", 1, 2, 20, 77, 40),
        sweep_configs.Case("bwd-D80", 1, 2, 32, 48, 80, backward=True),
    ],
    ids=lambda c: c.name,
)
def test_sweep_launches_every_variant(case):
    """Each variant the sweep times (tilings, K/V loads, dK/dV and dQ tiles) computes attention."""
    tensors = sweep_configs.case_tensors(case, device="cpu")
    q, k, v = tensors[:3]
    variants = {(kind, label) for _, kind, label, _ in sweep_configs.tasks(case)}
    assert variants  # every kind and label the GPU run would time
    for kind, label in sorted(variants):
        result = sweep_configs.launcher((case, kind, label, SMALL_TILE), tensors)()
        if kind == "fwd":
            assert rel_err(result, attention_ref(q, k, v)) <= RTOL[torch.float16], label
        else:
            do, out, lse = tensors[3:]
            expected = flash_attn_bwd(do, q, k, v, out, lse, 1 / math.sqrt(case.D))
            for got, want in zip(result, expected):
                assert rel_err(got, want.double()) <= RTOL[torch.float16], (kind, label)


@pytest.mark.parametrize("mode", list(probe_exp16.EXP_MODES))
@pytest.mark.parametrize("D", [40, 64], ids=lambda d: f"D{d}")
def test_exp16_probe_computes_attention(D, mode):
    """Each exponential of the fp16-exponential probe kernel gives attention, query tails included."""
    q, k, v = case_inputs(Case("probe", 2, 2, 45, 32, D), device="cpu")
    out = probe_exp16.exp16_attention(q, k, v, D**-0.5, as_config(SMALL_TILE), mode)
    assert rel_err(out, attention_ref(q, k, v, scale=D**-0.5)) <= RTOL[torch.float16]


@pytest.mark.parametrize("warp_specialize", [False, True], ids=["plain", "ws"])
@pytest.mark.parametrize("D", [40, 64], ids=lambda d: f"D{d}")
def test_ws_probe_computes_attention(D, warp_specialize):
    """The warp-specialization probe kernel (device-made descriptors) gives attention, a query
    tail and a padded head dim included."""
    q, k, v = case_inputs(Case("probe", 2, 2, 45, 32, D), device="cpu")
    out = probe_ws.ws_attention(q, k, v, D**-0.5, as_config(SMALL_TILE), warp_specialize)
    assert rel_err(out, attention_ref(q, k, v, scale=D**-0.5)) <= RTOL[torch.float16]
