"""Gradients of sdpatch.attention (triton through the interpreter, chunked) against float64."""

from __future__ import annotations

import pytest
import torch

from helpers import DT, RTOL, case, make_mask, make_qkv, rel_err
from sdpatch import attention
from sdpatch.attention.naive import attention_ref


GRAD_CASES = [
    case(2, 2, 33, 33, 40, "fp32"),
    case(1, 2, 97, 77, 40, "fp16", layout="bnhd"),  # cross-attention on CLIP's 77 tokens
    case(1, 1, 31, 31, 80, "bf16", "bool"),
    case(1, 1, 17, 23, 160, "fp32", "additive", "sliced"),
    case(2, 1, 20, 77, 64, "fp16", "padding"),
    case(1, 1, 1, 5, 8, "fp32", "bool"),
    case(1, 1, 6, 1, 1, "fp32"),
]


def check_grads(backend, B, H, Nq, Nk, D, dtype, mask_kind, layout, **kw):
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Nq, Nk, D, dtype, layout, seed=3))
    mask = make_mask(mask_kind, B, H, Nq, Nk, dtype)
    do = torch.randn(B, H, Nq, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    grads = torch.autograd.grad(attention(q, k, v, attn_mask=mask, backend=backend, **kw), (q, k, v), do)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, attn_mask=mask), (q64, k64, v64), do.double())
    for name, g, r, t in zip("qkv", grads, ref, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert rel_err(g, r) <= RTOL[dtype], f"d{name}"


@pytest.mark.parametrize("B,H,Nq,Nk,D,dtype,mask,layout", GRAD_CASES)
@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_grads_match_float64(backend, B, H, Nq, Nk, D, dtype, mask, layout):
    check_grads(backend, B, H, Nq, Nk, D, dtype, mask, layout)


@pytest.mark.parametrize("budget", [1, 3000, 10**9], ids=lambda b: f"budget{b}")
def test_chunked_backward_any_budget(budget):
    check_grads("chunked", 2, 3, 29, 19, 16, torch.float32, "bool", "bnhd", chunk_budget=budget)


def test_mask_takes_no_gradient():
    q, k, v = make_qkv(1, 1, 4, 4, 8, torch.float32)
    bias = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="takes no gradient"):
        attention(q, k, v, attn_mask=bias)


@pytest.mark.parametrize("split", [False, True], ids=["one-tile", "two-tiles"])
@pytest.mark.parametrize("D,mask_kind", [(40, "bool"), (80, "none"), (160, "additive")])
def test_triton_backward_head_dim_tilings_agree(D, mask_kind, split):
    """The backward kernels are exact with the head dim as one padded tile or as two parts."""
    from sdpatch.kernels.flash_bwd import flash_attn_bwd
    from sdpatch.kernels.forward import flash_attn_fwd

    q, k, v = make_qkv(1, 2, 17, 19, D, torch.float16, "bnhd", seed=5)
    mask = make_mask(mask_kind, 1, 2, 17, 19, torch.float16)
    if mask is not None:  # the kernels take 4-D masks; attention() adds the leading dims
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    scale = D**-0.5
    out, lse = flash_attn_fwd(q, k, v, scale, mask, return_lse=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(q.dtype)
    grads = flash_attn_bwd(do, q, k, v, out, lse, scale, mask, split_head_dim=split)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, attn_mask=mask), (q64, k64, v64), do.double())
    for name, g, r in zip("qkv", grads, ref):
        assert rel_err(g, r) <= RTOL[torch.float16], f"d{name}"


@pytest.mark.parametrize("splits", [1, 3, 10], ids=lambda s: f"splits{s}")
def test_triton_backward_query_splits_agree(splits):
    """dK and dV are the same whether one program per key block walks every query block or
    several share them out (10 splits of 7 query blocks leave some splits empty)."""
    from sdpatch.kernels.flash_bwd import flash_attn_bwd
    from sdpatch.kernels.forward import flash_attn_fwd

    q, k, v = make_qkv(2, 2, 97, 77, 40, torch.float16, "bnhd", seed=7)
    mask = make_mask("padding", 2, 2, 97, 77, torch.float16)
    out, lse = flash_attn_fwd(q, k, v, 40**-0.5, mask, return_lse=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(q.dtype)
    grads = flash_attn_bwd(do, q, k, v, out, lse, 40**-0.5, mask, query_splits=splits)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, attn_mask=mask), (q64, k64, v64), do.double())
    for name, g, r, t in zip("qkv", grads, ref, (q, k, v)):
        assert g.dtype == t.dtype and g.stride() == t.stride(), name
        assert rel_err(g, r) <= RTOL[torch.float16], f"d{name}"


def test_default_query_splits_fill_the_gpu_only_when_keys_are_few(monkeypatch):
    from sdpatch.kernels import flash_bwd

    monkeypatch.setattr(flash_bwd, "sm_count", lambda device: 132)  # an H200
    cuda = torch.device("cuda", 0)
    assert flash_bwd.default_query_splits(4096, 77, 16, cuda) == 8  # 32 programs -> 256
    assert flash_bwd.default_query_splits(4096, 4096, 16, cuda) == 1  # 1024 programs already
    assert flash_bwd.default_query_splits(300, 77, 1, cuda) == 3  # at least 128 queries a split
    assert flash_bwd.default_query_splits(256, 77, 16, cuda) == 1  # host-bound: no partial-sum launch
    assert flash_bwd.default_query_splits(4096, 77, 16, torch.device("cpu")) == 1


def test_backward_plans_follow_the_layout():
    """Backward launch plans, like the forward's, are reused only by calls of the same layout: rows
    that start misaligned get their own plan and no alignment hints, and each call stays exact."""
    from sdpatch.kernels import flash_bwd

    base = torch.randn(1, 2, 33, 48, generator=torch.Generator().manual_seed(0))
    aligned, shifted = base[..., :40], base[..., 3:43]
    for _ in range(2):  # the second round runs on the plans the first one made
        for view in (aligned, shifted):
            t = view.detach().requires_grad_()
            do = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
            got = torch.autograd.grad(attention(t, t, t, scale=0.1, backend="triton"), t, do)[0]
            t64 = t.detach().double().requires_grad_()
            ref = torch.autograd.grad(attention_ref(t64, t64, t64, scale=0.1), t64, do.double())[0]
            assert rel_err(got, ref) <= RTOL[torch.float32]
    aligns = {plan.meta["ALIGN"] for key, plan in flash_bwd._bwd_plans.items() if key[1] == (1, 2, 33, 40)}
    assert aligns == {4, 1}


def test_triton_backward_layout_seen_before_reuses_its_launch(monkeypatch):
    """A layout's second backward reuses its plan's launches (grids, strides, constexprs) with the
    new call's tensors, mask and query splits included, working none of it out again: the
    gradients are those of the new data."""
    from sdpatch.kernels import flash_bwd
    from sdpatch.kernels.forward import flash_attn_fwd

    for seed in (13, 14):
        if seed == 14:
            monkeypatch.setattr(flash_bwd, "_bwd_scalars", lambda *a: pytest.fail("scalars worked out again"))
        q, k, v = make_qkv(2, 2, 37, 21, 40, torch.float16, "bnhd", seed=seed)
        mask = make_mask("padding", 2, 2, 37, 21, torch.float16)
        out, lse = flash_attn_fwd(q, k, v, 0.2, mask, return_lse=True)
        do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q.dtype)
        grads = flash_bwd.flash_attn_bwd(do, q, k, v, out, lse, 0.2, mask, query_splits=2)
        plans = [p for p in flash_bwd._bwd_plans.values() if p.splits == 2 and p.meta["HEAD_DIM"] == 40]
        assert plans and all(p.tuned is not None for p in plans)

        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(attention_ref(q64, k64, v64, scale=0.2, attn_mask=mask), (q64, k64, v64), do.double())
        for name, g, r in zip("qkv", grads, ref):
            assert rel_err(g, r) <= RTOL[torch.float16], f"d{name}, seed {seed}"


def test_autotuned_tiles_divide_128():
    """On a layout's first call the launchers set EVEN_M / EVEN_N from the lengths modulo 128, before
    the autotuner has picked a tile: right only while every candidate tile divides 128."""
    from sdpatch.kernels.flash_bwd import _dkdv_configs, _dq_configs
    from sdpatch.kernels.flash_fwd import fwd_configs

    for c in fwd_configs(False) + fwd_configs(True) + _dkdv_configs() + _dq_configs():
        assert 128 % c.kwargs["BLOCK_M"] == 0 and 128 % c.kwargs["BLOCK_N"] == 0, c


def test_triton_backward_tails_with_every_score_far_below_zero():
    """Key and query tails (19 keys, 17 queries: not whole 16-row blocks) where every score is about
    -1000: the log-sum-exp is then so negative that exp2(0 - lse) on a padded key overflows, so
    the dQ kernel must still mask the key tail, and the dK/dV kernel's padded rows must stay its own."""
    from sdpatch.kernels.flash_bwd import flash_attn_bwd
    from sdpatch.kernels.forward import flash_attn_fwd

    g = torch.Generator().manual_seed(9)
    u = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)
    # Scores -1000 +- a few: q . k = -4000 + q . k_perp, with the keys' spread orthogonal to u (a
    # spread along u would make the scores span hundreds); their common -10 u cancels out of dq.
    k_perp = torch.randn(1, 2, 19, 16, generator=g)
    k_perp -= (k_perp @ u)[..., None] * u
    q = (400 * u + torch.randn(1, 2, 17, 16, generator=g)).half()
    k = (-10 * u + k_perp).half()
    v = torch.randn(1, 2, 19, 16, generator=g).half()
    out, lse = flash_attn_fwd(q, k, v, 0.25, return_lse=True)
    assert lse.max() < -1000  # base 2: exp2(-lse) is inf in fp32
    do = torch.randn(q.shape, generator=g).half()
    grads = flash_attn_bwd(do, q, k, v, out, lse, 0.25)

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, scale=0.25), (q64, k64, v64), do.double())
    for name, got, want in zip("qkv", grads, ref):
        assert torch.isfinite(got).all(), f"d{name}"
        assert rel_err(got, want) <= RTOL[torch.float16], f"d{name}"


def one_live_key_mask(kind: str, Nq: int, Nk: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A mask under which the even query rows see one key only (key r % Nk) and the odd ones see
    every key, and the (Nq,) flags of the rows with one live key; Nk = 1: no mask, every row."""
    rows = torch.arange(Nq)
    if Nk == 1:
        return None, torch.ones(Nq, dtype=torch.bool)
    single = rows % 2 == 0
    keep = torch.ones(Nq, Nk, dtype=torch.bool)
    keep[single] = torch.nn.functional.one_hot(rows[single] % Nk, Nk).bool()
    mask = keep if kind == "bool" else torch.zeros(Nq, Nk).masked_fill(~keep, float("-inf")).to(dtype)
    return mask, single


# Keys live for a query row: with one, dS = P * (dP - delta) is 0, so the row's dQ and its share
# of dK are exactly 0 (as PyTorch's are); the other rows and dV are held to the usual budget.
ONE_KEY_CASES = [
    pytest.param(1, 2, 6, 1, 40, dtype, "none", id=f"N6x1-D40-{name}") for name, dtype in DT.items() if name != "fp64"
] + [
    pytest.param(2, 1, 20, 1, 80, torch.float32, "none", id="B2-N20x1-D80-fp32"),  # a query tail; two head-dim tiles
    pytest.param(1, 2, 9, 5, 16, torch.float32, "bool", id="N9x5-D16-fp32-bool"),
    pytest.param(1, 1, 9, 12, 40, torch.float16, "additive", id="N9x12-D40-fp16-additive"),
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,dtype,mask_kind", ONE_KEY_CASES)
@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_rows_with_one_live_key_get_exact_zero_gradients(backend, B, H, Nq, Nk, D, dtype, mask_kind):
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Nq, Nk, D, dtype, seed=11))
    mask, single = one_live_key_mask(mask_kind, Nq, Nk, dtype)
    do = torch.randn(B, H, Nq, D, generator=torch.Generator().manual_seed(12)).to(dtype)

    def grads(do):
        return torch.autograd.grad(attention(q, k, v, attn_mask=mask, backend=backend), (q, k, v), do)

    dq, dk, dv = grads(do)
    assert torch.all(dq[:, :, single] == 0)
    # The rows with one key add exactly nothing to dK: it is, to the bit, dK without their dO.
    assert torch.equal(dk, grads(do * (~single).to(dtype)[:, None])[1])

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, attn_mask=mask), (q64, k64, v64), do.double())
    for name, g, r in zip("qkv", (dq, dk, dv), ref):
        assert rel_err(g, r) <= RTOL[dtype], f"d{name}"


def test_every_key_tile_holds_the_one_block_keys():
    """The kernels take a row's keys as one block up to ONE_BLOCK_KEYS keys: right only while
    every tile (the interpreter's too) has at least that many keys."""
    from sdpatch.kernels.flash_bwd import _INTERPRET_CONFIG, ONE_BLOCK_KEYS, _dkdv_configs, _dq_configs

    assert _INTERPRET_CONFIG["BLOCK_N"] >= ONE_BLOCK_KEYS
    for c in _dkdv_configs() + _dq_configs():
        assert c.kwargs["BLOCK_N"] >= ONE_BLOCK_KEYS, c
