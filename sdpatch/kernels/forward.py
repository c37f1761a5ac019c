"""The forward's launch layer: which kernel variant serves a call, and the call itself.

Two variants compute the same function: the Gluon Hopper kernel (:mod:`.flash_fwd_hopper`) for
unmasked self-attention on sm_90 wherever its grid fills the GPU (:func:`flash_fwd_hopper.serves`),
where its kernel time measured 1.03-1.3x the Triton kernel's, and the FlashAttention-2-style Triton
kernel (:mod:`.flash_fwd`) for every other call. A Gluon launch takes eight TMA descriptors, and
where its last wave is split a second launch and a workspace. An eager repeat of a layout
(:func:`repeat_launcher`) keeps its launches' arguments by the tensors' addresses: a diffusers layer
then costs the host what it does on the Triton kernel, but 20 us more where the wave is split (on a
lent H100 host). So the Gluon kernel serves calls that will be replayed from a CUDA graph
(:func:`for_capture`, which :mod:`sdpatch.graphs` sets around a signature's warm-up and capture, so
that the kernel it captures is the one its warm-up compiled), eager calls without log-sum-exp (no
gradients: the calls that repeat) whose grid is not split, and other eager calls from
:data:`EAGER_GLUON_MIN_FLOP` on, where a step waits on the GPU, not the host: a Gluon launch built
from scratch, as a call with gradients takes every time, cost the host 33-49 us more than the
Triton kernel's (H100). A Gluon kernel takes 2-3.5 s to compile, the Triton kernel 0.5-1: a CUDA
graph's warm-up has both compiled in the background
(:func:`sdpatch.kernels.runtime.compiles_in_background`), and PyTorch's SDPA stands in for them
until they are done (:func:`stand_in`; the graph is then captured again). A Gluon launch that
raises (an API this triton lacks) hands every later call to the Triton kernel, with one warning.
:func:`describe` says which variant, tiling and grid a call gets.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from . import flash_fwd, flash_fwd_hopper, runtime
from .shared import mask_kind, tiling
from .runtime import count_stand_in, vector_align

logger = logging.getLogger(__name__)


# Eager calls whose Gluon grid would split its last wave (a second launch, 20 us more host time
# a layer), and eager calls with gradients (a launch built from scratch every call), stay on the
# Triton kernel below this many FLOPs (4·B·H·Nq·Nk·D): a kernel of about 0.5 ms, past which the
# GPU, not the host, sets the pace of a diffusers step. Repeating calls on a whole grid take the
# Gluon kernel at any size: per call, back to back, paired against cuDNN on an H100, it is 1.17x
# cuDNN's speed at (2, 8, 4096, 40), 1.13x at (2, 8, 4096, 80), 1.18x at (2, 8, 1024, 160) and
# 1.05x at (2, 20, 1024, 64), where the Triton kernel's is 1.01x, 0.78x, 0.90x and 0.98x, for the
# same host time a layer. Whole eager UNet calls (SD 1.5 512² and SDXL 1024², host-bound there),
# alternating in one process on an H100, were as fast either way within the noise: medians of six
# calls 0.91-0.98x stock's time against 0.84-0.93x with those calls on the Triton kernel, and
# 0.78-0.89x against 0.75-0.88x; with split grids on the Gluon kernel too, 3-8 % slower at SDXL
# (docs/benchmarks.md).
EAGER_GLUON_MIN_FLOP = 1.5e11
_capture_depth = 0  # > 0 inside for_capture()
_captured_stand_in = False  # warned that a graph other than sdpatch's captured a stand-in


@contextlib.contextmanager
def for_capture():
    """Calls in this block are for a CUDA graph (its warm-up or its capture): the Gluon kernel
    serves wherever it can, since a replay costs no host time per launch."""
    global _capture_depth
    _capture_depth += 1
    try:
        yield
    finally:
        _capture_depth -= 1


def gluon_serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 return_lse: bool = False) -> bool:
    """Whether a default call goes to the Gluon kernel: see the module's docstring."""
    return flash_fwd_hopper.serves(q, k, v, mask) and (
        _capture_depth > 0 or 4 * q.numel() * k.shape[2] >= EAGER_GLUON_MIN_FLOP
        or not return_lse and not flash_fwd_hopper.splits_wave(q, k))


def flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    return_lse: bool = False,
    split_head_dim: bool | None = None,
    config: dict | None = None,
    kv_tma: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention forward on the variant that serves the call; arguments and results as
    :func:`flash_fwd.fa2_attn_fwd`'s. Calls that pin the Triton kernel's tiling (``config``,
    ``split_head_dim`` or ``kv_tma``) always get it. While the serving kernel compiles in the
    background, :func:`stand_in` serves, or the Triton kernel where the log-sum-exp is asked for."""
    if config is None and split_head_dim is None and kv_tma is None and gluon_serves(q, k, v, mask, return_lse):
        try:
            result = flash_fwd_hopper.gluon_attn_fwd(q, k, v, scale, return_lse)
        except torch.cuda.OutOfMemoryError:  # the Triton kernel needs the same memory
            raise
        except Exception as e:  # noqa: BLE001 - e.g. a Gluon API this triton lacks: fall back for good
            flash_fwd_hopper.disable(e)
        else:
            if result is not None:
                return result
            if not return_lse:  # compiling in the background (Gluon serves unmasked calls only)
                return stand_in(q, k, v, scale)
    result = flash_fwd.fa2_attn_fwd(q, k, v, scale, mask, return_lse, split_head_dim, config, kv_tma)
    return result if result is not None else stand_in(q, k, v, scale)


def repeat_launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """For an unmasked call without log-sum-exp that :func:`flash_attn_fwd` has just served: a
    launcher that serves later eager calls of the same layout on the same kernel, ``again(q, k, v)
    -> out``, or None from a call that must take the full path (inside :func:`for_capture`, where
    the Gluon kernel may serve instead). None where the kernel's launch is not settled yet
    (compiling in the background, autotuning)."""
    gluon = gluon_serves(q, k, v, None)
    again = flash_fwd_hopper.gluon_repeat(q, k, v, scale) if gluon else flash_fwd.fa2_repeat(q, k, v, scale)
    if again is None:
        return None

    def eager_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        return None if _capture_depth else again(q, k, v)

    return eager_only


def stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
    """(out, None) by PyTorch's SDPA (cuDNN or FlashAttention-2 on CUDA), for an unmasked call: what
    serves it while its own kernel compiles in the background
    (:func:`sdpatch.kernels.runtime.compiles_in_background`). The same function up to rounding.
    A CUDA graph captured now holds SDPA for good, unless it is sdpatch's own (``for_capture``),
    which is captured again once the kernel is ready: any other capture is warned about, once."""
    count_stand_in()
    global _captured_stand_in
    if _capture_depth == 0 and not _captured_stand_in and runtime.capturing(q.device):
        _captured_stand_in = True
        logger.warning("sdpatch: a CUDA graph is being captured while attention kernels still compile in the "
                       "background; PyTorch's SDPA stands in for them in that graph. Call "
                       "sdpatch.wait_for_kernels() after the warm-up and before capturing to have sdpatch's kernels.")
    return F.scaled_dot_product_attention(q, k, v, scale=scale), None


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, return_lse: bool = False) -> str:
    """The variant a default call takes here (eager, or inside :func:`for_capture`; with the
    log-sum-exp, as a call with gradients), with its head-dim tiling and, for Gluon, its grid."""
    D = q.shape[-1]
    if gluon_serves(q, k, v, mask, return_lse):
        lo, hi = flash_fwd_hopper.split_parts(D)
        config = flash_fwd_hopper.config_for(D)
        B, H, Nq, _ = q.shape
        grid = flash_fwd_hopper.grid_for(B * H, Nq, k.shape[2], flash_fwd_hopper.sm_count(q.get_device()), config)
        how = (f", last wave split in {grid.splits}" if grid.pieces else "") + (", tiles of two sizes" if grid.mixed else "")
        return f"gluon (Hopper, warp-specialized), head dim {D}" + (f" as {lo} + {hi}" if hi else "") + how
    a, b = tiling(D, None, vector_align(q, k, v), mask_kind(mask), k.shape[2])
    tma = flash_fwd.kv_tma_ok(k, v) and 4 * q.numel() * k.shape[2] >= flash_fwd.TMA_MIN_FLOP and q.is_cuda
    return (f"triton fa2, head dim {D}" + (f" as {a} + {b}" if b else f" in a {a}-wide tile" if a != D else "")
            + (", K and V through TMA" if tma else ""))


__all__ = ["EAGER_GLUON_MIN_FLOP", "describe", "flash_attn_fwd", "for_capture", "gluon_serves", "repeat_launcher", "stand_in"]
