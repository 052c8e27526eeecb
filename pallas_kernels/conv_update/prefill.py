"""Pallas (Triton lowering) kernel for a prefill (or mixed) step of a depthwise causal convolution over a step's
packed rows, each continuing from its conv-state slot (`reference.conv_prefill_reference`).

Grid `(T / BT, C / BC)`: program (i, c) writes tokens `[i BT, (i + 1) BT)` of channels `[c BC, (c + 1) BC)`. Per tap
it gathers the `[BT, BC]` inputs `d` tokens back (rows clamped at 0, so every load is in bounds and nothing needs a
mask) and, for the tokens whose tap reaches before their row's start, the row's history (`reference.conv_history`,
`[B, W-1, C]`, tiny); the other tokens' history index points at one address, which the cache serves once. The
taps are summed in fp32 in the reference's order, cast, and the bias, SiLU and output cast applied in registers
(`finish`). The input may be a wider packed projection whose columns `[offset, offset + C)` the conv takes (read in
place: no slice written first), and the output may be split by channels into several arrays (`splits`: the Gated
DeltaNet layer's q, k and v), each channel block stored into the one it falls in, so the consumers read no slice
either. The new state (the rows' last `W - 1` inputs) is XLA's: `B x (W-1) x C` values.

Why: XLA runs the same conv as loop fusions at 1.3-1.6 TB/s on an H100 (benchmarks/RESULTS.md, "Session 41": ~100
us a layer above the bytes' time in qwen3_next's and NemotronH's 8k prefills).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.conv_update.reference import (ACTIVATIONS, check_scale, conv_history, conv_new_state, finish,
                                                  split_bounds)

_WHOLE = pl.no_block_spec


def _kernel(seq_ref, local_ref, x_ref, w_ref, h0_ref, *refs, width: int, block_t: int, block_c: int, offset: int,
            has_bias: bool, activation: str | None, bounds: tuple[int, ...], contiguous: bool, scale_group: int):
    bias_ref = refs[0] if has_bias else None
    scale_ref = refs[int(has_bias)] if scale_group else None
    out_refs = refs[int(has_bias) + bool(scale_group):]
    scaled_ref = out_refs[-1] if scale_group else None
    i, c = pl.program_id(0), pl.program_id(1)
    hist = width - 1
    t0 = pl.multiple_of(i * block_t, block_t)
    tokens = pl.ds(t0, block_t)
    t = t0 + jnp.arange(block_t)
    seq, local = seq_ref[tokens], local_ref[tokens]
    start = pl.multiple_of(c * block_c, block_c)
    align = block_c if offset == 0 else min(block_c, offset & -offset)  # a power of two dividing the start
    columns = pl.ds(pl.multiple_of(offset + start, align), block_c)
    channels = pl.ds(start, block_c)

    def gathered():  # any tile: each tap's rows gathered, the history where a tap reaches before a row's start
        acc = jnp.zeros((block_t, block_c), jnp.float32)
        for tap in range(width):
            d = hist - tap  # the tap reads the input d tokens back
            src = local - d
            x = (x_ref[jnp.maximum(t - d, 0), columns] if d else x_ref[tokens, columns]).astype(jnp.float32)
            if hist:
                before = src < 0
                row = jnp.where(before, jnp.clip(seq, 0, h0_ref.shape[0] - 1), 0)  # in-row tokens: one address
                h = h0_ref[row, jnp.where(before, jnp.clip(hist + src, 0, hist - 1), 0), channels]
                x = jnp.where(before[:, None], h, x)
            acc = acc + x * w_ref[channels, tap].astype(jnp.float32)
        return acc

    def windows():  # a tile no tap of which reaches before a row's start or the array's: contiguous row windows
        acc = jnp.zeros((block_t, block_c), jnp.float32)
        for tap in range(width):
            x = x_ref[pl.ds(t0 - (hist - tap), block_t), columns].astype(jnp.float32)
            acc = acc + x * w_ref[channels, tap].astype(jnp.float32)
        return acc

    def store(acc):
        act = finish(acc.astype(x_ref.dtype), bias_ref[channels] if has_bias else None, activation, jnp.float32)
        out = act.astype(out_refs[0].dtype)
        for ref, lo, hi in zip(out_refs, bounds[:-1], bounds[1:]):
            @pl.when((start >= lo) & (start < hi))
            def _(ref=ref, lo=lo):
                ref[tokens, pl.ds(pl.multiple_of(start - lo, block_c), block_c)] = out

        if scale_group:  # the first split's channels times their token's scale, one more output
            @pl.when(start < bounds[1])
            def _():
                rows = jnp.broadcast_to(t[:, None], (block_t, block_c))  # each value's token and scale column
                cols = jnp.broadcast_to(((start + jnp.arange(block_c)) // scale_group)[None, :], (block_t, block_c))
                s = scale_ref[rows, cols].astype(jnp.float32)
                scaled_ref[tokens, channels] = (act * s).astype(scaled_ref.dtype)

    if not contiguous or not hist:
        store(gathered())
        return
    plain = (t0 >= hist) & (jnp.min(local) >= hist)  # every token's taps within its row and past row 0

    @pl.when(plain)
    def _():
        store(windows())

    @pl.when(jnp.logical_not(plain))
    def _():
        store(gathered())


def token_block(num_tokens: int, most: int = 16) -> int:
    """Tokens a program: the largest power of two up to `most` dividing T (so no program runs past the end)."""
    block = 1
    while block * 2 <= most and num_tokens % (block * 2) == 0:
        block *= 2
    return block


def channel_block(num_channels: int, bounds: tuple[int, ...], most: int = 128) -> int:
    """Channels a program: the largest power of two from 16 up to `most` dividing every split's offset (so a block
    never straddles two outputs); 0 if none does."""
    block = most
    while block >= 16 and any(b % block for b in bounds):
        block //= 2
    return block if block >= 16 else 0


def supported(x, weight, splits=None) -> bool:
    """Static check: a kernel width of at least 2 and a channel block of at least 16 dividing every split."""
    return weight.shape[1] > 1 and x.shape[0] > 0 and channel_block(weight.shape[0],
                                                                    split_bounds(weight.shape[0], splits)) > 0


@functools.partial(jax.jit, static_argnames=("offset", "activation", "out_dtype", "splits", "scale_group", "block_t",
                                             "block_c", "num_warps", "contiguous", "interpret"))
def conv_prefill_pallas(x: Float[Array, "T X"], conv_state: Float[Array, "S C W1"], weight: Float[Array, "C W"],
                        cu_seqlens: Int[Array, "B+1"], slot_ids: Int[Array, "B"], token_seq: Int[Array, "T"], *,
                        offset: int = 0, bias: Array | None = None, activation: str | None = None, out_dtype=None,
                        splits: tuple[int, ...] | None = None, scale: Array | None = None, scale_group: int = 1,
                        block_t: int | None = None,
                        block_c: int | None = None, num_warps: int = 4, contiguous: bool = True,
                        interpret: bool = False
                        ) -> tuple[tuple[Array, ...], Float[Array, "S C W1"]]:
    """Same signature and result as `conv_prefill_reference` (`supported` shapes). By default 16 tokens x 128
    channels a program at 4 warps (72 registers on the H200 compile; the 32-token tiles take ~242, two programs an
    SM), with `contiguous` tiles: a tile none of whose tokens' taps reaches before its row's start (nor before token
    0) reads each tap as one window of rows, no gather and no history; the others gather as before. At the 8k layers
    on an H100 (`benchmarks.prefill_fusions`, benchmarks/RESULTS.md, "Session 43"): Qwen3-Next's q | k | v 0.151 ms
    (32 x 128 gathered, the old default: 0.188; XLA 0.216), NemotronH's x | B | C 0.143 (0.156; 32 x 128 windows at
    4 warps 0.132; XLA 0.149). (64 x 128 at 4 warps spills ~5.5 KB a thread, "Session 41".)"""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown conv activation {activation!r}; choose one of {ACTIVATIONS}")
    num_tokens, (num_channels, width) = x.shape[0], weight.shape
    bounds = split_bounds(num_channels, splits)
    block_t = block_t or token_block(num_tokens)
    block_c = block_c or channel_block(num_channels, bounds)
    if (not supported(x, weight, splits) or num_tokens % block_t or any(b % block_c for b in bounds)
            or x.shape[1] < offset + num_channels):
        raise ValueError(f"conv_prefill_pallas: x {x.shape}, weight {weight.shape}, {offset=}, {splits=} do not tile "
                         f"with {block_t=}, {block_c=}")
    if scale is not None:
        check_scale(scale, num_tokens, bounds, scale_group)
    h0t = conv_history(conv_state, slot_ids)  # [B, W-1, C]
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_seqlens[token_seq].astype(jnp.int32)
    dtype = jnp.result_type(x.dtype, bias.dtype) if bias is not None else x.dtype
    dtype = dtype if out_dtype is None else out_dtype
    kernel = functools.partial(_kernel, width=width, block_t=block_t, block_c=block_c, offset=offset,
                               has_bias=bias is not None, activation=activation, bounds=bounds,
                               contiguous=contiguous, scale_group=scale_group if scale is not None else 0)
    shapes = [jax.ShapeDtypeStruct((num_tokens, hi - lo), dtype) for lo, hi in zip(bounds[:-1], bounds[1:])]
    shapes += [jax.ShapeDtypeStruct((num_tokens, bounds[1]), dtype)] if scale is not None else []
    extra = (() if bias is None else (bias,)) + (() if scale is None else (scale,))
    outs = pl.pallas_call(
        kernel, grid=(num_tokens // block_t, num_channels // block_c),
        in_specs=[_WHOLE] * (5 + len(extra)), out_specs=[_WHOLE] * len(shapes), out_shape=shapes,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name=f"conv_prefill_bt{block_t}_bc{block_c}_w{num_warps}" + ("_cw" if contiguous else "")
        + (f"_{activation}" if activation else "") + ("_scaled" if scale is not None else ""),
    )(token_seq.astype(jnp.int32), local, x, weight, h0t, *extra)
    return tuple(outs), conv_new_state(x, h0t, conv_state, cu_seqlens, slot_ids, offset)
