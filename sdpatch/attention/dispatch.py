"""``sdpatch.attention``: validation, the one backend decision, and the autograd wrappers.

Backends:

- ``"triton"``: sdpatch's FlashAttention-2-style kernels (CUDA; or the CPU interpreter under
  ``TRITON_INTERPRET=1``). Head dims 1..256, fp16/bf16/fp32, any strides, masks.
- ``"chunked"``: plain PyTorch, chunked over queries within a byte budget. Every device, every
  head dim (the SD VAE's 512), fp64 too.
- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``, for comparison.
- ``"auto"``: triton where it supports the call on a CUDA device, else chunked.

Faults (see :func:`attention`): a call that runs out of memory is retried on the chunked backend
at a smaller budget; a Triton kernel that fails to compile or launch makes ``auto`` use chunked
for such calls from then on, and makes an explicit ``"triton"`` raise. Neither happens inside a
``torch.compile`` trace or a CUDA-graph capture, which cannot re-run a call: there the error is
raised to the caller (see :func:`attention`).

Graphs and compilers: eager calls launch the kernels straight from Python; under ``torch.compile``
the triton backend is the custom op ``torch.ops.sdpatch.flash_fwd`` (:mod:`sdpatch.ops`), chosen
at trace time, with its backward op as its autograd formula. Nothing here keeps per-call state that
a captured graph or a compiled region would have to replay.

Mask convention, shared by every backend: a boolean mask keeps True entries; a float mask is
added to the scaled scores; a query row whose keys are all masked out gives zeros (not NaN).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .chunked import DEFAULT_CHUNK_BUDGET, chunked_attention, dead_rows
from .errors import first_line

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "chunked", "sdpa")
TRITON_MAX_HEAD_DIM = 256
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPES = (*_TRITON_DTYPES, torch.float64)
# Out of memory, the chunked retry starts at a quarter of its usual budget, leaving room for
# whatever else holds memory, and halves down to this floor (a few rows per chunk at SD sizes).
MIN_FALLBACK_BUDGET = 2**20

# (device, dtype, head dim) -> why the Triton kernel failed there. Remembered for the process:
# a compiler that is missing or rejects the kernel will not succeed on the next call either.
_triton_failures: dict[tuple[str, torch.dtype, int], str] = {}
_warned: set[str] = set()  # kinds of fault already logged at warning level


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve this call; the message says why."""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


@dataclass(frozen=True)
class Fallback:
    """A call that the chunked backend served after ``backend`` failed; ``budget`` is what fit."""

    backend: str
    reason: str
    budget: int


# CUDA calls' backend choices by (device, dtype, head dim, backend). Nothing a choice there depends
# on changes while the process runs, except a Triton failure, which clears this; deciding anew cost
# microseconds of host time per call, and SD's UNets at 512-1024 px are host-bound on an H200.
_cuda_choices: dict[tuple, BackendChoice] = {}


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401

        from .kernels import flash_fwd  # noqa: F401
    except Exception as e:  # a broken install is as unusable as a missing one
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    return None


@functools.lru_cache(maxsize=None)
def _kernels():
    """sdpatch's kernel modules (flash_fwd, flash_bwd), imported on first use: an import statement
    per call costs a microsecond of the host time that bounds SD's UNets (see :data:`_cuda_choices`)."""
    from .kernels import flash_bwd, flash_fwd

    return flash_fwd, flash_bwd


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
    elif (failure := _triton_failures.get((str(device), dtype, head_dim))) is not None:
        problem = f"the Triton kernel failed here before ({failure})"
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
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        name, t = next((n, t) for n, t in (("q", q), ("k", k), ("v", v)) if not isinstance(t, torch.Tensor))
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == len(ks) == len(vs) == 4):
        name, t = next((n, t) for n, t in (("q", q), ("k", k), ("v", v)) if t.ndim != 4)
        raise ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
    device, dtype = q.device, q.dtype
    if k.device != device or v.device != device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.dtype != dtype or v.dtype != dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if dtype not in _DTYPES:
        raise TypeError(f"unsupported dtype {q.dtype}; use fp16, bf16, fp32 or fp64")
    B, H, Nq, D = qs
    if ks[:2] != (B, H) or vs[:2] != (B, H):
        raise ValueError(f"batch and heads must match: q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}")
    if ks[3] != D or vs[3] != D:
        raise ValueError(f"head dims must match: q {D}, k {ks[3]}, v {vs[3]}")
    Nk = ks[2]
    if vs[2] != Nk:
        raise ValueError(f"k and v must have the same length, got {Nk} and {vs[2]}")
    if Nk == 0:
        raise ValueError("k and v have no keys (Nk = 0): softmax over nothing is undefined")
    if D == 0:
        raise ValueError("head dim is 0: the default scale 1/sqrt(D) is undefined")

    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif torch.compiler.is_compiling():  # a trace may carry the scale as a symbolic float
        pass
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
        needs_grad = any(ctx.needs_input_grad[:3])
        out, lse = _kernels()[0].flash_attn_fwd(q, k, v, scale, mask, return_lse=needs_grad)
        if needs_grad:
            ctx.save_for_backward(q, k, v, out, lse, mask)
            ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _kernels()[1].flash_attn_bwd(do, q, k, v, out, lse, ctx.scale, mask)
        return dq, dk, dv, None, None


def _sdpa(q, k, v, scale, mask):
    if any(t.data_ptr() % 16 or t.stride(-1) != 1 for t in (q, k, v)):
        # PyTorch's fused kernels returned wrong values (rel err 1.4) on rows that do not start
        # 16-byte aligned (a slice of wider rows, head dim 80, bool mask; H200, torch 2.11).
        q, k, v = (t.contiguous() for t in (q, k, v))
    bias = mask.to(q.dtype) if mask is not None and mask.is_floating_point() else mask  # SDPA wants q's dtype
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    if mask is not None:
        # SDPA returns NaN for rows with every key masked; sdpatch's convention is zeros.
        out = out.masked_fill(dead_rows(mask), 0.0)
    return out


def _run(name, q, k, v, scale, mask, needs_grad, chunk_budget, upcast):
    if name == "triton" and torch.compiler.is_compiling():
        from . import ops  # noqa: F401 (registers torch.ops.sdpatch)

        return torch.ops.sdpatch.flash_fwd(q, k, v, mask, scale, needs_grad)[0]
    if name == "triton":
        if not needs_grad:  # inference skips autograd's bookkeeping: it shows at 10-50 us kernels
            return _kernels()[0].flash_attn_fwd(q, k, v, scale, mask)[0]
        return TritonAttention.apply(q, k, v, scale, mask)
    if name == "sdpa":
        return _sdpa(q, k, v, scale, mask)
    return chunked_attention(q, k, v, scale, mask, chunk_budget, upcast)


def _warn_once(kind: str, msg: str, *args) -> None:
    """Log the first fault of each kind as a warning, later ones at debug level: a long run can
    fall back thousands of times, and the patch report counts them per layer."""
    logger.log(logging.DEBUG if kind in _warned else logging.WARNING, msg, *args)
    _warned.add(kind)


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
    on_fallback: Callable[[Fallback], None] | None = None,
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
        upcast: compute the chunked backend's scores in fp32 for fp16 inputs (diffusers'
            ``upcast_attention``; bf16 scores are always fp32); the triton backend always
            accumulates in fp32.
        on_fallback: called with a :class:`Fallback` when the chunked backend served the call
            instead of the chosen one (the processor counts these for the patch report).

    Returns:
        (B, H, Nq, D) in q's dtype, laid out like q.

    Faults, handled here and only here, in eager calls (inside a ``torch.compile`` trace or a
    CUDA-graph capture every error is raised to the caller, which must run the call eagerly to get
    these retries; :mod:`sdpatch.graphs` does):

    - ``torch.OutOfMemoryError`` on any backend: the call is retried on the chunked backend at a
      quarter of ``chunk_budget`` (default 64 MiB), halved on each further OOM down to
      :data:`MIN_FALLBACK_BUDGET`; an OOM there is raised.
    - Any other exception from the Triton launch (no compiler, an unsupported GPU, a compile
      error): remembered for this (device, dtype, head dim) for the rest of the process. With
      ``backend="auto"`` the call, and every later such call, runs chunked; with
      ``backend="triton"`` it raises :class:`BackendUnavailableError`. Failures in the Triton
      backward pass are not caught: the forward has already run on Triton.

    The first fault of each kind is logged as a warning, later ones at debug level.
    """
    mask, scale = _validate(q, k, v, attn_mask, scale)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if torch.compiler.is_compiling():  # chosen once, at trace time; no retries inside a graph
        if q.numel() == 0:
            return q * 0
        name = _traced_choice(q.device, q.dtype, q.shape[-1], backend)
        return _run(name, q, k, v, scale, mask, needs_grad, chunk_budget, upcast)
    key = (q.device, q.dtype, q.shape[-1], backend) if q.is_cuda else None
    choice = _cuda_choices.get(key) if key else None
    if choice is None:
        choice = choose_backend(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], backend=backend)
        if key:
            _cuda_choices[key] = choice
    if q.numel() == 0:  # B, H or Nq is 0: the result is well defined and empty
        return q * 0
    try:
        return _run(choice.name, q, k, v, scale, mask, needs_grad, chunk_budget, upcast)
    except torch.cuda.OutOfMemoryError as err:  # torch.OutOfMemoryError from 2.5 on; the same class
        if _capturing(q):
            raise
        reason = f"out of memory: {first_line(err)}"
        budget = (DEFAULT_CHUNK_BUDGET if chunk_budget is None else chunk_budget) // 4
        _warn_once(
            "oom",
            "%s attention: %s; retrying on chunked with a %.1f MiB budget",
            choice.name,
            reason,
            budget / 2**20,
        )
    except Exception as err:  # noqa: BLE001 (whatever the Triton launch raises: see the docstring)
        if choice.name != "triton" or _capturing(q):
            raise
        # Triton's CompilationError starts with the source location; its error_message says what failed.
        reason = f"{type(err).__name__}: {getattr(err, 'error_message', None) or first_line(err)}"
        _triton_failures[(str(q.device), q.dtype, q.shape[-1])] = reason
        _cuda_choices.clear()
        budget = chunk_budget
        if backend == "triton":
            raise BackendUnavailableError(
                f"backend='triton' failed to compile or launch its kernel ({reason}); "
                "backend='auto' would run such calls on chunked"
            ) from err
        _warn_once(
            "triton",
            "the Triton kernel failed on %s, %s, head dim %d (%s); such calls run on chunked from now on",
            q.device,
            q.dtype,
            q.shape[-1],
            reason,
        )
    # Retried outside the except blocks, so that the failed attempt's frames (held by the
    # traceback) and their tensors are freed first.
    out, budget = _chunked_retry(q, k, v, scale, mask, budget, upcast)
    if on_fallback is not None:
        on_fallback(Fallback(choice.name, reason, budget))
    return out


def _capturing(q: torch.Tensor) -> bool:
    """Whether this call is being recorded into a CUDA graph: a retry would record half a call."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _traced_choice(device: torch.device, dtype: torch.dtype, head_dim: int, backend: str) -> str:
    """:func:`choose_backend`'s pick, a constant of the trace: the trace keeps it until recompiled."""
    return choose_backend(device=device, dtype=dtype, head_dim=head_dim, backend=backend).name


if hasattr(torch, "_dynamo"):  # evaluated at trace time, not traced: its caches are plain Python
    _traced_choice = torch._dynamo.assume_constant_result(_traced_choice)


def _chunked_retry(q, k, v, scale, mask, budget, upcast) -> tuple[torch.Tensor, int]:
    """Chunked attention, halving ``budget`` on OOM down to the floor; returns the budget that fit."""
    budget = DEFAULT_CHUNK_BUDGET if budget is None else budget
    while True:
        try:
            return chunked_attention(q, k, v, scale, mask, budget, upcast), budget
        except torch.cuda.OutOfMemoryError:
            if budget <= MIN_FALLBACK_BUDGET:
                raise
        budget = max(MIN_FALLBACK_BUDGET, budget // 2)


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
    return choose_backend(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], backend=backend)
