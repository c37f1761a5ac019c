"""Probe: where the Gluon forward's per-call time goes beyond its kernel time, by waves.
(Needs an sm_90 GPU and triton 3.5 or later.)

    python scripts/probe_waves.py --json probe_waves.json

hd64 self-attention at 1152 tokens (six whole tiles of 3 x 64 rows a head) on grids of 1 to 4 waves
of 132 tiles (B 2, H 11 to 44), against cuDNN: time per call (``do_bench``, L2 flushed before each
call, median of ABBA rounds) and kernel time (CUDA-graph replay). A per-call excess that grows with
the waves is paid per program (its prologue: Q and the first K/V tiles from memory); one that stays
flat is paid per launch.
"""

from __future__ import annotations

import torch
from triton.testing import do_bench_cudagraph

from sdpatch.kernels.flash_fwd import flash_attn_fwd
from sdpatch.kernels.flash_fwd_hopper import config_for

from _bench import abba_call_us, forward_baselines, probe_rows_out, probe_start, show_row

ROUNDS = 4


def main() -> None:
    args = probe_start(__doc__)
    block_m, _, _, consumers = config_for(64)
    rows = []
    for B, H, N in [(2, 11, 1152), (2, 22, 1152), (2, 33, 1152), (2, 44, 1152), (2, 20, 1024)]:
        q, k, v = (torch.randn(B, N, H, 64, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
        fns = {"sdpatch": lambda: flash_attn_fwd(q, k, v, 0.125)[0], "cudnn": forward_baselines(q, k, v, 0.125)["cudnn"]}
        ref = fns["cudnn"]()
        assert ((fns["sdpatch"]().float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
        calls = abba_call_us(fns, ROUNDS)
        row = dict(B=B, H=H, N=N, tiles=B * H * -(-N // (block_m * consumers)))
        for name, fn in fns.items():
            row[f"{name} call us"] = calls[name]
            row[f"{name} graph us"] = 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")
        rows.append(row)
        show_row(row)
        del q, k, v
    probe_rows_out(rows, args.json)


if __name__ == "__main__":
    main()
