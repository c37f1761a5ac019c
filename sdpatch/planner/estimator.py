"""The estimator: an analytic model of a generation's peak memory, phase by phase (text encoding,
denoising, VAE decode), from the components' configs and the weights' size. Pure arithmetic on a
:class:`ModelSpec`: nothing here touches a pipeline or a device.

It replays, block by block, the allocations and frees of diffusers' forward passes (the UNet's
skip connections, each ResNet's norm/SiLU/conv temporaries, each transformer block's attention
projections and GEGLU feed-forward, the VAE decoder's upsampling), which gives the live bytes a
caching allocator sees, without its rounding. On CUDA it adds cuDNN's convolution workspace, and
the allocator's reserve over allocated; on the host, the process's resident memory over its tensors.

Calibration (H200, fp16, torch 2.11, 2026-11-30, docs/benchmarks.md): the liveness alone
reproduces the SD 1.5 UNet call peaks over the weights exactly (131 / 520 / 2080 MiB at
512 / 1024 / 2048 px, batch 2); the VAE decode and SDXL UNet peaks sit above liveness by one
convolution's input plus output bytes (:data:`CONV_WORKSPACE`). Under leaf-level group offload the
UNet's layers' weights are replayed beside the activations, as diffusers copies them in and drops
them (:func:`leaf_offload_run`). What this does not model: Triton autotuning's scratch buffer on a
shape's first run, and the caching allocator itself: reserved memory is allocated plus a factor on
the activations fitted on measured runs (:data:`RESERVE_OVER_ACTIVATIONS`).
``scripts/check_planner.py`` compares estimates with measured peaks on a GPU.

The streamed VAE decode (:mod:`~sdpatch.planner.streamed_decode`) is replayed the same way, strip
by strip, and matches its own allocations exactly on the CPU and the meta device (tests). On a GPU
it is taken as diffusers' decoder is: cuDNN's workspace on its strip convolutions
(:data:`CONV_WORKSPACE`), the reserve over allocated of its per-layer whole tensors and strips
(:data:`RESERVE_OVER_ACTIVATIONS`), and the time of its host store's copies
(:data:`HOST_TO_DEVICE_BYTES_PER_S`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sdpatch.attention.chunked import DEFAULT_CHUNK_BUDGET
from sdpatch.errors import InputError
from sdpatch.memory import MIB, PHASE_LABELS
from sdpatch.planner.levers import Levers
from sdpatch.planner.streamed_decode import host_buffers, pinned_bytes

GIB = 1024**3

# cuDNN convolutions (fp16, H200) take a workspace of about their input plus their output bytes,
# as an NCHW -> NHWC copy of both would. Fitted on the H200 measurements the liveness model falls
# short of: VAE decode peak over the weights 610 MiB / 2.4 GiB / 9.5 GiB at 512 / 1024 /
# 2048 px, where liveness alone gives 384 / 1536 / 6144 MiB and the 256 -> 256 channel upsampler
# conv at full size holds 352 / 1408 / 5632 MiB plus 256 / 1024 / 4096 MiB in and out; SDXL UNet
# call 325 / 1286 MiB at 1024 / 2048 px, liveness
# 315 / 1260 MiB. A factor of 1.0 gives 608 MiB / 2.38 / 9.50 GiB and 320 / 1280 MiB.
# 1x1 convolutions (shortcuts, projections), which cuDNN runs as matrix products, take none: the
# streamed decode peaks at its shortcut's strip, and with the workspace there its estimate was
# 75 / 226 / 112 MiB over the measured allocated peak (SDXL 1024² / 2048², SD 1.5 2048², H200,
# 2026-12-03); without it, 43 / 43 / 37 MiB under.
CONV_WORKSPACE = 1.0

# Reserved over allocated, as a factor on the activations (the weights are allocated once, in
# blocks that stay). Without expandable segments, from SD 1.5 stock end to end (3.1 /
# 3.7, 4.9 / 6.9, 12.0 / 19.9 GiB allocated / reserved over 2.58 GiB of weights and this model's
# decode peaks of 0.59 / 2.38 / 9.50 GiB): activations reserve 1.89 / 1.82 / 1.82x what they
# allocate where the VAE decode is the peak (1.13x in the tiled run, where the UNet is; the
# README's sd15 run: 1.85x stock, 1.35x auto). With expandable segments (scripts/check_planner.py,
# H200, 2026-11-30): full-size VAE decodes reserve 1.14-1.16x their activations (SD 1.5 and SDXL
# at 512-2048 px), the UNet 1.06-1.28x (SDXL 2048 px highest). 1.10, assumed before that run,
# underestimated SDXL 2048 px with an 8 GiB budget by 5 % (8.40 GiB reserved against 7.96), so
# the plan missed its budget; 1.16 would have estimated 8.07 and added split CFG. With the leaf-level
# offload pool replayed (OFFLOAD_POOL_ROUNDING; 2026-12-04), the small-card runs' default stream
# reserved 1.26x the activations (SD 1.5 512², diffusers' decoder), 1.21x (SD 1.5 2048², the UNet with
# 4 feed-forward chunks), 1.08x (the same with split CFG, 2026-12-03) and 1.10-1.12x (SDXL's streamed
# decode): 1.20 puts all five within -7...+9 %, and keeps the 4-chunk plan, which reserved 2.01 GiB,
# out of a 2 GiB budget (1.16 estimated it at 1.95).
RESERVE_OVER_ACTIVATIONS = {True: 1.20, False: 1.90}

# The copy stream's pool under leaf-level group offload, over the most weight bytes its replay holds
# at once (LeafOffloadRun.most): the allocator maps whole 2 MiB pages, and the small blocks (norms,
# biases) take a page of their own. Measured (H200, 2026-12-04, expandable segments): 62 MiB at SDXL
# (59.4 replayed), 64 at SD 1.5 (59.4).
OFFLOAD_POOL_ROUNDING = 2 * MIB

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

# The cost model. Group offload streams the UNet's weights to the GPU in every UNet call, and a
# step's copies and compute added up rather than overlapped: each kind of offload adds its
# weights' bytes at its own rate per UNet call, the rates from issue 29's H200 measurement (SDXL
# UNet, 1024², batch 2, fp16, torch 2.11, diffusers 0.42.1: 142 ms a step without a lever, 350 with
# leaf level, 455 with block level, over 5.13 GB of weights). The planned runs of 2026-12-03 added
# 71, 180, 194 and 2 x 88 ms a step at SD 1.5 512², SDXL 1024², SDXL 2048² and SD 1.5 2048² (split
# CFG), 19.5-28.5 GB/s; leaf level's 24.7 predicts them within 20 %. Sequential offload: not
# measured, assumed at half leaf level's rate (no streams). fp8 storage costs compute, a factor
# on the step (259 / 142 ms). The per-image copies of the text encoders and model offload are
# counted in seconds at HOST_TO_DEVICE_BYTES_PER_S.
OFFLOAD_BYTES_PER_S = {
    "group_offload:leaf_level": 5.13e9 / (0.350 - 0.142),
    "group_offload:block_level": 5.13e9 / (0.455 - 0.142),
    "sequential_offload": 5.13e9 / (0.350 - 0.142) / 2,
}
FP8_STEP_FACTOR = 259 / 142

# Pageable copies over PCIe 4/5 x16: an assumption, not measured. The streamed decode's host store
# is pinned, which copies faster: for it, an upper bound.
HOST_TO_DEVICE_BYTES_PER_S = 12e9

TEXT_TOKENS = 77  # CLIP's context: diffusers pads every prompt to it


class PlannerError(InputError):
    """The planner cannot model this pipeline (an unknown block type), or a budget is malformed."""


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
    ``streamed_decode``: :mod:`~sdpatch.planner.streamed_decode` can compute the VAE's decoder.
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
    streamed_decode: bool = False
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


class _Live:
    """Bytes alive during a forward pass, allocation by allocation, and their peak.

    ``new`` allocates an op's output, ``free`` releases tensors whose last reference is gone.
    ``workspace`` (bytes) is held only while the op runs: cuDNN's convolution workspace, an
    attention score buffer.

    ``weights`` (bytes) are the parameters of the layer the op runs. With ``trace``, every op is
    kept in :attr:`ops` as (bytes live with its workspace, its weights, site), in order: the
    weights' own replay (:func:`leaf_offload_run`).
    """

    def __init__(self, conv_workspace: float, trace: bool = False) -> None:
        self.now = 0
        self.peak = 0
        self.site = ""
        self.conv_workspace = conv_workspace
        self.ops: list[tuple[float, int, str]] | None = [] if trace else None

    def new(self, nbytes: float, site: str, workspace: float = 0, weights: int = 0) -> float:
        self.now += nbytes
        if self.now + workspace > self.peak:
            self.peak, self.site = self.now + workspace, site
        if self.ops is not None:
            self.ops.append((self.now + workspace, weights, site))
        return nbytes

    def run(self, weights: int, site: str) -> None:
        """A layer whose output the replay leaves out (a few bytes: the time embedding's vectors)."""
        self.new(0, site, weights=weights)

    def conv(
        self, nbytes_in: float, nbytes_out: float, site: str, pointwise: bool = False, weights: int = 0
    ) -> float:
        """A convolution's output, with its workspace while it runs; ``pointwise``: a 1x1 one, which
        cuDNN runs as a matrix product, without the workspace (see :data:`CONV_WORKSPACE`)."""
        workspace = 0 if pointwise else self.conv_workspace * (nbytes_in + nbytes_out)
        return self.new(nbytes_out, site, workspace, weights)

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

    # The bytes of a layer's parameters, in this element size.
    def conv_weights(self, c_in: int, c_out: int, kernel: int = 3) -> int:
        return (c_in * c_out * kernel * kernel + c_out) * self.elem

    def linear_weights(self, d_in: int, d_out: int, bias: bool = True) -> int:
        return (d_in * d_out + d_out * bias) * self.elem

    def norm_weights(self, channels: int) -> int:  # GroupNorm and LayerNorm: a scale and a shift
        return 2 * channels * self.elem


def _resnet(m: _Live, g: _Grid, c_in: int, c_out: int, site: str, temb: int = 0) -> float:
    """diffusers' ResnetBlock2D on an input its caller holds, ``temb``: its time embedding's
    channels (0: none); returns the output's bytes."""
    a = m.new(g(c_in), site + ".norm1", weights=g.norm_weights(c_in))
    b = m.new(g(c_in), site)  # SiLU, while the norm's output is still bound
    m.free(a)
    c = m.conv(b, g(c_out), site + ".conv1", weights=g.conv_weights(c_in, c_out))
    m.free(b)
    if temb:  # + the time embedding, projected: a new tensor
        m.run(g.linear_weights(temb, c_out), site + ".time_emb_proj")
        d = m.new(g(c_out), site)
        m.free(c)
        c = d
    e = m.new(g(c_out), site + ".norm2", weights=g.norm_weights(c_out))
    m.free(c)
    f = m.new(g(c_out), site)  # SiLU
    m.free(e)
    h = m.conv(f, g(c_out), site + ".conv2", weights=g.conv_weights(c_out, c_out))
    m.free(f)
    s = 0
    if c_in != c_out:
        shortcut = g.conv_weights(c_in, c_out, kernel=1)
        s = m.conv(g(c_in), g(c_out), site + ".conv_shortcut", pointwise=True, weights=shortcut)
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
    m: _Live,
    g: _Grid,
    channels: int,
    heads: int,
    context: tuple[int, int] | None,
    cost: AttentionCost,
    site: str,
) -> float:
    """diffusers' Attention on (B, N, C) input, AttnProcessor2_0's recipe (sdpatch's processor
    follows it); ``context``: the cross-attention's (tokens, channels), None for self-attention.
    Returns the output's bytes."""
    x = g(channels)
    kv_tokens, kv_dim = context or (g.tokens, channels)
    kv = channels * kv_tokens * g.batch * g.elem
    q = m.new(x, site + ".to_q", weights=g.linear_weights(channels, channels, bias=False))
    k = m.new(kv, site + ".to_k", weights=g.linear_weights(kv_dim, channels, bias=False))
    v = m.new(kv, site + ".to_v", weights=g.linear_weights(kv_dim, channels, bias=False))
    buffer = _score_buffer(cost, g.batch, heads, g.tokens, kv_tokens, channels // heads, g.elem)
    # Laid out like q, (B, N, H, D) in memory (every SDPA kernel, sdpatch's too): back to
    # (B, N, H * D) is a view.
    o = m.new(x, site + ".attention", buffer)
    lin = m.new(x, site + ".to_out", weights=g.linear_weights(channels, channels))
    m.free(o)
    out = m.new(x, site)  # / rescale_output_factor
    m.free(lin, q, k, v)
    return out


def _feed_forward(m: _Live, g: _Grid, dim: int, inner: int, chunks: int, site: str) -> float:
    """diffusers' FeedForward with GEGLU (a projection to 2 x inner, GELU of the gate, their product,
    a projection back), in ``chunks`` token chunks written into one output (:class:`_ChunkedFeedForward`)."""
    proj, back = g.linear_weights(dim, 2 * inner), g.linear_weights(inner, dim)
    if chunks <= 1:
        p = m.new(g(2 * inner), site + ".ff.net.0.proj", weights=proj)
        gelu = m.new(g(inner), site + ".ff")
        y = m.new(g(inner), site + ".ff")
        m.free(p, gelu)
        out = m.new(g(dim), site + ".ff.net.2", weights=back)
        m.free(y)
        return out
    out = m.new(g(dim), site + ".ff")
    part = -(-g.tokens // chunks) / g.tokens  # the first chunk is the largest
    copy = g(dim) * part if g.batch > 1 else 0  # a token slice of a batch > 1 is strided: Linear copies it
    peak = m.new(copy + g(4 * inner) * part, site + ".ff", weights=proj)
    m.free(peak)
    m.run(back, site + ".ff.net.2")
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
    cross_dim: int,
) -> float:
    """diffusers' Transformer2DModel (continuous input) on an input its caller holds;
    ``cross_dim``: the text embeddings' channels."""
    n = m.new(g(channels), site + ".norm", weights=g.norm_weights(channels))  # GroupNorm
    projection = g.linear_weights(channels, channels)  # a Linear or a 1x1 convolution: the same bytes
    if linear:
        r = m.new(g(channels), site)  # (B, C, H, W) -> (B, HW, C) is a copy
        m.free(n)
        hs = m.new(g(channels), site + ".proj_in", weights=projection)
        m.free(r)
    else:
        p = m.conv(n, g(channels), site + ".proj_in", pointwise=True, weights=projection)
        m.free(n)
        hs = m.new(g(channels), site)  # the copy to (B, HW, C)
        m.free(p)
    norm = g.norm_weights(channels)
    for j in range(depth):
        block = f"{site}.transformer_blocks.{j}"
        n1 = m.new(g(channels), block + ".norm1", weights=norm)
        a1 = _attention(m, g, channels, heads, None, cost, block + ".attn1")
        h2 = m.new(g(channels), block)  # + residual
        n2 = m.new(g(channels), block + ".norm2", weights=norm)
        m.free(n1)
        a2 = _attention(m, g, channels, heads, (TEXT_TOKENS, cross_dim), cost, block + ".attn2")
        m.free(a1)  # attn_output now names attn2's result, which it keeps until the block returns
        h3 = m.new(g(channels), block)
        m.free(h2)
        n3 = m.new(g(channels), block + ".norm3", weights=norm)
        m.free(n2)
        f = _feed_forward(m, g, channels, 4 * channels, ff_chunks, block)
        out = m.new(g(channels), block)
        m.free(f, h3, n3, a2, hs)  # the block's input goes when the caller rebinds it
        hs = out
    if linear:
        o = m.new(g(channels), site + ".proj_out", weights=projection)
        m.free(hs)
        c = m.new(g(channels), site)  # back to (B, C, H, W), contiguous
        m.free(o)
    else:
        c0 = m.new(g(channels), site)
        m.free(hs)
        c = m.conv(c0, g(channels), site + ".proj_out", pointwise=True, weights=projection)
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
    cross = cfg["cross_attention_dim"]
    temb = cfg.get("time_embedding_dim") or 4 * chans[0]
    m.run(g.linear_weights(chans[0], temb), "time_embedding.linear_1")
    m.run(g.linear_weights(temb, temb), "time_embedding.linear_2")
    if cfg.get("addition_embed_type") == "text_time":  # SDXL's pooled text and size conditioning
        m.run(g.linear_weights(cfg["projection_class_embeddings_input_dim"], temb), "add_embedding.linear_1")
        m.run(g.linear_weights(temb, temb), "add_embedding.linear_2")
    conv_in = g.conv_weights(cfg["in_channels"], chans[0])
    hs = m.conv(g(cfg["in_channels"]), g(chans[0]), "conv_in", weights=conv_in)
    skips = [(hs, chans[0], g)]
    c_prev = chans[0]
    for i, kind in enumerate(cfg["down_block_types"]):
        site = f"down_blocks.{i}"
        for j in range(layers[i]):
            r = _resnet(m, g, c_prev, chans[i], f"{site}.resnets.{j}", temb)
            if kind.startswith("CrossAttn"):
                attn = f"{site}.attentions.{j}"
                a = _transformer(m, g, chans[i], heads[i], depth[i], linear, ff_chunks, cost, attn, cross)
                m.free(r)
                r = a
            skips.append((r, chans[i], g))  # every output stays for the up path
            c_prev = chans[i]
        if i < n - 1:
            gd = g.down()
            down = g.conv_weights(chans[i], chans[i])
            hs = m.conv(g(chans[i]), gd(chans[i]), f"{site}.downsamplers.0.conv", weights=down)
            skips.append((hs, chans[i], gd))
            g = gd

    site = "mid_block"  # its input is the last skip, which stays
    r = _resnet(m, g, chans[-1], chans[-1], site + ".resnets.0", temb)
    a = _transformer(m, g, chans[-1], heads[-1], depth[-1], linear, ff_chunks, cost, site + ".attentions.0", cross)
    m.free(r)
    hs = _resnet(m, g, chans[-1], chans[-1], site + ".resnets.1", temb)
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
            r = _resnet(m, gs, c_hs + c_skip, rev[i], f"{site}.resnets.{j}", temb)
            m.free(cat)
            if kind.startswith("CrossAttn"):
                attn = f"{site}.attentions.{j}"
                a = _transformer(m, gs, rev[i], rev_heads[i], up_depth[i], linear, ff_chunks, cost, attn, cross)
                m.free(r)
                r = a
            cur, c_hs, g = r, rev[i], gs
        if skips:  # upsampled to the size of the next skip
            gu = skips[-1][2]
            up = m.new(gu(c_hs), site + ".upsamplers.0")  # nearest interpolation
            out = m.conv(up, gu(c_hs), site + ".upsamplers.0.conv", weights=g.conv_weights(c_hs, c_hs))
            m.free(up, cur)
            cur, g = out, gu
        m.free(x, *(b for b, _, _ in res))
        hs = cur

    norm = m.new(g(chans[0]), "conv_norm_out", weights=g.norm_weights(chans[0]))
    m.free(hs)
    act = m.new(g(chans[0]), "conv_act")
    m.free(norm)
    m.conv(act, g(cfg["out_channels"]), "conv_out", weights=g.conv_weights(chans[0], cfg["out_channels"]))


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
    lin = m.new(g(channels), site)  # to_out
    m.free(o)
    back = m.new(g(channels), site)  # (B, N, C) -> (B, C, H, W)
    m.free(lin)
    res = m.new(g(channels), site)  # + residual
    m.free(back)
    out = m.new(g(channels), site)  # / rescale_output_factor
    # The norm's output is the key and value input too (encoder_hidden_states in diffusers'
    # AttnProcessor2_0, x_k and x_v in sdpatch's): it lives until the processor returns.
    m.free(res, qkv, n)
    return out


def _vae_head(m: _Live, spec: ModelSpec, g: _Grid) -> tuple[float, float]:
    """diffusers' AutoencoderKL._decode up to the decoder's mid block (post-quant conv, conv_in,
    the mid block); returns the post-quant conv's output bytes (held until the decoder returns)
    and the mid block's output bytes."""
    cfg = spec.vae
    cost = spec.attention.get("vae", AttentionCost())
    latent = cfg["latent_channels"]
    post = m.conv(g(latent), g(latent), "post_quant_conv", pointwise=True) if cfg.get("use_post_quant_conv", True) else 0
    c = cfg["block_out_channels"][-1]
    hs = m.conv(g(latent), g(c), "decoder.conv_in")
    site = "decoder.mid_block"
    r = _resnet(m, g, c, c, site + ".resnets.0")
    a = _vae_attention(m, g, c, cost, site + ".attentions.0")
    m.free(r)
    r = _resnet(m, g, c, c, site + ".resnets.1")
    m.free(a, hs)
    return post, r


def _vae_decoder(m: _Live, spec: ModelSpec, lat_h: int, lat_w: int, batch: int, elem: int) -> float:
    """diffusers' AutoencoderKL._decode (post-quant conv and Decoder.forward); returns the image's bytes."""
    cfg = spec.vae
    g = _Grid(lat_h, lat_w, batch, elem)
    post, hs = _vae_head(m, spec, g)
    rev = list(cfg["block_out_channels"])[::-1]
    c_prev = rev[0]
    for i, c_out in enumerate(rev):
        site = f"decoder.up_blocks.{i}"
        cur = hs  # the decoder holds the block's input until it returns
        for j in range(cfg["layers_per_block"] + 1):
            r = _resnet(m, g, c_prev if j == 0 else c_out, c_out, f"{site}.resnets.{j}")
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


@dataclass
class _Store:
    """The streamed decode's whole tensors: on the device (in the liveness), or in host buffers
    (:func:`~sdpatch.planner.streamed_decode.host_buffers`); and the bytes its strips move between
    the host and the device."""

    m: _Live
    host: bool
    sizes: list[int] = field(default_factory=list)  # of each tensor stored, in turn
    copied: float = 0

    def new(self, nbytes: float, site: str) -> float:
        if self.host:
            self.sizes.append(int(nbytes))
        else:
            self.m.new(nbytes, site)
        return nbytes

    def free(self, nbytes: float) -> None:
        if not self.host:
            self.m.free(nbytes)

    @property
    def pinned(self) -> int:
        """The host buffers' pinned bytes, as PyTorch's pinned allocator rounds them."""
        return sum(pinned_bytes(n) for n in host_buffers(self.sizes)) if self.sizes else 0

    def read(self, nbytes: float, site: str) -> float:
        """A strip of a stored tensor on the device: a view of a device store, a copy of a host one."""
        if not self.host:
            return 0
        self.copied += nbytes
        return self.m.new(nbytes, site)

    def write(self, nbytes: float, site: str) -> None:
        """A strip into the store: a host store takes a contiguous copy of it over the bus."""
        if self.host:
            self.copied += nbytes
            self.m.free(self.m.new(nbytes, site))


class _StreamedDecode:
    """:mod:`~sdpatch.planner.streamed_decode`'s decode, allocation by allocation on the device:
    the head as diffusers runs it, then each layer's strips (its ``_resnet``, ``_upsample`` and
    output loop, step by step). Every strip frees what it allocates, so each distinct strip shape
    is replayed once; one sample's strips at a time (the stores hold the batch)."""

    def __init__(self, m: _Live, spec: ModelSpec, g: _Grid, strip: int, host: bool) -> None:
        self.m, self.g, self.strip = m, g, strip
        self.store = _Store(m, host)
        self.h, self.w = g.h, g.w  # the current layer's output size
        self.image_h = g.h * 2 ** (len(spec.vae["block_out_channels"]) - 1)
        self.wide = 4 / g.elem if g.elem < 4 else 0  # half types: norms and statistics take a float32 copy

    def rows(self, c: int, n: int, w: int) -> float:
        """Bytes of ``n`` rows of one sample's ``c`` channels, ``w`` wide."""
        return c * n * w * self.g.elem

    def norm_act(self, c: int, n: int, valid: int, w: int, site: str) -> float:
        buf = self.m.new(self.rows(c, n, w), site)  # the zero-padded strip
        self.m.free(self.m.new(self.wide * self.rows(c, valid, w), site))
        return buf

    def read_act(self, c: int, lo: int, hi: int, site: str) -> float:
        """Rows [lo, hi) of a stored tensor, normalized and activated (``_read_act``)."""
        a, e = max(lo, 0), min(hi, self.h)
        r = self.store.read(self.rows(c, e - a, self.w), site)
        buf = self.norm_act(c, hi - lo, e - a, self.w, site)
        self.m.free(r)
        return buf

    def written(self, c: int, n: int, normed: bool, site: str) -> None:
        """A strip into the store, and its statistics where a group norm follows."""
        self.store.write(self.rows(c, n, self.w), site)
        if normed:
            self.stats(c, n, site)

    def stats(self, c: int, n: int, site: str) -> None:
        self.m.free(self.m.new(self.wide * self.rows(c, n, self.w), site))

    def each_strip(self, replay: Callable[[int, int], None]) -> None:
        """Replay each distinct strip of the current layer (its size, its halo's reach into the
        borders, the parity of its ends, which halves an upsampler reads), and count the copies
        of every sample's strips."""
        height = self.h
        rows = max(1, self.strip * height // self.image_h)
        done: dict[tuple[int, ...], float] = {}
        start, copied = self.store.copied, 0.0
        for lo in range(0, height, rows):
            hi = min(lo + rows, height)
            key = (hi - lo, min(lo, 2), min(height - hi, 2), lo % 2, hi % 2)
            if key not in done:
                before = self.store.copied
                replay(lo, hi)
                done[key] = self.store.copied - before
            copied += done[key]
        self.store.copied = start + self.g.batch * copied

    def stored(self, c: int, site: str) -> float:
        """The mid block's whole output into the store, sample by sample."""
        x = self.store.new(self.g(c), site)
        for _ in range(self.g.batch):
            self.written(c, self.h, True, site)
        return x

    def resnet(self, c_in: int, c_out: int, normed: bool, site: str) -> float:
        m, h, w = self.m, self.h, self.w

        def statistics(lo: int, hi: int) -> None:
            buf = self.read_act(c_in, lo - 1, hi + 1, site + ".norm1")
            y = m.conv(buf, self.rows(c_out, hi - lo, w), site + ".conv1 (statistics pass)")
            m.free(buf)
            self.stats(c_out, hi - lo, site)
            m.free(y)

        def output(lo: int, hi: int) -> None:
            h_lo, h_hi = max(lo - 1, 0), min(hi + 1, h)
            a, e = max(h_lo - 1, 0), min(h_hi + 1, h)
            s = self.store.read(self.rows(c_in, e - a, w), site)  # kept for the shortcut
            buf = self.norm_act(c_in, h_hi - h_lo + 2, e - a, w, site + ".norm1")
            y1 = m.conv(buf, self.rows(c_out, h_hi - h_lo, w), site + ".conv1")
            m.free(buf)
            act = self.norm_act(c_out, hi - lo + 2, h_hi - h_lo, w, site + ".norm2")
            m.free(y1)
            y = m.conv(act, self.rows(c_out, hi - lo, w), site + ".conv2")
            m.free(act)
            if c_in != c_out:
                contiguous = m.new(self.rows(c_in, hi - lo, w), site)
                shortcut = m.conv(contiguous, self.rows(c_out, hi - lo, w), site + ".conv_shortcut", pointwise=True)
                m.free(contiguous, s)
                s = shortcut
            o = m.new(self.rows(c_out, hi - lo, w), site)
            m.free(s, y)
            self.written(c_out, hi - lo, normed, site)
            m.free(o)

        self.each_strip(statistics)
        out = self.store.new(self.g(c_out), site)
        self.each_strip(output)
        return out

    def upsample(self, c_in: int, c_out: int, normed: bool, site: str) -> float:
        m = self.m
        self.h, self.w, self.g = 2 * self.h, 2 * self.w, self.g.up()
        h, w = self.h, self.w

        def output(lo: int, hi: int) -> None:
            a, e = max(lo - 1, 0), min(hi + 1, h)
            first, last = a // 2, (e + 1) // 2
            r = self.store.read(self.rows(c_in, last - first, w // 2), site)
            up = m.new(self.rows(c_in, 2 * (last - first), w), site)
            m.free(r)
            buf = m.new(self.rows(c_in, hi - lo + 2, w), site)
            m.free(up)
            y = m.conv(buf, self.rows(c_out, hi - lo, w), site + ".conv")
            m.free(buf)
            self.written(c_out, hi - lo, normed, site)
            m.free(y)

        out = self.store.new(self.g(c_out), site)
        self.each_strip(output)
        return out

    def image(self, c: int, c_out: int) -> None:
        """conv_norm_out, SiLU and conv_out, strip by strip into the image (on the device)."""
        m, site = self.m, "decoder.conv_out"
        m.new(self.g(c_out), site)

        def output(lo: int, hi: int) -> None:
            buf = self.read_act(c, lo - 1, hi + 1, "decoder.conv_norm_out")
            m.free(m.conv(buf, self.rows(c_out, hi - lo, self.w), site), buf)

        self.each_strip(output)


def _streamed_decoder(
    m: _Live, spec: ModelSpec, lat_h: int, lat_w: int, batch: int, elem: int, strip: int, host: bool
) -> _Store:
    """The streamed decode (:class:`_StreamedDecode`) in ``strip`` image rows, with a host store or
    a device one; returns the store (its host buffers, the bytes copied)."""
    cfg = spec.vae
    g = _Grid(lat_h, lat_w, batch, elem)
    post, hs = _vae_head(m, spec, g)
    run = _StreamedDecode(m, spec, g, strip, host)
    rev = list(cfg["block_out_channels"])[::-1]
    layers = []  # (site, input channels, output channels, upsamples)
    for i, c_out in enumerate(rev):
        c_in = rev[max(i - 1, 0)]
        for j in range(cfg["layers_per_block"] + 1):
            layers.append((f"decoder.up_blocks.{i}.resnets.{j}", c_in if j == 0 else c_out, c_out, False))
        if i < len(rev) - 1:
            layers.append((f"decoder.up_blocks.{i}.upsamplers.0", c_out, c_out, True))
    x = run.stored(rev[0], "decoder.mid_block (stored)")
    m.free(hs)
    for k, (site, c_in, c_out, upsamples) in enumerate(layers):
        normed = k + 1 == len(layers) or not layers[k + 1][3]  # the next layer starts with a group norm
        out = (run.upsample if upsamples else run.resnet)(c_in, c_out, normed, site)
        run.store.free(x)
        x = out
    run.image(rev[-1], cfg["out_channels"])
    run.store.free(x)
    m.free(post)
    return run.store


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


@dataclass(frozen=True)
class LeafOffloadRun:
    """One UNet call under diffusers' leaf-level group offload with CUDA streams, the layers'
    parameters replayed beside the activations. Every layer with parameters of its own (each
    Linear, convolution and norm) is a group: the group before it copies it in (the prefetch) as
    that one starts, and it is dropped once it has run. So while a layer runs, its own and the
    next layer's weights are on the device; between layers, the next layer's.

    ``peak``: activations and weights on the device at their highest, and ``site`` where;
    ``weights``: the weights' part of that peak; ``most``: the most weight bytes on the device at
    once, which the copy stream's memory pool grows to (its freed blocks serve only that stream).
    """

    peak: int
    weights: int
    most: int
    site: str


def leaf_offload_run(
    spec: ModelSpec,
    shape: RunShape,
    *,
    batch: int,
    ff_chunks: int = 1,
    cuda: bool = False,
    storage: float = 1.0,
    cast: bool = False,
) -> LeafOffloadRun:
    """:class:`LeafOffloadRun` of one UNet call on ``batch`` samples (bytes over its inputs).
    ``storage``: bytes stored per byte of the compute dtype's weights (fp8 storage: about half);
    ``cast``: a running layer's weights are cast to the compute dtype (diffusers' layerwise casting
    replaces the stored copy with it while the layer runs)."""
    m = _Live(CONV_WORKSPACE if cuda else 0.0, trace=True)
    _unet(m, spec, shape, batch, ff_chunks)
    peak = at = most = 0.0
    site, upcoming = "", 0
    for live, weights, where in reversed(m.ops or []):
        on = (weights if cast else storage * weights) + storage * upcoming
        if live + on >= peak:
            peak, at, site = live + on, on, where
        most = max(most, on)
        upcoming = weights or upcoming
    return LeafOffloadRun(int(peak), int(at), int(most), f"unet.{site}")


@dataclass(frozen=True)
class _Decode:
    """A decode's device peak and where, and with the streamed decode's host store, its pinned
    host bytes at their peak and the bytes its strips copy between host and device."""

    peak: float
    site: str
    host: float = 0
    copied: float = 0


def _stream(levers: Levers) -> tuple[str, int] | None:
    """The streamed decode's store and strip rows, if the lever is on."""
    return (levers.vae_stream, levers.vae_strip) if levers.vae_stream and levers.vae_strip else None


def _decoder_run(
    spec: ModelSpec, lat_h: int, lat_w: int, batch: int, elem: int, workspace: float, stream: tuple[str, int] | None
) -> _Decode:
    m = _Live(workspace)
    if stream is None:
        _vae_decoder(m, spec, lat_h, lat_w, batch, elem)
        return _Decode(m.peak, f"vae.{m.site}")
    store, strip = stream
    held = _streamed_decoder(m, spec, lat_h, lat_w, batch, elem, strip, store == "host")
    return _Decode(m.peak, f"vae.{m.site} (streamed, {strip} px strips, {store} store)", held.pinned, held.copied)


def _decode(spec: ModelSpec, shape: RunShape, tile: int | None, stream: tuple[str, int] | None, cuda: bool) -> _Decode:
    """The VAE decode (diffusers' AutoencoderKL.decode, whole or in ``tile`` pixel tiles, each
    decoded by diffusers' decoder or streamed; in fp32 where the pipeline upcasts the VAE)."""
    workspace = CONV_WORKSPACE if cuda else 0.0
    elem = 4 if spec.vae_upcast else spec.dtype_bytes
    lat_h, lat_w = shape.height // spec.vae_scale, shape.width // spec.vae_scale
    tile_lat = tile // spec.vae_scale if tile else None
    if tile_lat is None or (lat_h <= tile_lat and lat_w <= tile_lat):
        return _decoder_run(spec, lat_h, lat_w, shape.batch, elem, workspace, stream)
    # Every decoded tile is kept until all are blended, then joined row by row.
    out_px = shape.batch * spec.vae["out_channels"] * spec.vae_scale**2 * elem
    peak, site, kept, host, copied = 0.0, "", 0.0, 0.0, 0.0
    by_size: dict[tuple[int, int], _Decode] = {}
    for th in _tiles(lat_h, tile_lat):
        for tw in _tiles(lat_w, tile_lat):
            if (th, tw) not in by_size:
                by_size[th, tw] = _decoder_run(spec, th, tw, shape.batch, elem, workspace, stream)
            run = by_size[th, tw]
            if kept + run.peak > peak:
                peak, site = kept + run.peak, f"vae, tile {th * spec.vae_scale}x{tw * spec.vae_scale}: {run.site}"
            kept += th * tw * out_px
            host, copied = max(host, run.host), copied + run.copied
    image = lat_h * lat_w * out_px
    if kept + 2 * image > peak:
        peak, site = kept + 2 * image, "vae.tiled_decode: blending the tiles"
    return _Decode(peak, site, host, copied)


def decode_peak(
    spec: ModelSpec, shape: RunShape, *, tile: int | None = None, stream: tuple[str, int] | None = None, cuda: bool = False
) -> tuple[int, str]:
    """Peak bytes of the VAE decode over its weights and input, and where: diffusers'
    AutoencoderKL.decode, whole or in ``tile`` pixel tiles, with diffusers' decoder or, with
    ``stream`` (store, strip rows), :mod:`~sdpatch.planner.streamed_decode`'s."""
    run = _decode(spec, shape, tile, stream, cuda)
    return int(run.peak), run.site


def decode_host(spec: ModelSpec, shape: RunShape, levers: Levers) -> tuple[int, int]:
    """The streamed decode's host store under ``levers``: its pinned bytes at their peak, and the
    bytes its strips copy between host and device per pipeline call (0, 0 without a host store)."""
    stream = _stream(levers)
    if stream is None or stream[0] != "host":
        return 0, 0
    run = _decode(spec, shape, levers.vae_tile, stream, cuda=True)
    return int(run.host), int(run.copied)


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
    # Leaf-level offload: the UNet's weights come and go layer by layer, replayed with the activations.
    leaf = _leaf_offload(spec, shape, levers, micro, device.cuda)
    unet_weights = 0
    if leaf is not None:
        unet, unet_site, unet_weights = leaf.peak, leaf.site, leaf.weights
    stream = _stream(levers)
    decode, decode_site = decode_peak(spec, shape, tile=levers.vae_tile, stream=stream, cuda=device.cuda)
    # The convolutions' workspace outside the tensors (oneDNN's reorders) on the host.
    workspace = {"text_encoding": 0, "denoising": 0, "vae_decode": 0}
    if not device.cuda:
        workspace["denoising"] = unet_peak(spec, shape, batch=micro, ff_chunks=levers.ff_chunks, cuda=True)[0] - unet
        workspace["vae_decode"] = decode_peak(spec, shape, tile=levers.vae_tile, stream=stream, cuda=True)[0] - decode
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
    # Group offload with CUDA streams allocates the UNet's weights on its own stream. PyTorch's
    # allocator keeps freed blocks in the pool of the stream that allocated them, which the default
    # stream's allocations do not reuse: from the denoising phase on, what the stream held stays
    # reserved (measured per stream under leaf level: 62-64 MiB, H200). Block level's groups reserve
    # like activations; leaf level's pool is the most its replay had on the device at once, in pages.
    offload_pool = 0
    if levers.group_offload and device.cuda:
        if leaf is not None and leaf.most:
            pages = -(-leaf.most // OFFLOAD_POOL_ROUNDING) + 1  # the weights, rounded up, and the small blocks' page
            offload_pool = pages * OFFLOAD_POOL_ROUNDING
        else:
            offload_pool = reserve * _footprint(spec, levers, "unet", True)[1]
    phases = []
    for name in PHASES:
        act, site = activations[name]
        weights, streamed = _weights(spec, levers, name)
        allocated = device.other + weights + act
        if device.cuda:  # streamed weights pass through the allocator as activations do, and reserve like them
            if name == "denoising" and leaf is not None:  # the weights in act are in the stream's pool
                reserved = allocated + device.cached + (reserve - 1) * (act - unet_weights) + offload_pool - unet_weights
            else:
                reserved = allocated + device.cached + (reserve - 1) * (act + streamed)
            if PHASES.index(name) > PHASES.index("denoising"):
                reserved += offload_pool
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
    if name == "unet" and levers.group_offload == "leaf_level":
        return 0, 0  # in the activations' replay (leaf_offload_run)
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


def _leaf_offload(spec: ModelSpec, shape: RunShape, levers: Levers, batch: int, cuda: bool) -> LeafOffloadRun | None:
    """The UNet call under leaf-level group offload, if the plan has it (stored in fp8 with fp8 storage)."""
    if levers.group_offload != "leaf_level" or levers.sequential_offload:
        return None
    weights = spec.weights.get("unet", 0)
    storage = spec.footprints.get("unet", {}).get("fp8", weights) / weights if levers.fp8_storage and weights else 1.0
    return leaf_offload_run(spec, shape, batch=batch, ff_chunks=levers.ff_chunks, cuda=cuda, storage=storage,
                            cast=levers.fp8_storage)


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


@dataclass(frozen=True)
class PlanCost:
    """A plan's expected time cost: a factor on each denoising step's compute (fp8 storage), the
    seconds each step adds (the offloaded UNet weights' copies, :data:`OFFLOAD_BYTES_PER_S`, once
    per UNet call) and the seconds per image of host-device copies (whole models; the streamed
    decode's strips with a host store; :data:`HOST_TO_DEVICE_BYTES_PER_S`)."""

    step_factor: float = 1.0
    step_seconds: float = 0.0
    image_seconds: float = 0.0

    def step(self, unplanned_step: float) -> float:
        """The expected planned step, from the unplanned one's seconds."""
        return unplanned_step * self.step_factor + self.step_seconds


def plan_cost(spec: ModelSpec, shape: RunShape, levers: Levers) -> PlanCost:
    """The plan's expected cost (:class:`PlanCost`)."""
    offload = "sequential_offload" if levers.sequential_offload else (
        f"group_offload:{levers.group_offload}" if levers.group_offload else None)
    step_seconds = 0.0
    if offload is not None:
        micro = min(levers.unet_micro_batch or shape.unet_batch, shape.unet_batch)
        calls = -(-shape.unet_batch // micro)  # UNet calls a step, each streaming every weight
        step_seconds = calls * spec.weights.get("unet", 0) / OFFLOAD_BYTES_PER_S[offload]
    factor = FP8_STEP_FACTOR if levers.fp8_storage and not levers.sequential_offload else 1.0
    copied = 0
    if levers.cpu_offload and not levers.sequential_offload:
        copied = sum(spec.weights.values()) - (spec.weights.get("unet", 0) if levers.group_offload else 0)
    elif levers.text_encoder_offload and not levers.sequential_offload:
        copied = sum(spec.weights.get(name, 0) for name in _TEXT_ENCODERS)
    copied += decode_host(spec, shape, levers)[1] / max(1, shape.batch)
    return PlanCost(factor, step_seconds, copied / HOST_TO_DEVICE_BYTES_PER_S)


# What a plan from configs assumes where it cannot look at the GPU (printed with it).
GPU_ASSUMPTIONS = (
    "every attention layer runs sdpatch auto as on CUDA: flash-style, no score buffer",
    "the CUDA context (about 0.5 GiB, driver- and GPU-dependent) is outside the budget, which is PyTorch's reserved memory",
    f"allocator: expandable segments, reserved = allocated + {RESERVE_OVER_ACTIVATIONS[True] - 1:.2f}x the activations "
    "(fitted on an H200)",
    f"cuDNN convolution workspace {CONV_WORKSPACE:g}x a convolution's input plus output (fitted on an H200)",
)
