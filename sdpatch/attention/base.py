"""The records the registry and the backends share: a backend, a call's facts, a choice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve this call; the message says why."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend a call gets (``name``, a key of :data:`REGISTRY`) and, in words, why: either
    ``"requested"`` or what made ``auto`` pick it (for chunked, what kept the others out). ``path``
    names the kernel path inside the backend where it has several (:func:`sdpatch.explain` fills it)."""

    name: str
    reason: str
    path: str | None = None

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})" + (f" via {self.path}" if self.path else "")


@dataclass(frozen=True)
class Call:
    """What a backend decision depends on, without the tensors (so the patcher and the planner can
    ask before any call is made)."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int


@dataclass(frozen=True)
class Backend:
    """One attention backend.

    ``supports(call)``: None if it can serve the call here, else why not (its device, dtype, head
    dim, or a failure remembered by :mod:`.faults`). ``auto_refuses(call)``: a further reason for
    ``auto`` to pass it over though it could serve (the Triton interpreter is for tests), or None.
    ``auto_reason(call)``: what the choice says when ``auto`` takes it. ``run(q, k, v, scale, mask,
    needs_grad, chunk_budget, upcast)``: the (B, H, Nq, D) output. ``workspace(batch, heads, nq, nk,
    head_dim, elem, chunk_budget, upcast)``: bytes a call holds beyond its inputs and output, for
    the planner. ``status(device)``: (whether it can run on the device here, why), for ``sdpatch info``.
    ``repeat(q, k, v, scale)``: after it served an unmasked call without gradients, a launcher
    ``again(q, k, v) -> out`` for later calls of the same layout, skipping the checks and plans that
    layout has passed, or None (see :data:`sdpatch.attention.faults.repeats`); ``again`` may return
    None to send a call down the full path.
    """

    name: str
    description: str
    supports: Callable[[Call], str | None]
    run: Callable[..., torch.Tensor]
    workspace: Callable[..., float]
    status: Callable[[torch.device], tuple[bool, str]]
    auto_refuses: Callable[[Call], str | None] = lambda call: None
    auto_reason: Callable[[Call], str] = lambda call: "auto"
    path: Callable[..., str | None] = lambda q, k, v, mask: None
    falls_back: bool = False
    repeat: Callable[..., Callable | None] = lambda q, k, v, scale: None
