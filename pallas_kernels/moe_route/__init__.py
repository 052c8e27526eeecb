"""A decode step's softmax MoE routing as per-pair tiles (`reference.py` defines it), and its dispatch.

`pair_route(logits, num_real, top_k=, norm_topk_prob=)` gives the tile experts and row weights of
`jhybrid.models.layers`' per-pair layout (one 16-row tile per (token, expert) pair) from the router's logits;
`impl` picks how:
  * "reference": pure jnp (XLA: the softmax, `top_k`, the renormalisation and the layout, five kernels on a GPU);
  * "pallas": the one-program kernel (`kernel.py`); `interpret=True` runs it in the Pallas interpreter;
  * "auto": the kernel on a GPU where `FUSED_ROUTE` is on and `pallas_supported` says the shapes fit it.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.moe_route.kernel import pair_route_pallas
from pallas_kernels.moe_route.reference import pair_route_reference

_IMPLS = ("auto", "reference", "pallas")

# "auto" runs the kernel on a GPU; JHYBRID_MOE_FUSED_ROUTE=0: XLA's ops. A MiniMax-shaped batch-1 decode step
# (10 MoE layers) compiles to 171 kernels for the H200 instead of 200, and on an H100 its token took 0.824 / 0.804 ->
# 0.742 / 0.761 ms in one program (`floors --device-loop`, interleaved) and 0.991 / 0.986 -> 0.921 / 0.952 ms through
# `LLM.generate` in 8-step programs (benchmarks/RESULTS.md, "Session 46").
FUSED_ROUTE = os.environ.get("JHYBRID_MOE_FUSED_ROUTE", "1") == "1"


def pallas_supported(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether the kernel takes these shapes: powers of two, k <= E, and few enough values for one program."""
    pow2 = all(v >= 1 and not v & (v - 1) for v in (num_tokens, num_experts, top_k))
    return pow2 and top_k <= num_experts and num_tokens * num_experts <= 16384


def pair_route(logits, num_real=None, *, top_k: int, norm_topk_prob: bool, block_m: int = 16, impl: str = "auto",
               interpret: bool = False):
    """(`tile_expert [T * k]`, `row_w [T * k * block_m]`) of `pair_route_reference`."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown pair_route {impl=}; choose one of {_IMPLS}")
    if impl == "auto":
        impl = "pallas" if (FUSED_ROUTE and jax.default_backend() == "gpu"
                            and pallas_supported(*logits.shape, top_k)) else "reference"
    if impl == "reference":
        return pair_route_reference(logits, num_real, top_k=top_k, norm_topk_prob=norm_topk_prob, block_m=block_m)
    return pair_route_pallas(logits, num_real, top_k=top_k, norm_topk_prob=norm_topk_prob, block_m=block_m,
                             interpret=interpret)


__all__ = ["FUSED_ROUTE", "pair_route", "pair_route_pallas", "pair_route_reference", "pallas_supported"]
