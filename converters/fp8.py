"""Block-wise FP8 checkpoints: e4m3 weights with per-block scales, dequantized at load.

The layout (transformers' `finegrained_fp8` integration; Qwen3-Next-80B-A3B-Instruct-FP8, DeepSeek-V3):
`config.json` has `quantization_config: {quant_method: "fp8", weight_block_size: [b0, b1], ...}`
(validated by `jhybrid.config_fields.read_quantization_config`); a quantized linear weight `X.weight [out, in]`
is stored as float8_e4m3fn next to `X.weight_scale_inv [ceil(out/b0), ceil(in/b1)]` (float32), and

    W[i, j] = float(X.weight[i, j]) * X.weight_scale_inv[i // b0, j // b1]

(a partial last block uses its block's scale). Fused expert tensors `experts.gate_up_proj [E, out, in]` carry
`experts.gate_up_proj_scale_inv [E, ceil(out/b0), ceil(in/b1)]`. Modules listed in `modules_to_not_convert`
(matched as transformers matches them: a prefix up to a module boundary, a regex, or a suffix) stay in their
unquantized dtype; the embeddings, LM head, norms, routers and conv weights of the published checkpoints do.

Which tensors are FP8 is read from the files (their dtype), then checked: every e4m3 tensor has its scale of
the implied shape and is not in `modules_to_not_convert`; every scale belongs to an e4m3 tensor; no static
activation scales. The product is computed in float32 (one rounding, as transformers' `Fp8Dequantize`), then
cast to the load dtype with the other parameters; the scales are consumed, never reported as unexpected. With
`quantization` fp8 the loader then packs each layer and quantizes it again to 128 x 128 blocks as soon as it is read
(`jhybrid.model_loader.load`, `jhybrid.models.quant`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from converters.plan import ConversionError, format_problems

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_FLOAT8 = (E4M3, np.dtype(ml_dtypes.float8_e5m2))
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
_ACTIVATION_SCALES = (".input_scale", ".activation_scale")


def scale_name(weight: str) -> str:
    """`X.weight` -> `X.weight_scale_inv`; a fused parameter `X.gate_up_proj` -> `X.gate_up_proj_scale_inv`."""
    return weight.removesuffix(".weight") + ".weight_scale_inv" if weight.endswith(".weight") else weight + "_scale_inv"


def _module(weight: str) -> str:
    """The module a stored weight belongs to: `a.b.weight` -> `a.b`; fused experts `a.experts.down_proj` -> `a.experts`."""
    return weight.removesuffix(".weight") if weight.endswith(".weight") else weight.rsplit(".", 1)[0]


def skipped(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether `module` matches `modules_to_not_convert` as transformers' `should_convert_module` matches it."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in patterns)


@dataclasses.dataclass(frozen=True)
class FP8Weights:
    """The FP8 tensors of one checkpoint: `{on-disk weight name: on-disk scale name}` and the block size."""

    block: tuple[int, int]
    scales: dict[str, str]

    def read(self, ckpt: Any, name: str) -> np.ndarray:
        """Tensor `name` of `ckpt`, dequantized to float32 when it is stored in FP8 (else as stored)."""
        w = ckpt.read(name)
        scale = self.scales.get(name)
        return w if scale is None else dequantize(w, ckpt.read(scale), self.block)

    def read_device(self, ckpt: Any, name: str):
        """As `read`, as a JAX array on the default device: an FP8 weight goes there as stored (1 byte per
        element) and is dequantized there, the same float32 products as the host path (`read`), which is far
        slower: numpy's float32 products on one core."""
        w = ckpt.read(name)
        scale = self.scales.get(name)
        return jnp.asarray(w) if scale is None else _dequantize_device(jnp.asarray(w), jnp.asarray(ckpt.read(scale)), self.block)


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`w [..., R, C]` (FP8) times its per-block scales `[..., ceil(R/b0), ceil(C/b1)]`, in float32."""
    b0, b1 = block
    *lead, rows, cols = w.shape
    s = np.asarray(scale_inv, np.float32)
    x = w.astype(np.float32)
    if rows % b0 == 0 and cols % b1 == 0:  # whole blocks: scale a [.., R/b0, b0, C/b1, b1] view in place
        blocks = x.reshape(*lead, rows // b0, b0, cols // b1, b1)
        blocks *= s[..., :, None, :, None]
        return x
    x *= np.repeat(np.repeat(s, b0, axis=-2)[..., :rows, :], b1, axis=-1)[..., :cols]  # partial last blocks
    return x


@functools.partial(jax.jit, static_argnums=2)
def _dequantize_device(w, scale_inv, block: tuple[int, int]):
    """`dequantize` on the device (compiled once per shape: a checkpoint has a handful)."""
    rows, cols = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block[0], axis=-2)[..., :rows, :], block[1], axis=-1)
    return w.astype(jnp.float32) * s[..., :cols]


def pair_scales(ckpt: Any, quant: dict[str, Any] | None) -> FP8Weights | None:
    """Pairs every float8 tensor of `ckpt` (a `SafetensorsCheckpoint`) with its scale, checking the layout.

    Args:
      ckpt: the opened checkpoint (headers only are read).
      quant: `read_quantization_config(config)`: None for an unquantized checkpoint.

    Raises:
      ConversionError: naming each float8 tensor without a quantization_config, without its scale, with a
        mis-shaped scale or listed in modules_to_not_convert; each scale without its FP8 weight; static
        activation scales.
    """
    names = ckpt.names()
    fp8 = [n for n in names if ckpt.dtype(n) in _FLOAT8]
    if quant is None:
        if fp8:
            raise ConversionError(
                f"{ckpt.path}: {len(fp8)} tensor(s) stored in float8 (e.g. {fp8[0]!r}) but config.json has no "
                "quantization_config: jhybrid cannot tell how to scale them"
            )
        return None
    block, skip = tuple(quant["weight_block_size"]), tuple(quant["modules_to_not_convert"])
    problems, scales = [], {}
    for name in fp8:
        shape, scale = ckpt.shape(name), scale_name(name)
        if ckpt.dtype(name) != E4M3:
            problems.append(f"{name!r} is {ckpt.dtype(name).name}; quantization_config (fp8) reads float8_e4m3fn weights")
        elif len(shape) < 2:
            problems.append(f"{name!r} with shape {shape}: a block-wise FP8 weight has at least 2 dims")
        elif scale not in ckpt.tensors:
            problems.append(f"{name!r} is stored in FP8 but its scale {scale!r} is missing")
        else:
            want = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
            if ckpt.shape(scale) != want or ckpt.dtype(scale) not in _SCALE_DTYPES:
                problems.append(
                    f"scale {scale!r} is {ckpt.dtype(scale).name} {ckpt.shape(scale)}; weight {name!r} {shape} with "
                    f"weight_block_size {list(block)} needs float32 {want}"
                )
            elif skip and skipped(_module(name), skip):
                problems.append(f"{name!r} is stored in FP8 but modules_to_not_convert lists its module")
            else:
                scales[name] = scale
    expected = {scale_name(n) for n in fp8}
    for name in names:
        if name.endswith("_scale_inv") and name not in expected:
            problems.append(f"scale {name!r} has no FP8 weight (expected a float8_e4m3fn tensor for it)")
        if name.endswith(_ACTIVATION_SCALES):
            problems.append(f"{name!r}: static activation scales are not supported (activation_scheme 'dynamic' only)")
    if problems:
        what = f"{ckpt.path}: FP8 checkpoint does not match its quantization_config"
        raise ConversionError(format_problems(what, problems), problems)
    return FP8Weights(block, scales)
