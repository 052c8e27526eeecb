"""Gated delta rule: references, Pallas kernels and dispatch.

`chunk_gated_delta_rule` (prefill, ragged packed sequences) and `fused_recurrent_gated_delta_rule`
(decode, one token per sequence) are the entry points the model calls. `impl` picks the implementation:
  * "reference": the pure-jnp references; "recurrent" (chunk form only): the token-by-token scan;
  * "pallas": the Pallas kernels (`fused_recurrent.py`, `chunk.py`); `interpret=True` runs them in the
    Pallas interpreter (CPU tests);
  * "auto": the Pallas kernel on GPU where its shapes are supported (power-of-two K and V), else the
    reference.
"""

from __future__ import annotations

import jax

from pallas_kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)

_IMPLS = ("auto", "reference", "recurrent", "pallas")

# Which kernels "auto" routes to on GPU: only those checked correct on the H200 (benchmarks/RESULTS.md).
_AUTO_PALLAS = frozenset({"fused_recurrent", "chunk"})


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def pallas_supported(q, v) -> bool:
    """Static check: Triton tiles need power-of-two key and value head dims."""
    return _pow2(q.shape[-1]) and _pow2(v.shape[-1]) and q.shape[-1] >= 16 and v.shape[-1] >= 16


def _pick(impl: str, kind: str, q, v) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"unknown gated delta rule {impl=}; choose one of {_IMPLS}")
    if impl == "auto":
        gpu = jax.default_backend() == "gpu"
        return "pallas" if gpu and kind in _AUTO_PALLAS and pallas_supported(q, v) else "reference"
    if impl == "pallas" and not pallas_supported(q, v):
        raise ValueError(
            f"the Pallas gated delta rule needs power-of-two K, V >= 16, got {q.shape[-1]=} {v.shape[-1]=}; "
            "use impl='reference'"
        )
    return impl


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slot_ids, *, impl: str = "auto",
                           interpret: bool = False, scale: float | None = None, chunk_size: int = 64,
                           **tuning):
    """Same signature and result as `chunk_gated_delta_rule_reference`.

    impl: "auto", "reference" (chunked WY form), "recurrent" (token-by-token scan, the definition) or
    "pallas". `tuning` (block_v, num_warps, num_stages, wy_num_warps, wy_precision, decayed_keys, fused_output,
    out_block_v) goes to the Pallas kernel.
    """
    impl = _pick(impl, "chunk", q, v)
    args = (q, k, v, g, beta, cu_seqlens, state, slot_ids)
    if impl == "recurrent":
        return recurrent_gated_delta_rule_reference(*args, scale=scale)
    if impl == "reference":
        return chunk_gated_delta_rule_reference(*args, scale=scale, chunk_size=chunk_size)
    return chunk_gated_delta_rule_pallas(*args, scale=scale, chunk_size=chunk_size, interpret=interpret, **tuning)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, slot_ids, *, impl: str = "auto",
                                     interpret: bool = False, scale: float | None = None, **tuning):
    """Same signature and result as `fused_recurrent_gated_delta_rule_reference` (one decode step).

    With impl "pallas" the state is aliased in place (donate it under jit to avoid a copy); `tuning`
    (block_v, num_warps, num_stages) goes to the kernel.
    """
    impl = _pick(impl, "fused_recurrent", q, v)
    if impl == "recurrent":
        raise ValueError("impl='recurrent' is for chunk_gated_delta_rule; decode is already recurrent")
    if impl == "reference":
        return fused_recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, slot_ids, scale=scale)
    return fused_recurrent_gated_delta_rule_pallas(
        q, k, v, g, beta, state, slot_ids, scale=scale, interpret=interpret, **tuning
    )


__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_pallas",
    "chunk_gated_delta_rule_reference",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_pallas",
    "fused_recurrent_gated_delta_rule_reference",
    "recurrent_gated_delta_rule_reference",
]
