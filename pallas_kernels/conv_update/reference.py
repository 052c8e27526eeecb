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


def conv_history(conv_state: Float[Array, "S C W1"], slot_ids: Int[Array, "B"]) -> Float[Array, "B W1 C"]:
    """Each row's last `W - 1` inputs before this step, oldest first, fp32, with the channels minor (zeros on the
    null slot 0): what a prefill step's first tokens read for their taps before the row's start. (Channels minor so
    that a token's tap reads C contiguous values: gathered from `[B, C, W-1]` directly, every value strides by
    W - 1 floats, which made XLA's conv several times slower than its bytes on the H200.)"""
    h0 = jnp.where((slot_ids == 0)[:, None, None], 0.0, conv_state[slot_ids].astype(jnp.float32))  # [B, C, W-1]
    return jax.lax.optimization_barrier(h0.transpose(0, 2, 1))


def conv_new_state(x: Float[Array, "T X"], h0t: Float[Array, "B W1 C"], conv_state: Float[Array, "S C W1"],
                   cu_seqlens: Int[Array, "B+1"], slot_ids: Int[Array, "B"], offset: int = 0
                   ) -> Float[Array, "S C W1"]:
    """The state after a prefill step: each row's slot holds the last `W - 1` inputs of `[h0t, its tokens]`."""
    num_tokens, num_channels, hist = x.shape[0], conv_state.shape[1], conv_state.shape[2]
    xf = x[:, offset : offset + num_channels].astype(jnp.float32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    idx = lengths[:, None] + jnp.arange(hist)[None, :]  # [B, W-1] index into the concatenation
    from_x = xf[jnp.clip(cu_seqlens[:-1, None] + idx - hist, 0, num_tokens - 1)]  # [B, W-1, C]
    from_h0 = jnp.take_along_axis(h0t, jnp.clip(idx, 0, max(hist - 1, 0))[:, :, None], axis=1)  # [B, W-1, C]
    new = jnp.where((idx < hist)[:, :, None], from_h0, from_x).transpose(0, 2, 1)  # [B, C, W-1]
    return conv_state.at[slot_ids].set(new.astype(conv_state.dtype))


def conv_prefill_reference(x: Float[Array, "T X"], conv_state: Float[Array, "S C W1"], weight: Float[Array, "C W"],
                           cu_seqlens: Int[Array, "B+1"], slot_ids: Int[Array, "B"], token_seq: Int[Array, "T"], *,
                           offset: int = 0, bias: Array | None = None, activation: str | None = None, out_dtype=None,
                           splits: tuple[int, ...] | None = None, scale: Array | None = None,
                           scale_group: int = 1) -> tuple[tuple[Array, ...], Float[Array, "S C W1"]]:
    """A depthwise causal conv over a step's packed rows, each continuing from its conv-state slot: token t of row
    b (`token_seq[t]`, at `local = t - cu_seqlens[b]` in the step's part of the row) outputs
    `sum_i w[:, i] * in(local - (W - 1 - i))`, where `in(j)` is the row's token j of this step for j >= 0 and its
    slot's input `W - 1 + j` before it (zeros on the null slot), summed in fp32 in tap order and cast to x's dtype;
    then `finish` (bias, activation, `out_dtype`), as `conv_update_reference`. The C channels are x's columns
    `[offset, offset + C)`. `splits` (channel counts summing to C) returns the output as that many arrays of those
    columns (default: one). `scale` `[T, H]` (fp32): one more output, the first split's channels after the
    activation, in fp32 and before the cast, times `scale[t, channel // scale_group]` (a Mamba2 mixer's `v = x dt`),
    then cast. Returns (outputs, state with each row's slot holding its last `W - 1` inputs)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown conv activation {activation!r}; choose one of {ACTIVATIONS}")
    num_tokens, (num_channels, width) = x.shape[0], weight.shape
    hist = width - 1
    h0t = conv_history(conv_state, slot_ids)  # [B, W-1, C]
    xf = x[:, offset : offset + num_channels].astype(jnp.float32)
    local = jnp.arange(num_tokens) - cu_seqlens[token_seq]  # the token's index in this step's part of its row
    out = jnp.zeros_like(xf)
    for i in range(width):
        d = hist - i  # tap i reads the input d tokens back
        src = local - d
        from_x = jnp.pad(xf, ((d, 0), (0, 0)))[:num_tokens] if d else xf  # x[t - d] (a static shift, not a gather)
        from_state = h0t[token_seq, jnp.clip(hist + src, 0, max(hist - 1, 0))] if hist else from_x
        out = out + jnp.where((src >= 0)[:, None], from_x, from_state) * weight[:, i].astype(jnp.float32)
    dtype = jnp.result_type(x.dtype, bias.dtype) if bias is not None else x.dtype
    dtype = dtype if out_dtype is None else out_dtype
    out = finish(out.astype(x.dtype), bias, activation, jnp.float32)  # fp32, before the cast
    bounds = split_bounds(num_channels, splits)
    outs = tuple(out[:, lo:hi].astype(dtype) for lo, hi in zip(bounds[:-1], bounds[1:]))
    if scale is not None:
        check_scale(scale, num_tokens, bounds, scale_group)
        outs += ((out[:, :bounds[1]] * jnp.repeat(scale.astype(jnp.float32), scale_group, axis=1)).astype(dtype),)
    return outs, conv_new_state(x, h0t, conv_state, cu_seqlens, slot_ids, offset)


def check_scale(scale, num_tokens: int, bounds: tuple[int, ...], scale_group: int) -> None:
    """`conv_prefill`'s `scale` must be `[T, first split / scale_group]`."""
    if scale_group < 1 or bounds[1] % scale_group or scale.shape != (num_tokens, bounds[1] // scale_group):
        raise ValueError(f"conv scale {scale.shape} must be [T, first split / scale_group] = "
                         f"[{num_tokens}, {bounds[1]} / {scale_group}]")


def split_bounds(num_channels: int, splits: tuple[int, ...] | None) -> tuple[int, ...]:
    """The channel offsets `(0, s0, s0 + s1, ..., C)` of `splits` (default: one part)."""
    splits = (num_channels,) if splits is None else tuple(splits)
    if sum(splits) != num_channels or min(splits) <= 0:
        raise ValueError(f"conv output splits {splits} must be positive and sum to the {num_channels} channels")
    bounds = [0]
    for s in splits:
        bounds.append(bounds[-1] + s)
    return tuple(bounds)
