import os

import pytest

# Before anything imports triton: run its kernels on the CPU interpreter; never touch the Hub.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def fresh_faults(monkeypatch):
    """The fault policy's process-wide state (:mod:`sdpatch.attention.faults`) emptied for one test:
    no remembered failure, no fault warned about yet, no cached choice or repeat signature."""
    from sdpatch.attention import faults

    for name, empty in (("_failures", {}), ("_warned", set()), ("choices", {}), ("repeats", {})):
        monkeypatch.setattr(faults, name, empty)
    return faults
