"""Host time per attention call, sdpatch against PyTorch's SDPA (needs a CUDA GPU for its figures).

    python scripts/bench_host.py --json bench_host.json

A training step of SD 1.5 at 512² is host-bound on the lent H200s (the host takes ~120 ms to enqueue
~62 ms of kernels), so every microsecond a layer's attention costs the host shows in the step. At
small shapes the GPU waits on the host, and the wall time of a long run of calls without
synchronizing is the host's time per call. For each case, forward alone (no gradient) and forward
plus backward (inputs that require grad, as in training): best and median of 5 runs of ``ITERS``
calls, sdpatch's and SDPA's runs alternating (ABBA, as the whole layers' runs do), then the top of a cProfile of sdpatch's forward plus backward, and the host time of each
piece of sdpatch's call alone (allocation, launch plan, autograd node, backward; on CUDA the
tuned forward launch through Triton's runner, through :class:`~sdpatch.kernels.runtime.Binary`,
and with integer pointers), to show where its time goes.

Last, on CUDA, the anatomy of one backward call at SD shapes, timed as ``do_bench`` times it (the L2
cache cleared, then CUDA events around ``torch.autograd.grad``), for sdpatch, cuDNN and flash: the
events' GPU time, the host's time in ``autograd.grad``, and for sdpatch where that time goes (from
the call to its Python backward, the backward itself, and back to the caller). A call whose host
time outlasts its kernels is timed by the host: this shows which one a per-call figure measures.

``--parts layers``: one diffusers ``Attention`` layer at host-bound SD shapes, stock's processor
against sdpatch's as it launches by default, with the Triton forward alone, and with the Gluon forward
serving eager calls wherever it serves (what lowering ``EAGER_GLUON_MIN_FLOP`` would cost or gain).

``--parts unet``: whole eager UNet calls (SD 1.5 512², SDXL 1024², batch 2, no grad), stock against
sdpatch: the host's time to enqueue one, its wall time, its host-device synchronizations, and the
top of a cProfile of each, to find what an eager denoising step spends beyond stock's; then stock
and sdpatch under four launch policies (as shipped, the Triton forward alone, the Gluon forward
for eager calls by their size alone as before whole grids took it, and the Gluon forward wherever
it serves) in alternating rounds, each with its ratio to stock's round beside it: the eager launch
policy's A/B on one host, which fresh processes on the lent hosts could not settle. Beside each
policy, the Gluon repeat launcher's lookups of kept arguments and the distinct address sets among
them (:func:`gluon_address_sets`).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import sdpatch

from _bench import Case, environment, launch_policy

CASES = [Case("self 256", 2, 8, 256, 256, 40), Case("cross 256x77", 2, 8, 256, 77, 40)]
ITERS = 200
# The backward cases whose per-call figures the host decides (measured on the lent H200 hosts).
# Whole attention layers, as a UNet calls them in eager mode at host-bound SD shapes: diffusers'
# AttnProcessor2_0 (SDPA) against sdpatch's processor (B, H, Nq, Nk, D; Nk 77 is cross-attention
# on SDXL's 2048-wide text states).
LAYER_CASES = [Case("layer hd40 4096", 2, 8, 4096, 4096, 40), Case("layer hd40 4096x77", 2, 8, 4096, 77, 40),
               Case("layer hd80 1024", 2, 8, 1024, 1024, 80), Case("layer hd160 256", 2, 8, 256, 256, 160),
               Case("layer hd160 1024", 2, 8, 1024, 1024, 160), Case("layer hd64 1024", 2, 20, 1024, 1024, 64),
               Case("layer hd64 1024x77", 2, 20, 1024, 77, 64), Case("layer hd64 4096", 2, 10, 4096, 4096, 64)]
PROFILED_LAYERS = ("layer hd160 1024", "layer hd64 4096")  # the eager per-call targets' shapes
# Whole UNet calls, eager, no grad, batch 2 (preset, size): where a host-bound step's time goes.
UNET_CASES = [("sd15", 512), ("sdxl", 1024)]
UNET_ROUNDS = 15  # ABBA rounds of the whole-UNet comparison
ANATOMY_CASES = [Case("bwd x77 hd40 4096", 2, 8, 4096, 77, 40), Case("bwd hd160 1024", 2, 8, 1024, 1024, 160)]


def inputs(c: Case, device: str) -> tuple:
    """q, k, v requiring grad, laid out as diffusers' processors pass them, and a gradient dO."""
    def heads(n):  # (B, N, H*D) projections viewed as (B, H, N, D)
        return torch.randn(c.B, n, c.H * c.D, device=device, dtype=torch.float16).view(c.B, n, c.H, c.D).transpose(1, 2)

    return *(heads(n).requires_grad_() for n in (c.Nq, c.Nk, c.Nk)), heads(c.Nq)


def calls(c: Case, device: str) -> dict:
    """{name: zero-argument call}: sdpatch's and SDPA's forward, and forward plus backward."""
    q, k, v, do = inputs(c, device)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    return {
        "sdpatch fwd": lambda: sdpatch.attention(qd, kd, vd, backend="triton"),
        "sdpa fwd": lambda: F.scaled_dot_product_attention(qd, kd, vd),
        "sdpatch fwd+bwd": lambda: sdpatch.attention(q, k, v, backend="triton").backward(do),
        "sdpa fwd+bwd": lambda: F.scaled_dot_product_attention(q, k, v).backward(do),
    }


def layer_calls(c: Case, device: str) -> dict:
    """({name: zero-argument call}, {name: context factory}): one diffusers ``Attention`` layer's
    forward without gradients, with its stock ``AttnProcessor2_0`` and with sdpatch's processor (the
    layer patch_unet sets) under each launch policy (:func:`launch_policy`), which its calls must be
    made in."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    from sdpatch.processor import SdpatchAttnProcessor

    cross = c.Nk != c.Nq
    layer = Attention(c.H * c.D, cross_attention_dim=2048 if cross else None, heads=c.H, dim_head=c.D)
    layer = layer.to(device, torch.float16).eval()
    x = torch.randn(c.B, c.Nq, c.H * c.D, device=device, dtype=torch.float16)
    context = torch.randn(c.B, c.Nk, 2048, device=device, dtype=torch.float16) if cross else None
    stock, ours = AttnProcessor2_0(), SdpatchAttnProcessor("layer")

    def call(processor):
        def run():
            with torch.no_grad():
                return processor(layer, x, context)
        return run

    # Each sdpatch variant keeps its own map of eager repeats (the fast path launches what served a
    # layout first), and its own forward launch policy: the default; the Gluon forward off, so that
    # the FA2 Triton kernel serves; the Gluon forward serving eager calls wherever it serves.
    return ({"stock layer": call(stock), "sdpatch layer": call(ours), "sdpatch fa2 layer": call(ours),
             "sdpatch gluon layer": call(ours)},
            {"sdpatch layer": launch_policy(), "sdpatch fa2 layer": launch_policy(gluon=False),
             "sdpatch gluon layer": launch_policy(gluon_min_flop=0)})


def unet_anatomy(preset: str, size: int, calls: int = 10) -> list[dict]:
    """One eager UNet call (no grad, batch 2), stock against sdpatch (``patch_unet``, no graphs): the
    host's time to enqueue it from an idle GPU, its wall time to the end of its kernels, the number
    of host-device synchronizations in it (``torch.cuda.set_sync_debug_mode``); then the alternating
    (ABBA) median of 3 back-to-back calls of stock and of each launch policy, and each one's paired
    ratio to stock's. Prints the top of a cProfile of one call of stock's and sdpatch's."""
    import warnings

    from sdpatch.models import build_preset

    from _bench import alternating_times, paired_ratio, unet_inputs, use_variant

    unet = build_preset(preset, device="cuda", dtype=torch.float16).unet
    kw = unet_inputs(unet, 2, size, torch.float16)

    def call():
        with torch.no_grad():
            return unet(**kw).sample

    rows = []
    for variant in ("stock", "auto"):
        use_variant(unet, variant)
        for _ in range(3):
            call()
        sdpatch.wait_for_kernels()  # the first call's new layouts compiled in the background
        torch.cuda.synchronize()
        host, wall = [], []
        for _ in range(calls):
            t = time.perf_counter()
            call()
            host.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t) * 1e3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        rows.append(dict(case=f"unet {preset} {size}", impl=variant, host_ms=statistics.median(host),
                         wall_ms=statistics.median(wall), syncs=len(syncs), sync_kinds=sorted(set(syncs))[:5]))
        print(rows[-1], flush=True)
        print(f"unet {preset} {size} {variant}", profile_top(call, 3, lines=30), sep="\n", flush=True)
    # The eager launch policies side by side with stock, in one alternation: which one a host-bound
    # eager step gains most from, on one host.
    policies = {"auto": launch_policy(), "auto fa2": launch_policy(gluon=False),
                "auto by-size": launch_policy(whole_grids=False), "auto gluon": launch_policy(gluon_min_flop=0)}
    with gluon_address_sets(policies) as sets:
        times = alternating_times(unet, ["stock", *policies], call, rounds=UNET_ROUNDS, contexts=policies)
    for variant, ms in times.items():
        row = next((r for r in rows if r["impl"] == variant), None)
        if row is None:
            row = dict(case=f"unet {preset} {size}", impl=variant)
            rows.append(row)
        row["abba_ms"] = statistics.median(ms)
        row["paired_vs_stock"] = paired_ratio(ms, times["stock"])
        if variant in sets:
            row["gluon_lookups"], row["gluon_address_sets"] = sets[variant][0], len(sets[variant][1])
    use_variant(unet, "stock")
    del unet
    torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def gluon_address_sets(policies: dict):
    """Wraps each policy's context (in place) to count, under it, the Gluon repeat launcher's
    lookups of its kept arguments and the distinct address sets looked up: {policy: [lookups,
    {address sets}]}. A set seen again is a launch from kept arguments; a new one walks the
    arguments again. Where the allocator hands a layer the same addresses every step, the sets stay
    at the layers' count however many calls run."""
    from sdpatch.kernels import flash_fwd_hopper

    seen = {name: [0, set()] for name in policies}
    active: list[str] = []
    real = flash_fwd_hopper._addresses

    def counted(*args):
        key = real(*args)
        if active:
            seen[active[-1]][0] += 1
            seen[active[-1]][1].add(key)
        return key

    def tagged(name, factory):
        @contextlib.contextmanager
        def context():
            active.append(name)
            try:
                with factory():
                    yield
            finally:
                active.pop()
        return context

    saved = dict(policies)
    policies.update({name: tagged(name, factory) for name, factory in saved.items()})
    flash_fwd_hopper._addresses = counted
    try:
        yield seen
    finally:
        flash_fwd_hopper._addresses = real
        policies.update(saved)


class _Identity(torch.autograd.Function):
    """A Python autograd node without kernels: what the autograd engine costs such a node."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


def pieces(c: Case, device: str) -> dict:
    """{name: zero-argument call} for the parts of one sdpatch call, each timed alone: what the
    forward's launch, its allocations, the autograd node and the backward cost the host."""
    from sdpatch.attention.triton_backend import TritonAttention
    from sdpatch.kernels import flash_fwd, runtime
    from sdpatch.kernels.shared import plan_key
    from sdpatch.kernels.flash_bwd import flash_attn_bwd

    qg, kg, vg, do = inputs(c, device)
    q, k, v = (t.detach() for t in (qg, kg, vg))
    scale = c.D**-0.5
    for _ in range(2):  # tune, then launch from the plan: each piece below is timed warm
        out, lse = flash_fwd.fa2_attn_fwd(q, k, v, scale, return_lse=True)
        flash_fwd.fa2_attn_fwd(q, k, v, scale)
        flash_attn_bwd(do, q, k, v, out, lse, scale)

    def direct():  # sdpatch's forward and backward without the autograd engine
        o, m = flash_fwd.fa2_attn_fwd(q, k, v, scale, return_lse=True)
        flash_attn_bwd(do, q, k, v, o, m, scale)

    found = {
        "autograd: Python node fwd+bwd": lambda: _Identity.apply(qg).backward(do),
        "autograd: C++ node (x * 2) fwd+bwd": lambda: (qg * 2).backward(do),
        "fwd + bwd, no autograd": direct,
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "flash_attn_fwd": lambda: flash_fwd.fa2_attn_fwd(q, k, v, scale),
        "flash_attn_fwd with lse": lambda: flash_fwd.fa2_attn_fwd(q, k, v, scale, return_lse=True),
        "TritonAttention.apply": lambda: TritonAttention.apply(qg, kg, vg, scale, None),
        "flash_attn_bwd": lambda: flash_attn_bwd(do, q, k, v, out, lse, scale),
    }
    plan = flash_fwd._plans[plan_key(q, k, v, None, scale, False, None, None)]
    if plan.tuned and plan.binaries:  # CUDA: the tuned launch, three ways
        grid, scalars, _, key = plan.tuned
        binary = plan.binaries[key]
        args = (q, k, v, None, None, None, out, None, *scalars)
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args) + binary.consts
        device_index, stream = runtime.current_device_and_stream()
        found |= {
            "launch: Triton's runner": lambda: binary.compiled[grid](*args, *binary.consts),
            "launch: sdpatch's Binary": lambda: binary(grid, args),
            "launch: C launcher, int pointers": lambda: binary.run(*grid, stream(device_index), binary.function,
                                                                    binary.metadata, None, None, None, *ints),
            "current device and stream": lambda: stream(runtime.current_device_and_stream()[0]),
        }
    return found


def gluon_pieces(c: Case) -> dict:
    """{name: zero-argument call} for the parts of one eager forward on the Gluon kernel (CUDA,
    sm_90, where it serves the case), each timed alone: the plan's path, the repeat launcher (with
    the descriptors' encodings reused, and made by Triton's launcher every launch), the launches'
    arguments, one TMA descriptor's encoding in Triton's launcher; and cuDNN's call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sdpatch.kernels import flash_fwd_hopper as hopper

    q, k, v, _ = (t.detach() for t in inputs(c, "cuda"))
    scale = c.D**-0.5
    if not hopper.serves(q, k, v, None):
        return {}
    hopper.gluon_attn_fwd(q, k, v, scale)
    hopper.gluon_attn_fwd(q, k, v, scale)  # the second launches from the binaries
    again = hopper.gluon_repeat(q, k, v, scale)
    out = torch.empty_like(q)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    found = {"gluon: gluon_attn_fwd": lambda: hopper.gluon_attn_fwd(q, k, v, scale),
             "gluon: launches' arguments": lambda: hopper.launches(q, k, v, out, None, scale, bound=True),
             "sdpa: cuDNN call": cudnn}
    binary = hopper._plans[hopper._plan_key(q, k, v, False)].binaries[("gluon", 0)]
    if again is not None:
        found["gluon: repeat launcher"] = lambda: again(q, k, v)
    if again is not None and binary.encoded is not None:
        encoded = binary.encoded
        # The same repeat, its descriptors encoded by Triton's wrapper every launch: a repeat
        # launcher of its own, whose kept argument lists hold descriptors, not their encodings.
        unencoded = hopper.gluon_repeat(q, k, v, scale)

        def triton_encodes():
            binary.encoded = None
            try:
                unencoded(q, k, v)
            finally:
                binary.encoded = encoded

        found["gluon: repeat, Triton encoding each launch"] = triton_encodes
    meta = getattr(binary.compiled.metadata, "tensordesc_meta", None)
    try:  # Triton 3.5-3.6's encoding of one descriptor per launch (its internals: may be absent)
        from triton.backends.nvidia.driver import make_tensordesc_arg

        desc = hopper.BoundDescriptor(q, list(q.shape), list(q.stride()))
        make_tensordesc_arg(desc, meta[0])
        found["gluon: one descriptor's encoding"] = lambda: make_tensordesc_arg(desc, meta[0])
    except Exception as e:  # noqa: BLE001 - a piece this Triton lacks is left out
        print("no descriptor piece:", type(e).__name__, e)
    return found


def host_us(fn, iters: int, device: str) -> list[float]:
    """us per call of 5 runs of ``iters`` unsynchronized calls, after a warm-up."""
    return alternating_us({"fn": fn}, iters, device)["fn"]


def alternating_us(fns: dict, iters: int, device: str, rounds: int = 5, contexts: dict | None = None) -> dict[str, list[float]]:
    """us per call of each of ``fns``, one figure per round of ``iters`` unsynchronized calls, after a
    warm-up; the calls take turns, each round in the reverse order of the one before (ABBA), so that
    a drift in the host's speed reaches each alike. ``contexts``: {name: context factory} that each
    of that name's runs is inside."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    contexts = contexts or {}
    for name, fn in fns.items():
        with contexts.get(name, contextlib.nullcontext)():
            for _ in range(min(iters, 20)):
                fn()
    sync()
    runs, order = {name: [] for name in fns}, list(fns)
    for _ in range(rounds):
        for name in order:
            with contexts.get(name, contextlib.nullcontext)():
                t = time.perf_counter()
                for _ in range(iters):
                    fns[name]()
                runs[name].append((time.perf_counter() - t) / iters * 1e6)
            sync()
        order.reverse()
    return runs


def profile_top(fn, iters: int, lines: int = 15) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


def kernel_table(fn, iters: int = 50) -> str:
    """torch.profiler's table of a call's kernels (CUDA): their GPU time against the host's."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)


def backward_anatomy(c: Case, iters: int = 300, skip: int = 30) -> list[dict]:
    """One backward call per iteration as ``triton.testing.do_bench`` times it, for sdpatch, cuDNN
    and flash (CUDA): medians of the events' GPU time and of the host's time in
    ``torch.autograd.grad`` (with its 10th and 90th percentiles), and for sdpatch the host's time
    to its Python backward, in it, and back to the caller. Each impl's first ``skip`` calls warm up."""
    from torch.nn.attention import sdpa_kernel

    from bench_kernels import SDPA
    from sdpatch.attention.triton_backend import TritonAttention

    marks = {}
    backward = TritonAttention.backward

    def marked(ctx, do):
        marks["in"] = time.perf_counter_ns()
        grads = backward(ctx, do)
        marks["out"] = time.perf_counter_ns()
        return grads

    q, k, v = (torch.randn(c.B, c.H, n, c.D, device="cuda", dtype=torch.float16, requires_grad=True) for n in (c.Nq, c.Nk, c.Nk))
    do = torch.randn_like(q)
    outs = {"sdpatch": sdpatch.attention(q, k, v, backend="triton")}
    for name in ("cudnn", "flash"):
        with sdpa_kernel(SDPA[name]):
            outs[name] = F.scaled_dot_product_attention(q, k, v)
    cache = torch.empty(256 * 2**20 // 4, dtype=torch.int, device="cuda")  # do_bench's L2 flush
    rows = []
    TritonAttention.backward = staticmethod(marked)
    try:
        for name, out in outs.items():
            calls = []
            for _ in range(iters):
                cache.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter_ns()
                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                t1 = time.perf_counter_ns()
                end.record()
                calls.append((start, end, t0, t1, marks.get("in"), marks.get("out")))
            torch.cuda.synchronize()
            calls = calls[skip:]
            host = sorted((t1 - t0) / 1e3 for _, _, t0, t1, _, _ in calls)
            row = dict(case=c.name, impl=name, gpu_us=statistics.median(s.elapsed_time(e) * 1e3 for s, e, *_ in calls),
                       host_us=statistics.median(host), host_p10_us=host[len(host) // 10], host_p90_us=host[9 * len(host) // 10])
            if name == "sdpatch":
                row |= dict(to_backward_us=statistics.median((i - t0) / 1e3 for _, _, t0, _, i, _ in calls),
                            backward_us=statistics.median((o - i) / 1e3 for *_, i, o in calls),
                            back_us=statistics.median((t1 - o) / 1e3 for _, _, _, t1, _, o in calls))
            rows.append(row)
            print(row, flush=True)
    finally:
        TritonAttention.backward = backward
    return rows


PARTS = ("calls", "layers", "anatomy", "unet")


def main(device: str = "cuda", iters: int = ITERS, json_path: str | None = None, cases: list[Case] = CASES,
         parts_run: tuple = PARTS) -> list[dict]:
    rows, parts = [], []
    for c in cases if "calls" in parts_run else []:
        fns = calls(c, device)
        for name, runs in alternating_us(fns, iters, device).items():
            rows.append(dict(case=c.name, impl=name, best_us=min(runs), median_us=statistics.median(runs)))
            print(f"{c.name:14s} {name:16s} host us/call: best {min(runs):6.0f}  median {statistics.median(runs):6.0f}", flush=True)
        print(profile_top(fns["sdpatch fwd+bwd"], iters), flush=True)
        if device == "cuda":
            for name in ("sdpatch fwd+bwd", "sdpa fwd+bwd"):
                print(name, kernel_table(fns[name]), sep="\n", flush=True)
        for name, fn in pieces(c, device).items():
            runs = host_us(fn, iters, device)
            parts.append(dict(case=c.name, piece=name, best_us=min(runs)))
            print(f"{c.name:14s}   {name:34s} host us/call: best {min(runs):6.1f}", flush=True)
    layer_rows = []
    for c in LAYER_CASES if device == "cuda" and "layers" in parts_run else []:
        fns, contexts = layer_calls(c, device)
        for name, runs in alternating_us(fns, iters, device, contexts=contexts).items():
            layer_rows.append(dict(case=c.name, impl=name, best_us=min(runs), median_us=statistics.median(runs)))
            print(f"{c.name:20s} {name:14s} us/call: best {min(runs):6.1f}  median {statistics.median(runs):6.1f}", flush=True)
    print(environment())
    if layer_rows:
        # Unsynchronized calls: each figure is the larger of the host's and the GPU's time per call.
        print("| layer, eager, no grad | stock AttnProcessor2_0 us | sdpatch us | sdpatch / stock | sdpatch, FA2 only, us | FA2 only / stock"
              " | sdpatch, Gluon wherever it serves, us | Gluon / stock |")
        print("|---|---|---|---|---|---|---|---|")
        med = {(r["case"], r["impl"]): r["median_us"] for r in layer_rows}
        for c in LAYER_CASES:
            theirs, ours, fa2, gluon = (med[c.name, n] for n in ("stock layer", "sdpatch layer", "sdpatch fa2 layer", "sdpatch gluon layer"))
            print(f"| {c.name} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f} | {fa2:.1f} | {fa2 / theirs:.2f} | {gluon:.1f} | {gluon / theirs:.2f} |")
        for c in (c for c in LAYER_CASES if c.name in PROFILED_LAYERS):
            for name, fn in gluon_pieces(c).items():
                runs = host_us(fn, iters, device)
                parts.append(dict(case=c.name, piece=name, best_us=min(runs)))
            fns, contexts = layer_calls(c, device)
            for name in ("sdpatch layer", "sdpatch gluon layer"):
                with contexts[name]():
                    fns[name]()
                    print(c.name, name, profile_top(fns[name], iters, lines=25), sep="\n")
    print("| case | call | sdpatch us | SDPA us | difference us |")
    print("|---|---|---|---|---|")
    best = {(r["case"], r["impl"]): r["best_us"] for r in rows}
    for c in cases if rows else []:
        for part in ("fwd", "fwd+bwd"):
            ours, theirs = best[c.name, f"sdpatch {part}"], best[c.name, f"sdpa {part}"]
            print(f"| {c.name} | {part} | {ours:.0f} | {theirs:.0f} | {ours - theirs:+.0f} |")
    print("\n| case | piece | host us |\n|---|---|---|")
    for p in parts:
        print(f"| {p['case']} | {p['piece']} | {p['best_us']:.1f} |")
    anatomy = [r for c in ANATOMY_CASES for r in backward_anatomy(c)] if device == "cuda" and "anatomy" in parts_run else []
    if anatomy:
        print("\n| case | impl | GPU us (events) | host us in autograd.grad: median (p10-p90) | sdpatch: to backward / backward / back us |")
        print("|---|---|---|---|---|")
    for r in anatomy:
        parts_us = " / ".join(f"{r[k]:.0f}" for k in ("to_backward_us", "backward_us", "back_us")) if "backward_us" in r else "–"
        print(f"| {r['case']} | {r['impl']} | {r['gpu_us']:.0f} | {r['host_us']:.0f} ({r['host_p10_us']:.0f}–{r['host_p90_us']:.0f}) | {parts_us} |")
    unets = [r for p, n in UNET_CASES for r in unet_anatomy(p, n)] if device == "cuda" and "unet" in parts_run else []
    if unets:
        print("\n| UNet call, eager | impl | host ms to enqueue | wall ms | ABBA median ms (3 calls) | × stock, paired (quartiles) "
              "| Gluon repeat lookups / address sets | syncs |")
        print("|---|---|---|---|---|---|---|---|")
    for r in unets:
        med, q1, q3 = r["paired_vs_stock"]
        host = f"{r['host_ms']:.1f} | {r['wall_ms']:.1f}" if "host_ms" in r else "– | –"
        sets = f"{r['gluon_lookups']} / {r['gluon_address_sets']}" if "gluon_lookups" in r else "–"
        print(f"| {r['case']} | {r['impl']} | {host} | {r['abba_ms']:.1f} | {med:.3f} ({q1:.3f}–{q3:.3f}) | {sets} | "
              f"{r.get('syncs', '–')} {r.get('sync_kinds', '')} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": environment(), "rows": rows, "layers": layer_rows, "pieces": parts, "anatomy": anatomy,
                       "unet": unets}, f, indent=1)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    args = ap.parse_args()
    main(json_path=args.json, parts_run=tuple(args.parts.split(",")))
