"""A decode step's projections with their neighbours fused: reference, Pallas kernel and dispatch.

`decode_linear(x, w, norm_w=, act=, residual=, impl=...)` is `residual + act(rms_norm(x) @ w)` (each part
optional) in one kernel; `decode_mlp(x, norm_w, w_in, w_down, ...)` a dense MLP block (RMSNorm, up / gate
projection, SwiGLU or relu^2, down projection, residual) in two. `impl`: "reference" (jnp, the model's rounding),
"pallas" (`kernel.py`; at most `MAX_ROWS` rows, K a multiple of 128, the output columns of 16) or "auto": the
kernel on a GPU where it applies and the switch is on (`DECODE_MLP` for the MLP blocks, `DECODE_LINEAR` for the
mixers' in and out projections), else the reference. Both off: on the H200 a batch-1 decode token with them took
40-60% longer than with XLA's kernels (benchmarks/RESULTS.md, "Session 31": the GEMV-shaped programs stream the
weights slower than XLA's GEMMs); JHYBRID_DECODE_MLP=1, JHYBRID_DECODE_LINEAR=1 turn them on.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.decode_linear.kernel import MAX_ROWS, decode_linear_pallas, decode_mlp_pallas, supported
from pallas_kernels.decode_linear.reference import ACTS, decode_linear_reference, decode_mlp_reference

DECODE_MLP = os.environ.get("JHYBRID_DECODE_MLP", "0") == "1"
DECODE_LINEAR = os.environ.get("JHYBRID_DECODE_LINEAR", "0") == "1"
_IMPLS = ("auto", "reference", "pallas")


def linear_supported(x, w, act: str | None = None) -> bool:
    """Static check for `decode_linear`'s kernel (plain weights of the shapes `kernel.supported` takes)."""
    return isinstance(w, jax.Array | jax.ShapeDtypeStruct) and w.ndim == 2 and w.shape[0] == x.shape[1] and supported(
        x.shape[0], x.shape[1], w.shape[1] // (2 if act == "silu" else 1))


def mlp_supported(x, w_in, w_down, act: str) -> bool:
    """Static check for `decode_mlp`'s kernels."""
    return (act in ACTS and linear_supported(x, w_in, act) and w_down.ndim == 2
            and w_in.shape[1] == w_down.shape[0] * (2 if act == "silu" else 1)
            and linear_supported(jax.ShapeDtypeStruct((x.shape[0], w_down.shape[0]), x.dtype), w_down))


def resolve(impl: str, switch: bool, applies: bool, what: str) -> str:
    """The implementation to run for `impl`: "pallas" or "reference" (`switch` decides "auto" on a GPU)."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown {what} {impl=}; choose one of {_IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and switch and applies else "reference"
    if impl == "pallas" and not applies:
        raise ValueError(f"the Pallas {what} needs at most {MAX_ROWS} rows, K a multiple of 128 and the output "
                         "columns of 16; use impl='reference'")
    return impl


def decode_linear(x, w, *, norm_w=None, eps: float = 1e-6, zero_centred: bool = False, act: str | None = None,
                  residual=None, impl: str = "auto", interpret: bool = False, **tuning):
    """Same signature and result as `decode_linear_reference` (`resolve` picks, `DECODE_LINEAR`). `tuning`
    (block_n, block_k, num_warps, num_stages) goes to the kernel."""
    form = dict(norm_w=norm_w, eps=eps, zero_centred=zero_centred, act=act, residual=residual)
    if resolve(impl, DECODE_LINEAR, linear_supported(x, w, act), "decode linear") == "pallas":
        return decode_linear_pallas(x, w, **form, interpret=interpret, **tuning)
    return decode_linear_reference(x, w, **form)


def decode_mlp(x, norm_w, w_in, w_down, *, eps: float, zero_centred: bool, act: str, impl: str = "auto",
               interpret: bool = False, **tuning):
    """Same signature and result as `decode_mlp_reference` (`resolve` picks, `DECODE_MLP`)."""
    form = dict(eps=eps, zero_centred=zero_centred, act=act)
    if resolve(impl, DECODE_MLP, mlp_supported(x, w_in, w_down, act), "decode MLP") == "pallas":
        return decode_mlp_pallas(x, norm_w, w_in, w_down, **form, interpret=interpret, **tuning)
    return decode_mlp_reference(x, norm_w, w_in, w_down, **form)


__all__ = ["ACTS", "DECODE_LINEAR", "DECODE_MLP", "MAX_ROWS", "decode_linear", "decode_linear_pallas",
           "decode_linear_reference", "decode_mlp", "decode_mlp_pallas", "decode_mlp_reference", "linear_supported",
           "mlp_supported", "resolve"]
