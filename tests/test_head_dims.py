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
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_every_kernel_lowers_at_every_power_of_two_head_dim(d, dtype):
    built = cases(d, dtype)
    assert set(built) == set(KERNELS) == set(TRITON)
    for name, (fn, args) in built.items():
        lower_for_h200(functools.partial(fn, impl="pallas", interpret=False), *args, kernels=TRITON[name])
