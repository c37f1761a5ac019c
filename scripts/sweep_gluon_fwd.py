"""The Gluon Hopper forward (``sdpatch/kernels/flash_fwd_hopper.py``) at issue 30's forward shapes:
each candidate (BLOCK_M, BLOCK_N, STAGES, CONSUMERS) tile config's kernel time and its output
against float64, beside cuDNN's and FlashAttention-4's kernels, in one run.

    python scripts/sweep_gluon_fwd.py --json sweep_gluon_fwd.json [--only hd40]

It chose ``config_for``'s tile at head dims up to 64 (FlashAttention-3's and -4's 192 query rows,
three 64-row warpgroups, by 128 keys; docs/benchmarks.md, 2026-12-07).

Kernel time by CUDA-graph replay, TFLOP/s of 4·B·H·N²·D. Inputs laid out as diffusers' processors
pass them: (B, N, H, D) memory viewed as (B, H, N, D). Each config's grid is the one the launcher
would plan for it (tail split and mixed tiles included).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from sdpatch.attention.naive import attention_ref
from sdpatch.kernels import flash_fwd_hopper

from _bench import environment, graph_tflops, rel_err
from bench_kernels import fa4, reason

CASES = [("hd40 16384", 2, 8, 16384, 40), ("hd40 65536", 1, 8, 65536, 40), ("hd40 4096", 2, 8, 4096, 40),
         ("hd64 4096", 2, 10, 4096, 64), ("hd64 1024", 2, 20, 1024, 64)]
# (BLOCK_M rows a consumer warpgroup, BLOCK_N keys a tile, STAGES of the K/V ring, CONSUMERS). The first
# of each head dim's list is config_for's, FA4's 192 x 128 tile.
CANDIDATES = {
    40: [(64, 128, 2, 3), (128, 64, 2, 2), (64, 64, 2, 3), (64, 128, 3, 3), (128, 64, 3, 2), (64, 128, 2, 2)],
    64: [(64, 128, 2, 3), (64, 128, 3, 3), (128, 64, 2, 2), (64, 64, 2, 3)],
}
REF_HEAD_TOKENS = 16384  # the float64 check takes batch 0, head 0 on the CPU up to this length


def head_ref(q, k, v) -> torch.Tensor | None:
    """Batch 0, head 0 of the output in float64 on the CPU, or None where N² would not fit."""
    if q.shape[2] > REF_HEAD_TOKENS:
        return None
    return attention_ref(*(t[:1, :1].cpu().double() for t in (q, k, v)))


def run_case(name, B, H, N, D) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    scale = 1 / math.sqrt(D)
    flops = 4 * B * H * N * N * D
    ref = head_ref(q, k, v)
    row = {"case": name, "shape": [B, H, N, D], "configs": {}, "config_for": flash_fwd_hopper.config_for(D)}

    def err(out: torch.Tensor) -> float | None:
        return None if ref is None else rel_err(out[:1, :1].cpu(), ref)

    for cfg in CANDIDATES[D]:
        try:
            out = flash_fwd_hopper.hopper_attn_fwd(q, k, v, scale, config=cfg)[0]
            res = {"err": err(out), "nan": int(out.isnan().sum()),
                   "tflops": graph_tflops(flops, lambda: flash_fwd_hopper.hopper_attn_fwd(q, k, v, scale, config=cfg))}
        except Exception as e:  # noqa: BLE001 (a config that does not build or fit is a result)
            res = {"error": reason(e)}
        row["configs"][str(cfg)] = res
        print(name, cfg, res, flush=True)

    aten = torch.ops.aten
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    row["cudnn"] = graph_tflops(flops, lambda: aten._scaled_dot_product_cudnn_attention(qc, kc, vc, None, False, scale=scale))
    fa = fa4()
    if fa is not None:
        qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        try:
            out = fa.flash_attn_func(qf, kf, vf, softmax_scale=scale)[0].transpose(1, 2)
            row["fa4_err"] = err(out)
            row["fa4"] = graph_tflops(flops, lambda: fa.flash_attn_func(qf, kf, vf, softmax_scale=scale))
        except Exception as e:  # noqa: BLE001 (CuTe DSL raises its own types)
            row["fa4"] = None
            row["fa4_error"] = reason(e)
    print(name, {k: v for k, v in row.items() if k != "configs"}, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated substrings of the case names")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows = [run_case(*c) for c in CASES if not args.only or any(t in c[0] for t in args.only.split(","))]
    print("\n| case | config (BLOCK_M, BLOCK_N, STAGES, CONSUMERS) | TFLOP/s | × config_for's | × cuDNN | × FA4 | rel err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = r["configs"].get(str(tuple(r["config_for"])), {}).get("tflops")
        for cfg, res in r["configs"].items():
            t = res.get("tflops")
            if t is None:
                print(f"| {r['case']} | {cfg} | {res.get('error')} | | | | |")
                continue
            ratios = [f"{t / b:.2f}" if b else "–" for b in (base, r.get("cudnn"), r.get("fa4"))]
            e = res["err"]
            print(f"| {r['case']} | {cfg} | {t:.0f} | {' | '.join(ratios)} | {'–' if e is None else f'{e:.1e}'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
