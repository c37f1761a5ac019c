"""Hopper forward kernel in Gluon, warp-specialized as FlashAttention-3: a producer warp streams K and
V through TMA into a ring of shared-memory stages, and two or three consumer warpgroups, each on its
own query tile, take turns issuing their MMAs, so that one's softmax runs while the tensor cores
work on another's (ping-pong).

Triton keeps a program's dots and softmax in program order (measured on its kernels). Gluon exposes
what the compiler hides: asynchronous warpgroup MMAs with explicit waits, TMA copies and mbarriers,
and warp specialization with per-partition register budgets (``setmaxnreg``). Each consumer, per key
tile j: in its turn, issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} and pass the turn on; wait for S_j
and release K_j's stage; compute P_j; wait for P V and release V_{j-1}'s stage; rescale O. In fp16
the row sums come from the tensor cores too, P times a block of ones beside P V, rescaled as O is:
an add an element less. (ptxas waits for P V before P_j's exponentials whatever the program order:
it hands P_j the registers that P_{j-1}'s MMA reads. The turns overlap one warpgroup's softmax
with another's MMAs all the same.)

Q, K, V and O go through 4-D TMA descriptors over their (B, H, N, D) views, so any layout whose last
dim is contiguous works (diffusers' (B, N, H, D) memory included). Boxes past N or D read zeros and
write nothing: odd lengths need no masks but on the scores past N (every tile's, where the tile does
not divide the keys). A head dim that is not a power of two runs as two power-of-two parts, each
with its own descriptors and MMAs (40 = 32 + 16: 48 columns of work where padding would do 64;
:func:`sdpatch.kernels.shared.split_parts`).

A program holds an SM, so the grid runs in waves of query tiles; where the last wave would leave most
SMs idle, its tiles are split along the keys into pieces that fill it, and a small Triton kernel
merges the pieces by their log-sum-exps (:func:`tail_split`, :func:`_combine_pieces`). Where
the last wave is too full to split, some heads may take tiles of a consumer fewer, so that the SMs
finish together (:func:`tile_plan`). A consumer with no rows in its program's tile only hands
the K and V stages back.

sm_90 only, no attention mask, fp16 and bf16; :func:`hopper_fwd_ok` says when, :func:`serves` when
the launch layer (:func:`sdpatch.kernels.forward.flash_attn_fwd`) takes it; ``SDPATCH_GLUON=0`` turns it off. Gluon kernels do not run
under ``TRITON_INTERPRET``: CI compiles this one for sm_90, and the GPU checks run it against float64.
"""

import functools
import heapq
import logging
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .runtime import LAUNCHED, Binary, Plan, cached_plan, launch, launch_hooked, on_device, stands_aside
from .shared import SERVES, split_parts

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

# Where this kernel serves the launch layer's default calls (H200 measurements): self-attention of
# MIN_KEYS keys and more (at 77 keys the Triton kernel won: 45 against 49 TFLOP/s at hd40), on
# grids of MIN_PROGRAMS programs and more: a program takes 2-3 query tiles, and a grid under one
# wave of the H200's 132 SMs leaves SMs idle where the Triton kernel's smaller tiles fill them.
MIN_KEYS = 256
MIN_PROGRAMS = 128
MIN_PIECE_TILES = 4  # key tiles a piece of a split query tile takes at least (tail_split)
# A consumer's MMAs and its softmax run in series, so a program's time is that of max(its
# consumers with rows, SERIAL_CONSUMERS) consumers' MMAs (tile_plan). Measured at hd64 on an H200: 768
# tokens, B 2, H 20, took 21.2 us in 240 tiles of 128 rows and 24.5 in 160 of 192, both two waves:
# a tile of two consumers takes 0.865 of one of three's time, 2.6 consumers' MMAs.
SERIAL_CONSUMERS = 2.6
MIXED_MAX_WAVES = 4  # tile_plan searches grids of up to this many waves (past it, a wave is under 1/4 of the time)
MIXED_MIN_GAIN = 0.05  # and takes a plan its model says is at least this much faster than whole tiles
COMBINE_ROWS = 32  # rows a program of _combine_pieces merges
ENABLED = os.environ.get("SDPATCH_GLUON", "1") != "0"
_failed: list[str] = []  # a launch that raised: the Triton kernel serves every call after it


def config_for(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, CONSUMERS): a consumer warpgroup's query rows, the key tile, the K
    and V ring's stages, and consumer warpgroups a program, from CUDA-graph replay, TFLOP/s
    (``scripts/sweep_gluon_fwd.py``). Head dims up to 64: three consumers of 64 rows and 128-key
    tiles, FlashAttention-3's and -4's 192 x 128 tile (H100, 2026-12-07: hd40 16384 344 against 292
    for two consumers of 128 rows and 64-key tiles, hd40 4096 295 against 283; hd64 4096 466 against
    397, hd64 1024 378 against 293; 3 stages and 64-key tiles slower). Above: two of 64 rows and
    128-key tiles (H200: hd80 4096 453 against 263 for three, which spill; hd160 1024 548-557 against
    508 for 64-key tiles), and 64-key tiles past 160, whose 128-key stages would not fit in shared
    memory."""
    if head_dim <= 64:
        return 64, 128, 2, 3
    return (64, 128, 2, 2) if head_dim <= 160 else (64, 64, 2, 2)


def consumer_regs(consumers: int) -> int:
    """Registers a consumer thread gets (``setmaxnreg``): an SM's 64K over 128-thread warpgroups,
    the producer's one warp holding a warpgroup's slot at 24 (240 for two consumers, 160 for three)."""
    return (65536 // 128 - 24) // consumers // 8 * 8


def tail_split(tiles: int, sms: int, key_tiles: int) -> tuple[int, int]:
    """(whole, splits): the grid's first ``whole`` query tiles each take all their keys in one
    program; every later tile takes ``splits`` programs, each a share of its key tiles, and
    :func:`_combine_pieces` merges their results.

    A program holds an SM (its warpgroups take the register file), so the grid runs in waves of
    ``sms`` tiles, and a last wave of a few tiles leaves the other SMs idle for a whole tile's time:
    hd64 at 4096 tokens (B 2, H 10) is 440 tiles of 192 rows, three waves and 44. Split in
    three, those 44 tiles are 132 programs of a third of a tile's time. Nothing is split under one
    wave, where the last wave is over half full, or into pieces of under :data:`MIN_PIECE_TILES`."""
    if sms <= 0 or tiles < sms or tiles % sms == 0:
        return tiles, 1
    rem = tiles % sms
    splits = min(sms // rem, key_tiles // MIN_PIECE_TILES)
    return (tiles - rem, splits) if splits >= 2 else (tiles, 1)


def tile_cost(active: int, consumers: int) -> float:
    """A program's time with ``active`` of its ``consumers`` warpgroups holding rows, as a share of
    a whole tile's (:data:`SERIAL_CONSUMERS`)."""
    return max(active, SERIAL_CONSUMERS) / max(consumers, SERIAL_CONSUMERS)


@functools.lru_cache(maxsize=1024)
def _head_costs(n_q: int, block_m: int, consumers: int, big: int, small: int) -> tuple[tuple, tuple]:
    """The costs of a head's ``big`` tiles of ``consumers`` x ``block_m`` rows and of the ``small``
    tiles of a consumer fewer after them; the last may have consumers past ``n_q``."""
    costs, row = [], 0
    for rows in [consumers * block_m] * big + [(consumers - 1) * block_m] * small:
        costs.append(tile_cost(min(rows, n_q - row + block_m - 1) // block_m, consumers))
        row += rows
    return tuple(costs[:big]), tuple(costs[big:])


def plan_time(plan: tuple, heads: int, n_q: int, sms: int, block_m: int, consumers: int) -> float:
    """A :func:`tile_plan` plan's time in whole tiles' time, as the hardware dispatches a grid:
    each program, in grid order, to the first SM free (:func:`tile_cost` a program)."""
    heads1, big1, small1, big2, small2 = plan
    bigs1, smalls1 = _head_costs(n_q, block_m, consumers, big1, small1)
    bigs2, smalls2 = _head_costs(n_q, block_m, consumers, big2, small2)
    n2 = heads - heads1
    free = [0.0] * sms
    for c in bigs1 * heads1 + bigs2 * n2 + smalls1 * heads1 + smalls2 * n2:
        heapq.heapreplace(free, free[0] + c)
    return max(free)


@functools.lru_cache(maxsize=256)
def tile_plan(heads: int, n_q: int, sms: int, block_m: int, consumers: int) -> tuple[int, int, int, int, int]:
    """(HEADS1, BIG1, SMALL1, BIG2, SMALL2): the grid's query tiles. The first HEADS1 of the
    ``heads`` (batch x head) pairs each take BIG1 tiles of ``consumers`` x ``block_m`` rows, then
    SMALL1 tiles of a consumer fewer; the others BIG2 and SMALL2. The grid holds every big tile,
    then every small one.

    Where the grid's last wave is neither full nor short enough for :func:`tail_split`, SMs idle
    for a tile's time at its end: hd64 at 1024 tokens (B 2, H 20) is 240 tiles of 192 rows, 1.82
    waves. As 7 heads of eight 128-row tiles and 33 of four 192-row and two 128-row ones, it is
    132 tiles of 192 rows and 122 of 128, one of each an SM: 1.87 tiles' time, not 2; measured,
    28.7 us against 30.6. Searched over one or two kinds of head, by :func:`plan_time`;
    whole tiles, (heads, tiles a head, 0, 0, 0), unless a plan is :data:`MIXED_MIN_GAIN` faster."""
    tile = consumers * block_m
    m_tiles = -(-n_q // tile)
    whole = (heads, m_tiles, 0, 0, 0)
    tiles = heads * m_tiles
    if sms <= 0 or tiles <= sms or tiles > MIXED_MAX_WAVES * sms or tile_cost(consumers - 1, consumers) >= 1:
        return whole
    # (big, small) tiles a head, of every way to cover n_q rows with no tile to spare
    kinds = [(big, -(-max(n_q - big * tile, 0) // (tile - block_m))) for big in range(m_tiles + 1)]
    plans = [(heads, *kind, 0, 0) for kind in kinds]  # every head alike, or two kinds of head
    plans += [(heads1, *a, *b) for a in kinds for b in kinds if a < b for heads1 in range(1, heads)]
    best, best_time = whole, plan_time(whole, heads, n_q, sms, block_m, consumers) * (1 - MIXED_MIN_GAIN)
    for plan in plans:
        t = plan_time(plan, heads, n_q, sms, block_m, consumers)
        if t < best_time:
            best, best_time = plan, t
    return best


class Grid(NamedTuple):
    """How a launch lays its query tiles over the SMs (:func:`grid_for`)."""

    plan: tuple[int, int, int, int, int]  # :func:`tile_plan`'s (whole tiles where the grid is split)
    whole: int  # programs that each take a whole tile's keys
    splits: int  # programs each later tile is split into (:func:`tail_split`), 1 where none is
    pieces: int  # those programs, after the whole ones

    @property
    def mixed(self) -> bool:
        """Whether some tiles are a consumer smaller."""
        return self.plan[2] + self.plan[4] > 0


def grid_for(heads: int, n_q: int, n_k: int, sms: int, config: tuple[int, int, int, int]) -> Grid:
    """The grid over ``sms`` SMs (0: whole tiles, none split) for ``heads`` (batch x head) pairs
    of ``n_q`` queries and ``n_k`` keys, with :func:`config_for`'s tiles: a short last wave split
    (:func:`tail_split`), else :func:`tile_plan`'s tiles."""
    block_m, block_n, _, consumers = config
    m_tiles = triton.cdiv(n_q, consumers * block_m)
    tiles = m_tiles * heads
    whole, splits = tail_split(tiles, sms, triton.cdiv(n_k, block_n))
    if splits > 1:  # the pieces' tiles are whole ones
        return Grid((heads, m_tiles, 0, 0, 0), whole, splits, (tiles - whole) * splits)
    plan = tile_plan(heads, n_q, sms, block_m, consumers)
    heads1, big1, small1, big2, small2 = plan
    return Grid(plan, heads1 * (big1 + small1) + (heads - heads1) * (big2 + small2), 1, 0)


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """The CUDA device's SM count (an index or a ``torch.device``); the backward's launcher takes it too."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _combine_pieces(
    Part_O, Part_L, Out, Lse,
    stride_ob, stride_oh, stride_om,
    H, N_Q, M_TILES, N_FULL, SPLITS,
    TILE_M: tl.constexpr, DW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """BLOCK_R rows of split tile N_FULL + program_id(0) from its SPLITS pieces (Part_O: each
    piece's TILE_M x DW rows, normalized over its keys, in fp32; Part_L: their base-2 log-sum-exps):
    O = sum_s 2^(lse_s - lse) O_s, lse = log2(sum_s 2^lse_s). Out's last dim is contiguous, as
    TMA has it for the Gluon kernel's."""
    u = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    first = u * SPLITS  # the tile's first piece
    lse_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(Part_L + (first + s) * TILE_M + offs_r))
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        rows = (first + s) * TILE_M + offs_r
        w = tl.exp2(tl.load(Part_L + rows) - lse_max)
        part = tl.load(Part_O + rows[:, None] * DW + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        total += w
        acc += w[:, None] * part
    tile = N_FULL + u
    bh = tile // M_TILES
    offs_m = tile % M_TILES * TILE_M + offs_r
    keep = offs_m < N_Q
    out = Out + (bh // H).to(tl.int64) * stride_ob + (bh % H).to(tl.int64) * stride_oh
    tl.store(out + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :], (acc / total[:, None]).to(Out.dtype.element_ty),
             mask=keep[:, None] & (offs_d[None, :] < HEAD_DIM))
    if STORE_LSE:
        tl.store(Lse + bh.to(tl.int64) * N_Q + offs_m, lse_max + tl.log2(total), mask=keep)


@functools.lru_cache(maxsize=None)
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def layout_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> bool:
    """Whether the kernel takes these inputs: no mask, fp16 or bf16, a head dim up to 256, and what
    TMA needs (16-byte aligned bases and strides, the last dim contiguous)."""
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return False
    if q.shape[3] > SERVES.max_head_dim:
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
    block_m, _, _, consumers = config_for(D)
    return (on() and k.shape[2] >= MIN_KEYS and triton.cdiv(Nq, block_m * consumers) * B * H >= MIN_PROGRAMS
            and hopper_fwd_ok(q, k, v, mask))


def splits_wave(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call's grid (:func:`grid_for`) splits its last wave: a second launch and a
    workspace, which cost an eager call host time."""
    B, H, Nq, D = q.shape
    return grid_for(B * H, Nq, k.shape[2], sm_count(q.get_device()), config_for(D)).pieces > 0


def disable(err: Exception) -> None:
    """After a launch that raised (a Gluon API this triton lacks, say): the Triton kernel from now on."""
    _failed.append(f"{type(err).__name__}: {err}")
    log.warning("sdpatch: the Gluon Hopper kernel failed (%s); the Triton kernel serves from now on", _failed[-1])


if gluon is not None:

    @gluon.jit
    def _scores_tail(scores, start, N_K, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Keys past N_K (zeros from TMA) out of the softmax."""
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        return gl.where((offs_n < N_K - start)[None, :], scores, float("-inf"))

    @gluon.jit
    def _load_tile(desc, hi_desc, b, h, row, D_LO: gl.constexpr, SPLIT: gl.constexpr, bar, smem, hi_smem):
        """A tile's column parts, both onto one barrier."""
        if SPLIT:
            mbarrier.expect(bar, desc.block_type.nbytes + hi_desc.block_type.nbytes)
            _tma_load(desc, [b, h, row, 0], bar, smem)
            _tma_load(hi_desc, [b, h, row, D_LO], bar, hi_smem)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes)
            _tma_load(desc, [b, h, row, 0], bar, smem)

    @gluon.jit
    def _work(work, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr, TAIL: gl.constexpr,
              MIXED: gl.constexpr):
        """This program's work: (batch x head, first query row, consumers with rows, first key tile,
        key tiles past its last, piece). Programs under N_FULL take a whole query tile's keys (piece
        < 0); with TAIL, each later one a piece of a tile's key tiles, SPLITS pieces a tile
        (:func:`tail_split`). Tiles are numbered as :func:`tile_plan` lays them out: the big ones
        (CONSUMERS x BLOCK_M rows), HEADS1 heads' BIG1 each and the other heads' BIG2, then the
        small ones (a consumer fewer), SMALL1 and SMALL2 a head, after each head's big ones. Only
        MIXED plans have small tiles, and consumers with no rows: whole ones (BIG1 a head) give
        every consumer rows, TMA reading zeros past N."""
        N_Q, N_K, N_FULL, SPLITS, HEADS, HEADS1, BIG1, SMALL1, BIG2, SMALL2 = work
        pid = gl.program_id(0)
        tile = pid
        piece = pid - N_FULL
        key_tiles = gl.cdiv(N_K, BLOCK_N)
        j0 = 0
        j1 = key_tiles
        if TAIL:  # branchless: programs under N_FULL take piece 0 of 1
            is_piece = (piece >= 0).to(gl.int32)
            own = piece * is_piece
            tile = pid + is_piece * (N_FULL + own // SPLITS - pid)
            splits = 1 + is_piece * (SPLITS - 1)
            j0 = own % SPLITS * key_tiles // splits
            j1 = (own % SPLITS + 1) * key_tiles // splits
        if not MIXED:
            return tile // BIG1, tile % BIG1 * (CONSUMERS * BLOCK_M), CONSUMERS, j0, j1, piece
        # The tile's segment: big or small, of the first heads or the others (branchless too).
        bigs1 = HEADS1 * BIG1
        bigs = bigs1 + (HEADS - HEADS1) * BIG2
        small = (tile >= bigs).to(gl.int32)
        u = tile - small * bigs
        per1 = BIG1 + small * (SMALL1 - BIG1)
        per2 = BIG2 + small * (SMALL2 - BIG2)
        second = (u >= HEADS1 * per1).to(gl.int32)
        u -= second * HEADS1 * per1
        per = per1 + second * (per2 - per1)
        row0 = small * (BIG1 + second * (BIG2 - BIG1)) * (CONSUMERS * BLOCK_M) + u % per * ((CONSUMERS - small) * BLOCK_M)
        active = gl.minimum(CONSUMERS - small, gl.cdiv(N_Q - row0, BLOCK_M))
        return second * HEADS1 + u // per, row0, active, j0, j1, piece

    @gluon.jit
    def _producer(args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_LO: gl.constexpr, SPLIT: gl.constexpr,
                  STAGES: gl.constexpr, CONSUMERS: gl.constexpr, TAIL: gl.constexpr, MIXED: gl.constexpr):
        """One warp: every consumer's Q tile, then K and V tiles into the ring as its stages come free."""
        (q_desc, k_desc, v_desc, q_hi_desc, k_hi_desc, v_hi_desc, H, work, q_smem, k_smem, v_smem, q_hi_smem, k_hi_smem,
         v_hi_smem, q_bars, k_full, v_full, k_empty, v_empty) = args
        bh, row0, active, j0, j1, _ = _work(work, BLOCK_M, BLOCK_N, CONSUMERS, TAIL, MIXED)
        b = bh // H
        h = bh % H
        for w in gl.static_range(CONSUMERS):
            if w < active:
                _load_tile(q_desc, q_hi_desc, b, h, row0 + w * BLOCK_M, D_LO, SPLIT, q_bars.index(w), q_smem.index(w),
                           q_hi_smem.index(w))
        for i in range(j1 - j0):
            st = i % STAGES
            free = ((i // STAGES) & 1) ^ 1  # a fresh barrier's phase before its first counts as complete
            mbarrier.wait(k_empty.index(st), free)
            _load_tile(k_desc, k_hi_desc, b, h, (j0 + i) * BLOCK_N, D_LO, SPLIT, k_full.index(st), k_smem.index(st),
                       k_hi_smem.index(st))
            mbarrier.wait(v_empty.index(st), free)
            _load_tile(v_desc, v_hi_desc, b, h, (j0 + i) * BLOCK_N, D_LO, SPLIT, v_full.index(st), v_smem.index(st),
                       v_hi_smem.index(st))

    @gluon.jit
    def _issue_s(q_op, q_hi_op, k_smem, k_hi_smem, s_zero, BLOCK_N: gl.constexpr, D_LO: gl.constexpr,
                 D_HI: gl.constexpr):
        """S = Q K^T over each head-dim part, one MMA group each; returns the last one's token."""
        s_tok = warpgroup_mma(q_op, k_smem.reshape([BLOCK_N, D_LO]).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if D_HI > 0:
            s_tok = warpgroup_mma(q_hi_op, k_hi_smem.reshape([BLOCK_N, D_HI]).permute((1, 0)), s_tok, is_async=True)
        return s_tok

    @gluon.jit
    def _issue_pv(p_op, v_smem, v_hi_smem, ones_smem, acc, acc_hi, acc_l, BLOCK_N: gl.constexpr, D_LO: gl.constexpr,
                  D_HI: gl.constexpr, ROWSUM_MMA: gl.constexpr, p_hi_layout: gl.constexpr, p_l_layout: gl.constexpr):
        """O += P V over each head-dim part, and (ROWSUM_MMA) l += P times ones, its every column a
        row sum: one MMA group each. Returns their tokens and the operands they read."""
        o_tok = warpgroup_mma(p_op, v_smem.reshape([BLOCK_N, D_LO]), acc, is_async=True)
        if D_HI > 0:
            p_hi_op = gl.convert_layout(p_op, p_hi_layout)
            o_hi_tok = warpgroup_mma(p_hi_op, v_hi_smem.reshape([BLOCK_N, D_HI]), acc_hi, is_async=True)
        else:  # stand-ins, never waited for
            p_hi_op = p_op
            o_hi_tok = o_tok
        if ROWSUM_MMA:
            p_l_op = gl.convert_layout(p_op, p_l_layout)
            l_tok = warpgroup_mma(p_l_op, ones_smem.permute((1, 0)), acc_l, is_async=True)
        else:
            p_l_op = p_op
            l_tok = o_tok
        return o_tok, o_hi_tok, l_tok, p_hi_op, p_l_op

    @gluon.jit
    def _wait_pv(o_tok, o_hi_tok, l_tok, p_op, p_hi_op, p_l_op, acc_hi, acc_l, D_HI: gl.constexpr,
                 ROWSUM_MMA: gl.constexpr):
        """_issue_pv's results. P's registers stay in deps: they must outlive the MMAs that read them."""
        acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        if D_HI > 0:
            acc_hi, p_hi_op = warpgroup_mma_wait(0, deps=(o_hi_tok, p_hi_op))
        if ROWSUM_MMA:
            acc_l, p_l_op = warpgroup_mma_wait(0, deps=(l_tok, p_l_op))
        return acc, acc_hi, acc_l

    @gluon.jit
    def _consumer(WG: gl.constexpr, args, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_LO: gl.constexpr,
                  D_HI: gl.constexpr, STAGES: gl.constexpr, STORE_LSE: gl.constexpr, EVEN_N: gl.constexpr,
                  CONSUMERS: gl.constexpr, TAIL: gl.constexpr, MIXED: gl.constexpr):
        """Warpgroup WG: its BLOCK_M rows of the program's tile (:func:`_attend`), or, where the tile
        has none for it, the K and V stages handed back as they fill, which the producer counts
        on (the barriers count every consumer)."""
        (_, _, _, _, _, _, _, work, _, _, _, _, _, _, _, k_full, v_full, k_empty, v_empty, _, _) = args
        pid_bh, row0, active, j0, j1, piece = _work(work, BLOCK_M, BLOCK_N, CONSUMERS, TAIL, MIXED)
        if WG < active:
            _attend(WG, args, pid_bh, row0 + WG * BLOCK_M, active, j0, j1, piece, BLOCK_M, BLOCK_N, D_LO, D_HI, STAGES,
                    STORE_LSE, EVEN_N, CONSUMERS, TAIL)
        else:
            for j in range(j1 - j0):
                st = j % STAGES
                mbarrier.wait(k_full.index(st), (j // STAGES) & 1)
                mbarrier.arrive(k_empty.index(st))
                mbarrier.wait(v_full.index(st), (j // STAGES) & 1)
                mbarrier.arrive(v_empty.index(st))

    @gluon.jit
    def _attend(WG: gl.constexpr, args, pid_bh, off_m, active, j0, j1, piece, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, D_LO: gl.constexpr, D_HI: gl.constexpr, STAGES: gl.constexpr,
                STORE_LSE: gl.constexpr, EVEN_N: gl.constexpr, CONSUMERS: gl.constexpr, TAIL: gl.constexpr):
        """Warpgroup WG's BLOCK_M query rows from off_m over the program's key tiles, the turns
        passed among the ``active`` consumers with rows. Per key tile j: in its turn, issue S_j =
        Q K_j^T and O += P_{j-1} V_{j-1} and hand the turn on; wait for S_j, release K_j, compute
        P_j; wait for P V, release V_{j-1}, rescale O."""
        (o_desc, o_hi_desc, Lse, Part_O, Part_L, qk_scale, N_Q, work, q_smem, k_smem, v_smem, q_hi_smem, k_hi_smem,
         v_hi_smem, q_bars, k_full, v_full, k_empty, v_empty, turns, ones_smem) = args
        SPLIT: gl.constexpr = D_HI > 0
        N_K = work[1]
        b = pid_bh // o_desc.shape[1]
        h = pid_bh % o_desc.shape[1]
        n_tiles = j1 - j0
        dtype: gl.constexpr = o_desc.dtype

        # S's, O's and l's MMA layouts differ only in N; P feeds the P V MMAs from registers.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D_LO, 16])
        # Unsplit head dims (D_HI = 0) keep an 8-wide stand-in for the second part, never computed.
        o_hi_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, max(D_HI, 8), 16])
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 8, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        p_hi_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_hi_layout, k_width=2)
        p_l_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        # fp16: the row sums from the tensor cores, of P as P V takes it (rounded to fp16: 2^-11).
        # bf16 rounds to 2^-8, and such sums moved the log-sum-exp 1.4e-3 from the Triton kernel's
        # (measured on an H200), so bf16 adds the fp32 P.
        ROWSUM_MMA: gl.constexpr = dtype == gl.float16
        PV_GROUPS: gl.constexpr = 1 + SPLIT + ROWSUM_MMA  # MMA groups behind S_j: P V's parts, the row sums

        q_op = q_smem.index(WG).reshape([BLOCK_M, D_LO])
        if SPLIT:
            q_hi_op = q_hi_smem.index(WG).reshape([BLOCK_M, D_HI])
        else:
            q_hi_op = q_op
        my_turn = turns.index(WG)
        next_turn = turns.index((WG + 1) % active)
        if WG == active - 1:  # the first turn is the first consumer's
            mbarrier.arrive(turns.index(0))

        # -- tile 0: its scores, then its softmax ------------------------------------------------
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_bars.index(WG), 0)
        mbarrier.wait(k_full.index(0), 0)
        mbarrier.wait(my_turn, 0)
        s_tok = _issue_s(q_op, q_hi_op, k_smem.index(0), k_hi_smem.index(0), s_zero, BLOCK_N, D_LO, D_HI)
        mbarrier.arrive(next_turn)
        scores = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(0))
        if (j0 + 1) * BLOCK_N > N_K:
            scores = _scores_tail(scores, j0 * BLOCK_N, N_K, BLOCK_N, s_layout)
        # The scale goes inside exp2 (one FMA an element): qk_scale = softmax scale / ln 2.
        m_i = gl.max(scores, axis=1) * qk_scale
        p = gl.exp2(scores * qk_scale - m_i[:, None])
        if not ROWSUM_MMA:
            l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = gl.zeros([BLOCK_M, D_LO], gl.float32, o_layout)
        acc_hi = gl.zeros([BLOCK_M, max(D_HI, 8)], gl.float32, o_hi_layout)
        acc_l = gl.zeros([BLOCK_M, 8], gl.float32, l_layout)

        for j in range(1, n_tiles):
            st = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_full.index(st), (j // STAGES) & 1)
            mbarrier.wait(my_turn, j & 1)
            s_tok = _issue_s(q_op, q_hi_op, k_smem.index(st), k_hi_smem.index(st), s_zero, BLOCK_N, D_LO, D_HI)
            mbarrier.wait(v_full.index(prev), ((j - 1) // STAGES) & 1)
            o_tok, o_hi_tok, l_tok, p_hi_op, p_l_op = _issue_pv(p_op, v_smem.index(prev), v_hi_smem.index(prev),
                                                                ones_smem, acc, acc_hi, acc_l, BLOCK_N, D_LO, D_HI,
                                                                ROWSUM_MMA, p_hi_layout, p_l_layout)
            mbarrier.arrive(next_turn)
            scores = warpgroup_mma_wait(PV_GROUPS, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(st))
            # No branch in the loop (a branch had ptxas wait for P V before the softmax): key
            # lengths that tiles do not divide mask every tile.
            if not EVEN_N:
                scores = _scores_tail(scores, (j0 + j) * BLOCK_N, N_K, BLOCK_N, s_layout)
            m_new = gl.maximum(m_i, gl.max(scores, axis=1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(scores * qk_scale - m_new[:, None])
            if not ROWSUM_MMA:
                l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc, acc_hi, acc_l = _wait_pv(o_tok, o_hi_tok, l_tok, p_op, p_hi_op, p_l_op, acc_hi, acc_l, D_HI, ROWSUM_MMA)
            mbarrier.arrive(v_empty.index(prev))
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            if SPLIT:
                acc_hi = acc_hi * gl.convert_layout(alpha, gl.SliceLayout(1, o_hi_layout))[:, None]
            if ROWSUM_MMA:
                acc_l = acc_l * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]

        # -- the last tile's P V, then the epilogue ----------------------------------------------
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_full.index(last), ((n_tiles - 1) // STAGES) & 1)
        mbarrier.wait(my_turn, n_tiles & 1)
        o_tok, o_hi_tok, l_tok, p_hi_op, p_l_op = _issue_pv(p_op, v_smem.index(last), v_hi_smem.index(last), ones_smem,
                                                            acc, acc_hi, acc_l, BLOCK_N, D_LO, D_HI, ROWSUM_MMA,
                                                            p_hi_layout, p_l_layout)
        mbarrier.arrive(next_turn)
        acc, acc_hi, acc_l = _wait_pv(o_tok, o_hi_tok, l_tok, p_op, p_hi_op, p_l_op, acc_hi, acc_l, D_HI, ROWSUM_MMA)
        mbarrier.arrive(v_empty.index(last))
        if ROWSUM_MMA:
            l_i = gl.max(acc_l, axis=1)  # all 8 columns hold it

        out = acc / gl.convert_layout(l_i, o_rows)[:, None]
        out_hi = acc_hi / gl.convert_layout(l_i, gl.SliceLayout(1, o_hi_layout))[:, None]
        lse = m_i + gl.log2(gl.convert_layout(l_i, gl.SliceLayout(1, s_layout)))  # base 2, of the scaled scores
        if TAIL:
            if piece >= 0:
                _store_piece(out, out_hi, lse, Part_O, Part_L, piece * CONSUMERS + WG, BLOCK_M, D_LO, D_HI, s_layout)
            else:
                _store_out(out, out_hi, lse, o_desc, o_hi_desc, Lse, q_smem.index(WG), q_hi_smem.index(WG), b, h,
                           pid_bh, off_m, N_Q, BLOCK_M, D_LO, D_HI, STORE_LSE, s_layout)
        else:
            _store_out(out, out_hi, lse, o_desc, o_hi_desc, Lse, q_smem.index(WG), q_hi_smem.index(WG), b, h, pid_bh,
                       off_m, N_Q, BLOCK_M, D_LO, D_HI, STORE_LSE, s_layout)

    @gluon.jit
    def _store_out(out, out_hi, lse, o_desc, o_hi_desc, Lse, o_smem, o_hi_smem, b, h, pid_bh, off_m, N_Q,
                   BLOCK_M: gl.constexpr, D_LO: gl.constexpr, D_HI: gl.constexpr, STORE_LSE: gl.constexpr,
                   s_layout: gl.constexpr):
        """A whole tile's epilogue: O through TMA from the consumer's Q buffers (every MMA that read
        them is done), and the log-sum-exp, as the Triton kernel stores it."""
        o_smem.reshape([BLOCK_M, D_LO]).store(out.to(o_desc.dtype))
        if D_HI > 0:
            o_hi_smem.reshape([BLOCK_M, D_HI]).store(out_hi.to(o_desc.dtype))
        fence_async_shared()
        _tma_store(o_desc, [b, h, off_m, 0], o_smem)
        if D_HI > 0:  # columns past the head dim are not written
            _tma_store(o_hi_desc, [b, h, off_m, D_LO], o_hi_smem)
        if STORE_LSE:
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            gl.store(Lse + pid_bh.to(gl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _store_piece(out, out_hi, lse, Part_O, Part_L, block, BLOCK_M: gl.constexpr, D_LO: gl.constexpr,
                     D_HI: gl.constexpr, s_layout: gl.constexpr):
        """A piece's epilogue: its rows of O, normalized over its keys, in fp32, and their
        log-sum-exp, as block ``block`` of BLOCK_M rows of the workspace :func:`_combine_pieces` reads."""
        DW: gl.constexpr = D_LO + D_HI
        o_layout: gl.constexpr = out.type.layout
        rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, D_LO, layout=gl.SliceLayout(0, o_layout))
        gl.store(Part_O + rows[:, None] * DW + cols[None, :], out)
        if D_HI > 0:
            o_hi_layout: gl.constexpr = out_hi.type.layout
            rows_hi = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_hi_layout))
            cols_hi = D_LO + gl.arange(0, D_HI, layout=gl.SliceLayout(0, o_hi_layout))
            gl.store(Part_O + rows_hi[:, None] * DW + cols_hi[None, :], out_hi)
        gl.store(Part_L + block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)), lse)

    @gluon.jit
    def _attn_fwd_hopper(
        q_desc, k_desc, v_desc, o_desc, q_hi_desc, k_hi_desc, v_hi_desc, o_hi_desc, Lse, Part_O, Part_L,
        qk_scale, H, N_Q, N_K, N_FULL, SPLITS, HEADS, HEADS1, BIG1, SMALL1, BIG2, SMALL2,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_LO: gl.constexpr, D_HI: gl.constexpr,
        STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, STORE_LSE: gl.constexpr,
        EVEN_N: gl.constexpr, TAIL: gl.constexpr, MIXED: gl.constexpr, num_warps: gl.constexpr,
    ):
        # The head dim in two power-of-two column parts, D_LO + D_HI (40 = 32 + 16, 80 = 64 + 16,
        # 160 = 128 + 32), each MMA once per part; D_HI = 0: one part, and the *_hi descriptors
        # are None. A query tile: CONSUMERS x BLOCK_M rows of one (batch, head), or a consumer fewer
        # (:func:`tile_plan`); a program takes a tile's keys, or with TAIL a piece of them (_work,
        # :func:`tail_split`).
        SPLIT: gl.constexpr = D_HI > 0
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")

        # -- shared memory: each consumer's Q (later its O), a ring of K and V stages, barriers ---
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, D_LO], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_LO], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_LO], v_desc.layout)
        if SPLIT:
            q_hi_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, D_HI], q_hi_desc.layout)
            k_hi_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_HI], k_hi_desc.layout)
            v_hi_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, D_HI], v_hi_desc.layout)
        else:  # partitions take no None: the first part's buffers and descriptors stand in, never read
            q_hi_smem = q_smem
            k_hi_smem = k_smem
            v_hi_smem = v_smem
            q_hi_desc = q_desc
            k_hi_desc = k_desc
            v_hi_desc = v_desc
            o_hi_desc = o_desc
        if not STORE_LSE:
            Lse = qk_scale
        if not TAIL:
            Part_O = qk_scale
            Part_L = qk_scale
        # Ones for the row sums' MMA, K-major as K is (the MMAs read them transposed).
        ones_smem = gl.allocate_shared_memory(
            dtype, [8, BLOCK_N], gl.NVMMASharedLayout(swizzle_byte_width=min(2 * BLOCK_N, 128), element_bitwidth=16,
                                                      rank=2),
            gl.full([8, BLOCK_N], 1.0, dtype, gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])))
        fence_async_shared()
        q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(q_bars.index(w), count=1)
            mbarrier.init(turns.index(w), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_full.index(s), count=1)
            mbarrier.init(v_full.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=CONSUMERS)  # one arrival from each consumer
            mbarrier.init(v_empty.index(s), count=CONSUMERS)

        # The partitions' runtime arguments as tuples; their constexprs written out in each entry (a
        # tuple bound to a name turns constexprs into tensors). The producer's one warp takes a
        # warpgroup's register slot, at 24 a thread.
        work = (N_Q, N_K, N_FULL, SPLITS, HEADS, HEADS1, BIG1, SMALL1, BIG2, SMALL2)
        consumer_args = (o_desc, o_hi_desc, Lse, Part_O, Part_L, qk_scale, N_Q, work, q_smem, k_smem, v_smem, q_hi_smem,
                         k_hi_smem, v_hi_smem, q_bars, k_full, v_full, k_empty, v_empty, turns, ones_smem)
        producer_args = (q_desc, k_desc, v_desc, q_hi_desc, k_hi_desc, v_hi_desc, H, work, q_smem, k_smem, v_smem,
                         q_hi_smem, k_hi_smem, v_hi_smem, q_bars, k_full, v_full, k_empty, v_empty)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (0, consumer_args, BLOCK_M, BLOCK_N, D_LO, D_HI, STAGES, STORE_LSE, EVEN_N, CONSUMERS,
                             TAIL, MIXED)),
                (_consumer, (1, consumer_args, BLOCK_M, BLOCK_N, D_LO, D_HI, STAGES, STORE_LSE, EVEN_N, CONSUMERS,
                             TAIL, MIXED)),
                (_producer, (producer_args, BLOCK_M, BLOCK_N, D_LO, SPLIT, STAGES, CONSUMERS, TAIL, MIXED)),
            ], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.static_assert(CONSUMERS == 3, "two or three consumer warpgroups")
            gl.warp_specialize([
                (_consumer, (0, consumer_args, BLOCK_M, BLOCK_N, D_LO, D_HI, STAGES, STORE_LSE, EVEN_N, CONSUMERS,
                             TAIL, MIXED)),
                (_consumer, (1, consumer_args, BLOCK_M, BLOCK_N, D_LO, D_HI, STAGES, STORE_LSE, EVEN_N, CONSUMERS,
                             TAIL, MIXED)),
                (_consumer, (2, consumer_args, BLOCK_M, BLOCK_N, D_LO, D_HI, STAGES, STORE_LSE, EVEN_N, CONSUMERS,
                             TAIL, MIXED)),
                (_producer, (producer_args, BLOCK_M, BLOCK_N, D_LO, SPLIT, STAGES, CONSUMERS, TAIL, MIXED)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, width: int, dtype: torch.dtype):
    gl_dtype = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, width], gl_dtype)


class BoundDescriptor(NamedTuple):
    """What a compiled kernel's launcher reads of a tensor descriptor argument: its tile shape and
    shared layout are fixed in the binary. Building Triton's ``TensorDescriptor`` checks its
    arguments in Python, several microseconds each, eight per call at split head dims; these are
    for launches of a binary compiled from the same layout (see :func:`sdpatch.kernels.runtime.launch`)."""

    base: torch.Tensor
    shape: list
    strides: list
    padding: str = "zero"


def _descriptor(t: torch.Tensor, rows: int, width: int, bound: bool):
    if bound:
        return BoundDescriptor(t, list(t.shape), list(t.stride()))
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, width], _shared_layout(rows, width, t.dtype))


def descriptors(q, k, v, out, block_m: int, block_n: int, bound: bool = False) -> list:
    """The kernel's eight descriptor arguments: q, k, v, out over the head dim's first part, then
    over its second (:func:`split_head_dim`), or None where there is none: the JIT and the launcher
    spend host time on each descriptor they are given. ``bound``: :class:`BoundDescriptor` s, for a
    compiled binary's launch."""
    d_lo, d_hi = split_parts(q.shape[3])
    rows = (block_m, block_n, block_n, block_m)
    lo = [_descriptor(t, r, d_lo, bound) for t, r in zip((q, k, v, out), rows)]
    return lo + ([_descriptor(t, r, d_hi, bound) for t, r in zip((q, k, v, out), rows)] if d_hi else [None] * 4)


def launches(q, k, v, out, lse, scale: float, config: tuple[int, int, int, int] | None = None,
             sms: int | None = None, bound: bool = False) -> list[tuple]:
    """The forward's launches, each ``(kernel, grid, runtime arguments, constexprs)``: the Gluon
    kernel, then, where :func:`tail_split` splits the grid's last wave, :func:`_combine_pieces` over
    the pieces' workspace, allocated here (fp32, at most ``sms`` programs' rows). A grid not split
    takes :func:`tile_plan`'s tiles. ``config`` as :func:`hopper_attn_fwd`'s; ``sms``: the SMs the
    grid is balanced over (None: the device's; 0: whole tiles, none split); ``bound`` as
    :func:`descriptors`'. :func:`gluon_attn_fwd` launches them through its launch plans."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert k.shape == v.shape and k.shape[:2] == (B, H) and k.shape[3] == D, f"k, v {tuple(k.shape)} do not match q {tuple(q.shape)}"
    d_lo, d_hi = split_parts(D)
    block_m, block_n, stages, consumers = config or config_for(D)
    assert block_m % 64 == 0 and consumers in (2, 3), f"BLOCK_M={block_m}, {consumers} consumers: 64-row MMAs, 2 or 3 warpgroups"
    tile_m = consumers * block_m
    grid = grid_for(B * H, Nq, Nk, sm_count(q.get_device()) if sms is None else sms, (block_m, block_n, stages, consumers))
    part_o = part_l = None
    if grid.pieces:
        part_o = torch.empty(grid.pieces, tile_m, d_lo + d_hi, device=q.device, dtype=torch.float32)
        part_l = torch.empty(grid.pieces, tile_m, device=q.device, dtype=torch.float32)
    args = (*descriptors(q, k, v, out, block_m, block_n, bound), lse, part_o, part_l, scale * 1.44269504,  # 1/ln 2
            H, Nq, Nk, grid.whole, grid.splits, B * H, *grid.plan)
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, D_LO=d_lo, D_HI=d_hi, STAGES=stages, CONSUMERS=consumers,
                  CONSUMER_REGS=consumer_regs(consumers), STORE_LSE=lse is not None, EVEN_N=Nk % block_n == 0,
                  TAIL=grid.pieces > 0, MIXED=grid.mixed, num_warps=4)
    runs = [(_attn_fwd_hopper, (grid.whole + grid.pieces, 1, 1), args, consts)]
    if grid.pieces:
        m_tiles = grid.plan[1]
        combine_args = (part_o, part_l, out, lse, *out.stride()[:3], H, Nq, m_tiles, grid.whole, grid.splits)
        combine_consts = dict(TILE_M=tile_m, DW=d_lo + d_hi, HEAD_DIM=D, BLOCK_R=COMBINE_ROWS,
                              BLOCK_D=triton.next_power_of_2(D), STORE_LSE=lse is not None, num_warps=4)
        runs.append((_combine_pieces, (grid.pieces // grid.splits, tile_m // COMBINE_ROWS, 1), combine_args,
                     combine_consts))
    return runs


def hopper_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, return_lse: bool = False,
                    config: tuple[int, int, int, int] | None = None,
                    sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward on the Gluon kernel, launched through the JIT; arguments and results as
    :func:`gluon_attn_fwd`'s. ``config``: (BLOCK_M, BLOCK_N, STAGES,
    CONSUMERS), else :func:`config_for`'s; ``sms`` as :func:`launches`'."""
    assert hopper_fwd_ok(q, k, v, None), "needs sm_90, fp16/bf16, head dim <= 256 and TMA-aligned strides (hopper_fwd_ok)"
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
    for kernel, grid, args, consts in launches(q, k, v, out, lse, scale, config, sms):
        kernel[grid](*args, **consts)
    return out, lse


_plans: dict[tuple, Plan] = {}  # the kernel's launches, by layout (see gluon_attn_fwd)


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool) -> tuple:
    return q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, return_lse


def gluon_attn_fwd(q, k, v, scale: float, return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The forward on this kernel, launched as the Triton kernels are: through the JIT once per
    layout, then straight to its binaries (:func:`sdpatch.kernels.runtime.launch`). Arguments and
    results as :func:`sdpatch.kernels.flash_fwd.fa2_attn_fwd`'s, no mask (see :func:`serves`).

    None, launching nothing, where the layout's kernels compile in the background (seconds: see
    :func:`sdpatch.kernels.runtime.stands_aside`) and another kernel is to serve the call. A compile
    that failed raises at the layout's next call (:func:`sdpatch.kernels.forward.flash_attn_fwd`
    then turns this kernel off)."""
    plan = cached_plan(_plans, _plan_key(q, k, v, return_lse), lambda: Plan({}))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
    if stands_aside(plan, q.device, lambda: launches(q, k, v, out, lse, scale)):
        return None
    bound = len(plan.binaries) > 0  # compiled at this layout: its binaries take bound descriptors
    with on_device(q):
        for i, (kernel, grid, args, consts) in enumerate(launches(q, k, v, out, lse, scale, bound=bound)):
            launch(kernel, grid, args, consts, plan.binaries, ("gluon", i))
    return out, lse


# Address sets a repeat launcher keeps the launches' arguments for: a layer's q, k, v and output
# come back at the same few addresses every step from the caching allocator.
MAX_REPEAT_ADDRESSES = 64


def gluon_repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """A launcher for later calls without log-sum-exp on tensors laid out exactly as these (shapes,
    strides, dtype, device), once :func:`gluon_attn_fwd` has launched their kernels from its
    binaries: ``again(q, k, v) -> out``. It skips the plan's key and lookup and works out the
    launches' grids and scalars once. Per call only the tensors' addresses are new: the launchers'
    whole argument lists (:meth:`~sdpatch.kernels.runtime.Binary.flat_args`: eight descriptors'
    encodings, the scalars) are kept by the addresses of q, k, v, the output and the split grid's
    workspace, which an eager loop's allocator hands out again every step. None where the layout has
    not launched from its binaries yet."""
    plan = _plans.get(_plan_key(q, k, v, False))
    if plan is None or plan.later not in (None, LAUNCHED):
        return None
    # The output's template is laid out as every call's (empty_like), which differs from q's where q
    # is not dense (a fused projection's view).
    runs = launches(q, k, v, torch.empty_like(q), None, scale, bound=True)
    if any(("gluon", i) not in plan.binaries for i in range(len(runs))):
        return None
    (kernel, grid, args, consts), combine = runs[0], runs[1:]
    templates, tail = args[:8], args[11:]  # 8 descriptors; then Lse, Part_O, Part_L; then scalars
    part_o, part_l = args[9:11]
    kept: dict[tuple, list] = {}  # addresses -> [(binary, grid, its flat arguments)] of each launch

    def launch_new(q, k, v, out, work) -> None:
        descs = tuple(d and BoundDescriptor(t, d.shape, d.strides) for d, t in zip(templates, (q, k, v, out) * 2))
        calls = [(kernel, grid, (*descs, None, *(work or (None, None)), *tail), consts, ("gluon", 0))]
        if combine:
            c_kernel, c_grid, c_args, c_consts = combine[0]
            calls.append((c_kernel, c_grid, (*work, out, None, *c_args[4:]), c_consts, ("gluon", 1)))
        # Through launch(), which hands the JIT a launch that a binary refuses; then the lists are
        # kept (a second walk over the arguments, once per new address set).
        for kern, g, a, c, key in calls:
            launch(kern, g, a, c, plan.binaries, key)
        binaries = [plan.binaries.get(key) for *_, key in calls]
        if all(isinstance(b, Binary) for b in binaries) and not launch_hooked():
            if len(kept) >= MAX_REPEAT_ADDRESSES:
                kept.clear()
            kept[_addresses(q, k, v, out, work)] = [(b, g, b.flat_args(a)) for b, (_, g, a, _, _) in zip(binaries, calls)]

    def again(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if ("gluon", 0) not in plan.binaries:  # direct launches turned off: the JIT takes no bound descriptors
            return gluon_attn_fwd(q, k, v, scale)[0]
        out = torch.empty_like(q)
        work = None
        if combine:
            work = (torch.empty(part_o.shape, device=q.device, dtype=torch.float32),
                    torch.empty(part_l.shape, device=q.device, dtype=torch.float32))
        with on_device(q):
            flat = kept.get(_addresses(q, k, v, out, work))
            if flat is None or launch_hooked():
                launch_new(q, k, v, out, work)
            else:
                for binary, g, values in flat:
                    binary.launch_flat(g, values)
        return out

    return again


def _addresses(q, k, v, out, work) -> tuple:
    if work is None:
        return q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    return q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), work[0].data_ptr(), work[1].data_ptr()
