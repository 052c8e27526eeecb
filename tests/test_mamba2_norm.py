"""A Mamba2 prefill's output after its scan as one kernel (`pallas_kernels.simple_gla.mamba2_gated_norm`): the
reference against the model's composition of the same steps, the Pallas kernel (interpreted) against the reference,
its lowering for the H200, and the model's prefill through it."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jhybrid.models.layers import grouped_rms_norm
from pallas_kernels import simple_gla
from pallas_kernels.simple_gla import chunk_mamba2_in_parts, chunk_simple_gla_reference
from pallas_kernels.simple_gla.mamba2_norm import mamba2_gated_norm_pallas, supported
from pallas_kernels.simple_gla.reference import mamba2_gated_norm_reference
from tests.test_kernels_pallas import assert_close, lower_for_h200

H, P, G, N = 4, 16, 2, 16  # heads, head dim, groups (of B / C and of the norm), state size
INNER = H * P


def _inputs(dtype, num_tokens=37, seed=0):
    rng = np.random.default_rng(seed)
    conv_dim = INNER + 2 * G * N
    xbc = jnp.asarray(rng.normal(size=(num_tokens, conv_dim)), dtype)
    z = jnp.asarray(rng.normal(size=(num_tokens, INNER + conv_dim + H)), dtype)  # the packed in_proj output
    d_skip = jnp.asarray(rng.normal(size=(H,)), dtype)
    weight = jnp.asarray(1 + 0.2 * rng.normal(size=(INNER,)), dtype)
    o = jnp.asarray(rng.normal(size=(num_tokens, H, P)), dtype)
    return o, xbc, z, d_skip, weight


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_equals_the_models_parts(dtype):
    """The scan without its skip (`chunk_mamba2_in_parts(d_skip=None)`) then the reference equal, bit for bit, the
    model's parts: the scan with the skip and the gate, then `grouped_rms_norm`. Two ragged rows, one from a slot.
    Checked to fail with y's rounding to the activations' dtype dropped (bf16) and with the gate's SiLU dropped."""
    rng = np.random.default_rng(1)
    _, xbc, z, d_skip, weight = _inputs(dtype)
    t = xbc.shape[0]
    dt = jnp.asarray(rng.uniform(0.01, 0.3, (t, H)), jnp.float32)
    cu, slots = jnp.asarray([0, 20, t], jnp.int32), jnp.asarray([2, 0], jnp.int32)
    state = jnp.asarray(rng.normal(size=(3, H, N, P)), jnp.float32)
    chunk = lambda *a: chunk_simple_gla_reference(*a, scale=1.0, chunk_size=8)  # noqa: E731
    common = dict(dims=(H, P, G, N), out_dtype=dtype, chunk=chunk)
    y, s_want = chunk_mamba2_in_parts(xbc, dt, -dt, d_skip, cu, state, slots, z, **common)
    want = grouped_rms_norm(y.reshape(t, INNER), weight, INNER // G, 1e-5, dtype)
    o, s_got = chunk_mamba2_in_parts(xbc, dt, -dt, None, cu, state, slots, **common)
    got = mamba2_gated_norm_reference(o, xbc, z, d_skip, weight, group_size=INNER // G, eps=1e-5, out_dtype=dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(s_got), np.asarray(s_want))


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)])
@pytest.mark.parametrize("group_size,block_t", [(INNER // G, 8), (INNER, 16), (16, 4)])
def test_kernel_matches_reference(dtype, tol, group_size, block_t):
    """The kernel, interpreted, on 37 tokens (the last program's tile runs past the arrays' end, masked), x and z
    read from wider packed arrays; norm groups of half a mixer, a whole one and one head. Checked to fail with each
    column's D taken from the wrong head (`% heads`), with the gate left out, and with the norm's mean over the whole
    tile."""
    o, xbc, z, d_skip, weight = _inputs(dtype)
    want = mamba2_gated_norm_reference(o, xbc, z, d_skip, weight, group_size=group_size, eps=1e-5, out_dtype=dtype)
    got = mamba2_gated_norm_pallas(o, xbc, z, d_skip, weight, group_size=group_size, eps=1e-5, out_dtype=dtype,
                                   block_t=block_t, interpret=True)
    assert got.dtype == want.dtype and got.shape == (o.shape[0], INNER)
    assert_close(f"{jnp.dtype(dtype).name} group {group_size}", got, want, tol)


def test_refusals_and_dispatch(monkeypatch):
    """Groups that are no power of two or do not divide the channels are refused by the kernel and run the
    reference through the dispatch; "auto" off the GPU, or without `MAMBA2_FUSED_NORM`, is the reference."""
    o, xbc, z, d_skip, weight = _inputs(jnp.float32)
    assert not supported(INNER, 24) and not supported(INNER, 128) and supported(INNER, 32)
    with pytest.raises(ValueError, match="do not fit"):
        mamba2_gated_norm_pallas(o, xbc, z, d_skip, weight, group_size=24, eps=1e-5, out_dtype=jnp.float32)
    assert simple_gla.mamba2_norm_impl("pallas", INNER, 24) == "reference"
    assert simple_gla.mamba2_norm_impl("pallas", INNER, 32) == "pallas"
    monkeypatch.setattr(simple_gla, "MAMBA2_FUSED_NORM", True)
    assert simple_gla.mamba2_norm_impl("auto", INNER, 32) == "reference"  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert simple_gla.mamba2_norm_impl("auto", INNER, 32) == "pallas"
    monkeypatch.setattr(simple_gla, "MAMBA2_FUSED_NORM", False)
    assert simple_gla.mamba2_norm_impl("auto", INNER, 32) == "reference"
    with pytest.raises(ValueError, match="unknown"):
        simple_gla.mamba2_norm_impl("triton", INNER, 32)


def test_lowers_for_h200():
    """The kernel lowers to Triton for the H200 at NemotronH's layer (one 8k prompt: 64 heads of 64, 8 groups of
    512 channels, x and z read from the conv and in_proj outputs)."""
    sd, t = jax.ShapeDtypeStruct, 8192
    args = (sd((t, 64, 64), jnp.bfloat16), sd((t, 6144), jnp.bfloat16), sd((t, 10304), jnp.bfloat16),
            sd((64,), jnp.bfloat16), sd((4096,), jnp.bfloat16))
    lower_for_h200(lambda *a: mamba2_gated_norm_pallas(*a, group_size=512, eps=1e-5, out_dtype=jnp.bfloat16), *args,
                   kernels=[r"mamba2_gated_norm_bt4_g512_w4"])


@pytest.mark.slow
def test_model_prefill_through_the_norm_kernel_equals_reference_path():
    """NemotronH's prefill (two chunks) and decode steps with every kernel on, interpreted, the post-scan work as this
    kernel, against the reference path: logits of every step, fp32. The kernel is traced, so the test knows it ran.
    Checked to fail with the layer passing the skip's D to the scan as well (the skip added twice)."""
    from tests.test_model_pallas_path import traced_kernel_error

    err, calls = traced_kernel_error("nemotron_h", simple_gla, "mamba2_gated_norm_pallas")
    assert calls, "no prefill step ran the Mamba2 norm kernel"
    assert err <= 1e-5, f"logits differ from the reference path's, relative error {err:.2e}"


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)])
def test_x_activated_reads_silu_x_as_given(dtype, tol):
    """With `x_activated` the reference and the kernel (interpreted) take x's columns as SiLU(x) already (what the
    conv kernel writes for `chunk_mamba2_operands`): given SiLU(x) so, the reference equals its plain form on x bit
    for bit in fp32, and the kernel equals the reference. Checked to fail with the kernel applying the SiLU again."""
    o, xbc, z, d_skip, weight = _inputs(dtype)
    form = dict(group_size=INNER // G, eps=1e-5, out_dtype=dtype)
    activated = jax.nn.silu(xbc.astype(jnp.float32)).astype(dtype)
    want = mamba2_gated_norm_reference(o, activated, z, d_skip, weight, **form, x_activated=True)
    if dtype == jnp.float32:
        np.testing.assert_array_equal(np.asarray(want), np.asarray(mamba2_gated_norm_reference(o, xbc, z, d_skip,
                                                                                               weight, **form)))
    got = mamba2_gated_norm_pallas(o, activated, z, d_skip, weight, **form, x_activated=True, block_t=8,
                                   interpret=True)
    assert_close(f"{jnp.dtype(dtype).name} x activated", got, want, tol)


@pytest.mark.slow
def test_model_prefill_with_conv_made_operands_equals_reference_path(monkeypatch):
    """NemotronH's prefill (two chunks) and decode steps with `MAMBA2_CONV_OPERANDS` on, every kernel interpreted:
    the conv kernel writes SiLU(x), B, C and v = x dt and the scan runs on them (`chunk_mamba2_operands`, traced, so
    the test knows it ran), against the reference path: logits of every step, fp32. Checked to fail with v made
    without dt (`scale` dropped: the kernel's unscaled copy) and with the norm re-applying the SiLU."""
    from tests.test_model_pallas_path import traced_kernel_error

    monkeypatch.setattr(simple_gla, "MAMBA2_CONV_OPERANDS", True)
    err, calls = traced_kernel_error("nemotron_h", simple_gla, "chunk_mamba2_operands")
    assert calls, "no prefill step ran the scan on the conv kernel's operands"
    assert err <= 1e-5, f"logits differ from the reference path's, relative error {err:.2e}"
