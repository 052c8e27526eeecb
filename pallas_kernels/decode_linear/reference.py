"""A decode step's projections in jnp, as the model computes them: `decode_linear` (an optional RMSNorm of the
input, the matmul, an optional activation, an optional residual added) and `decode_mlp` (a dense MLP block:
RMSNorm, up / gate projection, SwiGLU or relu^2, down projection, residual)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

ACTS = ("silu", "relu2")


def rms_norm(x: Float[Array, "M K"], w: Float[Array, "K"], eps: float, zero_centred: bool) -> Array:
    """`jhybrid.models.layers.rms_norm`'s rounding: normalised in fp32; zero-centred weights (`1 + w`) scale before
    the cast back, plain ones after it."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centred:
        return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * xf.astype(x.dtype)


def activate(up: Array, act: str, gate: Array | None = None) -> Array:
    """`silu(gate) * up` (SwiGLU) or `relu(up)^2`."""
    if act == "silu":
        return jax.nn.silu(gate) * up
    return jnp.square(jax.nn.relu(up))


def decode_linear_reference(x: Float[Array, "M K"], w: Float[Array, "K N"], *, norm_w: Array | None = None,
                            eps: float = 1e-6, zero_centred: bool = False, act: str | None = None,
                            residual: Array | None = None) -> Array:
    """`residual + act(rms_norm(x) @ w)`, each part optional: `norm_w` (with `eps`, `zero_centred`) normalises x
    first; `act="silu"` takes w's columns as the packed `[gate | up]` and returns `silu(gate) * up` (N / 2 columns),
    `"relu2"` `relu(.)^2`; `residual` is added last. In x's dtype."""
    if act not in (None, *ACTS):
        raise ValueError(f"unknown activation {act!r}; choose one of {ACTS}")
    if norm_w is not None:
        x = rms_norm(x, norm_w, eps, zero_centred)
    h = x @ w
    if act == "silu":
        half = h.shape[-1] // 2
        h = activate(h[:, half:], act, h[:, :half])
    elif act is not None:
        h = activate(h, act)
    return h if residual is None else residual + h


def decode_mlp_reference(x: Float[Array, "M D"], norm_w: Float[Array, "D"], w_in: Float[Array, "D N"],
                         w_down: Float[Array, "I D"], *, eps: float, zero_centred: bool, act: str) -> Array:
    """`x + down(act(in(rms_norm(x))))` with `w_in` the packed `[gate | up]` (SwiGLU, N = 2I) or the up projection
    (relu^2, N = I)."""
    if act not in ACTS:
        raise ValueError(f"unknown MLP activation {act!r}; choose one of {ACTS}")
    h = decode_linear_reference(x, w_in, norm_w=norm_w, eps=eps, zero_centred=zero_centred, act=act)
    return decode_linear_reference(h, w_down, residual=x)
