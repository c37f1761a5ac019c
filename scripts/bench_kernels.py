"""Attention kernel benchmark at Stable Diffusion shapes: sdpatch vs PyTorch's SDPA backends and FA4.

One command (needs a CUDA GPU):

    python scripts/bench_kernels.py --json bench_kernels.json

For every case it times, with ``triton.testing.do_bench`` medians after warm-up, on fresh
random inputs: sdpatch's Triton kernel (the launcher) and the public ``sdpatch.attention`` call,
PyTorch SDPA pinned to cuDNN, flash and efficient, and naive matmul + softmax where it fits.
It reports TFLOP/s (4·B·H·Nq·Nk·D forward, 2.5× that backward, with the true D), the ratio to
cuDNN, the relative error of sdpatch against a float64 reference, the extra peak memory, the
first-call latency of sdpatch (compile and autotune included), and kernel time alone, by CUDA-graph
replay, for sdpatch's kernels (with K and V through TMA too, where the default does not take it),
cuDNN's forward, and cuDNN's and flash's backward ops: at 77 keys or 1024 tokens a call's host work
(Python, launches) outlasts its kernels, and the two figures tell which one a ratio measures.
sdpatch's per-call figures are eager calls, on the forward variant the launch layer picks for them;
its kernel time is that of the calls a CUDA graph holds (``sdpatch.kernels.forward.for_capture``):
on Hopper below ``EAGER_GLUON_MIN_FLOP``, where the Gluon grid would split its last wave, these are
the Triton and the Gluon kernel respectively, so the forward's eager kernel is also timed by graph
replay on its own ("sdpatch eager" among the graph columns): per call against cuDNN, it is the
kernel that runs. Where that is the Triton kernel and the Gluon one would serve, "gluon eager" is
the public call with the Gluon kernel serving eager calls too (``EAGER_GLUON_MIN_FLOP`` at 0, its
own repeat map), timed per call and paired with cuDNN: where that threshold belongs.
On calls under 2 ms, sdpatch (the public call, a diffusers layer's path), cuDNN and flash are also
timed in turns over ``--rounds`` rounds: the per-round ratios ("paired") cancel the drift of the
host's speed that single figures carry.

FlashAttention-4 ("fa4", ``flash_attn.cute``) is an optional peer, timed where it imports (on the
lent machine it is installed by hand from wheels onto PYTHONPATH) and takes the case's head dim:
per call through its public ``flash_attn_func`` (backward through autograd, as the SDPA peers), and
kernel time by CUDA-graph replay of the forward call and of the backward op autograd calls. Its
inputs are (B, N, H, D) copies made before any timing. Its result is checked against the float64
reference like sdpatch's; a relative error over ``REL_ERR_BUDGET`` is flagged in the table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import sdpatch
from sdpatch.kernels import flash_bwd, flash_bwd_hopper, flash_fwd_hopper
from sdpatch.kernels.flash_bwd import flash_attn_bwd
from sdpatch.kernels.flash_fwd import kv_tma_ok, tuned_config
from sdpatch.kernels import forward
from sdpatch.kernels.forward import flash_attn_fwd
from sdpatch.kernels.shared import head_dim_parts
from sdpatch.attention.naive import attention_ref

from _bench import Case, chosen, environment, graph_tflops, launch_policy, paired_ratio, peak_over, rel_err

SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
NAIVE_LIMIT = 48 * 2**30  # bytes of fp16 scores + probabilities past which naive is skipped
REF_ROWS = 512  # queries checked against float64 (the reference materializes its scores)
PAIRED = ("sdpatch", "gluon eager", "cudnn", "flash")  # timed in turns, round by round (see measure_paired)
PAIRED_MAX_MS = 2.0  # calls longer than this are kernel-bound: the host's drift cannot move their ratios
REL_ERR_BUDGET = 1e-2  # fp16/bf16 error against float64 past which a result is wrong (check_gpu.py's RTOL)


CASES = [
    Case("hd40 4096", 2, 8, 4096, 4096, 40),
    Case("hd40 16384", 2, 8, 16384, 16384, 40),
    Case("hd40 65536", 2, 8, 65536, 65536, 40),
    Case("hd80 4096", 2, 8, 4096, 4096, 80),
    Case("hd160 1024", 2, 8, 1024, 1024, 160),
    Case("hd64 4096", 2, 10, 4096, 4096, 64),
    Case("hd64 1024", 2, 20, 1024, 1024, 64),
    Case("x77 hd40 4096", 2, 8, 4096, 77, 40),
    Case("x77 hd64 4096", 2, 10, 4096, 77, 64),
    Case("vae hd512 16384", 1, 1, 16384, 16384, 512, sdpatch_backend="chunked"),
    Case("hd40 4096 bf16", 2, 8, 4096, 4096, 40, dtype="bf16"),
    Case("hd40 16384 bf16", 2, 8, 16384, 16384, 40, dtype="bf16"),
    Case("bwd hd40 4096", 2, 8, 4096, 4096, 40, backward=True),
    Case("bwd hd40 16384", 2, 8, 16384, 16384, 40, backward=True),
    Case("bwd hd80 4096", 2, 8, 4096, 4096, 80, backward=True),
    Case("bwd hd160 1024", 2, 8, 1024, 1024, 160, backward=True),
    Case("bwd hd64 4096", 2, 10, 4096, 4096, 64, backward=True),
    Case("bwd x77 hd40 4096", 2, 8, 4096, 77, 40, backward=True),
    Case("bwd x77 hd64 4096", 2, 10, 4096, 77, 64, backward=True),
]


@dataclass
class Row:
    case: Case
    tflops: dict = field(default_factory=dict)  # impl -> TFLOP/s (None: refused or OOM)
    ms: dict = field(default_factory=dict)
    extra_mib: dict = field(default_factory=dict)
    graph_tflops: dict = field(default_factory=dict)  # impl -> TFLOP/s by CUDA-graph replay: kernel time, no host
    rel_err: float | None = None
    first_call_s: float | None = None
    tuned_config: str | None = None  # the autotuner's picks for sdpatch's kernels, for pruning their lists
    paired: dict = field(default_factory=dict)  # impl -> sdpatch's speed over it per round: median, quartiles
    rounds_ms: dict = field(default_factory=dict)  # impl -> its ms per call in each paired round
    fa4_rel_err: float | None = None  # FA4's output (forward) or dQ (backward) against float64, as rel_err
    grad_errs: dict = field(default_factory=dict)  # backward: "dk", "dv" of one head, each path, against float64


def naive(q, k, v, scale):
    return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, -1) @ v


def measure(row: Row, impl: str, fn, flops: float, out_bytes: int, context=contextlib.nullcontext) -> None:
    try:
        with context():
            fn()  # warm-up outside the timing: compile, autotune, cuDNN plans
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            row.ms[impl] = ms
            row.tflops[impl] = flops / ms / 1e9
            row.extra_mib[impl] = (peak_over(fn)[1] - out_bytes) / 2**20
    except (RuntimeError, torch.OutOfMemoryError) as e:  # a backend refusing the shape is a result
        row.ms[impl] = row.tflops[impl] = row.extra_mib[impl] = None
        print(f"  {row.case.name}: {impl} unavailable: {str(e).splitlines()[0][:100]}")
    torch.cuda.empty_cache()


def captured(fn):
    """``fn()`` as sdpatch.graphs warms up and captures a call: the forward's Gluon kernel serves
    wherever it can (sdpatch.kernels.forward.for_capture)."""
    with forward.for_capture():
        return fn()


def measure_graph(row: Row, impl: str, fn, flops: float) -> None:
    """Kernel time alone: CUDA-graph replay takes the host (Python, launches) out of the figure."""
    try:
        row.graph_tflops[impl] = graph_tflops(flops, fn)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        row.graph_tflops[impl] = None
        print(f"  {row.case.name}: {impl} not capturable: {str(e).splitlines()[0][:100]}")


class triton_two_pass:
    """Within: the backward on the Triton kernels' two passes, not the Gluon ones (new plans)."""

    def __enter__(self):
        self.saved = flash_bwd_hopper.ENABLED, flash_bwd_hopper.ONE_PASS
        flash_bwd_hopper.ENABLED = flash_bwd_hopper.ONE_PASS = False
        flash_bwd._bwd_plans.clear()

    def __exit__(self, *exc):
        flash_bwd_hopper.ENABLED, flash_bwd_hopper.ONE_PASS = self.saved
        flash_bwd._bwd_plans.clear()


def head_grads_ref(q, k, v, do) -> tuple[torch.Tensor, torch.Tensor] | None:
    """dK and dV of batch 0, head 0 in float64 (every query: a key's gradient sums over them), or
    None where its scores would pass 2**28 entries."""
    if q.shape[2] * k.shape[2] > 2**28:
        return None
    q64, k64, v64 = (t[:1, :1].detach().double().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(attention_ref(q64, k64, v64), (k64, v64), do[:1, :1].double())


def grad_errs(grads: tuple, ref) -> dict:
    """dK's and dV's relative errors in batch 0, head 0, against :func:`head_grads_ref`'s."""
    if ref is None:
        return {}
    return {name: rel_err(g[:1, :1], r) for name, g, r in zip(("dk", "dv"), grads[1:], ref)}


def sdpa_backward(name: str, q, k, v, do, scale: float):
    """A call of SDPA's backward op alone (``"cudnn"`` or ``"flash"``), on a forward run here, for
    CUDA-graph replay: autograd runs a backward on its forward's stream, outside a capture, so
    its kernel time is taken through aten's backward op, as autograd calls it."""
    aten = torch.ops.aten
    q, k, v = (t.detach() for t in (q, k, v))
    if name == "flash":
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)
        return lambda: aten._scaled_dot_product_flash_attention_backward(do, q, k, v, out, lse, cq, ck, mq, mk, 0.0, False,
                                                                         seed, offset, scale=scale)
    out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, scale=scale)
    return lambda: aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk,
                                                                     0.0, False, scale=scale)


def measure_paired(row: Row, fns: dict, rounds: int, contexts: dict | None = None) -> None:
    """sdpatch's per-call speed over cuDNN and flash, timed in turns: each round one short
    ``do_bench`` median per impl, the order reversed every round (ABBA). Per call, a call whose
    host work outlasts its kernels is timed by the host (``bench_host.py``'s anatomy), and the lent
    hosts drift: per-call figures at 77 keys once moved 2.2-2.7x between calls. A round's impls share
    the host's state, so the ratio within a round cancels most of it."""
    names = [n for n in PAIRED if row.ms.get(n) is not None]
    if rounds < 1 or names[:1] != ["sdpatch"] or len(names) < 2 or row.ms["sdpatch"] > PAIRED_MAX_MS:
        return
    times = {n: [] for n in names}
    order = list(names)
    contexts = contexts or {}
    for _ in range(rounds):
        for n in order:
            with contexts.get(n, contextlib.nullcontext)():
                times[n].append(do_bench(fns[n], warmup=5, rep=20, return_mode="median"))
        order.reverse()
    row.rounds_ms = times
    for n in names[1:]:
        row.paired[n] = paired_ratio(times[n], times["sdpatch"])
    if "gluon eager" in times and "cudnn" in times:
        row.paired["gluon eager ×cudnn"] = paired_ratio(times["cudnn"], times["gluon eager"])


def reason(e: BaseException) -> str:
    """An exception's type and first line, for a one-line note: FA4's assertions may carry no text."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:100]}" if lines else type(e).__name__


@functools.cache
def fa4():
    """FA4's ``flash_attn.cute.interface``, or None, with the reason printed once, where it does not
    import: FA4 is an optional peer, none of sdpatch's dependencies, and importing it loads CuTe DSL's
    CUDA libraries, so it is imported on first use, not with this script."""
    try:
        from flash_attn.cute import interface
    except Exception as e:  # not installed (ImportError), or CuTe DSL failing to load its libraries
        print(f"fa4 skipped: flash_attn.cute does not import ({reason(e)})")
        return None
    return interface


def measure_fa4_graph(row: Row, fn, flops: float) -> None:
    """FA4's kernel time by CUDA-graph replay, as :func:`measure_graph`; where the capture fails, FA4
    keeps its per-call figure (``do_bench``, host time included) alone, and the output says so."""
    try:
        row.graph_tflops["fa4"] = graph_tflops(flops, fn)
    except Exception as e:  # CuTe DSL and TVM-FFI raise their own types, not RuntimeError alone
        row.graph_tflops["fa4"] = None
        print(f"  {row.case.name}: fa4 not capturable in a CUDA graph ({reason(e)}); timed by do_bench per call only")


def measure_fa4(row: Row, q, k, v, do, scale: float, flops: float, out_bytes: int) -> torch.Tensor | None:
    """Time FA4 on a case's (B, H, N, D) q, k, v (and dO, for a backward case), per call and by
    graph replay. Returns its output (forward) or dQ (backward) viewed as (B, H, N, D), for the
    float64 check; None where FA4 is absent or refuses the case, with the reason printed."""
    fa = fa4()
    if fa is None:
        return None
    c = row.case
    # FA4 takes (B, N, H, D). Copies made once, here: handed transposed views, it would copy them
    # itself (maybe_contiguous) inside every timed call.
    qf, kf, vf = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v))
    try:
        if not c.backward:
            def fwd():
                return fa.flash_attn_func(qf, kf, vf, softmax_scale=scale)[0]

            got = fwd()  # the first call compiles; a head dim or arch FA4 does not take fails its assertion here
        else:
            dof = do.transpose(1, 2).contiguous()
            leaves = tuple(t.clone().requires_grad_(True) for t in (qf, kf, vf))
            out = fa.flash_attn_func(*leaves, softmax_scale=scale)[0]

            def bwd():
                return torch.autograd.grad(out, leaves, dof, retain_graph=True)

            got = bwd()[0]
    except Exception as e:  # an assertion for a refused shape or CuTe DSL's compile error: a result
        row.ms["fa4"] = row.tflops["fa4"] = row.extra_mib["fa4"] = None
        print(f"  {c.name}: fa4 unavailable: {reason(e)}")
        torch.cuda.empty_cache()
        return None
    if not c.backward:
        measure(row, "fa4", fwd, flops, out_bytes)
        measure_fa4_graph(row, fwd, flops)
        return got.transpose(1, 2)
    measure(row, "fa4", bwd, flops, 3 * out_bytes)
    # The graph replays the op FA4's autograd backward calls (a backward runs outside a capture, as
    # for sdpa_backward), on a forward run here for its log-sum-exp.
    out_d, lse = fa.flash_attn_func(qf, kf, vf, softmax_scale=scale, return_lse=True)

    def op():
        return fa._flash_attn_bwd(qf, kf, vf, out_d, dof, lse, scale)

    try:
        err = rel_err(op()[0], got)
    except Exception as e:  # the private op's signature may move between FA4's betas
        print(f"  {c.name}: fa4 backward op unavailable: {reason(e)}")
        return got.transpose(1, 2)
    if err < 1e-3:  # the op as called here gives autograd's dQ: the same kernels
        measure_fa4_graph(row, op, flops)
    else:
        print(f"  {c.name}: fa4 backward op's dQ differs from autograd's (rel err {err:.1e}); not timed")
    torch.cuda.empty_cache()
    return got.transpose(1, 2)


def check_err(row: Row, impl: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    """``got``'s relative error against the float64 ``ref``, with a line printed where it is over budget."""
    err = ((got.double() - ref).norm() / ref.norm()).item()
    if not err <= REL_ERR_BUDGET:  # NaN fails too
        print(f"  {row.case.name}: {impl} WRONG: rel err {err:.1e} against float64 (budget {REL_ERR_BUDGET:.0e})")
    return err


def run_case(c: Case, rounds: int) -> Row:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[c.dtype]
    torch.manual_seed(hash(c.name) % 2**31)
    q = torch.randn(c.B, c.H, c.Nq, c.D, device="cuda", dtype=dtype)
    k = torch.randn(c.B, c.H, c.Nk, c.D, device="cuda", dtype=dtype)
    v = torch.randn(c.B, c.H, c.Nk, c.D, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(c.D)
    flops = 4 * c.B * c.H * c.Nq * c.Nk * c.D * (2.5 if c.backward else 1)
    out_bytes = q.numel() * q.element_size()
    row = Row(c)

    def ours():
        if c.sdpatch_backend == "triton":
            return flash_attn_fwd(q, k, v, scale)[0]
        return sdpatch.attention(q, k, v, backend=c.sdpatch_backend)

    def public():
        return sdpatch.attention(q, k, v, backend=c.sdpatch_backend)

    impls = {"sdpatch": ours, "sdpatch.attention": public}
    if c.sdpatch_backend == "triton" and head_dim_parts(c.D)[1] and not c.backward:
        # The head dim tiled as one padded power of two, to measure what the two-part tiling buys.
        impls["one tile"] = lambda: flash_attn_fwd(q, k, v, scale, split_head_dim=False)[0]
    if c.sdpatch_backend == "triton" and not c.backward and c.Nk > 128 and kv_tma_ok(k, v):
        # K and V through TMA, forced: by default only the longest kernels take it (host cost).
        impls["kv_tma"] = lambda: flash_attn_fwd(q, k, v, scale, kv_tma=True)[0]
    contexts = {}
    if c.sdpatch_backend == "triton" and not c.backward and flash_fwd_hopper.serves(q, k, v, None) \
            and not forward.gluon_serves(q, k, v, None):
        # Eager calls stay on the Triton kernel here (EAGER_GLUON_MIN_FLOP): the public call with
        # the Gluon kernel serving them instead, the measure of where that threshold belongs.
        impls["gluon eager"], contexts["gluon eager"] = public, launch_policy(gluon_min_flop=0)
    for name, backend in SDPA.items():
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        impls[name] = sdpa
    if 2 * c.B * c.H * c.Nq * c.Nk * 2 <= NAIVE_LIMIT:
        impls["naive"] = lambda: naive(q, k, v, scale)
    if c.backward:
        impls.pop("sdpatch.attention")

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = public() if not c.backward else None
    if c.backward:
        for t in (q, k, v):
            t.requires_grad_(True)
        do = torch.randn_like(q)
        graphs = {}
        for name, f in list(impls.items()):
            def fwd(f=f, name=name):
                return sdpatch.attention(q, k, v, backend="triton") if name.startswith("sdpatch") else f()
            try:
                graphs[name] = fwd()
            except RuntimeError:
                graphs[name] = None

        def bwd(name):
            return lambda: torch.autograd.grad(graphs[name], (q, k, v), do, retain_graph=True)

        first = torch.autograd.grad(graphs["sdpatch"], (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
        # the tiles of the plan just made (shipped or autotuned): the tuners hold none when shipped ones serve
        row.tuned_config = str(list(flash_bwd._bwd_plans.values())[-1].configs)
        row.first_call_s = time.perf_counter() - t0
        for name in impls:
            if graphs[name] is None:
                row.ms[name] = row.tflops[name] = row.extra_mib[name] = None
                continue
            measure(row, name, bwd(name), flops, 3 * out_bytes)
        measure_paired(row, {name: bwd(name) for name in PAIRED if name in graphs}, rounds)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        out_f, lse = flash_attn_fwd(qd, kd, vd, scale, return_lse=True)
        measure_graph(row, "sdpatch", lambda: flash_attn_bwd(do, qd, kd, vd, out_f, lse, scale), flops)
        ref_kv = head_grads_ref(qd, kd, vd, do)
        row.grad_errs["sdpatch"] = grad_errs(flash_attn_bwd(do, qd, kd, vd, out_f, lse, scale), ref_kv)
        if flash_bwd_hopper.one_pass_serves(qd, kd, vd, do, None) or flash_bwd_hopper.serves(qd, kd, vd, do, None):
            # a Gluon backward served: the Triton kernels' two passes beside
            with triton_two_pass():
                measure_graph(row, "two pass", lambda: flash_attn_bwd(do, qd, kd, vd, out_f, lse, scale), flops)
                row.grad_errs["two pass"] = grad_errs(flash_attn_bwd(do, qd, kd, vd, out_f, lse, scale), ref_kv)
        for name in ("cudnn", "flash"):
            if graphs[name] is None:
                continue
            try:
                fn = sdpa_backward(name, q, k, v, do, scale)
                err = rel_err(fn()[0], bwd(name)()[0])
            except RuntimeError as e:
                print(f"  {c.name}: {name} backward op unavailable: {str(e).splitlines()[0][:100]}")
                continue
            if err < 1e-3:  # the op as called here gives autograd's dQ for that backend: the same kernels
                measure_graph(row, name, fn, flops)
            else:
                print(f"  {c.name}: {name} backward op's dQ differs from autograd's (rel err {err:.1e}); not timed")
        fa4_dq = measure_fa4(row, q, k, v, do, scale, flops, out_bytes)
        # dq against float64 on a slice of rows: a row's dq depends only on that row.
        n = min(REF_ROWS, c.Nq)
        q64 = q[:1, :1, :n].detach().double().requires_grad_()
        k64, v64 = (t[:1, :1].detach().double() for t in (k, v))
        ref = torch.autograd.grad(attention_ref(q64, k64, v64), q64, do[:1, :1, :n].double())[0]
        row.rel_err = check_err(row, "sdpatch", first[0][:1, :1, :n], ref)
        if fa4_dq is not None:
            row.fa4_rel_err = check_err(row, "fa4", fa4_dq[:1, :1, :n], ref)
        return row

    torch.cuda.synchronize()
    row.first_call_s = time.perf_counter() - t0
    for name, f in impls.items():
        measure(row, name, f, flops, out_bytes, contexts.get(name, contextlib.nullcontext))
    # Paired, sdpatch is the public call: a layer's path, whose eager repeats keep their launch
    # arguments; the launcher's column takes the full launch every call.
    measure_paired(row, {**impls, "sdpatch": public}, rounds, contexts)
    if c.sdpatch_backend == "triton":
        row.tuned_config = str(tuned_config(q, k, v, scale))
        measure_graph(row, "sdpatch", lambda: captured(ours), flops)
        measure_graph(row, "sdpatch eager", ours, flops)
        if "kv_tma" in impls:
            measure_graph(row, "kv_tma", impls["kv_tma"], flops)
        measure_graph(row, "cudnn", impls["cudnn"], flops)
    fa4_out = measure_fa4(row, q, k, v, None, scale, flops, out_bytes)
    n = min(REF_ROWS, c.Nq)
    ref = attention_ref(q[:1, :1, :n], k[:1, :1], v[:1, :1])
    row.rel_err = check_err(row, "sdpatch", first[:1, :1, :n], ref)
    if fa4_out is not None:
        row.fa4_rel_err = check_err(row, "fa4", fa4_out[:1, :1, :n], ref)
    return row


def fmt(x, spec=".0f"):
    return "–" if x is None else format(x, spec)


def paired(stats: tuple | None) -> str:
    """A paired ratio as 'median (lower-upper quartile)'."""
    return "–" if stats is None else f"{stats[0]:.2f} ({stats[1]:.2f}–{stats[2]:.2f})"


def err_cell(x: float | None) -> str:
    """A relative error, marked where it is over budget."""
    return fmt(x, ".1e") + (" WRONG" if x is not None and not x <= REL_ERR_BUDGET else "")


def table(rows: list[Row]) -> str:
    impls = ["sdpatch", "sdpatch.attention", "gluon eager", "one tile", "kv_tma", "cudnn", "flash", "efficient", "naive", "fa4"]
    graphed = ("sdpatch", "sdpatch eager", "two pass", "kv_tma", "cudnn", "flash", "fa4")
    head = ("| case | " + " | ".join(impls) + " | ×cuDNN | ×flash | ×fa4 | graph: " + " / ".join(graphed)
            + " | graph ×fa4 | rel err (sdpatch / fa4) | extra MiB (sdpatch / naive) | first call s | paired ×cuDNN | paired ×flash | gluon eager, paired ×cuDNN |")
    lines = [head, "|" + "---|" * (len(impls) + 12)]
    for r in rows:
        t, g = r.tflops, r.graph_tflops
        ours = t.get("sdpatch")
        ratio = lambda other: fmt(ours / t[other], ".2f") if ours and t.get(other) else "–"  # noqa: E731
        # sdpatch over FA4 in kernel time alone: FA4's per-call host work is large, so ×fa4 per call
        # can measure the host where this one measures the kernels.
        graph_ratio = fmt(g["sdpatch"] / g["fa4"], ".2f") if g.get("sdpatch") and g.get("fa4") else "–"
        lines.append(
            f"| {r.case.name} | " + " | ".join(fmt(t.get(i)) for i in impls)
            + f" | {ratio('cudnn')} | {ratio('flash')} | {ratio('fa4')}"
            + f" | {' / '.join(fmt(g.get(i)) for i in graphed)} | {graph_ratio}"
            + f" | {err_cell(r.rel_err)} / {err_cell(r.fa4_rel_err)}"
            + f" | {fmt(r.extra_mib.get('sdpatch'), '.1f')} / {fmt(r.extra_mib.get('naive'), '.0f')} | {fmt(r.first_call_s, '.1f')}"
            + "".join(f" | {paired(r.paired.get(i))}" for i in ("cudnn", "flash", "gluon eager ×cudnn")) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--only", help='case names\' substrings, "fwd" or "bwd", comma-separated; "+" joins parts (see _bench.chosen)')
    ap.add_argument("--rounds", type=int, default=9,
                    help=f"rounds of sdpatch, cuDNN and flash timed in turns, on calls under {PAIRED_MAX_MS} ms (0: none)")
    args = ap.parse_args()
    cases = [c for c in CASES if chosen(c, args.only)]
    rows = []
    for c in cases:
        rows.append(run_case(c, args.rounds))
        print(f"done {c.name}", flush=True)
    env = environment()
    if fa4() is not None:
        try:
            env["fa4"] = metadata.version("flash-attn-4")
        except metadata.PackageNotFoundError:  # imported from a source tree: no distribution to ask
            env["fa4"] = "unknown"
    print(env)
    print("TFLOP/s (forward 4·B·H·Nq·Nk·D; backward ×2.5)")
    print(table(rows))
    for r in rows:
        if r.grad_errs:
            print(f"{r.case.name}: dK, dV rel err against float64 (batch 0, head 0): {r.grad_errs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
