"""The backend registry: one record per backend, and the one decision of which backend a call gets.

Every reader of the set of backends reads it here: :func:`sdpatch.attention` and :func:`explain`,
``BACKENDS`` and the CLI's choices, the comparison report's columns, the planner's memory estimates.
A backend is a :class:`Backend` record, ``BACKEND`` in its module beside this one; adding one is that
module and its row in :data:`sdpatch.settings.ATTENTION_BACKENDS`, the torch-free table of names the
CLI reads too. ``auto`` takes the first record of :data:`AUTO_ORDER` that serves the call.
"""

from __future__ import annotations

import importlib

import torch

from ..settings import ATTENTION_BACKENDS
from .base import Backend, BackendChoice, BackendUnavailableError, Call


def _registry() -> dict[str, Backend]:
    """The records of :data:`~sdpatch.settings.ATTENTION_BACKENDS`, in its order."""
    records = {}
    for name, module in ATTENTION_BACKENDS.items():
        record = importlib.import_module(f".{module}", __package__).BACKEND
        if record.name != name:
            raise ImportError(f"sdpatch.attention.{module}.BACKEND is named {record.name!r}, its table row {name!r}")
        records[name] = record
    return records


REGISTRY: dict[str, Backend] = _registry()
AUTO_ORDER = ("triton", "chunked")  # chunked serves every call: auto always finds one
BACKENDS = ("auto", *REGISTRY)


def backend_status(device: torch.device | str) -> dict[str, tuple[bool, str]]:
    """For each backend: whether it can run on ``device`` here, and why (not)."""
    device = torch.device(device)
    return {name: b.status(device) for name, b in REGISTRY.items()}


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")


def choose_backend(
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    backend: str = "auto",
) -> BackendChoice:
    """The one place that decides which backend a call gets, and why.

    An explicit backend gets the call if it :attr:`~Backend.supports` it, else
    :class:`BackendUnavailableError` says why. ``auto`` takes the first backend of
    :data:`AUTO_ORDER` that supports the call and does not refuse it for ``auto``; the reason
    of a later pick is the earlier backends' refusal. Raises ``ValueError`` for an unknown backend.
    """
    check_backend(backend)
    call = Call(torch.device(device), dtype, head_dim)
    if backend != "auto":
        problem = REGISTRY[backend].supports(call)
        if problem is not None:
            raise BackendUnavailableError(f"backend={backend!r} cannot run here: {problem}")
        return BackendChoice(backend, "requested")
    refused = None
    for name in AUTO_ORDER:
        b = REGISTRY[name]
        problem = b.supports(call) or b.auto_refuses(call)
        if problem is None:
            return BackendChoice(name, refused or b.auto_reason(call))
        refused = refused or problem
    raise AssertionError("the last backend of AUTO_ORDER serves every call")  # pragma: no cover


def workspace_bytes(backend: str, *, batch: int, heads: int, nq: int, nk: int, head_dim: int, elem: int,
                    chunk_budget: int | None = None, upcast: bool = False) -> float:
    """Bytes one call on ``backend`` holds beyond its inputs and output (the planner's estimate)."""
    return REGISTRY[backend].workspace(batch, heads, nq, nk, head_dim, elem, chunk_budget, upcast)


__all__ = ["AUTO_ORDER", "BACKENDS", "REGISTRY", "Backend", "BackendChoice", "BackendUnavailableError", "Call",
           "backend_status", "check_backend", "choose_backend", "workspace_bytes"]
