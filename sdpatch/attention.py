"""``sdpatch.attention``: validation, the one backend decision, and the autograd wrappers.

Backends:

- ``"triton"``: sdpatch's FlashAttention-2-style kernels (CUDA; or the CPU interpreter under
  ``TRITON_INTERPRET=1``). Head dims 1..256, fp16/bf16/fp32, any strides, masks.
- ``"chunked"``: plain PyTorch, chunked over queries within a byte budget. Every device, every
  head dim (the SD VAE's 512), fp64 too.
- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, for comparison.
- ``"auto"``: triton where it supports the call on a CUDA device, else chunked.

Mask convention, shared by every backend: a boolean mask keeps True entries; a float mask is
added to the scaled scores; a query row whose keys are all masked out gives zeros (not NaN).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .chunked import chunked_attention, dead_rows

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "chunked", "sdpa")
TRITON_MAX_HEAD_DIM = 256
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPES = (*_TRITON_DTYPES, torch.float64)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve this call; the message says why."""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401

        from .kernels import flash_fwd  # noqa: F401
    except Exception as e:  # a broken install is as unusable as a missing one
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    return None


def _interpreting() -> bool:
    if _triton_import_error() is not None:
        return False
    from .kernels.flash_fwd import interpreting

    return interpreting()


def triton_status(device: torch.device | str) -> tuple[bool, str]:
    """Whether sdpatch's Triton kernels can run on ``device``, and why not."""
    device = torch.device(device)
    err = _triton_import_error()
    if err is not None:
        return False, err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        return True, "Triton kernels on CUDA"
    if device.type == "cpu" and _interpreting():
        return True, "TRITON_INTERPRET=1: the Triton interpreter on the CPU (slow, for tests)"
    return False, f"Triton kernels need a CUDA device, got {device.type}"


def backend_status(device: torch.device | str) -> dict[str, tuple[bool, str]]:
    """For each concrete backend: whether it can run on ``device`` here, and why (not)."""
    ok, why = triton_status(device)
    return {
        "triton": (ok, why),
        "chunked": (True, "plain PyTorch: every device and head dim"),
        "sdpa": (True, f"torch {torch.__version__} scaled_dot_product_attention"),
    }


def choose_backend(
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    needs_grad: bool = False,
    backend: str = "auto",
) -> BackendChoice:
    """The one place that decides which backend a call gets, and why.

    Raises ``ValueError`` for an unknown backend and :class:`BackendUnavailableError` when an
    explicitly requested backend cannot serve the call.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend in ("chunked", "sdpa"):
        return BackendChoice(backend, "requested")

    ok, why = triton_status(device)
    problem = None
    if not ok:
        problem = why
    elif head_dim > TRITON_MAX_HEAD_DIM:
        problem = f"head dim {head_dim} > {TRITON_MAX_HEAD_DIM}"
    elif dtype not in _TRITON_DTYPES:
        problem = f"dtype {dtype} is not fp16, bf16 or fp32"
    if backend == "triton":
        if problem is not None:
            raise BackendUnavailableError(f"backend='triton' cannot run here: {problem}")
        return BackendChoice("triton", "requested")
    if problem is not None:
        return BackendChoice("chunked", problem)
    if device.type != "cuda":  # never pick the interpreter on its own: it is for tests
        return BackendChoice("chunked", "not a CUDA device")
    return BackendChoice("triton", f"CUDA, head dim {head_dim} <= {TRITON_MAX_HEAD_DIM}")


def _validate(q, k, v, attn_mask, scale) -> tuple[torch.Tensor | None, float]:
    """Check the inputs; return the mask as a 4-D view (never expanded) and the scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"unsupported dtype {q.dtype}; use fp16, bf16, fp32 or fp64")
    B, H, Nq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(
            f"batch and heads must match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[3] != D or v.shape[3] != D:
        raise ValueError(f"head dims must match: q {D}, k {k.shape[3]}, v {v.shape[3]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length, got {k.shape[2]} and {v.shape[2]}")
    Nk = k.shape[2]
    if Nk == 0:
        raise ValueError("k and v have no keys (Nk = 0): softmax over nothing is undefined")
    if D == 0:
        raise ValueError("head dim is 0: the default scale 1/sqrt(D) is undefined")

    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")

    if attn_mask is None:
        return None, float(scale)
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")
    if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (additive), got {attn_mask.dtype}")
    target = (B, H, Nq, Nk)
    try:
        fits = attn_mask.ndim <= 4 and torch.broadcast_shapes(attn_mask.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Nq, Nk) = {target}")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask takes no gradient in sdpatch; pass attn_mask.detach()")
    return attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)), float(scale)


class TritonAttention(torch.autograd.Function):
    """Forward and backward through sdpatch's Triton kernels; saves O and the log-sum-exp only."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask):
        from .kernels.flash_fwd import flash_attn_fwd

        needs_grad = any(ctx.needs_input_grad[:3])
        out, lse = flash_attn_fwd(q, k, v, scale, mask, return_lse=needs_grad)
        if needs_grad:
            ctx.save_for_backward(q, k, v, out, lse, mask)
            ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, do):
        from .kernels.flash_bwd import flash_attn_bwd

        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd(do, q, k, v, out, lse, ctx.scale, mask)
        return dq, dk, dv, None, None


def _sdpa(q, k, v, scale, mask):
    bias = mask.to(q.dtype) if mask is not None and mask.is_floating_point() else mask  # SDPA wants q's dtype
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    if mask is not None:
        # SDPA returns NaN for rows with every key masked; sdpatch's convention is zeros.
        out = out.masked_fill(dead_rows(mask), 0.0)
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    backend: str = "auto",
    chunk_budget: int | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """Exact softmax attention, ``softmax(scale * q @ k^T + mask) @ v``, without an Nq x Nk matrix.

    Args:
        q: (B, H, Nq, D) queries; any strides.
        k, v: (B, H, Nk, D) keys and values.
        scale: softmax scale; default ``1 / sqrt(D)``.
        attn_mask: bool (True = attend) or additive float mask broadcastable to (B, H, Nq, Nk).
            Query rows with every key masked out give zeros. Masks take no gradient.
        backend: one of :data:`BACKENDS`; see :func:`choose_backend` for ``"auto"``.
        chunk_budget: bytes of score buffer for the chunked backend (default 256 MiB).
        upcast: compute the chunked backend's scores in fp32 for fp16/bf16 inputs (diffusers'
            ``upcast_attention``); the triton backend always accumulates in fp32.

    Returns:
        (B, H, Nq, D) in q's dtype, laid out like q.
    """
    mask, scale = _validate(q, k, v, attn_mask, scale)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    choice = choose_backend(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], needs_grad=needs_grad, backend=backend)
    if q.numel() == 0:  # B, H or Nq is 0: the result is well defined and empty
        return q * 0
    if choice.name == "triton":
        if not needs_grad:  # inference skips autograd's bookkeeping: it shows at 10-50 us kernels
            from .kernels.flash_fwd import flash_attn_fwd

            return flash_attn_fwd(q, k, v, scale, mask)[0]
        return TritonAttention.apply(q, k, v, scale, mask)
    if choice.name == "sdpa":
        return _sdpa(q, k, v, scale, mask)
    return chunked_attention(q, k, v, scale, mask, chunk_budget, upcast)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> BackendChoice:
    """Which backend :func:`attention` gives this call, and why, without running it."""
    _validate(q, k, v, attn_mask, None)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return choose_backend(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], needs_grad=needs_grad, backend=backend)
