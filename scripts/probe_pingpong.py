"""Probe: does a program's query block, split into two sub-tiles processed in alternation, make the
forward kernel faster at SD's small head dims? (Timings need a CUDA GPU.)

    python scripts/probe_pingpong.py --json probe_pingpong.json

Issue 6's lead: at head dim 40 a score costs 160 FLOPs of matrix work, so the softmax (max, exponential,
rescale, conversions) weighs as much as the dots. With two independent sub-tiles in one loop body, one's
QK^T and PV matrix multiplies can be in flight while the other's softmax runs, if Triton's Hopper
pipeliner waits on each dot only where its result is used: FlashAttention-3's ping-pong, within one
program instead of across two warpgroups. The probe kernel keeps only what the timing needs (no mask,
whole key blocks, one padded head tile, pointer loads); it is timed against sdpatch's kernel with the same
tiles and pointer loads, kernel time only (CUDA-graph replay), and checked against float64 first.
A win here is a reason to build the alternation into ``kernels/flash_fwd.py``, with its masks and tilings.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from sdpatch.kernels.flash_fwd import LOG2E, cdiv, flash_attn_fwd
from sdpatch.reference import attention_ref

from _bench import Case, as_config, case_inputs, probe_row, probe_summary


@triton.jit
def _softmax_step(s, m_i, l_i, acc, qk_scale):
    """One online-softmax step of a sub-tile (base-2 units, the scale folded into exp2's FMA):
    returns its probabilities, the new max and sum, and the rescaled accumulator."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _pingpong_fwd_kernel(
    Q, K, V, Out,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, N_Q, N_K,
    qk_scale,  # softmax scale * LOG2E
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_M: tl.constexpr,  # two sub-tiles of BLOCK_M // 2 query rows
    BLOCK_N: tl.constexpr,  # must divide N_K: no key-tail masking here
):
    HALF: tl.constexpr = BLOCK_M // 2
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m0 = pid_m * BLOCK_M + tl.arange(0, HALF)
    offs_m1 = offs_m0 + HALF
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    q0 = tl.load(q_base + offs_m0[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd,
                 mask=(offs_m0 < N_Q)[:, None] & d_valid[None, :], other=0.0)
    q1 = tl.load(q_base + offs_m1[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd,
                 mask=(offs_m1 < N_Q)[:, None] & d_valid[None, :], other=0.0)
    k_ptrs = K + off_b * stride_kb + off_h * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    v_ptrs = V + off_b * stride_vb + off_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    m0 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    m1 = tl.full([HALF], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([HALF], dtype=tl.float32)
    l1 = tl.zeros([HALF], dtype=tl.float32)
    acc0 = tl.zeros([HALF, BLOCK_D], dtype=tl.float32)
    acc1 = tl.zeros([HALF, BLOCK_D], dtype=tl.float32)
    for _ in range(0, N_K, BLOCK_N):
        k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        # Both score dots are issued before either softmax: sub-tile 1's runs during sub-tile 0's
        # softmax, and sub-tile 0's PV dot during sub-tile 1's softmax.
        s0 = tl.dot(q0, k)
        s1 = tl.dot(q1, k)
        p0, m0, l0, acc0 = _softmax_step(s0, m0, l0, acc0, qk_scale)
        acc0 = tl.dot(p0.to(v.dtype), v, acc0)
        p1, m1, l1, acc1 = _softmax_step(s1, m1, l1, acc1, qk_scale)
        acc1 = tl.dot(p1.to(v.dtype), v, acc1)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn

    o_base = Out + off_b * stride_ob + off_h * stride_oh
    tl.store(o_base + offs_m0[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od,
             (acc0 / l0[:, None]).to(Out.dtype.element_ty), mask=(offs_m0 < N_Q)[:, None] & d_valid[None, :])
    tl.store(o_base + offs_m1[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od,
             (acc1 / l1[:, None]).to(Out.dtype.element_ty), mask=(offs_m1 < N_Q)[:, None] & d_valid[None, :])


def pingpong_attention(q, k, v, scale: float, config: dict) -> torch.Tensor:
    """The probe kernel's launcher: q, k, v (B, H, N, D) with any strides, no mask."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert k.shape == v.shape == (B, H, Nk, D), "k and v must be (B, H, Nk, D)"
    assert Nk % config["BLOCK_N"] == 0, f"the probe takes whole key blocks: {Nk} keys, BLOCK_N {config['BLOCK_N']}"
    assert config["BLOCK_M"] >= 32, "two sub-tiles of at least 16 rows (the tensor-core minimum)"
    assert B * H <= 65535, "B*H on one grid dimension"
    out = torch.empty_like(q)
    grid = (cdiv(Nq, config["BLOCK_M"]), B * H)
    _pingpong_fwd_kernel[grid](
        q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(), H, Nq, Nk, scale * LOG2E,
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), **config,
    )
    return out


# SD's self-attention at the head dims where the softmax weighs most; diffusers' (B, N, H, D) layout.
CASES = [
    Case("hd40 4096", 2, 8, 4096, 4096, 40),
    Case("hd40 16384", 2, 8, 16384, 16384, 40),
    Case("hd64 4096", 2, 10, 4096, 4096, 64),
    Case("hd64 1024", 2, 20, 1024, 1024, 64),
]
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the production kernel's pointer tiles at these head dims,
# and the same with 256 query rows, i.e. two 128-row sub-tiles.
TILES = [
    (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3),
    (128, 128, 8, 2), (256, 64, 8, 3), (256, 64, 8, 2), (256, 128, 8, 2),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for c in CASES:
        q, k, v = case_inputs(c)
        scale = 1 / math.sqrt(c.D)
        flops = 4 * c.B * c.H * c.Nq * c.Nk * c.D
        ref = attention_ref(q[:1, :1, :512], k[:1, :1], v[:1, :1])

        def error_of(out) -> float:
            return ((out[:1, :1, :512].double() - ref).norm() / ref.norm()).item()

        for tile in TILES:
            impls = {
                "pingpong": lambda cfg=as_config(tile): pingpong_attention(q, k, v, scale, cfg),
                "sdpatch": lambda cfg=as_config(tile): flash_attn_fwd(q, k, v, scale, config=cfg, kv_tma=False)[0],
            }
            rows += [probe_row(c.name, f"{name} {tile}", fn, flops, error_of) for name, fn in impls.items()]
        del q, k, v
        torch.cuda.empty_cache()
    probe_summary(rows, [c.name for c in CASES], "pingpong", "sdpatch", args.json)


if __name__ == "__main__":
    main()
