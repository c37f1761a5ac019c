"""CUDA-graph capture of a model's forward: the denoising loop's UNet (and ControlNet) call.

On a fast GPU a diffusers denoising step is bound by the host: PyTorch's eager mode spends more time
in Python and kernel launches than the GPU spends in the kernels (SD 1.5 at 512² on an H200: 28 ms a
step eagerly, 12 ms replayed from a graph). :func:`capture` wraps a module's ``forward`` so that each
new input signature (the tree of arguments, with every tensor's shape, dtype, device and strides, and
every other value) runs eagerly ``warmup`` times (:data:`WARMUP_CALLS`), which autotunes the kernels
and launches each a first time, and is captured into a ``torch.cuda.CUDAGraph`` right after the last of them; every later
call with that signature copies its tensors into the graph's inputs and replays it. The denoising loop's
first two steps carry the warm-up and the capture; every other step is a replay.

A new signature's attention kernels are not compiled in its first step. The runner's eager calls,
warm-ups and others, run in background mode (:func:`sdpatch.kernels.runtime.compiles_in_background`):
the first warm-up hands every layout whose kernel has not launched yet to background threads, and
PyTorch's SDPA serves those layouts meanwhile (:func:`sdpatch.kernels.forward.stand_in`): the first
step costs about what an unpatched pipeline's does, where compiling a dozen kernels one after another
took seconds. The compiles start once the graph is captured (much of a compile holds the GIL, which
the warm-up needs), the graph replays with the stand-ins until they are done, and the first call after
that warms the signature up and captures it again (``recaptures`` in the stats), into the same memory
pool. All of a module's graphs share one pool, so graphs of several sizes cost about the largest
one's activations. A patched model's calls that no graph serves compile in the background too (see
"eager calls" below).

This is PyTorch's own machinery (``torch.cuda.graph`` with a shared pool) applied to the one call that
repeats: no compiler is involved, so there is no compile time, and the images equal eager's.
``torch.compile(mode="reduce-overhead")`` builds the same kind of graphs, after compiling.

A call runs eagerly instead, and the first time for each reason a log line says why, when:

- autograd would record it (grad enabled and any parameter or input requires grad);
- it is traced by ``torch.compile`` or already inside a capture;
- an input tensor is not on the module's CUDA device, or a non-tensor argument is unhashable;
- the module is offloaded (accelerate's or diffusers' hooks move its weights per call);
- the signature is new (its warm-up), or the module already holds ``max_graphs`` graphs (arguments
  that change every call: a LoRA scale set per step, say);
- capturing the signature failed (an operation that synchronizes, a kernel that cannot be captured).

What the graph bakes in and this module cannot see: the module's weights are read from their memory
each replay (in-place updates show), but modules or parameters replaced after capture (new LoRA
weights, ``fuse_qkv_projections``, another attention processor) and Python attributes read in
``forward`` are not. Call :func:`reset` after such changes; :func:`sdpatch.patch_unet` does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from . import undo as changes

logger = logging.getLogger(__name__)

_RUNNER = "_sdpatch_graphs"  # attribute on a captured module: its GraphRunner
GRAPHS = "cuda_graphs"  # what capture's changes are recorded under (sdpatch.undo)
MAX_GRAPHS = 8  # signatures a module captures; past that, new ones run eagerly
# Eager calls of a new signature before its capture: the Triton forward autotunes on a layout's first
# call and launches through the JIT on its second; from the third on every launch is a compiled
# binary's, so nothing is compiled, loaded or benchmarked inside the capture.
WARMUP_CALLS = 2
WARMUP = "warm-up of a new input signature"


@dataclass
class _Entry:
    """One captured signature: its graph, the tensors it reads and the output it writes."""

    graph: Any
    inputs: list[torch.Tensor]
    output: Any
    call: tuple  # (args, kwargs) of the captured call: ``inputs`` in their places
    provisional: bool = False  # holds stand-ins for kernels that were compiling: captured again once they are done


@dataclass
class GraphStats:
    """What a module's graphs did, for the run report."""

    graphs: int = 0
    recaptures: int = 0  # graphs captured again once the kernels compiled in the background were done
    replays: int = 0
    eager_calls: int = 0
    capture_s: float = 0.0  # host time spent capturing, all signatures
    compile_s: float = 0.0  # from the start of new signatures' background compiles until they were found done
    stand_in_replays: int = 0  # replays of graphs holding stand-ins for kernels that compiled meanwhile
    pool_bytes: int = 0  # CUDA memory reserved while capturing: the graphs' shared pool
    eager_reasons: dict[str, int] = field(default_factory=dict)  # reason -> calls

    def to_dict(self) -> dict:
        return {
            "graphs": self.graphs,
            "recaptures": self.recaptures,
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "capture_s": round(self.capture_s, 4),
            "compile_s": round(self.compile_s, 4),
            "stand_in_replays": self.stand_in_replays,
            "pool_bytes": self.pool_bytes,
            "eager_reasons": dict(self.eager_reasons),
        }


class GraphRunner:
    """A module's ``forward``, replayed from CUDA graphs by input signature (see the module docs).

    ``graph_factory`` and ``capture_context`` stand in for ``torch.cuda.CUDAGraph`` and
    ``torch.cuda.graph`` where CUDA is absent (the tests' stand-ins); ``reserved`` and
    ``pool_factory`` likewise for ``torch.cuda.memory_reserved`` and ``torch.cuda.graph_pool_handle``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        forward: Callable,
        *,
        warmup: int = WARMUP_CALLS,
        max_graphs: int = MAX_GRAPHS,
        graph_factory: Callable[[], Any] | None = None,
        capture_context: Callable[..., Any] | None = None,
        reserved: Callable[[], int] | None = None,
        pool_factory: Callable[[], Any] | None = None,
    ):
        self.module = module
        self.forward = forward
        self.warmup = warmup
        self.max_graphs = max_graphs
        self._graph_factory = graph_factory or torch.cuda.CUDAGraph
        self._capture_context = capture_context or torch.cuda.graph
        self._reserved = reserved or torch.cuda.memory_reserved
        self._pool_factory = pool_factory or (torch.cuda.graph_pool_handle if graph_factory is None else (lambda: None))
        self._pool = None
        self.entries: dict[Any, _Entry] = {}
        # Graphs holding stand-ins, replayed no more, kept until their signature is captured again:
        # the new capture then shares their pool and reuses its memory. PyTorch frees a pool's memory
        # only once no graph holds it and the cache is emptied, so a new pool would add its size to
        # the reserve for the rest of the process.
        self.retired: dict[Any, _Entry] = {}
        self.seen: dict[Any, int] = {}
        self.failed: dict[Any, str] = {}
        self.stats = GraphStats()
        self._compiles_started: float | None = None  # when the background compiles now running started

    # -- the call ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key, reason = self._signature(leaves, spec)
        if reason is None:
            entry = self.entries.get(key)
            if entry is not None and entry.provisional and not compiling_later():
                self._drop(key)
                entry = None
            if entry is not None:
                self._start_compiles()
                return self._replay(entry, leaves)
            reason = self._why_not_capture(key)
            if reason is None:  # no warm-up asked for: capture, then replay this very call
                entry = self._capture(key, leaves, spec)
                if entry is not None:
                    return self._replay(entry, leaves)
                reason = self.failed[key]
        self._eager(reason)
        first = reason == WARMUP and self.seen[key] == 1
        # Every eager call but a trace's runs in background mode: none waits for a kernel compiling.
        with _for_capture() if reason == WARMUP else contextlib.nullcontext(), \
                contextlib.nullcontext() if torch.compiler.is_compiling() else _in_background():
            output = self.forward(*args, **kwargs)
        captures = reason == WARMUP and self.seen[key] >= self.warmup and len(self.entries) < self.max_graphs
        if captures:  # captured now, replayed from the next call on: the one-time cost stays in this call
            self._capture(key, leaves, spec)
        if captures or not first:
            self._start_compiles()
        return output

    def _signature(self, leaves: list, spec) -> tuple[Any, str | None]:
        """The graph key of a call, or the reason the call cannot be replayed from one."""
        if torch.compiler.is_compiling():
            return None, "traced by torch.compile"
        device = self._device()
        if device is None:
            return None, "the module's weights are not on a CUDA device"
        if _offloaded(self.module):
            return None, "the module is offloaded: its weights move between calls"
        if torch.is_grad_enabled() and (
            any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
            or any(p.requires_grad for p in self.module.parameters())
        ):
            return None, "autograd is recording (training)"
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None, "already inside a CUDA-graph capture"
        parts = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                # A timestep may come as a CPU scalar: the graph's copy of it lives on the device.
                if leaf.device != device and not (leaf.device.type == "cpu" and leaf.numel() == 1):
                    return None, f"an input tensor is on {leaf.device}, the module on {device}"
                parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return None, f"an argument of type {type(leaf).__name__} is unhashable"
                parts.append((type(leaf), leaf))
        return (repr(spec), tuple(parts), torch.is_grad_enabled(), torch.is_autocast_enabled()), None

    def _why_not_capture(self, key) -> str | None:
        if key in self.failed:
            return self.failed[key]
        if len(self.entries) >= self.max_graphs:
            return f"{self.max_graphs} graphs held already (arguments that change every call?)"
        seen = self.seen.get(key, 0)
        if seen < self.warmup:
            self.seen[key] = seen + 1
            return WARMUP
        return None

    def _capture(self, key, leaves: list, spec) -> _Entry | None:
        start = time.perf_counter()
        device = self._device()
        inputs = [t.to(device, copy=True) for t in leaves if isinstance(t, torch.Tensor)]
        it = iter(inputs)
        static = [next(it) if isinstance(t, torch.Tensor) else t for t in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        graph = self._graph_factory()
        if self._pool is None:
            self._pool = self._pool_factory()
        reserved, stood_in = self._reserved(), stand_in_calls()
        try:
            with _for_capture(), self._capture_context(graph, pool=self._pool):
                output = self.forward(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - whatever the forward cannot do under capture
            why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            self.failed[key] = f"capturing this input signature failed ({why})"
            logger.warning("sdpatch: CUDA-graph capture failed (%s); this input signature runs eagerly", why)
            _clear_capture_error()
            self._release_retired(key)
            return None
        entry = self.entries[key] = _Entry(graph, inputs, output, (args, kwargs), stand_in_calls() != stood_in)
        self._release_retired(key)
        self.stats.graphs += 1
        self.stats.capture_s += time.perf_counter() - start
        self.stats.pool_bytes += max(0, self._reserved() - reserved)
        logger.info("sdpatch: captured a CUDA graph of %s in %.2f s", type(self.module).__name__, time.perf_counter() - start)
        return entry

    def _drop(self, key) -> None:
        """Retire a graph that holds stand-ins, its kernels now compiled: the signature warms up again
        (the first call tunes or first launches each kernel, neither of which a capture can hold) and
        is captured with them, into the retired graph's pool (see ``retired``)."""
        self.retired[key] = self.entries.pop(key)
        self.seen[key] = 0
        self.stats.graphs -= 1
        self.stats.recaptures += 1
        if self._compiles_started is not None:
            self.stats.compile_s += time.perf_counter() - self._compiles_started
            self._compiles_started = None
        logger.info("sdpatch: kernels compiled in the background are ready; %s is captured again", type(self.module).__name__)

    def _release_retired(self, key) -> None:
        """Free the retired graph of ``key``, once its signature's new capture is done or failed."""
        self.retired.pop(key, None)
        if not self.entries and not self.retired:  # PyTorch's allocator refuses captures into a pool whose last graph is gone
            self._pool = None

    def _start_compiles(self) -> None:
        """Start the background compiles a first warm-up asked for (:func:`_start_deferred`)."""
        if _start_deferred() and self._compiles_started is None:
            self._compiles_started = time.perf_counter()

    def _replay(self, entry: _Entry, leaves: list):
        for dst, src in zip(entry.inputs, (t for t in leaves if isinstance(t, torch.Tensor))):
            dst.copy_(src, non_blocking=True)
        entry.graph.replay()
        self.stats.replays += 1
        self.stats.stand_in_replays += entry.provisional
        # A copy: the next replay overwrites the graph's output, and a caller may still hold this one.
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.output)

    def _eager(self, reason: str) -> None:
        counts = self.stats.eager_reasons
        if reason not in counts:
            logger.log(logging.DEBUG if reason == WARMUP else logging.INFO,
                       "sdpatch: %s runs eagerly: %s", type(self.module).__name__, reason)
        counts[reason] = counts.get(reason, 0) + 1
        self.stats.eager_calls += 1

    def _device(self) -> torch.device | None:
        p = next(self.module.parameters(), None)
        if p is None or (p.device.type != "cuda" and self._graph_factory is torch.cuda.CUDAGraph):
            return None
        return p.device

    def reset(self) -> None:
        """Drop every graph (and, once nothing else holds it, their memory pool)."""
        self.entries.clear()
        self.retired.clear()
        self.seen.clear()
        self.failed.clear()
        self._pool = None


def _for_capture():
    """The kernels' launch mode for a signature's warm-up and capture: the attention kernel the
    graph holds is then the one the warm-up compiled (:func:`sdpatch.kernels.forward.for_capture`)."""
    from .kernels.forward import for_capture

    return for_capture()


def _triton():
    """sdpatch's kernel runtime, or None where Triton cannot be imported (then nothing compiles)."""
    from .attention.triton_backend import import_error

    if import_error() is not None:
        return None
    from .kernels import runtime

    return runtime


def _in_background():
    """A first warm-up's block: its new layouts compile in the background while stand-ins serve
    (:func:`sdpatch.kernels.runtime.compiles_in_background`)."""
    runtime = _triton()
    return contextlib.nullcontext() if runtime is None else runtime.compiles_in_background()


def _start_deferred() -> int:
    """Start the background compiles asked for so far; how many started."""
    runtime = _triton()
    return 0 if runtime is None else runtime.start_deferred()


def compiling_later() -> bool:
    """Whether kernels are still compiling in the background (or still to start)."""
    runtime = _triton()
    return runtime is not None and runtime.compiling_later()


def wait_for_kernels(timeout: float | None = None) -> bool:
    """Wait until the attention kernels compiling in the background are done (those still to start
    start now), at most ``timeout`` seconds; whether they are. Until then PyTorch's SDPA serves their
    calls: wait before timing a patched model, or to have its next calls on sdpatch's kernels."""
    _start_deferred()
    deadline = None if timeout is None else time.monotonic() + timeout
    while compiling_later():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def stand_in_calls() -> int:
    """Attention calls PyTorch's SDPA served in this process while their kernels compiled in the
    background (:func:`sdpatch.kernels.runtime.stood_in`)."""
    runtime = _triton()
    return 0 if runtime is None else runtime.stood_in()


# -- eager calls -----------------------------------------------------------------------------------
# A patched model's calls that no graph replays (patch_unet without cuda_graphs, --no-cuda-graphs, a
# --vram-budget plan) compile new layouts' kernels in the background too, as a graph's first warm-up
# does: a forward pre-hook puts the call in background mode, and a forward hook, run even when the
# call raises, ends it and starts the compiles it asked for (on the runtime's one background
# compile thread: an eager loop is host-bound, and shares the GIL with it). Calls a graph runner
# serves, and traces, are left to the runner and the trace. Only inference calls stand aside
# (:func:`sdpatch.kernels.runtime.stands_aside`): a training call needs its kernel's log-sum-exp, and
# compiles as it comes.
_eager = threading.local()  # .open: per hooked call in progress, (a weak reference to its module, whether it entered background mode)


def compile_eagerly_in_background(module: torch.nn.Module) -> None:
    """Give ``module``'s eager calls background compiles (see above); idempotent. Undo with
    :func:`stop_eager_background`."""
    if any(h is _eager_begin for h in module._forward_pre_hooks.values()):
        return
    module.register_forward_pre_hook(_eager_begin, prepend=True)
    module.register_forward_hook(_eager_end, always_call=True)


def stop_eager_background(module: torch.nn.Module) -> None:
    """Remove :func:`compile_eagerly_in_background`'s hooks from ``module`` (found by identity, so
    that a copy of a patched model removes its own)."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, h in hooks.items() if h is _eager_begin or h is _eager_end]:
            del hooks[key]
            module._forward_hooks_always_called.pop(key, None)


def _eager_begin(module: torch.nn.Module, args) -> None:
    """The forward pre-hook: background mode for the call, unless a graph runner or a trace has it."""
    if torch.compiler.is_compiling():
        return
    runtime = _triton() if runner_of(module) is None else None
    stack = _eager.__dict__.setdefault("open", [])
    # A model does not call itself: an entry of its own still open, or of a model since deleted, is
    # a call that an interrupt cut short (KeyboardInterrupt passes by the always_call hook), which
    # must not leave the mode on.
    while any(m() is module or m() is None for m, _ in stack):
        _close(stack.pop()[1])
    stack.append((weakref.ref(module), runtime is not None and runtime.background_on()))


def _eager_end(module: torch.nn.Module, args, output) -> None:
    """The forward hook (also when the call raised): out of background mode, the compiles started."""
    if torch.compiler.is_compiling() or not getattr(_eager, "open", None):
        return
    _close(_eager.open.pop()[1])


def _close(entered: bool) -> None:
    if entered:
        runtime = _triton()
        runtime.background_off()
        runtime.start_deferred()


def _offloaded(module: torch.nn.Module) -> bool:
    """Whether accelerate's or diffusers' hooks may move the module's weights during a call."""
    return any(hasattr(m, "_hf_hook") or hasattr(m, "_diffusers_hook") for m in (module, *module.children()))


def _clear_capture_error() -> None:
    """After a failed capture, clear CUDA's sticky capture error so that eager calls can go on."""
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            pass


def capture(module: torch.nn.Module, **options) -> GraphRunner:
    """Replay ``module``'s forward from CUDA graphs from now on (see the module docs); idempotent.

    ``options`` go to :class:`GraphRunner` (``warmup``, ``max_graphs``). Returns the runner, whose
    ``stats`` say what it did. The change is recorded through :mod:`sdpatch.undo`, and
    :func:`release` takes it back.
    """
    runner = getattr(module, _RUNNER, None)
    if runner is not None:
        return runner
    runner = GraphRunner(module, module.forward, **options)
    changes.record(module, GRAPHS, runner.reset)
    changes.record(module, GRAPHS, changes.attributes([(module, "forward"), (module, _RUNNER)]))
    setattr(module, _RUNNER, runner)
    module.forward = runner  # an instance attribute: nn.Module.__call__ finds it before the class's
    return runner


def runner_of(module: torch.nn.Module) -> GraphRunner | None:
    """The module's :class:`GraphRunner`, if :func:`capture` was applied."""
    return getattr(module, _RUNNER, None)


def reset(module: torch.nn.Module) -> None:
    """Drop the module's graphs (after changing its weights' objects, adapters or processors)."""
    runner = runner_of(module)
    if runner is not None:
        runner.reset()


def release(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`capture`: the module's own forward again, its graphs freed. Returns ``module``."""
    changes.undo(module, GRAPHS)
    return module


def graphed_components(pipe: object) -> list[tuple[str, torch.nn.Module]]:
    """The components of a pipeline (or the model itself) whose forward the denoising loop repeats:
    the UNet, and a ControlNet where there is one."""
    if isinstance(pipe, torch.nn.Module):
        return [("model", pipe)]
    components = getattr(pipe, "components", None) or {}
    return [(n, components[n]) for n in ("unet", "controlnet") if isinstance(components.get(n), torch.nn.Module)]
