"""The GPU scripts' own logic, on the CPU through the Triton interpreter: a script that breaks should
break here, not on a lent GPU (a 2-D mask once stopped scripts/sanitize_kernels.py there)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from _bench import Case, probe_forward  # noqa: E402
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


@pytest.mark.parametrize("probe", [probe_exp16, probe_ws], ids=lambda m: m.__name__)
def test_forward_probe_variants_compute_attention(probe):
    """Every kernel variant a forward probe times gives attention (float64 check of its main loop,
    query tails and head dims 40 and 64 included); only the GPU timing fails here, and is recorded."""
    cases = [Case("D40", 2, 2, 45, 32, 40), Case("D64", 1, 2, 33, 16, 64)]
    rows = probe_forward([SMALL_TILE], probe.impls_for, cases, device="cpu")
    names = [n for n in probe.impls_for(None, None, None, 1.0, {}) if n != "sdpatch-tma"]  # TMA needs a GPU
    checked = [r for r in rows if r["impl"].split()[0] in names]
    assert len(checked) == len(cases) * len(names)
    for r in checked:
        assert r["rel_err"] is not None and r["rel_err"] <= RTOL[torch.float16], (r["case"], r["impl"], r["error"])
