"""The launch runtime every launcher shares: launch plans, direct launches of compiled binaries,
grids, alignment hints, and the autotuner's options and parallel compiles.

A launcher keeps a :class:`Plan` per input layout (:func:`cached_plan`): the constexprs, the tiles the
autotuner picked, and the compiled binaries, so that a layout seen before costs its launch and
little else on the host. :func:`launch` goes through Triton's JIT once per (layout, tiles) and
straight to the compiled binary after (:class:`Binary`): no C++ is built on the user's machine. A
layout's first call compiles the autotuners' candidates on a few threads at once (:func:`precompile`);
inside :func:`compiles_in_background` (a CUDA graph's warm-up) it compiles nothing and leaves the
call to a stand-in while its kernels compile on background threads (:func:`stands_aside`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
from dataclasses import dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import triton

logger = logging.getLogger(__name__)

MAX_GRID_Y = 65535  # CUDA's limit on grid dims y and z


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host: ``triton.cdiv`` is a constexpr function, a few us a call."""
    return -(-a // b)


def launch_grid(n_rows: int, bh: int, block_m: int) -> tuple[int, int, int]:
    """Row blocks on grid dim 0 (limit 2^31 - 1); B*H over dims 1 and 2 (65,535 each)."""
    return cdiv(n_rows, block_m), min(bh, MAX_GRID_Y), cdiv(bh, MAX_GRID_Y)


def vector_align(*tensors: torch.Tensor) -> int:
    """The alignment the kernels' row offsets are hinted with, in elements (1: none known).

    Where every stride is a multiple of 16, as at head dims 64 and 128, 16: what Triton infers
    itself from its integer specialization, so that the hint claims no less (a hint of 8 there
    made the backward at head dim 64 run at 208 TFLOP/s against 290 without hints, H200).
    Otherwise, when every row of every tensor still starts 16-byte aligned (head dims 40 and 80),
    one 16-byte vector; else 1.
    """
    if any(t.stride(-1) != 1 or t.data_ptr() % 16 for t in tensors):
        return 1
    strides = [s for t in tensors for s in t.stride()[:-1]]
    for align in (16, 16 // tensors[0].element_size()):
        if all(s % align == 0 for s in strides):
            return align
    return 1


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device, not the tensors': make ``t``'s current (only
    when it is not: switching costs microseconds a call on the host)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# Triton >= 3.3 launches a compiled binary given every parameter's value, constexprs included
# (``CompiledKernel[grid](*args)``); older versions take another list, and keep the JIT path.
_DIRECT_LAUNCH = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3)

try:  # triton >= 3.4 keeps its launch hooks here; 3.3 on CompiledKernel
    from triton import knobs as _knobs
except ImportError:
    _knobs = None


def launch_hooked() -> bool:
    """Whether a profiler (Triton's proton, ...) has hooked kernel launches: then they go through
    Triton's own launch path, which calls the hooks."""
    if _knobs is not None:
        hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    else:
        from triton.compiler import CompiledKernel

        hooks = (CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook)
    return any(getattr(h, "calls", h) for h in hooks)  # triton >= 3.6: a chain, empty when unhooked


def current_device_and_stream():
    """The current CUDA device's index, and the function giving a device's current stream, as Triton has them."""
    from triton.runtime import driver

    return driver.active.get_current_device(), driver.active.get_current_stream


class Binary:
    """A compiled kernel, launched straight through its C launcher (``CompiledKernel.run``).

    Triton's runner (``CompiledKernel[grid]``) looks up the current device and stream, builds
    launch metadata and has the launcher call two (empty) hook chains back in Python, every launch:
    3-5 us of a 9-19 us launch on the lent H200 hosts. The kernel was
    loaded on the device current at its first launch, and :func:`on_device` makes that device
    current for every later launch of its plan, so only the stream is looked up per call.

    Tensors go to the launcher as their addresses: given a tensor, it asks the driver
    (``cuPointerGetAttribute``) whether the address is a device pointer, about a microsecond per
    tensor on the host. The launch plans' keys already fix each tensor's device, so the check can
    tell nothing new. Tensor descriptors go with their encodings reused where this Triton's
    launcher would make them anew every launch (:class:`EncodedLauncher`).
    """

    __slots__ = ("compiled", "consts", "run", "function", "metadata", "device", "current_stream", "pointers", "encoded")

    def __init__(self, compiled, consts: tuple, args: tuple = ()):
        self.compiled, self.consts = compiled, consts
        self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.device, self.current_stream = current_device_and_stream()
        # The argument slots that hold tensors; a plan's key fixes which do.
        self.pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.encoded = _encoded_launcher(compiled.run)

    def __call__(self, grid: tuple, args: tuple) -> None:
        if launch_hooked():
            self.compiled[grid](*args, *self.consts)
            return
        self.launch_flat(grid, self.flat_args(args))

    def flat_args(self, args: tuple) -> list:
        """The C launcher's arguments for ``args`` (its kernel's runtime parameters): tensors as
        their addresses, each tensor descriptor as its encoding, looked up by its slot, base
        address, padding, shape and strides and made only where it is new (see
        :class:`EncodedLauncher`). A caller that launches tensors at the same addresses again may
        keep the list and hand it to :meth:`launch_flat` again, skipping this walk over the arguments."""
        enc = self.encoded
        if enc is None:
            values = list(args)
            for i in self.pointers:
                values[i] = values[i].data_ptr()
            return values
        values = []
        for i, a in enumerate(args):
            meta = enc.slots.get(i)
            if meta is not None:
                key = (i, a.base.data_ptr(), a.padding, *a.shape, *a.strides)
                encoded = enc.maps.get(key)
                if encoded is None:
                    if len(enc.maps) >= MAX_ENCODED:
                        enc.maps.clear()
                    encoded = enc.maps[key] = enc.encode(a, meta)
                values += encoded
            else:
                values.append(a.data_ptr() if i in self.pointers else a)
        return values

    def launch_flat(self, grid: tuple, values: list) -> None:
        """The launch with :meth:`flat_args`' list, on the current stream. The caller checks
        :func:`launch_hooked` first: a hooked launch goes through Triton's runner, with the arguments."""
        enc = self.encoded
        stream = self.current_stream(self.device)
        if enc is None:
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.metadata, None, None, None, *values, *self.consts)
        else:
            enc.launch(grid[0], grid[1], grid[2], stream, self.function, enc.cooperative, enc.pdl, None, None, self.metadata,
                       None, None, None, *values, *self.consts)


# A TMA descriptor's encoding (a CUtensorMap: address, shape, strides, padding, and the box and
# swizzle its slot fixes) is made once per (slot, address, padding, shape, strides); an eager UNet's
# layers reuse a few dozen addresses per layout, which the caching allocator hands out again every step.
MAX_ENCODED = 256


class EncodedLauncher(NamedTuple):
    """A compiled kernel's C launcher under Triton's tensor-descriptor wrapper (Triton 3.5-3.6):
    that wrapper encodes every descriptor argument into a CUtensorMap on every launch
    (``make_tensordesc_arg``, a few microseconds each; the Gluon forward takes eight at split head
    dims). :meth:`Binary.flat_args` hands the launcher the same arguments with the encodings
    reused."""

    launch: Callable  # the C launcher: grid, stream, function, launch flags, scratch, metadata, hooks, arguments
    slots: dict  # argument slot -> its descriptor's metadata
    encode: Callable  # (descriptor, metadata) -> [CUtensorMap, *shape, *strides]
    cooperative: bool
    pdl: bool
    maps: dict  # (slot, address, padding, *shape, *strides) -> the encoded arguments


def _encoded_launcher(runner) -> EncodedLauncher | None:
    """The :class:`EncodedLauncher` of a compiled kernel's runner, where it takes descriptors and
    its launcher has the layout of Triton 3.5-3.6 (flat base arguments, no scratch memory); else
    None, and its launches go through Triton's wrapper."""
    wrapper = getattr(runner, "launch", None)
    code, closure = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or closure is None:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure)))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    metas = cells["tensordesc_meta"]
    if (getattr(driver, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO" or not metas or None in metas
            or getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1)):
        return None
    return EncodedLauncher(cells["launcher"], dict(zip(sorted(cells["tensordesc_indices"]), metas)), driver.make_tensordesc_arg,
                           runner.launch_cooperative_grid, runner.launch_pdl, {})


def launch(kernel, grid: tuple, args: tuple, consts: dict, binaries: dict, key) -> None:
    """Launch a jitted kernel: the first time for ``key`` through Triton's JIT (binding the
    arguments, specializing on them, compiling or finding the binary), later straight to that
    binary (:class:`Binary`).

    The JIT's binding and specialization cost tens of microseconds a launch on the host, as long as
    a whole kernel at 77 keys. ``key`` must fix everything Triton specializes on: dtypes, every
    integer argument (sizes, strides), each pointer's 16-byte alignment, and the constexprs; the
    launch plans' keys with the tile config do. ``args`` are the kernel's leading, runtime
    parameters; ``consts`` its constexprs and launch options.
    """
    binary = binaries.get(key)
    if binary is not None:
        try:
            binary(grid, args)
            return
        except (TypeError, ValueError, KeyError) as e:  # a Triton whose launcher wants other arguments
            _no_direct_launch(binaries, e)
    compiled = kernel[grid](*args, **consts)
    if _DIRECT_LAUNCH and not interpreting() and compiled is not None:
        try:  # the binary takes the constexprs too, in the kernel's parameter order
            binaries[key] = Binary(compiled, tuple(consts[name] for name in kernel.arg_names[len(args):]), args)
        except AttributeError as e:  # a Triton whose compiled kernels lack what Binary launches with
            _no_direct_launch(binaries, e)


def _no_direct_launch(binaries: dict, err: Exception) -> None:
    global _DIRECT_LAUNCH
    _DIRECT_LAUNCH = False
    binaries.clear()
    logger.warning("direct kernel launches disabled (%s: %s); launching through Triton's JIT", type(err).__name__, err)


@dataclass(slots=True)
class Plan:
    """What a launch of one input layout needs besides its tensors: found once, then reused."""

    meta: dict
    config: dict | None = None  # the autotuner's pick, once it has tuned this shape
    binaries: dict = field(default_factory=dict)  # tile config -> compiled kernel (see :func:`launch`)
    tuned: tuple | None = None  # (grid, scalars, constexprs, binary key) of the tuned launch
    later: object = None  # its background compile's future, then LAUNCHED (see :func:`stands_aside`)


# Plans a launcher keeps, by layout. Working out the constexprs and going through Triton's autotuner
# cost tens of microseconds per call on the host, as much as a whole attention kernel at 77 keys; a
# UNet repeats a few dozen layouts.
MAX_PLANS = 4096


def cached_plan(plans: dict, key: tuple, make):
    """``plans[key]``, made by ``make()`` on first use; the cache starts over past ``MAX_PLANS``."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plan = plans[key] = make()
    return plan


def config_kwargs(config: triton.Config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


# Tuned tiles shipped per GPU architecture (``tuned/sm_90.json``), by launcher ("fwd", "bwd") and the
# autotuner's key (:func:`tune_key`), collected on a GPU by ``scripts/collect_tuned_configs.py``. A
# layout found there starts its plan with them, as if tuned: its first call compiles one kernel
# instead of every candidate, and times none. Every other layout tunes (and caches) as before.
TUNED_DIR = Path(__file__).with_name("tuned")


def gpu_arch(device: torch.device) -> str | None:
    """The GPU's architecture as the tables are named (sm_90 for Hopper); None off CUDA and in the
    interpreter, where no table serves."""
    if device.type != "cuda" or interpreting():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def shipped_configs(arch: str) -> dict:
    """The tuned-tile table shipped for ``arch``, {} where none ships."""
    path = TUNED_DIR / f"{arch}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def tune_key(*values) -> str:
    """A table key: the autotuner's key values (sizes, head dim, tiling, mask kind, ...) and the dtype."""
    return "|".join(str(v).removeprefix("torch.") for v in values)


def shipped_config(launcher: str, device: torch.device, key: str):
    """The tiles shipped for ``launcher``'s layout ``key`` on ``device``'s architecture, or None."""
    arch = gpu_arch(device)
    return None if arch is None else shipped_configs(arch).get(launcher, {}).get(key)


# Compiles submitted to an executor while the mode is on (triton 3.6 and 3.9 have it).
_AsyncCompileMode = getattr(triton, "AsyncCompileMode", None)

# Threads compiling a new layout's autotune candidates, or a dry call's kernels, at once. Each compile
# holds a few hundred MiB of host memory while it runs, so at most 8, not one per core.
COMPILE_THREADS = min(8, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def _compile_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="sdpatch-compile")


def precompile(*calls: tuple) -> None:
    """Compile every candidate the autotuners will time for a layout's first call, on
    :data:`COMPILE_THREADS` threads at once, before the autotuners time them one after another.

    Each call is ``(tuner, grid, args, kwargs)`` as the tuner is about to be launched. Triton's
    compiles release the GIL (on 2 CPU cores the six candidates of a (2, 2, 256, 40) forward compiled
    for sm_90 in 2.5-3.2 s on two threads, 4.9-5.1 s one after another), and the autotuner then
    finds each candidate in the kernel's cache. Best effort: where this Triton has no async compile mode, or anything here fails, the
    autotuner compiles each candidate itself, as it would have. Not for configs with a pre-hook
    (the TMA loads'): ``Autotuner.warmup`` does not run it, so it would compile other variants.
    """
    if _AsyncCompileMode is None or COMPILE_THREADS < 2 or interpreting():
        return
    try:
        with _AsyncCompileMode(_compile_pool(), ignore_errors=True):
            for tuner, grid, args, kwargs in calls:
                tuner.warmup(*args, grid=grid, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure leaves the compiling to the autotuner
        logger.debug("parallel precompile skipped (%s: %s)", type(e).__name__, e)


# Compiles in the background (:func:`compiles_in_background`). A layout's first call then takes no
# compile: a kernel found in Triton's disk cache loads in about 0.1 s, a new one compiles in 0.5-1 s
# (Triton) or 2-3.5 s (Gluon), and a UNet has a dozen layouts, one after another as its layers reach
# them. Much of a compile holds the GIL (Triton's code generation is Python), so compiles asked for
# wait in ``_deferred`` until :func:`start_deferred`: the caller starts them once its own host-bound
# work (a CUDA graph's warm-up and capture) is done.
_background = 0  # > 0 inside compiles_in_background()
_later: set = set()  # futures of compile_later not done yet
_deferred: list = []
_stand_ins = 0  # calls a stand-in served while their kernels compiled (see stood_in)


# One thread runs every compile handed to the background, for a graph's warm-up and for eager calls
# alike: the caller's loop is host-bound and shares the GIL with it, and much of a compile holds the
# GIL. Measured on the 2-core CPU machine (triton 3.9, SD 1.5's 8 forward layouts compiled for sm_90,
# 2026-12-04): from Triton's disk cache they loaded in 0.35-0.37 s on one thread and 1.38-1.40 s on
# eight, whose turns at the GIL cost more than they overlap; from scratch, 4.60 s on one and 4.75 s
# on eight. Beside a loop of eager tiny-UNet calls of 18-20 ms, compiling from scratch on one thread
# slowed the loop 1.23-1.30x for 3.9-4.3 s (0.8-1.0 s of its time lost), on two 1.7-2.2x (1.3-1.7 s),
# on eight 6.7x (3.2 s), against 4.3 s in the loop's own thread; cache loads cost it 0.07 s from one
# thread, 0.27 s from two, 0.41 s in its own.
LATER_COMPILE_THREADS = 1


@functools.lru_cache(maxsize=None)
def _later_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(LATER_COMPILE_THREADS, thread_name_prefix="sdpatch-compile-later")


def background_on() -> bool:
    """Enter background mode (:func:`compiles_in_background`) where this Triton has it; whether it
    did. Each True must be paired with :func:`background_off`."""
    global _background
    on = _AsyncCompileMode is not None and not interpreting()
    _background += on
    return on


def background_off() -> None:
    global _background
    _background -= 1


@contextlib.contextmanager
def compiles_in_background():
    """Calls in this block whose layout has no compiled kernel yet hand its compile to background
    threads (:func:`compile_later`) and are served by a stand-in until it is done (:func:`stands_aside`).
    Only where Triton's JIT is known to compile from several threads at once (the versions with its
    async compile mode, 3.6 on); elsewhere, and in the interpreter, calls compile as they come."""
    on = background_on()
    try:
        yield
    finally:
        if on:
            background_off()


def compile_later(device: torch.device, launches: list[tuple]):
    """Compile ``launches`` (each ``(kernel, grid, args, consts)``, as :func:`launch` takes them, or
    an autotuner's ``(tuner, grid, args, kwargs)``: all its candidates) on a background thread once
    :func:`start_deferred` is called, without launching them; returns the future, whose exception is
    the first compile's that failed. The kernels land in their JIT's cache for ``device``, so that
    their first launch after the future is done compiles nothing."""
    from concurrent.futures import Future

    future = Future()
    _later.add(future)
    future.add_done_callback(_later.discard)
    _deferred.append(functools.partial(_build, future, device, [_compile_only(run) for run in launches]))
    return future


def _compile_only(run: tuple) -> tuple:
    """A launch as compiling it needs: each tensor argument, and a tensor descriptor's base,
    replaced by a placeholder of the same dtype, device and 16-byte alignment, which is all Triton
    specializes a kernel on for them (sizes and strides are the kernels' integer arguments). A
    compile waiting its turn then holds none of its call's tensors: a new layout's q, k, v and
    output would stay allocated until it is done, seconds that outlast a short run's VAE decode."""
    kernel, grid, args, consts = run
    return kernel, grid, tuple(_placeholder_for(a) for a in args), consts


def _placeholder_for(arg):
    if isinstance(arg, torch.Tensor):
        return _placeholder(arg.dtype, arg.device, arg.data_ptr() % 16 == 0)
    base = getattr(arg, "base", None)
    if isinstance(base, torch.Tensor) and is_dataclass(arg):  # Triton's TensorDescriptor
        return replace(arg, base=_placeholder(base.dtype, base.device, True))  # its base is aligned
    return arg


def _placeholder(dtype: torch.dtype, device: torch.device, aligned: bool) -> torch.Tensor:
    """A few bytes of ``dtype`` on ``device``, starting 16-byte aligned or not (one element in)."""
    t = torch.empty(32, dtype=dtype, device=device)  # allocations start at least 64-byte aligned
    return t if aligned else t[1:]


def _build(future, device: torch.device, launches: list[tuple]) -> None:
    """:func:`compile_later`'s task: compile ``launches``, and settle ``future`` with the outcome."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for kernel, grid, args, consts in launches:
                kernel.warmup(*args, grid=grid, **consts)
    except BaseException as e:  # noqa: BLE001 - the future carries it to the launcher
        future.set_exception(e)
    else:
        future.set_result(None)


def start_deferred() -> int:
    """Start the compiles :func:`compile_later` was asked for (on :data:`LATER_COMPILE_THREADS`); how many."""
    tasks = len(_deferred)
    for task in _deferred:
        _later_pool().submit(task)
    _deferred.clear()
    return tasks


def compiling_later() -> bool:
    """Whether any compile of :func:`compile_later` is still to start or running."""
    return bool(_later)


def stands_aside(plan: Plan, device: torch.device, launches: Callable[[], list[tuple]]) -> bool:
    """Whether a stand-in serves this call of ``plan``'s layout instead of its kernel.

    Inside :func:`compiles_in_background`, a layout that has launched nothing yet hands
    ``launches()`` (what its first call would compile) to :func:`compile_later`. Until that is done
    every call in that mode stands aside; so does a call under CUDA-graph capture that would be the
    layout's first launch since (an autotuner's timing, or the JIT's first launch, cannot be
    captured). Any other call waits for the compile, which it starts if it is still to start: a
    graph captured after it (``torch.compile``'s cudagraph trees, a user's ``torch.cuda.graph``,
    which warm up first) then holds the kernel, not a stand-in it would keep for good. The first
    call after that takes the kernel, and raises what the compile raised.
    """
    later = plan.later
    if later is None:
        if not _background or plan.binaries:
            return False
        plan.later = compile_later(device, launches())
        return True
    if later is LAUNCHED:
        return False
    if not later.done():
        if _background or capturing(device):
            return True
        start_deferred()
        later.exception()  # waits until it is done
    elif capturing(device):
        return True
    plan.later = LAUNCHED
    if later.exception() is not None:
        raise later.exception()
    return False


LAUNCHED = "launched"  # a plan's ``later`` once its background compile is done and its kernel has served


def capturing(device: torch.device) -> bool:
    """Whether work on ``device``'s current stream is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def stood_in() -> int:
    """Calls a stand-in served so far (a CUDA graph captured while this grows holds stand-ins)."""
    return _stand_ins


def count_stand_in() -> None:
    """Count one call a stand-in served (:func:`sdpatch.kernels.forward.stand_in` does)."""
    global _stand_ins
    _stand_ins += 1


class CompileOnlyDriver:
    """Triton's active driver as far as compiling needs one, for a machine without a GPU: a fixed
    CUDA target (sm_90 by default), device 0, stream 0; nothing can be launched. Set it with
    ``triton.runtime.driver.set_active(CompileOnlyDriver())`` before the first compile, with
    ``TRITON_INTERPRET`` unset (``scripts/kernel_digest.py``, and the tests of :func:`precompile`)."""

    def __init__(self, arch: int = 90, warp_size: int = 32):
        self.arch, self.warp_size = arch, warp_size

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, self.warp_size)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def tile_configs(tiles: list[tuple[int, int, int, int]], pre_hook=None) -> list[triton.Config]:
    """Autotune configs from (BLOCK_M, BLOCK_N, warps, stages) tuples."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=pre_hook) for bm, bn, w, s in tiles]


def autotuner(kernel, configs: list[triton.Config], key: list[str], prune):
    """Triton's autotuner of ``kernel`` over ``configs``, keyed by ``key``, pruned by ``prune``. Make
    it at first use, not at import: triton 3.2's looks up the active GPU driver when it is made, and
    a machine without a GPU has none."""
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune}, **autotune_options())(kernel)


def autotune_options() -> dict:
    """Keep autotuning results on disk beside Triton's kernel cache where Triton can (>= 3.3):
    a pipeline's second run skips the tuning its first run paid."""
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
