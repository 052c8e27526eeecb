"""The in-place prefix kernel of the split prefill (`pallas_kernels/paged_attention/prefix.py`, interpret mode)
against the paged reference, its lowering for the H200, and which prefix kernel the dispatch picks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention.prefix import paged_prefix_merge_pallas, query_tiles
from pallas_kernels.paged_attention.self_attention import packed_causal_attention
from tests.test_kernels_pallas import _paged_inputs, assert_close, lower_for_h200
from tests.test_paged_prefill_pallas import _with_padding
from tests.test_prefill_split import _new_kv

CASES = [
    # cached lengths after the step, new tokens per row (0: an empty row), H, KVH, D, BS
    ([37, 63, 71, 5], [37, 23, 1, 0], 8, 2, 32, 8),  # fresh prompt, chunk after a prefix, decode row, empty row
    ([300, 7, 129], [45, 7, 100], 16, 2, 256, 16),  # long prefixes over many pages, GQA 8, D 256
    ([50, 30, 90], [2, 30, 1], 6, 2, 64, 8),  # GQA 3: each token's 3 heads padded to 4 rows
    ([16, 9], [16, 9], 4, 4, 16, 16),  # fresh rows only: every tile exits at once
]


def _self_part(args, cu, d):
    """The self part as the split computes it (jnp), with NaN in its padding tokens (cuDNN leaves them unwritten)."""
    real = int(cu[-1])
    k, v = _new_kv(args, args[4], args[5], real)
    o, lse = packed_causal_attention(args[0], k, v, cu, scale=d**-0.5, impl="reference")
    return o.at[real:].set(jnp.nan), lse.at[real:].set(jnp.nan)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths,new,h,kvh,d,bs", CASES)
def test_prefix_merge_matches_reference(lengths, new, h, kvh, d, bs, dtype):
    rng = np.random.default_rng(sum(lengths) + d)
    args, cu = _with_padding(_paged_inputs(rng, lengths, new, h, kvh, d, bs, dtype), lengths, new)
    real = int(cu[-1])
    want_o, want_lse = jax.jit(paged_attention_reference, static_argnames=("return_lse",))(*args, return_lse=True)
    o_self, lse_self = _self_part(args, cu, d)
    got_o, got_lse = paged_prefix_merge_pallas(*args[:4], cu, args[5], o_self, lse_self, interpret=True,
                                               block_q=4, pages_per_block=2)
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    # checked to fail when the kernel starts its softmax from zeros instead of the self part's output
    assert_close("merged output", got_o[:real], want_o[:real], rtol)
    assert_close("merged lse", got_lse[:real], want_lse[:real], rtol)
    # checked to fail without the padding programs (the self part's NaN stays)
    assert np.all(np.asarray(got_o[real:], np.float32) == 0), "padding tokens must produce zeros"
    assert np.all(np.isneginf(np.asarray(got_lse[real:]))), "padding tokens' lse must be -inf"
    assert got_o.dtype == o_self.dtype and got_lse.dtype == jnp.float32


def test_rows_without_a_prefix_keep_the_self_part_exactly():
    rng = np.random.default_rng(3)
    lengths, new = [40, 12, 30], [40, 3, 30]  # fresh, 9 cached + 3 new, fresh
    args, cu = _with_padding(_paged_inputs(rng, lengths, new, 8, 2, 32, 8, jnp.float32), lengths, new)
    o_self = jnp.asarray(rng.normal(size=args[0].shape), jnp.float32)  # any values: fresh rows' are final
    lse_self = jnp.asarray(rng.normal(size=args[0].shape[:2]), jnp.float32)
    got_o, got_lse = paged_prefix_merge_pallas(*args[:4], cu, args[5], o_self, lse_self, interpret=True, block_q=4)
    fresh = np.r_[0:40, 43:73]
    np.testing.assert_array_equal(np.asarray(got_o)[fresh], np.asarray(o_self)[fresh])
    np.testing.assert_array_equal(np.asarray(got_lse)[fresh], np.asarray(lse_self)[fresh])
    assert not np.allclose(np.asarray(got_o)[40:43], np.asarray(o_self)[40:43])  # the row with a prefix moved


def test_query_tiles_cover_every_row_one_token_rows_too():
    cu = jnp.asarray([0, 5, 6, 6, 15], jnp.int32)  # rows of 5, 1, 0 and 9 tokens; tiles of 4
    row, start, length = (np.asarray(x) for x in query_tiles(cu, 17, 4))
    used = length > 0
    assert row[used].tolist() == [0, 0, 1, 3, 3, 3]
    assert start[used].tolist() == [0, 4, 5, 6, 10, 14] and length[used].tolist() == [4, 1, 1, 4, 4, 1]
    assert len(row) == -(-17 // 4) + 4 and np.all(start[~used] == 0)


def _lower_split_step(num_tokens: int, kernel: str) -> None:
    """A bf16 split prefill step of `num_tokens` (a fresh row, and 8 tokens after 192 cached) lowered for the
    H200 with the self part in jnp: its one Triton kernel must match `kernel`."""
    rng = np.random.default_rng(5)
    lengths, new = [num_tokens - 8, 200], [num_tokens - 8, 8]
    args, cu = _with_padding(_paged_inputs(rng, lengths, new, 16, 2, 128, 16, jnp.bfloat16), lengths, new)
    new_kv = _new_kv(args, args[4], args[5], int(cu[-1]))
    fn = lambda *a: paged_attention(*a, cu_seqlens=cu, impl="pallas", return_lse=True,  # noqa: E731
                                    new_kv=new_kv, self_impl="reference")
    lower_for_h200(fn, *args, kernels=[kernel])


def test_dispatch_merges_in_place_unless_the_step_wants_kv_splits():
    # 2,048 tokens in tiles of 16 (128 query rows over 8 heads): 130 tiles x 2 kv heads >= 256 programs, no KV
    # splits: the in-place kernel. 64 tokens: 7 tiles, whose keys the unmerged kernel splits
    _lower_split_step(2048, r"paged_prefix_merge_\w+")
    _lower_split_step(64, r"paged_prefill_\w+_ns\d+")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefix_merge_lowers_for_h200(d):
    rng = np.random.default_rng(2)
    lengths, new = [60, 17], [30, 17]
    args, cu = _with_padding(_paged_inputs(rng, lengths, new, 16, 2, d, 16, jnp.bfloat16), lengths, new)
    o_self, lse_self = jnp.zeros(args[0].shape, jnp.bfloat16), jnp.zeros(args[0].shape[:2], jnp.float32)
    fn = lambda *a: paged_prefix_merge_pallas(*a[:4], cu, a[5], *a[6:])  # noqa: E731
    lower_for_h200(fn, *args, o_self, lse_self, kernels=[r"paged_prefix_merge_bq\d+_gp8_np\d+_w\d+_s\d+"])
    lower_for_h200(fn, args[0].astype(jnp.float32), *args[1:], o_self.astype(jnp.float32), lse_self,
                   kernels=[r"paged_prefix_merge_bq\d+_gp8_np\d+_w\d+_s\d+"])  # fp32 q (the self part's dtype)
