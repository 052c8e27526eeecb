"""Ragged prefill attention in two parts: the step's own tokens by cuDNN's fused attention, the cached prefix by
a Pallas kernel, merged by log-sum-exp (in that kernel, `prefix.py`, or after it, `merge.py`).

A prefill step's query tokens attend to two disjoint key sets: the keys the step itself brings (each row's new
tokens, causally among themselves) and the keys its rows had before the step (a prompt's earlier chunks, a
prefix-cache hit, a decode row's context). The first is ordinary causal self-attention over packed
variable-length rows, which cuDNN's flash attention runs near the matmul rate on Hopper (its packed "THD" layout:
`q_offsets` / `q_seqlen` per row); the Pallas kernel reaches a fraction of that on a long fresh prompt
(benchmarks/RESULTS.md, session 27). The second stays with the Pallas kernel (`paged_attention_prefill_pallas`),
called with each query's position replaced by the position before its row's first new token, so that it
attends to the prefix only: a fresh row has no prefix (position -1) and costs nothing there.

`packed_causal_attention(impl="reference")` is the same self-attention in jnp (O(T^2) memory: CPU tests), so the
composition is tested on the CPU; cuDNN itself is checked against the paged reference on the GPU
(`python3 -m benchmarks.kernels`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention.merge import merge_attention

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_CUDNN_HEAD_DIM = 256  # Hopper; a multiple of 8


def cudnn_supported(q, k_pages) -> bool:
    """Static check: cuDNN's packed flash attention needs bf16 / fp16 and a head dim <= 256, a multiple of 8."""
    head_dim = q.shape[-1]
    return (k_pages.dtype in CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= MAX_CUDNN_HEAD_DIM
            and q.shape[1] % k_pages.shape[2] == 0)


def token_rows(cu_seqlens: Int[Array, "B+1"], num_tokens: int) -> tuple[Array, Array]:
    """Each packed token's row `[T]` (clipped to B - 1 for padding tokens) and whether it is a real token `[T]`."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all: T x B comparisons in one fusion; the default `scan` is a while loop the GPU runs from the host
    row = jnp.searchsorted(cu_seqlens[1:], t, side="right", method="compare_all").astype(jnp.int32)
    return jnp.minimum(row, cu_seqlens.shape[0] - 2), t < cu_seqlens[-1]


def packed_causal_attention(
    q: Float[Array, "T H D"],
    k: Float[Array, "T KVH D"],
    v: Float[Array, "T KVH D"],
    cu_seqlens: Int[Array, "B+1"],
    *,
    scale: float,
    impl: str = "cudnn",
) -> tuple[Float[Array, "T H D"], Float[Array, "T H"]]:
    """Causal attention of each row's packed tokens `[cu[b], cu[b+1])` over the same row's tokens (GQA: query head
    h reads kv head h // (H / KVH)). Returns (o `[T, H, D]` in q's dtype, lse `[T, H]` fp32, natural log of the
    scaled scores' sum-exp); padding tokens (at or after `cu[B]`) get o = 0 and lse = -inf."""
    o, lse = _self_part(q, k, v, cu_seqlens, scale, impl)
    real = jnp.arange(q.shape[0]) < cu_seqlens[-1]
    o = jnp.where(real[:, None, None], o, 0).astype(q.dtype)  # cuDNN leaves tokens outside every row unwritten
    return o, jnp.where(real[:, None], lse, -jnp.inf)


def _self_part(q, k, v, cu_seqlens, scale, impl):
    """`packed_causal_attention` with its padding tokens' o and lse unspecified (o in q's dtype)."""
    row, real = token_rows(cu_seqlens, q.shape[0])
    if impl == "reference":
        o, lse = _reference(q, k, v, row, real, scale)
    elif impl == "cudnn":
        o, lse = _cudnn(q, k, v, cu_seqlens, row, scale)
    else:
        raise ValueError(f"unknown packed attention {impl=}; choose 'cudnn' or 'reference'")
    return o.astype(q.dtype), lse


def _reference(q, k, v, row, real, scale):
    group = q.shape[1] // k.shape[1]
    kf = jnp.repeat(jnp.where(real[:, None, None], k, 0).astype(jnp.float32), group, axis=1)  # padding may be NaN
    vf = jnp.repeat(jnp.where(real[:, None, None], v, 0).astype(jnp.float32), group, axis=1)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kf) * scale
    t = jnp.arange(q.shape[0])
    mask = (row[:, None] == row[None, :]) & (t[None, :] <= t[:, None]) & real[:, None] & real[None, :]
    s = jnp.where(mask[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [H, T]; -inf for padding tokens
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    return jnp.einsum("hts,shd->thd", p, vf), lse.T


def _cudnn(q, k, v, cu_seqlens, row, scale):
    """cuDNN's fused attention in its packed layout: one batch of B segments (row b's tokens start at cu[b]; an
    empty row is a segment of length 0). The softmax statistics come back per (segment, head, position within
    the segment)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention  # jax==0.11.2 pinned

    num_tokens = q.shape[0]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).astype(jnp.int32)
    seg = lambda x: x[None].astype(jnp.int32)  # noqa: E731  [1, B] / [1, B + 1]: one batch of B segments
    dtype = q.dtype if q.dtype in CUDNN_DTYPES else k.dtype
    o, stats = dot_product_attention(
        q.astype(dtype)[None], k.astype(dtype)[None], v.astype(dtype)[None],
        q_seqlen=seg(lens), kv_seqlen=seg(lens), q_offsets=seg(cu_seqlens), kv_offsets=seg(cu_seqlens),
        scale=scale, mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH", return_residual=True,
    )
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_seqlens[row]  # [T] position within its row
    lse = stats[row, :, jnp.clip(local, 0, num_tokens - 1)]  # [T, H]
    return o[0], lse


# whether a step with no prefix at all skips the prefix part through a `lax.cond` (JHYBRID_PREFIX_SKIP=1). Off by
# default: XLA's runtime reads the cond's predicate back to the host, so the program's call waits for the device to
# reach it in every prefill step. Served at 64 streams on the H200, same machine (session 28): 7,060 tok/s and ITL
# p99 29.6 ms with the cond, 8,269 tok/s and 20.2 ms without; its gain is ~0.5 ms per 16k fresh tokens per layer.
SKIP_EMPTY_PREFIX = os.environ.get("JHYBRID_PREFIX_SKIP", "0") == "1"


def prefix_positions(positions: Int[Array, "T"], cu_seqlens: Int[Array, "B+1"]) -> Int[Array, "T"]:
    """Each token's row's last position before this step (its row's first new position - 1): attending up to it
    reads the row's prefix only. -1 for fresh rows and padding tokens (the Pallas kernel skips those)."""
    row, real = token_rows(cu_seqlens, positions.shape[0])
    first = positions[jnp.minimum(cu_seqlens[row], positions.shape[0] - 1)]
    return jnp.where(real, first - 1, -1).astype(positions.dtype)


def split_prefill_attention(q, k, v, cu_seqlens, positions, prefix_attention=None, *, scale: float,
                            impl: str = "cudnn", merge_prefix=None):
    """The step's self-attention (`packed_causal_attention`) merged with the attention over the rows' prefixes.

    `merge_prefix(o_self, lse_self)`: a callable continuing the self part's softmax over the prefixes and
    returning the merged (o, lse), with padding tokens' zeros and -inf (the in-place kernel, `prefix.py`);
    the self part's padding tokens are left as computed. Else `prefix_attention(prefix_positions)`: a callable
    returning (o, lse) of the queries over their rows' keys up to the given positions (the Pallas kernel),
    merged by `merge_attention` and skipped when no row has a prefix if `SKIP_EMPTY_PREFIX`. Returns (o in q's
    dtype, lse fp32)."""
    if merge_prefix is not None:
        return merge_prefix(*_self_part(q, k, v, cu_seqlens, scale, impl))
    o_self, lse_self = packed_causal_attention(q, k, v, cu_seqlens, scale=scale, impl=impl)
    before = prefix_positions(positions, cu_seqlens)

    def with_prefix(_):
        o_pre, lse_pre = prefix_attention(before)
        return merge_attention(o_self, lse_self, o_pre.astype(o_self.dtype), lse_pre)

    # with SKIP_EMPTY_PREFIX a step of fresh prompts only skips the prefix kernel and the merge (their layout passes
    # cost ~0.5 ms per 16k tokens of a layer on the H200, session 27), at the price of a predicate read (above)
    if not SKIP_EMPTY_PREFIX:
        return with_prefix(None)
    return jax.lax.cond(jnp.any(before >= 0), with_prefix, lambda _: (o_self, lse_self), None)
