"""`lightning.SCALE_AFTER_PROJ`: a lightning decode step's output norm scale applied after out_proj."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.models import lightning


def _decode_logits(cfg, params, ids, scale_after: bool, monkeypatch, **kernels):
    from tests.test_model_pallas_path import run

    calls = []
    real = lightning._output_scaled_after
    monkeypatch.setattr(lightning, "SCALE_AFTER_PROJ", scale_after)
    monkeypatch.setattr(lightning, "_output_scaled_after", lambda *a: calls.append(1) or real(*a))
    jax.clear_caches()  # the switch is read at trace time
    return run(cfg, params, ids, (20, 17), 3, **kernels)[-3:], len(calls)


@pytest.mark.slow  # four model traces after clearing JAX's caches
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_decode_with_the_scale_after_the_projection_equals_the_norm_before(dtype, tol, monkeypatch):
    """A MiniMax model's 3 decode steps (after a 37-token prompt in two chunks), lightning kernels interpreted: the
    logits with the scale after out_proj equal those with the norm before it, to 1e-5 in fp32 and 2e-2 in bf16
    (the bf16 roundings fall elsewhere), and the rewritten form ran in every decode step's lightning layers. Checked to
    fail with the scale left out, and with the norm weight left out."""
    from jhybrid.models.params import init_params
    from tests.test_model_pallas_path import kernel_config

    cfg = kernel_config("minimax")
    params = init_params(cfg, seed=6, scale=0.3)
    params = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    ids = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 37))
    kernels = dict(kernel_impl="pallas", interpret=True)
    want, none = _decode_logits(cfg, params, ids, False, monkeypatch, **kernels)
    got, calls = _decode_logits(cfg, params, ids, True, monkeypatch, **kernels)
    lightning_layers = sum(kind == "lightning_attention" for kind in cfg.layer_kinds)
    assert none == 0 and calls >= lightning_layers > 0, (none, calls, lightning_layers)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err <= tol, f"{dtype}: logits differ by {err:.2e} (relative)"
