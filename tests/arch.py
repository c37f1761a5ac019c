"""Tiny instances of diffusers' own classes with the structure of SD 1.5, SD 2.1, SDXL and the SD VAE.

Channel counts are cut so that the models run on a CPU in milliseconds; the structural features
that the patcher must handle are kept:

- sd15: CrossAttn blocks at three of four levels, a fixed number of heads, so the head dim doubles
  per level (8 / 16 / 32 standing for 40 / 80 / 160), conv projections, 77 text tokens.
- sd21: ``upcast_attention``, ``use_linear_projection``, heads per level chosen so that the head dim is
  the same everywhere (16 standing for 64).
- sdxl: no attention at level 1, transformer depth > 1 (``transformer_layers_per_block``), the
  ``text_time`` added conditions, linear projections.
- vae: ``AutoencoderKL``: one single-head mid-block attention on 4-D input, with group norm and a
  residual connection (head dim = channels, 64 standing for 512).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

TEXT_TOKENS = 77
LATENT = 16  # latent side: level-1 attention sees 16 * 16 = 256 tokens


def sd15_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=LATENT,
        block_out_channels=(32, 64, 128, 128),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=4,  # really the number of heads, as in SD 1.x configs (there: 8)
        cross_attention_dim=48,
        norm_num_groups=16,
    )


def sd21_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=LATENT,
        block_out_channels=(32, 64, 128, 128),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=(2, 4, 8, 8),  # heads per level: head dim 16 everywhere
        cross_attention_dim=64,
        use_linear_projection=True,
        upcast_attention=True,
        norm_num_groups=16,
    )


SDXL_TEXT_EMBEDS = 32  # pooled text embedding width


def sdxl_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=LATENT,
        block_out_channels=(32, 64, 128),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4, 8),  # head dim 16 everywhere
        transformer_layers_per_block=(1, 2, 3),  # SDXL: (1, 2, 10)
        cross_attention_dim=64,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + SDXL_TEXT_EMBEDS,
        norm_num_groups=16,
    )


def sd_vae() -> AutoencoderKL:
    return AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=16,
        sample_size=2 * LATENT,
    )


def unet_inputs(unet: UNet2DConditionModel, batch: int = 2, seed: int = 0) -> dict:
    """Keyword arguments for one UNet call; batch 2 as under classifier-free guidance."""
    g = torch.Generator().manual_seed(seed)
    cfg = unet.config
    kw = {
        "sample": torch.randn(batch, cfg.in_channels, LATENT, LATENT, generator=g),
        "timestep": torch.arange(batch) * 400 + 10,
        "encoder_hidden_states": torch.randn(batch, TEXT_TOKENS, cfg.cross_attention_dim, generator=g),
    }
    if cfg.addition_embed_type == "text_time":
        kw["added_cond_kwargs"] = {
            "text_embeds": torch.randn(batch, SDXL_TEXT_EMBEDS, generator=g),
            "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]).repeat(batch, 1),
        }
    return kw


def vae_inputs(vae: AutoencoderKL, batch: int = 1, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"sample": torch.randn(batch, vae.config.in_channels, 2 * LATENT, 2 * LATENT, generator=g)}


@dataclass(frozen=True)
class Arch:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[..., dict]


ARCHS = {
    "sd15": Arch(sd15_unet, unet_inputs),
    "sd21": Arch(sd21_unet, unet_inputs),
    "sdxl": Arch(sdxl_unet, unet_inputs),
    "vae": Arch(sd_vae, vae_inputs),
}


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    """A freshly initialized model, in eval mode, with deterministic weights."""
    torch.manual_seed(seed)
    return ARCHS[arch].build().eval()


def add_lora(unet: UNet2DConditionModel, seed: int = 1, dropout: float = 0.0) -> None:
    """A peft LoRA adapter on every attention projection, through diffusers' ``add_adapter``.

    ``init_lora_weights=False`` makes B random instead of zero, so the adapter changes the output.
    """
    from peft import LoraConfig

    torch.manual_seed(seed)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    config = LoraConfig(r=4, lora_alpha=4, lora_dropout=dropout, target_modules=targets, init_lora_weights=False)
    unet.add_adapter(config)


def sd_pipeline(xl: bool = False):
    """A tiny SD (or SDXL) pipeline without text encoders: call it with prompt embeddings."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    torch.manual_seed(0)
    unet = (sdxl_unet if xl else sd15_unet)().eval()
    vae = sd_vae().eval()
    scheduler = DDIMScheduler(steps_offset=1, clip_sample=False)
    if xl:
        return StableDiffusionXLPipeline(
            vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
            unet=unet, scheduler=scheduler, add_watermarker=False,
        )
    return StableDiffusionPipeline(
        vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def pipeline_inputs(pipe, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    width = pipe.unet.config.cross_attention_dim
    kw = {
        "prompt_embeds": torch.randn(1, TEXT_TOKENS, width, generator=g),
        "negative_prompt_embeds": torch.randn(1, TEXT_TOKENS, width, generator=g),
        "num_inference_steps": 2,
        "height": 2 * LATENT,
        "width": 2 * LATENT,
        "output_type": "pt",
        "generator": torch.Generator().manual_seed(seed),
    }
    if pipe.unet.config.addition_embed_type == "text_time":
        kw["pooled_prompt_embeds"] = torch.randn(1, SDXL_TEXT_EMBEDS, generator=g)
        kw["negative_pooled_prompt_embeds"] = torch.randn(1, SDXL_TEXT_EMBEDS, generator=g)
    return kw
