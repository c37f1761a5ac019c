"""FlashAttention-2-style backward kernels: dQ, dK, dV by recomputing scores block by block.

Only O and the base-2 log-sum-exp from the forward pass are kept. Two launches (three with few keys):

1. ``_bwd_dq_kernel``: one program per query block; computes delta = rowsum(dO * O) for its rows
   (stored for step 2), then loops over key blocks and accumulates dQ.
2. ``_bwd_dkdv_kernel``: one program per key block; loops over query blocks, accumulates dK, dV.
   With few keys (77 text tokens) several programs share a key block's query blocks and write fp32
   partial sums, which ``_bwd_sum_splits`` adds.

Each launch costs the host as much as a whole kernel at 77 keys: a separate delta kernel and four
PyTorch ops adding the partial sums made 7 launches there; now there are 3.

Splitting dQ from dK/dV, and adding partial sums in a fixed order, avoids atomics: results are
deterministic. The head dim is tiled as in the forward kernel (one padded tile, or two parts), by
the backward's own split rule (:func:`shared.head_dim_parts`).

A row with one live key (one key in all, or every other masked) has dS = 0, so dQ = 0 and no share
of dK, exactly, in PyTorch. Here dS = P * (dP - delta), and delta = rowsum(dO * O) sums the same
products as dP = dO . v in another order: a rounding apart, of order eps * |dO| |v|. With at most
:data:`ONE_BLOCK_KEYS` keys, every key of a row is in one block, and both kernels take such a row's
delta as its one live entry of dP, to the bit: dS is then exactly 0, whatever P's rounding; and
its P as exactly 1, so that dV is the plain sum of dO. With more keys a row's keys span blocks,
and finding its live keys first would cost the dQ kernel a second pass over them: there, the
rounding stays (masks that leave one key of many are rare).
"""

import functools
import logging
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .runtime import (
    autotuner,
    cached_plan,
    cdiv,
    config_kwargs,
    interpreting,
    launch,
    launch_grid,
    on_device,
    precompile,
    shipped_config,
    tile_configs,
    tune_key,
    vector_align,
)
from . import flash_bwd_hopper as hopper
from .shared import LOG2E, SERVES, batch_head, in_range, kernel_meta, mask_kind, masked_scores, plan_key, tiling
from .flash_fwd_hopper import sm_count

logger = logging.getLogger(__name__)


@triton.jit
def _load_rows(ptrs, stride_d, offs_d, d_valid, row_valid, DOT_FP32: tl.constexpr):
    """A (rows, len(offs_d)) tile of row pointers ``ptrs``, zero outside; fp32 for the interpreter."""
    t = tl.load(ptrs[:, None] + offs_d[None, :] * stride_d, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        t = t.to(tl.float32)
    return t


@triton.jit
def _load_cols(ptrs, stride_d, offs_d, d_valid, col_valid, DOT_FP32: tl.constexpr):
    """The transposed tile, (len(offs_d), cols), of column pointers ``ptrs``."""
    t = tl.load(ptrs[None, :] + offs_d[:, None] * stride_d, mask=d_valid[:, None] & col_valid[None, :], other=0.0)
    if DOT_FP32:
        t = t.to(tl.float32)
    return t


@triton.jit
def _one_live_key(p, valid, AXIS: tl.constexpr):
    """(live, single): the entries of ``p`` that are nonzero among ``valid`` keys, and the rows
    (along ``AXIS``) with exactly one. Such a row's P is 1 there, exactly (a softmax of one score;
    the recomputed score may differ from the forward's in its last bit), and its delta is that
    entry's dP, to the bit, so that dS = P * (dP - delta) is exactly 0."""
    live = (p > 0) & valid
    return live, tl.sum(live.to(tl.int32), AXIS) == 1


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
    stride_split,  # DK and DV: elements between the partial sums of consecutive query splits
    H, BH, N_Q, N_K,
    n_splits,  # programs per key block, each over its own share of the query blocks
    sm_scale,
    qk_scale,  # sm_scale * LOG2E
    HEAD_DIM: tl.constexpr,
    BLOCK_DA: tl.constexpr,  # the head dim as two power-of-two parts, as in the forward kernel
    BLOCK_DB: tl.constexpr,  # (B = 0: part A alone)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot returns garbage (triton 3.9)
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN elements (vector_align)
    FOLD_SCALE: tl.constexpr,  # scale > 0 and no additive mask: the scale joins exp2's FMA
    ONE_KEY_BLOCK: tl.constexpr,  # N_K <= ONE_BLOCK_KEYS: a row's keys are all in one block
    EVEN_M: tl.constexpr,  # N_Q % BLOCK_M == 0: no query-tail masking
):
    # Grid dim 0 is key block x query split: with few keys (77 text tokens are 2 blocks a head),
    # one program per key block leaves most of the GPU idle, so the query loop is shared out.
    n_blocks = tl.cdiv(N_K, BLOCK_N)
    pid_n = tl.program_id(0) % n_blocks
    pid_s = tl.program_id(0) // n_blocks
    pid_bh, off_b, off_h = batch_head(H)
    if pid_bh >= BH:
        return
    m_per_split = tl.cdiv(tl.cdiv(N_Q, BLOCK_M), n_splits) * BLOCK_M
    m_lo = pid_s * m_per_split
    m_hi = tl.minimum(N_Q, m_lo + m_per_split)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_valid = offs_n < N_K
    cols = offs_n.to(tl.int64)
    first_rows = m_lo.to(tl.int64) + offs_m

    # Row pointers, offsets hinted as multiples of ALIGN: vector loads at head dims 40 and 80.
    k_rows = K + tl.multiple_of(off_b * stride_kb + off_h * stride_kh, ALIGN) + tl.multiple_of(cols * stride_kn, ALIGN)
    v_rows = V + tl.multiple_of(off_b * stride_vb + off_h * stride_vh, ALIGN) + tl.multiple_of(cols * stride_vn, ALIGN)
    # Query-side tiles are read transposed, (BLOCK_D, BLOCK_M), so every product is a plain dot.
    q_cols = Q + tl.multiple_of(off_b * stride_qb + off_h * stride_qh, ALIGN) + tl.multiple_of(first_rows * stride_qm, ALIGN)
    do_rows = DO + tl.multiple_of(off_b * stride_dob + off_h * stride_doh, ALIGN) + tl.multiple_of(first_rows * stride_dom, ALIGN)
    if MASK_KIND != 0:
        maskT_ptrs = Mask + off_b * stride_mb + off_h * stride_mh + first_rows[None, :] * stride_mm + cols[:, None] * stride_mn
    row_base = pid_bh.to(tl.int64) * N_Q

    offs_da = tl.arange(0, BLOCK_DA)
    da_valid = offs_da < HEAD_DIM
    ka = _load_rows(k_rows, stride_kd, offs_da, da_valid, n_valid, DOT_FP32)
    va = _load_rows(v_rows, stride_vd, offs_da, da_valid, n_valid, DOT_FP32)
    dka = tl.zeros([BLOCK_N, BLOCK_DA], dtype=tl.float32)
    dva = tl.zeros([BLOCK_N, BLOCK_DA], dtype=tl.float32)
    if BLOCK_DB > 0:
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        db_valid = offs_db < HEAD_DIM
        kb = _load_rows(k_rows, stride_kd, offs_db, db_valid, n_valid, DOT_FP32)
        vb = _load_rows(v_rows, stride_vd, offs_db, db_valid, n_valid, DOT_FP32)
        dkb = tl.zeros([BLOCK_N, BLOCK_DB], dtype=tl.float32)
        dvb = tl.zeros([BLOCK_N, BLOCK_DB], dtype=tl.float32)

    for start_m in range(m_lo, m_hi, BLOCK_M):
        m_valid = in_range(start_m + offs_m, N_Q, EVEN_M)
        qTa = _load_cols(q_cols, stride_qd, offs_da, da_valid, m_valid, DOT_FP32)
        doa = _load_rows(do_rows, stride_dod, offs_da, da_valid, m_valid, DOT_FP32)
        lse = tl.load(Lse + row_base + start_m + offs_m, mask=m_valid, other=float("inf"))
        delta = tl.load(Delta + row_base + start_m + offs_m, mask=m_valid, other=0.0)
        # Fully masked rows carry lse = -inf; +inf makes their probabilities 0 instead of NaN.
        lse = tl.where(lse == float("-inf"), float("inf"), lse)

        # -- recompute P^T (BLOCK_N, BLOCK_M) ---------------------------------------------
        sT = tl.dot(ka, qTa, input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
            qTb = _load_cols(q_cols, stride_qd, offs_db, db_valid, m_valid, DOT_FP32)
            dob = _load_rows(do_rows, stride_dod, offs_db, db_valid, m_valid, DOT_FP32)
            sT = tl.dot(kb, qTb, sT, input_precision=DOT_PRECISION)
        if not FOLD_SCALE:
            sT = sT * qk_scale
        # Without a mask the tails need no -inf: a query past N_Q has lse = +inf, so its P^T column
        # is 0; a key past N_K has zero K and V rows, and its rows of P^T and dS^T, whatever they
        # hold, reach only its own rows of dK and dV, which are never stored.
        if MASK_KIND != 0:
            sT = masked_scores(sT, maskT_ptrs, n_valid[:, None] & m_valid[None, :], MASK_KIND)
        if FOLD_SCALE:  # -inf stays -inf: the scale is positive
            pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        else:
            pT = tl.math.exp2(sT - lse[None, :])

        if ONE_KEY_BLOCK:
            live, single = _one_live_key(pT, n_valid[:, None], 0)
            pT = tl.where(live & single[None, :], 1.0, pT)

        # -- dV += P^T dO; dS^T = P^T * (dP^T - delta); dK += dS^T Q ------------------------
        pT_in = pT.to(doa.dtype)
        dva = tl.dot(pT_in, doa, dva, input_precision=DOT_PRECISION)
        dpT = tl.dot(va, tl.trans(doa), input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
            dvb = tl.dot(pT_in, dob, dvb, input_precision=DOT_PRECISION)
            dpT = tl.dot(vb, tl.trans(dob), dpT, input_precision=DOT_PRECISION)
        if ONE_KEY_BLOCK:
            delta = tl.where(single, tl.sum(tl.where(live, dpT, 0.0), 0), delta)
        dsT = (pT * (dpT - delta[None, :])).to(qTa.dtype)
        dka = tl.dot(dsT, tl.trans(qTa), dka, input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
            dkb = tl.dot(dsT, tl.trans(qTb), dkb, input_precision=DOT_PRECISION)

        q_cols += BLOCK_M * stride_qm
        do_rows += BLOCK_M * stride_dom
        if MASK_KIND != 0:
            maskT_ptrs += BLOCK_M * stride_mm

    # One split writes dK and dV themselves; several write fp32 partial sums that the launcher adds.
    split_off = pid_s.to(tl.int64) * stride_split
    dk_rows = (DK + split_off + tl.multiple_of(off_b * stride_dkb + off_h * stride_dkh, ALIGN)
               + tl.multiple_of(cols * stride_dkn, ALIGN))
    dv_rows = (DV + split_off + tl.multiple_of(off_b * stride_dvb + off_h * stride_dvh, ALIGN)
               + tl.multiple_of(cols * stride_dvn, ALIGN))
    tl.store(dk_rows[:, None] + offs_da[None, :] * stride_dkd, (dka * sm_scale).to(DK.dtype.element_ty),
             mask=n_valid[:, None] & da_valid[None, :])
    tl.store(dv_rows[:, None] + offs_da[None, :] * stride_dvd, dva.to(DV.dtype.element_ty), mask=n_valid[:, None] & da_valid[None, :])
    if BLOCK_DB > 0:
        tl.store(dk_rows[:, None] + offs_db[None, :] * stride_dkd, (dkb * sm_scale).to(DK.dtype.element_ty),
                 mask=n_valid[:, None] & db_valid[None, :])
        tl.store(dv_rows[:, None] + offs_db[None, :] * stride_dvd, dvb.to(DV.dtype.element_ty),
                 mask=n_valid[:, None] & db_valid[None, :])


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Mask, DO, Out, DQ, Lse, Delta,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, BH, N_Q, N_K,
    sm_scale,
    qk_scale,  # sm_scale * LOG2E
    HEAD_DIM: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot returns garbage (triton 3.9)
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN elements (vector_align)
    FOLD_SCALE: tl.constexpr,  # scale > 0 and no additive mask: the scale joins exp2's FMA
    ONE_KEY_BLOCK: tl.constexpr,  # N_K <= ONE_BLOCK_KEYS: the key loop runs once
    EVEN_N: tl.constexpr,  # N_K % BLOCK_N == 0: no key-tail masking
):
    pid_m = tl.program_id(0)
    pid_bh, off_b, off_h = batch_head(H)
    if pid_bh >= BH:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_valid = offs_m < N_Q
    rows = offs_m.to(tl.int64)

    q_rows = Q + tl.multiple_of(off_b * stride_qb + off_h * stride_qh, ALIGN) + tl.multiple_of(rows * stride_qm, ALIGN)
    do_rows = DO + tl.multiple_of(off_b * stride_dob + off_h * stride_doh, ALIGN) + tl.multiple_of(rows * stride_dom, ALIGN)
    o_rows = Out + tl.multiple_of(off_b * stride_ob + off_h * stride_oh, ALIGN) + tl.multiple_of(rows * stride_om, ALIGN)
    k_cols = K + tl.multiple_of(off_b * stride_kb + off_h * stride_kh, ALIGN) + tl.multiple_of(offs_n * stride_kn, ALIGN)
    v_cols = V + tl.multiple_of(off_b * stride_vb + off_h * stride_vh, ALIGN) + tl.multiple_of(offs_n * stride_vn, ALIGN)
    if MASK_KIND != 0:
        mask_ptrs = Mask + off_b * stride_mb + off_h * stride_mh + rows[:, None] * stride_mm + offs_n[None, :] * stride_mn

    offs_da = tl.arange(0, BLOCK_DA)
    da_valid = offs_da < HEAD_DIM
    qa = _load_rows(q_rows, stride_qd, offs_da, da_valid, m_valid, DOT_FP32)
    doa = _load_rows(do_rows, stride_dod, offs_da, da_valid, m_valid, DOT_FP32)
    # delta = rowsum(dO * O), here rather than in a launch of its own; the dK/dV kernel reads it.
    delta = tl.sum(doa.to(tl.float32) * _load_rows(o_rows, stride_od, offs_da, da_valid, m_valid, False).to(tl.float32), 1)
    dqa = tl.zeros([BLOCK_M, BLOCK_DA], dtype=tl.float32)
    if BLOCK_DB > 0:
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        db_valid = offs_db < HEAD_DIM
        qb = _load_rows(q_rows, stride_qd, offs_db, db_valid, m_valid, DOT_FP32)
        dob = _load_rows(do_rows, stride_dod, offs_db, db_valid, m_valid, DOT_FP32)
        delta += tl.sum(dob.to(tl.float32) * _load_rows(o_rows, stride_od, offs_db, db_valid, m_valid, False).to(tl.float32), 1)
        dqb = tl.zeros([BLOCK_M, BLOCK_DB], dtype=tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * N_Q + offs_m, delta, mask=m_valid)
    lse = tl.load(Lse + pid_bh.to(tl.int64) * N_Q + offs_m, mask=m_valid, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)

    for start_n in range(0, N_K, BLOCK_N):
        n_valid = in_range(start_n + offs_n, N_K, EVEN_N)
        kTa = _load_cols(k_cols, stride_kd, offs_da, da_valid, n_valid, DOT_FP32)
        vTa = _load_cols(v_cols, stride_vd, offs_da, da_valid, n_valid, DOT_FP32)
        # -- recompute P, then dS = P * (dP - delta); dQ += dS K -------------------------------
        s = tl.dot(qa, kTa, input_precision=DOT_PRECISION)
        dp = tl.dot(doa, vTa, input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
            kTb = _load_cols(k_cols, stride_kd, offs_db, db_valid, n_valid, DOT_FP32)
            vTb = _load_cols(v_cols, stride_vd, offs_db, db_valid, n_valid, DOT_FP32)
            s = tl.dot(qb, kTb, s, input_precision=DOT_PRECISION)
            dp = tl.dot(dob, vTb, dp, input_precision=DOT_PRECISION)
        if not FOLD_SCALE:
            s = s * qk_scale
        if MASK_KIND != 0:
            s = masked_scores(s, mask_ptrs, m_valid[:, None] & n_valid[None, :], MASK_KIND)
        elif not EVEN_N:  # a key past N_K has zero K rows, but exp2(0 - lse) may overflow: 0 * inf
            s = tl.where(n_valid[None, :], s, float("-inf"))
        if FOLD_SCALE:
            p = tl.math.exp2(s * qk_scale - lse[:, None])
        else:
            p = tl.math.exp2(s - lse[:, None])
        if ONE_KEY_BLOCK:  # delta stays as stored: the dK/dV kernel takes its own from its own dP
            live, single = _one_live_key(p, n_valid[None, :], 1)
            row_delta = tl.where(single, tl.sum(tl.where(live, dp, 0.0), 1), delta)
            ds = (p * (dp - row_delta[:, None])).to(kTa.dtype)
        else:
            ds = (p * (dp - delta[:, None])).to(kTa.dtype)
        dqa = tl.dot(ds, tl.trans(kTa), dqa, input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
            dqb = tl.dot(ds, tl.trans(kTb), dqb, input_precision=DOT_PRECISION)

        k_cols += BLOCK_N * stride_kn
        v_cols += BLOCK_N * stride_vn
        if MASK_KIND != 0:
            mask_ptrs += BLOCK_N * stride_mn

    dq_rows = DQ + tl.multiple_of(off_b * stride_dqb + off_h * stride_dqh, ALIGN) + tl.multiple_of(rows * stride_dqm, ALIGN)
    tl.store(dq_rows[:, None] + offs_da[None, :] * stride_dqd, (dqa * sm_scale).to(DQ.dtype.element_ty),
             mask=m_valid[:, None] & da_valid[None, :])
    if BLOCK_DB > 0:
        tl.store(dq_rows[:, None] + offs_db[None, :] * stride_dqd, (dqb * sm_scale).to(DQ.dtype.element_ty),
                 mask=m_valid[:, None] & db_valid[None, :])


@triton.jit
def _bwd_sum_splits(
    DKP, DVP, DK, DV,
    stride_pb, stride_ph, stride_pn,  # the fp32 partial sums: each split a contiguous (B, H, N_K, D)
    stride_split,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, BH, N_K,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dK and dV as the sums of the query splits' partials, added in split order (deterministic)."""
    pid_n = tl.program_id(0)
    pid_bh, off_b, off_h = batch_head(H)
    if pid_bh >= BH:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_n < N_K)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_n.to(tl.int64)
    part = off_b * stride_pb + off_h * stride_ph + rows[:, None] * stride_pn + offs_d[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for split in range(n_splits):
        dk += tl.load(DKP + split * stride_split + part, mask=valid, other=0.0)
        dv += tl.load(DVP + split * stride_split + part, mask=valid, other=0.0)
    tl.store(DK + off_b * stride_dkb + off_h * stride_dkh + rows[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=valid)
    tl.store(DV + off_b * stride_dvb + off_h * stride_dvh + rows[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=valid)


def _dkdv_configs():
    """dK/dV kernel tiles (BLOCK_N keys per program, BLOCK_M queries per step): those that won or
    came within 5 % at some SD shape in ``scripts/sweep_configs.py`` (H200, triton 3.6)."""
    return tile_configs([(32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3)])


def _dq_configs():
    """dQ kernel tiles (BLOCK_M queries per program, BLOCK_N keys per step), chosen the same way."""
    return tile_configs([(128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2)])


def _prune(configs, named_args, **kwargs):
    """A padded 256-wide head keeps tiles of at most 64 x 64: five such tiles live at once."""
    if kwargs["BLOCK_DA"] + kwargs["BLOCK_DB"] >= 256:
        small = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
        return small or configs[-1:]
    return configs


# Autotune key: sequence lengths, head dim and its tiling. Each kernel overwrites its outputs
# whole, so benchmarking a config leaves nothing stale behind.
_KEY = ["N_Q", "N_K", "HEAD_DIM", "BLOCK_DB", "MASK_KIND"]


@functools.cache
def bwd_tuners():
    """The (dK/dV, dQ) kernels' autotuners (see :func:`runtime.autotuner`)."""
    return autotuner(_bwd_dkdv_kernel, _dkdv_configs(), _KEY, _prune), autotuner(_bwd_dq_kernel, _dq_configs(), _KEY, _prune)


# Up to this many queries the backward is not split: its kernels take a few us, its host tens (the
# lent H100 host: 72-131 us in flash_attn_bwd at 256 queries), and a split adds a launch of the
# partial-sum kernel and an fp32 buffer to the host's share (about 12 us) to save the GPU less.
SPLIT_MIN_QUERIES = 256


def default_query_splits(n_q: int, n_k: int, bh: int, device: torch.device) -> int:
    """dK/dV programs per key block: enough for about two programs per SM, none below 128 queries
    each, and one above :data:`SPLIT_MIN_QUERIES` queries only. Self-attention at SD sizes already
    has that many key blocks (1); 77 text tokens, two key blocks a head, get 8 at (2, 8, 4096) on an H200."""
    if device.type != "cuda" or n_q <= SPLIT_MIN_QUERIES:
        return 1
    programs = cdiv(n_k, 64) * bh
    return max(1, min(cdiv(n_q, 128), 2 * sm_count(device) // programs))


_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
ONE_BLOCK_KEYS = 16  # keys that one block of every tile holds (every BLOCK_N is at least this)
_SUM_BLOCK_N = 32  # key rows per program of the partial-sum kernel: memory-bound, a few us


@dataclass(slots=True)
class _BwdPlan:
    """What the backward launches of one input layout need besides the tensors: found once."""

    meta: dict
    block_d: int  # the partial-sum kernel's padded head dim
    splits: int
    configs: tuple[dict, dict] | None = None  # (dK/dV, dQ) tiles, once the autotuner has picked them
    binaries: dict = field(default_factory=dict)  # (kernel, tiles) -> compiled kernel (see :func:`launch`)
    tuned: tuple | None = None  # each kernel's (grid, scalars, constexprs, binary key) with the tuned tiles
    sums: tuple | None = None  # the partial-sum kernel's (grid, scalars, constexprs), with query splits
    hopper: bool = False  # dK and dV from the Gluon kernel (:mod:`.flash_bwd_hopper`), dQ from the Triton one
    one_pass: bool = False  # dQ, dK and dV from the Gluon one-pass kernel (:func:`flash_bwd_hopper.fused_launches`)
    scale: float = 0.0


# Like the forward's launch plans: a training step repeats a few dozen layouts, and the host work
# of the checks and of Triton's autotuner (tens of us per launch) outlasts the kernels of a
# 77-key cross-attention.
_bwd_plans: dict[tuple, _BwdPlan] = {}


def _bwd_plan(do, q, k, v, out, grads, mask, scale, split_head_dim, query_splits) -> _BwdPlan:
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert do.shape == q.shape, f"dO {tuple(do.shape)} must match q {tuple(q.shape)}"
    assert 1 <= D <= SERVES.max_head_dim, f"head dim {D} outside 1..{SERVES.max_head_dim}"
    kind = mask_kind(mask)
    align = vector_align(q, k, v, do, out, *grads)
    block_da, block_db = tiling(D, split_head_dim, align, kind, Nq, Nk, backward=True)
    pinned = query_splits is not None or split_head_dim
    one_pass = not pinned and hopper.one_pass_serves(q, k, v, do, mask)
    on_hopper = not pinned and not one_pass and hopper.serves(q, k, v, do, mask)
    splits = 1 if on_hopper or one_pass else default_query_splits(Nq, Nk, B * H, q.device) if query_splits is None else query_splits
    assert 1 <= splits, f"query_splits must be >= 1, got {splits}"
    meta = {**kernel_meta(q, block_da, block_db, kind, align, scale), "ONE_KEY_BLOCK": Nk <= ONE_BLOCK_KEYS}
    # (dK/dV, dQ) tiles known before any call where the interpreter fixes them (it cannot autotune)
    # or the table shipped for this GPU has them.
    if interpreting():
        configs = (_INTERPRET_CONFIG, _INTERPRET_CONFIG)
    else:
        configs = shipped_config("bwd", q.device, bwd_tune_key(Nq, Nk, q.dtype, meta))
        # A table made where the Gluon kernel took dK and dV has no dK/dV tiles (None).
        configs = tuple(configs) if configs and (on_hopper or configs[0]) else None
    return _BwdPlan(meta, max(16, triton.next_power_of_2(D)), splits, configs, hopper=on_hopper, one_pass=one_pass,
                    scale=scale)


def bwd_tune_key(n_q: int, n_k: int, dtype: torch.dtype, meta: dict) -> str:
    """A layout's key in the shipped tuned-tile table: the autotuners' key, and the dtype."""
    return tune_key(n_q, n_k, *(meta[name] for name in ("HEAD_DIM", "BLOCK_DB", "MASK_KIND")), dtype)


def dkdv_grid(n_k: int, bh: int, splits: int, block_n: int) -> tuple[int, int, int]:
    """The dK/dV kernel's grid: key blocks x query splits on dim 0, B*H as in :func:`launch_grid`."""
    n_blocks, *bh_dims = launch_grid(n_k, bh, block_n)
    return (n_blocks * splits, *bh_dims)


def _bwd_scalars(q, k, v, mask, do, out, dq, dk_out, dv_out, scale, splits) -> tuple[tuple, tuple]:
    """The dQ and dK/dV kernels' integer and float arguments: fixed by a backward plan's key."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    ms = mask.expand(B, H, Nq, Nk).stride() if mask is not None else (0, 0, 0, 0)  # broadcast dims: stride 0
    common = (*q.stride(), *k.stride(), *v.stride(), *ms, *do.stride())
    dims, scales = (H, B * H, Nq, Nk), (scale, scale * LOG2E)
    if splits > 1:  # (split, B, H, Nk, D) partial sums: one split's (B, H, Nk, D) strides, then the split stride
        dkdv_strides = (*dk_out.stride()[1:], *dv_out.stride()[1:], dk_out.stride(0))
    else:
        dkdv_strides = (*dk_out.stride(), *dv_out.stride(), 0)
    return (*common, *out.stride(), *dq.stride(), *dims, *scales), (*common, *dkdv_strides, *dims, splits, *scales)


def flash_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    config: dict | tuple[dict, dict] | None = None,
    split_head_dim: bool | None = None,
    query_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention with respect to q, k and v.

    do, q, out: (B, H, Nq, D); k, v: (B, H, Nk, D), any strides; lse: fp32 (B, H, Nq) base-2
    log-sum-exp from :func:`flash_attn_fwd`; mask as given to the forward (4-D, broadcastable).
    config: BLOCK_M, BLOCK_N, num_warps, num_stages to launch with instead of autotuning: one
    dict for both kernels, or a (dK/dV kernel, dQ kernel) pair.
    split_head_dim: tile the head dim as two power-of-two parts (40 = 32 + 16, 80 = 64 + 16,
    160 = 128 + 32); None decides by head dim, layout and mask (:func:`shared.tiling`, backward).
    query_splits: dK/dV programs per key block, each over a share of the queries, their fp32 partial
    sums added afterwards; None decides by the GPU's size (see :func:`default_query_splits`).
    Returns (dq, dk, dv) in the inputs' dtype and layouts.
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert out.shape == q.shape, f"O {tuple(out.shape)} must match q {tuple(q.shape)}"
    assert lse.shape == (B, H, Nq) and lse.dtype == torch.float32 and lse.is_contiguous(), "lse must be contiguous fp32 (B, H, Nq)"
    key = (plan_key(q, k, v, mask, scale, False, split_head_dim, None), do.shape, do.stride(), out.stride(),
           do.data_ptr() % 16, out.data_ptr() % 16, lse.data_ptr() % 16, query_splits)
    plan = _bwd_plans.get(key)
    if config is None and plan is not None:  # the common case: a layout seen before
        if plan.one_pass:
            return _launch_one_pass(plan, do, q, k, v, out, lse, mask)
        if plan.tuned:
            return _launch_tuned(plan, plan.tuned, do, q, k, v, out, lse, mask)

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # like q, k, v: one plan fits
    plan = cached_plan(_bwd_plans, key, lambda: _bwd_plan(do, q, k, v, out, (dq, dk, dv), mask, scale, split_head_dim, query_splits))
    if config is None and plan.one_pass:
        return _launch_one_pass(plan, do, q, k, v, out, lse, mask, (dq, dk, dv))
    BH, splits = B * H, plan.splits
    delta, (dk_out, dv_out) = _delta(q), _dkdv_targets(dk, dv, splits)
    dq_scalars, dkdv_scalars = _bwd_scalars(q, k, v, mask, do, out, dq, dk_out, dv_out, scale, splits)
    config = config or plan.configs
    if config is not None:
        dkdv_config, dq_config = (config, config) if isinstance(config, dict) else config
        tuned = (
            (launch_grid(Nq, BH, dq_config["BLOCK_M"]), dq_scalars,
             {**plan.meta, "EVEN_N": Nk % dq_config["BLOCK_N"] == 0, **dq_config}, ("dq", *dq_config.items())),
            None if plan.hopper else
            (dkdv_grid(Nk, BH, splits, dkdv_config["BLOCK_N"]), dkdv_scalars,
             {**plan.meta, "EVEN_M": Nq % dkdv_config["BLOCK_M"] == 0, **dkdv_config}, ("dkdv", *dkdv_config.items())),
        )
        try:
            grads = _launch_tuned(plan, tuned, do, q, k, v, out, lse, mask, (dq, dk, dv, delta, dk_out, dv_out))
        except OutOfResources as e:
            if config is not plan.configs:  # a plan's tiles that do not fit can only be shipped ones
                raise
            logger.warning("shipped tiles %s do not fit this GPU (%s); autotuning this layout", config, e)
            plan.configs = None
            return flash_attn_bwd(do, q, k, v, out, lse, scale, mask, None, split_head_dim, query_splits)
        if config is plan.configs:  # later calls of this layout reuse the whole launch
            plan.tuned = tuned
        return grads

    # This layout's first call: the autotuner picks the tiles. dQ first: it also computes delta,
    # which the dK/dV kernel reads. EVEN_N and EVEN_M depend on the tuned tiles; every candidate
    # BLOCK_N and BLOCK_M divides 128.
    dkdv_tuner, dq_tuner = bwd_tuners()
    dq_call = (dq_tuner, lambda META: launch_grid(Nq, BH, META["BLOCK_M"]),
               (q, k, v, mask, do, out, dq, lse, delta, *dq_scalars), {**plan.meta, "EVEN_N": Nk % 128 == 0})
    dkdv_call = (dkdv_tuner, lambda META: dkdv_grid(Nk, BH, splits, META["BLOCK_N"]),
                 (q, k, v, mask, do, dk_out, dv_out, lse, delta, *dkdv_scalars), {**plan.meta, "EVEN_M": Nq % 128 == 0})
    calls = (dq_call,) if plan.hopper else (dq_call, dkdv_call)
    with on_device(q):
        precompile(*calls)
        for tuner, grid, args, meta in calls:
            tuner[grid](*args, **meta)
        plan.configs = (None if plan.hopper else config_kwargs(dkdv_tuner.best_config), config_kwargs(dq_tuner.best_config))
        if plan.hopper:
            if not _launch_hopper(plan, q, k, v, do, dk, dv, lse, delta):
                return flash_attn_bwd(do, q, k, v, out, lse, scale, mask, None, split_head_dim, query_splits)
        _sum_splits(plan, dk_out, dv_out, dk, dv)
    return dq, dk, dv


def _delta(q: torch.Tensor) -> torch.Tensor:
    """delta's buffer: rowsum(dO * O), fp32 (B, H, Nq), written by the dQ kernel, read by dK/dV's."""
    return torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)


def _dkdv_targets(dk: torch.Tensor, dv: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the dK/dV kernel writes: dK and dV themselves, or with query splits one contiguous fp32
    partial sum per split, (splits, B, H, Nk, D) each, which :func:`_sum_splits` adds."""
    if splits == 1:
        return dk, dv
    # unbind(), not iteration: unpacking the tensor took 20 us of the lent host's time under cProfile
    return torch.empty((2, splits, *dk.shape), device=dk.device, dtype=torch.float32).unbind()


def _launch_tuned(plan: _BwdPlan, tuned: tuple, do, q, k, v, out, lse, mask, buffers: tuple | None = None):
    """The backward's launches with tiles already chosen (``tuned``: each kernel's grid, scalars,
    constexprs and binary key), into ``buffers`` (dq, dk, dv, delta, and the dK/dV kernel's
    targets) or new ones.

    New dK and dV buffers are allocated after the dQ kernel's launch, so that the host's work
    overlaps that kernel instead of delaying it. Every gradient buffer is alive during the dK/dV
    kernel either way: the training step's peaks stayed the same to the MiB. Per call, the gain was
    within the lent hosts' drift.
    """
    (grid, scalars, consts, key), dkdv = tuned
    dq, dk, dv, delta, dk_out, dv_out = buffers or (torch.empty_like(q), None, None, _delta(q), None, None)
    with on_device(q):
        # The kernels take the mask's base pointer; its (broadcast) strides are in the scalars.
        launch(_bwd_dq_kernel, grid, (q, k, v, mask, do, out, dq, lse, delta, *scalars), consts, plan.binaries, key)
        if dk is None:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            dk_out, dv_out = _dkdv_targets(dk, dv, plan.splits)
        if plan.hopper:
            if not _launch_hopper(plan, q, k, v, do, dk, dv, lse, delta):
                return flash_attn_bwd(do, q, k, v, out, lse, plan.scale, mask)
            return dq, dk, dv
        kv_grid, kv_scalars, kv_consts, kv_key = dkdv
        launch(_bwd_dkdv_kernel, kv_grid, (q, k, v, mask, do, dk_out, dv_out, lse, delta, *kv_scalars), kv_consts,
               plan.binaries, kv_key)
        _sum_splits(plan, dk_out, dv_out, dk, dv)
    return dq, dk, dv


def _launch_one_pass(plan: _BwdPlan, do, q, k, v, out, lse, mask, grads: tuple | None = None):
    """The backward on the one-pass Gluon kernel and its two small launches, into ``grads`` (dq, dk,
    dv) or new ones. A launch that raises turns the Gluon backward off, as :func:`_launch_hopper`'s,
    and the call starts over on the Triton kernels."""
    dq, dk, dv = grads or (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    bound = ("one pass", 1) in plan.binaries  # compiled at this layout: its binary takes bound descriptors
    try:
        with on_device(q):
            for i, (kernel, grid, args, consts) in enumerate(
                    hopper.fused_launches(q, k, v, do, out, dq, dk, dv, lse, plan.scale, bound=bound)):
                launch(kernel, grid, args, consts, plan.binaries, ("one pass", i))
    except torch.cuda.OutOfMemoryError:  # the Triton kernels need as much
        raise
    except Exception as e:  # noqa: BLE001 (any failure of an optional kernel turns it off)
        hopper.disable(e)
        _bwd_plans.clear()
        return flash_attn_bwd(do, q, k, v, out, lse, plan.scale, mask)
    return dq, dk, dv


def _launch_hopper(plan: _BwdPlan, q, k, v, do, dk, dv, lse, delta) -> bool:
    """dK and dV on the Gluon kernel, after the dQ kernel has written delta. False where its launch
    failed (a Gluon API this triton lacks, say): the Triton kernels serve every call from then on,
    and the caller starts this call over on them."""
    bound = "gluon" in plan.binaries  # compiled at this layout: its binary takes bound descriptors
    try:
        kernel, grid, args, consts = hopper.dkdv_launch(q, k, v, do, dk, dv, lse, delta, plan.scale, bound=bound)
        launch(kernel, grid, args, consts, plan.binaries, "gluon")
    except Exception as e:  # noqa: BLE001 (any failure of an optional kernel turns it off)
        hopper.disable(e)
        _bwd_plans.clear()
        return False
    return True


def _sum_splits(plan: _BwdPlan, dk_out, dv_out, dk, dv) -> None:
    """With query splits, dK and dV as the sums of the splits' partials (one launch)."""
    if plan.splits == 1:
        return
    if plan.sums is None:
        B, H, Nk, D = dk.shape
        scalars = (*dk_out.stride()[1:4], dk_out.stride(0), *dk.stride(), *dv.stride(), H, B * H, Nk, plan.splits)
        plan.sums = (launch_grid(Nk, B * H, _SUM_BLOCK_N), scalars, dict(HEAD_DIM=D, BLOCK_N=_SUM_BLOCK_N, BLOCK_D=plan.block_d))
    grid, scalars, consts = plan.sums
    launch(_bwd_sum_splits, grid, (dk_out, dv_out, dk, dv, *scalars), consts, plan.binaries, "sum")
