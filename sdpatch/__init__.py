"""sdpatch: flat-memory attention for diffusers' Stable Diffusion pipelines."""

from .attention import BACKENDS, BackendChoice, BackendUnavailableError, attention, backend_status, choose_backend, explain

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "BackendUnavailableError",
    "attention",
    "backend_status",
    "choose_backend",
    "explain",
]
