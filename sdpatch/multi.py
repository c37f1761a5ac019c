"""Prompt files, and one generation split over several processes: ``sdpatch generate --prompts-file``.

In one process it generates every prompt of the file. Under ``accelerate launch`` (or torchrun)
each process takes a contiguous share of the prompts (``PartialState().split_between_processes``),
loads and patches its own pipeline on its own device, and writes its images and a partial report;
the main process then writes one merged report.

Seeds and names do not depend on the number of processes: image ``k`` of the file (prompt ``i``,
its image ``j`` of ``--num-images n``, ``k = i * n + j``) uses seed ``seed + k`` and is written as
``p<i>-s<seed>.png``. The same file gives the same images on 1 or N processes.

No process can be left waiting on another one. The only collectives are PartialState's rendezvous
and one broadcast of a run id straight after it, before any process does anything that can fail.
After that the processes share nothing but files:

- each process writes its partial report ``<report>.rank<k>.json`` atomically when it starts,
  after an image at most every :data:`SAVE_EVERY_S` seconds, and when it ends (``done``,
  ``failed`` with the error, or ``interrupted``), and touches it every :data:`HEARTBEAT_S`
  seconds while it runs;
- a process whose generation fails records the failure and ends; a process other than the main
  one then exits with code 0, so that the launcher does not stop the processes still working;
- the main process does its own share, then reads the other partial reports until each is final,
  writes the merged report, and exits with code 1 if any process failed. A process whose report
  stops changing for :data:`STALE_S` seconds (it was killed on another machine, or its machine
  does not share the report's folder) counts as failed. On one machine the launcher itself stops
  every process as soon as one dies.

A barrier at the end was the alternative; it was rejected because a process that fails early
would sit in it for the rest of the run, past the process group's timeout (by default 10 minutes
on NCCL, 30 on gloo), and its timing out would make the launcher kill the processes still working.

Bad input is found by every process before anything is loaded or written, and ends each one with
code 2 (the launcher then reports a failure). Bad input that shows only once the model is loaded
(more steps than its scheduler has) ends the process with code 2 as well, as for one prompt.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from sdpatch.attention import BackendUnavailableError
from sdpatch.errors import InputError, first_line
from sdpatch.generate import (
    MAX_SEED,
    GenerationRequest,
    ImageRecord,
    RunOptions,
    Setup,
    check_output_file,
    check_setup,
    device_name,
    generate,
    plan_outputs,
    versions,
    write_json,
)
from sdpatch.memory import format_bytes, plural, summarize, total
from sdpatch.models import resolve_device
from sdpatch.progress import Progress

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
# Longer than anything a live process does without letting its heartbeat thread run (Triton
# compilation, reading a checkpoint), yet a bounded wait for one that died on another machine.
STALE_S = 300.0
POLL_S = 0.5
# A partial report holds every image so far: rewriting it after each one would cost time and I/O
# quadratic in the images of a long file. The heartbeat shows that the process lives meanwhile.
SAVE_EVERY_S = 5.0
REPORT_NAME = "sdpatch-report.json"


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompts file: its place among the prompts and its line in the file."""

    index: int
    line: int
    text: str


def read_prompts(path: Path) -> list[Prompt]:
    """The prompts of a UTF-8 file, one a line; blank lines and lines starting with ``#`` are skipped.

    Raises InputError for a file that is missing, unreadable, not UTF-8 or without prompts.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"--prompts-file {path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"--prompts-file {path} is a folder, not a file") from None
    except OSError as err:
        raise InputError(f"cannot read --prompts-file {path}: {err.strerror or first_line(err)}") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors) is not part of the first prompt
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise InputError(f"--prompts-file {path} is not UTF-8 text (line {line})") from None
    prompts = []
    # split("\n"), not splitlines(): the latter also splits at form feeds and Unicode separators,
    # and line numbers would no longer match an editor's.
    for number, raw in enumerate(text.split("\n"), start=1):
        prompt = raw.strip()
        if prompt and not prompt.startswith("#"):
            prompts.append(Prompt(len(prompts), number, prompt))
    if not prompts:
        raise InputError(f"--prompts-file {path} has no prompts (only blank lines and # comments)")
    return prompts


def prompt_request(request: GenerationRequest, prompt: Prompt) -> GenerationRequest:
    """``request`` for one prompt of a file: its images continue the file's run of seeds."""
    return replace(request, prompt=prompt.text, seed=request.seed + prompt.index * request.num_images)


def partial_report_path(report: Path, rank: int) -> Path:
    """Where process ``rank`` writes its partial report, beside the merged ``report``."""
    return report.with_name(f"{report.stem}.rank{rank}.json")


@dataclass
class ProcessReport:
    """One process's share of a prompts-file run, written as its partial report."""

    run: str
    rank: int
    num_processes: int
    device: str
    device_name: str
    memory_kind: str
    prompts: list[int]
    host: str | None = field(default_factory=socket.gethostname)
    pid: int | None = field(default_factory=os.getpid)
    status: str = "running"  # then done, failed or interrupted
    error: str | None = None
    load_seconds: float | None = None
    seconds: float = 0.0
    size: tuple[int, int] | None = None  # width, height
    images: list[tuple[Prompt, ImageRecord]] = field(default_factory=list)
    patch: dict[str, Any] | None = None

    @property
    def final(self) -> bool:
        return self.status != "running"

    def to_dict(self) -> dict[str, Any]:
        peak = total(summarize(record.phases for _, record in self.images)).to_dict() if self.images else None
        generating = self.seconds - (self.load_seconds or 0.0)
        return {
            "run": self.run,
            "rank": self.rank,
            "num_processes": self.num_processes,
            "host": self.host,
            "pid": self.pid,
            "device": self.device,
            "device_name": self.device_name,
            "memory_kind": self.memory_kind,
            "status": self.status,
            "error": self.error,
            "prompts": self.prompts,
            "size": list(self.size) if self.size else None,
            "image_count": len(self.images),
            "load_seconds": self.load_seconds,
            "seconds": self.seconds,
            "images_per_second": len(self.images) / generating if self.images and generating > 0 else None,
            "peak_allocated": peak and peak["peak_allocated"],
            "peak_reserved": peak and peak["peak_reserved"],
            "peak_host": peak and peak["peak_host"],
            "images": [
                {"prompt_index": p.index, "line": p.line, "prompt": p.text, **record.to_dict()}
                for p, record in self.images
            ],
            "patch": self.patch,
        }


@dataclass
class MultiReport:
    """The merged report of a prompts-file run: every process's partial report, and totals."""

    prompts_file: str
    model: str
    backend: str
    dtype: str
    request: GenerationRequest
    prompts: int
    processes: list[dict[str, Any]]

    @property
    def expected_images(self) -> int:
        return self.prompts * self.request.num_images

    @property
    def image_count(self) -> int:
        return sum(p["image_count"] for p in self.processes)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [p for p in self.processes if p["status"] != "done"]

    @property
    def complete(self) -> bool:
        return not self.failed and self.image_count == self.expected_images

    @property
    def wall_seconds(self) -> float:
        """The slowest process's time from the common start, loading included."""
        return max(p["seconds"] for p in self.processes)

    @property
    def generating_seconds(self) -> float:
        """The slowest process's time after loading: the time the throughput is measured over."""
        return max(p["seconds"] - (p["load_seconds"] or 0.0) for p in self.processes)

    @property
    def images_per_second(self) -> float | None:
        seconds = self.generating_seconds
        return self.image_count / seconds if self.image_count and seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        request = asdict(self.request)
        request.pop("prompt")
        size = next((p["size"] for p in self.processes if p["size"]), None)
        return {
            "sdpatch_multi_report": 1,
            "complete": self.complete,
            "prompts_file": self.prompts_file,
            "model": self.model,
            "backend": self.backend,
            "dtype": self.dtype,
            "size": size,
            "request": request,
            "seeds": "image k of the file (prompt i, its image j) uses seed + k, k = i * num_images + j",
            "prompts": self.prompts,
            "num_processes": len(self.processes),
            "totals": {
                "images": self.image_count,
                "expected_images": self.expected_images,
                "wall_seconds": self.wall_seconds,
                "generating_seconds": self.generating_seconds,
                "images_per_second": self.images_per_second,
            },
            "failed": [{"rank": p["rank"], "status": p["status"], "error": p["error"]} for p in self.failed],
            "processes": [{k: v for k, v in p.items() if k != "images"} for p in self.processes],
            "images": sorted((i | {"rank": p["rank"]} for p in self.processes for i in p["images"]), key=_image_order),
            "environment": versions(),
        }

    def format_table(self) -> str:
        """One row per process, then the totals."""
        r = self.request
        size = next((p["size"] for p in self.processes if p["size"]), None)
        n = len(self.processes)
        head = (
            f"{self.model} · backend {self.backend} · {self.dtype} · "
            f"{f'{size[0]}×{size[1]}' if size else 'native size'} · {plural(r.steps, 'step')} · "
            f"{plural(self.prompts, 'prompt')} × {plural(r.num_images, 'image')} · "
            f"{n} process{'es' if n != 1 else ''}"
        )
        cuda = any(p["memory_kind"] == "cuda" for p in self.processes)
        mem_cols = ("peak allocated", "peak reserved") if cuda else ("peak host memory",)
        rows = [["process", "device", "prompts", "images", "load", "generating", "images/s", *mem_cols, "status"]]
        for p in self.processes:
            prompts = p["prompts"]
            span = f"{prompts[0]}–{prompts[-1]}" if len(prompts) > 1 else "".join(map(str, prompts)) or "none"
            mem = [p["peak_allocated"], p["peak_reserved"]] if cuda else [p["peak_host"]]
            rate = p["images_per_second"]
            load = p["load_seconds"]
            rows.append(
                [
                    str(p["rank"]),
                    f"{p['device_name']} ({p['device']})" if p["device"] else "?",
                    span,
                    f"{p['image_count']}/{len(prompts) * r.num_images}",
                    f"{load:.1f} s" if load is not None else "",
                    f"{p['seconds'] - (load or 0.0):.1f} s",
                    f"{rate:.2f}" if rate else "",
                    *map(format_bytes, mem),
                    p["status"] + (f": {p['error']}" if p["error"] else ""),
                ]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        lines = [head] + ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows]
        rate = self.images_per_second
        lines.append(
            f"total: {self.image_count} of {self.expected_images} images · {self.wall_seconds:.1f} s wall "
            f"(loading included) · {f'{rate:.2f}' if rate else '0'} images/s while generating"
        )
        if not cuda:
            lines.append("host memory: resident memory of each whole process (not GPU memory)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


@dataclass
class MultiResult:
    """What one process of a prompts-file run did; ``report`` is the merged report (main process only)."""

    process: ProcessReport
    report: MultiReport | None
    report_path: Path

    @property
    def exit_code(self) -> int:
        """0, or 1 when the merged report lists a failure. Processes other than the main one exit
        with 0 even after a failure, so that the launcher does not stop the others (see the module)."""
        return 1 if self.report is not None and self.report.failed else 0


def run_prompts(
    request: GenerationRequest,
    prompts_file: Path,
    options: RunOptions = RunOptions(),
    *,
    progress: Progress | bool = True,
    on_image: Callable[[ImageRecord], None] | None = None,
) -> MultiResult:
    """What ``sdpatch generate --prompts-file`` does in each process (see the module docstring).

    ``request`` holds every setting but the prompt; ``options.output`` is a folder (default: the
    current one); the merged report goes to ``options.report_json``, by default
    ``sdpatch-report.json`` in that folder, and each process's partial report beside it. Every
    input is checked, by every process, before anything is loaded or written; a bad one raises
    InputError. CUDA graphs and ``compile`` as in :func:`sdpatch.generate.run`: one graph per shape
    serves every prompt. A memory plan (``vram_budget``) is not made for a prompts file.
    """
    model, device, output, overwrite, report_json = (
        options.model, options.device, options.output, options.overwrite, options.report_json)
    request.validate()
    prompts = read_prompts(prompts_file)
    images = len(prompts) * request.num_images
    if request.seed + images - 1 > MAX_SEED:
        raise InputError(
            f"--seed must be at most {MAX_SEED - (images - 1)} for {images} images "
            f"(image k of the file uses seed + k, at most 2**64 - 1), got {request.seed}"
        )
    requests = [prompt_request(request, p) for p in prompts]
    folder = Path(".") if output is None else output
    if folder.suffix.lower() == ".png" and not folder.is_dir():
        raise InputError(f"--output {folder} is one file, but --prompts-file makes an image per prompt: give a folder")
    width = max(4, len(str(len(prompts) - 1)))
    outputs = [
        plan_outputs(folder, r.seeds, overwrite=overwrite, prefix=f"p{p.index:0{width}d}-s")
        for p, r in zip(prompts, requests)
    ]
    report_path = _check_report_paths(report_json, folder, outputs, overwrite=overwrite)

    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, parse_flag_from_env

    if device == "auto" and parse_flag_from_env("ACCELERATE_USE_CPU"):  # accelerate launch --cpu
        device = "cpu"
    state = PartialState(cpu=resolve_device(device).type == "cpu")
    try:
        run_id = [uuid.uuid4().hex if state.is_main_process else None]
        if state.num_processes > 1:
            broadcast_object_list(run_id)  # the last collective: nothing has run that could fail yet
        setup = check_setup(replace(options, device=_process_device(state, device)))
        with state.split_between_processes(prompts) as share:
            mine = list(share)
        process = ProcessReport(
            run=run_id[0],
            rank=state.process_index,
            num_processes=state.num_processes,
            device=str(setup.device),
            device_name=device_name(setup.device),
            memory_kind="cuda" if setup.device.type == "cuda" else "host",
            prompts=[p.index for p in mine],
        )
        folder.mkdir(exist_ok=True)  # _check_report_paths checked that its parent exists
        _run_share(
            process,
            partial_report_path(report_path, state.process_index),
            setup,
            [(p, requests[p.index], outputs[p.index]) for p in mine],
            model=model,
            source=str(prompts_file),
            progress=Progress.of(progress) if state.is_main_process else Progress(enabled=False),
            on_image=on_image,
        )
        if not state.is_main_process:
            return MultiResult(process, None, report_path)
        others = wait_for_processes(
            {rank: partial_report_path(report_path, rank) for rank in range(1, state.num_processes)}, process.run
        )
        report = MultiReport(
            prompts_file=str(prompts_file),
            model=model,
            backend=options.backend,
            dtype=str(setup.dtype).removeprefix("torch."),
            request=request,
            prompts=len(prompts),
            processes=[process.to_dict(), *(others[rank] for rank in sorted(others))],
        )
        write_json(report_path, report.to_dict())
        return MultiResult(process, report, report_path)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def refuse_launch_without_prompts_file() -> None:
    """Raise InputError in a process of a multi-process launch: with one PROMPT, every process
    would make the same images into the same files."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:
        raise InputError(
            f"this is one of {processes} launched processes, and each would make the same images from PROMPT: "
            "give the prompts in --prompts-file, which the processes share"
        )


def _check_report_paths(report_json: Path | None, folder: Path, outputs: list[list[Path]], *, overwrite: bool) -> Path:
    """The merged report's path, checked, with no partial reports of an earlier run beside it
    (unless ``overwrite``: those of an earlier run are then told apart by their run id)."""
    if report_json is not None:
        check_output_file(report_json, overwrite=overwrite, what="--report-json", new_folder=folder)
        if report_json.resolve() in {path.resolve() for paths in outputs for path in paths}:
            raise InputError("--report-json must not be one of the image paths")
        path = report_json
    else:
        path = folder / REPORT_NAME
        if path.is_dir():
            raise InputError(f"{path} is a folder, not a file")
        if path.exists() and not overwrite:
            raise InputError(f"{path} already exists (pass --overwrite to replace it)")
    stale = sorted(path.parent.glob(f"{glob.escape(path.stem)}.rank*.json")) if path.parent.is_dir() else []
    if stale and not overwrite:
        raise InputError(f"{stale[0]} already exists (pass --overwrite to replace it)")
    return path


def _process_device(state: Any, device: str) -> str:
    """This process's device: ``device`` itself in a single process, else the launcher's choice."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != state.num_processes:
        raise InputError(
            f"this launch has {launched} processes, but accelerate runs them as {state.num_processes} "
            f"on --device {device}: use GPUs, or --device cpu"
        )
    if state.num_processes == 1:
        return device
    if device not in ("auto", "cuda", "cpu"):
        raise InputError(
            f"--device {device} names one device, but each of the {state.num_processes} processes of this "
            "launch runs on its own: leave --device auto (or cpu)"
        )
    return "cpu" if state.device.type == "cpu" else str(state.device)


def _run_share(
    process: ProcessReport,
    path: Path,
    setup: Setup,
    work: list[tuple[Prompt, GenerationRequest, list[Path]]],
    *,
    model: str,
    source: str,
    progress: Progress,
    on_image: Callable[[ImageRecord], None] | None,
) -> None:
    """Generate this process's prompts, keeping its partial report at ``path`` up to date.

    A failure is recorded, not raised, so that the process still ends normally (see the module);
    bad input found only once the model is loaded (e.g. more steps than its scheduler has) is
    raised as InputError while the process has no images yet, as it would be for one prompt.
    """
    start = saved = time.perf_counter()
    current: Prompt | None = None

    def save() -> None:
        nonlocal saved
        saved = time.perf_counter()
        process.seconds = saved - start
        write_json(path, process.to_dict())

    save()
    with _Heartbeat(path):
        try:
            if work:
                pipe = setup.load(progress)
                process.load_seconds = time.perf_counter() - start
                for done_prompts, (prompt, request, outputs) in enumerate(work):
                    current = prompt
                    progress.context["prompt"] = f"prompt {done_prompts + 1}/{len(work)}"

                    def done(record: ImageRecord, prompt: Prompt = prompt) -> None:
                        process.images.append((prompt, record))
                        if time.perf_counter() - saved >= SAVE_EVERY_S:
                            save()
                        if on_image is not None:
                            on_image(record)

                    result = generate(
                        pipe,
                        request,
                        model=model,
                        backend=setup.backend,
                        outputs=outputs,
                        notes=setup.notes,
                        progress=progress,
                        on_image=done,
                        speed=setup.speed,
                        prompt_label=f"{source} line {prompt.line}: the prompt",
                    )
                    process.size = (result.report.request.width, result.report.request.height)
                    process.patch = result.report.patch
            process.status = "done"
        except (InputError, BackendUnavailableError) as err:
            if process.images:
                _record_failure(process, current, err)
            else:
                path.unlink(missing_ok=True)
                raise InputError(str(err)) from err
        except Exception as err:  # noqa: BLE001 (any failure: recorded for the main process, see the module)
            _record_failure(process, current, err)
        except KeyboardInterrupt:
            process.status = "interrupted"
            save()
            raise
    save()


def _record_failure(process: ProcessReport, prompt: Prompt | None, err: BaseException) -> None:
    where = f"prompt {prompt.index} (line {prompt.line})" if prompt else "loading the model"
    process.status = "failed"
    process.error = f"{where}: {type(err).__name__}: {first_line(err)}"
    logger.error("process %d failed after %d image(s), at %s", process.rank, len(process.images), process.error)


def wait_for_processes(paths: dict[int, Path], run: str) -> dict[int, dict[str, Any]]:
    """Read the partial reports at ``paths`` (by rank) until each is final, and return them.

    A report that does not change for :data:`STALE_S` seconds (neither rewritten nor touched by
    its process's heartbeat) is taken as final, as a failure. Reports of another run are ignored.
    """
    results: dict[int, dict[str, Any]] = {}
    seen = {rank: (None, time.monotonic()) for rank in paths}
    while len(results) < len(paths):
        for rank, path in paths.items():
            if rank in results:
                continue
            data = _read_partial(path, run)
            if data is not None and data["status"] != "running":
                results[rank] = data
                continue
            signature = _signature(path)
            last, since = seen[rank]
            if signature != last:
                seen[rank] = (signature, time.monotonic())
            elif time.monotonic() - since > STALE_S:
                results[rank] = _stale(rank, path, run, data)
        if len(results) < len(paths):
            time.sleep(POLL_S)
    return results


def _read_partial(path: Path, run: str) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("run") == run else None


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _stale(rank: int, path: Path, run: str, data: dict[str, Any] | None) -> dict[str, Any]:
    if data is None:
        error = (
            f"no report in {path} after {STALE_S:.0f} s: the process died, or its machine does not share "
            "that folder (on several machines, --output and --report-json must be on a shared filesystem)"
        )
        data = ProcessReport(run, rank, 0, "", "", "host", [], host=None, pid=None).to_dict()
    else:
        error = f"its report stopped changing for {STALE_S:.0f} s: the process died or hangs"
    return data | {"status": "failed", "error": error}


class _Heartbeat:
    """Touches a partial report every :data:`HEARTBEAT_S` seconds, so that the main process can
    tell a process that is slow (a long image, a large checkpoint) from one that died."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="sdpatch-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self._path)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _image_order(image: dict[str, Any]) -> tuple[int, int]:
    return image["prompt_index"], image["index"]
