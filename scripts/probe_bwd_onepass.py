"""Probe: does a one-pass backward, dQ added up with fp32 atomics, beat sdpatch's two-kernel backward?
(Timings need a CUDA GPU.)

    python scripts/probe_bwd_onepass.py --json probe_bwd_onepass.json

sdpatch's backward (``kernels/flash_bwd.py``) is deterministic: a dQ kernel and a dK/dV kernel, each
recomputing the scores, seven matrix multiplies per tile pair where five suffice. The one-pass form
(FlashAttention-2's original) walks the query blocks once per key block and adds each block's share of
dQ into an fp32 buffer with atomics: 2/7 less matrix work, but B·H·Nq·D atomic adds per key block, and
an order of addition that varies from run to run. Issue 7's backward is at 0.73-0.89x cuDNN on the GPU-
bound shapes; this measures whether the trade pays on an H200 before the library takes it on (it would
have to be opt-in: results would no longer be bitwise reproducible). Kernel time only (CUDA-graph replay),
including the buffer's zeroing and the final conversion; checked against float64 first.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from sdpatch.kernels.flash_bwd import flash_attn_bwd
from sdpatch.kernels.flash_fwd import LOG2E, cdiv
from sdpatch.reference import attention_ref

from _bench import Case, as_config, case_tensors, probe_row, probe_summary


@triton.jit
def _bwd_onepass_kernel(
    Q, K, V, DO, Lse, Delta, DQ_ACC, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N_Q, N_K,
    sm_scale,
    qk_scale,  # sm_scale * LOG2E: Lse is the base-2 log-sum-exp of the scaled scores
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_M: tl.constexpr,  # query rows per step
    BLOCK_N: tl.constexpr,  # key rows per program
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < N_K
    d_valid = offs_d < HEAD_DIM
    cols = offs_n.to(tl.int64)

    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(K + off_b * stride_kb + off_h * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_h * stride_vh + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    row_base = pid_bh.to(tl.int64) * N_Q
    # DQ_ACC: a contiguous fp32 (B, H, N_Q, BLOCK_D) buffer, zeroed by the launcher.
    dq_base = DQ_ACC + row_base * BLOCK_D

    for start_m in range(0, N_Q, BLOCK_M):
        rows = start_m + offs_m
        m_valid = rows < N_Q
        rows64 = rows.to(tl.int64)
        q_mask = d_valid[:, None] & m_valid[None, :]
        qT = tl.load(Q + off_b * stride_qb + off_h * stride_qh + rows64[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                     mask=q_mask, other=0.0)
        do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows64[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                     mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        lse = tl.load(Lse + row_base + rows, mask=m_valid, other=float("inf"))  # inf: rows past N_Q give p = 0
        delta = tl.load(Delta + row_base + rows, mask=m_valid, other=0.0)

        sT = tl.dot(k, qT)  # (BLOCK_N, BLOCK_M)
        sT = tl.where(n_valid[:, None], sT, float("-inf"))
        pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = (pT * (dpT - delta[None, :])).to(qT.dtype)
        dk = tl.dot(dsT, tl.trans(qT), dk)
        dq = tl.dot(tl.trans(dsT), k)  # (BLOCK_M, BLOCK_D): this key block's share of dQ
        tl.atomic_add(dq_base + rows64[:, None] * BLOCK_D + offs_d[None, :], dq, mask=m_valid[:, None], sem="relaxed")

    tl.store(DK + off_b * stride_dkb + off_h * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + off_b * stride_dvb + off_h * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


def onepass_bwd(do, q, k, v, out, lse, scale: float, config: dict):
    """The probe's backward: delta, the zeroed dQ buffer, the one-pass kernel, dQ's conversion."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert B * H <= 65535, "B*H on one grid dimension"
    block_d = max(16, triton.next_power_of_2(D))
    delta = (out.float() * do.float()).sum(-1)
    dq_acc = torch.zeros((B, H, Nq, block_d), device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid = (cdiv(Nk, config["BLOCK_N"]), B * H)
    _bwd_onepass_kernel[grid](
        q, k, v, do, lse, delta, dq_acc, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        H, Nq, Nk, scale, scale * LOG2E, HEAD_DIM=D, BLOCK_D=block_d, **config,
    )
    return (dq_acc[..., :D] * scale).to(q.dtype), dk, dv


CASES = [
    Case("bwd hd40 4096", 2, 8, 4096, 4096, 40, backward=True),
    Case("bwd hd40 16384", 2, 8, 16384, 16384, 40, backward=True),
    Case("bwd hd64 4096", 2, 10, 4096, 4096, 64, backward=True),
]
# (BLOCK_M queries per step, BLOCK_N keys per program, num_warps, num_stages)
TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3)]


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
            fn = lambda cfg=as_config(tile): onepass_bwd(do, q, k, v, out, lse, scale, cfg)  # noqa: E731
            rows.append(probe_row(c.name, f"onepass {tile}", fn, flops, error_of))
        del q, k, v, do, out, lse
        torch.cuda.empty_cache()
    probe_summary(rows, [c.name for c in CASES], "onepass", "sdpatch", args.json)


if __name__ == "__main__":
    main()
