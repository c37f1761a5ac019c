"""The one diffusers attention processor: diffusers' recipe, with sdpatch's ``attention`` inside.

It knows nothing about kernels. It follows ``AttnProcessor2_0.__call__`` step for step and
replaces only the ``F.scaled_dot_product_attention`` call; which backend runs is decided by
:func:`sdpatch.attention.choose_backend`, inside :func:`sdpatch.attention.attention`. One step it
leaves out where it changes nothing: the division by ``rescale_output_factor`` when that is 1 (every
SD UNet), an elementwise kernel in the forward and another in the backward of each layer, which
host-bound training steps feel.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from .attention import BackendUnavailableError, Fallback, attention

if TYPE_CHECKING:
    from diffusers.models.attention_processor import Attention


class LastCall(NamedTuple):
    """What the processor saw on its latest call; read by the patch report."""

    nq: int
    nk: int
    dtype: torch.dtype
    device: torch.device


class SdpatchAttnProcessor:
    """Diffusers' ``AttnProcessor2_0`` recipe with :func:`sdpatch.attention` as the attention call.

    One instance per ``Attention`` module, so that errors can name the layer and the report can
    show the sequence lengths it last saw.

    Args:
        name: the module's name, used in error messages. None: a bare processor, as diffusers
            builds them (``type(processor)()``, when it loads or unloads an IP-Adapter); set on a
            patched layer, it is replaced by one with that layer's settings (see :mod:`sdpatch.patch`).
        backend: passed to :func:`sdpatch.attention` on every call.
        chunk_budget: bytes of score buffer for the chunked backend (``None``: its default).
        fused: use the fused ``to_qkv`` / ``to_kv`` projections, as ``FusedAttnProcessor2_0``
            does. Set when the processor it replaces was the fused one: diffusers'
            ``unfuse_qkv_projections`` restores processors but leaves ``attn.fused_projections``
            set, so the module's flag cannot be trusted.
        recompute: when a call builds a graph (grad enabled, and its inputs or the layer's
            parameters require grad), keep only the layer's inputs for the backward and recompute
            the rest there (non-reentrant activation checkpointing of the layer). Otherwise autograd
            keeps q, k, v, the attention output and the log-sum-exp. The backward then runs the
            layer's forward once more (projections and attention, no score matrix): on SD 1.5 at
            768², batch 4, 10 % less peak memory for a 1.2-1.3x slower step on an H200, whose step
            is bound by the host's Python (docs/benchmarks.md, training). Off by default.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        backend: str = "auto",
        chunk_budget: int | None = None,
        fused: bool = False,
        recompute: bool = False,
    ):
        self.name = name
        self.backend = backend
        self.chunk_budget = chunk_budget
        self.fused = fused
        self.recompute = recompute
        self.last_call: LastCall | None = None
        self.fallbacks = 0  # calls that the chunked backend served after the chosen one failed
        self.last_fallback: Fallback | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, backend={self.backend!r}, recompute={self.recompute})"

    def _fell_back(self, event: Fallback) -> None:
        self.fallbacks += 1
        self.last_fallback = event

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        # Extra arguments (the deprecated `scale`, ...) are ignored, as the stock processors do.
        inputs = (attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        if self.recompute and torch.is_grad_enabled() and _builds_graph(*inputs):
            # RNG state is kept and replayed (a LoRA's dropout draws the same mask twice); a
            # recomputation that saves other tensors than the forward did raises, never mixes them.
            return checkpoint(self._layer, *inputs, use_reentrant=False)
        return self._layer(*inputs)

    def _layer(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        temb: torch.Tensor | None,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            # An additive (batch * heads, 1 or Nq, Nk) mask, viewed as (batch, heads, ., Nk).
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        if encoder_hidden_states is not None and attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)

        if self.fused and encoder_hidden_states is None:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        elif self.fused:
            query = attn.to_q(hidden_states)
            key, value = attn.to_kv(encoder_hidden_states).chunk(2, dim=-1)
        elif encoder_hidden_states is None:
            x_q, x_k, x_v = _cast_once(hidden_states, attn.to_q, attn.to_k, attn.to_v)
            query, key, value = attn.to_q(x_q), attn.to_k(x_k), attn.to_v(x_v)
        else:
            x_k, x_v = _cast_once(encoder_hidden_states, attn.to_k, attn.to_v)
            query, key, value = attn.to_q(hidden_states), attn.to_k(x_k), attn.to_v(x_v)

        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if not torch.compiler.is_compiling():  # a report of eager calls; a trace would replay it as a side effect
            self.last_call = LastCall(query.shape[2], key.shape[2], query.dtype, query.device)
        try:
            hidden_states = attention(
                query,
                key,
                value,
                scale=attn.scale,
                attn_mask=attention_mask,
                backend=self.backend,
                chunk_budget=self.chunk_budget,
                upcast=attn.upcast_attention or attn.upcast_softmax,
                on_fallback=self._fell_back,
            )
        except (BackendUnavailableError, ValueError, TypeError) as err:
            # Say which layer failed; keep the class so callers can still catch it.
            cls = next(c for c in (BackendUnavailableError, ValueError, TypeError) if isinstance(err, c))
            raise cls(f"attention layer {self.name!r}: {err}") from err

        # attention() returns q's dtype, so AttnProcessor2_0's cast to it is left out.
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)

        projection, dropout, *_ = attn.to_out  # unpacked: ModuleList's indexing costs a microsecond each
        hidden_states = projection(hidden_states)
        if not _is_identity(dropout):
            hidden_states = dropout(hidden_states)

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)

        if attn.residual_connection:
            hidden_states = hidden_states + residual

        if attn.rescale_output_factor != 1.0:  # dividing by 1 is exact: skip its kernel, and its backward's
            hidden_states = hidden_states / attn.rescale_output_factor
        return hidden_states


# diffusers' ``Attention.forward`` reads its processor's parameters with ``inspect.signature`` on every
# call (to drop ``cross_attention_kwargs`` the processor does not take): 15-20 us of host time a layer,
# about what the attention call itself costs, on steps the host bounds. ``inspect`` returns a
# function's ``__signature__`` as it is, so the signature is worked out once here. (For the bound
# method it still builds the signature without ``self``, ~3 us; an instance attribute ``__call__``
# would avoid that, but ``torch.compile`` refuses to trace calls of an object that has one.)
SdpatchAttnProcessor.__call__.__signature__ = inspect.signature(SdpatchAttnProcessor.__call__)


# The hooks registered for every module (``torch.nn.modules.module.register_module_*_hook``): dicts that
# registration fills in place, so bound once here.
_GLOBAL_MODULE_HOOKS = tuple(
    getattr(torch.nn.modules.module, name, {})
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
)


def _is_identity(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` returns its input itself: a plain ``nn.Dropout`` of p = 0 or in eval
    mode (``F.dropout`` then returns its input), with no hooks to run. Skipping it saves a module call,
    2-3 us of host time a layer."""
    return (
        type(module) is torch.nn.Dropout
        and (module.p == 0 or not module.training)
        and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)
        and not any(_GLOBAL_MODULE_HOOKS)
    )


class _SharedCast(torch.autograd.Function):
    """``x`` cast to ``dtype`` once, as ``copies`` views of one tensor, one per consumer.

    Each view takes its own gradient, and the backward casts each back to ``x``'s dtype before
    summing, as autograd does when every consumer casts ``x`` itself.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, copies: int) -> tuple[torch.Tensor, ...]:
        ctx.input_dtype = x.dtype
        y = x.to(dtype)
        return (y, *(y.view_as(y) for _ in range(copies - 1)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        parts = [g.to(ctx.input_dtype) for g in grads if g is not None]
        return (sum(parts[1:], parts[0]) if parts else None), None, None


def _cast_once(x: torch.Tensor, *projections: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """``x`` for each projection. Under autocast each ``nn.Linear`` casts an fp32 input itself,
    and each keeps its own half-precision copy for the backward: three copies of a self-attention
    layer's input, where one has the same values. Cast once and share it. Only for plain
    ``nn.Linear`` projections, whose autocast cast is exactly this one; any other module (a LoRA
    wrapper, a quantized linear) gets ``x`` as it came."""
    device = x.device.type
    if (
        x.dtype != torch.float32
        or not torch.is_autocast_enabled(device)
        or not all(type(p) is torch.nn.Linear for p in projections)
    ):
        return (x,) * len(projections)
    return _SharedCast.apply(x, torch.get_autocast_dtype(device), len(projections))


def _builds_graph(attn: Attention, *tensors: torch.Tensor | None) -> bool:
    """Whether a call with grad enabled records anything for a backward."""
    return any(t is not None and t.requires_grad for t in tensors) or any(p.requires_grad for p in attn.parameters())
