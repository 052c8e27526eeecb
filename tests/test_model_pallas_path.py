"""The model's step with the Pallas kernels forced on (interpret mode on CPU) equals the reference path.

This runs the kernels with the exact arguments the model passes (dtypes included: l2-normalised q/k,
bf16 activations over fp32 state), which kernel-level tests alone can miss.
"""

from __future__ import annotations


import jax
import numpy as np
import pytest

from jhybrid.checkpoint import load_model
from tests.example_ckpt import write_example_checkpoint
from tests.runner_helpers import SequenceRunner



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_example_checkpoint(tmp_path_factory.mktemp("pallas") / "ckpt", seed=5)


def run(cfg, params, ids, chunks, decode_steps, **kernels):
    runner = SequenceRunner(cfg, params, max_len=96, **kernels)
    table, slot = runner.start()
    logits, start = [], 0
    for n in chunks:
        logits.append(np.asarray(runner.step(ids[start : start + n], start, table, slot, all_logits=True), np.float64))
        start += n
    token = int(np.argmax(logits[-1][-1]))
    for _ in range(decode_steps):
        out = np.asarray(runner.step([token], start, table, slot), np.float64)
        logits.append(out[None])
        token = int(np.argmax(out))
        start += 1
    return np.concatenate(logits)


def decode_error(cfg, params, seed: int) -> float:
    """Relative error of the Pallas path's (interpreted) logits against the reference path's over the 4 decode
    steps after a 29-token prompt in chunks of 16 and 13."""
    ids = list(np.random.default_rng(seed).integers(0, cfg.vocab_size, 29))
    want = run(cfg, params, ids, (16, 13), 4, kernel_impl="reference")
    got = run(cfg, params, ids, (16, 13), 4, kernel_impl="pallas", interpret=True)
    return float(np.linalg.norm(got[-4:] - want[-4:]) / np.linalg.norm(want[-4:]))


def traced_kernel_error(family: str, module, name: str) -> tuple[float, int]:
    """A `kernel_config(family)` model's prefill (two chunks, the second continuing from the state the first left)
    and 2 decode steps with every kernel on, interpreted, against the reference path: (the relative error of every
    step's logits, fp32; how many times `module.name`, a kernel entry point traced in place, was called)."""
    from jhybrid.models.params import init_params

    calls = []
    real = getattr(module, name)
    setattr(module, name, lambda *a, **k: calls.append(k) or real(*a, **k))
    try:
        jax.clear_caches()
        cfg = kernel_config(family)
        params = init_params(cfg, seed=6, scale=0.3)
        ids = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 37))
        want = run(cfg, params, ids, (20, 17), 2, kernel_impl="reference")
        got = run(cfg, params, ids, (20, 17), 2, kernel_impl="pallas", interpret=True)
    finally:
        setattr(module, name, real)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want)), len(calls)


def kernel_config(family: str):
    """`tests.tp_worker.family_config(family)` shaped for the kernels: NemotronH's Mamba2 head and state dims 16 (the
    kernels' tiles need powers of two >= 16), MiniMax's lightning layer first (the last layer of a model barely
    decays: `lightning_slopes`)."""
    import dataclasses

    from tests.tp_worker import family_config

    cfg = family_config(family)
    if family == "nemotron_h":
        cfg = dataclasses.replace(cfg, mamba_head_dim=16, ssm_state_size=16)
    if family == "minimax":
        cfg = dataclasses.replace(cfg, layer_kinds=cfg.layer_kinds[::-1])
    return cfg


@pytest.mark.slow  # the kernels themselves are in the fast tier (test_kernels_pallas.py)
@pytest.mark.parametrize("kernel_qk_norm", [True, False], ids=["qk_norm_in_kernel", "qk_norm_in_xla"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_pallas_path_equals_reference_path(ckpt, dtype, tol, kernel_qk_norm, monkeypatch):
    """The Gated DeltaNet prefill's q / k norms inside the chunk kernels or in XLA first
    (`gated_deltanet.KERNEL_QK_NORM`): either way the Pallas path's logits equal the reference path's. (Checked to
    fail with the in-kernel norm skipped in the sequential pass.)"""
    import jax

    from jhybrid.models import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "KERNEL_QK_NORM", kernel_qk_norm)
    jax.clear_caches()  # a trace of the other setting must not be reused
    cfg, params = load_model(ckpt, dtype=dtype)
    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 37))
    want = run(cfg, params, ids, (20, 17), 3, kernel_impl="reference")
    got = run(cfg, params, ids, (20, 17), 3, kernel_impl="pallas", interpret=True)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all()
    assert err <= tol, f"{dtype}: Pallas path logits differ from the reference path, relative error {err:.2e}"


@pytest.mark.slow
def test_fused_gdn_decode_equals_reference_path(ckpt, monkeypatch):
    """With the Gated DeltaNet decode step as one kernel (`gated_delta_rule.FUSED_DECODE`: q/k norms, gates,
    recurrence and output norm), interpreted, the model's logits over a chunked prefill and decode steps equal the
    reference path's (fp32). Checked to fail with the kernel's gated output norm dropped."""
    from pallas_kernels import gated_delta_rule

    monkeypatch.setattr(gated_delta_rule, "FUSED_DECODE", True)
    cfg, params = load_model(ckpt, dtype="float32")
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 29))
    want = run(cfg, params, ids, (16, 13), 4, kernel_impl="reference")
    got = run(cfg, params, ids, (16, 13), 4, kernel_impl="pallas", interpret=True)
    err = np.linalg.norm(got[-4:] - want[-4:]) / np.linalg.norm(want[-4:])
    assert err <= 1e-5, f"decode logits differ from the reference path's, relative error {err:.2e}"


@pytest.mark.slow
def test_conv_folded_gdn_decode_equals_reference_path(ckpt, monkeypatch):
    """With the conv update folded into the Gated DeltaNet decode kernel (`gated_delta_rule.CONV_DECODE`: one
    program per key head), interpreted, the model's decode logits equal the reference path's (fp32), and the steps
    took that kernel (its dispatch was traced). Checked to fail with the kernel's conv state left
    unstored (the second decode step reads a stale window)."""
    import jax

    from pallas_kernels import gated_delta_rule

    monkeypatch.setattr(gated_delta_rule, "FUSED_DECODE", True)
    monkeypatch.setattr(gated_delta_rule, "CONV_DECODE", True)
    jax.clear_caches()
    names = []
    real = gated_delta_rule.gated_delta_conv_decode_pallas
    monkeypatch.setattr(gated_delta_rule, "gated_delta_conv_decode_pallas",
                        lambda *a, **k: names.append(k["dims"]) or real(*a, **k))
    err = decode_error(*load_model(ckpt, dtype="float32"), seed=2)
    assert names, "no decode step ran the conv decode kernel"
    assert err <= 1e-5, f"decode logits differ from the reference path's, relative error {err:.2e}"


@pytest.mark.slow
def test_decode_prologue_path_equals_reference_path(ckpt, monkeypatch):
    """With the attention layers' decode prologue in one kernel (`paged_attention.DECODE_PROLOGUE`: norms, RoPE,
    K/V writes, padded queries straight into the decode kernel), interpreted, the model's decode logits equal the
    reference path's (fp32), and the steps took that kernel (its dispatch was traced). Checked to fail with the
    prologue's key written without its RoPE (the next step's attention reads a wrong key)."""
    import importlib

    import jax

    from jhybrid.models import attention

    paged_attention = importlib.import_module("pallas_kernels.paged_attention")  # the module (the package exports
    monkeypatch.setattr(paged_attention, "DECODE_PROLOGUE", True)  # a function of its name)
    jax.clear_caches()
    dims = []
    real = attention.decode_prologue_pallas
    monkeypatch.setattr(attention, "decode_prologue_pallas", lambda *a, **k: dims.append(k["dims"]) or real(*a, **k))
    err = decode_error(*load_model(ckpt, dtype="float32"), seed=3)
    assert dims, "no decode step ran the decode prologue kernel"
    assert err <= 1e-5, f"decode logits differ from the reference path's, relative error {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("family,mamba2_fused", [("minimax", False), ("nemotron_h", False), ("nemotron_h", True)])
def test_scalar_decay_families_pallas_path_equals_reference_path(family, mamba2_fused, monkeypatch):
    """Lightning attention (MiniMax) and Mamba2 (NemotronH) layers through the simple-GLA Pallas kernels (chunked
    prefill in two chunks, then decode steps), interpreted, against the reference path: logits of every step,
    fp32. Head dims are 16 so that the kernels apply (their tiles need powers of two >= 16). With `mamba2_fused`
    NemotronH's prefill takes `chunk_mamba2`'s in-place kernels (`simple_gla.MAMBA2_FUSED_PREFILL`). Checked to
    fail with the decay dropped from the decode kernel (`fused_recurrent.py`) and from the chunk kernel's state
    update, and with the D skip dropped from the Mamba2 chunks (the fused case)."""
    import jax

    from jhybrid.models.params import init_params
    from pallas_kernels import simple_gla

    monkeypatch.setattr(simple_gla, "MAMBA2_FUSED_PREFILL", mamba2_fused)
    jax.clear_caches()  # a trace of the other setting must not be reused

    cfg = kernel_config(family)
    params = init_params(cfg, seed=3, scale=0.3)
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 37))
    want = run(cfg, params, ids, (20, 17), 3, kernel_impl="reference")
    got = run(cfg, params, ids, (20, 17), 3, kernel_impl="pallas", interpret=True)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all()
    assert err <= 1e-5, f"{family}: Pallas path logits differ from the reference path, relative error {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("family,switch", [("nemotron_h", "MAMBA2_FUSED_DECODE"),
                                           ("minimax", "LIGHTNING_FUSED_DECODE")])
def test_fused_scalar_decay_decode_equals_reference_path(family, switch, monkeypatch):
    """With the scalar-decay families' decode step as one kernel reading the packed projections in place (NemotronH:
    `simple_gla.MAMBA2_FUSED_DECODE`, after the conv kernel with its bias and SiLU; MiniMax:
    `LIGHTNING_FUSED_DECODE`), interpreted, the logits of a chunked prefill and decode steps equal the reference
    path's (fp32). Checked to fail with the Mamba2 kernel's dt read one head over (`dt_offset + head + 1`), and with
    the lightning kernel's q read at k's offset."""

    from jhybrid.models.params import init_params
    from pallas_kernels import simple_gla

    monkeypatch.setattr(simple_gla, switch, True)
    cfg = kernel_config(family)
    err = decode_error(cfg, init_params(cfg, seed=4, scale=0.3), seed=2)
    assert err <= 1e-5, f"{family}: decode logits differ from the reference path's, relative error {err:.2e}"
