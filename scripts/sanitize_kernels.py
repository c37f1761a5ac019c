"""Launch sdpatch's Triton kernels at edge shapes, for compute-sanitizer (needs a CUDA GPU).

    compute-sanitizer --tool memcheck  python scripts/sanitize_kernels.py
    compute-sanitizer --tool racecheck python scripts/sanitize_kernels.py

Forward with every tile config the autotuner may pick for the shape, K and V loaded through pointers
and, where the GPU has TMA, through descriptors, in the head-dim tiling the launcher picks itself (so the two-part tiling at head dims 80 and 160 wherever the launcher would use it), and
backward with every pair of tiles; at odd lengths, head dims 40, 80 and 160, cross-attention on
77 keys, masks, and misaligned views. Each forward is also checked against the float64 reference,
so a wrong result fails too. A config that needs more shared memory than the GPU has is skipped
(the autotuner skips it too).

    compute-sanitizer --tool memcheck  python scripts/sanitize_kernels.py --gluon

launches the Gluon Hopper forward instead (sm_90): its head-dim splits (40 = 32 + 16, 80 = 64 + 16,
160 = 128 + 32) at odd lengths, with two consumer warpgroups and three (head dim 64), through the JIT
with and without the log-sum-exp, with the grid's last tile split into pieces and combined (as the
launcher splits a short last wave), and where default calls take it, twice through
``flash_attn_fwd``: the JIT, then the binary.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.runtime.errors import OutOfResources

from sdpatch.kernels import flash_fwd_hopper
from sdpatch.kernels.flash_bwd import _dkdv_configs, _dq_configs, flash_attn_bwd
from sdpatch.kernels.flash_fwd import fwd_configs, fwd_meta, kv_tma_ok
from sdpatch.kernels import forward
from sdpatch.kernels.forward import flash_attn_fwd
from sdpatch.kernels.runtime import config_kwargs
from sdpatch.kernels.flash_fwd import _prune as fwd_prune
from sdpatch.attention.naive import attention_ref

from _bench import grid_variants, make_mask

SHAPES = [  # B, H, Nq, Nk, D, mask, layout
    (1, 2, 97, 97, 40, None, "bnhd"),
    (2, 1, 1025, 77, 40, "padding", "bnhd"),
    (1, 2, 33, 129, 160, "bool", "bnhd"),
    (1, 1, 77, 77, 160, "additive", "bnhd"),
    (2, 2, 1, 5, 80, None, "bnhd"),
    # Where the split tiling once hit an illegal address: head dim 80, bool mask, rows that start
    # misaligned (a slice of wider rows).
    (2, 2, 130, 130, 80, "bool", "sliced"),
    # Shapes the launcher splits the head dim on (no mask, whole key blocks), with query tails.
    (1, 2, 127, 256, 80, None, "bnhd"),
    (2, 1, 200, 128, 160, None, "bnhd"),
    # The backward splits head dim 40 (32 + 16) where both lengths are whole 128-row blocks.
    (1, 2, 256, 384, 40, None, "bnhd"),
]


GLUON_SHAPES = [  # B, H, Nq, Nk, D; from (8, 16, 256, 256, 64) on, default calls take the Gluon kernel
    (1, 2, 97, 97, 40), (2, 1, 1025, 77, 40), (1, 1, 1, 1, 16), (2, 2, 1, 5, 80), (1, 2, 130, 129, 128),
    (1, 2, 300, 257, 64), (2, 1, 200, 256, 256), (8, 16, 256, 256, 64), (4, 16, 300, 257, 160), (2, 8, 4096, 4096, 40),
    (2, 10, 4096, 4096, 64),  # on an H200, default calls split the grid's last wave (tail_split)
    (2, 20, 1024, 1024, 64),  # and here take tiles of two sizes (tile_plan)
    (1, 3, 700, 1500, 160), (2, 3, 1000, 2000, 64),
]


def default_for_capture(q, k, v):
    """A default forward as sdpatch.graphs' warm-up makes it: on the Gluon kernel where it serves."""
    with forward.for_capture():
        return flash_attn_fwd(q, k, v, q.shape[-1] ** -0.5)[0]


def tensor(B, H, N, D, layout, device):
    if layout == "sliced":
        return torch.randn(B, H, N, D + 8, device=device, dtype=torch.float16)[..., 3 : D + 3]
    return torch.randn(B, N, H, D, device=device, dtype=torch.float16).transpose(1, 2)


def main(device: str = "cuda", backward_only: bool = False) -> int:
    """Every launch, checked; returns the number of wrong results. ``device="cpu"`` runs the same
    launches through the Triton interpreter (``--device cpu``; tests/test_scripts.py), with smaller tiles.
    ``backward_only`` runs only the first forward config that fits per shape, to feed the backward."""
    torch.manual_seed(0)
    bad = 0
    launches = 0
    for B, H, Nq, Nk, D, mk, layout in SHAPES:
        q, k, v = (tensor(B, H, n, D, layout, device) for n in (Nq, Nk, Nk))
        mask = make_mask(mk, B, Nq, Nk, torch.float16, device)
        ref = attention_ref(q, k, v, attn_mask=mask)
        scale = D**-0.5
        for tma in (False, True) if kv_tma_ok(k, v) and not backward_only else (False,):
            meta = fwd_meta(q, k, v, torch.empty_like(q), scale, mask, True, None, tma)
            for c in fwd_prune(fwd_configs(tma), {"N_K": Nk}, **meta):  # what the autotuner may pick here
                try:
                    out, lse = flash_attn_fwd(q, k, v, scale, mask, return_lse=True, config=config_kwargs(c), kv_tma=tma)
                except OutOfResources:
                    continue
                launches += 1
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err <= 1e-2:
                    bad += 1
                    print(f"WRONG fwd {B, H, Nq, Nk, D, mk, layout} {c} kv_tma={tma}: {err:.2e}", flush=True)
                if backward_only:
                    break
        do = torch.randn_like(q)
        for pair in zip(_dkdv_configs(), _dq_configs()):
            try:
                flash_attn_bwd(do, q, k, v, out, lse, scale, mask, config=tuple(config_kwargs(c) for c in pair))
            except OutOfResources:
                continue
            launches += 1
        print(f"{B, H, Nq, Nk, D, mk, layout}: {launches} launches so far, {bad} wrong", flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"{launches} launches, {bad} wrong results")
    return bad


def gluon() -> int:
    """The Gluon forward's launches (see the module's docstring), each checked on the first head's
    first 256 rows and the last head's last 256 (where a split last tile is) against float64, also
    with the last tile split (as on a GPU of one SM fewer than tiles) and in tiles of two sizes
    (over fewer SMs); returns the number of wrong results."""
    torch.manual_seed(0)
    bad = launches = 0
    for B, H, Nq, Nk, D in GLUON_SHAPES:
        q, k, v = (tensor(B, H, n, D, "bnhd", "cuda") for n in (Nq, Nk, Nk))
        refs = [attention_ref(q[:1, :1, :256], k[:1, :1], v[:1, :1]), attention_ref(q[-1:, -1:, -256:], k[-1:, -1:], v[-1:, -1:])]
        calls = [(f"jit lse={lse}", lambda lse=lse: flash_fwd_hopper.hopper_attn_fwd(q, k, v, D**-0.5, return_lse=lse)[0])
                 for lse in (False, True)]
        calls += [(f"{grid} over {sms} SMs", lambda sms=sms: flash_fwd_hopper.hopper_attn_fwd(q, k, v, D**-0.5, sms=sms)[0])
                  for grid, sms in grid_variants(B, H, Nq, Nk, flash_fwd_hopper.config_for(D))]
        if flash_fwd_hopper.serves(q, k, v, None):  # the JIT, then the binary, as a CUDA graph's warm-up calls it
            calls += [(f"default call for capture {i}", lambda: default_for_capture(q, k, v)) for i in (1, 2)]
        for name, fn in calls:
            out = fn()
            launches += 1
            err = max(((o.double() - ref).norm() / ref.norm()).item() for o, ref in zip((out[:1, :1, :256], out[-1:, -1:, -256:]), refs))
            if not err <= 1e-2:
                bad += 1
                print(f"WRONG gluon {B, H, Nq, Nk, D} {name}: {err:.2e}", flush=True)
        print(f"gluon {B, H, Nq, Nk, D}: {launches} launches so far, {bad} wrong", flush=True)
    torch.cuda.synchronize()
    print(f"{launches} launches, {bad} wrong results")
    return bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gluon", action="store_true", help="the Gluon Hopper forward's launches instead (sm_90)")
    ap.add_argument("--backward-only", action="store_true", help="one forward per shape, to feed the backward")
    ap.add_argument("--device", default="cuda", help='"cpu": the same launches through the Triton interpreter (TRITON_INTERPRET=1)')
    args = ap.parse_args()
    sys.exit(1 if (gluon() if args.gluon else main(args.device, args.backward_only)) else 0)
