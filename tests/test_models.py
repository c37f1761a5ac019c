"""Models: the embedded tiny model, the full-size presets (checked on the meta device, never run),
device/dtype resolution, and resolving and loading real models offline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdpatch.errors import InputError
from sdpatch.generate import measured_call
from sdpatch.memory import MemoryMeter
from sdpatch.generate import RunOptions, check_setup
from sdpatch.models import (
    build_preset,
    clip_bpe_file,
    load_pipeline,
    preset_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
    tokenizer_note,
)


@pytest.fixture(scope="module")
def tiny():
    pipe = build_preset("tiny")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- tiny -----------------------------------------------------------------------------------


def test_tiny_is_seeded_and_leaves_the_callers_rng_alone(tiny):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    again = build_preset("tiny")
    assert torch.equal(torch.rand(3), expected)
    for a, b in zip(tiny.unet.parameters(), again.unet.parameters()):
        assert torch.equal(a, b)


def test_tiny_uses_the_real_classes(tiny):
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    assert isinstance(tiny, StableDiffusionPipeline)
    assert isinstance(tiny.unet, UNet2DConditionModel)
    assert isinstance(tiny.vae, AutoencoderKL)
    assert isinstance(tiny.text_encoder, CLIPTextModel)
    assert isinstance(tiny.tokenizer, CLIPTokenizer)
    assert tiny.vae_scale_factor == 8  # as in every real SD VAE: 64 px -> 8x8 latents


@pytest.mark.parametrize("text", ["a photo of a cat", "ÜBER ünïcødé 🐱 日本語", "", "x" * 500])
def test_local_tokenizer_takes_any_text(tiny, text):
    ids = tiny.tokenizer(text, padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77
    assert ids[0] == tiny.tokenizer.bos_token_id
    assert max(ids) < tiny.text_encoder.config.vocab_size


def test_tiny_generates_a_non_degenerate_image(tiny):
    meter = MemoryMeter(torch.device("cpu"))
    images = measured_call(
        tiny, meter, prompt="a cat", negative_prompt=None, height=64, width=64, steps=2, guidance_scale=7.5, seed=0
    )
    pixels = np.asarray(images[0], dtype=np.float32) / 255
    assert pixels.shape == (64, 64, 3)
    assert np.isfinite(pixels).all()
    assert pixels.std() > 0.05  # not a flat colour
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 100
    assert [p.name for p in meter.phases] == ["text_encoding", "denoising", "vae_decode"]
    assert meter.phases[1].steps == 2
    assert all(p.peak_host and p.peak_host > 0 and p.seconds >= 0 for p in meter.phases)


def test_a_seed_gives_the_same_image_and_another_seed_another(tiny):
    def image(seed: int) -> np.ndarray:
        meter = MemoryMeter(torch.device("cpu"))
        args = dict(prompt="a", negative_prompt="b", height=64, width=64, steps=2, guidance_scale=5.0)
        return np.asarray(measured_call(tiny, meter, seed=seed, **args)[0])

    assert np.array_equal(image(1), image(1))
    assert not np.array_equal(image(1), image(2))


def test_sdxl_pipeline_phases():
    """The SDXL path (two text encoders, pooled embeddings) on a tiny SDXL of the real classes."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from sdpatch.configs import load_component_config

    tiny = build_preset("tiny")
    unet_cfg = {k: v for k, v in load_component_config("tiny", "unet").items() if k != "_class_name"}
    unet_cfg.update(
        cross_attention_dim=64,  # both encoders' hidden states side by side
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
        transformer_layers_per_block=[1, 2],
    )
    text_cfg = {k: v for k, v in load_component_config("tiny", "text_encoder").items() if k != "_class_name"}
    torch.manual_seed(0)
    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL.from_config(tiny.vae.config),
        text_encoder=CLIPTextModel(CLIPTextConfig(**text_cfg)),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**text_cfg)),
        tokenizer=tiny.tokenizer,
        tokenizer_2=tiny.tokenizer,
        unet=UNet2DConditionModel(**unet_cfg),
        scheduler=EulerDiscreteScheduler.from_config(tiny.scheduler.config),
    )
    pipe.set_progress_bar_config(disable=True)
    meter = MemoryMeter(torch.device("cpu"))
    images = measured_call(
        pipe, meter, prompt="a cat", negative_prompt="a dog", height=64, width=64, steps=2, guidance_scale=5.0, seed=0
    )
    assert images[0].size == (64, 64)
    assert [p.name for p in meter.phases] == ["text_encoding", "denoising", "vae_decode"]


# -- full-size presets, on the meta device --------------------------------------------------


@pytest.mark.parametrize(
    "preset, millions",
    [
        pytest.param("sd15", {"unet": 859.52, "vae": 83.65, "text_encoder": 123.06}, id="sd15"),
        pytest.param("sd21", {"unet": 865.91, "vae": 83.65, "text_encoder": 340.39}, id="sd21"),
        pytest.param(
            "sdxl", {"unet": 2567.46, "vae": 83.65, "text_encoder": 123.06, "text_encoder_2": 694.66}, id="sdxl"
        ),
    ],
)
def test_presets_have_the_published_sizes(preset, millions):
    pipe = build_preset(preset, device="meta")
    for name, expected in millions.items():
        assert _params(getattr(pipe, name)) / 1e6 == pytest.approx(expected, abs=0.01), name
    assert next(pipe.unet.parameters()).device.type == "meta"


def test_presets_keep_the_features_that_matter_for_attention():
    sd15 = build_preset("sd15", device="meta")
    sd21 = build_preset("sd21", device="meta")
    sdxl = build_preset("sdxl", device="meta")

    def head_dims(unet) -> set[int]:
        return {m.inner_dim // m.heads for m in unet.modules() if type(m).__name__ == "Attention"}

    assert head_dims(sd15.unet) == {40, 80, 160}
    assert head_dims(sd21.unet) == {64}
    assert sd21.unet.config.upcast_attention and sd21.unet.config.use_linear_projection
    assert sd21.scheduler.config.prediction_type == "v_prediction"
    assert head_dims(sdxl.unet) == {64}
    assert list(sdxl.unet.config.transformer_layers_per_block) == [1, 2, 10]
    assert type(sdxl).__name__ == "StableDiffusionXLPipeline"
    assert type(sdxl.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    vae_heads = {(m.heads, m.inner_dim // m.heads) for m in sd15.vae.modules() if type(m).__name__ == "Attention"}
    assert vae_heads == {(1, 512)}
    assert {sd15.vae_scale_factor, sdxl.vae_scale_factor} == {8}


def test_presets_build_in_the_requested_dtype():
    pipe = build_preset("sd15", device="meta", dtype=torch.float16)
    assert {p.dtype for p in pipe.unet.parameters()} == {torch.float16}
    assert {p.dtype for p in pipe.text_encoder.parameters()} == {torch.float16}
    assert torch.get_default_dtype() == torch.float32


# -- device and dtype ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, dtype, expected, noted",
    [
        pytest.param("cpu", "auto", torch.float32, False, id="auto-is-fp32-on-cpu"),
        pytest.param("cpu", "fp16", torch.float32, True, id="fp16-on-cpu-runs-fp32"),
        pytest.param("cpu", "bf16", torch.bfloat16, False, id="bf16-on-cpu"),
        pytest.param("cpu", "fp32", torch.float32, False, id="fp32"),
        pytest.param("cuda", "auto", torch.float16, False, id="auto-is-fp16-on-gpu"),
    ],
)
def test_resolve_dtype(device, dtype, expected, noted):
    got, note = resolve_dtype(dtype, torch.device(device))
    assert got == expected
    assert (note is not None) == noted


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto").type in ("cpu", "mps")
        for name in ("cuda", "cuda:0", "cuda:3"):
            with pytest.raises(InputError, match="no CUDA GPU"):
                resolve_device(name)
    for name in ("tpu", "gpu0", "npu"):
        with pytest.raises(InputError):
            resolve_device(name)


# -- resolving and loading real models ----------------------------------------------------


def _sd_keys(model_type: str) -> dict[str, torch.Tensor]:
    """The few tensors by which diffusers tells SD 1.x, 2.x and SDXL checkpoints apart."""
    keys = {"model.diffusion_model.output_blocks.11.0.skip_connection.weight": torch.zeros(1)}
    if model_type == "v2":
        keys["model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight"] = torch.zeros(320, 1024)
    if model_type == "xl_base":
        keys["conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias"] = torch.zeros(1)
    if model_type == "xl_refiner":
        keys["conditioner.embedders.0.model.transformer.resblocks.9.mlp.c_proj.bias"] = torch.zeros(1)
    return keys


@pytest.mark.parametrize(
    "model_type, pipeline",
    [
        pytest.param("v1", "StableDiffusionPipeline", id="sd1"),
        pytest.param("v2", "StableDiffusionPipeline", id="sd2"),
        pytest.param("xl_base", "StableDiffusionXLPipeline", id="sdxl"),
    ],
)
def test_single_file_architecture_is_guessed_from_its_keys(tmp_path, model_type, pipeline):
    path = tmp_path / "model.safetensors"
    save_file(_sd_keys(model_type), str(path))
    source = resolve_model(str(path))
    assert (source.kind, source.pipeline_class) == ("file", pipeline)


def _write(tmp_path: Path, name: str, data: bytes | dict) -> str:
    path = tmp_path / name
    if isinstance(data, dict):
        save_file(data, str(path))
    else:
        path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "make, message",
    [
        pytest.param(lambda d: "nonexistent-preset", "unknown model", id="unknown-name"),
        pytest.param(lambda d: str(d / "missing.safetensors"), "does not exist", id="missing-file"),
        pytest.param(lambda d: _write(d, "x.safetensors", b"not a checkpoint"), "cannot read", id="not-safetensors"),
        pytest.param(lambda d: _write(d, "t.safetensors", _truncated(d)), "cannot read", id="truncated-safetensors"),
        pytest.param(
            lambda d: _write(d, "o.safetensors", {"w": torch.zeros(2)}), "not a Stable Diffusion", id="other-model"
        ),
        pytest.param(lambda d: _write(d, "r.safetensors", _sd_keys("xl_refiner")), "xl_refiner", id="sdxl-refiner"),
        pytest.param(lambda d: _write(d, "m.ckpt", b"pickle"), "pickle", id="ckpt-needs-allow-pickle"),
        pytest.param(lambda d: _write(d, "m.txt", b"hello"), "not a .safetensors", id="text-file"),
        pytest.param(lambda d: str(d), "no model_index.json", id="folder-without-index"),
        pytest.param(lambda d: _folder(d, "FluxPipeline"), "FluxPipeline", id="unsupported-pipeline"),
        pytest.param(lambda d: "someone/not-cached-model", "HF_HUB_OFFLINE", id="hub-id-not-cached"),
    ],
)
def test_bad_models_fail_in_one_line_before_loading(tmp_path, make, message):
    with pytest.raises(InputError, match=message) as err:
        resolve_model(make(tmp_path))
    assert "\n" not in str(err.value)


def _truncated(tmp_path: Path) -> bytes:
    path = tmp_path / "whole.safetensors"
    save_file({"model.diffusion_model.w": torch.zeros(64)}, str(path))
    return path.read_bytes()[:-16]


def _folder(tmp_path: Path, class_name: str) -> str:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return str(tmp_path)


def test_pickle_checkpoint_loads_only_with_the_flag(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": _sd_keys("v1")}, path)
    with pytest.raises(InputError, match="--allow-pickle"):
        resolve_model(str(path))
    assert resolve_model(str(path), allow_pickle=True).pipeline_class == "StableDiffusionPipeline"


def test_diffusers_folder_round_trip(tmp_path, tiny):
    tiny.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.pipeline_class) == ("folder", "StableDiffusionPipeline")
    pipe = load_pipeline(source, device=torch.device("cpu"), dtype=torch.float32)
    for a, b in zip(tiny.unet.state_dict().values(), pipe.unet.state_dict().values()):
        assert torch.equal(a, b)
    assert pipe.tokenizer("a cat").input_ids == tiny.tokenizer("a cat").input_ids


def test_single_file_offline_without_cached_configs_fails_in_one_line(tmp_path):
    """diffusers' single-file loader fetches the model's configs and tokenizer from the Hub; offline
    and uncached it cannot, and sdpatch says so (loading a real checkpoint needs them cached)."""
    path = tmp_path / "model.safetensors"
    save_file(_sd_keys("v1"), str(path))
    with pytest.raises(InputError, match="configs and tokenizer") as err:
        load_pipeline(resolve_model(str(path)), device=torch.device("cpu"), dtype=torch.float32)
    assert "\n" not in str(err.value)


def test_step_time_leaves_out_only_the_first_step_of_a_run():
    from sdpatch.memory import PhaseStats, summarize

    first = PhaseStats("denoising", seconds=13.0, step_seconds=[10.0, 1.0, 2.0])
    second = PhaseStats("denoising", seconds=3.0, step_seconds=[1.0, 2.0])
    assert first.seconds_per_step == pytest.approx(1.5)
    (both,) = summarize([[first], [second]])
    assert both.steps == 5 and both.first_step_seconds == 10.0
    assert both.seconds_per_step == pytest.approx(1.5)
    assert both.seconds == pytest.approx(8.0)
    assert PhaseStats("x", step_seconds=[4.0]).seconds_per_step == 4.0


LIBRARY_IMPORTS = {
    "diffusers": "from diffusers import StableDiffusionPipeline",
    "sdpatch": "import sdpatch; from sdpatch.models import build_preset; build_preset('tiny')",
}


def test_library_use_drops_only_transformers_torchvision_notices():
    """transformers 5 without torchvision logs a fallback notice per image processor when diffusers'
    pipelines are first imported; sdpatch's own import of them drops those, and nothing else: a
    transformers warning of the user's still shows."""
    import subprocess
    import sys

    mine = "from transformers.utils import logging; logging.get_logger('transformers.mine').warning('my own warning')"

    def stderr(code: str) -> str:
        return subprocess.run([sys.executable, "-c", f"{code}; {mine}"], capture_output=True, text=True, check=True).stderr

    notice = "requires torchvision (not installed)"
    if notice not in stderr(LIBRARY_IMPORTS["diffusers"]):
        pytest.skip("this transformers logs no torchvision fallback notice")
    err = stderr(LIBRARY_IMPORTS["sdpatch"])
    assert notice not in err and "my own warning" in err

# -- tokenizers ----------------------------------------------------------------------------------

needs_clip = pytest.mark.skipif(clip_bpe_file() is None, reason="open-clip-torch (CLIP's BPE merges) is not installed")


@needs_clip
def test_full_size_presets_tokenize_as_clip():
    tokenizer = preset_tokenizer("sd15")
    assert len(tokenizer) == 49408 and tokenizer.model_max_length == 77
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]  # CLIP's ids
    long = tokenizer(" ".join(["a tall lighthouse on a rocky coast"] * 20), truncation=True).input_ids
    assert len(long) == 77 and long[-1] == 49407
    assert preset_tokenizer("sdxl", pad_token="!").pad_token_id == 0  # SDXL's second tokenizer pads with "!"
    assert check_setup(RunOptions(model="sd15", backend="stock", device="cpu")).notes == []


def test_without_clips_vocabulary_a_full_size_preset_says_its_token_counts_are_not_clips(monkeypatch):
    monkeypatch.setattr("sdpatch.models.clip_bpe_file", lambda: None)
    assert len(preset_tokenizer("sd15")) == 533
    (note,) = check_setup(RunOptions(model="sdxl", backend="stock", device="cpu")).notes
    assert note.startswith("the sdxl preset tokenizes with sdpatch's 533-entry stand-in vocabulary, not CLIP's")
    assert tokenizer_note("tiny") is None  # tiny's text encoder has the stand-in's 533 entries


def test_tiny_keeps_its_own_vocabulary():
    assert len(preset_tokenizer("tiny")) == 533
