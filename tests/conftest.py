import os

# Before anything imports triton: run its kernels on the CPU interpreter; never touch the Hub.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
