"""One UNet training step, stock diffusers (SDPA) vs sdpatch (needs a CUDA GPU).

    python scripts/bench_train_step.py --json bench_train.json

SD 1.5-architecture UNet with random fp32 weights, fp16 autocast, batch 4, at 512² and 768²,
gradient checkpointing off and on; sdpatch as patched by default, and with its attention layers
recomputed in the backward (``recompute=True``). A step is forward, MSE loss against noise, and backward
(the optimizer's memory does not depend on attention, so it is left out). Reports peak memory
over the weights, as the caching allocator's blocks, as the tensors' requested bytes and as the
segments reserved from the driver (``_bench.peaks_over``), each variant measured twice in ABBA order
from an emptied cache, median ms per step, and the time ratio to stock as the median (and
quartiles) of the ratios of rounds run side by side: blocks of three steps of each variant in turn,
in ABBA order (``_bench.alternating_times``), so that host load from elsewhere reaches both alike
(the lent hosts' load moved the same stock step by half between calls). Then conv_in's gradient
(every layer's gradient flows into it) against stock's and against an fp32 step without autocast:
fp16 rounding through a random-weight UNet moves that gradient by percents, so the fp32 figures say
whether sdpatch's gradient is any further from the exact one than stock's is.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from _bench import (alternating_times, environment, paired_ratio, peaks_over, rel_err, train_step, training_unet, unet_inputs,
                    use_variant, warm_up_step)

SIZES = [512, 768]
BATCH = 4
# "auto recompute": patch_unet(recompute=True), each attention layer recomputed in the backward.
VARIANTS = ("stock", "auto", "auto recompute")
# Rounds per configuration: 9 gave ratio quartiles 0.90-1.26 wide on a lent host; the
# median of 19 moves about a third less.
ROUNDS = 19


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, starting with stock (default: {','.join(VARIANTS)})")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds per configuration (default {ROUNDS})")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated image sizes")
    ap.add_argument("--checkpointing", default="off,on", help="gradient checkpointing: off, on, or both (off,on)")
    args = ap.parse_args()
    variants = tuple(args.variants.split(","))
    assert variants[0] == "stock", "the ratios and gradient errors are against stock: list it first"
    unet = training_unet()
    rows = []
    for size in map(int, args.sizes.split(",")):
        kw = unet_inputs(unet, BATCH, size, torch.float32)
        target = torch.randn_like(kw["sample"])
        step = train_step(unet, kw, target)

        use_variant(unet, "stock")
        unet.disable_gradient_checkpointing()
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False  # convolutions in TF32 would round like fp16
        train_step(unet, kw, target, autocast=False)()
        torch.backends.cudnn.allow_tf32 = tf32
        exact = unet.conv_in.weight.grad.detach().clone()
        for checkpointing in (c == "on" for c in args.checkpointing.split(",")):
            if checkpointing:
                unet.enable_gradient_checkpointing()
            else:
                unet.disable_gradient_checkpointing()
            found = {v: dict(peaks=[]) for v in variants}
            for variant in (*variants, *reversed(variants)):  # ABBA: each variant's peak twice, after either
                use_variant(unet, variant)
                warm_up_step(step, unet)
                _, peaks = peaks_over(step)
                found[variant]["peaks"].append(peaks)
                found[variant]["grad"] = unet.conv_in.weight.grad.detach().clone()
            times = alternating_times(unet, variants, step, rounds=args.rounds)
            stock = found["stock"]
            for variant, f in found.items():
                ratio, q1, q3 = paired_ratio(times[variant], times["stock"])
                # The larger of the two measurements of each figure: the step needs that much.
                peak = {k: max(p[k] for p in f["peaks"]) / 2**20 for k in f["peaks"][0]}
                row = dict(size=size, checkpointing=checkpointing, variant=variant, peak_mib=peak["allocated"],
                           requested_peak_mib=peak["requested"], reserved_peak_mib=peak["reserved"],
                           peaks_mib=[{k: b / 2**20 for k, b in p.items()} for p in f["peaks"]],
                           ms=statistics.median(times[variant]), time_ratio=ratio, time_ratio_quartiles=(q1, q3),
                           ms_rounds=times[variant],
                           grad_rel_err=None if variant == "stock" else rel_err(f["grad"], stock["grad"]),
                           grad_rel_err_fp32=rel_err(f["grad"], exact))
                print(row, flush=True)
                rows.append(row)
            torch.cuda.empty_cache()
    env = environment()
    print(env)
    print("| size | checkpointing | variant | peak over weights MiB: allocated / requested / reserved | ms / step | × stock (quartiles)"
          " | conv_in grad rel err vs stock | vs fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = "–" if r["grad_rel_err"] is None else f"{r['grad_rel_err']:.1e}"
        q1, q3 = r["time_ratio_quartiles"]
        print(f"| {r['size']}² | {'on' if r['checkpointing'] else 'off'} | {r['variant']} | {r['peak_mib']:.1f} / {r['requested_peak_mib']:.1f} / {r['reserved_peak_mib']:.0f}"
              f" | {r['ms']:.1f} | {r['time_ratio']:.2f} ({q1:.2f}–{q3:.2f})"
              f" | {err} | {r['grad_rel_err_fp32']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
