"""sdpatch's Triton and Gluon kernels (installed as ``sdpatch.kernels``). Importing this needs triton.

Layers, as flash-attention lays them out: the kernels with their launchers (:mod:`.flash_fwd`, the
FlashAttention-2-style forward; :mod:`.flash_fwd_hopper`, the Gluon Hopper forward; :mod:`.flash_bwd`,
the backward; :mod:`.flash_bwd_hopper`, the Gluon Hopper backward, off by default), the forward's launch layer that picks a variant per call (:mod:`.forward`), what the
kernels share (:mod:`.shared`: the table of what they serve, the head-dim split rule, jitted helpers)
and the launch runtime (:mod:`.runtime`: launch plans, direct launches of compiled binaries).
"""

from .shared import SERVES

__all__ = ["SERVES"]
