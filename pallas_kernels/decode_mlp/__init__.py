"""A decode step's MLP block (RMSNorm, up / gate projection, SwiGLU or relu^2, down projection, residual) in two
kernels: reference, Pallas kernels and dispatch.

`decode_mlp(x, norm_w, w_in, w_down, eps=, zero_centred=, act=, impl=...)`: "reference" (jnp, the model's
rounding), "pallas" (`kernel.py`; at most `MAX_ROWS` rows, D and I multiples of 128) or "auto": the kernels on a
GPU where they apply and `DECODE_MLP` is on, else the reference. Off by default until measured on the H200 against
XLA's five kernels (JHYBRID_DECODE_MLP=1 turns it on).
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.decode_mlp.kernel import decode_mlp_pallas
from pallas_kernels.decode_mlp.reference import ACTS, decode_mlp_reference

DECODE_MLP = os.environ.get("JHYBRID_DECODE_MLP", "0") == "1"
MAX_ROWS = 64  # the kernels keep every row of a tile in registers: decode buckets up to this many rows
_IMPLS = ("auto", "reference", "pallas")


def pallas_supported(x, w_in, w_down, act: str) -> bool:
    """Static check: at most `MAX_ROWS` rows, D and I multiples of 128, the packed shapes of `act`."""
    num_rows, dim = x.shape
    inner = w_down.shape[0]
    return (num_rows <= MAX_ROWS and dim % 128 == 0 and inner % 128 == 0 and act in ACTS
            and w_in.shape == (dim, inner * (2 if act == "silu" else 1)) and w_down.shape == (inner, dim))


def resolve(impl: str, x, w_in, w_down, act: str) -> str:
    """The implementation `decode_mlp` runs for `impl`: "pallas" or "reference"."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown decode MLP {impl=}; choose one of {_IMPLS}")
    if impl == "auto":
        gpu = jax.default_backend() == "gpu"
        return "pallas" if gpu and DECODE_MLP and pallas_supported(x, w_in, w_down, act) else "reference"
    if impl == "pallas" and not pallas_supported(x, w_in, w_down, act):
        raise ValueError(f"the Pallas decode MLP needs at most {MAX_ROWS} rows and D, I multiples of 128, got "
                         f"x {x.shape}, w_in {w_in.shape}, w_down {w_down.shape}; use impl='reference'")
    return impl


def decode_mlp(x, norm_w, w_in, w_down, *, eps: float, zero_centred: bool, act: str, impl: str = "auto",
               interpret: bool = False, **tuning):
    """Same signature and result as `decode_mlp_reference` (`resolve` picks). `tuning` (up_block_n, down_block_n,
    block_k, num_warps, num_stages) goes to the kernels."""
    form = dict(eps=eps, zero_centred=zero_centred, act=act)
    if resolve(impl, x, w_in, w_down, act) == "pallas":
        return decode_mlp_pallas(x, norm_w, w_in, w_down, **form, interpret=interpret, **tuning)
    return decode_mlp_reference(x, norm_w, w_in, w_down, **form)


__all__ = ["ACTS", "DECODE_MLP", "MAX_ROWS", "decode_mlp", "decode_mlp_pallas", "decode_mlp_reference", "pallas_supported",
           "resolve"]
