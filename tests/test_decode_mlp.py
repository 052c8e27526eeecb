"""`pallas_kernels.decode_mlp`: a decode step's MLP block (RMSNorm, up / gate projection, SwiGLU or relu^2, down
projection, residual) in two kernels, against float64 written out here, lowered for the H200, and in the model."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_mlp import decode_mlp, decode_mlp_reference
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


def test_decode_mlp_lowers_for_h200():
    """At the qwen3_next-shaped MLP (SwiGLU, D 2048, I 5632) and the NemotronH-shaped one (relu^2, I 8192), 4 and 64
    rows: two Triton kernels, nothing else."""
    for act, inner in (("silu", 5632), ("relu2", 8192)):
        for rows in (4, 64):
            args = (jnp.zeros((rows, 2048), jnp.bfloat16), jnp.zeros((2048,), jnp.bfloat16),
                    jnp.zeros((2048, inner * (2 if act == "silu" else 1)), jnp.bfloat16),
                    jnp.zeros((inner, 2048), jnp.bfloat16))
            fn = functools.partial(decode_mlp, eps=1e-6, zero_centred=act == "silu", act=act, impl="pallas")
            lower_for_h200(fn, *args, kernels=[rf"decode_mlp_up_{act}_\w+", r"decode_mlp_down_\w+"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_model_decode_mlp_equals_reference_path(family):
    """Dense-MLP models (SwiGLU with zero-centred norms; NemotronH's relu^2 and MLP-only layers) at hidden and
    intermediate 128, so that the kernels apply: the logits of a chunked prefill and decode steps through the Pallas
    path (interpreted; decode steps' MLPs by `decode_mlp`) equal the reference path's, fp32. Checked to fail with the
    model's decode MLP reading the input norm's weight instead of the post-attention norm's."""
    from jhybrid.models.params import init_params
    from tests.test_model_pallas_path import run
    from tests.tp_worker import family_config

    cfg = family_config(family)
    cfg = dataclasses.replace(cfg, hidden_size=128, intermediate_size=128, mlp_kinds=tuple(
        "dense" if k == "moe" else k for k in cfg.mlp_kinds))
    assert "dense" in cfg.mlp_kinds
    if family == "nemotron_h":  # the Mamba2 kernels' tiles: head dim and state 16
        cfg = dataclasses.replace(cfg, mamba_head_dim=16, ssm_state_size=16)
    params = init_params(cfg, seed=6, scale=0.3)
    ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 29))
    want = run(cfg, params, ids, (16, 13), 4, kernel_impl="reference")
    got = run(cfg, params, ids, (16, 13), 4, kernel_impl="pallas", interpret=True)
    err = np.linalg.norm(got[-4:] - want[-4:]) / np.linalg.norm(want[-4:])
    assert err <= 1e-5, f"{family}: decode logits differ from the reference path's, relative error {err:.2e}"
