"""Gated delta rule: references, Pallas kernels and dispatch.

`chunk_gated_delta_rule` (prefill, ragged packed sequences) and `fused_recurrent_gated_delta_rule`
(decode, one token per sequence) are the entry points the model calls. `impl` picks the implementation:
  * "reference": the pure-jnp references; "recurrent" (chunk form only): the token-by-token scan;
  * "pallas": the Pallas kernels (`fused_recurrent.py`, `chunk.py`); `interpret=True` runs them in the
    Pallas interpreter (CPU tests);
  * with `mesh` (a 1-D device mesh whose axis splits the heads: tensor parallelism) the Pallas kernels run
    per shard under `jax.shard_map` (q/k heads, value heads and state slots' heads split alike); the
    references need no wrapping (XLA SPMD partitions them);
  * "auto": the Pallas kernel on GPU where its shapes are supported (power-of-two K and V), else the
    reference.

`gated_delta_decode` is a Gated DeltaNet mixer's whole decode step after its convolution (the L2 norms of q and
k, the gates, the recurrence, the gated output norm): with `fused` (`FUSED_DECODE`) and the Pallas recurrence
chosen, one kernel (`fused_decode.py`), else those parts one by one, the recurrence dispatched as above.
`gated_delta_decode_packed` is the same from the layer's packed arrays (the conv's output and the in_proj output),
which the fused kernel reads in place.
"""

from __future__ import annotations

import functools
import os

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.gated_delta_rule.chunk import _l2norm, chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.conv_decode import (
    conv_decode_supported,
    gated_delta_conv_decode_pallas,
    gated_delta_conv_decode_reference,
)
from pallas_kernels.gated_delta_rule.fused_decode import (
    decode_in_parts,
    gated_delta_decode_packed_pallas,
    gated_delta_decode_pallas,
    gated_delta_decode_reference,
    packed_supported,
    split_packed_decode,
)
from pallas_kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_reference,
    recurrent_gated_delta_rule_reference,
)

_IMPLS = ("auto", "reference", "recurrent", "pallas")

# Which kernels "auto" routes to on GPU: only those checked correct on the H200 (benchmarks/RESULTS.md).
_AUTO_PALLAS = frozenset({"fused_recurrent", "chunk"})


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def pallas_supported(q, v) -> bool:
    """Static check: Triton tiles need power-of-two key and value head dims."""
    return _pow2(q.shape[-1]) and _pow2(v.shape[-1]) and q.shape[-1] >= 16 and v.shape[-1] >= 16


def _pick(impl: str, kind: str, q, v) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"unknown gated delta rule {impl=}; choose one of {_IMPLS}")
    if impl == "auto":
        gpu = jax.default_backend() == "gpu"
        return "pallas" if gpu and kind in _AUTO_PALLAS and pallas_supported(q, v) else "reference"
    if impl == "pallas" and not pallas_supported(q, v):
        raise ValueError(
            f"the Pallas gated delta rule needs power-of-two K, V >= 16, got {q.shape[-1]=} {v.shape[-1]=}; "
            "use impl='reference'"
        )
    return impl


def _per_head_shard(kernel, mesh, specs):
    """`kernel(*args)` run per shard of a 1-D mesh whose axis splits the heads (`specs`: one letter per
    argument: "h" [T, H, ...] heads on axis 1, "s" state [S, HV, K, V], "r" replicated)."""
    (axis,) = mesh.axis_names
    spec = {"h": P(None, axis), "s": P(None, axis, None, None), "r": P()}
    return jax.shard_map(kernel, mesh=mesh, in_specs=tuple(spec[c] for c in specs),
                         out_specs=(P(None, axis, None), spec["s"]), check_vma=False)


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state, slot_ids, *, impl: str = "auto",
                           interpret: bool = False, scale: float | None = None, chunk_size: int = 64,
                           mesh=None, qk_l2norm: bool = False, **tuning):
    """Same signature and result as `chunk_gated_delta_rule_reference`.

    impl: "auto", "reference" (chunked WY form), "recurrent" (token-by-token scan, the definition) or
    "pallas". `qk_l2norm`: q and k are L2-normalised over K first (in fp32, `fused_decode.L2_EPS`, rounded to their
    dtype), by the Pallas kernels as they load them, by jnp before the references. `tuning` (block_v, num_warps,
    num_stages, wy_num_warps, wy_precision, gcum, scores, fused_output, out_block_v, single_block_v, row_groups)
    goes to the Pallas kernel.
    """
    impl = _pick(impl, "chunk", q, v)
    if qk_l2norm and impl != "pallas":
        q, k = (_l2norm(x, True, x.dtype) for x in (q, k))
    elif qk_l2norm:
        tuning = dict(tuning, qk_l2norm=True)
    args = (q, k, v, g, beta, cu_seqlens, state, slot_ids)
    if impl == "recurrent":
        return recurrent_gated_delta_rule_reference(*args, scale=scale)
    if impl == "reference":
        return chunk_gated_delta_rule_reference(*args, scale=scale, chunk_size=chunk_size)
    kernel = lambda *a: chunk_gated_delta_rule_pallas(  # noqa: E731
        *a, scale=scale, chunk_size=chunk_size, interpret=interpret, **tuning
    )
    if mesh is not None and mesh.size > 1:
        kernel = _per_head_shard(kernel, mesh, "hhhhhrsr")
    return kernel(*args)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, slot_ids, *, impl: str = "auto",
                                     interpret: bool = False, scale: float | None = None, mesh=None,
                                     **tuning):
    """Same signature and result as `fused_recurrent_gated_delta_rule_reference` (one decode step).

    With impl "pallas" the state is aliased in place (donate it under jit to avoid a copy); `tuning`
    (block_v, num_warps, num_stages) goes to the kernel.
    """
    impl = _pick(impl, "fused_recurrent", q, v)
    if impl == "recurrent":
        raise ValueError("impl='recurrent' is for chunk_gated_delta_rule; decode is already recurrent")
    if impl == "reference":
        return fused_recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, slot_ids, scale=scale)
    kernel = lambda *a: fused_recurrent_gated_delta_rule_pallas(  # noqa: E731
        *a, scale=scale, interpret=interpret, **tuning
    )
    if mesh is not None and mesh.size > 1:
        kernel = _per_head_shard(kernel, mesh, "hhhhhsr")
    return kernel(q, k, v, g, beta, state, slot_ids)


# the decode step's norms, gates and recurrence as one kernel (`gated_delta_decode`): on, measured on the H200 against
# the parts one by one with the conv kernel (a qwen3_next-shaped batch-1 token 1.942 -> 1.786 ms, benchmarks/RESULTS.md,
# "Session 31"); JHYBRID_GDN_FUSED_DECODE=0 turns it off
FUSED_DECODE = os.environ.get("JHYBRID_GDN_FUSED_DECODE", "1") == "1"
FUSED_DECODE_MAX_V = 256  # the fused kernel holds a head's whole [K, V] state tile and output in one program


def gated_delta_decode(q, k, v, a, b, z, a_log, dt_bias, norm_w, state, slot_ids, *, eps: float, impl: str = "auto",
                       interpret: bool = False, scale: float | None = None, mesh=None, fused: bool | None = None,
                       **tuning):
    """Same signature and result as `gated_delta_decode_reference` (one decode token per row, q and k not yet
    normalised). `fused` (default `FUSED_DECODE`): one Pallas kernel where the recurrence's impl is "pallas" (so
    "auto" on a GPU), V <= `FUSED_DECODE_MAX_V` and no mesh splits the heads; else the norms and gates in jnp and
    `fused_recurrent_gated_delta_rule` (its `impl`, `mesh` and `tuning`)."""
    fused = FUSED_DECODE if fused is None else fused
    if (fused and _pick(impl, "fused_recurrent", q, v) == "pallas" and v.shape[-1] <= FUSED_DECODE_MAX_V
            and (mesh is None or mesh.size == 1)):
        return gated_delta_decode_pallas(q, k, v, a, b, z, a_log, dt_bias, norm_w, state, slot_ids, eps=eps,
                                         scale=scale, interpret=interpret, **tuning)
    recurrence = functools.partial(fused_recurrent_gated_delta_rule, impl=impl, interpret=interpret, scale=scale,
                                   mesh=mesh, **tuning)
    return decode_in_parts(q, k, v, a, b, z, a_log, dt_bias, norm_w, state, slot_ids, eps=eps, recurrence=recurrence)


# the conv update folded into the packed decode kernel (`conv_decode.py`: one launch a layer instead of two, a
# program per key head): off. End to end on an H100 the engine's step took -0.6% at batch 1, -4.9% at 64 rows and
# -4.1% at 256, less than the window conv with the split packed kernel from 64 / 128 rows (benchmarks/RESULTS.md,
# "Session 40"). JHYBRID_GDN_CONV_DECODE=1 turns it on (and takes precedence over the split form)
CONV_DECODE = os.environ.get("JHYBRID_GDN_CONV_DECODE", "0") == "1"


# steps of at least this many rows run the packed kernel in its split form (`block_v=SPLIT_BLOCK_V`: a program per
# [K, 64] block, 135 registers against the whole tile's 255 on the H200 compile; the gated norm after it in XLA). In
# the qwen3_next-shaped engine's decode step on an H100 with the conv's window form: 256 rows 11.248 -> 10.904 ms,
# 64 rows 4.415 -> 4.412 (benchmarks/RESULTS.md, "Session 40"). JHYBRID_GDN_SPLIT_DECODE_ROWS sets the bound (0: off).
SPLIT_FROM_ROWS = int(os.environ.get("JHYBRID_GDN_SPLIT_DECODE_ROWS", "128"))
SPLIT_BLOCK_V = 64


def _packed_kernel_runs(dims: tuple[int, int, int, int], dtype, impl: str, mesh, fused: bool | None) -> bool:
    """Whether the packed fused decode kernel runs (static): `fused` (default `FUSED_DECODE`) on, head dims it reads
    in place (`packed_supported`), V <= `FUSED_DECODE_MAX_V`, no mesh, and the Pallas recurrence for `impl`."""
    fused = FUSED_DECODE if fused is None else fused
    hk, dk, hv, dv = dims
    return (fused and packed_supported(dims) and dv <= FUSED_DECODE_MAX_V and (mesh is None or mesh.size == 1)
            and _pick(impl, "fused_recurrent", jax.ShapeDtypeStruct((1, hk, dk), dtype),
                      jax.ShapeDtypeStruct((1, hv, dv), dtype)) == "pallas")


def conv_decode_applies(dims: tuple[int, int, int, int], conv_weight_shape: tuple[int, int], dtype, *,
                        impl: str = "auto") -> bool:
    """Whether a decode step of these heads (one device) runs `gated_delta_conv_decode_pallas` (static):
    `CONV_DECODE` on, the packed kernel's conditions (`_packed_kernel_runs`) and the kernel's own
    (`conv_decode_supported`)."""
    return (CONV_DECODE and conv_decode_supported(dims, conv_weight_shape)
            and _packed_kernel_runs(dims, dtype, impl, None, None))


def gated_delta_decode_packed(qkv, proj, a_log, dt_bias, norm_w, state, slot_ids, *, dims: tuple[int, int, int, int],
                              eps: float, impl: str = "auto", interpret: bool = False, scale: float | None = None,
                              mesh=None, fused: bool | None = None, **tuning):
    """`gated_delta_decode` of `split_packed_decode(qkv, proj, dims)` (one device's unsharded packing). Where the
    fused kernel runs, its packed form reads q, k, v, z, a and b in place (split in column blocks from
    `SPLIT_FROM_ROWS` rows up, without `tuning`); else the arrays are split and `gated_delta_decode` dispatches."""
    if _packed_kernel_runs(dims, qkv.dtype, impl, mesh, fused):
        if not tuning and 0 < SPLIT_FROM_ROWS <= qkv.shape[0] and SPLIT_BLOCK_V < dims[3]:
            tuning = dict(block_v=SPLIT_BLOCK_V)
        return gated_delta_decode_packed_pallas(qkv, proj, a_log, dt_bias, norm_w, state, slot_ids, dims=dims, eps=eps,
                                                scale=scale, interpret=interpret, **tuning)
    q, k, v, a, b, z = split_packed_decode(qkv, proj, dims)
    return gated_delta_decode(q, k, v, a, b, z, a_log, dt_bias, norm_w, state, slot_ids, eps=eps, impl=impl,
                              interpret=interpret, scale=scale, mesh=mesh, fused=False, **tuning)


__all__ = [
    "CONV_DECODE",
    "conv_decode_applies",
    "gated_delta_conv_decode_pallas",
    "gated_delta_conv_decode_reference",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_pallas",
    "chunk_gated_delta_rule_reference",
    "gated_delta_decode",
    "gated_delta_decode_packed",
    "gated_delta_decode_packed_pallas",
    "gated_delta_decode_pallas",
    "gated_delta_decode_reference",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule_pallas",
    "fused_recurrent_gated_delta_rule_reference",
    "recurrent_gated_delta_rule_reference",
    "split_packed_decode",
]
