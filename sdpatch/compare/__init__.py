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

Modules: :mod:`~sdpatch.compare.cells` runs the cells, :mod:`~sdpatch.compare.report` is the
report model, :mod:`~sdpatch.compare.figures` draws the chart and the grid.
"""

from sdpatch.compare.cells import (
    DEFAULT_BACKENDS,
    BackendSwitcher,
    backend_availability,
    compare,
    image_difference,
    largest_fitting,
    plan_out_dir,
    release_memory,
    resolve_backends,
    run,
    run_cell,
    vram_cap_bytes,
    warm_up,
)
from sdpatch.compare.figures import finish, redraw, write_chart, write_grid
from sdpatch.compare.report import (
    BACKEND_DESCRIPTIONS,
    BASELINE_TOLERANCE,
    PLANNED,
    RANK_NOISE,
    Cell,
    CompareReport,
    MaxSize,
    format_psnr,
    json_psnr,
    psnr_value,
    read_report,
    write_reports,
)
from sdpatch.settings import (
    COMPARE_BACKENDS,
    DEFAULT_PROMPT,
    SIZE_STEP,
    CompareSettings,
    check_backends,
    check_sizes,
    parse_backends,
    parse_sizes,
)

__all__ = [
    "BACKEND_DESCRIPTIONS",
    "BASELINE_TOLERANCE",
    "COMPARE_BACKENDS",
    "DEFAULT_BACKENDS",
    "DEFAULT_PROMPT",
    "PLANNED",
    "RANK_NOISE",
    "SIZE_STEP",
    "BackendSwitcher",
    "Cell",
    "CompareReport",
    "CompareSettings",
    "MaxSize",
    "backend_availability",
    "check_backends",
    "check_sizes",
    "compare",
    "finish",
    "format_psnr",
    "image_difference",
    "json_psnr",
    "largest_fitting",
    "parse_backends",
    "parse_sizes",
    "plan_out_dir",
    "psnr_value",
    "read_report",
    "redraw",
    "release_memory",
    "resolve_backends",
    "run",
    "run_cell",
    "vram_cap_bytes",
    "warm_up",
    "write_chart",
    "write_grid",
    "write_reports",
]
