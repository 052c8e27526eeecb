"""Top-k / top-p thresholds of a sampler (vLLM's definitions, ties kept): reference, Pallas kernel and dispatch.

`top_k_top_p_thresholds` is the entry point: per row of float32 logits, the k-th largest logit's order key
(kth) and the top-p threshold over the softmax of the top-k set (pth), as `reference.py` defines them; a token is
kept iff its order key is >= both (`apply_thresholds`). `impl` picks how:
  * "reference": pure jnp (`top_k_top_p_thresholds_reference`: a 1-bit radix select, 64 masked row sums);
  * "pallas": the Pallas kernel (`kernel.py`: one program per row, both thresholds in one launch, R bits a
    pass); `interpret=True` runs it in the Pallas interpreter (CPU tests);
  * "auto": the kernel on a GPU, else the reference.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

from pallas_kernels.sampling.kernel import RADIX_BITS, signed_keys, top_k_top_p_thresholds_pallas
from pallas_kernels.sampling.reference import (
    apply_thresholds,
    clamp_top_k,
    order_keys,
    radix_select,
    top_k_top_p_thresholds_reference,
)

_IMPLS = ("auto", "reference", "pallas")


def top_k_top_p_thresholds(logits: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"], *,
                           impl: str = "auto", interpret: bool = False, **tuning) -> tuple[Array, Array]:
    """(kth, pth) `[B]` uint32 order keys of each row's top-k and top-p thresholds (`top_k` <= 0: off; `top_p`
    >= 1: off, pth = 0). `tuning` (block, bits, num_warps, num_stages, skip, eviction) goes to the kernel."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown top_k_top_p_thresholds {impl=}; choose one of {_IMPLS}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl == "reference":
        return top_k_top_p_thresholds_reference(logits, top_k, top_p)
    return top_k_top_p_thresholds_pallas(logits, top_k, top_p, interpret=interpret, **tuning)


__all__ = ["RADIX_BITS", "apply_thresholds", "clamp_top_k", "order_keys", "radix_select", "signed_keys",
           "top_k_top_p_thresholds", "top_k_top_p_thresholds_pallas", "top_k_top_p_thresholds_reference"]
