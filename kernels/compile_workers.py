"""Kernel compiles in worker processes, so that a dry call's compiles run at once.

Triton's compile holds the GIL for most of its time (its code generation is Python, and its MLIR
passes keep the GIL), so threads compile one kernel at a time: the dry call of SD 1.5's UNet at
512² took 3.9 s for its eight forward kernels on eight threads, about the sum of their times
(H200 host, triton 3.6). Worker processes compile them at once, each into Triton's on-disk cache,
where the launch that follows finds it: the cache key is the kernel's source, its specialization,
the target and the compiler's version, the same in a worker as here.

A worker is a plain ``python -c`` subprocess that reads pickled requests on its stdin and answers
on its stdout; not a ``multiprocessing`` one, which would import the user's main script again in
every worker. It sets a compile-only stand-in for Triton's driver with the GPU's target
(:class:`sdpatch.kernels.runtime.CompileOnlyDriver`: it never touches the GPU), rebuilds the
launch's arguments (Triton specializes a tensor on its dtype and 16-byte alignment alone) and
calls the kernel's ``warmup``. :func:`start` starts the workers, which then import torch and
Triton while the pipeline loads; they live as long as this process, and leave when it does (their
stdin closes).
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

MAX_WORKERS = 8
# Host memory a worker may take: torch and Triton imported (about 0.4 GiB), one compile running.
WORKER_BYTES = 2**30

_WORKER = """
import os, sys
replies = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # what a compile prints goes to stderr: stdout carries the replies
from sdpatch.kernels.compile_workers import serve
serve(sys.stdin.buffer, replies, int(sys.argv[1]))
"""


class _Pointer(NamedTuple):
    """A tensor argument, as Triton specializes it."""

    dtype: str
    aligned: bool  # data_ptr() % 16 == 0


class _NotPortable(Exception):
    """An argument a worker cannot rebuild (a TMA descriptor, ...): compile here."""


def _encode(value):
    if isinstance(value, torch.Tensor):
        return _Pointer(str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise _NotPortable(type(value).__name__)


def _rebuild(value):
    if isinstance(value, _Pointer):
        t = torch.empty(16, dtype=getattr(torch, value.dtype))
        return t if value.aligned else t[1:]
    return value


def _write(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read(stream):
    """The next message, or None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def serve(requests, replies, arch: int) -> None:
    """A worker's loop: compile each request ``(module, kernel, args, grid, constexprs)`` for
    ``arch`` and reply "" (done) or the error's text; return at the end of ``requests``."""
    import triton

    from .runtime import CompileOnlyDriver

    triton.runtime.driver.set_active(CompileOnlyDriver(arch))
    while (request := _read(requests)) is not None:
        module, name, args, grid, consts = request
        try:
            kernel = getattr(importlib.import_module(module), name)
            kernel.warmup(*map(_rebuild, args), grid=grid, **{k: _rebuild(v) for k, v in consts})
            error = ""
        except Exception as e:  # noqa: BLE001 - the launch compiles it again, and raises what it must
            error = f"{type(e).__name__}: {e}"
        _write(replies, error)


class _Pool:
    """Worker processes fed from one queue, a thread each."""

    def __init__(self, arch: int, count: int):
        self.jobs: queue.Queue = queue.Queue()
        self.alive = count
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # sdpatch as imported here
        env.pop("TRITON_INTERPRET", None)
        for _ in range(count):
            proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(arch)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
            threading.Thread(target=self._feed, args=(proc,), name="sdpatch-compile-worker", daemon=True).start()

    def _feed(self, proc: subprocess.Popen) -> None:
        while True:
            future, request = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                _write(proc.stdin, request)
                reply = _read(proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError):
                reply = None
            if reply == "":
                future.set_result(None)
            elif isinstance(reply, str):
                future.set_exception(RuntimeError(reply))
            else:
                future.set_exception(RuntimeError(f"the compile worker stopped (exit code {proc.poll()})"))
                with _lock:
                    self.alive -= 1
                logger.debug("sdpatch: a compile worker stopped; %d left", self.alive)
                while self.alive <= 0:  # the last one: nothing will take what is queued
                    try:
                        self.jobs.get_nowait()[0].set_exception(RuntimeError("no compile worker left"))
                    except queue.Empty:
                        break
                return


_pool: _Pool | None = None
_lock = threading.Lock()


def worker_count() -> int:
    """Workers this machine can hold: one a core but one, at most :data:`MAX_WORKERS`, as many as
    the host's available memory allows (:data:`WORKER_BYTES` each); 0 under two."""
    import psutil

    count = min(MAX_WORKERS, (os.cpu_count() or 1) - 1, psutil.virtual_memory().available // WORKER_BYTES)
    return count if count >= 2 else 0


def start(device: torch.device) -> bool:
    """Start the workers for ``device``'s GPU, once a process (see the module docs); whether any run."""
    global _pool
    with _lock:
        if _pool is None and device.type == "cuda":
            count = worker_count()
            if count:
                major, minor = torch.cuda.get_device_capability(device)
                try:
                    _pool = _Pool(10 * major + minor, count)
                except OSError as e:  # no process to spare: the compiles stay in threads
                    logger.debug("sdpatch: compile workers not started (%s)", e)
                    return False
        return _pool is not None and _pool.alive > 0


def running() -> bool:
    """Whether workers are there to take compiles."""
    return _pool is not None and _pool.alive > 0


def request(kernel, grid, args: tuple, consts: dict) -> tuple | None:
    """A launch of ``kernel`` (a module-level ``triton.jit`` function) as a worker takes it, or
    None where a worker cannot rebuild it (a TMA descriptor argument, a grid function): hashable,
    and equal for launches that compile the same binary."""
    if not isinstance(grid, tuple):
        return None
    try:
        return (kernel.fn.__module__, kernel.fn.__name__, tuple(map(_encode, args)), grid,
                tuple(sorted((k, _encode(v)) for k, v in consts.items())))
    except (_NotPortable, AttributeError):
        return None


def submit(request: tuple) -> Future:
    """Compile :func:`request`'s launch in a worker, launching nothing: the future is done once
    the binary is in Triton's cache (:func:`running` first)."""
    future: Future = Future()
    _pool.jobs.put((future, request))
    return future
