"""The ``sdpatch`` command line, through typer's CliRunner and as the installed console script.

Everything runs the embedded ``tiny`` model on the CPU at 64 px and 2 steps, offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from helpers import FAST, console_script, invoke
from sdpatch.generate import GenerationRequest, run, write_png


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- generating ----------------------------------------------------------------------------


def test_generate_writes_a_png_that_carries_its_record(tmp_path):
    out, report = tmp_path / "cat.png", tmp_path / "report.json"
    result = invoke(
        "generate",
        "a photo of a cat",
        *FAST,
        "--seed",
        "7",
        "-n",
        "blurry",
        "-o",
        str(out),
        "--report-json",
        str(report),
    )
    assert result.exit_code == 0, result.output
    for row in ("text encoding", "denoising", "VAE decode", "total", "peak host memory", "weights:"):
        assert row in result.stdout

    image = Image.open(out)
    assert image.size == (64, 64)
    text = image.text
    assert text["prompt"] == "a photo of a cat"
    assert text["negative_prompt"] == "blurry"
    assert (text["seed"], text["steps"], text["size"], text["model"], text["backend"]) == (
        "7",
        "2",
        "64x64",
        "tiny",
        "auto",
    )
    record = json.loads(text["sdpatch"])
    assert [p["name"] for p in record["phases"]] == ["text_encoding", "denoising", "vae_decode"]
    assert all(p["peak_host"] > 0 for p in record["phases"])
    assert record["phases"][1]["steps"] == 2 and record["phases"][1]["seconds_per_step"] > 0
    assert record["memory"]["kind"] == "host"
    assert record["weights_bytes"] > 0

    data = json.loads(report.read_text())
    assert data["complete"] is True
    assert data["images"][0]["path"] == str(out)
    assert data["images"][0]["seed"] == 7
    assert data["total"]["peak_host"] == max(p["peak_host"] for p in data["phases"])
    assert data["patch"]["patched"] > 0  # backend auto patches every attention layer
    assert data["environment"]["torch"] == torch.__version__


def test_several_images_go_into_a_folder_named_by_seed(tmp_path):
    out = tmp_path / "new-folder"
    result = invoke("generate", "a cat", *FAST, "--num-images", "2", "--seed", "5", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["sdpatch-5.png", "sdpatch-6.png"]
    first, second = (Image.open(out / f"sdpatch-{s}.png") for s in (5, 6))
    assert (first.text["seed"], second.text["seed"]) == ("5", "6")
    assert not np.array_equal(np.asarray(first), np.asarray(second))
    assert "2 images" in result.stdout


def test_the_same_seed_gives_the_same_image_on_every_backend(tmp_path):
    pixels = {}
    for backend in ("stock", "chunked", "sdpa"):
        out = tmp_path / f"{backend}.png"
        result = invoke("generate", "a cat", *FAST, "--backend", backend, "-o", str(out))
        assert result.exit_code == 0, result.output
        assert Image.open(out).text["backend"] == backend
        pixels[backend] = np.asarray(Image.open(out), dtype=np.int16)
    assert np.abs(pixels["chunked"] - pixels["stock"]).max() <= 1
    assert np.abs(pixels["sdpa"] - pixels["stock"]).max() <= 1


def test_overwrite_is_needed_to_replace_an_image(tmp_path):
    out = tmp_path / "a.png"
    assert invoke("generate", "a", *FAST, "-o", str(out)).exit_code == 0
    assert invoke("generate", "a", *FAST, "--seed", "1", "-o", str(out)).exit_code == 2
    assert Image.open(out).text["seed"] == "0"
    assert invoke("generate", "a", *FAST, "--seed", "1", "-o", str(out), "--overwrite").exit_code == 0
    assert Image.open(out).text["seed"] == "1"


def test_fp16_on_the_cpu_runs_as_fp32_and_says_so(tmp_path):
    result = invoke("generate", "a", *FAST, "--dtype", "fp16", "--device", "cpu", "-o", str(tmp_path / "a.png"))
    assert result.exit_code == 0, result.output
    assert "fp16 was requested on the CPU: running in fp32" in result.stdout
    assert Image.open(tmp_path / "a.png").text["dtype"] == "float32"


def test_default_output_is_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert invoke("generate", "a", *FAST, "--seed", "3").exit_code == 0
    assert (tmp_path / "sdpatch-3.png").is_file()


def test_an_interrupted_run_keeps_finished_images_and_a_valid_report(tmp_path):
    def interrupt(record) -> None:
        raise KeyboardInterrupt

    request = GenerationRequest("a cat", height=64, width=64, steps=2, num_images=3)
    with pytest.raises(KeyboardInterrupt):
        run(
            request,
            device="cpu",
            output=tmp_path / "out",
            report_json=tmp_path / "r.json",
            progress=False,
            on_image=interrupt,
        )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sdpatch-0.png"]
    Image.open(tmp_path / "out" / "sdpatch-0.png").load()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is False
    assert len(report["images"]) == 1


def test_an_image_write_that_fails_leaves_nothing(tmp_path):
    class Exploding(Image.Image):
        def save(self, *args, **kwargs):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_png(Exploding(), tmp_path / "a.png", {"prompt": "x"})
    assert list(tmp_path.iterdir()) == []


# -- bad input -------------------------------------------------------------------------------


def _setup_existing(d: Path) -> list[str]:
    (d / "taken.png").write_bytes(b"an earlier image")
    return ["-o", str(d / "taken.png")]


def _setup_model_file(name: str, content: bytes | dict):
    def setup(d: Path) -> list[str]:
        path = d / "models" / name
        path.parent.mkdir()
        if isinstance(content, dict):
            save_file(content, str(path))
            path.write_bytes(path.read_bytes()[:-8])  # truncated
        else:
            path.write_bytes(content)
        return ["-m", str(path)]

    return setup


BAD = [
    pytest.param(["--height", "60"], "multiple of 8", id="height-not-multiple-of-8"),
    pytest.param(["--width", "0"], "multiple of 8", id="width-zero"),
    pytest.param(["--height", "-64"], "multiple of 8", id="height-negative"),
    pytest.param(["--steps", "0"], "--steps", id="steps-zero"),
    pytest.param(["--steps", "-3"], "--steps", id="steps-negative"),
    pytest.param(["--steps", "two"], "--steps", id="steps-not-a-number"),
    pytest.param(["--guidance-scale", "-1"], "--guidance-scale", id="guidance-negative"),
    pytest.param(["--guidance-scale", "nan"], "--guidance-scale", id="guidance-nan"),
    pytest.param(["--num-images", "0"], "--num-images", id="num-images-zero"),
    pytest.param(["-m", "sd99"], "unknown model", id="unknown-preset"),
    pytest.param(["-m", "someone/uncached-model"], "not in the Hugging Face cache", id="hub-model-not-cached"),
    pytest.param(lambda d: ["-m", str(d / "missing.safetensors")], "does not exist", id="model-file-missing"),
    pytest.param(_setup_model_file("m.safetensors", b"\x00garbage"), "cannot read", id="model-file-unreadable"),
    pytest.param(_setup_model_file("m.safetensors", {"w": torch.zeros(8)}), "cannot read", id="model-file-truncated"),
    pytest.param(_setup_model_file("m.ckpt", b"PK"), "--allow-pickle", id="ckpt-without-allow-pickle"),
    pytest.param(lambda d: ["-o", str(d / "missing" / "a.png")], "does not exist", id="output-in-missing-folder"),
    pytest.param(lambda d: ["-o", str(d / "missing" / "new")], "does not exist", id="output-folder-in-missing-folder"),
    pytest.param(_setup_existing, "already exists", id="output-exists"),
    pytest.param(lambda d: ["-o", str(d / "a.jpg")], ".png", id="output-not-png"),
    pytest.param(lambda d: ["-o", str(d / "a.png"), "--num-images", "2"], "give a folder", id="two-images-one-file"),
    pytest.param(
        lambda d: ["--report-json", str(d / "no" / "r.json")], "does not exist", id="report-in-missing-folder"
    ),
    pytest.param(["--backend", "xformers"], "unknown backend", id="unknown-backend"),
    pytest.param(["--dtype", "fp8"], "unknown dtype", id="unknown-dtype"),
    pytest.param(["--device", "tpu"], "device", id="unknown-device"),
    pytest.param(
        ["--device", "cuda"],
        "no CUDA GPU",
        id="cuda-without-gpu",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
    ),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    extra = args(tmp_path) if callable(args) else args
    before = files_under(tmp_path)
    result = invoke("generate", "a cat", *FAST, *extra)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sdpatch: error: ")
    assert message in lines[0]
    assert result.stdout == ""
    assert files_under(tmp_path) == before


def test_an_unavailable_backend_is_refused_before_loading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status = {"triton": (False, "Triton kernels need a CUDA device"), "chunked": (True, ""), "sdpa": (True, "")}
    monkeypatch.setattr("sdpatch.generate.backend_status", lambda device: status)
    monkeypatch.setattr("sdpatch.generate.load_pipeline", lambda *a, **k: pytest.fail("loaded a model"))
    result = invoke("generate", "a cat", *FAST, "--backend", "triton")
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == "sdpatch: error: backend 'triton' cannot run on cpu: Triton kernels need a CUDA device"
    )
    assert list(tmp_path.iterdir()) == []


# -- info and help -------------------------------------------------------------------------------


def test_info_names_versions_and_each_backend():
    result = invoke("info")
    assert result.exit_code == 0, result.output
    for word in ("torch", "cuda", "triton", "diffusers", torch.__version__):
        assert word in result.stdout
    for backend in ("triton", "chunked", "sdpa"):
        assert any(
            line.split()[:1] == [backend] and line.split()[1] in ("yes", "no") for line in result.stdout.splitlines()
        )


def test_help_says_that_tiny_has_random_weights():
    result = invoke("generate", "--help")
    assert result.exit_code == 0
    assert "random" in result.stdout and "tiny" in result.stdout


# -- the installed console script ----------------------------------------------------------------


def _script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_console_script_generates_and_reports(tmp_path):
    result = _script(console_script(), "generate", "a cat", *FAST, "-o", "cat.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "VAE decode" in result.stdout
    assert Image.open(tmp_path / "cat.png").text["model"] == "tiny"


def test_console_script_bad_input_is_one_line_without_traceback(tmp_path):
    result = _script(console_script(), "generate", "a cat", "--height", "100", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_console_script_info_and_python_dash_m(tmp_path):
    info = _script(console_script(), "info", cwd=tmp_path)
    assert info.returncode == 0 and "chunked" in info.stdout
    helped = _script(sys.executable, "-m", "sdpatch", "generate", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "random" in helped.stdout
