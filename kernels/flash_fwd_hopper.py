"""Hopper forward kernel in Gluon: the softmax of one key tile overlaps the matrix multiplies of its
neighbours (FlashAttention-3's intra-warpgroup pipelining).

Triton keeps a program's dots and softmax in program order, so :mod:`flash_fwd`'s kernel cannot
overlap them (docs/benchmarks.md, v5-v9). Gluon exposes what the compiler hides: asynchronous
warpgroup MMAs with explicit waits, and TMA loads into a ring of shared-memory stages guarded by
mbarriers. Per key tile j the loop issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, waits for S_j
only, and computes P_j while the second MMA runs.

Q, K, V and O go through 4-D TMA descriptors over their (B, H, N, D) views, so any layout whose last
dim is contiguous works (diffusers' (B, N, H, D) memory included). Boxes past N or D read zeros and
write nothing: odd lengths need no masks but on the scores past N (every tile's, where the tile does
not divide the keys: a branch for the last tile alone had ptxas wait for P V before the softmax,
not after it; v13). A head dim that is not a power of two runs as two power-of-two parts, each with
its own descriptors and MMAs (40 = 32 + 16: 48 columns of work where padding would do 64;
:func:`split_head_dim`).

sm_90 only, no attention mask, fp16 and bf16; :func:`hopper_fwd_ok` says when, :func:`serves` when
:func:`flash_fwd.flash_attn_fwd` uses it; ``SDPATCH_GLUON=0`` turns it off. Gluon kernels do not run
under ``TRITON_INTERPRET``: CI compiles this one for sm_90, and the GPU checks run it against float64.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton

try:  # Gluon's Hopper API: triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # triton 3.7 renamed the TMA copies (the old names raise there).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except ImportError:  # older triton: the Triton kernel serves every call
    gluon = None

log = logging.getLogger(__name__)

# Where this kernel serves flash_attn_fwd's default calls, from per-call times against the Triton
# kernel on an H200, both launched natively (docs/benchmarks.md, v13), in TFLOP/s: self-attention
# of MIN_KEYS keys and more (at 77 keys it lost, 45 against 49 at hd40), at every head dim above 64
# (hd80: 284 against 226 at 1024 tokens, 407 against 392 at 4096; hd160: 63 against 55 at 256,
# 401 against 315 at 1024), and up to head dim 64 on calls of SMALL_HEAD_MIN_FLOP and more
# (SDXL's 1024 tokens at hd64, 1.1e10 FLOPs: 277 against 293; hd40 4096, 4.3e10: 260 against 238).
MIN_KEYS = 256
SMALL_HEAD_MIN_FLOP = 2e10
ENABLED = os.environ.get("SDPATCH_GLUON", "1") != "0"
_failed: list[str] = []  # a launch that raised: the Triton kernel serves every call after it


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(D_LO, D_HI): the head dim as a power of two plus a smaller one (40 = 32 + 16, 80 = 64 + 16,
    160 = 128 + 32; parts of at least 16, an MMA's K), or (next power of two, 0) where splitting
    saves no columns. The kernel runs each MMA once per part: at 40, 48 columns of work, not 64."""
    full = triton.next_power_of_2(max(head_dim, 16))
    if head_dim == full:
        return full, 0
    lo = full // 2
    hi = max(16, triton.next_power_of_2(head_dim - lo))
    return (lo, hi) if lo + hi < full else (full, 0)


def config_for(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, STAGES), from v11-v12's probes on an H200: one warpgroup a
    program, so that two share an SM and one's softmax also overlaps the other's MMAs. Head dims
    under 64 take 128 query rows: with 64, hd40's programs re-read K and V from L2 faster than L2
    serves them (175 against 257 TFLOP/s), and 3 stages beat 2 there (265 against 261). Above 128,
    64-key tiles (hd160: 497 against 350-389 for the other tiles)."""
    if head_dim < 64:
        return 128, 64, 4, 3
    return (64, 128, 4, 2) if head_dim <= 128 else (64, 64, 4, 2)


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> bool:
    """Whether the kernel takes these inputs: no mask, fp16 or bf16, a head dim up to 256, and what
    TMA needs (16-byte aligned bases and strides, the last dim contiguous)."""
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return False
    if q.shape[3] > 256:
        return False
    return all(t.stride(3) == 1 and t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:3])
               for t in (q, k, v))


def hopper_fwd_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> bool:
    """Whether :func:`hopper_attn_fwd` can serve this call: Gluon, an sm_90 GPU, :func:`layout_ok`."""
    return gluon is not None and q.is_cuda and _is_sm90(q.get_device()) and layout_ok(q, k, v, mask)


def on() -> bool:
    """Whether the kernel may serve default calls at all: ``SDPATCH_GLUON``, and no launch has failed."""
    return ENABLED and not _failed


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> bool:
    """Whether flash_attn_fwd's default call goes to this kernel (see :data:`MIN_KEYS`)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    return (on() and Nk >= MIN_KEYS and (D > 64 or 4 * B * H * Nq * Nk * D >= SMALL_HEAD_MIN_FLOP)
            and hopper_fwd_ok(q, k, v, mask))


def disable(err: Exception) -> None:
    """After a launch that raised (a Gluon API this triton lacks, say): the Triton kernel from now on."""
    _failed.append(f"{type(err).__name__}: {err}")
    log.warning("sdpatch: the Gluon Hopper kernel failed (%s); the Triton kernel serves from now on", _failed[-1])


if gluon is not None:

    @gluon.jit
    def _scores_tail(scores, start, N_K, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Keys past N_K (zeros from TMA) out of the softmax: only the last tile needs this."""
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        return gl.where((offs_n < N_K - start)[None, :], scores, float("-inf"))

    @gluon.jit
    def _load_tile(desc, hi_desc, b, h, row, D_LO: gl.constexpr, SPLIT: gl.constexpr, bar, smem, hi_smem, pred):
        """A tile's column parts, both onto one barrier."""
        if SPLIT:
            mbarrier.expect(bar, desc.block_type.nbytes + hi_desc.block_type.nbytes, pred=pred)
            _tma_load(desc, [b, h, row, 0], bar, smem, pred=pred)
            _tma_load(hi_desc, [b, h, row, D_LO], bar, hi_smem, pred=pred)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
            _tma_load(desc, [b, h, row, 0], bar, smem, pred=pred)

    @gluon.jit
    def _attn_fwd_hopper(
        q_desc, k_desc, v_desc, o_desc, q_hi_desc, k_hi_desc, v_hi_desc, o_hi_desc, Lse,
        qk_scale, H, N_Q, N_K,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_LO: gl.constexpr, D_HI: gl.constexpr,
        STAGES: gl.constexpr, STORE_LSE: gl.constexpr, EVEN_N: gl.constexpr, num_warps: gl.constexpr,
    ):
        # The head dim in two power-of-two column parts, D_LO + D_HI (40 = 32 + 16, 80 = 64 + 16,
        # 160 = 128 + 32), each MMA once per part; D_HI = 0: one part, and the *_hi descriptors
        # are None.
        SPLIT: gl.constexpr = D_HI > 0
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        off_m = pid_m * BLOCK_M
        n_tiles = gl.cdiv(N_K, BLOCK_N)
        dtype: gl.constexpr = q_desc.dtype

        # S's and O's MMA layouts differ only in N; P feeds the second MMA from registers.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, D_LO, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        if SPLIT:
            o_hi_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                  instr_shape=[16, D_HI, 16])
            p_hi_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_hi_layout, k_width=2)
            o_hi_rows: gl.constexpr = gl.SliceLayout(1, o_hi_layout)

        # -- shared memory: Q, a ring of K and V stages, their barriers --------------------------
        q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, D_LO], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_LO], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_LO], v_desc.layout)
        if SPLIT:
            q_hi_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, D_HI], q_hi_desc.layout)
            k_hi_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_HI], k_hi_desc.layout)
            v_hi_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_HI], v_hi_desc.layout)
        else:  # never read: the first part's buffers stand in
            q_hi_smem = q_smem
            k_hi_smem = k_smem
            v_hi_smem = v_smem
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(s), count=1)
            mbarrier.init(v_bars.index(s), count=1)
        q_op = q_smem.reshape([BLOCK_M, D_LO])

        _load_tile(q_desc, q_hi_desc, b, h, off_m, D_LO, SPLIT, q_bar, q_smem, q_hi_smem, True)
        for s in gl.static_range(STAGES):
            live = s < n_tiles
            _load_tile(k_desc, k_hi_desc, b, h, s * BLOCK_N, D_LO, SPLIT, k_bars.index(s), k_smem.index(s),
                       k_hi_smem.index(s), live)
            _load_tile(v_desc, v_hi_desc, b, h, s * BLOCK_N, D_LO, SPLIT, v_bars.index(s), v_smem.index(s),
                       v_hi_smem.index(s), live)

        # -- tile 0: its scores, then its softmax, with nothing to overlap -----------------------
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_bars.index(0), 0)
        s_tok = warpgroup_mma(q_op, k_smem.index(0).reshape([BLOCK_N, D_LO]).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        if SPLIT:
            s_tok = warpgroup_mma(q_hi_smem.reshape([BLOCK_M, D_HI]),
                                  k_hi_smem.index(0).reshape([BLOCK_N, D_HI]).permute((1, 0)), s_tok, is_async=True)
        scores = warpgroup_mma_wait(0, deps=(s_tok, ))
        _load_tile(k_desc, k_hi_desc, b, h, STAGES * BLOCK_N, D_LO, SPLIT, k_bars.index(0), k_smem.index(0),
                   k_hi_smem.index(0), STAGES < n_tiles)
        if BLOCK_N > N_K:
            scores = _scores_tail(scores, 0, N_K, BLOCK_N, s_layout)
        # The scale goes inside exp2 (one FMA an element): qk_scale = softmax scale / ln 2.
        m_i = gl.max(scores, axis=1) * qk_scale
        p = gl.exp2(scores * qk_scale - m_i[:, None])
        l_i = gl.sum(p, axis=1)
        acc = gl.zeros([BLOCK_M, D_LO], gl.float32, o_layout)
        if SPLIT:
            acc_hi = gl.zeros([BLOCK_M, D_HI], gl.float32, o_hi_layout)

        for j in range(1, n_tiles):
            st = j % STAGES
            prev = (j - 1) % STAGES
            # -- issue S_j, then O += P_{j-1} V_{j-1}; wait for S_j only ------------------------
            mbarrier.wait(k_bars.index(st), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_op, k_smem.index(st).reshape([BLOCK_N, D_LO]).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            if SPLIT:
                s_tok = warpgroup_mma(q_hi_smem.reshape([BLOCK_M, D_HI]),
                                      k_hi_smem.index(st).reshape([BLOCK_N, D_HI]).permute((1, 0)), s_tok,
                                      is_async=True)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, D_LO]), acc, is_async=True)
            if SPLIT:
                p_hi_op = gl.convert_layout(p_op, p_hi_layout)
                o_hi_tok = warpgroup_mma(p_hi_op, v_hi_smem.index(prev).reshape([BLOCK_N, D_HI]), acc_hi,
                                         is_async=True)
                scores = warpgroup_mma_wait(2, deps=(s_tok, ))  # one group an MMA: both P V parts may run on
            else:
                scores = warpgroup_mma_wait(1, deps=(s_tok, ))
            if num_warps > 4:  # every warpgroup reads K_j: none may refill it before all are done
                gl.thread_barrier()
            nxt = j + STAGES
            _load_tile(k_desc, k_hi_desc, b, h, nxt * BLOCK_N, D_LO, SPLIT, k_bars.index(st), k_smem.index(st),
                       k_hi_smem.index(st), nxt < n_tiles)
            # -- softmax of tile j while P_{j-1} V_{j-1} runs ------------------------------------
            # No branch in the loop: ptxas then waited for P V before the softmax, not after it
            # (its SASS, v13). Key lengths that tiles do not divide mask every tile instead.
            if not EVEN_N:
                scores = _scores_tail(scores, j * BLOCK_N, N_K, BLOCK_N, s_layout)
            m_new = gl.maximum(m_i, gl.max(scores, axis=1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(scores * qk_scale - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            # P_{j-1} stays in deps: its registers must outlive the MMAs that read them.
            if SPLIT:
                acc, acc_hi, p_op, p_hi_op = warpgroup_mma_wait(0, deps=(o_tok, o_hi_tok, p_op, p_hi_op))
            else:
                acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            if num_warps > 4:
                gl.thread_barrier()
            _load_tile(v_desc, v_hi_desc, b, h, (nxt - 1) * BLOCK_N, D_LO, SPLIT, v_bars.index(prev),
                       v_smem.index(prev), v_hi_smem.index(prev), nxt - 1 < n_tiles)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            if SPLIT:
                acc_hi = acc_hi * gl.convert_layout(alpha, o_hi_rows)[:, None]

        # -- the last tile's P V, then the epilogue ----------------------------------------------
        last = (n_tiles - 1) % STAGES
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, D_LO]), acc, is_async=True)
        if SPLIT:
            p_hi_op = gl.convert_layout(p_op, p_hi_layout)
            o_hi_tok = warpgroup_mma(p_hi_op, v_hi_smem.index(last).reshape([BLOCK_N, D_HI]), acc_hi, is_async=True)
            acc, acc_hi, p_op, p_hi_op = warpgroup_mma_wait(0, deps=(o_tok, o_hi_tok, p_op, p_hi_op))
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.invalidate(q_bar)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(s))
            mbarrier.invalidate(v_bars.index(s))

        o_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, D_LO], o_desc.layout)
        o_smem.reshape([BLOCK_M, D_LO]).store((acc / gl.convert_layout(l_i, o_rows)[:, None]).to(dtype))
        if SPLIT:
            o_hi_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, D_HI], o_hi_desc.layout)
            o_hi_smem.reshape([BLOCK_M, D_HI]).store((acc_hi / gl.convert_layout(l_i, o_hi_rows)[:, None]).to(dtype))
        fence_async_shared()
        _tma_store(o_desc, [b, h, off_m, 0], o_smem)
        if SPLIT:  # columns past the head dim are not written
            _tma_store(o_hi_desc, [b, h, off_m, D_LO], o_hi_smem)
        if STORE_LSE:  # base-2 log-sum-exp of the scaled scores, as the Triton kernel stores it
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            gl.store(Lse + pid_bh.to(gl.int64) * N_Q + offs_m, m_i + gl.log2(l_i), mask=offs_m < N_Q)
        tma.store_wait(pendings=0)


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, width: int, dtype: torch.dtype):
    gl_dtype = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, width], gl_dtype)


def _descriptor(t: torch.Tensor, rows: int, width: int):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, width], _shared_layout(rows, width, t.dtype))


def descriptors(q, k, v, out, block_m: int, block_n: int) -> list:
    """The kernel's eight descriptor arguments: q, k, v, out over the head dim's first part, then
    over its second (:func:`split_head_dim`), or None where there is none: the JIT and the launcher
    spend host time on each descriptor they are given."""
    d_lo, d_hi = split_head_dim(q.shape[3])
    rows = (block_m, block_n, block_n, block_m)
    lo = [_descriptor(t, r, d_lo) for t, r in zip((q, k, v, out), rows)]
    return lo + ([_descriptor(t, r, d_hi) for t, r in zip((q, k, v, out), rows)] if d_hi else [None] * 4)


def launch_args(q, k, v, out, lse, scale: float, config: tuple[int, int, int, int] | None = None) -> tuple[tuple, tuple, dict]:
    """A launch's grid, runtime arguments and constexprs (``config`` as :func:`hopper_attn_fwd`'s);
    :func:`flash_fwd.flash_attn_fwd` launches them through its launch plans."""
    B, H, Nq, D = q.shape
    assert k.shape == v.shape and k.shape[:2] == (B, H) and k.shape[3] == D, f"k, v {tuple(k.shape)} do not match q {tuple(q.shape)}"
    d_lo, d_hi = split_head_dim(D)
    block_m, block_n, num_warps, stages = config or config_for(D)
    assert block_m % (16 * num_warps) == 0, f"BLOCK_M={block_m}: 16-row MMA slices, as many for each of {num_warps} warps"
    args = (*descriptors(q, k, v, out, block_m, block_n), lse, scale * 1.44269504, H, Nq, k.shape[2])  # 1/ln 2
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, D_LO=d_lo, D_HI=d_hi, STAGES=stages, STORE_LSE=lse is not None,
                  EVEN_N=k.shape[2] % block_n == 0, num_warps=num_warps)
    return (triton.cdiv(Nq, block_m), B * H, 1), args, consts


def hopper_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, return_lse: bool = False,
                    config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward on the Gluon kernel, launched through the JIT; arguments and results as
    :func:`flash_fwd.flash_attn_fwd`'s (no mask). ``config``: (BLOCK_M, BLOCK_N, num_warps,
    STAGES), else :func:`config_for`'s."""
    assert hopper_fwd_ok(q, k, v, None), "needs sm_90, fp16/bf16, head dim <= 256 and TMA-aligned strides (hopper_fwd_ok)"
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
    grid, args, consts = launch_args(q, k, v, out, lse, scale, config)
    _attn_fwd_hopper[grid](*args, **consts)
    return out, lse
