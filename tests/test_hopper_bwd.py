"""The Gluon Hopper backward kernels, the one-pass kernel and the dK/dV kernel: which backward calls
they take, that they compile for sm_90 on this triton, that the one pass's Triton launches are right,
and that a failed launch hands the call to the Triton kernels. Gluon kernels do not run under the
interpreter; scripts/check_gpu.py and scripts/sweep_gluon_bwd.py run them against float64."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from sdpatch.attention.naive import attention_ref
from sdpatch.kernels import flash_bwd
from sdpatch.kernels import flash_bwd_hopper as bh

GRAD_RTOL = 1e-4  # fp32 inputs through the interpreter, against float64


def test_off_by_default_and_never_on_cpu_tensors():
    assert os.environ.get("SDPATCH_GLUON_BWD") == "1" or not (bh.ENABLED or bh.ONE_PASS)
    q = torch.randn(1, 2, 4096, 64)
    assert not bh.hopper_bwd_ok(q, q, q, q, None)
    assert not bh.serves(q, q, q, q, None)
    assert not bh.one_pass_serves(q, q, q, q, None)


SERVED = [  # (B, H, Nq, Nk, D, served): self-attention from MIN_KEYS tokens, head dims up to 128
    (2, 8, 4096, 4096, 40, True),  # SD 1.5 level 1
    (2, 10, 4096, 4096, 64, True),  # SDXL level 2
    (2, 8, 1024, 1024, 80, True),
    (2, 8, 1024, 1024, 128, True),
    (2, 8, 1024, 1024, 160, False),  # a padded 256-wide tile: the Triton kernels
    (2, 8, 4096, 77, 40, False),  # cross-attention
    (2, 8, 255, 255, 64, False),
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,served", SERVED, ids=[f"B{b}-H{h}-N{nq}x{nk}-D{d}" for b, h, nq, nk, d, _ in SERVED])
def test_serves(monkeypatch, B, H, Nq, Nk, D, served):
    monkeypatch.setattr(bh, "hopper_bwd_ok", lambda q, k, v, do, mask: True)  # as on an H200
    monkeypatch.setattr(bh, "ENABLED", True)
    q, k = torch.empty(B, H, Nq, D, device="meta"), torch.empty(B, H, Nk, D, device="meta")
    assert bh.serves(q, k, k, q, None) is served
    monkeypatch.setattr(bh, "ENABLED", False)  # SDPATCH_GLUON_BWD=0
    assert not bh.serves(q, k, k, q, None)


# Compiles the kernel for sm_90 in a process of its own, as tests/test_hopper.py does the forward's.
COMPILE = """
import json, sys, torch, triton
from sdpatch.kernels import flash_bwd_hopper as bh
from sdpatch.kernels.runtime import CompileOnlyDriver

D, n, dtype = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
q = torch.empty(2, n, 3, D, dtype=dtype).transpose(1, 2)
lse = torch.empty(q.shape[:3])
triton.runtime.driver.set_active(CompileOnlyDriver())
runs = [bh.dkdv_launch(q, q, q, q, torch.empty_like(q), torch.empty_like(q), lse, lse, 0.2),
        bh.dq_launch(q, q, q, q, q, torch.empty_like(q), lse, lse, 0.2)]
built = [kernel.warmup(*args, **consts, grid=grid) for kernel, grid, args, consts in runs]
print(json.dumps([{"ptx": b.asm["ptx"], "num_warps": b.metadata.num_warps, "grid": r[1]} for b, r in zip(built, runs)]))
"""

COMPILED = [(40, 1000, "float16"), (64, 4096, "bfloat16"), (80, 1000, "float16"), (128, 256, "float16")]


@pytest.mark.skipif(bh.gluon is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("D,n,dtype", COMPILED, ids=[f"D{d}-N{n}-{t}" for d, n, t in COMPILED])
def test_compiles_for_sm90(D, n, dtype):
    """The dK/dV and dQ kernels build to sm_90 binaries: warp-specialized (consumer warpgroups and a
    producer warp), asynchronous MMAs, TMA loads and stores, and barrier handoffs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, str(D), str(n), dtype], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    dkdv, dq = json.loads(run.stdout.strip().splitlines()[-1])
    for built, config, rows in ((dkdv, bh.config_for(D), 1), (dq, bh.dq_config_for(D), 0)):
        ptx = built["ptx"]
        consumers = config[3]
        assert built["num_warps"] == 4 * consumers + 4  # the producer's warp holds a warpgroup's slot
        assert built["grid"][0] == -(-n // (consumers * config[rows])) * 2 * 3  # a program: consumers x their rows
        assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{bh.consumer_regs(consumers)};", ptx)
        # S (or S^T) an MMA of the step's width, dK, dV or dQ of the padded head dim's
        assert "wgmma.mma_async" in ptx and f"m64n{config[1 - rows]}k16" in ptx and f"m64n{bh.padded(D)}k16" in ptx
        assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global", ptx)  # TMA loads
        assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx  # TMA stores of the gradients
        assert "mbarrier.arrive" in ptx and "ex2.approx" in ptx
    assert "st.global" in dq["ptx"]  # delta, for the dK/dV kernel


# The one-pass kernel at head dims up to 64 (a padded 64-wide tile): hd40 as SD 1.5's, hd64 as SDXL's;
# with S^T and dP^T over the padded head dim (0, the default) or over mma_k's 48 columns at hd40.
FUSED_COMPILED = [(40, 1000, "float16", 0), (40, 1000, "float16", 48), (64, 4096, "bfloat16", 0)]

FUSED_COMPILE = """
import json, sys, torch, triton
from sdpatch.kernels import flash_bwd_hopper as bh
from sdpatch.kernels.runtime import CompileOnlyDriver

D, n, dtype, reduce_k = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), int(sys.argv[4])
q = torch.empty(2, n, 3, D, dtype=dtype).transpose(1, 2)
lse = torch.empty(q.shape[:3])
triton.runtime.driver.set_active(CompileOnlyDriver())
kernel, grid, args, consts = bh.fused_launches(q, q, q, q, q, torch.empty_like(q), torch.empty_like(q),
                                               torch.empty_like(q), lse, 0.2, reduce_k=reduce_k or None)[1]
built = kernel.warmup(*args, **consts, grid=grid)
print(json.dumps({"ptx": built.asm["ptx"], "num_warps": built.metadata.num_warps, "grid": grid}))
"""


@pytest.mark.skipif(bh.gluon is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("D,n,dtype,reduce_k", FUSED_COMPILED,
                         ids=[f"D{d}-N{n}-{t}-K{k or 'padded'}" for d, n, t, k in FUSED_COMPILED])
def test_one_pass_kernel_compiles_for_sm90(D, n, dtype, reduce_k):
    """The one-pass kernel builds to an sm_90 binary: the dK/dV kernel's warp-specialized loop, plus
    dQ's MMA over both consumers' keys (K = 128) from shared memory and its TMA reduce-add."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", FUSED_COMPILE, str(D), str(n), dtype, str(reduce_k)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    ptx = built["ptx"]
    block_m, block_n, _, consumers = bh.fused_config_for(D)
    assert built["num_warps"] == 4 * consumers + 4
    assert built["grid"][0] == -(-n // (consumers * block_n)) * 2 * 3
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{bh.consumer_regs(consumers)};", ptx)
    # Per consumer: S^T and dP^T (K = the padded head dim, or reduce_k), dV and dK (K = BLOCK_M) and
    # its dQ (K = CONSUMERS x BLOCK_N), each in k16 steps
    steps = (2 * (reduce_k or bh.padded(D)) + 2 * block_m + consumers * block_n) // 16
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16", ptx)) == consumers * steps
    assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx  # dQ's adds
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx  # dK and dV
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global", ptx)  # Q, dO, K, V
    assert "ex2.approx" in ptx


PREP = [(1, 2, 70, 40, torch.float32), (2, 3, 64, 64, torch.float16), (1, 1, 5, 20, torch.bfloat16)]


@pytest.mark.parametrize("B,H,N,D,dtype", PREP, ids=[f"B{b}-H{h}-N{n}-D{d}-{str(t)[6:]}" for b, h, n, d, t in PREP])
def test_one_pass_prep_and_cast(B, H, N, D, dtype):
    """The one-pass backward's Triton launches around its Gluon kernel (here in the interpreter):
    delta = rowsum(dO * O) and a zeroed workspace before it, dQ cast into q's layout after it."""
    torch.manual_seed(0)
    out, do = (torch.randn(B, N, H, D).to(dtype).transpose(1, 2) for _ in range(2))
    width = bh.accumulator_width(D)
    delta, acc = torch.empty(B, H, N), torch.full((B, H, N, width), float("nan"))
    launches = bh.prep_and_cast(out, do, torch.empty(0), delta, acc)
    (prep, grid, args, consts), cast = launches
    prep[grid](*args, **consts)
    ref = (out.double() * do.double()).sum(-1)
    assert ((delta.double() - ref).norm() / ref.norm()).item() < 1e-6
    assert bool((acc == 0).all())
    acc.copy_(torch.randn(acc.shape))
    dq = torch.empty(B, N, H, D, dtype=dtype).transpose(1, 2)
    cast_kernel, grid, args, consts = bh.prep_and_cast(out, do, dq, delta, acc)[1]
    cast_kernel[grid](*args, **consts)
    # Within a unit in the last place: the interpreter rounds bf16 toward zero, the GPU to nearest.
    torch.testing.assert_close(dq, acc[..., :D].to(dtype), rtol=torch.finfo(dtype).eps, atol=0)


ONE_PASS_SERVED = [  # (B, H, Nq, Nk, D, served): self-attention from ONE_PASS_MIN_TOKENS, head dims up to 64
    (2, 8, 4096, 4096, 40, True),  # SD 1.5 level 1 at 512²
    (2, 8, 16384, 16384, 40, True),  # ... at 1024²
    (2, 10, 4096, 4096, 64, True),  # SDXL level 2
    (2, 20, 1024, 1024, 64, False),  # SDXL level 3: the two passes were faster
    (2, 8, 4096, 4096, 80, False),  # a padded 128-wide tile
    (2, 8, 4096, 77, 40, False),  # cross-attention
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,served", ONE_PASS_SERVED,
                         ids=[f"B{b}-H{h}-N{nq}x{nk}-D{d}" for b, h, nq, nk, d, _ in ONE_PASS_SERVED])
def test_one_pass_serves(monkeypatch, B, H, Nq, Nk, D, served):
    monkeypatch.setattr(bh, "hopper_bwd_ok", lambda q, k, v, do, mask: True)  # as on an H100
    monkeypatch.setattr(bh, "_failed", [])
    q, k = torch.empty(B, H, Nq, D, device="meta"), torch.empty(B, H, Nk, D, device="meta")
    assert bh.ONE_PASS == (os.environ.get("SDPATCH_GLUON_BWD") == "1")
    monkeypatch.setattr(bh, "ONE_PASS", True)  # SDPATCH_GLUON_BWD=1
    assert bh.one_pass_serves(q, k, k, q, None) is served
    with monkeypatch.context() as m:
        m.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert not bh.one_pass_serves(q, k, k, q, None)  # its dQ adds land in any order
    monkeypatch.setattr(bh, "ONE_PASS", False)  # SDPATCH_GLUON_BWD=0
    assert not bh.one_pass_serves(q, k, k, q, None)


# (the launcher that raises, the flag that turns its kernel on, the size it serves from)
FAILED = [("dkdv_launch", "ENABLED", "MIN_KEYS"), ("fused_launches", "ONE_PASS", "ONE_PASS_MIN_TOKENS")]


@pytest.mark.parametrize("launcher,flag,min_tokens", FAILED, ids=["dkdv", "one-pass"])
def test_a_failed_launch_hands_the_call_to_the_triton_kernels(monkeypatch, caplog, launcher, flag, min_tokens):
    """A Gluon launch that raises costs one warning, not the call: the Triton kernels' two passes
    serve it and every later one."""
    def broken(*args, **kwargs):
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(bh, "hopper_bwd_ok", lambda q, k, v, do, mask: True)
    monkeypatch.setattr(bh, flag, True)  # SDPATCH_GLUON_BWD=1
    monkeypatch.setattr(bh, launcher, broken)
    monkeypatch.setattr(bh, "_failed", [])
    monkeypatch.setattr(bh, min_tokens, 16)
    flash_bwd._bwd_plans.clear()
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 40, 16) for _ in range(4))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, scale=0.25), (q64, k64, v64), do.double())
    from sdpatch.kernels.forward import flash_attn_fwd

    out, lse = flash_attn_fwd(q, k, v, 0.25, return_lse=True)
    for _ in range(2):
        grads = flash_bwd.flash_attn_bwd(do, q, k, v, out, lse, 0.25)
        for g, r in zip(grads, ref):
            assert ((g.double() - r).norm() / r.norm()).item() < GRAD_RTOL
    assert bh._failed == ["RuntimeError: no such Gluon op"]
    assert sum("Gluon Hopper backward failed" in r.message for r in caplog.records) == 1
    flash_bwd._bwd_plans.clear()
