"""The Gluon Hopper backward kernels (``sdpatch/kernels/flash_bwd_hopper.py``) at the backward's SD
shapes: each candidate tile config's kernel time and gradients against float64 (the one-pass kernel,
the dK/dV and dQ kernels), beside the whole backward on the Triton kernels' two passes, on the
one-pass path, on the Gluon dK/dV path, and cuDNN's, in one run.

    python scripts/sweep_gluon_bwd.py --json sweep_gluon_bwd.json [--only hd64]

Kernel time by CUDA-graph replay; TFLOP/s count the backward's 2.5x the forward's 4·B·H·N²·D, the
dK/dV kernel's share of it 4/7 (four of the two passes' seven products), the dQ kernel's 3/7. Inputs
are laid out as diffusers' processors pass them: (B, N, H, D) memory viewed as (B, H, N, D).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from sdpatch.attention.naive import attention_ref
from sdpatch.kernels import flash_bwd, flash_bwd_hopper
from sdpatch.kernels.flash_bwd import flash_attn_bwd
from sdpatch.kernels.forward import flash_attn_fwd
from sdpatch.kernels.runtime import on_device

from _bench import environment, graph_tflops, rel_err

CASES = [("hd40 1000", 1, 3, 1000, 40),  # key and query tiles that end inside a block
         ("hd40 4096", 2, 8, 4096, 40), ("hd40 16384", 2, 8, 16384, 40), ("hd64 4096", 2, 10, 4096, 64),
         ("hd80 4096", 2, 8, 4096, 80), ("hd64 1024", 2, 20, 1024, 64), ("hd128 4096", 2, 8, 4096, 128)]
# (BLOCK_M, BLOCK_N, STAGES, CONSUMERS) (flash_bwd_hopper.config_for). On 2026-12-06 (H100) 128-query
# steps and three consumers, which spill, ran at 0.55-0.85x two consumers of 64 x 64, and a loop that
# issued tile i+1's S^T and dP^T behind tile i's dV and dK at 0.80-0.82x the plain one.
CANDIDATES = [(64, 64, 2, 2), (64, 64, 3, 2)]
# The one-pass kernel's (flash_bwd_hopper.fused_config_for), head dims up to 64: at 80 its padded
# 128-wide tiles spill (ptxas, sm_90a) and fill the shared memory.
FUSED_CANDIDATES = [(64, 64, 2, 2), (64, 64, 3, 2)]
# ... each with S^T's and dP^T's MMAs over the padded head dim (the default), and the first also over
# flash_bwd_hopper.mma_k's columns where fewer (48 at head dim 40).
FUSED_MAX_HEAD_DIM = 64
# The dQ kernel's (BLOCK_M queries a consumer owns, BLOCK_N keys a step, STAGES, CONSUMERS).
DQ_CANDIDATES = [(64, 64, 2, 2), (64, 128, 2, 2), (64, 64, 3, 2), (64, 128, 3, 2)]


def head_ref(q, k, v, do):
    """dQ, dK and dV of batch 0, head 0, in float64 on the CPU, out of reach of any stray GPU write."""
    q64, k64, v64 = (t[:1, :1].cpu().double().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(attention_ref(q64, k64, v64), (q64, k64, v64), do[:1, :1].cpu().double())


GUARD = 1 << 16  # elements of canary on each side of a guarded output
CANARY = 1234.0  # exact in fp16 and fp32, and no gradient here comes near it


def guarded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An uninitialized tensor laid out as ``t`` (same strides), inside a buffer whose GUARD
    elements before and after it hold CANARY; the buffer, for :func:`strays`."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    buf = torch.full((span + 2 * GUARD,), CANARY, device=t.device, dtype=t.dtype)
    buf[GUARD:GUARD + span] = float("nan")  # what the kernel must overwrite: poison, not zeros
    return buf.as_strided(t.shape, t.stride(), GUARD), buf


def strays(buf: torch.Tensor) -> int:
    """Canary elements a kernel overwrote: writes out of its output's bounds."""
    return int((buf[:GUARD] != CANARY).sum() + (buf[-GUARD:] != CANARY).sum())


def launcher(q: torch.Tensor, *launches):
    """A function that runs these ``(kernel, grid, args, constexprs)`` launches, in order."""
    def run():
        with on_device(q):
            for kernel, grid, args, consts in launches:
                kernel[grid](*args, **consts)
    return run


def run_case(name, B, H, N, D) -> dict:
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(4))
    scale = 1 / math.sqrt(D)
    flops = 2.5 * 4 * B * H * N * N * D
    out, lse = flash_attn_fwd(q, k, v, scale, return_lse=True)
    # The kernels read delta and lse as contiguous (B, H, N): a product of (B, N, H, D) views sums
    # into another layout, so make it explicit (and record what the layouts were).
    raw_delta = (do.float() * out.float()).sum(-1)
    delta = raw_delta.contiguous()
    ref = head_ref(q, k, v, do) if N * N <= 2**28 else None
    row = {"case": name, "shape": [B, H, N, D], "configs": {},
           "strides": {"q": q.stride(), "out": out.stride(), "lse": lse.stride(), "raw_delta": raw_delta.stride()}}
    if ref is not None:
        row["ref_norms"] = [r.norm().item() for r in ref]
        row["ref_finite"] = [bool(r.isfinite().all()) for r in ref]

    def head(t):
        return t[:1, :1].cpu()

    def check(names, outs, bufs=None) -> dict:
        """Each output's error against float64 (batch 0, head 0), NaNs left anywhere (elements
        never written) and canaries overwritten (writes out of bounds)."""
        res = {}
        for i, (n, t) in enumerate(zip(names, outs)):
            res[n] = {"err": None if ref is None else rel_err(head(t), ref["qkv".index(n[1])]),
                      "nan": int(t.isnan().sum()), "strays": None if bufs is None else strays(bufs[i])}
        return res

    def try_config(key, share, *launches, results) -> None:
        """One config's kernel time (its ``share`` of the backward's FLOPs) and ``results()``, or
        the error it raised: a config that does not build is a result."""
        try:
            row["configs"][key] = {"tflops": graph_tflops(flops * share, launcher(q, *launches)), **results()}
        except Exception as e:  # noqa: BLE001
            row["configs"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(name, key, row["configs"][key], flush=True)

    for cfg in DQ_CANDIDATES:
        (dq, bq), dl = guarded(q), torch.empty_like(delta)
        try_config("dq " + str(cfg), 3 / 7, flash_bwd_hopper.dq_launch(q, k, v, do, out, dq, lse, dl, scale, cfg),
                   results=lambda: {"delta_err": rel_err(dl, delta), **check(["dq"], [dq], [bq])})

    for cfg in CANDIDATES:
        (dk, bk), (dv, bv) = guarded(k), guarded(v)
        try_config(str(cfg), 4 / 7, flash_bwd_hopper.dkdv_launch(q, k, v, do, dk, dv, lse, delta, scale, cfg),
                   results=lambda: check(["dk", "dv"], [dk, dv], [bk, bv]))

    narrow = flash_bwd_hopper.mma_k(D)
    fused = [(cfg, None) for cfg in FUSED_CANDIDATES]
    fused += [(FUSED_CANDIDATES[0], narrow)] if narrow < flash_bwd_hopper.padded(D) else []
    for cfg, reduce_k in fused if D <= FUSED_MAX_HEAD_DIM else []:
        (dq, bq), (dk, bk), (dv, bv) = guarded(q), guarded(k), guarded(v)
        try_config("one pass " + str(cfg) + (f" K{reduce_k}" if reduce_k else ""), 1,
                   *flash_bwd_hopper.fused_launches(q, k, v, do, out, dq, dk, dv, lse, scale, cfg, reduce_k=reduce_k),
                   results=lambda: check(["dq", "dk", "dv"], [dq, dk, dv], [bq, bk, bv]))

    (dq, bq), (dk, bk), (dv, bv), dl = guarded(q), guarded(k), guarded(v), torch.empty_like(delta)
    row["all_gluon"] = graph_tflops(flops, launcher(q, flash_bwd_hopper.dq_launch(q, k, v, do, out, dq, lse, dl, scale),
                                              flash_bwd_hopper.dkdv_launch(q, k, v, do, dk, dv, lse, dl, scale)))
    row["all_gluon_check"] = check(["dq", "dk", "dv"], [dq, dk, dv], [bq, bk, bv])
    saved = flash_bwd_hopper.ENABLED, flash_bwd_hopper.ONE_PASS

    def path(name: str, enabled: bool, one_pass: bool):
        """The whole backward (flash_attn_bwd) with the Gluon kernels it may take so set: its kernel
        time, its gradients' check, whether a Gluon kernel served; returns the gradients."""
        flash_bwd_hopper.ENABLED, flash_bwd_hopper.ONE_PASS = enabled, one_pass
        flash_bwd._bwd_plans.clear()
        row[name] = graph_tflops(flops, lambda: flash_attn_bwd(do, q, k, v, out, lse, scale))
        g = flash_attn_bwd(do, q, k, v, out, lse, scale)
        row[name + "_check"] = check(["dq", "dk", "dv"], g)
        row[name + "_served"] = (flash_bwd_hopper.one_pass_serves if one_pass else flash_bwd_hopper.serves)(q, k, v, do, None)
        return g

    path("one_pass_path", False, True)
    path("gluon_path", True, False)
    t = path("two_pass", False, False)
    row["gluon_vs_two_pass"] = {n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), t)}
    flash_bwd_hopper.ENABLED, flash_bwd_hopper.ONE_PASS = saved
    flash_bwd._bwd_plans.clear()
    aten = torch.ops.aten
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    o, lse_c, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(qc, kc, vc, None, True, scale=scale)
    doc = do.contiguous()
    row["cudnn"] = graph_tflops(flops, lambda: aten._scaled_dot_product_cudnn_attention_backward(
        doc, qc, kc, vc, o, lse_c, seed, offset, None, cq, ck, mq, mk, 0.0, False, scale=scale))
    print(name, {k: v for k, v in row.items() if k != "configs"}, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--only", help="case names' substrings, comma-separated")
    args = ap.parse_args()
    rows = []
    for case in CASES:
        if args.only and not any(s in case[0] for s in args.only.split(",")):
            continue
        rows.append(run_case(*case))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": environment(), "rows": rows}, f, indent=1)
    print("| case | two pass | one-pass path | Gluon dK/dV path | both Gluon | cuDNN | "
          + " | ".join([f"one pass {c}" for c in FUSED_CANDIDATES] + [f"dK/dV {c}" for c in CANDIDATES]
                       + [f"dQ {c}" for c in DQ_CANDIDATES]) + " |")
    for r in rows:
        cells = [f"{r['configs'].get('one pass ' + str(c), {}).get('tflops', 0):.0f}" for c in FUSED_CANDIDATES]
        cells[0] += "".join(f" ({v.get('tflops', 0):.0f} K{k.split(' K')[1]})" for k, v in r["configs"].items()
                            if k.startswith("one pass") and " K" in k)
        cells += [f"{r['configs'][str(c)].get('tflops', 0):.0f}" for c in CANDIDATES]
        cells += [f"{r['configs']['dq ' + str(c)].get('tflops', 0):.0f}" for c in DQ_CANDIDATES]
        one_pass = f"{r['one_pass_path']:.0f}" + ("" if r["one_pass_path_served"] else " (not served)")
        print(f"| {r['case']} | {r['two_pass']:.0f} | {one_pass} | {r['gluon_path']:.0f} | {r['all_gluon']:.0f} | "
              f"{r['cudnn']:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
