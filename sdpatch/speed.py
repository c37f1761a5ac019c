"""Host-side speed levers for a pipeline's denoising loop: CUDA graphs and regional compilation.

- **CUDA graphs** (:mod:`sdpatch.graphs`): the UNet's (and ControlNet's) call captured once per input
  signature and replayed every step; on by default for ``sdpatch generate`` on CUDA.
- **Regional compilation** (``--compile``): ``torch.compile`` of the UNet's repeated blocks, each
  on its own, as diffusers' ``compile_repeated_blocks`` does, so that one compile serves every block
  of its shape. The regions are :data:`COMPILED_BLOCKS`: the transformer models and the ResNet
  blocks, with inductor's on-disk caches kept under ``~/.cache/sdpatch/inductor`` (or
  ``TORCHINDUCTOR_CACHE_DIR``), so that the next process at the same size starts from them.
  sdpatch's attention is an opaque custom op inside the compiled regions (:mod:`sdpatch.ops`). The
  graphs then capture the compiled regions too.

:func:`speed_up` applies them; :func:`remove_speed` undoes the graphs (a compiled block stays
compiled: ``torch.compile`` has no undo, and a compiled block computes what the eager one does).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import graphs

logger = logging.getLogger(__name__)

# The regions --compile compiles. diffusers' UNets list their BasicTransformerBlock as
# `_repeated_blocks`; a region per Transformer2DModel (its blocks with the GroupNorm, projections and
# residual around them) and per ResnetBlock2D (each GroupNorm fused with its SiLU, the residual adds)
# leaves little outside inductor's fusions. SD 1.5 at 512², a UNet call under sdpatch's graphs (H200):
# 10.7 ms with the transformer blocks alone, 7.05 ms with these regions, 7.11 ms for the whole stock
# UNet compiled with mode="reduce-overhead"; the first compile 52 s against that one's 58 s.
COMPILED_BLOCKS = ("Transformer2DModel", "ResnetBlock2D")
# Each region's shapes compile static, as a whole-model compile's do. A UNet has up to 14 ResNet
# block shapes, more than dynamo's default limit of 8 compiles per function, past which it runs eagerly.
RECOMPILE_LIMIT = 64
CACHE_DIR = Path.home() / ".cache" / "sdpatch" / "inductor"


@dataclass
class SpeedSetup:
    """Which levers a run asked for, and why any of them is off."""

    cuda_graphs: bool
    compile: bool
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"cuda_graphs": self.cuda_graphs, "compile": self.compile, "notes": list(self.notes)}


def speed_up(pipe: Any, *, cuda_graphs: bool, compile: bool) -> SpeedSetup:
    """Apply the levers to ``pipe``'s denoising components; returns what was applied.

    CUDA graphs need the components on a CUDA device and not offloaded; where they are not,
    the lever is off and a note says why (the runner would run every call eagerly anyway).
    """
    setup = SpeedSetup(cuda_graphs=False, compile=False)
    components = graphs.graphed_components(pipe)
    reason = compile_unavailable() if compile else None
    if reason is not None:
        setup.notes.append(f"--compile off: {reason}")
    elif compile:
        compiled = [name for name, module in components if compile_blocks(module)]
        setup.compile = bool(compiled)
        if not compiled:
            setup.notes.append("--compile: no transformer models or ResNet blocks to compile")
    if cuda_graphs:
        reason = _graphs_unavailable(components)
        if reason is None:
            for _, module in components:
                graphs.capture(module)
            setup.cuda_graphs = True
        else:
            setup.notes.append(f"CUDA graphs off: {reason}")
    return setup


def remove_speed(pipe: Any) -> Any:
    """Undo :func:`speed_up`'s graphs; returns ``pipe``."""
    for _, module in graphs.graphed_components(pipe):
        graphs.release(module)
    return pipe


def graph_stats(pipe: Any) -> dict[str, dict] | None:
    """Each graphed component's :class:`sdpatch.graphs.GraphStats`, or None where none is graphed."""
    stats = {name: r.stats.to_dict() for name, m in graphs.graphed_components(pipe) if (r := graphs.runner_of(m))}
    return stats or None


def _graphs_unavailable(components: list[tuple[str, torch.nn.Module]]) -> str | None:
    if not components:
        return "the pipeline has no UNet or ControlNet"
    for name, module in components:
        p = next(module.parameters(), None)
        if p is None or p.device.type != "cuda":
            return f"the {name} is not on a CUDA device"
        if graphs._offloaded(module):
            return f"the {name} is offloaded (its weights move between calls)"
    return None


def compile_unavailable() -> str | None:
    """Why ``torch.compile``'s default backend cannot load here (None: it can). Its inductor
    imports Triton's compiler internals, which change between releases: torch 2.4's, beside
    triton 3.2, fails on import."""
    try:
        importlib.import_module("torch._inductor.compile_fx")
    except Exception as e:  # noqa: BLE001 - whatever the import raises, the backend is unusable
        return f"torch {torch.__version__}'s inductor cannot load ({type(e).__name__}: {e})"
    return None


def compile_blocks(module: torch.nn.Module, **options) -> bool:
    """``torch.compile`` each of ``module``'s :data:`COMPILED_BLOCKS` (regional compilation), static
    shapes, with the on-disk caches on; whether any block was found. ``options`` go to ``torch.compile``."""
    use_caches()
    allow_recompiles(RECOMPILE_LIMIT)
    found = False
    for sub in module.modules():
        if type(sub).__name__ in COMPILED_BLOCKS:
            sub.compile(**{"fullgraph": True, "dynamic": False, **options})
            found = True
    return found


def allow_recompiles(limit: int) -> None:
    """Let dynamo compile a function for at least ``limit`` input signatures (a process-wide setting)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # its name before torch 2.6
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def use_caches() -> None:
    """Inductor's on-disk caches on, in a folder that outlives /tmp (unless the user chose one)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
    except (ImportError, AttributeError):  # an inductor without the option: its defaults
        pass
    try:
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "enable_autograd_cache"):
            functorch_config.enable_autograd_cache = True
    except ImportError:
        pass
