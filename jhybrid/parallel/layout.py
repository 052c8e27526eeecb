"""The shard-major layout of packed projections under tensor parallelism.

A packed projection (`jhybrid.models.params`: attention `qkv_proj`, Gated DeltaNet `in_proj`, MLP
`gate_up_proj`, ...) concatenates segments along its output axis, e.g. `[q | k | v]`. Split contiguously
into N column blocks, shard i would hold a mix of q and k columns instead of its own heads. So under
tensor parallelism N the packed axis is stored **shard-major**: block i (of N equal blocks) is the
concatenation of the i-th N-th of every segment,

    [q | k | v]  ->  [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ... ]        (q_i = q[i*Q/N : (i+1)*Q/N])

and the model reads a packed output with `split_packed(y, sizes, N)`: a reshape to `[..., N, F/N]`, a
slice per segment, a reshape back. Each segment comes back in its original order (heads 0..H-1), and
under XLA SPMD every step is local to a shard, with no collective. With N = 1 both are the identity:
the single-device layout is the N = 1 case.

The causal conv of Gated DeltaNet and Mamba2 runs over a packed channel axis too (`q|k|v`, `x|B|C`), so
its weight, bias and conv *state* carry the same shard-major channel order.

This module imports only JAX: the model layers use `split_packed`, `jhybrid.parallel.sharding` uses
`interleave`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

TP_AXIS = "tp"


def num_shards(mesh) -> int:
    """Tensor-parallel degree of `mesh` (1 for None)."""
    return 1 if mesh is None else int(mesh.shape[TP_AXIS])


def split_packed(y, sizes: Sequence[int], n: int) -> list:
    """Splits the last axis of `y [..., F]` (shard-major over `n` shards, F = sum(sizes)) into its
    segments `[..., sizes[j]]`, each in its original order."""
    total = sum(sizes)
    if y.shape[-1] != total or any(s % n for s in sizes):
        raise ValueError(f"cannot split a packed axis of {y.shape[-1]} into segments {tuple(sizes)} over {n} shards")
    lead = y.shape[:-1]
    blocks = y.reshape(*lead, n, total // n)  # [..., N, F/N]: block i lives on shard i
    out, offset = [], 0
    for s in sizes:
        out.append(blocks[..., offset : offset + s // n].reshape(*lead, s))
        offset += s // n
    return out


def interleave(w, sizes: Sequence[int], n: int, axis: int = -1):
    """The packed tensor `w` (segments `sizes` along `axis`, in the single-device layout) in the
    shard-major layout for `n` shards; the inverse of what `split_packed` reads."""
    if n == 1:
        return w
    total = sum(sizes)
    if w.shape[axis] != total or any(s % n for s in sizes):
        raise ValueError(f"cannot interleave an axis of {w.shape[axis]} with segments {tuple(sizes)} over {n} shards")
    w = jnp.moveaxis(jnp.asarray(w), axis, -1)
    lead = w.shape[:-1]
    pieces, offset = [], 0
    for s in sizes:
        pieces.append(w[..., offset : offset + s].reshape(*lead, n, s // n))  # [..., N, s/N]
        offset += s
    out = jnp.concatenate(pieces, axis=-1).reshape(*lead, total)  # [..., N, F/N] -> [..., F]
    return jnp.moveaxis(out, -1, axis)


def deinterleave(w, sizes: Sequence[int], n: int, axis: int = -1):
    """Inverse of `interleave`: the shard-major tensor back in the single-device layout."""
    if n == 1:
        return w
    w = jnp.moveaxis(jnp.asarray(w), axis, -1)
    out = jnp.concatenate(split_packed(w, sizes, n), axis=-1)
    return jnp.moveaxis(out, -1, axis)
