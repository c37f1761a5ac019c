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
import os
import re
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
from sdpatch.environment import device_name, environment, versions  # noqa: F401 (environment: re-exported)
from sdpatch.errors import InputError, OutputError, RunError, first_line
from sdpatch.memory import (
    PHASE_LABELS,
    MemoryMeter,
    PhaseStats,
    format_bytes,
    host_available_bytes,
    is_oom,
    plural,
    summarize,
    total,
    weights_bytes,
)
from sdpatch.models import (
    ModelSource,
    default_size,
    load_pipeline,
    resolve_device,
    resolve_dtype,
    resolve_model,
    tokenizer_note,
)
from sdpatch.planner import Plan, fit, parse_budget, plan_from_configs, plan_lines, weight_levers
from sdpatch.progress import Progress
from sdpatch.settings import MAX_IMAGES, MAX_SEED, MAX_SIDE, GenerationRequest, RunOptions  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

GENERATE_BACKENDS = ("stock", *BACKENDS)
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
    speed: dict[str, Any] | None = None  # CUDA graphs and compilation: what was applied, what they did
    notes: list[str] = field(default_factory=list)
    images: list[ImageRecord] = field(default_factory=list)
    complete: bool = False

    @property
    def phases(self) -> list[PhaseStats]:
        """Each phase over all images: mean time, highest peaks."""
        return summarize(r.phases for r in self.images)

    @property
    def measured_peak(self) -> int | None:
        """The peak a --vram-budget is about: PyTorch's peak reserved on CUDA, else host memory."""
        peak = total(self.phases)
        return peak.peak_reserved if self.memory_kind == "cuda" else peak.peak_host

    @property
    def budget_miss(self) -> str | None:
        """How the run missed its --vram-budget, in one line; None within it (or without one)."""
        measured = self.measured_peak
        if not self.plan or not self.images or measured is None or measured <= self.plan["budget_bytes"]:
            return None
        return (
            f"the run missed --vram-budget {self.plan['budget']}: measured {format_bytes(measured)}, "
            f"{format_bytes(measured - self.plan['budget_bytes'])} over"
        )

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
            "speed": self.speed,
            "environment": versions(),
        }

    def format_table(self) -> str:
        """A small text table: one row per phase and a total, then the weights' size."""
        r = self.request
        n = len(self.images)
        head = (
            f"{self.model} · backend {self.backend} · {self.device_name} ({self.device}) · {self.dtype} · "
            f"{r.width}×{r.height} · {plural(r.steps, 'step')} · {plural(n, 'image')}"
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
        lines.extend(speed_lines(self.speed))
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
            lines.extend(plan_lines(self.plan, self.measured_peak))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


@dataclass
class GenerationResult:
    """Images of a run (PIL, in seed order) and its report."""

    images: list[Image.Image]
    report: GenerationReport


def speed_lines(speed: dict[str, Any] | None) -> list[str]:
    """The report's lines on CUDA graphs and compilation."""
    if not speed:
        return []
    lines = []
    for name, st in (speed.get("graphs") or {}).items():
        eager = st["eager_calls"]
        lines.append(
            f"CUDA graphs ({name}): {st['graphs']} captured in {st['capture_s']:.2f} s"
            + (f", {st['stand_in_replays']} replays with SDPA standing in for kernels compiling in the background"
               if st.get("stand_in_replays") else "")
            + (f", {st['recaptures']} captured again once they had compiled ({st['compile_s']:.2f} s)"
               if st.get("recaptures") else "") + ", pool "
            f"{format_bytes(st['pool_bytes'])}, {st['replays']} calls replayed, {eager} eager"
            + (f" ({'; '.join(f'{r}: {n}' for r, n in st['eager_reasons'].items())})" if eager else "")
        )
    if speed.get("stand_in_calls") and not speed.get("graphs"):
        lines.append(f"SDPA stood in for {speed['stand_in_calls']} attention calls while their kernels compiled "
                     "in the background")
    if speed.get("compiling_in_background"):
        lines.append("kernels still compiling in the background: the process exits once they are done, "
                     "and later runs find them in Triton's cache")
    if speed.get("compile"):
        lines.append("compiled: the UNet's transformer models and ResNet blocks (torch.compile, regional; on-disk caches)")
    return lines


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
    progress: Progress | None = None,
) -> list[Image.Image]:
    """One pipeline call, measured as three phases appended to ``meter.phases``, and shown as
    they run on ``progress``.

    Text encoding runs through the pipeline's own ``encode_prompt``; the embeddings then go into
    the pipeline call, whose last step callback is the boundary between the denoising loop and
    VAE decode (the decode, safety checker if any, and post-processing). The initial noise comes
    from a CPU generator, so a seed gives the same latents on every device.

    Returns the images; the denoising phase also records each step's wall time. On an exception
    ``meter.current`` names the phase that failed.
    """
    device = pipe._execution_device
    cfg = guidance_scale > 1.0  # diffusers' own rule for classifier-free guidance
    progress = progress or Progress(enabled=False)
    progress.phase(PHASE_LABELS["text_encoding"])
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
        progress.advance()
        if i == pipeline.num_timesteps - 1:
            meter.switch("vae_decode")
            progress.phase(PHASE_LABELS["vae_decode"])
        return {}

    progress.phase(PHASE_LABELS["denoising"], total=steps)
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
    progress: Progress | bool = True,
    on_image: Callable[[ImageRecord], None] | None = None,
    plan: dict[str, Any] | None = None,
    speed: dict[str, Any] | None = None,
    prompt_label: str = "the prompt",
) -> GenerationResult:
    """Generate ``request`` on a loaded (and maybe patched) pipeline, one image at a time.

    Args:
        pipe: a StableDiffusionPipeline or StableDiffusionXLPipeline.
        request: what to generate; its None height/width become the model's native size.
        model: the model's name, for the report.
        backend: the attention backend the pipeline was patched with (``stock``: unpatched).
        outputs: one PNG path per image (see :func:`plan_outputs`), or None to write nothing.
            Each image is written atomically as soon as it is done, so an interrupted run, or
            one whose write fails (OutputError), keeps the images it finished.
        report_json: where to write the report; rewritten (atomically) after every image, so
            it is valid JSON and covers the finished images at any moment.
        notes: lines to carry in the report (e.g. a dtype substitution).
        progress: the progress line to show the phases on (True: a new one, drawn on a terminal).
        on_image: called with each image's record once it is written.
        plan: the memory plan applied to ``pipe`` (:meth:`sdpatch.planner.Plan.to_dict`), for the report.
        speed: the speed levers applied to ``pipe`` (:meth:`sdpatch.speed.SpeedSetup.to_dict`), for the report.
        prompt_label: how a warning about a prompt too long for the text encoder names it.

    A prompt longer than the text encoder reads is cut by diffusers; a warning says so, and the
    report and PNGs keep only the part that was read (:func:`read_prompt`). Running out of host
    memory raises RunError, naming the phase.
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
    progress = Progress.of(progress)
    pipe.set_progress_bar_config(disable=True)  # the progress line shows the steps instead
    device = pipe._execution_device
    meter = MemoryMeter(device)
    notes = list(notes or [])
    prompt, prompt_note = read_prompt(pipe.tokenizer, request.prompt, prompt_label)
    negative, negative_note = read_prompt(pipe.tokenizer, request.negative_prompt or "", "--negative-prompt")
    for note in (prompt_note, negative_note):
        if note:
            logger.warning("%s", note)
            notes.append(note)
    report = GenerationReport(
        model=model,
        backend=backend,
        device=str(device),
        device_name=device_name(device),
        dtype=str(pipe.unet.dtype).removeprefix("torch."),
        request=replace(request, prompt=prompt, negative_prompt=negative if request.negative_prompt else None),
        memory_kind=meter.kind,
        host_scope=None,
        weights=weights_bytes(pipe.components),
        plan=plan,
        notes=notes,
    )
    images: list[Image.Image] = []
    if report_json is not None:  # from the start, an interrupted run leaves a valid report
        write_json(report_json, report.to_dict())
    for index, seed in enumerate(request.seeds):
        if request.num_images > 1:
            progress.context["image"] = f"image {index + 1}/{request.num_images}"
        meter.phases = []
        try:
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
                progress=progress,
            )
        except Exception as err:
            if meter.kind == "host" and is_oom(err):
                where = "in " + PHASE_LABELS.get(meter.current or "", meter.current or "setup")
                raise RunError(host_oom_message(where, err, index)) from err
            raise
        image = batch[0]
        record = ImageRecord(index, seed, None, meter.phases)
        report.host_scope = meter.host_scope
        if outputs is not None:
            record.path = str(outputs[index])
            try:
                write_png(image, outputs[index], png_text(report, record))
            except OutputError as err:
                raise OutputError(f"{err}{_kept(index)}") from err
            logger.info("wrote %s", record.path)
        images.append(image)
        report.images.append(record)
        report.complete = index == request.num_images - 1
        report.patch = _patch_report(pipe)
        report.speed = _speed_report(pipe, speed)
        if report_json is not None:
            write_json(report_json, report.to_dict())
        if on_image is not None:
            on_image(record)
    progress.context.pop("image", None)
    return GenerationResult(images, report)


def read_prompt(tokenizer: Any, text: str, label: str) -> tuple[str, str | None]:
    """The part of ``text`` that the text encoder reads, and a warning if that is not all of it.

    diffusers cuts a prompt to the tokenizer's ``model_max_length`` (77 for CLIP, with its start
    and end tokens). The part returned is the shortest prefix of ``text`` whose tokens begin with
    the same ones, so that it makes the same image; the search doubles the prefix, then bisects,
    which keeps a long prompt to a few tokenizer calls of about the kept length.
    """
    limit = tokenizer.model_max_length - 2
    if not text or limit <= 0:
        return text, None
    ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    if len(ids) <= limit:
        return text, None
    head = ids[:limit]

    def reads_the_same(n: int) -> bool:
        return tokenizer(text[:n], add_special_tokens=False, verbose=False).input_ids[:limit] == head

    lo, hi = 0, limit
    while hi < len(text) and not reads_the_same(hi):
        lo, hi = hi, min(2 * hi, len(text))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reads_the_same(mid) else (mid, hi)
    kept = text[:hi]
    dropped = tokenizer.decode(ids[limit : limit + 8]).strip()
    note = (
        f"{label} is {len(ids)} tokens long and the text encoder reads only the first {limit}: the rest "
        f"(from {dropped + '…'!r}) is ignored; the images' metadata keep only the part it reads "
        f"({len(kept)} of {len(text)} characters)"
    )
    return kept, note


def _kept(images: int) -> str:
    """What a run that failed after ``images`` images leaves."""
    if not images:
        return ""
    return f"; the {plural(images, 'image')} written before it {'is' if images == 1 else 'are'} kept"


def host_oom_message(where: str, err: BaseException, images_done: int) -> str:
    """One line for a run that ran out of host memory ``where`` (a phase), and what it asked for."""
    asked = re.search(r"allocate (\d+) bytes", str(err))
    need = f": it asked for {format_bytes(int(asked.group(1)))} more" if asked else ""
    free = format_bytes(host_available_bytes())
    kept = _kept(images_done)
    return (
        f"out of host memory {where}{need} ({free} available now); "
        f"--vram-budget GIB plans memory levers (tiled VAE decode, attention and feed-forward chunking) "
        f"to fit a budget{kept}"
    )


def run(
    request: GenerationRequest,
    options: RunOptions = RunOptions(),
    *,
    progress: Progress | bool = True,
    on_image: Callable[[ImageRecord], None] | None = None,
) -> GenerationResult:
    """What ``sdpatch generate`` does: check every input, then load, patch and generate.

    Everything that can be checked without loading weights is checked first and raises
    InputError, before anything is loaded or written. See :func:`plan_outputs` for ``output``.
    ``options.vram_budget`` (GiB or ``"auto"``) plans and applies memory levers (:func:`sdpatch.planner.fit`)
    before generating; a budget that cannot be met raises InputError then, unless ``best_effort``;
    one that the run misses shows in ``report.budget_miss``. A plan that moves weights off the GPU
    (planned from the configs first) loads the model on the CPU, so that the weights reach the GPU
    only as the plan places them. ``allow_fp8``: the plan may store the UNet's weights in fp8
    (approximate). ``progress`` shows the model's build or load and then each image's phases (True:
    a progress line drawn on a terminal). ``cuda_graphs`` (None: on for a patched pipeline on CUDA,
    unless a budget is planned) and ``compile``: see :func:`sdpatch.speed.speed_up`.
    """
    model, backend, dtype = options.model, options.backend, options.dtype
    output, overwrite, report_json = options.output, options.overwrite, options.report_json
    vram_budget, best_effort, allow_fp8 = options.vram_budget, options.best_effort, options.allow_fp8
    request.validate()
    if vram_budget is not None:
        parse_budget(vram_budget, "--vram-budget")
    elif best_effort or allow_fp8:
        raise InputError(f"{'--best-effort' if best_effort else '--allow-fp8'} is only used with --vram-budget")
    setup = check_setup(options)
    outputs = plan_outputs(output, request.seeds, overwrite=overwrite)
    if report_json is not None:
        check_output_file(report_json, overwrite=overwrite, what="--report-json", new_folder=outputs[0].parent)
        if report_json.resolve() in {p.resolve() for p in outputs}:
            raise InputError("--report-json must not be one of the image paths")

    cfg = request.guidance_scale > 1  # diffusers' rule for classifier-free guidance
    on_cpu_first = False
    if vram_budget is not None and setup.device.type == "cuda" and parse_budget(vram_budget, "--vram-budget") != "auto":
        ahead = dry_run(request, model=model, device=str(setup.device), dtype=dtype, vram_budget=vram_budget, allow_fp8=allow_fp8)
        on_cpu_first = weight_levers(ahead.levers)
    progress = Progress.of(progress)
    try:
        pipe = setup.load(progress, torch.device("cpu") if on_cpu_first else None)
    except Exception as err:
        if setup.device.type != "cuda" and is_oom(err):
            verb = "building" if setup.source.kind == "preset" else "loading"
            raise RunError(host_oom_message(f"while {verb} {model}", err, 0)) from err
        raise
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
            speed=setup.speed,
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
    cuda_graphs: bool = False
    compile: bool = False
    speed: dict[str, Any] = field(default_factory=dict)  # what load() applied (SpeedSetup.to_dict)

    def load(self, progress: Progress | None = None, device: torch.device | None = None) -> Any:
        """Load the pipeline on its device (or on ``device``, e.g. the CPU for a plan that places
        the weights on the GPU itself), patch it with the backend, apply the speed levers."""
        from sdpatch.speed import speed_up

        if progress is not None:
            verb = "building" if self.source.kind == "preset" else "loading"
            progress.phase(f"{verb} {self.source.name} on {self.device}")
        if self.device.type == "cuda":
            # Triton launches on the current device, whatever device the tensors are on.
            torch.cuda.set_device(self.device)
        pipe = load_pipeline(self.source, device=device or self.device, dtype=self.dtype)
        apply_backend(pipe, self.backend)
        applied = speed_up(pipe, cuda_graphs=self.cuda_graphs, compile=self.compile)
        self.speed.update(applied.to_dict())
        self.notes.extend(applied.notes)
        return pipe


def check_setup(options: RunOptions) -> Setup:
    """Check the model, backend, device and dtype a run names; raise InputError for a bad one.

    ``cuda_graphs`` None is on for a patched pipeline on CUDA without a memory plan: the graphs'
    pool is memory the planner does not budget, and ``stock`` means diffusers as it is."""
    backend, model, cuda_graphs = options.backend, options.model, options.cuda_graphs
    planned = options.vram_budget is not None
    if backend not in GENERATE_BACKENDS:
        raise InputError(f"unknown backend {backend!r}: use one of {', '.join(GENERATE_BACKENDS)}")
    torch_device = resolve_device(options.device)
    torch_dtype, dtype_note = resolve_dtype(options.dtype, torch_device)
    if backend not in ("stock", "auto"):
        ok, why = backend_status(torch_device)[backend]
        if not ok:
            raise InputError(f"backend {backend!r} cannot run on {torch_device}: {why}")
    source = resolve_model(model, allow_pickle=options.allow_pickle)
    notes = [n for n in (dtype_note, tokenizer_note(model)) if n]
    if cuda_graphs is None:
        cuda_graphs = torch_device.type == "cuda" and backend != "stock" and not planned
        if planned and torch_device.type == "cuda" and backend != "stock":
            notes.append("CUDA graphs off: --vram-budget plans memory without their pool")
    return Setup(source, backend, torch_device, torch_dtype, notes, cuda_graphs=cuda_graphs, compile=options.compile)


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


def check_output_file(path: Path, *, overwrite: bool, what: str, new_folder: Path | None = None) -> None:
    """Raise InputError unless ``path`` can be written: its folder exists (or is ``new_folder``,
    which the run creates in an existing folder), and it does not exist yet or ``overwrite`` is set."""
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder, not a file")
    folder = path.parent
    if new_folder is not None and not folder.exists() and folder.resolve() == new_folder.resolve():
        folder = folder.parent
    check_folder(folder, what)
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
    full["complete"] = True  # the record of this one image, which is finished
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


def check_folder(folder: Path, what: str) -> None:
    """Raise InputError unless files can be made in ``folder``: a probe file is written and removed,
    which finds what permission bits do not (a read-only mount, /proc, a full disk)."""
    folder = folder if str(folder) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{what}: folder {folder} does not exist")
    probe = folder / f".sdpatch-probe-{secrets.token_hex(4)}"
    try:
        with open(probe, "xb") as f:
            f.write(b"sdpatch")
    except OSError as err:
        raise InputError(f"{what}: cannot write in folder {folder}: {err.strerror or first_line(err)}") from None
    finally:
        probe.unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file beside it, then rename it over.

    A failed write (a full disk, say) raises OutputError and leaves neither file behind.
    """
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:  # the file is created inside the try, under a name known before: mkstemp's window between
        # creating it and returning its name once let a Ctrl-C leave one behind
        with open(tmp, "xb") as f:  # a plain file's mode: 0o666 less the umask
            write(f)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {err.strerror or first_line(err)}") from err
    except BaseException:  # KeyboardInterrupt too: never leave the temporary file behind
        tmp.unlink(missing_ok=True)
        raise


def _speed_report(pipe: Any, speed: dict[str, Any] | None) -> dict[str, Any] | None:
    """The speed levers applied, with what each graphed component's graphs did so far."""
    from sdpatch import graphs
    from sdpatch.speed import graph_stats

    stats = graph_stats(pipe)
    if not speed and not stats:
        return None
    return {**(speed or {}), "graphs": stats, "compiling_in_background": graphs.compiling_later(),
            "stand_in_calls": graphs.stand_in_calls()}


def _patch_report(pipe: Any) -> dict[str, Any] | None:
    """The patch report after the run (with the sequence lengths each layer saw), if patched."""
    from sdpatch.patch import patch_report

    report = patch_report(pipe)
    return report.to_dict() if report.patched else None
