"""The native launch path's recording and layout matching (its launches need CUDA: scripts/check_gpu.py)."""

from __future__ import annotations

import shutil
import struct
from types import SimpleNamespace

import pytest
import torch

from sdpatch.kernels import native

CELLS = [  # (Triton type, value, the cell's integer value: the value's bytes, little-endian, zero-padded)
    ("i32", -3, 0xFFFFFFFD),
    ("i32", 7, 7),
    ("i64", -(2**40), struct.unpack("<Q", struct.pack("<q", -(2**40)))[0]),
    ("u64", 2**63, 2**63),
    ("fp32", 0.5, 0x3F000000),
    ("fp32", 0.15811388300841897, struct.unpack("<I", struct.pack("<f", 0.15811388300841897))[0]),
    ("fp64", -2.0, struct.unpack("<Q", struct.pack("<d", -2.0))[0]),
    ("i1", True, 1),
    ("u8", 255, 255),
]


@pytest.mark.parametrize("ty,value,cell", CELLS, ids=[f"{t}-{v}" for t, v, _ in CELLS])
def test_scalar_cell(ty, value, cell):
    assert native.scalar_cell(ty, value) == cell


@pytest.mark.parametrize("ty", ["fp16", "bf16", "tensordesc<fp16[1,1,64,64]>"])
def test_scalar_cell_refuses_unhandled_types(ty):
    assert native.scalar_cell(ty, 1.0) is None


class FakeModule:
    """Records what :func:`native.build_program` asks of the C++ module's Program."""

    class Program:
        def __init__(self):
            self.buffers, self.launches, self.outputs = [], [], None

        def buffer(self, sizes, strides, dtype):
            self.buffers.append((sizes, strides, dtype))

        def launch(self, function, grid, threads, shared, cells, pointers, allocate, maps):
            self.launches.append(dict(function=function, grid=grid, threads=threads, shared=shared, cells=cells,
                                      pointers=pointers, allocate=allocate, maps=maps))


def fake_binary(signature: list[str], function: int = 0xF00, num_warps: int = 4, shared: int = 1024, **meta):
    """A compiled kernel as :class:`flash_fwd.Binary` holds it, with this parameter signature."""
    metadata = SimpleNamespace(**{"global_scratch_size": 0, "profile_scratch_size": 0, "launch_cooperative_grid": False,
                                  "launch_pdl": False, "num_ctas": 1, **meta})
    src = SimpleNamespace(signature={f"p{i}": t for i, t in enumerate(signature)})
    return SimpleNamespace(compiled=SimpleNamespace(metadata=metadata, src=src), function=function,
                           metadata=(num_warps, 1, shared))


def backward_like():
    """Inputs, a two-launch record in the backward's shape (a buffer made before the first launch,
    two after it, one shared), and its outputs."""
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    dq, delta = torch.empty_like(q), torch.empty(1, 2, 8)
    dk = torch.empty_like(k)
    first = fake_binary(["*fp32", "*fp32", "constexpr", "*fp32", "*fp32", "i32", "fp32"], function=1, num_warps=8)
    second = fake_binary(["*fp32", "*fp32", "*fp32", "*fp32", "i32", "constexpr"], function=2, shared=0)
    record = [(first, (2, 1, 1), (q, k, None, dq, delta, 8, 0.5)), (second, (1, 2, 1), (q, delta, dk, k, 8, 1))]
    return (q, k, None), record, (dq, dk)


def test_build_program_replays_allocations_and_launches():
    inputs, record, outputs = backward_like()
    p = native.build_program(FakeModule, inputs, record, outputs)
    # Slots: inputs 0-2 (q, k, None), then buffers in order of first use: dq 3, delta 4, dk 5.
    assert [b[0] for b in p.buffers] == [[1, 2, 8, 4], [1, 2, 8], [1, 2, 8, 4]]
    assert [b[2] for b in p.buffers] == [torch.float32] * 3
    first, second = p.launches
    assert (first["function"], first["grid"], first["threads"], first["shared"]) == (1, [2, 1, 1], 256, 1024)
    assert first["pointers"] == [(0, 0), (1, 1), (2, 3), (3, 4)] and first["allocate"] == [3, 4]
    assert first["cells"] == [0, 0, 0, 0, 8, 0x3F000000, 0, 0]  # the constexpr left out; two scratch cells last
    assert second["pointers"] == [(0, 0), (1, 4), (2, 5), (3, 1)] and second["allocate"] == [5]
    assert second["cells"] == [0, 0, 0, 0, 8, 0, 0]
    assert first["maps"] == second["maps"] == []
    assert p.outputs == [3, 5]


FP16 = 6  # Triton's TMA data type for fp16 (the fake driver's table maps it to 6 as well)


def tma_meta(block: list[int], swizzle: int = 2) -> dict:
    return dict(swizzle=swizzle, elem_size=2, elem_type=FP16, block_size=block, fp4_padded=False)


def descriptor(t: torch.Tensor, padding: str = "zero"):
    """A host tensor descriptor, as the launcher reads one."""
    return SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), padding=padding)


@pytest.fixture
def triton_expansion(monkeypatch):
    """Triton's expansion of a descriptor as triton 3.6 has it: a CUtensorMap, the shape, the strides."""
    monkeypatch.setattr(native, "_tensordesc_arg", (lambda d, meta: ["map", *d.shape, *d.strides], {FP16: 6}))


def gluon_like():
    """Inputs and a one-launch record in the Gluon forward's shape: descriptors over q (diffusers'
    (B, N, H, D) memory) and over the output, a buffer of the call; an absent descriptor, a scalar."""
    q = torch.randn(2, 8, 3, 32, dtype=torch.float16).transpose(1, 2)
    out = torch.empty_like(q)
    binary = fake_binary(["tensordesc<fp16[1,1,64,32]>", "constexpr", "tensordesc<fp16[1,1,64,32]>", "fp32", "i32"],
                         tensordesc_meta=[tma_meta([1, 1, 64, 32]), tma_meta([1, 1, 64, 32], swizzle=3)])
    return (q, None), [(binary, (1, 6, 1), (descriptor(q), None, descriptor(out), 0.5, 3))], (out,)


def test_build_program_encodes_tma_descriptors(triton_expansion):
    inputs, record, outputs = gluon_like()
    p = native.build_program(FakeModule, inputs, record, outputs)
    (launch,) = p.launches
    # Per descriptor: a CUtensorMap cell, then its shape (i32) and strides (i64), as Triton expands it.
    q_cells = [0, 2, 3, 8, 32, 768, 32, 96, 1]
    assert launch["cells"] == [*q_cells, *q_cells, 0x3F000000, 3, 0, 0]
    assert launch["pointers"] == [] and launch["allocate"] == [2] and p.outputs == [2]
    # (parameter, slot, data type, swizzle, OOB fill, dims, byte strides, box): innermost dim first.
    dims, strides, box = [32, 8, 3, 2], [2 * 96, 2 * 32, 2 * 768], [32, 64, 1, 1]
    assert launch["maps"] == [(0, 0, 6, 2, 0, dims, strides, box), (9, 2, 6, 3, 0, dims, strides, box)]


def refusals():
    inputs, record, outputs = backward_like()
    q, k, _ = inputs
    view_of_input = (record[0][0], (1, 1, 1), (q, k, None, q[:, :1], record[0][2][4], 8, 0.5))
    scratch = (fake_binary(["*fp32"], global_scratch_size=128), (1, 1, 1), (q,))
    descriptor_without_tma = (fake_binary(["tensordesc<fp16[1,1,64,64]>"]), (1, 1, 1), (q,))
    fp4 = dict(tma_meta([1, 1, 8, 4]), fp4_padded=True)
    fp4_descriptor = (fake_binary(["tensordesc<fp16[1,1,8,4]>"], tensordesc_meta=[fp4]), (1, 1, 1), (descriptor(q),))
    view_descriptor = (fake_binary(["tensordesc<fp32[1,1,8,4]>"], tensordesc_meta=[tma_meta([1, 1, 8, 4])]), (1, 1, 1),
                       (descriptor(q[:, :, 1:]),))
    half_scalar = (fake_binary(["*fp32", "fp16"]), (1, 1, 1), (q, 1.0))
    return {
        "jit-launch": (inputs, [record[0], None], outputs),
        "buffer-overlaps-input": (inputs, [view_of_input], outputs[:1]),
        "output-is-input": (inputs, record, (q,)),
        "output-never-launched": (inputs, record, (torch.empty(1),)),
        "scratch-memory": (inputs, [scratch], ()),
        "descriptor-without-tma": (inputs, [descriptor_without_tma], ()),
        "fp4-descriptor": (inputs, [fp4_descriptor], ()),
        "descriptor-over-a-view-of-an-input": (inputs, [view_descriptor], ()),
        "fp16-scalar": (inputs, [half_scalar], ()),
        "empty": (inputs, [], ()),
    }


@pytest.mark.parametrize("case", ["jit-launch", "buffer-overlaps-input", "output-is-input", "output-never-launched",
                                  "scratch-memory", "descriptor-without-tma", "fp4-descriptor",
                                  "descriptor-over-a-view-of-an-input", "fp16-scalar", "empty"])
def test_build_program_refuses(case, triton_expansion):
    inputs, record, outputs = refusals()[case]
    assert native.build_program(FakeModule, inputs, record, outputs) is None


needs_toolchain = pytest.mark.skipif(shutil.which("ninja") is None or shutil.which("c++") is None,
                                     reason="building the native module needs ninja and a C++ compiler")


@needs_toolchain
def test_registry_matches_exact_layouts():
    """A program runs only for its recorded layout and options; on the CPU its launch then fails
    for want of libcuda, after the layout matched."""
    assert native.wait(), "the native module did not build"
    mod = native.module()
    inputs, record, outputs = backward_like()
    registry = mod.Registry()
    registry.add(list(inputs), [0.5], native.build_program(mod, inputs, record, outputs))
    assert len(registry) == 1
    q, k, _ = inputs
    with pytest.raises(RuntimeError, match="libcuda"):
        registry.run([q.clone(), k.clone(), None], [0.5], 0)
    others = {
        "options": ([q, k, None], [0.25]),
        "dtype": ([q.double(), k, None], [0.5]),
        "strides": ([q.transpose(1, 2).contiguous().transpose(1, 2), k, None], [0.5]),
        "sizes": ([q[:, :, :7], k, None], [0.5]),
        "alignment": ([torch.randn(q.numel() + 1)[1:].view(q.shape), k, None], [0.5]),
        "mask-present": ([q, k, torch.ones(1, 1, 1, 8, dtype=torch.bool)], [0.5]),
    }
    for name, (ins, options) in others.items():
        assert registry.run(ins, options, 0) is None, name


def test_build_program_refuses_descriptors_triton_expands_otherwise(monkeypatch):
    """A Triton whose launcher passes a descriptor otherwise (say, as a pointer, its shape and strides
    twice) keeps those launches: the program's cells would not match the kernel's parameters."""
    inputs, record, outputs = gluon_like()
    monkeypatch.setattr(native, "_tensordesc_arg", (lambda d, meta: [d.base, *d.shape, *d.strides, False, *d.shape, *d.strides],
                                                    {FP16: 6}))
    assert native.build_program(FakeModule, inputs, record, outputs) is None
    monkeypatch.setattr(native, "_tensordesc_arg", None)  # a Triton without the expansion
    assert native.build_program(FakeModule, inputs, record, outputs) is None


@needs_toolchain
def test_registry_runs_descriptor_programs_for_their_layout(triton_expansion):
    """The C++ module takes a program with TMA descriptors; on the CPU its run stops at the driver
    (encoding the first descriptor), after the layout matched."""
    assert native.wait(), "the native module did not build"
    mod = native.module()
    inputs, record, outputs = gluon_like()
    registry = mod.Registry()
    registry.add(list(inputs), [0.5], native.build_program(mod, inputs, record, outputs))
    q, _ = inputs
    with pytest.raises(RuntimeError, match="libcuda"):
        registry.run([q.clone().transpose(1, 2).contiguous().transpose(1, 2), None], [0.5], 0)
    assert registry.run([q.contiguous(), None], [0.5], 0) is None


@needs_toolchain
def test_registry_checks_programs():
    assert native.wait(), "the native module did not build"
    mod = native.module()
    inputs, record, outputs = backward_like()
    program = native.build_program(mod, inputs, record, outputs)
    program.launch(0, [1, 1, 1], 32, 0, [0], [(0, 2)], [], [])  # a pointer to input 2, which is None
    with pytest.raises(RuntimeError, match="None"):
        mod.Registry().add(list(inputs), [0.5], program)
    program = native.build_program(mod, inputs, record, outputs)
    program.launch(0, [1, 1, 1], 32, 0, [0], [], [], [(0, 2, 6, 2, 0, [32, 8], [64], [32, 8])])  # a descriptor of None
    with pytest.raises(RuntimeError, match="None"):
        mod.Registry().add(list(inputs), [0.5], program)
    with pytest.raises(RuntimeError, match="one stride fewer"):
        program.launch(0, [1, 1, 1], 32, 0, [0], [], [], [(0, 0, 6, 2, 0, [32, 8], [64, 64], [32, 8])])


def test_status_says_why_the_path_is_not_used(monkeypatch):
    from sdpatch.generate import environment

    assert environment()["native_launch"].startswith("not used")  # no CUDA device here
    monkeypatch.setattr(native, "ENABLED", False)
    assert native.status().startswith("off") and native.module() is None
    monkeypatch.setattr(native, "ENABLED", True)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_build_error", "RuntimeError: Ninja is required to load C++ extensions")
    assert "Ninja is required" in native.status()


@needs_toolchain
def test_registry_starts_over_when_full(monkeypatch):
    """Endless new layouts (a resolution sweep) do not grow the registry past MAX_PROGRAMS."""
    assert native.wait(), "the native module did not build"
    monkeypatch.setattr(native, "MAX_PROGRAMS", 2)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    site = native.Site(lambda: False)
    for n in (8, 9, 10):
        inputs, record, outputs = backward_like()
        q, k, _ = inputs
        inputs = (q[:, :, :n - 1] if n > 8 else q, k, None)  # a new layout each time
        record = [(b, g, (inputs[0], *args[1:])) for b, g, args in record]
        plan = SimpleNamespace(native=None)
        site.register(plan, record, inputs, (0.5,), outputs)
        assert plan.native is True
    assert len(site.registry) == 1  # cleared at 2, then the third added


def test_enabled_restores_and_never_turns_the_path_on(monkeypatch):
    monkeypatch.setattr(native, "ENABLED", True)
    with native.enabled(False):
        assert not native.ENABLED
    assert native.ENABLED
    monkeypatch.setattr(native, "ENABLED", False)  # SDPATCH_NATIVE=0
    with native.enabled(True):
        assert not native.ENABLED
    assert not native.ENABLED
