"""Peak-memory and time measurement of the phases of a run.

On a CUDA device a phase's peak is PyTorch's caching-allocator peak (``max_memory_allocated``
and ``max_memory_reserved``), reset at the start of every phase. Elsewhere (CPU, MPS) it is the
peak resident memory of the whole process, labelled as host memory: on Linux its high-water
mark is reset at each phase start (``/proc/self/clear_refs``), so it is the phase's own peak;
where that cannot be reset it is ``ru_maxrss``, the peak since the process started, and the
report says so through :attr:`MemoryMeter.host_scope`.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

MIB = 1024**2
# The phases of a generation as reports name them.
PHASE_LABELS = {"text_encoding": "text encoding", "denoising": "denoising", "vae_decode": "VAE decode"}


@dataclass
class PhaseStats:
    """Time and peak memory of one phase, in seconds and bytes.

    ``peak_allocated``/``peak_reserved`` are set on CUDA, ``peak_host`` elsewhere.
    ``step_seconds`` holds the wall time of each step of a loop phase (the denoising loop).
    """

    name: str
    seconds: float = 0.0
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    peak_host: int | None = None
    step_seconds: list[float] | None = None

    @property
    def steps(self) -> int | None:
        return len(self.step_seconds) if self.step_seconds else None

    @property
    def seconds_per_step(self) -> float | None:
        """Mean step time, leaving out the first step when there are others: it carries one-time
        costs (Triton compilation and autotuning, cuDNN plans, allocator growth)."""
        if not self.step_seconds:
            return None
        steady = self.step_seconds[1:] or self.step_seconds
        return sum(steady) / len(steady)

    @property
    def first_step_seconds(self) -> float | None:
        return self.step_seconds[0] if self.step_seconds else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "steps": self.steps,
            "seconds_per_step": self.seconds_per_step,
            "first_step_seconds": self.first_step_seconds,
        }


@dataclass
class MemoryMeter:
    """Measures consecutive phases on one device.

    Use ``with meter.phase("name"):`` for a phase that is a block of code, or :meth:`start` and
    :meth:`switch` when the boundary is inside a callback (e.g. between diffusers' denoising
    loop and its VAE decode). :attr:`current` names the phase that is running, so that a failure
    (an out-of-memory error, say) can be attributed to it.
    """

    device: torch.device
    phases: list[PhaseStats] = field(default_factory=list)
    current: str | None = None
    _t0: float = 0.0
    _host_reset: bool | None = None

    @property
    def kind(self) -> Literal["cuda", "host"]:
        """``cuda``: allocator figures of the GPU; ``host``: process resident memory."""
        return "cuda" if self.device.type == "cuda" else "host"

    @property
    def host_scope(self) -> Literal["phase", "process"] | None:
        """For host memory, whether each peak is the phase's own or the process's since start."""
        if self.kind == "cuda":
            return None
        return "phase" if self._host_reset is not False else "process"

    def start(self, name: str) -> None:
        """Begin phase ``name``: synchronize, reset the peaks, start the clock."""
        self.synchronize()
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._host_reset = _reset_host_peak()
        self.phases.append(PhaseStats(name))
        self.current = name
        self._t0 = time.perf_counter()

    def stop(self) -> PhaseStats:
        """End the current phase and record its time and peaks."""
        if self.current is None:
            raise RuntimeError("MemoryMeter.stop() without a phase in progress")
        self.synchronize()
        stats = self.phases[-1]
        stats.seconds = time.perf_counter() - self._t0
        if self.kind == "cuda":
            stats.peak_allocated = torch.cuda.max_memory_allocated(self.device)
            stats.peak_reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            stats.peak_host = host_peak_bytes()
        self.current = None
        return stats

    def switch(self, name: str) -> PhaseStats:
        """End the current phase and begin the next; returns the stats of the one that ended."""
        stats = self.stop()
        self.start(name)
        return stats

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseStats]:
        """Measure the block as phase ``name``. On an exception the phase is left open."""
        self.start(name)
        yield self.phases[-1]
        self.stop()

    def in_use(self) -> int:
        """Bytes in use now: allocated by PyTorch on CUDA, the process's resident memory elsewhere."""
        self.synchronize()
        if self.kind == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return host_resident_bytes()

    def synchronize(self) -> None:
        """Wait for the device's queued work, so that times and peaks cover it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (its weights' size in memory)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def weights_bytes(components: dict[str, Any]) -> dict[str, int]:
    """Weights' size per component, for the ``torch.nn.Module`` values of ``components``."""
    return {name: module_bytes(m) for name, m in components.items() if isinstance(m, torch.nn.Module)}


def summarize(runs: Iterable[list[PhaseStats]]) -> list[PhaseStats]:
    """Combine several runs' phases by name: mean time, highest peaks, and the steps of all runs
    in order (so that only the very first step counts as warm-up)."""
    grouped: dict[str, list[PhaseStats]] = {}
    for phases in runs:
        for p in phases:
            grouped.setdefault(p.name, []).append(p)
    out = []
    for name, items in grouped.items():
        out.append(
            PhaseStats(
                name,
                seconds=sum(p.seconds for p in items) / len(items),
                peak_allocated=_max(p.peak_allocated for p in items),
                peak_reserved=_max(p.peak_reserved for p in items),
                peak_host=_max(p.peak_host for p in items),
                step_seconds=[t for p in items for t in p.step_seconds or []] or None,
            )
        )
    return out


def total(phases: list[PhaseStats]) -> PhaseStats:
    """The whole run as one phase: summed time and the highest peaks."""
    return PhaseStats(
        "total",
        seconds=sum(p.seconds for p in phases),
        peak_allocated=_max(p.peak_allocated for p in phases),
        peak_reserved=_max(p.peak_reserved for p in phases),
        peak_host=_max(p.peak_host for p in phases),
    )


def host_peak_bytes() -> int:
    """Peak resident memory of this process (since start, or since the last reset on Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def host_resident_bytes() -> int:
    """Resident memory of this process now."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # not Linux: no /proc

    return psutil.Process().memory_info().rss


def host_available_bytes() -> int:
    """Host memory available to new allocations now (psutil's ``available``)."""
    import psutil

    return psutil.virtual_memory().available


_OOM_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError, MemoryError)


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` means the device (or host) ran out of memory."""
    if isinstance(err, _OOM_ERRORS):  # torch.OutOfMemoryError from 2.5 on is torch.cuda's class
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text or "not enough memory" in text
    )


def plural(n: int, noun: str) -> str:
    """``1 step``, ``3 steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_bytes(n: int | None) -> str:
    """``1.50 GiB`` / ``312.4 MiB``; an em dash for None."""
    if n is None:
        return "—"
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / MIB:.1f} MiB"


def _reset_host_peak() -> bool:
    # Writing 5 to clear_refs resets the process's peak RSS (VmHWM); Linux 4.0+ only.
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
