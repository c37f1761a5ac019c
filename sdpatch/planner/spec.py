"""Reading a pipeline and its device into what the estimator needs: :func:`model_spec` (configs,
weights, each component's attention cost and offload footprints) and :func:`device_state` (memory
in use on the run device now)."""

from __future__ import annotations

import re
from typing import Any

import torch

from sdpatch.attention.chunked import DEFAULT_CHUNK_BUDGET
from sdpatch.memory import host_available_bytes, host_resident_bytes, weights_bytes
from sdpatch.planner.estimator import AttentionCost, DeviceState, ModelSpec
from sdpatch.planner.levers import expandable_segments_on
from sdpatch.planner.streamed_decode import unsupported

_KIND_ORDER = {"flash": 0, "chunked": 1, "materialized": 2}


def _layer_cost(
    processor: Any, device: torch.device, dtype: torch.dtype, head_dim: int, backend: str | None
) -> tuple[AttentionCost, bool]:
    """One attention layer's cost with its processor (``backend`` None) or with sdpatch's
    ``backend``, and whether it runs sdpatch's Triton kernel on CUDA."""
    from sdpatch.attention import BackendUnavailableError, choose_backend
    from sdpatch.processor import SdpatchAttnProcessor

    if backend is None and not isinstance(processor, SdpatchAttnProcessor):
        name = type(processor).__name__
        if name == "AttnProcessor":
            return AttentionCost("materialized"), False
        if name == "SlicedAttnProcessor":
            return AttentionCost("materialized", slice=processor.slice_size), False
        return AttentionCost(), False  # SDPA, xformers and the like: flash-style
    try:
        choice = choose_backend(device=device, dtype=dtype, head_dim=head_dim, backend=backend or processor.backend)
    except BackendUnavailableError:  # such a call fails anyway: nothing to estimate
        return AttentionCost(), False
    if choice.name == "chunked":
        budget = processor.chunk_budget if backend is None else None
        return AttentionCost("chunked", budget or DEFAULT_CHUNK_BUDGET), False
    return AttentionCost(), choice.name == "triton" and device.type == "cuda"


def _component_cost(module: torch.nn.Module, device: torch.device, backend: str | None) -> tuple[AttentionCost, bool]:
    """The costliest attention layer of a component, and whether any of its layers runs Triton."""
    from diffusers.models.attention_processor import Attention

    def rank(cost: AttentionCost) -> tuple[int, int, int]:
        return _KIND_ORDER[cost.kind], cost.budget, -(cost.slice or 0)

    worst, triton = AttentionCost(), False
    for attn in (m for m in module.modules() if isinstance(m, Attention)):
        dtype = next(attn.parameters()).dtype
        cost, runs_triton = _layer_cost(attn.processor, device, dtype, attn.inner_dim // attn.heads, backend)
        worst = max(worst, cost, key=rank)
        triton = triton or runs_triton
    return worst, triton


# The layers diffusers' group offload (leaf level) and layerwise casting treat as leaves
# (diffusers.hooks._common._GO_LC_SUPPORTED_PYTORCH_LAYERS).
_LEAF_LAYERS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear, torch.nn.Embedding)

_FP8_BYTES = 1


def _nbytes(module: torch.nn.Module, recurse: bool = True) -> int:
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return sum(t.numel() * t.element_size() for t in tensors)


def offload_footprints(module: torch.nn.Module) -> dict[str, int]:
    """A component's weights on the device while it runs, under each way of offloading it.

    ``block_level``: diffusers' group offload of each ModuleList entry, with streams: the group
    that runs and the next one, prefetched, plus the unmatched group (every other child, on the
    device for the whole call). Leaf level has none here: its layers come and go one by one,
    replayed with the activations (:func:`~sdpatch.planner.estimator.leaf_offload_run`).
    ``sequential``: accelerate moves each module's own weights when it runs: the largest. ``fp8``: all weights, the leaf layers' at one byte per
    element outside diffusers' skip patterns (norms, a top-level ``proj_in``/``proj_out``); ``fp8_cast``: the
    largest such layer back in its dtype while it runs. ``largest_conv``: the largest 2-D
    convolution's weights (the host's reorder of them, :data:`HOST_RESERVE_OVER_ACTIVATIONS`).
    """
    groups, unmatched = [], _nbytes(module, recurse=False)
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            groups += [_nbytes(block) for block in child]
        else:
            unmatched += _nbytes(child)
    pairs = [a + b for a, b in zip(groups, groups[1:])] or groups or [0]
    leaves = [m for m in module.modules() if isinstance(m, _LEAF_LAYERS)]
    own = [_nbytes(m, recurse=False) for m in module.modules()]
    skip = re.compile("|".join(_FP8_SKIP))
    cast = [
        m for name, m in module.named_modules() if isinstance(m, _LEAF_LAYERS) and not skip.search(name)
    ]
    cast_bytes = [_nbytes(m) for m in cast]
    elems = sum(t.numel() for m in cast for t in (*m.parameters(), *m.buffers()))
    return {
        "block_level": unmatched + max(pairs),
        "sequential": max(own),
        "fp8": _nbytes(module) - sum(cast_bytes) + elems * _FP8_BYTES,
        "fp8_cast": max(cast_bytes, default=0),
        "largest_conv": max((_nbytes(m) for m in leaves if isinstance(m, torch.nn.Conv2d)), default=0),
    }


# diffusers' layerwise casting skips these (DEFAULT_SKIP_MODULES_PATTERN and the UNet's own
# ``_skip_layerwise_casting_patterns``), matched against every level of a module's name.
_FP8_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


def model_spec(pipe: Any, device: torch.device | None = None) -> ModelSpec:
    """What :func:`estimate` needs to know about a loaded pipeline (it may be on the meta device).

    ``device``: where it will run, when that is not where it is (a pipeline built on the meta
    device, or loaded on the CPU for a plan that places its weights): every model counts as
    resident there until a lever says otherwise.
    """
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    if device is None:
        device = pipe._execution_device
        resident = frozenset(name for name, c in modules.items() if any(p.device == device for p in c.parameters()))
    else:
        resident = frozenset(modules)
    costs, autos, triton = {}, {}, False
    for name in ("unet", "vae"):
        costs[name], uses_triton = _component_cost(modules[name], device, None)
        autos[name], _ = _component_cost(modules[name], device, "auto")
        triton = triton or uses_triton
    vae = pipe.vae
    return ModelSpec(
        unet=dict(pipe.unet.config),
        vae=dict(vae.config),
        text_encoders=tuple(modules[k].config.to_dict() for k in ("text_encoder", "text_encoder_2") if k in modules),
        weights=weights_bytes(modules),
        resident=resident,
        dtype_bytes=pipe.unet.dtype.itemsize,
        # SDXL's pipeline decodes an fp16 VAE in fp32 when its config asks (upcast_vae).
        vae_upcast=hasattr(pipe, "upcast_vae") and vae.dtype == torch.float16 and bool(vae.config.get("force_upcast")),
        streamed_decode=unsupported(vae.decoder) is None,
        attention=costs,
        auto_attention=autos,
        triton=triton,
        footprints={name: offload_footprints(m) for name, m in modules.items()},
    )


def device_state(pipe: Any, spec: ModelSpec, device: torch.device | None = None) -> DeviceState:
    """Memory in use on the run device now (default: the pipeline's), besides the pipeline's
    weights there; on CUDA, the host memory weights may go to."""
    device = device or pipe._execution_device
    if device.type == "cuda":
        on_gpu = {n for n, c in pipe.components.items() if isinstance(c, torch.nn.Module) and c.device.type == "cuda"}
        resident = sum(spec.weights[name] for name in on_gpu)
        on_host = sum(nbytes for name, nbytes in spec.weights.items() if name not in on_gpu)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return DeviceState(
            True,
            max(0, allocated - resident),
            reserved - allocated,
            expandable_segments_on(),
            host_available=host_available_bytes() + on_host,
        )
    resident = sum(spec.weights[name] for name in spec.resident)
    return DeviceState(False, max(0, host_resident_bytes() - resident))

