"""Where a UNet training step's peak memory goes, stock diffusers (SDPA) vs sdpatch (needs a CUDA GPU).

    python scripts/peak_where.py --json peak_where.json

The training step of ``bench_train_step.py`` (SD 1.5 architecture, random weights, fp16 autocast,
batch 4), one step per variant under PyTorch's allocation recorder. Replaying the recorded
allocations and frees finds the moment of the peak, and the tensors alive then, grouped by the
diffusers or sdpatch line that allocated them. Printed per variant, then the groups whose bytes differ:
what makes one variant's peak higher than the other's.

sdpatch runs three ways (v10's training step measured lower requested peaks on one of them, not
explained): "auto", its layouts' fifth step, on the native launch path; "auto python", the same
with that path off; "auto step 2", its layouts' second step, on new launch plans (the path v10's
first measurement took: tuned tiles, kernels launched through Triton's JIT).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from collections import Counter

import torch

from _bench import environment, peaks_over, train_step, training_unet, unet_inputs, use_variant, warm_up_step

CONFIGS = [(768, False), (768, True)]  # (size, gradient checkpointing)
BATCH = 4
OURS = ("diffusers", "sdpatch", "_bench")  # the first frame from these files names an allocation


def site(frames: list[dict]) -> str:
    """The allocating line: the innermost frame in diffusers, sdpatch or the step itself."""
    for f in frames:
        if any(part in f["filename"] for part in OURS):
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    return frames[0]["name"] if frames else "?"


def live_at_peak(trace: list[dict]) -> tuple[int, str, Counter]:
    """Replay ``trace``: the peak of bytes allocated while it was recorded, the allocation that
    reached it, and the bytes alive then by allocating site."""

    def replay(stop: int | None = None):
        live: dict[int, dict] = {}
        total = peak = peak_at = 0
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif e["action"] == "free_requested" and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
        return live, peak, peak_at

    _, peak, peak_at = replay()
    live, _, _ = replay(peak_at + 1)
    at_peak: Counter = Counter()
    for e in live.values():
        at_peak[site(e.get("frames", []))] += e["size"]
    return peak, site(trace[peak_at].get("frames", [])) if trace else "?", at_peak


VARIANTS = ("stock", "auto", "auto python", "auto step 2")


def measure(unet, kw, target, variant: str) -> dict:
    from sdpatch.kernels import flash_bwd, flash_fwd, native

    use_variant(unet, "stock" if variant == "stock" else "auto")
    step = train_step(unet, kw, target)
    if variant == "auto step 2":  # new plans, no programs: the autotuner's cache keeps this to one warm-up step
        flash_fwd._plans.clear()
        flash_bwd._bwd_plans.clear()
        flash_fwd._native_fwd.registry = flash_bwd._native_bwd.registry = None
    with native.enabled(variant != "auto python"):
        warm_up_step(step, unet, calls=1 if variant == "auto step 2" else 4)
        record = torch.cuda.memory._record_memory_history
        fresh = {"clear_history": True} if "clear_history" in inspect.signature(record).parameters else {}
        record(stacks="python", max_entries=2_000_000, **fresh)  # no earlier variant's events
        _, peaks = peaks_over(step)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    traced, peak_site, at_peak = live_at_peak(trace)
    return dict(peak_mib=peaks["allocated"] / 2**20, requested_peak_mib=peaks["requested"] / 2**20, traced_peak_mib=traced / 2**20,
                peak_site=peak_site,
                by_site_mib={k: v / 2**20 for k, v in at_peak.most_common()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    unet = training_unet()
    results = []
    for size, checkpointing in CONFIGS:
        kw = unet_inputs(unet, BATCH, size, torch.float32)
        target = torch.randn_like(kw["sample"])
        if checkpointing:
            unet.enable_gradient_checkpointing()
        else:
            unet.disable_gradient_checkpointing()
        found = {v: measure(unet, kw, target, v) for v in VARIANTS}
        print(f"== {size}² checkpointing {'on' if checkpointing else 'off'}")
        for v, f in found.items():
            print(f"{v}: peak {f['peak_mib']:.1f} MiB over the weights, {f['requested_peak_mib']:.1f} requested"
                  f" (traced {f['traced_peak_mib']:.1f}), reached at {f['peak_site']}")
            for where, mib in list(f["by_site_mib"].items())[:15]:
                print(f"    {mib:9.1f} MiB  {where}")
        for v in VARIANTS[1:]:
            sites = set(found["stock"]["by_site_mib"]) | set(found[v]["by_site_mib"])
            diff = {s: found[v]["by_site_mib"].get(s, 0.0) - found["stock"]["by_site_mib"].get(s, 0.0) for s in sites}
            print(f"sdpatch ({v}) - stock, alive at each one's peak:")
            for s, d in sorted(diff.items(), key=lambda x: -abs(x[1])):
                if abs(d) >= 0.25:
                    print(f"    {d:+9.1f} MiB  {s}")
        results.append(dict(size=size, checkpointing=checkpointing, **found))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
