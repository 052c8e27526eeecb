"""Paged attention: reference, Pallas kernels and dispatch.

`paged_attention` is the entry point the model calls; `impl` picks the implementation:
  * "reference": pure jnp (`paged_attention_reference`), any backend;
  * "pallas": the Pallas kernels: `decode.py` (one program per (query token, kv head, KV split), split-KV
    with an LSE merge) for `decode=True`, `prefill.py` (ragged query tiles per row, needs `cu_seqlens`)
    otherwise; `interpret=True` runs them in the Pallas interpreter (CPU tests);
  * with `mesh` (a 1-D device mesh whose axis splits the heads: tensor parallelism) the Pallas kernels run
    per shard under `jax.shard_map` (q heads and kv heads split alike, block tables replicated); the
    reference needs no wrapping (XLA SPMD partitions it);
  * "auto": on GPU, for shapes they support, the Pallas decode kernel for decode batches and the Pallas
    prefill kernel for ragged prefill batches (`AUTO_PALLAS_PREFILL`, set since its check on the H200,
    benchmarks/RESULTS.md); else the reference.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention.decode import paged_attention_decode_pallas
from pallas_kernels.paged_attention.merge import merge_attention
from pallas_kernels.paged_attention.prefill import paged_attention_prefill_pallas
from pallas_kernels.paged_attention.reference import paged_attention_reference, write_kv_pages

_IMPLS = ("auto", "reference", "pallas")
_TUNING = ("pages_per_block", "num_splits", "num_warps", "num_stages", "per_page", "block_q")
_PREFILL_TUNING = ("pages_per_block", "num_warps", "num_stages", "block_q", "per_page")
# "auto" routes prefill (many queries per row) to the ragged Pallas kernel: checked against the reference on
# the H200 (benchmarks/kernels.py, 2026-11-30 session 2). Set False to fall back to the reference.
AUTO_PALLAS_PREFILL = True


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def pallas_supported(q, k_pages) -> bool:
    """Static check: the Triton tiles need power-of-two head dim and page size."""
    head_dim, block_size = q.shape[-1], k_pages.shape[1]
    return _pow2(head_dim) and head_dim >= 16 and _pow2(block_size) and q.shape[1] % k_pages.shape[2] == 0


def paged_attention(
    q, k_pages, v_pages, block_tables, token_seq, positions, *,
    impl: str = "auto", interpret: bool = False, cu_seqlens=None, decode: bool = False,
    scale: float | None = None, sliding_window: int | None = None, soft_cap: float | None = None,
    return_lse: bool = False, mesh=None, **tuning,
):
    """Same arguments and result as `paged_attention_reference`; `impl` picks the implementation.

    `cu_seqlens [B + 1]` (the rows' query ranges in the packed queries) and `decode` (static: one query per
    row, `token_seq == arange(B)`) describe the batch's structure. `tuning` (pages_per_block, num_splits,
    num_warps, num_stages) goes to the Pallas kernel.
    """
    if impl not in _IMPLS:
        raise ValueError(f"unknown paged attention {impl=}; choose one of {_IMPLS}")
    if unknown := set(tuning) - set(_TUNING):
        raise ValueError(f"unknown paged attention tuning arguments {unknown}; known: {_TUNING}")
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, return_lse=return_lse)
    if impl == "auto":
        on_gpu = jax.default_backend() == "gpu" and pallas_supported(q, k_pages)
        use_pallas = on_gpu and (decode or (AUTO_PALLAS_PREFILL and cu_seqlens is not None))
        impl = "pallas" if use_pallas else "reference"
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, token_seq, positions, **kw)
    if not pallas_supported(q, k_pages):
        raise ValueError(
            f"the Pallas paged attention needs power-of-two head_dim >= 16 and page size, got "
            f"{q.shape[-1]=} {k_pages.shape[1]=}; use impl='reference'"
        )
    if not decode and cu_seqlens is not None:  # ragged prefill: query tiles per row
        tuning = {k: v for k, v in tuning.items() if k in _PREFILL_TUNING}
        kernel = lambda q, kp, vp, bt, rows, pos: paged_attention_prefill_pallas(  # noqa: E731
            q, kp, vp, bt, rows, pos, interpret=interpret, **kw, **tuning
        )
        rows = cu_seqlens
    else:
        tuning = {k: v for k, v in tuning.items() if k != "block_q"}
        kernel = lambda q, kp, vp, bt, rows, pos: paged_attention_decode_pallas(  # noqa: E731
            q, kp, vp, bt, rows, pos, interpret=interpret, **kw, **tuning
        )
        rows = token_seq
    if mesh is not None and mesh.size > 1:
        kernel = _per_head_shard(kernel, mesh, return_lse)
    return kernel(q, k_pages, v_pages, block_tables, rows, positions)


def _per_head_shard(kernel, mesh, return_lse: bool):
    """`kernel` run per shard of a 1-D mesh: each device attends with its q heads over its kv heads."""
    (axis,) = mesh.axis_names
    heads, pages, rep = P(None, axis, None), P(None, None, axis, None), P()
    out_specs = (heads, P(None, axis)) if return_lse else heads
    return jax.shard_map(kernel, mesh=mesh, in_specs=(heads, pages, pages, rep, rep, rep), out_specs=out_specs,
                         check_vma=False)


__all__ = [
    "AUTO_PALLAS_PREFILL",
    "merge_attention",
    "paged_attention",
    "paged_attention_decode_pallas",
    "paged_attention_prefill_pallas",
    "paged_attention_reference",
    "write_kv_pages",
]
