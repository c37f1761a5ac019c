"""The figures of a ``sdpatch compare`` report: the memory chart (matplotlib, optional) and the
image grid (PIL), drawn from a report; and drawing them again from a report's folder."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from sdpatch.compare.report import (
    CHART_NOTE,
    GIB,
    Cell,
    CompareReport,
    format_gib,
    format_psnr,
    read_report,
    write_reports,
)
from sdpatch.generate import atomic_write, write_png

logger = logging.getLogger(__name__)


def write_chart(report: CompareReport, path: Path) -> str | None:
    """Peak memory against size, one line per backend, log scales: the whole generation, and
    the denoising phase over the weights. A failed cell is a cross at the top of its column.
    Returns the file's name, or None (with a note in the report) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator
    except ImportError:
        note = f"{CHART_NOTE} it needs matplotlib (pip install 'sdpatch[report]'; then python -m sdpatch.compare DIR)"
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
                psnr = "reference" if backend == report.reference else format_psnr(cell.psnr_db)
                caption = f"{format_gib(cell.peak)}, {psnr}"
            else:
                draw.rectangle((x, y, x + tile - 1, y + tile - 1), fill=(200, 200, 200))
                draw.text((x + 4, y + tile // 2 - 6), cell.failure or "", fill=(160, 0, 0), font=font)
                caption = ""
            draw.text((x + 2, y + tile + 2), caption, fill="black", font=font)
    write_png(grid, path, {"sdpatch": f"compare grid: {report.model}, rows {report.backends}, sizes {report.sizes}"})
    return path.name


def finish(report: CompareReport, out_dir: Path) -> CompareReport:
    """Draw the chart and the grid, then write report.json and report.md with their paths."""
    report.chart = write_chart(report, out_dir / "memory.png")
    report.grid = write_grid(report, out_dir / "grid.png")
    write_reports(report)
    return report


def redraw(out_dir: Path) -> CompareReport:
    """Write report.md, the chart and the grid again from ``out_dir``'s report.json and images,
    e.g. where the run had no matplotlib: ``python -m sdpatch.compare DIR``."""
    return finish(read_report(out_dir), out_dir)


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()
