"""CUDA-graph capture of a model's forward (sdpatch.graphs), its control flow on the CPU.

CUDA is absent here, so the runner gets stand-ins for ``torch.cuda.CUDAGraph`` and
``torch.cuda.graph``: a "graph" whose replay runs the module again on the captured call's inputs
and writes the result into the captured output, as a real replay writes into its static output.
That tests what the runner decides and copies; that a real capture replays the same kernels is the
GPU checks' part (scripts/check_gpu.py, scripts/bench_e2e.py).
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch.utils import _pytree as pytree

import arch
from sdpatch import graphs, patch_unet, speed_up, unpatch_unet

RTOL = 1e-5


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class FakeGraph:
    """Records nothing; replay recomputes the captured call into the captured output."""

    runner: graphs.GraphRunner | None = None

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1
        entry = next(e for e in self.runner.entries.values() if e.graph is self)
        args, kwargs = entry.call
        with torch.no_grad():
            fresh = self.runner.forward(*args, **kwargs)
        for dst, src in zip(pytree.tree_leaves(entry.output), pytree.tree_leaves(fresh)):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


class Capture:
    """Stands in for torch.cuda.graph: counts the captures, and the pool each was given."""

    def __init__(self):
        self.captures = 0
        self.pools = []

    @contextlib.contextmanager
    def __call__(self, graph, pool=None):
        self.captures += 1
        self.pools.append(pool)
        yield


def fake_runner(module, **options) -> tuple[graphs.GraphRunner, Capture]:
    """A runner with the stand-ins, warming up once (a call's worth of control flow is what counts)."""
    options.setdefault("warmup", 1)
    capture = Capture()
    runner = graphs.GraphRunner(module, module.forward, graph_factory=FakeGraph, capture_context=capture,
                                reserved=lambda: 0, **options)
    FakeGraph.runner = runner
    return runner, capture


@pytest.fixture
def unet():
    return arch.build("sd15")


def test_first_call_warms_up_and_captures_then_replays(unet):
    runner, capture = fake_runner(unet)
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        want = unet(**kw).sample
        first = runner(**kw).sample  # eager, then captured
        assert capture.captures == 1 and runner.stats.replays == 0
        kw2 = {**kw, "sample": kw["sample"] * 0.5}  # same signature, other values: copied in
        second = runner(**kw2).sample
        want2 = unet(**kw2).sample
    assert rel_err(first, want) < RTOL and rel_err(second, want2) < RTOL
    assert runner.stats.graphs == 1 and runner.stats.replays == 1 and runner.stats.eager_calls == 1
    assert runner.stats.eager_reasons == {graphs.WARMUP: 1}


def test_a_new_signatures_warm_ups_compile_in_the_background_and_start_them_after_its_capture(unet, monkeypatch):
    """A new signature's warm-up calls run with new layouts' compiles sent to the background (so
    that none waits for a kernel still compiling), under the kernels' capture mode; the compiles the
    first asked for start once the signature is captured, not before (they would hold the GIL the
    warm-up needs), and a replay starts any left waiting. Other eager calls run in background mode
    too, outside capture mode, and start what they asked for as they end."""
    from sdpatch.kernels import forward

    events = []

    @contextlib.contextmanager
    def in_background():
        events.append(("background", forward._capture_depth))
        yield

    monkeypatch.setattr(graphs, "_in_background", in_background)
    monkeypatch.setattr(graphs, "_start_deferred", lambda: events.append("start") or 0)
    runner, capture = fake_runner(unet, warmup=graphs.WARMUP_CALLS)
    real_capture = runner._capture
    monkeypatch.setattr(runner, "_capture", lambda *a: events.append("capture") or real_capture(*a))
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        runner(**kw)
        assert events == [("background", 1)]
        runner(**kw)  # the second warm-up, and the capture
        assert events == [("background", 1), ("background", 1), "capture", "start"]
        runner(**kw)  # a replay
        assert events[4:] == ["start"] and capture.captures == 1
        runner(**{**kw, "sample": kw["sample"][:1], "timestep": kw["timestep"][:1],
                  "encoder_hidden_states": kw["encoder_hidden_states"][:1]})
    assert events[5:] == [("background", 1)]
    unet.requires_grad_(True)
    runner(**kw)  # autograd records: eager, not for a graph, and in background mode too
    assert events[6:] == [("background", 0), "start"]


def stand_in_runner(unet, compiling: list, monkeypatch, **options):
    """A runner whose module's calls count as stand-ins' while ``compiling[0]`` (the kernels compile
    in the background), as sdpatch.kernels.forward.stand_in counts them."""
    served, pools = [0], []
    monkeypatch.setattr(graphs, "compiling_later", lambda: compiling[0])
    monkeypatch.setattr(graphs, "stand_in_calls", lambda: served[0])
    monkeypatch.setattr(graphs, "_start_deferred", lambda: 1)

    def forward(*args, **kwargs):
        served[0] += compiling[0]
        return unet.forward(*args, **kwargs)

    capture = Capture()
    runner = graphs.GraphRunner(unet, forward, graph_factory=FakeGraph, capture_context=capture, reserved=lambda: 0,
                                pool_factory=lambda: pools.append(object()) or pools[-1], **options)
    FakeGraph.runner = runner
    return runner, capture, pools


def test_a_graph_holding_stand_ins_is_captured_again_once_the_kernels_are_done(unet, monkeypatch):
    """Captured while stand-ins served (its kernels compiling in the background), a graph replays until
    they are done; then the signature warms up again, twice (the first call tunes or first launches
    each kernel, which a capture cannot hold), and is captured with them, into the same pool: the
    old graph is held until then, so that PyTorch keeps the pool alive and the new capture reuses
    its memory. The new graph is kept, the old one freed."""
    compiling = [True]
    runner, capture, pools = stand_in_runner(unet, compiling, monkeypatch, warmup=graphs.WARMUP_CALLS)
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        want = unet(**kw).sample
        outs = [runner(**kw).sample for _ in range(4)]  # two warm-ups (the second captures), two replays
        assert capture.captures == 1 and runner.stats.stand_in_replays == 2
        old = next(iter(runner.entries.values()))
        assert old.provisional
        compiling[0] = False
        outs += [runner(**kw).sample for _ in range(2)]  # two warm-ups, the second capturing again
        assert capture.captures == 2 and list(runner.retired.values()) == [] and old not in runner.entries.values()
        outs += [runner(**kw).sample for _ in range(2)]  # two replays
    st = runner.stats
    assert capture.captures == 2 and st.replays == 4 and st.stand_in_replays == 2 and st.compile_s > 0
    assert len(pools) == 1 and capture.pools == [pools[0], pools[0]]
    assert st.graphs == 1 and st.recaptures == 1 and st.eager_calls == 4
    assert not next(iter(runner.entries.values())).provisional
    assert all(rel_err(out, want) < RTOL for out in outs)


def test_a_retired_graph_is_held_until_its_signature_is_captured_again(unet, monkeypatch):
    """Between the drop of a provisional graph and its signature's new capture, the old graph stays
    held (its pool with it), replayed no more; a capture that fails frees it, and a runner left
    holding no graph takes a new pool for its next capture."""
    compiling = [True]
    runner, capture, pools = stand_in_runner(unet, compiling, monkeypatch, warmup=graphs.WARMUP_CALLS)
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        for _ in range(3):
            runner(**kw)
        old = next(iter(runner.entries.values()))
        compiling[0] = False
        runner(**kw)  # the first warm-up with the kernels: the old graph is retired, held
        assert runner.entries == {} and list(runner.retired.values()) == [old] and runner.stats.replays == 1

        def fail(graph, pool=None):
            raise RuntimeError("operation not permitted when stream is capturing")

        runner._capture_context = fail
        runner(**kw)  # the second warm-up's capture fails: the old graph goes, and the pool with it
    assert runner.retired == {} and runner.entries == {} and runner._pool is None and len(pools) == 1


def test_a_graph_captured_without_stand_ins_is_kept_while_other_kernels_compile(unet, monkeypatch):
    """Only a graph that holds stand-ins is captured again: other kernels compiling in the background
    (another module's, another size's) leave it be."""
    compiling = [False]
    runner, capture, _ = stand_in_runner(unet, compiling, monkeypatch, warmup=graphs.WARMUP_CALLS)
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        for _ in range(2):
            runner(**kw)
        compiling[0] = True  # from now on, every call would be served by stand-ins: a replay calls nothing
        for _ in range(2):
            runner(**kw)
        compiling[0] = False
        runner(**kw)
    assert capture.captures == 1 and runner.stats.recaptures == 0 and runner.stats.replays == 3


class FakeRuntime:
    """Stands in for sdpatch.kernels.runtime in the eager hooks: records background mode's turns."""

    def __init__(self):
        self.events, self.depth = [], 0

    def background_on(self):
        self.depth += 1
        self.events.append("on")
        return True

    def background_off(self):
        self.depth -= 1
        self.events.append("off")

    def start_deferred(self):
        self.events.append("start")
        return 0


def test_a_patched_models_eager_calls_compile_in_the_background_and_start_them_at_their_end(unet, monkeypatch):
    """Each eager call of a patched model runs in background mode (new layouts hand their compiles to
    threads, stand-ins serve meanwhile) and starts what it asked for as it ends; one raising inside
    still leaves the mode. A model a graph runner serves is left to the runner, and an unpatched one
    is left alone."""
    fake = FakeRuntime()
    monkeypatch.setattr(graphs, "_triton", lambda: fake)
    graphs._eager.__dict__.setdefault("open", []).clear()  # calls other tests cut short
    patch_unet(unet, backend="chunked")
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        unet(**kw)
        assert fake.events == ["on", "off", "start"] and fake.depth == 0
        with pytest.raises(RuntimeError):
            unet(**{**kw, "sample": kw["sample"][:, :1]})  # a wrong channel count raises in conv_in
        assert fake.events[3:] == ["on", "off", "start"] and fake.depth == 0
        runner, _ = fake_runner(unet)
        monkeypatch.setattr(graphs, "runner_of", lambda module: runner)
        unet(**kw)
        assert len(fake.events) == 6 and graphs._eager.open == []
        monkeypatch.undo()
        monkeypatch.setattr(graphs, "_triton", lambda: fake)
        unpatch_unet(unet)
        unet(**kw)
    assert len(fake.events) == 6 and graphs._eager.open == []


def test_a_call_cut_short_by_an_interrupt_leaves_background_mode_at_the_next_call(unet, monkeypatch):
    """Ctrl-C inside a patched model's call skips its always_call hook; the model's next call
    closes what that one opened, so background mode does not stay on for good."""
    fake = FakeRuntime()
    monkeypatch.setattr(graphs, "_triton", lambda: fake)
    graphs._eager.__dict__.setdefault("open", []).clear()  # calls other tests cut short
    patch_unet(unet, backend="chunked")
    kw = arch.unet_inputs(unet)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(unet.conv_in, "forward", interrupt)
            with pytest.raises(KeyboardInterrupt):
                unet(**kw)
        assert fake.depth == 1 and len(graphs._eager.open) == 1
        unet(**kw)
    assert fake.events == ["on", "off", "start", "on", "off", "start"] and fake.depth == 0
    assert graphs._eager.open == []


# A patched SD 1.5-shaped UNet's eager call on the Triton backend, with its kernels compiled for sm_90
# through the stand-in driver (nothing can launch here, so the Triton backend is let serve the CPU
# tensors, and each layout given tiles as the shipped tables give them): every layout stands aside for
# SDPA and compiles once the call ends, on one thread, and sdpatch.wait_for_kernels() returns once all
# are compiled. The call's output is SDPA's attention, as unpatched diffusers computes it.
# (A second call would launch the kernels, which the stand-in driver cannot.)
_EAGER_SCRIPT = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
sys.path.insert(0, sys.argv[2])
import torch, triton
from sdpatch.kernels.runtime import CompileOnlyDriver

triton.runtime.driver.set_active(CompileOnlyDriver())
import arch
import sdpatch
from sdpatch.attention import triton_backend
from sdpatch.kernels import flash_fwd, runtime

triton_backend.status = lambda device: (True, "compiling for sm_90 only")
tiles = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
plan = flash_fwd._fwd_plan
flash_fwd._fwd_plan = lambda *a: runtime.Plan(plan(*a).meta, tiles)
unet = arch.build("sd15")
kw = arch.unet_inputs(unet)
with torch.no_grad():
    want = unet(**kw).sample
    sdpatch.patch_unet(unet, backend="triton")
    got = unet(**kw).sample
threads = {t.name for t in __import__("threading").enumerate()}
cache = flash_fwd._attn_fwd_kernel.device_caches[0][0]
print(runtime.stood_in(), len(flash_fwd._plans), runtime.compiling_later(), len(cache),
      sum(n.startswith("sdpatch-compile-later") for n in threads))
ready = sdpatch.wait_for_kernels(timeout=500)
built = all(p.later is not None and p.later.done() and p.later.exception() is None for p in flash_fwd._plans.values())
print(ready, built, len(cache), ((got - want).norm() / want.norm()).item() < 1e-5)
"""


def test_an_eager_call_of_a_patched_unet_compiles_its_kernels_in_the_background(tmp_path):
    """The hooks, the runtime and Triton together, as _EAGER_SCRIPT says."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sdpatch.kernels import runtime

    if runtime._AsyncCompileMode is None:
        pytest.skip("this Triton compiles nothing in the background (no async compile mode)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _EAGER_SCRIPT, str(tmp_path), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (served, layouts, compiling, cached, threads), (ready, built, compiled, same) = (
        line.split() for line in done.stdout.strip().splitlines()[-2:])
    assert int(served) >= int(layouts) > 1 and compiling == "True" and cached == "0" and threads == "1"
    # every layout's compile done; layouts of one specialization share a kernel
    assert ready == built == same == "True" and 1 < int(compiled) <= int(layouts)


def test_eager_hooks_without_triton_do_nothing(unet, monkeypatch):
    monkeypatch.setattr(graphs, "_triton", lambda: None)
    graphs.compile_eagerly_in_background(unet)
    graphs.compile_eagerly_in_background(unet)  # idempotent
    assert sum(h is graphs._eager_begin for h in unet._forward_pre_hooks.values()) == 1
    with torch.no_grad():
        unet(**arch.unet_inputs(unet))
    assert graphs._eager.open == []
    graphs.stop_eager_background(unet)
    assert not unet._forward_pre_hooks and not unet._forward_hooks and not unet._forward_hooks_always_called


def test_background_compiles_are_off_in_the_interpreter():
    """The interpreter compiles nothing: a first warm-up there runs its layouts as they come."""
    from sdpatch.kernels import runtime

    with graphs._in_background():
        assert runtime._background == 0
    assert graphs._start_deferred() == 0 and not graphs.compiling_later()


def test_replay_returns_a_copy_the_next_replay_does_not_overwrite(unet):
    runner, _ = fake_runner(unet)
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        runner(**kw)
        a = runner(**kw).sample
        kept = a.clone()
        runner(**{**kw, "sample": kw["sample"] + 1})
    assert torch.equal(a, kept)


@pytest.mark.parametrize(
    "change, graphs_after",
    [
        pytest.param(lambda kw: {**kw, "sample": kw["sample"][:1], "timestep": kw["timestep"][:1],
                                 "encoder_hidden_states": kw["encoder_hidden_states"][:1]}, 2, id="new-batch"),
        pytest.param(lambda kw: {**kw, "return_dict": False}, 2, id="new-flag"),
        pytest.param(lambda kw: {**kw, "sample": kw["sample"][..., :8, :8]}, 2, id="new-size"),
        pytest.param(lambda kw: {**kw, "sample": kw["sample"] + 1}, 1, id="same-signature"),
    ],
)
def test_one_graph_per_signature(unet, change, graphs_after):
    runner, _ = fake_runner(unet)
    kw = arch.unet_inputs(unet)
    other = change(kw)
    with torch.no_grad():
        for _ in range(2):
            runner(**kw)
            runner(**other)
    assert runner.stats.graphs == graphs_after


@pytest.mark.parametrize(
    "setup, reason",
    [
        pytest.param(lambda m, kw: (torch.enable_grad(), kw), "autograd is recording", id="training"),
        pytest.param(lambda m, kw: (torch.no_grad(), {**kw, "cross_attention_kwargs": {"unused": {1.0}}}),
                     "unhashable", id="unhashable-argument"),
        pytest.param(lambda m, kw: (setattr(m, "_hf_hook", object()) or torch.no_grad(), kw), "offloaded",
                     id="offloaded"),
    ],
)
def test_calls_that_cannot_be_replayed_run_eagerly_with_one_logged_reason(unet, caplog, setup, reason):
    runner, capture = fake_runner(unet)
    unet.requires_grad_(True)
    context, kw = setup(unet, arch.unet_inputs(unet))
    with caplog.at_level(logging.INFO, logger="sdpatch.graphs"), context:
        for _ in range(3):
            runner(**kw)
    assert capture.captures == 0 and runner.stats.eager_calls == 3
    mine = [r.message for r in caplog.records if r.name == "sdpatch.graphs"]
    assert len(mine) == 1 and reason in mine[0]


def test_signatures_past_the_limit_run_eagerly(unet):
    """A LoRA scale set per step makes a new signature every call: once the graphs are full, every
    new one runs eagerly (with one logged reason), with no more warm-ups or captures."""
    runner, capture = fake_runner(unet, max_graphs=2)
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        for scale in (0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4):
            runner(**kw, cross_attention_kwargs={"scale": scale})
    assert capture.captures == 2 and runner.stats.graphs == 2
    assert runner.stats.eager_reasons["2 graphs held already (arguments that change every call?)"] == 3


def test_a_failed_capture_leaves_that_signature_eager(unet, caplog):
    class Refuses(Capture):
        @contextlib.contextmanager
        def __call__(self, graph, pool=None):
            self.captures += 1
            yield
            raise RuntimeError("operation not permitted when stream is capturing")

    runner = graphs.GraphRunner(unet, unet.forward, graph_factory=FakeGraph, capture_context=Refuses(), reserved=lambda: 0,
                                warmup=1)
    FakeGraph.runner = runner
    kw = arch.unet_inputs(unet)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="sdpatch.graphs"):
        outs = [runner(**kw).sample for _ in range(3)]
    assert runner.stats.graphs == 0 and runner.stats.eager_calls == 3
    assert len([r for r in caplog.records if r.name == "sdpatch.graphs"]) == 1
    with torch.no_grad():
        assert rel_err(outs[-1], unet(**kw).sample) < RTOL


def test_capture_is_idempotent_and_release_restores_the_forward(unet):
    forward = unet.forward
    runner = graphs.capture(unet)
    assert graphs.capture(unet) is runner and unet.forward is runner
    graphs.release(unet)
    assert unet.forward == forward and graphs.runner_of(unet) is None
    graphs.release(unet)  # twice: nothing left to undo


def test_on_the_cpu_the_lever_is_off_with_a_note():
    pipe = arch.sd_pipeline()
    setup = speed_up(pipe, cuda_graphs=True, compile=False)
    assert not setup.cuda_graphs and setup.notes == ["CUDA graphs off: the unet is not on a CUDA device"]
    assert graphs.runner_of(pipe.unet) is None


def test_patching_again_drops_graphs_and_unpatching_releases_them(unet):
    runner = graphs.capture(unet)
    runner.entries["x"] = "stale"
    patch_unet(unet, backend="chunked")
    assert runner.entries == {}
    unpatch_unet(unet)
    assert graphs.runner_of(unet) is None


def test_the_default_warm_up_puts_every_launch_on_its_binary_before_the_capture(unet):
    """Two eager calls: the Triton forward's first call autotunes and its second compiles through
    the JIT, so that a capture records compiled binaries' launches only."""
    runner, capture = fake_runner(unet, warmup=graphs.WARMUP_CALLS)
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        for _ in range(4):
            runner(**kw)
    assert graphs.WARMUP_CALLS == 2 and capture.captures == 1
    assert runner.stats.eager_calls == 2 and runner.stats.replays == 2


def test_warm_up_and_capture_launch_as_for_a_graph_and_other_calls_as_eager(unet):
    """The launch layer serves a graph's warm-up and capture with the kernels a replay wants
    (sdpatch.kernels.forward.for_capture), and so the capture holds what the warm-up compiled;
    calls that are not for a graph launch as eager calls."""
    from sdpatch.kernels import forward

    modes = []
    inner = unet.forward

    def recording(*args, **kwargs):
        modes.append(forward._capture_depth > 0)
        return inner(*args, **kwargs)

    capture = Capture()
    runner = graphs.GraphRunner(unet, recording, graph_factory=FakeGraph, capture_context=capture,
                                reserved=lambda: 0, warmup=graphs.WARMUP_CALLS)
    FakeGraph.runner = runner
    kw = arch.unet_inputs(unet)
    with torch.no_grad():
        for _ in range(3):  # two warm-up calls, the capture, a replay (the stand-in's replay runs it again)
            runner(**kw)
    assert modes[:3] == [True, True, True] and capture.captures == 1
    with torch.enable_grad():
        for p in unet.parameters():
            p.requires_grad_(True)
        runner(**kw)  # autograd records: eager
    assert modes[-1] is False and forward._capture_depth == 0


def test_compile_marks_each_region_static_and_turns_the_caches_on(monkeypatch, tmp_path):
    """--compile: every Transformer2DModel and ResnetBlock2D compiled on its own, static shapes
    (lazily: nothing runs here), no transformer block inside them compiled apart, dynamo allowed
    a compile per ResNet block shape, inductor's on-disk caches on, in sdpatch's folder unless the
    user chose one."""
    import os

    import torch._dynamo.config as dynamo_config
    from diffusers.models.attention import BasicTransformerBlock

    from sdpatch.speed import COMPILED_BLOCKS, RECOMPILE_LIMIT, compile_unavailable

    if (reason := compile_unavailable()) is not None:
        pytest.skip(reason)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr("sdpatch.speed.CACHE_DIR", tmp_path / "inductor")
    calls = []
    original = torch.nn.Module.compile

    def compile(module, **kwargs):
        calls.append((type(module).__name__, kwargs))
        original(module, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile)
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    pipe = arch.sd_pipeline()
    with dynamo_config.patch({limit: 8}):  # dynamo's default, restored after
        setup = speed_up(pipe, cuda_graphs=False, compile=True)
        assert getattr(dynamo_config, limit) == RECOMPILE_LIMIT
    regions = [m for m in pipe.unet.modules() if type(m).__name__ in COMPILED_BLOCKS]
    assert setup.compile and {type(m).__name__ for m in regions} == set(COMPILED_BLOCKS)
    assert all(getattr(m, "_compiled_call_impl", None) is not None for m in regions)
    assert len(calls) == len(regions) and all(kw == {"fullgraph": True, "dynamic": False} for _, kw in calls)
    blocks = [m for m in pipe.unet.modules() if isinstance(m, BasicTransformerBlock)]
    assert blocks and all(getattr(b, "_compiled_call_impl", None) is None for b in blocks)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_compile_where_inductor_cannot_load_is_off_with_its_reason(monkeypatch):
    """A torch whose inductor cannot load beside the installed Triton: --compile is off, it says
    why, and nothing is compiled."""
    from diffusers.models.attention import BasicTransformerBlock

    monkeypatch.setattr("sdpatch.speed.compile_unavailable", lambda: "inductor cannot load (TypeError: stand-in)")
    pipe = arch.sd_pipeline()
    setup = speed_up(pipe, cuda_graphs=False, compile=True)
    blocks = [m for m in pipe.unet.modules() if isinstance(m, BasicTransformerBlock)]
    assert not setup.compile and setup.notes == ["--compile off: inductor cannot load (TypeError: stand-in)"]
    assert blocks and all(getattr(b, "_compiled_call_impl", None) is None for b in blocks)


STATS = graphs.GraphStats(graphs=1, recaptures=1, replays=17, eager_calls=4, capture_s=0.1, compile_s=1.5,
                          stand_in_replays=8).to_dict()
SPEED_LINES = [
    ({"graphs": {"unet": STATS}, "compiling_in_background": False},
     ["8 replays with SDPA standing in", "1 captured again once they had compiled (1.50 s)"], ["still compiling"]),
    ({"graphs": {"unet": {**STATS, "recaptures": 0, "stand_in_replays": 19}}, "compiling_in_background": True},
     ["19 replays with SDPA standing in", "kernels still compiling in the background"], ["captured again"]),
    ({"graphs": {"unet": {**STATS, "recaptures": 0, "stand_in_replays": 0}}, "compiling_in_background": False,
      "stand_in_calls": 40},
     ["CUDA graphs (unet): 1 captured"], ["standing in", "captured again", "still compiling", "stood in"]),
    ({"graphs": None, "compiling_in_background": True, "stand_in_calls": 640},
     ["SDPA stood in for 640 attention calls", "kernels still compiling in the background"], ["CUDA graphs"]),
    ({"graphs": None, "compiling_in_background": False, "stand_in_calls": 0}, [], ["stood in", "still compiling"]),
]


@pytest.mark.parametrize("speed, shown, absent", SPEED_LINES,
                         ids=["recaptured", "still-compiling", "no-stand-ins", "eager-stand-ins", "eager-compiled"])
def test_the_report_says_what_the_stand_ins_and_background_compiles_did(speed, shown, absent):
    from sdpatch.generate import speed_lines

    text = "\n".join(speed_lines(speed))
    assert all(s in text for s in shown) and not any(s in text for s in absent)
