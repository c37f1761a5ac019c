"""``patch_unet`` / ``unpatch_unet`` / ``patch_report``: put :class:`SdpatchAttnProcessor` into diffusers models.

Each diffusers ``Attention`` module whose processor is one of diffusers' stock processors gets its
own :class:`SdpatchAttnProcessor`; the original processor object is kept on the module, so
``unpatch_unet`` restores it by identity. Patching is idempotent: a second patch starts again from
the originals. Any other processor (IP-Adapter, Custom Diffusion, PAG, user classes) stays in place
and the report names it.

diffusers resets processors itself: loading and unloading an IP-Adapter, fusing projections,
attention slicing, and it rebuilds a processor as ``type(processor)()``. So a patched layer stays
patched through those: its ``set_processor`` serves a stock processor set on it, and a bare
``SdpatchAttnProcessor()``, with the layer's sdpatch settings. ``set_default_attn_processor`` on a
patched model means diffusers' defaults: it unpatches that model first. Each patched model also gets
the forward hooks of :func:`sdpatch.graphs.compile_eagerly_in_background`, removed on unpatching.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass, fields

import torch
from diffusers.models import attention_processor as _ap
from diffusers.models.attention_processor import Attention

from . import undo as changes
from .attention import BACKENDS, BackendUnavailableError, choose_backend
from .processor import SdpatchAttnProcessor

logger = logging.getLogger(__name__)

# Processors that follow AttnProcessor2_0's recipe; only these are replaced. Matched by exact
# type: a subclass may change the recipe. getattr: not every diffusers version has every class.
_STOCK_NAMES = (
    "AttnProcessor",
    "AttnProcessor2_0",
    "SlicedAttnProcessor",
    "XFormersAttnProcessor",
    "FusedAttnProcessor2_0",
)
STOCK_PROCESSORS: tuple[type, ...] = tuple(getattr(_ap, n) for n in _STOCK_NAMES if hasattr(_ap, n))
_FUSED = getattr(_ap, "FusedAttnProcessor2_0", None)

PATCH = "attention_processors"  # what patch_unet's changes are recorded under (sdpatch.undo)
_ORIGINAL = "_sdpatch_original_processor"  # attribute on each patched Attention module
# Per-instance overrides of diffusers' methods on what is patched (see the module docstring).
_SET_PROCESSOR = "set_processor"  # on each patched Attention module
_SET_DEFAULT = "set_default_attn_processor"  # on each model (pipeline component) with a patched layer


@dataclass(frozen=True)
class _Settings:
    """How a patched layer is served: the arguments of its :class:`SdpatchAttnProcessor`."""

    name: str
    backend: str
    chunk_budget: int | None
    recompute: bool

    def processor(self, fused: bool) -> SdpatchAttnProcessor:
        return SdpatchAttnProcessor(
            self.name, backend=self.backend, chunk_budget=self.chunk_budget, fused=fused, recompute=self.recompute
        )


def _set_processor(attn: Attention, settings: _Settings, processor, *args, **kwargs) -> None:
    """``attn.set_processor`` on a patched layer: a stock processor, or a bare
    ``SdpatchAttnProcessor()``, is served by sdpatch with the layer's settings; anything else
    (an IP-Adapter's processor, a user's class) is set as given."""
    if type(processor) in STOCK_PROCESSORS:
        processor = settings.processor(fused=type(processor) is _FUSED)
    elif isinstance(processor, SdpatchAttnProcessor) and processor.name is None:
        current = attn.processor
        processor = settings.processor(fused=isinstance(current, SdpatchAttnProcessor) and current.fused)
    type(attn).set_processor(attn, processor, *args, **kwargs)


def _set_default_attn_processor(model: torch.nn.Module) -> None:
    """``set_default_attn_processor`` of a patched model: unpatch it, then diffusers' own."""
    unpatch_unet(model)
    model.set_default_attn_processor()


# The undo steps patch_unet records (sdpatch.undo): partials of these module functions, that is
# data, so that a patched model stays picklable and copyable, and a copy's undo acts on the copy.
def _unpatch_layer(attn: Attention) -> None:
    """One layer back: diffusers' own ``set_processor``, and its original processor unless another
    than sdpatch's holds the layer now (an IP-Adapter's, a user's)."""
    if _SET_PROCESSOR in vars(attn):
        delattr(attn, _SET_PROCESSOR)
    if isinstance(attn.processor, SdpatchAttnProcessor) and hasattr(attn, _ORIGINAL):
        attn.set_processor(getattr(attn, _ORIGINAL))
    if hasattr(attn, _ORIGINAL):
        delattr(attn, _ORIGINAL)


def _unpatch_model(model: torch.nn.Module) -> None:
    """A model's own ``set_default_attn_processor`` back, and its calls without background compiles."""
    if _SET_DEFAULT in vars(model):
        delattr(model, _SET_DEFAULT)
    from . import graphs

    graphs.stop_eager_background(model)


@dataclass(frozen=True)
class LayerRow:
    """One attention layer in a :class:`PatchReport`."""

    name: str
    kind: str  # "self" or "cross"
    heads: int
    head_dim: int
    nq: int | None  # sequence lengths of the latest call; None before the first one
    nk: int | None
    patched: bool
    backend: str  # the backend the layer gets, or "kept: <processor class>"
    reason: str


@dataclass(frozen=True)
class LayerFallback:
    """A patched layer some of whose calls the chunked backend served after its backend failed
    (out of memory, or a Triton kernel that would not compile); see :func:`sdpatch.attention`."""

    name: str
    calls: int  # calls served by the fallback since the layer was patched
    backend: str  # the backend that failed on the latest of them
    reason: str  # why it failed


@dataclass(frozen=True)
class PatchReport:
    """Which attention layers sdpatch serves, with which backend and why; one row per layer,
    and the layers whose calls had to fall back."""

    rows: tuple[LayerRow, ...]
    fallbacks: tuple[LayerFallback, ...] = ()

    @property
    def patched(self) -> int:
        return sum(r.patched for r in self.rows)

    @property
    def kept(self) -> int:
        return len(self.rows) - self.patched

    def to_dict(self) -> dict:
        """Plain JSON-serializable data: a summary and one dict per layer."""
        return {
            "patched": self.patched,
            "kept": self.kept,
            "layers": [asdict(r) for r in self.rows],
            "fallbacks": [asdict(f) for f in self.fallbacks],
        }

    def __str__(self) -> str:
        cols = [f.name for f in fields(LayerRow) if f.name != "patched"]
        table = [cols] + [["-" if getattr(r, c) is None else str(getattr(r, c)) for c in cols] for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(cols) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1] for line in table]
        head = f"sdpatch: {len(self.rows)} attention layers, {self.patched} patched, {self.kept} kept"
        falls = [
            f"fallback: {f.name}: {f.calls} calls ran chunked after {f.backend} failed: {f.reason}"
            for f in self.fallbacks
        ]
        return "\n".join([head, *lines, *falls])


def _attention_layers(target: object, include_vae: bool) -> list[tuple[str, Attention]]:
    """(name, module) for every diffusers Attention layer in ``target``; TypeError if there are none."""
    layers = [(prefix + n, m) for prefix, part in _parts(target, include_vae) for n, m in part.named_modules() if isinstance(m, Attention)]
    if not layers:
        raise TypeError(
            "patch_unet expects a diffusers pipeline, UNet2DConditionModel, AutoencoderKL or another torch "
            f"module with diffusers Attention layers; got {type(target).__name__}, which has none"
        )
    return layers


def _parts(target: object, include_vae: bool) -> list[tuple[str, torch.nn.Module]]:
    """(name prefix, model) for ``target`` itself or each of a pipeline's components."""
    if isinstance(target, torch.nn.Module):
        parts = [("", target)]
    elif isinstance(getattr(target, "components", None), dict):
        # A pipeline, known by its `components` rather than by isinstance: importing diffusers'
        # pipelines costs a second, and fails on old diffusers with transformers 5. Every component
        # with attention layers is patched: the UNet, and a ControlNet or prior where there is one.
        parts = [
            (f"{name}.", c)
            for name, c in target.components.items()
            if isinstance(c, torch.nn.Module) and (include_vae or name != "vae")
        ]
    else:
        parts = []
    return parts


def _original(attn: Attention):
    """The processor to restore: the saved original if sdpatch's is in place, else the current one."""
    if isinstance(attn.processor, SdpatchAttnProcessor):
        return getattr(attn, _ORIGINAL, attn.processor)
    return attn.processor


def _weights(attn: Attention) -> tuple[torch.device, torch.dtype]:
    p = next(attn.parameters())
    return p.device, p.dtype


def _run_device(device: torch.device) -> torch.device:
    # Models on the CPU (or meta) on a CUDA machine are usually moved or offloaded there to run.
    if device.type in ("cpu", "meta") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def patch_unet(
    target: object,
    *,
    backend: str = "auto",
    include_vae: bool = True,
    chunk_budget: int | None = None,
    recompute: bool = False,
    cuda_graphs: bool = False,
) -> PatchReport:
    """Serve the attention layers of a diffusers model or pipeline with :func:`sdpatch.attention`.

    Args:
        target: a ``DiffusionPipeline`` (every component with attention layers: the UNet, a
            ControlNet, and the VAE unless ``include_vae=False``), or a model such as
            ``UNet2DConditionModel`` or ``AutoencoderKL``.
        backend: one of :data:`sdpatch.BACKENDS`. ``"auto"`` picks per call (Triton on CUDA
            where it can, else chunked). An explicit backend that cannot serve some layer raises
            here, before anything is changed; e.g. ``"triton"`` without Triton, or on the VAE's
            head dim 512 (pass ``include_vae=False``).
        include_vae: whether a pipeline's ``vae`` is patched too.
        chunk_budget: bytes of score buffer for the chunked backend (``None``: its default).
        recompute: in training, each patched layer keeps only its inputs for the backward and
            recomputes its projections and attention forward there, instead of keeping q, k, v
            and the attention output: less peak memory for a slower step (see
            :class:`SdpatchAttnProcessor`). No effect on calls that build no graph (inference,
            ``torch.no_grad``, frozen layers on frozen inputs).
        cuda_graphs: also replay the UNet's (and a ControlNet's) calls from CUDA graphs, one per
            input shape, captured after a warm-up call (:func:`sdpatch.speed_up`; needs the model
            on CUDA and not offloaded, and inference). On a fast GPU, where the host bounds an
            eager step, this is what makes the pipeline faster than stock: on an H200 a step took
            0.42x stock's at SD 1.5 512² and 0.58x at SDXL 1024² with graphs, and about stock's
            without (docs/benchmarks.md, end to end). Without
            it, graphs applied earlier stay, and are dropped, since the processors they captured
            changed.

    Returns:
        A :class:`PatchReport`. Call :func:`patch_report` after running the model to see the
        sequence lengths each layer got.

    A patched model's eager inference calls compile new layouts' kernels on a background thread,
    PyTorch's SDPA serving them until they are ready (:mod:`sdpatch.graphs`, eager calls);
    :func:`sdpatch.wait_for_kernels` waits for them.

    Patching again re-patches from the original processors (for example with another backend);
    :func:`unpatch_unet` restores them. Processors that are not diffusers' stock ones stay. A stock
    processor set on a patched layer later, by diffusers or by you, is served by sdpatch too, and
    the model's ``set_default_attn_processor()`` unpatches it (see the module docstring).

    Raises:
        TypeError: ``target`` has no diffusers Attention layers.
        ValueError: unknown ``backend``, a ``chunk_budget`` that is not a positive int, or a
            ``recompute`` that is not a bool.
        BackendUnavailableError: ``backend`` cannot serve a layer; the message names it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if chunk_budget is not None and (type(chunk_budget) is not int or chunk_budget <= 0):
        raise ValueError(f"chunk_budget must be a positive number of bytes or None, got {chunk_budget!r}")
    if type(recompute) is not bool:
        raise ValueError(f"recompute must be True or False, got {recompute!r}")
    layers = _attention_layers(target, include_vae)
    plan = []
    for name, attn in layers:  # check every layer before changing any
        original = _original(attn)
        # A layer patched before that holds another processor now (an IP-Adapter's) keeps it, and
        # takes the new settings for when diffusers resets it.
        if type(original) not in STOCK_PROCESSORS and not hasattr(attn, _ORIGINAL):
            continue
        device, dtype = _weights(attn)
        try:
            choose_backend(
                device=_run_device(device),
                dtype=dtype,
                head_dim=attn.inner_dim // attn.heads,
                backend=backend,
            )
        except BackendUnavailableError as err:
            raise BackendUnavailableError(f"attention layer {name!r}: {err}") from err
        plan.append((name, attn, original))

    from . import graphs, speed

    for _, module in graphs.graphed_components(target):
        graphs.reset(module)  # their graphs captured the processors replaced here
    for name, attn, original in plan:
        settings = _Settings(name, backend, chunk_budget, recompute)
        if type(original) in STOCK_PROCESSORS:
            type(attn).set_processor(attn, settings.processor(fused=type(original) is _FUSED))
            setattr(attn, _ORIGINAL, original)
        setattr(attn, _SET_PROCESSOR, functools.partial(_set_processor, attn, settings))
        if not changes.applied(attn, PATCH):  # patching again keeps the one step: it restores the originals
            changes.record(attn, PATCH, functools.partial(_unpatch_layer, attn))
    patched = {id(attn) for _, attn, _ in plan}
    for _, part in _parts(target, include_vae):
        if not any(id(m) in patched for m in part.modules()):
            continue
        if not changes.applied(part, PATCH):  # patching again keeps the one step
            changes.record(part, PATCH, functools.partial(_unpatch_model, part))
        if hasattr(part, _SET_DEFAULT):
            setattr(part, _SET_DEFAULT, functools.partial(_set_default_attn_processor, part))
        graphs.compile_eagerly_in_background(part)
    logger.info(
        "%d attention layers patched (backend=%s, recompute=%s), %d kept",
        len(plan), backend, recompute, len(layers) - len(plan),
    )
    if cuda_graphs:
        for note in speed.speed_up(target, cuda_graphs=True, compile=False).notes:
            logger.warning("sdpatch: %s", note)
    return patch_report(target, include_vae=include_vae)


def unpatch_unet(target: object) -> object:
    """Put back the processor objects that :func:`patch_unet` replaced, and return ``target``.

    Layers that hold another processor than sdpatch's now (an IP-Adapter's, a user's) keep it.
    A pipeline's VAE is always included. CUDA graphs applied with ``cuda_graphs=True`` are released.
    """
    from .speed import remove_speed

    remove_speed(target)
    for _, attn in _attention_layers(target, include_vae=True):
        changes.undo(attn, PATCH)
    for _, part in _parts(target, include_vae=True):
        changes.undo(part, PATCH)
    return target


def patch_report(target: object, *, include_vae: bool = True) -> PatchReport:
    """The report of ``target`` as it stands, one row per attention layer.

    For a patched layer: the sequence lengths of its latest call, and the backend that call got
    and why (before any call: what it would get on the device and dtype of the layer's weights).
    Other layers show ``kept: <processor class>``. Layers whose calls fell back to chunked are
    listed in ``fallbacks``. Raises TypeError like :func:`patch_unet`.
    """
    rows, fallbacks = [], []
    for name, attn in _attention_layers(target, include_vae):
        proc = attn.processor
        head_dim = attn.inner_dim // attn.heads
        kind = "cross" if attn.is_cross_attention else "self"
        if not isinstance(proc, SdpatchAttnProcessor):
            reason = "sdpatch not applied" if type(proc) in STOCK_PROCESSORS else "not a stock processor"
            kept = f"kept: {type(proc).__name__}"
            rows.append(LayerRow(name, kind, attn.heads, head_dim, None, None, False, kept, reason))
            continue
        call = proc.last_call
        device, dtype = _weights(attn) if call is None else (call.device, call.dtype)
        try:
            choice = choose_backend(device=device, dtype=dtype, head_dim=head_dim, backend=proc.backend)
            backend, reason = choice.name, choice.reason
        except BackendUnavailableError as err:
            backend, reason = proc.backend, f"cannot run on {device}: {err}"
        nq, nk = (None, None) if call is None else (call.nq, call.nk)
        rows.append(LayerRow(name, kind, attn.heads, head_dim, nq, nk, True, backend, reason))
        if proc.last_fallback is not None:
            event = proc.last_fallback
            fallbacks.append(LayerFallback(name, proc.fallbacks, event.backend, event.reason))
    return PatchReport(tuple(rows), tuple(fallbacks))
