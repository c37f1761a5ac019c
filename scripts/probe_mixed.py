"""Probe: the Gluon forward on grids of two tile sizes (``tile_plan``) against whole tiles and cuDNN.
(Needs an sm_90 GPU and triton 3.5 or later.)

    python scripts/probe_mixed.py --json probe_mixed.json

hd64 self-attention, fp16, diffusers' (B, N, H, D) layout, where this GPU's plan mixes tiles (SDXL's
1024 tokens among them) and two controls that it leaves alone. For each: kernel time (CUDA-graph
replay) as planned, in whole tiles (``sms=0``) and on cuDNN, with the plan's modelled gain beside
the measured one; then time per call (``do_bench``, L2 flushed before each call, median of ABBA
rounds) for default calls and cuDNN's, and the relative error of each against float64 on one head.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench, do_bench_cudagraph

from sdpatch.kernels import native
from sdpatch.kernels.flash_fwd import flash_attn_fwd
from sdpatch.kernels.flash_fwd_hopper import _head_costs, _makespan, config_for, hopper_attn_fwd, sm_count, tile_plan
from sdpatch.reference import attention_ref

from _bench import environment, forward_baselines, rel_err

ROUNDS = 6
CASES = [(2, 20, 1024), (2, 10, 2048), (2, 20, 768), (2, 20, 1152), (2, 10, 4096)]  # B, H, N


def model_time(plan, heads: int, n: int, sms: int) -> float:
    """The plan's makespan in whole tiles' time, as ``tile_plan`` models it."""
    block_m, _, _, consumers = config_for(64)
    heads1, big1, small1, big2, small2 = plan
    (b1, s1), (b2, s2) = (_head_costs(n, block_m, consumers, *kind) for kind in ((big1, small1), (big2, small2)))
    return _makespan(b1 * heads1 + b2 * (heads - heads1) + s1 * heads1 + s2 * (heads - heads1), sms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    native.wait()
    torch.manual_seed(0)
    sms = sm_count(0)
    block_m, _, _, consumers = config_for(64)
    rows = []
    for B, H, N in CASES:
        q, k, v = (torch.randn(B, N, H, 64, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
        ref = attention_ref(q[:1, :1], k[:1, :1], v[:1, :1])
        plan = tile_plan(B * H, N, sms, block_m, consumers)
        whole = (B * H, -(-N // (block_m * consumers)), 0, 0, 0)
        fns = {"sdpatch": lambda: flash_attn_fwd(q, k, v, 0.125)[0], "cudnn": forward_baselines(q, k, v, 0.125)["cudnn"]}
        graph = {**fns, "whole": lambda: hopper_attn_fwd(q, k, v, 0.125, sms=0)[0]}
        row = dict(B=B, H=H, N=N, plan=plan, model_gain=model_time(whole, B * H, N, sms) / model_time(plan, B * H, N, sms))
        for name, fn in graph.items():
            row[f"{name} rel err"] = rel_err(fn()[:1, :1], ref)
            row[f"{name} graph us"] = 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")
        row["measured_gain"] = row["whole graph us"] / row["sdpatch graph us"]
        calls = {name: [] for name in fns}
        for r in range(ROUNDS):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                calls[name].append(1e3 * do_bench(fns[name], warmup=10, rep=60, return_mode="median"))
        for name in fns:
            row[f"{name} call us"] = sorted(calls[name])[ROUNDS // 2]
        row["x cudnn call"] = row["cudnn call us"] / row["sdpatch call us"]
        row["x cudnn graph"] = row["cudnn graph us"] / row["sdpatch graph us"]
        rows.append(row)
        print(" | ".join(f"{key} {val:.3g}" if isinstance(val, float) else f"{key} {val}" for key, val in row.items()), flush=True)
        del q, k, v
    print(environment())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
