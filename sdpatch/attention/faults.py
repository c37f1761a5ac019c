"""The one fallback policy, and the only process-wide state of sdpatch's attention.

- **Out of memory** on any backend: the call is retried on the chunked backend at a quarter of its
  budget, halved on each further OOM down to :data:`MIN_FALLBACK_BUDGET`.
- **A kernel that fails to compile or launch** (no compiler, an unsupported GPU): remembered for
  the process per (backend, device, dtype, head dim), since it will not succeed on the next call
  either; ``auto`` runs such calls on chunked from then on, and an explicit request raises.
- **Neither inside a ``torch.compile`` trace or a CUDA-graph capture**, which cannot run a call
  twice: there the error is raised to the caller (a capture then runs the call eagerly).

The first fault of each kind is logged as a warning, later ones at debug level: a long run can fall
back thousands of times, and the patch report counts them per layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("sdpatch.attention")

# Out of memory, the chunked retry starts at a quarter of its usual budget, leaving room for
# whatever else holds memory, and halves down to this floor (a few rows per chunk at SD sizes).
MIN_FALLBACK_BUDGET = 2**20

# (backend, device, dtype, head dim) -> why the backend's kernel failed there.
_failures: dict[tuple[str, str, torch.dtype, int], str] = {}
_warned: set[str] = set()  # kinds of fault already logged at warning level
# CUDA calls' backend choices by (device, dtype, head dim, backend). Nothing a choice depends on
# changes while the process runs, except a remembered failure, which clears this: deciding anew
# costs microseconds of host time per call, and SD's UNets at 512-1024 px are host-bound on an H200.
choices: dict[tuple, object] = {}


@dataclass(frozen=True)
class Repeat:
    """How an eager call was served, for later calls of the same signature: the backend, the
    validated scale, and its launcher ``again(q, k, v) -> out`` (None: take the full path)."""

    backend: str
    scale: float
    again: Callable


# Eager calls without a mask or gradients, by their exact signature (``dispatch._repeat_signature``):
# how the last such call was served. Validating, choosing and planning again cost a short call's
# host as much as its kernel (hd160 at 1024 tokens: 20 us on an H100). Cleared with ``choices``.
repeats: dict[tuple, Repeat] = {}
MAX_REPEATS = 4096  # a UNet repeats a few dozen signatures; past this the map starts over


def cached(q: torch.Tensor) -> bool:
    """Whether a call's choice and repeat signature are kept: CUDA calls, the host-bound ones. On the
    CPU the Triton interpreter comes and goes with TRITON_INTERPRET, which a kept choice would miss."""
    return q.is_cuda


def remember_repeat(signature: tuple, repeat: Repeat) -> None:
    if len(repeats) >= MAX_REPEATS:
        repeats.clear()
    repeats[signature] = repeat


@dataclass(frozen=True)
class Fallback:
    """A call that the chunked backend served after ``backend`` failed; ``budget`` is what fit."""

    backend: str
    reason: str
    budget: int


def failure(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``backend`` failed before on such calls, or None."""
    return _failures.get((backend, str(device), dtype, head_dim))


def remember_failure(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int, reason: str) -> None:
    _failures[(backend, str(device), dtype, head_dim)] = reason
    choices.clear()
    repeats.clear()


def forget() -> None:
    """Forget every remembered failure and cached choice (for tests, and after fixing an install)."""
    _failures.clear()
    choices.clear()
    repeats.clear()
    _warned.clear()


def warn_once(kind: str, msg: str, *args) -> None:
    """Log the first fault of each kind as a warning, later ones at debug level."""
    logger.log(logging.DEBUG if kind in _warned else logging.WARNING, msg, *args)
    _warned.add(kind)


def capturing(q: torch.Tensor) -> bool:
    """Whether this call is being recorded into a CUDA graph: a retry would record half a call."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()
