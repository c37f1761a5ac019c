"""sdpatch's attention: exact softmax attention that never holds the Nq x Nk score matrix.

One package, laid out as flash-linear-attention lays out an op:

- :mod:`.dispatch`: :func:`attention` (validation, the backend the registry picks, the fault
  policy's retries) and :func:`explain`;
- :mod:`.registry`: the backends (:data:`REGISTRY`), ``auto``'s order and :func:`choose_backend`,
  the one place a call's backend is decided;
- one module per backend: :mod:`.triton_backend` (sdpatch's kernels, :mod:`sdpatch.kernels`),
  :mod:`.chunked` (plain PyTorch, every device and head dim), :mod:`.sdpa` (PyTorch's SDPA, for
  comparison); :mod:`.ops`, the Triton backend as ``torch.library`` custom ops for ``torch.compile``;
- :mod:`.naive`: the float64 reference every backend is tested against;
- :mod:`.faults`: the fallback policy (out of memory, a kernel that fails to compile) and the only
  process-wide state.

Backends (:data:`BACKENDS`): ``"triton"`` (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``;
head dims up to 256, fp16/bf16/fp32, any strides, masks), ``"chunked"`` (every device, every head dim
such as the SD VAE's 512, fp64 too), ``"sdpa"``, and ``"auto"``: triton where it supports the call on
a CUDA device, else chunked.

Graphs and compilers: eager calls launch the kernels straight from Python; under ``torch.compile`` the
triton backend is the custom op ``torch.ops.sdpatch.flash_fwd``, chosen at trace time, with its
backward op as its autograd formula. Nothing keeps per-call state that a captured graph or a
compiled region would have to replay.
"""

from .base import Backend, BackendChoice, BackendUnavailableError, Call
from .dispatch import attention, explain
from .faults import MIN_FALLBACK_BUDGET, Fallback
from .registry import AUTO_ORDER, BACKENDS, REGISTRY, backend_status, choose_backend, workspace_bytes

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "MIN_FALLBACK_BUDGET",
    "REGISTRY",
    "Backend",
    "BackendChoice",
    "BackendUnavailableError",
    "Call",
    "Fallback",
    "attention",
    "backend_status",
    "choose_backend",
    "explain",
    "workspace_bytes",
]
