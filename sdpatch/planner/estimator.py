"""Fit a generation into a memory budget: ``sdpatch generate --vram-budget`` and :func:`plan`.

Two halves:

- **The estimator** (:func:`estimate`): an analytic model of the peak memory of each phase of a
  generation (text encoding, denoising, VAE decode), from the components' configs and the
  weights' size. It replays, block by block, the allocations and frees of diffusers' forward
  passes (the UNet's skip connections, each ResNet's norm/SiLU/conv temporaries, each
  transformer block's attention projections and GEGLU feed-forward, the VAE decoder's
  upsampling), which gives the live bytes a caching allocator sees, without its rounding. On
  CUDA it adds cuDNN's convolution workspace, and the allocator's reserve over allocated.
- **The planner** (:func:`plan_for`, :func:`plan`): given a budget, it takes levers cheapest first
  until the estimate fits (:data:`LEVER_ORDER`), then relaxes each graded lever back to its
  mildest setting that still fits. :func:`apply_plan` puts a plan in place on a pipeline and
  :func:`remove_plan` takes it out again.

Calibration (H200, fp16, torch 2.11, DESIGN.md and docs/benchmarks.md, 2026-11-30): the liveness
alone reproduces the SD 1.5 UNet call peaks over the weights exactly (131 / 520 / 2080 MiB at
512 / 1024 / 2048 px, batch 2); the VAE decode and SDXL UNet peaks sit above liveness by one
convolution's input plus output bytes (:data:`CONV_WORKSPACE`). What this does not model: Triton
autotuning's scratch buffer on a shape's first run, and reserved memory under expandable
segments, which was never measured (:data:`RESERVE_OVER_ACTIVATIONS`). ``scripts/check_planner.py``
compares estimates with measured peaks on a GPU.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from sdpatch.attention.chunked import DEFAULT_CHUNK_BUDGET
from sdpatch.errors import InputError
from sdpatch.memory import MIB, PHASE_LABELS, format_bytes, host_resident_bytes, weights_bytes

logger = logging.getLogger(__name__)

GIB = 1024**3

# cuDNN convolutions (fp16, H200) take a workspace of about their input plus their output bytes,
# as an NCHW -> NHWC copy of both would. Fitted on the measurements the liveness model falls short
# of (DESIGN.md): VAE decode peak over the weights 610 MiB / 2.4 GiB / 9.5 GiB at 512 / 1024 /
# 2048 px, where liveness alone gives 384 / 1536 / 6144 MiB and the 256 -> 256 channel upsampler
# conv at full size holds 352 / 1408 / 5632 MiB plus 256 / 1024 / 4096 MiB in and out; SDXL UNet
# call 325 MiB / 1.3 GiB at 1024 / 2048 px (docs/benchmarks.md: 325 / 1286 MiB), liveness
# 315 / 1260 MiB. A factor of 1.0 gives 608 MiB / 2.38 / 9.50 GiB and 320 / 1280 MiB.
CONV_WORKSPACE = 1.0
# Reserved over allocated, as a factor on the activations (the weights are allocated once, in
# blocks that stay). Without expandable segments, from SD 1.5 stock end to end (DESIGN.md: 3.1 /
# 3.7, 4.9 / 6.9, 12.0 / 19.9 GiB allocated / reserved over 2.58 GiB of weights and this model's
# decode peaks of 0.59 / 2.38 / 9.50 GiB): activations reserve 1.89 / 1.82 / 1.82x what they
# allocate where the VAE decode is the peak (1.13x in the tiled run, where the UNet is; the
# README's sd15 run: 1.85x stock, 1.35x auto). With expandable segments (scripts/check_planner.py,
# H200, 2026-11-30): full-size VAE decodes reserve 1.14-1.16x their activations (SD 1.5 and SDXL
# at 512-2048 px), the UNet 1.06-1.28x (SDXL 2048 px highest). 1.10, assumed before that run,
# underestimated SDXL 2048 px with an 8 GiB budget by 5 % (8.40 GiB reserved against 7.96), so
# the plan missed its budget; 1.16 would have estimated 8.07 and added split CFG.
RESERVE_OVER_ACTIVATIONS = {True: 1.16, False: 1.90}
# On the host the budget is the process's resident memory, which holds more than the tensors do:
# glibc's heap keeps freed blocks below its (growing) mmap threshold, oneDNN reorders each
# convolution's input and output (as CONV_WORKSPACE models) and its weights into blocked layouts
# outside PyTorch's allocator, and a first call maps code and JIT-compiles kernels. Measured on the
# CPU (torch 2.13, glibc, 1 thread, fp32, 2026-12-01): with MALLOC_MMAP_THRESHOLD_ fixed, resident
# memory over the liveness peak was a first call's 14-20 MiB (tiny) and 63-86 MiB (sd15 at 256 px:
# its largest convolution's weights, 118 MiB in fp32, are reordered); glibc's default adds
# 0.3-1.9x the activations. 1.5x the activations with the convolutions' workspace, the largest
# convolution's weights and HOST_FIRST_RUN: sd15 256 px (issue 32's case, 4.63 GiB estimated,
# 4.82-4.90 measured) is estimated within +1 %, tiny at 128-512 px within -4...+6 % (the tiny
# 256 px decode is the one under).
HOST_RESERVE_OVER_ACTIVATIONS = 1.5
HOST_FIRST_RUN = 16 * MIB
# Triton's autotuner benchmarks with a 256 MB L2-flush buffer (triton.testing.do_bench): the
# README's first sd15 run shows it, 2.34 GiB denoising peak against 1.99 + 0.13 GiB.
TRITON_AUTOTUNE_SCRATCH = 256 * 10**6

PHASES = tuple(PHASE_LABELS)
# The levers, cheapest first. The allocator setting costs nothing; flash-style attention and
# smaller chunks of the chunked backend cost a little speed; feed-forward chunking, more kernel
# launches; split CFG, the batch's efficiency at small sizes; tiled decode, exactness (the tiles'
# seams are blended); CPU offload, a copy of each model to the GPU on every call.
# The weight levers move weights off the GPU: the text encoders to the CPU between their calls
# (one copy per image; exact, so before tiled decode); model CPU offload (every model, one copy per call); diffusers'
# group offload of the UNet with CUDA streams (every step streams the UNet's weights); fp8 weight
# storage (approximate: only with ``allow_fp8``); accelerate's sequential offload (every layer's
# weights copied when it runs, without overlap).
LEVER_ORDER = (
    "allocator",
    "attention",
    "ff_chunking",
    "split_cfg",
    "text_encoder_offload",
    "vae_tiling",
    "cpu_offload",
    "group_offload",
    "fp8_storage",
    "sequential_offload",
)
EXACT_LEVERS = frozenset(LEVER_ORDER) - {"vae_tiling", "fp8_storage"}
GROUP_OFFLOAD_TYPES = ("block_level", "leaf_level")  # diffusers' offload_type, mildest first
# The cost model: each weight lever's factor on a denoising step, measured on an H200 (issue 29,
# SDXL UNet at 1024² and batch 2, fp16, torch 2.11, diffusers 0.42.1: 142 ms per step without a
# lever). Group offload streams every weight each step, so the factor shrinks where the step's
# compute grows (larger images); at smaller ones it may be larger. Not measured: sequential
# offload (assumed no faster than leaf-level group offload without streams, 2x its factor), and
# the per-image copies of the text encoder and model offloads, counted in seconds at
# HOST_TO_DEVICE_BYTES_PER_S.
STEP_SLOWDOWN = {
    "group_offload:block_level": 455 / 142,
    "group_offload:leaf_level": 350 / 142,
    "fp8_storage": 259 / 142,
    "sequential_offload": 2 * 350 / 142,
}
HOST_TO_DEVICE_BYTES_PER_S = 12e9  # pageable copies over PCIe 4/5 x16: an assumption, not measured
FF_CHUNKS = (2, 4, 8, 16)
CHUNK_BUDGETS = (64 * MIB, 16 * MIB, 4 * MIB)
MIN_VAE_TILE = 128  # pixels: tiles are halved down to this (or the VAE's own tile, if smaller)
MIN_GAIN = MIB  # a lever is taken for what it saves, not for rounding
TEXT_TOKENS = 77  # CLIP's context: diffusers pads every prompt to it


class PlannerError(InputError):
    """The planner cannot model this pipeline (an unknown block type), or a budget is malformed."""


# -- what the estimator needs to know about a pipeline ------------------------------------------


@dataclass(frozen=True)
class AttentionCost:
    """How a component's attention layers use memory beyond their output.

    ``flash``: nothing (PyTorch SDPA, sdpatch's triton and sdpa backends, xformers). ``chunked``:
    sdpatch's chunked backend, a score buffer of at most ``budget`` bytes (its formula is the
    backend's own, :func:`sdpatch.attention.chunked.workspace`). ``materialized``: diffusers'
    ``AttnProcessor`` (``slice`` None) or ``SlicedAttnProcessor`` (``slice`` batch x heads rows
    at a time), counted roughly as the score matrix and its softmax: the planner only replaces
    these, it does not plan with them.
    """

    kind: Literal["flash", "chunked", "materialized"] = "flash"
    budget: int = DEFAULT_CHUNK_BUDGET
    slice: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the estimator uses: configs, weights, dtype, attention costs.

    ``weights`` are bytes per component; ``resident`` names the components whose weights are on
    the run device now. ``vae_upcast``: the pipeline decodes in fp32 (SDXL's ``force_upcast``).
    ``attention`` is each component's attention cost now (keys ``unet``, ``vae``);
    ``auto_attention`` what sdpatch's ``auto`` backend would give it on this device.
    """

    unet: dict[str, Any]
    vae: dict[str, Any]
    text_encoders: tuple[dict[str, Any], ...]
    weights: dict[str, int]
    resident: frozenset[str]
    dtype_bytes: int
    vae_upcast: bool = False
    attention: dict[str, AttentionCost] = field(default_factory=dict)
    auto_attention: dict[str, AttentionCost] = field(default_factory=dict)  # what sdpatch auto would give
    triton: bool = False  # some layer runs sdpatch's Triton kernel: autotuning on a first run
    # Per component, its weights' bytes on the device while it runs under each offload kind
    # (:func:`offload_footprints`); offloaded, an idle component holds none there.
    footprints: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def vae_scale(self) -> int:
        return 2 ** (len(self.vae["block_out_channels"]) - 1)

    @property
    def default_tile(self) -> int:
        """diffusers' VAE tile side in pixels: the VAE's ``sample_size``."""
        size = self.vae["sample_size"]
        return int(size[0] if isinstance(size, (list, tuple)) else size)


@dataclass(frozen=True)
class RunShape:
    """What one pipeline call generates: size, images per call, classifier-free guidance."""

    height: int
    width: int
    batch: int = 1
    cfg: bool = True

    @property
    def unet_batch(self) -> int:
        return self.batch * (2 if self.cfg else 1)


@dataclass(frozen=True)
class Levers:
    """Settings of every lever; the defaults change nothing.

    ``flash_attention``: diffusers' materializing processors become sdpatch ``auto``.
    ``chunk_budget``: score-buffer bytes of sdpatch's chunked attention (None: as set).
    ``ff_chunks``: token chunks of each transformer feed-forward. ``unet_micro_batch``: the UNet
    batch runs in calls of at most this many samples (half the batch: split CFG). ``vae_tile``:
    tiled VAE decode with tiles of this many pixels a side. ``text_encoder_offload``: the text
    encoders on the CPU except during their call (accelerate's ``cpu_offload_with_hook``).
    ``cpu_offload``: diffusers' model CPU offload. ``group_offload``: diffusers' group offload of
    the UNet (``block_level`` or ``leaf_level``, with CUDA streams). ``fp8_storage``: the UNet's
    weights stored in fp8 (diffusers' layerwise casting), cast on the CPU. ``sequential_offload``:
    diffusers' sequential CPU offload of every model.
    """

    expandable_segments: bool = False
    flash_attention: bool = False
    chunk_budget: int | None = None
    ff_chunks: int = 1
    unet_micro_batch: int | None = None
    vae_tile: int | None = None
    text_encoder_offload: bool = False
    cpu_offload: bool = False
    group_offload: str | None = None
    fp8_storage: bool = False
    sequential_offload: bool = False


# -- the liveness model ---------------------------------------------------------------------------


class _Live:
    """Bytes alive during a forward pass, allocation by allocation, and their peak.

    ``new`` allocates an op's output, ``free`` releases tensors whose last reference is gone.
    ``workspace`` (bytes) is held only while the op runs: cuDNN's convolution workspace, an
    attention score buffer.
    """

    def __init__(self, conv_workspace: float) -> None:
        self.now = 0
        self.peak = 0
        self.site = ""
        self.conv_workspace = conv_workspace

    def new(self, nbytes: float, site: str, workspace: float = 0) -> float:
        self.now += nbytes
        if self.now + workspace > self.peak:
            self.peak, self.site = self.now + workspace, site
        return nbytes

    def conv(self, nbytes_in: float, nbytes_out: float, site: str) -> float:
        return self.new(nbytes_out, site, self.conv_workspace * (nbytes_in + nbytes_out))

    def free(self, *nbytes: float) -> None:
        self.now -= sum(nbytes)


@dataclass(frozen=True)
class _Grid:
    """A feature map's spatial size, batch and element bytes; ``g(c)`` is the bytes of ``c`` channels."""

    h: int
    w: int
    batch: int
    elem: int

    def __call__(self, channels: float) -> float:
        return channels * self.h * self.w * self.batch * self.elem

    @property
    def tokens(self) -> int:
        return self.h * self.w

    def down(self) -> _Grid:
        # A 3x3 stride-2 convolution with padding 1: ceil(n / 2).
        return replace(self, h=-(-self.h // 2), w=-(-self.w // 2))

    def up(self) -> _Grid:
        return replace(self, h=self.h * 2, w=self.w * 2)


def _resnet(m: _Live, g: _Grid, c_in: int, c_out: int, site: str, temb: bool = True) -> float:
    """diffusers' ResnetBlock2D on an input its caller holds; returns the output's bytes."""
    a = m.new(g(c_in), site)  # norm1
    b = m.new(g(c_in), site)  # SiLU, while the norm's output is still bound
    m.free(a)
    c = m.conv(b, g(c_out), site + ".conv1")
    m.free(b)
    if temb:  # + the time embedding: a new tensor
        d = m.new(g(c_out), site)
        m.free(c)
        c = d
    e = m.new(g(c_out), site)  # norm2
    m.free(c)
    f = m.new(g(c_out), site)  # SiLU
    m.free(e)
    h = m.conv(f, g(c_out), site + ".conv2")
    m.free(f)
    s = m.conv(g(c_in), g(c_out), site + ".conv_shortcut") if c_in != c_out else 0
    t = m.new(g(c_out), site)  # input + h
    out = m.new(g(c_out), site)  # / output_scale_factor
    m.free(t, h, s)
    return out


def _score_buffer(
    cost: AttentionCost, batch: int, heads: int, nq: int, nk: int, head_dim: int, elem: int, upcast: bool = False
) -> float:
    """Bytes an attention call holds beyond q, k, v and its output; ``upcast``: fp32 scores. An
    sdpatch backend's is its own formula (:func:`sdpatch.attention.workspace_bytes`)."""
    if cost.kind == "flash":
        return 0
    if cost.kind == "materialized":
        rows = batch * heads if cost.slice is None else min(cost.slice, batch * heads)
        return 2 * rows * nq * nk * (4 if upcast else elem)  # the scores and their softmax
    from sdpatch.attention import workspace_bytes

    return workspace_bytes("chunked", batch=batch, heads=heads, nq=nq, nk=nk, head_dim=head_dim, elem=elem,
                           chunk_budget=cost.budget, upcast=upcast)


def _attention(
    m: _Live, g: _Grid, channels: int, heads: int, kv_tokens: int | None, cost: AttentionCost, site: str
) -> float:
    """diffusers' Attention on (B, N, C) input, AttnProcessor2_0's recipe (sdpatch's processor
    follows it); ``kv_tokens`` None for self-attention. Returns the output's bytes."""
    x = g(channels)
    kv = x if kv_tokens is None else channels * kv_tokens * g.batch * g.elem
    q = m.new(x, site)
    k = m.new(2 * kv, site)  # k and v
    buffer = _score_buffer(cost, g.batch, heads, g.tokens, kv_tokens or g.tokens, channels // heads, g.elem)
    # Laid out like q, (B, N, H, D) in memory (every SDPA kernel, sdpatch's too): back to
    # (B, N, H * D) is a view.
    o = m.new(x, site + ".attention", buffer)
    lin = m.new(x, site)  # to_out
    m.free(o)
    out = m.new(x, site)  # / rescale_output_factor
    m.free(lin, q, k)
    return out


def _feed_forward(m: _Live, g: _Grid, dim: int, inner: int, chunks: int, site: str) -> float:
    """diffusers' FeedForward with GEGLU (a projection to 2 x inner, GELU of the gate, their product,
    a projection back), in ``chunks`` token chunks written into one output (:class:`_ChunkedFeedForward`)."""
    if chunks <= 1:
        p = m.new(g(2 * inner), site + ".ff")
        gelu = m.new(g(inner), site + ".ff")
        y = m.new(g(inner), site + ".ff")
        m.free(p, gelu)
        out = m.new(g(dim), site + ".ff")
        m.free(y)
        return out
    out = m.new(g(dim), site + ".ff")
    part = -(-g.tokens // chunks) / g.tokens  # the first chunk is the largest
    copy = g(dim) * part if g.batch > 1 else 0  # a token slice of a batch > 1 is strided: Linear copies it
    peak = m.new(copy + g(4 * inner) * part, site + ".ff")
    m.free(peak)
    return out


def _transformer(
    m: _Live,
    g: _Grid,
    channels: int,
    heads: int,
    depth: int,
    linear: bool,
    ff_chunks: int,
    cost: AttentionCost,
    site: str,
) -> float:
    """diffusers' Transformer2DModel (continuous input) on an input its caller holds."""
    n = m.new(g(channels), site)  # GroupNorm
    if linear:
        r = m.new(g(channels), site)  # (B, C, H, W) -> (B, HW, C) is a copy
        m.free(n)
        hs = m.new(g(channels), site)  # proj_in
        m.free(r)
    else:
        p = m.conv(n, g(channels), site + ".proj_in")
        m.free(n)
        hs = m.new(g(channels), site)  # the copy to (B, HW, C)
        m.free(p)
    for j in range(depth):
        block = f"{site}.transformer_blocks.{j}"
        n1 = m.new(g(channels), block)
        a1 = _attention(m, g, channels, heads, None, cost, block + ".attn1")
        h2 = m.new(g(channels), block)  # + residual
        n2 = m.new(g(channels), block)
        m.free(n1)
        a2 = _attention(m, g, channels, heads, TEXT_TOKENS, cost, block + ".attn2")
        m.free(a1)  # attn_output now names attn2's result, which it keeps until the block returns
        h3 = m.new(g(channels), block)
        m.free(h2)
        n3 = m.new(g(channels), block)
        m.free(n2)
        f = _feed_forward(m, g, channels, 4 * channels, ff_chunks, block)
        out = m.new(g(channels), block)
        m.free(f, h3, n3, a2, hs)  # the block's input goes when the caller rebinds it
        hs = out
    if linear:
        o = m.new(g(channels), site)  # proj_out
        m.free(hs)
        c = m.new(g(channels), site)  # back to (B, C, H, W), contiguous
        m.free(o)
    else:
        c0 = m.new(g(channels), site)
        m.free(hs)
        c = m.conv(c0, g(channels), site + ".proj_out")
        m.free(c0)
    out = m.new(g(channels), site)  # + residual
    m.free(c)
    return out


def _unet(m: _Live, spec: ModelSpec, shape: RunShape, batch: int, ff_chunks: int) -> None:
    """diffusers' UNet2DConditionModel.forward for SD 1.x, 2.x and SDXL block types."""
    cfg = spec.unet
    n = len(cfg["down_block_types"])
    chans = list(cfg["block_out_channels"])
    heads = _per_block(cfg.get("num_attention_heads") or cfg["attention_head_dim"], n)
    layers = _per_block(cfg["layers_per_block"], n)
    depth = _per_block(cfg.get("transformer_layers_per_block") or 1, n)
    up_depth = list(cfg.get("reverse_transformer_layers_per_block") or depth[::-1])
    linear = bool(cfg.get("use_linear_projection"))
    cost = spec.attention.get("unet", AttentionCost())
    for kind in (*cfg["down_block_types"], *cfg["up_block_types"], cfg.get("mid_block_type")):
        if kind not in _UNET_BLOCKS:
            raise PlannerError(f"the memory planner does not model UNet block type {kind!r} (SD 1.x, 2.x, SDXL only)")

    g = _Grid(shape.height // spec.vae_scale, shape.width // spec.vae_scale, batch, spec.dtype_bytes)
    hs = m.conv(g(cfg["in_channels"]), g(chans[0]), "conv_in")
    skips = [(hs, chans[0], g)]
    c_prev = chans[0]
    for i, kind in enumerate(cfg["down_block_types"]):
        site = f"down_blocks.{i}"
        for j in range(layers[i]):
            r = _resnet(m, g, c_prev, chans[i], f"{site}.resnets.{j}")
            if kind.startswith("CrossAttn"):
                a = _transformer(m, g, chans[i], heads[i], depth[i], linear, ff_chunks, cost, f"{site}.attentions.{j}")
                m.free(r)
                r = a
            skips.append((r, chans[i], g))  # every output stays for the up path
            c_prev = chans[i]
        if i < n - 1:
            gd = g.down()
            hs = m.conv(g(chans[i]), gd(chans[i]), f"{site}.downsamplers.0")
            skips.append((hs, chans[i], gd))
            g = gd

    site = "mid_block"  # its input is the last skip, which stays
    r = _resnet(m, g, chans[-1], chans[-1], site + ".resnets.0")
    a = _transformer(m, g, chans[-1], heads[-1], depth[-1], linear, ff_chunks, cost, site + ".attentions.0")
    m.free(r)
    hs = _resnet(m, g, chans[-1], chans[-1], site + ".resnets.1")
    m.free(a)

    c_hs = chans[-1]
    rev = chans[::-1]
    rev_heads, rev_layers = heads[::-1], layers[::-1]
    for i, kind in enumerate(cfg["up_block_types"]):
        site = f"up_blocks.{i}"
        count = rev_layers[i] + 1
        res, skips = skips[-count:], skips[:-count]
        x = cur = hs  # the UNet holds the block's input until the block returns
        for j, (_, c_skip, gs) in enumerate(reversed(res)):
            cat = m.new(gs(c_hs + c_skip), site)
            if j:
                m.free(cur)
            r = _resnet(m, gs, c_hs + c_skip, rev[i], f"{site}.resnets.{j}")
            m.free(cat)
            if kind.startswith("CrossAttn"):
                attn = f"{site}.attentions.{j}"
                a = _transformer(m, gs, rev[i], rev_heads[i], up_depth[i], linear, ff_chunks, cost, attn)
                m.free(r)
                r = a
            cur, c_hs, g = r, rev[i], gs
        if skips:  # upsampled to the size of the next skip
            gu = skips[-1][2]
            up = m.new(gu(c_hs), site + ".upsamplers.0")  # nearest interpolation
            out = m.conv(up, gu(c_hs), site + ".upsamplers.0.conv")
            m.free(up, cur)
            cur, g = out, gu
        m.free(x, *(b for b, _, _ in res))
        hs = cur

    norm = m.new(g(chans[0]), "conv_norm_out")
    m.free(hs)
    act = m.new(g(chans[0]), "conv_act")
    m.free(norm)
    m.conv(act, g(cfg["out_channels"]), "conv_out")


_UNET_BLOCKS = frozenset(
    {"CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnUpBlock2D", "UpBlock2D", "UNetMidBlock2DCrossAttn"}
)


def _per_block(value: Any, n: int) -> list[int]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def _vae_attention(m: _Live, g: _Grid, channels: int, cost: AttentionCost, site: str) -> float:
    """The VAE mid-block's Attention on 4-D input: group norm, one head, a residual connection."""
    n = m.new(g(channels), site)  # group_norm; q, k, v project its transposed (strided) view
    qkv = 0.0
    for _ in range(3):
        copy = m.new(g(channels), site)  # Linear copies a strided input
        qkv += m.new(g(channels), site)
        m.free(copy)
    buffer = _score_buffer(cost, g.batch, 1, g.tokens, g.tokens, channels, g.elem, upcast=True)
    o = m.new(g(channels), site + ".attention", buffer)
    m.free(n)
    lin = m.new(g(channels), site)  # to_out
    m.free(o)
    back = m.new(g(channels), site)  # (B, N, C) -> (B, C, H, W)
    m.free(lin)
    res = m.new(g(channels), site)  # + residual
    m.free(back)
    out = m.new(g(channels), site)  # / rescale_output_factor
    m.free(res, qkv)
    return out


def _vae_decoder(m: _Live, spec: ModelSpec, lat_h: int, lat_w: int, batch: int, elem: int) -> float:
    """diffusers' AutoencoderKL._decode (post-quant conv and Decoder.forward); returns the image's bytes."""
    cfg = spec.vae
    cost = spec.attention.get("vae", AttentionCost())
    g = _Grid(lat_h, lat_w, batch, elem)
    latent = cfg["latent_channels"]
    post = m.conv(g(latent), g(latent), "post_quant_conv") if cfg.get("use_post_quant_conv", True) else 0
    rev = list(cfg["block_out_channels"])[::-1]
    hs = m.conv(g(latent), g(rev[0]), "decoder.conv_in")
    site = "decoder.mid_block"
    r = _resnet(m, g, rev[0], rev[0], site + ".resnets.0", temb=False)
    a = _vae_attention(m, g, rev[0], cost, site + ".attentions.0")
    m.free(r)
    r = _resnet(m, g, rev[0], rev[0], site + ".resnets.1", temb=False)
    m.free(a, hs)
    hs, c_prev = r, rev[0]
    for i, c_out in enumerate(rev):
        site = f"decoder.up_blocks.{i}"
        cur = hs  # the decoder holds the block's input until it returns
        for j in range(cfg["layers_per_block"] + 1):
            r = _resnet(m, g, c_prev if j == 0 else c_out, c_out, f"{site}.resnets.{j}", temb=False)
            if j:
                m.free(cur)
            cur = r
        if i < len(rev) - 1:
            gu = g.up()
            up = m.new(gu(c_out), site + ".upsamplers.0")
            out = m.conv(up, gu(c_out), site + ".upsamplers.0.conv")
            m.free(up, cur)
            cur, g = out, gu
        m.free(hs)
        hs, c_prev = cur, c_out
    norm = m.new(g(rev[-1]), "decoder.conv_norm_out")
    m.free(hs)
    act = m.new(g(rev[-1]), "decoder.conv_act")
    m.free(norm)
    image = m.conv(act, g(cfg["out_channels"]), "decoder.conv_out")
    m.free(act, post)
    return image


def _text_activations(spec: ModelSpec) -> float:
    """A text encoder call (one prompt, 77 tokens): every layer's hidden states (SDXL keeps them
    all), one layer's MLP and attention temporaries. A few MiB: the phase is its weights."""
    worst = 0.0
    for cfg in spec.text_encoders:
        hidden, inner, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
        per_token = hidden * (cfg["num_hidden_layers"] + 6) + 2 * inner + 2 * heads * TEXT_TOKENS
        worst = max(worst, TEXT_TOKENS * per_token * spec.dtype_bytes)
    return worst


def _tiles(size: int, tile: int) -> list[int]:
    """Tile extents along one side of ``size`` latents, as diffusers' tiled_decode cuts them (25 % overlap)."""
    stride = int(tile * 0.75)
    return [min(tile, size - start) for start in range(0, size, stride)]


def unet_peak(
    spec: ModelSpec, shape: RunShape, *, batch: int, ff_chunks: int = 1, cuda: bool = False
) -> tuple[int, str]:
    """Peak bytes of one UNet call on ``batch`` samples over its weights and inputs, and where it
    is; ``cuda`` adds cuDNN's convolution workspace."""
    m = _Live(CONV_WORKSPACE if cuda else 0.0)
    _unet(m, spec, shape, batch, ff_chunks)
    return int(m.peak), f"unet.{m.site}"


def decode_peak(spec: ModelSpec, shape: RunShape, *, tile: int | None = None, cuda: bool = False) -> tuple[int, str]:
    """Peak bytes of the VAE decode (diffusers' AutoencoderKL.decode, whole or in ``tile`` pixel
    tiles; in fp32 where the pipeline upcasts the VAE) over its weights and input, and where."""
    workspace = CONV_WORKSPACE if cuda else 0.0
    elem = 4 if spec.vae_upcast else spec.dtype_bytes
    lat_h, lat_w = shape.height // spec.vae_scale, shape.width // spec.vae_scale
    tile_lat = tile // spec.vae_scale if tile else None
    if tile_lat is None or (lat_h <= tile_lat and lat_w <= tile_lat):
        m = _Live(workspace)
        _vae_decoder(m, spec, lat_h, lat_w, shape.batch, elem)
        return int(m.peak), f"vae.{m.site}"
    # Every decoded tile is kept until all are blended, then joined row by row.
    out_px = shape.batch * spec.vae["out_channels"] * spec.vae_scale**2 * elem
    peak, site, kept = 0.0, "", 0.0
    by_size: dict[tuple[int, int], tuple[float, str]] = {}
    for th in _tiles(lat_h, tile_lat):
        for tw in _tiles(lat_w, tile_lat):
            if (th, tw) not in by_size:
                m = _Live(workspace)
                _vae_decoder(m, spec, th, tw, shape.batch, elem)
                by_size[th, tw] = m.peak, m.site
            tile_peak, tile_site = by_size[th, tw]
            if kept + tile_peak > peak:
                peak, site = kept + tile_peak, f"vae, tile {th * spec.vae_scale}x{tw * spec.vae_scale}: {tile_site}"
            kept += th * tw * out_px
    image = lat_h * lat_w * out_px
    if kept + 2 * image > peak:
        peak, site = kept + 2 * image, "vae.tiled_decode: blending the tiles"
    return int(peak), site


@dataclass(frozen=True)
class DeviceState:
    """The run device as the estimate sees it.

    ``cuda``: budgets and peaks are CUDA reserved memory (else the process's resident host
    memory). ``other``: bytes in use now besides the pipeline's weights on the device (CUDA
    allocations of other objects; on the host, the interpreter and libraries). ``cached``:
    CUDA memory reserved but not allocated now. ``expandable_segments``: already on.
    ``host_available``: host memory the plan may keep weights in (available memory plus the
    weights already there), None: not checked. ``cuda_graph_pool``: bytes a captured denoising
    step's private memory pool holds beside the estimate's denoising phase (about one UNet call's
    activations; whoever captures the graph sets it, :func:`unet_peak` sizes such a call).
    """

    cuda: bool = False
    other: int = 0
    cached: int = 0
    expandable_segments: bool = False
    host_available: int | None = None
    cuda_graph_pool: int = 0


@dataclass(frozen=True)
class PhaseEstimate:
    """Estimated peak of one phase: allocated and reserved bytes (equal off CUDA), the part that
    is activations (beyond weights and ``other``), and where the activation peak is."""

    name: str
    allocated: int
    reserved: int
    activations: int
    site: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "allocated_bytes": self.allocated,
            "reserved_bytes": self.reserved,
            "activations_bytes": self.activations,
            "site": self.site,
        }


@dataclass(frozen=True)
class Estimate:
    phases: tuple[PhaseEstimate, ...]

    def phase(self, name: str) -> PhaseEstimate:
        return next(p for p in self.phases if p.name == name)

    @property
    def top(self) -> PhaseEstimate:
        """The phase with the highest peak (what the budget is compared with)."""
        return max(self.phases, key=lambda p: p.reserved)

    @property
    def peak(self) -> int:
        return self.top.reserved


def _attention_costs(spec: ModelSpec, levers: Levers) -> dict[str, AttentionCost]:
    """Each component's attention cost once the attention lever is applied."""
    costs = {}
    for name, cost in spec.attention.items():
        if levers.flash_attention and cost.kind == "materialized":
            cost = spec.auto_attention.get(name, AttentionCost())
        if levers.chunk_budget is not None and cost.kind == "chunked":
            cost = replace(cost, budget=min(cost.budget, levers.chunk_budget))
        costs[name] = cost
    return costs


def estimate(
    spec: ModelSpec, shape: RunShape, levers: Levers = Levers(), device: DeviceState = DeviceState()
) -> Estimate:
    """Peak memory of each phase of one pipeline call of ``shape`` with ``levers`` in place."""
    spec = replace(spec, attention=_attention_costs(spec, levers))
    expandable = levers.expandable_segments or device.expandable_segments
    reserve = RESERVE_OVER_ACTIVATIONS[expandable]
    micro = min(levers.unet_micro_batch or shape.unet_batch, shape.unet_batch)
    unet, unet_site = unet_peak(spec, shape, batch=micro, ff_chunks=levers.ff_chunks, cuda=device.cuda)
    decode, decode_site = decode_peak(spec, shape, tile=levers.vae_tile, cuda=device.cuda)
    # The convolutions' workspace outside the tensors (oneDNN's reorders) on the host.
    workspace = {"text_encoding": 0, "denoising": 0, "vae_decode": 0}
    if not device.cuda:
        workspace["denoising"] = unet_peak(spec, shape, batch=micro, ff_chunks=levers.ff_chunks, cuda=True)[0] - unet
        workspace["vae_decode"] = decode_peak(spec, shape, tile=levers.vae_tile, cuda=True)[0] - decode
    # Latents, guidance and the scheduler's fp32 step: a few latent-sized tensors per UNet sample.
    pixels = (shape.height // spec.vae_scale) * (shape.width // spec.vae_scale)
    latent = shape.unet_batch * spec.unet["in_channels"] * pixels * 4
    embeds = shape.unet_batch * TEXT_TOKENS * spec.unet["cross_attention_dim"] * spec.dtype_bytes
    # SDXL decodes in fp32: its VAE's weights are converted in place, twice their fp16 bytes.
    upcast = spec.weights.get("vae", 0) if spec.vae_upcast else 0
    activations = {
        "text_encoding": (_text_activations(spec), "text encoder"),
        "denoising": (unet + device.cuda_graph_pool + 8 * latent + embeds, unet_site),
        "vae_decode": (decode + upcast + latent, decode_site),
    }
    phases = []
    for name in PHASES:
        act, site = activations[name]
        weights, streamed = _weights(spec, levers, name)
        allocated = device.other + weights + act
        if device.cuda:  # streamed weights pass through the allocator as activations do, and reserve like them
            reserved = allocated + device.cached + (reserve - 1) * (act + streamed)
        else:
            convs = max((spec.footprints.get(c, {}).get("largest_conv", 0) for c in _PHASE_COMPONENTS[name]), default=0)
            ws = workspace[name]
            reserved = allocated + (HOST_RESERVE_OVER_ACTIVATIONS - 1) * act + HOST_RESERVE_OVER_ACTIVATIONS * ws
            reserved += convs + HOST_FIRST_RUN
        phases.append(PhaseEstimate(name, int(allocated), int(reserved), int(act), site))
    return Estimate(tuple(phases))


_PHASE_COMPONENTS = {
    "text_encoding": ("text_encoder", "text_encoder_2"),
    "denoising": ("unet",),
    "vae_decode": ("vae",),
}
_TEXT_ENCODERS = _PHASE_COMPONENTS["text_encoding"]


def _footprint(spec: ModelSpec, levers: Levers, name: str, running: bool) -> tuple[int, int]:
    """Bytes of component ``name``'s weights on the device, idle or running, and the part of them
    that is streamed in and out during its call (allocated and freed layer by layer, like
    activations)."""
    weights = spec.weights.get(name, 0)
    own = spec.footprints.get(name, {})
    if name == "unet" and levers.fp8_storage:
        weights = own.get("fp8", weights)
    if levers.sequential_offload:
        return (own.get("sequential", weights), own.get("sequential", weights)) if running else (0, 0)
    if name == "unet" and levers.group_offload:
        size = own.get(levers.group_offload, weights)
        size = int(size * weights / spec.weights.get(name, weights))  # fp8 storage streams fp8 weights
        return (size, size) if running else (0, 0)
    if levers.cpu_offload or (name in _TEXT_ENCODERS and levers.text_encoder_offload):
        return (weights, 0) if running else (0, 0)
    if name not in spec.resident:
        return 0, 0
    # fp8 storage: a layer's weights are cast back to the compute dtype while it runs.
    cast = own.get("fp8_cast", 0) if name == "unet" and levers.fp8_storage and running else 0
    return weights + cast, cast


def _weights(spec: ModelSpec, levers: Levers, phase: str) -> tuple[int, int]:
    """Weights on the device at ``phase``'s peak, and the streamed part of them: every idle
    component's, plus the costliest running one over its idle bytes (SDXL's two text encoders take
    turns under offload; resident, both stay)."""
    idle = {name: _footprint(spec, levers, name, False)[0] for name in spec.weights}
    extra, streamed = 0, 0
    for name in _PHASE_COMPONENTS[phase]:
        if name in spec.weights:
            run, stream = _footprint(spec, levers, name, True)
            if run - idle[name] > extra:
                extra, streamed = run - idle[name], stream
    return sum(idle.values()) + extra, streamed


def host_weights(spec: ModelSpec, levers: Levers) -> int:
    """Bytes of weights the plan keeps in host memory: every component off the device between
    its calls (group offload's copies are pinned, page-locked), and with fp8 storage the UNet's
    original weights, kept so that :func:`remove_plan` puts them back exactly."""
    total = 0
    for name, nbytes in spec.weights.items():
        idle, _ = _footprint(spec, levers, name, False)
        if idle == 0:
            total += spec.footprints.get(name, {}).get("fp8", nbytes) if name == "unet" and levers.fp8_storage else nbytes
    if levers.fp8_storage:
        total += spec.weights.get("unet", 0)
    return total


def slowdown(spec: ModelSpec, levers: Levers) -> tuple[float, float]:
    """The plan's expected cost: a factor on each denoising step (:data:`STEP_SLOWDOWN`) and the
    seconds per image of copying whole models to the device (text encoder and model offload)."""
    factor = 1.0
    if levers.sequential_offload:
        factor *= STEP_SLOWDOWN["sequential_offload"]
    elif levers.group_offload:
        factor *= STEP_SLOWDOWN[f"group_offload:{levers.group_offload}"]
    if levers.fp8_storage and not levers.sequential_offload:
        factor *= STEP_SLOWDOWN["fp8_storage"]
    copied = 0
    if levers.cpu_offload and not levers.sequential_offload:
        copied = sum(spec.weights.values()) - (spec.weights.get("unet", 0) if levers.group_offload else 0)
    elif levers.text_encoder_offload and not levers.sequential_offload:
        copied = sum(spec.weights.get(name, 0) for name in _TEXT_ENCODERS)
    return factor, copied / HOST_TO_DEVICE_BYTES_PER_S


# -- the pipeline as the estimator sees it ---------------------------------------------------------

_KIND_ORDER = {"flash": 0, "chunked": 1, "materialized": 2}


def _layer_cost(
    processor: Any, device: torch.device, dtype: torch.dtype, head_dim: int, backend: str | None
) -> tuple[AttentionCost, bool]:
    """One attention layer's cost with its processor (``backend`` None) or with sdpatch's
    ``backend``, and whether it runs sdpatch's Triton kernel on CUDA."""
    from sdpatch.attention import BackendUnavailableError, choose_backend
    from sdpatch.processor import SdpatchAttnProcessor

    if backend is None and not isinstance(processor, SdpatchAttnProcessor):
        name = type(processor).__name__
        if name == "AttnProcessor":
            return AttentionCost("materialized"), False
        if name == "SlicedAttnProcessor":
            return AttentionCost("materialized", slice=processor.slice_size), False
        return AttentionCost(), False  # SDPA, xformers and the like: flash-style
    try:
        choice = choose_backend(device=device, dtype=dtype, head_dim=head_dim, backend=backend or processor.backend)
    except BackendUnavailableError:  # such a call fails anyway: nothing to estimate
        return AttentionCost(), False
    if choice.name == "chunked":
        budget = processor.chunk_budget if backend is None else None
        return AttentionCost("chunked", budget or DEFAULT_CHUNK_BUDGET), False
    return AttentionCost(), choice.name == "triton" and device.type == "cuda"


def _component_cost(module: torch.nn.Module, device: torch.device, backend: str | None) -> tuple[AttentionCost, bool]:
    """The costliest attention layer of a component, and whether any of its layers runs Triton."""
    from diffusers.models.attention_processor import Attention

    def rank(cost: AttentionCost) -> tuple[int, int, int]:
        return _KIND_ORDER[cost.kind], cost.budget, -(cost.slice or 0)

    worst, triton = AttentionCost(), False
    for attn in (m for m in module.modules() if isinstance(m, Attention)):
        dtype = next(attn.parameters()).dtype
        cost, runs_triton = _layer_cost(attn.processor, device, dtype, attn.inner_dim // attn.heads, backend)
        worst = max(worst, cost, key=rank)
        triton = triton or runs_triton
    return worst, triton


# The layers diffusers' group offload (leaf level) and layerwise casting treat as leaves
# (diffusers.hooks._common._GO_LC_SUPPORTED_PYTORCH_LAYERS).
_LEAF_LAYERS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear, torch.nn.Embedding)
_FP8_BYTES = 1


def _nbytes(module: torch.nn.Module, recurse: bool = True) -> int:
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return sum(t.numel() * t.element_size() for t in tensors)


def offload_footprints(module: torch.nn.Module) -> dict[str, int]:
    """A component's weights on the device while it runs, under each way of offloading it.

    ``block_level``: diffusers' group offload of each ModuleList entry, with streams: the group
    that runs and the next one, prefetched, plus the unmatched group (every other child, on the
    device for the whole call). ``leaf_level``: each leaf layer as a group: the weights outside
    leaf layers, and two of the largest leaves. ``sequential``: accelerate moves each module's own
    weights when it runs: the largest. ``fp8``: all weights, the leaf layers' at one byte per
    element outside diffusers' skip patterns (norms, a top-level ``proj_in``/``proj_out``); ``fp8_cast``: the
    largest such layer back in its dtype while it runs. ``largest_conv``: the largest 2-D
    convolution's weights (the host's reorder of them, :data:`HOST_RESERVE_OVER_ACTIVATIONS`).
    """
    groups, unmatched = [], _nbytes(module, recurse=False)
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            groups += [_nbytes(block) for block in child]
        else:
            unmatched += _nbytes(child)
    pairs = [a + b for a, b in zip(groups, groups[1:])] or groups or [0]
    leaves = [m for m in module.modules() if isinstance(m, _LEAF_LAYERS)]
    leaf_bytes = sorted((_nbytes(m) for m in leaves), reverse=True) or [0]
    outside = _nbytes(module) - sum(leaf_bytes)
    own = [_nbytes(m, recurse=False) for m in module.modules()]
    skip = re.compile("|".join(_FP8_SKIP))
    cast = [
        m for name, m in module.named_modules() if isinstance(m, _LEAF_LAYERS) and not skip.search(name)
    ]
    cast_bytes = [_nbytes(m) for m in cast]
    elems = sum(t.numel() for m in cast for t in (*m.parameters(), *m.buffers()))
    return {
        "block_level": unmatched + max(pairs),
        "leaf_level": outside + sum(leaf_bytes[:2]),
        "sequential": max(own),
        "fp8": _nbytes(module) - sum(cast_bytes) + elems * _FP8_BYTES,
        "fp8_cast": max(cast_bytes, default=0),
        "largest_conv": max((_nbytes(m) for m in leaves if isinstance(m, torch.nn.Conv2d)), default=0),
    }


# diffusers' layerwise casting skips these (DEFAULT_SKIP_MODULES_PATTERN and the UNet's own
# ``_skip_layerwise_casting_patterns``), matched against every level of a module's name.
_FP8_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")


def model_spec(pipe: Any, device: torch.device | None = None) -> ModelSpec:
    """What :func:`estimate` needs to know about a loaded pipeline (it may be on the meta device).

    ``device``: where it will run, when that is not where it is (a pipeline built on the meta
    device, or loaded on the CPU for a plan that places its weights): every model counts as
    resident there until a lever says otherwise.
    """
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    if device is None:
        device = pipe._execution_device
        resident = frozenset(name for name, c in modules.items() if any(p.device == device for p in c.parameters()))
    else:
        resident = frozenset(modules)
    costs, autos, triton = {}, {}, False
    for name in ("unet", "vae"):
        costs[name], uses_triton = _component_cost(modules[name], device, None)
        autos[name], _ = _component_cost(modules[name], device, "auto")
        triton = triton or uses_triton
    vae = pipe.vae
    return ModelSpec(
        unet=dict(pipe.unet.config),
        vae=dict(vae.config),
        text_encoders=tuple(modules[k].config.to_dict() for k in ("text_encoder", "text_encoder_2") if k in modules),
        weights=weights_bytes(modules),
        resident=resident,
        dtype_bytes=pipe.unet.dtype.itemsize,
        # SDXL's pipeline decodes an fp16 VAE in fp32 when its config asks (upcast_vae).
        vae_upcast=hasattr(pipe, "upcast_vae") and vae.dtype == torch.float16 and bool(vae.config.get("force_upcast")),
        attention=costs,
        auto_attention=autos,
        triton=triton,
        footprints={name: offload_footprints(m) for name, m in modules.items()},
    )


def expandable_segments_on() -> bool:
    """Whether PyTorch's CUDA allocator runs with expandable segments (from its environment, or
    turned on by :func:`apply_plan` in this process)."""
    if _runtime_expandable is not None:
        return _runtime_expandable
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        options = dict(o.split(":", 1) for o in os.environ.get(var, "").split(",") if ":" in o)
        if "expandable_segments" in options:
            return options["expandable_segments"].strip() == "True"
    return False


_runtime_expandable: bool | None = None  # set when apply_plan changed the running allocator


def request_expandable_segments() -> str | None:
    """Ask for expandable segments through ``PYTORCH_CUDA_ALLOC_CONF``, which PyTorch reads when
    CUDA initialises: call it before anything touches CUDA. Returns a note when the variable
    already says otherwise (the user's setting is kept)."""
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in current:
        return None if expandable_segments_on() else f"PYTORCH_CUDA_ALLOC_CONF={current} is kept"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [current, "expandable_segments:True"]))
    return None


def device_state(pipe: Any, spec: ModelSpec, device: torch.device | None = None) -> DeviceState:
    """Memory in use on the run device now (default: the pipeline's), besides the pipeline's
    weights there; on CUDA, the host memory weights may go to."""
    device = device or pipe._execution_device
    if device.type == "cuda":
        on_gpu = {n for n, c in pipe.components.items() if isinstance(c, torch.nn.Module) and c.device.type == "cuda"}
        resident = sum(spec.weights[name] for name in on_gpu)
        on_host = sum(nbytes for name, nbytes in spec.weights.items() if name not in on_gpu)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        return DeviceState(
            True,
            max(0, allocated - resident),
            reserved - allocated,
            expandable_segments_on(),
            host_available=_host_available() + on_host,
        )
    resident = sum(spec.weights[name] for name in spec.resident)
    return DeviceState(False, max(0, host_resident_bytes() - resident))


def parse_budget(text: str | float, what: str = "budget") -> float | Literal["auto"]:
    """A budget: a positive number of GiB, or ``auto`` (the device's free memory). ``what`` names
    it in the error: the argument for library calls, the option (``--vram-budget``) for the CLI's."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        gib = float(text)
    except (TypeError, ValueError):
        raise PlannerError(f"{what} must be a number of GiB or 'auto', got {text!r}") from None
    if not (math.isfinite(gib) and gib > 0):
        raise PlannerError(f"{what} must be a positive number of GiB, got {text!r}")
    return gib


def resolve_budget(budget: str | float, device: torch.device) -> tuple[int, str]:
    """The budget in bytes and how to describe it. ``auto``: the device's free memory plus what
    this process already holds there (CUDA reserved, or the process's resident host memory)."""
    value = parse_budget(budget)
    if value != "auto":
        return int(value * GIB), f"{value:g} GiB"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        return free + held, f"auto: {format_bytes(free)} free on {device} + {format_bytes(held)} reserved here"
    available, held = _host_available(), host_resident_bytes()
    label = f"auto: {format_bytes(available)} of host memory available + {format_bytes(held)} resident here"
    return available + held, label


def _host_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # not Linux

    return psutil.virtual_memory().available


# -- the planner ------------------------------------------------------------------------------------

# The Levers fields each lever sets; resetting them to a start value takes the lever out.
_LEVER_FIELDS = {
    "allocator": ("expandable_segments",),
    "attention": ("flash_attention", "chunk_budget"),
    "ff_chunking": ("ff_chunks",),
    "split_cfg": ("unet_micro_batch",),
    "vae_tiling": ("vae_tile",),
    "text_encoder_offload": ("text_encoder_offload",),
    "cpu_offload": ("cpu_offload",),
    "group_offload": ("group_offload",),
    "fp8_storage": ("fp8_storage",),
    "sequential_offload": ("sequential_offload",),
}


@dataclass(frozen=True)
class PlanStep:
    """A lever the plan takes: its setting, why (what it changes in the estimate), whether exact."""

    lever: str
    setting: str
    reason: str
    exact: bool

    def to_dict(self) -> dict[str, Any]:
        return {"lever": self.lever, "setting": self.setting, "reason": self.reason, "exact": self.exact}


@dataclass(frozen=True)
class Plan:
    """The levers a generation of ``shape`` takes to fit ``budget`` bytes, and the estimates.

    ``memory`` says what the budget is compared with: ``reserved`` (CUDA: PyTorch's peak reserved
    memory; the CUDA context is outside it) or ``host`` (the process's peak resident memory).
    ``unplanned`` is the estimate without any lever.
    """

    budget: int
    budget_label: str
    shape: RunShape
    levers: Levers
    steps: tuple[PlanStep, ...]
    estimate: Estimate
    unplanned: Estimate
    memory: Literal["reserved", "host"]
    notes: tuple[str, ...] = ()
    host_bytes: int = 0  # weights the plan keeps in host memory (host_weights)
    host_available: int | None = None
    host_limit: str | None = None  # why no stronger plan was taken: the host's memory
    step_slowdown: float = 1.0  # expected factor on each denoising step (STEP_SLOWDOWN)
    copy_seconds: float = 0.0  # expected seconds per image of whole-model copies

    @property
    def fits(self) -> bool:
        return self.estimate.peak <= self.budget

    def failure(self, best_effort: bool = False) -> str:
        """One line: the budget cannot be met, with the best estimate."""
        top = self.estimate.top
        levers = ", ".join(s.setting for s in self.steps) or "no lever helps"
        host = f"; {self.host_limit}" if self.host_limit else ""
        return (
            f"--vram-budget {self.budget_label} cannot be met for {self.shape.width}x{self.shape.height}: the "
            f"floor for this model and size is the smallest plan ({levers}), which needs an estimated "
            f"{format_bytes(top.reserved)} of {self.memory} memory in {PHASE_LABELS[top.name]}, "
            f"{format_bytes(top.reserved - self.budget)} over{host}; "
            + ("running it anyway (best effort)" if best_effort else "pass --best-effort to run anyway")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget,
            "budget": self.budget_label,
            "memory": self.memory,
            "shape": vars(self.shape).copy(),
            "fits": self.fits,
            "approximate": self.levers.vae_tile is not None or self.levers.fp8_storage,
            "estimated_peak_bytes": self.estimate.peak,
            "estimated_peak_phase": self.estimate.top.name,
            "unplanned_peak_bytes": self.unplanned.peak,
            "levers": [s.to_dict() for s in self.steps],
            "settings": vars(self.levers).copy(),
            "estimate": [p.to_dict() for p in self.estimate.phases],
            "unplanned": [p.to_dict() for p in self.unplanned.phases],
            "notes": list(self.notes),
            "host_bytes": self.host_bytes,
            "host_available_bytes": self.host_available,
            "host_limit": self.host_limit,
            "step_slowdown": self.step_slowdown,
            "copy_seconds_per_image": self.copy_seconds,
        }


def _reset(levers: Levers, lever: str, start: Levers) -> Levers:
    return replace(levers, **{f: getattr(start, f) for f in _LEVER_FIELDS[lever]})


def _options(
    lever: str, spec: ModelSpec, shape: RunShape, levers: Levers, device: DeviceState, allow_fp8: bool = False
) -> list[Levers]:
    """Settings of ``lever`` stronger than the current one, mildest first; the weight levers on
    CUDA only, fp8 storage only with ``allow_fp8``."""
    if lever == "allocator":
        return [replace(levers, expandable_segments=True)] if device.cuda and not levers.expandable_segments else []
    if lever == "attention":
        out, base = [], levers
        if not levers.flash_attention and any(c.kind == "materialized" for c in spec.attention.values()):
            base = replace(levers, flash_attention=True)
            out.append(base)
        budgets = [c.budget for c in _attention_costs(spec, base).values() if c.kind == "chunked"]
        return out + [replace(base, chunk_budget=b) for b in CHUNK_BUDGETS if budgets and b < max(budgets)]
    if lever == "ff_chunking":
        return [replace(levers, ff_chunks=k) for k in FF_CHUNKS if k > levers.ff_chunks]
    if lever == "split_cfg":
        sizes, size = [], levers.unet_micro_batch or shape.unet_batch
        while size > 1:
            size = (size + 1) // 2
            sizes.append(size)
        return [replace(levers, unet_micro_batch=s) for s in sizes]
    if lever == "vae_tiling":
        tiles, tile = [], spec.default_tile
        while tile >= min(MIN_VAE_TILE, spec.default_tile):
            if max(shape.height, shape.width) > tile and tile < (levers.vae_tile or math.inf):
                tiles.append(tile)
            tile //= 2
        return [replace(levers, vae_tile=t) for t in tiles]
    if not device.cuda or lever_unavailable(lever) or (lever == "fp8_storage" and not allow_fp8):
        return []
    if lever == "text_encoder_offload":
        return [] if levers.text_encoder_offload or levers.cpu_offload else [replace(levers, text_encoder_offload=True)]
    if lever == "cpu_offload":
        return [] if levers.cpu_offload else [replace(levers, cpu_offload=True)]
    if lever == "group_offload":
        # It replaces model offload for the UNet (diffusers refuses both on one pipeline).
        done = GROUP_OFFLOAD_TYPES.index(levers.group_offload) + 1 if levers.group_offload else 0
        kinds = _cheaper_and_smaller(spec, GROUP_OFFLOAD_TYPES[done:])
        return [replace(levers, group_offload=k, cpu_offload=False) for k in kinds]
    if lever == "fp8_storage":
        return [] if levers.fp8_storage else [replace(levers, fp8_storage=True)]
    return [] if levers.sequential_offload else [replace(levers, sequential_offload=True, **_SUBSUMED)]


# What sequential offload replaces: every other weight lever (it offloads every model itself).
_SUBSUMED = {"text_encoder_offload": False, "cpu_offload": False, "group_offload": None, "fp8_storage": False}


def _cheaper_and_smaller(spec: ModelSpec, kinds: tuple[str, ...]) -> list[str]:
    """The group offload kinds, mildest in memory first, without those that a stronger one beats
    on time too (:data:`STEP_SLOWDOWN`): on the H200 measurement, block level was slower than
    leaf level for the SDXL UNet and saved less, so leaf level is the only one offered."""
    cost = {k: STEP_SLOWDOWN[f"group_offload:{k}"] for k in kinds}
    return [k for i, k in enumerate(kinds) if not any(cost[s] <= cost[k] for s in kinds[i + 1 :])]


def lever_unavailable(lever: str) -> str | None:
    """Why a weight lever cannot run with the installed libraries (None: it can)."""
    import diffusers

    if lever == "group_offload":
        try:
            from diffusers.hooks import apply_group_offloading  # noqa: F401
        except ImportError:
            return f"diffusers {diffusers.__version__} has no group offloading (diffusers.hooks.apply_group_offloading)"
    if lever == "fp8_storage":
        if not hasattr(torch, "float8_e4m3fn"):
            return f"torch {torch.__version__} has no float8_e4m3fn"
        if not hasattr(diffusers.ModelMixin, "enable_layerwise_casting"):
            return f"diffusers {diffusers.__version__} has no layerwise casting (ModelMixin.enable_layerwise_casting)"
    return None


def _excess(est: Estimate, budget: int) -> int:
    """How far the phases are over budget, summed: a lever helps when it lowers this."""
    return sum(max(0, p.reserved - budget) for p in est.phases)


def _setting(lever: str, levers: Levers, shape: RunShape) -> str:
    if lever == "allocator":
        return "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    if lever == "attention":
        parts = ["sdpatch auto attention instead of materializing processors"] if levers.flash_attention else []
        if levers.chunk_budget is not None:
            parts.append(f"chunked attention in {format_bytes(levers.chunk_budget)} chunks")
        return ", ".join(parts)
    if lever == "ff_chunking":
        return f"feed-forward in {levers.ff_chunks} token chunks"
    if lever == "split_cfg":
        n = levers.unet_micro_batch
        if shape.cfg and n == shape.batch:
            return f"split CFG: the UNet batch of {shape.unet_batch} runs as 2 calls of {n}"
        return f"UNet batch of {shape.unet_batch} in calls of {n}"
    if lever == "vae_tiling":
        return f"tiled VAE decode in {levers.vae_tile} px tiles"
    if lever == "text_encoder_offload":
        return "text encoders on the CPU between their calls"
    if lever == "group_offload":
        return f"UNet group offload ({levers.group_offload.replace('_', ' ')}, CUDA streams)"
    if lever == "fp8_storage":
        return "UNet weights stored in fp8 (float8_e4m3fn, approximate)"
    if lever == "sequential_offload":
        return "sequential CPU offload of every model"
    return "model CPU offload"


def plan_for(
    spec: ModelSpec,
    shape: RunShape,
    budget: int,
    device: DeviceState = DeviceState(),
    *,
    budget_label: str | None = None,
    allow_fp8: bool = False,
) -> Plan:
    """Choose levers for ``shape`` on ``spec`` within ``budget`` bytes: cheapest first
    (:data:`LEVER_ORDER`) until the estimate fits, each at its mildest setting that fits, else at
    its strongest; then each lever taken is relaxed back to its mildest setting that does as well,
    since a later lever may have done its work. A lever that lowers the phases over the budget by
    less than :data:`MIN_GAIN` is not taken, nor a setting whose weights would not fit in
    ``device.host_available`` (it would swap). When nothing fits, the plan holds the levers that
    lowered the estimate, and ``fits`` is False."""
    start = Levers(expandable_segments=device.expandable_segments)
    unplanned = estimate(spec, shape, start, device)
    levers, current, taken = start, unplanned, []
    host_refused: list[Levers] = []

    def options(lever: str, base: Levers) -> list[Levers]:
        found = _options(lever, spec, shape, base, device, allow_fp8)
        if device.host_available is None:
            return found
        host_refused.extend(o for o in found if host_weights(spec, o) > device.host_available)
        return [o for o in found if host_weights(spec, o) <= device.host_available]

    for lever in LEVER_ORDER:
        if current.peak <= budget:
            break
        best: tuple[Levers, Estimate] | None = None
        for option in options(lever, levers):
            best = option, estimate(spec, shape, option, device)
            if best[1].peak <= budget:
                break
        # Nothing fits: the strongest setting, if it helps; the relaxing below undoes what a
        # later lever makes unnecessary.
        if best is not None and _excess(best[1], budget) < _excess(current, budget) - MIN_GAIN:
            levers, current = best
            taken.append(lever)
    # Relax: the mildest setting of each lever that keeps the estimate as good (within budget, or
    # as little over it); the allocator costs nothing and stays.
    target = _excess(current, budget)
    for lever in reversed([t for t in taken if t != "allocator"]):
        off = _reset(levers, lever, start)
        for option in [off, *options(lever, off)]:
            if option == levers:
                break
            est = estimate(spec, shape, option, device)
            if _excess(est, budget) <= target:
                levers, current = option, est
                break
    taken = [t for t in taken if _reset(levers, t, start) != levers]
    steps = []
    for lever in taken:
        without = estimate(spec, shape, _reset(levers, lever, start), device)
        changes = [
            f"{PHASE_LABELS[p.name]} {format_bytes(w.reserved)} -> {format_bytes(p.reserved)}"
            for w, p in zip(without.phases, current.phases)
            if w.reserved - p.reserved >= MIN_GAIN and format_bytes(w.reserved) != format_bytes(p.reserved)
        ]
        reason = "lowers " + ", ".join(changes) if changes else "no change on its own"
        steps.append(PlanStep(lever, _setting(lever, levers, shape), reason, lever in EXACT_LEVERS))
    notes = []
    if device.cuda and spec.triton:
        notes.append(
            f"a size's first run autotunes the Triton kernels, with up to {format_bytes(TRITON_AUTOTUNE_SCRATCH)} "
            "more in its first denoising step (not in the estimate; autotune results are then kept on disk)"
        )
    if device.cuda:
        # An unavailable lever matters where the plan fails or takes a costlier one instead.
        last = max((LEVER_ORDER.index(t) for t in taken), default=-1)
        for i, lever in enumerate(LEVER_ORDER):
            why = lever_unavailable(lever)
            if why and (current.peak > budget or i < last):
                notes.append(f"{lever.replace('_', ' ')} is unavailable: {why}")
    if device.cuda and current.peak > budget:
        if not allow_fp8 and not lever_unavailable("fp8_storage"):
            with_fp8 = plan_for(spec, shape, budget, device, allow_fp8=True)
            if with_fp8.estimate.peak < current.peak:
                notes.append(f"with --allow-fp8 (approximate) the floor is {format_bytes(with_fp8.estimate.peak)}")
    host_limit = None
    if host_refused and current.peak > budget:
        need = min(host_weights(spec, o) for o in host_refused)
        host_limit = (
            f"the host is the limit: a stronger plan keeps {format_bytes(need)} of weights in host memory, "
            f"{format_bytes(device.host_available)} is available (it would swap)"
        )
    factor, copy_seconds = slowdown(spec, levers)
    return Plan(
        budget=budget,
        budget_label=budget_label or format_bytes(budget),
        shape=shape,
        levers=levers,
        steps=tuple(steps),
        estimate=current,
        unplanned=unplanned,
        memory="reserved" if device.cuda else "host",
        notes=tuple(notes),
        host_bytes=host_weights(spec, levers),
        host_available=device.host_available,
        host_limit=host_limit,
        step_slowdown=factor,
        copy_seconds=copy_seconds,
    )


def plan(
    pipe: Any,
    budget: float | str,
    *,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    cfg: bool = True,
    device: torch.device | str | None = None,
    allow_fp8: bool = False,
) -> Plan:
    """Plan the levers that fit a generation on ``pipe`` into ``budget``, without changing ``pipe``.

    Args:
        pipe: a loaded StableDiffusionPipeline or StableDiffusionXLPipeline, patched or not.
        budget: GiB of PyTorch's peak reserved memory on CUDA (the process's resident memory
            elsewhere), or ``"auto"``: the device's free memory plus what this process holds.
        height, width: the image size (None: the model's native size).
        batch: images per pipeline call.
        cfg: classifier-free guidance (diffusers: a guidance scale > 1), which doubles the UNet batch.
        device: where it will run, if not where it is (e.g. loaded on the CPU to run on CUDA).
        allow_fp8: the plan may store the UNet's weights in fp8 (approximate).

    Returns a :class:`Plan`; ``plan.fits`` says whether its estimate is within the budget.
    """
    from sdpatch.models import default_size

    target = torch.device(device) if device is not None else None
    spec = model_spec(pipe, target)
    size = default_size(pipe)
    shape = RunShape(height or size, width or size, batch, cfg)
    nbytes, label = resolve_budget(budget, target or pipe._execution_device)
    state = device_state(pipe, spec, target)
    return plan_for(spec, shape, nbytes, state, budget_label=label, allow_fp8=allow_fp8)


# What a plan from configs assumes where it cannot look at the GPU (printed with it).
GPU_ASSUMPTIONS = (
    "every attention layer runs sdpatch auto as on CUDA: flash-style, no score buffer",
    "the CUDA context (about 0.5 GiB, driver- and GPU-dependent) is outside the budget, which is PyTorch's reserved memory",
    f"allocator: expandable segments, reserved = allocated + {RESERVE_OVER_ACTIVATIONS[True] - 1:.2f}x the activations "
    "(fitted on an H200)",
    f"cuDNN convolution workspace {CONV_WORKSPACE:g}x a convolution's input plus output (fitted on an H200)",
)


def plan_from_configs(
    pipe: Any,
    budget: float | str,
    *,
    device: str,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    cfg: bool = True,
    allow_fp8: bool = False,
) -> Plan:
    """The plan for a pipeline built on the meta device from its configs (no weights, no GPU):
    what ``sdpatch plan`` and ``generate --dry-run`` print. On ``cuda`` the device's state is
    assumed (:data:`GPU_ASSUMPTIONS`, in the plan's notes): nothing else on the GPU, expandable
    segments on (``--vram-budget`` asks for them); host memory is this machine's."""
    from sdpatch.models import default_size

    target = torch.device(device)
    spec = model_spec(pipe, target)
    cuda = target.type == "cuda"
    if cuda:
        flash = {name: AttentionCost() for name in spec.attention}
        spec = replace(spec, attention=flash, auto_attention=flash)
    if parse_budget(budget) == "auto":
        raise PlannerError("a plan from configs needs a budget in GiB: 'auto' reads the device's free memory")
    size = default_size(pipe)
    shape = RunShape(height or size, width or size, batch, cfg)
    nbytes, label = resolve_budget(budget, target)
    state = DeviceState(cuda=cuda, expandable_segments=cuda, host_available=_host_available() if cuda else None)
    chosen = plan_for(spec, shape, nbytes, state, budget_label=label, allow_fp8=allow_fp8)
    return replace(chosen, notes=chosen.notes + (tuple(f"assumed: {a}" for a in GPU_ASSUMPTIONS) if cuda else ()))


def fit(
    pipe: Any,
    budget: float | str,
    *,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    cfg: bool = True,
    best_effort: bool = False,
    device: torch.device | str | None = None,
    allow_fp8: bool = False,
) -> Plan:
    """:func:`plan`, then :func:`apply_plan`: what ``--vram-budget`` does.

    A budget that cannot be met raises :class:`PlannerError` (a one-line message with the
    estimate) before anything changes, unless ``best_effort``: then the best plan is applied and
    a warning says by how much it is expected to miss.
    """
    chosen = plan(pipe, budget, height=height, width=width, batch=batch, cfg=cfg, device=device, allow_fp8=allow_fp8)
    if not chosen.fits and not best_effort:
        raise PlannerError(chosen.failure())
    if not chosen.fits:
        logger.warning("%s", chosen.failure(best_effort=True))
    notes = apply_plan(pipe, chosen, device)
    return replace(chosen, notes=chosen.notes + tuple(notes))


def plan_lines(plan: dict[str, Any], measured: int | None) -> list[str]:
    """The report's lines for a plan (:meth:`Plan.to_dict`) and the measured peak (None: not run)."""
    budget, est = plan["budget_bytes"], plan["estimated_peak_bytes"]
    what = "peak reserved" if plan["memory"] == "reserved" else "peak host memory"
    phase = PHASE_LABELS[plan["estimated_peak_phase"]]
    head = f"vram budget {plan['budget']} ({what}): estimated {format_bytes(est)} in {phase}"
    if plan["levers"]:
        head += f" ({format_bytes(plan['unplanned_peak_bytes'])} without the plan)"
    if measured is not None:
        head += f", measured {format_bytes(measured)}: " + (
            f"within budget, {format_bytes(budget - measured)} to spare"
            if measured <= budget
            else f"missed the budget by {format_bytes(measured - budget)}"
        )
    elif not plan["fits"]:
        head += f": {format_bytes(est - budget)} over budget"
    levers = "; ".join(f"{s['setting']} ({s['reason']})" for s in plan["levers"])
    lines = [head, "plan: " + (levers or ("no lever needed" if plan["fits"] else "no lever helps"))]
    approximate = [s["setting"] for s in plan["levers"] if not s["exact"]]
    if approximate:
        lines.append(f"plan: approximate, the image may differ: {'; '.join(approximate)}")
    costs = []
    if plan.get("step_slowdown", 1.0) > 1.0:
        costs.append(f"denoising steps about {plan['step_slowdown']:.1f}x slower")
    if plan.get("copy_seconds_per_image"):
        costs.append(f"+{plan['copy_seconds_per_image']:.2f} s per image of model copies")
    if costs:
        lines.append("plan cost (H200 measurements, docs/benchmarks.md): " + ", ".join(costs))
    if plan.get("host_bytes"):
        available = plan.get("host_available_bytes")
        lines.append(
            f"plan: {format_bytes(plan['host_bytes'])} of weights in host memory"
            + (f" ({format_bytes(available)} available)" if available is not None else "")
        )
    return lines + [f"plan note: {n}" for n in plan["notes"]]


def estimate_lines(plan: dict[str, Any]) -> list[str]:
    """Each phase's estimated peak with and without the plan (:meth:`Plan.to_dict`), for a plan
    that is not run."""
    what = "reserved" if plan["memory"] == "reserved" else "host"
    lines = []
    for planned, unplanned in zip(plan["estimate"], plan["unplanned"]):
        lines.append(
            f"  {PHASE_LABELS[planned['name']]:<14} {format_bytes(planned['reserved_bytes']):>10} {what}"
            f"  (activations {format_bytes(planned['activations_bytes'])}; without the plan "
            f"{format_bytes(unplanned['reserved_bytes'])}) at {planned['site']}"
        )
    return ["estimated peak per phase:", *lines]


# -- putting a plan in place ------------------------------------------------------------------------


class _ChunkedFeedForward:
    """A FeedForward's forward over token chunks, written into one output.

    Exact up to rounding: a feed-forward treats every token on its own. diffusers' own
    ``enable_forward_chunking`` needs a chunk size that divides every block's token count, and its
    ``torch.cat`` holds the output twice; this takes any count and holds it once.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], chunks: int) -> None:
        self.forward = forward
        self.chunks = chunks

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if hidden_states.ndim != 3 or hidden_states.shape[1] < 2:
            return self.forward(hidden_states, *args, **kwargs)
        out, start = None, 0
        for piece in hidden_states.chunk(self.chunks, dim=1):
            y = self.forward(piece, *args, **kwargs)
            if out is None:
                out = y.new_empty((*hidden_states.shape[:2], y.shape[-1]))
            out[:, start : start + piece.shape[1]] = y
            start += piece.shape[1]
        return out


class _MicroBatchedUNet:
    """A UNet's forward in calls of at most ``size`` samples, concatenated (split CFG at half the batch).

    Exact up to rounding: every sample of a UNet batch is computed on its own (group norms and
    attention are per sample). Every tensor argument whose first dimension is the batch is cut
    with it, nested ones too (SDXL's ``added_cond_kwargs``); a 0-d timestep is shared.
    """

    def __init__(self, forward: Callable[..., Any], size: int) -> None:
        self.forward = forward
        self.size = size

    def __call__(self, sample: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = sample.shape[0]
        if n <= self.size:
            return self.forward(sample, *args, **kwargs)
        parts = [
            self.forward(sample[s : s + self.size], *_cut(args, n, s, self.size), **_cut(kwargs, n, s, self.size))
            for s in range(0, n, self.size)
        ]
        first = parts[0]
        if isinstance(first, tuple):  # return_dict=False, as the pipelines call it
            return (torch.cat([p[0] for p in parts]), *first[1:])
        return type(first)(**{key: torch.cat([p[key] for p in parts]) for key in first.keys()})


def _cut(value: Any, n: int, start: int, size: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start : start + size] if value.ndim and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _cut(v, n, start, size) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cut(v, n, start, size) for v in value)
    return value


_APPLIED = "_sdpatch_plan_undo"  # on the pipeline: how to take the applied plan out again


def _set_expandable_segments(on: bool) -> bool:
    """Switch the running CUDA allocator's expandable segments through PyTorch's private setter
    (``torch._C._accelerator_setAllocatorSettings``, formerly
    ``_cuda_cudaCachingAllocator_set_allocator_settings``); False where neither exists."""
    global _runtime_expandable
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )
    if setter is None:
        return False
    setter(f"expandable_segments:{on}")
    _runtime_expandable = on
    return True


def apply_plan(pipe: Any, plan: Plan | Levers, device: torch.device | str | None = None) -> list[str]:
    """Put ``plan``'s levers in place on ``pipe`` (after taking out any plan applied before).

    ``device``: where the pipeline runs (default: where it is). A pipeline loaded on the CPU for a
    plan with weight levers gets its weights placed from there, so that no weight reaches the GPU
    in a form the plan does not keep (fp8 storage casts on the CPU). Returns notes on what could
    not be done as planned (e.g. expandable segments, which PyTorch only reads when CUDA
    initialises unless its private setter exists). :func:`remove_plan` takes the levers out again.
    """
    from diffusers.models.attention import FeedForward

    from sdpatch.patch import patch_unet, unpatch_unet
    from sdpatch.processor import SdpatchAttnProcessor

    remove_plan(pipe)
    levers = plan.levers if isinstance(plan, Plan) else plan
    moving = device is not None  # the caller names the run device: every model goes there
    device = torch.device(device) if device is not None else pipe._execution_device
    undo: list[Callable[[], None]] = []
    notes: list[str] = []
    if levers.expandable_segments and device.type == "cuda" and not expandable_segments_on():
        if _set_expandable_segments(True):
            undo.append(lambda: _set_expandable_segments(False))
        else:
            notes.append(
                "expandable segments could not be turned on after CUDA started: set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts"
            )
    if levers.flash_attention:
        patch_unet(pipe, backend="auto", chunk_budget=levers.chunk_budget)
        undo.append(lambda: unpatch_unet(pipe))
    elif levers.chunk_budget is not None:
        procs = [p for c in (pipe.unet, pipe.vae) for p in c.attn_processors.values()]
        procs = [p for p in procs if isinstance(p, SdpatchAttnProcessor)]
        undo.append(_restorer([(p, "chunk_budget") for p in procs]))
        for p in procs:
            p.chunk_budget = min(p.chunk_budget or DEFAULT_CHUNK_BUDGET, levers.chunk_budget)
    if levers.ff_chunks > 1:
        ffs = [m for m in pipe.unet.modules() if isinstance(m, FeedForward)]
        undo.append(_restorer([(ff, "forward") for ff in ffs]))
        for ff in ffs:
            ff.forward = _ChunkedFeedForward(ff.forward, levers.ff_chunks)
    if levers.unet_micro_batch is not None:
        undo.append(_restorer([(pipe.unet, "forward")]))
        pipe.unet.forward = _MicroBatchedUNet(pipe.unet.forward, levers.unet_micro_batch)
    if levers.vae_tile is not None:
        vae = pipe.vae
        undo.append(_restorer([(vae, "use_tiling"), (vae, "tile_sample_min_size"), (vae, "tile_latent_min_size")]))
        vae.enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size = levers.vae_tile, levers.vae_tile // pipe.vae_scale_factor
    _place_weights(pipe, levers, device, undo, moving)
    setattr(pipe, _APPLIED, undo)
    return notes


def weight_levers(levers: Levers) -> bool:
    """Whether ``levers`` move weights off the run device or change how they are stored."""
    return any(getattr(levers, f) for lever in _WEIGHT_LEVERS for f in _LEVER_FIELDS[lever])


_WEIGHT_LEVERS = ("text_encoder_offload", "cpu_offload", "group_offload", "fp8_storage", "sequential_offload")


def _place_weights(
    pipe: Any, levers: Levers, device: torch.device, undo: list[Callable[[], None]], moving: bool
) -> None:
    """The weight levers, through diffusers' and accelerate's own offloading and casting; each
    step's undo goes on ``undo``. Every model ends on ``device`` or under a hook that brings its
    weights there when it runs."""
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    elsewhere = moving and any(p.device != device for c in modules.values() for p in c.parameters())
    if not weight_levers(levers) and not elsewhere:
        return
    # Last undone: each model back where it was, its hooks' instance attributes gone, and the
    # pipeline's offload bookkeeping as it was.
    hooked = [m for c in modules.values() for m in c.modules()]
    attributes = [(m, a) for m in hooked for a in ("forward", "_diffusers_hook", "_hf_hook", "_old_forward")]
    attributes += [(pipe, a) for a in ("_all_hooks", "_offload_device", "_offload_gpu_id")]
    restore_attributes = _restorer(attributes)
    places = {name: next((p.device for p in c.parameters()), device) for name, c in modules.items()}

    def back_in_place() -> None:
        import accelerate.hooks

        for c in modules.values():
            accelerate.hooks.remove_hook_from_module(c, recurse=True)
        restore_attributes()
        for name, c in modules.items():
            c.to(places[name])

    undo.append(back_in_place)
    cpu = torch.device("cpu")
    if device.type == "cuda" and any(place.type == "cuda" for place in places.values()):
        for c in modules.values():  # every weight lever starts from the CPU copy
            c.to(cpu)
        torch.cuda.empty_cache()
    unet = pipe.unet
    if levers.sequential_offload:
        # What diffusers' enable_sequential_cpu_offload does, with the device as given: it names
        # the CPU "cpu:0", on which accelerate's hooks fail (a plan on the CPU never takes this
        # lever, but its tests run there).
        from accelerate import cpu_offload

        for c in modules.values():
            cpu_offload(c, device, offload_buffers=len(c._parameters) > 0)
        return
    if levers.fp8_storage:
        originals = [(t, t.data) for t in (*unet.parameters(), *unet.buffers())]

        def exact_weights() -> None:  # layerwise casting's own removal refuses: fp8 lost precision
            for t, data in originals:
                t.data = data

        undo.append(exact_weights)
        unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=unet.dtype)
    if levers.group_offload:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(
            unet,
            onload_device=device,
            offload_device=cpu,
            offload_type=levers.group_offload,
            num_blocks_per_group=1 if levers.group_offload == "block_level" else None,
            use_stream=device.type == "cuda",
        )
    if levers.cpu_offload:
        pipe.enable_model_cpu_offload(device=device)
        return
    resident = [name for name in modules if not (name == "unet" and levers.group_offload)]
    if levers.text_encoder_offload:
        from accelerate import cpu_offload_with_hook

        hook = None
        for name in _TEXT_ENCODERS:
            if name in modules:
                _, hook = cpu_offload_with_hook(modules[name], device, prev_module_hook=hook)
                resident.remove(name)
        if hook is not None:  # the last text encoder goes back to the CPU when the UNet starts
            last = hook
            handle = unet.register_forward_pre_hook(lambda *_: last.offload())
            undo.append(handle.remove)
    for name in resident:
        modules[name].to(device)


def _restorer(attributes: list[tuple[Any, str]]) -> Callable[[], None]:
    """A function that puts each (object, attribute) back as it is now: its value, or, for an
    attribute only the class defines (a module's ``forward``), no instance attribute at all."""
    saved = [(obj, name, obj.__dict__.get(name, _CLASS)) for obj, name in attributes]

    def restore() -> None:
        for obj, name, value in saved:
            if value is _CLASS:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, value)

    return restore


_CLASS = object()  # marks an attribute that came from the class


def remove_plan(pipe: Any) -> Any:
    """Take out what :func:`apply_plan` put in place, last lever first; returns ``pipe``."""
    for step in reversed(getattr(pipe, _APPLIED, [])):
        step()
    if hasattr(pipe, _APPLIED):
        delattr(pipe, _APPLIED)
    return pipe


def single_lever(settings: dict[str, Any], lever: str) -> Levers:
    """The levers of a plan's ``settings`` (:meth:`Plan.to_dict`) with only ``lever`` kept."""
    levers = Levers(**settings)
    for other in LEVER_ORDER:
        if other != lever:
            levers = _reset(levers, other, Levers())
    return levers
