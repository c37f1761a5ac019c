"""`torch.compile` choices per UNet call (no grad, batch 2 as with guidance, fp16), each in fresh processes.

    python scripts/bench_compile.py --json bench_compile.json [--presets sd15:512,sdxl:1024]
                                    [--only stock-ro,...] [--runs cold,warm]

Configurations:

- ``stock-ro``: the stock UNet under ``torch.compile(mode="reduce-overhead")``, whole: the anchor a
  user picks for speed;
- ``patched-ro``: sdpatch's patched UNet compiled the same way (its attention an opaque custom op);
- ``graphs``: the patched UNet under sdpatch's CUDA graphs, nothing compiled;
- ``regional``: ``--compile``, :func:`sdpatch.speed.compile_blocks` under sdpatch's graphs;
- ``transformer-blocks``: diffusers' ``compile_repeated_blocks(fullgraph=True)`` (its
  ``_repeated_blocks``, the transformer blocks alone, dynamo's default shapes) under sdpatch's graphs.

Each runs first with empty inductor and Triton caches (``cold``), then again in a new process with
the caches that run left (``warm``). Per run: the seconds until the call is steady (the first calls,
which trace, compile, record or capture), the steady call's time (CUDA events over 30 back-to-back
calls, best of 3) and its ratio to ``stock-ro``'s in the same call, relative error against the eager
UNet (stock's for ``stock-ro``, the patched one's otherwise), and peak reserved. sdpatch's graphs
capture again once the kernels compiled in the background are done: the script waits for them
before timing, so that the timed calls are sdpatch's kernels, not their SDPA stand-ins.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("stock-ro", "patched-ro", "graphs", "regional", "transformer-blocks")
FIRST_CALLS = 4  # past every configuration's tracing, compiling, recording and capture
WORKER_TIMEOUT_S = 420


def worker(config: str, preset: str, size: int) -> dict:
    import torch

    from _bench import rel_err, settle_graphs, timed_ms, unet_inputs
    from sdpatch import graphs, speed
    from sdpatch.generate import apply_backend
    from sdpatch.models import build_preset

    torch.cuda.set_device(0)
    pipe = build_preset(preset, device="cuda", dtype=torch.float16)
    unet = pipe.unet
    kw = unet_inputs(unet, 2, size, torch.float16)
    if config != "stock-ro":
        apply_backend(pipe, "auto")
    with torch.no_grad():
        ref = unet(**kw).sample
        graphs.wait_for_kernels()  # the reference's new layouts compiled in the background, SDPA standing in
        ref = unet(**kw).sample
        call = unet
        if config.endswith("-ro"):
            call = torch.compile(unet, mode="reduce-overhead")
        elif config == "regional":
            speed.compile_blocks(unet)
        elif config == "transformer-blocks":
            speed.use_caches()
            unet.compile_repeated_blocks(fullgraph=True)
        if not config.endswith("-ro"):
            graphs.capture(unet)
        start = time.perf_counter()
        first_calls = []
        for _ in range(FIRST_CALLS):
            s = time.perf_counter()
            call(**kw)
            torch.cuda.synchronize()
            first_calls.append(round(time.perf_counter() - s, 3))
        steady_after = time.perf_counter() - start
        waited = settle_graphs(lambda: call(**kw)) if not config.endswith("-ro") else 0.0
        err = rel_err(call(**kw).sample, ref)
        ms = min(timed_ms(lambda: call(**kw), calls=30) for _ in range(3))
    runner = graphs.runner_of(unet)
    return {"steady_after_s": round(steady_after, 2), "first_calls_s": first_calls, "waited_for_kernels_s": round(waited, 2),
            "ms_per_call": round(ms, 3), "rel_err": err, "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
            "graph_stats": runner.stats.to_dict() if runner else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--presets", default="sd15:512")
    ap.add_argument("--only", help="comma-separated configurations (default: all)")
    ap.add_argument("--runs", default="cold,warm", help="cold, warm or both")
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    presets = [(p.split(":")[0], int(p.split(":")[1])) for p in args.presets.split(",")]
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, *presets[0])), flush=True)
        return 0
    configs = [c for c in CONFIGS if not args.only or c in args.only.split(",")]
    rows = []
    for preset, size in presets:
        for config in configs:
            cache = Path(tempfile.mkdtemp(prefix=f"bench_compile-{config}-"))
            env = dict(os.environ, TRITON_CACHE_DIR=str(cache / "triton"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                       HF_HUB_OFFLINE="1")
            for run in args.runs.split(","):
                start = time.perf_counter()
                proc = subprocess.run([sys.executable, __file__, "--worker", config, "--presets", f"{preset}:{size}"],
                                      env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
                row = {"preset": preset, "size": size, "config": config, "run": run, "process_s": round(time.perf_counter() - start, 1)}
                found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if found:
                    row |= json.loads(found[-1][len("RESULT "):])
                else:
                    row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\n| preset | config | run | ms per call | × stock-ro | steady after s | process s | rel err | peak reserved GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        anchors = [a for a in rows if a["config"] == "stock-ro" and (a["preset"], a["size"]) == (r["preset"], r["size"])
                   and "ms_per_call" in a]
        anchor = next((a["ms_per_call"] for a in sorted(anchors, key=lambda a: a["run"] != r["run"])), None)  # same run first
        if "error" in r:
            print(f"| {r['preset']} {r['size']}² | {r['config']} | {r['run']} | failed: {r['error'][-1]} | | | | | |")
            continue
        ratio = f"{r['ms_per_call'] / anchor:.2f}" if anchor else "–"
        print(f"| {r['preset']} {r['size']}² | {r['config']} | {r['run']} | {r['ms_per_call']:.2f} | {ratio} | "
              f"{r['steady_after_s']:.1f} | {r['process_s']:.0f} | {r['rel_err']:.1e} | {r['peak_reserved_gib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
