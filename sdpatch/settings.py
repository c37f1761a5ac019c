"""What a run is asked to do: :class:`GenerationRequest` (what ``sdpatch generate`` makes),
:class:`RunOptions` (how: model, device, outputs, memory and speed levers) and
:class:`CompareSettings` (``sdpatch compare``), with the checks of their values.

Nothing here imports torch or diffusers, so that the CLI refuses a bad value (``-H 63``) before
it imports them: that takes seconds, the check microseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdpatch.errors import InputError

# Sanity bounds that turn a typo into an error instead of a hang or an OOM kill. At 16384 px a
# side, each of the VAE decoder's activations is already 64 GiB in fp16.
MAX_SIDE = 16384
MAX_IMAGES = 10_000
MAX_SEED = 2**64 - 1  # the largest seed a torch.Generator takes


@dataclass(frozen=True)
class RunOptions:
    """How a generation runs, carried whole from the CLI to :func:`sdpatch.generate.run`,
    :func:`sdpatch.multi.run_prompts` and :func:`sdpatch.generate.check_setup`.

    ``model``: a preset, a folder, a checkpoint file or a Hub repo id; ``backend``: ``stock`` or one
    of sdpatch's; ``device`` and ``dtype``: ``auto`` or a name. ``output``, ``overwrite``,
    ``report_json``: where results go (:func:`sdpatch.generate.plan_outputs`). ``vram_budget`` (GiB
    or ``"auto"``), ``best_effort`` and ``allow_fp8``: the memory plan (:mod:`sdpatch.planner`).
    ``cuda_graphs`` (None: on for a patched pipeline on CUDA without a plan) and ``compile``: the
    speed levers (:mod:`sdpatch.speed`).
    """

    model: str = "tiny"
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    allow_pickle: bool = False
    output: Path | None = None
    overwrite: bool = False
    report_json: Path | None = None
    vram_budget: float | str | None = None
    best_effort: bool = False
    allow_fp8: bool = False
    cuda_graphs: bool | None = None
    compile: bool = False


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


SIZE_STEP = 64  # --max-size searches square sizes in steps of 64 px
DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"
# sdpatch.attention's backends, each with the module beside its registry that holds its record
# (``BACKEND``): the one table a new backend joins. It lives here, free of torch, so that the CLI
# names and checks backends before importing torch; the registry builds its records from it.
ATTENTION_BACKENDS = {"triton": "triton_backend", "chunked": "chunked", "sdpa": "sdpa"}
# The comparison report's columns that are not sdpatch backends: diffusers as it is, and its own
# attention processors (switched in sdpatch.compare.cells).
COMPARE_PEERS = ("stock", "naive", "sliced", "xformers")
COMPARE_BACKENDS = (*COMPARE_PEERS, *ATTENTION_BACKENDS, "auto")


@dataclass(frozen=True)
class CompareSettings:
    """What a comparison run measures.

    ``sizes`` None: the model's native size, 2× and 4×. ``backends`` None: every backend of
    :data:`sdpatch.compare.DEFAULT_BACKENDS` that can run on the device. The reference backend is ``stock`` when
    it is compared, else the first backend. ``batch`` images per pipeline call (the UNet batch
    is twice that with classifier-free guidance). ``vram_cap_gib`` emulates a smaller GPU.
    ``warmup`` runs one step of the reference before the first cell, and each cell once with one
    step, unmeasured, before measuring it, so that one-time costs (Triton autotuning's scratch buffers, cuDNN plans, cuBLAS workspaces) stay
    out of the figures. ``vram_budget`` (GiB or ``auto``) adds the ``planned`` column: sdpatch
    auto with the levers :func:`sdpatch.planner.fit` picks for each size.
    """

    sizes: tuple[int, ...] | None = None
    backends: tuple[str, ...] | None = None
    prompt: str = DEFAULT_PROMPT
    steps: int = 3
    guidance_scale: float = 7.5
    seed: int = 0
    batch: int = 1
    vram_cap_gib: float | None = None
    max_size: bool = False
    max_size_limit: int = 8192
    warmup: bool = True
    vram_budget: str | None = None

    def validate(self) -> None:
        """Raise InputError for settings no run can use (device-independent checks)."""
        if self.sizes is not None:
            check_sizes(self.sizes)
        if self.backends is not None:
            check_backends(self.backends)
        # The shared rules for steps, guidance and seed.
        GenerationRequest(self.prompt, steps=self.steps, guidance_scale=self.guidance_scale, seed=self.seed).validate()
        if self.batch < 1:
            raise InputError(f"--batch must be at least 1, got {self.batch}")
        if self.vram_cap_gib is not None and not self.vram_cap_gib > 0:
            raise InputError(f"--vram-cap must be a positive number of GiB, got {self.vram_cap_gib}")
        if self.max_size_limit < SIZE_STEP or self.max_size_limit % SIZE_STEP:
            raise InputError(f"--max-size-limit must be a positive multiple of {SIZE_STEP}, got {self.max_size_limit}")
        if self.vram_budget is not None:
            from sdpatch.planner import parse_budget  # the planner imports torch: only when needed

            parse_budget(self.vram_budget, "--vram-budget")

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes) if self.sizes else None,
            "backends": list(self.backends) if self.backends else None,
            "prompt": self.prompt,
            "steps": self.steps,
            "guidance_scale": self.guidance_scale,
            "seed": self.seed,
            "batch": self.batch,
            "vram_cap_gib": self.vram_cap_gib,
            "max_size": self.max_size,
            "max_size_limit": self.max_size_limit if self.max_size else None,
            "warmup": self.warmup,
            "vram_budget": self.vram_budget,
        }


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"512,1024"`` → (512, 1024), checked by :func:`check_sizes`."""
    parts = [p.strip() for p in text.split(",")]
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        raise InputError(f"--sizes must be comma-separated whole numbers of pixels, got {text!r}") from None
    check_sizes(sizes)
    return sizes


def check_sizes(sizes: Sequence[int]) -> None:
    """Raise InputError unless ``sizes`` are distinct positive multiples of 8 (square image sides)."""
    if not sizes:
        raise InputError("--sizes needs at least one size")
    for size in sizes:
        if size <= 0 or size % 8:
            raise InputError(f"--sizes: each size must be a positive multiple of 8, got {size}")
    if len(set(sizes)) != len(sizes):
        raise InputError(f"--sizes: a size is given twice in {','.join(map(str, sizes))}")


def parse_backends(text: str) -> tuple[str, ...]:
    """``"stock,naive"`` → ("stock", "naive"), checked by :func:`check_backends`."""
    backends = tuple(p.strip().lower() for p in text.split(","))
    check_backends(backends)
    return backends


def check_backends(backends: Sequence[str]) -> None:
    """Raise InputError for an empty list, an unknown backend or one named twice."""
    if not backends or not all(backends):
        raise InputError(f"--backends needs comma-separated backend names: {', '.join(COMPARE_BACKENDS)}")
    for name in backends:
        if name not in COMPARE_BACKENDS:
            raise InputError(f"unknown backend {name!r}: use some of {', '.join(COMPARE_BACKENDS)}")
    if len(set(backends)) != len(backends):
        raise InputError("--backends: a backend is named twice")
