"""The ``triton`` backend: sdpatch's flash-attention kernels (:mod:`sdpatch.kernels`).

What it serves is :data:`sdpatch.kernels.SERVES` (head dims, dtypes, masks): the one table the
kernels' launchers assert and this backend reads. Eager calls go straight to the launchers (the
dispatcher's host time per call shows on host-bound UNet steps); a ``torch.compile`` trace gets the
custom op ``torch.ops.sdpatch.flash_fwd`` (:mod:`.ops`).
"""

from __future__ import annotations

import functools

import torch

from . import faults
from .base import Backend, Call


@functools.lru_cache(maxsize=None)
def import_error() -> str | None:
    try:
        import triton  # noqa: F401

        from ..kernels import forward  # noqa: F401
    except Exception as e:  # a broken install is as unusable as a missing one
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    return None


@functools.lru_cache(maxsize=None)
def kernels():
    """The launch layer's forward and backward modules, imported on first use: an import statement
    per call costs a microsecond of the host time that bounds SD's UNets."""
    from ..kernels import flash_bwd, forward

    return forward, flash_bwd


def _interpreting() -> bool:
    if import_error() is not None:
        return False
    from ..kernels.runtime import interpreting

    return interpreting()


def status(device: torch.device) -> tuple[bool, str]:
    """Whether sdpatch's Triton kernels can run on ``device``, and why not."""
    err = import_error()
    if err is not None:
        return False, err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        return True, "Triton kernels on CUDA"
    if device.type == "cpu" and _interpreting():
        return True, "TRITON_INTERPRET=1: the Triton interpreter on the CPU (slow, for tests)"
    return False, f"Triton kernels need a CUDA device, got {device.type}"


def supports(call: Call) -> str | None:
    ok, why = status(call.device)
    if not ok:
        return why
    from ..kernels import SERVES

    if call.head_dim > SERVES.max_head_dim:
        return f"head dim {call.head_dim} > {SERVES.max_head_dim}"
    if call.dtype not in SERVES.dtypes:
        return f"dtype {call.dtype} is not fp16, bf16 or fp32"
    failed = faults.failure("triton", call.device, call.dtype, call.head_dim)
    if failed is not None:
        return f"the Triton kernel failed here before ({failed})"
    return None


def auto_refuses(call: Call) -> str | None:
    return None if call.device.type == "cuda" else "not a CUDA device"  # the interpreter is for tests


def auto_reason(call: Call) -> str:
    from ..kernels import SERVES

    return f"CUDA, head dim {call.head_dim} <= {SERVES.max_head_dim}"


class TritonAttention(torch.autograd.Function):
    """Forward and backward through the kernels in eager mode; saves O and the log-sum-exp only."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask):
        needs_grad = any(ctx.needs_input_grad[:3])
        out, lse = kernels()[0].flash_attn_fwd(q, k, v, scale, mask, return_lse=needs_grad)
        if needs_grad:
            ctx.save_for_backward(q, k, v, out, lse, mask)
            ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = kernels()[1].flash_attn_bwd(do, q, k, v, out, lse, ctx.scale, mask)
        return dq, dk, dv, None, None


def run(q, k, v, scale, mask, needs_grad, chunk_budget, upcast):
    if torch.compiler.is_compiling():
        from . import ops  # noqa: F401 (registers torch.ops.sdpatch)

        return torch.ops.sdpatch.flash_fwd(q, k, v, mask, scale, needs_grad)[0]
    if not needs_grad:  # inference skips autograd's bookkeeping: it shows at 10-50 us kernels
        return kernels()[0].flash_attn_fwd(q, k, v, scale, mask)[0]
    return TritonAttention.apply(q, k, v, scale, mask)


def repeat(q, k, v, scale):
    return kernels()[0].repeat_launcher(q, k, v, scale)


def workspace(batch, heads, nq, nk, head_dim, elem, chunk_budget, upcast) -> float:
    """None beyond the log-sum-exp: the score tiles live in registers (the split grids' fp32
    workspace of at most one query tile an SM is a few MiB, left out)."""
    return 0


def path(q, k, v, mask) -> str | None:
    """The kernel a call on these tensors takes here, with gradients where they ask for them (see
    :func:`sdpatch.kernels.forward.describe`)."""
    if import_error() is not None:
        return None
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return kernels()[0].describe(q, k, v, mask, return_lse=needs_grad)


BACKEND = Backend(
    name="triton",
    description="sdpatch's flash-attention kernels (Triton, and Gluon on Hopper): CUDA, head dims up to 256",
    supports=supports,
    run=run,
    workspace=workspace,
    status=status,
    auto_refuses=auto_refuses,
    auto_reason=auto_reason,
    path=path,
    falls_back=True,
    repeat=repeat,
)
