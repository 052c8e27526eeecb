"""The device state pytree: paged KV for full-attention layers, state slots for linear layers.

    k_pages[i], v_pages[i]   [P, BS, KVH, hd]   full-attention layer i (in order of appearance), model dtype
    conv[j]                  [S, C, W-1]        linear layer j: last W-1 conv inputs, fp32
    ssm[j]                   [S, HV, K, V]      linear layer j: recurrent state, fp32

Linear layer j is the j-th layer whose kind is in `LINEAR_KINDS`; shapes differ by kind
(`ModelConfig.linear_state_shapes`): Gated DeltaNet `[S, 2*HK*K + HV*V, W-1]` / `[S, HV, K, V]`; lightning
attention has no conv, so its conv state is a placeholder `[S, 1, 1]` that nothing reads (kept so conv[j] and
ssm[j] stay aligned; why not empty: `ModelConfig.linear_state_shapes`), and `[S, H, hd, hd]`; Mamba2
`[S, Hm*P + 2*G*N, Wm-1]` / `[S, Hm, N, P]` (N = ssm_state_size, the B/C dim, plays K; P = head dim plays V).
A model without full-attention layers has empty `k_pages`/`v_pages`.

With prefix caching the conv / ssm arrays have `num_snapshot_slots` more rows past the sequences' slots
(`CacheConfig.num_state_rows`): snapshots of a sequence's state at a block boundary
(`jhybrid.cache.prefix_cache`), moved by `copy_slots`.

Page 0 and slot 0 are null targets that padding writes into (pallas_kernels/README.md); a slot must be
zeroed (`zero_slots`) when it is handed to a new sequence. Block tables and lengths are per-step metadata
(`jhybrid.models.batch.Batch`), not state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jhybrid.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Sizes of the two caches, fixed once memory is planned."""

    num_blocks: int  # KV pages, page 0 included (reserved)
    block_size: int
    num_slots: int  # state slots, slot 0 included (reserved)
    kv_dtype: str = "bfloat16"
    num_snapshot_slots: int = 0  # prefix-cache state snapshots: state rows num_slots .. num_state_rows - 1

    @property
    def num_state_rows(self) -> int:
        return self.num_slots + self.num_snapshot_slots

    @property
    def snapshot_slots(self) -> range:
        return range(self.num_slots, self.num_state_rows)

    def __post_init__(self):
        if self.num_blocks < 2 or self.num_slots < 2 or self.block_size < 1:
            raise ValueError(
                f"need num_blocks >= 2 and num_slots >= 2 (index 0 is reserved) and block_size >= 1, got "
                f"{self.num_blocks=} {self.num_slots=} {self.block_size=}"
            )
        if self.num_snapshot_slots < 0:
            raise ValueError(f"{self.num_snapshot_slots=} must be >= 0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridState:
    k_pages: tuple[Array, ...]
    v_pages: tuple[Array, ...]
    conv: tuple[Array, ...]
    ssm: tuple[Array, ...]


def init_state(cfg: ModelConfig, cache: CacheConfig) -> HybridState:
    """Zeroed caches for `cfg` sized by `cache`."""
    kv_shape = (cache.num_blocks, cache.block_size, cfg.num_kv_heads, cfg.head_dim)
    shapes = [cfg.linear_state_shapes(kind) for kind in cfg.linear_layer_kinds]
    kv_dtype = jnp.dtype(cache.kv_dtype)
    return HybridState(
        k_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(cfg.num_full_layers)),
        v_pages=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(cfg.num_full_layers)),
        conv=tuple(jnp.zeros((cache.num_state_rows, *conv), jnp.float32) for conv, _ in shapes),
        ssm=tuple(jnp.zeros((cache.num_state_rows, *ssm), jnp.float32) for _, ssm in shapes),
    )


def zero_rows(state: HybridState, rows: Int[Array, "N"]) -> HybridState:
    """Zeroes the linear-layer state (conv and recurrent, every layer) of state rows `rows`; a row past the last
    state row is dropped (padding)."""
    return dataclasses.replace(
        state,
        conv=tuple(c.at[rows].set(0.0, mode="drop") for c in state.conv),
        ssm=tuple(s.at[rows].set(0.0, mode="drop") for s in state.ssm),
    )


@functools.partial(jax.jit, donate_argnums=0)
def zero_slots(state: HybridState, slot_ids: Int[Array, "N"]) -> HybridState:
    """Zeroes the linear-layer state of `slot_ids` (done when slots are handed to new sequences, unless the step
    program does it: `jhybrid.engine.runner.ZERO_IN_STEP`)."""
    return zero_rows(state, slot_ids)


def copy_rows(state: HybridState, src: Int[Array, "N"], dst: Int[Array, "N"]) -> HybridState:
    """Copies the linear-layer state (conv and recurrent, every layer) of state rows `src` into rows `dst`. A pair
    whose `dst` lies past the last state row is dropped (the padding of the snapshot pairs a step program takes
    in, `jhybrid.engine.runner.engine_step`). No row may be both a source and a destination of one call."""
    return dataclasses.replace(
        state,
        conv=tuple(c.at[dst].set(c[src], mode="drop") for c in state.conv),
        ssm=tuple(s.at[dst].set(s[src], mode="drop") for s in state.ssm),
    )


@functools.partial(jax.jit, donate_argnums=0)
def copy_slots(state: HybridState, src: Int[Array, "N"], dst: Int[Array, "N"]) -> HybridState:
    """`copy_rows` as a program of its own (prefix-cache restores, and the snapshots a step program did not take
    in). Padding pairs are (0, 0): the null slot onto itself."""
    return copy_rows(state, src, dst)
