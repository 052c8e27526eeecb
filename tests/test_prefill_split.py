"""The split ragged prefill (`pallas_kernels/paged_attention/self_attention.py`): the step's tokens among
themselves plus the Pallas kernel over each row's earlier keys, merged by LSE, against the paged reference.

On the CPU the self part runs its jnp form (`self_impl="reference"`); cuDNN's form is checked against the paged
reference on the GPU (`python3 -m benchmarks.kernels`, the "paged_prefill" rows)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention import self_attention
from pallas_kernels.paged_attention.self_attention import packed_causal_attention, prefix_positions
from tests.test_kernels_pallas import _paged_inputs, assert_close
from tests.test_paged_prefill_pallas import _with_padding

pa = importlib.import_module("pallas_kernels.paged_attention")  # the package (its name is also the function's)

CASES = [
    # cached lengths after the step, new tokens per row (0: an empty row), H, KVH, D, BS
    ([37, 63, 71, 5], [37, 23, 1, 0], 8, 2, 32, 8),  # fresh prompt, chunk after a prefix, decode row, empty row
    ([16, 9], [16, 9], 4, 4, 16, 16),  # only fresh rows (the prefix kernel reads nothing)
    ([50, 30], [2, 30], 6, 2, 64, 8),  # GQA 3 (group padded to 4 in the kernel)
]


def _new_kv(args, token_seq, positions, n_real):
    """This step's K/V as the layer has them: read back from the pages at each real token's position."""
    _, k_pages, v_pages, tables, _, _ = args
    bs = k_pages.shape[1]
    seq, pos = np.asarray(token_seq)[:n_real], np.asarray(positions)[:n_real]
    pages = np.asarray(tables)[seq, pos // bs]
    k, v = np.asarray(k_pages)[pages, pos % bs], np.asarray(v_pages)[pages, pos % bs]
    pad = len(token_seq) - n_real
    return (jnp.asarray(np.concatenate([k, np.full((pad, *k.shape[1:]), np.nan, k.dtype)])),
            jnp.asarray(np.concatenate([v, np.full((pad, *v.shape[1:]), np.nan, v.dtype)])))


def _route(monkeypatch, route: str) -> None:
    """The split's prefix part: "in_place" (`prefix.py`, which these small steps would not take by default: their
    few query tiles get KV splits), "unmerged" (the prefill kernel + `merge_attention`, the prefix part run for
    every step) or "unmerged_skip" (the same, skipped by a `lax.cond` when no row has a prefix)."""
    from pallas_kernels.paged_attention import prefill

    monkeypatch.setattr(pa, "PREFIX_IN_PLACE", route == "in_place")
    monkeypatch.setattr(prefill, "TARGET_PROGRAMS", 1 if route == "in_place" else prefill.TARGET_PROGRAMS)
    monkeypatch.setattr(self_attention, "SKIP_EMPTY_PREFIX", route == "unmerged_skip")
    jax.clear_caches()  # a trace of another route must not be reused


ROUTES = ["in_place", "unmerged", "unmerged_skip"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("lengths,new,h,kvh,d,bs", CASES)
def test_split_prefill_matches_reference(lengths, new, h, kvh, d, bs, route, monkeypatch):
    _route(monkeypatch, route)
    rng = np.random.default_rng(sum(lengths) + d)
    args, cu = _with_padding(_paged_inputs(rng, lengths, new, h, kvh, d, bs, jnp.float32), lengths, new)
    real = int(cu[-1])
    new_kv = _new_kv(args, args[4], args[5], real)
    want_o, want_lse = jax.jit(paged_attention_reference, static_argnames=("return_lse",))(*args, return_lse=True)
    got_o, got_lse = paged_attention(*args, cu_seqlens=cu, impl="pallas", interpret=True, return_lse=True,
                                     new_kv=new_kv, self_impl="reference", block_q=4, pages_per_block=2)
    # checked to fail when the prefix kernel attends up to each query (`prefix_positions` returning positions):
    # the step's keys are then counted twice
    assert_close("split prefill output", got_o[:real], want_o[:real], 1e-5)
    assert_close("split prefill lse", got_lse[:real], want_lse[:real], 1e-5)
    assert np.all(np.asarray(got_o)[real:] == 0), "padding tokens must produce zeros"


def test_prefix_positions_end_before_each_rows_first_new_token():
    # rows: 3 new tokens after 5 cached, 2 fresh tokens, an empty row, 1 token after 9; then 2 padding tokens
    positions = jnp.asarray([5, 6, 7, 0, 1, 9, 0, 0], jnp.int32)
    cu = jnp.asarray([0, 3, 5, 5, 6], jnp.int32)
    assert np.asarray(prefix_positions(positions, cu)).tolist() == [4, 4, 4, -1, -1, 8, -1, -1]


def test_packed_causal_attention_stays_inside_each_row():
    rng = np.random.default_rng(0)
    cu = jnp.asarray([0, 3, 3, 7], jnp.int32)
    q, k, v = (jnp.asarray(rng.normal(size=(9, 4, 16)), jnp.float32) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA 2
    o, lse = packed_causal_attention(q, k, v, cu, scale=0.25, impl="reference")
    for b in range(3):  # each row alone, dense causal attention in numpy
        s, e = int(cu[b]), int(cu[b + 1])
        for t in range(s, e):
            for hd in range(4):
                sc = np.asarray(q[t, hd]) @ np.asarray(k[s:t + 1, hd // 2]).T * 0.25
                w = np.exp(sc - sc.max())
                np.testing.assert_allclose(np.asarray(o[t, hd]), w @ np.asarray(v[s:t + 1, hd // 2]) / w.sum(),
                                           rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(float(lse[t, hd]), sc.max() + np.log(w.sum()), rtol=1e-5)
    assert np.all(np.asarray(o[7:]) == 0) and np.all(np.isneginf(np.asarray(lse[7:])))


def test_split_refuses_what_it_cannot_do():
    rng = np.random.default_rng(1)
    args, cu = _with_padding(_paged_inputs(rng, [9], [9], 4, 2, 16, 8, jnp.float32), [9], [9])
    with pytest.raises(ValueError, match="new_kv"):
        paged_attention(*args, cu_seqlens=cu, impl="pallas", interpret=True, self_impl="reference")
    new_kv = _new_kv(args, args[4], args[5], 9)
    with pytest.raises(ValueError, match="sliding window"):
        paged_attention(*args, cu_seqlens=cu, impl="pallas", interpret=True, new_kv=new_kv, self_impl="reference",
                        sliding_window=4)
    with pytest.raises(ValueError, match="self_impl"):
        paged_attention(*args, cu_seqlens=cu, impl="pallas", interpret=True, new_kv=new_kv, self_impl="flash")


@pytest.mark.parametrize("route", ["in_place", "unmerged"])
def test_the_attention_layer_splits_prefill_steps_only(route, monkeypatch):
    """The model hands a prefill step's K/V to the attention (so that the GPU splits it); the logits of a fresh chunk, a chunk after it and decode steps through the split equal the reference path's.
    Checked to fail when `attention_layer` drops `new_kv`."""
    import dataclasses

    _route(monkeypatch, route)
    from jhybrid.models.params import init_params
    from tests.test_model_pallas_path import run
    from tests.tp_worker import family_config

    seen = []

    def split_impl(q, k_pages, new_kv, self_impl, *rest):  # called for prefill (not decode) steps
        seen.append((q.shape[0], new_kv is not None))
        return "reference" if new_kv is not None else None

    monkeypatch.setattr(pa, "_split_impl", split_impl)
    cfg = dataclasses.replace(family_config("qwen3_next"), vocab_size=131)  # a config no other test traced
    params = init_params(cfg, seed=4, scale=0.3)
    ids = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 37))
    want = run(cfg, params, ids, (20, 17), 2, kernel_impl="reference")
    got = run(cfg, params, ids, (20, 17), 2, kernel_impl="pallas", interpret=True)
    assert seen and all(split for _, split in seen), f"prefill steps pass their K/V: {seen}"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 1e-5, f"logits through the split prefill differ from the reference path: {err:.2e}"
