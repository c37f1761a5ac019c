"""Helpers shared by the GPU benchmark scripts: UNet inputs, timing, peak memory, environment."""

from __future__ import annotations

import contextlib
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
    from sdpatch.kernels.forward import flash_attn_fwd

    q, k, v = case_inputs(c, device=device)
    if not c.backward:
        return (q, k, v)
    out, lse = flash_attn_fwd(q, k, v, 1 / math.sqrt(c.D), return_lse=True)
    return (q, k, v, torch.randn_like(q), out, lse)


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
    """``calls`` calls of a training ``step`` (compile, autotune, the layouts' launch plans; a layout
    the Gluon forward serves compiles in the background, waited for here), then the parameters'
    gradients cleared: the next step's peak counts them as its own, not as memory live before it.
    The allocator's cache is emptied too, so the next step starts from the blocks a fresh process
    would hold whatever ran before, not from the blocks the variant before left."""
    from sdpatch import wait_for_kernels

    for _ in range(calls):
        step()
    if not wait_for_kernels(timeout=0):  # a kernel compiling in the background: wait, and launch it once
        wait_for_kernels()
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
    allocations left; the allocation recorder's trace counts requested sizes."""
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


def graph_tflops(flops: float, fn) -> float:
    """TFLOP/s of ``fn`` by CUDA-graph replay (kernel time alone, no host time): one call to warm it
    up (compile, autotune), then ``do_bench_cudagraph``'s median."""
    from triton.testing import do_bench_cudagraph

    fn()
    return flops / do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e9


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
    " recompute" suffix ("auto recompute") patches with ``recompute=True``; any other suffix names a
    launch policy that the caller's calls run in ("auto gluon", :func:`launch_policy`)."""
    import sdpatch

    backend, _, suffix = variant.partition(" ")
    sdpatch.unpatch_unet(unet)
    if backend != "stock":
        sdpatch.patch_unet(unet, backend=backend, recompute=suffix == "recompute")


def alternating_times(unet, variants, fn, rounds: int = 9, block: int = 3, contexts: dict | None = None) -> dict[str, list[float]]:
    """ms per call of ``fn`` under each variant, one figure per round. The variants take turns, each
    round in the reverse order of the one before (ABBA), so that a drift in host load (another job
    on the machine) reaches each alike and neither always runs first: earlier runs, timed one variant
    after the other, disagreed by up to 30 % on host-bound calls. After each switch one untimed call
    settles the allocator's cache; then ``block`` calls run back to back, as in a real loop, and are
    timed together. ``contexts``: a context factory per variant that its calls run in (a launch
    policy, :func:`launch_policy`)."""
    from sdpatch import wait_for_kernels

    times = {v: [] for v in variants}
    order = list(variants)
    for _ in range(rounds):
        for v in order:
            use_variant(unet, v)
            with (contexts or {}).get(v, contextlib.nullcontext)():
                fn()
                wait_for_kernels()  # a new layout's first call compiles its kernel in the background
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


def settle_graphs(call) -> float:
    """Wait for the kernels sdpatch's CUDA graphs compile in the background, then call ``call`` for
    a warm-up and capture (a graph that held stand-ins is captured again with the kernels; one
    that did not just replays); the seconds waited."""
    from sdpatch import graphs

    start = time.perf_counter()
    graphs.wait_for_kernels()
    waited = time.perf_counter() - start
    for _ in range(graphs.WARMUP_CALLS):
        call()
    return waited


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Launches a probe run times: thousands of microseconds, long against the timer's resolution. The GPU
# runs each one-element add faster than a host enqueues it, so the queue never fills and the time is the host's.
HOST_PROBE_LAUNCHES = 2000


def host_launch_us(launches: int = HOST_PROBE_LAUNCHES, runs: int = 5) -> float | None:
    """The host's time to enqueue one small CUDA kernel (an in-place add on one element), in µs:
    the median of ``runs`` runs of ``launches`` launches, none waited for; None without CUDA.

    An eager diffusers step is bound by this host work, and the lent machines' hosts differ in it
    by more than 2x on one card model (SD 1.5 512²'s stock eager step: 18 ms on one H100 host and
    39-46 ms on another, 2026-12-07), so every figure that the host bounds needs this beside it."""
    if not torch.cuda.is_available():
        return None
    x = torch.zeros(1, device="cuda")
    for _ in range(100):  # warm-up: the kernel's first launch loads it
        x.add_(1)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        times.append((time.perf_counter() - start) / launches * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


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
        "host_launch_us": host_launch_us(),
    }


def launch_policy(gluon: bool = True, gluon_min_flop: float | None = None, whole_grids: bool = True):
    """A context factory: inside, sdpatch's forward launches with the Gluon kernel on or off and
    ``EAGER_GLUON_MIN_FLOP`` at ``gluon_min_flop`` (None: as shipped), and eager calls repeat from
    a map of this policy's own. ``whole_grids=False``: eager calls under that threshold stay on the
    Triton kernel even where the Gluon grid is whole (its wave not split), as they did before
    ``forward.gluon_serves`` gave those calls to the Gluon kernel."""
    from sdpatch.attention import faults
    from sdpatch.kernels import flash_fwd_hopper, forward

    repeats: dict = {}

    @contextlib.contextmanager
    def policy():
        saved = faults.repeats, flash_fwd_hopper.ENABLED, forward.EAGER_GLUON_MIN_FLOP, forward.gluon_serves
        shipped = saved[3]
        faults.repeats, flash_fwd_hopper.ENABLED = repeats, gluon
        forward.EAGER_GLUON_MIN_FLOP = saved[2] if gluon_min_flop is None else gluon_min_flop
        # By size alone is the rule the shipped policy keeps for calls with gradients.
        forward.gluon_serves = shipped if whole_grids else (lambda q, k, v, mask, return_lse=False: shipped(q, k, v, mask, True))
        try:
            yield
        finally:
            faults.repeats, flash_fwd_hopper.ENABLED, forward.EAGER_GLUON_MIN_FLOP, forward.gluon_serves = saved

    return policy
