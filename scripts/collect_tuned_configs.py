"""Collect the autotuner's tiles at Stable Diffusion's layer shapes into the shipped table (needs a CUDA GPU).

    python scripts/collect_tuned_configs.py --out tuned_sm_90.json   # then copy it to sdpatch/kernels/tuned/sm_90.json

Runs, with sdpatch's default backend, one eager UNet call without gradients (batch 2: guidance)
and one fp16-autocast training step (batch 2) of each preset at its usual sizes, so that the
Triton forward and backward tune every layout those calls launch; then writes each tuned plan's
tiles under the key the launchers look up (``sdpatch/kernels/runtime.py``'s ``shipped_config``), merged
into the table given with ``--base`` (entries measured now win). Layouts the Gluon forward serves
tune nothing and are not in the table. The table is keyed by the GPU architecture: run it on the
GPU whose tiles it is to hold.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from sdpatch import wait_for_kernels
from sdpatch.kernels import flash_bwd, flash_fwd, runtime
from sdpatch.kernels.runtime import gpu_arch, shipped_configs
from sdpatch.models import build_preset

from _bench import environment, train_step, unet_inputs, use_variant

# (preset, image sizes): the sizes SD users run each model at.
RUNS = (("sd15", (512, 768, 1024)), ("sd21", (768,)), ("sdxl", (1024,)))
BATCH = 2


def tune(preset: str, sizes: tuple[int, ...], train: bool) -> None:
    unet = build_preset(preset, device="cuda", dtype=torch.float16).unet
    use_variant(unet, "auto")
    for size in sizes:
        if train:
            unet.float().train().requires_grad_(True)
            kw = unet_inputs(unet, BATCH, size, torch.float32)
            train_step(unet, kw, torch.randn_like(kw["sample"]))()
            unet.zero_grad(set_to_none=True)
            unet.half().eval().requires_grad_(False)
        else:
            kw = unet_inputs(unet, BATCH, size, torch.float16)
            with torch.no_grad():  # the first call's new layouts compile in the background; the second tunes them
                unet(**kw)
                wait_for_kernels()
                unet(**kw)
        torch.cuda.synchronize()
        print(f"tuned {preset} {size}²{' training' if train else ''}: {len(flash_fwd._plans)} forward and "
              f"{len(flash_bwd._bwd_plans)} backward layouts so far", flush=True)
    del unet
    torch.cuda.empty_cache()


def tuned_entries() -> dict:
    """{"fwd": {key: tiles}, "bwd": {key: [dK/dV tiles, dQ tiles]}} of every plan the autotuners tuned."""
    fwd, bwd = {}, {}
    for key, plan in flash_fwd._plans.items():
        q_shape, k_shape, dtype = key[0], key[2], key[6]  # shared.plan_key's order
        if plan.config:
            tiles = {k: v for k, v in plan.config.items() if k != "EVEN_N"}
            fwd[flash_fwd.fwd_tune_key(q_shape[2], k_shape[2], dtype, plan.meta)] = tiles
    for key, plan in flash_bwd._bwd_plans.items():
        q_shape, k_shape, dtype = key[0][0], key[0][2], key[0][6]
        if plan.configs:
            bwd[flash_bwd.bwd_tune_key(q_shape[2], k_shape[2], dtype, plan.meta)] = list(plan.configs)
    return {"fwd": fwd, "bwd": bwd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the merged table goes")
    ap.add_argument("--base", help="a table to merge into (default: the one this sdpatch ships for this GPU)")
    ap.add_argument("--no-train", action="store_true", help="the forward alone")
    args = ap.parse_args()
    arch = gpu_arch(torch.device("cuda"))
    base = json.loads(Path(args.base).read_text()) if args.base else shipped_configs(arch)
    # Tune from scratch: with the shipped table in place its layouts would take its tiles untimed.
    runtime.TUNED_DIR = Path(tempfile.mkdtemp())
    shipped_configs.cache_clear()
    # Inference first, every preset, then the training steps: a run cut off by a time limit still
    # leaves the table of what a first image needs, written after every preset.
    for train in (False,) if args.no_train else (False, True):
        for preset, sizes in RUNS:
            tune(preset, sizes, train=train)
            write_table(args.out, base, arch)


def write_table(out: str, base: dict, arch: str) -> None:
    found = tuned_entries()
    table = {kind: {**base.get(kind, {}), **found[kind]} for kind in ("fwd", "bwd")}
    table["measured_on"] = environment()
    Path(out).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{arch}: {len(found['fwd'])} forward and {len(found['bwd'])} backward layouts tuned; "
          f"{len(table['fwd'])} and {len(table['bwd'])} in {out}", flush=True)


if __name__ == "__main__":
    main()
