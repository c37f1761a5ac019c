"""Configs shipped with sdpatch, so that its models build offline.

- ``tiny/``: a miniature Stable Diffusion (UNet2DConditionModel, AutoencoderKL, CLIPTextModel,
  EulerDiscreteScheduler) that generates a 64 px image on a CPU in a second or so.
- ``sd15/``, ``sd21/``, ``sdxl/``: the component configs of runwayml's SD 1.5,
  stabilityai's SD 2.1 and SDXL base 1.0, as diffusers and transformers publish them.
- ``tokenizer/``: a byte-level CLIP BPE vocabulary (the 256 byte symbols, their end-of-word
  forms, a few merges and CLIP's two special tokens). Every byte string tokenizes, but it is not
  CLIP's real vocabulary: it serves ``tiny``, and the full-size presets where CLIP's own is not
  installed (:func:`sdpatch.models.preset_tokenizer`), which their reports then say.

Each preset folder holds one ``<component>.json`` per component; ``_class_name`` names the class.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any


def config_dir() -> Path:
    """The folder that holds the shipped configs (a real folder: the package is not zipped)."""
    return Path(str(resources.files(__package__)))


def tokenizer_dir() -> Path:
    """The folder of the local byte-level CLIP tokenizer (vocab.json, merges.txt)."""
    return config_dir() / "tokenizer"


def load_component_config(preset: str, component: str) -> dict[str, Any]:
    """The config dict of one component of a preset, e.g. ``("sd15", "unet")``."""
    with open(config_dir() / preset / f"{component}.json", encoding="utf-8") as f:
        return json.load(f)
