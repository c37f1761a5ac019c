"""Hopper backward kernels in Gluon, warp-specialized as FlashAttention-3's: a producer warp streams Q
and dO tiles through TMA into a ring of shared-memory stages, and consumer warpgroups, each owning
BLOCK_N keys of the program's key block, run the four products of a query tile with asynchronous
warpgroup MMAs:

    S^T = K Q^T,  P^T = exp2(S^T * qk_scale - lse),  dP^T = V dO^T,
    dV += P^T dO,  dS^T = P^T * (dP^T - delta),  dK += dS^T Q.

P^T and dS^T feed their MMAs from registers (an accumulator's layout is an operand's, as in the
forward); K and V stay in shared memory for the whole loop, and dK and dV in registers. The MMA of
dP^T runs while P^T's exponentials do, and dV's while dS^T is formed.

Two kernels are built on this loop:

- the dK/dV kernel (:func:`dkdv_launch`), with dQ and delta = rowsum(dO * O) from a dQ kernel launched
  first (:func:`dq_launch`, or the Triton one of :mod:`.flash_bwd`), as in the two-pass backward: its
  warpgroups stay independent;
- the one-pass kernel (:func:`fused_launches`), FlashAttention-3's exchange: each consumer also writes
  its dS^T tile into a double-buffered shared tile, and on query tile i consumer i mod 2 computes that
  tile's dQ = dS K over every key of the program (one MMA, K from the consumers' buffers) and adds it,
  scaled, to an fp32 workspace by a TMA reduce-add; two mbarriers a buffer order the exchange. Five
  products a score tile instead of the two passes' seven. Triton launches around it compute delta
  and zero the workspace, then cast dQ into q's layout.

The head dim is padded to a power of two by TMA (boxes past D read zeros and write nothing); the
one-pass kernel's S^T and dP^T can reduce over its first :func:`mma_k` columns only. No attention mask;
fp16 and bf16; sm_90. :func:`serves` and :func:`one_pass_serves` say when the launch layer takes them.
"""

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from . import flash_fwd_hopper as fwd_hopper
from .flash_fwd_hopper import BoundDescriptor, _is_sm90, _shared_layout, gluon, layout_ok

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .flash_fwd_hopper import _tma_load, _tma_store

    _sync = getattr(gl, "thread_barrier", None) or gl.barrier  # the partition's warps (bar.sync); renamed in 3.7
    _tma_add = getattr(tma, "async_atomic_add", None)
    if _tma_add is None:  # triton 3.5-3.6: the builder's op, which later releases wrap as async_atomic_add
        from triton.experimental.gluon.language._core import builtin as _builtin
        from triton._C.libtriton import ir as _ir

        @_builtin
        def _tma_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

# Where the kernels may serve the backward's calls, both only where SDPATCH_GLUON_BWD=1: self-attention
# of at least MIN_KEYS keys and queries (at 77 keys a key block is most of the keys, and the Triton
# kernel's query splits fill the GPU). The one-pass kernel takes head dims up to
# ONE_PASS_MAX_HEAD_DIM (at 80 its padded 128-wide tiles spill and fill the shared memory) from
# ONE_PASS_MIN_TOKENS on: on an H100 it was 1.09x the Triton kernels' two passes at head dim 64 and
# 4096 tokens, even at 40, 0.96x at 64 and 1024 tokens (docs/benchmarks.md, "Backward leads", lead 6);
# its final form (the race fix and 48-wide products at head dim 40) has not run on a GPU yet. The
# dK/dV kernel takes the rest, head dims up to MAX_HEAD_DIM (a padded 256-wide tile would not fit the
# registers): it matched the Triton kernels at head dim 64 and trailed them at 40 and 80 (lead 4).
MIN_KEYS = 256
MAX_HEAD_DIM = 128
ONE_PASS_MAX_HEAD_DIM = 64
ONE_PASS_MIN_TOKENS = 2048
ENABLED = ONE_PASS = os.environ.get("SDPATCH_GLUON_BWD", "0") == "1"
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


def one_pass_serves(q, k, v, do, mask) -> bool:
    """Whether the backward's default call takes the one-pass kernel (:func:`fused_launches`). Not
    under ``torch.use_deterministic_algorithms``: its dQ adds land in any order, where the two passes
    add in a fixed one."""
    return (ONE_PASS and not _failed and q.shape[3] <= ONE_PASS_MAX_HEAD_DIM
            and min(q.shape[2], k.shape[2]) >= ONE_PASS_MIN_TOKENS and not torch.are_deterministic_algorithms_enabled()
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
            _tma_load(k_desc, [b, h, off_n + w * BLOCK_N, 0], bar, k_smem.slice(w * BLOCK_N, BLOCK_N, dim=2))
            _tma_load(v_desc, [b, h, off_n + w * BLOCK_N, 0], bar, v_smem.slice(w * BLOCK_N, BLOCK_N, dim=2))
        for i in range(gl.cdiv(N_Q, BLOCK_M)):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier's phase counts as complete
            bar = full.index(st)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, i * BLOCK_M, 0], bar, q_smem.index(st))
            _tma_load(do_desc, [b, h, i * BLOCK_M, 0], bar, do_smem.index(st))

    @gluon.jit
    def _reduce_head(a, b_rows, acc, BLOCK_M: gl.constexpr, DP: gl.constexpr, DK: gl.constexpr):
        """a (keys x DP) times b_rows^T (b_rows: BLOCK_M x DP, in shared memory) over the head dim's
        first DK columns (the rest are TMA's zeros), issued: one MMA where DK is a power of two, else
        two, over its largest power of two and the rest (48 = 32 + 16; shared-memory views take
        power-of-two shapes)."""
        b = b_rows.reshape([BLOCK_M, DP])
        LO: gl.constexpr = DK if DK & (DK - 1) == 0 else 1 << (DK.bit_length() - 1)
        tok = warpgroup_mma(a.slice(0, LO, dim=1), b.slice(0, LO, dim=1).permute((1, 0)), acc, use_acc=False,
                            is_async=True)
        if LO < DK:
            tok = warpgroup_mma(a.slice(LO, DK - LO, dim=1), b.slice(LO, DK - LO, dim=1).permute((1, 0)), tok,
                                is_async=True)
        return tok

    @gluon.jit
    def _issue_sdp(k_op, v_op, q_buf, do_buf, s_zero, BLOCK_M: gl.constexpr, DP: gl.constexpr, DK: gl.constexpr):
        """A query tile's S^T = K Q^T and dP^T = V dO^T over the head dim's first DK columns, issued;
        their tokens."""
        s_tok = _reduce_head(k_op, q_buf, s_zero, BLOCK_M, DP, DK)
        dp_tok = _reduce_head(v_op, do_buf, s_zero, BLOCK_M, DP, DK)
        return s_tok, dp_tok

    @gluon.jit
    def _dkdv_tile(i, k_op, v_op, q_smem, do_smem, full, s_zero, dk, dv, Lse, Delta, rows, offs_m, key_ok, qk_scale,
                   N_Q, BLOCK_M: gl.constexpr, DP: gl.constexpr, DK: gl.constexpr, STAGES: gl.constexpr,
                   op_layout: gl.constexpr, EVEN_N: gl.constexpr):
        """Query tile i, once its Q and dO are in the ring: S^T and dP^T (:func:`_issue_sdp`), P^T,
        then dV's MMA, dS^T, then dK's; returns their tokens, the register operands they read, which
        must live until they are waited for, and dS^T in the MMAs' layout. ``key_ok``: which of the
        warpgroup's keys are below N_K, read unless EVEN_N."""
        st = i % STAGES
        mbarrier.wait(full.index(st), (i // STAGES) & 1)
        q_buf = q_smem.index(st)
        do_buf = do_smem.index(st)
        s_tok, dp_tok = _issue_sdp(k_op, v_op, q_buf, do_buf, s_zero, BLOCK_M, DP, DK)
        dtype: gl.constexpr = q_buf.dtype
        # Queries past N_Q (zeros from TMA) take lse = +inf: their column of P^T, and of dS^T, is 0.
        m_valid = i * BLOCK_M + offs_m < N_Q
        lse = gl.load(Lse + rows + i * BLOCK_M + offs_m, mask=m_valid, other=float("inf"))
        delta = gl.load(Delta + rows + i * BLOCK_M + offs_m, mask=m_valid, other=0.0)
        s_t = warpgroup_mma_wait(1, deps=(s_tok, ))
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        if not EVEN_N:  # a key past N_K has zero K rows, but exp2(0 - lse) may overflow: 0 * inf in dQ
            p_t = gl.where(key_ok[:, None], p_t, 0.0)
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do_buf.reshape([BLOCK_M, DP]), dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_tok, ))
        ds = (p_t * (dp_t - delta[None, :])).to(dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        dk_tok = warpgroup_mma(ds_op, q_buf.reshape([BLOCK_M, DP]), dk, is_async=True)
        return dv_tok, dk_tok, p_op, ds_op, ds

    @gluon.jit
    def _key_rows(smem, WG: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr, CONSUMERS: gl.constexpr):
        """Warpgroup WG's BLOCK_N rows of a K or V buffer ([1, 1, CONSUMERS x BLOCK_N, DP]) as a 2-D
        operand: reshaped before it is sliced (a slice's view cannot be reshaped)."""
        return smem.reshape([CONSUMERS * BLOCK_N, DP]).slice(WG * BLOCK_N, BLOCK_N)

    @gluon.jit
    def _store_dkdv(dk, dv, k_smem, v_smem, dk_desc, dv_desc, b, h, off_n, sm_scale, WG: gl.constexpr,
                    BLOCK_N: gl.constexpr, DP: gl.constexpr, CONSUMERS: gl.constexpr):
        """dK and dV through TMA from warpgroup WG's K and V buffers, which no MMA may read any more;
        rows past N_K and columns past the head dim are not written."""
        dtype: gl.constexpr = dk_desc.dtype
        _key_rows(k_smem, WG, BLOCK_N, DP, CONSUMERS).store((dk * sm_scale).to(dtype))
        _key_rows(v_smem, WG, BLOCK_N, DP, CONSUMERS).store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [b, h, off_n, 0], k_smem.slice(WG * BLOCK_N, BLOCK_N, dim=2))
        _tma_store(dv_desc, [b, h, off_n, 0], v_smem.slice(WG * BLOCK_N, BLOCK_N, dim=2))
        tma.store_wait(pendings=0)

    @gluon.jit
    def _consumer(WG: gl.constexpr, args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr,
                  STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """Warpgroup WG: dK and dV of its BLOCK_N keys over every query tile."""
        (dk_desc, dv_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K, k_smem, v_smem, q_smem, do_smem, kv_bars, full,
         empty) = args
        bh, off_n = _owned_rows(N_K, BLOCK_N, CONSUMERS, WG)

        # S^T's and dP^T's MMA layout (keys x queries), dK's and dV's (keys x head dim); P^T and dS^T
        # enter the dK and dV MMAs as register operands.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DP, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)

        k_op = _key_rows(k_smem, WG, BLOCK_N, DP, CONSUMERS)
        v_op = _key_rows(v_smem, WG, BLOCK_N, DP, CONSUMERS)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([BLOCK_N, DP], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, DP], gl.float32, kv_layout)
        rows = bh.to(gl.int64) * N_Q
        offs_m = gl.arange(0, BLOCK_M, layout=cols)
        mbarrier.wait(kv_bars.index(WG), 0)

        for i in range(gl.cdiv(N_Q, BLOCK_M)):
            dv_tok, dk_tok, p_op, ds_op, _ = _dkdv_tile(i, k_op, v_op, q_smem, do_smem, full, s_zero, dk, dv, Lse,
                                                        Delta, rows, offs_m, offs_m, qk_scale, N_Q, BLOCK_M, DP, DP,
                                                        STAGES, op_layout, True)
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
            mbarrier.arrive(empty.index(i % STAGES))

        _store_dkdv(dk, dv, k_smem, v_smem, dk_desc, dv_desc, bh // H, bh % H, off_n, sm_scale, WG, BLOCK_N, DP,
                    CONSUMERS)

    @gluon.jit
    def _attn_bwd_dkdv_hopper(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr, STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        # A program: CONSUMERS x BLOCK_N keys of one (batch, head) (_owned_rows).
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        k_smem = gl.allocate_shared_memory(dtype, [1, 1, CONSUMERS * BLOCK_N, DP], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, CONSUMERS * BLOCK_N, DP], v_desc.layout)
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
    def _fused_consumer(WG: gl.constexpr, args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr,
                        DK: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, EVEN_N: gl.constexpr):
        """Warpgroup WG of the one-pass kernel: dK and dV of its BLOCK_N keys as :func:`_consumer`'s,
        each query tile's dS^T into shared memory beside the other warpgroups', and on query tiles
        i = WG (mod CONSUMERS) the tile's dQ over all the program's keys (dS K, one MMA of
        CONSUMERS x BLOCK_N keys), scaled, added to the fp32 workspace by a TMA reduce-add."""
        (dk_desc, dv_desc, dq_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K, k_smem, v_smem, q_smem, do_smem,
         ds_smem, dq_smem, kv_bars, full, empty, ds_ready, ds_free) = args
        bh, off_n = _owned_rows(N_K, BLOCK_N, CONSUMERS, WG)
        b = bh // H
        h = bh % H

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DP, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)

        k_op = _key_rows(k_smem, WG, BLOCK_N, DP, CONSUMERS)
        v_op = _key_rows(v_smem, WG, BLOCK_N, DP, CONSUMERS)
        k_all = k_smem.reshape([CONSUMERS * BLOCK_N, DP])  # every consumer's keys: dQ's B operand
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, DP], gl.float32, kv_layout)
        dk = gl.zeros([BLOCK_N, DP], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, DP], gl.float32, kv_layout)
        rows = bh.to(gl.int64) * N_Q
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        key_ok = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout)) < N_K - off_n
        mbarrier.wait(kv_bars.index(WG), 0)

        for i in range(gl.cdiv(N_Q, BLOCK_M)):
            dv_tok, dk_tok, p_op, ds_op, ds = _dkdv_tile(i, k_op, v_op, q_smem, do_smem, full, s_zero, dk, dv, Lse,
                                                         Delta, rows, offs_m, key_ok, qk_scale, N_Q, BLOCK_M, DP, DK,
                                                         STAGES, op_layout, EVEN_N)
            # dS^T into buffer i % 2, once tile i - 2's dQ has read it (a fresh barrier's phase counts
            # as complete); the warpgroup's writes are made visible to the MMAs' proxy before the
            # one thread that arrives says they are there.
            buf = i % 2
            mbarrier.wait(ds_free.index(buf), ((i // 2) & 1) ^ 1)
            ds_smem.index(buf).slice(WG * BLOCK_N, BLOCK_N).store(ds)
            fence_async_shared()
            _sync()
            mbarrier.arrive(ds_ready.index(buf))
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
            mbarrier.arrive(empty.index(i % STAGES))
            if i % CONSUMERS == WG:
                mbarrier.wait(ds_ready.index(buf), (i // 2) & 1)
                dq_tok = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_all, dq_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
                mbarrier.arrive(ds_free.index(buf))
                # The staging buffer's last add (two tiles back) has read it before it is written.
                tma.store_wait(pendings=0)
                _sync()
                stage = dq_smem.index(WG)
                stage.reshape([BLOCK_M, DP]).store(dq * sm_scale)
                fence_async_shared()
                _sync()
                _tma_add(dq_desc, [b, h, i * BLOCK_M, 0], stage)

        # dK and dV into the K and V buffers once the last tile's dQ MMA, which reads every consumer's
        # K, is done (tile n - 1's, on buffer (n - 1) % 2; the earlier tiles' dQ MMAs finished before
        # their buffers were written again); the stores' wait also drains this warpgroup's last dQ add.
        last = gl.cdiv(N_Q, BLOCK_M) - 1
        mbarrier.wait(ds_free.index(last % 2), (last // 2) & 1)
        _store_dkdv(dk, dv, k_smem, v_smem, dk_desc, dv_desc, b, h, off_n, sm_scale, WG, BLOCK_N, DP, CONSUMERS)

    @gluon.jit
    def _attn_bwd_hopper(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DP: gl.constexpr, DK: gl.constexpr, STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, EVEN_N: gl.constexpr, DS_LAYOUT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # The one-pass backward: a program, CONSUMERS x BLOCK_N keys of one (batch, head) (_owned_rows),
        # makes their dK and dV and adds their share of every query's dQ.
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        gl.static_assert(CONSUMERS == 2, "dQ's tiles alternate between two consumer warpgroups")
        k_smem = gl.allocate_shared_memory(dtype, [1, 1, CONSUMERS * BLOCK_N, DP], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, CONSUMERS * BLOCK_N, DP], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, DP], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, DP], do_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, CONSUMERS * BLOCK_N, BLOCK_M], DS_LAYOUT)
        dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 1, 1, BLOCK_M, DP], dq_desc.layout)
        kv_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(kv_bars.index(w), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(full.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        for s in gl.static_range(2):
            mbarrier.init(ds_ready.index(s), count=CONSUMERS)  # every consumer's dS^T is in
            mbarrier.init(ds_free.index(s), count=1)  # the tile's dQ MMA has read them

        consumer_args = (dk_desc, dv_desc, dq_desc, Lse, Delta, sm_scale, qk_scale, H, N_Q, N_K, k_smem, v_smem, q_smem,
                         do_smem, ds_smem, dq_smem, kv_bars, full, empty, ds_ready, ds_free)
        producer_args = (q_desc, k_desc, v_desc, do_desc, H, N_Q, N_K, k_smem, v_smem, q_smem, do_smem, kv_bars, full,
                         empty)
        gl.warp_specialize([
            (_fused_consumer, (0, consumer_args, BLOCK_M, BLOCK_N, DP, DK, STAGES, CONSUMERS, EVEN_N)),
            (_fused_consumer, (1, consumer_args, BLOCK_M, BLOCK_N, DP, DK, STAGES, CONSUMERS, EVEN_N)),
            (_producer, (producer_args, BLOCK_M, BLOCK_N, STAGES, CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, 24])

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


def _descriptor(t: torch.Tensor, rows: int, width: int, bound: bool, layout=None):
    """A TMA descriptor of ``t`` in tiles of (rows, width), in ``layout`` (default: the swizzled one for
    ``t``'s dtype), or with ``bound`` its :class:`BoundDescriptor`."""
    if bound:
        return BoundDescriptor(t, list(t.shape), list(t.stride()))
    return fwd_hopper.TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, width],
                                      layout or _shared_layout(rows, width, t.dtype))


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


PREP_ROWS = 64  # query rows a program of _bwd_prep and _bwd_dq_cast takes


@triton.jit
def _bwd_prep(Out, DO, Delta, Acc, stride_ob, stride_oh, stride_om, stride_od, stride_dob, stride_doh, stride_dom,
              stride_dod, H, N_Q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
              ACC_W: tl.constexpr):
    """The one-pass backward's first launch: delta = rowsum(dO * O), fp32 (B, H, Nq), and dQ's fp32
    workspace, (B, H, Nq, ACC_W), zeroed."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N_Q
    ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=ok, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=ok, other=0.0)
    row = bh.to(tl.int64) * N_Q + offs_m
    tl.store(Delta + row, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=m_ok)
    offs_w = tl.arange(0, BLOCK_D)
    tl.store(Acc + row[:, None] * ACC_W + offs_w[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
             mask=m_ok[:, None] & (offs_w < ACC_W)[None, :])


@triton.jit
def _bwd_dq_cast(Acc, DQ, stride_qb, stride_qh, stride_qm, stride_qd, H, N_Q, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC_W: tl.constexpr):
    """The one-pass backward's last launch: dQ from its fp32 workspace (already scaled), in q's dtype
    and layout."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m < N_Q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    row = bh.to(tl.int64) * N_Q + offs_m
    dq = tl.load(Acc + row[:, None] * ACC_W + offs_d[None, :], mask=ok, other=0.0)
    tl.store(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
             dq.to(DQ.dtype.element_ty), mask=ok)


def fused_config_for(head_dim: int) -> tuple[int, int, int, int]:
    """The one-pass kernel's (BLOCK_M, BLOCK_N, STAGES, CONSUMERS), as :func:`config_for`'s: three
    stages ran as fast as two on an H100 (benchmark doc, backward lead 6)."""
    return 64, 64, 3, 2


def accumulator_width(head_dim: int) -> int:
    """Columns of dQ's fp32 workspace: the head dim, to a 16-byte row (a TMA stride)."""
    return -(-head_dim // 4) * 4


@functools.lru_cache(maxsize=None)
def _ds_layout(rows: int, cols: int, dtype: torch.dtype):
    """The shared layout of the one-pass kernel's dS^T tiles (keys x queries)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float16 if dtype == torch.float16 else gl.bfloat16)


@functools.lru_cache(maxsize=None)
def _plain_layout():
    """An unswizzled shared layout for 4-D fp32 tiles: a TMA reduce-add takes a box as wide as the
    tile's row only without swizzling (a 128-byte swizzle caps a box at 32 fp32 columns)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)


def mma_k(head_dim: int) -> int:
    """The fewest head-dim columns S^T's and dP^T's MMAs can reduce over: the head dim to a multiple
    of 16 (one MMA step), 48 of the padded 64 at head dim 40. :func:`fused_launches` takes it as
    ``reduce_k``; by default they reduce over the padded width, the form measured on a GPU (the
    benchmark doc's backward lead 6)."""
    return -(-head_dim // 16) * 16


def fused_launches(q, k, v, do, out, dq, dk, dv, lse, scale: float, config: tuple[int, int, int, int] | None = None,
                   bound: bool = False, reduce_k: int | None = None) -> list[tuple]:
    """The one-pass backward's launches, each ``(kernel, grid, runtime arguments, constexprs)``:
    delta and the zeroed fp32 dQ workspace (:func:`_bwd_prep`, allocated here), the Gluon kernel
    (dK and dV into ``dk`` and ``dv``, dQ added to the workspace), and dQ's cast into ``dq``
    (:func:`_bwd_dq_cast`). ``config`` as :func:`fused_config_for`'s; ``bound`` as
    :func:`sdpatch.kernels.flash_fwd_hopper.descriptors`'; ``reduce_k``: the head-dim columns S^T's
    and dP^T's MMAs reduce over, from :func:`mma_k`'s to the padded head dim (the default)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    block_m, block_n, stages, consumers = config or fused_config_for(D)
    dp, acc_w = padded(D), accumulator_width(D)
    delta = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    acc = torch.empty(B, H, Nq, acc_w, device=q.device, dtype=torch.float32)
    descs = [_descriptor(t, r, dp, bound) for t, r in ((q, block_m), (k, block_n), (v, block_n), (do, block_m),
                                                         (dk, block_n), (dv, block_n))]
    descs.append(_descriptor(acc, block_m, dp, bound, _plain_layout()))
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, DP=dp, DK=reduce_k or dp, STAGES=stages, CONSUMERS=consumers,
                  CONSUMER_REGS=consumer_regs(consumers), EVEN_N=Nk % (consumers * block_n) == 0,
                  DS_LAYOUT=_ds_layout(consumers * block_n, block_m, q.dtype), num_warps=4)
    prep, cast = prep_and_cast(out, do, dq, delta, acc)
    return [prep, (_attn_bwd_hopper, (triton.cdiv(Nk, consumers * block_n) * B * H, 1, 1),
                   (*descs, lse, delta, scale, scale * 1.44269504, H, Nq, Nk), consts), cast]  # 1/ln 2


def prep_and_cast(out, do, dq, delta, acc) -> tuple[tuple, tuple]:
    """The launches of :func:`_bwd_prep` (delta, fp32 (B, H, Nq), and the zeroed workspace ``acc``,
    fp32 (B, H, Nq, :func:`accumulator_width`)) and of :func:`_bwd_dq_cast` (``acc`` into ``dq``,
    laid out as q), as :func:`fused_launches` has them."""
    B, H, Nq, D = out.shape
    acc_w = acc.shape[3]
    grid = (triton.cdiv(Nq, PREP_ROWS), B * H, 1)
    small = dict(HEAD_DIM=D, BLOCK_M=PREP_ROWS, BLOCK_D=max(16, triton.next_power_of_2(acc_w)), ACC_W=acc_w, num_warps=4)
    return ((_bwd_prep, grid, (out, do, delta, acc, *out.stride(), *do.stride(), H, Nq), small),
            (_bwd_dq_cast, grid, (acc, dq, *dq.stride(), H, Nq), small))
