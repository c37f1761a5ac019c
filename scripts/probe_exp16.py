"""Probe: does a packed fp16 exponential make the forward kernel faster at SD's head dims now that
the rest of the kernel is tuned? (Timings need a CUDA GPU.)

    python scripts/probe_exp16.py --json probe_exp16.json

At head dim 64 (and 40, padded to 64) a score costs 256 FLOPs of tensor-core work; an H200 SM does
4096 dense fp16 FLOPs per clock and 16 exponentials (MUFU ``ex2``) per clock, so both take 1/16 clock
per score: the exponential unit is as busy as the tensor cores. ``ex2.approx.f16x2`` computes two
exponentials per MUFU operation. v0 measured it on a plain kernel at half of today's speed and it did
not help (DESIGN.md); that kernel was bound elsewhere. The probabilities feed the PV dot as fp16 in
any case; the exponent is rounded to fp16 first, which costs precision on small probabilities only
(the relative error is reported). The row sum is taken from the fp16 probabilities, so that it
matches what the dot sums. Three variants of one probe kernel (no mask, whole key blocks, pointer
loads): fp32 ``exp2`` (the production math, to tell the probe's overhead from the change), fp16
exponential with an fp32 row sum, and with the row sum in fp16 pairs; against sdpatch's kernel with the
same tiles, kernel time only (CUDA-graph replay).

Measured in v5 (docs/benchmarks.md): at head dim 64 the fp16 exponential lost (0.93-0.96 of the fp32
variant). At head dim 40 that run had no alignment hints and no verdict; the kernel now has them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sdpatch.kernels.flash_fwd import LOG2E, cdiv, flash_attn_fwd, interpreting, vector_align

from _bench import probe_main

EXP_MODES = {"exp32": 0, "exp16": 1, "exp16-hsum": 2}


@triton.jit
def _exp2_f16(x, ASM: tl.constexpr):
    """2**x for fp32 x <= 0, computed in fp16 two at a time (``ex2.approx.f16x2``); the interpreter,
    which cannot run PTX, rounds the same way through fp32."""
    x16 = x.to(tl.float16)
    if ASM:
        return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x16], dtype=tl.float16, is_pure=True, pack=2)
    return tl.math.exp2(x16.to(tl.float32)).to(tl.float16)


@triton.jit
def _exp16_fwd_kernel(
    Q, K, V, Out,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, N_Q, N_K,
    qk_scale,  # softmax scale * LOG2E
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # must divide N_K: no key-tail masking here
    EXP_MODE: tl.constexpr,  # 0: fp32 exp2; 1: fp16 pairs, fp32 row sum; 2: fp16 pairs, fp16 row sum per tile
    ASM: tl.constexpr,
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN elements (vector_align)
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    rows = offs_m.to(tl.int64)
    q_mask = (offs_m < N_Q)[:, None] & d_valid[None, :]
    # Row offsets hinted as the production kernel hints them: without the hints, rows of 40 halves
    # load element by element (call 2 of v5 measured this probe at 95 TFLOP/s at head dim 40).
    q_rows = Q + tl.multiple_of(off_b * stride_qb + off_h * stride_qh, ALIGN) + tl.multiple_of(rows * stride_qm, ALIGN)
    q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    k_cols = K + tl.multiple_of(off_b * stride_kb + off_h * stride_kh, ALIGN) + tl.multiple_of(offs_n * stride_kn, ALIGN)
    v_rows = V + tl.multiple_of(off_b * stride_vb + off_h * stride_vh, ALIGN) + tl.multiple_of(offs_n * stride_vn, ALIGN)
    k_ptrs = k_cols[None, :] + offs_d[:, None] * stride_kd
    v_ptrs = v_rows[:, None] + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for _ in range(0, N_K, BLOCK_N):
        k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        # -- scores, new row max (base-2 units, the scale folded into one FMA) ----
        s = tl.dot(q, k)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        x = s * qk_scale - m_new[:, None]
        # -- probabilities and row sum ----
        if EXP_MODE == 0:
            p32 = tl.math.exp2(x)
            row = tl.sum(p32, 1)
            p = p32.to(v.dtype)
        else:
            p = _exp2_f16(x, ASM)
            if EXP_MODE == 1:
                row = tl.sum(p.to(tl.float32), 1)
            else:
                row = tl.sum(p, 1).to(tl.float32)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + row
        acc = tl.dot(p, v, acc * alpha[:, None])
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn

    o_rows = Out + tl.multiple_of(off_b * stride_ob + off_h * stride_oh, ALIGN) + tl.multiple_of(rows * stride_om, ALIGN)
    tl.store(o_rows[:, None] + offs_d[None, :] * stride_od,
             (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=q_mask)


def exp16_attention(q, k, v, scale: float, config: dict, mode: str) -> torch.Tensor:
    """The probe kernel's launcher: fp16 q, k, v (B, H, N, D) with any strides, no mask."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert q.dtype == torch.float16, f"the fp16 exponential feeds an fp16 PV dot; got {q.dtype}"
    assert k.shape == v.shape == (B, H, Nk, D), "k and v must be (B, H, Nk, D)"
    assert Nk % config["BLOCK_N"] == 0, f"the probe takes whole key blocks: {Nk} keys, BLOCK_N {config['BLOCK_N']}"
    assert B * H <= 65535, "B*H on one grid dimension"
    out = torch.empty_like(q)
    grid = (cdiv(Nq, config["BLOCK_M"]), B * H)
    _exp16_fwd_kernel[grid](
        q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(), H, Nq, Nk, scale * LOG2E,
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), EXP_MODE=EXP_MODES[mode], ASM=not interpreting(),
        ALIGN=vector_align(q, k, v, out), **config,
    )
    return out


# (BLOCK_M, BLOCK_N, num_warps, num_stages): the production kernel's pointer tiles at these head dims.
TILES = [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 2)]


def impls_for(q, k, v, scale: float, cfg: dict) -> dict:
    """What the probe times on one case and tile: {name: zero-argument call}."""
    impls = {mode: (lambda m=mode: exp16_attention(q, k, v, scale, cfg, m)) for mode in EXP_MODES}
    impls["sdpatch"] = lambda: flash_attn_fwd(q, k, v, scale, config=cfg, kv_tma=False)[0]
    return impls


def main() -> None:
    probe_main(__doc__.splitlines()[0], TILES, impls_for, [("exp16 ", "sdpatch"), ("exp16-hsum", "sdpatch"), ("exp32", "sdpatch")])


if __name__ == "__main__":
    main()
