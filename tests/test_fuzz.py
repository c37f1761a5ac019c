"""Property-based fuzzing of sdpatch.attention against the float64 reference (hypothesis).

hypothesis draws shapes, memory layouts, dtypes, masks, scales and chunk budgets, and every case
is checked against ``attention_ref`` within the error budget ``RTOL`` of test_attention. Runs are
derandomized, so CI sees the same 600 generated cases every time, in about a minute on 2 cores.

Triton runs through the CPU interpreter, whose cost grows with the number of 16 x 16 tiles it
visits; its cases keep B * H * ceil(Nq / 16) * ceil(Nk / 16) <= TRITON_TILES.
"""

from __future__ import annotations

import importlib
import math
from contextlib import nullcontext
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

chunked_module = importlib.import_module("sdpatch.attention.chunked")
from helpers import RTOL, rel_err
from sdpatch import attention
from sdpatch.attention.naive import attention_ref

FUZZ = settings(
    derandomize=True,  # a fixed seed: the same cases on every run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TRITON_TILES = 20
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
NEG_INF = float("-inf")


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- building a case's tensors --------------------------------------------------------------


def lay_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (B, H, N, D) in a given memory layout: the views diffusers and users hand over.

    The broadcast layouts share one slice across batch or heads, so their values differ from t's.
    """
    B, H, N, D = t.shape
    if layout == "contiguous":
        return t.contiguous()
    if layout == "bnhd":  # diffusers: a (B, N, H, D) buffer viewed as (B, H, N, D)
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "dn":  # head dim not unit-stride
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    if layout == "sliced":  # every other head of a buffer with a wider head dim
        buf = t.new_full((B, 2 * H, N, D + 3), float("nan"))  # NaN: a read outside the view shows
        buf[:, ::2, :, 1 : D + 1] = t
        return buf[:, ::2, :, 1 : D + 1]
    if layout == "bcast_b":  # stride 0 along batch
        return t[:1].expand(B, H, N, D)
    if layout == "bcast_h":  # stride 0 along heads
        return t[:, :1].expand(B, H, N, D)
    if layout == "ones":  # what out.sum().backward() passes as dO: all strides 0
        return t.new_ones(()).expand(B, H, N, D)
    raise ValueError(layout)


QKV_LAYOUTS = ["contiguous", "bnhd", "dn", "sliced", "bcast_b", "bcast_h"]
DO_LAYOUTS = ["contiguous", "bnhd", "ones"]


@dataclass(frozen=True)
class Mask:
    """A random mask, broadcastable to (B, H, Nq, Nk)."""

    kind: str  # "bool" (True = attend) or "additive"
    shape: tuple[int, ...]  # rank 0..4, size-1 dims broadcast
    dtype: torch.dtype  # the additive mask's dtype
    keep: float  # share of keys attended to
    dead: float  # share of query rows with every key masked out
    pad: bool  # additive: masked keys get diffusers' finite -1e4, not -inf (dead rows stay -inf)
    layout: str  # "contiguous", "t" (stored transposed), "sliced", "expanded" (full size, stride 0)

    def build(self, g: torch.Generator, full: tuple[int, ...]) -> torch.Tensor:
        keep = torch.rand(self.shape, generator=g) < self.keep
        row_shape = (*self.shape[:-1], 1) if self.shape else ()
        keep &= torch.rand(row_shape, generator=g) >= self.dead
        if self.kind == "bool":
            m = keep
        else:
            dead = ~keep.any(-1, keepdim=True) if self.shape else ~keep
            m = torch.randn(self.shape, generator=g).masked_fill(~keep, -1e4 if self.pad else NEG_INF)
            m = m.masked_fill(dead, NEG_INF).to(self.dtype)
        if self.layout == "t" and m.ndim >= 2:
            m = m.transpose(-1, -2).contiguous().transpose(-1, -2)
        elif self.layout == "sliced" and m.ndim >= 1:
            buf = m.new_zeros((*m.shape[:-1], 2 * m.shape[-1]))
            buf[..., ::2] = m
            m = buf[..., ::2]
        elif self.layout == "expanded":
            m = m.expand(full)
        return m


def dead_rows(mask: torch.Tensor | None, full: tuple[int, ...]) -> torch.Tensor:
    """(B, H, Nq) flags of query rows with every key masked out, from the mask alone."""
    if mask is None:
        return torch.zeros(full[:3], dtype=torch.bool)
    m = mask.expand(full)
    return ~m.any(-1) if m.dtype == torch.bool else (m == NEG_INF).all(-1)


@dataclass(frozen=True)
class Case:
    backend: str
    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    dtype: torch.dtype
    layouts: tuple[str, str, str] = ("contiguous",) * 3  # q, k, v
    mask: Mask | None = None
    scale: float | None = None  # a multiple of 1 / sqrt(D); None: the default
    grads: str = ""  # which of q, k, v take gradients: "", "qkv", "q" or "kv"
    do_layout: str = "contiguous"
    budget: int | None = None  # chunked: score-buffer bytes
    # chunked: "cpu" (fp32 scores), "device" (scores in the input dtype, as on CUDA and MPS, which
    # this CPU run imitates), "upcast" (fp32 scores by request)
    scores: str = "cpu"
    seed: int = 0

    def tensors(self):
        g = torch.Generator().manual_seed(self.seed)
        shapes = [(self.B, self.H, n, self.D) for n in (self.Nq, self.Nk, self.Nk)]
        q, k, v = (lay_out(torch.randn(s, generator=g).to(self.dtype), lay) for s, lay in zip(shapes, self.layouts))
        full = (self.B, self.H, self.Nq, self.Nk)
        mask = self.mask.build(g, full) if self.mask is not None else None
        do = lay_out(torch.randn(shapes[0], generator=g).to(self.dtype), self.do_layout)
        return q, k, v, mask, do


_SCORE_DTYPE = chunked_module._score_dtype


def _device_score_dtype(dtype, device, upcast):
    # sdpatch.attention.chunked's own choice as it would be on a CUDA device.
    return _SCORE_DTYPE(dtype, torch.device("cuda"), upcast)


def run_sdpatch(case: Case, q, k, v, mask, scale):
    """sdpatch.attention on the case's backend (for chunked: its budget and score dtype)."""
    kw = {"chunk_budget": case.budget, "upcast": case.scores == "upcast"} if case.backend == "chunked" else {}
    like_device = case.scores == "device"
    with mock.patch.object(chunked_module, "_score_dtype", _device_score_dtype) if like_device else nullcontext():
        return attention(q, k, v, scale=scale, attn_mask=mask, backend=case.backend, **kw)


# -- the check ---------------------------------------------------------------------------------


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str):
    """Within the error budget of the float64 reference; NaN never passes.

    Relative error ||got - ref|| / ||ref||, except where ref is zero (every row masked, or dq at
    Nk = 1): then nothing can be relative to it, and the error is absolute.
    """
    assert got.shape == ref.shape, what
    assert not got.isnan().any(), f"{what}: NaN"
    if ref.abs().max() <= 1e-12:
        err = got.double().abs().max().item()
        assert err <= RTOL[dtype], f"{what}: |err| {err:.3g} where the reference is 0"
    else:
        err = rel_err(got, ref)
        assert err <= RTOL[dtype], f"{what}: rel err {err:.3g} > {RTOL[dtype]}"


def check(case: Case):
    """The case against the float64 reference: output, gradients, and zeros for dead rows."""
    q, k, v, mask, do = case.tensors()
    scale = None if case.scale is None else case.scale / math.sqrt(case.D)
    full = (case.B, case.H, case.Nq, case.Nk)
    dead = dead_rows(mask, full)
    # detach() keeps the view's strides
    q, k, v = (t.detach().requires_grad_(name in case.grads) for name, t in zip("qkv", (q, k, v)))

    out = run_sdpatch(case, q, k, v, mask, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = attention_ref(q.detach(), k.detach(), v.detach(), scale=scale, attn_mask=mask)
    assert_close(out, ref, case.dtype, "out")
    assert torch.all(out.detach()[dead] == 0), "fully masked rows must be zeros"
    if not case.grads:
        return

    grads = torch.autograd.grad(out, [t for t in (q, k, v) if t.requires_grad], do)
    q64, k64, v64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v))
    ref = attention_ref(q64, k64, v64, scale=scale, attn_mask=mask)
    ref_grads = torch.autograd.grad(ref, [t for t in (q64, k64, v64) if t.requires_grad], do.double())
    for name, got, want in zip(case.grads, grads, ref_grads):
        assert got.dtype == case.dtype, f"d{name}"
        assert_close(got, want, case.dtype, f"d{name}")
    if "q" in case.grads:
        assert torch.all(grads[0][dead] == 0), "fully masked rows must have zero gradients"


# -- strategies --------------------------------------------------------------------------------

SCALES = [None, 0.0, 1e-3, 0.5, 2.0, 4.0, 16.0, -1.0, -4.0]  # multiples of 1 / sqrt(D)
GRAD_SCALES = [None, 0.0, 0.5, 2.0, -1.0]


@st.composite
def masks(draw, full: tuple[int, ...], dtype: torch.dtype):
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    if kind == "none":
        return None
    rank = draw(st.integers(0, 4))
    shape = tuple(draw(st.sampled_from([n, 1])) for n in full[4 - rank :])
    return Mask(
        kind=kind,
        shape=shape,
        dtype=draw(st.sampled_from([dtype, F16, F32, F64])),
        keep=draw(st.sampled_from([1.0, 0.8, 0.3, 0.05])),
        dead=draw(st.sampled_from([0.0, 0.0, 0.25, 1.0])),
        pad=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "t", "sliced", "expanded"])),
    )


LENGTHS = st.one_of(st.sampled_from([1, 2, 16, 17, 77]), st.integers(1, 96))


@st.composite
def cases(draw, backend: str):
    if backend == "triton":
        # Tiles of 16 x 16 per (batch, head): draw the tile counts, then lengths that fill them.
        B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        tiles = TRITON_TILES // (B * H)
        mq = draw(st.integers(1, tiles))
        mk = draw(st.integers(1, tiles // mq))
        Nq, Nk = draw(st.integers(16 * mq - 15, 16 * mq)), draw(st.integers(16 * mk - 15, 16 * mk))
        D = draw(st.one_of(st.sampled_from([1, 40, 64, 80, 160, 256]), st.integers(1, 256)))
        dtype = draw(st.sampled_from([F16, BF16, F32]))
    else:
        B, H = draw(st.integers(1, 3)), draw(st.integers(1, 4))
        Nq, Nk = draw(LENGTHS), draw(LENGTHS)
        D = draw(st.one_of(st.sampled_from([1, 40, 64, 80, 160, 512]), st.integers(1, 600)))
        # CPU SDPA in fp16 is not a reference-grade path.
        dtype = draw(st.sampled_from([F32, BF16, F64] if backend == "sdpa" else [F16, BF16, F32, F64]))
    # Gradients in 3 cases of 7, sdpa aside (a comparison backend: forward only).
    grads = "" if backend == "sdpa" else draw(st.sampled_from(["", "", "", "", "qkv", "q", "kv"]))
    scores = draw(st.sampled_from(["cpu", "device", "upcast"])) if backend == "chunked" else "cpu"
    scale_choices = GRAD_SCALES if grads else SCALES
    # 16-bit scores near 50 round by up to 0.125 (bf16) or 0.016 (fp16): past the budget.
    if scores == "device" and dtype in (F16, BF16):
        scale_choices = [f for f in scale_choices if f is None or abs(f) <= 4]
    return Case(
        backend=backend,
        B=B, H=H, Nq=Nq, Nk=Nk, D=D,
        dtype=dtype,
        layouts=tuple(draw(st.sampled_from(QKV_LAYOUTS)) for _ in range(3)),
        mask=draw(masks((B, H, Nq, Nk), dtype)),
        scale=draw(st.sampled_from(scale_choices)),
        grads=grads,
        do_layout=draw(st.sampled_from(DO_LAYOUTS)),
        budget=draw(st.sampled_from([None, 1, 7, 100, 999, 4096, 65536, 10**6])) if backend == "chunked" else None,
        scores=scores,
        seed=draw(st.integers(0, 2**31)),
    )


# -- the fuzz tests ----------------------------------------------------------------------------


@settings(FUZZ, max_examples=300)
@given(cases("chunked"))
def test_fuzz_chunked(case):
    check(case)


@settings(FUZZ, max_examples=180)
@given(cases("triton"))
def test_fuzz_triton(case):
    check(case)


@settings(FUZZ, max_examples=120)
@given(cases("sdpa"))
def test_fuzz_sdpa(case):
    check(case)


# -- extreme values ----------------------------------------------------------------------------

# Backends and, for chunked, where its scores are computed (see Case.scores).
ALL_PATHS = [("chunked", "cpu"), ("chunked", "device"), ("chunked", "upcast"), ("triton", "cpu"), ("sdpa", "cpu")]


@pytest.mark.parametrize("path", ALL_PATHS, ids="-".join)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("D", [1, 40, 64, 160, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "bool"])
def test_extreme_scores(path, dtype, D, masked):
    """Scores of about +-1e4 in fp16: the output is finite (the reference always is).

    q and k are +-c, so the scores are sums of +-c^2, nearly exact in fp32; keys planted equal to
    q or -q reach +1e4 and -1e4. Where a backend keeps its scores in 16 bits (chunked on a
    device), 1e4 has an ulp of 8 or more and only finiteness can be asked; every other path
    stays within the error budget.
    """
    backend, scores = path
    Nq, Nk = 37, (29 if D % 2 else 16)  # a key tail, or whole tiles
    g = torch.Generator().manual_seed(D)
    c = 100 / D**0.25  # scale * c^2 * D = 1e4 with the default scale 1 / sqrt(D)
    q, k, v = (torch.randn(1, 2, n, D, generator=g) for n in (Nq, Nk, Nk))
    q, k = c * q.sign(), c * k.sign()
    n = min(Nq, Nk)
    k[:, :, : n // 2 + 1] = q[:, :, : n // 2 + 1]
    k[:, :, n // 2 + 1 : n] = -q[:, :, n // 2 + 1 : n]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    m = torch.rand(Nq, Nk, generator=g) > 0.3 if masked else None
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    assert s.max() > 9e3 and s.min() < -9e3

    out = run_sdpatch(Case(backend, 1, 2, Nq, Nk, D, dtype, scores=scores), q, k, v, m, None)
    ref = attention_ref(q, k, v, attn_mask=m)
    assert torch.isfinite(out).all()
    if scores != "device":
        assert_close(out, ref, dtype, "out")


@pytest.mark.parametrize("path", ALL_PATHS, ids="-".join)
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=dtype_id)
@pytest.mark.parametrize("value", [-1e5, torch.finfo(F16).min, torch.finfo(F32).min], ids=lambda x: f"{x:.3g}")
# The interpreter's numpy reports the triton kernel's bias * (1 / ln 2) overflowing to -inf at
# fp32's end; that -inf is as good as the finite value, except in the ill-conditioned row.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_huge_finite_mask_values(path, dtype, value):
    """Additive masks with finite values beyond fp16's range (or at fp32's end): never NaN.

    A row holding such a value next to ordinary ones matches the reference: exp() of it is 0.
    A row holding nothing else is ill-conditioned: the scores vanish when rounded into such a
    sum (in float64 too, at fp32's end), so backends only have to stay finite there.
    """
    backend, scores = path
    if backend == "sdpa" and dtype == F16:
        pytest.skip("CPU SDPA in fp16 is not a reference-grade path")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 24, generator=g).to(dtype) for n in (20, 19, 19))
    m = torch.randn(20, 19, generator=g)
    m[:, ::3] = value  # every third key
    m[5] = value  # a whole row
    out = run_sdpatch(Case(backend, 2, 2, 20, 19, 24, dtype, scores=scores), q, k, v, m, None)
    ref = attention_ref(q, k, v, attn_mask=m)
    assert torch.isfinite(out).all()
    ordinary = torch.arange(20) != 5
    assert_close(out[:, :, ordinary], ref[:, :, ordinary], dtype, "out")


# -- fully masked rows -------------------------------------------------------------------------

DEAD_MASKS = {
    # name: (kind, shape) with the rows to kill; every backend must give them zeros
    "bool-rows": ("bool", (2, 1, 21, 18)),
    "bool-every-row": ("bool", (21, 18)),
    "additive-rows": ("additive", (1, 3, 21, 18)),
    "additive-every-row": ("additive", (18,)),
    "bool-key-broadcast": ("bool", (2, 3, 21, 1)),
}


@pytest.mark.parametrize("name", DEAD_MASKS)
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=dtype_id)
def test_fully_masked_rows_agree(name, dtype):
    """Rows with every key masked out give zeros, and zero gradients, on every backend."""
    kind, shape = DEAD_MASKS[name]
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(shape, generator=g) > 0.3
    if "every-row" in name:
        keep[:] = False
    else:
        keep[..., ::2, :] = False  # even query rows (or, broadcast over queries, all of them)
    mask = keep if kind == "bool" else torch.zeros(shape).masked_fill(~keep, NEG_INF).to(dtype)
    full = (2, 3, 21, 18)
    dead = dead_rows(mask, full)
    assert dead.any()

    q, k, v = (torch.randn(2, 3, n, 40, generator=g).to(dtype).requires_grad_() for n in (21, 18, 18))
    outs = {}
    for backend, scores in ALL_PATHS:
        if backend == "sdpa" and dtype == F16:
            continue  # CPU SDPA in fp16 is not a reference-grade path
        out = run_sdpatch(Case(backend, *full, 40, dtype, scores=scores), q, k, v, mask, None)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert torch.all(out.detach()[dead] == 0) and torch.all(dq[dead] == 0), f"{backend}/{scores}"
        assert not any(t.isnan().any() for t in (dq, dk, dv)), f"{backend}/{scores}"
        outs[f"{backend}/{scores}"] = out.detach()
    ref = attention_ref(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    for path, out in outs.items():
        assert_close(out, ref, dtype, path)


# -- degenerate sizes --------------------------------------------------------------------------

DEGENERATE = [  # (Nq, Nk, D)
    (1, 1, 1),
    (1, 1, 64),
    (1, 77, 40),
    (77, 1, 40),
    (33, 17, 1),
    (1, 5, 1),
    (5, 1, 1),
    (1, 1, 256),
]


@pytest.mark.parametrize("Nq,Nk,D", DEGENERATE, ids=[f"Nq{a}-Nk{b}-D{c}" for a, b, c in DEGENERATE])
@pytest.mark.parametrize("backend", ["chunked", "triton", "sdpa"])
@pytest.mark.parametrize("dtype", [F16, F32], ids=dtype_id)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "bool"])
def test_degenerate_sizes(backend, dtype, Nq, Nk, D, masked):
    """Nk = 1 (the softmax is 1, so dq = 0), Nq = 1 and D = 1, forward and gradients."""
    if backend == "sdpa" and dtype == F16:
        pytest.skip("CPU SDPA in fp16 is not a reference-grade path")
    mask = Mask("bool", (1, 1, Nq, Nk), torch.bool, keep=0.7, dead=0.3, pad=False, layout="contiguous")
    grads = "" if backend == "sdpa" else "qkv"
    check(Case(backend, 2, 2, Nq, Nk, D, dtype, mask=mask if masked else None, grads=grads))
