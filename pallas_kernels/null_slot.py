"""State slot 0, the null slot that a step's padding rows point at (README.md): it reads as zeros and is never
written. `load_state` is how the decode kernels read a row's state tile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt


def load_state(ref, slot, mask=None) -> jax.Array:
    """`ref`, a view of one slot's state (e.g. `state_ref.at[slot, head, :, cols]`), in fp32: zeros on the null slot,
    whose load is predicated off, so that a padding row moves none of the state's bytes (and zeros where `mask`,
    broadcastable to the view, is False). (A batch-1 decode step runs in a 4-row bucket: its three padding rows read
    the null slot's tiles, one row's state from memory at least and three through the L2, beside the real row's.)"""
    keep = slot != 0 if mask is None else mask & (slot != 0)
    return plt.load(ref, mask=jnp.broadcast_to(keep, ref.shape), other=0).astype(jnp.float32)
