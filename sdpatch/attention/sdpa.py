"""The ``sdpa`` backend: PyTorch's ``scaled_dot_product_attention``, for comparison, under sdpatch's
mask convention (a row with every key masked out gives zeros, where SDPA gives NaN)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Backend, Call
from .chunked import dead_rows


def run(q, k, v, scale, mask, needs_grad, chunk_budget, upcast):
    if torch.compiler.is_compiling() or any(t.data_ptr() % 16 or t.stride(-1) != 1 for t in (q, k, v)):
        # PyTorch's fused kernels returned wrong values (rel err 1.4) on rows that do not start
        # 16-byte aligned (a slice of wider rows, head dim 80, bool mask; H200, torch 2.11); a
        # trace cannot read the alignment.
        q, k, v = (t.contiguous() for t in (q, k, v))
    bias = mask.to(q.dtype) if mask is not None and mask.is_floating_point() else mask  # SDPA wants q's dtype
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    if mask is not None:
        out = out.masked_fill(dead_rows(mask), 0.0)
    return out


def workspace(batch, heads, nq, nk, head_dim, elem, chunk_budget, upcast) -> float:
    """SDPA's fused backends hold a few MiB at SD shapes (its math backend would hold the scores)."""
    return 0


BACKEND = Backend(
    name="sdpa",
    description=f"torch {torch.__version__} scaled_dot_product_attention (cuDNN, flash, efficient or math)",
    supports=lambda call: None,
    run=run,
    workspace=workspace,
    status=lambda device: (True, f"torch {torch.__version__} scaled_dot_product_attention"),
)
