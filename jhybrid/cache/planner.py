"""Sizes the KV pool and the state slots from one memory budget, each from its own share.

Linear-layer state is not paged: every running sequence needs one slot of fixed size, so the slots
(`max_num_seqs + 1`, the null slot included) are reserved first; the KV pool gets the rest of the budget.
"""

from __future__ import annotations

import os

import jax

from jhybrid.cache.state import CacheConfig
from jhybrid.config import ModelConfig

_CPU_FALLBACK_BYTES = 4 << 30  # a CPU backend reports no memory limit: plan for 4 GiB
# Free memory is rounded down to this, so that two starts of one server plan the same pool whatever few megabytes
# their allocations differ by: the pool's shape is in every step program's cache key, and a pool a few blocks
# larger made a restart with the compilation cache compile every program again (benchmarks/RESULTS.md, "Session 25")
PLAN_GRANULE = 256 << 20


def device_memory_bytes() -> int:
    """Free memory of one of this process's devices, rounded down to `PLAN_GRANULE`. In a multi-process job every
    process must plan the same pool (the same shapes, so the same programs and collectives), so the smallest figure
    of all processes is returned there."""
    stats = jax.local_devices()[0].memory_stats() or {}  # jax.devices()[0] may belong to another process
    if "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    else:
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            host = _CPU_FALLBACK_BYTES
        free = min(_CPU_FALLBACK_BYTES, host // 4)
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        free = int(np.min(multihost_utils.process_allgather(np.int64(free))))
    return free // PLAN_GRANULE * PLAN_GRANULE if free >= 4 * PLAN_GRANULE else free


def plan_cache(
    cfg: ModelConfig,
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    kv_dtype: str,
    num_kv_blocks: int | None = None,
    memory_fraction: float = 0.9,
    free_bytes: int | None = None,
    activation_reserve: float = 0.1,
    num_snapshot_slots: int | None = 0,
    prefix_caching: bool = False,
) -> CacheConfig:
    """The cache sizes. `num_kv_blocks` fixes the pool; otherwise it fills what the budget leaves after the state
    slots and the `num_snapshot_slots` prefix-cache snapshots (each the size of a state slot).

    `num_snapshot_slots=None` (prefix caching of a model with linear layers, no size given): a tenth of the
    budget, and at least `2 * max_num_seqs + 2` (each running sequence may hold a decode snapshot and a pending
    one, which must not push every prompt's snapshot out). `prefix_caching`: the KV pool is not capped at what
    `max_num_seqs` sequences can use, since cached blocks of finished sequences live in the rest.

    Raises ValueError when the budget cannot hold the slots plus one `max_model_len` sequence of KV.
    """
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    num_slots = max_num_seqs + 1
    blocks_per_seq = -(-max_model_len // block_size)
    min_blocks = blocks_per_seq + 1  # one full-length sequence plus the null page
    kv_itemsize = jax.numpy.dtype(kv_dtype).itemsize
    block_bytes = block_size * cfg.kv_bytes_per_token(kv_itemsize)
    least_snapshots = 2 * max_num_seqs + 2
    if num_kv_blocks is None:
        if cfg.num_full_layers == 0:
            num_kv_blocks = min_blocks
        else:
            free = device_memory_bytes() if free_bytes is None else free_bytes
            budget = free * memory_fraction * (1.0 - activation_reserve)
            if num_snapshot_slots is None:
                per = max(cfg.state_bytes_per_sequence(), 1)
                num_snapshot_slots = max(least_snapshots, int(0.1 * budget // per))
            state_bytes = (num_slots + num_snapshot_slots) * cfg.state_bytes_per_sequence()
            num_kv_blocks = int((budget - state_bytes) // block_bytes)
            if not prefix_caching:
                num_kv_blocks = min(num_kv_blocks, max_num_seqs * blocks_per_seq + 1)  # more is never used
            if num_kv_blocks < min_blocks:
                raise ValueError(
                    f"memory budget {budget / 2**30:.2f} GiB holds {num_slots} state slots and {num_snapshot_slots} "
                    f"snapshots "
                    f"({state_bytes / 2**30:.2f} GiB) but not one {max_model_len}-token sequence of KV "
                    f"({min_blocks} blocks of {block_bytes} bytes): lower max_model_len or max_num_seqs"
                )
    elif num_kv_blocks < min_blocks:
        raise ValueError(f"{num_kv_blocks=} cannot hold one {max_model_len=} sequence: need >= {min_blocks}")
    if num_snapshot_slots is None:  # a fixed pool (or no KV): no budget to take a share of
        num_snapshot_slots = least_snapshots
    return CacheConfig(num_blocks=num_kv_blocks, block_size=block_size, num_slots=num_slots, kv_dtype=kv_dtype,
                       num_snapshot_slots=num_snapshot_slots)
