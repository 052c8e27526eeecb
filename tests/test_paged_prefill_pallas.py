"""The ragged prefill paged-attention Pallas kernel (interpret mode) against the reference, and its
lowering for the H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, paged_attention_prefill_pallas, paged_attention_reference
from tests.test_kernels_pallas import _paged_inputs, assert_close, lower_for_h200

PREFILL_CASES = [
    # cached lengths after the step, new tokens per row, H, KVH, D, BS
    ([1], [1], 4, 4, 64, 16),  # one token
    ([16, 33], [16, 5], 8, 2, 128, 16),  # exactly one block; a chunk continuing a cached prefix
    ([300, 7, 129], [45, 7, 100], 16, 2, 256, 16),  # many blocks with ragged tails, GQA 8
    ([40, 5, 77], [40, 5, 3], 6, 2, 64, 8),  # GQA 3, group padded to 4
]


def _with_padding(args, lengths, new, pad=3):
    q, kp, vp, tables, token_seq, positions = args
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    q = jnp.concatenate([q, jnp.full((pad, *q.shape[1:]), jnp.nan, q.dtype)])  # padding queries: NaN
    token_seq = jnp.concatenate([token_seq, jnp.full((pad,), len(lengths) - 1, jnp.int32)])
    positions = jnp.concatenate([positions, jnp.zeros((pad,), jnp.int32)])
    return (q, kp, vp, tables, token_seq, positions), cu


@pytest.mark.parametrize("variant,lengths,new,h,kvh,d,bs", [  # fast tier: every variant on the GQA-8 case
    pytest.param(variant, *case, marks=() if i == 2 else pytest.mark.slow, id=f"{variant}-case{i}")
    for variant in ["plain", "window", "softcap", "gathered", "one_split"] for i, case in enumerate(PREFILL_CASES)])
def test_paged_prefill_pallas_matches_reference(lengths, new, h, kvh, d, bs, variant):
    rng = np.random.default_rng(sum(lengths) + d + len(variant))
    args, cu = _with_padding(_paged_inputs(rng, lengths, new, h, kvh, d, bs, jnp.float32), lengths, new)
    kw = dict(sliding_window=21 if variant == "window" else None, soft_cap=2.0 if variant == "softcap" else None)
    real = int(cu[-1])
    want_o, want_lse = jax.jit(paged_attention_reference, static_argnames=("scale", "sliding_window", "soft_cap", "return_lse"))(*args, return_lse=True, **kw)
    # these few tiles get the kernel's default KV splits (up to 8 programs share a tile's keys); "one_split": none
    split = dict(num_splits=1) if variant == "one_split" else {}
    got_o, got_lse = paged_attention_prefill_pallas(*args[:4], cu, args[5], interpret=True, return_lse=True,
                                                    block_q=4, pages_per_block=2, per_page=variant != "gathered",
                                                    **split, **kw)  # gathered: one [NP*BS, D] key tile
    assert_close("prefill attention output", got_o[:real], want_o[:real], 1e-5)
    assert_close("prefill attention lse", got_lse[:real], want_lse[:real], 1e-5)
    assert np.all(np.asarray(got_o)[real:] == 0), "padding tokens must produce zeros"


@pytest.mark.parametrize("h,kvh,d", [(16, 2, 256), (8, 8, 64), (32, 4, 128)])
def test_paged_prefill_lowers_for_h200(h, kvh, d):
    rng = np.random.default_rng(2)
    args, cu = _with_padding(_paged_inputs(rng, [40, 17], [30, 17], h, kvh, d, 16, jnp.bfloat16), [40, 17], [30, 17])
    fn = lambda *a: paged_attention(*a, cu_seqlens=cu, decode=False, impl="pallas", return_lse=True,  # noqa: E731
                                    sliding_window=64)
    kernel = r"paged_prefill_bq\d+_gp\d+_{}\d+_w\d+_s\d+(_ns\d+)?"  # {}: "pp" per page, "np" gathered; KV splits
    lower_for_h200(fn, *args, kernels=[kernel.format("np")])
    lower_for_h200(fn, args[0].astype(jnp.float32), *args[1:], kernels=[kernel.format("np")])  # fp32 q, bf16 pages
    for per_page in (True, False):  # no window (the models' case) and gathered page tiles
        plain = lambda *a: paged_attention(*a, cu_seqlens=cu, decode=False, impl="pallas",  # noqa: E731
                                           per_page=per_page, pages_per_block=4)
        lower_for_h200(plain, *args, kernels=[kernel.format("pp" if per_page else "np")])


def test_token_and_tile_layouts_lower_without_a_loop():
    """The layouts a prefill step computes in every layer (each token's row, the query tiles of the paged kernel
    and of the chunked recurrences) are comparisons in one fusion, not `searchsorted`'s default `scan`: an XLA
    while loop, whose every trip the GPU runtime starts from the host after reading its predicate back. (Checked
    to fail: with the default method in `gated_delta_rule.reference` both lowerings hold a `stablehlo.while`.)"""
    from pallas_kernels.gated_delta_rule.reference import _token_rows, chunk_layout

    cu = jnp.asarray([0, 5, 9, 30], jnp.int32)
    for fn in (lambda c: chunk_layout(c, 40, 8), lambda c: _token_rows(c, 40)):
        text = jax.jit(fn).lower(cu).as_text()
        assert "stablehlo.while" not in text, text[:2000]
    lay = chunk_layout(cu, 40, 8)  # and the same layout: rows of 5, 4 and 21 tokens in chunks of 8
    np.testing.assert_array_equal(np.asarray(lay.chunk_row)[:5], [0, 1, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(lay.token_chunk)[[0, 4, 5, 9, 17, 29, 30]], [0, 0, 1, 2, 3, 4, 8])
