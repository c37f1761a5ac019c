"""The streamed VAE decode (sdpatch.planner.streamed_decode) against diffusers' own decoder.

Small VAEs built from configs on the CPU: the ``tiny`` preset's, and SDXL's (SD 1.5's has the
same structure) with its channel counts cut to 8-16, which keeps its three resnets per block and
its 1x1 shortcut convolutions. Error budgets, relative L2 error of the decoded image:
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from sdpatch.configs import load_component_config
from sdpatch.planner import streamed_decode
from sdpatch.planner.streamed_decode import StreamedDecoderForward, decode, host_buffers, pinned_bytes, unsupported

FLOAT64_BUDGET = 1e-12  # against diffusers' decoder, both in float64: rounding alone (measured: 1e-14)
FLOAT32_BUDGET = 1e-5  # against the float64 decoder (test_patch's fp32 budget; diffusers' own fp32: 2e-6)
HALF_MARGIN = 1.25  # bf16: no further from the float64 decoder than diffusers' own bf16 decoder, x this


def vae_from(preset: str, **changes):
    from diffusers import AutoencoderKL

    cfg = {**load_component_config(preset, "vae"), **changes}
    cfg.pop("_class_name")
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(cfg).eval()
    for m in vae.modules():  # norms away from identity, so that their statistics matter
        if isinstance(m, nn.GroupNorm):
            m.weight.data.normal_(1, 0.3)
            m.bias.data.normal_(0, 0.3)
    return vae


VAES = {
    "tiny": lambda: vae_from("tiny"),
    "sdxl-structure": lambda: vae_from("sdxl", block_out_channels=[8, 16, 16, 16], norm_num_groups=4),
}


@pytest.fixture(scope="module")
def vaes():
    return {name: build().double() for name, build in VAES.items()}


def latents(batch: int, height: int, width: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (3 * torch.randn(batch, 4, height, width, generator=g) + 1).to(dtype)  # off-centre, as latents are


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference.double()).norm() / reference.double().norm()).item()


# Strips in image rows: 1 (every layer one row), 5 (divides no layer's height), larger than the image.
EQUALITY_CASES = [
    pytest.param(vae, strip, store, id=f"{vae}-strip{strip}-{store}")
    for vae in VAES
    for strip in (1, 5, 10_000)
    for store in streamed_decode.STORES
]


@pytest.mark.parametrize("vae, strip, store", EQUALITY_CASES)
def test_equals_diffusers_decoder_in_float64(vaes, vae, strip, store):
    """Odd latents (13x21: no layer's height is a multiple of the strip), a batch of 2."""
    decoder = vaes[vae].decoder
    z = latents(2, 13, 21)
    with torch.no_grad():
        assert relative_error(decode(decoder, z, strip, store), decoder(z)) <= FLOAT64_BUDGET


@pytest.mark.parametrize("layout", ["two-buffers", "one-buffer"])
def test_both_host_layouts_are_exact(monkeypatch, vaes, layout):
    """The host store's tensors alternate between two buffers, or between the two ends of one."""
    if layout == "two-buffers":
        monkeypatch.setattr(streamed_decode, "host_buffers", lambda s: [max(s[0::2]), max(s[1::2])])
    else:
        monkeypatch.setattr(streamed_decode, "host_buffers", lambda s: [max(a + b for a, b in zip(s, s[1:]))])
    decoder = vaes["sdxl-structure"].decoder
    z = latents(2, 9, 7)
    with torch.no_grad():
        assert relative_error(decode(decoder, z, 3, "host"), decoder(z)) <= FLOAT64_BUDGET


def test_an_output_scale_factor_is_kept(vaes):
    decoder = copy.deepcopy(vaes["tiny"].decoder)
    for block in decoder.up_blocks:
        for resnet in block.resnets:
            resnet.output_scale_factor = 2.0
    z = latents(1, 6, 10)
    with torch.no_grad():
        assert relative_error(decode(decoder, z, 4, "device"), decoder(z)) <= FLOAT64_BUDGET


@pytest.mark.parametrize("store", streamed_decode.STORES)
def test_float32_and_bf16_within_budget_of_float64(vaes, store):
    """fp32 within FLOAT32_BUDGET of the float64 decoder; bf16 (norms and statistics in fp32, as
    PyTorch's group norm accumulates) no further from it than diffusers' bf16 decoder."""
    reference_vae = vaes["sdxl-structure"]
    z = latents(2, 13, 21)
    with torch.no_grad():
        reference = reference_vae.decoder(z)
        single = copy.deepcopy(reference_vae.decoder).float()
        assert relative_error(decode(single, z.float(), 5, store), reference) <= FLOAT32_BUDGET
        half = copy.deepcopy(reference_vae.decoder).to(torch.bfloat16)
        stock = relative_error(half(z.bfloat16()), reference)
        assert relative_error(decode(half, z.bfloat16(), 5, store), reference) <= HALF_MARGIN * stock


def spatial_norm_decoder():
    from diffusers.models.autoencoders.vae import Decoder

    # SpatialNorm's own group norm has 32 groups.
    return Decoder(in_channels=4, up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 32),
                   norm_num_groups=8, norm_type="spatial")


def with_up_block(block_type: str):
    from diffusers.models.autoencoders.vae import Decoder

    return Decoder(in_channels=4, up_block_types=("UpDecoderBlock2D", block_type), block_out_channels=(8, 16),
                   norm_num_groups=4)


def transposed_upsampler():
    from diffusers.models.upsampling import Upsample2D

    decoder = vae_from("tiny").decoder
    decoder.up_blocks[0].upsamplers[0] = Upsample2D(32, use_conv_transpose=True)
    return decoder


UNSERVED = [
    pytest.param(spatial_norm_decoder, "spatial norm", id="spatial-norm"),
    pytest.param(lambda: with_up_block("AttnUpDecoderBlock2D"), "not UpDecoderBlock2D", id="attention-up-block"),
    pytest.param(transposed_upsampler, "upsampler", id="transposed-conv-upsampler"),
    pytest.param(lambda: vae_from("tiny", act_fn="gelu").decoder, "SiLU", id="gelu"),
    pytest.param(lambda: nn.Conv2d(4, 3, 3), "not diffusers' AutoencoderKL Decoder", id="not-a-decoder"),
]


@pytest.mark.parametrize("build, reason", UNSERVED)
def test_what_it_cannot_serve_is_named(build, reason):
    assert reason in (unsupported(build()) or "")


@pytest.mark.parametrize("vae", VAES)
def test_the_presets_structure_is_served(vae):
    assert unsupported(VAES[vae]().decoder) is None


def test_calls_it_cannot_stream_run_diffusers_decoder(vaes, caplog):
    """With gradients (or latent_embeds, in training mode, under offload hooks) the stock forward
    runs, with a warning: this code reads weights directly and keeps no graph."""
    decoder = copy.deepcopy(vaes["tiny"].decoder)
    stock = decoder.forward
    decoder.forward = StreamedDecoderForward(stock, decoder, 4, "device")
    z = latents(1, 6, 10)
    with caplog.at_level(logging.WARNING, logger=streamed_decode.__name__):
        out = decoder(z)
    assert out.requires_grad and "gradients are enabled" in caplog.text
    decoder._hf_hook = object()  # accelerate's offload hook, as its cpu_offload sets it
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger=streamed_decode.__name__):
        assert torch.equal(decoder(z), stock(z))
    assert "offload or casting hooks" in caplog.text


def test_host_buffers_take_the_layout_the_pinned_allocator_rounds_least():
    # SDXL 1024² in MiB: the mid block's output, three resnets, the upsampler, ... the last block.
    sdxl = [32, 32, 32, 32, 128, 128, 128, 128, 512, 256, 256, 256, 1024, 512, 512, 512]
    assert host_buffers(sdxl) == [1024, 512]  # 1.5 GiB pinned; one buffer: 1.5 GiB rounded to 2
    sd21 = [n * 9 // 8 for n in sdxl]  # SD 2.1 at 1536² in fp16: 1152 + 576 MiB live at once
    assert host_buffers(sd21) == [1728]  # 2 GiB pinned; two buffers: 2 + 1 GiB
    assert [pinned_bytes(n) for n in (1, 3, 4, 5, 1536)] == [1, 4, 4, 8, 2048]
