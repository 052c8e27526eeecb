"""FP8 weights: which projections and routed experts are held block-wise in FP8, `linear` (the matmul every layer
calls) and `dequantize` (what the MoE einsums read).

`quantize_params(params)` replaces, in the packed parameters, each dense projection (attention qkv / o, the linear
mixers' in / out projections, dense and shared-expert MLPs) and each routed-expert tensor (`gate_up_proj` /
`up_proj` `[E, D, 2Ie]`, `down_proj` `[E, Ie, D]`) whose input dim is a multiple of 128 by an `Fp8Weight`: 128 x 128
blocks of float8_e4m3fn with a float32 scale each, amax / 448 (pallas_kernels/fp8_matmul; per expert for the
experts). A dense projection runs as a block-wise FP8 matmul (`linear`). Experts run W8A16: grouped by expert
(`jhybrid.models.layers.routed_experts_grouped`, a GPU's path) the kernel reads each routed expert's FP8 tiles and
scales them in registers; on the dense path (`routed_experts_dense`) they are dequantized inside the step, one layer
at a time (`expert_weights`), so no step materialises more than its current layer's experts in the compute dtype.

Both `--quantization fp8` on a bf16 checkpoint and FP8 checkpoints take this path: an FP8 checkpoint is
dequantized block by block as it is read (converters/fp8.py; float32 products, then the load dtype), and each layer
is packed and quantized here as soon as its tensors are read (`jhybrid.model_loader.load`), so the device never
holds more than the FP8 model plus one layer in the load dtype. Where the packed matrix's blocks are the
checkpoint's blocks (the published 128-aligned layouts) and the checkpoint's scales are amax / 448 (DeepSeek's and
transformers' recipe), that gives back the checkpoint's own FP8 values (and its scales to the load dtype's rounding:
bf16's, at most 2^-8, moves no e4m3 value to a neighbour, whose spacing is 2^-3).

Under N-way tensor parallelism (`quantize_params(params, fp8_layout(cfg, N))`) a projection is quantized only
where its split falls on whole 128-blocks (`jhybrid.parallel.sharding.fp8_splittable`): then its FP8 values and
scales are split (and permuted shard-major) block by block, so every device holds the same blocks the single-device
model does, and `linear` runs per shard; experts split along the expert axis.

Left in the load dtype: embeddings and the LM head, routers and shared-expert gates, norms, convolutions, biases,
projections and expert tensors whose input dim is not a multiple of 128, and under tensor parallelism projections
whose split is not 128-aligned (`unquantized` lists them with the reason).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from pallas_kernels.fp8_matmul import BLOCK, dequantize_weight, fp8_matmul, quantize_weight

# the projections `quantize_params` converts, by the layer sub-dict holding them (in an MoE `mlp`: the experts)
FP8_PROJECTIONS = {
    "attn": ("qkv_proj", "o_proj"),
    "gdn": ("in_proj", "out_proj"),
    "lightning": ("in_proj", "out_proj"),
    "mamba": ("in_proj", "out_proj"),
    "mlp": ("gate_up_proj", "up_proj", "down_proj"),
    "shared": ("gate_up_proj", "up_proj", "down_proj"),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A `[K, N]` projection (the model's `[in, out]`), or a stack `[E, K, N]` of routed experts, held block-wise in
    FP8: `w [..., Npad, K]` float8_e4m3fn in `[out, in]` order, N padded by zero rows to a multiple of 128;
    `scale [..., Npad/128, K/128]` float32.

    `mesh` and `split_axis`: set by `jhybrid.parallel.shard_params` on a projection it splits over a tensor-parallel
    mesh (`split_axis` 0: `w`'s rows, column-parallel; 1: its columns, row-parallel), so that `linear` runs the FP8
    matmul per shard."""

    w: Array
    scale: Array
    n: int = dataclasses.field(metadata=dict(static=True))
    mesh: Any = dataclasses.field(default=None, metadata=dict(static=True))
    split_axis: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.w.shape[:-2], self.w.shape[-1], self.n)

    @property
    def dtype(self):
        return self.w.dtype


# XLA's GPU simplifier rewrites a dot of fewer multiply-adds than this as an elementwise product over the whole
# weight plus a reduction (two kernels, three times the weight's bytes): at one row that is every projection of
# 4096 x 2048 or less, 27 us instead of ~6 us on the H200 (issue 20, `benchmarks/device_loop.py`). `linear` pads
# the rows of such a dot up to this size when its weight is large enough to matter; 0 turns that off.
MIN_GEMM_MACS = 10_000_000
_MIN_PADDED_WEIGHT = 1 << 20  # elements: smaller weights (routers, gates) are cheap either way
# A plain projection of at most `gemv.MAX_ROWS` rows (a decode step) as `pallas_kernels.decode_linear.gemv_pallas`
# (a split-K GEMV kernel) instead of XLA's GEMM, on a GPU, for the weight shapes where it was measured faster on the
# H200 (`gemv.MEASURED_TILES`, with their tiles). JHYBRID_DECODE_GEMV=1 turns it on.
DECODE_GEMV = os.environ.get("JHYBRID_DECODE_GEMV", "0") == "1"


def _gemm_rows(m: int, k: int, n: int) -> int:
    """The rows `x` is padded to for a `[m, k] x [k, n]` dot (m itself when no padding is needed)."""
    if not MIN_GEMM_MACS or m * k * n >= MIN_GEMM_MACS or k * n < _MIN_PADDED_WEIGHT:
        return m
    return -(-MIN_GEMM_MACS // (k * n)) + 1  # the threshold's comparison is not ours to rely on: one row more


def _gemv_tiles(x: Array, w: Array) -> dict | None:
    """The tiles with which `linear` runs `x @ w` as the GEMV kernel (`DECODE_GEMV` on), or None for XLA's GEMM: a
    GPU's, or a CPU test's (interpreted, `GEMV_ON_CPU`), few rows, a weight shape with measured tiles
    (`gemv.tiles_for`). (Not for tensor parallelism yet: XLA would gather a sharded weight for the kernel.)"""
    from pallas_kernels.decode_linear.gemv import MAX_ROWS, supported, tiles_for

    if (jax.default_backend() != "gpu" and not GEMV_ON_CPU) or x.shape[0] > MAX_ROWS:
        return None
    tiles = tiles_for(*w.shape)
    ok = tiles is not None and x.dtype == w.dtype and supported(x.shape[0], *w.shape, *tiles.values())
    return tiles if ok else None


GEMV_ON_CPU = False  # tests: let `DECODE_GEMV` run the kernel interpreted on the CPU


def linear(x: Float[Array, "... K"], w: Array | Fp8Weight) -> Float[Array, "... N"]:
    """`x @ w`: a plain matmul, or the block-wise FP8 matmul for an `Fp8Weight` (FP8 tensor cores on a GPU that has
    them, else its jnp reference), in `x`'s dtype; per shard (`jax.shard_map`) for a weight split over a mesh. A
    plain matmul of few rows is padded with zero rows up to a GEMM's size (`MIN_GEMM_MACS`)."""
    if not isinstance(w, Fp8Weight):
        if x.ndim == 2 and w.ndim == 2:
            if DECODE_GEMV and (tiles := _gemv_tiles(x, w)) is not None:
                from pallas_kernels.decode_linear.gemv import gemv_pallas

                return gemv_pallas(x, w, interpret=jax.default_backend() != "gpu", **tiles)
            rows = _gemm_rows(x.shape[0], *w.shape)
            if rows > x.shape[0]:
                return (jnp.pad(x, ((0, rows - x.shape[0]), (0, 0))) @ w)[: x.shape[0]]
        return x @ w
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])  # [M, K]
    y = fp8_matmul(x, w.w, w.scale, n=w.n) if w.mesh is None else _per_shard(w)(x, w.w, w.scale)
    return y.reshape(*lead, w.n)


def in_projection(x: Array, w: Array, io: dict | None) -> Array:
    """A mixer's in projection: `linear`, or with `io` (`jhybrid.models.hybrid._fused_io`: a decode step) the
    layer's input norm and the projection in one kernel (`pallas_kernels.decode_linear`)."""
    if io is None:
        return linear(x, w)
    from pallas_kernels.decode_linear import decode_linear

    return decode_linear(x, w, norm_w=io["norm_w"], eps=io["eps"], zero_centred=io["zero_centred"], impl="pallas",
                         interpret=io["interpret"])


def out_projection(x: Array, w: Array, io: dict | None) -> Array:
    """A mixer's out projection: `linear`, or with `io` the projection plus the residual stream (`io["residual"]`)
    in one kernel: the layer's residual add done."""
    if io is None:
        return linear(x, w)
    from pallas_kernels.decode_linear import decode_linear

    return decode_linear(x, w, residual=io["residual"], impl="pallas", interpret=io["interpret"])


def _per_shard(w: Fp8Weight):
    """The FP8 matmul of `w` run by each device on its blocks: column-parallel, its output columns of the whole
    input; row-parallel, its part of K (whole 128-groups, so the activations quantize as on one device), the partial
    products summed over the mesh."""
    (axis,) = w.mesh.axis_names

    def column(x, q, s):  # x [M, K], q [N/S, K]: this device's output columns (no padding: N/S is whole blocks)
        return fp8_matmul(x, q, s, n=q.shape[0])

    def row(x, q, s):  # x [M, K/S], q [Npad, K/S]: this device's share of the sums
        return jax.lax.psum(fp8_matmul(x, q, s, n=w.n), axis)

    if w.split_axis == 0:
        return jax.shard_map(column, mesh=w.mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P(None, axis),
                             check_vma=False)
    return jax.shard_map(row, mesh=w.mesh, in_specs=(P(None, axis),) * 3, out_specs=P(), check_vma=False)


def dequantize(w: Fp8Weight, dtype) -> Array:
    """`w`'s values `[..., K, N]` in `dtype` (float32 products of the FP8 values and their block scales)."""
    fn = functools.partial(dequantize_weight, n=w.n)
    for _ in range(w.w.ndim - 2):
        fn = jax.vmap(fn)
    return fn(w.w, w.scale).astype(dtype)


def expert_weights(x: Array, *ws: Array | Fp8Weight) -> tuple[Array, ...]:
    """A layer's routed-expert tensors as the MoE einsums read them, in `x`'s dtype: an `Fp8Weight` dequantized here,
    inside the step. An optimization barrier ties the FP8 tensors to `x` (this layer's input), so XLA cannot
    dequantize them before the layer runs, i.e. every layer's experts up front: one layer's exist at a time."""
    if not any(isinstance(w, Fp8Weight) for w in ws):
        return ws
    _, ws = jax.lax.optimization_barrier((x, ws))
    return tuple(dequantize(w, x.dtype) if isinstance(w, Fp8Weight) else w for w in ws)


def quantizable(w: Any) -> bool:
    """A plain `[K, N]` or `[E, K, N]` array whose input dim K is a multiple of 128."""
    return isinstance(w, (jax.Array, np.ndarray)) and w.ndim in (2, 3) and w.shape[-2] % BLOCK == 0


_quantize = jax.jit(quantize_weight)
_quantize_experts = jax.jit(lambda w: jax.lax.map(quantize_weight, w))  # one expert at a time: small temporaries


def quantize_weight_tree(w: Array) -> Fp8Weight:
    """`w [K, N]` or `[E, K, N]` as an `Fp8Weight`."""
    q, s = (_quantize if w.ndim == 2 else _quantize_experts)(w)
    return Fp8Weight(q, s, w.shape[-1])


def candidates(layer: dict) -> list[tuple[str, str, Any]]:
    """`(sub-dict key, name, leaf)` of each leaf of a packed layer that `quantize_layer` may convert; key "shared"
    for the shared expert (in `layer["mlp"]["shared"]`), "experts" for routed experts (in `layer["mlp"]`)."""
    out = []
    for key in ("attn", "gdn", "lightning", "mamba", "mlp"):
        p = layer.get(key, {})
        kind = "experts" if key == "mlp" and "router" in p else key
        out += [(kind, name, p[name]) for name in FP8_PROJECTIONS[key] if name in p]
        if "shared" in p:
            out += [("shared", name, p["shared"][name]) for name in FP8_PROJECTIONS["shared"] if name in p["shared"]]
    return out


def quantize_layer(layer: dict, splittable: Callable[[dict], dict] | None = None) -> dict:
    """A packed layer with its `candidates` as `Fp8Weight`s where `quantizable` (and, under tensor parallelism, where
    `splittable(layer)`, a tree of bools like the layer's: `jhybrid.parallel.fp8_layout`, says their split falls on
    whole blocks), one at a time (each bf16/fp32 tensor freed as soon as its FP8 copy exists when nothing else holds
    it). FP8 leaves are kept as they are."""
    ok = splittable(layer) if splittable is not None else None
    layer = {k: ({**v, "shared": dict(v["shared"])} if "shared" in v else dict(v)) if isinstance(v, dict) else v
             for k, v in layer.items()}
    for kind, name, w in candidates(layer):
        key = "mlp" if kind == "experts" else kind
        if not quantizable(w) or (ok is not None and not _at(ok, key, name)):
            continue
        p = layer["mlp"]["shared"] if kind == "shared" else layer[key]
        p[name] = quantize_weight_tree(w)
    return layer


def _at(tree: dict, key: str, name: str) -> Any:
    return tree["mlp"]["shared"][name] if key == "shared" else tree[key][name]


def quantize_params(params: dict, splittable: Callable[[dict], dict] | None = None) -> dict:
    """Packed parameters with every layer through `quantize_layer`."""
    return {**params, "layers": tuple(quantize_layer(layer, splittable) for layer in params["layers"])}


def num_fp8_weights(params: dict, experts: bool | None = None) -> int:
    """How many `Fp8Weight`s `params` holds: all (`experts=None`), routed-expert stacks only (True) or 2-D
    projections only (False)."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda w: isinstance(w, Fp8Weight))
    return sum(isinstance(w, Fp8Weight) and (experts is None or (w.w.ndim == 3) == experts) for w in leaves)


def unquantized(params: dict, tensor_parallel_size: int = 1) -> dict[str, str]:
    """`{"layers.i.key.name": why}` of the `candidates` `params` holds in the load dtype: the input dim not a multiple
    of 128, or (when it is) a split over `tensor_parallel_size` devices that is not 128-aligned."""
    out = {}
    for i, layer in enumerate(params["layers"]):
        for kind, name, w in candidates(layer):
            if isinstance(w, Fp8Weight):
                continue
            key = {"experts": "mlp", "shared": "mlp.shared"}.get(kind, kind)
            if w.shape[-2] % BLOCK:
                why = f"input dim {w.shape[-2]} is not a multiple of {BLOCK}"
            elif tensor_parallel_size > 1:
                why = f"its {tensor_parallel_size}-way tensor-parallel split is not on whole {BLOCK}-blocks"
            else:
                why = "not quantized"
            out[f"layers.{i}.{key}.{name}"] = why
    return out
