"""The forward's launch layer: which kernel variant serves a call, and the call itself.

Two variants compute the same function: the Gluon Hopper kernel (:mod:`.flash_fwd_hopper`) for
unmasked self-attention on sm_90 wherever its grid fills the GPU (:func:`flash_fwd_hopper.serves`),
where it measured faster, and the FlashAttention-2-style Triton kernel (:mod:`.flash_fwd`) for every
other call. A Gluon launch that raises (an API this triton lacks) hands every later call to the
Triton kernel, with one warning. :func:`describe` says which variant, tiling and grid a call gets.
"""

from __future__ import annotations

import torch

from . import flash_fwd, flash_fwd_hopper
from .shared import mask_kind, tiling
from .runtime import vector_align


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
    """Attention forward on the variant that serves the call; arguments and results as
    :func:`flash_fwd.fa2_attn_fwd`'s. Calls that pin the Triton kernel's tiling (``config``,
    ``split_head_dim`` or ``kv_tma``) always get it."""
    if config is None and split_head_dim is None and kv_tma is None and flash_fwd_hopper.serves(q, k, v, mask):
        try:
            return flash_fwd_hopper.gluon_attn_fwd(q, k, v, scale, return_lse)
        except torch.cuda.OutOfMemoryError:  # the Triton kernel needs the same memory
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a Gluon API this triton lacks: fall back for good
            flash_fwd_hopper.disable(e)
    return flash_fwd.fa2_attn_fwd(q, k, v, scale, mask, return_lse, split_head_dim, config, kv_tma)


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The variant a default call takes, with its head-dim tiling and, for Gluon, its grid."""
    D = q.shape[-1]
    if flash_fwd_hopper.serves(q, k, v, mask):
        lo, hi = flash_fwd_hopper.split_parts(D)
        config = flash_fwd_hopper.config_for(D)
        B, H, Nq, _ = q.shape
        grid = flash_fwd_hopper.grid_for(B * H, Nq, k.shape[2], flash_fwd_hopper.sm_count(q.get_device()), config)
        how = (f", last wave split in {grid.splits}" if grid.pieces else "") + (", tiles of two sizes" if grid.mixed else "")
        return f"gluon (Hopper, warp-specialized), head dim {D}" + (f" as {lo} + {hi}" if hi else "") + how
    a, b = tiling(D, None, vector_align(q, k, v), mask_kind(mask), k.shape[2])
    tma = flash_fwd.kv_tma_ok(k, v) and 4 * q.numel() * k.shape[2] >= flash_fwd.TMA_MIN_FLOP and q.is_cuda
    return (f"triton fa2, head dim {D}" + (f" as {a} + {b}" if b else f" in a {a}-wide tile" if a != D else "")
            + (", K and V through TMA" if tma else ""))


__all__ = ["describe", "flash_attn_fwd"]
