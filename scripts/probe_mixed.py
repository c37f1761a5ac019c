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

import torch
from triton.testing import do_bench_cudagraph

from sdpatch.kernels.flash_fwd import flash_attn_fwd
from sdpatch.kernels.flash_fwd_hopper import config_for, hopper_attn_fwd, plan_time, sm_count, tile_plan
from sdpatch.reference import attention_ref

from _bench import abba_call_us, forward_baselines, probe_rows_out, probe_start, rel_err, show_row

ROUNDS = 6
CASES = [(2, 20, 1024), (2, 10, 2048), (2, 20, 768), (2, 20, 1152), (2, 10, 4096)]  # B, H, N


def main() -> None:
    args = probe_start(__doc__)
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
        model = [plan_time(p, B * H, N, sms, block_m, consumers) for p in (whole, plan)]
        row = dict(B=B, H=H, N=N, plan=plan, model_gain=model[0] / model[1])
        for name, fn in graph.items():
            row[f"{name} rel err"] = rel_err(fn()[:1, :1], ref)
            row[f"{name} graph us"] = 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")
        row["measured_gain"] = row["whole graph us"] / row["sdpatch graph us"]
        for name, us in abba_call_us(fns, ROUNDS).items():
            row[f"{name} call us"] = us
        row["x cudnn call"] = row["cudnn call us"] / row["sdpatch call us"]
        row["x cudnn graph"] = row["cudnn graph us"] / row["sdpatch graph us"]
        rows.append(row)
        show_row(row, ".3g")
        del q, k, v
    probe_rows_out(rows, args.json)


if __name__ == "__main__":
    main()
