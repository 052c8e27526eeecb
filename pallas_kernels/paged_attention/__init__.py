"""Paged attention: reference and dispatch.

`paged_attention` is the entry point the model calls; it picks an implementation by `impl`:
"reference" (pure jnp, any backend) is the only one until the Pallas kernels land, and "auto" selects it.
"""

from __future__ import annotations

from pallas_kernels.paged_attention.reference import paged_attention_reference, write_kv_pages

_IMPLS = ("auto", "reference")


def paged_attention(*args, impl: str = "auto", **kwargs):
    """Same signature and result as `paged_attention_reference`; `impl` picks the implementation."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown paged attention {impl=}; choose one of {_IMPLS}")
    return paged_attention_reference(*args, **kwargs)


__all__ = ["paged_attention", "paged_attention_reference", "write_kv_pages"]
