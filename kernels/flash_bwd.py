"""FlashAttention-2-style backward kernels: dQ, dK, dV by recomputing scores block by block.

Only O and the base-2 log-sum-exp from the forward pass are kept. Three launches:

1. ``_bwd_preprocess``: delta = rowsum(dO * O), one fp32 number per query row.
2. ``_bwd_dkdv_kernel``: one program per key block; loops over query blocks, accumulates dK, dV.
3. ``_bwd_dq_kernel``: one program per query block; loops over key blocks, accumulates dQ.

Splitting dQ from dK/dV avoids atomics, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_fwd import LOG2E, MAX_HEAD_DIM, _masked_scores, autotune_options, interpreting, launch_grid, mask_kind, on_device, tile_configs, vector_align


@triton.jit
def _bwd_preprocess(
    Out, DO, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, BH, N_Q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    if pid_bh >= BH:
        return
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)
    valid = (offs_m < N_Q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=valid, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=valid, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, Mask, DO, DK, DV, Lse, Delta,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, BH, N_Q, N_K,
    sm_scale,
    qk_scale,  # sm_scale * LOG2E
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot returns garbage (triton 3.9)
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN elements (vector_align)
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    if pid_bh >= BH:
        return
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < N_K
    d_valid = offs_d < HEAD_DIM
    cols = offs_n.to(tl.int64)
    nd_valid = n_valid[:, None] & d_valid[None, :]

    # Offsets hinted as multiples of ALIGN: vector loads at head dims 40 and 80 (see the forward).
    k = tl.load(K + tl.multiple_of(off_b * stride_kb + off_h * stride_kh, ALIGN)
                + tl.multiple_of(cols * stride_kn, ALIGN)[:, None] + offs_d[None, :] * stride_kd, mask=nd_valid, other=0.0)
    v = tl.load(V + tl.multiple_of(off_b * stride_vb + off_h * stride_vh, ALIGN)
                + tl.multiple_of(cols * stride_vn, ALIGN)[:, None] + offs_d[None, :] * stride_vd, mask=nd_valid, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    # Query-side tiles are read transposed, (BLOCK_D, BLOCK_M), so every product is a plain dot.
    qT_ptrs = (Q + tl.multiple_of(off_b * stride_qb + off_h * stride_qh, ALIGN)
               + tl.multiple_of(offs_m * stride_qm, ALIGN)[None, :] + offs_d[:, None] * stride_qd)
    do_ptrs = (DO + tl.multiple_of(off_b * stride_dob + off_h * stride_doh, ALIGN)
               + tl.multiple_of(offs_m * stride_dom, ALIGN)[:, None] + offs_d[None, :] * stride_dod)
    if MASK_KIND != 0:
        maskT_ptrs = Mask + off_b * stride_mb + off_h * stride_mh + offs_m[None, :] * stride_mm + cols[:, None] * stride_mn
    row_base = pid_bh.to(tl.int64) * N_Q

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for start_m in range(0, N_Q, BLOCK_M):
        m_valid = (start_m + offs_m) < N_Q
        qT = tl.load(qT_ptrs, mask=d_valid[:, None] & m_valid[None, :], other=0.0)
        do = tl.load(do_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        if DOT_FP32:
            qT = qT.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(Lse + row_base + start_m + offs_m, mask=m_valid, other=float("inf"))
        delta = tl.load(Delta + row_base + start_m + offs_m, mask=m_valid, other=0.0)
        # Fully masked rows carry lse = -inf; +inf makes their probabilities 0 instead of NaN.
        lse = tl.where(lse == float("-inf"), float("inf"), lse)

        # -- recompute P^T (BLOCK_N, BLOCK_M) ---------------------------------------------
        sT = tl.dot(k, qT, input_precision=DOT_PRECISION) * qk_scale
        if MASK_KIND != 0:
            sT = _masked_scores(sT, maskT_ptrs, n_valid[:, None] & m_valid[None, :], MASK_KIND)
        else:
            sT = tl.where(n_valid[:, None] & m_valid[None, :], sT, float("-inf"))
        pT = tl.math.exp2(sT - lse[None, :])

        # -- dV += P^T dO; dS^T = P^T * (dP^T - delta); dK += dS^T Q ------------------------
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)

        qT_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        if MASK_KIND != 0:
            maskT_ptrs += BLOCK_M * stride_mm

    dk *= sm_scale
    tl.store(DK + tl.multiple_of(off_b * stride_dkb + off_h * stride_dkh, ALIGN)
             + tl.multiple_of(cols * stride_dkn, ALIGN)[:, None] + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=nd_valid)
    tl.store(DV + tl.multiple_of(off_b * stride_dvb + off_h * stride_dvh, ALIGN)
             + tl.multiple_of(cols * stride_dvn, ALIGN)[:, None] + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=nd_valid)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Mask, DO, DQ, Lse, Delta,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, BH, N_Q, N_K,
    sm_scale,
    qk_scale,  # sm_scale * LOG2E
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot returns garbage (triton 3.9)
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN elements (vector_align)
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    if pid_bh >= BH:
        return
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < N_Q
    d_valid = offs_d < HEAD_DIM
    rows = offs_m.to(tl.int64)
    md_valid = m_valid[:, None] & d_valid[None, :]

    q = tl.load(Q + tl.multiple_of(off_b * stride_qb + off_h * stride_qh, ALIGN)
                + tl.multiple_of(rows * stride_qm, ALIGN)[:, None] + offs_d[None, :] * stride_qd, mask=md_valid, other=0.0)
    do = tl.load(DO + tl.multiple_of(off_b * stride_dob + off_h * stride_doh, ALIGN)
                 + tl.multiple_of(rows * stride_dom, ALIGN)[:, None] + offs_d[None, :] * stride_dod, mask=md_valid, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + pid_bh.to(tl.int64) * N_Q + offs_m, mask=m_valid, other=float("inf"))
    delta = tl.load(Delta + pid_bh.to(tl.int64) * N_Q + offs_m, mask=m_valid, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)

    kT_ptrs = (K + tl.multiple_of(off_b * stride_kb + off_h * stride_kh, ALIGN)
               + tl.multiple_of(offs_n * stride_kn, ALIGN)[None, :] + offs_d[:, None] * stride_kd)
    vT_ptrs = (V + tl.multiple_of(off_b * stride_vb + off_h * stride_vh, ALIGN)
               + tl.multiple_of(offs_n * stride_vn, ALIGN)[None, :] + offs_d[:, None] * stride_vd)
    if MASK_KIND != 0:
        mask_ptrs = Mask + off_b * stride_mb + off_h * stride_mh + rows[:, None] * stride_mm + offs_n[None, :] * stride_mn

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        n_valid = (start_n + offs_n) < N_K
        kT = tl.load(kT_ptrs, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
        vT = tl.load(vT_ptrs, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
        if DOT_FP32:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)
        # -- recompute P, then dS = P * (dP - delta); dQ += dS K -------------------------------
        s = tl.dot(q, kT, input_precision=DOT_PRECISION) * qk_scale
        if MASK_KIND != 0:
            s = _masked_scores(s, mask_ptrs, m_valid[:, None] & n_valid[None, :], MASK_KIND)
        else:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)

        kT_ptrs += BLOCK_N * stride_kn
        vT_ptrs += BLOCK_N * stride_vn
        if MASK_KIND != 0:
            mask_ptrs += BLOCK_N * stride_mn

    dq *= sm_scale
    tl.store(DQ + tl.multiple_of(off_b * stride_dqb + off_h * stride_dqh, ALIGN)
             + tl.multiple_of(rows * stride_dqm, ALIGN)[:, None] + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=md_valid)


def _configs():
    """Autotune space for the GPU, shared by both kernels."""
    return tile_configs([(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 3)])


def _prune(configs, named_args, **kwargs):
    """Wide heads keep only small tiles: five tiles live at once in the backward pass."""
    if kwargs["BLOCK_D"] >= 128:
        small = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
        return small or configs[-1:]
    return configs


# Autotune key: sequence lengths and head dim. Each kernel overwrites its outputs whole, so
# benchmarking a config leaves nothing stale behind.
_KEY = ["N_Q", "N_K", "HEAD_DIM", "MASK_KIND"]


def _tuned(kernel):
    return triton.autotune(configs=_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune}, **autotune_options())(kernel)


_dkdv_tuned = _tuned(_bwd_dkdv_kernel)
_dq_tuned = _tuned(_bwd_dq_kernel)

_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
_PREPROCESS_BLOCK_M = 64


def flash_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention with respect to q, k and v.

    do, q, out: (B, H, Nq, D); k, v: (B, H, Nk, D), any strides; lse: fp32 (B, H, Nq) base-2
    log-sum-exp from :func:`flash_attn_fwd`; mask as given to the forward (4-D, broadcastable).
    config: BLOCK_M, BLOCK_N, num_warps, num_stages for both kernels instead of autotuning.
    Returns (dq, dk, dv) in the inputs' dtype and layouts.
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert do.shape == out.shape == q.shape, f"dO {tuple(do.shape)} and O {tuple(out.shape)} must match q {tuple(q.shape)}"
    assert lse.shape == (B, H, Nq) and lse.dtype == torch.float32 and lse.is_contiguous(), "lse must be contiguous fp32 (B, H, Nq)"
    assert 1 <= D <= MAX_HEAD_DIM, f"head dim {D} outside 1..{MAX_HEAD_DIM}"
    if mask is not None:
        mask = mask.expand(B, H, Nq, Nk)
    BH = B * H
    block_d = max(16, triton.next_power_of_2(D))

    delta = torch.empty((B, H, Nq), device=q.device, dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ms = mask.stride() if mask is not None else (0, 0, 0, 0)
    common = (*q.stride(), *k.stride(), *v.stride(), *ms, *do.stride())
    tail = (H, BH, Nq, Nk, scale, scale * LOG2E)
    meta = dict(
        HEAD_DIM=D,
        BLOCK_D=block_d,
        MASK_KIND=mask_kind(mask),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=interpreting() and q.dtype == torch.bfloat16,
        ALIGN=vector_align(q, k, v, do, dq, dk, dv),
    )
    dkdv_args = (q, k, v, mask, do, dk, dv, lse, delta, *common, *dk.stride(), *dv.stride(), *tail)
    dq_args = (q, k, v, mask, do, dq, lse, delta, *common, *dq.stride(), *tail)
    config = config or (_INTERPRET_CONFIG if interpreting() else None)
    with on_device(q):
        _bwd_preprocess[launch_grid(Nq, BH, _PREPROCESS_BLOCK_M)](
            out, do, delta, *out.stride(), *do.stride(), H, BH, Nq,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=_PREPROCESS_BLOCK_M,
        )
        if config is not None:
            _bwd_dkdv_kernel[launch_grid(Nk, BH, config["BLOCK_N"])](*dkdv_args, **meta, **config)
            _bwd_dq_kernel[launch_grid(Nq, BH, config["BLOCK_M"])](*dq_args, **meta, **config)
        else:
            _dkdv_tuned[lambda META: launch_grid(Nk, BH, META["BLOCK_N"])](*dkdv_args, **meta)
            _dq_tuned[lambda META: launch_grid(Nq, BH, META["BLOCK_M"])](*dq_args, **meta)
    return dq, dk, dv
