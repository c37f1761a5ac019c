"""The levers: their settings (:class:`Levers`), their order, and putting them in place on a
pipeline and taking them out again (:func:`apply_plan`, :func:`remove_plan`).

Every lever's undo is recorded on the pipeline through sdpatch's one undo mechanism
(:mod:`sdpatch.undo`, as :data:`PLAN`); :func:`remove_plan` runs it, last lever first. The allocator's expandable segments are process-wide: whether this
process turned them on is kept here, and only here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from sdpatch import undo as changes
from sdpatch.attention.chunked import DEFAULT_CHUNK_BUDGET
from sdpatch.planner.streamed_decode import StreamedDecoderForward, unsupported

if TYPE_CHECKING:
    from sdpatch.planner.search import Plan

# The levers, cheapest first. The allocator setting costs nothing; flash-style attention and
# smaller chunks of the chunked backend cost a little speed; feed-forward chunking, more kernel
# launches; split CFG, the batch's efficiency at small sizes; the streamed decode, one more
# convolution per ResNet block and, with a host store, the strips' copies (exact, so before tiled
# decode); tiled decode, exactness (the tiles' seams are blended); CPU offload, a copy of each
# model to the GPU on every call.
# The weight levers move weights off the GPU: the text encoders to the CPU between their calls
# (one copy per image; exact, so before the decode levers); model CPU offload (every model, one copy per call); diffusers'
# group offload of the UNet with CUDA streams (every step streams the UNet's weights); fp8 weight
# storage (approximate: only with ``allow_fp8``); accelerate's sequential offload (every layer's
# weights copied when it runs, without overlap).
LEVER_ORDER = (
    "allocator",
    "attention",
    "ff_chunking",
    "split_cfg",
    "text_encoder_offload",
    "vae_streaming",
    "vae_tiling",
    "cpu_offload",
    "group_offload",
    "fp8_storage",
    "sequential_offload",
)

EXACT_LEVERS = frozenset(LEVER_ORDER) - {"vae_tiling", "fp8_storage"}

GROUP_OFFLOAD_TYPES = ("block_level", "leaf_level")  # diffusers' offload_type, mildest first


@dataclass(frozen=True)
class Levers:
    """Settings of every lever; the defaults change nothing.

    ``flash_attention``: diffusers' materializing processors become sdpatch ``auto``.
    ``chunk_budget``: score-buffer bytes of sdpatch's chunked attention (None: as set).
    ``ff_chunks``: token chunks of each transformer feed-forward. ``unet_micro_batch``: the UNet
    batch runs in calls of at most this many samples (half the batch: split CFG). ``vae_stream``:
    the VAE decoder streamed in strips of ``vae_strip`` image rows
    (:mod:`~sdpatch.planner.streamed_decode`), its whole tensors held on the run device
    (``device``) or in pinned host memory (``host``). ``vae_tile``: tiled VAE decode with tiles of
    this many pixels a side. ``text_encoder_offload``: the text encoders on the CPU except during
    their call (accelerate's ``cpu_offload_with_hook``).
    ``cpu_offload``: diffusers' model CPU offload. ``group_offload``: diffusers' group offload of
    the UNet (``block_level`` or ``leaf_level``, with CUDA streams). ``fp8_storage``: the UNet's
    weights stored in fp8 (diffusers' layerwise casting), cast on the CPU. ``sequential_offload``:
    diffusers' sequential CPU offload of every model.
    """

    expandable_segments: bool = False
    flash_attention: bool = False
    chunk_budget: int | None = None
    ff_chunks: int = 1
    unet_micro_batch: int | None = None
    vae_stream: str | None = None
    vae_strip: int | None = None
    vae_tile: int | None = None
    text_encoder_offload: bool = False
    cpu_offload: bool = False
    group_offload: str | None = None
    fp8_storage: bool = False
    sequential_offload: bool = False


def expandable_segments_on() -> bool:
    """Whether PyTorch's CUDA allocator runs with expandable segments (from its environment, or
    turned on by :func:`apply_plan` in this process)."""
    if _runtime_expandable is not None:
        return _runtime_expandable
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        options = dict(o.split(":", 1) for o in os.environ.get(var, "").split(",") if ":" in o)
        if "expandable_segments" in options:
            return options["expandable_segments"].strip() == "True"
    return False


_runtime_expandable: bool | None = None  # set when apply_plan changed the running allocator


def request_expandable_segments() -> str | None:
    """Ask for expandable segments through ``PYTORCH_CUDA_ALLOC_CONF``, which PyTorch reads when
    CUDA initialises: call it before anything touches CUDA. Returns a note when the variable
    already says otherwise (the user's setting is kept)."""
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in current:
        return None if expandable_segments_on() else f"PYTORCH_CUDA_ALLOC_CONF={current} is kept"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [current, "expandable_segments:True"]))
    return None


# The Levers fields each lever sets; resetting them to a start value takes the lever out.
_LEVER_FIELDS = {
    "allocator": ("expandable_segments",),
    "attention": ("flash_attention", "chunk_budget"),
    "ff_chunking": ("ff_chunks",),
    "split_cfg": ("unet_micro_batch",),
    "vae_streaming": ("vae_stream", "vae_strip"),
    "vae_tiling": ("vae_tile",),
    "text_encoder_offload": ("text_encoder_offload",),
    "cpu_offload": ("cpu_offload",),
    "group_offload": ("group_offload",),
    "fp8_storage": ("fp8_storage",),
    "sequential_offload": ("sequential_offload",),
}


def _reset(levers: Levers, lever: str, start: Levers) -> Levers:
    return replace(levers, **{f: getattr(start, f) for f in _LEVER_FIELDS[lever]})


def lever_unavailable(lever: str) -> str | None:
    """Why a weight lever cannot run with the installed libraries (None: it can)."""
    import diffusers

    if lever == "group_offload":
        try:
            from diffusers.hooks import apply_group_offloading  # noqa: F401
        except ImportError:
            return f"diffusers {diffusers.__version__} has no group offloading (diffusers.hooks.apply_group_offloading)"
    if lever == "fp8_storage":
        if not hasattr(torch, "float8_e4m3fn"):
            return f"torch {torch.__version__} has no float8_e4m3fn"
        if not hasattr(diffusers.ModelMixin, "enable_layerwise_casting"):
            return f"diffusers {diffusers.__version__} has no layerwise casting (ModelMixin.enable_layerwise_casting)"
    return None


class _ChunkedFeedForward:
    """A FeedForward's forward over token chunks, written into one output.

    Exact up to rounding: a feed-forward treats every token on its own. diffusers' own
    ``enable_forward_chunking`` needs a chunk size that divides every block's token count, and its
    ``torch.cat`` holds the output twice; this takes any count and holds it once.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], chunks: int) -> None:
        self.forward = forward
        self.chunks = chunks

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if hidden_states.ndim != 3 or hidden_states.shape[1] < 2:
            return self.forward(hidden_states, *args, **kwargs)
        out, start = None, 0
        for piece in hidden_states.chunk(self.chunks, dim=1):
            y = self.forward(piece, *args, **kwargs)
            if out is None:
                out = y.new_empty((*hidden_states.shape[:2], y.shape[-1]))
            out[:, start : start + piece.shape[1]] = y
            start += piece.shape[1]
        return out


class _MicroBatchedUNet:
    """A UNet's forward in calls of at most ``size`` samples, concatenated (split CFG at half the batch).

    Exact up to rounding: every sample of a UNet batch is computed on its own (group norms and
    attention are per sample). Every tensor argument whose first dimension is the batch is cut
    with it, nested ones too (SDXL's ``added_cond_kwargs``); a 0-d timestep is shared.
    """

    def __init__(self, forward: Callable[..., Any], size: int) -> None:
        self.forward = forward
        self.size = size

    def __call__(self, sample: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = sample.shape[0]
        if n <= self.size:
            return self.forward(sample, *args, **kwargs)
        parts = [
            self.forward(sample[s : s + self.size], *_cut(args, n, s, self.size), **_cut(kwargs, n, s, self.size))
            for s in range(0, n, self.size)
        ]
        first = parts[0]
        if isinstance(first, tuple):  # return_dict=False, as the pipelines call it
            return (torch.cat([p[0] for p in parts]), *first[1:])
        return type(first)(**{key: torch.cat([p[key] for p in parts]) for key in first.keys()})


def _cut(value: Any, n: int, start: int, size: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start : start + size] if value.ndim and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _cut(v, n, start, size) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cut(v, n, start, size) for v in value)
    return value


PLAN = "plan"  # what the planner's changes are recorded under (sdpatch.undo)


def _set_expandable_segments(on: bool) -> bool:
    """Switch the running CUDA allocator's expandable segments through PyTorch's private setter
    (``torch._C._accelerator_setAllocatorSettings``, formerly
    ``_cuda_cudaCachingAllocator_set_allocator_settings``); False where neither exists."""
    global _runtime_expandable
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if setter is None:
        return False
    setter(f"expandable_segments:{on}")
    _runtime_expandable = on
    return True


def apply_plan(pipe: Any, plan: Plan | Levers, device: torch.device | str | None = None) -> list[str]:
    """Put ``plan``'s levers in place on ``pipe`` (after taking out any plan applied before).

    ``device``: where the pipeline runs (default: where it is). A pipeline loaded on the CPU for a
    plan with weight levers gets its weights placed from there, so that no weight reaches the GPU
    in a form the plan does not keep (fp8 storage casts on the CPU). Returns notes on what could
    not be done as planned (e.g. expandable segments, which PyTorch only reads when CUDA
    initialises unless its private setter exists). :func:`remove_plan` takes the levers out again.
    """
    from diffusers.models.attention import FeedForward

    from sdpatch.patch import patch_unet, unpatch_unet
    from sdpatch.processor import SdpatchAttnProcessor

    remove_plan(pipe)
    levers = plan if isinstance(plan, Levers) else plan.levers
    moving = device is not None  # the caller names the run device: every model goes there
    device = torch.device(device) if device is not None else pipe._execution_device
    undo: list[Callable[[], None]] = []  # each lever's undo, in the order applied
    notes: list[str] = []
    if levers.expandable_segments and device.type == "cuda" and not expandable_segments_on():
        if _set_expandable_segments(True):
            undo.append(lambda: _set_expandable_segments(False))
        else:
            notes.append(
                "expandable segments could not be turned on after CUDA started: set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts"
            )
    if levers.flash_attention:
        patch_unet(pipe, backend="auto", chunk_budget=levers.chunk_budget)
        undo.append(lambda: unpatch_unet(pipe))
    elif levers.chunk_budget is not None:
        procs = [p for c in (pipe.unet, pipe.vae) for p in c.attn_processors.values()]
        procs = [p for p in procs if isinstance(p, SdpatchAttnProcessor)]
        undo.append(changes.attributes([(p, "chunk_budget") for p in procs]))
        for p in procs:
            p.chunk_budget = min(p.chunk_budget or DEFAULT_CHUNK_BUDGET, levers.chunk_budget)
    if levers.ff_chunks > 1:
        ffs = [m for m in pipe.unet.modules() if isinstance(m, FeedForward)]
        undo.append(changes.attributes([(ff, "forward") for ff in ffs]))
        for ff in ffs:
            ff.forward = _ChunkedFeedForward(ff.forward, levers.ff_chunks)
    if levers.unet_micro_batch is not None:
        # Inside the weight levers' hooks, which wrap forward too: outside group offload's, each
        # half of the batch is a UNet call of its own to them, and SD 1.5 at 2048² reserved 2.69 GiB
        # instead of 1.59 (H200; leaf level, streams).
        undo.append(changes.attributes([(pipe.unet, "forward")]))
        pipe.unet.forward = _MicroBatchedUNet(pipe.unet.forward, levers.unet_micro_batch)
    if levers.vae_stream is not None:
        decoder = pipe.vae.decoder
        why = unsupported(decoder)
        if why is None:
            undo.append(changes.attributes([(decoder, "forward")]))
            decoder.forward = StreamedDecoderForward(decoder.forward, decoder, levers.vae_strip, levers.vae_stream)
        else:
            notes.append(f"the streamed VAE decode cannot run this VAE: {why}")
    if levers.vae_tile is not None:
        vae = pipe.vae
        undo.append(changes.attributes([(vae, "use_tiling"), (vae, "tile_sample_min_size"), (vae, "tile_latent_min_size")]))
        vae.enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size = levers.vae_tile, levers.vae_tile // pipe.vae_scale_factor
    _place_weights(pipe, levers, device, undo, moving)
    for step in undo:
        changes.record(pipe, PLAN, step)
    return notes


def weight_levers(levers: Levers) -> bool:
    """Whether ``levers`` move weights off the run device or change how they are stored."""
    return any(getattr(levers, f) for lever in _WEIGHT_LEVERS for f in _LEVER_FIELDS[lever])


_WEIGHT_LEVERS = ("text_encoder_offload", "cpu_offload", "group_offload", "fp8_storage", "sequential_offload")


def _place_weights(
    pipe: Any, levers: Levers, device: torch.device, undo: list[Callable[[], None]], moving: bool
) -> None:
    """The weight levers, through diffusers' and accelerate's own offloading and casting; each
    step's undo goes on ``undo``. Every model ends on ``device`` or under a hook that brings its
    weights there when it runs."""
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    elsewhere = moving and any(p.device != device for c in modules.values() for p in c.parameters())
    if not weight_levers(levers) and not elsewhere:
        return
    # Last undone: each model back where it was, its hooks' instance attributes gone, and the
    # pipeline's offload bookkeeping as it was.
    hooked = [m for c in modules.values() for m in c.modules()]
    attributes = [(m, a) for m in hooked for a in ("forward", "_diffusers_hook", "_hf_hook", "_old_forward")]
    attributes += [(pipe, a) for a in ("_all_hooks", "_offload_device", "_offload_gpu_id")]
    restore_attributes = changes.attributes(attributes)
    places = {name: next((p.device for p in c.parameters()), device) for name, c in modules.items()}

    def back_in_place() -> None:
        import accelerate.hooks

        for c in modules.values():
            accelerate.hooks.remove_hook_from_module(c, recurse=True)
        restore_attributes()
        for name, c in modules.items():
            c.to(places[name])

    undo.append(back_in_place)
    cpu = torch.device("cpu")
    if device.type == "cuda" and any(place.type == "cuda" for place in places.values()):
        for c in modules.values():  # every weight lever starts from the CPU copy
            c.to(cpu)
        torch.cuda.empty_cache()
    unet = pipe.unet
    if levers.sequential_offload:
        # What diffusers' enable_sequential_cpu_offload does, with the device as given: it names
        # the CPU "cpu:0", on which accelerate's hooks fail (a plan on the CPU never takes this
        # lever, but its tests run there).
        from accelerate import cpu_offload

        for c in modules.values():
            cpu_offload(c, device, offload_buffers=len(c._parameters) > 0)
        return
    if levers.fp8_storage:
        originals = [(t, t.data) for t in (*unet.parameters(), *unet.buffers())]

        def exact_weights() -> None:  # layerwise casting's own removal refuses: fp8 lost precision
            for t, data in originals:
                t.data = data

        undo.append(exact_weights)
        unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=unet.dtype)
    if levers.group_offload:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(
            unet,
            onload_device=device,
            offload_device=cpu,
            offload_type=levers.group_offload,
            num_blocks_per_group=1 if levers.group_offload == "block_level" else None,
            use_stream=device.type == "cuda",
        )
    if levers.cpu_offload:
        pipe.enable_model_cpu_offload(device=device)
        return
    resident = [name for name in modules if not (name == "unet" and levers.group_offload)]
    if levers.text_encoder_offload:
        from accelerate import cpu_offload_with_hook

        from sdpatch.planner.estimator import _TEXT_ENCODERS  # estimate imports this module

        hook = None
        for name in _TEXT_ENCODERS:
            if name in modules:
                _, hook = cpu_offload_with_hook(modules[name], device, prev_module_hook=hook)
                resident.remove(name)
        if hook is not None:  # the last text encoder goes back to the CPU when the UNet starts
            last = hook
            handle = unet.register_forward_pre_hook(lambda *_: last.offload())
            undo.append(handle.remove)
    for name in resident:
        modules[name].to(device)


def remove_plan(pipe: Any) -> Any:
    """Take out what :func:`apply_plan` put in place, last lever first; returns ``pipe``."""
    changes.undo(pipe, PLAN)
    return pipe


def single_lever(settings: dict[str, Any], lever: str) -> Levers:
    """The levers of a plan's ``settings`` (:meth:`Plan.to_dict`) with only ``lever`` kept."""
    levers = Levers(**settings)
    for other in LEVER_ORDER:
        if other != lever:
            levers = _reset(levers, other, Levers())
    return levers
