"""Hopper backward kernel for dK and dV in Gluon, warp-specialized as FlashAttention-3's: a producer
warp streams Q and dO tiles through TMA into a ring of shared-memory stages, and consumer warpgroups,
each owning BLOCK_N keys of the program's key block, run the four products of a query tile with
asynchronous warpgroup MMAs:

    S^T = K Q^T,  P^T = exp2(S^T * qk_scale - lse),  dP^T = V dO^T,
    dV += P^T dO,  dS^T = P^T * (dP^T - delta),  dK += dS^T Q.

P^T and dS^T feed their MMAs from registers (an accumulator's layout is an operand's, as in the
forward); K and V stay in shared memory for the whole loop, and dK and dV in registers. The MMA of
dP^T runs while P^T's exponentials do, and dV's while dS^T is formed.

dQ and delta = rowsum(dO * O) come from the Triton dQ kernel (:mod:`.flash_bwd`), launched first, as
in the two-pass backward there: keeping dQ out of this kernel keeps its warpgroups independent (no
exchange of dS through shared memory, no atomics), measured in the benchmark doc's "Backward leads".

The head dim is padded to a power of two by TMA (boxes past D read zeros and write nothing); no
attention mask; fp16 and bf16; sm_90. :func:`serves` says when the launch layer takes it.
"""

import logging
import os

import torch
import triton

from . import flash_fwd_hopper as fwd_hopper
from .flash_fwd_hopper import BoundDescriptor, _is_sm90, _shared_layout, gluon, layout_ok

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .flash_fwd_hopper import _tma_load, _tma_store

# Where the kernel may serve the backward's calls: self-attention of at least MIN_KEYS keys and
# queries (at 77 keys a key block is most of the keys, and the Triton kernel's query splits fill the
# GPU), head dims up to MAX_HEAD_DIM (a padded 256-wide tile would not fit the registers). Off unless
# SDPATCH_GLUON_BWD=1: on an H100 it matched the Triton kernels at head dim 64 and trailed them at 40
# and 80 (docs/benchmarks.md, "Backward leads", lead 4).
MIN_KEYS = 256
MAX_HEAD_DIM = 128
ENABLED = os.environ.get("SDPATCH_GLUON_BWD", "0") == "1"
_failed: list[str] = []  # a launch that raised: the Triton kernels serve every call after it
log = logging.getLogger(__name__)


def config_for(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, CONSUMERS): queries a step, keys a consumer warpgroup owns (one
    64-row MMA), the Q and dO ring's stages, and consumer warpgroups a program."""
    return 64, 64, 2, 2


def dq_config_for(head_dim: int) -> tuple[int, int, int, int]:
    """The dQ kernel's (BLOCK_M, BLOCK_N, STAGES, CONSUMERS): queries a consumer warpgroup owns (one
    64-row MMA), keys a step, the K and V ring's stages, and consumer warpgroups a program."""
    return 64, 128, 2, 2


def padded(head_dim: int) -> int:
    """The head dim the MMAs run at: the next power of two, at least 16 (one MMA's K)."""
    return max(16, triton.next_power_of_2(head_dim))


def consumer_regs(consumers: int) -> int:
    """Registers a consumer thread gets (``setmaxnreg``), the producer's warp holding 24."""
    return (65536 // 128 - 24) // consumers // 8 * 8


def hopper_bwd_ok(q, k, v, do, mask) -> bool:
    """Whether the kernel can take these inputs: Gluon, an sm_90 GPU, no mask, and what TMA needs of
    q, k, v and dO (:func:`sdpatch.kernels.flash_fwd_hopper.layout_ok`)."""
    return (gluon is not None and mask is None and q.is_cuda and _is_sm90(q.get_device()) and layout_ok(q, k, v, None)
            and layout_ok(do, k, v, None))


def serves(q, k, v, do, mask) -> bool:
    """Whether the backward's default call takes this kernel for dK and dV."""
    return (ENABLED and not _failed and q.shape[3] <= MAX_HEAD_DIM and min(q.shape[2], k.shape[2]) >= MIN_KEYS
            and hopper_bwd_ok(q, k, v, do, mask))


def disable(err: Exception) -> None:
    """After a launch that raised: the Triton dK/dV kernel from now on."""
    _failed.append(f"{type(err).__name__}: {err}")
    log.warning("sdpatch: the Gluon Hopper backward failed (%s); the Triton kernels serve from now on", _failed[-1])


if gluon is not None:

    @gluon.jit
    def _owned_rows(N, BLOCK: gl.constexpr, CONSUMERS: gl.constexpr, WG: gl.constexpr):
        """(batch x head, first row) of warpgroup WG's BLOCK rows: a program owns CONSUMERS x BLOCK
        rows (keys for dK/dV, queries for dQ) of one (batch, head), program_id = bh * blocks + block,
        so that the programs of a head, which read the same other operands, run together."""
        n_blocks = gl.cdiv(N, CONSUMERS * BLOCK)
        pid = gl.program_id(0)
        return pid // n_blocks, pid % n_blocks * (CONSUMERS * BLOCK) + WG * BLOCK

    @gluon.jit
    def _producer(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """One warp: each consumer's K and V, then the query tiles' Q and dO into the ring."""
        q_desc, k_desc, v_desc, do_desc, H, N_Q, N_K, k_smem, v_smem, q_smem, do_smem, kv_bars, full, empty = args
        bh, off_n = _owned_rows(N_K, BLOCK_N, CONSUMERS, 0)
        b = bh // H
        h = bh % H
        for w in gl.static_range(CONSUMERS):
            bar = kv_bars.index(w)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [b, h, off_n + w * BLOCK_N, 0], bar, k_smem.index(w))
            _tma_load(v_desc, [b, h, off_n + w * BLOCK_N, 0], bar, v_smem.index(w))
        for i in range(gl.cdiv(N_Q, BLOCK_M)):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier's phase counts as complete
            bar = full.index(st)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, i * BLOCK_M, 0], bar, q_smem.index(st))
            _tma_load(do_desc, [b, h, i * BLOCK_M, 0], bar, do_smem.index(st))

    @gluon.jit
    def _issue_sdp(k_op, v_op, q_buf, do_buf, s_zero, BLOCK_M: gl.constexpr, DP: gl.constexpr):
        """A query tile's S^T = K Q^T and dP^T = V dO^T, issued; their tokens."""
        s_tok = warpgroup_mma(k_op, q_buf.reshape([BLOCK_M, DP]).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v_op, do_buf.reshape([BLOCK_M, DP]).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return s_tok, dp_tok

    @gluon.jit
    def _dkdv_tile(i, s_tok, dp_tok, q_buf, do_buf, dk, dv, Lse, Delta, rows, offs_m, qk_scale, N_Q,
                   BLOCK_M: gl.constexpr, DP: gl.constexpr, op_layout: gl.constexpr):
        """Query tile i, its S^T and dP^T issued (the last two MMA groups): P^T, then dV's MMA, dS^T,
        then dK's; returns their tokens and the register operands they read, which must live until
        they are waited for."""
        dtype: gl.constexpr = q_buf.dtype
        # Queries past N_Q (zeros from TMA) take lse = +inf: their column of P^T, and of dS^T, is 0.
        m_valid = i * BLOCK_M + offs_m < N_Q
        lse = gl.load(Lse + rows + i * BLOCK_M + offs_m, mask=m_valid, other=float("inf"))
        delta = gl.load(Delta + rows + i * BLOCK_M + offs_m, mask=m_valid, other=0.0)
        s_t = warpgroup_mma_wait(1, deps=(s_tok, ))
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do_buf.reshape([BLOCK_M, DP]), dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_tok, ))
        ds_op = gl.convert_layout((p_t * (dp_t - delta[None, :])).to(dtype), op_layout)
        dk_tok = warpgroup_mma(ds_op, q_buf.reshape([BLOCK_M, DP]), dk, is_async=True)
        return dv_tok, dk_tok, p_op, ds_op

    @gluon.jit
    def _consumer(WG: gl.constexpr, args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr,
                  STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """Warpgroup WG: dK and dV of its BLOCK_N keys over every query tile."""
        (dk_desc, dv_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K, k_smem, v_smem, q_smem, do_smem, kv_bars, full,
         empty) = args
        dtype: gl.constexpr = dk_desc.dtype
        bh, off_n = _owned_rows(N_K, BLOCK_N, CONSUMERS, WG)

        # S^T's and dP^T's MMA layout (keys x queries), dK's and dV's (keys x head dim); P^T and dS^T
        # enter the dK and dV MMAs as register operands.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DP, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)

        k_op = k_smem.index(WG).reshape([BLOCK_N, DP])
        v_op = v_smem.index(WG).reshape([BLOCK_N, DP])
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([BLOCK_N, DP], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, DP], gl.float32, kv_layout)
        rows = bh.to(gl.int64) * N_Q
        offs_m = gl.arange(0, BLOCK_M, layout=cols)
        mbarrier.wait(kv_bars.index(WG), 0)

        for i in range(gl.cdiv(N_Q, BLOCK_M)):
            st = i % STAGES
            mbarrier.wait(full.index(st), (i // STAGES) & 1)
            s_tok, dp_tok = _issue_sdp(k_op, v_op, q_smem.index(st), do_smem.index(st), s_zero, BLOCK_M, DP)
            dv_tok, dk_tok, p_op, ds_op = _dkdv_tile(i, s_tok, dp_tok, q_smem.index(st), do_smem.index(st), dk, dv,
                                                     Lse, Delta, rows, offs_m, qk_scale, N_Q, BLOCK_M, DP, op_layout)
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
            mbarrier.arrive(empty.index(st))

        # dK and dV through TMA from this warpgroup's K and V buffers (every MMA that read them is
        # done); rows past N_K and columns past the head dim are not written.
        b = bh // H
        h = bh % H
        k_out = k_smem.index(WG)
        v_out = v_smem.index(WG)
        k_out.reshape([BLOCK_N, DP]).store((dk * sm_scale).to(dtype))
        v_out.reshape([BLOCK_N, DP]).store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [b, h, off_n, 0], k_out)
        _tma_store(dv_desc, [b, h, off_n, 0], v_out)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _attn_bwd_dkdv_hopper(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr, STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        # A program: CONSUMERS x BLOCK_N keys of one (batch, head) (_owned_rows).
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_N, DP], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_N, DP], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, DP], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, DP], do_desc.layout)
        kv_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(kv_bars.index(w), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)  # one arrival from each consumer

        consumer_args = (dk_desc, dv_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K, k_smem, v_smem, q_smem, do_smem,
                         kv_bars, full, empty)
        producer_args = (q_desc, k_desc, v_desc, do_desc, H, N_Q, N_K, k_smem, v_smem, q_smem, do_smem, kv_bars, full,
                         empty)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (0, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS)),
                (_consumer, (1, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS)),
                (_producer, (producer_args, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.static_assert(CONSUMERS == 3, "two or three consumer warpgroups")
            gl.warp_specialize([
                (_consumer, (0, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS)),
                (_consumer, (1, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS)),
                (_consumer, (2, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS)),
                (_producer, (producer_args, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])

    @gluon.jit
    def _dq_producer(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """One warp: each consumer's Q, dO and O rows, then the key tiles' K and V into the ring."""
        q_desc, k_desc, v_desc, do_desc, o_desc, H, N_Q, N_K, q_smem, do_smem, o_smem, k_smem, v_smem, row_bars, full, empty = args
        bh, off_m = _owned_rows(N_Q, BLOCK_M, CONSUMERS, 0)
        b = bh // H
        h = bh % H
        for w in gl.static_range(CONSUMERS):
            bar = row_bars.index(w)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + o_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, off_m + w * BLOCK_M, 0], bar, q_smem.index(w))
            _tma_load(do_desc, [b, h, off_m + w * BLOCK_M, 0], bar, do_smem.index(w))
            _tma_load(o_desc, [b, h, off_m + w * BLOCK_M, 0], bar, o_smem.index(w))
        for j in range(gl.cdiv(N_K, BLOCK_N)):
            st = j % STAGES
            mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
            bar = full.index(st)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [b, h, j * BLOCK_N, 0], bar, k_smem.index(st))
            _tma_load(v_desc, [b, h, j * BLOCK_N, 0], bar, v_smem.index(st))

    @gluon.jit
    def _dq_consumer(WG: gl.constexpr, args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr,
                     STAGES: gl.constexpr, CONSUMERS: gl.constexpr, EVEN_N: gl.constexpr):
        """Warpgroup WG: delta and dQ of its BLOCK_M queries over every key tile."""
        (dq_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K, q_smem, do_smem, o_smem, k_smem, v_smem, row_bars, full,
         empty) = args
        dtype: gl.constexpr = dq_desc.dtype
        bh, off_m = _owned_rows(N_Q, BLOCK_M, CONSUMERS, WG)

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DP, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        # dO and O rows read from shared memory, 8 columns a thread, for delta.
        COLS: gl.constexpr = min(32, DP // 8)
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLS, COLS], [4, 1], [1, 0])

        mbarrier.wait(row_bars.index(WG), 0)
        q_op = q_smem.index(WG).reshape([BLOCK_M, DP])
        do_op = do_smem.index(WG).reshape([BLOCK_M, DP])
        row0 = bh.to(gl.int64) * N_Q + off_m
        # delta = rowsum(dO * O), stored for the dK/dV kernel; rows past N_Q (zeros) are not.
        prod = do_op.load(rows_layout).to(gl.float32) * o_smem.index(WG).reshape([BLOCK_M, DP]).load(rows_layout).to(gl.float32)
        delta_rows = gl.sum(prod, axis=1)
        offs_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
        gl.store(Delta + row0 + offs_r, delta_rows, mask=off_m + offs_r < N_Q)
        delta = gl.convert_layout(delta_rows, row_layout)
        offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
        lse = gl.load(Lse + row0 + offs_m, mask=off_m + offs_m < N_Q, other=float("inf"))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([BLOCK_M, DP], gl.float32, q_layout)
        for j in range(gl.cdiv(N_K, BLOCK_N)):
            st = j % STAGES
            mbarrier.wait(full.index(st), (j // STAGES) & 1)
            k_t = k_smem.index(st).reshape([BLOCK_N, DP])
            v_t = v_smem.index(st).reshape([BLOCK_N, DP])
            s_tok = warpgroup_mma(q_op, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_op, v_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            if not EVEN_N:  # a key past N_K has zero K rows, but exp2(0 - lse) may overflow: 0 * inf
                s = gl.where((offs_n < N_K - j * BLOCK_N)[None, :], s, float("-inf"))
            p = gl.exp2(s * qk_scale - lse[:, None])
            dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
            ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout)
            dq_tok = warpgroup_mma(ds_op, k_t, dq, is_async=True)
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
            mbarrier.arrive(empty.index(st))

        b = bh // H
        h = bh % H
        q_out = q_smem.index(WG)
        q_out.reshape([BLOCK_M, DP]).store((dq * sm_scale).to(dtype))
        fence_async_shared()
        _tma_store(dq_desc, [b, h, off_m, 0], q_out)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _attn_bwd_dq_hopper(
        q_desc, k_desc, v_desc, do_desc, o_desc, dq_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr, STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, EVEN_N: gl.constexpr, num_warps: gl.constexpr,
    ):
        # A program: CONSUMERS x BLOCK_M queries of one (batch, head) (_owned_rows).
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, DP], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, DP], do_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, DP], o_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, DP], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, DP], v_desc.layout)
        row_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(row_bars.index(w), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)

        consumer_args = (dq_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K, q_smem, do_smem, o_smem, k_smem, v_smem,
                         row_bars, full, empty)
        producer_args = (q_desc, k_desc, v_desc, do_desc, o_desc, H, N_Q, N_K, q_smem, do_smem, o_smem, k_smem, v_smem,
                         row_bars, full, empty)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_dq_consumer, (0, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS, EVEN_N)),
                (_dq_consumer, (1, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS, EVEN_N)),
                (_dq_producer, (producer_args, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.static_assert(CONSUMERS == 3, "two or three consumer warpgroups")
            gl.warp_specialize([
                (_dq_consumer, (0, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS, EVEN_N)),
                (_dq_consumer, (1, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS, EVEN_N)),
                (_dq_consumer, (2, consumer_args, BLOCK_M, BLOCK_N, DP, STAGES, CONSUMERS, EVEN_N)),
                (_dq_producer, (producer_args, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


def _descriptor(t: torch.Tensor, rows: int, width: int, bound: bool):
    if bound:
        return BoundDescriptor(t, list(t.shape), list(t.stride()))
    return fwd_hopper.TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, width], _shared_layout(rows, width, t.dtype))


def dkdv_launch(q, k, v, do, dk, dv, lse, delta, scale: float, config: tuple[int, int, int, int] | None = None,
                bound: bool = False) -> tuple:
    """The dK/dV kernel's launch, ``(kernel, grid, runtime arguments, constexprs)``, into ``dk``
    and ``dv`` (laid out as k and v); ``lse`` and ``delta`` as the Triton backward's (fp32 (B, H,
    Nq), delta from its dQ kernel). ``config`` as :func:`config_for`'s; ``bound`` as
    :func:`sdpatch.kernels.flash_fwd_hopper.descriptors`'."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    block_m, block_n, stages, consumers = config or config_for(D)
    dp = padded(D)
    descs = [_descriptor(t, r, dp, bound) for t, r in ((q, block_m), (k, block_n), (v, block_n), (do, block_m),
                                                         (dk, block_n), (dv, block_n))]
    args = (*descs, lse, delta, scale, scale * 1.44269504, H, Nq, Nk)  # 1/ln 2
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, DP=dp, STAGES=stages, CONSUMERS=consumers,
                  CONSUMER_REGS=consumer_regs(consumers), num_warps=4)
    grid = (triton.cdiv(Nk, consumers * block_n) * B * H, 1, 1)
    return _attn_bwd_dkdv_hopper, grid, args, consts



def dq_launch(q, k, v, do, out, dq, lse, delta, scale: float, config: tuple[int, int, int, int] | None = None,
              bound: bool = False) -> tuple:
    """The dQ kernel's launch, as :func:`dkdv_launch`'s: dQ into ``dq`` (laid out as q), and delta =
    rowsum(dO * O) into ``delta`` (fp32 (B, H, Nq)) for the dK/dV kernel. ``config``: (BLOCK_M
    queries a consumer owns, BLOCK_N keys a step, STAGES, CONSUMERS)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    block_m, block_n, stages, consumers = config or dq_config_for(D)
    dp = padded(D)
    descs = [_descriptor(t, r, dp, bound) for t, r in ((q, block_m), (k, block_n), (v, block_n), (do, block_m),
                                                         (out, block_m), (dq, block_m))]
    args = (*descs, lse, delta, scale, scale * 1.44269504, H, Nq, Nk)  # 1/ln 2
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, DP=dp, STAGES=stages, CONSUMERS=consumers,
                  CONSUMER_REGS=consumer_regs(consumers), EVEN_N=Nk % block_n == 0, num_warps=4)
    grid = (triton.cdiv(Nq, consumers * block_m) * B * H, 1, 1)
    return _attn_bwd_dq_hopper, grid, args, consts
