"""FP8 weights: which projections run as block-wise FP8 matmuls, and `linear`, the matmul every layer calls.

`quantize_params(params)` replaces each dense projection of the packed parameters (attention qkv / o, the
linear mixers' in / out projections, dense and shared-expert MLPs) whose input dim is a multiple of 128 by an
`Fp8Weight`: 128 x 128 blocks of float8_e4m3fn with a float32 scale each (pallas_kernels/fp8_matmul). Both
`--quantization fp8` on a bf16 checkpoint and FP8 checkpoints take this path: an FP8 checkpoint is dequantized
block by block at load (converters/fp8.py; float32 products, then the load dtype), packed, then quantized again
here; where the packed matrix's blocks are the checkpoint's blocks (the published 128-aligned layouts) and the
checkpoint's scales are amax / 448 (DeepSeek's and transformers' recipe), that gives back the checkpoint's own
FP8 values (and its scales to the load dtype's rounding: bf16's, at most 2^-8, moves no e4m3 value to a
neighbour, whose spacing is 2^-3).

Left in the load dtype: embeddings and the LM head, routers and MoE experts (their matmuls are einsums over
experts; no grouped FP8 kernel yet), norms, convolutions, biases, and projections whose input dim is not a
multiple of 128.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jaxtyping import Array, Float

from pallas_kernels.fp8_matmul import BLOCK, fp8_matmul, quantize_weight

# the projections `quantize_params` converts, by the layer sub-dict holding them
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
    """A `[K, N]` projection (the model's `[in, out]`) held block-wise in FP8: `w [Npad, K]` float8_e4m3fn in
    `[out, in]` order, N padded by zero rows to a multiple of 128; `scale [Npad/128, K/128]` float32."""

    w: Array
    scale: Array
    n: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.w.shape[1], self.n)

    @property
    def dtype(self):
        return self.w.dtype


def linear(x: Float[Array, "... K"], w: Array | Fp8Weight) -> Float[Array, "... N"]:
    """`x @ w`: a plain matmul, or the block-wise FP8 matmul for an `Fp8Weight` (FP8 tensor cores on a GPU that has
    them, else its jnp reference), in `x`'s dtype."""
    if not isinstance(w, Fp8Weight):
        return x @ w
    lead = x.shape[:-1]
    y = fp8_matmul(x.reshape(-1, x.shape[-1]), w.w, w.scale, n=w.n)
    return y.reshape(*lead, w.n)


def quantizable(w: Any) -> bool:
    return isinstance(w, jax.Array) and w.ndim == 2 and w.shape[0] % BLOCK == 0


_quantize = jax.jit(quantize_weight)


def quantize_params(params: dict) -> dict:
    """Packed parameters with `FP8_PROJECTIONS` as `Fp8Weight`s (one projection at a time, each bf16/fp32 matrix
    freed as soon as its FP8 copy exists when nothing else holds it)."""

    def convert(p: dict, names: tuple[str, ...]) -> dict:
        out = dict(p)
        for name in names:
            if quantizable(out.get(name)):
                w = out[name]
                q, s = _quantize(w)
                out[name] = Fp8Weight(q, s, w.shape[1])
        return out

    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for key in ("attn", "gdn", "lightning", "mamba", "mlp"):
            if key in layer:
                layer[key] = convert(layer[key], FP8_PROJECTIONS[key])
        if "shared" in layer.get("mlp", {}):
            layer["mlp"]["shared"] = convert(layer["mlp"]["shared"], FP8_PROJECTIONS["shared"])
        layers.append(layer)
    return {**params, "layers": tuple(layers)}


def num_fp8_weights(params: dict) -> int:
    return sum(isinstance(w, Fp8Weight) for w in jax.tree_util.tree_leaves(params, is_leaf=lambda w: isinstance(w, Fp8Weight)))
