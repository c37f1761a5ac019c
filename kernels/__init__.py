"""sdpatch's Triton kernels (installed as ``sdpatch.kernels``). Importing this needs triton."""
