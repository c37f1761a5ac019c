"""The ``sdpatch`` command line: ``generate`` and ``info``.

Commands parse their options, call the library (:mod:`sdpatch.generate`) and format what it
returns. Option types are defined once below, so that later commands share them.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from sdpatch.errors import InputError
from sdpatch.generate import GenerationRequest, environment, run

try:  # typer >= 0.26 vendors click; older typers use click itself
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

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
    int | None, typer.Option("--height", "-H", help="Image height in pixels, a multiple of 8 [default: model's native]")
]
WidthOpt = Annotated[
    int | None, typer.Option("--width", "-W", help="Image width in pixels, a multiple of 8 [default: model's native]")
]
StepsOpt = Annotated[int, typer.Option("--steps", "-s", help="Denoising steps (num_inference_steps).")]
GuidanceOpt = Annotated[
    float, typer.Option("--guidance-scale", "-g", help="Classifier-free guidance scale; <= 1 turns guidance off.")
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the first image; image i uses seed + i.")]
NumImagesOpt = Annotated[int, typer.Option("--num-images", help="How many images, generated one after another.")]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        "-b",
        help="Attention: auto (triton on CUDA where it can, else chunked), triton, chunked, sdpa, "
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
        "where images are named sdpatch-<seed>.png [default: the current folder]",
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
        except InputError as err:
            typer.echo(f"sdpatch: error: {err}", err=True)
            code = 2
        except (KeyboardInterrupt, typer.Abort):
            typer.echo("sdpatch: interrupted (finished images are kept)", err=True)
            code = 130
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(
    cls=_OneLineErrors,
    help="Flat-memory attention for diffusers' Stable Diffusion, and what a generation costs in GPU memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command(help=f"Generate images from PROMPT and report time and peak memory per phase. {_TINY}")
def generate(
    prompt: Annotated[str, typer.Argument(help="What the image should show.")],
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
) -> None:
    request = GenerationRequest(
        prompt=prompt,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        steps=steps,
        guidance_scale=guidance_scale,
        seed=seed,
        num_images=num_images,
    )
    result = run(
        request,
        model=model,
        backend=backend,
        device=device,
        dtype=dtype,
        output=output,
        overwrite=overwrite,
        report_json=report_json,
        allow_pickle=allow_pickle,
        on_image=lambda record: typer.echo(f"saved {record.path}"),
    )
    typer.echo(result.report.format_table())
    if report_json is not None:
        typer.echo(f"report: {report_json}")


@app.command()
def info() -> None:
    """Show versions, GPUs, and which attention backends can run here (and why not)."""
    from sdpatch import __version__
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


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Deprecation notices are for the code that calls diffusers, not for the person running sdpatch.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # transformers warns about optional image-processor extras that text-to-image never uses.
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    app()
