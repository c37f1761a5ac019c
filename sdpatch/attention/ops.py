"""sdpatch's Triton attention as ``torch.library`` custom ops, for ``torch.compile`` and AOTAutograd.

``torch.ops.sdpatch.flash_fwd`` and ``torch.ops.sdpatch.flash_bwd`` wrap the kernels' launchers
(:func:`sdpatch.kernels.flash_fwd.flash_attn_fwd`, :func:`sdpatch.kernels.flash_bwd.flash_attn_bwd`)
with fake (meta) implementations, so that a trace sees their output shapes without running them,
and the forward's autograd formula is the backward op. Inductor treats them as opaque kernels:
a compiled UNet keeps sdpatch's attention and fuses everything around it.

Eager calls do not go through these ops: :func:`sdpatch.attention.attention` calls the launchers
directly there, since the dispatcher's host time per call shows on host-bound UNet steps. So the
forward op launches as a CUDA graph's calls do (:func:`sdpatch.kernels.forward.for_capture`: the
Gluon kernel wherever it serves, not only past the eager threshold): ``mode="reduce-overhead"``
warms the compiled code up eagerly and then captures it, and its replays cost no host time per
launch, while compiled code without graphs spends less host time between launches than an eager
UNet does.
"""

from typing import Optional, Tuple  # the ops' schemas are read from these hints: no postponed annotations

import torch
from torch import Tensor


@torch.library.custom_op("sdpatch::flash_fwd", mutates_args=())
def flash_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, return_lse: bool) -> Tuple[Tensor, Tensor]:
    """(out, lse): attention of (B, H, Nq, D) q over (B, H, Nk, D) k and v, and the fp32 (B, H, Nq)
    base-2 log-sum-exp, or an empty lse unless ``return_lse`` (an op cannot return None)."""
    from ..kernels.forward import flash_attn_fwd, for_capture

    with for_capture():
        out, lse = flash_attn_fwd(q, k, v, scale, mask, return_lse=return_lse)
    return out, (lse if lse is not None else q.new_empty((0,), dtype=torch.float32))


@flash_fwd.register_fake
def _(q, k, v, mask, scale, return_lse):
    lse_shape = q.shape[:3] if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("sdpatch::flash_bwd", mutates_args=())
def flash_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Optional[Tensor], scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`flash_fwd`, from its output and log-sum-exp."""
    from ..kernels.flash_bwd import flash_attn_bwd

    return flash_attn_bwd(do, q, k, v, out, lse, scale, mask)


@flash_bwd.register_fake
def _(do, q, k, v, out, lse, mask, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, scale, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.scale = scale


def _backward(ctx, dout: Tensor, _dlse: Tensor):
    q, k, v, out, lse, mask = ctx.saved_tensors
    if lse.numel() == 0:
        raise RuntimeError("sdpatch::flash_fwd was called with return_lse=False: its backward needs the log-sum-exp")
    dq, dk, dv = flash_bwd(dout, q, k, v, out, lse, mask, ctx.scale)
    return dq, dk, dv, None, None, None


flash_fwd.register_autograd(_backward, setup_context=_setup_context)
