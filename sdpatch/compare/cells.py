"""Running the cells of ``sdpatch compare``: switching a loaded pipeline between backends,
measuring one backend at one size, the largest size that fits, and the driver (:func:`compare`,
:func:`run`) that goes over sizes and backends and writes the report as it goes."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from sdpatch import graphs
from sdpatch import undo as changes
from sdpatch.attention import backend_status
from sdpatch.compare.figures import finish
from sdpatch.compare.report import GIB, PLANNED, Cell, CompareReport, MaxSize, json_psnr, write_reports
from sdpatch.environment import device_environment, device_name
from sdpatch.errors import InputError, first_line
from sdpatch.generate import apply_backend, check_folder, measured_call, write_png
from sdpatch.memory import MemoryMeter, format_bytes, is_oom, weights_bytes
from sdpatch.models import default_size, load_pipeline, resolve_device, resolve_dtype, resolve_model, tokenizer_note
from sdpatch.planner import apply_plan, fit, remove_plan, single_lever
from sdpatch.progress import Progress
from sdpatch.settings import ATTENTION_BACKENDS, COMPARE_PEERS, SIZE_STEP, CompareSettings, RunOptions

logger = logging.getLogger(__name__)

# What a run compares when no backends are named: each one that can run here. ``auto`` is left
# out: it is triton or chunked, layer by layer.
DEFAULT_BACKENDS = (*COMPARE_PEERS, *ATTENTION_BACKENDS)


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


class BackendSwitcher:
    """Switches a loaded pipeline between compare backends, always from its own stock processors.

    Each switch is recorded on the pipeline through sdpatch's one undo mechanism
    (:mod:`sdpatch.undo`, as :data:`SWITCH`) and taken back before the next and by :meth:`restore`,
    which also puts back, by identity, the processor objects the pipeline had when the switcher
    was made.
    """

    SWITCH = "compare_backend"

    def __init__(self, pipe: Any) -> None:
        from diffusers.models.attention_processor import Attention

        self.pipe = pipe
        self.current = "stock"
        modules = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
        self.stock = {m: m.processor for c in modules for m in c.modules() if isinstance(m, Attention)}

    def set(self, backend: str) -> None:
        """Put ``backend`` in place (see :data:`BACKEND_DESCRIPTIONS`)."""
        from sdpatch.patch import unpatch_unet

        self.restore()
        pipe = self.pipe
        if backend == "naive":
            from diffusers.models.attention_processor import AttnProcessor

            pipe.unet.set_attn_processor(AttnProcessor())
        elif backend == "sliced":
            self._slice()
            changes.record(pipe, self.SWITCH, pipe.disable_attention_slicing)
        elif backend == "xformers":
            pipe.enable_xformers_memory_efficient_attention()
            changes.record(pipe, self.SWITCH, pipe.disable_xformers_memory_efficient_attention)
        elif backend != "stock":
            apply_backend(pipe, "auto" if backend == PLANNED else backend)
            changes.record(pipe, self.SWITCH, lambda: unpatch_unet(pipe))
        self.current = backend

    def restore(self) -> None:
        """Take the last switch (and any plan) back, then put the stock processors back (the very
        objects the pipeline had)."""
        remove_plan(self.pipe)
        changes.undo(self.pipe, self.SWITCH)
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
        graphs.wait_for_kernels()  # the warm-up's new layouts compiled in the background, SDPA standing in
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
        cell.plan.update(max_abs_diff_vs_unplanned=diff, psnr_db_vs_unplanned=json_psnr(psnr))
        for step in cell.plan["levers"]:
            apply_plan(pipe, single_lever(cell.plan["settings"], step["lever"]))
            diff, psnr = image_difference(images(), unplanned)
            step.update(max_abs_diff=diff, psnr_db=json_psnr(psnr))
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
    write_reports(report)


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
        environment=device_environment(device),
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
        write_reports(report)
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
                write_reports(report)
        if settings.max_size:
            for backend in order:
                progress.describe(f"largest size: {backend}")
                _max_size(report, pipe, switcher, settings, backend, record)
        report.complete = True
    finally:
        switcher.restore()
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return finish(report, out_dir)


def run(
    settings: CompareSettings,
    options: RunOptions = RunOptions(),
    *,
    out: Path = Path("sdpatch-compare"),
    on_cell: Callable[[Cell], None] | None = None,
    progress: Progress | bool = True,
) -> CompareReport:
    """What ``sdpatch compare`` does: check every input, load the pipeline once, compare.

    ``options`` as for ``sdpatch generate`` (its model, device, dtype, ``allow_pickle`` and
    ``overwrite``; the backends are the settings'). Every input is checked before anything is
    loaded or written (InputError). ``--vram-cap`` needs a CUDA device: on the CPU or MPS there is
    no allocator to cap, so it is refused.
    """
    model, device, dtype, allow_pickle, overwrite = (
        options.model, options.device, options.dtype, options.allow_pickle, options.overwrite)
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


def _malloc_trim() -> None:
    # glibc keeps freed heap pages mapped; returning them makes resident memory a fair baseline.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
