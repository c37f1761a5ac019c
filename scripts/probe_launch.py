"""Probe: what a launch of the Gluon Hopper forward costs per call, by launch path, against cuDNN
and the Triton kernel, on issue 6's forward cases. (Needs an sm_90 GPU and triton 3.5 or later.)

    python scripts/probe_launch.py --json probe_launch.json

The Gluon kernel is timed through the JIT (``hopper_attn_fwd``), straight to its binary (the
native path off), and natively (C++ encodes the TMA descriptors), each serving every case here
whatever :func:`flash_fwd_hopper.serves` would say. Per implementation: the relative error against
float64, the median time per call (``do_bench``: host time shows where it exceeds the kernel's),
and the host time per call, from 50 calls queued without a sync.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

from sdpatch.kernels import flash_fwd, flash_fwd_hopper, native
from sdpatch.kernels.flash_fwd import flash_attn_fwd
from sdpatch.kernels.flash_fwd_hopper import hopper_attn_fwd

from _bench import Case, chosen, environment, forward_baselines, probe_inputs
from bench_kernels import CASES as BENCH_CASES

CASES = [c for c in BENCH_CASES if not c.backward and c.sdpatch_backend == "triton" and c.Nq <= 16384]
CASES += [Case("hd80 1024", 2, 8, 1024, 1024, 80), Case("hd160 256", 2, 8, 256, 256, 160)]  # SD 1.5 at 512 x 512
HOST_CALLS = 50


def host_us(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--only", help="cases, as bench_kernels.py --only")
    args = ap.parse_args()
    assert native.wait(), "the native module did not build"
    # Every case here goes to the Gluon kernel when it is on: the probe decides where it should.
    flash_fwd_hopper.MIN_KEYS, flash_fwd_hopper.MIN_PROGRAMS = 0, 0
    rows = []
    for c in CASES:
        if not chosen(c, args.only):
            continue
        q, k, v, scale, flops, error_of = probe_inputs(c)

        def gluon_binary():
            with native.enabled(False):
                return flash_attn_fwd(q, k, v, scale)[0]

        impls = {**forward_baselines(q, k, v, scale), "gluon jit": lambda: hopper_attn_fwd(q, k, v, scale)[0],
                 "gluon binary": gluon_binary, "gluon native": lambda: flash_attn_fwd(q, k, v, scale)[0]}
        for name, fn in impls.items():
            row = dict(case=c.name, impl=name)
            try:
                for _ in range(3):  # compile, record, then replay
                    out = fn()
                row["rel_err"] = error_of(out)
                hits = flash_fwd._native_fwd.hits
                row["ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
                row["native_calls"] = flash_fwd._native_fwd.hits - hits
                row["tflops"] = flops / row["ms"] / 1e9
                row["host_us"] = host_us(fn)
            except Exception as e:  # noqa: BLE001 - recorded, not raised
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            print(f"{c.name:16s} {name:13s} " + (row.get("error") or
                  f"{row['tflops']:6.0f} TFLOP/s {row['ms'] * 1e3:8.1f} us/call  host {row['host_us']:6.1f} us  "
                  f"rel err {row['rel_err']:.1e}  native calls {row['native_calls']}"), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    print(environment())
    print("| case | cuDNN | Triton kernel | Gluon JIT | Gluon binary | Gluon native | native × cuDNN | native × Triton |")
    print("|---|---|---|---|---|---|---|---|")
    for c in CASES:
        got = {r["impl"]: r.get("tflops") for r in rows if r["case"] == c.name}
        if not got:
            continue
        cell = lambda x: "–" if x is None else f"{x:.0f}"  # noqa: E731
        ratio = lambda a, b: "–" if not (a and b) else f"{a / b:.2f}"  # noqa: E731
        print(f"| {c.name} | " + " | ".join(cell(got.get(n)) for n in ("cudnn", "triton", "gluon jit", "gluon binary", "gluon native"))
              + f" | {ratio(got.get('gluon native'), got.get('cudnn'))} | {ratio(got.get('gluon native'), got.get('triton'))} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
