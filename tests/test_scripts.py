"""The one GPU script with a CPU test: the sanitizer's launches, run as ``gpu_session.sh sanitize``
runs them, through the Triton interpreter. A sanitizer run that breaks should break here, not
under compute-sanitizer on a lent GPU (a 2-D mask once stopped it there). The script runs as a
command, as on the GPU: tests import no scripts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_sanitize_script_checks_every_shape_and_tile():
    """Every launch compute-sanitizer watches on the GPU (each shape with every tile the autotuner
    may pick, forward and backward), each forward checked against float64: none wrong."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(SCRIPTS / "sanitize_kernels.py"), "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    launches = re.search(r"^(\d+) launches, 0 wrong results$", run.stdout, re.M)
    assert launches and int(launches.group(1)) > 0, run.stdout[-2000:]
