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

A ragged prefill given its own keys and values (`new_kv`) runs split (`self_attention.py`): the step's tokens
among themselves by cuDNN's fused attention, the rows' cached prefixes by a Pallas kernel that merges into the
self part's output in place (`prefix.py`; `PREFIX_IN_PLACE`), or, for steps of few query tiles, by the prefill
kernel with KV splits followed by an LSE merge (`AUTO_CUDNN_PREFILL` on the GPU; `self_impl` picks the self
part's implementation explicitly).
"""

from __future__ import annotations

import os

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention.decode import paged_attention_decode_pallas
from pallas_kernels.paged_attention.decode_prologue import decode_prologue_pallas, decode_prologue_supported
from pallas_kernels.paged_attention.merge import merge_attention
from pallas_kernels.paged_attention.prefill import paged_attention_prefill_pallas, tiling
from pallas_kernels.paged_attention.prefix import paged_prefix_merge_pallas
from pallas_kernels.paged_attention.reference import paged_attention_reference, write_kv_pages
from pallas_kernels.paged_attention.self_attention import cudnn_supported, split_prefill_attention

_IMPLS = ("auto", "reference", "pallas")
_TUNING = ("pages_per_block", "num_splits", "num_warps", "num_stages", "per_page", "block_softmax", "tail_mask",
           "block_q")
_PREFILL_TUNING = ("pages_per_block", "num_warps", "num_stages", "block_q", "per_page")
_PREFIX_TUNING = ("pages_per_block", "num_warps", "num_stages", "block_q")
_TILING = ("pages_per_block", "block_q")
# "auto" routes prefill (many queries per row) to the ragged Pallas kernel: checked against the reference on
# the H200 (benchmarks/kernels.py, 2026-11-30 session 2). Set False to fall back to the reference.
AUTO_PALLAS_PREFILL = True
# "auto" splits a ragged prefill given `new_kv` into cuDNN self-attention + the Pallas kernel over the prefix:
# benchmarks/RESULTS.md, session 27. JHYBRID_CUDNN_PREFILL=0 turns it off (traced into the programs, so set it
# before the engine starts).
AUTO_CUDNN_PREFILL = os.environ.get("JHYBRID_CUDNN_PREFILL", "1") != "0"
_SELF_IMPLS = ("cudnn", "reference")
# a split prefill continues the self part's softmax over the prefixes in place (`prefix.py`: a fresh prompt's
# tiles exit at once, and there is no tile layout, fp32 partial output or merge pass), unless the step's query
# tiles are so few that the unmerged kernel would split their keys across programs (a short suffix after a long
# cached prefix). JHYBRID_PREFIX_IN_PLACE=0: always the unmerged kernel and `merge_attention` (session 27's form).
PREFIX_IN_PLACE = os.environ.get("JHYBRID_PREFIX_IN_PLACE", "1") != "0"


# a decode step's attention layer runs its q/k norms, RoPE, K/V writes and query padding as one kernel
# (`decode_prologue.py`): the qwen3_next-shaped batch-1 step 334 -> 305 kernels (H200 compile); on an H100 its
# batch-1 token 2.049 -> 2.028 ms and batch-256 step 10.744 -> 10.699 ms (`benchmarks.floors`), logits within bf16
# rounding of the parts' (benchmarks/RESULTS.md, "Session 40"). JHYBRID_ATTN_DECODE_PROLOGUE=0 turns it off.
DECODE_PROLOGUE = os.environ.get("JHYBRID_ATTN_DECODE_PROLOGUE", "1") == "1"


def decode_prologue_applies(dims: tuple[int, int, int], rotary_dim: int, k_pages, *, impl: str = "auto",
                            mesh=None) -> bool:
    """Whether a decode step of these heads (`(H, KVH, D)`) runs `decode_prologue_pallas` and then the decode kernel
    on its padded queries (static): `DECODE_PROLOGUE` on, no mesh splitting the heads, the kernels' shapes
    (`decode_prologue_supported`, a power-of-two page size), and `impl` "pallas", or "auto" on a GPU."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown paged attention {impl=}; choose one of {_IMPLS}")
    return (DECODE_PROLOGUE and (mesh is None or mesh.size == 1) and decode_prologue_supported(dims, rotary_dim)
            and _pow2(k_pages.shape[1]) and (impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu")))


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
    return_lse: bool = False, mesh=None, new_kv=None, self_impl: str | None = None, **tuning,
):
    """Same arguments and result as `paged_attention_reference`; `impl` picks the implementation.

    `cu_seqlens [B + 1]` (the rows' query ranges in the packed queries) and `decode` (static: one query per
    row, `token_seq == arange(B)`) describe the batch's structure. `tuning` (pages_per_block, num_splits,
    num_warps, num_stages) goes to the Pallas kernel.

    `new_kv`: this step's keys and values `([T, KVH, D], [T, KVH, D])`, packed like q (and already written into
    the pages; a decode step ignores them). With them a ragged Pallas prefill runs split: `self_impl` ("cudnn"
    or "reference") attends the step's tokens among themselves, the Pallas kernel their rows' earlier keys.
    None: "cudnn" on the GPU where it applies (`AUTO_CUDNN_PREFILL`, bf16/fp16, no sliding window or soft cap,
    no mesh), else no split.
    """
    if impl not in _IMPLS:
        raise ValueError(f"unknown paged attention {impl=}; choose one of {_IMPLS}")
    if self_impl is not None and self_impl not in _SELF_IMPLS:
        raise ValueError(f"unknown prefill self-attention {self_impl=}; choose one of {_SELF_IMPLS}")
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
        self_impl = _split_impl(q, k_pages, new_kv, self_impl, sliding_window, soft_cap, mesh)
        if self_impl is not None:
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            prefix = lambda pos: paged_attention_prefill_pallas(  # noqa: E731
                q, k_pages, v_pages, block_tables, cu_seqlens, pos, interpret=interpret, scale=scale, return_lse=True,
                **tuning)
            merge = None
            if PREFIX_IN_PLACE and tiling(q.shape, k_pages, block_tables.shape, **_only(tuning, _TILING))[2] == 1:
                merge = lambda o, lse: paged_prefix_merge_pallas(  # noqa: E731
                    q, k_pages, v_pages, block_tables, cu_seqlens, positions, o, lse, scale=scale, interpret=interpret,
                    **_only(tuning, _PREFIX_TUNING))
            o, lse = split_prefill_attention(q, *new_kv, cu_seqlens, positions, prefix, scale=scale, impl=self_impl,
                                             merge_prefix=merge)
            return (o, lse) if return_lse else o
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


def _only(tuning: dict, names: tuple[str, ...]) -> dict:
    return {k: v for k, v in tuning.items() if k in names}


def _split_impl(q, k_pages, new_kv, self_impl, sliding_window, soft_cap, mesh) -> str | None:
    """The self-attention implementation a ragged Pallas prefill splits off, or None (no split)."""
    if new_kv is None:
        if self_impl is not None:
            raise ValueError(f"{self_impl=} needs this step's keys and values (new_kv)")
        return None
    if self_impl is None:
        auto = (AUTO_CUDNN_PREFILL and jax.default_backend() == "gpu" and cudnn_supported(q, k_pages)
                and sliding_window is None and soft_cap is None and (mesh is None or mesh.size == 1))
        return "cudnn" if auto else None
    if sliding_window is not None or soft_cap is not None or (mesh is not None and mesh.size > 1):
        raise ValueError("the split prefill supports neither a sliding window, a soft cap nor a mesh")
    return self_impl


def _per_head_shard(kernel, mesh, return_lse: bool):
    """`kernel` run per shard of a 1-D mesh: each device attends with its q heads over its kv heads."""
    (axis,) = mesh.axis_names
    heads, pages, rep = P(None, axis, None), P(None, None, axis, None), P()
    out_specs = (heads, P(None, axis)) if return_lse else heads
    return jax.shard_map(kernel, mesh=mesh, in_specs=(heads, pages, pages, rep, rep, rep), out_specs=out_specs,
                         check_vma=False)


__all__ = [
    "AUTO_CUDNN_PREFILL",
    "AUTO_PALLAS_PREFILL",
    "DECODE_PROLOGUE",
    "decode_prologue_applies",
    "decode_prologue_pallas",
    "merge_attention",
    "paged_attention",
    "paged_attention_decode_pallas",
    "paged_attention_prefill_pallas",
    "paged_prefix_merge_pallas",
    "paged_attention_reference",
    "write_kv_pages",
]
