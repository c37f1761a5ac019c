"""Where a UNet call's time goes, stock vs sdpatch: GPU time per kernel family (needs a CUDA GPU).

    python scripts/profile_unet.py [--preset sd15] [--sizes 512,1024] [--train]

--train profiles a training step instead (fp32 weights, fp16 autocast, batch 4, forward and backward),
as ``scripts/bench_train_step.py`` times it.

The UNet benchmark shows sdpatch's UNet calls slower than stock by more than its attention
kernels' measured gap accounts for; this splits each variant's CUDA time into attention
kernels and the rest, and reports the CPU time per call, to tell kernel time from launch cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sdpatch.models import build_preset

from _bench import alternating_median_ms, train_step, training_unet, unet_inputs, use_variant

ATTENTION_KERNELS = ("attn", "_bwd_", "fmha", "flash", "sdpa")  # sdpatch's, PyTorch's and cuDNN's attention kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sd15")
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--train", action="store_true")
    args = ap.parse_args()
    unet = training_unet(args.preset) if args.train else build_preset(args.preset, device="cuda", dtype=torch.float16).unet
    for size in map(int, args.sizes.split(",")):
        if args.train:
            kw = unet_inputs(unet, 4, size, torch.float32)
            profile_size(train_step(unet, kw, torch.randn_like(kw["sample"])), unet, f"{args.preset} train", size)
        else:
            kw = unet_inputs(unet, 2, size, torch.float16)
            with torch.no_grad():
                profile_size(lambda: unet(**kw), unet, args.preset, size)


def profile_size(call, unet, label: str, size: int) -> None:
    for variant in ("stock", "auto"):
        use_variant(unet, variant)
        for _ in range(3):  # compile, autotune, warm caches
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in events) / 5 / 1e3
        attn = sum(e.self_device_time_total for e in events if any(s in e.key.lower() for s in ATTENTION_KERNELS)) / 5 / 1e3
        cpu = max(e.cpu_time_total for e in prof.key_averages()) / 5 / 1e3
        launches = sum(e.count for e in events) / 5
        print(f"{label} {size}² {variant}: GPU {total:.1f} ms per call, attention kernels {attn:.1f} ms, "
              f"{launches:.0f} kernels, CPU {cpu:.1f} ms")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    # Outside the profiler: wall ms per call (variants alternating), and the host's time to enqueue
    # one call; where enqueueing takes as long as the call, the GPU waits for the host.
    ms = alternating_median_ms(unet, ["stock", "auto"], call, block=1)
    for variant in ("stock", "auto"):
        use_variant(unet, variant)
        host = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        print(f"{label} {size}² {variant}: wall {ms[variant]:.1f} ms per call, host enqueue {statistics.median(host):.1f} ms")


if __name__ == "__main__":
    main()
