"""The prefill step's short conv (`pallas_kernels.conv_update.conv_prefill`): the jnp reference against an fp64 loop
over tokens, the Pallas kernel (interpreted) against the reference, its lowering for the H200, and the model's
prefill through it."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import conv_update
from pallas_kernels.conv_update import conv_prefill, conv_prefill_reference
from pallas_kernels.conv_update.prefill import conv_prefill_pallas, supported
from tests.test_kernels_pallas import lower_for_h200

# a step's rows: a prompt longer than the window, one-token rows (decodes), a row shorter than the window's history,
# a row on the null slot 0, then padding tokens up to 32 (assigned to the last row, as the engine pads)
LENGTHS, SLOTS, NUM_TOKENS = [9, 1, 2, 1, 7, 5], [3, 0, 5, 1, 7, 2], 32


def _rows():
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    token_seq = np.full(NUM_TOKENS, len(LENGTHS) - 1, np.int32)
    for b in range(len(LENGTHS)):
        token_seq[cu[b]:cu[b + 1]] = b
    return cu, np.asarray(SLOTS, np.int32), token_seq


def _inputs(dtype, width=4, channels=64, extra=48, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(NUM_TOKENS, channels + extra)), dtype)
    state = jnp.asarray(rng.normal(size=(8, channels, width - 1)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(channels, width)) * 0.5, dtype)
    bias = jnp.asarray(rng.normal(size=(channels,)), dtype)
    return x, state, weight, bias


def _fp64_loop(x, state, weight, cu, slots, *, offset, bias, silu):
    """Ground truth, token by token: each row's window is its slot's history (zeros on slot 0) then its tokens."""
    x, state, weight = (np.asarray(a, np.float64) for a in (x, state, weight))
    channels, width = weight.shape
    out = np.zeros((cu[-1], channels))
    new_state = state.copy()
    for b, slot in enumerate(slots):
        hist = np.zeros((width - 1, channels)) if slot == 0 else state[slot].T  # [W-1, C], oldest first
        seq = np.concatenate([hist, x[cu[b]:cu[b + 1], offset:offset + channels]])
        for j in range(cu[b + 1] - cu[b]):
            out[cu[b] + j] = sum(seq[j + i] * weight[:, i] for i in range(width))
        new_state[slot] = seq[-(width - 1):].T
    if bias is not None:
        out = out + np.asarray(bias, np.float64)
    if silu:
        out = out / (1 + np.exp(-out))
    return out, new_state


def _scale(group: int, first: int, seed: int = 3):
    """A `[T, first / group]` fp32 scale (a Mamba2 mixer's dt per head), positive."""
    return jnp.asarray(np.random.default_rng(seed).uniform(0.01, 2.0, (NUM_TOKENS, first // group)), jnp.float32)


@pytest.mark.parametrize("offset,with_bias,silu,splits,scaled", [
    (0, False, False, None, False), (16, True, False, None, False), (48, False, True, (16, 16, 32), False),
    (16, True, True, (32, 16, 16), True)])  # NemotronH's x | B | C with v = x dt
def test_conv_prefill_reference_matches_an_fp64_loop(offset, with_bias, silu, splits, scaled):
    """The reference (fp32 inputs) equals a per-token fp64 loop over each row's window: outputs of the real tokens
    and every row's new state (the null slot's included: the engine never reads it back); with a `scale`, one more
    output, the first split times its channels' scale (groups of 16 channels). Checked to fail with the taps' order
    reversed, with the state's history read newest first, and with the scale's columns repeated in the wrong order
    (`jnp.tile`)."""
    x, state, weight, bias = _inputs(jnp.float32)
    cu, slots, token_seq = _rows()
    scale = _scale(16, splits[0]) if scaled else None
    outs, new_state = conv_prefill_reference(x, state, weight, jnp.asarray(cu), jnp.asarray(slots),
                                             jnp.asarray(token_seq), offset=offset, bias=bias if with_bias else None,
                                             activation="silu" if silu else None, splits=splits, scale=scale,
                                             scale_group=16)
    want, want_state = _fp64_loop(x, state, weight, cu, slots, offset=offset, bias=bias if with_bias else None,
                                  silu=silu)
    if scaled:
        first = want[:, :splits[0]] * np.repeat(np.asarray(scale, np.float64), 16, axis=1)[: cu[-1]]
        np.testing.assert_allclose(np.asarray(outs[-1], np.float64)[: cu[-1]], first, rtol=1e-5, atol=1e-5)
        outs = outs[:-1]
    got = np.concatenate([np.asarray(o, np.float64) for o in outs], axis=1)[: cu[-1]]
    assert [o.shape[1] for o in outs] == list(splits or (64,))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    live = [s for s in SLOTS if s]
    np.testing.assert_allclose(np.asarray(new_state)[live], want_state[live], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("offset,with_bias,silu,splits,tiles", [
    (0, False, False, None, {}),
    # every tile gathered (`contiguous=False`): programs that cut rows apart, several channel blocks
    (16, True, False, None, dict(block_t=4, block_c=16, contiguous=False)),
    (48, False, True, (16, 16, 32), dict(block_t=8, block_c=16, contiguous=False)),  # Gated DeltaNet's q | k | v
    # window tiles beside gathered ones (the default): 32 tokens in 4-token tiles, rows of 9, 1, 2, 1, 7, 5 and padding
    (16, True, False, None, dict(block_t=4, block_c=16)),
    (48, False, True, (16, 16, 32), dict(block_t=4, block_c=16)),
    # NemotronH's x | B | C with `v = x dt` (`scale`, one column per 8 channels: two a block), gathered and window tiles
    (16, True, True, (32, 16, 16), dict(block_t=8, block_c=16, contiguous=False, scale=8)),
    (16, True, True, (32, 16, 16), dict(block_t=4, block_c=16, scale=8)),
])
def test_conv_prefill_kernel_matches_reference(dtype, offset, with_bias, silu, splits, tiles):
    """The kernel, interpreted, gives the reference's outputs (every token, padding included; to fp32 rounding: the
    SiLU's sigmoid may fuse differently) and its state bit for bit. Checked to fail with the taps reading one token too
    far back (`t - d - 1`), with each split's channels stored at the first split's columns, and with the history
    read for every token (the in-row taps taken from the state); the window tiles, with their windows one row too far
    back, with a tile that holds a row's first tokens taken as a window tile, and with window tiles storing zeros;
    the scaled output, with each channel block scaled by its first channel's scale (`start // scale_group`)."""
    x, state, weight, bias = _inputs(dtype)
    cu, slots, token_seq = (jnp.asarray(a) for a in _rows())
    tiles = dict(tiles)
    group = tiles.pop("scale", 0)
    form = dict(offset=offset, bias=bias if with_bias else None, activation="silu" if silu else None,
                splits=splits, out_dtype=jnp.float32 if silu and not group else None)
    if group:  # the model's form: bf16 (or fp32) outputs, v rounded once
        form.update(scale=_scale(group, splits[0]), scale_group=group)
    want, want_state = conv_prefill_reference(x, state, weight, cu, slots, token_seq, **form)
    got, got_state = conv_prefill_pallas(x, state, weight, cu, slots, token_seq, **form, **tiles, interpret=True)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        tol = 1e-2 if group and dtype == jnp.bfloat16 else 1e-6  # bf16 after the SiLU: one rounding may differ
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got_state), np.asarray(want_state))


def test_conv_prefill_refuses_what_it_cannot_run():
    """Splits that do not sum to the channels, a split no 16-channel block divides, and impl="pallas" on such a
    shape are refused with the reason; "auto" falls back to the reference. (Checked to fail with the splits'
    alignment left out of `supported`.)"""
    x, state, weight, _ = _inputs(jnp.float32)
    cu, slots, token_seq = (jnp.asarray(a) for a in _rows())
    with pytest.raises(ValueError, match="sum to the 64 channels"):
        conv_prefill_reference(x, state, weight, cu, slots, token_seq, splits=(16, 16))
    assert supported(x, weight, (16, 48)) and not supported(x, weight, (8, 56))
    with pytest.raises(ValueError, match="multiple of 16"):
        conv_prefill(x, state, weight, cu, slots, token_seq, splits=(8, 56), impl="pallas")
    with pytest.raises(ValueError, match="unknown conv activation"):
        conv_prefill(x, state, weight, cu, slots, token_seq, activation="gelu", impl="reference")
    outs, _ = conv_prefill(x, state, weight, cu, slots, token_seq, splits=(8, 56))  # CPU "auto": the reference
    assert [o.shape[1] for o in outs] == [8, 56]


def test_conv_prefill_lowers_for_h200():
    """The kernel lowers to Triton for the H200 at Qwen3-Next's and NemotronH's layers (one 8k prompt): q | k | v
    with SiLU from the in_proj output, and x | B | C with the bias at its offset."""
    sd, t = jax.ShapeDtypeStruct, 8192
    rows = (sd((2,), jnp.int32), sd((1,), jnp.int32), sd((t,), jnp.int32))
    qwen = (sd((t, 12352), jnp.bfloat16), sd((4, 8192, 3), jnp.float32), sd((8192, 4), jnp.bfloat16), *rows)
    lower_for_h200(lambda *a: conv_prefill_pallas(*a, activation="silu", out_dtype=jnp.bfloat16,
                                                  splits=(2048, 2048, 4096)), *qwen,
                   kernels=[r"conv_prefill_bt16_bc128_w4_cw_silu"])
    nemotron = (sd((t, 10304), jnp.bfloat16), sd((4, 6144, 3), jnp.float32), sd((6144, 4), jnp.bfloat16), *rows,
                sd((6144,), jnp.bfloat16))
    lower_for_h200(lambda *a: conv_prefill_pallas(*a[:6], bias=a[6], offset=4096), *nemotron,
                   kernels=[r"conv_prefill_bt16_bc128_w4_cw"])
    lower_for_h200(lambda *a: conv_prefill_pallas(*a[:6], bias=a[6], offset=4096, contiguous=False), *nemotron,
                   kernels=[r"conv_prefill_bt16_bc128_w4"])
    # x | B | C after SiLU, in three arrays, and v = x dt (64 heads of 64 channels)
    lower_for_h200(lambda *a: conv_prefill_pallas(*a[:6], bias=a[6], offset=4096, activation="silu",
                                                  splits=(4096, 1024, 1024), scale=a[7], scale_group=64),
                   *nemotron, sd((t, 64), jnp.float32), kernels=[r"conv_prefill_bt16_bc128_w4_cw_silu_scaled"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_model_prefill_through_the_conv_kernel_equals_reference_path(family):
    """A model's prefill (two chunks, the second continuing from the conv state the first left) and decode steps
    with every kernel on, interpreted, the conv as this kernel (Gated DeltaNet: q, k, v with SiLU out of the
    in_proj output; Mamba2: x | B | C with the conv bias), against the reference path: logits of every step, fp32.
    The kernel's dispatch is traced, so the test knows it ran. Checked to fail with the kernel's bias left out
    (NemotronH) and with q and k swapped in the Gated DeltaNet layer's splits."""
    from tests.test_model_pallas_path import traced_kernel_error

    err, calls = traced_kernel_error(family, conv_update, "conv_prefill_pallas")
    assert calls, "no prefill step ran the conv prefill kernel"
    assert err <= 1e-5, f"{family}: logits differ from the reference path's, relative error {err:.2e}"
