"""Block-wise FP8 matmul (128 x 128 weight blocks of float8_e4m3fn, a float32 scale each): reference, Pallas
kernel and dispatch.

`fp8_matmul` is the entry point. Up to `DEQUANT_MIN_ROWS` activation rows (decode steps) it is W8A8: the
activations are quantized per row and 128-group at run time and multiplied in FP8; `impl` picks how:
  * "reference": pure jnp (`fp8_matmul_reference`: the FP8 values dequantized, float32 products), any backend;
  * "pallas": the Pallas kernel (`kernel.py`: FP8 tensor-core dots); `interpret=True` runs it in the Pallas
    interpreter (CPU tests);
  * "auto": the kernel on a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper and later), else
    the reference.
Above it (prefill chunks, mixed steps: compute-bound, where cuBLAS's bf16 GEMM beats the kernel), the weight is
dequantized to the activations' dtype and multiplied by XLA (W8A16: `fp8_matmul_dequantized`), on any backend
and for any `impl` but "pallas".
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float

from pallas_kernels.fp8_matmul.kernel import fp8_matmul_pallas
from pallas_kernels.fp8_matmul.reference import (
    BLOCK,
    dequantize_weight,
    fp8_matmul_reference,
    quantize_rows,
    quantize_weight,
)

_IMPLS = ("auto", "reference", "pallas")
DEQUANT_MIN_ROWS = 65  # rows from which `fp8_matmul` dequantizes the weight instead (benchmarks/fp8.py)


def gpu_has_fp8() -> bool:
    """Whether the default backend is a GPU with FP8 tensor cores (compute capability >= 8.9)."""
    if jax.default_backend() != "gpu":
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    major, _, minor = str(capability).partition(".")
    return (int(major), int(minor or 0)) >= (8, 9)


def block_config(m: int) -> dict:
    """The Pallas kernel's configuration for M activation rows (benchmarks/fp8.py times the alternatives)."""
    if m <= 64:
        return dict(block_n=64, split_k=None, prequantized=True, num_warps=4, num_stages=3)
    return dict(block_m=64, block_n=128, split_k=1, prequantized=True, num_warps=4, num_stages=3)


def fp8_matmul_dequantized(x: Float[Array, "M K"], w: Array, scale: Float[Array, "NB KB"], n: int) -> Float[Array, "M N"]:
    """`x @ W` with `W` dequantized to `x.dtype` first (one XLA fusion), the activations as they are (W8A16)."""
    return x @ dequantize_weight(w, scale, n).astype(x.dtype)


def fp8_matmul(x: Float[Array, "M K"], w: Array, scale: Float[Array, "NB KB"], *, n: int, impl: str = "auto",
               interpret: bool = False, **tuning) -> Float[Array, "M N"]:
    """`x @ W` for a weight held as `quantize_weight` holds it (`w [Npad, K]` float8_e4m3fn, `scale [Npad/128,
    K/128]`, `n` its true output dim); the result in `x.dtype`. `tuning` (block_m, block_n, num_warps,
    num_stages) goes to the Pallas kernel (default: `block_config(M)`)."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown fp8_matmul {impl=}; choose one of {_IMPLS}")
    if impl != "pallas" and x.shape[0] >= DEQUANT_MIN_ROWS:
        return fp8_matmul_dequantized(x, w, scale, n)
    if impl == "auto":
        impl = "pallas" if gpu_has_fp8() else "reference"
    if impl == "reference":
        return fp8_matmul_reference(x, w, scale, n)
    return fp8_matmul_pallas(x, w, scale, n=n, interpret=interpret, **(tuning or block_config(x.shape[0])))


__all__ = ["BLOCK", "DEQUANT_MIN_ROWS", "dequantize_weight", "fp8_matmul", "fp8_matmul_dequantized", "fp8_matmul_pallas",
           "fp8_matmul_reference", "gpu_has_fp8", "quantize_rows", "quantize_weight"]
