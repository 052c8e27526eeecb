"""Every Pallas kernel lowers for the H200 at every power-of-two head dimension from 16 to 256, with bf16 and fp32
inputs (issue 20), calling the Triton kernels it is expected to (none falls back to the reference). The inputs are
`benchmarks.head_dims`'s, which runs the same cases on the GPU against the references (what fits in shared memory
is only known there). Checked to fail: with `pallas_supported` in pallas_kernels/gated_delta_rule rejecting head
dims below 32, the d=16 cases of the GDN and simple-GLA kernels raise ValueError ("needs power-of-two K, V")."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from benchmarks.head_dims import KERNELS, cases
from tests.test_kernels_pallas import lower_for_h200

TRITON = {  # the Triton kernels each call lowers to, in program order (names carry the tuning: not pinned here)
    "paged_decode": [r"paged_decode_pb\w+"],  # one softmax step a block of pages: the default
    "paged_decode_page": [r"paged_decode_pp\w+"],
    "paged_prefill": [r"paged_prefill_\w+"],
    "paged_prefix_merge": [r"paged_prefix_merge_\w+"],
    "gdn_decode": [r"gdn_fused_recurrent_\w+"],
    "gdn_fused_decode": [r"gdn_fused_decode_w\d+"],
    "gdn_packed_decode": [r"gdn_fused_decode_packed_\w+"],
    "gdn_conv_decode": [r"gdn_conv_decode_w\d+"],
    "gdn_chunk": [r"gdn_chunk_wy_\w+", r"gdn_chunk_fused_\w+", r"gdn_chunk_single_\w+"],
    "gdn_chunk_normed_qk": [r"gdn_chunk_wy_\w+_qk", r"gdn_chunk_fused_\w+", r"gdn_chunk_single_\w+"],
    "sgla_decode": [r"sgla_fused_recurrent_\w+"],
    "sgla_chunk": [r"sgla_chunk_fused_\w+", r"sgla_chunk_single_\w+"],
    "mamba2_chunk": [r"mamba2_chunk_fused_\w+", r"mamba2_chunk_single_\w+"],
    "mamba2_decode": [r"mamba2_decode_\w+"],
    "lightning_decode": [r"lightning_decode_\w+"],
    "conv_prefill": [r"conv_prefill_\w+"],
    "mamba2_norm": [r"mamba2_gated_norm_\w+"],
    "paged_decode_tail": [r"paged_decode_pb\w+"],
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_every_kernel_lowers_at_every_power_of_two_head_dim(d, dtype):
    built = cases(d, dtype)
    assert set(built) == set(KERNELS) == set(TRITON)
    for name, (fn, args) in built.items():
        lower_for_h200(functools.partial(fn, impl="pallas", interpret=False), *args, kernels=TRITON[name])


def test_run_cases_reports_a_failing_kernel_and_runs_the_rest(monkeypatch):
    """`run_cases` compiles in threads and runs in order: a kernel that raises while compiling is a FAIL row naming
    the error, one that gives a wrong answer is a FAIL row with its error, and the cases after them still run and
    pass. (Checked to fail with `compile_case`'s except clause removed: the error escapes `run_cases`.)"""
    import benchmarks.head_dims as head_dims

    def good(x, *, impl, interpret):
        return x * 2.0

    def wrong(x, *, impl, interpret):
        return x * (2.0 if impl == "reference" else 3.0)

    def broken(x, *, impl, interpret):
        if impl == "pallas":
            raise ValueError("needs power-of-two K, V")
        return x

    x = jnp.ones((4, 8), jnp.float32)
    monkeypatch.setattr(head_dims, "cases", lambda d, dtype: {"a": (broken, (x,)), "b": (wrong, (x,)),
                                                                "c": (good, (x,))})
    seen = []
    rows = head_dims.run_cases(["a", "b", "c"], [16, 32], [jnp.float32], interpret=True, iters=2, jobs=3,
                               report=seen.append)
    assert rows == seen
    assert [(r["kernel"], r["head_dim"], r["status"]) for r in rows] == [
        ("a", 16, "FAIL"), ("a", 32, "FAIL"), ("b", 16, "FAIL"), ("b", 32, "FAIL"),
        ("c", 16, "PASS"), ("c", 32, "PASS")]
    assert rows[0]["error"] == "ValueError: needs power-of-two K, V"
    assert rows[2]["rel_err"] > 0.4 and rows[4]["rel_err"] == 0.0 and rows[4]["ms"] is not None
