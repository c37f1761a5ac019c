"""Where a UNet call's time goes, stock vs sdpatch: GPU time per kernel family (needs a CUDA GPU).

    python scripts/profile_unet.py [--preset sd15] [--sizes 512,1024]

The UNet benchmark shows sdpatch's UNet calls slower than stock by more than its attention
kernels' measured gap accounts for; this splits each variant's CUDA time into attention
kernels and the rest, and reports the CPU time per call, to tell kernel time from launch cost.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import sdpatch
from sdpatch.models import build_preset

from _bench import unet_inputs

ATTENTION_KERNELS = ("attn", "fmha", "flash", "cudnn", "sdpa", "softmax")


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sd15")
    ap.add_argument("--sizes", default="512,1024")
    args = ap.parse_args()
    unet = build_preset(args.preset, device="cuda", dtype=torch.float16).unet
    for size in map(int, args.sizes.split(",")):
        profile_size(unet, args.preset, size)


def profile_size(unet, preset: str, size: int) -> None:
    kw = unet_inputs(unet, 2, size, torch.float16)
    for variant in ("stock", "auto"):
        sdpatch.unpatch_unet(unet)
        if variant != "stock":
            sdpatch.patch_unet(unet, backend=variant)
        for _ in range(3):  # compile, autotune, warm caches
            unet(**kw)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                unet(**kw)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in events) / 5 / 1e3
        attn = sum(e.self_device_time_total for e in events if any(s in e.key.lower() for s in ATTENTION_KERNELS)) / 5 / 1e3
        cpu = max(e.cpu_time_total for e in prof.key_averages()) / 5 / 1e3
        print(f"{preset} {size}² {variant}: GPU {total:.1f} ms per call, attention kernels {attn:.1f} ms, CPU {cpu:.1f} ms")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
