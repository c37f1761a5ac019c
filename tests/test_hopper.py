"""The Gluon Hopper forward: which calls it takes, and that it compiles for sm_90 on this triton.
Gluon kernels do not run under the interpreter; scripts/check_gpu.py runs this one against float64."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import sdpatch
from sdpatch.kernels import flash_fwd_hopper as fh
from sdpatch.kernels import forward
from sdpatch.kernels.shared import split_parts
from sdpatch.attention.naive import attention_ref


def qkv(dtype=torch.float16, D=40, layout="bnhd", Nq=64, Nk=64):
    def r(n):
        if layout == "bnhd":  # diffusers' (B, N, H, D) memory
            return torch.randn(2, n, 3, D, dtype=dtype).transpose(1, 2)
        if layout == "fused":  # q, k or v of diffusers' fused projections: (B, N, 3, H, D) memory, not dense
            return torch.randn(2, n, 3, 3, D, dtype=dtype)[:, :, 0].transpose(1, 2)
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


SERVED = [  # (B, H, Nq, Nk, D, served): from 256 keys on, on grids of 128 programs and more (measured on an H200)
    (2, 8, 4096, 4096, 40, True),  # SD 1.5 level 1: 22 x 16 programs of 3 x 64 rows
    (2, 8, 1024, 1024, 40, False),  # 6 x 16: the Triton kernel
    (2, 20, 1024, 1024, 64, True),  # SDXL level 2: 6 x 40 programs of 3 x 64 rows
    (2, 10, 4096, 4096, 64, True),
    (2, 8, 1024, 1024, 80, True),  # SD 1.5 at 512 x 512: 8 x 16 programs of 2 x 64 rows
    (1, 8, 1024, 1024, 80, False),  # 8 x 8
    (2, 8, 256, 256, 160, False),  # 2 x 16
    (8, 8, 255, 255, 160, False),  # under 256 keys
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


EAGER_OR_CAPTURED = [  # (B, H, Nq, Nk, D, eager, captured): calls fh.serves takes, by the launch layer's policy on 132 SMs
    (2, 8, 4096, 4096, 40, True, True),  # SD 1.5 at 512², level 1: 352 tiles, 2.67 waves, not split
    (2, 10, 4096, 4096, 64, False, True),  # SDXL at 1024², level 2: 440 tiles, a last wave of 44 split in 3; 8.6e10 FLOPs
    (2, 20, 1024, 1024, 64, True, True),  # SDXL at 1024², level 3: tiles of two sizes, none split
    (2, 8, 1024, 1024, 160, True, True),  # SD 1.5 at 1024², level 3: 128 tiles, under a wave
    (2, 8, 1024, 1024, 80, True, True),  # SD 1.5 at 512², level 2
    (1, 8, 4096, 4096, 40, False, True),  # SD 1.5 at 512², no guidance: 176 tiles, a last wave of 44 split in 3
    (2, 8, 16384, 16384, 40, True, True),  # SD 1.5 at 1024², level 1: split, but 6.9e11 FLOPs, past EAGER_GLUON_MIN_FLOP
    (2, 10, 16384, 16384, 64, True, True),  # SDXL at 2048²: split, 1.4e12 FLOPs
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,eager,captured", EAGER_OR_CAPTURED,
                         ids=[f"B{b}-H{h}-N{nq}x{nk}-D{d}" for b, h, nq, nk, d, *_ in EAGER_OR_CAPTURED])
def test_gluon_serves_captured_calls_and_eager_ones_on_whole_grids_or_past_the_eager_threshold(
        monkeypatch, B, H, Nq, Nk, D, eager, captured):
    monkeypatch.setattr(fh, "serves", lambda q, k, v, mask: True)  # as fh.serves takes every case above on an H200
    monkeypatch.setattr(fh, "sm_count", lambda device: 132)
    q, k = torch.empty(B, H, Nq, D, device="meta"), torch.empty(B, H, Nk, D, device="meta")
    assert fh.splits_wave(q, k) is (fh.grid_for(B * H, Nq, Nk, 132, fh.config_for(D)).pieces > 0)
    assert forward.gluon_serves(q, k, k, None) is eager
    # With gradients (the log-sum-exp) a call does not repeat: its launch is built from scratch,
    # dearer on Gluon, so only the threshold takes it there.
    assert forward.gluon_serves(q, k, k, None, return_lse=True) is (4 * q.numel() * Nk >= forward.EAGER_GLUON_MIN_FLOP)
    with forward.for_capture():
        with forward.for_capture():  # nested: a capture inside a warm-up's block
            pass
        assert forward.gluon_serves(q, k, k, None) is captured
        assert forward.gluon_serves(q, k, k, None, return_lse=True) is captured
    assert forward.gluon_serves(q, k, k, None) is eager
    monkeypatch.setattr(fh, "serves", lambda q, k, v, mask: False)  # SDPATCH_GLUON=0, another GPU, a mask
    with forward.for_capture():
        assert not forward.gluon_serves(q, k, k, None)


def test_explain_names_the_kernel_a_call_gets_with_and_without_gradients(monkeypatch):
    """SD 1.5's 1024-token level at hd80 is one whole Gluon grid: eager calls take the Gluon kernel
    there, but calls with gradients (which do not repeat) the Triton kernel, under the threshold."""
    monkeypatch.setattr(fh, "serves", lambda q, k, v, mask: True)  # as on an H200
    monkeypatch.setattr(fh, "sm_count", lambda device: 132)
    q = torch.zeros(2, 8, 1024, 80, dtype=torch.float16)
    assert sdpatch.explain(q, q, q, backend="triton").path.startswith("gluon")
    q.requires_grad_(True)
    assert sdpatch.explain(q, q, q, backend="triton").path.startswith("triton fa2")
    with torch.no_grad():
        assert sdpatch.explain(q, q, q, backend="triton").path.startswith("gluon")


@pytest.mark.parametrize("D,config", [(40, (64, 128, 2, 3)), (64, (64, 128, 2, 3)), (16, (64, 128, 2, 3)), (80, (64, 128, 2, 2)),
                                      (160, (64, 128, 2, 2)), (256, (64, 64, 2, 2))])
def test_config_for(D, config):
    assert fh.config_for(D) == config


def test_consumer_registers_fit_an_sm():
    """The consumers' ``setmaxnreg`` budgets and the producer's 24 fit in an SM's 64K registers."""
    for consumers in (2, 3):
        regs = fh.consumer_regs(consumers)
        assert regs % 8 == 0 and consumers * 128 * regs + 128 * 24 <= 65536 < (consumers * 128 * (regs + 8) + 128 * 24)


SPLITS = [(40, (32, 16)), (48, (32, 16)), (64, (64, 0)), (80, (64, 16)), (100, (128, 0)), (160, (128, 32)), (20, (32, 0)),
          (8, (16, 0)), (256, (256, 0))]


@pytest.mark.parametrize("D,parts", SPLITS, ids=[f"D{d}" for d, _ in SPLITS])
def test_split_head_dim(D, parts):
    assert split_parts(D) == parts


# Compiles the kernel for sm_90 in a process of its own: under TRITON_INTERPRET (set for every test)
# Gluon cannot reference the interpreted standard library. A stand-in for Triton's active driver
# gives the target; nothing is launched.
COMPILE = """
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from sdpatch.kernels import flash_fwd_hopper as fh

class Sm90:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")

D, lse, n, dtype, sms = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), getattr(torch, sys.argv[4]), int(sys.argv[5])
q = torch.empty(2, n, 3, D, dtype=dtype).transpose(1, 2)
triton.runtime.driver.set_active(Sm90())
runs = fh.launches(q, q, q, torch.empty_like(q), torch.empty(q.shape[:3]) if lse else None, 0.2, sms=sms)
built = [kernel.warmup(*args, **consts, grid=grid) for kernel, grid, args, consts in runs]
print(json.dumps({"ptx": [k.asm["ptx"] for k in built], "num_warps": built[0].metadata.num_warps,
                  "tail": runs[0][3]["TAIL"], "mixed": runs[0][3]["MIXED"]}))
"""

# (head dim, log-sum-exp stored, tokens, dtype, SMs to balance over, grid): split and unsplit head
# dims, two and three consumers; with SMs, a grid whose last wave is split (36 query tiles over 5 SMs
# at D64, 36 over 11 at D40, 48 over 11 at D80: 1, 3 and 4 tiles in pieces), or one of mixed tiles
# (tile_plan: at D64, 6 heads of 1000 tokens over 14 SMs, 1800 over 35: TILE_PLANS).
COMPILED = [(40, True, 256, "float16", 0, "whole"), (40, False, 250, "bfloat16", 0, "whole"),
            (64, False, 256, "float16", 0, "whole"), (80, False, 256, "float16", 0, "whole"),
            (128, True, 250, "float16", 0, "whole"), (160, False, 256, "float16", 0, "whole"),
            (64, False, 1024, "float16", 5, "tail"), (40, True, 1000, "bfloat16", 11, "tail"),
            (80, True, 1000, "float16", 11, "tail"), (64, True, 1000, "float16", 14, "mixed"),
            (64, False, 1800, "bfloat16", 35, "mixed")]


@pytest.mark.skipif(fh.gluon is None, reason="this triton has no Gluon Hopper API")
@pytest.mark.parametrize("D,lse,n,dtype,sms,grid", COMPILED,
                         ids=[f"D{d}-N{n}-{t}{'-lse' if lse else ''}{f'-sms{m}-{g}' if m else ''}" for d, lse, n, t, m, g in COMPILED])
def test_compiles_for_sm90(D, lse, n, dtype, sms, grid):
    """The kernel builds to an sm_90 binary, warp-specialized, with its asynchronous MMAs, TMA copies
    and barrier handoffs, on whatever triton CI installs: Gluon's API moves between releases (3.7
    renamed the TMA copies). S_j is waited for alone, with P V's MMA groups (one a head-dim part)
    and, in fp16, the row sums' still in flight. A split last wave adds the pieces' stores and
    the combine kernel; mixed tiles, consumers that only hand the stages back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, str(D), str(int(lse)), str(n), dtype, str(sms)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    ptx, *combine = built["ptx"]
    assert built["tail"] is (grid == "tail") and built["mixed"] is (grid == "mixed") and len(combine) == (grid == "tail")
    parts = 2 if split_parts(D)[1] else 1
    consumers = fh.config_for(D)[3]
    assert built["num_warps"] == 4 * consumers + 4  # the producer's warp holds a warpgroup's slot
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{fh.consumer_regs(consumers)};", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    rowsum_mma = dtype == "float16"
    assert "wgmma.mma_async" in ptx and f"wgmma.wait_group.sync.aligned {parts + rowsum_mma};" in ptx
    assert ("m64n8k16" in ptx) is rowsum_mma
    assert "cp.async.bulk.tensor.4d" in ptx and "mbarrier.arrive" in ptx
    assert ("st.global" in ptx) is (lse or grid == "tail")
    assert all("ex2.approx" in c and "st.global" in c for c in combine)


# A graph's first warm-up of a Gluon-served layout, compiled for sm_90 as COMPILE does: SDPA serves
# the call, and the Gluon kernel alone compiles in the background once started (the Triton kernel,
# which serves only if Gluon fails, not at all), from placeholder descriptors, under the key of the
# call's own (a warm-up with them compiles nothing more).
BACKGROUND = """
import os, sys, time
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
import torch, triton
from sdpatch.kernels import flash_fwd, flash_fwd_hopper as fh, forward, runtime

triton.runtime.driver.set_active(runtime.CompileOnlyDriver())
fh.serves = lambda q, k, v, mask: True
fh.sm_count = lambda device: 132
q = torch.randn(2, 256, 2, 64).transpose(1, 2).to(torch.float16)
with forward.for_capture(), runtime.compiles_in_background():
    out, _ = forward.flash_attn_fwd(q, q, q, 0.2)
pending = runtime.compiling_later()
runtime.start_deferred()
next(iter(fh._plans.values())).later.result(timeout=600)
time.sleep(0.1)  # the done callback runs after result() returns
compiled = len(fh._attn_fwd_hopper.device_caches[0][0])
for kernel, grid, args, consts in fh.launches(q, q, q, torch.empty_like(q), None, 0.2):  # the call's own descriptors
    kernel.warmup(*args, grid=grid, **consts)
print(runtime.stood_in(), pending, len(flash_fwd._attn_fwd_kernel.device_caches[0][0]), compiled,
      len(fh._attn_fwd_hopper.device_caches[0][0]), runtime.compiling_later())
"""


@pytest.mark.skipif(fh.gluon is None, reason="this triton has no Gluon Hopper API")
def test_a_first_warm_up_compiles_the_gluon_kernel_in_the_background(tmp_path):
    from sdpatch.kernels import runtime

    if runtime._AsyncCompileMode is None:
        pytest.skip("this Triton compiles nothing in the background (no async compile mode)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", BACKGROUND, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["1", "True", "0", "1", "1", "False"]  # compiled under the key the call's own tensors give


def test_a_failed_launch_hands_every_later_call_to_the_triton_kernel(monkeypatch, caplog):
    """A Gluon launch that raises (say, an API this triton changed) costs one warning, not the call."""
    from sdpatch.kernels.forward import flash_attn_fwd

    def broken(*args, **kwargs):
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(fh, "serves", lambda q, k, v, mask: not fh._failed)
    monkeypatch.setattr(fh, "launches", broken)
    monkeypatch.setattr(fh, "_failed", [])
    q, k, v = qkv(torch.float32, D=16, Nq=33, Nk=17)
    for _ in range(2):
        with forward.for_capture():  # where the Gluon kernel serves a call of this size
            out, _ = flash_attn_fwd(q, k, v, 0.25)
        ref = attention_ref(q, k, v, scale=0.25)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4
    assert fh._failed == ["RuntimeError: no such Gluon op"]
    assert sum("Gluon Hopper kernel failed" in r.message for r in caplog.records) == 1


def test_while_a_gluon_layout_compiles_in_the_background_sdpa_stands_in(monkeypatch):
    """In background mode a Gluon layout's compile goes to the background and SDPA serves the call
    (nothing is compiled for the Triton kernel); so does every call in that mode until that compile
    is done, then the Gluon kernel launches. A background compile that failed turns the Gluon kernel
    off, with one warning, and the Triton kernel serves."""
    from concurrent.futures import Future

    from sdpatch.kernels import runtime
    from sdpatch.kernels.forward import flash_attn_fwd

    later, launched = [], []
    monkeypatch.setattr(fh, "serves", lambda q, k, v, mask: not fh._failed)
    monkeypatch.setattr(fh, "launches", lambda *args, **kwargs: [(fh._attn_fwd_hopper, (1, 1, 1), (), {})])
    monkeypatch.setattr(runtime, "compile_later", lambda device, runs: later.append(Future()) or later[-1])
    monkeypatch.setattr(fh, "launch", lambda kernel, *args: launched.append(kernel))
    monkeypatch.setattr(fh, "_failed", [])
    monkeypatch.setattr(fh, "_plans", {})
    q, k, v = qkv(torch.float32, D=16, Nq=33, Nk=17)
    ref = attention_ref(q, k, v, scale=0.25)

    def call(background: bool = False) -> float:
        monkeypatch.setattr(runtime, "_background", int(background))
        with forward.for_capture():
            out, _ = flash_attn_fwd(q, k, v, 0.25)
        return ((out.double() - ref).norm() / ref.norm()).item()

    served = runtime.stood_in()
    assert call(True) < 1e-4 and len(later) == 1 and not launched and runtime.stood_in() == served + 1
    assert call(True) < 1e-4 and len(later) == 1 and not launched and runtime.stood_in() == served + 2  # compiling
    later[0].set_result(None)
    call()
    assert launched == [fh._attn_fwd_hopper] and runtime.stood_in() == served + 2  # compiled: Gluon
    fh._plans.clear()
    call(True)
    later[1].set_exception(RuntimeError("ptxas died"))
    assert call() < 1e-4 and fh._failed == ["RuntimeError: ptxas died"] and len(launched) == 1
    assert runtime.stood_in() == served + 3  # the Triton kernel served the last call


@pytest.mark.parametrize("layout", ["bnhd", "fused"])
@pytest.mark.parametrize("sms,pieces", [(132, 0), (5, 2)], ids=["whole-grid", "split-grid"])
def test_a_repeat_launches_the_layouts_binaries_on_new_tensors(monkeypatch, sms, pieces, layout):
    """An eager repeat of a layout that launched from its binaries: the same launches as the plan's
    path would make on the new tensors (grids, descriptors, scalars), a fresh output, and with a
    split grid one fresh workspace that the combine reads. Fused projections' q is not dense: its
    output is laid out otherwise (``empty_like``), and the output's descriptor and strides follow."""
    from sdpatch.kernels.runtime import LAUNCHED, Plan

    monkeypatch.setattr(fh, "sm_count", lambda device: sms)
    monkeypatch.setattr(fh, "_plans", {})
    q, k, v = qkv(D=40, Nq=1024, Nk=1024, layout=layout)  # 36 tiles; over 5 SMs the last is split in 2
    assert fh.gluon_repeat(q, k, v, 0.25) is None  # the layout has not launched
    plan = fh._plans[fh._plan_key(q, k, v, False)] = Plan({}, later=LAUNCHED)
    assert fh.gluon_repeat(q, k, v, 0.25) is None  # nor compiled its binaries
    calls = []
    plan.binaries = {("gluon", i): lambda grid, args, i=i: calls.append((i, grid, args)) for i in range(1 + (pieces > 0))}
    again = fh.gluon_repeat(q, k, v, 0.25)
    q2, k2, v2 = qkv(D=40, Nq=1024, Nk=1024, layout=layout)
    out = again(q2, k2, v2)
    assert out.shape == q2.shape and out.stride() == torch.empty_like(q2).stride() and out is not q2
    assert (out.stride() == q2.stride()) == (layout == "bnhd")
    expected = fh.launches(q2, k2, v2, out, None, 0.25, bound=True)
    assert [i for i, *_ in calls] == list(range(len(expected))) and (len(expected) > 1) == (pieces > 0)

    def same(a, b):
        if isinstance(b, fh.BoundDescriptor):
            return a.base is b.base and (a.shape, a.strides) == (b.shape, b.strides)
        if isinstance(b, torch.Tensor):  # out, or a workspace: fresh, of the same shape
            return a is b if b is out else a.shape == b.shape and a.dtype == b.dtype
        return a == b

    for (_, grid, args), (_, grid_e, args_e, _) in zip(calls, expected):
        assert grid == grid_e and len(args) == len(args_e) and all(same(a, b) for a, b in zip(args, args_e))
    if pieces:
        assert calls[1][2][0] is calls[0][2][9] and calls[1][2][1] is calls[0][2][10]  # the combine reads the pieces


class _RecordingBinary(fh.Binary):
    """A compiled binary that records its launches: through its arguments (``launch``'s way, on a
    layout's first addresses) or its kept flat list (a repeat on addresses seen before)."""

    __slots__ = ("calls",)

    def __init__(self, calls: list):
        self.calls = calls

    def __call__(self, grid, args):
        self.calls.append(("args", grid, args))

    def flat_args(self, args):
        return [a.base.data_ptr() if isinstance(a, fh.BoundDescriptor) else a.data_ptr() if isinstance(a, torch.Tensor) else a
                for a in args]

    def launch_flat(self, grid, values):
        self.calls.append(("flat", grid, values))


@pytest.mark.parametrize("sms", [132, 5], ids=["whole-grid", "split-grid"])
def test_a_repeat_keeps_its_launch_arguments_by_address(monkeypatch, sms):
    """On addresses it has launched before (the caching allocator hands a layer's tensors the same
    ones every step), a repeat hands each binary the flat argument list it kept, made from those
    tensors; new addresses, or a profiler's launch hook, launch through the arguments again."""
    from sdpatch.kernels.runtime import LAUNCHED, Plan

    monkeypatch.setattr(fh, "sm_count", lambda device: sms)
    monkeypatch.setattr(fh, "_plans", {})
    monkeypatch.setattr(fh, "launch_hooked", lambda: hooked)
    hooked = False
    q, k, v = qkv(D=40, Nq=1024, Nk=1024)
    plan = fh._plans[fh._plan_key(q, k, v, False)] = Plan({}, later=LAUNCHED)
    calls = []
    launches = len(fh.launches(q, k, v, torch.empty_like(q), None, 0.25, bound=True))
    assert launches == (1 if sms == 132 else 2)  # over 5 SMs the last wave is split: a combine launch too
    plan.binaries = {("gluon", i): _RecordingBinary(calls) for i in range(launches)}
    again = fh.gluon_repeat(q, k, v, 0.25)
    # The output and workspace at the same addresses on every call, as from the caching allocator.
    like, empty, kept = torch.empty_like, torch.empty, {}
    monkeypatch.setattr(torch, "empty_like", lambda t: kept.setdefault(("like", t.shape, t.stride()), like(t)))
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: kept.setdefault((a, tuple(kw.items())), empty(*a, **kw)))

    def ways(*tensors):
        calls.clear()
        out = again(*tensors)
        return [way for way, *_ in calls], out

    first, out = ways(q, k, v)
    assert first == ["args"] * launches
    by_args = list(calls)
    assert ways(q, k, v)[0] == ["flat"] * launches
    for (_, grid, args), (_, flat_grid, values) in zip(by_args, calls):
        assert flat_grid == grid and values == _RecordingBinary(None).flat_args(args)
    assert calls[0][2][:3] == [q.data_ptr(), k.data_ptr(), v.data_ptr()] and out.data_ptr() in calls[0][2]
    assert ways(*qkv(D=40, Nq=1024, Nk=1024))[0] == ["args"] * launches  # new addresses
    hooked = True
    assert ways(q, k, v)[0] == ["args"] * launches


def test_the_eager_repeat_takes_the_kernel_that_serves_and_none_inside_a_capture(monkeypatch):
    from sdpatch.kernels import flash_fwd

    q, k, v = qkv(D=64, Nq=256, Nk=256)
    launched = []
    monkeypatch.setattr(fh, "gluon_repeat", lambda *a: lambda q, k, v: launched.append("gluon"))
    monkeypatch.setattr(flash_fwd, "fa2_repeat", lambda *a: lambda q, k, v: launched.append("triton"))
    for gluon in (True, False):
        monkeypatch.setattr(forward, "gluon_serves", lambda q, k, v, mask: gluon)
        again = forward.repeat_launcher(q, k, v, 0.125)
        again(q, k, v)
        with forward.for_capture():
            assert again(q, k, v) is None  # the full path, where the Gluon kernel may serve instead
    assert launched == ["gluon", "triton"]


TAIL_SPLITS = [  # (tiles, SMs, key tiles, (whole, splits))
    (440, 132, 32, (396, 3)),  # hd64 4096, B2 H10: 3 waves and 44 tiles, those in thirds
    (256, 132, 64, (256, 1)),  # hd40 4096, B2 H8: a last wave of 124 tiles
    (4096, 132, 1024, (4092, 33)),  # hd40 65536: 31 waves and 4 tiles
    (576, 132, 144, (528, 2)),  # hd40 9216 (768 x 768): 4 waves and 48
    (128, 132, 16, (128, 1)),  # under one wave
    (264, 132, 32, (264, 1)),  # whole waves
    (440, 132, 7, (440, 1)),  # pieces of under MIN_PIECE_TILES key tiles
    (440, 0, 32, (440, 1)),  # no balancing asked
]


@pytest.mark.parametrize("tiles,sms,key_tiles,split", TAIL_SPLITS, ids=[f"T{t}-S{s}-K{k}" for t, s, k, _ in TAIL_SPLITS])
def test_tail_split(tiles, sms, key_tiles, split):
    assert fh.tail_split(tiles, sms, key_tiles) == split


TILE_PLANS = [  # (heads, tokens, SMs, BLOCK_M, consumers, plan)
    # hd64 1024, B2 H20: 240 whole tiles are 1.82 waves; 132 of 192 rows and 122 of 128, 1.87 tiles' time
    (40, 1024, 132, 64, 3, (7, 0, 8, 4, 2)),
    (20, 2048, 132, 64, 3, (20, 6, 7, 0, 0)),  # 220 tiles, 1.67 waves: 120 of 192 rows and 140 of 128
    (40, 768, 132, 64, 3, (40, 0, 6, 0, 0)),  # 160 tiles, 1.21 waves: 240 of 128 rows, 1.82 waves of 0.865
    (6, 1000, 14, 64, 3, (6, 2, 5, 0, 0)),  # each head's last tile: 104 rows
    (6, 1800, 35, 64, 3, (1, 0, 15, 7, 4)),  # last tiles: 8 rows, one consumer, and 72
    (20, 2304, 132, 64, 3, (20, 12, 0, 0, 0)),  # 240 tiles: one of each size an SM would not cover the rows
    (40, 1152, 132, 64, 3, (40, 6, 0, 0, 0)),
    (16, 4096, 132, 128, 2, (16, 16, 0, 0, 0)),  # two consumers: one is no faster than two (tile_cost)
    (16, 1024, 132, 64, 3, (16, 6, 0, 0, 0)),  # under one wave
    (160, 1024, 132, 64, 3, None),  # 960 tiles: over MIXED_MAX_WAVES waves
    (40, 1024, 0, 64, 3, (40, 6, 0, 0, 0)),  # no balancing asked
]


@pytest.mark.parametrize("heads,n_q,sms,block_m,consumers,plan", TILE_PLANS,
                         ids=[f"BH{h}-N{n}-S{s}-M{m}x{c}" for h, n, s, m, c, _ in TILE_PLANS])
def test_tile_plan(heads, n_q, sms, block_m, consumers, plan):
    whole = (heads, -(-n_q // (block_m * consumers)), 0, 0, 0)
    assert fh.tile_plan(heads, n_q, sms, block_m, consumers) == (plan or whole)


GRIDS = [  # (heads, Nq, Nk, SMs, config, (whole programs, splits, pieces, mixed))
    (20, 4096, 4096, 132, (64, 128, 2, 3), (396, 3, 132, False)),  # hd64 4096: the last wave's 44 tiles in thirds
    (40, 1024, 1024, 132, (64, 128, 2, 3), (254, 1, 0, True)),  # hd64 1024: tile_plan's 132 + 122 tiles
    (16, 4096, 4096, 132, (64, 128, 2, 3), (352, 1, 0, False)),  # hd40 4096: 2.67 waves, too full to split
    (40, 1024, 1024, 0, (64, 128, 2, 3), (240, 1, 0, False)),  # no balancing asked
]


@pytest.mark.parametrize("heads,n_q,n_k,sms,config,grid", GRIDS, ids=[f"BH{h}-N{n}-S{s}-x{c[3]}" for h, n, _, s, c, _ in GRIDS])
def test_grid_for(heads, n_q, n_k, sms, config, grid):
    """A short last wave is split (tail_split); only a grid not split may mix tile sizes (tile_plan)."""
    got = fh.grid_for(heads, n_q, n_k, sms, config)
    assert (got.whole, got.splits, got.pieces, got.mixed) == grid


def test_plan_time():
    """hd64 1024 (B 2, H 20): whole tiles take two tiles' time; the mixed plan one whole tile and
    one of two consumers, 2.6 / 3 of it (SERIAL_CONSUMERS, measured on an H200)."""
    whole, mixed = (40, 6, 0, 0, 0), (7, 0, 8, 4, 2)
    assert fh.plan_time(whole, 40, 1024, 132, 64, 3) == pytest.approx(2.0)
    assert fh.plan_time(mixed, 40, 1024, 132, 64, 3) == pytest.approx(1 + 2.6 / 3)
    assert fh.plan_time(whole, 40, 1024, 240, 64, 3) == pytest.approx(1.0)  # a wave holds them all


def program_rows(plan, heads, n_q, block_m, consumers):
    """Each program's (head, first row, consumers with rows): the Gluon kernel's ``_work``, which
    runs only on a GPU, transcribed for the grid :func:`tile_plan` lays out."""
    heads1, big1, small1, big2, small2 = plan
    out = []
    for tile in range(heads1 * (big1 + small1) + (heads - heads1) * (big2 + small2)):
        bigs = heads1 * big1 + (heads - heads1) * big2
        small = int(tile >= bigs)
        u = tile - small * bigs
        per1, per2 = (small1, small2) if small else (big1, big2)
        second = int(u >= heads1 * per1)
        u -= second * heads1 * per1
        per = per2 if second else per1
        row0 = small * (big2 if second else big1) * consumers * block_m + u % per * (consumers - small) * block_m
        out.append((second * heads1 + u // per, row0, min(consumers - small, -(-(n_q - row0) // block_m))))
    return out


@pytest.mark.parametrize("heads,n_q,sms,block_m,consumers,plan", [p for p in TILE_PLANS if p[-1] and p[-1][2] + p[-1][4]],
                         ids=[f"BH{h}-N{n}-S{s}" for h, n, s, _, _, p in TILE_PLANS if p and p[2] + p[4]])
def test_tile_plan_covers_every_row_once(heads, n_q, sms, block_m, consumers, plan):
    """The programs' consumers with rows hold every query row of every head once, and each has
    some."""
    seen = torch.zeros(heads, n_q, dtype=torch.int32)
    programs = program_rows(plan, heads, n_q, block_m, consumers)
    for head, row0, active in programs:
        assert 1 <= active <= consumers and row0 < n_q
        seen[head, row0 : row0 + active * block_m] += 1
    assert (seen == 1).all()


# (B, H, Nq, Nk, D, dtype, SMs): grids whose last wave is split, tiles of 192 (D40, D64) and
# 128 rows (D80, D160), rows and keys that tiles do not divide.
COMBINED = [(2, 1, 300, 1000, 40, torch.float16, 3), (1, 2, 500, 1100, 64, torch.float16, 4),
            (1, 3, 257, 2048, 80, torch.bfloat16, 4), (1, 1, 300, 1024, 160, torch.bfloat16, 2)]
COMBINE_RTOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}  # the output's rounding: the pieces are fp32
COMBINE_LSE_ATOL = 1e-5


@pytest.mark.parametrize("B,H,Nq,Nk,D,dtype,sms", COMBINED,
                         ids=[f"B{b}-H{h}-N{nq}x{nk}-D{d}-{str(t)[6:]}-sms{m}" for b, h, nq, nk, d, t, m in COMBINED])
def test_combine_pieces(B, H, Nq, Nk, D, dtype, sms):
    """The split tiles' rows, merged by the combine launch that :func:`launches` builds from pieces
    as the Gluon kernel leaves them (each over its share of the key tiles, normalized, in fp32, with
    its base-2 log-sum-exp), match float64 attention; nothing else is written, and neither the
    workspace's rows past the queries nor its columns past the head dim reach the output."""
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype) for n in (Nq, Nk, Nk))
    scale = D**-0.5
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    runs = fh.launches(q, k, v, out, lse, scale, sms=sms)
    assert len(runs) == 2 and runs[0][3]["TAIL"]
    kernel, grid, args, consts = runs[1]
    part_o, part_l, *_, m_tiles, whole, splits = args
    tile_m, block_n = consts["TILE_M"], fh.config_for(D)[1]
    key_tiles = -(-Nk // block_n)
    assert splits >= 2 and part_o.shape[0] == (m_tiles * B * H - whole) * splits
    part_o.fill_(float("nan"))
    part_l.fill_(float("nan"))
    split_rows = torch.zeros(B, H, Nq, dtype=torch.bool)
    for piece in range(part_o.shape[0]):
        tile, s = whole + piece // splits, piece % splits
        b, h = divmod(tile // m_tiles, H)
        rows = slice(tile % m_tiles * tile_m, min((tile % m_tiles + 1) * tile_m, Nq))
        keys = slice(s * key_tiles // splits * block_n, min((s + 1) * key_tiles // splits * block_n, Nk))
        scores = q[b, h, rows].double() @ k[b, h, keys].double().T * scale
        n = scores.shape[0]
        part_l[piece, :n] = torch.logsumexp(scores, -1) / math.log(2)
        part_o[piece, :n, :D] = torch.softmax(scores, -1) @ v[b, h, keys].double()
        split_rows[b, h, rows] = True
    kernel[grid](*args, **consts)
    ref = attention_ref(q, k, v, scale=scale)
    lse_ref = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) * scale, -1) / math.log(2)
    got, want = out[split_rows].double(), ref[split_rows]
    assert ((got - want).norm() / want.norm()).item() < COMBINE_RTOL[dtype]
    assert (lse[split_rows].double() - lse_ref[split_rows]).abs().max().item() < COMBINE_LSE_ATOL
    assert out[~split_rows].isnan().all() and lse[~split_rows].isnan().all()
