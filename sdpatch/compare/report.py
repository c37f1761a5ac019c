"""The report model of ``sdpatch compare``: its cells, the report with its JSON and markdown
renderings, reading a report back from its folder, and the baseline and timing checks."""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sdpatch.errors import InputError, first_line
from sdpatch.generate import atomic_write, write_json
from sdpatch.memory import PHASE_LABELS, PhaseStats, format_bytes, plural, total
from sdpatch.planner import plan_lines
from sdpatch.settings import SIZE_STEP, CompareSettings

GIB = 1024**3

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

CHART_NOTE = "chart not drawn:"
PLANNED = "planned"  # the --vram-budget column
_APPROXIMATE = {"vae_tiling": "tiled decode", "fp8_storage": "fp8 weights"}  # the planner's inexact levers

# Issue 5's reference: one SD 1.5 UNet call, batch 2, fp16, H200; peak over the weights.
SD15_REFERENCE = {
    "naive": {1024: "16.2 GiB", 2048: "OOM at 139 GiB"},
    "sliced": {1024: "4.2 GiB", 2048: "65.0 GiB"},
    "SDPA (stock, sdpa)": {1024: "0.5 GiB", 2048: "2.0 GiB"},
}

PHASE_FIELDS = ("name", "seconds", "peak_allocated", "peak_reserved", "peak_host", "step_seconds")


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
            parts.append(f"PSNR {format_psnr(self.psnr_db)} vs {self.reference}, max diff {self.max_abs_diff}")
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
            "psnr_db": json_psnr(self.psnr_db),
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
            psnr_db=psnr_value(data["psnr_db"], data["max_abs_diff"]),
            plan=data.get("plan"),
            recheck_seconds_per_step=data.get("recheck_seconds_per_step"),
        )


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
            notes=[n for n in data["notes"] if not n.startswith(CHART_NOTE)],
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
                psnr = format_psnr(
                    psnr_value(cell.plan["psnr_db_vs_unplanned"], cell.plan.get("max_abs_diff_vs_unplanned"))
                )
                lines.append(f"- the whole plan: PSNR {psnr} against unplanned auto")
            for step in cell.plan["levers"]:
                if "psnr_db" in step:
                    kind = "exact" if step["exact"] else "approximate"
                    psnr = format_psnr(psnr_value(step["psnr_db"], step.get("max_abs_diff")))
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
            diff = f"PSNR {format_psnr(cell.psnr_db)}"
        approximate = [_APPROXIMATE[s["lever"]] for s in (cell.plan or {}).get("levers", []) if not s["exact"]]
        if approximate:
            diff += f" ({', '.join(approximate)})"
        return f"{format_gib(cell.peak)} · {_per_step(cell.seconds_per_step, cell.step_spread)} · {diff}"


def write_reports(report: CompareReport) -> None:
    write_json(report.out_dir / "report.json", report.to_dict())
    atomic_write(report.out_dir / "report.md", lambda f: f.write(report.to_markdown().encode()))


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
    return f"**{cell.failure}**" if cell.status != "ok" else format_gib(cell.peak_reserved)


def _per_step(seconds: float | None, spread: float | None = None) -> str:
    if seconds is None:
        return "— s/step"
    return f"{seconds:.3f} s/step" + ("" if spread is None else f" ±{50 * spread:.0f} %")


def format_gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f} GiB"


def format_psnr(psnr: float | None) -> str:
    # "inf", not ∞: Pillow's built-in font, which the grid's captions use, has no ∞.
    if psnr is None:
        return "—"
    return "inf dB" if math.isinf(psnr) else f"{psnr:.1f} dB"


def json_psnr(psnr: float | None) -> float | None:
    """A PSNR for JSON, which has no infinity: an identical image's is null, beside its
    ``max_abs_diff`` of 0."""
    return None if psnr is None or math.isinf(psnr) else psnr


def psnr_value(psnr: float | str | None, max_abs_diff: int | None) -> float | None:
    """The PSNR :func:`json_psnr` wrote; ``"inf"``, in the reports under docs/compare/, reads as infinity too."""
    if psnr == "inf" or (psnr is None and max_abs_diff == 0):
        return math.inf
    return psnr


def read_report(out_dir: Path) -> CompareReport:
    """The report that ``out_dir``'s report.json holds (InputError when it holds none)."""
    path = out_dir / "report.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {path}: {first_line(err)}") from None
    if data.get("sdpatch_compare") != 1:
        raise InputError(f"{path} is not a report of sdpatch compare")
    return CompareReport.from_dict(data, out_dir)
