"""The models sdpatch runs: an embedded tiny model, full-size presets with random weights, and
real checkpoints (a Hugging Face repo id, a local diffusers folder or a single checkpoint file).

Resolving a model (:func:`resolve_model`) is cheap and checks everything it can without loading
weights, so that bad input fails before anything heavy happens; :func:`load_pipeline` then
builds or loads it.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import logging
import os
import pickle
import re
import shutil
import socket
import tempfile
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import torch

from sdpatch.configs import load_component_config, tokenizer_dir
from sdpatch.errors import InputError, first_line

logger = logging.getLogger(__name__)

PRESETS: dict[str, str] = {
    "tiny": "embedded miniature SD (random weights: noise-like images, for tests and demos)",
    "sd15": "Stable Diffusion 1.5 architecture, random weights",
    "sd21": "Stable Diffusion 2.1 (768-v) architecture, random weights",
    "sdxl": "SDXL base 1.0 architecture, random weights",
}

PIPELINE_CLASSES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")

DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

PRESET_SEED = 0

# Model types of diffusers' single-file loader that a text-to-image pipeline here can run.
_SINGLE_FILE_TYPES = {
    "v1": "StableDiffusionPipeline",
    "v2": "StableDiffusionPipeline",
    "xl_base": "StableDiffusionXLPipeline",
    "playground-v2-5": "StableDiffusionXLPipeline",
}
_MODEL_KINDS = (
    f"use a preset ({', '.join(PRESETS)}), a local diffusers folder, a .safetensors file, "
    "or a Hugging Face repo id (owner/name)"
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, found by :func:`resolve_model` without loading weights.

    Attributes:
        name: the model as the user named it.
        kind: ``preset``, ``folder`` (local diffusers folder), ``hub`` (repo id) or ``file``.
        pipeline_class: ``StableDiffusionPipeline`` or ``StableDiffusionXLPipeline``.
        location: the preset name, the folder or file path, or the repo id.
        cached: for a hub repo, whether it is in the local cache (then it loads offline).
    """

    name: str
    kind: Literal["preset", "folder", "hub", "file"]
    pipeline_class: str
    location: str
    cached: bool = True


def resolve_device(name: str) -> torch.device:
    """Turn ``auto|cpu|cuda|cuda:N|mps`` into a device that exists here, or raise InputError."""
    name = name.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {name!r} requested, but no CUDA GPU is available here (use --device cpu)")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= count:
            raise InputError(f"device {name!r} requested, but this machine has {count} CUDA GPU(s)")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise InputError("device 'mps' requested, but MPS is not available here")
        return device
    raise InputError(f"unsupported device {name!r}: use auto, cpu, cuda, cuda:N or mps")


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str | None]:
    """Turn ``auto|fp16|bf16|fp32`` into a dtype for ``device``.

    ``auto`` is fp16 on a GPU and fp32 on the CPU. fp16 asked for on the CPU runs as fp32,
    because many CPU kernels lack fp16 and the rest are slow; the second value is then a note
    that says so (None otherwise).
    """
    name = name.strip().lower()
    if name == "auto":
        return (torch.float32 if device.type == "cpu" else torch.float16), None
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}: use auto, fp16, bf16 or fp32")
    if name == "fp16" and device.type == "cpu":
        return torch.float32, "fp16 was requested on the CPU: running in fp32 instead"
    return DTYPES[name], None


def resolve_model(model: str, *, allow_pickle: bool = False) -> ModelSource:
    """Find out what ``model`` names and check it can be loaded, without loading weights.

    ``model`` is a preset (``tiny``, ``sd15``, ``sd21``, ``sdxl``), a local diffusers folder, a
    ``.safetensors`` file, a ``.ckpt`` file (only with ``allow_pickle``: unpickling can run
    code), or a Hugging Face repo id. Raises InputError with a one-line reason otherwise.
    """
    if model in PRESETS:
        pipeline = "StableDiffusionXLPipeline" if model == "sdxl" else "StableDiffusionPipeline"
        return ModelSource(model, "preset", pipeline, model)
    if not model.strip():  # Path("") is the current folder
        raise InputError(f"--model is empty: {_MODEL_KINDS}")
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(model, "folder", _folder_pipeline_class(path), str(path))
    if path.suffix.lower() in (".safetensors", ".ckpt", ".pt", ".pth", ".bin"):
        return ModelSource(model, "file", _single_file_pipeline_class(path, allow_pickle), str(path))
    if path.exists():
        raise InputError(f"model file {model!r} is not a .safetensors or .ckpt checkpoint")
    if _REPO_ID.match(model) and not model.startswith((".", "/", "~")):
        return _resolve_hub(model)
    raise InputError(f"unknown model {model!r}: {_MODEL_KINDS}")


def load_pipeline(source: ModelSource, *, device: torch.device, dtype: torch.dtype) -> Any:
    """Build or load the pipeline ``source`` names, on ``device`` in ``dtype``.

    Presets are built from the shipped configs with seeded random weights. Loading failures
    (a missing or broken file, an unreachable Hub) raise InputError with a one-line reason.
    """
    if source.kind == "preset":
        return build_preset(source.location, device=device, dtype=dtype)
    cls = diffusers_pipeline(source.pipeline_class)
    try:
        with warnings.catch_warnings():
            # Newer diffusers renamed torch_dtype to dtype; older ones know only torch_dtype.
            warnings.filterwarnings("ignore", message=".*torch_dtype.*deprecated", category=FutureWarning)
            if source.kind == "file":
                # Its configs and tokenizer come from the Hub repo of the checkpoint's architecture.
                local = _offline() or not _hub_reachable()
                pipe = cls.from_single_file(source.location, torch_dtype=dtype, local_files_only=local)
            else:
                local = source.kind == "folder" or source.cached
                pipe = cls.from_pretrained(source.location, torch_dtype=dtype, local_files_only=local)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise InputError(_load_failure(source, exc)) from exc
    return pipe.to(device)


def build_preset(name: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """Build a preset pipeline from the shipped configs with random weights seeded by PRESET_SEED.

    The modules are created directly on ``device`` in ``dtype`` (no fp32 CPU copy first), so the
    full-size presets build quickly on a GPU. ``device="meta"`` builds them without memory, which
    is how tests check their sizes. The caller's random state is left as it was.
    """
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    device = torch.device(device)
    modules = ["unet", "vae", "text_encoder", *(["text_encoder_2"] if name == "sdxl" else [])]
    with _seeded(device), device, _default_dtype(dtype):
        components = {key: _component(name, key).eval().requires_grad_(False) for key in modules}
    # The scheduler stays outside the device context: its tables belong on the CPU.
    components["scheduler"] = _component(name, "scheduler")
    tokenizer = preset_tokenizer(name)
    if name == "sdxl":  # the second, OpenCLIP's, pads with "!" (id 0), as SDXL's own does
        tokenizer_2 = preset_tokenizer(name, pad_token="!")
        return diffusers_pipeline("StableDiffusionXLPipeline")(tokenizer=tokenizer, tokenizer_2=tokenizer_2, **components)
    return diffusers_pipeline("StableDiffusionPipeline")(
        tokenizer=tokenizer, safety_checker=None, feature_extractor=None, requires_safety_checker=False, **components
    )


def diffusers_pipeline(name: str) -> type:
    """diffusers' pipeline class ``name``. Its first import loads transformers' image processors,
    and transformers 5 logs for each that, without torchvision, it falls back to the PIL version:
    text-to-image never uses them, so sdpatch's import drops those notices (only those)."""
    import diffusers

    source = logging.getLogger("transformers.utils.import_utils")
    quiet = _TorchvisionFallbacks()
    source.addFilter(quiet)
    try:
        return getattr(diffusers, name)
    finally:
        source.removeFilter(quiet)


class _TorchvisionFallbacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back" not in record.getMessage()


def build_from_configs(source: ModelSource, *, dtype: torch.dtype = torch.float16) -> Any:
    """The pipeline ``source`` names, built on the meta device from its components' configs alone
    (no weights are read or downloaded): what a plan without weights measures. Configs come from
    the shipped presets, a local diffusers folder, or the Hugging Face cache."""
    if source.kind == "preset":
        return build_preset(source.location, device="meta", dtype=dtype)
    if source.kind == "file":
        raise InputError(f"{source.name}: a checkpoint file carries no configs; plan with a diffusers folder or repo id")
    keys = ["unet", "vae", "text_encoder", *(["text_encoder_2"] if source.pipeline_class.endswith("XLPipeline") else [])]
    with torch.device("meta"), _default_dtype(dtype):
        components = {key: _build(_config_of(source, key)).eval() for key in keys}
    components["scheduler"] = _component("sd15", "scheduler")  # any scheduler: it holds no memory
    tokenizer = preset_tokenizer("tiny")  # no text is encoded on the meta device
    if "text_encoder_2" in components:
        return diffusers_pipeline("StableDiffusionXLPipeline")(tokenizer=tokenizer, tokenizer_2=tokenizer, **components)
    return diffusers_pipeline("StableDiffusionPipeline")(
        tokenizer=tokenizer, safety_checker=None, feature_extractor=None, requires_safety_checker=False, **components
    )


def _config_of(source: ModelSource, component: str) -> dict[str, Any]:
    """A component's config.json from a folder or the Hub cache, with its class name (from
    model_index.json where the config lacks one, as transformers' configs do)."""
    if source.kind == "folder":
        root = Path(source.location)
        index, path = root / "model_index.json", root / component / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = [try_to_load_from_cache(source.location, f) for f in ("model_index.json", f"{component}/config.json")]
        if not all(isinstance(f, str) for f in found):
            raise InputError(f"{source.name}: {component}/config.json is not in the Hugging Face cache")
        index, path = (Path(f) for f in found)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        cfg.setdefault("_class_name", json.loads(index.read_text(encoding="utf-8"))[component][1])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise InputError(f"cannot read {source.name}'s {component} config: {first_line(exc)}") from None
    return cfg


def _build(cfg: dict[str, Any]) -> Any:
    """A component from its config, by the class its ``_class_name`` names."""
    import diffusers
    import transformers

    class_name = cfg.pop("_class_name")
    if hasattr(diffusers, class_name):
        return getattr(diffusers, class_name).from_config(cfg)
    cls = getattr(transformers, class_name)
    return cls(cls.config_class(**cfg))


def default_size(pipe: Any) -> int:
    """The image side the pipeline was trained at (diffusers' default height and width)."""
    return int(pipe.unet.config.sample_size * pipe.vae_scale_factor)


# -- helpers -------------------------------------------------------------------------------


def _component(preset: str, component: str) -> Any:
    """A preset's component, built from its shipped config by the class ``_class_name`` names."""
    return _build(load_component_config(preset, component))


def preset_tokenizer(name: str, **kwargs: Any) -> Any:
    """The tokenizer of a preset: CLIP's own BPE vocabulary for the full-size ones where it is
    installed (:func:`clip_bpe_file`), else the stand-in of ``configs/tokenizer`` (see
    :func:`tokenizer_note`). ``kwargs`` go to ``CLIPTokenizer.from_pretrained``."""
    from transformers import CLIPTokenizer

    bpe = clip_bpe_file() if name != "tiny" else None
    if bpe is None:
        return CLIPTokenizer.from_pretrained(str(tokenizer_dir()), **kwargs)
    with tempfile.TemporaryDirectory() as folder:
        _write_clip_tokenizer(bpe, Path(folder))
        return CLIPTokenizer.from_pretrained(folder, **kwargs)


# CLIP's vocabulary: its 256 byte symbols, each also ending a word, 48894 merges, 2 special tokens.
CLIP_MERGES = 49408 - 2 * 256 - 2


def clip_bpe_file() -> Path | None:
    """CLIP's BPE merges (``bpe_simple_vocab_16e6.txt.gz``) as the open-clip-torch package ships
    them, found without importing it (that would import torchvision); None if not installed."""
    spec = importlib.util.find_spec("open_clip")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "bpe_simple_vocab_16e6.txt.gz"
        if path.is_file():
            return path
    return None


def tokenizer_note(model: str) -> str | None:
    """A line for the report of a full-size preset whose prompts do not tokenize as CLIP's."""
    if model not in PRESETS or model == "tiny" or clip_bpe_file() is not None:
        return None
    return (
        f"the {model} preset tokenizes with sdpatch's 533-entry stand-in vocabulary, not CLIP's: its token "
        "counts and where a long prompt is cut differ from the real model's "
        "(pip install --no-deps open-clip-torch gives it CLIP's)"
    )


def _byte_symbols() -> list[str]:
    """Byte-level BPE's symbols for the 256 bytes, in CLIP's vocabulary order: the bytes that are
    printable Latin-1 characters as themselves, then each other byte as a character from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def _write_clip_tokenizer(bpe: Path, folder: Path) -> None:
    """Write CLIP's vocab.json, merges.txt and tokenizer config into ``folder``, from its merges."""
    lines = gzip.decompress(bpe.read_bytes()).decode("utf-8").split("\n")
    merges = lines[1 : 1 + CLIP_MERGES]  # the first line is a version header
    symbols = _byte_symbols()
    tokens = [*symbols, *(s + "</w>" for s in symbols), *(m.replace(" ", "") for m in merges)]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    (folder / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n", encoding="utf-8")
    shutil.copy(tokenizer_dir() / "tokenizer_config.json", folder / "tokenizer_config.json")


@contextlib.contextmanager
def _seeded(device: torch.device) -> Iterator[None]:
    """Seed weight init with PRESET_SEED without disturbing the caller's random state."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(PRESET_SEED)
        yield


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _folder_pipeline_class(path: Path) -> str:
    index = path / "model_index.json"
    if not index.is_file():
        raise InputError(f"{str(path)!r} is not a diffusers model folder (no model_index.json)")
    return _pipeline_class_from_index(index, str(path))


def _pipeline_class_from_index(index: Path, name: str) -> str:
    try:
        class_name = json.loads(index.read_text(encoding="utf-8"))["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"cannot read {name}'s model_index.json: {exc}") from None
    if class_name not in PIPELINE_CLASSES:
        raise InputError(f"{name} is a {class_name}; sdpatch runs {' and '.join(PIPELINE_CLASSES)} models")
    return class_name


def _single_file_pipeline_class(path: Path, allow_pickle: bool) -> str:
    """Check a checkpoint file is readable and a supported SD model; return its pipeline class."""
    if not path.is_file():
        raise InputError(f"model file {str(path)!r} does not exist")
    if not os.access(path, os.R_OK):
        raise InputError(f"model file {str(path)!r} is not readable")
    if path.suffix.lower() == ".safetensors":
        checkpoint: Mapping[str, Any] = _SafetensorsView(path)
    elif not allow_pickle:
        raise InputError(
            f"{path.name} is a pickle checkpoint, and loading pickle can run code: convert it to "
            ".safetensors, or pass --allow-pickle if you trust the file"
        )
    else:
        try:
            # Memory-map where the format allows it (zip-based checkpoints): only a few tensors are read.
            mmap = zipfile.is_zipfile(path)
            checkpoint = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message advises weights_only=False, which --allow-pickle does not mean.
            detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", str(exc), re.S)
            raise InputError(
                f"cannot read {path.name} as a checkpoint of tensors: torch.load(weights_only=True) refused it"
                + (f" ({detail.group(1).split('. ')[0]})" if detail else "")
                + "; it is damaged, or holds other Python objects, which sdpatch does not load"
            ) from None
        except Exception as exc:  # noqa: BLE001 (any failure here means "not a checkpoint")
            raise InputError(f"cannot read {path.name} as a checkpoint: {first_line(exc)}") from None
        checkpoint = checkpoint.get("state_dict", checkpoint)
    if not any(key.startswith("model.diffusion_model.") for key in checkpoint):
        raise InputError(f"{path.name} is not a Stable Diffusion checkpoint (no model.diffusion_model.* weights)")
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    try:
        model_type = infer_diffusers_model_type(checkpoint)
    except Exception as exc:  # noqa: BLE001 (it indexes tensor shapes that a damaged file may lack)
        raise InputError(f"cannot tell which model {path.name} is: {type(exc).__name__}: {first_line(exc)}") from None
    if model_type not in _SINGLE_FILE_TYPES:
        raise InputError(f"{path.name} is a {model_type!r} checkpoint; sdpatch runs SD 1.x, 2.x and SDXL base")
    return _SINGLE_FILE_TYPES[model_type]


class _SafetensorsView(Mapping[str, torch.Tensor]):
    """A read-only view of a .safetensors file that loads a tensor only when it is indexed.

    Opening it parses and validates the header, which catches truncated and non-safetensors
    files before any weights are read.
    """

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        try:
            self._file = safe_open(str(path), framework="pt")
            self._keys = set(self._file.keys())
        except Exception as exc:  # noqa: BLE001 (safetensors raises several unrelated types)
            raise InputError(f"cannot read {path.name} as safetensors: {first_line(exc)}") from None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "")
    return bool(constants.HF_HUB_OFFLINE) or flag.upper() in {"1", "ON", "YES", "TRUE"}


def _hub_reachable() -> bool:
    """Whether a TCP connection to the Hub opens within 3 s.

    huggingface_hub retries an unreachable Hub for about 25 s; this probe lets an offline
    machine fail at once instead.
    """
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=_HUB_PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _resolve_hub(repo_id: str) -> ModelSource:
    """A repo id loads from the local cache if it is there; otherwise the Hub must be reachable."""
    from huggingface_hub import constants, try_to_load_from_cache

    index = try_to_load_from_cache(repo_id, "model_index.json")
    if isinstance(index, str):
        return ModelSource(repo_id, "hub", _pipeline_class_from_index(Path(index), repo_id), repo_id, cached=True)
    hint = "use --model tiny, or a local folder or .safetensors file"
    if _offline():
        raise InputError(f"model {repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {hint}")
    if not _hub_reachable():
        host = urlparse(constants.ENDPOINT).hostname
        raise InputError(f"model {repo_id!r} is not in the Hugging Face cache and {host} cannot be reached: {hint}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import HfHubHTTPError

    try:
        index_path = hf_hub_download(repo_id, "model_index.json")
    except (HfHubHTTPError, OSError) as exc:
        raise InputError(f"cannot fetch model {repo_id!r} from the Hub: {first_line(exc)}") from None
    return ModelSource(repo_id, "hub", _pipeline_class_from_index(Path(index_path), repo_id), repo_id, cached=False)


def _load_failure(source: ModelSource, exc: BaseException) -> str:
    if source.kind == "file" and (_offline() or not _hub_reachable()):
        return (
            f"cannot load {Path(source.location).name}: diffusers' single-file loader needs the matching "
            "configs and tokenizer from the Hugging Face Hub, which are not cached here, and this run is "
            "offline; run it once online, or use a diffusers folder"
        )
    return f"cannot load model {source.name!r}: {first_line(exc)}"
