"""Comparison runs across attention backends and image sizes: the library behind ``sdpatch compare``.

A run loads the pipeline once and measures every cell (one square size with one backend) with
:func:`~sdpatch.generate.measured_call`: the same prompt, seed and initial latents in every cell,
per-phase peak memory, seconds per denoising step, and the image compared with the reference
cell (``stock`` at the same size). Between cells the pipeline goes back to its own stock
processors (the same objects) and memory is released; each cell records the memory in use when
it starts, and the report checks that every cell started from the same baseline.

An out-of-memory error is a result: the cell records ``OOM in <phase>`` and the run goes on.
``max_size`` adds, per backend, a bisection for the largest square size that completes.

Output folder: ``report.json`` (rewritten atomically after every cell, so a run that stops keeps
what it finished), ``report.md``, ``memory.png`` (peak memory against size; needs matplotlib),
``grid.png`` (the images, backends × sizes) and ``images/<backend>-<size>.png``.
``python -m sdpatch.compare DIR`` draws report.md and the figures again from DIR's report.json,
e.g. after a run on a machine without matplotlib.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import importlib.util
import json
import logging
import math
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from sdpatch.attention import backend_status
from sdpatch.errors import InputError, first_line
from sdpatch.generate import (
    PHASE_LABELS,
    atomic_write,
    check_folder,
    apply_backend,
    device_name,
    measured_call,
    versions,
    write_json,
    write_png,
)
from sdpatch.memory import MemoryMeter, PhaseStats, format_bytes, is_oom, plural, total, weights_bytes
from sdpatch.models import default_size, load_pipeline, resolve_device, resolve_dtype, resolve_model, tokenizer_note
from sdpatch.planner import apply_plan, fit, plan_lines, remove_plan, single_lever
from sdpatch.progress import Progress
from sdpatch.settings import (  # noqa: F401 (re-exported: the compare API)
    COMPARE_BACKENDS,
    DEFAULT_PROMPT,
    SIZE_STEP,
    CompareSettings,
    check_backends,
    check_sizes,
    parse_backends,
    parse_sizes,
)

logger = logging.getLogger(__name__)

GIB = 1024**3

# What a run compares when no backends are named: each one that can run here. ``auto`` is left
# out: it is triton or chunked, layer by layer.
DEFAULT_BACKENDS = ("stock", "naive", "sliced", "xformers", "sdpa", "triton", "chunked")
BACKEND_DESCRIPTIONS = {
    "stock": "the pipeline as loaded: diffusers' AttnProcessor2_0 (PyTorch SDPA) in the UNet and VAE",
    "naive": "diffusers' AttnProcessor in the UNet (materializes the N×N scores); the VAE stays stock",
    "sliced": "diffusers' attention slicing, pipe.enable_attention_slicing() (slice 'auto': half the heads "
    "at a time), in the UNet; the VAE stays stock",
    "xformers": "pipe.enable_xformers_memory_efficient_attention(): UNet and VAE",
    "sdpa": "sdpatch's processor on PyTorch SDPA: UNet and VAE",
    "triton": "sdpatch's Triton flash kernel in the UNet; the VAE (one head of dim 512) gets sdpatch auto",
    "chunked": "sdpatch's chunked-query PyTorch fallback: UNet and VAE",
    "auto": "sdpatch auto (Triton where it can serve a layer, else chunked): UNet and VAE",
    "planned": "sdpatch auto with the --vram-budget plan for each size (see the plans section)",
}

# How far apart cell baselines may be and still count as equal. The caching allocator gives
# exact figures on CUDA (a few MiB of scheduler state may remain); resident host memory moves
# with the C allocator's free lists.
BASELINE_TOLERANCE = {"cuda": 16 * 1024**2, "host": 64 * 1024**2}

# Step times that spread by more than this (their range over their mean), within a cell or between
# a size's two runs of the reference, rank no backend at that size: CPU runs share their cores.
RANK_NOISE = 0.10

_CHART_NOTE = "chart not drawn:"
PLANNED = "planned"  # the --vram-budget column
_APPROXIMATE = {"vae_tiling": "tiled decode", "fp8_storage": "fp8 weights"}  # the planner's inexact levers

# Issue 5's reference: one SD 1.5 UNet call, batch 2, fp16, H200; peak over the weights.
SD15_REFERENCE = {
    "naive": {1024: "16.2 GiB", 2048: "OOM at 139 GiB"},
    "sliced": {1024: "4.2 GiB", 2048: "65.0 GiB"},
    "SDPA (stock, sdpa)": {1024: "0.5 GiB", 2048: "2.0 GiB"},
}

PHASE_FIELDS = ("name", "seconds", "peak_allocated", "peak_reserved", "peak_host", "step_seconds")



def backend_availability(device: torch.device) -> dict[str, tuple[bool, str]]:
    """For each compare backend: whether it can run on ``device`` here, and why (not)."""
    status = backend_status(device)
    if importlib.util.find_spec("xformers") is None:
        xformers = (False, "xformers is not installed")
    elif device.type != "cuda":
        xformers = (False, f"xformers needs a CUDA device, got {device.type}")
    else:
        xformers = (True, "xformers memory_efficient_attention")
    return {
        "stock": (True, "diffusers' default processors"),
        "naive": (True, "diffusers' AttnProcessor"),
        "sliced": (True, "diffusers' attention slicing"),
        "xformers": xformers,
        **status,
        "auto": (True, "sdpatch auto"),
    }


def resolve_backends(backends: Sequence[str] | None, device: torch.device) -> tuple[list[str], list[str]]:
    """The backends to compare, and notes on those left out.

    Named backends that cannot run here raise InputError; without names, every default backend
    that can run is taken and each one left out is noted.
    """
    available = backend_availability(device)
    if backends is not None:
        for name in backends:
            ok, why = available[name]
            if not ok:
                raise InputError(f"backend {name!r} cannot run on {device}: {why}")
        return list(backends), []
    chosen = [name for name in DEFAULT_BACKENDS if available[name][0]]
    notes = [f"backend {name} left out: {available[name][1]}" for name in DEFAULT_BACKENDS if not available[name][0]]
    return chosen, notes


def plan_out_dir(out: Path, *, overwrite: bool) -> tuple[Path, str | None]:
    """The folder a run writes to, and a note when it is not ``out``.

    ``out`` is used when it does not exist yet (its parent must), when it is empty, or with
    ``overwrite``. Otherwise the run goes to the first of ``out-2``, ``out-3``, ... that does not
    exist or is empty, so an earlier report is never replaced by accident.
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a folder")
    if not out.exists():
        check_folder(out.parent, "--out")
        return out, None
    check_folder(out, "--out")
    if overwrite or not any(out.iterdir()):
        return out, None
    base = out.resolve()
    n = 2
    while True:
        candidate = base.with_name(f"{base.name}-{n}")
        if not candidate.exists() or (candidate.is_dir() and not any(candidate.iterdir())):
            return candidate, f"{out} is not empty: writing to {candidate} instead (pass --overwrite to replace it)"
        n += 1


# -- cells -------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One measured generation: one backend at one square size.

    ``status`` is ``ok``, ``oom`` (out of memory in ``failed_phase``) or ``error`` (another
    exception, its first line in ``message``); ``during_warmup`` says the failure came in the
    warm-up run, whose steps have the same peak as the measured run's. ``baseline`` is the
    memory in use when the cell started (allocated on CUDA, resident on the host): the weights,
    and nothing left by earlier cells. ``kind`` is ``grid`` for a cell of the sizes × backends
    table, ``probe`` for a ``max_size`` probe (no image kept).
    """

    backend: str
    size: int
    kind: Literal["grid", "probe"] = "grid"
    status: Literal["ok", "oom", "error"] = "ok"
    failed_phase: str | None = None
    message: str | None = None
    during_warmup: bool = False
    baseline: int = 0
    baseline_reserved: int | None = None
    phases: list[PhaseStats] = field(default_factory=list)
    seconds: float = 0.0
    images: list[str] = field(default_factory=list)
    reference: str | None = None
    max_abs_diff: int | None = None
    psnr_db: float | None = None
    plan: dict[str, Any] | None = None  # the planned column's plan, with each lever's PSNR
    recheck_seconds_per_step: float | None = None  # the reference's run again, after its size's other cells

    @property
    def failure(self) -> str | None:
        """``OOM in denoising``, ``error in VAE decode``, ...; None when the cell completed."""
        if self.status == "ok":
            return None
        where = PHASE_LABELS.get(self.failed_phase or "", self.failed_phase or "setup")
        what = "OOM" if self.status == "oom" else "error"
        return f"{what} in {where}"

    def phase(self, name: str) -> PhaseStats | None:
        return next((p for p in self.phases if p.name == name), None)

    @property
    def peak(self) -> int | None:
        """Peak memory of the whole cell: allocated on CUDA, resident on the host."""
        t = total(self.phases)
        return t.peak_allocated if t.peak_allocated is not None else t.peak_host

    @property
    def peak_reserved(self) -> int | None:
        return total(self.phases).peak_reserved

    def over_baseline(self, name: str | None = None) -> int | None:
        """Peak of phase ``name`` (None: the whole cell) above the cell's baseline."""
        p = total(self.phases) if name is None else self.phase(name)
        if p is None:
            return None
        peak = p.peak_allocated if p.peak_allocated is not None else p.peak_host
        return None if peak is None else peak - self.baseline

    @property
    def seconds_per_step(self) -> float | None:
        denoise = self.phase("denoising")
        return denoise.seconds_per_step if denoise and self.status == "ok" else None

    @property
    def step_spread(self) -> float | None:
        """The range of the step times that ``seconds_per_step`` averages (all but the first step),
        relative to their mean; None with fewer than two of them."""
        denoise = self.phase("denoising")
        steady = (denoise.step_seconds or [])[1:] if denoise and self.status == "ok" else []
        if len(steady) < 2:
            return None
        return (max(steady) - min(steady)) / (sum(steady) / len(steady))

    def summary(self) -> str:
        """One line for progress output."""
        head = f"{self.size}² {self.backend}"
        if self.status != "ok":
            return f"{head}: {self.failure}" + (f" ({self.message})" if self.status == "error" else "")
        parts = [f"peak {format_bytes(self.peak)}", _per_step(self.seconds_per_step, self.step_spread)]
        if self.reference is not None and self.reference != self.backend:
            parts.append(f"PSNR {_format_psnr(self.psnr_db)} vs {self.reference}, max diff {self.max_abs_diff}")
        if self.plan is not None:
            parts.append("plan: " + (", ".join(s["setting"] for s in self.plan["levers"]) or "no lever"))
        return f"{head}: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "size": self.size,
            "kind": self.kind,
            "status": self.status,
            "failure": self.failure,
            "failed_phase": self.failed_phase,
            "message": self.message,
            "during_warmup": self.during_warmup,
            "baseline_bytes": self.baseline,
            "baseline_reserved_bytes": self.baseline_reserved,
            "peak_bytes": self.peak,
            "peak_reserved_bytes": self.peak_reserved,
            "over_baseline_bytes": {
                **{p.name: self.over_baseline(p.name) for p in self.phases},
                "total": self.over_baseline() if self.phases else None,
            },
            "seconds": self.seconds,
            "seconds_per_step": self.seconds_per_step,
            "step_spread": self.step_spread,
            "recheck_seconds_per_step": self.recheck_seconds_per_step,
            "first_step_seconds": (self.phase("denoising") or PhaseStats("")).first_step_seconds,
            "phases": [p.to_dict() for p in self.phases],
            "images": self.images,
            "reference": self.reference,
            "max_abs_diff": self.max_abs_diff,
            "psnr_db": _json_psnr(self.psnr_db),
            "plan": self.plan,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        """The cell :meth:`to_dict` wrote."""
        fields = {"backend", "size", "kind", "status", "failed_phase", "message", "during_warmup", "seconds", "images"}
        phases = [PhaseStats(**{k: p[k] for k in PHASE_FIELDS}) for p in data["phases"]]
        return cls(
            **{k: data[k] for k in fields},
            baseline=data["baseline_bytes"],
            baseline_reserved=data["baseline_reserved_bytes"],
            phases=phases,
            reference=data["reference"],
            max_abs_diff=data["max_abs_diff"],
            psnr_db=_psnr_value(data["psnr_db"], data["max_abs_diff"]),
            plan=data.get("plan"),
            recheck_seconds_per_step=data.get("recheck_seconds_per_step"),
        )


class BackendSwitcher:
    """Switches a loaded pipeline between compare backends, always from its own stock processors.

    The processor objects the pipeline had when the switcher was made are kept and put back, by
    identity, before each switch and by :meth:`restore`.
    """

    def __init__(self, pipe: Any) -> None:
        from diffusers.models.attention_processor import Attention

        self.pipe = pipe
        self.current = "stock"
        modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
        self.stock = {m: m.processor for c in modules for m in c.modules() if isinstance(m, Attention)}

    def set(self, backend: str) -> None:
        """Put ``backend`` in place (see :data:`BACKEND_DESCRIPTIONS`)."""
        self.restore()
        pipe = self.pipe
        if backend == "naive":
            from diffusers.models.attention_processor import AttnProcessor

            pipe.unet.set_attn_processor(AttnProcessor())
        elif backend == "sliced":
            self._slice()
        elif backend == "xformers":
            pipe.enable_xformers_memory_efficient_attention()
        elif backend != "stock":
            apply_backend(pipe, "auto" if backend == PLANNED else backend)
        self.current = backend

    def restore(self) -> None:
        """Put the stock processors back (the very objects the pipeline had)."""
        from sdpatch.patch import unpatch_unet

        remove_plan(self.pipe)
        if self.current == "sliced":
            self.pipe.disable_attention_slicing()
        elif self.current == "xformers":
            self.pipe.disable_xformers_memory_efficient_attention()
        unpatch_unet(self.pipe)
        for attn, processor in self.stock.items():
            if attn.processor is not processor:
                attn.set_processor(processor)
        self.current = "stock"

    def _slice(self) -> None:
        from diffusers.models.attention_processor import SlicedAttnProcessor

        self.pipe.enable_attention_slicing()
        # diffusers' 'auto' slice is heads // 2, which is 0 (a division by zero) for one head.
        for attn in self.stock:
            if isinstance(attn.processor, SlicedAttnProcessor) and attn.processor.slice_size < 1:
                attn.set_processor(SlicedAttnProcessor(1))


def release_memory(device: torch.device) -> None:
    """Free what the last cell left: garbage, and the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


def image_difference(images: Sequence[Image.Image], reference: Sequence[Image.Image]) -> tuple[int, float]:
    """Maximum absolute pixel difference (0–255) and PSNR in dB (``inf`` when identical)."""
    a = np.stack([np.asarray(i.convert("RGB"), dtype=np.float64) for i in images])
    b = np.stack([np.asarray(i.convert("RGB"), dtype=np.float64) for i in reference])
    diff = a - b
    mse = float(np.mean(diff**2))
    psnr = math.inf if mse == 0 else 10 * math.log10(255**2 / mse)
    return int(np.abs(diff).max()), psnr


def run_cell(
    pipe: Any,
    switcher: BackendSwitcher,
    settings: CompareSettings,
    backend: str,
    size: int,
    *,
    kind: Literal["grid", "probe"] = "grid",
) -> tuple[Cell, list[Image.Image]]:
    """Measure ``backend`` at ``size``×``size``: warm-up (if set), then the measured generation.

    Out-of-memory errors and other exceptions (but not KeyboardInterrupt) end the cell, not the
    run: the cell records them (an exception while switching backends is an error in "setup"),
    and the memory they held is released before the next cell measures its baseline.
    """
    device = pipe._execution_device
    release_memory(device)
    meter = MemoryMeter(device)
    cell = Cell(backend, size, kind=kind, baseline=meter.in_use())
    if meter.kind == "cuda":
        cell.baseline_reserved = torch.cuda.memory_reserved(device)
    if not _attempt(cell, meter, lambda: switcher.set(backend)):  # e.g. a broken xformers install
        return cell, []
    if backend == PLANNED and not _attempt(cell, meter, lambda: _plan_cell(cell, pipe, settings)):
        return cell, []

    def call(m: MemoryMeter, steps: int) -> list[Image.Image]:
        return _generate(pipe, m, settings, size, steps)

    images: list[Image.Image] = []
    if settings.warmup:
        warm = MemoryMeter(device)
        if not _attempt(cell, warm, lambda: call(warm, 1)):
            cell.during_warmup = True
            cell.phases = warm.phases
            return cell, []
        release_memory(device)
    start = time.perf_counter()
    _attempt(cell, meter, lambda: images.extend(call(meter, settings.steps)))
    cell.seconds = time.perf_counter() - start
    cell.phases = meter.phases
    return cell, images


def _generate(pipe: Any, meter: MemoryMeter, settings: CompareSettings, size: int, steps: int) -> list[Image.Image]:
    """One measured generation of a cell: the settings' prompt and seed at ``size``×``size``."""
    with torch.no_grad():  # real checkpoints load with requires_grad: no graph to keep
        return measured_call(
            pipe,
            meter,
            prompt=settings.prompt,
            negative_prompt=None,
            height=size,
            width=size,
            steps=steps,
            guidance_scale=settings.guidance_scale,
            seed=settings.seed,
            num_images_per_prompt=settings.batch,
        )


def _plan_cell(cell: Cell, pipe: Any, settings: CompareSettings) -> None:
    """Plan and apply the --vram-budget levers for the cell's size. Best effort: a plan that
    cannot fit still runs, and its miss (or out of memory) is the cell's result."""
    budget = settings.vram_budget
    if budget == "auto" and settings.vram_cap_gib:  # the emulated GPU's memory, not the real one's
        budget = str(settings.vram_cap_gib)
    cfg = settings.guidance_scale > 1
    plan = fit(pipe, budget, height=cell.size, width=cell.size, batch=settings.batch, cfg=cfg, best_effort=True)
    cell.plan = plan.to_dict()


def _lever_effects(pipe: Any, switcher: BackendSwitcher, settings: CompareSettings, cell: Cell, planned: list) -> None:
    """Each lever's effect on the image: PSNR of the planned images, and of each lever of the plan
    on its own, against sdpatch auto without a plan at the same seed; kept in ``cell.plan``."""
    assert cell.plan is not None
    device = pipe._execution_device

    def images() -> list[Image.Image]:
        release_memory(device)
        return _generate(pipe, MemoryMeter(device), settings, cell.size, settings.steps)

    switcher.set("auto")
    try:
        unplanned = images()
        diff, psnr = image_difference(planned, unplanned)
        cell.plan.update(max_abs_diff_vs_unplanned=diff, psnr_db_vs_unplanned=_json_psnr(psnr))
        for step in cell.plan["levers"]:
            apply_plan(pipe, single_lever(cell.plan["settings"], step["lever"]))
            diff, psnr = image_difference(images(), unplanned)
            step.update(max_abs_diff=diff, psnr_db=_json_psnr(psnr))
            remove_plan(pipe)
    except Exception as err:  # noqa: BLE001 (e.g. a lever alone runs out of memory: the cell stands)
        cell.plan["lever_effects_error"] = first_line(err)
    finally:
        switcher.restore()
        release_memory(device)


def _attempt(cell: Cell, meter: MemoryMeter, fn: Callable[[], Any]) -> bool:
    """Run ``fn``; on an exception record it in ``cell`` with the phase that was running."""
    try:
        fn()
        return True
    except Exception as err:  # noqa: BLE001 (a failing backend is a result; KeyboardInterrupt still stops the run)
        cell.status = "oom" if is_oom(err) else "error"
        cell.failed_phase = meter.current
        cell.message = first_line(err)
        if cell.status == "error":
            logger.warning("%s at %d²: %s: %s", cell.backend, cell.size, type(err).__name__, cell.message)
    # Outside the except block: the traceback (and the tensors its frames hold) is gone.
    if meter.current is not None:
        try:
            meter.stop()  # the failed phase's time and peak up to the failure
        except Exception:  # noqa: BLE001 (a broken CUDA context: the phase keeps no figures)
            meter.current = None
    return False


def largest_fitting(
    fits: Callable[[int], bool],
    *,
    limit: int,
    step: int = SIZE_STEP,
    known: Mapping[int, bool] | None = None,
) -> int | None:
    """The largest multiple of ``step`` in [step, limit] for which ``fits`` is true, by bisection.

    ``fits`` must be monotone (a size fits, so does every smaller one). ``known`` holds results
    already measured at any sizes; they bound the search and are not probed again: a size that
    did not fit bounds it from above (rounded up to a multiple of ``step``), one that fit from
    below (rounded down), counting only fits below the smallest failure. None: ``step`` does
    not fit.
    """
    known = known or {}
    # In units of step: lo fits (0: nothing is known to fit); hi does not, or lies past the limit.
    failed = min((-(-size // step) for size, ok in known.items() if not ok), default=math.inf)
    hi = int(min(failed, limit // step + 1))
    lo = max((min(size // step, hi - 1) for size, ok in known.items() if ok and size // step < failed), default=0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step or None


@dataclass
class MaxSize:
    """The ``max_size`` result of one backend: the largest square size that completed, and the
    probes measured to find it (grid cells count as known results and are not probed again)."""

    backend: str
    limit: int
    size: int | None = None
    probes: list[Cell] = field(default_factory=list)
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "size": self.size,
            "limit": self.limit,
            "done": self.done,
            "probes": [p.to_dict() for p in self.probes],
        }


# -- the run -----------------------------------------------------------------------------------


@dataclass
class CompareReport:
    """Everything a comparison run measured, and where it was written."""

    model: str
    settings: CompareSettings
    sizes: list[int]
    backends: list[str]
    reference: str
    out_dir: Path
    device: str
    device_name: str
    dtype: str
    memory_kind: Literal["cuda", "host"]
    weights: dict[str, int]
    environment: dict[str, Any]
    vram_cap_bytes: int | None = None
    host_scope: str | None = None
    started: str = field(default_factory=lambda: datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    notes: list[str] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    max_sizes: dict[str, MaxSize] = field(default_factory=dict)
    chart: str | None = None
    grid: str | None = None
    complete: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any], out_dir: Path) -> CompareReport:
        """The report :meth:`to_dict` wrote into ``out_dir``."""
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in data["settings"].items() if v is not None}
        report = cls(
            **{k: data[k] for k in ("model", "sizes", "backends", "reference", "device", "device_name", "dtype")},
            settings=CompareSettings(**settings),
            out_dir=out_dir,
            memory_kind=data["memory"]["kind"],
            host_scope=data["memory"]["host_scope"],
            weights=data["weights_by_component"],
            environment=data["environment"],
            vram_cap_bytes=data["vram_cap_bytes"],
            started=data["started"],
            notes=[n for n in data["notes"] if not n.startswith(_CHART_NOTE)],
            cells=[Cell.from_dict(c) for c in data["cells"]],
            complete=data["complete"],
        )
        for backend, m in data["max_size"].items():
            probes = [Cell.from_dict(p) for p in m["probes"]]
            report.max_sizes[backend] = MaxSize(backend, m["limit"], m["size"], probes, m["done"])
        return report

    @property
    def unet_batch(self) -> int:
        """Images per call, times two with classifier-free guidance (diffusers' rule: scale > 1)."""
        return self.settings.batch * (2 if self.settings.guidance_scale > 1 else 1)

    def cell(self, backend: str, size: int) -> Cell | None:
        return next((c for c in self.cells if c.backend == backend and c.size == size), None)

    @property
    def all_cells(self) -> list[Cell]:
        """Grid cells and max-size probes."""
        return self.cells + [p for m in self.max_sizes.values() for p in m.probes]

    def timing_check(self) -> list[dict[str, Any]]:
        """Per size: whether its step times are steady enough to rank the backends, and if not why.

        A size is too noisy when a cell has fewer than two steps to time after its first (``--steps``
        under 3), when a cell's step times spread by more than :data:`RANK_NOISE`, or when the
        reference timed again after the size's other cells differs from its first run by more.
        """
        checks = []
        for size in self.sizes:
            cells = [c for c in self.cells if c.size == size and c.seconds_per_step]
            reasons = []
            few = [c.backend for c in cells if c.step_spread is None]
            if few:
                reasons.append(f"{', '.join(few)}: one timed step (--steps 3 or more times two)")
            wide = [f"{c.backend} ±{50 * c.step_spread:.0f} %" for c in cells if (c.step_spread or 0) > RANK_NOISE]
            if wide:
                reasons.append("step times spread: " + ", ".join(wide))
            ref = self.cell(self.reference, size)
            if ref is not None and ref.seconds_per_step and ref.recheck_seconds_per_step:
                drift = abs(ref.recheck_seconds_per_step - ref.seconds_per_step) / ref.seconds_per_step
                if drift > RANK_NOISE:
                    reasons.append(
                        f"{self.reference} took {ref.seconds_per_step:.3f} s/step first and "
                        f"{ref.recheck_seconds_per_step:.3f} after the other cells"
                    )
            if cells:
                checks.append({"size": size, "rankable": not reasons, "reasons": reasons})
        return checks

    def timing_notes(self) -> list[str]:
        """One line per size whose timings are too noisy to rank."""
        return [
            f"timings at {c['size']}² are too noisy to rank the backends ({'; '.join(c['reasons'])}): "
            "run more --steps, on an idle machine"
            for c in self.timing_check()
            if not c["rankable"]
        ]

    def baseline_check(self) -> dict[str, Any]:
        """Whether every cell started from the same memory in use, within the tolerance."""
        tolerance = BASELINE_TOLERANCE[self.memory_kind]
        values = [c.baseline for c in self.all_cells]
        if not values:
            return {"equal": None, "cells": 0, "tolerance_bytes": tolerance, "message": "no cells measured"}
        low, high = min(values), max(values)
        equal = high - low <= tolerance
        what = "allocated GPU memory" if self.memory_kind == "cuda" else "resident host memory"
        if equal:
            message = (
                f"All {len(values)} cells started from the same {what}: {format_bytes(low)} "
                f"(spread {format_bytes(high - low)}, tolerance {format_bytes(tolerance)}), so memory was "
                "released between cells."
            )
        else:
            worst = max(self.all_cells, key=lambda c: c.baseline)
            message = (
                f"Baselines differ: {what} at the start of a cell ranged from {format_bytes(low)} to "
                f"{format_bytes(high)} (tolerance {format_bytes(tolerance)}; highest before {worst.backend} at "
                f"{worst.size}²), so some cells' peaks include memory left by earlier cells."
            )
        return {
            "equal": equal,
            "cells": len(values),
            "min_bytes": low,
            "max_bytes": high,
            "tolerance_bytes": tolerance,
            "message": message,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "sdpatch_compare": 1,
            "complete": self.complete,
            "started": self.started,
            "model": self.model,
            "settings": self.settings.to_dict(),
            "sizes": self.sizes,
            "backends": self.backends,
            "backend_descriptions": {b: BACKEND_DESCRIPTIONS[b] for b in self.backends},
            "reference": self.reference,
            "device": self.device,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "unet_batch": self.unet_batch,
            "memory": {"kind": self.memory_kind, "host_scope": self.host_scope},
            "vram_cap_bytes": self.vram_cap_bytes,
            "weights_bytes": sum(self.weights.values()),
            "weights_by_component": self.weights,
            "environment": self.environment,
            "baseline_check": self.baseline_check(),
            "timing_check": self.timing_check(),
            "cells": [c.to_dict() for c in self.cells],
            "max_size": {b: m.to_dict() for b, m in self.max_sizes.items()},
            "files": {"markdown": "report.md", "chart": self.chart, "grid": self.grid},
            "notes": self.notes,
        }

    def main_table(self) -> str:
        """Rows backends, columns sizes: peak, s/step and PSNR against the reference, or the failure."""
        return _table(self.backends, self.sizes, self.cell, self._main_cell)

    def to_markdown(self) -> str:
        """The report a person reads: tables, the baseline check, the chart and grid, notes."""
        s = self.settings
        env = self.environment
        cuda = self.memory_kind == "cuda"
        unet_batch = self.unet_batch
        images = f"{plural(s.batch, 'image')} per call (UNet batch {unet_batch})"
        lines = [
            f"# sdpatch compare: {self.model} on {self.device_name}",
            "",
            f"{self.started[:10]} · {self.dtype} · {plural(s.steps, 'step')} · seed {s.seed} · "
            f"guidance {s.guidance_scale} · {images} · prompt “{s.prompt}”",
            "",
            _environment_line(env, self.device_name),
            "",
            f"Weights: {format_bytes(sum(self.weights.values()))}. Memory cap: "
            + (f"{format_bytes(self.vram_cap_bytes)} (--vram-cap)." if self.vram_cap_bytes else "none.")
            + ("" if self.complete else " **This run did not finish: the tables hold the cells it measured.**"),
            "",
            "## Peak memory, time per step, image difference",
            "",
            (
                "Peak allocated GPU memory of the whole generation (text encoding, denoising, VAE decode); "
                if cuda
                else "Peak resident host memory of the whole process (a CPU run: not GPU memory); "
            )
            + "mean seconds per denoising step, leaving out the first, ± half the range of those steps "
            "relative to their mean; PSNR of the image against "
            f"{self.reference} at the same size (same prompt, seed and initial latents).",
            "",
            self.main_table(),
            "",
            "## Peak over the weights: denoising (UNet) / VAE decode",
            "",
            "Each phase's peak minus the memory in use when the cell started (the weights). The denoising "
            f"figure is the UNet at batch {unet_batch}, comparable with a single UNet call's peak over the weights.",
            "",
            _table(self.backends, self.sizes, self.cell, _phases_cell),
        ]
        if self.model == "sd15":
            ref = "; ".join(
                f"{name} " + " / ".join(f"{v} at {k}²" for k, v in by_size.items())
                for name, by_size in SD15_REFERENCE.items()
            )
            lines += ["", f"Issue 5's reference (one SD 1.5 UNet call, batch 2, fp16, H200): {ref}."]
        if cuda:
            lines += [
                "",
                "## Peak reserved",
                "",
                "What PyTorch's caching allocator held from the GPU at the peak (allocated plus cached blocks).",
                "",
                _table(self.backends, self.sizes, self.cell, _reserved_cell),
            ]
        if self.max_sizes:
            cap = f"under the {format_bytes(self.vram_cap_bytes)} cap" if self.vram_cap_bytes else "on this device"
            lines += [
                "",
                "## Largest square size (--max-size)",
                "",
                f"Bisection in steps of {SIZE_STEP} px up to {s.max_size_limit} px for the largest size that "
                f"completes {cap}, assuming every smaller size does too; the grid's cells count as known results.",
                "",
                "| backend | largest size | probes |",
                "|---|---|---|",
            ]
            for backend, m in self.max_sizes.items():
                found = f"{m.size}²" if m.size else ("none" if m.done else "not finished")
                probes = ", ".join(f"{p.size} {'ok' if p.status == 'ok' else p.failure}" for p in m.probes) or "–"
                lines.append(f"| {backend} | {found} | {probes} |")
        lines += self._plans_section()
        check = self.baseline_check()
        lines += ["", "## Baseline check", "", check["message"]]
        timing = self.timing_notes()
        lines += ["", "## Timing check", ""] + (
            [f"- {n}" for n in timing]
            or [
                f"Every size's step times spread by {100 * RANK_NOISE:.0f} % or less, and each reference ran "
                "again after its size's other cells within that: the backends can be ranked by s/step."
            ]
        )
        failures = [c for c in self.all_cells if c.status == "error"]
        if failures:
            lines += ["", "## Errors", ""]
            lines += [f"- {c.backend} at {c.size}²: {c.failure}: {c.message}" for c in failures]
        lines += ["", "## Backends", ""]
        lines += [f"- **{b}**: {BACKEND_DESCRIPTIONS[b]}" for b in self.backends]
        if self.chart:
            lines += ["", f"![Peak memory against image size, one line per backend]({self.chart})"]
        if self.grid:
            lines += ["", f"![Images: backends × sizes]({self.grid})"]
        notes = list(self.notes)
        if not cuda:
            scope = "each phase's own peak" if self.host_scope != "process" else "the process's peak since it started"
            notes.append(f"host memory: resident memory of the whole process, {scope}")
        if s.warmup:
            notes.append(
                f"one untimed step of {self.reference} ran before the first cell, and each cell ran once with one "
                "step before it was measured (warm-up), unmeasured"
            )
        if notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
        return "\n".join(lines) + "\n"

    def _plans_section(self) -> list[str]:
        """The planned column's plans: budget, estimated and measured peak, the levers and why, and
        each lever's PSNR on its own against sdpatch auto without a plan (same seed)."""
        planned = [c for c in self.cells if c.plan is not None]
        if not planned:
            return []
        lines = [
            "",
            f"## --vram-budget plans ({self.settings.vram_budget})",
            "",
            "Per size: the plan for the `planned` column, its estimate against the measured peak, and the "
            "PSNR of each lever alone against sdpatch auto without a plan at the same seed (exact levers "
            "should stay at 40 dB or more; tiled decode is approximate).",
        ]
        for cell in planned:
            measured = cell.peak_reserved if self.memory_kind == "cuda" else cell.peak
            lines += ["", f"**{cell.size}²** ({cell.failure or 'completed'})", ""]
            lines += [f"- {line}" for line in plan_lines(cell.plan, measured if cell.status == "ok" else None)]
            if "psnr_db_vs_unplanned" in cell.plan:
                psnr = _format_psnr(
                    _psnr_value(cell.plan["psnr_db_vs_unplanned"], cell.plan.get("max_abs_diff_vs_unplanned"))
                )
                lines.append(f"- the whole plan: PSNR {psnr} against unplanned auto")
            for step in cell.plan["levers"]:
                if "psnr_db" in step:
                    kind = "exact" if step["exact"] else "approximate"
                    psnr = _format_psnr(_psnr_value(step["psnr_db"], step.get("max_abs_diff")))
                    lines.append(f"- {step['setting']} alone ({kind}): PSNR {psnr}")
            if "lever_effects_error" in cell.plan:
                lines.append(f"- lever effects not measured: {cell.plan['lever_effects_error']}")
        return lines

    def _main_cell(self, cell: Cell) -> str:
        if cell.status != "ok":
            return f"**{cell.failure}**"
        if cell.backend == self.reference:
            diff = "reference"
        elif cell.reference is None:
            diff = "no reference"
        else:
            diff = f"PSNR {_format_psnr(cell.psnr_db)}"
        approximate = [_APPROXIMATE[s["lever"]] for s in (cell.plan or {}).get("levers", []) if not s["exact"]]
        if approximate:
            diff += f" ({', '.join(approximate)})"
        return f"{_gib(cell.peak)} · {_per_step(cell.seconds_per_step, cell.step_spread)} · {diff}"


def compare(
    pipe: Any,
    settings: CompareSettings,
    out_dir: Path,
    *,
    model: str,
    notes: Sequence[str] = (),
    on_cell: Callable[[Cell], None] | None = None,
    progress: Progress | bool = True,
) -> CompareReport:
    """Run the comparison on a loaded pipeline and write the output folder.

    Args:
        pipe: a StableDiffusionPipeline or StableDiffusionXLPipeline, unpatched.
        settings: what to compare; its backends must be able to run on the pipeline's device
            (see :func:`resolve_backends`).
        out_dir: an existing or new folder (its parent exists); see :func:`plan_out_dir`.
        model: the model's name, for the report.
        notes: lines to carry in the report.
        on_cell: called with each cell (and max-size probe) once it is recorded.
        progress: the progress line to show the cells on (True: a new one, drawn on a terminal).

    Timings: with ``warmup``, one untimed step of the reference at the smallest size comes first,
    so that no cell pays the process's one-time costs; each size's reference is timed again after
    the size's other cells, and :meth:`CompareReport.timing_check` says where the step times
    spread too much to rank the backends.

    The pipeline is left with its stock processors. With ``vram_cap_gib`` on CUDA the process's
    memory fraction is set for the run and put back to 1 afterwards.
    """
    settings.validate()
    timesteps = pipe.scheduler.config.num_train_timesteps
    if settings.steps > timesteps:  # past it, diffusers' schedulers fail mid-run, in every cell
        raise InputError(f"--steps must be at most {timesteps} for {model}, got {settings.steps}")
    device = pipe._execution_device
    backends, left_out = resolve_backends(settings.backends, device)
    sizes = list(settings.sizes or [default_size(pipe) * k for k in (1, 2, 4)])
    reference = "stock" if "stock" in backends else backends[0]
    order = [reference, *(b for b in backends if b != reference), *([PLANNED] if settings.vram_budget else [])]
    cap = vram_cap_bytes(settings.vram_cap_gib, device)
    meter = MemoryMeter(device)
    with meter.phase("probe"):  # an empty phase tells whether host peaks can be reset per phase
        pass
    report = CompareReport(
        model=model,
        settings=settings,
        sizes=sizes,
        backends=order,
        reference=reference,
        out_dir=out_dir,
        device=str(device),
        device_name=device_name(device),
        dtype=str(pipe.unet.dtype).removeprefix("torch."),
        memory_kind=meter.kind,
        host_scope=meter.host_scope,
        weights=weights_bytes(pipe.components),
        environment=_environment(device),
        vram_cap_bytes=cap,
        notes=[*notes, *left_out],
    )
    _prepare_out_dir(out_dir)
    pipe.set_progress_bar_config(disable=True)
    switcher = BackendSwitcher(pipe)
    if device.type == "cuda":
        # cuBLAS takes its workspace (tens of MiB, kept for the process) from PyTorch's allocator
        # on the first matmul: take it now, so that it is in every cell's baseline, like the weights.
        ones = torch.ones(8, 8, device=device, dtype=pipe.unet.dtype)
        torch.matmul(ones, ones)
        del ones
    if cap is not None:
        total_memory = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total_memory, device)

    def record(cell: Cell) -> None:
        _write_reports(report)
        logger.info("%s", cell.summary())
        if on_cell is not None:
            on_cell(cell)

    progress = Progress.of(progress)
    try:
        if settings.warmup:
            progress.phase(f"warm-up: {reference} at {min(sizes)}²")
            warm_up(pipe, switcher, settings, reference, min(sizes))
        progress.phase("cells", total=len(sizes) * len(order))
        for size in sizes:
            ref_images: list[Image.Image] | None = None
            for backend in order:
                progress.describe(f"{size}² {backend}")
                cell, images = run_cell(pipe, switcher, settings, backend, size)
                if backend == reference and cell.status == "ok":
                    ref_images = images
                if ref_images is not None and cell.status == "ok":
                    cell.reference = reference
                    cell.max_abs_diff, cell.psnr_db = image_difference(images, ref_images)
                if backend == PLANNED and cell.status == "ok":
                    _lever_effects(pipe, switcher, settings, cell, images)
                _save_images(report, cell, images)
                del images
                report.cells.append(cell)
                record(cell)
                progress.advance()
            ref = report.cell(reference, size)
            if ref is not None and ref.status == "ok" and len(order) > 1:
                progress.describe(f"{size}² {reference} again")
                again, _ = run_cell(pipe, switcher, replace(settings, warmup=False), reference, size)
                ref.recheck_seconds_per_step = again.seconds_per_step
                _write_reports(report)
        if settings.max_size:
            for backend in order:
                progress.describe(f"largest size: {backend}")
                _max_size(report, pipe, switcher, settings, backend, record)
        report.complete = True
    finally:
        switcher.restore()
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return _finish(report, out_dir)


def run(
    settings: CompareSettings,
    *,
    model: str = "tiny",
    device: str = "auto",
    dtype: str = "auto",
    out: Path = Path("sdpatch-compare"),
    overwrite: bool = False,
    allow_pickle: bool = False,
    on_cell: Callable[[Cell], None] | None = None,
    progress: Progress | bool = True,
) -> CompareReport:
    """What ``sdpatch compare`` does: check every input, load the pipeline once, compare.

    Every input is checked before anything is loaded or written (InputError). ``--vram-cap``
    needs a CUDA device: on the CPU or MPS there is no allocator to cap, so it is refused.
    """
    settings.validate()
    torch_device = resolve_device(device)
    torch_dtype, dtype_note = resolve_dtype(dtype, torch_device)
    resolve_backends(settings.backends, torch_device)
    vram_cap_bytes(settings.vram_cap_gib, torch_device)
    source = resolve_model(model, allow_pickle=allow_pickle)
    out_dir, out_note = plan_out_dir(out, overwrite=overwrite)
    if out_note:
        logger.warning("%s", out_note)
    progress = Progress.of(progress)
    progress.phase(f"{'building' if source.kind == 'preset' else 'loading'} {model} on {torch_device}")
    pipe = load_pipeline(source, device=torch_device, dtype=torch_dtype)
    notes = [n for n in (dtype_note, out_note, tokenizer_note(model)) if n]
    return compare(pipe, settings, out_dir, model=model, notes=notes, on_cell=on_cell, progress=progress)


def _finish(report: CompareReport, out_dir: Path) -> CompareReport:
    """Draw the chart and the grid, then write report.json and report.md with their paths."""
    report.chart = write_chart(report, out_dir / "memory.png")
    report.grid = write_grid(report, out_dir / "grid.png")
    _write_reports(report)
    return report


def redraw(out_dir: Path) -> CompareReport:
    """Write report.md, the chart and the grid again from ``out_dir``'s report.json and images,
    e.g. where the run had no matplotlib: ``python -m sdpatch.compare DIR``."""
    path = out_dir / "report.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {path}: {first_line(err)}") from None
    if data.get("sdpatch_compare") != 1:
        raise InputError(f"{path} is not a report of sdpatch compare")
    report = CompareReport.from_dict(data, out_dir)
    return _finish(report, out_dir)


def warm_up(pipe: Any, switcher: BackendSwitcher, settings: CompareSettings, backend: str, size: int) -> None:
    """One untimed step of ``backend`` at ``size``, before any cell: what runs first in a process
    pays one-time costs (thread pools, kernel selection, the allocator's first growth) that would
    otherwise land in the first cell's time and memory. A failure is left for that cell to record."""
    try:
        switcher.set(backend)
        _generate(pipe, MemoryMeter(pipe._execution_device), settings, size, 1)
    except Exception as err:  # noqa: BLE001 (the cells record what fails, with its phase)
        logger.info("warm-up of %s at %d² failed: %s", backend, size, first_line(err))
    finally:
        switcher.restore()
        release_memory(pipe._execution_device)


def _max_size(
    report: CompareReport,
    pipe: Any,
    switcher: BackendSwitcher,
    settings: CompareSettings,
    backend: str,
    record: Callable[[Cell], None],
) -> None:
    """Bisect ``backend``'s largest size into ``report.max_sizes``; each probe is a recorded cell."""
    result = MaxSize(backend, settings.max_size_limit)
    report.max_sizes[backend] = result
    known = {c.size: c.status == "ok" for c in report.cells if c.backend == backend}

    def fits(size: int) -> bool:
        cell, _ = run_cell(pipe, switcher, settings, backend, size, kind="probe")
        result.probes.append(cell)
        record(cell)
        return cell.status == "ok"

    result.size = largest_fitting(fits, limit=settings.max_size_limit, known=known)
    result.done = True
    _write_reports(report)


# -- output files ------------------------------------------------------------------------------


def write_chart(report: CompareReport, path: Path) -> str | None:
    """Peak memory against size, one line per backend, log scales: the whole generation, and
    the denoising phase over the weights. A failed cell is a cross at the top of its column.
    Returns the file's name, or None (with a note in the report) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator
    except ImportError:
        note = f"{_CHART_NOTE} it needs matplotlib (pip install 'sdpatch[report]'; then python -m sdpatch.compare DIR)"
        logger.warning("%s", note)
        report.notes.append(note)
        return None
    cells = report.all_cells
    whole_label = "peak allocated" if report.memory_kind == "cuda" else "peak host memory"
    panels: list[tuple[str, str, Callable[[Cell], int | None]]] = [
        ("Whole generation", whole_label, lambda c: c.peak),
        ("Denoising (UNet)", "peak over the weights", lambda c: c.over_baseline("denoising")),
    ]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: no display needed, pyplot's global state untouched
    axes = fig.subplots(1, 2)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, (title, ylabel, value) in zip(axes, panels):
        values = [v for c in cells if c.status == "ok" and (v := value(c))]
        unit, scale = ("GiB", GIB) if max(values, default=0) >= GIB else ("MiB", 1024**2)
        for i, backend in enumerate(report.backends):
            mine = sorted((c for c in cells if c.backend == backend), key=lambda c: c.size)
            points = [(c.size, v / scale) for c in mine if c.status == "ok" and (v := value(c)) and v > 0]
            failed = [c.size for c in mine if c.status != "ok"]
            if points:
                ax.plot(*zip(*points), marker="o", color=f"C{i % 10}", label=backend)
            if failed:
                # x in data, y in axes coordinates: along the top edge whatever the scale, one row
                # per backend so that crosses at the same size do not hide each other.
                top, y = ax.get_xaxis_transform(), 0.97 - 0.03 * i
                label = None if points else backend
                ax.plot(failed, [y] * len(failed), "x", ms=8, mew=2, color=f"C{i % 10}", transform=top, label=label)
        if report.vram_cap_bytes and ax is axes[0]:
            ax.axhline(report.vram_cap_bytes / scale, color="k", ls="--", lw=1, label="--vram-cap")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # Ticks at the grid's sizes (max-size probes are plotted between them, unlabelled).
        ax.set_xticks(report.sizes, [str(s) for s in report.sizes], rotation=45 if len(report.sizes) > 6 else 0)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        low, high = ax.get_ylim()
        labelled = [t for t in ax.yaxis.get_majorticklocs() if low <= t <= high]
        # A narrow range has too few 1-2-5 ticks to read: label the minor ticks too.
        ax.yaxis.set_minor_formatter(plain if len(labelled) < 3 else NullFormatter())
        ax.set_xlabel("image size (px, square)")
        ax.set_ylabel(f"{ylabel} ({unit})")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.25)
    axes[0].legend(fontsize="small")
    failed_any = any(c.status != "ok" for c in cells)
    fig.suptitle(
        f"sdpatch compare: {report.model}, {report.dtype}, {report.device_name}"
        + ("   (× at the top: out of memory or error)" if failed_any else "")
    )
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return path.name


def write_grid(report: CompareReport, path: Path) -> str | None:
    """The images side by side: one row per backend, one column per size, each captioned with
    its peak and PSNR, a grey tile where the cell failed. Returns the file's name (None when no
    cell was measured)."""
    if not report.cells:
        return None
    tile = min(256, max(report.sizes))
    font = _font(12)
    label_w, head_h, caption_h, pad = 90, 22, 18, 6
    width = label_w + len(report.sizes) * (tile + pad)
    height = head_h + len(report.backends) * (tile + caption_h + pad)
    grid = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(grid)
    for j, size in enumerate(report.sizes):
        draw.text((label_w + j * (tile + pad) + 4, 4), f"{size} px", fill="black", font=font)
    for i, backend in enumerate(report.backends):
        y = head_h + i * (tile + caption_h + pad)
        draw.text((4, y + tile // 2 - 6), backend, fill="black", font=font)
        for j, size in enumerate(report.sizes):
            x = label_w + j * (tile + pad)
            cell = report.cell(backend, size)
            if cell is None:
                continue
            if cell.status == "ok" and cell.images:
                with Image.open(report.out_dir / cell.images[0]) as img:
                    resample = Image.Resampling.NEAREST if size < tile else Image.Resampling.LANCZOS
                    grid.paste(img.convert("RGB").resize((tile, tile), resample), (x, y))
                psnr = "reference" if backend == report.reference else _format_psnr(cell.psnr_db)
                caption = f"{_gib(cell.peak)}, {psnr}"
            else:
                draw.rectangle((x, y, x + tile - 1, y + tile - 1), fill=(200, 200, 200))
                draw.text((x + 4, y + tile // 2 - 6), cell.failure or "", fill=(160, 0, 0), font=font)
                caption = ""
            draw.text((x + 2, y + tile + 2), caption, fill="black", font=font)
    write_png(grid, path, {"sdpatch": f"compare grid: {report.model}, rows {report.backends}, sizes {report.sizes}"})
    return path.name


def _write_reports(report: CompareReport) -> None:
    write_json(report.out_dir / "report.json", report.to_dict())
    atomic_write(report.out_dir / "report.md", lambda f: f.write(report.to_markdown().encode()))


def _save_images(report: CompareReport, cell: Cell, images: list[Image.Image]) -> None:
    """Write a grid cell's images (with the cell's record in their metadata)."""
    s = report.settings
    for k, image in enumerate(images):
        name = f"images/{cell.backend}-{cell.size}" + (f"-{k}" if len(images) > 1 else "") + ".png"
        cell.images.append(name)
    text = {
        "prompt": s.prompt,
        "seed": str(s.seed),
        "steps": str(s.steps),
        "model": report.model,
        "backend": cell.backend,
        "size": f"{cell.size}x{cell.size}",
        "sdpatch": json.dumps(cell.to_dict()),
    }
    for name, image in zip(cell.images, images):
        write_png(image, report.out_dir / name, text)


def _prepare_out_dir(out_dir: Path) -> None:
    """Create the folder, and remove what an earlier run wrote there (only sdpatch's own files)."""
    out_dir.mkdir(exist_ok=True)
    images = out_dir / "images"
    images.mkdir(exist_ok=True)
    ours = [out_dir / name for name in ("report.json", "report.md", "memory.png", "grid.png")]
    for stale in [*images.glob("*.png"), *ours]:
        stale.unlink(missing_ok=True)


def vram_cap_bytes(cap_gib: float | None, device: torch.device) -> int | None:
    """``--vram-cap`` in bytes (None: no cap), checked against ``device``.

    The cap is applied with ``torch.cuda.set_per_process_memory_fraction``, which limits what
    PyTorch's caching allocator may reserve. The CPU and MPS have no such allocator, so a cap
    there is refused (InputError) rather than silently ignored.
    """
    if cap_gib is None:
        return None
    if device.type != "cuda":
        raise InputError(f"--vram-cap emulates a smaller GPU and needs a CUDA device; this run is on {device}")
    memory = torch.cuda.get_device_properties(device).total_memory
    if cap_gib * GIB > memory:
        raise InputError(f"--vram-cap {cap_gib} GiB is more than this GPU's {format_bytes(memory)}")
    return int(cap_gib * GIB)


def _environment(device: torch.device) -> dict[str, Any]:
    """Versions, and the GPU with its driver when the run is on CUDA."""
    env: dict[str, Any] = {**versions(), "gpu": None, "gpu_memory_bytes": None, "driver": None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            compute_capability=f"{props.major}.{props.minor}",
            driver=_driver_version(device),
        )
    return env


def _driver_version(device: torch.device) -> str | None:
    """The NVIDIA driver's version, from NVML or nvidia-smi (torch does not expose it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 (no NVML: try nvidia-smi)
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index or 0}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _environment_line(env: dict[str, Any], name: str) -> str:
    parts = []
    if env.get("gpu"):
        parts.append(f"{env['gpu']} ({format_bytes(env['gpu_memory_bytes'])})")
        if env.get("driver"):
            parts.append(f"driver {env['driver']}")
    else:
        parts.append(name)
    for key in ("torch", "cuda", "triton", "diffusers", "transformers"):
        parts.append(f"{key} {env.get(key) or 'n/a'}")
    return ", ".join(parts) + "."


def _table(
    backends: Sequence[str], sizes: Sequence[int], lookup: Callable[[str, int], Cell | None], fmt: Callable[[Cell], str]
) -> str:
    rows = ["| backend | " + " | ".join(f"{s}²" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for backend in backends:
        cells = [lookup(backend, s) for s in sizes]
        rows.append(f"| {backend} | " + " | ".join("" if c is None else fmt(c) for c in cells) + " |")
    return "\n".join(rows)


def _phases_cell(cell: Cell) -> str:
    if cell.status != "ok":
        return f"**{cell.failure}**"
    return f"{format_bytes(cell.over_baseline('denoising'))} / {format_bytes(cell.over_baseline('vae_decode'))}"


def _reserved_cell(cell: Cell) -> str:
    return f"**{cell.failure}**" if cell.status != "ok" else _gib(cell.peak_reserved)


def _per_step(seconds: float | None, spread: float | None = None) -> str:
    if seconds is None:
        return "— s/step"
    return f"{seconds:.3f} s/step" + ("" if spread is None else f" ±{50 * spread:.0f} %")


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f} GiB"


def _format_psnr(psnr: float | None) -> str:
    # "inf", not ∞: Pillow's built-in font, which the grid's captions use, has no ∞.
    if psnr is None:
        return "—"
    return "inf dB" if math.isinf(psnr) else f"{psnr:.1f} dB"


def _json_psnr(psnr: float | None) -> float | None:
    """A PSNR for JSON, which has no infinity: an identical image's is null, beside its
    ``max_abs_diff`` of 0."""
    return None if psnr is None or math.isinf(psnr) else psnr


def _psnr_value(psnr: float | str | None, max_abs_diff: int | None) -> float | None:
    """The PSNR :func:`_json_psnr` wrote; ``"inf"``, in the reports under docs/compare/, reads as infinity too."""
    if psnr == "inf" or (psnr is None and max_abs_diff == 0):
        return math.inf
    return psnr


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def _malloc_trim() -> None:
    # glibc keeps freed heap pages mapped; returning them makes resident memory a fair baseline.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _redraw_main(argv: list[str]) -> int:
    """``python -m sdpatch.compare DIR``, with the exit codes of the ``sdpatch`` command."""
    if len(argv) != 1:
        print("usage: python -m sdpatch.compare DIR   (redraw DIR's report.md and figures)", file=sys.stderr)
        return 2
    try:
        done = redraw(Path(argv[0]))
    except InputError as err:
        print(f"sdpatch: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {done.out_dir}: report.json, report.md, " + ", ".join(f for f in (done.chart, done.grid) if f))
    return 0


if __name__ == "__main__":
    sys.exit(_redraw_main(sys.argv[1:]))
