"""The decode step of a depthwise causal convolution over state slots, in jnp: each row's one new input against
the last `W - 1` inputs its slot holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def conv_update_reference(x: Float[Array, "B X"], conv_state: Float[Array, "S C W1"], weight: Float[Array, "C W"],
                          slot_ids: Int[Array, "B"], *, offset: int = 0, bias: Array | None = None,
                          activation: str | None = None, out_dtype=None
                          ) -> tuple[Float[Array, "B C"], Float[Array, "S C W1"]]:
    """Row b's output `sum_i h[:, i] * weight[:, i]` over its window `h = [state[slot_b], x[b]]` (the slot's
    `W - 1` inputs, oldest first, then the new one; the null slot 0 reads zeros), summed in fp32 in that order and
    cast to x's dtype; the slot then holds the window's last `W - 1` inputs (fp32). Rows on slot 0 write nothing.

    The layers' forms: the conv's C channels are x's columns `[offset, offset + C)` (x may be a wider packed
    projection); `bias` ([C]) is added to the cast output (in the promoted dtype, as `out + bias` in jnp);
    `activation="silu"` applies `silu` in fp32 to that; the result is cast to `out_dtype` (default: its dtype
    before the activation). Returns (out [B, C], state)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown conv activation {activation!r}; choose one of {ACTIVATIONS}")
    xf = x[:, offset : offset + weight.shape[0]].astype(jnp.float32)
    h0 = jnp.where((slot_ids == 0)[:, None, None], 0.0, conv_state[slot_ids].astype(jnp.float32))  # [B, C, W-1]
    window = jnp.concatenate([h0, xf[:, :, None]], axis=-1)  # [B, C, W]
    w = weight.astype(jnp.float32)
    out = jnp.zeros_like(xf)
    for i in range(window.shape[-1]):
        out = out + window[:, :, i] * w[:, i]
    num_slots = conv_state.shape[0]
    dst = jnp.where(slot_ids == 0, num_slots, slot_ids)  # out of range: dropped
    new_state = conv_state.at[dst].set(window[:, :, 1:].astype(conv_state.dtype), mode="drop")
    return finish(out.astype(x.dtype), bias, activation, out_dtype), new_state


ACTIVATIONS = (None, "silu")


def finish(out, bias, activation: str | None, out_dtype):
    """The conv's cast output after the bias (`out + bias`), the activation (`silu` in fp32) and the cast to
    `out_dtype` (default: the dtype after the bias)."""
    if bias is not None:
        out = out + bias
    dtype = out.dtype if out_dtype is None else out_dtype
    if activation is None:
        return out.astype(dtype)
    return jax.nn.silu(out.astype(jnp.float32)).astype(dtype)
