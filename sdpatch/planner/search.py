"""The search: given a budget, the levers a generation takes to fit it (:func:`plan_for`, on a
:class:`~sdpatch.planner.estimator.ModelSpec`; :func:`plan`, :func:`fit` and
:func:`plan_from_configs`, on a pipeline), the floor when nothing fits (:meth:`Plan.failure`), and
a plan's report lines.

Levers are taken cheapest first (:data:`~sdpatch.planner.levers.LEVER_ORDER`) until the estimate
fits, then each graded lever is relaxed back to its mildest setting that still fits.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from sdpatch.memory import MIB, PHASE_LABELS, format_bytes, host_available_bytes, host_resident_bytes
from sdpatch.planner.estimator import (
    GIB,
    GPU_ASSUMPTIONS,
    OFFLOAD_BYTES_PER_S,
    TRITON_AUTOTUNE_SCRATCH,
    AttentionCost,
    DeviceState,
    Estimate,
    ModelSpec,
    PlannerError,
    PlanCost,
    RunShape,
    _attention_costs,
    decode_host,
    estimate,
    host_weights,
    plan_cost,
)
from sdpatch.planner.levers import (
    EXACT_LEVERS,
    GROUP_OFFLOAD_TYPES,
    LEVER_ORDER,
    Levers,
    _reset,
    apply_plan,
    lever_unavailable,
)
from sdpatch.planner.spec import device_state, model_spec
from sdpatch.planner.streamed_decode import STORES

logger = logging.getLogger(__name__)

FF_CHUNKS = (2, 4, 8, 16)

CHUNK_BUDGETS = (64 * MIB, 16 * MIB, 4 * MIB)

MIN_VAE_TILE = 128  # pixels: tiles are halved down to this (or the VAE's own tile, if smaller)

# The streamed decode's strips, in image rows, largest (fewest kernel launches, least halo
# recomputed) first. At 16 the decoder's 1/8-size layers still get 2 rows a strip, and a full-size
# resnet's second pass computes conv1 on 18 rows for the 16 it writes; smaller strips would spend
# more on halos and launches than they save.
STREAM_STRIPS = (512, 256, 128, 64, 32, 16)

MIN_GAIN = MIB  # a lever is taken for what it saves, not for rounding


def parse_budget(text: str | float, what: str = "budget") -> float | Literal["auto"]:
    """A budget: a positive number of GiB, or ``auto`` (the device's free memory). ``what`` names
    it in the error: the argument for library calls, the option (``--vram-budget``) for the CLI's."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        gib = float(text)
    except (TypeError, ValueError):
        raise PlannerError(f"{what} must be a number of GiB or 'auto', got {text!r}") from None
    if not (math.isfinite(gib) and gib > 0):
        raise PlannerError(f"{what} must be a positive number of GiB, got {text!r}")
    return gib


def resolve_budget(budget: str | float, device: torch.device) -> tuple[int, str]:
    """The budget in bytes and how to describe it. ``auto``: the device's free memory plus what
    this process already holds there (CUDA reserved, or the process's resident host memory)."""
    value = parse_budget(budget)
    if value != "auto":
        return int(value * GIB), f"{value:g} GiB"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        return free + held, f"auto: {format_bytes(free)} free on {device} + {format_bytes(held)} reserved here"
    available, held = host_available_bytes(), host_resident_bytes()
    label = f"auto: {format_bytes(available)} of host memory available + {format_bytes(held)} resident here"
    return available + held, label


@dataclass(frozen=True)
class PlanStep:
    """A lever the plan takes: its setting, why (what it changes in the estimate), whether exact."""

    lever: str
    setting: str
    reason: str
    exact: bool

    def to_dict(self) -> dict[str, Any]:
        return {"lever": self.lever, "setting": self.setting, "reason": self.reason, "exact": self.exact}


@dataclass(frozen=True)
class Plan:
    """The levers a generation of ``shape`` takes to fit ``budget`` bytes, and the estimates.

    ``memory`` says what the budget is compared with: ``reserved`` (CUDA: PyTorch's peak reserved
    memory; the CUDA context is outside it) or ``host`` (the process's peak resident memory).
    ``unplanned`` is the estimate without any lever.
    """

    budget: int
    budget_label: str
    shape: RunShape
    levers: Levers
    steps: tuple[PlanStep, ...]
    estimate: Estimate
    unplanned: Estimate
    memory: Literal["reserved", "host"]
    notes: tuple[str, ...] = ()
    host_bytes: int = 0  # weights the plan keeps in host memory (host_weights)
    host_decode_bytes: int = 0  # the streamed decode's pinned host store at its peak (decode_host)
    host_available: int | None = None
    host_limit: str | None = None  # why no stronger plan was taken: the host's memory
    cost: PlanCost = PlanCost()  # expected time cost (a factor and seconds on each step, seconds an image)

    @property
    def fits(self) -> bool:
        return self.estimate.peak <= self.budget

    def failure(self, best_effort: bool = False) -> str:
        """One line: the budget cannot be met, with the best estimate."""
        top = self.estimate.top
        levers = ", ".join(s.setting for s in self.steps) or "no lever helps"
        host = f"; {self.host_limit}" if self.host_limit else ""
        return (
            f"--vram-budget {self.budget_label} cannot be met for {self.shape.width}x{self.shape.height}: the "
            f"floor for this model and size is the smallest plan ({levers}), which needs an estimated "
            f"{format_bytes(top.reserved)} of {self.memory} memory in {PHASE_LABELS[top.name]}, "
            f"{format_bytes(top.reserved - self.budget)} over{host}; "
            + ("running it anyway (best effort)" if best_effort else "pass --best-effort to run anyway")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget,
            "budget": self.budget_label,
            "memory": self.memory,
            "shape": vars(self.shape).copy(),
            "fits": self.fits,
            "approximate": self.levers.vae_tile is not None or self.levers.fp8_storage,
            "estimated_peak_bytes": self.estimate.peak,
            "estimated_peak_phase": self.estimate.top.name,
            "unplanned_peak_bytes": self.unplanned.peak,
            "levers": [s.to_dict() for s in self.steps],
            "settings": vars(self.levers).copy(),
            "estimate": [p.to_dict() for p in self.estimate.phases],
            "unplanned": [p.to_dict() for p in self.unplanned.phases],
            "notes": list(self.notes),
            "host_bytes": self.host_bytes,
            "host_decode_bytes": self.host_decode_bytes,
            "host_available_bytes": self.host_available,
            "host_limit": self.host_limit,
            "step_factor": self.cost.step_factor,
            "step_seconds": self.cost.step_seconds,
            "copy_seconds_per_image": self.cost.image_seconds,
        }


def _options(
    lever: str, spec: ModelSpec, shape: RunShape, levers: Levers, device: DeviceState, allow_fp8: bool = False
) -> list[Levers]:
    """Settings of ``lever`` stronger than the current one, mildest first; the weight levers on
    CUDA only, fp8 storage only with ``allow_fp8``."""
    if lever == "allocator":
        return [replace(levers, expandable_segments=True)] if device.cuda and not levers.expandable_segments else []
    if lever == "attention":
        out, base = [], levers
        if not levers.flash_attention and any(c.kind == "materialized" for c in spec.attention.values()):
            base = replace(levers, flash_attention=True)
            out.append(base)
        budgets = [c.budget for c in _attention_costs(spec, base).values() if c.kind == "chunked"]
        return out + [replace(base, chunk_budget=b) for b in CHUNK_BUDGETS if budgets and b < max(budgets)]
    if lever == "ff_chunking":
        return [replace(levers, ff_chunks=k) for k in FF_CHUNKS if k > levers.ff_chunks]
    if lever == "split_cfg":
        sizes, size = [], levers.unet_micro_batch or shape.unet_batch
        while size > 1:
            size = (size + 1) // 2
            sizes.append(size)
        return [replace(levers, unet_micro_batch=s) for s in sizes]
    if lever == "vae_streaming":
        if not spec.streamed_decode:
            return []
        # The device store first (no copies); off CUDA the device is the host.
        stores = STORES if device.cuda else STORES[:1]
        settings = [(store, strip) for store in stores for strip in STREAM_STRIPS if strip < shape.height]
        current = (levers.vae_stream, levers.vae_strip)
        done = settings.index(current) + 1 if current in settings else 0
        return [replace(levers, vae_stream=store, vae_strip=strip) for store, strip in settings[done:]]
    if lever == "vae_tiling":
        tiles, tile = [], spec.default_tile
        while tile >= min(MIN_VAE_TILE, spec.default_tile):
            if max(shape.height, shape.width) > tile and tile < (levers.vae_tile or math.inf):
                tiles.append(tile)
            tile //= 2
        return [replace(levers, vae_tile=t) for t in tiles]
    if not device.cuda or lever_unavailable(lever) or (lever == "fp8_storage" and not allow_fp8):
        return []
    if lever == "text_encoder_offload":
        return [] if levers.text_encoder_offload or levers.cpu_offload else [replace(levers, text_encoder_offload=True)]
    if lever == "cpu_offload":
        return [] if levers.cpu_offload else [replace(levers, cpu_offload=True)]
    if lever == "group_offload":
        # It replaces model offload for the UNet (diffusers refuses both on one pipeline).
        done = GROUP_OFFLOAD_TYPES.index(levers.group_offload) + 1 if levers.group_offload else 0
        kinds = _cheaper_and_smaller(spec, GROUP_OFFLOAD_TYPES[done:])
        return [replace(levers, group_offload=k, cpu_offload=False) for k in kinds]
    if lever == "fp8_storage":
        return [] if levers.fp8_storage else [replace(levers, fp8_storage=True)]
    return [] if levers.sequential_offload else [replace(levers, sequential_offload=True, **_SUBSUMED)]


# What sequential offload replaces: every other weight lever (it offloads every model itself),
# and the streamed decode, which reads the decoder's weights directly, where accelerate's hooks on
# each layer would have to move them (it would run diffusers' decoder instead).
_SUBSUMED = {
    "text_encoder_offload": False,
    "cpu_offload": False,
    "group_offload": None,
    "fp8_storage": False,
    "vae_stream": None,
    "vae_strip": None,
}


def _cheaper_and_smaller(spec: ModelSpec, kinds: tuple[str, ...]) -> list[str]:
    """The group offload kinds, mildest in memory first, without those that a stronger one beats
    on time too (:data:`OFFLOAD_BYTES_PER_S`): on the H200 measurement, block level was slower than
    leaf level for the SDXL UNet and saved less, so leaf level is the only one offered."""
    rate = {k: OFFLOAD_BYTES_PER_S[f"group_offload:{k}"] for k in kinds}
    return [k for i, k in enumerate(kinds) if not any(rate[s] >= rate[k] for s in kinds[i + 1 :])]


def _excess(est: Estimate, budget: int) -> int:
    """How far the phases are over budget, summed: a lever helps when it lowers this."""
    return sum(max(0, p.reserved - budget) for p in est.phases)


def _setting(lever: str, levers: Levers, shape: RunShape) -> str:
    if lever == "allocator":
        return "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    if lever == "attention":
        parts = ["sdpatch auto attention instead of materializing processors"] if levers.flash_attention else []
        if levers.chunk_budget is not None:
            parts.append(f"chunked attention in {format_bytes(levers.chunk_budget)} chunks")
        return ", ".join(parts)
    if lever == "ff_chunking":
        return f"feed-forward in {levers.ff_chunks} token chunks"
    if lever == "split_cfg":
        n = levers.unet_micro_batch
        if shape.cfg and n == shape.batch:
            return f"split CFG: the UNet batch of {shape.unet_batch} runs as 2 calls of {n}"
        return f"UNet batch of {shape.unet_batch} in calls of {n}"
    if lever == "vae_streaming":
        held = "in pinned host memory" if levers.vae_stream == "host" else "on the device"
        return f"streamed VAE decode in {levers.vae_strip} px strips, whole tensors {held}"
    if lever == "vae_tiling":
        return f"tiled VAE decode in {levers.vae_tile} px tiles"
    if lever == "text_encoder_offload":
        return "text encoders on the CPU between their calls"
    if lever == "group_offload":
        return f"UNet group offload ({levers.group_offload.replace('_', ' ')}, CUDA streams)"
    if lever == "fp8_storage":
        return "UNet weights stored in fp8 (float8_e4m3fn, approximate)"
    if lever == "sequential_offload":
        return "sequential CPU offload of every model"
    return "model CPU offload"


def plan_for(
    spec: ModelSpec,
    shape: RunShape,
    budget: int,
    device: DeviceState = DeviceState(),
    *,
    budget_label: str | None = None,
    allow_fp8: bool = False,
) -> Plan:
    """Choose levers for ``shape`` on ``spec`` within ``budget`` bytes: cheapest first
    (:data:`LEVER_ORDER`) until the estimate fits, each at its mildest setting that fits, else at
    its strongest; then each lever taken is relaxed back to its mildest setting that does as well,
    since a later lever may have done its work, until none relaxes further. A lever that lowers
    the phases over the budget by less than :data:`MIN_GAIN` is not taken, nor a setting whose
    weights and streamed-decode host store would not fit in ``device.host_available`` (it would
    swap). When nothing fits, the plan holds the levers that
    lowered the estimate, and ``fits`` is False."""
    start = Levers(expandable_segments=device.expandable_segments)
    unplanned = estimate(spec, shape, start, device)
    levers, current, taken = start, unplanned, []
    host_refused: list[Levers] = []

    def host_need(levers: Levers) -> int:
        return host_weights(spec, levers) + decode_host(spec, shape, levers)[0]

    def host_holds(levers: Levers) -> bool:
        return device.host_available is None or host_need(levers) <= device.host_available

    def options(lever: str, base: Levers) -> list[Levers]:
        found = _options(lever, spec, shape, base, device, allow_fp8)
        host_refused.extend(o for o in found if not host_holds(o))
        return [o for o in found if host_holds(o)]

    for lever in LEVER_ORDER:
        if current.peak <= budget:
            break
        best: tuple[Levers, Estimate] | None = None
        for option in options(lever, levers):
            best = option, estimate(spec, shape, option, device)
            if best[1].peak <= budget:
                break
        # Nothing fits: the strongest setting, if it helps; the relaxing below undoes what a
        # later lever makes unnecessary.
        if best is not None and _excess(best[1], budget) < _excess(current, budget) - MIN_GAIN:
            levers, current = best
            taken.append(lever)
    # Relax: the mildest setting of each lever that keeps the estimate as good (within budget, or
    # as little over it); the allocator costs nothing and stays. Again until none relaxes: a lever
    # taken out may leave room for one relaxed before it (tiles larger once the decode is not
    # also streamed). Each lever only ever moves to a milder setting, so this ends.
    target = _excess(current, budget)
    relaxed = True
    while relaxed:
        relaxed = False
        for lever in reversed([t for t in taken if t != "allocator"]):
            off = _reset(levers, lever, start)
            for option in [off, *options(lever, off)]:
                if option == levers:
                    break
                if not host_holds(option):  # without tiled decode, the streamed decode's host store is whole
                    continue
                est = estimate(spec, shape, option, device)
                if _excess(est, budget) <= target:
                    levers, current, relaxed = option, est, True
                    break
    taken = [t for t in taken if _reset(levers, t, start) != levers]
    steps = []
    for lever in taken:
        without = estimate(spec, shape, _reset(levers, lever, start), device)
        changes = [
            f"{PHASE_LABELS[p.name]} {format_bytes(w.reserved)} -> {format_bytes(p.reserved)}"
            for w, p in zip(without.phases, current.phases)
            if w.reserved - p.reserved >= MIN_GAIN and format_bytes(w.reserved) != format_bytes(p.reserved)
        ]
        reason = "lowers " + ", ".join(changes) if changes else "no change on its own"
        steps.append(PlanStep(lever, _setting(lever, levers, shape), reason, lever in EXACT_LEVERS))
    notes = []
    if device.cuda and spec.triton:
        notes.append(
            f"a size's first run autotunes the Triton kernels, with up to {format_bytes(TRITON_AUTOTUNE_SCRATCH)} "
            "more in its first denoising step (not in the estimate; autotune results are then kept on disk)"
        )
    if device.cuda:
        # An unavailable lever matters where the plan fails or takes a costlier one instead.
        last = max((LEVER_ORDER.index(t) for t in taken), default=-1)
        for i, lever in enumerate(LEVER_ORDER):
            why = lever_unavailable(lever)
            if why and (current.peak > budget or i < last):
                notes.append(f"{lever.replace('_', ' ')} is unavailable: {why}")
    if device.cuda and current.peak > budget:
        if not allow_fp8 and not lever_unavailable("fp8_storage"):
            with_fp8 = plan_for(spec, shape, budget, device, allow_fp8=True)
            if with_fp8.estimate.peak < current.peak:
                notes.append(f"with --allow-fp8 (approximate) the floor is {format_bytes(with_fp8.estimate.peak)}")
    host_limit = None
    if host_refused and current.peak > budget:
        need = min(host_need(o) for o in host_refused)
        host_limit = (
            f"the host is the limit: a stronger plan keeps {format_bytes(need)} in host memory, "
            f"{format_bytes(device.host_available)} is available (it would swap)"
        )
    return Plan(
        budget=budget,
        budget_label=budget_label or format_bytes(budget),
        shape=shape,
        levers=levers,
        steps=tuple(steps),
        estimate=current,
        unplanned=unplanned,
        memory="reserved" if device.cuda else "host",
        notes=tuple(notes),
        host_bytes=host_weights(spec, levers),
        host_decode_bytes=decode_host(spec, shape, levers)[0],
        host_available=device.host_available,
        host_limit=host_limit,
        cost=plan_cost(spec, shape, levers),
    )


def plan(
    pipe: Any,
    budget: float | str,
    *,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    cfg: bool = True,
    device: torch.device | str | None = None,
    allow_fp8: bool = False,
) -> Plan:
    """Plan the levers that fit a generation on ``pipe`` into ``budget``, without changing ``pipe``.

    Args:
        pipe: a loaded StableDiffusionPipeline or StableDiffusionXLPipeline, patched or not.
        budget: GiB of PyTorch's peak reserved memory on CUDA (the process's resident memory
            elsewhere), or ``"auto"``: the device's free memory plus what this process holds.
        height, width: the image size (None: the model's native size).
        batch: images per pipeline call.
        cfg: classifier-free guidance (diffusers: a guidance scale > 1), which doubles the UNet batch.
        device: where it will run, if not where it is (e.g. loaded on the CPU to run on CUDA).
        allow_fp8: the plan may store the UNet's weights in fp8 (approximate).

    Returns a :class:`Plan`; ``plan.fits`` says whether its estimate is within the budget.
    """
    from sdpatch.models import default_size

    target = torch.device(device) if device is not None else None
    spec = model_spec(pipe, target)
    size = default_size(pipe)
    shape = RunShape(height or size, width or size, batch, cfg)
    nbytes, label = resolve_budget(budget, target or pipe._execution_device)
    state = device_state(pipe, spec, target)
    return plan_for(spec, shape, nbytes, state, budget_label=label, allow_fp8=allow_fp8)


def plan_from_configs(
    pipe: Any,
    budget: float | str,
    *,
    device: str,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    cfg: bool = True,
    allow_fp8: bool = False,
) -> Plan:
    """The plan for a pipeline built on the meta device from its configs (no weights, no GPU):
    what ``sdpatch plan`` and ``generate --dry-run`` print. On ``cuda`` the device's state is
    assumed (:data:`GPU_ASSUMPTIONS`, in the plan's notes): nothing else on the GPU, expandable
    segments on (``--vram-budget`` asks for them); host memory is this machine's."""
    from sdpatch.models import default_size

    target = torch.device(device)
    spec = model_spec(pipe, target)
    cuda = target.type == "cuda"
    if cuda:
        flash = {name: AttentionCost() for name in spec.attention}
        spec = replace(spec, attention=flash, auto_attention=flash)
    if parse_budget(budget) == "auto":
        raise PlannerError("a plan from configs needs a budget in GiB: 'auto' reads the device's free memory")
    size = default_size(pipe)
    shape = RunShape(height or size, width or size, batch, cfg)
    nbytes, label = resolve_budget(budget, target)
    state = DeviceState(cuda=cuda, expandable_segments=cuda, host_available=host_available_bytes() if cuda else None)
    chosen = plan_for(spec, shape, nbytes, state, budget_label=label, allow_fp8=allow_fp8)
    return replace(chosen, notes=chosen.notes + (tuple(f"assumed: {a}" for a in GPU_ASSUMPTIONS) if cuda else ()))


def fit(
    pipe: Any,
    budget: float | str,
    *,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    cfg: bool = True,
    best_effort: bool = False,
    device: torch.device | str | None = None,
    allow_fp8: bool = False,
) -> Plan:
    """:func:`plan`, then :func:`apply_plan`: what ``--vram-budget`` does.

    A budget that cannot be met raises :class:`PlannerError` (a one-line message with the
    estimate) before anything changes, unless ``best_effort``: then the best plan is applied and
    a warning says by how much it is expected to miss.
    """
    chosen = plan(pipe, budget, height=height, width=width, batch=batch, cfg=cfg, device=device, allow_fp8=allow_fp8)
    if not chosen.fits and not best_effort:
        raise PlannerError(chosen.failure())
    if not chosen.fits:
        logger.warning("%s", chosen.failure(best_effort=True))
    notes = apply_plan(pipe, chosen, device)
    return replace(chosen, notes=chosen.notes + tuple(notes))


def plan_lines(plan: dict[str, Any], measured: int | None) -> list[str]:
    """The report's lines for a plan (:meth:`Plan.to_dict`) and the measured peak (None: not run)."""
    budget, est = plan["budget_bytes"], plan["estimated_peak_bytes"]
    what = "peak reserved" if plan["memory"] == "reserved" else "peak host memory"
    phase = PHASE_LABELS[plan["estimated_peak_phase"]]
    head = f"vram budget {plan['budget']} ({what}): estimated {format_bytes(est)} in {phase}"
    if plan["levers"]:
        head += f" ({format_bytes(plan['unplanned_peak_bytes'])} without the plan)"
    if measured is not None:
        head += f", measured {format_bytes(measured)}: " + (
            f"within budget, {format_bytes(budget - measured)} to spare"
            if measured <= budget
            else f"missed the budget by {format_bytes(measured - budget)}"
        )
    elif not plan["fits"]:
        head += f": {format_bytes(est - budget)} over budget"
    levers = "; ".join(f"{s['setting']} ({s['reason']})" for s in plan["levers"])
    lines = [head, "plan: " + (levers or ("no lever needed" if plan["fits"] else "no lever helps"))]
    approximate = [s["setting"] for s in plan["levers"] if not s["exact"]]
    if approximate:
        lines.append(f"plan: approximate, the image may differ: {'; '.join(approximate)}")
    costs = []
    if plan.get("step_seconds"):
        costs.append(f"+{plan['step_seconds']:.2f} s per denoising step of weight copies")
    if plan.get("step_factor", 1.0) > 1.0:
        costs.append(f"denoising compute about {plan['step_factor']:.1f}x slower (fp8 weights cast each step)")
    if plan.get("copy_seconds_per_image"):
        costs.append(f"+{plan['copy_seconds_per_image']:.2f} s per image of host-device copies")
    if costs:
        lines.append("plan cost (H200 measurements, docs/benchmarks.md): " + ", ".join(costs))
    held = [f"{format_bytes(plan['host_bytes'])} of weights"] if plan.get("host_bytes") else []
    if plan.get("host_decode_bytes"):
        held.append(f"{format_bytes(plan['host_decode_bytes'])} of the streamed decode's activations (pinned)")
    if held:
        available = plan.get("host_available_bytes")
        lines.append(
            f"plan: {' and '.join(held)} in host memory"
            + (f" ({format_bytes(available)} available)" if available is not None else "")
        )
    return lines + [f"plan note: {n}" for n in plan["notes"]]


def estimate_lines(plan: dict[str, Any]) -> list[str]:
    """Each phase's estimated peak with and without the plan (:meth:`Plan.to_dict`), for a plan
    that is not run."""
    what = "reserved" if plan["memory"] == "reserved" else "host"
    lines = []
    for planned, unplanned in zip(plan["estimate"], plan["unplanned"]):
        lines.append(
            f"  {PHASE_LABELS[planned['name']]:<14} {format_bytes(planned['reserved_bytes']):>10} {what}"
            f"  (activations {format_bytes(planned['activations_bytes'])}; without the plan "
            f"{format_bytes(unplanned['reserved_bytes'])}) at {planned['site']}"
        )
    return ["estimated peak per phase:", *lines]
