"""The ``sdpatch`` command line, through typer's CliRunner and as the installed console script.

Everything runs the embedded ``tiny`` model on the CPU at 64 px and 2 steps, offline.
"""

from __future__ import annotations

import errno
import io
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
from sdpatch.generate import GenerationRequest, RunOptions, run, write_png


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
    assert record["complete"] is True  # the image's own record, finished as the file is written

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
            RunOptions(device="cpu", output=tmp_path / "out", report_json=tmp_path / "r.json"),
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


# -- issue 32: start-up, help, failures after the work, honest reports -----------------------------

PARSE_ONLY = [
    pytest.param(["--help"], 0, id="help"),
    pytest.param(["--version"], 0, id="version"),
    pytest.param(["generate", "--help"], 0, id="generate-help"),
    pytest.param(["genrate", "a cat"], 2, id="typo"),
    pytest.param(["generate", "a cat", "-H", "63"], 2, id="height-63"),
    pytest.param(["generate", "a cat", "--steps", "0"], 2, id="steps-0"),
    pytest.param(["compare", "--sizes", "63"], 2, id="compare-sizes-63"),
]


@pytest.mark.parametrize("args, code", PARSE_ONLY)
def test_parsing_and_checking_arguments_imports_neither_torch_nor_diffusers(args, code):
    program = (
        "import sys\n"
        "from sdpatch.cli import main\n"
        f"sys.argv = ['sdpatch', *{args!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exit:\n"
        "    print('exit', exit.code, 'torch' in sys.modules, 'diffusers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == f"exit {code} False False", (result.stdout, result.stderr)


def test_version():
    from sdpatch import __version__

    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout == f"sdpatch {__version__}\n"


@pytest.mark.parametrize("command", [[], ["generate"], ["compare"]], ids=["top", "generate", "compare"])
def test_help_shows_flags_as_flags_and_the_exit_codes(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout
    assert "Exit codes:" in result.stdout and "3    --vram-budget missed" in result.stdout
    if command == ["generate"]:
        flags = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  --")}
        assert {"--overwrite", "--allow-pickle", "--best-effort"} <= flags
        assert "p0000-s0.png" in result.stdout  # how a prompts file's images are named


def test_a_flag_takes_no_value():
    result = invoke("generate", "a cat", *FAST, "--overwrite", "true")
    assert result.exit_code == 2 and "unexpected extra argument" in result.stderr


def test_an_unwritable_output_folder_is_found_before_the_model_loads(tmp_path, monkeypatch):
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc")
    monkeypatch.setattr("sdpatch.generate.load_pipeline", lambda *a, **k: pytest.fail("loaded a model"))
    result = invoke("generate", "a cat", *FAST, "-o", "/proc/a.png")  # a folder that passes os.access as root
    assert result.exit_code == 2
    assert result.stderr.startswith("sdpatch: error: --output: cannot write in folder /proc: ")


def _disk_full_after(monkeypatch, images: int) -> None:
    """Make every PNG save after the first ``images`` fail as on a full disk."""
    real = Image.Image.save
    saved = []

    def save(self, fp, *args, **kwargs):
        if kwargs.get("format") == "PNG" and len(saved) >= images:
            fp.write(b"\x89PNG half an image")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        saved.append(fp)
        return real(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)


FULL_DISK = [
    pytest.param(1, 0, "", id="one-image"),
    pytest.param(3, 1, "; the 1 image written before it is kept", id="second-of-three"),
]


@pytest.mark.parametrize("num_images, written, kept", FULL_DISK)
def test_a_full_disk_at_the_end_is_one_line_exit_2_and_leaves_no_partial_file(
    tmp_path, monkeypatch, num_images, written, kept
):
    _disk_full_after(monkeypatch, written)
    out, report = tmp_path / "out", tmp_path / "r.json"
    args = ["--num-images", str(num_images), "-o", str(out), "--report-json", str(report)]
    result = invoke("generate", "a cat", *FAST, *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1
    failed = out / f"sdpatch-{written}.png"
    assert result.stderr == f"sdpatch: error: cannot write {failed}: No space left on device{kept}\n"
    assert sorted(p.name for p in out.iterdir()) == [f"sdpatch-{i}.png" for i in range(written)]  # no .tmp
    for i in range(written):
        Image.open(out / f"sdpatch-{i}.png").load()
    data = json.loads(report.read_text())
    assert data["complete"] is False and len(data["images"]) == written


def _host_oom(*args, **kwargs):
    raise RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
        "you tried to allocate 17179869184 bytes."
    )


HOST_OOM = [
    pytest.param("diffusers.AutoencoderKL.decode", "in VAE decode", id="vae-decode"),
    pytest.param("sdpatch.generate.load_pipeline", "while building tiny", id="model-build"),
]


@pytest.mark.parametrize("target, where", HOST_OOM)
def test_running_out_of_host_memory_names_the_phase_and_the_need(tmp_path, monkeypatch, target, where):
    monkeypatch.setattr(target, _host_oom)
    result = invoke("generate", "a cat", *FAST, "-o", str(tmp_path / "a.png"))
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sdpatch: error: out of host memory {where}: ")
    assert "it asked for 16.00 GiB more" in lines[0] and "--vram-budget" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "best_effort, code", [pytest.param([], 3, id="missed"), pytest.param(["--best-effort"], 0, id="best-effort")]
)
def test_a_run_that_misses_its_budget_exits_3_unless_best_effort(tmp_path, monkeypatch, best_effort, code):
    # The plan fits 1000 GiB easily; the measured peak is made to exceed it.
    monkeypatch.setattr("sdpatch.memory.host_peak_bytes", lambda: 2000 * 1024**3)
    result = invoke("generate", "a cat", *FAST, "-o", str(tmp_path / "a.png"), "--vram-budget", "1000", *best_effort)
    assert result.exit_code == code, result.output
    assert "missed the budget by 1000.00 GiB" in result.stdout
    assert (tmp_path / "a.png").is_file()
    if code:
        assert result.stderr == (
            "sdpatch: error: the run missed --vram-budget 1000 GiB: measured 2000.00 GiB, 1000.00 GiB over "
            "(pass --best-effort to accept a miss)\n"
        )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_progress_line_follows_the_phases_on_a_terminal_only(tmp_path, monkeypatch):
    from sdpatch.progress import Progress

    request = GenerationRequest("a cat", height=64, width=64, steps=2, num_images=2)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with Progress() as progress:
        run(request, RunOptions(device="cpu", output=tmp_path / "out"), progress=progress)
    shown = sys.stderr.getvalue()
    for label in ("building tiny on cpu", "image 1/2 · text encoding", "image 2/2 · denoising: ", "VAE decode"):
        assert label in shown
    assert "it/s" in shown  # the denoising steps' bar, not diffusers' own

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: nothing
    with Progress() as progress:
        run(request, RunOptions(device="cpu", output=tmp_path / "again"), progress=progress)
    assert sys.stderr.getvalue() == ""


def test_a_successful_run_in_a_pipe_prints_nothing_on_stderr(tmp_path):
    result = invoke("generate", "a cat", *FAST, "--steps", "1", "-o", str(tmp_path / "a.png"))
    assert result.exit_code == 0 and result.stderr == ""
    assert "64×64 · 1 step · 1 image" in result.stdout


def test_a_long_prompt_is_warned_about_and_kept_only_as_far_as_it_is_read(tmp_path):
    from sdpatch.models import build_preset

    prompt = "a tall lighthouse on a rocky coast at dusk, " * 500  # 22,000 characters
    out = tmp_path / "a.png"
    result = invoke("generate", prompt, *FAST, "-o", str(out))
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: the prompt is ")]
    assert len(notes) == 1 and "the text encoder reads only the first 75" in notes[0]
    text = Image.open(out).text
    kept = text["prompt"]
    assert prompt.startswith(kept) and len(kept) < 1000 and len(text["sdpatch"]) < 20_000
    assert json.loads(text["sdpatch"])["request"]["prompt"] == kept
    tokenizer = build_preset("tiny").tokenizer  # the kept part reads as the prompt did
    ids = [tokenizer(t, truncation=True, max_length=77).input_ids for t in (prompt, kept)]
    assert ids[0] == ids[1]


def test_report_json_may_go_into_the_new_output_folder(tmp_path):
    out = tmp_path / "out"
    result = invoke("generate", "a cat", *FAST, "-o", f"{out}/", "--report-json", str(out / "r.json"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["r.json", "sdpatch-0.png"]


def test_redrawing_a_missing_report_exits_2(tmp_path):
    command = [sys.executable, "-m", "sdpatch.compare", str(tmp_path / "nothing")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("sdpatch: error: cannot read ") and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "flags, want",
    [
        pytest.param([], {"cuda_graphs": None, "compile": False}, id="default"),
        pytest.param(["--no-cuda-graphs"], {"cuda_graphs": False, "compile": False}, id="no-cuda-graphs"),
        pytest.param(["--cuda-graphs", "--compile"], {"cuda_graphs": True, "compile": True}, id="graphs-and-compile"),
    ],
)
def test_speed_flags_reach_the_run(monkeypatch, flags, want):
    """--cuda-graphs/--no-cuda-graphs and --compile are flags (no value) that reach the library's run."""
    import typer

    import sdpatch.generate

    seen = {}

    def run(request, options, **kwargs):
        seen.update(cuda_graphs=options.cuda_graphs, compile=options.compile)
        raise typer.Exit(0)

    monkeypatch.setattr(sdpatch.generate, "run", run)
    result = invoke("generate", "a cat", *flags)
    assert result.exit_code == 0, result.output
    assert {k: seen[k] for k in want} == want


@pytest.mark.parametrize(
    "backend, device, planned, graphs",
    [
        pytest.param("auto", "cpu", False, False, id="cpu"),
        pytest.param("stock", "cuda", False, False, id="stock-is-diffusers-as-it-is"),
        pytest.param("auto", "cuda", False, True, id="patched-on-cuda"),
        pytest.param("auto", "cuda", True, False, id="planned-budget"),
    ],
)
def test_cuda_graphs_default(monkeypatch, backend, device, planned, graphs):
    """Graphs are on by default only for a patched pipeline on CUDA without a --vram-budget plan."""
    import torch

    import sdpatch.generate as gen

    monkeypatch.setattr(gen, "resolve_device", lambda d: torch.device(device))
    monkeypatch.setattr(gen, "resolve_dtype", lambda d, dev: (torch.float16, None))
    monkeypatch.setattr(gen, "backend_status", lambda dev: {"triton": (True, ""), "chunked": (True, ""), "sdpa": (True, "")})
    setup = gen.check_setup(gen.RunOptions(backend=backend, device=device, vram_budget=2 if planned else None))
    assert setup.cuda_graphs is graphs
    assert any("CUDA graphs off" in n for n in setup.notes) is (planned and device == "cuda" and backend != "stock")
