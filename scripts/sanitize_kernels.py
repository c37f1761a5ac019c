"""Launch sdpatch's Triton kernels at edge shapes, for compute-sanitizer (needs a CUDA GPU).

    compute-sanitizer --tool memcheck  python scripts/sanitize_kernels.py
    compute-sanitizer --tool racecheck python scripts/sanitize_kernels.py

Forward (both head-dim tilings) and backward, with the smallest, largest and default tiles the
autotuner may pick (forward) and all of them (backward), at odd lengths, head dims 40 and 160, cross-attention on 77 keys, and masks.
Each launch is also checked against the float64 reference, so a wrong result fails too.
"""

from __future__ import annotations

import sys

import torch

from sdpatch.kernels.flash_bwd import _configs as bwd_configs
from sdpatch.kernels.flash_bwd import flash_attn_bwd
from sdpatch.kernels.flash_fwd import _configs as fwd_configs
from sdpatch.kernels.flash_fwd import flash_attn_fwd
from sdpatch.reference import attention_ref

from _bench import make_mask

SHAPES = [  # B, H, Nq, Nk, D, mask
    (1, 2, 97, 97, 40, None),
    (2, 1, 1025, 77, 40, "padding"),
    (1, 2, 33, 129, 160, "bool"),
    (1, 1, 77, 77, 160, "additive"),
    (2, 2, 1, 5, 80, None),
]


FWD_CONFIGS = [c for c in fwd_configs() if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) in {(128, 64), (128, 128), (64, 32)}]


def as_dict(c):
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def main() -> int:
    torch.manual_seed(0)
    bad = 0
    launches = 0
    for B, H, Nq, Nk, D, mk in SHAPES:
        q = torch.randn(B, Nq, H, D, device="cuda", dtype=torch.float16).transpose(1, 2)
        k = torch.randn(B, H, Nk, D, device="cuda", dtype=torch.float16)
        v = torch.randn(B, H, Nk, D, device="cuda", dtype=torch.float16)
        mask = make_mask(mk, B, Nq, Nk, torch.float16)
        ref = attention_ref(q, k, v, attn_mask=mask)
        scale = D**-0.5
        for split in (False, True):
            for c in FWD_CONFIGS:
                out, lse = flash_attn_fwd(q, k, v, scale, mask, return_lse=True, split_head_dim=split, config=as_dict(c))
                launches += 1
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not err <= 1e-2:
                    bad += 1
                    print(f"WRONG fwd {B, H, Nq, Nk, D, mk} split={split} {c}: {err:.2e}")
        do = torch.randn_like(q)
        for c in bwd_configs():
            flash_attn_bwd(do, q, k, v, out, lse, scale, mask, config=as_dict(c))
            launches += 1
    torch.cuda.synchronize()
    print(f"{launches} launches, {bad} wrong results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
