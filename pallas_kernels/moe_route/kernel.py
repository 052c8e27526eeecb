"""Pallas (Triton lowering) kernel for `reference.py`: a decode step's softmax routing in one program.

The layer's routing was five XLA kernels a MoE layer in a decode step (the softmax, `top_k`, the renormalisation,
the padding tokens' select and the row weights' padding), each a launch of a few microseconds for a `[T, E]`
array of a few hundred values. Here one program loads the logits `[T, E]` (T and E powers of two), finds the k
largest of each row by k rounds of max and arg-max (the lowest index among equals, as `lax.top_k`), and writes
the tile experts `[T, k]` and the rows' weights `[T, k * BM]` (the pair's weight in its tile's first row) at once.

The weights come from the chosen logits: `exp(l - max) / sum(exp(l - max))` over all E (or, renormalised, over the
k: the softmax's denominator cancels), the reference's values up to fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

_WHOLE = pl.no_block_spec


def _route_kernel(num_real_ref, logits_ref, tile_expert_ref, row_w_ref, *, top_k: int, norm_topk_prob: bool,
                  block_m: int):
    logits = logits_ref[...].astype(jnp.float32)  # [T, E]
    num_tokens, num_experts = logits.shape
    expert = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)  # [T, E]
    row_max = jnp.max(logits, axis=1)  # [T]
    left = logits
    ids, weights = [], []
    for _ in range(top_k):
        best = jnp.max(left, axis=1)  # [T]
        pick = jnp.min(jnp.where(left == best[:, None], expert, num_experts), axis=1)  # [T]: the lowest among equals
        ids.append(pick)
        weights.append(jnp.exp(best - row_max))
        left = jnp.where(expert == pick[:, None], -jnp.inf, left)
    if norm_topk_prob:
        total = functools.reduce(jnp.add, weights)  # [T]
    else:
        total = jnp.sum(jnp.exp(logits - row_max[:, None]), axis=1)  # [T]
    real = jnp.arange(num_tokens) < num_real_ref[0]  # [T]
    slot = jax.lax.broadcasted_iota(jnp.int32, (num_tokens, top_k), 1)  # [T, k]
    column = jax.lax.broadcasted_iota(jnp.int32, (num_tokens, top_k * block_m), 1)  # [T, k * BM]
    experts = jnp.full((num_tokens, top_k), -1, jnp.int32)
    rows_w = jnp.zeros((num_tokens, top_k * block_m), jnp.float32)
    for j in range(top_k):
        experts = jnp.where((slot == j) & real[:, None], ids[j][:, None], experts)
        rows_w = jnp.where((column == j * block_m) & real[:, None], (weights[j] / total)[:, None], rows_w)
    tile_expert_ref[...] = experts
    row_w_ref[...] = rows_w


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "block_m", "interpret"))
def pair_route_pallas(logits: Float[Array, "T E"], num_real: Int[Array, ""] | None, *, top_k: int,
                      norm_topk_prob: bool, block_m: int = 16, interpret: bool = False) -> tuple[Array, Array]:
    """Same arguments and results as `pair_route_reference`; T, E, k and `block_m` powers of two, k <= E."""
    num_tokens, num_experts = logits.shape
    for name, value in (("T", num_tokens), ("E", num_experts), ("top_k", top_k), ("block_m", block_m)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"pair_route_pallas: {name}={value} must be a power of two")
    if top_k > num_experts:
        raise ValueError(f"pair_route_pallas: top_k={top_k} > E={num_experts} experts")
    real = jnp.asarray(num_tokens if num_real is None else num_real, jnp.int32).reshape(1)
    kernel = functools.partial(_route_kernel, top_k=top_k, norm_topk_prob=norm_topk_prob, block_m=block_m)
    tile_expert, row_w = pl.pallas_call(
        kernel,
        grid=(1,),
        in_specs=[_WHOLE, _WHOLE],
        out_specs=[_WHOLE, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32),
                   jax.ShapeDtypeStruct((num_tokens, top_k * block_m), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=1 if num_tokens * num_experts <= 256 else 4, num_stages=1),
        interpret=interpret,
        name=f"moe_pair_route_k{top_k}_e{num_experts}{'_norm' if norm_topk_prob else ''}",
    )(real, logits)
    return tile_expert.reshape(-1), row_w.reshape(-1)
