"""Parameter dtypes.

Policy: every parameter is cast to the requested dtype except the Gated DeltaNet decay parameters
`A_log` and `dt_bias`, which stay float32 (a few numbers per layer; the gating math `-exp(A_log) *
softplus(a + dt_bias)` runs in float32, and rounding A_log to bf16 would change the decay rates of an
fp32 checkpoint). Norm weights follow the requested dtype like everything else.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

_NAMES = {
    "float32": np.dtype(np.float32),
    "fp32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "fp16": np.dtype(np.float16),
    "half": np.dtype(np.float16),
    "float": np.dtype(np.float32),
}
SUPPORTED = ("float32", "bfloat16", "float16")
FP32_PARAMS = ("A_log", "dt_bias", "router_bias")  # router_bias: HF keeps e_score_correction_bias in fp32


def resolve_dtype(dtype: Any) -> np.dtype:
    """`"bfloat16"` / `"bf16"` / `jnp.bfloat16` / `np.float32` ... -> a numpy dtype (one of SUPPORTED).

    Raises:
      ValueError: anything else.
    """
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _NAMES:
            return _NAMES[key]
    else:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt is not None and dt.name in SUPPORTED:
            return dt
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {SUPPORTED}")


def dtype_name(dtype: Any) -> str:
    return resolve_dtype(dtype).name


def checkpoint_dtype(config_dtype: Any) -> np.dtype:
    """The default load dtype for a checkpoint whose config.json says `config_dtype` ("dtype" /
    "torch_dtype"): that dtype when it is one of SUPPORTED, else float32 (e.g. absent, "auto", fp8)."""
    try:
        return resolve_dtype(config_dtype)
    except ValueError:
        return np.dtype(np.float32)


def param_dtype(name: str, dtype: np.dtype) -> np.dtype:
    """The dtype jhybrid stores parameter `name` (a flat dotted name) in, given the requested dtype."""
    if name.rsplit(".", 1)[-1] in FP32_PARAMS:
        return np.dtype(np.float32)
    return dtype
