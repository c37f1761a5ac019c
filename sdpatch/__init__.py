"""sdpatch: flat-memory attention for diffusers' Stable Diffusion pipelines."""

from .attention import (
    BACKENDS,
    BackendChoice,
    BackendUnavailableError,
    Fallback,
    attention,
    backend_status,
    choose_backend,
    explain,
)
from .errors import InputError
from .patch import PatchReport, patch_report, patch_unet, unpatch_unet
from .planner import Plan, PlannerError, apply_plan, fit, plan, remove_plan
from .processor import SdpatchAttnProcessor
from .speed import apply_speed as speed_up
from .speed import remove_speed

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "BackendUnavailableError",
    "Fallback",
    "InputError",
    "PatchReport",
    "Plan",
    "PlannerError",
    "SdpatchAttnProcessor",
    "apply_plan",
    "attention",
    "backend_status",
    "choose_backend",
    "explain",
    "fit",
    "patch_report",
    "patch_unet",
    "plan",
    "remove_plan",
    "remove_speed",
    "speed_up",
    "unpatch_unet",
]
