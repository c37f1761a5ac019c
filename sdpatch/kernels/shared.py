"""What the forward and backward kernels share: the table of what they serve, the one head-dim
tiling rule, the mask kinds, their common constexprs, and two jitted helpers."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .runtime import interpreting

LOG2E = 1.4426950408889634  # 1/ln 2: exp(x) = exp2(x * LOG2E)


class Serves(NamedTuple):
    """What the kernels take: head dims 1..``max_head_dim``, these dtypes, these mask kinds (any
    strides, any sequence lengths). The triton backend and every launcher read this one table."""

    max_head_dim: int
    dtypes: tuple
    masks: tuple


SERVES = Serves(256, (torch.float16, torch.bfloat16, torch.float32), ("none", "additive", "bool"))

# Mask kinds (constexpr MASK_KIND), in SERVES.masks' order.
NO_MASK, ADDITIVE_MASK, BOOL_MASK = 0, 1, 2


@triton.jit
def batch_head(H):
    """This program's index into B*H, and its batch and head (int64 for the offsets). B*H is spread
    over grid dims 1 and 2 so that it can exceed 65,535 (see :func:`launch_grid`)."""
    pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    return pid_bh, (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)


@triton.jit
def in_range(offs, n, NO_TAIL: tl.constexpr):
    """Which of the offsets ``offs`` are below ``n``; all, known at compile time, where there is no
    tail (``NO_TAIL``), so that loads under this mask compile unmasked. "All" is the comparison of
    a value with itself, which folds to a constant like a literal True, which triton 3.2's
    interpreter cannot broadcast (it has no int1 constants)."""
    valid = offs < n
    if NO_TAIL:
        valid = valid == valid
    return valid


@triton.jit
def masked_scores(s, mask_ptrs, valid, MASK_KIND: tl.constexpr):
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


def split_parts(head_dim: int, halves: bool = False) -> tuple[int, int]:
    """The one head-dim split rule: (A, B), a power of two and a smaller one covering the head dim
    (40 = 32 + 16, 80 = 64 + 16, 160 = 128 + 32; parts of at least 16, an MMA's K), or (next power of
    two, 0) where two parts save no columns; ``halves`` also allows two equal parts (a split forced
    for tests: 64 = 32 + 32). Each kernel decides whether it takes the split: the Gluon forward
    wherever there is one, the Triton kernels where it was measured to pay (:func:`head_dim_parts`)."""
    whole = max(16, triton.next_power_of_2(head_dim))
    a = max(16, whole // 2)
    b = max(16, triton.next_power_of_2(head_dim - a)) if head_dim > a else 0
    return (a, b) if 0 < b and (a + b < whole or halves) else (whole, 0)


def head_dim_parts(head_dim: int, split: bool | None = None, backward: bool = False) -> tuple[int, int]:
    """Power-of-two tile widths (A, B) covering the head dim; B = 0 when one tile serves.

    ``split=None`` splits where it was measured to pay (H200, triton 3.6, diffusers' layout). The
    forward splits when part B is at most a quarter of part A: 80 -> (64, 16) ran at 390 TFLOP/s
    against 285 padded to 128, and 160 -> (128, 32) at 382 against 200 padded to 256; 40 -> (32, 16),
    where B is half of A, ran at 236 against 245 padded to 64, so its 40 stays whole. The
    ``backward``, five products a block pair to the forward's two, splits when B is at most half of
    A: its 40 -> (32, 16) ran at 239 TFLOP/s against 213 padded (4096 tokens) and 247 against 218
    (16384), with each tiling's best tiles. Tiles are at least 16 wide (the tensor-core minimum);
    ``split=True`` forces two parts wherever the head dim allows.
    """
    a, b = split_parts(head_dim, halves=True)
    if split is None:
        split = 0 < b <= a // (2 if backward else 4)
    return (a, b) if split and b > 0 else (max(16, triton.next_power_of_2(head_dim)), 0)


def tiling(head_dim: int, split: bool | None, align: int, kind: int, *lengths: int, backward: bool = False) -> tuple[int, int]:
    """The head-dim tiles a launch uses: :func:`head_dim_parts`, but with ``split=None`` two parts
    only on aligned rows, without a mask, and with every sequence in ``lengths`` a whole number of
    128-row blocks. compute-sanitizer caught the two-part tiling reading shared memory out of bounds
    in its second p @ v dot with a mask and 77 keys (triton 3.6, H200: wrong results or an illegal
    address); these are the launches where it ran clean. The backward kernels follow the same
    conditions, with their own split rule (``backward``)."""
    if split is None and (align == 1 or kind != NO_MASK or any(n % 128 for n in lengths)):
        split = False
    return head_dim_parts(head_dim, split, backward)


def mask_kind(mask: torch.Tensor | None) -> int:
    if mask is None:
        return NO_MASK
    return BOOL_MASK if mask.dtype == torch.bool else ADDITIVE_MASK



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


def plan_key(q, k, v, mask, scale, return_lse, split_head_dim, kv_tma) -> tuple:
    """Everything a launch's constexprs and Triton's specialization depend on (see :func:`launch`);
    the outputs are allocated here, like q, so q's layout fixes theirs."""
    mask_layout = None if mask is None else (mask.dtype, mask.shape, mask.stride(), mask.device, mask.data_ptr() % 16)
    alignment = (q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, alignment,
            mask_layout, scale, return_lse, split_head_dim, kv_tma)
