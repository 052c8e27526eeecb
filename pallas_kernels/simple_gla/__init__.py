"""Scalar-decay linear recurrence without the delta rule (lightning attention, Mamba2 SSD): references and
dispatch.

`chunk_simple_gla` (prefill, ragged packed sequences) and `fused_recurrent_simple_gla` (decode, one token
per sequence) are the entry points the model calls. `impl` picks the implementation:
  * "reference" (and "auto"): the pure-jnp references; "recurrent" (chunk form only): the token-by-token
    scan;
  * "pallas": no Pallas kernel exists yet for this op (a later issue); asking for one raises.
The arguments mirror `pallas_kernels.gated_delta_rule` without `beta`.
"""

from __future__ import annotations

from pallas_kernels.simple_gla.reference import (
    chunk_simple_gla_reference,
    fused_recurrent_simple_gla_reference,
    recurrent_simple_gla_reference,
)

_IMPLS = ("auto", "reference", "recurrent", "pallas")


def _pick(impl: str) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"unknown simple GLA {impl=}; choose one of {_IMPLS}")
    if impl == "pallas":
        raise ValueError("simple GLA (lightning attention / Mamba2) has no Pallas kernel yet; use impl='reference' or 'auto'")
    return "reference" if impl == "auto" else impl


def chunk_simple_gla(q, k, v, g, cu_seqlens, state, slot_ids, *, impl: str = "auto", interpret: bool = False,
                     scale: float = 1.0, chunk_size: int = 64, mesh=None):
    """Same signature and result as `chunk_simple_gla_reference`; `interpret` and `mesh` are accepted for
    symmetry with the other ops (no kernel to interpret or run per shard yet: XLA SPMD partitions the
    reference)."""
    del interpret, mesh
    args = (q, k, v, g, cu_seqlens, state, slot_ids)
    if _pick(impl) == "recurrent":
        return recurrent_simple_gla_reference(*args, scale=scale)
    return chunk_simple_gla_reference(*args, scale=scale, chunk_size=chunk_size)


def fused_recurrent_simple_gla(q, k, v, g, state, slot_ids, *, impl: str = "auto", interpret: bool = False,
                               scale: float = 1.0, mesh=None):
    """Same signature and result as `fused_recurrent_simple_gla_reference` (one decode step)."""
    del interpret, mesh
    if _pick(impl) == "recurrent":
        raise ValueError("impl='recurrent' is for chunk_simple_gla; decode is already recurrent")
    return fused_recurrent_simple_gla_reference(q, k, v, g, state, slot_ids, scale=scale)


__all__ = [
    "chunk_simple_gla",
    "chunk_simple_gla_reference",
    "fused_recurrent_simple_gla",
    "fused_recurrent_simple_gla_reference",
    "recurrent_simple_gla_reference",
]
