"""The GPU scripts' own logic, on the CPU through the Triton interpreter: a script that breaks should
break here, not on a lent GPU (a 2-D mask once stopped scripts/sanitize_kernels.py there)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from _bench import Case, case_tensors, chosen, mixed_sms, paired_ratio, probe_forward  # noqa: E402
import peak_where  # noqa: E402
import probe_bwd_tma  # noqa: E402
import probe_exp16  # noqa: E402
import probe_maxnreg  # noqa: E402
import probe_ws  # noqa: E402
import sanitize_kernels  # noqa: E402
import sweep_configs  # noqa: E402

from sdpatch.kernels.flash_bwd import flash_attn_bwd  # noqa: E402
from sdpatch.reference import attention_ref  # noqa: E402
from test_attention import RTOL, rel_err  # noqa: E402

SMALL_TILE = (16, 16, 4, 1)


def test_sanitize_script_checks_every_shape_and_tile():
    """The very launches compute-sanitizer watches on the GPU, each checked against float64."""
    assert sanitize_kernels.main("cpu") == 0


@pytest.mark.parametrize(
    "case",
    [
        sweep_configs.Case("fwd-D80", 1, 2, 33, 64, 80),
        sweep_configs.Case("fwd-x77-D40", 1, 2, 20, 77, 40),
        sweep_configs.Case("bwd-D80", 1, 2, 32, 48, 80, backward=True),
    ],
    ids=lambda c: c.name,
)
def test_sweep_launches_every_variant(case):
    """Each variant the sweep times (tilings, K/V loads, dK/dV and dQ tiles) computes attention."""
    tensors = sweep_configs.case_tensors(case, device="cpu")
    q, k, v = tensors[:3]
    variants = {(kind, label) for _, kind, label, _ in sweep_configs.tasks(case)}
    assert variants  # every kind and label the GPU run would time
    for kind, label in sorted(variants):
        result = sweep_configs.launcher((case, kind, label, SMALL_TILE), tensors)()
        if kind == "fwd":
            assert rel_err(result, attention_ref(q, k, v)) <= RTOL[torch.float16], label
        else:
            do, out, lse = tensors[3:]
            expected = flash_attn_bwd(do, q, k, v, out, lse, 1 / math.sqrt(case.D))
            for got, want in zip(result, expected):
                assert rel_err(got, want.double()) <= RTOL[torch.float16], (kind, label)


@pytest.mark.parametrize("probe", [probe_exp16, probe_maxnreg, probe_ws], ids=lambda m: m.__name__)
def test_forward_probe_variants_compute_attention(probe):
    """Every kernel variant a forward probe times gives attention (float64 check of its main loop,
    query tails and head dims 40 and 64 included); only the GPU timing fails here, and is recorded."""
    cases = [Case("D40", 2, 2, 45, 32, 40), Case("D64", 1, 2, 33, 16, 64)]
    rows = probe_forward([SMALL_TILE], probe.impls_for, cases, device="cpu")
    names = [n for n in probe.impls_for(None, None, None, 1.0, {}) if n != "sdpatch-tma"]  # TMA needs a GPU
    checked = [r for r in rows if r["impl"].split()[0] in names]
    assert len(checked) == len(cases) * len(names)
    for r in checked:
        assert r["rel_err"] is not None and r["rel_err"] <= RTOL[torch.float16], (r["case"], r["impl"], r["error"])


@pytest.mark.parametrize("case", [Case("B1-H2-N64x32-D40", 1, 2, 64, 32, 40, backward=True),
                                  Case("B2-H1-N32x48-D64", 2, 1, 32, 48, 64, backward=True)], ids=lambda c: c.name)
def test_onepass_backward_probe_gives_gradients(case):
    """The one-pass backward probe (its pointer-atomic path: the interpreter has no TMA reductions)
    against float64 gradients, with two and three key blocks adding into one dQ."""
    q, k, v, do, out, lse = case_tensors(case, device="cpu")
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    grads = probe_bwd_tma.onepass_bwd(do, q, k, v, out, lse, 1 / math.sqrt(case.D), config, dq_tma=False)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64), (q64, k64, v64), do.double())
    for name, got, want in zip("qkv", grads, ref):
        assert rel_err(got, want) <= RTOL[torch.float16], f"d{name}"


def test_paired_ratio_cancels_shared_load():
    """Rounds that ran side by side share the host's load: a variant 10 % slower than stock in every
    round is 1.10 however much the rounds themselves differ."""
    stock = [100.0, 180.0, 120.0, 300.0, 140.0]
    ratio, q1, q3 = paired_ratio([1.1 * t for t in stock], stock)
    assert (round(ratio, 6), round(q1, 6), round(q3, 6)) == (1.1, 1.1, 1.1)
    ratio, q1, q3 = paired_ratio([110.0, 170.0, 150.0, 300.0, 140.0], stock)
    assert ratio == 1.0 and q1 < 1.0 < q3


def test_paired_bench_times_impls_in_turns(monkeypatch):
    """bench_kernels' paired rounds: impls alternate ABBA, and each ratio is sdpatch's speed over the
    other impl in the same round; kernel-bound calls and missing impls are skipped."""
    import bench_kernels

    calls = []
    monkeypatch.setattr(bench_kernels, "do_bench", lambda fn, **kw: fn())

    def timed(name, ms):
        return lambda: calls.append(name) or ms[len([c for c in calls if c == name]) - 1]

    row = bench_kernels.Row(Case("x", 1, 1, 8, 8, 8), ms={"sdpatch": 0.1, "cudnn": 0.2, "flash": None})
    fns = {"sdpatch": timed("sdpatch", [1.0, 2.0, 1.0]), "cudnn": timed("cudnn", [1.5, 3.0, 2.0])}
    bench_kernels.measure_paired(row, fns, rounds=3)
    assert calls == ["sdpatch", "cudnn", "cudnn", "sdpatch", "sdpatch", "cudnn"]
    assert row.paired["cudnn"][0] == 1.5 and "flash" not in row.paired
    assert "| 1.50 (" in bench_kernels.table([row])

    for ms in ({"sdpatch": 5.0, "cudnn": 4.0}, {"sdpatch": None, "cudnn": 0.2}):  # kernel-bound; sdpatch refused
        skipped = bench_kernels.Row(Case("x", 1, 1, 8, 8, 8), ms=ms)
        bench_kernels.measure_paired(skipped, fns, rounds=3)
        assert skipped.paired == {}


def test_peaks_over_counts_blocks_and_requested_bytes_beyond_what_was_live(monkeypatch):
    """_bench.peaks_over: each kind's peak during the call, less what was live before it; the
    allocator's blocks (rounded, remainders kept), the tensors' requested bytes and the reserved
    segments apart."""
    import _bench

    stats = iter([
        {"allocated_bytes.all.current": 1000, "allocated_bytes.all.peak": 5000, "requested_bytes.all.current": 900,
         "requested_bytes.all.peak": 4000, "reserved_bytes.all.current": 2048, "reserved_bytes.all.peak": 8192},
        {"allocated_bytes.all.current": 1100, "allocated_bytes.all.peak": 3600, "requested_bytes.all.current": 950,
         "requested_bytes.all.peak": 3000, "reserved_bytes.all.current": 4096, "reserved_bytes.all.peak": 6144},
    ])
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: next(stats))
    out, peaks = _bench.peaks_over(lambda: "done")
    assert out == "done" and peaks == {"allocated": 2600, "requested": 2100, "reserved": 4096}


def test_host_bench_times_every_call():
    """bench_host.py's calls (forward, and forward plus backward through autograd) run and are timed."""
    import bench_host

    rows = bench_host.main("cpu", iters=2, cases=[Case("B1-H1-N16x8-D40", 1, 1, 16, 8, 40)])
    assert sorted(r["impl"] for r in rows) == ["sdpa fwd", "sdpa fwd+bwd", "sdpatch fwd", "sdpatch fwd+bwd"]
    assert all(r["best_us"] > 0 for r in rows)
    found = bench_host.pieces(Case("B1-H1-N16x16-D40", 1, 1, 16, 16, 40), "cpu")
    assert "flash_attn_bwd" in found and not any(name.startswith("launch") for name in found)  # no binaries on CPU
    for fn in found.values():
        fn()


def _event(action, addr, size, line=None):
    frames = [{"filename": "/site/diffusers/models/attention_processor.py", "line": line, "name": "__call__"}] if line else []
    return {"action": action, "addr": addr, "size": size, "frames": frames}


@pytest.mark.parametrize(
    "trace,peak,alive",
    [
        pytest.param([_event("alloc", 1, 10, 1), _event("alloc", 2, 5, 2), _event("free_requested", 1, 10),
                      _event("alloc", 3, 20, 3), _event("free_requested", 3, 20)],
                     25, {"attention_processor.py:2 __call__": 5, "attention_processor.py:3 __call__": 20},
                     id="peak-after-a-free"),
        pytest.param([_event("alloc", 1, 30, 1), _event("free_requested", 1, 30), _event("alloc", 1, 20, 2)],
                     30, {"attention_processor.py:1 __call__": 30}, id="address-reused-below-the-peak"),
        pytest.param([_event("free_requested", 9, 4), _event("alloc", 2, 8)], 8, {"?": 8}, id="freed-before-recording"),
    ],
)
def test_peak_replay_finds_what_is_alive_at_the_peak(trace, peak, alive):
    """peak_where.py's replay of a recorded trace: the peak, and the bytes alive then by the line
    that allocated them (frees of blocks allocated before recording began are ignored)."""
    found, _, at_peak = peak_where.live_at_peak(trace)
    assert found == peak and dict(at_peak) == alive


@pytest.mark.parametrize(
    "only,picked",
    [
        (None, ["hd40 4096", "x77 hd40 4096", "bwd hd40 4096", "bwd x77 hd40 4096"]),
        ("bwd", ["bwd hd40 4096", "bwd x77 hd40 4096"]),
        ("fwd", ["hd40 4096", "x77 hd40 4096"]),
        ("x77", ["x77 hd40 4096", "bwd x77 hd40 4096"]),
        ("bwd+x77", ["bwd x77 hd40 4096"]),
        ("fwd+x77,bwd+hd40 4096", ["x77 hd40 4096", "bwd hd40 4096", "bwd x77 hd40 4096"]),
    ],
    ids=lambda x: str(x),
)
def test_only_picks_cases_by_name_and_kind(only, picked):
    """The benchmark scripts' --only: substrings, kinds, and parts joined by "+" that must all match."""
    cases = [Case("hd40 4096", 1, 1, 16, 16, 40), Case("x77 hd40 4096", 1, 1, 16, 77, 40),
             Case("bwd hd40 4096", 1, 1, 16, 16, 40, backward=True), Case("bwd x77 hd40 4096", 1, 1, 16, 77, 40, backward=True)]
    assert [c.name for c in cases if chosen(c, only)] == picked


MIXED_SMS = [  # (B, H, Nq, Nk, Gluon config, SMs): the GPU checks' grids of two tile sizes
    (2, 3, 1000, 2000, (64, 128, 2, 3), 21),  # 36 tiles of 192 rows over 21 SMs: 1.7 waves
    (2, 10, 4096, 77, (64, 128, 2, 3), 258),
    (1, 2, 4097, 4097, (64, 128, 2, 2), 0),  # two consumers: a tile of one is no faster (tile_cost)
    (1, 2, 97, 97, (128, 64, 2, 2), 0),
]


@pytest.mark.parametrize("B,H,Nq,Nk,config,sms", MIXED_SMS, ids=[f"B{b}-H{h}-N{q}x{k}-x{c[3]}" for b, h, q, k, c, _ in MIXED_SMS])
def test_mixed_sms(B, H, Nq, Nk, config, sms):
    """The SM count the GPU checks lay a grid of two tile sizes out for: one whose grid mixes them."""
    from sdpatch.kernels.flash_fwd_hopper import grid_for

    assert mixed_sms(B, H, Nq, Nk, config) == sms
    if sms:
        grid = grid_for(B * H, Nq, Nk, sms, config)
        assert grid.mixed and grid.splits == 1 and grid.pieces == 0
