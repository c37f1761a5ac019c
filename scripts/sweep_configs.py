"""Time every candidate tile config of sdpatch's kernels at SD shapes, to choose the autotune lists.

    python scripts/sweep_configs.py --json sweep.json [--jobs 12]

- Forward: each candidate config at each case, with the head dim as one padded tile and as two
  parts where they differ, and with K and V tiles loaded through pointers or TMA descriptors.
- Backward: each dK/dV config with the dQ kernel's config fixed, then each dQ config with the
  dK/dV one fixed (the fixed kernel adds the same time to every row, so the ranking holds), in
  both head-dim tilings where the launcher would split.
- Kernel time only: CUDA-graph replay (``do_bench_cudagraph``), so that launch overhead, which
  every config pays alike, does not blur the ranking. Inputs are laid out as diffusers' processors
  pass them: (B, N, H, D) memory viewed as (B, H, N, D).
- Host overhead: microseconds per call of each layer (public call, launcher with its launch plan,
  fixed-config launcher, a launch through Triton's JIT, PyTorch SDPA, the backward launcher) at a
  tiny shape, where the GPU waits on the host.

Compilation dominates a cold run, so ``--jobs`` worker processes compile every variant first, into
Triton's on-disk cache, and the timing process then loads them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import multiprocessing as mp
import pstats
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

import sdpatch
from sdpatch.kernels.flash_bwd import flash_attn_bwd
from sdpatch.kernels.flash_fwd import TensorDescriptor, _attn_fwd_kernel, fwd_args, fwd_meta, kv_operands
from sdpatch.kernels.forward import flash_attn_fwd
from sdpatch.kernels.runtime import interpreting, launch_grid
from sdpatch.kernels.shared import head_dim_parts

from _bench import Case, as_config, case_tensors, chosen, environment
from bench_kernels import CASES as BENCH_CASES

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
FWD_CANDIDATES = [
    (64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
    (128, 32, 4, 3), (128, 32, 4, 4), (128, 64, 4, 3), (128, 64, 4, 4),
    (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 4, 3), (128, 128, 8, 3),
    (128, 128, 8, 2), (256, 32, 8, 3), (256, 64, 8, 3), (256, 128, 8, 2),
]
# dK/dV kernel: BLOCK_N keys per program, BLOCK_M queries per loop step. The 8-warp and 32-wide tiles
# are for the split 160 = 128 + 32 head (bwd 82 TFLOP/s, 0.57x flash): its four fp32 accumulators take
# about 160 registers a thread at 4 warps and 64 keys, where spills are likely (not yet measured).
DKDV_CANDIDATES = [
    (16, 64, 4, 3), (16, 128, 4, 3), (32, 32, 4, 3), (32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 2),
    (32, 128, 4, 3), (32, 128, 4, 5), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 4, 3),
    (64, 128, 8, 2), (64, 128, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
]
# dQ kernel: BLOCK_M queries per program, BLOCK_N keys per loop step.
DQ_CANDIDATES = [
    (32, 32, 4, 3), (64, 16, 4, 3), (64, 32, 4, 3), (64, 32, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3),
    (64, 64, 8, 2), (128, 16, 4, 3), (128, 32, 4, 3), (128, 32, 4, 5), (128, 64, 4, 3), (128, 64, 8, 2),
    (128, 64, 8, 3), (128, 128, 8, 2),
]
DKDV_FIXED, DQ_FIXED = (64, 64, 4, 2), (64, 64, 4, 2)


# The kernel benchmark's Triton cases (65,536 tokens left out: one run takes 40 ms), and two more
# sizes a 512-px SD 1.5 image runs at.
CASES = [c for c in BENCH_CASES if c.sdpatch_backend == "triton" and c.Nq <= 16384] + [
    Case("hd80 1024", 2, 8, 1024, 1024, 80),
    Case("hd160 256", 2, 8, 256, 256, 160),
]


def fwd_variants(c: Case) -> list[tuple[str, bool, bool]]:
    """(label, split head dim, K/V through TMA): both tilings where they differ, both loads where the
    GPU has TMA. (an earlier sweep measured the scale folded into exp2's FMA, +2-3 % everywhere, and another a
    lazy rescale of the accumulators, -4 to -12 %: neither is a variant any more.)"""
    tilings = [False, True] if head_dim_parts(c.D, True)[1] else [False]
    tma = TensorDescriptor is not None and (interpreting() or torch.cuda.get_device_capability()[0] >= 9)
    return [(f"{'split' if s else 'one'}{' tma' if t else ''}", s, t) for s in tilings for t in ([False, True] if tma else [False])]


def bwd_variants(c: Case) -> list[str]:
    """Both head-dim tilings where the backward launcher would split (40, 80, 160), else its one tiling."""
    return ["split", "one"] if head_dim_parts(c.D, backward=True)[1] else ["one"]


def tasks(c: Case) -> list[tuple]:
    """Every (case, kind, label, config) the sweep launches."""
    if not c.backward:
        return [(c, "fwd", label, cfg) for label, *_ in fwd_variants(c) for cfg in FWD_CANDIDATES]
    return [(c, kind, label, cfg) for label in bwd_variants(c)
            for kind, cands in (("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)) for cfg in cands]


def launcher(task, tensors):
    """A no-argument function that runs one task's kernel(s) on ``tensors``."""
    c, kind, label, cfg = task
    q, k, v = tensors[:3]
    scale = 1 / math.sqrt(c.D)
    if kind == "fwd":
        split, tma = next(var[1:] for var in fwd_variants(c) if var[0] == label)
        return lambda: flash_attn_fwd(q, k, v, scale, split_head_dim=split, config=as_config(cfg), kv_tma=tma)[0]
    do, out, lse = tensors[3:]
    pair = (as_config(cfg), as_config(DQ_FIXED)) if kind == "dkdv" else (as_config(DKDV_FIXED), as_config(cfg))
    return lambda: flash_attn_bwd(do, q, k, v, out, lse, scale, config=pair, split_head_dim=label == "split")


def _compile_worker(chunk: list[tuple]) -> list[str]:
    """Launch each task once, so that its kernel lands in Triton's on-disk cache."""
    failures, tensors = [], {}
    for task in chunk:
        c = task[0]
        if c not in tensors:
            tensors[c] = case_tensors(c)
        try:
            launcher(task, tensors[c])()
        except Exception as e:  # noqa: BLE001 (a config that cannot compile is a result)
            failures.append(f"{c.name} {task[1]} {task[2]} {task[3]}: {type(e).__name__}")
    torch.cuda.synchronize()
    return failures


def host_overhead_us(reps: int = 2000) -> dict[str, float]:
    """Microseconds of host time per call at (1, 1, 64, 40): the GPU's share is negligible."""
    q, k, v = (torch.randn(1, 64, 1, 40, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    scale = 40**-0.5
    out = torch.empty_like(q)
    cfg = as_config((64, 64, 4, 3))
    meta = fwd_meta(q, k, v, out, scale, None, False, None)
    args = fwd_args(q, k, v, None, out, None, scale, kv_operands(k, v, meta, cfg["BLOCK_N"]))
    grid = launch_grid(64, 1, 64)
    o, lse = flash_attn_fwd(q, k, v, scale, return_lse=True)
    do = torch.randn_like(q)
    # 256 keys, where TMA descriptors can carry K and V: built on the host each call.
    k2, v2 = (torch.randn(1, 256, 1, 40, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(2))
    impls = {
        "sdpatch.attention": lambda: sdpatch.attention(q, k, v),
        "flash_attn_fwd (256 keys)": lambda: flash_attn_fwd(q, k2, v2, scale),
        "flash_attn_fwd (256 keys, kv_tma=True)": lambda: flash_attn_fwd(q, k2, v2, scale, kv_tma=True),
        "flash_attn_fwd (plan)": lambda: flash_attn_fwd(q, k, v, scale),
        "flash_attn_fwd (config)": lambda: flash_attn_fwd(q, k, v, scale, config=cfg),
        "triton JIT launch": lambda: _attn_fwd_kernel[grid](*args, **meta, **cfg, EVEN_N=True),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v),
        "flash_attn_bwd": lambda: flash_attn_bwd(do, q, k, v, o, lse, scale),
    }
    result = {}
    for name, f in impls.items():
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        result[name] = (time.perf_counter() - t0) / reps * 1e6
    # Where a call's host time goes, by function (the profiler's own cost inflates the small ones).
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        sdpatch.attention(q, k, v)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue(), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--jobs", type=int, default=12, help="compile worker processes")
    ap.add_argument("--only", help='case names\' substrings, "fwd" or "bwd", comma-separated; "+" joins parts (see _bench.chosen)')
    args = ap.parse_args()
    cases = [c for c in CASES if chosen(c, args.only)]
    todo = [t for c in cases for t in tasks(c)]

    t0 = time.perf_counter()
    chunks = [todo[i :: args.jobs] for i in range(args.jobs)]
    failures = []
    if todo:  # --only none: the host-overhead figures alone
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            failures = [f for part in pool.map(_compile_worker, chunks) for f in part]
    print(f"compiled {len(todo)} variants in {time.perf_counter() - t0:.0f} s; {len(failures)} failed", flush=True)
    for f in failures:
        print("  failed:", f)

    rows, overhead = [], {}

    def save() -> None:  # after every case: a run cut off keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": environment(), "rows": rows, "host_overhead_us": overhead, "compile_failures": failures}, f, indent=1)

    for c in cases:
        tensors = case_tensors(c)
        flops = 4 * c.B * c.H * c.Nq * c.Nk * c.D
        for task in tasks(c):
            try:
                fn = launcher(task, tensors)
                fn()
                ms = do_bench_cudagraph(fn, rep=30, return_mode="median")
            except Exception as e:  # noqa: BLE001
                ms, err = None, type(e).__name__
            else:
                err = None
            rows.append({"case": c.name, "kind": task[1], "variant": task[2], "config": task[3], "ms": ms,
                         "tflops": flops / ms / 1e9 if ms and task[1] == "fwd" else None, "error": err})
        for kind in sorted({r["kind"] for r in rows if r["case"] == c.name}):
            ranked = sorted((r for r in rows if r["case"] == c.name and r["kind"] == kind and r["ms"]), key=lambda r: r["ms"])
            for r in ranked[:4]:
                tf = f"{r['tflops']:.0f} TFLOP/s" if r["tflops"] else ""
                print(f"{c.name:18s} {kind:4s} {r['variant']:13s} {r['config']} {r['ms'] * 1e3:8.1f} us {tf}", flush=True)
            for label in {r["variant"] for r in rows if r["case"] == c.name and r["kind"] == kind}:
                best = min((r for r in ranked if r["variant"] == label), key=lambda r: r["ms"], default=None)
                if best:
                    tf = f"{best['tflops']:.0f} TFLOP/s" if best["tflops"] else f"{best['ms'] * 1e3:.1f} us"
                    print(f"{'':18s} best {kind} of {label:13s} {best['config']} {tf}")
        del tensors
        torch.cuda.empty_cache()
        save()

    overhead.update(host_overhead_us())
    for name, us in overhead.items():
        print(f"host overhead {name:42s} {us:6.1f} us/call")
    save()


if __name__ == "__main__":
    main()
