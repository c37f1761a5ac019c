"""Probe: a one-pass backward whose dQ is added up by TMA reductions: faster than sdpatch's two kernels?
(Timings need a CUDA GPU.)

    python scripts/probe_bwd_tma.py --json probe_bwd_tma.json

sdpatch's backward recomputes the scores twice, once in the dK/dV kernel and once in the dQ kernel:
seven matrix multiplies and two exponentials per score where the one-pass form (each key block's
program also computes its share of dQ) needs five and one. v5's one-pass probe added those shares with
per-element fp32 atomics and ran at 0.56-0.83x. Hopper's TMA can add a whole tile into global memory
in one asynchronous bulk reduction (``cp.reduce.async.bulk.tensor``), which Triton exposes as a tensor
descriptor's ``atomic_add``; the shares then cost the program one instruction per query block, and the
additions run in the TMA unit and L2 while the next block's dots run. This kernel is that form: pointer
loads as in sdpatch's dK/dV kernel, one padded head tile, no mask, whole blocks. A small kernel first
computes delta = rowsum(dO * O) and zeroes the fp32 dQ buffer; PyTorch converts it at the end; all
three are in the time (kernel time, CUDA-graph replay), against sdpatch's tuned backward, each
checked against float64 first. The order of the additions varies from run to run (not bitwise
reproducible). ``DQ_TMA=False`` adds with pointer atomics instead: the interpreter's path (it has no
descriptor reductions), which the CPU test checks.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from sdpatch.kernels.flash_bwd import flash_attn_bwd
from sdpatch.kernels.flash_fwd import LOG2E, TensorDescriptor, cdiv, interpreting
from sdpatch.reference import attention_ref

from _bench import Case, as_config, case_tensors, probe_row, probe_summary


@triton.jit
def _delta_kernel(
    DO, Out, Delta, DQ_ACC,  # DQ_ACC: contiguous fp32 (B, H, N_Q, HEAD_DIM), zeroed here
    stride_dob, stride_doh, stride_dom,
    stride_ob, stride_oh, stride_om,
    H, N_Q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (rows < N_Q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :], mask=valid, other=0.0)
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + rows[:, None] * stride_om + offs_d[None, :], mask=valid, other=0.0)
    row_base = pid_bh.to(tl.int64) * N_Q
    tl.store(Delta + row_base + rows, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1), mask=rows < N_Q)
    tl.store(DQ_ACC + (row_base + rows[:, None]) * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=valid)


@triton.jit
def _bwd_onepass_kernel(
    Q, K, V, DO, Lse, Delta, DQ_ACC, DK, DV,  # DQ_TMA: DQ_ACC is a descriptor of (1, 1, BLOCK_M, BLOCK_D) tiles
    stride_qb, stride_qh, stride_qm,  # every head dim is contiguous (stride 1)
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H, N_Q, N_K,
    sm_scale,
    qk_scale,  # sm_scale * LOG2E: Lse is the base-2 log-sum-exp of the scaled scores
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_M: tl.constexpr,  # query rows per step; must divide N_Q
    BLOCK_N: tl.constexpr,  # key rows per program; must divide N_K
    DQ_TMA: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    cols = offs_n.to(tl.int64)
    k = tl.load(K + off_b * stride_kb + off_h * stride_kh + cols[:, None] * stride_kn + offs_d[None, :], mask=d_valid[None, :], other=0.0)
    v = tl.load(V + off_b * stride_vb + off_h * stride_vh + cols[:, None] * stride_vn + offs_d[None, :], mask=d_valid[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    q_cols = Q + off_b * stride_qb + off_h * stride_qh + offs_m.to(tl.int64) * stride_qm
    do_rows = DO + off_b * stride_dob + off_h * stride_doh + offs_m.to(tl.int64) * stride_dom
    row_base = pid_bh.to(tl.int64) * N_Q

    for start_m in range(0, N_Q, BLOCK_M):
        qT = tl.load(q_cols[None, :] + offs_d[:, None], mask=d_valid[:, None], other=0.0)  # (BLOCK_D, BLOCK_M)
        do = tl.load(do_rows[:, None] + offs_d[None, :], mask=d_valid[None, :], other=0.0)
        lse = tl.load(Lse + row_base + start_m + offs_m)
        delta = tl.load(Delta + row_base + start_m + offs_m)
        pT = tl.math.exp2(tl.dot(k, qT) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = (pT * (dpT - delta[None, :])).to(qT.dtype)
        dk = tl.dot(dsT, tl.trans(qT), dk)
        dq = tl.dot(tl.trans(dsT), k)  # (BLOCK_M, BLOCK_D): this key block's share of dQ, unscaled
        if DQ_TMA:
            DQ_ACC.atomic_add([off_b, off_h, start_m, 0], dq.reshape(1, 1, BLOCK_M, BLOCK_D))
        else:
            rows = row_base + start_m + offs_m
            tl.atomic_add(DQ_ACC + rows[:, None] * HEAD_DIM + offs_d[None, :], dq, mask=d_valid[None, :], sem="relaxed")
        q_cols += BLOCK_M * stride_qm
        do_rows += BLOCK_M * stride_dom

    tl.store(DK + off_b * stride_dkb + off_h * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=d_valid[None, :])
    tl.store(DV + off_b * stride_dvb + off_h * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=d_valid[None, :])


_DELTA_BLOCK_M = 64  # rows per program of the delta kernel: memory-bound, a few us


def onepass_bwd(do, q, k, v, out, lse, scale: float, config: dict, dq_tma: bool = True):
    """The probe's backward: delta and the zeroed buffer, the one-pass kernel, dQ's conversion.
    q, k, v, do, out: (B, H, N, D) with a contiguous head dim; N_Q and N_K whole blocks."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do), ("out", out)):
        assert t.stride(-1) == 1, f"{name}'s head dim must be contiguous"
    assert Nq % config["BLOCK_M"] == 0 and Nk % config["BLOCK_N"] == 0, "the probe takes whole blocks"
    assert not dq_tma or TensorDescriptor is not None, "TMA reductions need triton >= 3.4"
    block_d = max(16, triton.next_power_of_2(D))
    delta = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    dq_acc = torch.empty((B, H, Nq, D), device=q.device, dtype=torch.float32)
    _delta_kernel[(cdiv(Nq, _DELTA_BLOCK_M), B * H)](
        do, out, delta, dq_acc, *do.stride()[:3], *out.stride()[:3], H, Nq, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=_DELTA_BLOCK_M)
    dq_arg = TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [1, 1, config["BLOCK_M"], block_d]) if dq_tma else dq_acc
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _bwd_onepass_kernel[(Nk // config["BLOCK_N"], B * H)](
        q, k, v, do, lse, delta, dq_arg, dk, dv,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        H, Nq, Nk, scale, scale * LOG2E, HEAD_DIM=D, BLOCK_D=block_d, DQ_TMA=dq_tma, **config,
    )
    return (dq_acc * scale).to(q.dtype), dk, dv


CASES = [
    Case("bwd hd40 4096", 2, 8, 4096, 4096, 40, backward=True),
    Case("bwd hd40 16384", 2, 8, 16384, 16384, 40, backward=True),
    Case("bwd hd64 4096", 2, 10, 4096, 4096, 64, backward=True),
]
# (BLOCK_M queries per step, BLOCK_N keys per program, num_warps, num_stages)
TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 2),
         (128, 128, 8, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for c in CASES:
        q, k, v, do, out, lse = case_tensors(c)
        scale = 1 / math.sqrt(c.D)
        flops = 2.5 * 4 * c.B * c.H * c.Nq * c.Nk * c.D
        n = 256  # dq of the first rows, dk and dv of the first keys, of batch 0, head 0, against float64
        q64, k64, v64 = (t[:1, :1].double().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(attention_ref(q64, k64, v64), (q64, k64, v64), do[:1, :1].double())

        def error_of(grads) -> float:
            return max(((g[:1, :1, :n].double() - r[:, :, :n]).norm() / r[:, :, :n].norm()).item() for g, r in zip(grads, ref))

        rows.append(probe_row(c.name, "sdpatch (tuned)", lambda: flash_attn_bwd(do, q, k, v, out, lse, scale), flops, error_of))
        for tile in TILES:
            fn = lambda cfg=as_config(tile): onepass_bwd(do, q, k, v, out, lse, scale, cfg, not interpreting())  # noqa: E731
            rows.append(probe_row(c.name, f"onepass {tile}", fn, flops, error_of))
        del q, k, v, do, out, lse
        torch.cuda.empty_cache()
    probe_summary(rows, [c.name for c in CASES], "onepass", "sdpatch", args.json)


if __name__ == "__main__":
    main()
