"""Grouped (per-expert) matmul over expert-sorted row tiles, pure jnp: the ground truth of `kernel.py`.

The rows of `x [M, K]` come in tiles of `block_m` rows; every row of tile b is multiplied by the weight of expert
`tile_expert[b]` (a tile holds one expert's rows: the MoE layer sorts its (token, expert) pairs by expert and pads
each expert's run to whole tiles). A tile whose expert is negative is unused; its rows come out as zeros here and
as anything in the kernel (nothing may read them).

The weights are a stack over experts, either
  * plain `w [E, K, N]` (the model's `[in, out]` layout), or
  * block-wise FP8 (`pallas_kernels/fp8_matmul`'s layout, one stack per expert): `w [E, Npad, K]`
    float8_e4m3fn in `[out, in]` order and `scale [E, Npad/128, K/128]` float32; the products are W8A16: the
    weight's FP8 values times their block scales, in the activations' dtype, against the activations as they are.

`epilogue` maps the fp32 product `y [rows, N]` to the output:
  * "none": `y` (`n` columns);
  * "silu_gate": `silu(y[:, :n/2]) * y[:, n/2:]` (`n/2` columns: SwiGLU over a packed gate-and-up weight);
  * "relu2": `relu(y) ** 2`.
Then each row is multiplied by `row_scale[row]` when given (the router's combine weight), and cast to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.fp8_matmul.reference import dequantize_weight

EPILOGUES = ("none", "silu_gate", "relu2")


def apply_epilogue(y: Float[Array, "R N"], epilogue: str) -> Array:
    """`epilogue` (module docstring) on fp32 products `y`; "silu_gate" halves the columns."""
    if epilogue == "silu_gate":
        gate, up = jnp.split(y, 2, axis=-1)
        return jax.nn.silu(gate) * up
    if epilogue == "relu2":
        return jnp.square(jax.nn.relu(y))
    if epilogue != "none":
        raise ValueError(f"unknown grouped_matmul {epilogue=}; choose one of {EPILOGUES}")
    return y


def expert_weights_kn(w: Array, scale: Array | None, n: int) -> Float[Array, "E K N"]:
    """The stack as float32 `[E, K, n]`: a plain stack as it is, an FP8 one dequantized (its block scales applied)."""
    if scale is None:
        return w[..., :n].astype(jnp.float32)
    return jax.vmap(lambda q, s: dequantize_weight(q, s, n))(w, scale)


def grouped_matmul_reference(
    x: Float[Array, "M K"],
    w: Array,
    tile_expert: Int[Array, "MB"],
    *,
    n: int,
    block_m: int,
    scale: Float[Array, "E NB KB"] | None = None,
    row_scale: Float[Array, "M"] | None = None,
    epilogue: str = "none",
) -> Array:
    """See the module docstring. `n`: the weight's true output columns (before the epilogue)."""
    m = x.shape[0]
    if m % block_m or tile_expert.shape[0] * block_m != m:
        raise ValueError(f"grouped_matmul needs M = tiles * block_m, got M={m}, {tile_expert.shape[0]} tiles, {block_m=}")
    wd = expert_weights_kn(w, scale, n)
    if scale is not None:  # W8A16: the dequantized weight in the activations' dtype
        wd = wd.astype(x.dtype).astype(jnp.float32)
    row_expert = jnp.repeat(tile_expert, block_m)  # [M]
    used = row_expert >= 0
    y = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), wd[jnp.maximum(row_expert, 0)],
                   precision=jax.lax.Precision.HIGHEST)  # [M, n]
    y = apply_epilogue(y, epilogue)
    if row_scale is not None:
        y = y * row_scale.astype(jnp.float32)[:, None]
    return jnp.where(used[:, None], y, 0.0).astype(x.dtype)
