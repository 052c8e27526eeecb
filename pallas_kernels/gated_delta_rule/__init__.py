"""Gated delta rule: references and dispatch.

`chunk_gated_delta_rule` (prefill, ragged packed sequences) and `fused_recurrent_gated_delta_rule`
(decode, one token per sequence) are the entry points the model calls. `impl="auto"` picks the pure-jnp
references until the Pallas kernels land.
"""

from __future__ import annotations

from pallas_kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)

_IMPLS = ("auto", "reference", "recurrent")


def chunk_gated_delta_rule(*args, impl: str = "auto", **kwargs):
    """Same signature and result as `chunk_gated_delta_rule_reference`.

    impl: "auto"/"reference" (chunked WY form) or "recurrent" (token-by-token scan, the definition).
    """
    if impl not in _IMPLS:
        raise ValueError(f"unknown gated delta rule {impl=}; choose one of {_IMPLS}")
    if impl == "recurrent":
        kwargs.pop("chunk_size", None)
        return recurrent_gated_delta_rule_reference(*args, **kwargs)
    return chunk_gated_delta_rule_reference(*args, **kwargs)


def fused_recurrent_gated_delta_rule(*args, impl: str = "auto", **kwargs):
    """Same signature and result as `fused_recurrent_gated_delta_rule_reference` (one decode step)."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown gated delta rule {impl=}; choose one of {_IMPLS}")
    return fused_recurrent_gated_delta_rule_reference(*args, **kwargs)


__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_reference",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_reference",
    "recurrent_gated_delta_rule_reference",
]
