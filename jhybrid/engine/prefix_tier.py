"""Moves the prefix cache's blocks and snapshots between the device state and the host tier (`TierOps`, decided by
`jhybrid.cache.prefix_cache.PrefixCache` during `schedule()`), through JAX's pinned host memory.

Demotions (`PrefixTierMover.demote`, before the step that reuses the device blocks and snapshot slots): one jitted
gather of the blocks (every full layer's K and V pages) and one of the snapshot rows (every linear layer's conv and
recurrent state), whose result is put into page-locked host memory (`device_put` to the "pinned_host" memory kind:
an asynchronous DMA; the engine thread never waits for it). The result is a *piece* (the rows of one gather); the
mover remembers where each host block and host slot's data is (piece, row) and for which node.

Promotions (`promote`, before the step, after the demotions so that a device block demoted and reused in one step
is read before it is overwritten, and before an offload's gather, which may read a promoted block): each piece that
holds rows to bring back is put back on the device (asynchronous DMA) and one jitted scatter per piece writes its
rows into the new device blocks, or into the sequences' slots for host snapshots. JAX orders each copy after the one
that produced its data. The host tier's allocator accounts for the blocks and slots (`host_kv_memory_gb`); its NumPy
arrays are not used for these: on the H200 the NumPy path (copies through pageable memory, waited for on the engine
thread) moved 1.2-2.3 GB/s and made a hit from the host about as slow as recomputing it (benchmarks/RESULTS.md,
session 24).

A piece is dropped once none of its rows is still some node's data (`sweep`, every `SWEEP_EVERY` demotions).

Every program takes its index lists padded with the null page / null slot to a power of 4 (at most `MAX_ROWS`,
longer lists go in pieces), so a server compiles them once, at warm-up (`warm`).
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
from jhybrid.engine.offload import gather_blocks
from jhybrid.engine.swap import _to_pinned

MAX_ROWS = 64  # the largest padded index list of one call
SWEEP_EVERY = 4096  # rows demoted between two sweeps of the pieces


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
def gather_rows(state: HybridState, ids: Int[Array, "N"]):
    """`(conv, ssm)`: every linear layer's state rows `ids`."""
    return tuple(c[ids] for c in state.conv), tuple(s[ids] for s in state.ssm)


@functools.partial(jax.jit, donate_argnums=0)
def scatter_blocks_from(state: HybridState, data, src: Int[Array, "N"], dst: Int[Array, "N"]) -> HybridState:
    """Pages `dst` of every full layer get rows `src` of `data` (`gather_blocks`' output, on the device)."""
    k, v = data
    return dataclasses.replace(
        state,
        k_pages=tuple(p.at[dst].set(x[src].astype(p.dtype)) for p, x in zip(state.k_pages, k, strict=True)),
        v_pages=tuple(p.at[dst].set(x[src].astype(p.dtype)) for p, x in zip(state.v_pages, v, strict=True)),
    )


@functools.partial(jax.jit, donate_argnums=0)
def scatter_rows_from(state: HybridState, data, src: Int[Array, "N"], dst: Int[Array, "N"]) -> HybridState:
    """State rows `dst` of every linear layer get rows `src` of `data` (`gather_rows`' output, on the device)."""
    conv, ssm = data
    return dataclasses.replace(
        state,
        conv=tuple(c.at[dst].set(x[src]) for c, x in zip(state.conv, conv, strict=True)),
        ssm=tuple(s.at[dst].set(x[src]) for s, x in zip(state.ssm, ssm, strict=True)),
    )


def _to_device(data, like):
    """Starts the copy of pinned host arrays back into device memory, each with the sharding of its counterpart in
    `like` (the state's pages or rows: the scatter's output state then keeps the state's shardings exactly, and the
    programs after it find their compiled versions)."""
    return jax.device_put(data, jax.tree.map(lambda x: x.sharding, like))


class PrefixTierMover:
    """Runs `TierOps` against the device state; the host copies live in pinned host memory."""

    def __init__(self, host: HostTier):
        self.host = host
        self.has_kv, self.has_state = bool(host.k), bool(host.conv)
        self._pieces: dict[int, tuple] = {}  # piece id -> its pinned arrays ((k, v) or (conv, ssm))
        # ("b", host block) or ("s", host slot) -> (piece id, row, node) of the demotion that last wrote it
        self._where: dict[tuple[str, int], tuple[int, int, object]] = {}
        self._ids = 0  # the last piece id
        self._since_sweep = 0
        self._compiled: dict[tuple[str, int], object] = {}  # (program, rows) -> compiled program
        # engine-thread seconds and bytes: demotions (gather + copy dispatch) and promotions (copy + scatter dispatch)
        self.seconds_out = self.seconds_in = 0.0
        self.bytes_out = self.bytes_in = 0

    @property
    def num_pieces(self) -> int:
        return len(self._pieces)

    def demote(self, state: HybridState, ops: TierOps) -> None:
        """Gathers the demoted blocks and snapshot rows (reading `state` as it stands) and starts their copies."""
        t0 = time.perf_counter()
        if self.has_kv:
            for ids, piece in _pieces(ops.demote_blocks, 0):
                self._keep("b", piece, self._run(gather_blocks, state, ids), self.host.block_bytes)
        if self.has_state:
            for ids, piece in _pieces(ops.demote_snapshots, 0):
                self._keep("s", piece, self._run(gather_rows, state, ids), self.host.slot_bytes)
        self.seconds_out += time.perf_counter() - t0

    def _keep(self, kind: str, piece: list, data, row_bytes: int) -> None:
        self._ids += 1
        self._pieces[self._ids] = _to_pinned(data)
        for row, (_, dst, node) in enumerate(piece):
            self._where[(kind, dst)] = (self._ids, row, node)
        self.bytes_out += len(piece) * row_bytes
        self._since_sweep += len(piece)

    def flush(self) -> None:
        """Between steps: drops the pieces no node needs any more, every `SWEEP_EVERY` rows demoted."""
        if self._since_sweep >= SWEEP_EVERY:
            self.sweep()

    def sweep(self) -> None:
        """Drops every piece none of whose rows is still the data of the node it was demoted for."""
        self._since_sweep = 0
        live = set()
        for (kind, dst), (pid, _, node) in list(self._where.items()):
            if node.alive and (node.host_block if kind == "b" else node.host_snapshot) == dst:
                live.add(pid)
            else:
                del self._where[(kind, dst)]
        for pid in [p for p in self._pieces if p not in live]:
            del self._pieces[pid]

    def promote(self, state: HybridState, ops: TierOps) -> HybridState:
        """Writes promoted host blocks into their device blocks and host snapshots into sequence slots."""
        if not (ops.promote_blocks or ops.host_restores):
            return state
        t0 = time.perf_counter()
        if self.has_kv:
            state = self._bring("b", ops.promote_blocks, state, scatter_blocks_from)
        if self.has_state:
            state = self._bring("s", ops.host_restores, state, scatter_rows_from)
        self.bytes_in += len(ops.promote_blocks) * self.host.block_bytes + len(ops.host_restores) * self.host.slot_bytes
        self.seconds_in += time.perf_counter() - t0
        return state

    def _bring(self, kind: str, moves: list[tuple[int, int]], state: HybridState, program) -> HybridState:
        """(host block or slot, device block or slot) moves, grouped by the piece holding each source."""
        by_piece: dict[int, list[tuple[int, int]]] = {}
        for src, dst in moves:
            pid, row, _ = self._where[(kind, src)]
            by_piece.setdefault(pid, []).append((row, dst))
        like = (state.k_pages, state.v_pages) if kind == "b" else (state.conv, state.ssm)
        for pid, rows in by_piece.items():
            data = _to_device(self._pieces[pid], like)
            size = jax.tree.leaves(data)[0].shape[0]
            for at in range(0, len(rows), size):
                chunk = rows[at : at + size]
                src, dst = np.zeros(size, np.int32), np.zeros(size, np.int32)
                src[: len(chunk)], dst[: len(chunk)] = zip(*chunk, strict=True)
                state = self._run(program, state, data, src, dst)
        return state

    def _run(self, program, state, *args):
        """`program(state, *args)` through its compiled form for these shapes, compiled ahead of time like the
        step programs (the first call of a shape compiles it; `warm` makes them all). On one device the state is
        uncommitted (as the step programs return it); a program lowered with uncommitted arguments returns
        uncommitted arrays, so the state keeps one signature whichever program ran last and the runner's jitted
        slot programs find their compiled versions. (Through `jax.jit`, a scatter fed the committed data of a
        pinned copy returned committed state: on the H200 12 programs compiled again after ready.)"""
        key = (program.__name__, args[-1].shape[0])
        compiled = self._compiled.get(key)
        if compiled is None:
            specs = args
            if not jax.tree.leaves(state)[0].committed:
                specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            compiled = self._compiled[key] = program.lower(state, *specs).compile()
        return compiled(state, *args)

    def warm(self, state: HybridState) -> HybridState:
        """Compiles every program at every bucket size and runs the pinned copies once (on the null page and slot
        only: their data is padding anyway); returns the state."""
        for size in buckets():
            ids = np.zeros(size, np.int32)
            if self.has_kv:
                data = _to_device(_to_pinned(self._run(gather_blocks, state, ids)), (state.k_pages, state.v_pages))
                state = self._run(scatter_blocks_from, state, data, ids, ids)
            if self.has_state:
                data = _to_device(_to_pinned(self._run(gather_rows, state, ids)), (state.conv, state.ssm))
                state = self._run(scatter_rows_from, state, data, ids, ids)
        return jax.block_until_ready(state)
