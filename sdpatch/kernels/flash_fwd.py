"""FlashAttention-2-style forward kernel and its launcher: online softmax over key blocks, fp32 accumulation.

The (Nq, Nk) score matrix lives only in registers, one (BLOCK_M, BLOCK_N) tile at a time.
Any Nq, Nk >= 1 (tails are masked), head dims 1..256 (padded to power-of-two tiles inside the kernel,
never by copying inputs), arbitrary strides, and an additive or boolean mask broadcast
through zero strides. On Hopper, K and V tiles of the longest kernels (16,384 tokens and up at SD
sizes: :data:`TMA_MIN_FLOP`) come through TMA descriptors (:func:`kv_operands`); elsewhere through
pointer loads. On Hopper, :mod:`.forward` sends unmasked self-attention to the Gluon kernel of
:mod:`.flash_fwd_hopper` instead, where it measured faster.
"""

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .runtime import (
    Plan,
    autotuner,
    cached_plan,
    config_kwargs,
    interpreting,
    launch,
    launch_grid,
    on_device,
    precompile,
    shipped_config,
    stands_aside,
    tile_configs,
    tune_key,
    vector_align,
)
from .shared import LOG2E, SERVES, batch_head, in_range, kernel_meta, mask_kind, masked_scores, plan_key, tiling

logger = logging.getLogger(__name__)

try:  # triton >= 3.4: host-side descriptors for Hopper's tensor memory accelerator (TMA)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

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
    pid_bh, off_b, off_h = batch_head(H)
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
        kv_valid = in_range(start_n + offs_n, N_K, EVEN_N)
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
            qk = masked_scores(qk, mask_ptrs, m_valid[:, None] & n_valid[None, :], MASK_KIND)
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
    """TMA configs' pre-hook: the descriptors' tiles follow the config's BLOCK_N."""
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


def _prune(configs, named_args, **kwargs):
    """Keep the tiles that can win for this shape (see :data:`POINTER_TILES`, :data:`TMA_TILES`):
    32-key blocks for short key sequences, 64-row blocks of 32 or 64 keys for one padded 256-wide
    tile, 64-key blocks (pointer loads) or 64- and 128-key blocks (TMA) otherwise. The autotuner
    skips a tile that does not fit the GPU's shared memory."""
    n_k = named_args["N_K"]
    tma = kwargs["KV_TMA"]
    wide = kwargs["BLOCK_DA"] + kwargs["BLOCK_DB"] >= 256

    def keep(c):
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if wide and (bm != 64 or c.num_stages != 3):  # larger tiles spill or run out of shared memory
            return False
        if n_k <= 128:
            return bn == 32
        # A padded 256-wide head keeps 32-key blocks too: with pointer loads and an additive mask,
        # 64 x 64 at 3 stages needs 240 KiB of shared memory (H200: 227 KiB), and GPUs before
        # Hopper have less.
        return wide or (bn >= 64 if tma else bn == 64)

    return [c for c in configs if keep(c)] or configs[-1:]


# Autotune key: sequence lengths, head dim and its tiling, and the K/V loads; the tiles that win change with each.
FWD_KEY = ["N_Q", "N_K", "HEAD_DIM", "BLOCK_DB", "MASK_KIND", "KV_TMA"]

# One autotuner per way of loading K and V. Pointer-load configs carry no pre-hook, so that Triton
# keeps their tuning on disk and a new process skips it: it cannot store a config with a pre-hook,
# and re-tuned every shape in every process (1-3 s of an SD pipeline's first step on an H200). The
# TMA configs need theirs: it sets the descriptors' tile rows to the config's BLOCK_N.
_FWD_CONFIGS = {False: tile_configs(POINTER_TILES), True: tile_configs(TMA_TILES, pre_hook=_kv_tile_rows)}


@functools.cache
def fwd_tuner(kv_tma: bool):
    """The forward's autotuner for one way of loading K and V (see :func:`runtime.autotuner`)."""
    return autotuner(_attn_fwd_kernel, _FWD_CONFIGS[kv_tma], FWD_KEY, _prune)


def fwd_configs(kv_tma: bool) -> list[triton.Config]:
    """The forward autotuner's candidates for one way of loading K and V, before pruning."""
    return _FWD_CONFIGS[kv_tma]


# The interpreter cannot autotune without a GPU driver: one fixed small config, which also
# exercises the tail masking on small test shapes.
_INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


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
    assert q.dtype in SERVES.dtypes, f"unsupported dtype {q.dtype}"
    assert 1 <= D <= SERVES.max_head_dim, f"head dim {D} outside 1..{SERVES.max_head_dim}"
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


def fwd_args(q, k, v, mask, out, lse, scale, kv: tuple | None = None) -> tuple:
    """The kernel's runtime arguments, in its order; ``kv``: K, V, KB, VB from :func:`kv_operands`."""
    return (q, *(kv or (k, v, None, None)), mask, out, lse, *fwd_scalars(q, k, v, mask, out, scale))


def fwd_scalars(q, k, v, mask, out, scale) -> tuple:
    """The kernel's integer and float arguments (strides, sizes, scale): fixed by a launch plan's key."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    ms = mask.expand(B, H, Nq, Nk).stride() if mask is not None else (0, 0, 0, 0)  # broadcast dims: stride 0
    return (*q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(), H, B * H, Nq, Nk, scale * LOG2E)


# Launch plans by layout (see :func:`sdpatch.kernels.runtime.cached_plan`).
_plans: dict[tuple, Plan] = {}


def fwd_tune_key(n_q: int, n_k: int, dtype: torch.dtype, meta: dict) -> str:
    """A layout's key in the shipped tuned-tile table: the autotuner's key, and the dtype."""
    return tune_key(n_q, n_k, *(meta[name] for name in ("HEAD_DIM", "BLOCK_DB", "MASK_KIND", "KV_TMA")), dtype)


def _fwd_plan(q, k, v, out, scale, mask, return_lse, split_head_dim, kv_tma) -> Plan:
    """A layout's plan, with the tiles already known where the interpreter fixes them (it cannot
    autotune) or the table shipped for this GPU has them."""
    meta = fwd_meta(q, k, v, out, scale, mask, return_lse, split_head_dim, kv_tma)
    if interpreting():
        return Plan(meta, _INTERPRET_CONFIG)
    return Plan(meta, shipped_config("fwd", q.device, fwd_tune_key(q.shape[2], k.shape[2], q.dtype, meta)))


def tuned_config(q, k, v, scale: float, mask=None, return_lse: bool = False, split_head_dim=None, kv_tma=None) -> dict | None:
    """The tiles the autotuner picked for this call's layout, once a call has tuned it."""
    plan = _plans.get(plan_key(q, k, v, mask, scale, return_lse, split_head_dim, kv_tma))
    return None if plan is None else plan.config


def fa2_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    return_lse: bool = False,
    split_head_dim: bool | None = None,
    config: dict | None = None,
    kv_tma: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Launch the FlashAttention-2-style forward kernel (:func:`sdpatch.kernels.forward.flash_attn_fwd`
    chooses between it and the Gluon kernel).

    q: (B, H, Nq, D); k, v: (B, H, Nk, D), any strides; mask: bool (True = keep) or additive,
    4-D and broadcastable to (B, H, Nq, Nk) (size-1 dims are read with stride 0).
    split_head_dim: tile the head dim as two power-of-two parts (see :func:`head_dim_parts`);
    None decides by head dim, layout and mask.
    kv_tma: load K and V tiles through TMA descriptors (Hopper); None: where the GPU and layout
    allow it, on kernels of :data:`TMA_MIN_FLOP` and more.
    config: BLOCK_M, BLOCK_N, num_warps, num_stages to launch with instead of autotuning
    (the interpreter always uses a fixed one).
    Returns (out, lse): out has q's shape, dtype and layout; lse is the fp32 (B, H, Nq)
    base-2 log-sum-exp of the scaled scores (None unless ``return_lse``). None, launching nothing,
    where the layout's kernel compiles in the background and a stand-in is to serve the call
    (:func:`sdpatch.kernels.runtime.stands_aside`; never with ``return_lse``, a mask or ``config``).
    """
    out = torch.empty_like(q)  # keeps q's layout: diffusers' (B, N, H, D) views reshape for free
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32) if return_lse else None
    plan = cached_plan(_plans, plan_key(q, k, v, mask, scale, return_lse, split_head_dim, kv_tma),
                       lambda: _fwd_plan(q, k, v, out, scale, mask, return_lse, split_head_dim, kv_tma))
    Nq, Nk, BH = q.shape[2], k.shape[2], q.shape[0] * q.shape[1]

    tuned = config is None and plan.tuned
    with on_device(q):
        if tuned:  # the common case: a layout seen before, its launch worked out then
            _launch_tuned(plan, q, k, v, mask, out, lse)
            return out, lse
        pinned, config = bool(config), config or plan.config
        scalars = fwd_scalars(q, k, v, mask, out, scale)
        if config is not None:
            kv = kv_operands(k, v, plan.meta, config["BLOCK_N"])
            consts = {**plan.meta, "EVEN_N": Nk % config["BLOCK_N"] == 0, **config}
            grid, key = launch_grid(Nq, BH, config["BLOCK_M"]), tuple(config.items())
            first = [(_attn_fwd_kernel, grid, (q, *kv, mask, out, lse, *scalars), consts)]
        else:
            args = (q, *kv_operands(k, v, plan.meta), mask, out, lse, *scalars)  # tiles set per config
            # EVEN_N depends on the tuned BLOCK_N; every candidate BLOCK_N divides 128.
            tuner = fwd_tuner(plan.meta["KV_TMA"])
            grid, meta = (lambda META: launch_grid(Nq, BH, META["BLOCK_M"])), {**plan.meta, "EVEN_N": Nk % 128 == 0}
            # The TMA configs' pre-hook, which warmup skips, sets what they compile: they compile when tuned.
            first = [] if plan.meta["KV_TMA"] else [(tuner, grid, args, meta)]
        # A stand-in can serve a call that needs no log-sum-exp and has no mask (a row with every key
        # masked gives zeros here, NaN in SDPA) while its kernel compiles in the background.
        if not pinned and not return_lse and mask is None and stands_aside(plan, q.device, lambda: first):
            return None
        if config is not None:
            try:
                launch(_attn_fwd_kernel, grid, first[0][2], consts, plan.binaries, key)
            except OutOfResources as e:
                if pinned:  # a plan's tiles that do not fit can only be shipped ones
                    raise
                logger.warning("shipped tiles %s do not fit this GPU (%s); autotuning this layout", config, e)
                plan.config = None
                return fa2_attn_fwd(q, k, v, scale, mask, return_lse, split_head_dim, None, kv_tma)
            if not pinned:
                plan.tuned = (grid, scalars, consts, key)
        else:
            if first:
                precompile(*first)
            tuner[grid](*args, **meta)
            # Later calls launch the tuned kernel directly; the same EVEN_N reuses its binary.
            plan.config = {**config_kwargs(tuner.best_config), "EVEN_N": Nk % 128 == 0}
    return out, lse


def _launch_tuned(plan, q, k, v, mask, out, lse) -> None:
    """The plan's tuned launch on this call's tensors (the caller makes their device current)."""
    grid, scalars, consts, key = plan.tuned
    kv = kv_operands(k, v, plan.meta, consts["BLOCK_N"])
    launch(_attn_fwd_kernel, grid, (q, *kv, mask, out, lse, *scalars), consts, plan.binaries, key)


def fa2_repeat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """A launcher for later unmasked calls on tensors laid out exactly as these (shapes, strides,
    dtype, device, alignment), once their plan has a tuned launch (:func:`fa2_attn_fwd` has served
    such a call): ``again(q, k, v) -> out``. It skips the plan's key and lookup, the host's largest
    share of a short call. None where the plan is not yet tuned."""
    plan = _plans.get(plan_key(q, k, v, None, scale, False, None, None))
    if plan is None or not plan.tuned:
        return None

    def again(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        with on_device(q):
            _launch_tuned(plan, q, k, v, None, out, None)
        return out

    return again


__all__ = ["fa2_attn_fwd", "fa2_repeat", "fwd_args", "fwd_configs", "fwd_meta", "fwd_scalars", "kv_operands", "kv_tma_ok", "tuned_config"]
