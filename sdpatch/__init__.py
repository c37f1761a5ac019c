"""sdpatch: flat-memory attention for diffusers' Stable Diffusion pipelines.

The public names are imported from their submodules on first use, so that importing the package
costs nothing: the ``sdpatch`` command parses and checks its arguments before it imports torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the submodule that defines it.
_EXPORTS = {
    "BACKENDS": "attention",
    "BackendChoice": "attention",
    "BackendUnavailableError": "attention",
    "Fallback": "attention",
    "attention": "attention",
    "backend_status": "attention",
    "choose_backend": "attention",
    "explain": "attention",
    "PatchReport": "patch",
    "patch_report": "patch",
    "patch_unet": "patch",
    "unpatch_unet": "patch",
    "Plan": "planner",
    "apply_plan": "planner",
    "fit": "planner",
    "plan": "planner",
    "remove_plan": "planner",
    "SdpatchAttnProcessor": "processor",
    "InputError": "errors",
    "PlannerError": "planner",
    "speed_up": "speed",
    "remove_speed": "speed",
    "wait_for_kernels": "graphs",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
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
    from .graphs import wait_for_kernels
    from .patch import PatchReport, patch_report, patch_unet, unpatch_unet
    from .planner import Plan, PlannerError, apply_plan, fit, plan, remove_plan
    from .processor import SdpatchAttnProcessor
    from .speed import remove_speed, speed_up


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    setattr(sys.modules[__name__], name, value)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """The package's module type: importing the submodule ``sdpatch.attention`` binds it as an
    attribute of the package, over the function of the same name; this binds the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if _EXPORTS.get(name) == name and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
