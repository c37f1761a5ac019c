"""Issue 10, faults during generation and hostile CLI input (CPU, offline).

- Out of memory in a backend: the call is retried on chunked at a smaller budget, the run goes on,
  one warning is logged and the patch report (and the generate report) say which layers fell back.
- A Triton kernel that will not compile or launch: ``auto`` falls back to chunked and remembers it;
  an explicit ``triton`` raises a clear error.
- Ctrl-C: finished images stay, no partial file is left, the report so far is valid JSON.
- A table of bad invocations: each is one line on stderr, exit code 2, no traceback, nothing written.

Faults are injected by monkeypatching the backend calls inside ``sdpatch.attention``. ``auto`` never
picks the Triton interpreter on the CPU, so the Triton tests make ``choose_backend`` treat the CPU
as a CUDA device (:func:`triton_as_on_cuda`); its own logic, remembered failures included, still runs.
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import importlib
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

import arch
from helpers import FAST, console_script, invoke
from sdpatch import BackendChoice, BackendUnavailableError, explain, patch_report, patch_unet
from sdpatch.attention.chunked import DEFAULT_CHUNK_BUDGET
from sdpatch.errors import InputError
from sdpatch.generate import GenerationRequest, RunOptions, run
from sdpatch.models import resolve_model
from sdpatch.attention.naive import attention_ref

# `sdpatch.attention` is also the name of the function that the package exports.
attention_mod = importlib.import_module("sdpatch.attention.dispatch")
faults = importlib.import_module("sdpatch.attention.faults")
chunked_mod = importlib.import_module("sdpatch.attention.chunked")
forward = importlib.import_module("sdpatch.kernels.forward")

MiB = 2**20
OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.fixture(autouse=True)
def fresh_fault_state(fresh_faults):
    """Each test starts from an empty fault state (conftest's ``fresh_faults``)."""


@pytest.fixture
def triton_as_on_cuda(monkeypatch):
    """``auto`` decides as on a CUDA machine: the CPU's "not a CUDA device" becomes triton."""
    real = attention_mod.choose_backend

    def choose(**kwargs):
        choice = real(**kwargs)
        return BackendChoice("triton", "as on CUDA") if choice.reason == "not a CUDA device" else choice

    monkeypatch.setattr(attention_mod, "choose_backend", choose)


def fail_launch(monkeypatch, exc: BaseException) -> list[tuple]:
    """Make the Triton forward launcher raise ``exc``; returns the shapes it was called with."""
    calls = []

    def launch(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        raise exc

    monkeypatch.setattr(forward, "flash_attn_fwd", launch)
    return calls


def fail_sdpa(monkeypatch) -> None:
    def sdpa(*args, **kwargs):
        raise OOM

    monkeypatch.setitem(attention_mod.REGISTRY, "sdpa", dataclasses.replace(attention_mod.REGISTRY["sdpa"], run=sdpa))


def spy_chunked(monkeypatch, fits_below: int | None = None) -> list[int | None]:
    """Record the budget of every chunked call; raise OOM for budgets of ``fits_below`` or more."""
    budgets = []
    real = chunked_mod.chunked_attention

    def chunked(q, k, v, scale, mask=None, budget=None, upcast=False):
        budgets.append(budget)
        if fits_below is not None and (budget is None or budget >= fits_below):
            raise OOM
        return real(q, k, v, scale, mask, budget, upcast)

    monkeypatch.setattr(chunked_mod, "chunked_attention", chunked)
    return budgets


def warnings_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sdpatch.attention" and r.levelno == logging.WARNING]


def qkv(n: int = 33, d: int = 40, nk: int = 77):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 3, length, d, generator=g) for length in (n, nk, nk))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def unet_out(model, kw) -> torch.Tensor:
    with torch.no_grad():
        return model(**kw).sample


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file (with its bytes) and folder under ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def leftovers(folder: Path) -> list[str]:
    """Temporary files of interrupted atomic writes."""
    return [p.name for p in folder.rglob("*.tmp")]


# -- out of memory -----------------------------------------------------------------------------


def test_oom_in_sdpa_is_retried_on_chunked_in_every_layer(monkeypatch, caplog):
    unet = arch.build("sd15")
    kw = arch.unet_inputs(unet)
    ref = unet_out(unet, kw)
    patch_unet(unet, backend="sdpa")
    fail_sdpa(monkeypatch)
    budgets = spy_chunked(monkeypatch)

    assert rel_err(unet_out(unet, kw), ref) <= 1e-5
    report = patch_report(unet)
    assert {f.name for f in report.fallbacks} == {r.name for r in report.rows}
    assert all(f.calls == 1 and f.backend == "sdpa" for f in report.fallbacks)
    assert all(f.reason == "out of memory: CUDA out of memory. Tried to allocate 20.00 GiB" for f in report.fallbacks)
    assert set(budgets) == {DEFAULT_CHUNK_BUDGET // 4}  # a quarter of the default, and it fit
    assert len(warnings_logged(caplog)) == 1  # once, however many layers fell back

    unet_out(unet, kw)
    assert {f.calls for f in patch_report(unet).fallbacks} == {2}
    text = str(patch_report(unet))
    assert text.count("\nfallback: ") == len(report.rows) and "ran chunked after sdpa failed" in text
    assert json.loads(json.dumps(patch_report(unet).to_dict()))["fallbacks"][0]["calls"] == 2


def test_oom_in_triton_is_retried_and_triton_stays_in_use(monkeypatch, triton_as_on_cuda):
    launches = fail_launch(monkeypatch, OOM)
    q, k, v = qkv()
    events = []
    for _ in range(2):
        out = attention_mod.attention(q, k, v, on_fallback=events.append)
        assert rel_err(out, attention_ref(q, k, v)) <= 1e-6
    assert len(launches) == 2  # out of memory is not a broken kernel: every call tries triton again
    assert [(e.backend, e.budget) for e in events] == [("triton", DEFAULT_CHUNK_BUDGET // 4)] * 2


def test_oom_retry_halves_the_budget_until_it_fits(monkeypatch):
    budgets = spy_chunked(monkeypatch, fits_below=16 * MiB)
    q, k, v = qkv()
    events = []
    out = attention_mod.attention(q, k, v, backend="chunked", on_fallback=events.append)
    assert rel_err(out, attention_ref(q, k, v)) <= 1e-6
    assert budgets == [None, 64 * MiB, 32 * MiB, 16 * MiB, 8 * MiB]
    assert [(e.backend, e.budget) for e in events] == [("chunked", 8 * MiB)]


def test_oom_at_the_floor_is_raised(monkeypatch):
    fail_sdpa(monkeypatch)
    budgets = spy_chunked(monkeypatch, fits_below=0)
    with pytest.raises(torch.OutOfMemoryError):
        attention_mod.attention(*qkv(), backend="sdpa", chunk_budget=8 * MiB)
    assert budgets == [2 * MiB, faults.MIN_FALLBACK_BUDGET]


def test_generate_survives_oom_and_reports_it(tmp_path, monkeypatch, caplog):
    chunked = invoke("generate", "a cat", *FAST, "--backend", "chunked", "-o", str(tmp_path / "chunked.png"))
    assert chunked.exit_code == 0, chunked.output
    fail_sdpa(monkeypatch)
    out, report = tmp_path / "sdpa.png", tmp_path / "report.json"
    result = invoke("generate", "a cat", *FAST, "--backend", "sdpa", "-o", str(out), "--report-json", str(report))
    assert result.exit_code == 0, result.output

    fallback_lines = [line for line in result.stdout.splitlines() if line.startswith("fallbacks: ")]
    assert len(fallback_lines) == 1 and "ran chunked after sdpa failed (out of memory" in fallback_lines[0]
    data = json.loads(report.read_text())
    assert data["complete"] is True
    called = {layer["name"] for layer in data["patch"]["layers"] if layer["nq"] is not None}  # no VAE encoder
    assert {f["name"] for f in data["patch"]["fallbacks"]} == called
    assert all(f["backend"] == "sdpa" and f["calls"] >= 1 for f in data["patch"]["fallbacks"])
    assert len(warnings_logged(caplog)) == 1
    pixels = [np.asarray(Image.open(p), dtype=np.int16) for p in (out, tmp_path / "chunked.png")]
    assert np.abs(pixels[0] - pixels[1]).max() <= 1


# -- Triton failures ---------------------------------------------------------------------------

LAUNCH_FAILURES = [
    pytest.param(
        CompilationError("def kernel(): ...", ast.parse("x = 1").body[0], "unsupported layout"),
        "CompilationError: unsupported layout",
        id="compile-error",
    ),
    pytest.param(RuntimeError("PassManager::run failed"), "RuntimeError: PassManager::run failed", id="passmanager"),
    pytest.param(OutOfResources(232448, 101376, "shared memory"), "OutOfResources: out of resource", id="shared-mem"),
    pytest.param(FileNotFoundError("cc: not found"), "FileNotFoundError: cc: not found", id="no-compiler"),
]


@pytest.mark.parametrize("failure, reason", LAUNCH_FAILURES)
def test_auto_falls_back_once_and_remembers_a_broken_kernel(monkeypatch, caplog, triton_as_on_cuda, failure, reason):
    launches = fail_launch(monkeypatch, failure)
    q, k, v = qkv()
    events = []
    for _ in range(3):
        out = attention_mod.attention(q, k, v, on_fallback=events.append)
        assert rel_err(out, attention_ref(q, k, v)) <= 1e-6
    assert len(launches) == 1  # compiled once; later calls go straight to chunked
    assert [(e.backend, e.reason.startswith(reason)) for e in events] == [("triton", True)]
    choice = explain(q, k, v)
    assert choice.name == "chunked" and "failed here before" in choice.reason and reason in choice.reason
    assert len(warnings_logged(caplog)) == 1

    # Another head dim is another kernel: it gets its own try.
    attention_mod.attention(*qkv(d=80))
    assert len(launches) == 2


def test_explicit_triton_raises_a_clear_error_and_does_not_retry(monkeypatch):
    failure = RuntimeError("PassManager::run failed")
    launches = fail_launch(monkeypatch, failure)
    q, k, v = qkv()
    with pytest.raises(BackendUnavailableError, match=r"backend='triton' failed to compile or launch") as caught:
        attention_mod.attention(q, k, v, backend="triton")
    assert caught.value.__cause__ is failure
    with pytest.raises(BackendUnavailableError, match="failed here before"):
        attention_mod.attention(q, k, v, backend="triton")
    assert len(launches) == 1


def test_a_broken_kernel_does_not_stop_a_patched_unet(monkeypatch, caplog, triton_as_on_cuda):
    unet = arch.build("sd15")
    kw = arch.unet_inputs(unet)
    ref = unet_out(unet, kw)
    patch_unet(unet)
    launches = fail_launch(monkeypatch, RuntimeError("PassManager::run failed"))
    assert rel_err(unet_out(unet, kw), ref) <= 1e-5

    report = patch_report(unet)
    head_dims = {r.head_dim for r in report.rows}
    assert len(launches) == len(head_dims)  # one try per kernel, not per layer or call
    assert len(report.fallbacks) == len(head_dims)
    assert all(r.backend == "chunked" and "failed here before" in r.reason for r in report.rows)
    assert len(warnings_logged(caplog)) == 1


def test_generate_auto_with_a_broken_kernel(tmp_path, monkeypatch, triton_as_on_cuda):
    fail_launch(monkeypatch, RuntimeError("PassManager::run failed"))
    result = invoke("generate", "a cat", *FAST, "-o", str(tmp_path / "a.png"))
    assert result.exit_code == 0, result.output
    assert "ran chunked after triton failed (RuntimeError: PassManager::run failed)" in result.stdout
    Image.open(tmp_path / "a.png").load()


def test_generate_explicit_triton_with_a_broken_kernel(tmp_path, monkeypatch):
    # The Triton interpreter lets the CPU pass the up-front check; the kernel then fails mid-run.
    fail_launch(monkeypatch, RuntimeError("PassManager::run failed"))
    result = invoke("generate", "a cat", *FAST, "--backend", "triton", "-o", str(tmp_path / "a.png"))
    assert result.exit_code == 2, (result.output, result.exception)
    error = result.stderr.splitlines()[-1]  # after the progress bar of the denoising loop
    assert error.startswith("sdpatch: error: attention layer ")
    assert "failed to compile or launch its kernel (RuntimeError: PassManager::run failed)" in error
    assert "backend='auto' would run such calls on chunked" in error
    assert list(tmp_path.iterdir()) == []


# -- interruptions -----------------------------------------------------------------------------


def test_ctrl_c_in_the_middle_of_an_image(tmp_path, monkeypatch):
    import sdpatch.processor

    armed = []
    real = sdpatch.processor.attention

    def attention(*args, **kwargs):
        if armed:  # the next image's first attention call: deep inside its denoising loop
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpatch.processor, "attention", attention)
    request = GenerationRequest("a cat", height=64, width=64, steps=2, num_images=3)
    with pytest.raises(KeyboardInterrupt):
        run(
            request,
            RunOptions(device="cpu", output=tmp_path / "out", report_json=tmp_path / "r.json"),
            progress=False,
            on_image=armed.append,
        )

    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sdpatch-0.png"]
    Image.open(tmp_path / "out" / "sdpatch-0.png").load()
    assert leftovers(tmp_path) == []
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is False and [i["seed"] for i in report["images"]] == [0]


@pytest.mark.parametrize("moment", ["file-created", "mid-write"])
def test_an_interrupted_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, moment):
    """A Ctrl-C at any point of a write: right after the temporary file exists (mkstemp returned its
    name only after creating it, and a signal between the two once left a file behind), or mid-write."""
    from sdpatch import generate

    path = tmp_path / "r.json"
    path.write_bytes(b"old")

    def interrupted_open(file, mode):
        real = open(file, mode)
        if moment == "file-created":
            real.close()
            raise KeyboardInterrupt
        return real

    def write(f):
        f.write(b"new, half")
        if moment == "mid-write":
            raise KeyboardInterrupt

    monkeypatch.setattr(generate, "open", interrupted_open, raising=False)
    with pytest.raises(KeyboardInterrupt):
        generate.atomic_write(path, write)
    assert path.read_bytes() == b"old" and leftovers(tmp_path) == []


def test_atomic_write_makes_a_plain_file(tmp_path):
    from sdpatch.generate import atomic_write

    umask = os.umask(0o022)
    os.umask(umask)
    atomic_write(tmp_path / "r.json", lambda f: f.write(b"{}"))
    assert (tmp_path / "r.json").read_bytes() == b"{}" and leftovers(tmp_path) == []
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_sigint_to_the_console_script(tmp_path):
    out, report = tmp_path / "out", tmp_path / "r.json"
    args = ["--steps", "10", "--num-images", "200", "-o", str(out), "--report-json", str(report)]
    proc = subprocess.Popen(
        [console_script(), "generate", "a cat", *FAST, *args],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell without job control starts background jobs with SIGINT ignored; Python then
        # installs no KeyboardInterrupt handler. Restore the default, as in a terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "sdpatch-0.png").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()

    assert proc.returncode == 130, stderr
    assert "sdpatch: interrupted" in stderr and "Traceback" not in stderr
    assert leftovers(tmp_path) == []
    pngs = sorted(p.name for p in out.iterdir())
    assert 1 <= len(pngs) < 200
    for name in pngs:
        Image.open(out / name).load()
    data = json.loads(report.read_text())
    assert data["complete"] is False
    # The report is rewritten after each image: it may trail the images by the one just written.
    listed = [Path(i["path"]).name for i in data["images"]]
    assert listed == pngs[: len(listed)] and len(pngs) - len(listed) <= 1


# -- hostile input -----------------------------------------------------------------------------

NOT_UTF8 = os.fsdecode(b"a \xff\xfe cat")  # how Python hands undecodable argv bytes over
SD_KEY = "model.diffusion_model.input_blocks.0.0.weight"  # SD 1.x's conv_in: (320, 4, 3, 3)


def model_file(name: str, content: bytes | dict | None = None, *flags: str):
    """A setup that writes ``content`` (bytes, or tensors saved in the file's format) and passes it as -m."""

    def setup(d: Path) -> list[str]:
        path = d / "models" / name
        path.parent.mkdir()
        if isinstance(content, dict) and name.endswith(".safetensors"):
            save_file(content, str(path))
        elif isinstance(content, dict):
            torch.save(content, path)
        else:
            path.write_bytes(content or b"")
        return ["-m", str(path), *flags]

    return setup


def truncated_safetensors(d: Path) -> list[str]:
    args = model_file("m.safetensors", {SD_KEY: torch.zeros(320, 4, 3, 3)})(d)
    path = Path(args[1])
    path.write_bytes(path.read_bytes()[:-100])
    return args


def model_folder(index: str | None):
    def setup(d: Path) -> list[str]:
        (d / "model").mkdir()
        if index is not None:
            (d / "model" / "model_index.json").write_text(index)
        return ["-m", str(d / "model")]

    return setup


def existing(name: str, *args: str):
    def setup(d: Path) -> list[str]:
        (d / name).write_bytes(b"something earlier")
        return [a.replace("{d}", str(d)) for a in args]

    return setup


def in_tmp(*args: str):
    return lambda d: [a.replace("{d}", str(d)) for a in args]


def folder_at(name: str, *args: str):
    def setup(d: Path) -> list[str]:
        (d / name).mkdir()
        return [a.replace("{d}", str(d)) for a in args]

    return setup


def prompts_file(content: bytes, *args: str, then=None):
    """A setup that writes prompts.txt and passes it as --prompts-file; ``then``: another setup."""

    def setup(d: Path) -> list[str]:
        (d / "prompts.txt").write_bytes(content)
        return ["--prompts-file", str(d / "prompts.txt"), *args, *(then(d) if then else [])]

    return setup


def bad(id: str, args, message: str, prompt: str | None = "a cat", marks=()):
    """A row; ``prompt`` None passes no PROMPT argument."""
    return pytest.param(prompt, args, message, id=id, marks=marks)


def no_prompt(id: str, args, message: str):
    return bad(id, args, message, prompt=None)


HOSTILE = [
    # sizes
    bad("height-zero", ["--height", "0"], "--height must be a positive multiple of 8"),
    bad("height-negative", ["--height", "-8"], "--height must be a positive multiple of 8"),
    bad("height-not-multiple-of-8", ["--height", "7"], "--height must be a positive multiple of 8"),
    bad("width-not-a-number", ["--width", "abc"], "'--width'"),
    bad("height-in-exponent-notation", ["--height", "1e9"], "'--height'"),
    bad("height-absurd", ["--height", "999999992"], "--height must be at most 16384"),
    bad("width-beyond-int64", ["--width", "1" + "0" * 30], "--width must be at most 16384"),
    # numbers
    bad("steps-zero", ["--steps", "0"], "--steps must be at least 1"),
    bad("steps-negative", ["--steps", "-1"], "--steps must be at least 1"),
    bad("steps-nan", ["--steps", "nan"], "'--steps'"),
    bad("steps-beyond-the-scheduler", ["--steps", "5000"], "--steps must be at most 1000 for tiny"),
    bad("guidance-negative", ["--guidance-scale", "-1"], "--guidance-scale must be a finite number"),
    bad("guidance-nan", ["--guidance-scale", "nan"], "--guidance-scale must be a finite number"),
    bad("guidance-inf", ["--guidance-scale", "inf"], "--guidance-scale must be a finite number"),
    bad("guidance-not-a-number", ["--guidance-scale", "high"], "'--guidance-scale'"),
    bad("num-images-zero", ["--num-images", "0"], "--num-images must be between 1 and 10000"),
    bad("num-images-negative", ["--num-images", "-1"], "--num-images must be between 1 and 10000"),
    bad("num-images-absurd", in_tmp("--num-images", "1000000000", "-o", "{d}"), "--num-images must be between"),
    bad("seed-negative", ["--seed", "-1"], "--seed must be between 0 and"),
    bad("seed-past-2**64", ["--seed", str(2**64)], "--seed must be between 0 and"),
    bad("seed-plus-images-past-2**64", in_tmp("--seed", str(2**64 - 1), "--num-images", "2", "-o", "{d}"), "--seed"),
    # text (undecodable bytes reach sdpatch through argv, or in a prompts file)
    bad("prompt-not-utf8", [], "the prompt is not valid UTF-8 text", prompt=NOT_UTF8),
    bad("negative-prompt-not-utf8", ["-n", NOT_UTF8], "--negative-prompt is not valid UTF-8 text"),
    no_prompt("prompts-file-not-utf8", prompts_file(b"a cat\n\xff\xfe a dog\n"), "is not UTF-8 text (line 2)"),
    # prompt files
    no_prompt("neither-prompt-nor-prompts-file", [], "give a PROMPT or --prompts-file FILE"),
    bad("prompt-and-prompts-file", prompts_file(b"a dog\n"), "give a PROMPT or --prompts-file FILE, not both"),
    no_prompt("prompts-file-missing", in_tmp("--prompts-file", "{d}/missing.txt"), "does not exist"),
    no_prompt("prompts-file-is-a-folder", in_tmp("--prompts-file", "{d}"), "is a folder, not a file"),
    no_prompt("prompts-file-empty", prompts_file(b""), "has no prompts"),
    no_prompt("prompts-file-only-comments", prompts_file(b"# one\n\n   \n  # two\n"), "has no prompts"),
    no_prompt("prompts-file-seeds-past-2**64", prompts_file(b"a\nb\n", "--seed", str(2**64 - 1)), "--seed must be at"),
    no_prompt("prompts-file-output-is-a-png", prompts_file(b"a\n", then=in_tmp("-o", "{d}/a.png")), "give a folder"),
    no_prompt("prompts-file-image-exists", prompts_file(b"a\n", then=existing("p0000-s0.png")), "already exists"),
    no_prompt(
        "prompts-file-image-is-a-folder",
        prompts_file(b"a\n", "--overwrite", then=folder_at("p0000-s0.png")),
        "p0000-s0.png is a folder, not a file",
    ),
    no_prompt("prompts-file-report-exists", prompts_file(b"a\n", then=existing("sdpatch-report.json")), "exists"),
    no_prompt(
        "prompts-file-partial-report-exists",
        prompts_file(b"a\n", then=existing("sdpatch-report.rank1.json")),
        "sdpatch-report.rank1.json already exists",
    ),
    no_prompt(  # found once the model is loaded; the partial report already written is removed
        "prompts-file-steps-beyond-the-scheduler",
        prompts_file(b"a\n", "--steps", "5000"),
        "--steps must be at most 1000 for tiny",
    ),
    # where output goes
    bad("output-in-missing-folder", in_tmp("-o", "{d}/missing/a.png"), "does not exist"),
    bad("output-folder-in-missing-folder", in_tmp("-o", "{d}/missing/new"), "does not exist"),
    bad("output-exists", existing("taken.png", "-o", "{d}/taken.png"), "already exists (pass --overwrite"),
    bad("output-image-in-folder-exists", existing("sdpatch-0.png", "-o", "{d}"), "already exists (pass --overwrite"),
    bad("output-image-is-a-folder", folder_at("sdpatch-0.png", "-o", "{d}", "--overwrite"), "is a folder, not a file"),
    bad("output-is-a-file-not-a-folder", existing("notes", "-o", "{d}/notes"), "exists and is not a folder"),
    bad("output-not-png", in_tmp("-o", "{d}/a.jpg"), ".png"),
    bad("two-images-one-file", in_tmp("-o", "{d}/a.png", "--num-images", "2"), "give a folder"),
    bad("report-json-in-missing-folder", in_tmp("--report-json", "{d}/no/r.json"), "does not exist"),
    bad("report-json-is-a-folder", in_tmp("--report-json", "{d}"), "is a folder, not a file"),
    bad("report-json-exists", existing("r.json", "--report-json", "{d}/r.json"), "already exists"),
    bad("report-json-is-the-image", in_tmp("-o", "{d}/a.png", "--report-json", "{d}/a.png"), "must not be one of"),
    # models
    bad("unknown-preset", ["-m", "sd99"], "unknown model 'sd99'"),
    bad("model-empty", ["-m", ""], "--model is empty: use a preset"),
    bad("hub-model-not-cached", ["-m", "someone/uncached-model"], "not in the Hugging Face cache"),
    bad("model-file-missing", in_tmp("-m", "{d}/missing.safetensors"), "does not exist"),
    bad("model-file-wrong-kind", existing("weights.txt", "-m", "{d}/weights.txt"), "is not a .safetensors or .ckpt"),
    bad("safetensors-random-bytes", model_file("m.safetensors", os.urandom(4096)), "cannot read m.safetensors"),
    bad("safetensors-empty", model_file("m.safetensors", b""), "cannot read m.safetensors"),
    bad("safetensors-truncated", truncated_safetensors, "cannot read m.safetensors"),
    bad("safetensors-not-sd", model_file("m.safetensors", {"w": torch.zeros(4)}), "not a Stable Diffusion checkpoint"),
    bad("safetensors-sd-key-wrong-shape", model_file("m.safetensors", {SD_KEY: torch.zeros(4)}), "cannot tell which"),
    bad(
        "safetensors-needs-no-flag-but-hub-configs",  # passes every check up to diffusers' loader
        model_file("m.safetensors", {SD_KEY: torch.zeros(320, 4, 3, 3)}),
        "cannot load m.safetensors",
    ),
    bad("ckpt-without-allow-pickle", model_file("m.ckpt", {SD_KEY: torch.zeros(320, 4, 3, 3)}), "--allow-pickle"),
    bad("ckpt-random-bytes", model_file("m.ckpt", os.urandom(4096), "--allow-pickle"), "cannot read m.ckpt"),
    bad(  # torch's own message advises weights_only=False; sdpatch's says what it means for this file
        "ckpt-of-other-objects",
        model_file("m.ckpt", {SD_KEY: fractions.Fraction(1, 3)}, "--allow-pickle"),
        "torch.load(weights_only=True) refused it (Unsupported global: GLOBAL fractions.Fraction was not an "
        "allowed global by default); it is damaged, or holds other Python objects, which sdpatch does not load",
    ),
    bad("ckpt-empty", model_file("m.ckpt", b"", "--allow-pickle"), "cannot read m.ckpt"),
    bad("folder-without-model-index", model_folder(None), "not a diffusers model folder"),
    bad("folder-with-broken-model-index", model_folder("{not json"), "cannot read"),
    bad("folder-of-another-pipeline", model_folder('{"_class_name": "FluxPipeline"}'), "is a FluxPipeline"),
    # where it runs
    bad("unknown-backend", ["--backend", "xformers"], "unknown backend 'xformers'"),
    bad("unknown-dtype", ["--dtype", "fp8"], "unknown dtype 'fp8'"),
    bad("unknown-device", ["--device", "tpu"], "unknown device 'tpu'"),
    bad("empty-device", ["--device", ""], "unknown device ''"),
    bad("device-negative-index", ["--device", "cuda:-1"], "unknown device 'cuda:-1'"),
    bad(
        "cuda-without-gpu",
        ["--device", "cuda"],
        "no CUDA GPU is available",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
    ),
    bad(
        "mps-unavailable",
        ["--device", "mps"],
        "MPS is not available",
        marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS"),
    ),
]


@pytest.mark.parametrize("prompt, args, message", HOSTILE)
def test_hostile_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, prompt, args, message):
    monkeypatch.chdir(tmp_path)
    extra = args(tmp_path) if callable(args) else args
    before = snapshot(tmp_path)
    result = invoke("generate", *([prompt] if prompt is not None else []), *FAST, *extra)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdpatch: error: "), result.stderr
    assert message in lines[0]
    assert result.stdout == ""
    assert snapshot(tmp_path) == before


# Rows that get past click and fail in the library, where a traceback could escape.
SCRIPT_ROWS = (
    "prompt-not-utf8",
    "steps-beyond-the-scheduler",
    "seed-past-2**64",
    "safetensors-truncated",
    "prompts-file-not-utf8",
    "prompts-file-steps-beyond-the-scheduler",
)


@pytest.mark.parametrize("prompt, args, message", [row for row in HOSTILE if row.id in SCRIPT_ROWS])
def test_hostile_input_through_the_console_script(tmp_path, prompt, args, message):
    extra = args(tmp_path) if callable(args) else args
    before = snapshot(tmp_path)
    # A str prompt with surrogates goes out as the undecodable bytes it came from (os.fsencode).
    result = subprocess.run(
        [console_script(), "generate", *([prompt] if prompt is not None else []), *FAST, *extra],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        timeout=300,
    )
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("sdpatch: error: ") and message in stderr
    assert "Traceback" not in stderr and result.stdout == b""
    assert snapshot(tmp_path) == before


# -- pickle needs a flag; safetensors does not ---------------------------------------------------


def test_ckpt_needs_allow_pickle_and_safetensors_does_not(tmp_path):
    weights = {SD_KEY: torch.zeros(320, 4, 3, 3)}
    save_file(weights, str(tmp_path / "m.safetensors"))
    torch.save(weights, tmp_path / "m.ckpt")

    assert resolve_model(str(tmp_path / "m.safetensors")).pipeline_class == "StableDiffusionPipeline"
    with pytest.raises(InputError, match="pickle.*--allow-pickle"):
        resolve_model(str(tmp_path / "m.ckpt"))
    assert resolve_model(str(tmp_path / "m.ckpt"), allow_pickle=True).pipeline_class == "StableDiffusionPipeline"
