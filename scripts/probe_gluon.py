"""Probe: the Gluon Hopper forward (``kernels/flash_fwd_hopper.py``) against sdpatch's Triton kernel
and cuDNN, on issue 6's cases. (Needs an sm_90 GPU and triton 3.5 or later.)

    python scripts/probe_gluon.py --json probe_gluon.json

First a correctness pass over odd shapes (output and log-sum-exp against float64, whole tensors)
with two and three consumer warpgroups, each also with its grid's last tile split into pieces (as
if the GPU had one SM fewer than tiles) and in tiles of two sizes (``tile_plan``, over fewer SMs),
then kernel time by CUDA-graph replay for each tile, with the grid laid out for this GPU and in
whole tiles (``tail_split``, ``tile_plan``).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from sdpatch.kernels.flash_fwd import flash_attn_fwd
from sdpatch.kernels.flash_fwd_hopper import config_for, hopper_attn_fwd
from sdpatch.reference import attention_ref

from _bench import Case, environment, forward_baselines, grid_variants, probe_inputs, probe_row, probe_summary
from bench_kernels import CASES as BENCH_CASES

# Issue 6's self-attention cases, and SD 1.5's second level at 512 x 512.
CASES = [c for c in BENCH_CASES if c.name in ("hd40 4096", "hd40 16384", "hd80 4096", "hd160 1024", "hd64 4096", "hd64 1024")]
CASES.append(Case("hd80 1024", 2, 8, 1024, 1024, 80))
# (BLOCK_M a consumer, BLOCK_N, STAGES, CONSUMERS) per head dim; the first is config_for's.
TILES = {40: [(128, 64, 2, 2)], 64: [(64, 128, 2, 3), (64, 128, 2, 2)], 80: [(64, 128, 2, 2)], 160: [(64, 128, 2, 2)]}
# B, H, Nq, Nk, D, dtype, layout ("bnhd": diffusers' (B, N, H, D) memory)
ODD = [(1, 2, 97, 97, 40, torch.float16, "bnhd"), (2, 3, 1025, 77, 40, torch.float16, "bnhd"),
       (1, 2, 4097, 4097, 64, torch.bfloat16, "contiguous"), (2, 2, 300, 1000, 80, torch.float16, "contiguous"),
       (1, 1, 1, 1, 16, torch.float16, "contiguous"), (2, 10, 4096, 77, 64, torch.bfloat16, "bnhd"),
       (1, 2, 130, 129, 128, torch.float16, "bnhd"), (1, 2, 130, 129, 160, torch.float16, "bnhd"),
       (1, 2, 4097, 4097, 40, torch.bfloat16, "bnhd"), (2, 2, 1000, 333, 80, torch.bfloat16, "bnhd"),
       (1, 2, 300, 300, 256, torch.float16, "bnhd"), (1, 3, 700, 1500, 160, torch.float16, "bnhd"),
       (2, 3, 1000, 2000, 64, torch.float16, "bnhd")]


def check_odd(consumers: int) -> list[dict]:
    """ODD's shapes against float64 with this many consumer warpgroups (three up to head dim 128:
    above, three Q tiles and the K/V ring outgrow shared memory), in whole tiles, then in each grid
    ``grid_variants`` finds (a split last tile, tiles of two sizes)."""
    rows = []
    for B, H, Nq, Nk, D, dtype, layout in ODD:
        config = (*config_for(D)[:3], consumers)
        if consumers > 2 and D > 128:
            continue
        for grid, sms in [("whole", 0)] + grid_variants(B, H, Nq, Nk, config):
            rows.append(check_one(B, H, Nq, Nk, D, dtype, layout, config, grid, sms))
    return rows


def check_one(B, H, Nq, Nk, D, dtype, layout, config, grid: str, sms: int) -> dict:
    """One shape's output and log-sum-exp against float64, whole tensors, on this grid."""
    def r(n):
        t = torch.randn(B, n, H, D, device="cuda", dtype=dtype)
        return t.transpose(1, 2) if layout == "bnhd" else t.transpose(1, 2).contiguous()

    q, k, v = r(Nq), r(Nk), r(Nk)
    scale = 1 / math.sqrt(D)
    out, lse = hopper_attn_fwd(q, k, v, scale, return_lse=True, config=config, sms=sms)
    ref = attention_ref(q, k, v)
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    lse_ref = torch.logsumexp(s, -1) / math.log(2)
    e = ((out.double() - ref).norm() / ref.norm()).item()
    e_lse = (lse.double() - lse_ref).abs().max().item()
    ok = e < 1e-2 and e_lse < 1e-2 and out.stride() == q.stride()
    shape = f"B{B}-H{H}-N{Nq}x{Nk}-D{D}-{str(dtype)[6:]}-{layout} x{config[3]}{f' {grid} over {sms}' if sms else ''}"
    print(f"{'PASS' if ok else 'FAIL'} {shape}: rel err {e:.2e}, lse max err {e_lse:.2e}", flush=True)
    return dict(shape=shape, rel_err=e, lse_max_err=e_lse, ok=ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    odd = check_odd(2) + check_odd(3)
    rows = []
    for c in CASES:
        q, k, v, scale, flops, error_of = probe_inputs(c)

        rows.append(probe_row(c.name, "sdpatch", lambda: flash_attn_fwd(q, k, v, scale)[0], flops, error_of))
        rows += [probe_row(c.name, name, fn, flops, error_of) for name, fn in forward_baselines(q, k, v, scale).items()]
        for tile in TILES[c.D]:
            rows.append(probe_row(c.name, f"gluon {tile}", lambda tile=tile: hopper_attn_fwd(q, k, v, scale, config=tile)[0],
                                  flops, error_of))
            rows.append(probe_row(c.name, f"gluon {tile} whole", lambda tile=tile: hopper_attn_fwd(q, k, v, scale, config=tile,
                                                                                                  sms=0)[0], flops, error_of))
        del q, k, v
        torch.cuda.empty_cache()
    names = [c.name for c in CASES]
    probe_summary(rows, names, "gluon", "cudnn", None)
    probe_summary(rows, names, "gluon", "triton", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "odd": odd, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
