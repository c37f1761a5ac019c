"""Full-size UNet call, stock diffusers (SDPA) vs sdpatch, at SD resolutions (needs a CUDA GPU).

    python scripts/bench_unet.py --json bench_unet.json

Random-weight SD 1.5 and SDXL UNets from sdpatch's presets, fp16, batch 2 (one image with
classifier-free guidance). For each variant: peak memory allocated over the weights and inputs,
median ms per UNet call (the variants' calls alternating), and the output's relative error against stock.
"""

from __future__ import annotations

import argparse
import json

import torch

from sdpatch import wait_for_kernels
from sdpatch.models import build_preset

from _bench import alternating_median_ms, environment, peak_over, rel_err, unet_inputs, use_variant

CASES = [("sd15", 512), ("sd15", 1024), ("sd15", 2048), ("sdxl", 1024), ("sdxl", 2048)]
VARIANTS = ["stock", "auto", "chunked"]  # auto = triton where it can serve the layer


@torch.no_grad()
def run(preset: str, sizes: list[int]) -> list[dict]:
    unet = build_preset(preset, device="cuda", dtype=torch.float16).unet
    rows = []
    for size in sizes:
        kw = unet_inputs(unet, 2, size, torch.float16)
        call = lambda: unet(**kw).sample  # noqa: E731
        found = {}
        for variant in VARIANTS:
            use_variant(unet, variant)
            call()  # warm-up: compile and autotune outside the numbers
            wait_for_kernels()  # (a new layout compiles in the background, SDPA standing in)
            found[variant] = peak_over(call)
            torch.cuda.empty_cache()
        ms = alternating_median_ms(unet, VARIANTS, call, block=1)
        ref = found["stock"][0]
        for variant, (out, peak) in found.items():
            row = dict(preset=preset, size=size, variant=variant, peak_mib=peak / 2**20, ms=ms[variant],
                       time_ratio=ms[variant] / ms["stock"], rel_err=None if variant == "stock" else rel_err(out, ref))
            print(row, flush=True)
            rows.append(row)
        del found, ref
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for preset in dict.fromkeys(p for p, _ in CASES):
        rows += run(preset, [s for p, s in CASES if p == preset])
    env = environment()
    print(env)
    print("| model | size | variant | peak over weights MiB | ms / call | × stock | rel err vs stock |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        err = "–" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"| {r['preset']} | {r['size']}² | {r['variant']} | {r['peak_mib']:.0f} | {r['ms']:.1f} | {r['time_ratio']:.2f} | {err} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
