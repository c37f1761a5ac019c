"""Issue 9: ``sdpatch generate --prompts-file``, in one process and split over two with accelerate.

Everything runs the embedded ``tiny`` model on the CPU at 64 px and 2 steps, offline. Two
processes are started as ``accelerate launch --multi_gpu --num_processes 2 -m sdpatch generate
--device cpu``: accelerate's ``--cpu`` starts a single process unless it is given an MPI host
file, while its ``--multi_gpu`` launcher (torchrun) starts two, which run on the CPU and talk
through gloo because of ``--device cpu``. Each launch costs a few seconds of start-up: there are
three (success, a failing process, a killed process).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import sdpatch.multi as multi
from helpers import FAST, invoke
from sdpatch.errors import InputError
from sdpatch.multi import ProcessReport, partial_report_path, read_prompts, wait_for_processes

PROMPTS = ["a red cube", "a blue sphere", "a green cone", "a yellow ring", "a purple star"]
LAUNCH_TIMEOUT_S = 240


def write_prompts(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def pngs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.png"))


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def launch(tmp_path):
    """Start ``accelerate launch`` of two CPU processes running ``sdpatch generate *args``; whatever
    of it still runs at the end of the test is killed (it is a process group of its own)."""
    started = []

    def start(*args: str, preexec_fn=None) -> subprocess.Popen:
        started.append(_launch(tmp_path, *args, preexec_fn=preexec_fn))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _launch(tmp_path: Path, *args: str, preexec_fn=None) -> subprocess.Popen:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),  # no accelerate config of the user's
        # The same thread count as this process, so that the images are bit-equal to its own.
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "-m", "sdpatch", "generate", *args,
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launch did not end within {LAUNCH_TIMEOUT_S} s")
    return proc.returncode, stdout, stderr


# -- prompt files ----------------------------------------------------------------------------


def test_read_prompts_skips_comments_and_blank_lines_and_keeps_line_numbers(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeff# header\r\na cat\r\n\r\n   \n  # indented comment\n\ta dog, #1 \n\x0ca fox".encode())
    assert [(p.index, p.line, p.text) for p in read_prompts(path)] == [
        (0, 2, "a cat"),
        (1, 6, "a dog, #1"),
        (2, 7, "a fox"),
    ]


def test_prompts_file_in_one_process(tmp_path, caplog):
    long_line = " ".join(["a tall lighthouse on a rocky coast"] * 20)
    prompts = write_prompts(tmp_path / "prompts.txt", ["# shapes", PROMPTS[0], "", PROMPTS[1], long_line])
    out = tmp_path / "out"
    args = ["--prompts-file", str(prompts), *FAST, "--seed", "10", "--num-images", "2", "-o", str(out)]
    with caplog.at_level(logging.WARNING, logger="sdpatch.generate"):
        result = invoke("generate", *args)
    assert result.exit_code == 0, (result.output, result.exception)

    names = ["p0000-s10.png", "p0000-s11.png", "p0001-s12.png", "p0001-s13.png", "p0002-s14.png", "p0002-s15.png"]
    assert pngs(out) == names
    stored = [Image.open(out / n).text["prompt"] for n in names]
    assert stored[:4] == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    # The long prompt is kept up to what the text encoder reads.
    assert stored[4] == stored[5] and long_line.startswith(stored[4]) and len(stored[4]) < len(long_line)
    assert "3 prompts × 2 images · 1 process" in result.stdout and "6/6" in result.stdout

    report = json.loads((out / "sdpatch-report.json").read_text())
    assert report["complete"] is True and report["failed"] == []
    assert report["num_processes"] == 1 and report["totals"]["images"] == report["totals"]["expected_images"] == 6
    assert report["totals"]["images_per_second"] > 0 and report["totals"]["wall_seconds"] > 0
    assert [(i["prompt_index"], i["line"], i["seed"], Path(i["path"]).name) for i in report["images"]] == [
        (k // 2, [2, 4, 5][k // 2], 10 + k, name) for k, name in enumerate(names)
    ]
    assert report["processes"][0]["image_count"] == 6 and report["processes"][0]["peak_host"] > 0
    assert json.loads((out / "sdpatch-report.rank0.json").read_text())["status"] == "done"

    warnings = [r.getMessage() for r in caplog.records if r.name == "sdpatch.generate" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"{prompts} line 5: the prompt is ")
    assert "only the first 75" in warnings[0]
    assert json.loads(Image.open(out / "p0002-s14.png").text["sdpatch"])["notes"] == warnings

    # Image k of the file is the single-prompt run of its prompt with seed + k.
    alone = tmp_path / "alone.png"
    assert invoke("generate", PROMPTS[1], *FAST, "--seed", "13", "-o", str(alone)).exit_code == 0
    assert np.array_equal(pixels(alone), pixels(out / "p0001-s13.png"))


# -- two processes -----------------------------------------------------------------------------


def test_two_processes_make_the_same_images_as_one(tmp_path, launch):
    prompts = write_prompts(tmp_path / "prompts.txt", PROMPTS)
    one, two = tmp_path / "one", tmp_path / "two"
    proc = launch("--prompts-file", str(prompts), *FAST, "--seed", "3", "-o", str(two))
    # Meanwhile, the same file in this process.
    single = invoke("generate", "--prompts-file", str(prompts), *FAST, "--seed", "3", "-o", str(one))
    assert single.exit_code == 0, single.output
    code, stdout, stderr = finish(proc)
    assert code == 0, stderr

    names = [f"p{i:04d}-s{3 + i}.png" for i in range(5)]
    assert pngs(one) == pngs(two) == names  # every prompt exactly one image
    for name in names:
        assert np.array_equal(pixels(one / name), pixels(two / name)), name
    assert stdout.count("saved ") == 5 and "2 processes" in stdout

    report = json.loads((two / "sdpatch-report.json").read_text())
    assert report["complete"] is True and report["failed"] == [] and report["num_processes"] == 2
    processes = report["processes"]
    assert [(p["rank"], p["prompts"], p["image_count"], p["status"]) for p in processes] == [
        (0, [0, 1, 2], 3, "done"),
        (1, [3, 4], 2, "done"),
    ]
    assert processes[0]["pid"] != processes[1]["pid"] and all(p["device"] == "cpu" for p in processes)
    assert all(p["peak_host"] > 0 and p["images_per_second"] > 0 and p["load_seconds"] > 0 for p in processes)
    totals = report["totals"]
    assert totals["images"] == totals["expected_images"] == 5
    assert totals["wall_seconds"] == max(p["seconds"] for p in processes)
    assert totals["images_per_second"] == pytest.approx(5 / totals["generating_seconds"])
    assert [(i["rank"], Path(i["path"]).name) for i in report["images"]] == [(i // 3, n) for i, n in enumerate(names)]
    for rank in (0, 1):
        partial = json.loads((two / f"sdpatch-report.rank{rank}.json").read_text())
        assert partial["status"] == "done" and partial["run"] == processes[0]["run"]


def test_a_failing_process_ends_the_launch_with_an_error_and_keeps_finished_images(tmp_path, launch):
    """Process 1 has prompts 3-5. Prompt 4 is a valid prompt, but its image carries the part of it
    that the text encoder reads in its metadata, and the launch runs under a file-size limit (as a
    quota would impose) that the PNG exceeds: the write fails mid-run in process 1 only."""
    limit = 256 * 1024
    # One token a word, 4 KB of spaces between words: the 75 tokens read span 300 KB.
    huge = (" " * 4000).join(["a"] * 80)
    prompts = write_prompts(tmp_path / "prompts.txt", [*PROMPTS[:4], huge, PROMPTS[4]])
    out = tmp_path / "out"
    proc = launch(
        "--prompts-file",
        str(prompts),
        *FAST,
        "-o",
        str(out),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    code, stdout, stderr = finish(proc)

    assert code != 0
    assert pngs(out) == ["p0000-s0.png", "p0001-s1.png", "p0002-s2.png", "p0003-s3.png"]
    for name in pngs(out):
        Image.open(out / name).load()
    assert list(out.glob(".*.tmp")) == []
    assert stderr.count("line 5: the prompt is ") == 1

    report = json.loads((out / "sdpatch-report.json").read_text())
    assert report["complete"] is False and report["totals"]["images"] == 4
    statuses = [(p["rank"], p["status"], p["image_count"]) for p in report["processes"]]
    assert statuses == [(0, "done", 3), (1, "failed", 1)]
    [failed] = report["failed"]
    assert failed["rank"] == 1
    assert failed["error"] == f"prompt 4 (line 5): OutputError: cannot write {out / 'p0004-s4.png'}: File too large"
    assert "failed: prompt 4 (line 5): OutputError" in stdout


def test_a_killed_process_does_not_leave_the_launch_hanging(tmp_path, launch):
    prompts = write_prompts(tmp_path / "prompts.txt", PROMPTS[:4])
    out = tmp_path / "out"
    proc = launch("--prompts-file", str(prompts), *FAST, "--num-images", "100", "-o", str(out))
    partial = out / "sdpatch-report.rank1.json"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not partial.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(json.loads(partial.read_text())["pid"], signal.SIGKILL)  # as the kernel's OOM killer would
    code, _, stderr = finish(proc)

    assert code != 0 and "SIGKILL" in stderr  # the launcher saw it, and stopped the other process
    assert json.loads(partial.read_text())["status"] == "running"  # it never got to say so
    for name in pngs(out):
        Image.open(out / name).load()


def test_a_full_disk_fails_the_prompt_it_hits_and_keeps_the_images_before_it(tmp_path, monkeypatch):
    real, saved = Image.Image.save, []

    def save(self, fp, *args, **kwargs):  # the second PNG finds the disk full
        if kwargs.get("format") == "PNG" and len(saved) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        saved.append(fp)
        return real(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)
    prompts = write_prompts(tmp_path / "prompts.txt", PROMPTS[:3])
    out = tmp_path / "out"
    result = invoke("generate", "--prompts-file", str(prompts), *FAST, "-o", str(out))
    assert result.exit_code == 1, result.output
    assert pngs(out) == ["p0000-s0.png"] and list(out.glob(".*.tmp")) == []
    assert "3 prompts × 1 image · 1 process" in result.stdout
    [failed] = json.loads((out / "sdpatch-report.json").read_text())["failed"]
    assert failed["error"] == (
        f"prompt 1 (line 2): OutputError: cannot write {out / 'p0001-s1.png'}: No space left on device"
    )


def test_one_prompt_under_a_launch_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = invoke("generate", "a cat", *FAST)
    assert result.exit_code == 2
    assert result.stderr.startswith("sdpatch: error: this is one of 2 launched processes")
    assert list(tmp_path.iterdir()) == []


def test_each_process_of_a_launch_takes_its_own_device(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    state = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    assert multi._process_device(state, "auto") == multi._process_device(state, "cpu") == "cpu"
    with pytest.raises(InputError, match="--device cuda:1 names one device, but each of the 2 processes"):
        multi._process_device(state, "cuda:1")
    # accelerate saw a single process (e.g. --device mps): each process would do the whole file.
    with pytest.raises(InputError, match="this launch has 2 processes, but accelerate runs them as 1"):
        multi._process_device(SimpleNamespace(num_processes=1, device=torch.device("mps")), "mps")


# -- the main process's wait -------------------------------------------------------------------


@pytest.fixture
def short_waits(monkeypatch):
    monkeypatch.setattr(multi, "STALE_S", 0.3)
    monkeypatch.setattr(multi, "POLL_S", 0.02)


def test_a_silent_process_counts_as_failed(tmp_path, short_waits):
    report = tmp_path / "r.json"
    running = ProcessReport("run-1", 1, 3, "cpu", "CPU", "host", [2])
    partial_report_path(report, 1).write_text(json.dumps(running.to_dict()))
    other_run = ProcessReport("run-0", 2, 3, "cpu", "CPU", "host", [3], status="done")
    partial_report_path(report, 2).write_text(json.dumps(other_run.to_dict()))

    found = wait_for_processes({rank: partial_report_path(report, rank) for rank in (1, 2)}, "run-1")
    assert found[1]["status"] == "failed" and "stopped changing" in found[1]["error"]
    assert found[1]["prompts"] == [2]
    assert found[2]["status"] == "failed"
    assert found[2]["error"].startswith(f"no report in {partial_report_path(report, 2)} after 0 s")


def test_the_main_process_waits_for_a_slow_one(tmp_path, short_waits):
    path = tmp_path / "r.rank1.json"
    running = ProcessReport("run", 1, 2, "cpu", "CPU", "host", [1])
    path.write_text(json.dumps(running.to_dict()))

    def finish_later() -> None:
        for _ in range(10):  # keeps changing for longer than STALE_S, as the heartbeat does
            time.sleep(0.1)
            os.utime(path, ns=(time.time_ns(), time.time_ns() + 1))
        running.status = "done"
        path.write_text(json.dumps(running.to_dict()))

    writer = threading.Thread(target=finish_later)
    writer.start()
    found = wait_for_processes({1: path}, "run")
    writer.join()
    assert found[1]["status"] == "done"
