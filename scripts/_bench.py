"""Helpers shared by the GPU benchmark scripts: UNet inputs, timing, peak memory, environment."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    """One attention shape the kernel scripts measure: (B, H, Nq, Nk, D), forward or backward."""

    name: str
    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    dtype: str = "fp16"
    backward: bool = False
    sdpatch_backend: str = "triton"


# The forward probes' cases: SD's self-attention where the softmax weighs most (head dim 64, and 40
# padded to 64), in diffusers' (B, N, H, D) layout.
PROBE_CASES = [
    Case("hd40 4096", 2, 8, 4096, 4096, 40),
    Case("hd40 16384", 2, 8, 16384, 16384, 40),
    Case("hd64 4096", 2, 10, 4096, 4096, 64),
    Case("hd64 1024", 2, 20, 1024, 1024, 64),
]


def chosen(c: Case, only: str | None) -> bool:
    """Whether the scripts' ``--only`` picks case ``c``: comma-separated terms, each a substring of
    the case's name or "fwd" / "bwd" for every case of that kind; parts of a term joined by "+" must
    all match ("bwd+x77": the backward cases on 77 keys). No ``--only`` picks every case."""
    kind = "bwd" if c.backward else "fwd"
    return not only or any(all(p in c.name or p == kind for p in term.split("+")) for term in only.split(","))


def as_config(tile: tuple[int, int, int, int]) -> dict:
    """A launcher config from a (BLOCK_M, BLOCK_N, num_warps, num_stages) tile."""
    bm, bn, w, s = tile
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


def case_inputs(c: Case, seed: int = 0, device: str = "cuda"):
    """Random q, k, v for a case, laid out as diffusers' processors pass them: (B, N, H, D) memory
    viewed as (B, H, N, D)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[c.dtype]
    g = torch.Generator(device).manual_seed(seed)

    def r(n):
        return torch.randn(c.B, n, c.H, c.D, device=device, dtype=dtype, generator=g).transpose(1, 2)

    return r(c.Nq), r(c.Nk), r(c.Nk)


def case_tensors(c: Case, device: str = "cuda") -> tuple:
    """(q, k, v) for a forward case; (q, k, v, dO, O, log-sum-exp) for a backward one."""
    from sdpatch.kernels.flash_fwd import flash_attn_fwd

    q, k, v = case_inputs(c, device=device)
    if not c.backward:
        return (q, k, v)
    out, lse = flash_attn_fwd(q, k, v, 1 / math.sqrt(c.D), return_lse=True)
    return (q, k, v, torch.randn_like(q), out, lse)


def probe_row(case: str, impl: str, fn, flops: float, error_of) -> dict:
    """One probe measurement: ``fn``'s result checked by ``error_of`` (a relative error), then its
    kernel time by CUDA-graph replay; a tile that cannot compile or fit is recorded, not raised."""
    from triton.testing import do_bench_cudagraph

    row = {"case": case, "impl": impl, "tflops": None, "rel_err": None, "error": None}
    try:
        row["rel_err"] = error_of(fn())
        row["tflops"] = flops / do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e9
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    tf = "–" if row["tflops"] is None else f"{row['tflops']:.0f} TFLOP/s"
    outcome = row["error"] or f"rel err {row['rel_err']:.1e}"
    print(f"{case:15s} {impl:30s} {tf:>14s}  {outcome}", flush=True)
    return row


def split_sms(B: int, H: int, Nq: int, Nk: int, config: tuple) -> int:
    """SMs for the Gluon kernel's ``sms`` that leave one query tile of this grid for a last wave,
    split into pieces (``tail_split``); 0 where none would be split. ``config`` as ``config_for``'s."""
    from sdpatch.kernels.flash_fwd_hopper import grid_for

    tiles = grid_for(B * H, Nq, Nk, 0, config).whole
    return tiles - 1 if tiles > 2 and grid_for(B * H, Nq, Nk, tiles - 1, config).splits > 1 else 0


def mixed_sms(B: int, H: int, Nq: int, Nk: int, config: tuple) -> int:
    """SMs for the Gluon kernel's ``sms`` under which its grid mixes tiles of two sizes
    (``tile_plan``), tried at 1.3 to 3.6 waves of whole tiles; 0 where none does."""
    from sdpatch.kernels.flash_fwd_hopper import grid_for

    tiles = grid_for(B * H, Nq, Nk, 0, config).whole
    for waves in (1.82, 1.7, 1.5, 1.3, 2.6, 3.6):
        sms = max(2, int(tiles / waves))
        if grid_for(B * H, Nq, Nk, sms, config).mixed:
            return sms
    return 0


def grid_variants(B: int, H: int, Nq: int, Nk: int, config: tuple) -> list[tuple[str, int]]:
    """(name, SMs) for the Gluon kernel's ``sms`` of each grid this shape can be laid out in
    besides whole tiles: its last tile split (:func:`split_sms`), tiles of two sizes
    (:func:`mixed_sms`)."""
    variants = [("split", split_sms(B, H, Nq, Nk, config)), ("mixed", mixed_sms(B, H, Nq, Nk, config))]
    return [(name, sms) for name, sms in variants if sms]


def abba_call_us(fns: dict, rounds: int) -> dict[str, float]:
    """Each zero-argument call's time per call in µs (``do_bench``: the L2 flushed before each
    call), the median of ``rounds`` rounds that alternate the calls' order (ABBA), so that drift
    between rounds falls on every call alike."""
    from triton.testing import do_bench

    calls = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            calls[name].append(1e3 * do_bench(fns[name], warmup=10, rep=60, return_mode="median"))
    return {name: sorted(times)[rounds // 2] for name, times in calls.items()}


def probe_start(doc: str):
    """A GPU probe's start: its ``--json`` argument parsed, the native module built, the seed set."""
    import argparse

    from sdpatch.kernels import native

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    native.wait()
    torch.manual_seed(0)
    return args


def show_row(row: dict, fmt: str = ".1f") -> None:
    """A probe's row on one line, its floats in ``fmt``."""
    print(" | ".join(f"{key} {val:{fmt}}" if isinstance(val, float) else f"{key} {val}" for key, val in row.items()), flush=True)


def probe_rows_out(rows: list[dict], json_path: str | None) -> None:
    """A probe's end: the environment, and its rows with it as JSON where asked."""
    print(environment())
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)


def probe_inputs(c: Case, device: str = "cuda"):
    """A forward probe's case: q, k, v, the scale, the FLOP count, and ``error_of(out)``, a result's
    relative error against float64 on 512 rows of one head."""
    from sdpatch.reference import attention_ref

    q, k, v = case_inputs(c, device=device)
    ref = attention_ref(q[:1, :1, :512], k[:1, :1], v[:1, :1])

    def error_of(out) -> float:
        return ((out[:1, :1, :512].double() - ref).norm() / ref.norm()).item()

    return q, k, v, 1 / math.sqrt(c.D), 4 * c.B * c.H * c.Nq * c.Nk * c.D, error_of


def forward_baselines(q, k, v, scale: float) -> dict:
    """What the Gluon probes time the Gluon kernel against, as zero-argument calls: PyTorch's SDPA
    pinned to cuDNN, and sdpatch's Triton kernel (the Gluon kernel turned off for the call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sdpatch.kernels import flash_fwd_hopper
    from sdpatch.kernels.flash_fwd import flash_attn_fwd

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)

    def triton_kernel():
        flash_fwd_hopper.ENABLED = False
        try:
            return flash_attn_fwd(q, k, v, scale)[0]
        finally:
            flash_fwd_hopper.ENABLED = True

    return {"cudnn": cudnn, "triton": triton_kernel}


def probe_forward(tiles: list[tuple], impls_for, cases: list[Case] = PROBE_CASES, device: str = "cuda") -> list[dict]:
    """Run a forward probe: for each case and tile, ``impls_for(q, k, v, scale, config)`` gives
    {implementation name: zero-argument call}; each is checked against float64 on 512 rows of
    one head, then timed (see :func:`probe_row`). Returns the rows, named "<implementation> <tile>"."""
    rows = []
    for c in cases:
        q, k, v, scale, flops, error_of = probe_inputs(c, device)
        for tile in tiles:
            impls = impls_for(q, k, v, scale, as_config(tile))
            rows += [probe_row(c.name, f"{name} {tile}", fn, flops, error_of) for name, fn in impls.items()]
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def probe_main(description: str, tiles: list[tuple], impls_for, pairs: list[tuple[str, str]]) -> None:
    """A forward probe's command line: ``--json PATH``; times every variant (:func:`probe_forward`)
    and prints, for each (candidate, baseline) pair of name prefixes, the best of each per case."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = probe_forward(tiles, impls_for)
    for i, (candidate, baseline) in enumerate(pairs):
        probe_summary(rows, [c.name for c in PROBE_CASES], candidate, baseline, args.json if i == 0 else None)


def probe_summary(rows: list[dict], cases: list[str], candidate: str, baseline: str, json_path: str | None) -> None:
    """Print each case's fastest correct ``candidate`` row against its fastest ``baseline`` row (rows
    from :func:`probe_row`, told apart by the start of their ``impl``), and write every row as JSON."""
    print(environment())
    print(f"| case | best {baseline} | best {candidate} | × |")
    print("|---|---|---|---|")
    for case in cases:
        best = {}
        for name in (baseline, candidate):
            ok = [r for r in rows if r["case"] == case and r["impl"].startswith(name) and r["tflops"] and r["rel_err"] < 1e-2]
            best[name] = max(ok, key=lambda r: r["tflops"], default=None)
        base, cand = best[baseline], best[candidate]
        cell = lambda r: "–" if r is None else f"{r['tflops']:.0f} ({r['impl']})"  # noqa: E731
        ratio = f"{cand['tflops'] / base['tflops']:.2f}" if base and cand else "–"
        print(f"| {case} | {cell(base)} | {cell(cand)} | {ratio} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)


def unet_inputs(unet, batch: int, size: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random UNet call arguments for a batch at an image side of ``size`` pixels."""
    g = torch.Generator("cuda").manual_seed(seed)
    cfg = unet.config
    lat = size // 8
    kw = dict(
        sample=torch.randn(batch, cfg.in_channels, lat, lat, device="cuda", dtype=dtype, generator=g),
        timestep=torch.full((batch,), 500, device="cuda"),
        encoder_hidden_states=torch.randn(batch, 77, cfg.cross_attention_dim, device="cuda", dtype=dtype, generator=g),
    )
    if cfg.addition_embed_type == "text_time":  # SDXL's added conditions
        kw["added_cond_kwargs"] = dict(
            text_embeds=torch.randn(batch, 1280, device="cuda", dtype=dtype, generator=g),
            time_ids=torch.tensor([[size, size, 0, 0, size, size]] * batch, device="cuda", dtype=dtype),
        )
    return kw


def training_unet(preset: str = "sd15"):
    """A preset's UNet as the training benchmarks use it: random fp32 weights on CUDA, train mode,
    every parameter taking gradients."""
    from sdpatch.models import build_preset

    unet = build_preset(preset, device="cuda", dtype=torch.float32).unet
    return unet.train().requires_grad_(True)


def warm_up_step(step, unet, calls: int = 1) -> None:
    """``calls`` calls of a training ``step`` (compile, autotune; from the third call of a layout on,
    sdpatch's native launch path), then the parameters' gradients cleared: the next step's peak
    counts them as its own, not as memory live before it. The allocator's cache is emptied too, so
    the next step starts from the blocks a fresh process would hold whatever ran before: v7-v9
    measured the second variant on the first one's cached blocks."""
    for _ in range(calls):
        step()
    for p in unet.parameters():
        p.grad = None
    torch.cuda.empty_cache()


def train_step(unet, kw: dict, target: torch.Tensor, autocast: bool = True):
    """One training step of ``unet`` on the call arguments ``kw``, as a closure: gradients cleared,
    forward under fp16 autocast, MSE loss against ``target``, backward (no optimizer: its memory and
    time do not depend on attention)."""
    import torch.nn.functional as F

    params = [p for p in unet.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            pred = unet(**kw).sample
        F.mse_loss(pred.float(), target).backward()

    return step


def make_mask(kind: str | None, B: int, Nq: int, Nk: int, dtype: torch.dtype, device: str = "cuda") -> torch.Tensor | None:
    """Test masks, 4-D as the kernels take them: bool (B, 1, Nq, Nk) with row 0 fully masked,
    additive (1, 1, Nq, Nk), or diffusers' (B, 1, 1, Nk) encoder padding mask."""
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, Nq, Nk, device=device) > 0.3
        m[:, :, 0] = False
        return m
    if kind == "additive":
        return torch.randn(1, 1, Nq, Nk, device=device, dtype=dtype)
    a = torch.zeros(B, 1, 1, Nk, device=device, dtype=dtype)
    a[..., Nk // 2 :] = -10000.0
    return a


def peaks_over(fn) -> tuple[object, dict[str, int]]:
    """Run ``fn``; return its result and its peak bytes beyond what was live before, three ways:
    ``allocated``, the caching allocator's blocks (``max_memory_allocated``); ``requested``, the
    tensors' own sizes; ``reserved``, the segments the allocator took from the driver, which is what
    must fit on the card. A block rounds its tensor up to 512 bytes, and a large one keeps a remainder
    under 1 MiB unsplit, so the allocated peak also moves with which cached blocks earlier
    allocations left; the allocation recorder's trace counts requested sizes (v9)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    out = fn()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return out, {k: after[f"{k}_bytes.all.peak"] - before[f"{k}_bytes.all.current"] for k in ("allocated", "requested", "reserved")}


def peak_over(fn) -> tuple[object, int]:
    """Run ``fn``; return its result and the peak bytes allocated beyond what was live before."""
    out, peaks = peaks_over(fn)
    return out, peaks["allocated"]


def timed_ms(fn, calls: int = 1) -> float:
    """Wall time per call of ``calls`` back-to-back calls of ``fn`` in ms, between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def use_variant(unet, variant: str) -> None:
    """Give the UNet stock diffusers attention, or sdpatch's with ``variant`` as its backend; a
    " recompute" suffix ("auto recompute") patches with ``recompute=True``."""
    import sdpatch

    backend, _, suffix = variant.partition(" ")
    sdpatch.unpatch_unet(unet)
    if backend != "stock":
        sdpatch.patch_unet(unet, backend=backend, recompute=suffix == "recompute")


def alternating_times(unet, variants, fn, rounds: int = 9, block: int = 3) -> dict[str, list[float]]:
    """ms per call of ``fn`` under each variant, one figure per round. The variants take turns, each
    round in the reverse order of the one before (ABBA), so that a drift in host load (another job
    on the machine) reaches each alike and neither always runs first: v2's runs, timed one variant
    after the other, disagreed by up to 30 % on host-bound calls. After each switch one untimed call
    settles the allocator's cache; then ``block`` calls run back to back, as in a real loop, and are
    timed together."""
    times = {v: [] for v in variants}
    order = list(variants)
    for _ in range(rounds):
        for v in order:
            use_variant(unet, v)
            fn()
            times[v].append(timed_ms(fn, block))
        order.reverse()
    return times


def alternating_median_ms(unet, variants, fn, rounds: int = 9, block: int = 3) -> dict[str, float]:
    """The median of :func:`alternating_times` for each variant."""
    return {v: statistics.median(t) for v, t in alternating_times(unet, variants, fn, rounds, block).items()}


def paired_ratio(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median, lower and upper quartile of the per-round ratios ``times[i] / base[i]``: rounds ran
    side by side, so their ratio cancels the host load they shared."""
    ratios = sorted(t / b for t, b in zip(times, base))
    q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return med, q1, q3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def environment() -> dict:
    import diffusers
    import triton

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        driver = smi.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        driver = None
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "diffusers": diffusers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
