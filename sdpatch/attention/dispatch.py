"""``sdpatch.attention``: validation, the backend the registry chooses, and the fault policy's retries.

Mask convention, shared by every backend: a boolean mask keeps True entries; a float mask is
added to the scaled scores; a query row whose keys are all masked out gives zeros (not NaN).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch

from ..errors import first_line
from . import faults
from .base import BackendChoice, BackendUnavailableError
from . import chunked
from .chunked import DEFAULT_CHUNK_BUDGET
from .faults import MIN_FALLBACK_BUDGET, Fallback
from .registry import REGISTRY, choose_backend

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
        backend: one of :data:`sdpatch.BACKENDS`; see :func:`choose_backend` for ``"auto"``.
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
    compiling = torch.compiler.is_compiling()
    signature = None if attn_mask is not None or compiling else _repeat_signature(q, k, v, scale, backend)
    if signature is not None:
        repeat = faults.repeats.get(signature)
        if repeat is not None:
            out, _ = _served(repeat.backend, repeat.again, q, k, v, repeat.scale, None, backend, chunk_budget, upcast,
                             on_fallback)
            if out is not None:
                return out
    mask, scale = _validate(q, k, v, attn_mask, scale)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if compiling:  # chosen once, at trace time; no retries inside a graph
        if q.numel() == 0:
            return q * 0
        # A dynamic-shape trace may carry the head dim as a symbol; index() makes it a constant of the
        # trace (guarded: another head dim traces again), which the choice needs.
        name = _traced_choice(q.device, q.dtype, operator.index(q.shape[-1]), backend)
        return REGISTRY[name].run(q, k, v, scale, mask, needs_grad, chunk_budget, upcast)
    key = (q.device, q.dtype, q.shape[-1], backend) if faults.cached(q) else None
    choice = faults.choices.get(key) if key else None
    if choice is None:
        choice = choose_backend(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], backend=backend)
        if key:
            faults.choices[key] = choice
    if q.numel() == 0:  # B, H or Nq is 0: the result is well defined and empty
        return q * 0
    record = REGISTRY[choice.name]
    out, fell_back = _served(choice.name, lambda q, k, v: record.run(q, k, v, scale, mask, needs_grad, chunk_budget, upcast),
                             q, k, v, scale, mask, backend, chunk_budget, upcast, on_fallback)
    if signature is not None and not fell_back:
        again = record.repeat(q, k, v, scale)
        if again is not None:
            faults.remember_repeat(signature, faults.Repeat(choice.name, scale, again))
    return out


def _repeat_signature(q, k, v, scale, backend: str) -> tuple | None:
    """What an eager call without a mask or gradients must share with an earlier one to be served
    as it was, skipping validation and the backend's choice (:data:`faults.repeats`): every fact
    :func:`_validate` and the launch layer read (shapes, strides, dtypes, devices, 16-byte
    alignment) and the arguments. None for a call that needs gradients, or for arguments that are
    not tensors (validation then says what is wrong), and where calls are not cached (:func:`faults.cached`)."""
    try:
        if not faults.cached(q) or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return None
        signature = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
                     q.device, k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, scale, backend)
        hash(signature)
    except (AttributeError, TypeError):
        return None
    return signature


def _served(name: str, run, q, k, v, scale, mask, backend, chunk_budget, upcast, on_fallback) -> tuple:
    """``run(q, k, v)`` on backend ``name``, with the fault policy's retries (see :func:`attention`):
    (the output, or None where ``run`` declined the call; whether the chunked retry served it)."""
    try:
        return run(q, k, v), False
    except torch.cuda.OutOfMemoryError as err:  # torch.OutOfMemoryError from 2.5 on; the same class
        if faults.capturing(q):
            raise
        reason = f"out of memory: {first_line(err)}"
        budget = (DEFAULT_CHUNK_BUDGET if chunk_budget is None else chunk_budget) // 4
        faults.warn_once(
            "oom",
            "%s attention: %s; retrying on chunked with a %.1f MiB budget",
            name,
            reason,
            budget / 2**20,
        )
    except Exception as err:  # noqa: BLE001 (whatever a kernel's launch raises: see the docstring)
        if not REGISTRY[name].falls_back or faults.capturing(q):
            raise
        # Triton's CompilationError starts with the source location; its error_message says what failed.
        reason = f"{type(err).__name__}: {getattr(err, 'error_message', None) or first_line(err)}"
        faults.remember_failure(name, q.device, q.dtype, q.shape[-1], reason)
        budget = chunk_budget
        if backend == name:
            raise BackendUnavailableError(
                f"backend={backend!r} failed to compile or launch its kernel ({reason}); "
                "backend='auto' would run such calls on chunked"
            ) from err
        faults.warn_once(
            name,
            "the %s kernel failed on %s, %s, head dim %d (%s); such calls run on chunked from now on",
            name.capitalize(),
            q.device,
            q.dtype,
            q.shape[-1],
            reason,
        )
    # Retried outside the except blocks, so that the failed attempt's frames (held by the
    # traceback) and their tensors are freed first.
    out, budget = _chunked_retry(q, k, v, scale, mask, budget, upcast)
    if on_fallback is not None:
        on_fallback(Fallback(name, reason, budget))
    return out, True


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
            return chunked.chunked_attention(q, k, v, scale, mask, budget, upcast), budget
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
    """Which backend :func:`attention` gives this call, why, and which kernel path inside it, without
    running it.

    The returned :class:`BackendChoice` has the backend's ``name`` (a key of the registry), the
    ``reason`` (``"requested"``, or what made ``auto`` pick it), and ``path``: for ``triton``, the
    kernel and its grid as the launch layer would run them (e.g. ``"gluon, head dim 40 as 32 + 16,
    last wave split in 3"`` or ``"triton fa2, head dim 64"``); None for backends with one path.
    Raises like :func:`attention` for invalid inputs or an explicit backend that cannot serve.
    """
    mask, _ = _validate(q, k, v, attn_mask, None)
    choice = choose_backend(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], backend=backend)
    path = REGISTRY[choice.name].path(q, k, v, mask)
    return BackendChoice(choice.name, choice.reason, path)
