"""Probe: does Triton's warp specialization make the forward kernel faster on an H200?
(Timings need a CUDA GPU.)

    python scripts/probe_ws.py --json probe_ws.json

cuDNN and FlashAttention-3 overlap one tile's softmax with another's matrix multiplies by giving
loads, dots and softmax to different warps. Triton does this itself for a loop marked
``tl.range(..., warp_specialize=True)``; v0 found that it did not compile on Hopper with pointer
loads (triton 3.6, DESIGN.md), and Triton's own notes (PR 7658) say Hopper's automatic warp
specialization takes attention with descriptors made on the device (``tl.make_tensor_descriptor``),
not on the host, which is what sdpatch's TMA path uses. This kernel loads Q, K and V through device
descriptors over diffusers' (B, N, H, D) memory, in one padded head tile, no mask, whole key blocks,
and runs the same loop with and without warp specialization; both are timed against sdpatch's kernel
(pointer loads and host TMA) on the same tiles, kernel time only (CUDA-graph replay), each checked
against float64 first. A tile that does not compile is recorded with its error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sdpatch.kernels.flash_fwd import LOG2E, cdiv, flash_attn_fwd

from _bench import probe_main


@triton.jit
def _ws_fwd_kernel(
    Q, K, V, Out,  # (B, N, H, D) memory, each a contiguous tensor
    B, H, N_Q, N_K,
    qk_scale,  # softmax scale * LOG2E
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two: the descriptors zero-fill the rest
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # must divide N_K: no key-tail masking here
    WARP_SPECIALIZE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    row_stride = H * HEAD_DIM
    q_desc = tl.make_tensor_descriptor(Q, shape=[B, N_Q, H, HEAD_DIM], strides=[N_Q * row_stride, row_stride, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_M, 1, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(K, shape=[B, N_K, H, HEAD_DIM], strides=[N_K * row_stride, row_stride, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_N, 1, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(V, shape=[B, N_K, H, HEAD_DIM], strides=[N_K * row_stride, row_stride, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_N, 1, BLOCK_D])
    o_desc = tl.make_tensor_descriptor(Out, shape=[B, N_Q, H, HEAD_DIM], strides=[N_Q * row_stride, row_stride, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_M, 1, BLOCK_D])
    q = q_desc.load([off_b, pid_m * BLOCK_M, off_h, 0]).reshape(BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in tl.range(0, N_K, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        # -- scores, new row max (base-2 units, the scale folded into one FMA) ----
        k = k_desc.load([off_b, start_n, off_h, 0]).reshape(BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- accumulate p @ v ----
        v = v_desc.load([off_b, start_n, off_h, 0]).reshape(BLOCK_N, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    # The descriptor clips rows past N_Q and columns past HEAD_DIM.
    o = (acc / l_i[:, None]).to(Out.dtype.element_ty)
    o_desc.store([off_b, pid_m * BLOCK_M, off_h, 0], o.reshape(1, BLOCK_M, 1, BLOCK_D))


def _scratch(size: int, alignment: int, stream):
    """Global memory for the descriptors the kernel makes on the device (Triton asks for it)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ws_attention(q, k, v, scale: float, config: dict, warp_specialize: bool) -> torch.Tensor:
    """The probe kernel's launcher: fp16 or bf16 q, k, v (B, H, N, D), views of contiguous (B, N, H, D)
    memory as diffusers' processors pass them; no mask."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert k.shape == v.shape == (B, H, Nk, D), "k and v must be (B, H, Nk, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.transpose(1, 2).is_contiguous(), f"{name} must view contiguous (B, N, H, D) memory"
    assert (D * q.element_size()) % 16 == 0, f"TMA rows must be 16-byte multiples: head dim {D}"
    assert Nk % config["BLOCK_N"] == 0, f"the probe takes whole key blocks: {Nk} keys, BLOCK_N {config['BLOCK_N']}"
    assert B * H <= 65535, "B*H on one grid dimension"
    if q.is_cuda:
        triton.set_allocator(_scratch)
    out = torch.empty(B, Nq, H, D, device=q.device, dtype=q.dtype).transpose(1, 2)
    grid = (cdiv(Nq, config["BLOCK_M"]), B * H)
    _ws_fwd_kernel[grid](q, k, v, out, B, H, Nq, Nk, scale * LOG2E, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
                         WARP_SPECIALIZE=warp_specialize, **config)
    return out


# (BLOCK_M, BLOCK_N, num_warps, num_stages)
TILES = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]


def impls_for(q, k, v, scale: float, cfg: dict) -> dict:
    """What the probe times on one case and tile: {name: zero-argument call}."""
    return {
        "ws": lambda: ws_attention(q, k, v, scale, cfg, True),
        "plain": lambda: ws_attention(q, k, v, scale, cfg, False),
        "sdpatch": lambda: flash_attn_fwd(q, k, v, scale, config=cfg, kv_tma=False)[0],
        "sdpatch-tma": lambda: flash_attn_fwd(q, k, v, scale, config=cfg, kv_tma=True)[0],
    }


def main() -> None:
    # "sdpatch" names both of its loads (rows whose names start with it): pointers and TMA.
    probe_main(__doc__.splitlines()[0], TILES, impls_for, [("ws", "sdpatch"), ("ws", "plain")])


if __name__ == "__main__":
    main()
