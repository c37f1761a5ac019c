"""A measured generation run: the library behind ``sdpatch generate``.

Layers, from the bottom:

- :func:`measured_call`: one pipeline call split into three real phases (text encoding, the
  denoising loop, VAE decode), each timed and its peak memory measured by a
  :class:`~sdpatch.memory.MemoryMeter`. ``sdpatch compare`` reuses it per cell.
- :func:`generate`: a :class:`GenerationRequest` on a loaded pipeline, one image at a time, each
  PNG written atomically with its record in its metadata as soon as it is done.
- :func:`run`: the whole command: check every input (:func:`check_setup`, :func:`plan_outputs`),
  load and patch the model (:meth:`Setup.load`), generate. :mod:`sdpatch.multi` runs a prompts
  file, in one process or several, from the same pieces.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from sdpatch.attention import BACKENDS, BackendUnavailableError, backend_status
from sdpatch.errors import InputError
from sdpatch.memory import PHASE_LABELS, MemoryMeter, PhaseStats, format_bytes, summarize, total, weights_bytes
from sdpatch.models import (
    ModelSource,
    default_size,
    load_pipeline,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from sdpatch.planner import Plan, fit, parse_budget, plan_from_configs, plan_lines, weight_levers

logger = logging.getLogger(__name__)

GENERATE_BACKENDS = ("stock", *BACKENDS)
# Sanity bounds that turn a typo into an error instead of a hang or an OOM kill. At 16384 px a
# side, each of the VAE decoder's activations is already 64 GiB in fp16.
MAX_SIDE = 16384
MAX_IMAGES = 10_000
MAX_SEED = 2**64 - 1  # the largest seed a torch.Generator takes


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate. ``height``/``width`` None means the model's native size.

    Image ``i`` of ``num_images`` uses seed ``seed + i``, so that each image can be made again
    on its own with ``--seed``.
    """

    prompt: str
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    steps: int = 30
    guidance_scale: float = 7.5
    seed: int = 0
    num_images: int = 1

    def validate(self) -> None:
        """Raise InputError for a value no pipeline can run."""
        for name, text in (("the prompt", self.prompt), ("--negative-prompt", self.negative_prompt)):
            try:
                (text or "").encode("utf-8")
            except UnicodeEncodeError:  # e.g. undecodable bytes in argv, kept as lone surrogates
                raise InputError(f"{name} is not valid UTF-8 text") from None
        for name, value in (("height", self.height), ("width", self.width)):
            if value is not None and (value <= 0 or value % 8):
                raise InputError(f"--{name} must be a positive multiple of 8, got {value}")
            if value is not None and value > MAX_SIDE:
                raise InputError(f"--{name} must be at most {MAX_SIDE}, got {value}")
        if self.steps <= 0:
            raise InputError(f"--steps must be at least 1, got {self.steps}")
        if not (math.isfinite(self.guidance_scale) and self.guidance_scale >= 0):
            raise InputError(f"--guidance-scale must be a finite number >= 0, got {self.guidance_scale}")
        if not 1 <= self.num_images <= MAX_IMAGES:
            raise InputError(f"--num-images must be between 1 and {MAX_IMAGES}, got {self.num_images}")
        if not 0 <= self.seed <= MAX_SEED - (self.num_images - 1):
            raise InputError(
                f"--seed must be between 0 and {MAX_SEED - (self.num_images - 1)} "
                f"(image i uses seed + i, at most 2**64 - 1), got {self.seed}"
            )

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.num_images)]


@dataclass
class ImageRecord:
    """One generated image: its seed, where it was written, and its measured phases."""

    index: int
    seed: int
    path: str | None
    phases: list[PhaseStats]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "seed": self.seed,
            "path": self.path,
            "phases": [p.to_dict() for p in self.phases],
            "total": total(self.phases).to_dict(),
        }


@dataclass
class GenerationReport:
    """The record of a run: settings, environment, weights, and per-image phase measurements."""

    model: str
    backend: str
    device: str
    device_name: str
    dtype: str
    request: GenerationRequest
    memory_kind: str
    host_scope: str | None
    weights: dict[str, int]
    patch: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None  # the --vram-budget plan (sdpatch.planner.Plan.to_dict)
    notes: list[str] = field(default_factory=list)
    images: list[ImageRecord] = field(default_factory=list)
    complete: bool = False

    @property
    def phases(self) -> list[PhaseStats]:
        """Each phase over all images: mean time, highest peaks."""
        return summarize(r.phases for r in self.images)

    def to_dict(self) -> dict[str, Any]:
        phases = self.phases
        return {
            "sdpatch_report": 1,
            "complete": self.complete,
            "model": self.model,
            "backend": self.backend,
            "device": self.device,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "request": asdict(self.request),
            "memory": {"kind": self.memory_kind, "host_scope": self.host_scope},
            "weights_bytes": sum(self.weights.values()),
            "weights_by_component": self.weights,
            "phases": [p.to_dict() for p in phases],
            "total": total(phases).to_dict() if phases else None,
            "images": [r.to_dict() for r in self.images],
            "notes": self.notes,
            "patch": self.patch,
            "plan": self.plan,
            "environment": versions(),
        }

    def format_table(self) -> str:
        """A small text table: one row per phase and a total, then the weights' size."""
        r = self.request
        n = len(self.images)
        head = (
            f"{self.model} · backend {self.backend} · {self.device_name} ({self.device}) · {self.dtype} · "
            f"{r.width}×{r.height} · {r.steps} steps · {n} image{'s' if n != 1 else ''}"
        )
        cuda = self.memory_kind == "cuda"
        cols = ["phase", "time", "s/it", *(("peak allocated", "peak reserved") if cuda else ("peak host memory",))]
        rows = [cols]
        phases = self.phases
        for p in [*phases, total(phases)] if phases else []:
            sit = f"{p.seconds_per_step:.3f}" if p.seconds_per_step else ""
            mem = (
                [format_bytes(p.peak_allocated), format_bytes(p.peak_reserved)] if cuda else [format_bytes(p.peak_host)]
            )
            rows.append([PHASE_LABELS.get(p.name, p.name), f"{p.seconds:.2f} s", sit, *mem])
        widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.weights.items())
        lines.append(f"weights: {format_bytes(sum(self.weights.values()))} ({parts})")
        if self.patch:
            counts = Counter(layer["backend"] for layer in self.patch["layers"])
            served = ", ".join(f"{name} {n}" for name, n in counts.most_common())
            lines.append(f"attention layers: {served}")
            falls = self.patch["fallbacks"]
            if falls:
                calls = sum(f["calls"] for f in falls)
                last = falls[-1]
                lines.append(
                    f"fallbacks: {calls} attention calls in {len(falls)} layers ran chunked after "
                    f"{last['backend']} failed ({last['reason']})"
                )
        if n > 1:
            lines.append(f"time: mean per image; peaks: highest over the {n} images")
        denoise = next((p for p in phases if p.name == "denoising"), None)
        if denoise and denoise.steps and denoise.steps > 1:
            lines.append(
                f"s/it leaves out the first step ({denoise.first_step_seconds:.2f} s), "
                "which carries one-time costs such as kernel compilation"
            )
        if not cuda:
            scope = "each phase's own peak" if self.host_scope == "phase" else "the process's peak since it started"
            lines.append(f"host memory: resident memory of the whole process, {scope} (not GPU memory)")
        if self.plan:
            peak = total(phases)
            lines.extend(plan_lines(self.plan, peak.peak_reserved if cuda else peak.peak_host))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


@dataclass
class GenerationResult:
    """Images of a run (PIL, in seed order) and its report."""

    images: list[Image.Image]
    report: GenerationReport


def measured_call(
    pipe: Any,
    meter: MemoryMeter,
    *,
    prompt: str,
    negative_prompt: str | None,
    height: int,
    width: int,
    steps: int,
    guidance_scale: float,
    seed: int,
    num_images_per_prompt: int = 1,
) -> list[Image.Image]:
    """One pipeline call, measured as three phases appended to ``meter.phases``.

    Text encoding runs through the pipeline's own ``encode_prompt``; the embeddings then go into
    the pipeline call, whose last step callback is the boundary between the denoising loop and
    VAE decode (the decode, safety checker if any, and post-processing). The initial noise comes
    from a CPU generator, so a seed gives the same latents on every device.

    Returns the images; the denoising phase also records each step's wall time. On an exception
    ``meter.current`` names the phase that failed.
    """
    device = pipe._execution_device
    cfg = guidance_scale > 1.0  # diffusers' own rule for classifier-free guidance
    with meter.phase("text_encoding"):
        # Encode once, unrepeated: the pipeline repeats the embeddings per image itself.
        embeds = pipe.encode_prompt(
            prompt=prompt,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=negative_prompt,
        )
    names = ["prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"]
    step_ends: list[float] = []

    def on_step_end(pipeline: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        meter.synchronize()
        step_ends.append(time.perf_counter())
        if i == pipeline.num_timesteps - 1:
            meter.switch("vae_decode")
        return {}

    meter.start("denoising")
    denoise = meter.phases[-1]
    step_ends.append(time.perf_counter())
    output = pipe(
        **dict(zip(names, embeds)),
        height=height,
        width=width,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        num_images_per_prompt=num_images_per_prompt,
        generator=torch.Generator("cpu").manual_seed(seed),
        callback_on_step_end=on_step_end,
        callback_on_step_end_tensor_inputs=[],
    )
    meter.stop()
    denoise.step_seconds = [b - a for a, b in zip(step_ends, step_ends[1:])]
    return output.images


def generate(
    pipe: Any,
    request: GenerationRequest,
    *,
    model: str,
    backend: str = "stock",
    outputs: list[Path] | None = None,
    report_json: Path | None = None,
    notes: list[str] | None = None,
    progress: bool = True,
    on_image: Callable[[ImageRecord], None] | None = None,
    plan: dict[str, Any] | None = None,
) -> GenerationResult:
    """Generate ``request`` on a loaded (and maybe patched) pipeline, one image at a time.

    Args:
        pipe: a StableDiffusionPipeline or StableDiffusionXLPipeline.
        request: what to generate; its None height/width become the model's native size.
        model: the model's name, for the report.
        backend: the attention backend the pipeline was patched with (``stock``: unpatched).
        outputs: one PNG path per image (see :func:`plan_outputs`), or None to write nothing.
            Each image is written atomically as soon as it is done, so an interrupted run
            keeps the images it finished.
        report_json: where to write the report; rewritten (atomically) after every image, so
            it is valid JSON and covers the finished images at any moment.
        notes: lines to carry in the report (e.g. a dtype substitution).
        progress: show diffusers' progress bar for the denoising loop (the only bar).
        on_image: called with each image's record once it is written.
        plan: the memory plan applied to ``pipe`` (:meth:`sdpatch.planner.Plan.to_dict`), for the report.
    """
    request.validate()
    timesteps = pipe.scheduler.config.num_train_timesteps
    if request.steps > timesteps:  # past it, diffusers' schedulers raise or index out of range mid-run
        raise InputError(f"--steps must be at most {timesteps} for {model}, got {request.steps}")
    size = default_size(pipe)
    request = replace(request, height=request.height or size, width=request.width or size)
    if outputs is not None and len(outputs) != request.num_images:
        raise ValueError(f"{len(outputs)} output paths for {request.num_images} images")
    if outputs:
        outputs[0].parent.mkdir(exist_ok=True)  # plan_outputs checked that its parent exists
    pipe.set_progress_bar_config(disable=not progress)
    device = pipe._execution_device
    meter = MemoryMeter(device)
    report = GenerationReport(
        model=model,
        backend=backend,
        device=str(device),
        device_name=device_name(device),
        dtype=str(pipe.unet.dtype).removeprefix("torch."),
        request=request,
        memory_kind=meter.kind,
        host_scope=None,
        weights=weights_bytes(pipe.components),
        plan=plan,
        notes=list(notes or []),
    )
    images: list[Image.Image] = []
    if report_json is not None:  # from the start, an interrupted run leaves a valid report
        write_json(report_json, report.to_dict())
    for index, seed in enumerate(request.seeds):
        meter.phases = []
        batch = measured_call(
            pipe,
            meter,
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            height=request.height,
            width=request.width,
            steps=request.steps,
            guidance_scale=request.guidance_scale,
            seed=seed,
        )
        image = batch[0]
        record = ImageRecord(index, seed, None, meter.phases)
        report.host_scope = meter.host_scope
        if outputs is not None:
            record.path = str(outputs[index])
            write_png(image, outputs[index], png_text(report, record))
            logger.info("wrote %s", record.path)
        images.append(image)
        report.images.append(record)
        report.complete = index == request.num_images - 1
        report.patch = _patch_report(pipe)
        if report_json is not None:
            write_json(report_json, report.to_dict())
        if on_image is not None:
            on_image(record)
    return GenerationResult(images, report)


def run(
    request: GenerationRequest,
    *,
    model: str = "tiny",
    backend: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    output: Path | None = None,
    overwrite: bool = False,
    report_json: Path | None = None,
    allow_pickle: bool = False,
    progress: bool = True,
    on_image: Callable[[ImageRecord], None] | None = None,
    vram_budget: float | str | None = None,
    best_effort: bool = False,
    allow_fp8: bool = False,
) -> GenerationResult:
    """What ``sdpatch generate`` does: check every input, then load, patch and generate.

    Everything that can be checked without loading weights is checked first and raises
    InputError, before anything is loaded or written. See :func:`plan_outputs` for ``output``.
    ``vram_budget`` (GiB or ``"auto"``) plans and applies memory levers (:func:`sdpatch.planner.fit`)
    before generating; a budget that cannot be met raises InputError then, unless ``best_effort``.
    A plan that moves weights off the GPU (planned from the configs first) loads the model on the
    CPU, so that the weights reach the GPU only as the plan places them. ``allow_fp8``: the plan
    may store the UNet's weights in fp8 (approximate).
    """
    request.validate()
    if vram_budget is not None:
        parse_budget(vram_budget)
    elif best_effort or allow_fp8:
        raise InputError(f"{'--best-effort' if best_effort else '--allow-fp8'} is only used with --vram-budget")
    setup = check_setup(model=model, backend=backend, device=device, dtype=dtype, allow_pickle=allow_pickle)
    outputs = plan_outputs(output, request.seeds, overwrite=overwrite)
    if report_json is not None:
        check_output_file(report_json, overwrite=overwrite, what="--report-json")
        if report_json.resolve() in {p.resolve() for p in outputs}:
            raise InputError("--report-json must not be one of the image paths")

    cfg = request.guidance_scale > 1  # diffusers' rule for classifier-free guidance
    on_cpu_first = False
    if vram_budget is not None and setup.device.type == "cuda" and parse_budget(vram_budget) != "auto":
        ahead = dry_run(request, model=model, device=str(setup.device), dtype=dtype, vram_budget=vram_budget, allow_fp8=allow_fp8)
        on_cpu_first = weight_levers(ahead.levers)
    pipe = setup.load(torch.device("cpu") if on_cpu_first else None)
    plan = None
    if vram_budget is not None:
        size = default_size(pipe)
        plan = fit(
            pipe,
            vram_budget,
            height=request.height or size,
            width=request.width or size,
            cfg=cfg,
            best_effort=best_effort,
            device=setup.device if on_cpu_first else None,
            allow_fp8=allow_fp8,
        ).to_dict()
    try:
        return generate(
            pipe,
            request,
            model=model,
            backend=backend,
            outputs=outputs,
            report_json=report_json,
            notes=setup.notes,
            progress=progress,
            on_image=on_image,
            plan=plan,
        )
    except BackendUnavailableError as err:  # e.g. --backend triton, whose kernel failed to compile mid-run
        raise InputError(str(err)) from err


def dry_run(
    request: GenerationRequest,
    *,
    model: str = "tiny",
    device: str = "cuda",
    dtype: str = "auto",
    vram_budget: float | str,
    allow_fp8: bool = False,
    allow_pickle: bool = False,
    batch: int = 1,
) -> Plan:
    """The ``--vram-budget`` plan of a run from the model's configs alone, without weights and
    without touching the device: ``sdpatch plan`` and ``generate --dry-run``. ``device`` is only
    parsed (``cuda`` plans for a GPU this machine need not have)."""
    from sdpatch.models import build_from_configs

    request.validate()
    name = device.strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        target = torch.device(name)
    except RuntimeError:
        raise InputError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if target.type not in ("cpu", "cuda"):
        raise InputError(f"a plan is for cpu or cuda, not {device!r}")
    torch_dtype, _ = resolve_dtype(dtype, target)
    pipe = build_from_configs(resolve_model(model, allow_pickle=allow_pickle), dtype=torch_dtype)
    return plan_from_configs(
        pipe,
        vram_budget,
        device=str(target),
        height=request.height,
        width=request.width,
        batch=batch,
        cfg=request.guidance_scale > 1,
        allow_fp8=allow_fp8,
    )


@dataclass(frozen=True)
class Setup:
    """What a run loads and where, checked by :func:`check_setup` without loading anything."""

    source: ModelSource
    backend: str
    device: torch.device
    dtype: torch.dtype
    notes: list[str]

    def load(self, device: torch.device | None = None) -> Any:
        """Load the pipeline on its device (or on ``device``, e.g. the CPU for a plan that places
        the weights on the GPU itself) and patch it with the backend."""
        if self.device.type == "cuda":
            # Triton launches on the current device, whatever device the tensors are on.
            torch.cuda.set_device(self.device)
        pipe = load_pipeline(self.source, device=device or self.device, dtype=self.dtype)
        apply_backend(pipe, self.backend)
        return pipe


def check_setup(*, model: str, backend: str, device: str, dtype: str, allow_pickle: bool) -> Setup:
    """Check the model, backend, device and dtype a run names; raise InputError for a bad one."""
    if backend not in GENERATE_BACKENDS:
        raise InputError(f"unknown backend {backend!r}: use one of {', '.join(GENERATE_BACKENDS)}")
    torch_device = resolve_device(device)
    torch_dtype, dtype_note = resolve_dtype(dtype, torch_device)
    if backend not in ("stock", "auto"):
        ok, why = backend_status(torch_device)[backend]
        if not ok:
            raise InputError(f"backend {backend!r} cannot run on {torch_device}: {why}")
    source = resolve_model(model, allow_pickle=allow_pickle)
    return Setup(source, backend, torch_device, torch_dtype, [dtype_note] if dtype_note else [])


def apply_backend(pipe: Any, backend: str) -> None:
    """Patch ``pipe`` with ``backend``; ``stock`` leaves it as diffusers made it.

    An explicit backend that cannot serve the VAE's single head of dim 512 (``triton``) serves
    the UNet, and the VAE gets ``auto``, which picks what can run it.
    """
    if backend == "stock":
        return
    from sdpatch.attention import BackendUnavailableError
    from sdpatch.patch import patch_unet

    try:
        patch_unet(pipe, backend=backend)
        return
    except BackendUnavailableError:
        pass
    try:
        patch_unet(pipe, backend=backend, include_vae=False)
    except BackendUnavailableError as err:
        raise InputError(f"backend {backend!r}: {err}") from None
    patch_unet(pipe.vae, backend="auto")


def plan_outputs(
    output: Path | None, seeds: list[int], *, overwrite: bool, prefix: str = "sdpatch-"
) -> list[Path]:
    """The PNG path of each image, checked before anything runs.

    ``output`` is a ``.png`` file (one image only) or a folder (existing, or one new folder in an
    existing one), where image files are named ``<prefix><seed>.png``; None is the current
    folder. Raises InputError for a path in a missing folder, an existing file without
    ``overwrite``, a folder where an image goes, or a file path for several images.
    """
    output = Path(".") if output is None else output
    if output.suffix.lower() == ".png" and not output.is_dir():
        if len(seeds) > 1:
            raise InputError(f"--output {output} is one file, but {len(seeds)} images were asked for: give a folder")
        check_output_file(output, overwrite=overwrite, what="--output")
        return [output]
    if output.suffix and not output.is_dir():
        raise InputError(f"--output {output}: images are written as .png files; give a .png file or a folder")
    if output.exists() and not output.is_dir():
        raise InputError(f"--output {output} exists and is not a folder")
    check_folder(output.parent if not output.exists() else output, "--output")
    paths = [output / f"{prefix}{seed}.png" for seed in seeds]
    for path in paths:
        if path.is_dir():  # --overwrite cannot replace it: the write would fail after the image is made
            raise InputError(f"{path} is a folder, not a file")
        if path.exists() and not overwrite:
            raise InputError(f"{path} already exists (pass --overwrite to replace it)")
    return paths


def check_output_file(path: Path, *, overwrite: bool, what: str) -> None:
    """Raise InputError unless ``path`` can be written: its folder exists, and it does not
    exist yet or ``overwrite`` is set."""
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder, not a file")
    check_folder(path.parent, what)
    if path.exists() and not overwrite:
        raise InputError(f"{path} already exists (pass --overwrite to replace it)")


def png_text(report: GenerationReport, record: ImageRecord) -> dict[str, str]:
    """The text chunks of an image: its settings one by one, and its whole record as JSON."""
    r = report.request
    fields = {
        "prompt": r.prompt,
        "negative_prompt": r.negative_prompt or "",
        "seed": str(record.seed),
        "steps": str(r.steps),
        "guidance_scale": str(r.guidance_scale),
        "size": f"{r.width}x{r.height}",
        "model": report.model,
        "backend": report.backend,
        "device": report.device_name,
        "dtype": report.dtype,
    }
    full = report.to_dict()
    full["images"] = [record.to_dict()]
    full["phases"] = full["images"][0]["phases"]
    full["total"] = full["images"][0]["total"]
    full.pop("patch")  # one row per layer: too long for an image's metadata
    return {**fields, "sdpatch": json.dumps(full)}


def write_png(image: Image.Image, path: Path, text: dict[str, str]) -> None:
    """Write ``image`` to ``path`` with ``text`` chunks, atomically: a temporary file in the same
    folder, then a rename, so a reader never sees a truncated PNG."""
    info = PngInfo()
    for key, value in text.items():
        info.add_itxt(key, value)  # iTXt is UTF-8: prompts may be any language
    atomic_write(path, lambda f: image.save(f, format="PNG", pnginfo=info))


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically."""
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=2).encode()))


def device_name(device: torch.device) -> str:
    """The GPU's name, or what kind of device it is."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU, {torch.get_num_threads()} threads"
    return device.type.upper()


def versions() -> dict[str, str | None]:
    """Versions of the libraries that a measurement depends on (None: not installed)."""
    import diffusers
    import transformers

    try:
        import triton

        triton_version: str | None = triton.__version__
    except Exception:  # noqa: BLE001 (a broken triton install is as good as none)
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
    }


def environment() -> dict[str, Any]:
    """What ``sdpatch info`` shows: versions, GPUs, and each backend's availability here."""
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": props.name, "memory_bytes": props.total_memory})
    device = torch.device("cuda") if gpus else torch.device("cpu")
    status = backend_status(device)
    return {
        "versions": versions(),
        "gpus": gpus,
        "backends_device": str(device),
        "backends": {name: {"available": ok, "reason": why} for name, (ok, why) in status.items()},
        "native_launch": native_launch_status(device, status.get("triton", (False, ""))[0]),
    }


def native_launch_status(device: torch.device, triton_ok: bool) -> str:
    """Whether the triton backend's launches go through sdpatch's C++ launch path (CUDA only)."""
    if device.type != "cuda" or not triton_ok:
        return "not used (it serves the triton backend on CUDA)"
    from .kernels import native

    return native.status()


def check_folder(folder: Path, what: str) -> None:
    folder = folder if str(folder) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{what}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{what}: folder {folder} is not writable")


def atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file beside it, then rename it over."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:  # the file is created inside the try, under a name known before: mkstemp's window between
        # creating it and returning its name once let a Ctrl-C leave one behind
        with open(tmp, "xb") as f:  # a plain file's mode: 0o666 less the umask
            write(f)
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt too: never leave the temporary file behind
        tmp.unlink(missing_ok=True)
        raise


def _patch_report(pipe: Any) -> dict[str, Any] | None:
    """The patch report after the run (with the sequence lengths each layer saw), if patched."""
    from sdpatch.patch import patch_report

    report = patch_report(pipe)
    return report.to_dict() if report.patched else None
