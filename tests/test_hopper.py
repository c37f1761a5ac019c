"""The Gluon Hopper forward: which calls it takes, and that it compiles for sm_90 on this triton.
Gluon kernels do not run under the interpreter; scripts/check_gpu.py runs this one against float64."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from sdpatch.kernels import flash_fwd_hopper as fh


def qkv(dtype=torch.float16, D=40, layout="bnhd", Nq=64, Nk=64):
    def r(n):
        if layout == "bnhd":  # diffusers' (B, N, H, D) memory
            return torch.randn(2, n, 3, D, dtype=dtype).transpose(1, 2)
        if layout == "sliced":  # last dim contiguous, base 6 bytes past a 16-byte boundary
            return torch.randn(2, 3, n, D + 8, dtype=dtype)[..., 3 : D + 3]
        return torch.randn(2, 3, n, D, dtype=dtype)

    return r(Nq), r(Nk), r(Nk)


LAYOUTS = [  # (id, q/k/v, mask, taken)
    ("fp16-D40-bnhd", qkv(), None, True),
    ("bf16-D64-contiguous", qkv(torch.bfloat16, 64, "contiguous"), None, True),
    ("fp16-D128-bnhd", qkv(D=128), None, True),
    ("fp16-D40-x77", qkv(Nk=77), None, True),
    ("masked", qkv(), torch.ones(1, 1, 64, 64, dtype=torch.bool), False),
    ("fp32", qkv(torch.float32), None, False),
    ("fp16-D160", qkv(D=160), None, True),
    ("fp16-D320", qkv(D=320), None, False),
    ("fp16-D40-misaligned", qkv(layout="sliced"), None, False),
    ("fp16-D4-rows-8-bytes", qkv(D=4, layout="contiguous"), None, False),  # strides of 8 bytes: no TMA
    ("last-dim-strided", tuple(t.transpose(2, 3).contiguous().transpose(2, 3) for t in qkv(D=64, layout="contiguous")), None, False),
]


@pytest.mark.parametrize("q,k,v,mask,taken", [(*t[1], t[2], t[3]) for t in LAYOUTS], ids=[t[0] for t in LAYOUTS])
def test_layout_ok(q, k, v, mask, taken):
    assert fh.layout_ok(q, k, v, mask) is taken


def test_cpu_tensors_never_taken():
    q, k, v = qkv(Nq=4096, Nk=4096)
    assert not fh.hopper_fwd_ok(q, k, v, None)
    assert not fh.serves(q, k, v, None)


SERVED = [  # (B, H, Nq, Nk, D, served): measured per call against the Triton kernel (docs/benchmarks.md, v13)
    (2, 8, 4096, 4096, 40, True),  # SD 1.5 level 1: 4.3e10 FLOPs
    (2, 8, 1024, 1024, 40, False),  # 2.7e9 FLOPs: the Triton kernel
    (2, 20, 1024, 1024, 64, False),  # SDXL level 3, 1.1e10 FLOPs: the Triton kernel won (293 against 277)
    (2, 10, 4096, 4096, 64, True),
    (2, 8, 1024, 1024, 80, True),  # SD 1.5 at 512 x 512: above head dim 64, from 256 keys on
    (2, 8, 256, 256, 160, True),
    (2, 8, 255, 255, 160, False),
    (2, 8, 4096, 77, 40, False),  # cross-attention
    (2, 10, 4096, 77, 64, False),
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,served", SERVED, ids=[f"B{b}-H{h}-N{nq}x{nk}-D{d}" for b, h, nq, nk, d, _ in SERVED])
def test_serves(monkeypatch, B, H, Nq, Nk, D, served):
    monkeypatch.setattr(fh, "hopper_fwd_ok", lambda q, k, v, mask: True)  # as on an H200
    monkeypatch.setattr(fh, "ENABLED", True)
    q, k = torch.empty(B, H, Nq, D, device="meta"), torch.empty(B, H, Nk, D, device="meta")
    assert fh.serves(q, k, k, None) is served
    monkeypatch.setattr(fh, "ENABLED", False)  # SDPATCH_GLUON=0
    assert not fh.serves(q, k, k, None)


@pytest.mark.parametrize("D,config", [(40, (128, 64, 4, 3)), (64, (64, 128, 4, 2)), (16, (128, 64, 4, 3)), (80, (64, 128, 4, 2)),
                                      (160, (64, 64, 4, 2))])
def test_config_for(D, config):
    assert fh.config_for(D) == config


SPLITS = [(40, (32, 16)), (48, (32, 16)), (64, (64, 0)), (80, (64, 16)), (100, (128, 0)), (160, (128, 32)), (20, (32, 0)),
          (8, (16, 0)), (256, (256, 0))]


@pytest.mark.parametrize("D,parts", SPLITS, ids=[f"D{d}" for d, _ in SPLITS])
def test_split_head_dim(D, parts):
    assert fh.split_head_dim(D) == parts


# Compiles the kernel for sm_90 in a process of its own: under TRITON_INTERPRET (set for every test)
# Gluon cannot reference the interpreted standard library. A stand-in for Triton's active driver
# gives the target; nothing is launched.
COMPILE = """
import json, os, subprocess, sys, tempfile, torch, triton
from triton.backends.compiler import GPUTarget
from sdpatch.kernels import flash_fwd_hopper as fh

class Sm90:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")

D, lse, n = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
q = torch.empty(2, n, 3, D, dtype=torch.float16).transpose(1, 2)
triton.runtime.driver.set_active(Sm90())
grid, args, consts = fh.launch_args(q, q, q, torch.empty_like(q), torch.empty(q.shape[:3]) if lse else None, 0.2)
k = fh._attn_fwd_hopper.warmup(*args, **consts, grid=grid)
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
sass = None
if os.path.exists(cuobjdump):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
print(json.dumps({"ptx": k.asm["ptx"], "sass": sass}))
"""


def main_loop(sass: str) -> list[str]:
    """The SASS instructions of the kernel's key-tile loop: the widest conditional backward branch's
    span (the unconditional ones return from the barrier waits' retry stubs at the end)."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    back = [(int(t, 16), a) for a, text in code if text.startswith("@") and "BRA" in text
            for t in re.findall(r"0x([0-9a-f]+)", text) if int(t, 16) < a]
    start, end = max(back, key=lambda span: span[1] - span[0])
    return [text for a, text in code if start <= a <= end]


# (head dim, log-sum-exp stored, keys, whether the SASS order is checked). At hd160, triton 3.9's
# ptxas (CI's) waits for P V before the softmax whatever the loop holds; triton 3.6's (the H200's) after it.
COMPILED = [(40, True, 256, True), (40, False, 250, True), (64, False, 256, True), (80, False, 256, True),
            (128, True, 250, True), (160, False, 256, False)]


@pytest.mark.skipif(fh.gluon is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("D,lse,n,order", COMPILED, ids=[f"D{d}-N{n}{'-lse' if lse else ''}" for d, lse, n, _ in COMPILED])
def test_compiles_for_sm90(D, lse, n, order):
    """The kernel builds to an sm_90 binary with its asynchronous MMAs and TMA copies, on whatever
    triton CI installs: Gluon's API moves between releases (3.7 renamed the TMA copies). S_j is
    waited for alone: with P V in flight, one MMA group a head-dim part. And in the binary, P V is
    waited for after the softmax's exponentials, not before them: a branch in the loop had ptxas
    move that wait up (v13), with or without a tile that needs masking."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, str(D), str(int(lse)), str(n)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    ptx = built["ptx"]
    parts = 2 if fh.split_head_dim(D)[1] else 1
    assert "wgmma.mma_async" in ptx and f"wgmma.wait_group.sync.aligned {parts};" in ptx
    assert "cp.async.bulk.tensor.4d" in ptx
    assert ("st.global" in ptx) is lse
    if not order:
        return
    if built["sass"] is None:
        pytest.skip("this triton ships no cuobjdump: the SASS order is not checked")
    loop = main_loop(built["sass"])
    exps = [i for i, text in enumerate(loop) if "MUFU.EX2" in text]
    waits = [i for i, text in enumerate(loop) if "WARPGROUP.DEPBAR.LE" in text and text.rstrip().endswith("0x0")]
    block_n = fh.config_for(D)[1]
    assert len(exps) >= block_n // 2 and waits, "no softmax or no wait for P V in the loop"
    assert waits[0] > exps[block_n // 4], f"P V waited for before the softmax: wait at {waits[0]}, exponentials {exps[:3]}..."


def test_a_failed_launch_hands_every_later_call_to_the_triton_kernel(monkeypatch, caplog):
    """A Gluon launch that raises (say, an API this triton changed) costs one warning, not the call."""
    from sdpatch.kernels.flash_fwd import flash_attn_fwd
    from sdpatch.reference import attention_ref

    def broken(*args, **kwargs):
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(fh, "serves", lambda q, k, v, mask: not fh._failed)
    monkeypatch.setattr(fh, "launch_args", broken)
    monkeypatch.setattr(fh, "_failed", [])
    q, k, v = qkv(torch.float32, D=16, Nq=33, Nk=17)
    for _ in range(2):
        out, _ = flash_attn_fwd(q, k, v, 0.25)
        ref = attention_ref(q, k, v, scale=0.25)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4
    assert fh._failed == ["RuntimeError: no such Gluon op"]
    assert sum("Gluon Hopper kernel failed" in r.message for r in caplog.records) == 1
