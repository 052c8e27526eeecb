"""The one-kernel softmax routing of a decode step's per-pair MoE tiles (`pallas_kernels.moe_route`): the kernel
(interpreted) against its jnp reference, the reference against the routing written out by hand, the layer through
it against the dense layer, and the lowering for the H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.models import layers
from pallas_kernels import moe_route
from pallas_kernels.moe_route import pair_route, pair_route_pallas, pair_route_reference
from tests.test_kernels_pallas import assert_close, lower_for_h200


def _by_hand(logits, num_real, top_k, norm, block_m=16):
    """The routing in float64 NumPy, one token at a time: a stable descending order (lower expert first among
    equals), the softmax weights of the first k, renormalised over them or not."""
    logits = np.asarray(logits, np.float64)
    num_tokens, _ = logits.shape
    experts = np.full((num_tokens, top_k), -1)
    rows_w = np.zeros((num_tokens, top_k, block_m))
    for t in range(min(num_tokens, num_real)):
        probs = np.exp(logits[t] - logits[t].max())
        probs /= probs.sum()
        order = sorted(range(len(probs)), key=lambda e: (-logits[t, e], e))[:top_k]
        w = probs[order] / (probs[order].sum() if norm else 1.0)
        experts[t], rows_w[t, :, 0] = order, w
    return experts.reshape(-1), rows_w.reshape(-1)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 32, 2), (4, 32, 2), (8, 8, 1), (2, 64, 4),
                                                          (4, 512, 2)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("num_real", [None, 1])
def test_kernel_equals_reference_and_the_routing_by_hand(num_tokens, num_experts, top_k, norm, num_real):
    """bf16 logits rounded to a coarse grid (many ties among the experts): the kernel's tile experts equal the
    reference's and a stable sort's exactly, lower expert first among equals, and its row weights the reference's to
    fp32 rounding and the float64 routing's to 1e-6; the padding tokens' pairs (from `num_real`) have expert -1 and
    weight 0. Checked to fail with the ties broken towards the higher expert, with the renormalisation skipped, and
    with the padding tokens routed as real ones."""
    rng = np.random.default_rng(num_tokens * 1000 + num_experts + top_k)
    logits = jnp.asarray(np.round(rng.standard_normal((num_tokens, num_experts)) * 4) / 4, jnp.bfloat16)
    real = None if num_real is None else jnp.int32(num_real)
    want_e, want_w = pair_route_reference(logits, real, top_k=top_k, norm_topk_prob=norm)
    got_e, got_w = pair_route_pallas(logits, real, top_k=top_k, norm_topk_prob=norm, interpret=True)
    hand_e, hand_w = _by_hand(logits.astype(jnp.float32), num_tokens if num_real is None else num_real, top_k, norm)
    np.testing.assert_array_equal(np.asarray(got_e), np.asarray(want_e))
    np.testing.assert_array_equal(np.asarray(got_e), hand_e)
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_w), hand_w, rtol=1e-6, atol=1e-7)
    assert got_w.shape == (num_tokens * top_k * 16,)


def test_kernel_refuses_shapes_it_does_not_take():
    with pytest.raises(ValueError, match="E=24 must be a power of two"):
        pair_route_pallas(jnp.zeros((4, 24)), None, top_k=2, norm_topk_prob=True, interpret=True)
    with pytest.raises(ValueError, match="top_k=8 > E=4"):
        pair_route_pallas(jnp.zeros((1, 4)), None, top_k=8, norm_topk_prob=True, interpret=True)
    with pytest.raises(ValueError, match="unknown pair_route impl='triton'"):
        pair_route(jnp.zeros((1, 4)), top_k=1, norm_topk_prob=True, impl="triton")
    assert not moe_route.pallas_supported(3, 32, 2) and moe_route.pallas_supported(4, 32, 2)


@pytest.mark.parametrize("act", ["silu", "relu2"])
@pytest.mark.parametrize("num_real", [4, 1])
def test_decode_layer_through_the_route_kernel_equals_dense(act, num_real, monkeypatch):
    """`moe` in a 4-row decode step at top-2 of 32 experts (MiniMax's routing; `kernels` impl "pallas", interpreted)
    runs the route kernel and the grouped experts, and its real tokens' outputs equal the dense reference layer's
    (`MOE_IMPL="dense"`) in fp32. Checked to fail with the route kernel's weights not renormalised, and with the
    kernel's tile experts taken for the wrong pairs (token-major order read expert-major)."""
    calls = []
    kernel = moe_route.pair_route_pallas
    monkeypatch.setattr(moe_route, "pair_route_pallas", lambda *a, **kw: calls.append(a[0].shape) or kernel(*a, **kw))
    rng = np.random.default_rng(7)
    e, k, d, ie, t = 32, 2, 128, 64, 4
    n_in = ie if act == "relu2" else 2 * ie
    p = dict(router=jnp.asarray(rng.standard_normal((d, e)), jnp.float32),
             down_proj=jnp.asarray(rng.standard_normal((e, ie, d)) / np.sqrt(ie), jnp.float32))
    p["up_proj" if act == "relu2" else "gate_up_proj"] = jnp.asarray(rng.standard_normal((e, d, n_in)) / np.sqrt(d),
                                                                     jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    got = layers.moe(p, x, k, True, act=act, kernels=dict(impl="pallas", interpret=True), num_real=jnp.int32(num_real))
    monkeypatch.setattr(layers, "MOE_IMPL", "dense")
    want = layers.moe(p, x, k, True, act=act, kernels=dict(impl="reference"))
    assert calls == [(t, e)]
    assert_close(f"{act} real={num_real}", got[:num_real], want[:num_real], 1e-5)


def test_route_kernel_lowers_for_h200_in_a_decode_layer(monkeypatch):
    """With `FUSED_ROUTE` on, a MiniMax-shaped decode step's MoE layer (4 rows, top-2 of 32 experts, bf16) lowers for
    the H200 with the route kernel before the two grouped expert kernels; with it off, the routing is XLA's (no route
    kernel: `lower_for_h200` checks the exact list). Checked to fail with `FUSED_ROUTE` ignored by `pair_route`."""
    e, k, d, ie, t = 32, 2, 1024, 256, 4
    sd = jax.ShapeDtypeStruct
    args = [sd((t, d), jnp.bfloat16), sd((d, e), jnp.bfloat16), sd((e, d, 2 * ie), jnp.bfloat16),
            sd((e, ie, d), jnp.bfloat16)]

    def fn(x, router, w_in, w_down):
        return layers.moe(dict(router=router, gate_up_proj=w_in, down_proj=w_down), x, k, True,
                          num_real=jnp.int32(1))

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # "auto" as on the GPU
    experts = [r"grouped_matmul_silu_gate_bm16_bn32_bk128_sk8$", r"grouped_matmul_none_bm16_bn32_bk128_sk2$"]
    monkeypatch.setattr(moe_route, "FUSED_ROUTE", True)
    lower_for_h200(fn, *args, kernels=[r"moe_pair_route_k2_e32_norm$"] + experts)
    monkeypatch.setattr(moe_route, "FUSED_ROUTE", False)
    lower_for_h200(lambda *a: fn(*a), *args, kernels=experts)  # a new function: the switch is read at trace time
