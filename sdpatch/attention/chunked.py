"""Chunked-query attention in plain PyTorch: the fallback for every device and head dim.

The score matrix is never held whole. Queries (and, when one query row of every head is
already over budget, heads and batch entries) are processed in chunks whose score buffer
fits a byte budget. One buffer is allocated up front and reused: scores are written into it
by ``matmul(out=...)``, the softmax runs in place, and each chunk's result lands directly in
a preallocated output.

The backward pass recomputes each chunk's probabilities from the saved log-sum-exp, so
training through this path also stays within the budget instead of keeping a score matrix
per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch

from .base import Backend

DEFAULT_CHUNK_BUDGET = 256 * 2**20  # bytes of score buffer; 256 MiB keeps matmuls large on GPUs


@dataclass(frozen=True)
class ChunkPlan:
    """How a (B, H, Nq, Nk) score tensor is cut: chunks of (batch, heads, queries)."""

    batch: int
    heads: int
    queries: int

    def slices(self, B: int, H: int, Nq: int):
        for b, h, m in product(range(0, B, self.batch), range(0, H, self.heads), range(0, Nq, self.queries)):
            yield slice(b, b + self.batch), slice(h, h + self.heads), slice(m, m + self.queries)


def plan_chunks(B: int, H: int, Nq: int, row_bytes: int, budget: int) -> ChunkPlan:
    """Largest chunk of query rows whose temporaries (``row_bytes`` per row) fit ``budget``.

    Whole query rows are the unit; a single row is the floor, whatever the budget.
    """
    rows = max(1, budget // max(1, row_bytes))
    if rows >= H * Nq:
        return ChunkPlan(min(B, rows // (H * Nq)), H, Nq)
    if rows >= Nq:
        return ChunkPlan(1, rows // Nq, Nq)
    return ChunkPlan(1, 1, rows)


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """(..., Nq, 1) flags of query rows whose keys are all masked out (they get zeros)."""
    if mask.dtype == torch.bool:
        return ~mask.any(-1, keepdim=True)
    return (mask == float("-inf")).all(-1, keepdim=True)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _score_dtype(dtype: torch.dtype, device: torch.device, upcast: bool) -> torch.dtype:
    # bf16 scores (8-bit mantissa) alone cost up to 1e-2 relative error at ordinary logits, so
    # they are always fp32; fp16 holds 8x finer. CPU half matmuls are slow and lose range.
    if dtype == torch.bfloat16 or (dtype == torch.float16 and (upcast or device.type == "cpu")):
        return torch.float32
    return dtype


def _scores(q, k, scale, mask, out):
    """out <- (scale * q) @ k^T (+ mask); masked-out entries become -inf."""
    # Scaling q first: in fp16 scores the unscaled q @ k^T overflows long before the scores do
    # (scores of 1e4 at head dim 64 are 8e4 unscaled).
    torch.matmul(q.to(out.dtype) * scale, k.to(out.dtype).transpose(-1, -2), out=out)
    if mask is not None:
        if mask.dtype == torch.bool:
            torch.where(mask, out, out.new_full((), float("-inf")), out=out)  # in place: no inverted-mask temporary
        else:
            out.add_(mask)
    return out


def _mask_chunk(mask, bs, hs, ms):
    if mask is None:
        return None
    # A broadcast (size-1) dimension is indexed whole, so the slice keeps broadcasting.
    idx = tuple(slice(None) if mask.shape[i] == 1 else s for i, s in enumerate((bs, hs, ms)))
    return mask[idx]


class _Buffer:
    """One flat allocation, viewed contiguously at each chunk's shape (the last chunk may be smaller)."""

    def __init__(self, plan: ChunkPlan, Nk: int, device: torch.device, dtype: torch.dtype):
        self.flat = torch.empty(plan.batch * plan.heads * plan.queries * Nk, device=device, dtype=dtype)
        self.Nk = Nk

    def view(self, chunk: torch.Tensor) -> torch.Tensor:
        shape = (*chunk.shape[:3], self.Nk)
        return self.flat[: shape[0] * shape[1] * shape[2] * self.Nk].view(shape)


def _forward(q, k, v, scale, mask, plan, score_dtype, with_lse):
    B, H, Nq, _ = q.shape
    k, v = k.to(score_dtype), v.to(score_dtype)  # no-ops unless upcasting
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Nq, 1), device=q.device, dtype=_acc_dtype(q.dtype)) if with_lse else None
    buf = _Buffer(plan, k.shape[2], q.device, score_dtype)
    for bs, hs, ms in plan.slices(B, H, Nq):
        qc = q[bs, hs, ms]
        s = buf.view(qc)
        mc = _mask_chunk(mask, bs, hs, ms)
        _scores(qc, k[bs, hs], scale, mc, s)
        if with_lse:
            lse[bs, hs, ms] = torch.logsumexp(s, -1, keepdim=True)
        if mc is not None:
            # Rows of -inf scores (every key masked, or an additive mask beyond fp16's range
            # rounded to -inf) would softmax to NaN; they give zeros.
            dead = s.amax(-1, keepdim=True) == float("-inf")
        torch.softmax(s, -1, out=s)
        if mc is not None:
            s.masked_fill_(dead, 0.0)
        out[bs, hs, ms] = torch.matmul(s, v[bs, hs])
    return out, lse


def _backward(do, q, k, v, lse, scale, mask, budget):
    """Gradients by recomputation, chunk by chunk; the P and dP buffers share the budget.

    dS = P * (dP - delta), with delta = rowsum(P * dP) from the chunk's own P and dP (each chunk
    holds whole rows), not rowsum(dO * O) as flash attention's kernels take it: the two are equal
    in exact arithmetic, but only the first is dP itself, to the bit, in a row with one live key
    (P is exactly 1 there: the log-sum-exp of one score is that score). dS is then exactly 0, as
    are that row's dQ and its share of dK, as in PyTorch; with dO * O summed in another order,
    they were rounding noise of order eps * |dO| |V|.
    """
    B, H, Nq, Nk = *q.shape[:3], k.shape[2]
    f = _acc_dtype(q.dtype)
    plan = plan_chunks(B, H, Nq, 2 * (Nk + q.shape[3]) * f.itemsize, budget)
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k, dtype=f)
    dv = torch.zeros_like(v, dtype=f)
    p_buf, dp_buf = _Buffer(plan, Nk, q.device, f), _Buffer(plan, Nk, q.device, f)
    for bs, hs, ms in plan.slices(B, H, Nq):
        qc, doc = q[bs, hs, ms].to(f), do[bs, hs, ms].to(f)
        kc, vc = k[bs, hs].to(f), v[bs, hs].to(f)
        p, dp = p_buf.view(qc), dp_buf.view(qc)
        _scores(qc, kc, scale, _mask_chunk(mask, bs, hs, ms), p)
        lc = lse[bs, hs, ms]
        # Dead rows have lse = -inf; their probabilities are zero, not exp(-inf + inf).
        p.sub_(torch.where(torch.isinf(lc), float("inf"), lc)).exp_()
        dv[bs, hs] += torch.matmul(p.transpose(-1, -2), doc)
        torch.matmul(doc, vc.transpose(-1, -2), out=dp)
        delta = torch.matmul(p.unsqueeze(-2), dp.unsqueeze(-1)).squeeze(-1)  # rowsum(P * dP), no (rows, Nk) temporary
        p.mul_(dp.sub_(delta))  # p <- dS = P * (dP - delta)
        p.mul_(scale)
        dq[bs, hs, ms] = torch.matmul(p, kc).to(q.dtype)
        dk[bs, hs] += torch.matmul(p.transpose(-1, -2), qc)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, mask, budget, upcast):
        needs_grad = any(ctx.needs_input_grad[:3])
        # Training saves an fp32 log-sum-exp; fp16 scores would make it too coarse for the backward.
        f = _acc_dtype(q.dtype) if needs_grad else _score_dtype(q.dtype, q.device, upcast)
        B, H, Nq, D = q.shape
        # The budget covers every temporary: per query row its scores, its scaled query and its
        # P @ V result, and, when upcasting, fp32 copies of k and v made once.
        upcast_copies = 0 if f == q.dtype else (k.numel() + v.numel()) * f.itemsize
        plan = plan_chunks(B, H, Nq, (k.shape[2] + 2 * D) * f.itemsize, budget - upcast_copies)
        out, lse = _forward(q, k, v, scale, mask, plan, f, needs_grad)
        if needs_grad:
            ctx.save_for_backward(q, k, v, lse, mask)  # not the output: the backward's delta needs no O
            ctx.scale, ctx.budget = scale, budget
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse, mask = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, lse, ctx.scale, mask, ctx.budget)
        return dq, dk, dv, None, None, None, None


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    budget: int | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """Chunked exact attention. Inputs are validated by :func:`sdpatch.attention`.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D); mask broadcastable to (B, H, Nq, Nk), never expanded.
    budget: bytes for the score buffer (default :data:`DEFAULT_CHUNK_BUDGET`).
    upcast: compute scores and softmax in fp32 for fp16/bf16 inputs.
    """
    budget = DEFAULT_CHUNK_BUDGET if budget is None else budget
    return ChunkedAttention.apply(q, k, v, scale, mask, budget, upcast)


def workspace(batch: int, heads: int, nq: int, nk: int, head_dim: int, elem: int,
              chunk_budget: int | None = None, upcast: bool = False) -> float:
    """Bytes a forward call holds beyond q, k, v and its output, as :class:`ChunkedAttention` sizes
    it: ``elem``-byte scores (fp32 when ``upcast``), with fp32 copies of k and v when upcasting,
    then whole query rows within the rest of the budget, each row counted as its scores, scaled
    query and P @ V result; the latter two are never alive at once."""
    budget = DEFAULT_CHUNK_BUDGET if chunk_budget is None else chunk_budget
    f = 4 if upcast else elem
    copies = 2 * batch * heads * nk * head_dim * f if f != elem else 0
    chunk = plan_chunks(batch, heads, nq, (nk + 2 * head_dim) * f, budget - copies)
    return copies + chunk.batch * chunk.heads * chunk.queries * (nk + head_dim) * f


def _run(q, k, v, scale, mask, needs_grad, chunk_budget, upcast):
    return chunked_attention(q, k, v, scale, mask, chunk_budget, upcast)


BACKEND = Backend(
    name="chunked",
    description="plain PyTorch, queries in chunks within a byte budget: every device, dtype and head dim",
    supports=lambda call: None,
    run=_run,
    workspace=workspace,
    status=lambda device: (True, "plain PyTorch: every device and head dim"),
    auto_reason=lambda call: "serves every call",
)
