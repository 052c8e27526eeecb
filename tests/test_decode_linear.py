"""`pallas_kernels.decode_linear`: a decode step's projections with the norm before them and the activation and
residual after them in one kernel; the dense MLP block (RMSNorm, up / gate projection, SwiGLU or relu^2, down
projection, residual) in two. Against float64 written out here, lowered for the H200, and in the model."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_linear import decode_mlp, decode_mlp_reference
from tests.test_kernels_pallas import assert_close, lower_for_h200


def _fp64(x, norm_w, w_in, w_down, eps, zero_centred, act):
    x, norm_w, w_in, w_down = (np.asarray(a, np.float64) for a in (x, norm_w, w_in, w_down))
    xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xn = xn * (1 + norm_w) if zero_centred else xn * norm_w
    h = xn @ w_in
    if act == "silu":
        gate, up = np.split(h, 2, axis=-1)
        h = gate / (1 + np.exp(-gate)) * up
    else:
        h = np.maximum(h, 0) ** 2
    return x + h @ w_down


@pytest.mark.parametrize("act,zero_centred", [("silu", True), ("silu", False), ("relu2", False)])
@pytest.mark.parametrize("rows,dtype", [(1, jnp.float32), (5, jnp.float32), (3, jnp.bfloat16)])
def test_decode_mlp_matches_fp64(act, zero_centred, rows, dtype):
    """Both kernels (interpreted) and the jnp reference against float64, for 1, 3 and 5 rows (the rows past them
    masked in a 16-row tile), zero-centred and plain norm weights. Checked to fail with the norm's rsqrt taken over
    one block of D instead of all of it, with gate and up swapped, and with the residual left out."""
    rng = np.random.default_rng(rows * 7 + len(act))
    d, inner = 256, 384
    x = jnp.asarray(rng.normal(size=(rows, d)) * 2, dtype)
    norm_w = jnp.asarray(rng.uniform(-0.5, 0.5, d) if zero_centred else rng.uniform(0.5, 1.5, d), dtype)
    w_in = jnp.asarray(rng.normal(size=(d, inner * (2 if act == "silu" else 1))) / 16, dtype)
    w_down = jnp.asarray(rng.normal(size=(inner, d)) / 20, dtype)
    form = dict(eps=1e-6, zero_centred=zero_centred, act=act)
    want = _fp64(x, norm_w, w_in, w_down, 1e-6, zero_centred, act)
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert_close("reference", decode_mlp_reference(x, norm_w, w_in, w_down, **form), want, rtol)
    got = decode_mlp(x, norm_w, w_in, w_down, **form, impl="pallas", interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert_close("kernels", got, want, rtol)


@pytest.mark.parametrize("with_norm,with_residual,dtype", [(True, False, jnp.float32), (False, True, jnp.float32),
                                                            (True, True, jnp.bfloat16)])
def test_decode_linear_parts_match_fp64(with_norm, with_residual, dtype):
    """`decode_linear` as the mixers use it: the input norm fused before the projection (in_proj), the residual
    after it (out_proj), or both; 6 rows, 400 output columns (25 programs of 16). Against float64. Checked to fail
    with the residual read from the output's columns one block over."""
    from pallas_kernels.decode_linear import decode_linear, decode_linear_reference

    rng = np.random.default_rng(int(with_norm) * 2 + int(with_residual))
    rows, k, n = 6, 256, 400
    x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)) / 16, dtype)
    norm_w = jnp.asarray(rng.uniform(-0.5, 0.5, k), dtype) if with_norm else None
    residual = jnp.asarray(rng.normal(size=(rows, n)), dtype) if with_residual else None
    x64 = np.asarray(x, np.float64)
    if with_norm:
        x64 = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6) * (1 + np.asarray(norm_w, np.float64))
    want = x64 @ np.asarray(w, np.float64) + (np.asarray(residual, np.float64) if with_residual else 0)
    form = dict(norm_w=norm_w, eps=1e-6, zero_centred=True, residual=residual)
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert_close("reference", decode_linear_reference(x, w, **form), want, rtol)
    assert_close("kernel", decode_linear(x, w, **form, impl="pallas", interpret=True), want, rtol)


def test_decode_mlp_lowers_for_h200():
    """At the qwen3_next-shaped MLP (SwiGLU, D 2048, I 5632) and the NemotronH-shaped one (relu^2, I 8192), 4 and 64
    rows: two Triton kernels, nothing else."""
    for act, inner in (("silu", 5632), ("relu2", 8192)):
        for rows in (4, 64):
            args = (jnp.zeros((rows, 2048), jnp.bfloat16), jnp.zeros((2048,), jnp.bfloat16),
                    jnp.zeros((2048, inner * (2 if act == "silu" else 1)), jnp.bfloat16),
                    jnp.zeros((inner, 2048), jnp.bfloat16))
            fn = functools.partial(decode_mlp, eps=1e-6, zero_centred=act == "silu", act=act, impl="pallas")
            lower_for_h200(fn, *args, kernels=[rf"decode_linear_norm_{act}_bn\d+_bk128", r"decode_linear_res_bn16_bk128"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_model_decode_projections_equal_reference_path(family):
    """Dense-MLP models at hidden and intermediate 128, so that the kernels apply: Gated DeltaNet + SwiGLU with
    zero-centred norms, Mamba2 + relu^2 (NemotronH's MLP-only layers too). (MiniMax's layers take their residual
    from the normed input, scaled: its mixers keep XLA's projections, and its MLPs are MoE.) Through the Pallas
    path (interpreted) a decode step's MLP blocks run as `decode_mlp` and its mixers' in projections (attention's qkv
    too) take the input norm and their out projections the residual (`decode_linear`); the logits of a chunked prefill and
    decode steps equal the reference path's, fp32. Checked to fail with the model's decode MLP reading the input
    norm's weight instead of the post-attention norm's, with the mixers' fused out projection leaving out the
    residual, and with the attention layer's alone leaving it out."""
    from jhybrid.models.params import init_params
    from tests.test_model_pallas_path import decode_error
    from tests.tp_worker import family_config

    cfg = family_config(family)
    cfg = dataclasses.replace(cfg, hidden_size=128, intermediate_size=128, mlp_kinds=tuple(
        "dense" if k == "moe" else k for k in cfg.mlp_kinds))
    assert "dense" in cfg.mlp_kinds
    if family == "nemotron_h":  # the Mamba2 kernels' tiles (head dim and state 16) and 16-column projections
        cfg = dataclasses.replace(cfg, mamba_num_heads=16, mamba_head_dim=16, ssm_state_size=16)
    err = decode_error(cfg, init_params(cfg, seed=6, scale=0.3), seed=3)
    assert err <= 1e-5, f"{family}: decode logits differ from the reference path's, relative error {err:.2e}"
