"""FlashAttention-2-style forward kernel: online softmax over key blocks, fp32 accumulation.

The (Nq, Nk) score matrix lives only in registers, one (BLOCK_M, BLOCK_N) tile at a time.
Any Nq, Nk >= 1 (tails are masked), head dims 1..256 (padded to power-of-two tiles inside the kernel,
never by copying inputs), arbitrary strides, and an additive or boolean mask broadcast
through zero strides. On Hopper, K and V tiles of the longest kernels (16,384 tokens and up at SD
sizes: :data:`TMA_MIN_FLOP`) come through TMA descriptors (:func:`kv_operands`); elsewhere through
pointer loads. On Hopper, unmasked self-attention goes to the Gluon kernel of :mod:`flash_fwd_hopper`
instead, where it measured faster (:func:`flash_fwd_hopper.serves`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import flash_fwd_hopper

try:  # triton >= 3.4: host-side descriptors for Hopper's tensor memory accelerator (TMA)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634  # 1/ln 2: exp(x) = exp2(x * LOG2E)
MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535  # CUDA's limit on grid dims y and z

# Mask kinds (constexpr MASK_KIND).
NO_MASK, ADDITIVE_MASK, BOOL_MASK = 0, 1, 2


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _batch_head(H):
    """This program's index into B*H, and its batch and head (int64 for the offsets). B*H is spread
    over grid dims 1 and 2 so that it can exceed 65,535 (see :func:`launch_grid`)."""
    pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    return pid_bh, (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)


@triton.jit
def _masked_scores(s, mask_ptrs, valid, MASK_KIND: tl.constexpr):
    """Apply the mask to a tile of base-2 scores; out-of-range entries become -inf."""
    if MASK_KIND == 1:
        bias = tl.load(mask_ptrs, mask=valid, other=0.0)
        bias = bias.to(tl.float32)
        # Finite biases below -1e38 would overflow to -inf in base 2 and wrongly mask the key.
        bias = tl.where(bias == float("-inf"), bias, tl.maximum(bias, -1e38))
        s += bias * 1.44269504  # 1/ln 2: the bias joins base-2 scores
    if MASK_KIND == 2:
        keep = tl.load(mask_ptrs, mask=valid, other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, KB, VB, Mask, Out, Lse,  # KV_TMA: K, V are descriptors of part A's tiles, KB, VB of part B's
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    H, BH, N_Q, N_K,
    qk_scale,  # softmax scale * LOG2E: scores are kept in base 2
    HEAD_DIM: tl.constexpr,
    BLOCK_DA: tl.constexpr,  # the head dim is covered by two power-of-two parts, A and B,
    BLOCK_DB: tl.constexpr,  # so that 40 = 32 + 16, 80 = 64 + 16, 160 = 128 + 32 (B = 0: A alone)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,
    EVEN_N: tl.constexpr,  # N_K % BLOCK_N == 0: no key-tail masking
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot returns garbage (triton 3.9)
    ALIGN: tl.constexpr,  # every row start is a multiple of ALIGN elements (see vector_align)
    FOLD_SCALE: tl.constexpr,  # scale > 0 and no additive mask: apply the scale inside exp2's FMA
    KV_TMA: tl.constexpr,  # K and V tiles come through TMA descriptors, which zero-fill out of bounds
):
    # -- which (batch, head) and query block -------------------------------------------
    pid_m = tl.program_id(0)
    pid_bh, off_b, off_h = _batch_head(H)
    if pid_bh >= BH:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_valid = offs_m < N_Q
    rows = offs_m.to(tl.int64)  # row offsets can pass 2^31 at long sequences and wide strides

    # Offsets are hinted as multiples of ALIGN so that row loads vectorize at head dims such as
    # 40 and 80, whose strides Triton cannot prove divisible by 16 on its own.
    q_rows = Q + tl.multiple_of(off_b * stride_qb + off_h * stride_qh, ALIGN) + tl.multiple_of(rows * stride_qm, ALIGN)
    if not KV_TMA:
        k_cols = K + tl.multiple_of(off_b * stride_kb + off_h * stride_kh, ALIGN) + tl.multiple_of(offs_n * stride_kn, ALIGN)
        v_rows = V + tl.multiple_of(off_b * stride_vb + off_h * stride_vh, ALIGN) + tl.multiple_of(offs_n * stride_vn, ALIGN)
    o_rows = Out + tl.multiple_of(off_b * stride_ob + off_h * stride_oh, ALIGN) + tl.multiple_of(rows * stride_om, ALIGN)
    if MASK_KIND != 0:
        mask_ptrs = Mask + off_b * stride_mb + off_h * stride_mh + rows[:, None] * stride_mm + offs_n[None, :] * stride_mn

    # Head-dim part A; K is read transposed, (BLOCK_DA, BLOCK_N), so the score tile is a plain dot.
    offs_da = tl.arange(0, BLOCK_DA)
    da_valid = offs_da < HEAD_DIM
    if not KV_TMA:
        ka_ptrs = k_cols[None, :] + offs_da[:, None] * stride_kd
        va_ptrs = v_rows[:, None] + offs_da[None, :] * stride_vd
    qa = tl.load(q_rows[:, None] + offs_da[None, :] * stride_qd, mask=m_valid[:, None] & da_valid[None, :], other=0.0)
    if DOT_FP32:
        qa = qa.to(tl.float32)
    acc_a = tl.zeros([BLOCK_M, BLOCK_DA], dtype=tl.float32)
    if BLOCK_DB > 0:  # head-dim part B
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        db_valid = offs_db < HEAD_DIM
        if not KV_TMA:
            kb_ptrs = k_cols[None, :] + offs_db[:, None] * stride_kd
            vb_ptrs = v_rows[:, None] + offs_db[None, :] * stride_vd
        qb = tl.load(q_rows[:, None] + offs_db[None, :] * stride_qd, mask=m_valid[:, None] & db_valid[None, :], other=0.0)
        if DOT_FP32:
            qb = qb.to(tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_DB], dtype=tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if KV_TMA:  # descriptor coordinates are int32
        tma_b, tma_h = off_b.to(tl.int32), off_h.to(tl.int32)
    for start_n in range(0, N_K, BLOCK_N):
        n_valid = (start_n + offs_n) < N_K
        kv_valid = n_valid | EVEN_N  # all true when no key tail exists: the compiler drops it
        # -- compute qk ------------------------------------------------------------------
        if KV_TMA:
            ka = tl.trans(K.load([tma_b, tma_h, start_n, 0]).reshape(BLOCK_N, BLOCK_DA))
        else:
            ka = tl.load(ka_ptrs, mask=da_valid[:, None] & kv_valid[None, :], other=0.0)
        if DOT_FP32:
            ka = ka.to(tl.float32)
        qk = tl.dot(qa, ka, input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
            if KV_TMA:
                kb = tl.trans(KB.load([tma_b, tma_h, start_n, BLOCK_DA]).reshape(BLOCK_N, BLOCK_DB))
            else:
                kb = tl.load(kb_ptrs, mask=db_valid[:, None] & kv_valid[None, :], other=0.0)
            if DOT_FP32:
                kb = kb.to(tl.float32)
            qk = tl.dot(qb, kb, qk, input_precision=DOT_PRECISION)
        if not FOLD_SCALE:
            qk = qk * qk_scale
        if MASK_KIND != 0:
            qk = _masked_scores(qk, mask_ptrs, m_valid[:, None] & n_valid[None, :], MASK_KIND)
        elif not EVEN_N:
            qk = tl.where(n_valid[None, :], qk, float("-inf"))

        # -- online softmax (m_i, l_i in base-2 units of the scaled scores) ----------------
        if FOLD_SCALE:
            # max(c * s) = c * max(s) for c > 0; exp2(s * c - m) is then one FMA per score,
            # where scaling first costs a multiply and a subtract: the softmax, not the dots,
            # bounds small head dims.
            m_tile = tl.max(qk, 1) * qk_scale
        else:
            m_tile = tl.max(qk, 1)
        m_new = tl.maximum(m_i, m_tile)
        # A row with every key so far masked keeps m = -inf; subtract 0 so that it stays 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if FOLD_SCALE:
            p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
        else:
            p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_a = acc_a * alpha[:, None]
        if BLOCK_DB > 0:
            acc_b = acc_b * alpha[:, None]
        m_i = m_new

        # -- accumulate p @ v -------------------------------------------------------------
        if KV_TMA:
            va = V.load([tma_b, tma_h, start_n, 0]).reshape(BLOCK_N, BLOCK_DA)
        else:
            va = tl.load(va_ptrs, mask=kv_valid[:, None] & da_valid[None, :], other=0.0)
            ka_ptrs += BLOCK_N * stride_kn
            va_ptrs += BLOCK_N * stride_vn
        if DOT_FP32:
            va = va.to(tl.float32)
        p = p.to(va.dtype)
        acc_a = tl.dot(p, va, acc_a, input_precision=DOT_PRECISION)
        if BLOCK_DB > 0:
            if KV_TMA:
                vb = VB.load([tma_b, tma_h, start_n, BLOCK_DA]).reshape(BLOCK_N, BLOCK_DB)
            else:
                vb = tl.load(vb_ptrs, mask=kv_valid[:, None] & db_valid[None, :], other=0.0)
                kb_ptrs += BLOCK_N * stride_kn
                vb_ptrs += BLOCK_N * stride_vn
            if DOT_FP32:
                vb = vb.to(tl.float32)
            acc_b = tl.dot(p, vb, acc_b, input_precision=DOT_PRECISION)
        if MASK_KIND != 0:
            mask_ptrs += BLOCK_N * stride_mn

    # -- epilogue: normalize; fully masked rows (l = 0) give zeros ---------------------------
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(o_rows[:, None] + offs_da[None, :] * stride_od, (acc_a / l_safe[:, None]).to(Out.dtype.element_ty),
             mask=m_valid[:, None] & da_valid[None, :])
    if BLOCK_DB > 0:
        tl.store(o_rows[:, None] + offs_db[None, :] * stride_od, (acc_b / l_safe[:, None]).to(Out.dtype.element_ty),
                 mask=m_valid[:, None] & db_valid[None, :])
    if STORE_LSE:
        # Base-2 log-sum-exp of the scaled scores; -inf for fully masked rows.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(Lse + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=m_valid)


def head_dim_parts(head_dim: int, split: bool | None = None) -> tuple[int, int]:
    """Power-of-two tile widths (A, B) covering the head dim; B = 0 when one tile serves.

    ``split=None`` splits where it was measured to pay (H200, triton 3.6, diffusers' layout):
    when part B is at most a quarter of part A. 80 -> (64, 16) ran at 390 TFLOP/s against 285
    padded to 128, and 160 -> (128, 32) at 382 against 200 padded to 256; 40 -> (32, 16), where
    B is half of A, ran at 236 against 245 padded to 64, so 40 stays whole. Tiles are at least
    16 wide (the tensor-core minimum); ``split=True`` forces two parts wherever the head dim allows.
    """
    whole = max(16, triton.next_power_of_2(head_dim))
    a = max(16, whole // 2)
    b = max(16, triton.next_power_of_2(head_dim - a)) if head_dim > a else 0
    if split is None:
        split = 0 < b <= a // 4
    return (a, b) if split and b > 0 else (whole, 0)


def tiling(head_dim: int, split: bool | None, align: int, kind: int, *lengths: int) -> tuple[int, int]:
    """The head-dim tiles a launch uses: :func:`head_dim_parts`, but with ``split=None`` two parts
    only on aligned rows, without a mask, and with every sequence in ``lengths`` a whole number of
    128-row blocks. compute-sanitizer caught the two-part tiling reading shared memory out of bounds
    in its second p @ v dot with a mask and 77 keys (triton 3.6, H200: wrong results or an illegal
    address); these are the launches where it ran clean. The backward kernels follow the same rule."""
    if split is None and (align == 1 or kind != NO_MASK or any(n % 128 for n in lengths)):
        split = False
    return head_dim_parts(head_dim, split)


def tile_configs(tiles: list[tuple[int, int, int, int]], pre_hook=None) -> list[triton.Config]:
    """Autotune configs from (BLOCK_M, BLOCK_N, warps, stages) tuples."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=pre_hook) for bm, bn, w, s in tiles]


# TMA loads measured +1 to +9 % kernel time on self-attention, nothing on 77 keys (H200, triton
# 3.6), but building the descriptors costs 23 us of host time per call (81 against 58 us), and SD's
# UNets at 512-1024 px are host-bound on the H200 (SDXL 1024²: 42 ms of kernels in a 104 ms call).
# So TMA only where ~5 % of the kernel outweighs that: kernels of 2e11 FLOP (~0.6 ms) and more,
# i.e. 16,384 tokens and up at SD head dims.
TMA_MIN_FLOP = 2e11


def kv_tma_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether K and V tiles can come through TMA descriptors: triton >= 3.4, a Hopper or newer GPU
    (or the interpreter), 16-bit data, and the descriptor's alignment (16-byte base and strides)."""
    if TensorDescriptor is None or k.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not interpreting() and not (k.is_cuda and torch.cuda.get_device_capability(k.device)[0] >= 9):
        return False
    return vector_align(k, v) > 1


def kv_operands(k: torch.Tensor, v: torch.Tensor, meta: dict, block_n: int = 16) -> tuple:
    """The kernel's K, V, KB, VB arguments: the tensors themselves, or with KV_TMA descriptors of
    (1, 1, block_n, part width) tiles over the (B, H, N, D) views, for head-dim parts A and B."""
    if not meta["KV_TMA"]:
        return k, v, None, None

    def desc(t, width):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, width]) if width else None

    return desc(k, meta["BLOCK_DA"]), desc(v, meta["BLOCK_DA"]), desc(k, meta["BLOCK_DB"]), desc(v, meta["BLOCK_DB"])


def _kv_tile_rows(nargs: dict) -> None:
    """Autotuner pre-hook: the descriptors' tiles follow the config's BLOCK_N."""
    if nargs["KV_TMA"]:
        for name in ("K", "V", "KB", "VB"):
            if nargs[name] is not None:
                nargs[name].block_shape[2] = nargs["BLOCK_N"]


# Forward tiles (BLOCK_M, BLOCK_N, warps, stages): every tile that won or came within 3 % at some SD
# shape in ``scripts/sweep_configs.py`` (H200, triton 3.6), for each way of loading K and V.
POINTER_TILES = [
    (128, 64, 4, 3),  # head dim 40 (one 64-wide tile), and bf16
    (128, 64, 4, 4),  # head dim 80 (64 + 16)
    (128, 64, 8, 3),  # head dim 160 (128 + 32), 64 at 4096 tokens
    (128, 64, 8, 4),  # head dim 64 at 4096 tokens
    (64, 64, 4, 3),  # 1024 tokens at head dim 80, and one padded 256-wide tile
    (64, 64, 4, 4),  # 1024 tokens at head dim 64
    (64, 32, 4, 3),  # 77 keys at head dim 64, and 256 tokens at a 256-wide tile
    (128, 32, 4, 4),  # 77 keys at head dim 40
]
TMA_TILES = [
    (128, 64, 4, 3),  # head dim 40 and bf16 at 4096 tokens
    (128, 64, 4, 4),  # head dim 40 at 16384 tokens, head dim 80 (64 + 16) at 4096
    (128, 128, 8, 2),  # head dim 160 (128 + 32) at 1024 tokens, 80 at 1024
    (64, 128, 4, 3),  # head dim 64 at 4096 tokens
    (64, 64, 4, 3),  # head dim 64 at 1024 tokens, 160 at 256
    (128, 32, 4, 3),  # 77 keys at head dim 40 (when asked for: TMA is off there by default)
    (64, 32, 4, 3),  # 77 keys at head dim 64
]


def _configs():
    """Autotune space for the GPU: both lists; :func:`_prune` keeps the few that can win for the
    shape and load at hand, so a new shape compiles and times at most six."""
    return tile_configs(list(dict.fromkeys(POINTER_TILES + TMA_TILES)), pre_hook=_kv_tile_rows)


def _prune(configs, named_args, **kwargs):
    """Keep the tiles that can win for this shape (see :data:`POINTER_TILES`, :data:`TMA_TILES`):
    32-key blocks for short key sequences, 64-row blocks of 32 or 64 keys for one padded 256-wide
    tile, 64-key blocks (pointer loads) or 64- and 128-key blocks (TMA) otherwise. The autotuner
    skips a tile that does not fit the GPU's shared memory."""
    n_k = named_args["N_K"]
    tma = kwargs["KV_TMA"]
    wide = kwargs["BLOCK_DA"] + kwargs["BLOCK_DB"] >= 256
    tiles = set(TMA_TILES if tma else POINTER_TILES)

    def keep(c):
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if (bm, bn, c.num_warps, c.num_stages) not in tiles:
            return False
        if wide and (bm != 64 or c.num_stages != 3):  # larger tiles spill or run out of shared memory
            return False
        if n_k <= 128:
            return bn == 32
        # A padded 256-wide head keeps 32-key blocks too: with pointer loads and an additive mask,
        # 64 x 64 at 3 stages needs 240 KiB of shared memory (H200: 227 KiB), and GPUs before
        # Hopper have less.
        return wide or (bn >= 64 if tma else bn == 64)

    return [c for c in configs if keep(c)] or configs[-1:]


def autotune_options() -> dict:
    """Keep autotuning results on disk beside Triton's kernel cache where Triton can (>= 3.3):
    a pipeline's second run skips the tuning its first run paid."""
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


# Autotune key: sequence lengths, head dim and its tiling, and the K/V loads; the tiles that win change with each.
_attn_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["N_Q", "N_K", "HEAD_DIM", "BLOCK_DB", "MASK_KIND", "KV_TMA"],
    prune_configs_by={"early_config_prune": _prune},
    **autotune_options(),
)(_attn_fwd_kernel)

# The interpreter cannot autotune without a GPU driver: one fixed small config, which also
# exercises the tail masking on small test shapes.
_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host: ``triton.cdiv`` is a constexpr function, a few us a call."""
    return -(-a // b)


def launch_grid(n_rows: int, bh: int, block_m: int) -> tuple[int, int, int]:
    """Row blocks on grid dim 0 (limit 2^31 - 1); B*H over dims 1 and 2 (65,535 each)."""
    return cdiv(n_rows, block_m), min(bh, MAX_GRID_Y), cdiv(bh, MAX_GRID_Y)


def vector_align(*tensors: torch.Tensor) -> int:
    """The alignment the kernels' row offsets are hinted with, in elements (1: none known).

    Where every stride is a multiple of 16, as at head dims 64 and 128, 16: what Triton infers
    itself from its integer specialization, so that the hint claims no less (v1 hinted 8 there,
    and its backward at head dim 64 measured 208 TFLOP/s against v0's 290 without hints).
    Otherwise, when every row of every tensor still starts 16-byte aligned (head dims 40 and 80),
    one 16-byte vector; else 1.
    """
    if any(t.stride(-1) != 1 or t.data_ptr() % 16 for t in tensors):
        return 1
    strides = [s for t in tensors for s in t.stride()[:-1]]
    for align in (16, 16 // tensors[0].element_size()):
        if all(s % align == 0 for s in strides):
            return align
    return 1


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device, not the tensors': make ``t``'s current (only
    when it is not: switching costs microseconds a call on the host)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# Triton >= 3.3 launches a compiled binary given every parameter's value, constexprs included
# (``CompiledKernel[grid](*args)``); older versions take another list, and keep the JIT path.
_DIRECT_LAUNCH = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3)

try:  # triton >= 3.4 keeps its launch hooks here; 3.3 on CompiledKernel
    from triton import knobs as _knobs
except ImportError:
    _knobs = None


def launch_hooked() -> bool:
    """Whether a profiler (Triton's proton, ...) has hooked kernel launches: then they go through
    Triton's own launch path, which calls the hooks."""
    if _knobs is not None:
        hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    else:
        from triton.compiler import CompiledKernel

        hooks = (CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)  # triton >= 3.6: a chain, empty when unhooked


def current_device_and_stream():
    """The current CUDA device's index, and the function giving a device's current stream, as Triton has them."""
    from triton.runtime import driver

    return driver.active.get_current_device(), driver.active.get_current_stream


class Binary:
    """A compiled kernel, launched straight through its C launcher (``CompiledKernel.run``).

    Triton's runner (``CompiledKernel[grid]``) looks up the current device and stream, builds
    launch metadata and has the launcher call two (empty) hook chains back in Python, every launch:
    3-5 us of a 9-19 us launch on the lent H200 hosts (docs/benchmarks.md, v7). The kernel was
    loaded on the device current at its first launch, and :func:`on_device` makes that device
    current for every later launch of its plan, so only the stream is looked up per call.
    """

    __slots__ = ("compiled", "consts", "run", "function", "metadata", "device", "current_stream")

    def __init__(self, compiled, consts: tuple):
        self.compiled, self.consts = compiled, consts
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.device, self.current_stream = current_device_and_stream()

    def __call__(self, grid: tuple, args: tuple) -> None:
        if launch_hooked():
            self.compiled[grid](*args, *self.consts)
            return
        self.run(grid[0], grid[1], grid[2], self.current_stream(self.device), self.function, self.metadata, None, None, None,
                 *args, *self.consts)


def launch(kernel, grid: tuple, args: tuple, consts: dict, binaries: dict, key) -> None:
    """Launch a jitted kernel: the first time for ``key`` through Triton's JIT (binding the
    arguments, specializing on them, compiling or finding the binary), later straight to that
    binary (:class:`Binary`).

    The JIT's binding and specialization cost tens of microseconds a launch on the host, as long as
    a whole kernel at 77 keys. ``key`` must fix everything Triton specializes on: dtypes, every
    integer argument (sizes, strides), each pointer's 16-byte alignment, and the constexprs; the
    launch plans' keys with the tile config do. ``args`` are the kernel's leading, runtime
    parameters; ``consts`` its constexprs and launch options.
    """
    binary = binaries.get(key)
    if binary is not None:
        try:
            binary(grid, args)
            return
        except (TypeError, ValueError, KeyError) as e:  # a Triton whose launcher wants other arguments
            _no_direct_launch(binaries, e)
    compiled = kernel[grid](*args, **consts)
    if _DIRECT_LAUNCH and not interpreting() and compiled is not None:
        try:  # the binary takes the constexprs too, in the kernel's parameter order
            binaries[key] = Binary(compiled, tuple(consts[name] for name in kernel.arg_names[len(args):]))
        except AttributeError as e:  # a Triton whose compiled kernels lack what Binary launches with
            _no_direct_launch(binaries, e)


def _no_direct_launch(binaries: dict, err: Exception) -> None:
    global _DIRECT_LAUNCH
    _DIRECT_LAUNCH = False
    binaries.clear()
    logger.warning("direct kernel launches disabled (%s: %s); launching through Triton's JIT", type(err).__name__, err)


def mask_kind(mask: torch.Tensor | None) -> int:
    if mask is None:
        return NO_MASK
    return BOOL_MASK if mask.dtype == torch.bool else ADDITIVE_MASK


def fwd_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    return_lse: bool,
    split_head_dim: bool | None,
    kv_tma: bool | None = None,
) -> dict:
    """Check the inputs; return the kernel's constexprs for this layout (everything but the tiles)."""
    assert q.ndim == k.ndim == v.ndim == 4, "q, k, v must be 4-D (B, H, N, D)"
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    assert k.shape == v.shape == (B, H, Nk, D), f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, H, Nk, {D})"
    assert q.dtype == k.dtype == v.dtype, f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}"
    assert 1 <= D <= MAX_HEAD_DIM, f"head dim {D} outside 1..{MAX_HEAD_DIM}"
    assert Nq >= 1 and Nk >= 1 and B * H >= 1, "empty sequence or batch"
    if mask is not None:
        assert mask.ndim == 4, "mask must be 4-D; broadcast dims of size 1"
        assert mask.device == q.device, "mask must be on q's device"
    align = vector_align(q, k, v, out)
    kind = mask_kind(mask)
    block_da, block_db = tiling(D, split_head_dim, align, kind, Nk)
    tma_ok = kv_tma_ok(k, v)
    assert tma_ok or not kv_tma, "kv_tma needs triton >= 3.4, a Hopper GPU, 16-bit data and 16-byte-aligned strides"
    if kv_tma is None:
        kv_tma = not interpreting() and 4 * B * H * Nq * Nk * D >= TMA_MIN_FLOP
    return dict(**kernel_meta(q, block_da, block_db, kind, align, scale), STORE_LSE=return_lse, KV_TMA=kv_tma and tma_ok)


def kernel_meta(q: torch.Tensor, block_da: int, block_db: int, kind: int, align: int, scale: float) -> dict:
    """The constexprs the forward and backward kernels share."""
    return dict(
        HEAD_DIM=q.shape[-1],
        BLOCK_DA=block_da,
        BLOCK_DB=block_db,
        MASK_KIND=kind,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=interpreting() and q.dtype == torch.bfloat16,
        ALIGN=align,
        FOLD_SCALE=scale > 0 and kind != ADDITIVE_MASK,
    )


def fwd_args(q, k, v, mask, out, lse, scale, kv: tuple | None = None) -> tuple:
    """The kernel's runtime arguments, in its order; ``kv``: K, V, KB, VB from :func:`kv_operands`."""
    return (q, *(kv or (k, v, None, None)), mask, out, lse, *fwd_scalars(q, k, v, mask, out, scale))


def fwd_scalars(q, k, v, mask, out, scale) -> tuple:
    """The kernel's integer and float arguments (strides, sizes, scale): fixed by a launch plan's key."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    ms = mask.expand(B, H, Nq, Nk).stride() if mask is not None else (0, 0, 0, 0)  # broadcast dims: stride 0
    return (*q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(), H, B * H, Nq, Nk, scale * LOG2E)


@dataclass(slots=True)
class _Plan:
    """What a launch of one input layout needs besides its tensors: found once, then reused."""

    meta: dict
    config: dict | None = None  # the autotuner's pick, once it has tuned this shape
    binaries: dict = field(default_factory=dict)  # tile config -> compiled kernel (see :func:`launch`)
    tuned: tuple | None = None  # (grid, scalars, constexprs, binary key) of the tuned launch


# (shapes, strides, dtype, device, alignment, mask layout, options) -> _Plan. Working out the
# constexprs and going through Triton's autotuner cost tens of microseconds per call on the
# host, as much as a whole attention kernel at 77 keys; a UNet repeats a few dozen layouts.
_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def cached_plan(plans: dict, key: tuple, make):
    """``plans[key]``, made by ``make()`` on first use; the cache starts over past ``_MAX_PLANS``."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[key] = make()
    return plan


def _plan_key(q, k, v, mask, scale, return_lse, split_head_dim, kv_tma) -> tuple:
    """Everything a launch's constexprs and Triton's specialization depend on (see :func:`launch`);
    the outputs are allocated here, like q, so q's layout fixes theirs."""
    mask_layout = None if mask is None else (mask.dtype, mask.shape, mask.stride(), mask.device, mask.data_ptr() % 16)
    alignment = (q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, alignment,
            mask_layout, scale, return_lse, split_head_dim, kv_tma)


_hopper_plans: dict[tuple, _Plan] = {}  # the Gluon kernel's launches, by layout (see _hopper_fwd)


def _hopper_fwd(q, k, v, scale: float, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A default call on the Gluon Hopper kernel, launched as the Triton kernel's are: through the
    JIT once per layout, then straight to its binary (:func:`launch`)."""
    plan = cached_plan(_hopper_plans, (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, return_lse),
                       lambda: _Plan({}))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
    bound = len(plan.binaries) > 0  # compiled at this layout: its binaries take bound descriptors
    with on_device(q):
        for i, (kernel, grid, args, consts) in enumerate(flash_fwd_hopper.launches(q, k, v, out, lse, scale, bound=bound)):
            launch(kernel, grid, args, consts, plan.binaries, ("gluon", i))
    return out, lse


def _config_kwargs(config: triton.Config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def tuned_config(q, k, v, scale: float, mask=None, return_lse: bool = False, split_head_dim=None, kv_tma=None) -> dict | None:
    """The tiles the autotuner picked for this call's layout, once a call has tuned it."""
    plan = _plans.get(_plan_key(q, k, v, mask, scale, return_lse, split_head_dim, kv_tma))
    return None if plan is None else plan.config


def flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    return_lse: bool = False,
    split_head_dim: bool | None = None,
    config: dict | None = None,
    kv_tma: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel.

    q: (B, H, Nq, D); k, v: (B, H, Nk, D), any strides; mask: bool (True = keep) or additive,
    4-D and broadcastable to (B, H, Nq, Nk) (size-1 dims are read with stride 0).
    split_head_dim: tile the head dim as two power-of-two parts (see :func:`head_dim_parts`);
    None decides by head dim, layout and mask.
    kv_tma: load K and V tiles through TMA descriptors (Hopper); None: where the GPU and layout
    allow it, on kernels of :data:`TMA_MIN_FLOP` and more.
    config: BLOCK_M, BLOCK_N, num_warps, num_stages to launch with instead of autotuning
    (the interpreter always uses a fixed one).
    Returns (out, lse): out has q's shape, dtype and layout; lse is the fp32 (B, H, Nq)
    base-2 log-sum-exp of the scaled scores (None unless ``return_lse``).
    Default calls (no config, split_head_dim or kv_tma) that :func:`flash_fwd_hopper.serves` run
    on the Gluon Hopper kernel instead.
    """
    default = config is None and split_head_dim is None and kv_tma is None
    if default and flash_fwd_hopper.serves(q, k, v, mask):  # Hopper, unmasked self-attention
        try:
            return _hopper_fwd(q, k, v, scale, return_lse)
        except torch.cuda.OutOfMemoryError:  # the Triton kernel needs the same memory
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a Gluon API this triton lacks: fall back for good
            flash_fwd_hopper.disable(e)
    out = torch.empty_like(q)  # keeps q's layout: diffusers' (B, N, H, D) views reshape for free
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
    # The interpreter cannot autotune: its plans start with a fixed config, as if tuned.
    plan = cached_plan(_plans, _plan_key(q, k, v, mask, scale, return_lse, split_head_dim, kv_tma),
                       lambda: _Plan(fwd_meta(q, k, v, out, scale, mask, return_lse, split_head_dim, kv_tma),
                                     _INTERPRET_CONFIG if interpreting() else None))
    Nq, Nk, BH = q.shape[2], k.shape[2], q.shape[0] * q.shape[1]

    tuned = config is None and plan.tuned
    with on_device(q):
        if tuned:  # the common case: a layout seen before, its launch worked out then
            grid, scalars, consts, key = tuned
            kv = kv_operands(k, v, plan.meta, consts["BLOCK_N"])
            launch(_attn_fwd_kernel, grid, (q, *kv, mask, out, lse, *scalars), consts, plan.binaries, key)
            return out, lse
        config = config or plan.config
        scalars = fwd_scalars(q, k, v, mask, out, scale)
        if config is not None:
            kv = kv_operands(k, v, plan.meta, config["BLOCK_N"])
            consts = {**plan.meta, "EVEN_N": Nk % config["BLOCK_N"] == 0, **config}
            grid, key = launch_grid(Nq, BH, config["BLOCK_M"]), tuple(config.items())
            launch(_attn_fwd_kernel, grid, (q, *kv, mask, out, lse, *scalars), consts, plan.binaries, key)
            if config is plan.config:
                plan.tuned = (grid, scalars, consts, key)
        else:
            args = (q, *kv_operands(k, v, plan.meta), mask, out, lse, *scalars)  # tiles set per config
            # EVEN_N depends on the tuned BLOCK_N; every candidate BLOCK_N divides 128.
            _attn_fwd_tuned[lambda META: launch_grid(Nq, BH, META["BLOCK_M"])](*args, **plan.meta, EVEN_N=Nk % 128 == 0)
            # Later calls launch the tuned kernel directly; the same EVEN_N reuses its binary.
            plan.config = {**_config_kwargs(_attn_fwd_tuned.best_config), "EVEN_N": Nk % 128 == 0}
    return out, lse


__all__ = ["flash_attn_fwd", "fwd_args", "fwd_meta", "fwd_scalars", "kv_operands", "kv_tma_ok", "launch", "tuned_config", "head_dim_parts", "launch_grid", "vector_align", "MAX_HEAD_DIM", "LOG2E", "interpreting"]
