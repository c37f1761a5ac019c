"""Host time per attention call, sdpatch against PyTorch's SDPA (needs a CUDA GPU for its figures).

    python scripts/bench_host.py --json bench_host.json

A training step of SD 1.5 at 512² is host-bound on the lent H200s (the host takes ~120 ms to enqueue
~62 ms of kernels), so every microsecond a layer's attention costs the host shows in the step. At
small shapes the GPU waits on the host, and the wall time of a long run of calls without
synchronizing is the host's time per call. For each case, forward alone (no gradient) and forward
plus backward (inputs that require grad, as in training): best and median of 5 runs of ``ITERS``
calls, then the top of a cProfile of sdpatch's forward plus backward, to show where its time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import sdpatch

from _bench import Case, environment

CASES = [Case("self 256", 2, 8, 256, 256, 40), Case("cross 256x77", 2, 8, 256, 77, 40)]
ITERS = 200


def calls(c: Case, device: str) -> dict:
    """{name: zero-argument call} on q, k, v laid out as diffusers' processors pass them."""
    def heads(n):  # (B, N, H*D) projections viewed as (B, H, N, D)
        return torch.randn(c.B, n, c.H * c.D, device=device, dtype=torch.float16).view(c.B, n, c.H, c.D).transpose(1, 2)

    q, k, v = (heads(n).requires_grad_() for n in (c.Nq, c.Nk, c.Nk))
    do = heads(c.Nq)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    return {
        "sdpatch fwd": lambda: sdpatch.attention(qd, kd, vd, backend="triton"),
        "sdpa fwd": lambda: F.scaled_dot_product_attention(qd, kd, vd),
        "sdpatch fwd+bwd": lambda: sdpatch.attention(q, k, v, backend="triton").backward(do),
        "sdpa fwd+bwd": lambda: F.scaled_dot_product_attention(q, k, v).backward(do),
    }


def host_us(fn, iters: int, device: str) -> list[float]:
    """us per call of 5 runs of ``iters`` unsynchronized calls, after a warm-up."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(min(iters, 20)):
        fn()
    sync()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t) / iters * 1e6)
        sync()
    return runs


def profile_top(fn, iters: int, lines: int = 15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


def main(device: str = "cuda", iters: int = ITERS, json_path: str | None = None, cases: list[Case] = CASES) -> list[dict]:
    rows = []
    for c in cases:
        fns = calls(c, device)
        for name, fn in fns.items():
            runs = host_us(fn, iters, device)
            rows.append(dict(case=c.name, impl=name, best_us=min(runs), median_us=statistics.median(runs)))
            print(f"{c.name:14s} {name:16s} host us/call: best {min(runs):6.0f}  median {statistics.median(runs):6.0f}", flush=True)
        print(profile_top(fns["sdpatch fwd+bwd"], iters), flush=True)
    print(environment())
    print("| case | call | sdpatch us | SDPA us | difference us |")
    print("|---|---|---|---|---|")
    best = {(r["case"], r["impl"]): r["best_us"] for r in rows}
    for c in cases:
        for part in ("fwd", "fwd+bwd"):
            ours, theirs = best[c.name, f"sdpatch {part}"], best[c.name, f"sdpa {part}"]
            print(f"| {c.name} | {part} | {ours:.0f} | {theirs:.0f} | {ours - theirs:+.0f} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    main(json_path=ap.parse_args().json)
