"""Float64 reference attention: the ground truth every backend is tested against.

It materializes the full score matrix, so use it on small shapes only.
"""

from __future__ import annotations

import math

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact softmax attention in float64; returns float64 (B, H, Nq, D).

    Masks follow sdpatch's convention: a boolean mask keeps True entries, a float mask is added
    to the scores, and a query row with every key masked out gives zeros.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.double()
    m = s.amax(-1, keepdim=True)
    dead = m == float("-inf")
    p = torch.exp(s - torch.where(dead, 0.0, m))
    p = p / torch.where(dead, 1.0, p.sum(-1, keepdim=True))
    return torch.matmul(p, v.double())
