"""The native launch path: a layout's allocations and kernel launches, replayed in one C++ call.

A launcher (the forward, the backward) records, on a call that went through its tuned plan, what it
allocated and which compiled kernels it launched with which arguments. :class:`Site` turns that
record into a program of the C++ module (``native.cpp``) keyed by the inputs' layout; later calls
with that layout run the program instead of the Python launcher. Per call this skips the Python
around each allocation and Triton's launcher, which parses every argument again: at 77 keys and at
head dim 160 the backward's host time exceeded its kernels' (docs/benchmarks.md, v9).

The module is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) in a background
thread on first use, and cached like any torch extension; until it is ready, or where it cannot be
built, the Python launchers serve every call. ``SDPATCH_NATIVE=0`` turns the path off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("SDPATCH_NATIVE", "1") != "0"
"""Whether launchers use the native path: ``SDPATCH_NATIVE`` at import; :func:`enabled` within a block."""

MAX_PROGRAMS = 4096  # per launcher, like the launch plans' cache (flash_fwd._MAX_PLANS)

_SOURCE = Path(__file__).with_name("native.cpp")
_module = None
_builder: threading.Thread | None = None
_build_lock = threading.Lock()
_build_error: str | None = None

# How Triton's launchers pass each scalar parameter type (triton/backends/nvidia/driver.py): its
# bytes, little-endian, at the start of the parameter's 8-byte cell. fp16 and bf16 scalars are
# left out: no launcher here passes one.
_SCALAR_FORMATS = {
    "i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
    "i64": "q", "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d",
}
# Cells after the kernel's own parameters: Triton >= 3.3 appends a global-scratch pointer and
# >= 3.5 a profile-scratch pointer, both null unless the kernel asks for scratch (checked below).
# cuLaunchKernel reads only the parameters a kernel declares, so older kernels ignore them.
_SCRATCH_CELLS = (0, 0)


def _build() -> None:
    global _module, _build_error
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # pip's ninja, in a virtual environment run without activating it
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        options = dict(name="sdpatch_native", sources=[str(_SOURCE)], extra_cflags=["-O2"])
        # The compiler runs in a process of its own session, with no pipe to this one: a short run that
        # exits (or takes a Ctrl-C) mid-build would otherwise leave the build folder's lock behind, and
        # every later process would wait on it. Then the load here is an import; after a failed build,
        # it fails again with the reason.
        subprocess.run([sys.executable, "-c", f"from torch.utils.cpp_extension import load; load(**{options!r})"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _module = load(**options, verbose=False)
        logger.info("sdpatch native launch path built in %.1f s", time.perf_counter() - start)
    except Exception as e:  # no compiler, no ninja, a read-only cache: the Python launchers remain
        _build_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logger.warning("sdpatch native launch path unavailable (%s: %s); launching through Triton's launcher",
                       type(e).__name__, e)


def module():
    """The compiled module, or None: while it builds (in the background, from the first call on),
    or where it cannot be built, or with the path turned off."""
    global _builder
    if _module is None and ENABLED and _builder is None:
        with _build_lock:
            if _builder is None:
                _builder = threading.Thread(target=_build, name="sdpatch-native-build", daemon=True)
                _builder.start()
    return _module if ENABLED else None


@contextlib.contextmanager
def enabled(on: bool):
    """Within the block, launchers use the native path only if ``on`` (and it was on before); the
    benchmarks time "sdpatch python", the Python launchers alone, this way."""
    global ENABLED
    before = ENABLED
    ENABLED = before and on
    try:
        yield
    finally:
        ENABLED = before


def status() -> str:
    """The path's state in words, for ``sdpatch info``; starts no build."""
    if not ENABLED:
        return "off (SDPATCH_NATIVE=0)"
    if _module is not None:
        return "ready"
    if _build_error is not None:
        return f"unavailable ({_build_error}); Triton's launcher serves every call"
    if _builder is not None:
        return "building"
    return "built at the first CUDA call, in the background (cached per machine)"


def wait(timeout: float | None = 600) -> bool:
    """Block until the module is built (or its build failed), at most ``timeout`` seconds; whether it
    is usable. Benchmarks call this so that every timed call takes the same path."""
    module()
    if _builder is not None:
        _builder.join(timeout)
    return module() is not None


def scalar_cell(ty: str, value) -> int | None:
    """A scalar parameter of Triton type ``ty`` as a cell's integer value; None for a type not handled."""
    fmt = _SCALAR_FORMATS.get(ty)
    if fmt is None:
        return None
    return int.from_bytes(struct.pack("<" + fmt, value).ljust(8, b"\0"), "little")


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of what ``t`` can address."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    start = t.storage_offset() * t.element_size()
    return t.untyped_storage().data_ptr(), start, start + extent * t.element_size()


def _signature(binary) -> list[str] | None:
    """Each runtime parameter's Triton type ('constexpr' for specialized ones) in order, or None
    when the compiled kernel needs what the native launch does not do (scratch memory, clusters,
    cooperative or programmatic launches, tensor descriptors not lowered to TMA)."""
    compiled = binary.compiled
    meta = compiled.metadata
    if any(getattr(meta, name, 0) for name in ("global_scratch_size", "profile_scratch_size",
                                                "launch_cooperative_grid", "launch_pdl")):
        return None
    if getattr(meta, "num_ctas", 1) != 1:
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict) or any(not isinstance(t, str) for t in signature.values()):
        return None
    descriptors = sum(t.startswith("tensordesc") for t in signature.values())
    if descriptors and (_tensordesc_arg is None or len(getattr(meta, "tensordesc_meta", None) or ()) != descriptors):
        return None
    return list(signature.values())


def _triton_tensordesc_arg():
    """Triton's expansion of a host tensor descriptor into launch arguments (a CUtensorMap, then
    the shape and strides), and its map of TMA data types to the driver's; None where this Triton
    has neither (the descriptors' launches then stay with Triton)."""
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST, make_tensordesc_arg
    except ImportError:
        return None
    return make_tensordesc_arg, TMA_DTYPE_DEVICE_TO_HOST


_tensordesc_arg = _triton_tensordesc_arg()


def tensor_map(desc, meta: dict) -> tuple | None:
    """A host tensor descriptor as the C++ module encodes it per call: (data type, swizzle, OOB
    fill, dims, byte strides, box), innermost dim first, as Triton's launcher hands them to
    cuTensorMapEncodeTiled; None for what it does not handle (fp4 padding)."""
    if meta.get("fp4_padded"):
        return None
    _, device_to_host = _tensordesc_arg
    strides = [s * meta["elem_size"] for s in desc.strides[:-1]]
    return (device_to_host[meta["elem_type"]], meta["swizzle"], int(desc.padding == "nan"), list(desc.shape)[::-1],
            strides[::-1], list(meta["block_size"])[::-1])


def _expands_as_cells(desc, meta: dict) -> bool:
    """Whether Triton's launcher passes this descriptor as the program does: one CUtensorMap, then
    its shape (i32 each) and strides (i64 each). Asked of Triton's own expansion, once per recording."""
    make_arg, _ = _tensordesc_arg
    try:
        expanded = make_arg(desc, meta)
    except Exception:  # noqa: BLE001 - whatever this Triton's expansion wants, the program cannot replay it
        return False
    return len(expanded) == 1 + 2 * len(desc.shape) and list(expanded[1:]) == [*desc.shape, *desc.strides]


def build_program(mod, inputs: tuple, record: list, outputs: tuple):
    """The module's program replaying ``record`` (one ``(binary, grid, args)`` per launch, in order)
    for ``inputs``, returning ``outputs``; None if some launch cannot be replayed.

    Tensors among a launch's arguments that are not inputs are the call's own buffers: each is
    allocated, with its recorded sizes, strides and dtype, just before the first launch that takes
    it, as the Python launcher allocated it. Buffers must not overlap inputs or one another.
    """
    if not record or any(r is None for r in record):
        return None
    program = mod.Program()
    slots = {id(t): i for i, t in enumerate(inputs) if t is not None}
    spans = [_span(t) for t in inputs if t is not None]
    n_slots = len(inputs)
    for binary, grid, args in record:
        signature = _signature(binary)
        if signature is None or len(signature) < len(args):
            return None
        cells, pointers, allocate, maps = [], [], [], []
        metas = iter(getattr(binary.compiled.metadata, "tensordesc_meta", None) or ())

        def slot_of(t: torch.Tensor) -> int | None:
            """The slot holding ``t``: an input, or a buffer of the call (given a slot on first use)."""
            nonlocal n_slots
            slot = slots.get(id(t))
            if slot is None:  # a buffer this call allocated
                storage, lo, hi = span = _span(t)
                if any(s == storage and lo < h and l < hi for s, l, h in spans):
                    return None
                spans.append(span)
                slot = slots[id(t)] = n_slots
                n_slots += 1
                program.buffer(list(t.shape), list(t.stride()), t.dtype)
                allocate.append(slot)
            return slot

        for ty, arg in zip(signature, args):
            if ty == "constexpr":
                continue
            if ty.startswith("tensordesc"):  # a CUtensorMap cell, then what Triton passes beside it
                meta = next(metas)
                spec = tensor_map(arg, meta)
                if spec is None or not isinstance(arg.base, torch.Tensor) or not _expands_as_cells(arg, meta):
                    return None
                slot = slot_of(arg.base)
                if slot is None:
                    return None
                maps.append((len(cells), slot, *spec))
                cells += [0, *(scalar_cell("i32", n) for n in arg.shape), *(scalar_cell("i64", s) for s in arg.strides)]
            elif ty.startswith("*"):
                slot = slot_of(arg) if isinstance(arg, torch.Tensor) else None
                if slot is None:
                    return None
                pointers.append((len(cells), slot))
                cells.append(0)
            else:
                cell = scalar_cell(ty, arg)
                if cell is None:
                    return None
                cells.append(cell)
        num_warps, _num_ctas, shared = binary.metadata
        program.launch(binary.function, list(grid), 32 * num_warps, shared, [*cells, *_SCRATCH_CELLS], pointers, allocate,
                       maps)
    out_slots = [-1 if t is None else slots.get(id(t), -2) for t in outputs]
    if any(s == -2 or 0 <= s < len(inputs) for s in out_slots):  # every output is a buffer of the call
        return None
    program.outputs = out_slots
    return program


class Site:
    """One launcher's programs, by input layout and options (the softmax scale, flags)."""

    __slots__ = ("registry", "launch_hooked", "raw_stream", "hits")

    def __init__(self, launch_hooked):
        self.registry = None
        self.launch_hooked = launch_hooked  # a profiler's hooks want Triton's own launch path
        self.raw_stream = None
        self.hits = 0  # calls served by a program (the GPU checks count them)

    def run(self, inputs: tuple, options: tuple, device: int):
        """The outputs of the program recorded for these inputs, or None (no program, path off)."""
        registry = self.registry
        if registry is None or not ENABLED or self.launch_hooked():
            return None
        found = registry.run(inputs, options, self.raw_stream(device))
        if found is not None:
            self.hits += 1
        return found

    def recording(self, plan, t: torch.Tensor) -> list | None:
        """A list for the launcher to record this call's launches into, when ``plan`` (of CUDA
        tensors like ``t``) has no program yet and the module is ready; else None."""
        if plan.native is None and t.is_cuda and module() is not None and not self.launch_hooked():
            return []
        return None

    def register(self, plan, record: list | None, inputs: tuple, options: tuple, outputs: tuple) -> None:
        """Make ``record`` the program for these inputs; ``plan.native`` keeps whether it could."""
        if record is None or any(r is None for r in record):  # a launch compiled on this call: try the next
            return
        mod = module()
        program = build_program(mod, inputs, record, outputs) if mod is not None else None
        if program is None:  # the plan launches through Python for good
            plan.native = False
            logger.debug("no native program for this layout: a launch cannot be replayed")
            return
        if self.registry is None:
            self.registry = mod.Registry()
            self.raw_stream = torch._C._cuda_getCurrentRawStream
        elif len(self.registry) >= MAX_PROGRAMS:  # endless new shapes: start over, as the launch plans do
            self.registry.clear()
        self.registry.add(list(inputs), list(options), program)
        plan.native = True
