"""sdpatch.attention against a float64 reference, for every backend, plus its bad-input errors.

Triton runs under TRITON_INTERPRET=1 (tests/conftest.py) on the CPU, so its shapes stay small.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import time

import pytest
import torch

import sdpatch
from helpers import DT, RTOL, case, make_mask, make_qkv, rel_err
from sdpatch import attention
from sdpatch.attention import BackendUnavailableError
from sdpatch.attention.chunked import plan_chunks
from sdpatch.attention.naive import attention_ref


def check(backend, B, H, Nq, Nk, D, dtype, mask_kind, layout, **kw):
    q, k, v = make_qkv(B, H, Nq, Nk, D, dtype, layout)
    mask = make_mask(mask_kind, B, H, Nq, Nk, dtype)
    out = attention(q, k, v, attn_mask=mask, backend=backend, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_ref(q, k, v, attn_mask=mask)
    assert rel_err(out, ref) <= RTOL[dtype]
    if mask_kind == "bool":  # row 0 has every key masked: zeros by convention
        assert torch.all(out[:, :, 0] == 0)
    return out


# Chunked and sdpa run on the CPU at full test sizes.
CPU_CASES = [
    case(2, 8, 77, 77, 40, "fp32"),
    case(1, 2, 4097, 77, 40, "fp32"),
    case(1, 1, 1025, 1025, 64, "fp32", "bool"),
    case(2, 2, 97, 77, 80, "fp16", "padding", "bnhd"),
    case(2, 2, 97, 97, 160, "bf16", "additive"),
    case(1, 1, 256, 256, 512, "fp32"),  # SD VAE mid-block: one head of 512
    case(1, 1, 4097, 4097, 40, "fp16", layout="bnhd"),
    case(2, 3, 1, 1, 64, "fp32"),
    case(1, 2, 33, 17, 1, "fp64", "bool", "sliced"),
    case(2, 4, 65, 77, 40, "fp32", "additive", "sliced"),
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,dtype,mask,layout", CPU_CASES)
@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
def test_cpu_backends(backend, B, H, Nq, Nk, D, dtype, mask, layout):
    if backend == "sdpa" and dtype == torch.float16:
        pytest.skip("CPU SDPA in fp16 is not a reference-grade path")
    check(backend, B, H, Nq, Nk, D, dtype, mask, layout)


@pytest.mark.parametrize("budget", [1, 5000, 200_000, 10**9], ids=lambda b: f"budget{b}")
def test_chunked_budgets_agree(budget):
    """Every way of cutting (batch, heads, queries) gives the same answer."""
    check("chunked", 2, 3, 37, 29, 16, torch.float32, "bool", "bnhd", chunk_budget=budget)


@pytest.mark.parametrize(
    "B,H,Nq,Nk,budget,expect",
    [
        (2, 8, 4096, 4096, 2**40, (2, 8, 4096)),
        (2, 8, 4096, 4096, 8 * 4096 * 4096 * 4, (1, 8, 4096)),
        (2, 8, 4096, 4096, 4096 * 4096 * 4 * 3, (1, 3, 4096)),
        (2, 8, 4096, 4096, 4096 * 4 * 100, (1, 1, 100)),
        (1, 1, 10, 10**6, 1, (1, 1, 1)),
    ],
)
def test_plan_chunks_fits_budget(B, H, Nq, Nk, budget, expect):
    plan = plan_chunks(B, H, Nq, Nk * 4, budget)
    assert (plan.batch, plan.heads, plan.queries) == expect
    rows = plan.batch * plan.heads * plan.queries
    assert rows == 1 or rows * Nk * 4 <= budget


# Triton through the interpreter: small shapes, but every feature: tails, head dims, masks, strides.
TRITON_CASES = [
    case(2, 2, 33, 33, 40, "fp16"),
    case(1, 2, 77, 77, 64, "fp16", "bool"),
    case(2, 1, 17, 77, 80, "bf16", "padding", "bnhd"),
    case(1, 1, 20, 19, 160, "fp32", "additive"),
    case(1, 1, 1025, 17, 40, "fp16"),
    case(1, 1, 5, 97, 40, "fp32", "bool", "sliced"),
    case(1, 2, 9, 16, 256, "bf16"),
    case(2, 1, 1, 1, 1, "fp32"),
    case(1, 1, 16, 32, 24, "fp32", "additive", "bnhd"),
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,dtype,mask,layout", TRITON_CASES)
def test_triton_interpreted(B, H, Nq, Nk, D, dtype, mask, layout):
    out = check("triton", B, H, Nq, Nk, D, dtype, mask, layout)
    q, _, _ = make_qkv(B, H, Nq, Nk, D, dtype, layout)
    if layout != "sliced":  # dense layouts are kept, so diffusers' reshape after it is free
        assert out.stride() == q.stride(), "output should keep q's layout"


def test_triton_launch_grid_splits_large_batch_heads():
    from sdpatch.kernels.runtime import launch_grid

    assert launch_grid(2**20, 2**20, 128) == (2**13, 65535, 17)
    assert launch_grid(77, 16, 64) == (2, 16, 1)
    # Enough programs for every (batch*head, row block) pair; extra ones exit at once.
    x, y, z = launch_grid(5, 70000, 16)
    assert y * z >= 70000 and y <= 65535


def test_extreme_scores_stay_finite():
    """fp16 scores near +-1e4: fp32 accumulation keeps the output finite and exact."""
    q, k, v = make_qkv(1, 2, 40, 40, 64, torch.float16)
    q, k = 35 * q.sign(), 35 * k.sign()
    k[:, :, :5], k[:, :, 5:10] = q[:, :, :5], -q[:, :, 5:10]  # scores of +-9800 on these keys
    assert (q.float() @ k.float().transpose(-1, -2) / 8).abs().max() > 9e3
    ref = attention_ref(q, k, v)
    for backend in ("chunked", "triton"):
        out = attention(q, k, v, backend=backend)
        assert torch.isfinite(out).all(), backend
        assert rel_err(out, ref) <= RTOL[torch.float16], backend


def test_empty_batch_gives_empty_output():
    q, k, v = make_qkv(0, 2, 5, 5, 8, torch.float32)
    assert attention(q, k, v).shape == (0, 2, 5, 8)


def test_auto_and_explain_on_cpu():
    q, k, v = make_qkv(1, 1, 4, 4, 40, torch.float32)
    choice = sdpatch.explain(q, k, v)
    assert choice.name == "chunked" and "CUDA" in choice.reason
    assert sdpatch.choose_backend(device="cpu", dtype=torch.float16, head_dim=512).name == "chunked"
    assert sdpatch.backend_status("cpu")["chunked"][0]


def test_triton_unavailable_says_why(monkeypatch):
    with pytest.raises(BackendUnavailableError, match="head dim 512"):
        sdpatch.choose_backend(device="cpu", dtype=torch.float32, head_dim=512, backend="triton")
    # The package re-exports the function `attention`, which shadows the module's name.
    monkeypatch.setattr(importlib.import_module("sdpatch.attention.triton_backend"), "_interpreting", lambda: False)
    q, k, v = make_qkv(1, 1, 4, 4, 40, torch.float32)
    with pytest.raises(BackendUnavailableError, match="need a CUDA device"):
        attention(q, k, v, backend="triton")


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


BAD_INPUTS = [
    pytest.param(dict(q=_t(2, 4, 8, 16), k=_t(3, 4, 8, 16), v=_t(3, 4, 8, 16)), ValueError, "batch and heads", id="batch-mismatch"),
    pytest.param(dict(q=_t(2, 4, 8, 16), k=_t(2, 5, 8, 16), v=_t(2, 5, 8, 16)), ValueError, "batch and heads", id="heads-mismatch"),
    pytest.param(dict(q=_t(2, 4, 8, 16), k=_t(2, 4, 8, 32), v=_t(2, 4, 8, 32)), ValueError, "head dims", id="headdim-mismatch"),
    pytest.param(dict(q=_t(2, 4, 8, 16), k=_t(2, 4, 8, 16), v=_t(2, 4, 9, 16)), ValueError, "same length", id="kv-length-mismatch"),
    pytest.param(dict(q=_t(2, 4, 8, 16), k=_t(2, 4, 8, 16, dtype=torch.float16), v=_t(2, 4, 8, 16)), TypeError, "dtype", id="dtype-mismatch"),
    pytest.param(dict(q=_t(4, 8, 16), k=_t(4, 8, 16), v=_t(4, 8, 16)), ValueError, "4-D", id="ndim3"),
    pytest.param(dict(q=_t(2, 4, 8, 16), k=_t(2, 4, 0, 16), v=_t(2, 4, 0, 16)), ValueError, "no keys", id="zero-keys"),
    pytest.param(dict(q=_t(2, 4, 8, 0), k=_t(2, 4, 8, 0), v=_t(2, 4, 8, 0)), ValueError, "head dim is 0", id="zero-headdim"),
    pytest.param(dict(q=_t(2, 4, 8, 16, dtype=torch.float64).int(), k=_t(2, 4, 8, 16).int(), v=_t(2, 4, 8, 16).int()), TypeError, "unsupported dtype", id="int-dtype"),
    pytest.param(dict(q=_t(1, 1, 8, 16), k=_t(1, 1, 8, 16), v=_t(1, 1, 8, 16), backend="flash3"), ValueError, "valid backends", id="unknown-backend"),
    pytest.param(dict(q=_t(1, 1, 8, 16), k=_t(1, 1, 6, 16), v=_t(1, 1, 6, 16), attn_mask=_t(8, 8)), ValueError, "does not broadcast", id="mask-shape"),
    pytest.param(dict(q=_t(1, 1, 8, 16), k=_t(1, 1, 6, 16), v=_t(1, 1, 6, 16), attn_mask=_t(1, 1, 1, 1, 6)), ValueError, "does not broadcast", id="mask-5d"),
    pytest.param(dict(q=_t(1, 1, 8, 16), k=_t(1, 1, 6, 16), v=_t(1, 1, 6, 16), attn_mask=torch.ones(8, 6, dtype=torch.int32)), TypeError, "bool", id="mask-int"),
    pytest.param(dict(q=_t(1, 1, 8, 16), k=_t(1, 1, 6, 16), v=_t(1, 1, 6, 16), scale=float("nan")), ValueError, "scale", id="scale-nan"),
    pytest.param(dict(q="q", k=_t(1, 1, 6, 16), v=_t(1, 1, 6, 16)), TypeError, "torch.Tensor", id="not-a-tensor"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_INPUTS)
def test_bad_input(kwargs, exc, match):
    kwargs = dict(kwargs)
    q, k, v = kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v")
    with pytest.raises(exc, match=match):
        attention(q, k, v, **kwargs)


def test_bad_input_on_meta_device_mismatch():
    q = _t(1, 1, 4, 8)
    k = torch.empty(1, 1, 4, 8, device="meta")
    with pytest.raises(ValueError, match="one device"):
        attention(q, k, k)


@pytest.mark.parametrize("split", [False, True], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("D", [1, 40, 64, 80, 160, 256])
def test_triton_head_dim_tilings_agree(D, split):
    """Both ways of tiling the head dim (padded to one power of two, or two parts) are exact."""
    from sdpatch.kernels.forward import flash_attn_fwd

    q, k, v = make_qkv(1, 1, 17, 19, D, torch.float16, "bnhd")
    mask = make_mask("bool", 1, 1, 17, 19, torch.float16)
    out, _ = flash_attn_fwd(q, k, v, D**-0.5, mask, split_head_dim=split)
    assert rel_err(out, attention_ref(q, k, v, attn_mask=mask)) <= RTOL[torch.float16]


@pytest.mark.parametrize(
    "B,H,Nq,Nk,D,dtype,mask_kind,split",
    [
        pytest.param(1, 2, 17, 19, 40, "fp16", "none", False, id="B1-H2-N17x19-D40-fp16"),
        pytest.param(2, 1, 16, 77, 40, "fp16", "padding", False, id="B2-H1-N16x77-D40-fp16-padding"),
        pytest.param(1, 1, 33, 128, 80, "fp16", "none", True, id="B1-H1-N33x128-D80-fp16-split"),
        pytest.param(1, 2, 20, 21, 64, "bf16", "bool", False, id="B1-H2-N20x21-D64-bf16-bool"),
    ],
)
@pytest.mark.skipif(not importlib.util.find_spec("triton.tools.tensor_descriptor"), reason="triton < 3.4: no TMA descriptors")
def test_triton_kv_tma(B, H, Nq, Nk, D, dtype, mask_kind, split):
    """K and V tiles through TMA descriptors (diffusers' layout): the descriptors' zero fill stands
    in for the key-tail and head-dim masks of the pointer loads."""
    from sdpatch.kernels.flash_fwd import kv_tma_ok
    from sdpatch.kernels.forward import flash_attn_fwd

    q, k, v = make_qkv(B, H, Nq, Nk, D, DT[dtype], "bnhd")
    assert kv_tma_ok(k, v)
    mask = make_mask(mask_kind, B, H, Nq, Nk, DT[dtype])
    out, _ = flash_attn_fwd(q, k, v, D**-0.5, mask, split_head_dim=split, kv_tma=True)
    assert rel_err(out, attention_ref(q, k, v, attn_mask=mask)) <= RTOL[DT[dtype]]


def test_kv_tma_needs_aligned_rows():
    from sdpatch.kernels.flash_fwd import kv_tma_ok
    from sdpatch.kernels.forward import flash_attn_fwd

    q, k, v = make_qkv(1, 1, 8, 8, 40, torch.float16, "sliced")
    assert not kv_tma_ok(k, v)
    with pytest.raises(AssertionError, match="16-byte-aligned"):
        flash_attn_fwd(q, k, v, 1.0, kv_tma=True)


@pytest.mark.parametrize(
    "n_k,da,db,tma,expect",
    [
        pytest.param(4096, 64, 0, True, {(128, 64), (128, 128), (64, 128), (64, 64)}, id="self-D64-tma"),
        pytest.param(4096, 64, 0, False, {(128, 64), (64, 64)}, id="self-D64-pointers"),
        pytest.param(77, 64, 0, True, {(128, 32), (64, 32)}, id="x77-D40-tma"),
        pytest.param(77, 64, 0, False, {(64, 32), (128, 32)}, id="x77-D40-pointers"),
        pytest.param(1024, 256, 0, False, {(64, 64), (64, 32)}, id="wide-D256"),
    ],
)
def test_forward_tile_pruning(n_k, da, db, tma, expect):
    """Each shape and load keeps only tiles from its own measured list, at most six of them."""
    from sdpatch.kernels.flash_fwd import POINTER_TILES, TMA_TILES, _prune, fwd_configs

    kept = _prune(fwd_configs(tma), {"N_K": n_k}, BLOCK_DA=da, BLOCK_DB=db, KV_TMA=tma)
    assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept} == expect and len(kept) <= 6
    tiles = TMA_TILES if tma else POINTER_TILES
    assert all((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in tiles for c in kept)


def test_pointer_load_tuning_can_be_kept_on_disk():
    """Triton re-tunes an autotuner whose configs carry a pre-hook in every process (it cannot
    store one). The pointer-load forward, which serves every SD shape below TMA_MIN_FLOP, has
    none; the TMA configs need theirs (it sizes the descriptors' tiles)."""
    from sdpatch.kernels.flash_fwd import fwd_configs

    assert all(c.pre_hook is None for c in fwd_configs(False))
    assert all(c.pre_hook is not None for c in fwd_configs(True))


# Compiles sdpatch's forward for sm_90 in a fresh interpreter, without TRITON_INTERPRET and without a
# GPU: Triton's driver is replaced by a stand-in that names the target (nothing is launched).
_PRECOMPILE_SCRIPT = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
import torch, triton
from sdpatch.kernels.runtime import CompileOnlyDriver

triton.runtime.driver.set_active(CompileOnlyDriver())
from sdpatch.kernels import flash_fwd, runtime

q, k, v = (torch.empty(2, 256, 2, 40, dtype=torch.float16).transpose(1, 2) for _ in range(3))
out = torch.empty_like(q)
meta = {**flash_fwd.fwd_meta(q, k, v, out, 0.2, None, False, None, False), "EVEN_N": True}
args = flash_fwd.fwd_args(q, k, v, None, out, None, 0.2)
candidates = flash_fwd._prune(flash_fwd.fwd_configs(False), {"N_K": 256}, **meta)
runtime.precompile((flash_fwd.fwd_tuner(False), lambda META: (1, 1, 1), args, meta))
cache = flash_fwd._attn_fwd_kernel.device_caches[0][0]
print(len(candidates), len(cache), runtime._AsyncCompileMode is not None)
"""


# Calls of two new layouts inside compiles_in_background, compiled for sm_90 through the stand-in
# driver: a layout to tune and one with given tiles. Both are served by SDPA (on the CPU here) and
# compile nothing until start_deferred; the compiles waiting hold none of the calls' tensors. Then
# the background threads compile every candidate of the one and the given tiles of the other, under
# the keys the calls' own tensors give (a warm-up with them compiles nothing more).
_BACKGROUND_SCRIPT = """
import gc, os, sys, time, weakref
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
import torch, triton
from sdpatch.kernels.runtime import CompileOnlyDriver

triton.runtime.driver.set_active(CompileOnlyDriver())
from sdpatch.kernels import flash_fwd, forward, runtime

torch.manual_seed(0)
q, k, v = (torch.randn(2, 256, 2, 40).transpose(1, 2) for _ in range(3))
meta = flash_fwd.fwd_meta(q, k, v, torch.empty_like(q), 0.2, None, False, None, False)
candidates = flash_fwd._prune(flash_fwd.fwd_configs(False), {"N_K": 256}, **meta)
q2, k2, v2 = (torch.randn(2, 128, 2, 40).transpose(1, 2) for _ in range(3))
tiles = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
plan = flash_fwd._fwd_plan
flash_fwd._fwd_plan = lambda q, *a: runtime.Plan(plan(q, *a).meta, tiles if q.shape[2] == 128 else None)
with runtime.compiles_in_background():
    outs = [forward.flash_attn_fwd(*x, 0.2)[0] for x in ((q, k, v), (q2, k2, v2))]
want = [torch.softmax(a @ b.transpose(-1, -2) * 0.2, -1) @ c for a, b, c in ((q, k, v), (q2, k2, v2))]
cache = flash_fwd._attn_fwd_kernel.device_caches[0][0]
print(runtime.stood_in(), max(((o - w).abs().max().item() for o, w in zip(outs, want))) < 1e-5, len(cache),
      runtime.compiling_later())
held = [weakref.ref(t) for t in (q2, k2, v2)]
del q2, k2, v2, outs, want
gc.collect()
print(sum(r() is not None for r in held))  # the waiting compiles keep none of them alive
started = runtime.start_deferred()
while runtime.compiling_later():
    time.sleep(0.05)
compiled = len(cache)
q2, k2, v2 = (torch.randn(2, 128, 2, 40).transpose(1, 2) for _ in range(3))
out = torch.empty_like(q2)
consts = {**meta, "EVEN_N": True, **tiles}
flash_fwd._attn_fwd_kernel.warmup(*flash_fwd.fwd_args(q2, k2, v2, None, out, None, 0.2), grid=(1, 1, 1), **consts)
print(started, len(candidates), compiled, len(cache))
"""


def test_calls_in_background_mode_stand_aside_and_compile_their_kernels_once_started(tmp_path):
    """Inside compiles_in_background, new layouts' calls are served by the stand-in (SDPA) and hand
    their compiles (every autotune candidate, or the given tiles) to background threads, which
    start at start_deferred and leave every kernel compiled, as the calls' own tensors specialize
    it; until then the compiles hold placeholders, not the calls' tensors."""
    import subprocess
    import sys

    from sdpatch.kernels import runtime

    if runtime._AsyncCompileMode is None:
        pytest.skip("this Triton compiles nothing in the background (no async compile mode)")
    done = subprocess.run([sys.executable, "-c", _BACKGROUND_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    served, exact, cached_before, compiling, alive, started, candidates, compiled, cached = done.stdout.split()
    assert (served, exact, cached_before, compiling, alive, started) == ("2", "True", "0", "True", "0", "2")
    assert int(candidates) > 1 and int(compiled) == int(candidates) + 1 == int(cached)


def test_a_compile_for_later_starts_at_start_deferred(monkeypatch):
    """compile_later queues its compile until start_deferred; its future then says when it is
    done, and compiling_later() until then."""
    from sdpatch.kernels import runtime

    built = []

    class Kernel:
        def warmup(self, *args, grid, **consts):
            built.append((args, grid, consts))

    monkeypatch.setattr(runtime, "_deferred", [])
    future = runtime.compile_later(torch.device("cpu"), [(Kernel(), (1, 1, 1), (7,), {"BLOCK": 16})])
    assert runtime.compiling_later() and not future.running() and not built
    assert runtime.start_deferred() == 1
    future.result(timeout=60)
    assert built == [((7,), (1, 1, 1), {"BLOCK": 16})] and not runtime._deferred
    for _ in range(100):  # the done callback runs on the compile thread, just after the result is set
        if not runtime.compiling_later():
            break
        time.sleep(0.01)
    assert not runtime.compiling_later()


def test_stands_aside_until_the_background_compile_is_done_then_raises_what_it_raised(monkeypatch):
    """A plan's call in background mode hands its compile to compile_later once and stands aside
    while it runs; out of that mode nothing new is handed over, and a call waits for the compile
    instead (starting what is still to start); a compile done lets the next call through, and one
    that failed raises there, once."""
    import threading
    from concurrent.futures import Future

    from sdpatch.kernels import runtime

    later, started = [], []
    monkeypatch.setattr(runtime, "compile_later", lambda device, runs: later.append((Future(), runs)) or later[-1][0])
    monkeypatch.setattr(runtime, "start_deferred", lambda: started.append(True) or 0)
    cpu = torch.device("cpu")
    plan, fresh, failing, waited = runtime.Plan({}), runtime.Plan({}), runtime.Plan({}), runtime.Plan({})
    assert not runtime.stands_aside(plan, cpu, lambda: ["launch"])  # out of background mode: the kernel serves
    monkeypatch.setattr(runtime, "_background", 1)
    assert runtime.stands_aside(plan, cpu, lambda: ["launch"]) and later[0][1] == ["launch"]
    assert runtime.stands_aside(plan, cpu, lambda: ["again"]) and len(later) == 1
    fresh.binaries["tiles"] = object()  # launched before: nothing to compile
    assert not runtime.stands_aside(fresh, cpu, list) and len(later) == 1
    later[0][0].set_result(None)
    assert not runtime.stands_aside(plan, cpu, list) and not runtime.stands_aside(plan, cpu, list)
    assert not runtime.stands_aside(plan, cpu, list) and len(later) == 1  # served once: never handed over again
    assert runtime.stands_aside(failing, cpu, list)
    later[1][0].set_exception(RuntimeError("ptxas died"))
    with pytest.raises(RuntimeError, match="ptxas died"):
        runtime.stands_aside(failing, cpu, list)
    assert not runtime.stands_aside(failing, cpu, list)
    assert runtime.stands_aside(waited, cpu, list) and not started
    monkeypatch.setattr(runtime, "_background", 0)
    threading.Timer(0.2, later[2][0].set_result, (None,)).start()
    start = time.perf_counter()
    assert not runtime.stands_aside(waited, cpu, list)  # out of background mode: waits for the compile
    assert time.perf_counter() - start >= 0.15 and started == [True] and waited.later is runtime.LAUNCHED


def test_a_stand_in_captured_into_a_graph_other_than_sdpatchs_is_warned_about_once(monkeypatch, caplog):
    """SDPA standing in while a foreign CUDA graph captures (a user's torch.cuda.graph after a warm-up
    that started the compiles) stays in that graph: one warning says to wait for the kernels first.
    sdpatch's own captures (for_capture) are captured again, and say nothing."""
    from sdpatch.kernels import forward, runtime

    monkeypatch.setattr(forward, "_captured_stand_in", False)
    monkeypatch.setattr(runtime, "capturing", lambda device: True)
    q, k, v = make_qkv(1, 2, 8, 8, 16, torch.float32)
    with caplog.at_level("WARNING", logger="sdpatch.kernels.forward"):
        with forward.for_capture():
            forward.stand_in(q, k, v, 0.25)
        assert not caplog.records
        for _ in range(2):
            out, _ = forward.stand_in(q, k, v, 0.25)
    assert [r.message for r in caplog.records if "wait_for_kernels" in r.message] == [caplog.records[0].message]
    assert len(caplog.records) == 1
    assert rel_err(out, torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v) < RTOL[torch.float32]


STAND_IN = [(False, "none", True), (True, "none", False), (False, "bool", False), (False, "padding", False)]


@pytest.mark.parametrize("return_lse,mask,stands_in", STAND_IN, ids=[f"{'lse' if l else 'no-lse'}-mask-{m}" for l, m, _ in STAND_IN])
def test_while_a_layout_compiles_sdpa_stands_in_for_unmasked_calls_without_the_lse(monkeypatch, return_lse, mask, stands_in):
    """flash_attn_fwd in background mode: an unmasked call that needs no log-sum-exp gets SDPA's
    result while the layout compiles (the same attention; counted), then the kernel's. A call that
    asks for the log-sum-exp, or has a mask (SDPA gives NaN where every key of a row is masked,
    sdpatch zeros), gets the kernel at once."""
    from concurrent.futures import Future

    from sdpatch.attention.naive import attention_ref
    from sdpatch.kernels import flash_fwd, forward, runtime

    later = []
    monkeypatch.setattr(runtime, "compile_later", lambda device, runs: later.append(Future()) or later[-1])
    monkeypatch.setattr(flash_fwd, "_plans", {})
    monkeypatch.setattr(runtime, "_background", 1)
    q, k, v = make_qkv(2, 3, 33, 17, 16, torch.float32)
    m = make_mask(mask, 2, 3, 33, 17, torch.float32)
    ref = attention_ref(q, k, v, scale=0.25, attn_mask=m)
    served = runtime.stood_in()
    out, lse = forward.flash_attn_fwd(q, k, v, 0.25, m, return_lse=return_lse)
    assert rel_err(out, ref) < RTOL[torch.float32] and (lse is not None) is return_lse
    assert runtime.stood_in() == served + stands_in and len(later) == stands_in
    if stands_in:
        later[0].set_result(None)
        out, _ = forward.flash_attn_fwd(q, k, v, 0.25)
        assert rel_err(out, ref) < RTOL[torch.float32] and runtime.stood_in() == served + 1
    (plan,) = flash_fwd._plans.values()  # its constexprs reach the kernel: nothing else in them
    assert set(plan.meta) <= set(flash_fwd._attn_fwd_kernel.arg_names)


def test_precompile_leaves_every_candidate_compiled(tmp_path):
    """A layout's first call compiles the autotuner's candidates at once (runtime.precompile), so
    that the autotuner finds each in the kernel's cache: one cached kernel per pruned candidate."""
    import subprocess
    import sys

    from sdpatch.kernels import runtime

    if runtime._AsyncCompileMode is None or runtime.COMPILE_THREADS < 2:
        pytest.skip("this Triton has no async compile mode, or the machine one core")
    done = subprocess.run([sys.executable, "-c", _PRECOMPILE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    candidates, cached, async_mode = done.stdout.split()
    assert async_mode == "True" and int(candidates) > 1 and cached == candidates


class _Tuned(Exception):
    """Raised by a stand-in autotuner: the launcher went to autotune."""


class _RaisingTuner:
    """A stand-in autotuner: launching it raises :class:`_Tuned`."""

    def __getitem__(self, grid):
        raise _Tuned()


SHIPPED = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 2, "num_stages": 2}  # no tuner's pick: seen only if shipped


@pytest.fixture
def shipped_table(tmp_path, monkeypatch):
    """Launchers as on an sm_90 GPU with ``tmp_path`` as the shipped tuned-tile table's folder: their
    launches recorded (consts), not run, and their autotuners raising :class:`_Tuned`. Returns
    (write the table, the recorded launches)."""
    import json

    from sdpatch.kernels import flash_bwd, flash_fwd, runtime

    monkeypatch.setattr(runtime, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(runtime, "gpu_arch", lambda device: "sm_90")
    runtime.shipped_configs.cache_clear()
    launches = []
    for module in (flash_fwd, flash_bwd):
        monkeypatch.setattr(module, "interpreting", lambda: False)
        monkeypatch.setattr(module, "launch", lambda kernel, grid, args, consts, binaries, key: launches.append(consts))
    monkeypatch.setattr(flash_fwd, "fwd_tuner", lambda kv_tma: _RaisingTuner())
    monkeypatch.setattr(flash_bwd, "bwd_tuners", lambda: (_RaisingTuner(), _RaisingTuner()))
    flash_fwd._plans.clear()
    flash_bwd._bwd_plans.clear()

    def write(table: dict) -> None:
        (tmp_path / "sm_90.json").write_text(json.dumps(table))
        runtime.shipped_configs.cache_clear()

    yield write, launches
    runtime.shipped_configs.cache_clear()
    flash_fwd._plans.clear()
    flash_bwd._bwd_plans.clear()


def _shipped_call(launcher: str, n_k: int):
    """One call of ``launcher`` at (1, 2, 64, n_k, 40) fp16, and its layout's table key."""
    from sdpatch.kernels import flash_bwd, flash_fwd

    q, k, v = make_qkv(1, 2, 64, n_k, 40, torch.float16, "bnhd")
    if launcher == "fwd":
        meta = flash_fwd.fwd_meta(q, k, v, torch.empty_like(q), 0.2, None, False, None)
        return lambda: flash_fwd.fa2_attn_fwd(q, k, v, 0.2), flash_fwd.fwd_tune_key(64, n_k, q.dtype, meta)
    lse = torch.zeros(1, 2, 64)
    do = torch.randn_like(q)
    meta = {"HEAD_DIM": 40, "BLOCK_DB": 0, "MASK_KIND": 0}
    return lambda: flash_bwd.flash_attn_bwd(do, q, k, v, q, lse, 0.2), flash_bwd.bwd_tune_key(64, n_k, q.dtype, meta)


@pytest.mark.parametrize("launcher", ["fwd", "bwd"])
def test_shipped_tiles_skip_the_autotuner_for_their_layout_only(shipped_table, monkeypatch, launcher):
    """A layout in the table shipped for the GPU's architecture launches its tiles with no tuning;
    another layout, or the same one on a GPU no table ships for, goes to the autotuner."""
    from sdpatch.kernels import flash_bwd, flash_fwd, runtime

    write, launches = shipped_table
    call, key = _shipped_call(launcher, 77)
    write({launcher: {key: SHIPPED if launcher == "fwd" else [SHIPPED, SHIPPED]}})
    call()
    assert launches and all(c["BLOCK_M"] == SHIPPED["BLOCK_M"] and c["num_warps"] == 2 for c in launches if "BLOCK_M" in c)
    other, _ = _shipped_call(launcher, 50)
    with pytest.raises(_Tuned):
        other()
    monkeypatch.setattr(runtime, "gpu_arch", lambda device: "sm_80")
    flash_fwd._plans.clear()
    flash_bwd._bwd_plans.clear()
    with pytest.raises(_Tuned):
        call()


@pytest.mark.parametrize("launcher", ["fwd", "bwd"])
def test_shipped_tiles_that_do_not_fit_fall_back_to_autotuning(shipped_table, monkeypatch, launcher, caplog):
    """Shipped tiles that run out of shared memory (another Triton may pipeline them differently)
    are dropped with a warning, and the layout is tuned as if none had shipped."""
    from triton.runtime.errors import OutOfResources

    from sdpatch.kernels import flash_bwd, flash_fwd

    write, _ = shipped_table
    call, key = _shipped_call(launcher, 77)
    write({launcher: {key: SHIPPED if launcher == "fwd" else [SHIPPED, SHIPPED]}})

    def out_of_resources(*args):
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(flash_fwd if launcher == "fwd" else flash_bwd, "launch", out_of_resources)
    with pytest.raises(_Tuned):
        call()
    assert "do not fit this GPU" in caplog.text


def test_the_shipped_tables_hold_tiles_the_autotuners_offer():
    """Every shipped tile is one of its kernel's autotune candidates, keyed as the launchers look up."""
    import json

    from sdpatch.kernels import flash_bwd, flash_fwd, runtime

    def tiles(configs):
        return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in configs]

    fwd = tiles(flash_fwd.fwd_configs(False) + flash_fwd.fwd_configs(True))
    dkdv, dq = tiles(flash_bwd._dkdv_configs()), tiles(flash_bwd._dq_configs())
    tables = list(runtime.TUNED_DIR.glob("sm_*.json"))
    assert tables
    for path in tables:
        table = json.loads(path.read_text())
        for key, tile in table["fwd"].items():
            assert len(key.split("|")) == 7 and tile in fwd, (path.name, key)
        for key, (a, b) in table["bwd"].items():
            assert len(key.split("|")) == 6 and a in dkdv and b in dq, (path.name, key)


def test_head_dim_parts():
    from sdpatch.kernels.shared import NO_MASK, head_dim_parts, tiling

    assert [head_dim_parts(d) for d in (40, 64, 80, 160, 24, 1, 256, 72)] == [
        (64, 0), (64, 0), (64, 16), (128, 32), (32, 0), (16, 0), (256, 0), (64, 16)
    ]
    assert head_dim_parts(40, True) == (32, 16) and head_dim_parts(160, False) == (256, 0)
    # The backward also splits where part B is half of part A; a launch only on aligned, unmasked,
    # whole 128-row blocks (tiling).
    assert [head_dim_parts(d, backward=True) for d in (40, 64, 80, 160, 24, 96)] == [
        (32, 16), (64, 0), (64, 16), (128, 32), (32, 0), (64, 32)
    ]
    assert tiling(40, None, 8, NO_MASK, 4096, 4096, backward=True) == (32, 16)
    assert tiling(40, None, 8, NO_MASK, 4096, 4096) == (64, 0)
    assert tiling(40, None, 8, NO_MASK, 4096, 77, backward=True) == (64, 0)
    assert tiling(40, None, 1, NO_MASK, 4096, 4096, backward=True) == (64, 0)


@pytest.mark.parametrize(
    "D,dtype,layout,expect",
    [
        (64, "fp16", "contiguous", 16),  # Triton proves this alone; the hint must not claim less
        (40, "fp16", "bnhd", 8),  # rows of 80 bytes: 16-byte aligned, not 16-element
        (40, "fp32", "contiguous", 4),
        (40, "fp16", "sliced", 1),  # starts 6 bytes into its buffer: no alignment to claim
    ],
)
def test_vector_align(D, dtype, layout, expect):
    from sdpatch.kernels.runtime import vector_align

    assert vector_align(*make_qkv(2, 4, 33, 33, D, DT[dtype], layout)) == expect


def test_launch_plans_follow_the_layout():
    """A launch plan (constexprs, tuned tiles) is reused only by calls of the same layout:
    same shapes and strides but rows that start misaligned get their own plan, and no hints."""
    from sdpatch.kernels import flash_fwd
    from sdpatch.kernels.shared import plan_key

    base = torch.randn(1, 2, 33, 48, generator=torch.Generator().manual_seed(0))
    aligned, shifted = base[..., :40], base[..., 3:43]  # rows 16-byte aligned / 12 bytes off
    assert aligned.shape == shifted.shape and aligned.stride() == shifted.stride()
    for _ in range(2):  # the second round runs on the plans the first one made
        for q in (aligned, shifted):
            out, _ = flash_fwd.fa2_attn_fwd(q, q, q, 0.1)
            assert rel_err(out, attention_ref(q, q, q, scale=0.1)) <= RTOL[torch.float32]
    plans = [flash_fwd._plans[plan_key(q, q, q, None, 0.1, False, None, None)] for q in (aligned, shifted)]
    assert plans[0].meta["ALIGN"] == 4 and plans[1].meta["ALIGN"] == 1


def test_a_layout_seen_before_launches_from_its_plan(monkeypatch):
    """The second call of a layout reuses its plan's launch (grid, scalars, constexprs) with the
    new call's tensors, working none of it out again: new data, the answers a first call gives."""
    from sdpatch.kernels import flash_fwd
    from sdpatch.kernels.shared import LOG2E, plan_key

    q, k, v = make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=11)
    flash_fwd.fa2_attn_fwd(q, k, v, 0.3, return_lse=True)
    plan = flash_fwd._plans[plan_key(q, k, v, None, 0.3, True, None, None)]
    assert plan.tuned is not None
    q2, k2, v2 = make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=12)
    assert q2.stride() == q.stride() and k2.stride() == k.stride()
    monkeypatch.setattr(flash_fwd, "fwd_scalars", lambda *a: pytest.fail("scalars worked out again"))
    monkeypatch.setattr(flash_fwd, "fwd_meta", lambda *a: pytest.fail("constexprs worked out again"))
    out, lse = flash_fwd.fa2_attn_fwd(q2, k2, v2, 0.3, return_lse=True)
    assert rel_err(out, attention_ref(q2, k2, v2, scale=0.3)) <= RTOL[torch.float16]
    s = (q2.double() @ k2.double().transpose(-1, -2)) * 0.3
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1) * LOG2E, atol=1e-3)


@pytest.fixture
def cached_faults(fresh_faults, monkeypatch):
    """An empty fault state (conftest's ``fresh_faults``), with CPU calls cached as CUDA ones are
    (the interpreter stands in for the GPU)."""
    monkeypatch.setattr(fresh_faults, "cached", lambda q: True)
    return fresh_faults


def _spy(monkeypatch, module, name) -> list:
    """Count the calls of ``module.name``, which still runs."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_a_repeat_call_skips_validation_the_choice_and_the_plan(cached_faults, monkeypatch):
    """An eager call of a signature served before goes straight to the launch that served it: new
    data, the answers a first call gives, and none of the checks worked out again."""
    from sdpatch.attention import dispatch
    from sdpatch.kernels import flash_fwd

    q, k, v = make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=11)
    attention(q, k, v, backend="triton")
    assert len(cached_faults.repeats) == 1
    for module, name in ((dispatch, "_validate"), (dispatch, "choose_backend"), (flash_fwd, "plan_key")):
        monkeypatch.setattr(module, name, lambda *a, **kw: pytest.fail("worked out again"))
    q2, k2, v2 = make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=12)
    out = attention(q2, k2, v2, backend="triton")
    assert out.stride() == q2.stride() and rel_err(out, attention_ref(q2, k2, v2)) <= RTOL[torch.float16]


def _other_alignment(q, k, v):
    base = torch.randn(*q.shape[:3], q.shape[3] + 8, dtype=q.dtype)
    return base[..., 3:3 + q.shape[3]], k, v  # same shape and strides, rows 6 bytes off


REPEAT_MISSES = [
    pytest.param(lambda q, k, v: (q.requires_grad_(), k, v), {}, id="needs-grad"),
    pytest.param(lambda q, k, v: (q, k, v), {"attn_mask": torch.ones(37, 21, dtype=torch.bool)}, id="mask"),
    pytest.param(lambda q, k, v: (q, k, v), {"scale": 0.2}, id="other-scale"),
    pytest.param(lambda q, k, v: (q, k, v), {"backend": "auto"}, id="other-backend"),
    pytest.param(lambda q, k, v: (q.contiguous(), k, v), {}, id="other-strides"),
    pytest.param(_other_alignment, {}, id="other-alignment"),
    pytest.param(lambda q, k, v: (q.float(), k.float(), v.float()), {}, id="other-dtype"),
    pytest.param(lambda q, k, v: (q, k, v), {"capture": True}, id="in-for_capture"),
]


@pytest.mark.parametrize("change, kwargs", REPEAT_MISSES)
def test_a_call_unlike_the_repeat_signature_takes_the_full_path(cached_faults, monkeypatch, change, kwargs):
    from sdpatch.attention import dispatch
    from sdpatch.kernels import forward

    q, k, v = make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=11)
    attention(q, k, v, backend="triton")
    validated = _spy(monkeypatch, dispatch, "_validate")
    q2, k2, v2 = change(*make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=12))
    kwargs = {"backend": "triton", **kwargs}
    with forward.for_capture() if kwargs.pop("capture", False) else contextlib.nullcontext():
        out = attention(q2, k2, v2, **kwargs)
    assert validated == [1]
    ref = attention_ref(q2, k2, v2, scale=kwargs.get("scale"), attn_mask=kwargs.get("attn_mask"))
    assert rel_err(out, ref) <= RTOL[q2.dtype]


def test_a_kernel_that_fails_on_a_repeat_call_is_remembered_and_its_repeats_forgotten(cached_faults, monkeypatch):
    from sdpatch.kernels import flash_fwd

    q, k, v = make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=11)
    attention(q, k, v, backend="triton")
    monkeypatch.setattr(flash_fwd, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("no kernel image")))
    with pytest.raises(BackendUnavailableError, match="failed to compile or launch"):
        attention(q, k, v, backend="triton")
    assert cached_faults.repeats == {}
    with pytest.raises(BackendUnavailableError, match="failed here before"):
        attention(q, k, v, backend="triton")


def test_out_of_memory_on_a_repeat_call_is_retried_on_chunked(cached_faults, monkeypatch):
    from sdpatch.kernels import flash_fwd

    q, k, v = make_qkv(1, 2, 37, 21, 40, torch.float16, "bnhd", seed=11)
    attention(q, k, v, backend="triton")
    monkeypatch.setattr(flash_fwd, "launch", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
    events = []
    out = attention(q, k, v, backend="triton", on_fallback=events.append)
    assert rel_err(out, attention_ref(q, k, v)) <= RTOL[torch.float16]
    assert [e.backend for e in events] == ["triton"] and len(cached_faults.repeats) == 1


class _Compiled:
    """Stands in for Triton's CompiledKernel: records launches through its C launcher (``run``)
    and through its runner (``compiled[grid](*args)``)."""

    function, packed_metadata = 0xF00, (4, 1, 0)

    def __init__(self, calls, refuse=False):
        self.calls, self.refuse = calls, refuse

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        if self.refuse:
            raise TypeError("launcher wants other arguments")
        assert (function, metadata, launch_metadata, enter_hook, exit_hook) == (0xF00, (4, 1, 0), None, None, None)
        self.calls.append(("binary", (gx, gy, gz), stream, args))

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("runner", grid, args))


class _Kernel:
    arg_names = ["X", "N", "BLOCK", "FLAG"]

    def __init__(self, compiled):
        self.compiled = compiled

    def __getitem__(self, grid):
        def run(*args, **consts):
            self.compiled.calls.append(("jit", grid, args, consts))
            return self.compiled
        return run


@pytest.fixture
def direct_launch(monkeypatch):
    """Direct launches on, as on a CUDA device with triton >= 3.3; device 3's stream is 0x5EA."""
    from sdpatch.kernels import runtime

    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    monkeypatch.setattr(runtime, "_DIRECT_LAUNCH", True)
    monkeypatch.setattr(runtime, "current_device_and_stream", lambda: (3, {3: 0x5EA}.get))
    return runtime


def test_launch_goes_to_the_binary_after_the_first_call(direct_launch):
    """After its first launch of a key through Triton's JIT, :func:`launch` calls the compiled
    binary's C launcher with every parameter in order, constexprs included, on the current stream
    of the device it was first launched on, and no launch hooks; a launcher that refuses that
    list turns direct launches off and goes back to the JIT."""
    runtime = direct_launch
    calls = []
    binaries = {}
    consts = {"FLAG": True, "BLOCK": 16, "num_warps": 4}
    for _ in range(2):
        runtime.launch(_Kernel(_Compiled(calls)), (2, 1, 1), ("x", 7), consts, binaries, "key")
    assert calls == [("jit", (2, 1, 1), ("x", 7), consts), ("binary", (2, 1, 1), 0x5EA, ("x", 7, 16, True))]

    calls.clear()
    refusing = {"key": runtime.Binary(_Compiled(calls, refuse=True), (16, True))}
    runtime.launch(_Kernel(_Compiled(calls)), (1, 1, 1), ("x", 7), consts, refusing, "key")
    assert calls == [("jit", (1, 1, 1), ("x", 7), consts)] and not runtime._DIRECT_LAUNCH


def test_binary_launches_pass_tensors_as_addresses(direct_launch):
    """The C launcher gets each tensor argument as its address, so that it does not ask the driver
    about it again every launch; other arguments (None, scalars, descriptors) pass unchanged."""
    runtime = direct_launch
    calls, binaries = [], {}
    x, y = torch.zeros(4), torch.ones(2)
    kernel = _Kernel(_Compiled(calls))
    kernel.arg_names = ["X", "M", "Y", "N", "BLOCK", "FLAG"]
    for _ in range(2):
        runtime.launch(kernel, (1, 1, 1), (x, None, y, 7), {"BLOCK": 16, "FLAG": True}, binaries, "key")
    assert calls[-1] == ("binary", (1, 1, 1), 0x5EA, (x.data_ptr(), None, y.data_ptr(), 7, 16, True))


class _DescriptorRunner:
    """Stands in for Triton 3.5-3.6's runner of a kernel with descriptor arguments: its ``launch``
    wraps the C launcher (``raw``) in a closure over the descriptors' slots and metadata."""

    launch_cooperative_grid, launch_pdl, profile_scratch_size = False, True, 0

    def __init__(self, raw, indices: set, metas: list, scratch: int = 0):
        launcher, tensordesc_indices, tensordesc_meta = raw, indices, metas
        self.global_scratch_size = scratch

        def inner(*args):  # Triton's wrapper encodes here; the binary must not call it
            raise AssertionError((launcher, tensordesc_indices, tensordesc_meta))

        self.launch = inner


class _DescriptorCompiled(_Compiled):
    def __init__(self, calls, runner):
        super().__init__(calls)
        self.run = runner


@pytest.fixture
def descriptor_wrapper(monkeypatch):
    """Triton 3.5-3.6's launcher layout, with an encoding that records what it encodes."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    encoded = []

    def encode(desc, meta):
        encoded.append((desc.base.data_ptr(), meta))
        return [("map", desc.base.data_ptr(), meta), *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOO", raising=False)
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode, raising=False)
    return encoded


def test_a_binary_encodes_each_descriptor_once_per_address(direct_launch, descriptor_wrapper):
    """Where Triton's launcher wraps its C launcher to encode every tensor descriptor on every launch
    (Triton 3.5-3.6), a binary calls the C launcher itself with the same arguments, each descriptor's
    encoding made once per slot, address, padding, shape and strides."""
    from sdpatch.kernels.flash_fwd_hopper import BoundDescriptor

    runtime, encoded = direct_launch, descriptor_wrapper
    launched = []
    runner = _DescriptorRunner(lambda *args: launched.append(args), {0, 2}, [{"swizzle": 128}, {"swizzle": 32}])
    x, a, b, c = torch.zeros(4), torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(2, 8)

    def desc(t):
        return BoundDescriptor(t, list(t.shape), list(t.stride()))

    binary = runtime.Binary(_DescriptorCompiled([], runner), (16, True), (desc(a), x, desc(b), 7))
    for first in (a, a, c):
        binary((3, 1, 1), (desc(first), x, desc(b), 7))
    base = (3, 1, 1, 0x5EA, 0xF00, False, True, None, None, (4, 1, 0), None, None, None)
    assert encoded == [(a.data_ptr(), {"swizzle": 128}), (b.data_ptr(), {"swizzle": 32}), (c.data_ptr(), {"swizzle": 128})]
    assert launched[-1] == (*base, ("map", c.data_ptr(), {"swizzle": 128}), 2, 8, 8, 1, x.data_ptr(),
                            ("map", b.data_ptr(), {"swizzle": 32}), 2, 4, 4, 1, 7, 16, True)
    assert launched[0][13] is launched[1][13] and len(launched) == 3  # the same encoding, reused


@pytest.mark.parametrize("runner", ["no wrapper", "scratch memory"])
def test_other_launchers_keep_tritons_encoding(direct_launch, descriptor_wrapper, runner):
    """A launcher without that wrapper, or one that takes scratch memory, is called as before."""
    calls = []
    compiled = _Compiled(calls) if runner == "no wrapper" else _DescriptorCompiled(calls, _DescriptorRunner(None, {0}, [{}], scratch=64))
    assert direct_launch.Binary(compiled, ()).encoded is None


def test_hooked_launches_go_through_tritons_runner(direct_launch, monkeypatch):
    """With a launch hook registered (a profiler such as proton), the binary is launched through
    Triton's runner, which calls the hooks, instead of straight through its C launcher."""
    runtime = direct_launch
    calls = []
    binary = runtime.Binary(_Compiled(calls), (16, True))
    monkeypatch.setattr(runtime, "launch_hooked", lambda: True)
    runtime.launch(_Kernel(_Compiled(calls)), (2, 1, 1), ("x", 7), {}, {"key": binary}, "key")
    assert calls == [("runner", (2, 1, 1), ("x", 7, 16, True))]


def test_launch_hooks_are_seen():
    """:func:`launch_hooked` notices a hook added the way proton adds its own, and its removal."""
    from sdpatch.kernels import runtime

    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this triton's launch hook is a plain attribute")
    assert not runtime.launch_hooked()
    hook = lambda metadata: None  # noqa: E731
    chain.add(hook)
    try:
        assert runtime.launch_hooked()
    finally:
        chain.remove(hook)
    assert not runtime.launch_hooked()


@pytest.mark.parametrize("n_q,n_k,expect", [(16384, 16384, True), (4096, 4096, False), (65536, 77, False)],
                         ids=["16384", "4096", "65536x77"])
def test_kv_tma_by_default_on_long_kernels(monkeypatch, n_q, n_k, expect):
    """Where the GPU allows TMA, the launcher takes it only where the kernel gains more than the
    descriptors cost the host: SD 1.5's 16,384-token self-attention, not 4096 tokens or 77 keys."""
    from sdpatch.kernels import flash_fwd

    monkeypatch.setattr(flash_fwd, "interpreting", lambda: False)
    monkeypatch.setattr(flash_fwd, "kv_tma_ok", lambda k, v: True)
    # (2, 8, ., ., 40): SD 1.5's first level; expanded views, as only shapes and strides count.
    q = torch.empty(1, 1, 1, 40, dtype=torch.float16).expand(2, 8, n_q, 40)
    k = v = torch.empty(1, 1, 1, 40, dtype=torch.float16).expand(2, 8, n_k, 40)
    assert flash_fwd.fwd_meta(q, k, v, q, 40**-0.5, None, False, None)["KV_TMA"] is expect
    assert flash_fwd.fwd_meta(q, k, v, q, 40**-0.5, None, False, None, kv_tma=False)["KV_TMA"] is False
