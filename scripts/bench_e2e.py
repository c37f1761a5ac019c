"""End to end, as a user runs it: `sdpatch generate` per configuration, each in a fresh process.

    python scripts/bench_e2e.py --json bench_e2e.json [--presets sd15:512,sd15:1024,sdxl:1024] [--steps 20]
                                [--only stock,graphs,...]

Configurations (each a fresh process on the same GPU, the same seed and prompt):

- ``stock``: ``--backend stock``, diffusers' own attention (SDPA), eager;
- ``stock-compile``: stock with ``pipe.unet = torch.compile(pipe.unet, mode="reduce-overhead")``,
  the anchor a user would pick for speed (a worker process, since the CLI has no such flag);
- ``eager-cold``: sdpatch, ``--no-cuda-graphs``, with an empty Triton cache: the first eager run at a
  size, whose new layouts compile in the background while SDPA stands in;
- ``eager``: the same again, caches warm;
- ``eager-triton``: ``eager`` with ``SDPATCH_GLUON=0``, the Triton forward serving every call, and
  ``eager-gluon``: ``eager`` with ``EAGER_GLUON_MIN_FLOP`` at 0, the Gluon forward serving every eager
  call it can: the two ends of the eager launch policy, what the Gluon forward's eager calls gain or
  cost a host-bound step;
- ``graphs-cold``: sdpatch's default (CUDA graphs), with an empty Triton cache: the first run at a size;
- ``graphs``: the same again, caches warm;
- ``compile-cold`` / ``compile``: ``--compile`` with empty, then warm, inductor and Triton caches;
- ``patched-compile``: the patched UNet under ``torch.compile(mode="reduce-overhead")``, per UNet call
  against ``stock-compile`` (a worker process).

Each run makes three images (seeds 0-2): the first at a new size, as a user's first image, and two
more with every one-time cost paid (compiles, captures, sdpatch's kernels compiled in the
background while SDPA stood in for them). The warm configurations run ``--rounds`` times, each
round in the reverse order of the one before (ABBA), the cold ones once, in the first round: the
lent hosts' speed comes in bursts (a whole run's steps 1.7x slower, or stretches of a run), which
one run per configuration cannot tell from a difference between them. Each run reports steady s/it
(the median step of the later images, each from its third step on), the first image's s/it as the CLI reports it,
its first step and wall time, peak allocated and reserved over the run, the CUDA graphs' pool, and
PSNR of the first image against stock's (random-weight presets: identical settings give identical
noise images up to fp16 rounding). The last lines are a table, one row per configuration: the best
run's steady s/it (host bursts only ever add time) and every run's, with ratios to ``stock``'s best
in the same call, and the median run's: a whole process can run at one of two speeds on those hosts
(at SD 1.5 512² on an H200, 26-29 or 43-45 ms a step, stock and sdpatch alike), which the best run
of a few hides from one configuration and not from another. The host's time to enqueue a small
kernel, before and after the runs, goes beside them (``host_launch_us``): the eager configurations are
bound by it, and it differs from host to host on one card model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("stock", "stock-compile", "eager-cold", "eager", "eager-triton", "eager-gluon", "graphs-cold", "graphs",
           "compile-cold", "compile", "patched-compile")
PROMPT = "a photo of an astronaut riding a horse on the moon"
WORKER_TIMEOUT_S = 420
# Steady s/it: the later images' median step, each from its third step on. torch.compile's reduce-overhead mode
# records its CUDA graphs over its first calls, and sdpatch's graphs warm up and capture in the first step.
STEADY_FROM = 2
IMAGES = 3


def cli_args(config: str, preset: str, size: int, steps: int, images: Path, report: Path) -> list[str]:
    """The `sdpatch generate` command line of a configuration (None for the worker ones)."""
    # eager-gluon: the CLI in a process whose launch layer sends every eager call the Gluon forward serves to it.
    run = (["-c", "import sdpatch.kernels.forward as f; f.EAGER_GLUON_MIN_FLOP = 0; import sdpatch.cli; sdpatch.cli.main()"]
           if config == "eager-gluon" else ["-m", "sdpatch"])
    base = [sys.executable, *run, "generate", PROMPT, "-m", preset, "-H", str(size), "-W", str(size),
            "--steps", str(steps), "--seed", "0", "--num-images", str(IMAGES), "-o", str(images),
            "--report-json", str(report), "--overwrite"]
    extra = {"stock": ["--backend", "stock"], "eager-cold": ["--no-cuda-graphs"], "eager": ["--no-cuda-graphs"],
             "eager-triton": ["--no-cuda-graphs"], "eager-gluon": ["--no-cuda-graphs"], "graphs-cold": [], "graphs": [],
             "compile-cold": ["--compile"], "compile": ["--compile"]}[config]
    return base + extra


def run_config(config: str, preset: str, size: int, steps: int, work: Path, caches: dict[str, Path]) -> dict:
    images, report = work / f"{preset}-{size}-{config}", work / f"{preset}-{size}-{config}.json"
    images.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if config == "eager-triton":
        env["SDPATCH_GLUON"] = "0"
    # Cold configurations start from empty caches; the warm ones reuse what their cold run left.
    family = config.removesuffix("-cold")
    if config.endswith("-cold"):
        caches[family] = Path(tempfile.mkdtemp(prefix=f"cache-{family}-", dir=work))
    cache = caches.get(family)
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache / "triton")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    if config in ("stock-compile", "patched-compile"):
        cmd = [sys.executable, __file__, "--worker", config, "--presets", f"{preset}:{size}", "--steps", str(steps),
               "--image", str(images), "--json", str(report)]
    else:
        cmd = cli_args(config, preset, size, steps, images, report)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    wall = time.perf_counter() - start
    row = {"config": config, "preset": preset, "size": size, "process_s": round(wall, 2), "rc": proc.returncode}
    if proc.returncode != 0 or not report.exists():
        row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return row
    row.update(summarize(json.loads(report.read_text())))
    return row


def summarize(report: dict) -> dict:
    """The figures of one run's report (sdpatch's --report-json, or a worker's, which has the same keys)."""
    first, last = report["images"][0], report["images"][-1]
    denoise = {p["name"]: p for p in first["phases"]}["denoising"]
    steps = [s for image in report["images"][1:]
             for s in ({p["name"]: p for p in image["phases"]}["denoising"].get("step_seconds") or [])[STEADY_FROM:]]
    total = report["total"]
    speed = report.get("speed") or {}
    graphs = (speed.get("graphs") or {}).get("unet") or {}
    later = sorted(steps)  # past every configuration's one-time steps
    return {
        "s_per_it": later[len(later) // 2] if later else None,
        "cli_s_per_it": denoise.get("seconds_per_step"),
        "first_step_s": denoise.get("first_step_seconds"),
        "image_s": first["total"]["seconds"],
        "image": first["path"],
        "peak_allocated": total.get("peak_allocated"),
        "peak_reserved": total.get("peak_reserved"),
        # Where each image's peaks lie: (phase, peak allocated, peak reserved), first image then last.
        "phase_peaks": [[(p["name"], p.get("peak_allocated"), p.get("peak_reserved")) for p in image["phases"]]
                        for image in (first, last)],
        "graph_pool": graphs.get("pool_bytes"),
        "graph_replays": graphs.get("replays"),
        "graph_eager": graphs.get("eager_calls"),
        "graph_compile_s": graphs.get("compile_s"),
        "graph_capture_s": graphs.get("capture_s"),
        "graph_recaptures": graphs.get("recaptures"),
        "graph_stand_in_replays": graphs.get("stand_in_replays"),
        "stand_in_calls": speed.get("stand_in_calls"),  # attention calls SDPA served while their kernels compiled
    }


def psnr(a: Path, b: Path) -> float | None:
    import numpy as np
    from PIL import Image

    x = np.asarray(Image.open(a).convert("RGB"), dtype=np.float64)
    y = np.asarray(Image.open(b).convert("RGB"), dtype=np.float64)
    if x.shape != y.shape:
        return None
    mse = float(((x - y) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def worker(config: str, preset: str, size: int, steps: int, images: Path, out: Path) -> None:
    """stock-compile / patched-compile: the pipeline built as the CLI builds it, the UNet compiled
    whole with mode="reduce-overhead", then the CLI's own measured generation."""
    import torch

    from sdpatch.generate import GenerationRequest, apply_backend, generate
    from sdpatch.models import build_preset

    torch.cuda.set_device(0)
    pipe = build_preset(preset, device="cuda", dtype=torch.float16)
    if config == "patched-compile":
        apply_backend(pipe, "auto")
    pipe.unet = torch.compile(pipe.unet, mode="reduce-overhead")
    request = GenerationRequest(prompt=PROMPT, height=size, width=size, steps=steps, seed=0, num_images=IMAGES)
    start = time.perf_counter()
    result = generate(pipe, request, model=preset, backend="stock" if config == "stock-compile" else "auto",
                      outputs=[images / f"sdpatch-{seed}.png" for seed in request.seeds], progress=False)
    report = result.report.to_dict()
    report["wall_s"] = round(time.perf_counter() - start, 2)  # the first step holds the compile
    out.write_text(json.dumps(report))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--presets", default="sd15:512,sd15:1024,sdxl:1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", help="comma-separated configurations (default: all)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each warm configuration, in alternating order")
    ap.add_argument("--worker", choices=("stock-compile", "patched-compile"), help=argparse.SUPPRESS)
    ap.add_argument("--image", help=argparse.SUPPRESS)
    args = ap.parse_args()
    presets = [(p.split(":")[0], int(p.split(":")[1])) for p in args.presets.split(",")]
    if args.worker:
        worker(args.worker, *presets[0], args.steps, Path(args.image), Path(args.json))
        return 0
    configs = [c for c in CONFIGS if not args.only or c in args.only.split(",")]
    host_before = host_probe()
    work = Path(tempfile.mkdtemp(prefix="bench_e2e-"))
    rows = []
    for preset, size in presets:
        caches: dict[str, Path] = {}
        for i in range(args.rounds):
            order = configs if i % 2 == 0 else configs[::-1]
            for config in order if i == 0 else [c for c in order if not c.endswith("-cold")]:
                row = run_config(config, preset, size, args.steps, work, caches) | {"round": i + 1}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:  # PSNR against stock eager of the same preset and size
        stock = next((r for r in rows if r["config"] == "stock" and (r["preset"], r["size"]) == (row["preset"], row["size"])
                      and "image" in r), None)
        if stock and "image" in row:
            row["psnr_vs_stock_db"] = psnr(Path(stock["image"]), Path(row["image"]))
    host = [host_before, host_probe()]
    if args.json:
        Path(args.json).write_text(json.dumps({"host_launch_us": host, "rows": rows}, indent=1))
    print("host: " + ", ".join("–" if h is None else f"{h:.2f}" for h in host)
          + " µs to enqueue a small kernel, before and after the runs (scripts/_bench.py's host_launch_us)")
    print_table(rows)
    return 0


def host_probe() -> float | None:
    """:func:`_bench.host_launch_us`, in a process of its own: this one holds no CUDA context, and
    leaves the GPU to the runs' processes."""
    run = subprocess.run([sys.executable, "-c", "from _bench import host_launch_us; print(host_launch_us())"],
                         cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=300)
    try:
        return float(run.stdout.split()[-1])
    except (ValueError, IndexError):  # no CUDA ("None"), or the probe failed
        return None


def best_runs(rows: list[dict]) -> list[dict]:
    """One row per (preset, size, config): its first working run's figures, with the best run's s/it
    and every run's in ``runs_s_per_it``, and how many runs failed (``failed_runs``)."""
    found: dict[tuple, dict] = {}
    for row in rows:
        key = (row["preset"], row["size"], row["config"])
        if key not in found or ("error" in found[key] and "error" not in row):  # the first run that worked
            earlier = found.get(key, {})
            found[key] = dict(row, runs_s_per_it=earlier.get("runs_s_per_it", []), failed_runs=earlier.get("failed_runs", 0))
        if row.get("s_per_it"):
            found[key]["runs_s_per_it"].append(row["s_per_it"])
        found[key]["failed_runs"] += "error" in row
    for row in found.values():
        runs = sorted(row["runs_s_per_it"])
        row["s_per_it"] = runs[0] if runs else None
        row["median_s_per_it"] = statistics.median(runs) if runs else None
    return list(found.values())


def print_table(rows: list[dict]) -> None:
    rows = best_runs(rows)
    print("| preset | config | s/it, best run | × stock | s/it, median run | × stock | every run's s/it | first image s/it | first step s | image s | peak alloc GiB | "
          "peak reserved GiB | × stock reserved | graph pool MiB | SDPA stand-in calls | PSNR dB | process s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        stock = next((r for r in rows if r["config"] == "stock" and (r["preset"], r["size"]) == (row["preset"], row["size"])), {})
        if "error" in row or row["s_per_it"] is None:
            print(f"| {row['preset']} {row['size']} | {row['config']} | error: {' / '.join(row.get('error', []))[-160:]} |")
            continue

        def ratio(key):
            a, b = row.get(key), stock.get(key)
            return f"{a / b:.2f}" if a and b else "–"

        gib = lambda b: f"{b / 2**30:.2f}" if b else "–"  # noqa: E731
        pool = f"{row['graph_pool'] / 2**20:.0f}" if row.get("graph_pool") else "–"
        p = row.get("psnr_vs_stock_db")
        runs = ", ".join(f"{x:.4f}" for x in row["runs_s_per_it"]) + (f" ({row['failed_runs']} failed)" if row["failed_runs"] else "")
        print(f"| {row['preset']} {row['size']}² | {row['config']} | {row['s_per_it']:.4f} | {ratio('s_per_it')} | "
              f"{row['median_s_per_it']:.4f} | {ratio('median_s_per_it')} | {runs} | "
              f"{row['cli_s_per_it']:.4f} | {row['first_step_s']:.2f} | {row['image_s']:.2f} | {gib(row['peak_allocated'])} | "
              f"{gib(row['peak_reserved'])} | {ratio('peak_reserved')} | {pool} | {row.get('stand_in_calls') or '–'} | "
              f"{'–' if p is None else ('inf' if p == math.inf else f'{p:.1f}')} | {row['process_s']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
