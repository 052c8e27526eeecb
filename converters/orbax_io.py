"""The params part of a converted jhybrid checkpoint: an orbax checkpoint of a flat
`{dotted jhybrid name: array}` dict (e.g. `"layers.3.attn.q_proj"`), saved from numpy arrays."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def save_flat(path: str | os.PathLike, flat: dict[str, np.ndarray]) -> None:
    """Writes `flat` to the (not yet existing) directory `path`."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.fspath(path)), flat)
        ckptr.wait_until_finished()


def read_metadata(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`{name: (shape, dtype)}` from the checkpoint's metadata; no array data is read."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    with ocp.StandardCheckpointer() as ckptr:
        meta: Any = ckptr.metadata(path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    if tree is None:  # older orbax returns the tree directly
        tree = meta
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: expected a flat dict of arrays, found {type(tree).__name__}")
    return {str(name): (tuple(int(n) for n in m.shape), np.dtype(m.dtype)) for name, m in tree.items()}


def restore_flat(path: str | os.PathLike, metadata: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, Any]:
    """Restores every array onto the default JAX device (whatever device the checkpoint was written on;
    `jax.default_device` picks another, e.g. the CPU for tensor-parallel loading).

    Args:
      metadata: from `read_metadata` (already validated by the caller).
    Returns:
      `{name: jax.Array}` with the stored shapes and dtypes.
    """
    import jax
    import orbax.checkpoint as ocp

    device = jax.config.jax_default_device or jax.devices()[0]
    device = jax.devices(device)[0] if isinstance(device, str) else device  # a platform name
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for name, (shape, dtype) in metadata.items()}
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(os.fspath(path)), target)
