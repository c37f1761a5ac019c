"""An exact low-memory VAE decode: diffusers' AutoencoderKL ``Decoder.forward`` computed in
horizontal strips of rows (the planner's ``vae_streaming`` lever).

The decoder's large activations are those of its up blocks, at up to the image's full size. Their
layers are local except for the group norms: a 3x3 convolution needs one row above and below its
output rows, and nearest 2x upsampling copies each input row into two; so every layer can be
computed strip by strip from a strip of its input with a halo. Each group norm's mean and variance are those of the whole tensor:
they are accumulated strip by strip as the tensor is written (each strip's own, combined in
float64), and each strip is normalized with them. The result equals the stock decoder's up to
floating-point rounding (tests/test_streamed_decode.py).

What is held where: ``conv_in`` and the mid block (whose attention needs the whole latent) run as
diffusers runs them, at latent size. From there, each layer's whole input and output tensors are in
a *store*, the run device (``device``) or pinned host memory (``host``), laid out rows first so that
a strip of one sample is one contiguous block; the run device holds only a few strips at a time.
Each ResnetBlock2D takes two passes over its input: the first computes ``conv1``'s output strip by
strip only for its norm's statistics, the second recomputes it (one convolution more, instead of a
third whole tensor) and writes the block's output. Upsample2D (nearest 2x, then its convolution)
writes its output in one pass. ``conv_norm_out``, SiLU and ``conv_out`` write the image, on the
run device.

Served: SD 1.x, 2.x and SDXL's VAE (group norms, nearest-and-conv upsampling, SiLU); for anything else
:func:`unsupported` says why and the planner does not take the lever. A decoder that cannot be
served at call time (with ``latent_embeds``, with gradients, in training mode, or under offload
hooks on its layers, which would move weights that this code reads directly) runs diffusers' own
forward, with a warning.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

STORES = ("device", "host")  # where each layer's whole input and output are held


def _conv3(conv: Any) -> bool:
    """A 3x3 convolution with stride 1 and zero padding 1: one row of halo on each side."""
    return (
        isinstance(conv, nn.Conv2d) and conv.kernel_size == (3, 3) and conv.stride == (1, 1)
        and conv.padding == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1 and conv.padding_mode == "zeros"
    )


def _conv1(conv: Any) -> bool:
    return (
        isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
        and conv.padding == (0, 0) and conv.groups == 1
    )


def _group_norm(norm: Any) -> bool:
    return isinstance(norm, nn.GroupNorm) and norm.affine


def _upsampler_conv(up: Any) -> Any:
    return up.conv if up.name == "conv" else up.Conv2d_0


def unsupported(decoder: Any) -> str | None:
    """Why the streamed decode cannot compute ``decoder`` (None: it can): the structure of SD's
    and SDXL's AutoencoderKL decoder is required, layer by layer."""
    from diffusers.models.autoencoders.vae import Decoder
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.unets.unet_2d_blocks import UpDecoderBlock2D
    from diffusers.models.upsampling import Upsample2D

    if type(decoder) is not Decoder:
        return f"{type(decoder).__name__} is not diffusers' AutoencoderKL Decoder"
    if getattr(decoder, "mid_block", None) is None or not decoder.up_blocks:
        return "the decoder has no mid block or no up blocks"
    if not _group_norm(decoder.conv_norm_out):
        return f"its output norm is {type(decoder.conv_norm_out).__name__}, not an affine GroupNorm (spatial norm?)"
    if not (_conv3(decoder.conv_out) and isinstance(decoder.conv_act, nn.SiLU)):
        return "its output layers are not SiLU and a 3x3 convolution"
    for i, block in enumerate(decoder.up_blocks):
        if type(block) is not UpDecoderBlock2D:
            return f"up block {i} is {type(block).__name__}, not UpDecoderBlock2D"
        for j, r in enumerate(block.resnets):
            where = f"up block {i}, resnet {j}"
            if type(r) is not ResnetBlock2D:
                return f"{where} is {type(r).__name__}, not ResnetBlock2D"
            if r.time_emb_proj is not None or r.upsample is not None or r.downsample is not None:
                return f"{where} has a time embedding or resamples"
            if not (_group_norm(r.norm1) and _group_norm(r.norm2) and isinstance(r.nonlinearity, nn.SiLU)):
                return f"{where} is not affine GroupNorm and SiLU"
            if not (_conv3(r.conv1) and _conv3(r.conv2)):
                return f"{where}'s convolutions are not 3x3 with padding 1"
            if r.conv_shortcut is not None and not _conv1(r.conv_shortcut):
                return f"{where}'s shortcut is not a 1x1 convolution"
        for up in block.upsamplers or ():
            if not (
                type(up) is Upsample2D and up.use_conv and not up.use_conv_transpose
                and getattr(up, "interpolate", True) and getattr(up, "norm", None) is None
                and _conv3(_upsampler_conv(up))
            ):
                return f"up block {i}'s upsampler is not nearest 2x interpolation and a 3x3 convolution"
    return None


def _unservable_call(decoder: nn.Module, latent_embeds: Any) -> str | None:
    """Why this call cannot be streamed, though the decoder's structure can."""
    if latent_embeds is not None:
        return "latent_embeds (spatial norm) was given"
    if torch.is_grad_enabled():
        return "gradients are enabled"
    if decoder.training:
        return "the decoder is in training mode (dropout)"
    if any(hasattr(m, "_hf_hook") or hasattr(m, "_diffusers_hook") for m in decoder.modules()):
        return "its layers are under offload or casting hooks"
    return None


class StreamedDecoderForward:
    """A Decoder's forward, streamed (:func:`decode`), in place of ``stock`` (the forward it
    replaces, run where a call cannot be streamed). ``strip``: rows of the image per strip (each
    layer takes its share: half as many at half the size); ``store``: one of :data:`STORES`."""

    def __init__(self, stock: Callable[..., torch.Tensor], decoder: nn.Module, strip: int, store: str) -> None:
        if store not in STORES or not (isinstance(strip, int) and strip >= 1):
            raise ValueError(f"streamed decode: store must be one of {STORES} and strip >= 1, got {store!r}, {strip}")
        self.stock = stock
        self.decoder = decoder
        self.strip = strip
        self.store = store

    def __call__(self, sample: torch.Tensor, latent_embeds: torch.Tensor | None = None) -> torch.Tensor:
        why = _unservable_call(self.decoder, latent_embeds)
        if why is not None:
            logger.warning("streamed VAE decode: running diffusers' decoder instead, since %s", why)
            return self.stock(sample, latent_embeds)
        return decode(self.decoder, sample, self.strip, self.store)


class _Rows:
    """A whole (B, C, H, W) activation, held as ``data`` (B, H, C, W) on the run device or in host
    memory, so that rows of one sample are one contiguous block."""

    def __init__(self, data: torch.Tensor, device: torch.device, host: bool) -> None:
        self.data = data
        self.height, self.width = data.shape[1], data.shape[3]
        self.device, self.host = device, host

    def read(self, b: int, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of sample ``b`` on the run device, as a (1, C, rows, W) view: of the
        store itself, or of a fresh copy from the host."""
        rows = self.data[b, lo:hi]
        if self.host:
            rows = rows.to(self.device, non_blocking=True, copy=True)
        return rows.permute(1, 0, 2).unsqueeze(0)

    def write(self, b: int, lo: int, strip: torch.Tensor) -> None:
        rows = strip[0].permute(1, 0, 2)
        target = self.data[b, lo : lo + strip.shape[2]]
        if self.host:  # one contiguous block over the bus
            target.copy_(rows.contiguous(), non_blocking=True)
        else:
            target.copy_(rows)


class _Store:
    """Where a decode's whole tensors are: fresh tensors on the run device, or views of host
    buffers (pinned where the device is CUDA) allocated once for the decode (:func:`host_buffers`)."""

    def __init__(self, shapes: list[tuple[int, int, int, int]], dtype: torch.dtype, device: torch.device, host: bool):
        self.dtype, self.device, self.host = dtype, device, host
        self.turn = 0
        sizes = [math.prod(shape) for shape in shapes]
        self.buffers = [
            torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda") for n in host_buffers(sizes)
        ] if host else []

    def new(self, shape: tuple[int, int, int, int]) -> _Rows:
        batch, channels, height, width = shape
        rows, n = (batch, height, channels, width), math.prod(shape)
        if not self.host:
            data = torch.empty(rows, dtype=self.dtype, device=self.device)
        elif len(self.buffers) == 2:  # the layers' inputs and outputs alternate between the two
            data = self.buffers[self.turn % 2][:n].view(rows)
        else:  # one buffer: inputs and outputs alternate between its two ends
            buffer = self.buffers[0]
            start = 0 if self.turn % 2 == 0 else buffer.numel() - n
            data = buffer[start : start + n].view(rows)
        self.turn += 1
        return _Rows(data, self.device, self.host)


def pinned_bytes(nbytes: float) -> int:
    """What PyTorch's pinned allocator (at::CachingHostAllocator) takes for a block: its size
    rounded up to a power of two, kept cached when freed (for the next decode)."""
    return 2 ** math.ceil(math.log2(nbytes)) if nbytes > 0 else 0


def host_buffers(sizes: list[int]) -> list[int]:
    """The host buffers for a decode that stores tensors of ``sizes`` in turn (elements or bytes of
    a power-of-two item size), each layer's input alive with its output: of two layouts, the one
    the pinned allocator rounds to fewer bytes. Two buffers that the tensors alternate between,
    each as large as the largest it takes; or one buffer with each input at one end and the output
    at the other, as large as the largest consecutive pair. A block per tensor would be rounded
    too, and keep a cached block of every size the decode passes through."""
    two = [max(sizes[0::2]), max(sizes[1::2], default=0)]
    one = [max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0])]
    return min(two, one, key=lambda buffers: sum(pinned_bytes(n) for n in buffers))


class _GroupStats:
    """Per (sample, group) mean and variance of a tensor seen strip by strip: each strip's own, in
    its compute precision, combined in float64 by Chan et al.'s pairwise update, which stays exact
    where a running sum of squares would cancel."""

    def __init__(self, batch: int, norm: nn.GroupNorm, device: torch.device) -> None:
        self.norm = norm
        self.count = [0] * batch
        self.mean = torch.zeros(batch, norm.num_groups, dtype=torch.float64, device=device)
        self.m2 = torch.zeros_like(self.mean)

    def add(self, b: int, strip: torch.Tensor) -> None:
        x = strip.reshape(1, self.norm.num_groups, -1).to(_compute_dtype(strip.dtype))
        var, mean = torch.var_mean(x, dim=-1, correction=0)
        n, seen = x.shape[-1], self.count[b]
        total = seen + n
        delta = mean[0].double() - self.mean[b]
        self.mean[b] += delta * (n / total)
        self.m2[b] += var[0].double() * n + delta.square() * (seen * n / total)
        self.count[b] = total

    def affine(self, b: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The norm of sample ``b`` as (x - mean) * scale + shift, each (1, C, 1, 1) in ``dtype``."""
        norm = self.norm
        per_group = norm.num_channels // norm.num_groups
        rstd = torch.rsqrt(self.m2[b] / self.count[b] + norm.eps)
        mean = self.mean[b].repeat_interleave(per_group)
        scale = rstd.repeat_interleave(per_group) * norm.weight.double()
        return tuple(t.to(dtype).view(1, -1, 1, 1) for t in (mean, scale, norm.bias))  # type: ignore[return-value]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms are computed in float32 at least, as PyTorch's GroupNorm accumulates half types."""
    return torch.promote_types(dtype, torch.float32)


def _norm_act(x: torch.Tensor, first: int, stats: _GroupStats, b: int, lo: int, hi: int, height: int) -> torch.Tensor:
    """Rows [lo, hi) of SiLU(norm(.)) of a tensor of which ``x`` holds rows [first, first + len),
    with zeros for rows outside the image's [0, height): the next 3x3 convolution's padding."""
    buf = x.new_zeros((1, x.shape[1], hi - lo, x.shape[3]))
    a, e = max(lo, 0), min(hi, height)
    view = buf[:, :, a - lo : e - lo]
    compute = _compute_dtype(x.dtype)
    mean, scale, shift = stats.affine(b, compute)
    t = view if compute == x.dtype else torch.empty(view.shape, dtype=compute, device=x.device)
    torch.sub(x[:, :, a - first : e - first], mean, out=t)
    t.mul_(scale).add_(shift)
    F.silu(t, inplace=True)
    if t is not view:
        view.copy_(t)
    return buf


def _read_act(x: _Rows, stats: _GroupStats, b: int, lo: int, hi: int) -> torch.Tensor:
    """:func:`_norm_act` of the stored tensor ``x``."""
    a, e = max(lo, 0), min(hi, x.height)
    return _norm_act(x.read(b, a, e), a, stats, b, lo, hi, x.height)


def _conv_rows(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A 3x3 convolution of a strip that holds its halo rows: only the width is padded, and two
    rows fewer come out."""
    return F.conv2d(x, conv.weight, conv.bias, padding=(0, 1))


def _strips(height: int, rows: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + rows, height)) for lo in range(0, height, rows)]


def _stats(batch: int, norm: nn.GroupNorm | None, device: torch.device) -> _GroupStats | None:
    return None if norm is None else _GroupStats(batch, norm, device)


def _resnet(
    block: Any, x: _Rows, x_stats: _GroupStats, rows: int, norm: nn.GroupNorm | None, store: _Store
) -> tuple[_Rows, Any]:
    """A ResnetBlock2D (no time embedding) in two passes over ``x``, into a new tensor of
    ``store``; ``norm``: the group norm its output feeds, whose statistics are gathered as it is
    written (None: none)."""
    batch, height = x.data.shape[0], x.height
    h_stats = _GroupStats(batch, block.norm2, x.device)
    for b in range(batch):
        for lo, hi in _strips(height, rows):
            h_stats.add(b, _conv_rows(block.conv1, _read_act(x, x_stats, b, lo - 1, hi + 1)))
    out = store.new((batch, block.conv2.out_channels, height, x.width))
    out_stats = _stats(batch, norm, x.device)
    for b in range(batch):
        for lo, hi in _strips(height, rows):
            # conv1's output with one row of halo, recomputed; then conv2's strip. The input rows
            # are read once, for conv1 and the shortcut: a host store's strips cross the bus twice
            # (statistics pass, this one), not three times.
            h_lo, h_hi = max(lo - 1, 0), min(hi + 1, height)
            first = max(h_lo - 1, 0)
            xs = x.read(b, first, min(h_hi + 1, height))
            h = _conv_rows(block.conv1, _norm_act(xs, first, x_stats, b, h_lo - 1, h_hi + 1, height))
            act = _norm_act(h, h_lo, h_stats, b, lo - 1, hi + 1, height)
            del h
            y = _conv_rows(block.conv2, act)
            del act
            s = xs[:, :, lo - first : hi - first]
            del xs
            if block.conv_shortcut is not None:
                s = F.conv2d(s.contiguous(), block.conv_shortcut.weight, block.conv_shortcut.bias)
            strip = s + y  # diffusers' order: input + hidden states
            del s, y
            if block.output_scale_factor != 1:
                strip.div_(block.output_scale_factor)
            out.write(b, lo, strip)
            if out_stats is not None:
                out_stats.add(b, strip)
            del strip  # before the next strip's allocations
    return out, out_stats


def _upsample(up: Any, x: _Rows, rows: int, norm: nn.GroupNorm | None, store: _Store) -> tuple[_Rows, Any]:
    """An Upsample2D (nearest 2x, then a 3x3 convolution), written strip by strip."""
    conv = _upsampler_conv(up)
    batch, height = x.data.shape[0], 2 * x.height
    out = store.new((batch, conv.out_channels, height, 2 * x.width))
    out_stats = _stats(batch, norm, x.device)
    for b in range(batch):
        for lo, hi in _strips(height, rows):
            a, e = max(lo - 1, 0), min(hi + 1, height)  # the upsampled rows the convolution reads
            first = a // 2
            up_rows = F.interpolate(x.read(b, first, (e + 1) // 2), scale_factor=2.0, mode="nearest")
            buf = up_rows.new_zeros((1, up_rows.shape[1], hi - lo + 2, up_rows.shape[3]))
            buf[:, :, a - lo + 1 : e - lo + 1] = up_rows[:, :, a - 2 * first : e - 2 * first]
            del up_rows
            strip = _conv_rows(conv, buf)
            del buf
            out.write(b, lo, strip)
            if out_stats is not None:
                out_stats.add(b, strip)
            del strip  # before the next strip's allocations
    return out, out_stats


def _stored(sample: torch.Tensor, store: _Store, norm: nn.GroupNorm | None) -> tuple[_Rows, Any]:
    """A whole device tensor into a new tensor of ``store``, with its norm's statistics."""
    batch = sample.shape[0]
    out = store.new(tuple(sample.shape))  # type: ignore[arg-type]
    stats = _stats(batch, norm, sample.device)
    for b in range(batch):
        out.write(b, 0, sample[b : b + 1])
        if stats is not None:
            stats.add(b, sample[b : b + 1])
    return out, stats


def _layers(decoder: Any) -> list[Any]:
    """The streamed layers in order: every up block's resnets, then its upsampler."""
    return [layer for block in decoder.up_blocks for layer in (*block.resnets, *(block.upsamplers or ()))]


def _upsamples(layer: Any) -> bool:
    return not hasattr(layer, "norm1")  # an Upsample2D; the other layers are ResnetBlock2D


def _input_norm(layer: Any) -> nn.GroupNorm | None:
    return None if _upsamples(layer) else layer.norm1


def _store_shapes(layers: list[Any], shape: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """The shapes of the tensors a decode stores: the mid block's output ``shape``, then each
    layer's output."""
    batch, channels, height, width = shape
    shapes = [shape]
    for layer in layers:
        if _upsamples(layer):
            channels, height, width = _upsampler_conv(layer).out_channels, 2 * height, 2 * width
        else:
            channels = layer.conv2.out_channels
        shapes.append((batch, channels, height, width))
    return shapes


def decode(decoder: Any, sample: torch.Tensor, strip: int, store: str) -> torch.Tensor:
    """``decoder(sample)`` (diffusers' Decoder.forward without ``latent_embeds``), its up blocks in
    strips of ``strip`` image rows with whole tensors in ``store`` (:data:`STORES`). Call it
    without gradients, on a decoder :func:`unsupported` accepts."""
    sample = decoder.conv_in(sample)
    sample = decoder.mid_block(sample, None)
    sample = sample.to(next(iter(decoder.up_blocks.parameters())).dtype)  # diffusers <= 0.30's upscale_dtype
    layers = _layers(decoder)
    norms = [_input_norm(layer) for layer in layers[1:]] + [decoder.conv_norm_out]
    image_height = sample.shape[2] * 2 ** sum(_upsamples(layer) for layer in layers)
    held = _Store(_store_shapes(layers, tuple(sample.shape)), sample.dtype, sample.device, store == "host")
    x, stats = _stored(sample, held, _input_norm(layers[0]))
    del sample
    for layer, norm in zip(layers, norms):
        if _upsamples(layer):
            x, stats = _upsample(layer, x, max(1, strip * 2 * x.height // image_height), norm, held)
        else:
            x, stats = _resnet(layer, x, stats, max(1, strip * x.height // image_height), norm, held)
    conv = decoder.conv_out
    batch, rows = x.data.shape[0], max(1, strip * x.height // image_height)
    image = torch.empty((batch, conv.out_channels, x.height, x.width), dtype=x.data.dtype, device=x.device)
    for b in range(batch):
        for lo, hi in _strips(x.height, rows):
            image[b : b + 1, :, lo:hi] = _conv_rows(conv, _read_act(x, stats, b, lo - 1, hi + 1))
    return image
