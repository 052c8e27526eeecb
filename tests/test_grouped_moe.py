"""Routed experts grouped by expert (issue 20's grouped MoE; issue 22's FP8 experts): `expert_tiles` (the sorted
layout), the Pallas grouped matmul (interpreted) against its jnp reference, the grouped MoE layer against the dense
one (every expert on every token), the model wired to it, and lowering for the H200.

The dense path is the ground truth: it weights every expert's output by the router's combine weights, so it shares
no sorting, tiling or gathering with the grouped path.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.models import layers
from jhybrid.models.quant import Fp8Weight, quantize_weight_tree
from pallas_kernels.grouped_matmul import (
    default_block_m,
    expert_tiles,
    grouped_matmul,
    grouped_matmul_pallas,
    grouped_matmul_reference,
    num_tiles,
)
from tests.test_kernels_pallas import assert_close, lower_for_h200

gm = importlib.import_module("pallas_kernels.grouped_matmul")


@pytest.mark.parametrize("by_comparison", [True, False])
@pytest.mark.parametrize("num_pairs,num_experts,block_m", [(1, 4, 16), (24, 6, 16), (40, 3, 16), (300, 64, 16),
                                                            (64, 8, 32)])
def test_expert_tiles_lay_out_every_pair_in_a_tile_of_its_expert(num_pairs, num_experts, block_m, by_comparison,
                                                                 monkeypatch):
    """Every pair lands in its own row, inside a tile of its expert, in its order among its expert's pairs; `row_pair`
    inverts `pair_row`; tiles after the last run are unused (-1); pairs of experts outside `[0, E)` are dropped; the
    static tile count covers the worst case (every expert with a partly filled tile). Both ways of ranking a pair
    among its expert's (pairwise comparison, the small steps' way, and a stable sort). Checked to fail with the
    pairs of each expert taken in reverse order, with `num_tiles` leaving out the partial tiles, and with the
    compared rank counting the pair itself."""
    monkeypatch.setattr(gm, "RANK_BY_COMPARISON_MAX", 1 << 30 if by_comparison else -1)
    rng = np.random.default_rng(num_pairs)
    ids = rng.integers(-1, num_experts + 1, num_pairs)  # some outside [0, E): dropped
    pair_row, row_pair, tile_expert = (np.asarray(a) for a in expert_tiles(jnp.asarray(ids), num_experts, block_m))
    m = num_tiles(num_pairs, num_experts, block_m) * block_m
    assert row_pair.shape == (m,) and tile_expert.shape == (m // block_m,)
    valid = (ids >= 0) & (ids < num_experts)
    assert (pair_row[~valid] == m).all()
    rows = pair_row[valid]
    assert len(set(rows.tolist())) == rows.size and (rows < m).all()
    assert (tile_expert[rows // block_m] == ids[valid]).all()
    assert (row_pair[rows] == np.flatnonzero(valid)).all()
    assert (np.delete(row_pair, rows) == num_pairs).all()  # every other row is padding
    for e in range(num_experts):  # stable: an expert's pairs keep their order, in the first rows of its run
        rows_e = pair_row[ids == e]
        assert (np.diff(rows_e) == 1).all() and (rows_e.size == 0 or rows_e[0] % block_m == 0)
    used = tile_expert >= 0
    assert used.sum() == sum(-(-np.sum(ids == e) // block_m) for e in range(num_experts))
    assert not used[used.argmin():].any() if not used.all() else True  # unused tiles only at the end
    # the worst case: the pairs spread over min(E, P) experts, each with a partly filled last tile
    worst = np.arange(num_pairs) % min(num_experts, num_pairs)
    worst_rows, _, worst_tiles = expert_tiles(jnp.asarray(worst), num_experts, block_m)
    assert (np.asarray(worst_rows) < np.asarray(worst_tiles).size * block_m).all()


def _case(rng, num_tiles_used, num_unused, e, k, n, block_m, dtype, fp8):
    tiles = np.concatenate([rng.integers(0, e, num_tiles_used), -np.ones(num_unused, int)])
    x = jnp.asarray(rng.standard_normal((tiles.size * block_m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), jnp.float32)
    if fp8:
        q = quantize_weight_tree(w)
        return x, q.w, q.scale, jnp.asarray(tiles, jnp.int32)
    return x, w.astype(dtype), None, jnp.asarray(tiles, jnp.int32)


@pytest.mark.parametrize("block", [(32, 64, 1), (16, 128, 1), (16, 32, 4), (32, 64, 2)],
                         ids=["bn32", "bn16", "bn16_sk4", "bn32_sk2"])  # bn16: `NARROW_DECODE_TILES`'s
@pytest.mark.parametrize("epilogue", ["none", "silu_gate", "relu2"])
@pytest.mark.parametrize("dtype,fp8,tol", [("float32", False, 1e-5), ("bfloat16", False, 1e-2), ("bfloat16", True, 1e-2),
                                           ("float32", True, 1e-5)])
def test_grouped_matmul_kernel_equals_reference(epilogue, dtype, fp8, tol, block):
    """The Pallas kernel (interpreted), each tile through its expert with the epilogue and row scales fused, equals the
    jnp reference on the used tiles, for plain and FP8 (W8A16) stacks, at 32 and 16 columns a program, and with K
    split 2 and 4 ways (`split_k`: partial sums, then the epilogue after the kernel). Checked to fail with the kernel
    reading expert 0 for every tile, with its up-projection offset set to 0 ("silu_gate"), and with every split
    program reading K's first part."""
    rng = np.random.default_rng(7)
    block_m, e, k, n = 16, 5, 256, 128
    x, w, scale, tiles = _case(rng, 4, 2, e, k, n, block_m, dtype, fp8)
    row_scale = jnp.asarray(rng.uniform(0, 1, x.shape[0]), jnp.float32)
    kw = dict(n=n, block_m=block_m, scale=scale, row_scale=row_scale, epilogue=epilogue)
    want = grouped_matmul_reference(x, w, tiles, **kw)
    got = grouped_matmul_pallas(x, w, tiles, interpret=True, block_n=block[0], block_k=block[1], split_k=block[2],
                                **kw)
    used = np.repeat(np.asarray(tiles) >= 0, block_m)
    assert_close(f"{epilogue} {dtype} fp8={fp8}", np.asarray(got, np.float32)[used], np.asarray(want, np.float32)[used],
                 tol)


def test_grouped_matmul_refuses_tiles_that_do_not_divide():
    x = jnp.zeros((32, 96), jnp.float32)
    with pytest.raises(ValueError, match="block_k=64 K=96"):
        grouped_matmul_pallas(x, jnp.zeros((2, 96, 64)), jnp.zeros(2, jnp.int32), n=64, block_m=16, block_k=64,
                              interpret=True)
    with pytest.raises(ValueError, match="split_k=3 must divide K's 2 blocks"):
        grouped_matmul_pallas(jnp.zeros((32, 128)), jnp.zeros((2, 128, 64)), jnp.zeros(2, jnp.int32), n=64,
                              block_m=16, block_k=64, split_k=3, interpret=True)
    with pytest.raises(ValueError, match="not 3 tiles"):
        grouped_matmul_pallas(x, jnp.zeros((2, 96, 64)), jnp.zeros(3, jnp.int32), n=64, block_m=16, interpret=True)


def _experts(rng, e, d, ie, act, fp8):
    n_in = ie if act == "relu2" else 2 * ie
    w_in = jnp.asarray(rng.standard_normal((e, d, n_in)) / np.sqrt(d), jnp.float32)
    w_down = jnp.asarray(rng.standard_normal((e, ie, d)) / np.sqrt(ie), jnp.float32)
    if fp8:
        return quantize_weight_tree(w_in), quantize_weight_tree(w_down)
    return w_in, w_down


@pytest.mark.parametrize("act", ["silu", "relu2"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_grouped_layer_equals_dense_layer(act, fp8, num_tokens):
    """`routed_experts_grouped` (the Pallas kernel, interpreted) equals `routed_experts_dense` (every expert on every
    token, weighted by the combine matrix) for 1 to 40 tokens, top-3 of 6 experts, SwiGLU and relu^2 experts, plain and
    FP8 stacks, fp32. Checked to fail with the down projection's row scales left out, and with each token's k rows
    read from the wrong pairs (`pair_row` unsorted)."""
    rng = np.random.default_rng(num_tokens)
    e, k, d, ie = 6, 3, 128, 128
    w_in, w_down = _experts(rng, e, d, ie, act, fp8)
    x = jnp.asarray(rng.standard_normal((num_tokens, d)), jnp.float32)
    top_i = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(num_tokens)]), jnp.int32)
    top_p = jnp.asarray(rng.uniform(0.1, 1, (num_tokens, k)), jnp.float32)
    want = layers.routed_experts_dense(x, top_i, top_p, w_in, w_down, act)
    got = layers.routed_experts_grouped(x, top_i, top_p, w_in, w_down, act, impl="pallas", interpret=True)
    assert_close(f"{act} fp8={fp8} T={num_tokens}", got, want, 1e-5)


@pytest.mark.parametrize("act", ["silu", "relu2"])
@pytest.mark.parametrize("fp8", [False, True])
def test_batch1_top2_layer_splits_k_and_equals_dense(act, fp8, monkeypatch):
    """A batch-1 token at top-2 (2 tiles, within `NARROW_DECODE_TILES`) runs its gate/up projection with K split over
    programs by default (K 512 in blocks of 128: 4 parts) and still equals the dense layer, SwiGLU and relu^2, plain
    and FP8. Checked to fail with `SPLIT_DECODE_TUNING` unsplit and with the partial sums' epilogue skipped."""
    seen = []
    kernel = gm.grouped_matmul_pallas
    monkeypatch.setattr(gm, "grouped_matmul_pallas", lambda *a, **kw: seen.append(kw.get("split_k", 1)) or
                        kernel(*a, **kw))
    rng = np.random.default_rng(5)
    e, k, d, ie = 4, 2, 512, 128
    w_in, w_down = _experts(rng, e, d, ie, act, fp8)
    x = jnp.asarray(rng.standard_normal((1, d)), jnp.float32)
    top_i, top_p = jnp.asarray([[3, 1]], jnp.int32), jnp.asarray([[0.7, 0.3]], jnp.float32)
    want = layers.routed_experts_dense(x, top_i, top_p, w_in, w_down, act)
    got = layers.routed_experts_grouped(x, top_i, top_p, w_in, w_down, act, impl="pallas", interpret=True)
    assert_close(f"{act} fp8={fp8}", got, want, 1e-5)
    assert seen[0] == 4, seen  # the gate/up call: K's 4 blocks in 4 parts


def test_padding_tokens_route_to_no_expert(monkeypatch):
    """A decode bucket of 4 rows with one real token (`num_real=1`): the grouped path's tiles hold only the real
    token's experts, so the padding rows' experts' weights are never read; the real token's output equals the layer
    without padding. Checked to fail with the padding rows routed as real ones."""
    rng = np.random.default_rng(5)
    e, k, d, ie, t = 8, 2, 64, 64, 4
    w_in, w_down = _experts(rng, e, d, ie, "silu", False)
    p = dict(gate_up_proj=w_in, down_proj=w_down, router=jnp.asarray(rng.standard_normal((d, e)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    seen = []
    real_gm = layers.grouped_matmul

    def spy(x_rows, w, tile_expert, **kw):
        seen.append(np.asarray(tile_expert))
        return real_gm(x_rows, w, tile_expert, **kw)

    monkeypatch.setattr(layers, "grouped_matmul", spy)
    monkeypatch.setattr(layers, "MOE_IMPL", "grouped")
    kernels = dict(impl="reference")
    out = layers.moe(p, x, k, True, kernels=dict(impl="pallas", interpret=True), num_real=jnp.int32(1))
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    real_experts = set(np.asarray(jax.lax.top_k(probs[0], k)[1]).tolist())
    all_experts = set(np.asarray(jax.lax.top_k(probs, k)[1]).ravel().tolist())
    assert all_experts != real_experts  # the padding rows would have read other experts
    for tiles in seen:
        assert set(tiles[tiles >= 0].tolist()) == real_experts, tiles
    alone = layers.moe(p, x[:1], k, True, kernels=dict(kernels))
    assert_close("the real token's output", out[:1], alone, 1e-5)


def test_grouped_layer_drops_other_devices_experts():
    """With its expert ids offset (as a device holding experts E/2.. sees them under expert splitting) the grouped
    path computes only the pairs of its own experts: the two halves' sums give the whole layer. Checked to fail with
    `expert_tiles` keeping the ids outside [0, E) (clipped into range instead)."""
    rng = np.random.default_rng(3)
    e, k, d, ie, t = 8, 2, 64, 64, 12
    w_in, w_down = _experts(rng, e, d, ie, "silu", False)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    top_i = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    top_p = jnp.asarray(rng.uniform(0.1, 1, (t, k)), jnp.float32)
    want = layers.routed_experts_dense(x, top_i, top_p, w_in, w_down, "silu")
    halves = [layers._grouped_pairs(x, top_i - lo, top_p, (w_in[lo:lo + e // 2], None, 2 * ie),
                                    (w_down[lo:lo + e // 2], None, d), "silu", "reference", False)
              for lo in (0, e // 2)]
    assert_close("two halves", halves[0] + halves[1], want, 1e-5)
    assert float(jnp.abs(halves[0]).max()) > 0 and float(jnp.abs(halves[1]).max()) > 0


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_per_pair_tiles_of_a_decode_step(impl, monkeypatch):
    """At most `PER_PAIR_TILES_MAX` pairs (a decode step) run one tile each: 3 tokens at top-2 whose first two share
    an expert (its weights read once per pair), with the other half of the experts' ids out of range (another
    device's, dropped: their tiles skipped and their rows masked, which the Pallas kernel leaves unwritten). The two
    halves equal the dense layer, and the sorted layout's `expert_tiles` is never called. Checked to fail with the
    dropped pairs' rows left unmasked (the interpreted kernel's unwritten rows) and with each pair's token taken
    as p // 2 of the wrong axis (`jnp.tile` for `jnp.repeat`)."""
    rng = np.random.default_rng(11)
    e, k, d, ie = 8, 2, 64, 64
    w_in, w_down = _experts(rng, e, d, ie, "silu", False)
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    top_i = jnp.asarray([[1, 6], [1, 2], [7, 4]], jnp.int32)
    top_p = jnp.asarray(rng.uniform(0.1, 1, (3, k)), jnp.float32)
    want = layers.routed_experts_dense(x, top_i, top_p, w_in, w_down, "silu")
    monkeypatch.setattr(layers, "expert_tiles", None)  # the sorted layout would call it
    halves = [layers._grouped_pairs(x, top_i - lo, top_p, (w_in[lo:lo + e // 2], None, 2 * ie),
                                    (w_down[lo:lo + e // 2], None, d), "silu", impl, impl == "pallas")
              for lo in (0, e // 2)]
    assert_close("two halves, one tile a pair", halves[0] + halves[1], want, 1e-5)


@pytest.mark.slow  # two model traces after clearing JAX's caches (~30 s); the layer-level cases are in the fast tier
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_model_with_grouped_experts_equals_dense(family, monkeypatch):
    """A MoE model's logits (a 13-token prompt in one chunk, then two decode steps) with the routed experts grouped
    (`MOE_IMPL="grouped"`; the grouped matmul's jnp reference on the CPU) equal those of the dense path, fp32: the
    layer is wired with its routing (softmax top-k; NemotronH's grouped sigmoid router with its scaling) and its
    shared expert. Checked to fail with `moe` passing the unnormalised routing weights to the grouped path."""
    from jhybrid.models.params import init_params
    from tests.runner_helpers import SequenceRunner
    from tests.tp_worker import family_config

    cfg = family_config(family)
    params = init_params(cfg, seed=2, scale=0.2)
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 13))

    def logits(impl):
        monkeypatch.setattr(layers, "MOE_IMPL", impl)
        jax.clear_caches()  # the switch is read at trace time
        runner = SequenceRunner(cfg, params, max_len=32)
        table, slot = runner.start()
        out = [np.asarray(runner.step(ids, 0, table, slot, all_logits=True), np.float64)]
        for pos in (13, 14):
            out.append(np.asarray(runner.step([int(np.argmax(out[-1][-1]))], pos, table, slot), np.float64)[None])
        return np.concatenate(out)

    want, got = logits("dense"), logits("grouped")
    assert_close(family, got, want, 1e-5)


@pytest.mark.parametrize("num_tokens,e,fp8", [(1, 64, False), (64, 64, False), (64, 512, False), (64, 512, True),
                                              (1, 64, True), (256, 64, False), (2048, 64, False), (2048, 64, True)])
def test_grouped_moe_layer_lowers_for_h200(num_tokens, e, fp8):
    """The grouped layer lowers for the H200 with each of its default tiles (`default_tuning`): decode (16-row tiles;
    few of them, or many with 512 experts), a batch (64-row tiles) and prefill (128-row tiles), plain bf16 and FP8:
    both Pallas calls compile to Triton IR."""
    k, d, ie = 8, 1024, 256
    w_in = jax.ShapeDtypeStruct((e, d, 2 * ie), jnp.bfloat16)
    w_down = jax.ShapeDtypeStruct((e, ie, d), jnp.bfloat16)
    args = [jax.ShapeDtypeStruct((num_tokens, d), jnp.bfloat16), jax.ShapeDtypeStruct((num_tokens, k), jnp.int32),
            jax.ShapeDtypeStruct((num_tokens, k), jnp.float32)]

    if fp8:
        def fn(x, top_i, top_p, q_in, s_in, q_down, s_down):
            return layers.routed_experts_grouped(x, top_i, top_p, Fp8Weight(q_in, s_in, 2 * ie), Fp8Weight(q_down, s_down, d),
                                                 "silu", impl="pallas")

        f8 = jnp.float8_e4m3fn
        args += [jax.ShapeDtypeStruct((e, 2 * ie, d), f8), jax.ShapeDtypeStruct((e, 2 * ie // 128, d // 128), jnp.float32),
                 jax.ShapeDtypeStruct((e, d, ie), f8), jax.ShapeDtypeStruct((e, d // 128, ie // 128), jnp.float32)]
    else:
        def fn(x, top_i, top_p, w_in, w_down):
            return layers.routed_experts_grouped(x, top_i, top_p, w_in, w_down, "silu", impl="pallas")

        args += [w_in, w_down]
    bm = default_block_m(num_tokens * k, e)
    suffix = "_fp8" if fp8 else ""
    lower_for_h200(fn, *args, kernels=[rf"grouped_matmul_silu_gate_bm{bm}_bn\d+_bk\d+{suffix}(_sk\d+)?",
                                       rf"grouped_matmul_none_bm{bm}_bn\d+_bk\d+{suffix}(_sk\d+)?"])


@pytest.mark.parametrize("top_k, narrow, tuning, gate_up, down", [
    (2, None, None, "bn32_bk128_sk8", "bn32_bk128_sk2"), (8, None, None, "bn32_bk128_sk8", "bn32_bk128_sk2"),
    (16, None, None, "bn64_bk64", "bn64_bk64"),
    (2, 8, None, "bn32_bk128_sk8", "bn32_bk128_sk2"), (2, 0, None, "bn64_bk64", "bn64_bk64"),
    (8, 0, None, "bn64_bk64", "bn64_bk64"),
    (8, 8, dict(block_n=32, block_k=256, num_warps=4, num_stages=3), "bn32_bk256", "bn32_bk256"),
    (2, 8, dict(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=4), "bn64_bk128_sk4", "bn64_bk128_sk2")])
def test_narrow_decode_tiles_lower_for_h200(monkeypatch, top_k, narrow, tuning, gate_up, down):
    """With `NARROW_DECODE_TILES` at 8 (the default), a batch-1 decode layer's per-pair tiles take `few_tile_tuning`'s
    tiles and lower for the H200: at top-2 and top-8 (2 and 8 tiles) 32 columns a program with K split 8 ways (the
    down projection's K of 256, two blocks of 128, split 2 ways: `grouped_matmul` shrinks `split_k`); at top-16 (16
    tiles, above the bound) and at 0 (off) the 64 columns and K blocks of 64 of `default_tuning`; with
    `NARROW_DECODE_TUNING` set, its tiles at any count. `narrow` None: the module's own setting, which must be on
    (checked to fail with JHYBRID_MOE_NARROW_TILES=0). Checked to fail with the switch ignored, with the tuning
    ignored, and with the bound taken as 16 tiles."""
    if narrow is not None:
        monkeypatch.setattr(gm, "NARROW_DECODE_TILES", narrow)
    if tuning is not None:
        monkeypatch.setattr(gm, "NARROW_DECODE_TUNING", tuning)
    e, d, ie = 64, 1024, 256
    args = [jax.ShapeDtypeStruct((1, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, top_k), jnp.int32),
            jax.ShapeDtypeStruct((1, top_k), jnp.float32), jax.ShapeDtypeStruct((e, d, 2 * ie), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, ie, d), jnp.bfloat16)]

    def fn(x, top_i, top_p, w_in, w_down):
        return layers.routed_experts_grouped(x, top_i, top_p, w_in, w_down, "silu", impl="pallas")

    lower_for_h200(fn, *args, kernels=[rf"grouped_matmul_silu_gate_bm16_{gate_up}$", rf"grouped_matmul_none_bm16_{down}$"])


def test_fp8_top2_decode_split_k_lowers_for_h200():
    """A batch-1 token at top-2 over block-wise FP8 stacks takes the split-K tiles (`SPLIT_DECODE_TUNING`, the FP8
    weights' tiles dividing their 128-blocks) and lowers for the H200: gate/up K 1024 in 8 parts, the down
    projection's K 256 in 2. Checked to fail with `SPLIT_DECODE_TUNING` unsplit."""
    e, k, d, ie = 64, 2, 1024, 256
    f8, sd = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    args = [sd((1, d), jnp.bfloat16), sd((1, k), jnp.int32), sd((1, k), jnp.float32),
            sd((e, 2 * ie, d), f8), sd((e, 2 * ie // 128, d // 128), jnp.float32),
            sd((e, d, ie), f8), sd((e, d // 128, ie // 128), jnp.float32)]

    def fn(x, top_i, top_p, q_in, s_in, q_down, s_down):
        w_in, w_down = Fp8Weight(q_in, s_in, 2 * ie), Fp8Weight(q_down, s_down, d)
        return layers.routed_experts_grouped(x, top_i, top_p, w_in, w_down, "silu", impl="pallas")

    lower_for_h200(fn, *args, kernels=[r"grouped_matmul_silu_gate_bm16_bn32_bk128_fp8_sk8$",
                                       r"grouped_matmul_none_bm16_bn32_bk128_fp8_sk2$"])


@pytest.mark.parametrize("num_experts,split", [(8, True), (5, False)])
def test_grouped_moe_layer_under_tensor_parallelism_lowers_for_two_h200s(num_experts, split):
    """Over an abstract 2-H200 mesh the grouped layer runs per device (a manual region over "tp") calling both Pallas
    kernels: with the experts split along the expert axis (8 experts: 4 a device, as `jhybrid.parallel.sharding`
    splits them) on its own 4 experts and then an all-reduce of the partial outputs; with them replicated (5 experts
    do not split 2 ways) on all of them, no all-reduce.
    Checked to fail with the split case's `psum` removed (no all-reduce) and with the shard_map dropped (the Pallas
    call then refuses the sharded operands)."""
    from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((2,), ("tp",), abstract_device=h200)
    t, k, d, ie = 4, 2, 256, 128
    spec = P("tp") if split else P()

    def sds(shape, dtype, s=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, s))

    def fn(x, top_i, top_p, w_in, w_down):
        return layers.routed_experts_grouped(x, top_i, top_p, w_in, w_down, "silu", impl="pallas", mesh=mesh)

    args = (sds((t, d), jnp.bfloat16), sds((t, k), jnp.int32), sds((t, k), jnp.float32),
            sds((num_experts, d, 2 * ie), jnp.bfloat16, spec), sds((num_experts, ie, d), jnp.bfloat16, spec))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    from tests.test_kernels_pallas import assert_triton_kernels

    assert_triton_kernels(text, [r"grouped_matmul_silu_gate_\w+", r"grouped_matmul_none_\w+"])
    manual = [line for line in text.splitlines() if "manual_computation" in line]
    local = f"tensor<{num_experts // 2 if split else num_experts}x{d}x{2 * ie}xbf16>"  # the device's stack
    assert manual and 'manual_axes={"tp"}' in manual[0] and local in manual[0], manual[:1]
    assert ("all_reduce" in text) == split
