"""Moves the prefix cache's blocks and snapshots between the device state and the host tier (`TierOps`, decided by
`jhybrid.cache.prefix_cache.PrefixCache` during `schedule()`).

Demotions (`PrefixTierMover.demote`, before the step that reuses the device blocks and snapshot slots): one jitted
gather of the blocks (every full layer's K and V pages) and one of the snapshot rows (every linear layer's conv and
recurrent state), whose copies to the host start at once (`copy_to_host_async`); `flush()` stores them in the host
tier's NumPy arrays after the engine has read the previous step (the gather was queued right behind it), skipping a
move whose host block or slot has changed hands since (the cache gave it to swapping, or evicted it again).

Promotions (`promote`, before the step, after the demotions so that a device block demoted and reused in one step
is read before it is overwritten, and before an offload's gather, which may read a promoted block): the host blocks
are written into their new device blocks and host snapshots into the sequences' slots by one jitted scatter each.
Their host data arrived in an earlier step's `flush`: a block or slot demoted in this step is never promoted in it
(the cache does not offer it), and a promoted node's host block is freed only at the next step, so no pending
demotion writes the rows read.

Every program takes its index lists padded with the null page / null slot to a power of 4 (at most
`MAX_ROWS`, longer lists go in pieces), so a server compiles them once, at warm-up (`warm`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np
from jaxtyping import Array, Int

from jhybrid.cache.host_tier import HostTier
from jhybrid.cache.prefix_cache import TierOps
from jhybrid.cache.state import HybridState

MAX_ROWS = 64  # the largest padded index list of one call


def buckets() -> list[int]:
    """The padded sizes the programs are built for: powers of 4 up to `MAX_ROWS`."""
    out, n = [], 1
    while n <= MAX_ROWS:
        out.append(n)
        n *= 4
    return out


def _pieces(ops: list[tuple], column: int) -> list[tuple[np.ndarray, list[tuple]]]:
    """`ops` in pieces of at most MAX_ROWS, each with the index array of its `column`, padded with 0 (the null
    page or slot) to a bucket size."""
    out = []
    for at in range(0, len(ops), MAX_ROWS):
        piece = ops[at : at + MAX_ROWS]
        size = next(b for b in buckets() if b >= len(piece))
        ids = np.zeros(size, np.int32)
        ids[: len(piece)] = [op[column] for op in piece]
        out.append((ids, piece))
    return out


@jax.jit
def gather_blocks(state: HybridState, ids: Int[Array, "N"]):
    """`(k, v)`: every full layer's pages `ids`, `[N, BS, KVH, hd]` each."""
    return tuple(k[ids] for k in state.k_pages), tuple(v[ids] for v in state.v_pages)


@jax.jit
def gather_rows(state: HybridState, ids: Int[Array, "N"]):
    """`(conv, ssm)`: every linear layer's state rows `ids`."""
    return tuple(c[ids] for c in state.conv), tuple(s[ids] for s in state.ssm)


@functools.partial(jax.jit, donate_argnums=0)
def scatter_blocks(state: HybridState, ids: Int[Array, "N"], k, v) -> HybridState:
    return dataclasses.replace(
        state,
        k_pages=tuple(p.at[ids].set(x.astype(p.dtype)) for p, x in zip(state.k_pages, k, strict=True)),
        v_pages=tuple(p.at[ids].set(x.astype(p.dtype)) for p, x in zip(state.v_pages, v, strict=True)),
    )


@functools.partial(jax.jit, donate_argnums=0)
def scatter_rows(state: HybridState, ids: Int[Array, "N"], conv, ssm) -> HybridState:
    return dataclasses.replace(
        state,
        conv=tuple(c.at[ids].set(x) for c, x in zip(state.conv, conv, strict=True)),
        ssm=tuple(s.at[ids].set(x) for s, x in zip(state.ssm, ssm, strict=True)),
    )


class PrefixTierMover:
    """Runs `TierOps` against the device state and `host`'s arrays."""

    def __init__(self, host: HostTier):
        self.host = host
        self.has_kv, self.has_state = bool(host.k), bool(host.conv)
        self._pending: list[tuple[str, list, tuple]] = []  # ("blocks" | "rows", the ops of a piece, device data)
        # engine-thread seconds and bytes: demotions (gather dispatch + flush) and promotions (read + scatter dispatch)
        self.seconds_out = self.seconds_in = 0.0
        self.bytes_out = self.bytes_in = 0

    def demote(self, state: HybridState, ops: TierOps) -> None:
        """Gathers the demoted blocks and snapshot rows (reading `state` as it stands) and starts their copies."""
        t0 = time.perf_counter()
        if self.has_kv:
            for ids, piece in _pieces(ops.demote_blocks, 0):
                self._start("blocks", piece, gather_blocks(state, ids))
        if self.has_state:
            for ids, piece in _pieces(ops.demote_snapshots, 0):
                self._start("rows", piece, gather_rows(state, ids))
        self.seconds_out += time.perf_counter() - t0

    def _start(self, kind: str, piece: list, data) -> None:
        for leaf in jax.tree.leaves(data):
            leaf.copy_to_host_async()
        self._pending.append((kind, piece, data))

    def flush(self) -> None:
        """Stores the arrived demotions in the host arrays (waits for them), in the order they were decided; a move
        whose node no longer owns its host block or slot is skipped."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        host = self.host
        for kind, piece, (a, b) in self._pending:
            if kind == "blocks":
                keep = [(row, dst) for row, (_, dst, node) in enumerate(piece) if node.alive and node.host_block == dst]
                pools = host.k + host.v
            else:
                keep = [(row, dst) for row, (_, dst, node) in enumerate(piece)
                        if node.alive and node.host_snapshot == dst]
                pools = host.conv + host.ssm
            if keep:
                rows, dsts = (list(x) for x in zip(*keep, strict=True))
                for pool, x in zip(pools, (*a, *b), strict=True):
                    pool[dsts] = np.asarray(x)[rows]
                self.bytes_out += len(rows) * (host.block_bytes if kind == "blocks" else host.slot_bytes)
        self._pending.clear()
        self.seconds_out += time.perf_counter() - t0

    def promote(self, state: HybridState, ops: TierOps) -> HybridState:
        """Writes promoted host blocks into their device blocks and host snapshots into sequence slots."""
        if not (ops.promote_blocks or ops.host_restores):
            return state
        t0 = time.perf_counter()
        host = self.host  # (their data arrived in an earlier step's flush: nothing pending writes these rows)
        self.bytes_in += len(ops.promote_blocks) * host.block_bytes + len(ops.host_restores) * host.slot_bytes
        if self.has_kv:
            for ids, piece in _pieces(ops.promote_blocks, 1):
                src = [op[0] for op in piece]
                k = tuple(_padded(pool, src, len(ids)) for pool in host.k)
                v = tuple(_padded(pool, src, len(ids)) for pool in host.v)
                state = scatter_blocks(state, ids, k, v)
        if self.has_state:
            for ids, piece in _pieces(ops.host_restores, 1):
                src = [op[0] for op in piece]
                conv = tuple(_padded(pool, src, len(ids)) for pool in host.conv)
                ssm = tuple(_padded(pool, src, len(ids)) for pool in host.ssm)
                state = scatter_rows(state, ids, conv, ssm)
        self.seconds_in += time.perf_counter() - t0
        return state

    def warm(self, state: HybridState) -> HybridState:
        """Compiles every program at every bucket size (on the null page and slot only: their data is padding
        anyway); returns the state."""
        host = self.host
        for size in buckets():
            ids = np.zeros(size, np.int32)
            if self.has_kv:
                k, v = gather_blocks(state, ids)
                state = scatter_blocks(state, ids, tuple(_padded(p, [], size) for p in host.k),
                                       tuple(_padded(p, [], size) for p in host.v))
                del k, v
            if self.has_state:
                conv, ssm = gather_rows(state, ids)
                state = scatter_rows(state, ids, tuple(_padded(p, [], size) for p in host.conv),
                                     tuple(_padded(p, [], size) for p in host.ssm))
                del conv, ssm
        return jax.block_until_ready(state)


def _padded(pool: np.ndarray, rows: list[int], size: int) -> np.ndarray:
    """`pool[rows]` padded with zero rows to `size` (the padding is written into the null page or slot)."""
    out = np.zeros((size, *pool.shape[1:]), pool.dtype)
    if rows:
        out[: len(rows)] = pool[rows]
    return out
