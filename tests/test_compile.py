"""sdpatch's custom ops under torch.library's checks, and patched UNets under torch.compile(fullgraph=True).

The ops run the Triton kernels in the interpreter (CPU), so shapes stay small. Error budget, as
relative error against float64 attention or against the same model run eagerly: 1e-5 in fp32.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import arch
import sdpatch
from sdpatch import patch_unet
from sdpatch.attention import ops
from sdpatch.attention.naive import attention_ref

RTOL = 1e-5
attention_module = importlib.import_module("sdpatch.attention.dispatch")
faults = importlib.import_module("sdpatch.attention.faults")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def qkv(B, H, Nq, Nk, D, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, H, Nk, D, generator=g, dtype=dtype) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


MASKS = {
    "none": lambda Nq, Nk: None,
    "bool": lambda Nq, Nk: torch.rand(1, 1, Nq, Nk, generator=torch.Generator().manual_seed(1)) > 0.3,
    "additive": lambda Nq, Nk: torch.randn(1, 1, 1, Nk, generator=torch.Generator().manual_seed(2)),
}


@pytest.mark.parametrize(
    "B, H, Nq, Nk, D, mask, lse",
    [
        pytest.param(1, 2, 33, 33, 40, "none", True, id="B1-H2-N33-D40-lse"),
        pytest.param(2, 1, 17, 77, 16, "none", False, id="B2-H1-Nq17-Nk77-D16"),
        pytest.param(1, 2, 20, 24, 80, "bool", True, id="B1-H2-Nq20-Nk24-D80-bool"),
        pytest.param(1, 1, 16, 9, 64, "additive", True, id="B1-H1-Nq16-Nk9-D64-additive"),
    ],
)
def test_forward_op_passes_opcheck(B, H, Nq, Nk, D, mask, lse):
    q, k, v = qkv(B, H, Nq, Nk, D, grad=lse)
    torch.library.opcheck(torch.ops.sdpatch.flash_fwd.default, (q, k, v, MASKS[mask](Nq, Nk), 0.3, lse))


def test_backward_op_passes_opcheck():
    q, k, v = qkv(1, 2, 24, 20, 40)
    out, lse = ops.flash_fwd(q, k, v, None, 0.25, True)
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.sdpatch.flash_bwd.default, (do, q, k, v, out, lse, None, 0.25))


def test_op_gradients_match_float64():
    q, k, v = qkv(1, 2, 19, 23, 40, grad=True)
    out, _ = torch.ops.sdpatch.flash_fwd(q, k, v, None, 0.3, True)
    do = torch.randn_like(out)
    out.backward(do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(qd, kd, vd, scale=0.3)
    ref.backward(do.double())
    assert rel_err(out, ref) < RTOL
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert rel_err(got, want) < RTOL


def test_forward_op_launches_as_captured_calls(monkeypatch):
    # Compiled code reaches the kernels only through the op; under mode="reduce-overhead" its calls
    # are a CUDA graph's warm-up and capture, which take the kernel that is fastest on replay.
    forward = importlib.import_module("sdpatch.kernels.forward")
    depths = []
    real = forward.flash_attn_fwd

    def spy(*args, **kwargs):
        depths.append(forward._capture_depth)
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "flash_attn_fwd", spy)
    ops.flash_fwd(*qkv(1, 1, 16, 16, 16), None, 0.25, False)
    assert depths == [1] and forward._capture_depth == 0


def _small_inputs(unet) -> dict:
    kw = arch.unet_inputs(unet, batch=1)
    kw["sample"] = kw["sample"][..., :8, :8].contiguous()  # 64 tokens: cheap in the interpreter
    return kw


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_patched_unet_compiles_whole_and_matches_eager(name):
    unet = arch.build(name)
    patch_unet(unet, backend="triton")
    kw = _small_inputs(unet)
    with torch.no_grad():
        eager = unet(**kw).sample
        compiled = torch.compile(unet, fullgraph=True, backend="aot_eager")(**kw).sample
    assert rel_err(compiled, eager) < RTOL


def test_regional_compile_of_a_patched_unet_matches_eager(monkeypatch, tmp_path):
    """--compile's regions (each Transformer2DModel and ResnetBlock2D, whole: fullgraph) around the op."""
    import torch._dynamo.config as dynamo_config

    from sdpatch import speed

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    unet = arch.build("sd15")
    patch_unet(unet, backend="triton")
    kw = _small_inputs(unet)
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with torch.no_grad(), dynamo_config.patch({limit: getattr(dynamo_config, limit)}):  # restored after
        eager = unet(**kw).sample
        assert speed.compile_blocks(unet, backend="aot_eager")
        compiled = unet(**kw).sample
    assert rel_err(compiled, eager) < RTOL


def test_patched_unet_training_step_compiles_whole_and_matches_eager():
    torch.manual_seed(0)
    unet = arch.build("sd15").train()
    patch_unet(unet, backend="triton")
    kw = _small_inputs(unet)
    target = torch.randn_like(kw["sample"])

    def step(model):
        loss = torch.nn.functional.mse_loss(model(**kw).sample, target)
        loss.backward()
        return loss.detach()

    eager_loss = step(unet)
    eager_grads = [p.grad.clone() for p in unet.parameters()]
    unet.zero_grad(set_to_none=True)
    compiled_loss = step(torch.compile(unet, fullgraph=True, backend="aot_eager"))
    assert rel_err(compiled_loss, eager_loss) < RTOL
    grads = [p.grad for p in unet.parameters()]
    assert rel_err(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in eager_grads])) < RTOL


def test_compiled_call_takes_the_backend_chosen_at_trace_time():
    """On the CPU ``auto`` is chunked; a head dim past the kernel's limit is chunked even if
    ``triton`` could run elsewhere: the trace keeps the choice, with no op in its graph."""
    q, k, v = qkv(1, 1, 16, 16, 300)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    out = torch.compile(lambda q, k, v: sdpatch.attention(q, k, v), fullgraph=True, backend=backend)(q, k, v)
    assert rel_err(out, attention_ref(q.double(), k.double(), v.double())) < RTOL
    assert not any("sdpatch" in t for t in seen)


@pytest.mark.parametrize("backend, graphs_expected", [
    pytest.param("triton", 2, id="triton"),  # one per head dim: the op takes any sequence lengths
    pytest.param("chunked", 3, id="chunked"),  # and per query length: its chunks are a Python loop over it
    pytest.param("auto", 3, id="auto-is-chunked-on-cpu"),
])
def test_dynamic_shape_trace_takes_each_head_dim_as_a_constant(backend, graphs_expected):
    """``dynamic=True`` (or dynamo's automatic dynamic shapes after a recompile) traces the head dim
    as a symbol; the backend's choice, made once per trace, specializes it, and each call matches
    float64."""
    torch._dynamo.reset()  # the lambda's code is shared by the parameters: each starts with no graphs
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v: sdpatch.attention(q, k, v, backend=backend), fullgraph=True, dynamic=True,
                       backend=recording)
    for B, H, Nq, Nk, D in [(1, 2, 16, 9, 24), (1, 2, 20, 12, 24), (1, 2, 16, 9, 32)]:  # distinct sizes: dynamo gives equal ones one symbol
        q, k, v = qkv(B, H, Nq, Nk, D)
        assert rel_err(fn(q, k, v), attention_ref(q.double(), k.double(), v.double())) < RTOL, (Nq, Nk, D)
    assert len(graphs) == graphs_expected


def test_compiled_call_raises_instead_of_retrying(monkeypatch):
    """Inside a trace there is no retry: a kernel failure reaches the caller as it is."""
    import sdpatch.kernels.forward as kernels

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(kernels, "flash_attn_fwd", broken)
    q, k, v = qkv(1, 1, 16, 16, 16)
    fn = torch.compile(lambda q, k, v: sdpatch.attention(q, k, v, backend="triton"), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="no kernel today"):
        fn(q, k, v)
    assert not faults._failures  # and nothing was remembered for eager calls


def test_capture_raises_out_of_memory_instead_of_retrying(monkeypatch):
    """A CUDA-graph capture cannot re-run half a call: out of memory there is raised, not retried."""
    fallbacks = []

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setitem(attention_module.REGISTRY, "chunked", dataclasses.replace(attention_module.REGISTRY["chunked"], run=oom))
    q, k, v = qkv(1, 1, 8, 8, 16)
    monkeypatch.setattr(faults, "capturing", lambda q: True)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        sdpatch.attention(q, k, v, backend="chunked", on_fallback=fallbacks.append)
    monkeypatch.setattr(faults, "capturing", lambda q: False)
    out = sdpatch.attention(q, k, v, backend="chunked", on_fallback=fallbacks.append)  # eager: retried
    assert [f.backend for f in fallbacks] == ["chunked"]
    assert rel_err(out, attention_ref(q.double(), k.double(), v.double())) < RTOL
