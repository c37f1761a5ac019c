"""``sdpatch compare``: the whole flow on the CPU with the embedded ``tiny`` model, out-of-memory
injection, the ``--max-size`` bisection, the output folder rules and bad input.

Sizes 64–320 px and 2 steps keep each run to a few seconds. Out-of-memory errors are injected
with hooks on the pipeline's modules, keyed on which attention processor is in place.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import sdpatch.compare as compare_lib
import sdpatch.compare.cells as cells_lib
from sdpatch.cli import app
from sdpatch.compare import (
    BackendSwitcher,
    CompareSettings,
    image_difference,
    largest_fitting,
    vram_cap_bytes,
)
from sdpatch.errors import InputError
from sdpatch.settings import RunOptions
from sdpatch.memory import PhaseStats, is_oom
from sdpatch.models import build_preset

BACKENDS = ["stock", "naive", "sliced", "sdpa", "chunked"]
FAST = ["--model", "tiny", "--device", "cpu", "--steps", "2"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def strict_json(path: Path) -> dict:
    """Parse as strict JSON: Infinity and NaN are not JSON."""

    def refuse(name: str):
        raise ValueError(f"{path.name} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def current_backend(pipe) -> str:
    """Which compare backend a pipeline's UNet has, from its first attention processor."""
    proc = next(iter(pipe.unet.attn_processors.values()))
    names = {"AttnProcessor": "naive", "SlicedAttnProcessor": "sliced", "AttnProcessor2_0": "stock"}
    return names.get(type(proc).__name__) or proc.backend


Rule = tuple[str, str, Callable[[], BaseException], int]  # backend, phase, error, smallest size it hits


def inject(monkeypatch, *rules: Rule) -> list:
    """Make ``load_pipeline`` return a pipeline that raises in a phase for a backend, from a size on.

    Returns a list that collects the loaded pipelines (to count loads).
    """
    real_load, real_call = cells_lib.load_pipeline, cells_lib.measured_call
    loaded = []
    size = {}

    def hit(pipe, phase: str) -> None:
        for backend, where, error, min_size in rules:
            if where == phase and current_backend(pipe) == backend and size["now"] >= min_size:
                raise error()

    def load(*args, **kwargs):
        pipe = real_load(*args, **kwargs)
        loaded.append(pipe)
        pipe.text_encoder.register_forward_pre_hook(lambda m, a: hit(pipe, "text_encoding"))
        pipe.unet.register_forward_pre_hook(lambda m, a: hit(pipe, "denoising"))
        decode = pipe.vae.decode

        def checked_decode(*a, **k):
            hit(pipe, "vae_decode")
            return decode(*a, **k)

        pipe.vae.decode = checked_decode
        return pipe

    def call(pipe, meter, **kwargs):
        size["now"] = kwargs["height"]
        return real_call(pipe, meter, **kwargs)

    monkeypatch.setattr(cells_lib, "load_pipeline", load)
    monkeypatch.setattr(cells_lib, "measured_call", call)
    return loaded


def cuda_oom() -> BaseException:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")


# -- the whole flow --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One CLI run over five backends at 64 and 128 px, shared by the tests that read its files."""
    out = tmp_path_factory.mktemp("compare") / "run"
    with pytest.MonkeyPatch.context() as mp:
        loads = inject(mp)
        result = invoke("compare", *FAST, "--sizes", "64,128", "--backends", ",".join(BACKENDS), "--out", str(out))
    return SimpleNamespace(result=result, out=out, loads=loads)


def test_cli_run_writes_every_file_and_loads_the_model_once(full_run):
    result, out = full_run.result, full_run.out
    assert result.exit_code == 0, result.output
    assert len(full_run.loads) == 1
    assert sorted(p.name for p in out.iterdir()) == ["grid.png", "images", "memory.png", "report.json", "report.md"]
    assert sorted(p.name for p in (out / "images").iterdir()) == sorted(
        f"{b}-{s}.png" for b in BACKENDS for s in (64, 128)
    )
    for line in ("64² naive: peak", "128² chunked: peak", "| backend | 64² | 128² |", "All 10 cells started from"):
        assert line in result.stdout
    assert f"wrote {out}" in result.stdout


def test_report_json_holds_every_number(full_run):
    report = strict_json(full_run.out / "report.json")
    assert report["complete"] is True
    assert report["model"] == "tiny" and report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["sizes"] == [64, 128]
    assert report["backends"] == BACKENDS and report["reference"] == "stock"
    assert report["unet_batch"] == 2
    assert report["memory"] == {"kind": "host", "host_scope": "phase"}
    assert report["weights_bytes"] == sum(report["weights_by_component"].values()) > 0
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["diffusers"] and "triton" in env
    assert env["gpu"] is None and env["driver"] is None  # a CPU run
    assert report["settings"]["steps"] == 2 and report["settings"]["seed"] == 0

    cells = report["cells"]
    assert [(c["size"], c["backend"]) for c in cells] == [(s, b) for s in (64, 128) for b in BACKENDS]
    for c in cells:
        assert c["status"] == "ok" and c["failure"] is None
        assert [p["name"] for p in c["phases"]] == ["text_encoding", "denoising", "vae_decode"]
        assert c["peak_bytes"] == max(p["peak_host"] for p in c["phases"]) > c["baseline_bytes"] > 0
        assert c["over_baseline_bytes"]["total"] == c["peak_bytes"] - c["baseline_bytes"]
        assert c["over_baseline_bytes"]["denoising"] is not None
        assert c["seconds_per_step"] > 0 and c["first_step_seconds"] > 0 and c["seconds"] > 0
        assert c["phases"][1]["steps"] == 2
        assert c["reference"] == "stock"
        assert c["images"] == [f"images/{c['backend']}-{c['size']}.png"]
        psnr = c["psnr_db"]
        assert (psnr is None and c["max_abs_diff"] == 0) or psnr >= 40, (c["backend"], c["size"], psnr)
        assert c["max_abs_diff"] <= 2
        if c["backend"] == "stock":
            assert (psnr, c["max_abs_diff"]) == (None, 0)  # identical: JSON has no infinity
            assert c["recheck_seconds_per_step"] > 0  # timed again after the size's other cells

    check = report["baseline_check"]
    assert check["equal"] is True and check["cells"] == 10
    assert check["max_bytes"] - check["min_bytes"] <= check["tolerance_bytes"]
    assert "started from the same resident host memory" in check["message"]
    assert report["files"] == {"markdown": "report.md", "chart": "memory.png", "grid": "grid.png"}
    assert report["max_size"] == {}


def test_report_md_is_a_backends_by_sizes_table(full_run):
    md = (full_run.out / "report.md").read_text()
    assert md.startswith("# sdpatch compare: tiny on CPU")
    lines = md.splitlines()
    head = lines.index("| backend | 64² | 128² |")
    rows = lines[head + 2 : head + 2 + len(BACKENDS)]
    assert [r.split("|")[1].strip() for r in rows] == BACKENDS
    assert all(r.count("|") == 4 for r in rows)
    assert "reference" in rows[0]
    for row in rows[1:]:
        assert row.count("s/step") == 2 and row.count("PSNR") == 2
        assert row.count("GiB") == 2
    assert "Peak resident host memory" in md  # a CPU run says what it measured
    assert "## Peak over the weights: denoising (UNet) / VAE decode" in md
    assert "## Peak reserved" not in md  # CUDA only
    assert "## Baseline check" in md and "All 10 cells started from the same" in md
    assert "](memory.png)" in md and "](grid.png)" in md
    assert "**naive**: diffusers' AttnProcessor" in md


def test_chart_and_grid_are_pngs_of_the_right_shape(full_run):
    out = full_run.out
    chart = Image.open(out / "memory.png")
    assert chart.format == "PNG" and chart.size == (1100, 450)
    assert len(np.unique(np.asarray(chart.convert("L")))) > 10  # something is drawn

    grid = Image.open(out / "grid.png")
    assert grid.format == "PNG"
    tile = 128  # the largest size, under 256
    assert grid.width >= 2 * tile + 80 and grid.height >= len(BACKENDS) * tile
    # The 128 px column shows each image unscaled: the stock row's tile is the stock image.
    stock = np.asarray(Image.open(out / "images" / "stock-128.png").convert("RGB"))
    x, y = 90 + tile + 6, 22
    assert np.array_equal(np.asarray(grid.convert("RGB"))[y : y + tile, x : x + tile], stock)


def test_each_image_carries_its_cell_record(full_run):
    image = Image.open(full_run.out / "images" / "sdpa-128.png")
    assert image.size == (128, 128)
    assert (image.text["backend"], image.text["size"], image.text["model"]) == ("sdpa", "128x128", "tiny")
    record = json.loads(image.text["sdpatch"])
    assert record["backend"] == "sdpa" and record["max_abs_diff"] is not None


# -- switching backends ----------------------------------------------------------------------------


def processors(pipe) -> dict[str, object]:
    """Every attention processor object of the pipeline, by component and layer."""
    return {f"{c}.{name}": p for c in ("unet", "vae") for name, p in getattr(pipe, c).attn_processors.items()}


def test_switching_backends_restores_the_stock_processor_objects():
    pipe = build_preset("tiny")
    before = processors(pipe)
    switcher = BackendSwitcher(pipe)
    for backend in ["naive", "sliced", "sdpa", "chunked", "auto", "naive", "stock", "sliced"]:
        switcher.set(backend)
        assert current_backend(pipe) == backend
        now = processors(pipe)
        if backend in ("naive", "sliced"):  # diffusers' options touch the UNet only
            assert all(now[k] is before[k] for k in before if k.startswith("vae."))
        kinds = {type(p).__name__ for p in pipe.unet.attn_processors.values()}
        assert len(kinds) == 1, kinds  # nothing left over from the backend before
    switcher.restore()
    after = processors(pipe)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert not any(hasattr(m, "_sdpatch_original_processor") for m in [*pipe.unet.modules(), *pipe.vae.modules()])


# -- out of memory ---------------------------------------------------------------------------------

OOMS = [
    pytest.param("naive", "denoising", cuda_oom, id="cuda-oom-denoising"),
    pytest.param(
        "sliced",
        "vae_decode",
        lambda: RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"),
        id="cpu-allocator-vae-decode",
    ),
    pytest.param("sdpa", "text_encoding", MemoryError, id="memoryerror-text-encoding"),
]
LABELS = {"denoising": "denoising", "vae_decode": "VAE decode", "text_encoding": "text encoding"}


@pytest.mark.parametrize("backend, phase, error", OOMS)
def test_out_of_memory_is_a_result_and_the_run_goes_on(tmp_path, monkeypatch, backend, phase, error):
    inject(monkeypatch, (backend, phase, error, 128))
    out = tmp_path / "oom"
    result = invoke("compare", *FAST, "--sizes", "64,128", "--backends", f"stock,{backend},chunked", "--out", str(out))
    assert result.exit_code == 0, result.output
    failure = f"OOM in {LABELS[phase]}"
    assert f"128² {backend}: {failure}" in result.stdout

    report = strict_json(out / "report.json")
    cells = {(c["backend"], c["size"]): c for c in report["cells"]}
    assert len(cells) == 6 and report["complete"] is True
    failed = cells[(backend, 128)]
    assert (failed["status"], failed["failure"], failed["failed_phase"]) == ("oom", failure, phase)
    assert failed["during_warmup"] is True  # the warm-up ran into it first
    assert failed["images"] == [] and failed["psnr_db"] is None and failed["seconds_per_step"] is None
    # Phases before the failure, and the failed one up to the failure, are recorded.
    assert [p["name"] for p in failed["phases"]][-1] == phase
    assert all(c["status"] == "ok" for key, c in cells.items() if key != (backend, 128))
    assert cells[("chunked", 128)]["max_abs_diff"] == 0 or cells[("chunked", 128)]["psnr_db"] >= 40
    assert report["baseline_check"]["equal"] is True  # the failed cell's memory was released

    md = (out / "report.md").read_text()
    assert f"**{failure}**" in md
    assert not (out / "images" / f"{backend}-128.png").exists()
    assert Image.open(out / "grid.png").format == "PNG"


def test_oom_in_the_measured_run_after_a_clean_warm_up(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = cells_lib.load_pipeline

    def load(*args, **kwargs):
        pipe = real(*args, **kwargs)

        def hook(module, args):
            if current_backend(pipe) == "naive":
                calls["n"] += 1
                if calls["n"] == 3:  # warm-up: call 1; measured run: calls 2 and 3
                    raise cuda_oom()

        pipe.unet.register_forward_pre_hook(hook)
        return pipe

    monkeypatch.setattr(cells_lib, "load_pipeline", load)
    report = compare_lib.run(
        CompareSettings(sizes=(64,), backends=("stock", "naive"), steps=2), RunOptions(device="cpu"), out=tmp_path / "o"
    )
    naive = report.cell("naive", 64)
    assert (naive.status, naive.failure, naive.during_warmup) == ("oom", "OOM in denoising", False)
    assert naive.phase("denoising").peak_host > 0


def test_another_error_is_recorded_and_the_exit_code_says_so(tmp_path, monkeypatch):
    inject(monkeypatch, ("sdpa", "denoising", lambda: ValueError("kernel exploded\nsecond line"), 0))
    out = tmp_path / "err"
    result = invoke("compare", *FAST, "--sizes", "64", "--backends", "stock,sdpa,chunked", "--out", str(out))
    assert result.exit_code == 1
    assert "1 cell failed with an error other than out of memory" in result.stderr
    report = strict_json(out / "report.json")
    sdpa = report["cells"][1]
    assert (sdpa["status"], sdpa["failure"], sdpa["message"]) == ("error", "error in denoising", "kernel exploded")
    assert report["cells"][2]["status"] == "ok" and report["complete"] is True
    assert "## Errors" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "err, expected",
    [
        (torch.OutOfMemoryError("CUDA out of memory"), True),
        (MemoryError(), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_is_oom(err, expected):
    assert is_oom(err) is expected


# -- --max-size ------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [64, 512, 8192])
def test_bisection_finds_the_largest_fitting_size(limit):
    for threshold in range(0, limit + 64, 64):
        probes: list[int] = []

        def fits(size: int) -> bool:
            probes.append(size)
            return size <= threshold

        found = largest_fitting(fits, limit=limit)
        assert found == (threshold or None), (limit, threshold)
        assert len(probes) == len(set(probes)) <= math.ceil(math.log2(limit // 64 + 1)) + 1
        assert all(s % 64 == 0 and 64 <= s <= limit for s in probes)


def test_bisection_uses_known_results_without_probing_them():
    probes: list[int] = []

    def fits(size: int) -> bool:
        probes.append(size)
        return size <= 1500

    known = {512: True, 1024: True, 2048: False}
    assert largest_fitting(fits, limit=8192, known=known) == 1472
    assert all(1024 < s < 2048 for s in probes) and len(probes) <= 4
    # Sizes that are not multiples of 64 bound the search by rounding (down for a fit, up for a failure).
    assert largest_fitting(lambda s: pytest.fail("probed"), limit=8192, known={1000: True, 1020: False}) == 960
    # Everything known: nothing to probe.
    assert largest_fitting(lambda s: pytest.fail("probed"), limit=256, known={256: True}) == 256
    assert largest_fitting(lambda s: pytest.fail("probed"), limit=256, known={512: True}) == 256
    assert largest_fitting(lambda s: pytest.fail("probed"), limit=256, known={64: False}) is None
    # A fit above a failure contradicts monotonicity: the failure wins.
    assert largest_fitting(lambda s: s <= 192, limit=512, known={256: False, 384: True}) == 192


def test_max_size_end_to_end_with_an_injected_threshold(tmp_path, monkeypatch):
    inject(monkeypatch, ("naive", "denoising", cuda_oom, 256), ("stock", "vae_decode", cuda_oom, 384))
    out = tmp_path / "max"
    result = invoke(
        "compare", *FAST, "--sizes", "64,128", "--backends", "stock,naive", "--no-warmup",
        "--max-size", "--max-size-limit", "512", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "largest size, stock: 320²" in result.stdout and "largest size, naive: 192²" in result.stdout
    report = strict_json(out / "report.json")
    found = report["max_size"]
    assert found["stock"]["size"] == 320 and found["naive"]["size"] == 192
    assert found["stock"]["limit"] == 512 and found["stock"]["done"] is True
    stock_probes = [(p["size"], p["status"]) for p in found["stock"]["probes"]]
    assert stock_probes == [(320, "ok"), (448, "oom"), (384, "oom")]  # 64 and 128 came from the grid
    naive_probes = [(p["size"], p["status"]) for p in found["naive"]["probes"]]
    assert naive_probes == [(320, "oom"), (192, "ok"), (256, "oom")]
    assert all(p["kind"] == "probe" and p["images"] == [] for p in found["stock"]["probes"])
    assert found["stock"]["probes"][1]["failure"] == "OOM in VAE decode"
    assert report["baseline_check"]["cells"] == 4 + 6
    md = (out / "report.md").read_text()
    assert "## Largest square size (--max-size)" in md
    assert "| stock | 320² | 320 ok, 448 OOM in VAE decode, 384 OOM in VAE decode |" in md
    assert "| naive | 192² |" in md
    assert sorted(p.name for p in (out / "images").iterdir()) == [
        "naive-128.png", "naive-64.png", "stock-128.png", "stock-64.png",
    ]  # fmt: skip


# -- output folder ---------------------------------------------------------------------------------

QUICK = [*FAST, "--backends", "stock", "--no-warmup"]


def test_a_non_empty_folder_needs_overwrite_or_the_run_goes_to_a_new_one(tmp_path):
    out = tmp_path / "cmp"
    assert invoke("compare", *QUICK, "--sizes", "64", "--out", str(out)).exit_code == 0
    first = files_under(out)

    again = invoke("compare", *QUICK, "--sizes", "64", "--out", str(out))
    assert again.exit_code == 0, again.output
    assert f"writing to {tmp_path / 'cmp-2'} instead" in again.output
    assert files_under(out) == first  # untouched
    assert (tmp_path / "cmp-2" / "report.json").is_file()
    assert "cmp-2 instead" in (tmp_path / "cmp-2" / "report.md").read_text()

    third = invoke("compare", *QUICK, "--sizes", "64", "--out", str(out))
    assert f"writing to {tmp_path / 'cmp-3'} instead" in third.output

    (out / "mine.txt").write_text("the user's own file")
    replaced = invoke("compare", *QUICK, "--sizes", "128", "--out", str(out), "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert "instead" not in replaced.output
    assert sorted(p.name for p in (out / "images").iterdir()) == ["stock-128.png"]  # no stale 64 px image
    assert strict_json(out / "report.json")["sizes"] == [128]
    assert (out / "mine.txt").read_text() == "the user's own file"


def test_an_empty_existing_folder_is_used(tmp_path):
    (tmp_path / "empty").mkdir()
    assert invoke("compare", *QUICK, "--sizes", "64", "--out", str(tmp_path / "empty")).exit_code == 0
    assert (tmp_path / "empty" / "report.json").is_file() and not (tmp_path / "empty-2").exists()


def test_an_interrupted_run_keeps_its_finished_cells(tmp_path):
    seen = []

    def stop_after_two(cell) -> None:
        seen.append(cell)
        if len(seen) == 2:
            raise KeyboardInterrupt

    settings = CompareSettings(sizes=(64, 128), backends=("stock", "sdpa"), steps=2, warmup=False)
    with pytest.raises(KeyboardInterrupt):
        compare_lib.run(settings, RunOptions(device="cpu"), out=tmp_path / "o", on_cell=stop_after_two)
    report = strict_json(tmp_path / "o" / "report.json")
    assert report["complete"] is False
    assert [(c["backend"], c["size"]) for c in report["cells"]] == [("stock", 64), ("sdpa", 64)]
    assert "did not finish" in (tmp_path / "o" / "report.md").read_text()
    assert sorted(p.name for p in (tmp_path / "o" / "images").iterdir()) == ["sdpa-64.png", "stock-64.png"]


def test_a_batch_keeps_every_image_and_compares_them_all(tmp_path):
    settings = CompareSettings(sizes=(64,), backends=("sdpa", "chunked"), steps=2, batch=2, warmup=False)
    report = compare_lib.run(settings, RunOptions(device="cpu"), out=tmp_path / "b")
    data = strict_json(tmp_path / "b" / "report.json")
    assert data["reference"] == "sdpa"  # no stock: the first backend is the reference
    assert data["unet_batch"] == 4
    chunked = report.cell("chunked", 64)
    assert chunked.images == ["images/chunked-64-0.png", "images/chunked-64-1.png"]
    first, second = (np.asarray(Image.open(tmp_path / "b" / p)) for p in chunked.images)
    assert not np.array_equal(first, second)
    assert chunked.psnr_db >= 40


def test_without_matplotlib_the_chart_is_skipped_and_can_be_drawn_later(tmp_path):
    out = tmp_path / "m"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.ticker"):
            mp.setitem(sys.modules, name, None)  # import raises ImportError
        settings = CompareSettings(sizes=(64,), backends=("stock",), steps=1, warmup=False)
        report = compare_lib.run(settings, RunOptions(device="cpu"), out=out)
    assert report.chart is None and report.grid == "grid.png"
    assert not (out / "memory.png").exists()
    md = (out / "report.md").read_text()
    assert "pip install 'sdpatch[report]'" in md and "memory.png" not in md
    assert strict_json(out / "report.json")["files"]["chart"] is None

    redrawn = compare_lib.redraw(out)  # python -m sdpatch.compare DIR, where matplotlib is installed
    assert redrawn.chart == "memory.png" and Image.open(out / "memory.png").format == "PNG"
    md = (out / "report.md").read_text()
    assert "](memory.png)" in md and "chart not drawn" not in md


def test_redrawing_a_report_from_its_json_gives_the_same_report(full_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(full_run.out, copy)
    compare_lib.redraw(copy)
    assert (copy / "report.md").read_text() == (full_run.out / "report.md").read_text()
    assert strict_json(copy / "report.json") == strict_json(full_run.out / "report.json")
    assert Image.open(copy / "grid.png").tobytes() == Image.open(full_run.out / "grid.png").tobytes()
    (copy / "report.json").write_text("{}")
    with pytest.raises(InputError, match="not a report of sdpatch compare"):
        compare_lib.redraw(copy)


# -- small pieces ----------------------------------------------------------------------------------


def test_image_difference_and_json_safe_psnr():
    a = Image.fromarray(np.full((8, 8, 3), 100, np.uint8))
    b = Image.fromarray(np.full((8, 8, 3), 103, np.uint8))
    assert image_difference([a], [a]) == (0, math.inf)
    diff, psnr = image_difference([b], [a])
    assert diff == 3 and psnr == pytest.approx(10 * math.log10(255**2 / 9))
    assert compare_lib.json_psnr(math.inf) is None and compare_lib.json_psnr(1.5) == 1.5
    assert compare_lib.psnr_value(None, 0) == math.inf and compare_lib.psnr_value(None, None) is None
    assert compare_lib.psnr_value("inf", 0) == math.inf  # as the reports under docs/compare/ hold it
    assert compare_lib.format_psnr(math.inf) == "inf dB"  # in the table, the summary and the grid alike


def test_vram_cap_is_a_fraction_of_the_gpu_and_refused_off_cuda(monkeypatch):
    with pytest.raises(InputError, match="needs a CUDA device"):
        vram_cap_bytes(8, torch.device("cpu"))
    assert vram_cap_bytes(None, torch.device("cpu")) is None
    props = SimpleNamespace(total_memory=80 * 1024**3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert vram_cap_bytes(8, torch.device("cuda", 0)) == 8 * 1024**3
    with pytest.raises(InputError, match="more than this GPU"):
        vram_cap_bytes(100, torch.device("cuda", 0))


def _out_is_a_file(d: Path) -> list[str]:
    (d / "f").write_text("x")
    return ["--out", str(d / "f")]


BAD = [
    pytest.param(["--backends", "stock,flash"], "unknown backend 'flash'", id="unknown-backend"),
    pytest.param(["--backends", "stock,stock"], "named twice", id="backend-twice"),
    pytest.param(["--backends", ""], "--backends needs", id="no-backends"),
    pytest.param(["--sizes", "60"], "multiple of 8", id="size-not-multiple-of-8"),
    pytest.param(["--sizes", "0"], "multiple of 8", id="size-zero"),
    pytest.param(["--sizes", "-64"], "multiple of 8", id="size-negative"),
    pytest.param(["--sizes", "64,big"], "whole numbers", id="size-not-a-number"),
    pytest.param(["--sizes", ""], "whole numbers", id="sizes-empty"),
    pytest.param(["--sizes", "64,64"], "given twice", id="size-twice"),
    pytest.param(["--steps", "0"], "--steps", id="steps-zero"),
    pytest.param(["--batch", "0"], "--batch", id="batch-zero"),
    pytest.param(["--seed", "-1"], "--seed", id="seed-negative"),
    pytest.param(["--guidance-scale", "nan"], "--guidance-scale", id="guidance-nan"),
    pytest.param(["--vram-cap", "8"], "needs a CUDA device", id="vram-cap-on-cpu"),
    pytest.param(["--vram-cap", "0"], "--vram-cap", id="vram-cap-zero"),
    pytest.param(["--max-size-limit", "1024"], "only used with --max-size", id="limit-without-max-size"),
    pytest.param(["--max-size", "--max-size-limit", "1000"], "multiple of 64", id="limit-not-multiple-of-64"),
    pytest.param(["--model", "sd99"], "unknown model", id="unknown-model"),
    pytest.param(["--dtype", "fp8"], "unknown dtype", id="unknown-dtype"),
    pytest.param(lambda d: ["--out", str(d / "missing" / "out")], "does not exist", id="out-in-missing-folder"),
    pytest.param(_out_is_a_file, "not a folder", id="out-is-a-file"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_input_is_one_line_exit_2_before_loading(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cells_lib, "load_pipeline", lambda *a, **k: pytest.fail("loaded a model"))
    extra = args(tmp_path) if callable(args) else args
    before = files_under(tmp_path)
    result = invoke("compare", "--device", "cpu", "--sizes", "64", "--backends", "stock", *extra)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdpatch: error: "), result.stderr
    assert message in lines[0]
    assert result.stdout == ""
    assert files_under(tmp_path) == before


def test_a_backend_that_cannot_run_here_is_refused(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    status = {"triton": (False, "Triton kernels need a CUDA device"), "chunked": (True, ""), "sdpa": (True, "")}
    monkeypatch.setattr(cells_lib, "backend_status", lambda device: status)
    result = invoke("compare", "--device", "cpu", "--backends", "stock,triton")
    assert result.exit_code == 2
    expected = "sdpatch: error: backend 'triton' cannot run on cpu: Triton kernels need a CUDA device"
    assert result.stderr.strip() == expected
    result = invoke("compare", "--device", "cpu", "--backends", "xformers")
    assert result.exit_code == 2 and "xformers" in result.stderr
    # Without --backends, what cannot run is left out and noted.
    chosen, notes = compare_lib.resolve_backends(None, torch.device("cpu"))
    assert "triton" not in chosen and "stock" in chosen and "auto" not in chosen
    assert any(n.startswith("backend triton left out: Triton kernels need a CUDA device") for n in notes)
    assert list(tmp_path.iterdir()) == []


def test_a_cuda_report_shows_reserved_memory_the_cap_and_the_reference(tmp_path):
    # What an H200 run writes, from made-up cells: the CUDA-only parts of report.md and the chart.
    gib, w = 1024**3, 2 * 1024**3

    def cell(backend: str, size: int, unet_gib: float | None) -> compare_lib.Cell:
        if unet_gib is None:
            phases = [PhaseStats("denoising", 0.1, w + 30 * gib, w + 31 * gib)]
            return compare_lib.Cell(backend, size, status="oom", failed_phase="denoising", baseline=w, phases=phases)
        peak = int(w + unet_gib * gib)
        unet = PhaseStats("denoising", 1, peak, int(w + 1.5 * unet_gib * gib), step_seconds=[1, 1])
        vae = PhaseStats("vae_decode", 1, w + gib, w + 2 * gib)
        return compare_lib.Cell(backend, size, baseline=w, phases=[unet, vae], reference="stock", psnr_db=math.inf)

    report = compare_lib.CompareReport(
        model="sd15", settings=CompareSettings(sizes=(1024, 2048), vram_cap_gib=80), sizes=[1024, 2048],
        backends=["stock", "naive"], reference="stock", out_dir=tmp_path, device="cuda:0",
        device_name="NVIDIA H200", dtype="float16", memory_kind="cuda", weights={"unet": w},
        environment={"gpu": "NVIDIA H200", "gpu_memory_bytes": 140 * gib, "driver": "580.1"},
        vram_cap_bytes=80 * gib, complete=True,
    )  # fmt: skip
    report.cells = [cell("stock", 1024, 0.5), cell("naive", 1024, 16.2)]
    report.cells += [cell("stock", 2048, 2.0), cell("naive", 2048, None)]
    md = report.to_markdown()
    assert "Peak allocated GPU memory" in md and "NVIDIA H200 (140.00 GiB), driver 580.1" in md
    assert "Memory cap: 80.00 GiB (--vram-cap)." in md
    assert "| naive | 16.20 GiB / 1.00 GiB | **OOM in denoising** |" in md  # over the weights
    assert "## Peak reserved" in md and "| naive | 26.30 GiB | **OOM in denoising** |" in md
    assert "Issue 5's reference" in md and "16.2 GiB at 1024²" in md
    assert "All 4 cells started from the same allocated GPU memory: 2.00 GiB" in md
    assert compare_lib.write_chart(report, tmp_path / "memory.png") == "memory.png"
    assert Image.open(tmp_path / "memory.png").size == (1100, 450)


def test_more_steps_than_the_scheduler_has_is_refused_before_anything_is_written(tmp_path):
    result = invoke("compare", *QUICK, "--sizes", "64", "--steps", "1001", "--out", str(tmp_path / "s"))
    assert result.exit_code == 2
    assert result.stderr.strip() == "sdpatch: error: --steps must be at most 1000 for tiny, got 1001"
    assert list(tmp_path.iterdir()) == []


def timed(backend: str, steady: list[float], recheck: float | None = None) -> compare_lib.Cell:
    """A 64² cell whose denoising steps after the first took ``steady`` seconds."""
    phases = [PhaseStats("denoising", 1, step_seconds=[1.0, *steady])]
    return compare_lib.Cell(backend, 64, phases=phases, reference="stock", recheck_seconds_per_step=recheck)


TIMINGS = [
    pytest.param([timed("stock", [0.100, 0.104], 0.103), timed("naive", [0.20, 0.21])], [], id="steady"),
    pytest.param(
        [timed("stock", [0.100, 0.101], 0.1), timed("naive", [0.2])], ["naive: one timed step"], id="one-step"
    ),
    pytest.param(
        [timed("stock", [0.100, 0.101], 0.1), timed("naive", [0.20, 0.30])],
        ["step times spread: naive ±20 %"],
        id="wide-spread",
    ),
    pytest.param(
        [timed("stock", [0.100, 0.100], 0.150), timed("naive", [0.20, 0.20])],
        ["stock took 0.100 s/step first and 0.150 after the other cells"],
        id="reference-drifted",
    ),
]


@pytest.mark.parametrize("cells, reasons", TIMINGS)
def test_timing_check_says_when_a_size_is_too_noisy_to_rank(tmp_path, cells, reasons):
    report = compare_lib.CompareReport(
        model="tiny", settings=CompareSettings(sizes=(64,)), sizes=[64], backends=["stock", "naive"],
        reference="stock", out_dir=tmp_path, device="cpu", device_name="CPU", dtype="float32",
        memory_kind="host", weights={}, environment={}, complete=True,
    )  # fmt: skip
    report.cells = cells
    (check,) = report.timing_check()
    assert check["rankable"] == (not reasons)
    assert [r for r in check["reasons"] if not any(r.startswith(x) for x in reasons)] == []
    assert len(check["reasons"]) == len(reasons)
    md = report.to_markdown()
    if reasons:
        assert "timings at 64² are too noisy to rank the backends" in md and reasons[0] in md
    else:
        assert "the backends can be ranked by s/step" in md
        assert "0.102 s/step ±2 %" in report.main_table()


def test_the_cli_run_warms_up_and_says_its_two_step_timings_cannot_rank(full_run):
    report = strict_json(full_run.out / "report.json")
    assert [c["rankable"] for c in report["timing_check"]] == [False, False]  # --steps 2: one timed step each
    assert "timings at 64² are too noisy to rank the backends" in full_run.result.stdout
    assert "one untimed step of stock ran before the first cell" in (full_run.out / "report.md").read_text()


def test_compare_shows_one_bar_over_its_cells_on_a_terminal(tmp_path, monkeypatch):
    from sdpatch.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    settings = CompareSettings(sizes=(64,), backends=("stock", "sdpa"), steps=1)
    with Progress() as progress:
        compare_lib.run(settings, RunOptions(device="cpu"), out=tmp_path / "o", progress=progress)
    shown = sys.stderr.getvalue()
    for label in ("building tiny on cpu", "warm-up: stock at 64²", "cells: 0/2", "64² sdpa: 1/2", "64² stock again"):
        assert label in shown


def test_one_table_names_the_backends_for_the_registry_the_cli_and_compare():
    """sdpatch.settings.ATTENTION_BACKENDS, free of torch, is what the registry builds its records
    from, and what the --backend help, compare's names and its default columns list."""
    from sdpatch.attention import BACKENDS, REGISTRY
    from sdpatch.cli import BackendOpt
    from sdpatch.compare.cells import DEFAULT_BACKENDS
    from sdpatch.settings import ATTENTION_BACKENDS, COMPARE_BACKENDS

    assert tuple(REGISTRY) == tuple(ATTENTION_BACKENDS) and BACKENDS == ("auto", *ATTENTION_BACKENDS)
    help_text = BackendOpt.__metadata__[0].help
    for name in ATTENTION_BACKENDS:
        assert name in COMPARE_BACKENDS and name in DEFAULT_BACKENDS and name in help_text
