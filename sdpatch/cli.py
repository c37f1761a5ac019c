"""The ``sdpatch`` command line: ``generate``, ``compare`` and ``info``.

Commands parse their options, call the library and format what it returns. Option types are
defined once below, so that later commands share them. This module imports neither torch nor
diffusers: a command checks its arguments first and imports the library only to run, so that
``--help``, a typo or a bad value is answered at once.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from sdpatch import __version__
from sdpatch.errors import InputError, RunError
from sdpatch.progress import Progress
from sdpatch.settings import (
    ATTENTION_BACKENDS,
    CompareSettings,
    GenerationRequest,
    RunOptions,
    parse_backends,
    parse_sizes,
)

try:  # typer >= 0.26 vendors click; older typers use click itself
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

# What each exit code means; the errors the CLI turns into one line on stderr, and their codes.
EXIT_CODES = {
    0: "done",
    1: "the run failed (out of memory; a failed cell or process)",
    2: "bad input, or an output that cannot be written",
    3: "--vram-budget missed: the measured peak was over the budget (without --best-effort)",
    130: "interrupted",
}
ERROR_CODES: tuple[tuple[type[Exception], int], ...] = ((InputError, 2), (RunError, 1))
BUDGET_MISSED = 3
# \b keeps click from rewrapping the lines.
_EXIT_HELP = "\b\nExit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())

_TINY = (
    "The default model, tiny, is embedded and runs offline, but its weights are random: "
    "its images are noise-like patterns, not pictures. sd15, sd21 and sdxl are the real "
    "architectures at full size, also with random weights, for measuring memory and speed."
)

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="tiny (embedded, random weights: noise-like images), sd15, sd21, sdxl (full-size "
        "architectures, random weights), a local diffusers folder, a .safetensors file, or a "
        "Hugging Face repo id.",
    ),
]
NegativePromptOpt = Annotated[
    str | None, typer.Option("--negative-prompt", "-n", help="What the image should not show.")
]
HeightOpt = Annotated[
    int | None, typer.Option("--height", "-H", help="Image height in pixels, a multiple of 8 (default: the model's native size).")
]
WidthOpt = Annotated[
    int | None, typer.Option("--width", "-W", help="Image width in pixels, a multiple of 8 (default: the model's native size).")
]
StepsOpt = Annotated[int, typer.Option("--steps", "-s", help="Denoising steps (num_inference_steps).")]
GuidanceOpt = Annotated[
    float, typer.Option("--guidance-scale", "-g", help="Classifier-free guidance scale; <= 1 turns guidance off.")
]
SeedOpt = Annotated[
    int,
    typer.Option("--seed", help="Seed of the first image; image i uses seed + i (counted over a whole --prompts-file)."),
]
NumImagesOpt = Annotated[int, typer.Option("--num-images", help="How many images, generated one after another.")]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        "-b",
        help=f"Attention: auto (sdpatch's pick per call; `sdpatch info` says which), {', '.join(ATTENTION_BACKENDS)}, "
        "or stock (leave the pipeline unpatched).",
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype", help="auto (fp16 on a GPU, fp32 on the CPU), fp16, bf16 or fp32. fp16 on the CPU runs as fp32."
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")]
OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="A .png file for one image, or a folder (existing, or new inside an existing one) "
        "where images are named sdpatch-<seed>.png (default: the current folder).",
    ),
]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace output files that already exist.")]
ReportJsonOpt = Annotated[
    Path | None, typer.Option("--report-json", help="Also write the report (every measured number) to this JSON file.")
]
AllowPickleOpt = Annotated[
    bool,
    typer.Option(
        "--allow-pickle", help="Allow loading a .ckpt file. It is pickle, and unpickling can run code: trust the file."
    ),
]
VramBudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--vram-budget",
        help="GiB of GPU memory (PyTorch's peak reserved; host memory on the CPU) the run must fit in, or auto "
        "(the device's free memory): memory levers are chosen, cheapest first, until the estimate fits. "
        "A budget that cannot be met is an error before the run; a run whose measured peak misses it "
        "exits with code 3.",
        show_default=False,
    ),
]
BestEffortOpt = Annotated[
    bool,
    typer.Option(
        "--best-effort",
        help="With --vram-budget: run the best plan even when it cannot fit, and report a miss (exit code 0).",
    ),
]
CudaGraphsOpt = Annotated[
    bool | None,
    typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="Capture the UNet's call once per shape and replay it every step (CUDA). Default: on for a patched "
        "pipeline without --vram-budget; off for --backend stock, which runs diffusers as it is.",
        show_default=False,
    ),
]
CompileOpt = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="torch.compile the UNet's transformer models and ResNet blocks, each on its own (regional "
        "compilation), with on-disk caches: the first run at a size compiles (about a minute), later ones start "
        "from the cache.",
    ),
]
AllowFp8Opt = Annotated[
    bool,
    typer.Option(
        "--allow-fp8",
        help="With --vram-budget: the plan may store the UNet's weights in fp8 (approximate: the image changes), "
        "cast on the CPU before they reach the GPU.",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="With --vram-budget: print the plan from the model's configs (no weights, no GPU needed) and stop.",
    ),
]
PlanDeviceOpt = Annotated[
    str, typer.Option("--device", help="The device to plan for: cuda, cuda:N or cpu (this machine need not have it).")
]
PromptsFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts-file",
        help="Instead of PROMPT: a UTF-8 file of prompts, one a line (blank lines and lines starting with # "
        "are skipped). Images go into the --output folder as p<index>-s<seed>.png (the prompt's index "
        "zero-padded to 4 digits: p0000-s0.png), the report into "
        "sdpatch-report.json there (or --report-json). Started with `accelerate launch -m sdpatch generate "
        "...`, the processes share the prompts.",
    ),
]


# click < 8.2 prints the help for a bare command itself, without this exception.
_NoArgsIsHelp = getattr(click_exceptions, "NoArgsIsHelpError", ())


class _OneLineErrors(TyperGroup):
    """Every usage error is one line on stderr and exit code 2, whether click or sdpatch found it."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _NoArgsIsHelp as err:
            typer.echo(err.ctx.get_help() if err.ctx else str(err))
            code = 0
        except click_exceptions.UsageError as err:
            typer.echo(f"sdpatch: error: {err.format_message()}", err=True)
            code = 2
        except tuple(error for error, _ in ERROR_CODES) as err:
            typer.echo(f"sdpatch: error: {err}", err=True)
            code = next(code for error, code in ERROR_CODES if isinstance(err, error))
        except (KeyboardInterrupt, typer.Abort):
            code = 130
        if code == 130:  # newer typers turn Ctrl-C into a silent exit code 130 themselves
            typer.echo("sdpatch: interrupted (finished images are kept)", err=True)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_OneLineErrors,
    help="Flat-memory attention for diffusers' Stable Diffusion, and what a generation costs in GPU memory.",
    epilog=_EXIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: typer's rich panels label every flag <bool>, as if it took a value.
    rich_markup_mode=None,
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"sdpatch {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


def _library() -> None:
    """Quiet the libraries sdpatch runs on, before a command first imports them.

    Deprecation notices are for the code that calls diffusers, not for the person running sdpatch;
    transformers warns about optional image-processor extras that text-to-image never uses, and
    diffusers about its own fallbacks (the single-file loader's Hub download), which sdpatch turns
    into one-line errors itself.
    """
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    diffusers_logging.set_verbosity_error()


@app.command(
    help=f"Generate images from PROMPT (or --prompts-file) and report time and peak memory per phase. {_TINY}",
    epilog=_EXIT_HELP,
)
def generate(
    prompt: Annotated[
        str | None, typer.Argument(help="What the image should show.", metavar="PROMPT", show_default=False)
    ] = None,
    prompts_file: PromptsFileOpt = None,
    model: ModelOpt = "tiny",
    negative_prompt: NegativePromptOpt = None,
    height: HeightOpt = None,
    width: WidthOpt = None,
    steps: StepsOpt = GenerationRequest.steps,
    guidance_scale: GuidanceOpt = GenerationRequest.guidance_scale,
    seed: SeedOpt = GenerationRequest.seed,
    num_images: NumImagesOpt = GenerationRequest.num_images,
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    output: OutputOpt = None,
    overwrite: OverwriteOpt = False,
    report_json: ReportJsonOpt = None,
    allow_pickle: AllowPickleOpt = False,
    vram_budget: VramBudgetOpt = None,
    best_effort: BestEffortOpt = False,
    cuda_graphs: CudaGraphsOpt = None,
    compile: CompileOpt = False,
    allow_fp8: AllowFp8Opt = False,
    dry_run: DryRunOpt = False,
) -> None:
    if dry_run:
        if vram_budget is None:
            raise InputError("--dry-run prints a --vram-budget plan: give --vram-budget")
        plan(
            model=model, height=height, width=width, guidance_scale=guidance_scale, batch=1, vram_budget=vram_budget,
            allow_fp8=allow_fp8, device=device, dtype=dtype, allow_pickle=allow_pickle,
        )
        return
    if (prompt is None) == (prompts_file is None):
        raise InputError("give a PROMPT or --prompts-file FILE" + (", not both" if prompt is not None else ""))
    if prompts_file is not None and (vram_budget is not None or best_effort):
        raise InputError("--vram-budget and --best-effort do not work with --prompts-file yet")
    request = GenerationRequest(
        prompt=prompt or "",
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        steps=steps,
        guidance_scale=guidance_scale,
        seed=seed,
        num_images=num_images,
    )
    request.validate()
    _library()
    from sdpatch.generate import run
    from sdpatch.multi import refuse_launch_without_prompts_file, run_prompts
    from sdpatch.planner import request_expandable_segments

    if vram_budget is not None:
        # PyTorch reads its allocator settings once, when CUDA starts: this is before anything touches it.
        note = request_expandable_segments()
        if note:
            logging.getLogger(__name__).warning("expandable segments stay off: %s", note)
    with Progress() as progress:
        options = RunOptions(
            model=model, backend=backend, device=device, dtype=dtype, allow_pickle=allow_pickle, output=output,
            overwrite=overwrite, report_json=report_json, vram_budget=vram_budget, best_effort=best_effort,
            allow_fp8=allow_fp8, cuda_graphs=cuda_graphs, compile=compile,
        )
        show = dict(progress=progress, on_image=lambda record: progress.write(f"saved {record.path}"))
        if prompts_file is not None:
            multi = run_prompts(request, prompts_file, options, **show)
        else:
            refuse_launch_without_prompts_file()
            result = run(request, options, **show)
    if prompts_file is not None:
        if multi.report is not None:  # the main process
            typer.echo(multi.report.format_table())
            typer.echo(f"report: {multi.report_path}")
        raise typer.Exit(multi.exit_code)
    typer.echo(result.report.format_table())
    if report_json is not None:
        typer.echo(f"report: {report_json}")
    missed = result.report.budget_miss
    if missed and not best_effort:
        typer.echo(f"sdpatch: error: {missed} (pass --best-effort to accept a miss)", err=True)
        raise typer.Exit(BUDGET_MISSED)


@app.command(
    help="Print the --vram-budget plan for a model and size from its configs alone (the presets, a local "
    "folder or a cached Hub repo; no weights, no GPU needed): each phase's estimated peak, the host memory "
    "it needs and the expected slow-down. A budget below every plan is an error that names the floor."
)
def plan(
    model: ModelOpt = "tiny",
    height: HeightOpt = None,
    width: WidthOpt = None,
    guidance_scale: GuidanceOpt = GenerationRequest.guidance_scale,
    batch: BatchOpt = 1,
    vram_budget: VramBudgetOpt = None,
    allow_fp8: AllowFp8Opt = False,
    device: PlanDeviceOpt = "cuda",
    dtype: DtypeOpt = "auto",
    allow_pickle: AllowPickleOpt = False,
) -> None:
    from sdpatch.generate import dry_run
    from sdpatch.planner import PlannerError, estimate_lines, plan_lines

    if vram_budget is None:
        raise InputError("give --vram-budget GiB")
    request = GenerationRequest("", height=height, width=width, guidance_scale=guidance_scale)
    chosen = dry_run(
        request, model=model, device=device, dtype=dtype, vram_budget=vram_budget, allow_fp8=allow_fp8,
        allow_pickle=allow_pickle, batch=batch,
    )
    shape, report = chosen.shape, chosen.to_dict()
    cfg = " with CFG" if shape.cfg else ""
    typer.echo(f"{model} · {shape.width}×{shape.height} · batch {shape.batch}{cfg} · {device} (planned from configs)")
    lines = plan_lines(report, None)
    typer.echo("\n".join([*lines[:1], *estimate_lines(report), *lines[1:]]))
    if not chosen.fits:
        raise PlannerError(chosen.failure())


@app.command()
def info() -> None:
    """Show versions, GPUs, and which attention backends can run here (and why not)."""
    _library()
    from sdpatch.generate import environment
    from sdpatch.memory import format_bytes

    env = environment()
    v = env["versions"]
    typer.echo(f"sdpatch {__version__}")
    for name in ("python", "torch", "cuda", "triton", "diffusers", "transformers"):
        typer.echo(f"  {name:<13}{v[name] or 'not available'}")
    if env["gpus"]:
        for gpu in env["gpus"]:
            typer.echo(f"GPU {gpu['index']}: {gpu['name']}, {format_bytes(gpu['memory_bytes'])}")
    else:
        typer.echo("GPU: none (torch sees no CUDA device)")
    typer.echo(f"attention backends on {env['backends_device']}:")
    for name, status in env["backends"].items():
        mark = "yes" if status["available"] else "no "
        typer.echo(f"  {name:<8} {mark}  {status['reason']}")


SizesOpt = Annotated[
    str | None,
    typer.Option(
        "--sizes",
        help="Square image sides in pixels, comma-separated, each a multiple of 8, e.g. 512,1024,2048 "
        "(default: the model's native size, 2x and 4x).",
    ),
]
BackendsOpt = Annotated[
    str | None,
    typer.Option(
        "--backends",
        help="Comma-separated: stock (unpatched), naive (diffusers' AttnProcessor), sliced (diffusers' "
        "attention slicing), xformers (where installed), and sdpatch's sdpa, triton, chunked, auto. The "
        "reference for PSNR is stock, if named, else the first (default: every one that can run here, except auto).",
    ),
]
PromptOpt = Annotated[str, typer.Option("--prompt", "-p", help="The prompt of every cell.")]
CompareSeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the initial latents, the same in every cell.")]
BatchOpt = Annotated[
    int, typer.Option("--batch", help="Images per pipeline call; the UNet batch is twice that with guidance.")
]
VramCapOpt = Annotated[
    float | None,
    typer.Option(
        "--vram-cap",
        help="Emulate a GPU with this many GiB (torch.cuda.set_per_process_memory_fraction). CUDA only.",
    ),
]
MaxSizeOpt = Annotated[
    bool,
    typer.Option(
        "--max-size", help="Also find, per backend, the largest square size (steps of 64 px) that completes."
    ),
]
MaxSizeLimitOpt = Annotated[
    int | None,
    typer.Option("--max-size-limit", help="Largest size --max-size tries, a multiple of 64 (default: 8192)."),
]
WarmupOpt = Annotated[
    bool,
    typer.Option(
        "--warmup/--no-warmup",
        help="Run one step of the reference before the first cell, and each cell once with one step before "
        "measuring it, so that one-time costs (Triton autotuning, cuDNN plans) stay out of the figures.",
    ),
]
CompareVramBudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--vram-budget",
        help="Add a 'planned' column: sdpatch auto with the memory levers that fit this many GiB (or auto: the "
        "device's free memory, or --vram-cap), planned per size; the report gives each lever's PSNR.",
        show_default=False,
    ),
]
OutDirOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        help="Output folder (new, or empty; a non-empty one needs --overwrite, else DIR-2 is used).",
    ),
]


@app.command(
    help="Compare attention backends across image sizes: peak memory per phase, seconds per step and "
    "PSNR against stock, in report.json, report.md, a memory chart and an image grid. Out of memory "
    f"is a result, not a failure. {_TINY}",
    epilog=_EXIT_HELP,
)
def compare(
    model: ModelOpt = "tiny",
    sizes: SizesOpt = None,
    backends: BackendsOpt = None,
    prompt: PromptOpt = CompareSettings.prompt,
    steps: StepsOpt = CompareSettings.steps,
    seed: CompareSeedOpt = CompareSettings.seed,
    guidance_scale: GuidanceOpt = CompareSettings.guidance_scale,
    batch: BatchOpt = CompareSettings.batch,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    vram_cap: VramCapOpt = None,
    max_size: MaxSizeOpt = False,
    max_size_limit: MaxSizeLimitOpt = None,
    warmup: WarmupOpt = CompareSettings.warmup,
    vram_budget: CompareVramBudgetOpt = None,
    out: OutDirOpt = Path("sdpatch-compare"),
    overwrite: OverwriteOpt = False,
    allow_pickle: AllowPickleOpt = False,
) -> None:
    if max_size_limit is not None and not max_size:
        raise InputError("--max-size-limit is only used with --max-size")
    settings = CompareSettings(
        sizes=parse_sizes(sizes) if sizes is not None else None,
        backends=parse_backends(backends) if backends is not None else None,
        prompt=prompt,
        steps=steps,
        guidance_scale=guidance_scale,
        seed=seed,
        batch=batch,
        vram_cap_gib=vram_cap,
        max_size=max_size,
        max_size_limit=max_size_limit if max_size_limit is not None else CompareSettings.max_size_limit,
        warmup=warmup,
        vram_budget=vram_budget,
    )
    settings.validate()
    _library()
    from sdpatch.compare import run as run_compare
    from sdpatch.memory import plural

    with Progress() as progress:
        report = run_compare(
            settings,
            RunOptions(model=model, device=device, dtype=dtype, allow_pickle=allow_pickle, overwrite=overwrite),
            out=out,
            progress=progress,
            on_cell=lambda cell: progress.write(("max-size probe " if cell.kind == "probe" else "") + cell.summary()),
        )
    typer.echo("")
    typer.echo(report.main_table())
    for backend, found in report.max_sizes.items():
        typer.echo(f"largest size, {backend}: " + (f"{found.size}²" if found.size else "none"))
    typer.echo(report.baseline_check()["message"])
    for note in [*report.timing_notes(), *report.notes]:
        typer.echo(f"note: {note}")
    files = ", ".join(f for f in ("report.json", "report.md", report.chart, report.grid) if f)
    typer.echo(f"wrote {report.out_dir}: {files}, images/")
    errors = sum(c.status == "error" for c in report.all_cells)
    if errors:
        failed = plural(errors, "cell")
        typer.echo(f"sdpatch: {failed} failed with an error other than out of memory: see report.md", err=True)
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
