"""Probe: do more programs per SM, by capping registers, make the forward kernel faster at SD's
head dims? (Timings need a CUDA GPU.)

    python scripts/probe_maxnreg.py --json probe_maxnreg.json

cuDNN's and FlashAttention-3's Hopper kernels overlap one tile's softmax with another's matrix
multiplies inside a program (ping-pong between warpgroups). Triton keeps a program's dots and
softmax in program order (v5's ping-pong probe gained nothing), but two programs resident on one SM
overlap the same way, through the warp schedulers. An 8-warp program at ~150 registers a thread
leaves room for one program per SM (65,536 registers); capped at 128 (``maxnreg``), two fit, and
4-warp programs at 168 or 128 fit three or four, if shared memory allows and the cap does not make
the compiler spill. Each tile of the production lists that wins at these shapes, with no cap and
with each cap, pointer loads (the default below 2e11 FLOP); kernel time only (CUDA-graph replay).
"""

from __future__ import annotations

from sdpatch.kernels.flash_fwd import flash_attn_fwd

from _bench import probe_main

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the pointer tiles that won at head dims 40 and 64.
TILES = [(128, 64, 4, 3), (128, 64, 8, 4), (64, 64, 4, 4)]
CAPS = (128, 168)  # registers a thread: 2 programs of 8 warps, or 4 / 3 of 4 warps, per SM


def impls_for(q, k, v, scale: float, cfg: dict) -> dict:
    """What the probe times on one case and tile: {name: zero-argument call}."""
    impls = {f"maxnreg{cap}": (lambda cap=cap: flash_attn_fwd(q, k, v, scale, config={**cfg, "maxnreg": cap}, kv_tma=False)[0])
             for cap in CAPS}
    impls["sdpatch"] = lambda: flash_attn_fwd(q, k, v, scale, config=cfg, kv_tma=False)[0]
    return impls


def main() -> None:
    probe_main(__doc__.splitlines()[0], TILES, impls_for, [("maxnreg128", "sdpatch"), ("maxnreg168", "sdpatch")])


if __name__ == "__main__":
    main()
