"""A decode step's MLP block in jnp, as the model computes it: RMSNorm of the residual stream, the up (and gate)
projection, the activation, the down projection, and the residual added back."""

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
    """`silu(gate) * up` (SwiGLU) or `relu(up)^2`, in the activations' dtype."""
    if act == "silu":
        return jax.nn.silu(gate) * up
    return jnp.square(jax.nn.relu(up))


def decode_mlp_reference(x: Float[Array, "M D"], norm_w: Float[Array, "D"], w_in: Float[Array, "D N"],
                         w_down: Float[Array, "I D"], *, eps: float, zero_centred: bool, act: str) -> Array:
    """`x + down(act(in(rms_norm(x))))` with `w_in` the packed `[gate | up]` (SwiGLU, N = 2I) or the up projection
    (relu^2, N = I)."""
    if act not in ACTS:
        raise ValueError(f"unknown MLP activation {act!r}; choose one of {ACTS}")
    h = rms_norm(x, norm_w, eps, zero_centred) @ w_in
    if act == "silu":
        half = h.shape[-1] // 2
        h = activate(h[:, half:], act, h[:, :half])
    else:
        h = activate(h, act)
    return x + h @ w_down
