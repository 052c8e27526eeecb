"""Exact prefix caching for hybrid models (host bookkeeping only, no JAX): KV blocks shared by content, and
snapshots of the linear layers' state at block boundaries.

Why snapshots. A full-attention layer can resume from any shared prefix of KV, but a linear layer (Gated
DeltaNet, lightning attention, Mamba2 and their conv state) keeps one fixed-size state that summarises *all*
tokens so far: resuming a prompt at position p needs the state after exactly p tokens of that prefix. So a
hit is the deepest point p where both exist: the KV blocks of positions [0, p) and a state snapshot at p.

The decision (exact, no kernel change): snapshot points are block boundaries. With the cache on, the scheduler ends
every chunk that the step's token budget cuts short on a block boundary (a few tokens less in that step), so a long
prompt also leaves a snapshot at the end of each of its chunks, at no extra step (with `snapshot_interval = N` it
also cuts chunks at every N-th boundary of a long prompt, and with `prompt_end` at the last block boundary strictly
inside each prompt); right after that step the sequence's state slot is copied into a snapshot slot (one device-
side copy of the slot's rows in every linear layer, conv and recurrent state: `jhybrid.cache.state.copy_slots`). A
prompt whose length is a multiple of the block size also snapshots at its end (no cut needed), and a decoding
sequence snapshots each time its fed tokens reach a block boundary (one copy per `block_size` tokens; each new one
replaces the sequence's previous decode snapshot), so a finished sequence leaves the state at its last full block,
where a chat's next turn resumes. And where a lookup matched KV blocks deeper than its deepest snapshot (two
prompts that share a system prompt but were snapshotted only at their own ends), the request's prefill is also cut
and snapshotted at that deepest matched boundary (`PrefixCursor.branch`), so the next request with that prefix hits
there. The same happens to a prompt sent again: without `prompt_end` its second request resumes at its last chunk
end and cuts at its last block boundary, and the third resumes there. The prompt-end cut makes the second one
resume there, but costs every prompt one extra, short chunk (its tail is fed in a later step, which then runs a
mixed program instead of the decode one): about 3.5% of served throughput on the H200 at 64 streams without reuse
(benchmarks/RESULTS.md, session 26), so it is off by default in the engine. A kernel that also wrote the state at a
chosen position inside a chunk would remove the cost; it is left for later.

The index. Full blocks form a trie: a node is one block of `block_size` tokens under its parent (the
prefix before it), keyed by `(parent node id, the block's token ids)` in a dict, so a lookup compares
token ids exactly (no hash collisions). A live node holds its device KV block and optionally a snapshot
slot (the state after its last token). A lookup walks the request's full blocks and returns the deepest
node with a snapshot, at most `len(tokens) - 1` tokens deep (the last token is always fed, for its logits;
partial blocks are never shared); the request then shares the KV blocks of the nodes on the way (reference
count + 1), its state slot is loaded from the snapshot, and its prefill starts at that position. A model
without linear layers needs no snapshot: every matched node is a hit.

Reference counts and eviction. `CachingBlockAllocator` counts the sequences holding each block. A cached
block whose count drops to zero stays cached but evictable, in LRU order (a sequence's blocks are released
tail first, so deeper blocks go first); new allocations take never-cached free blocks first, then evict. A
block in use is never evicted. Evicting a node's block kills the node and all its descendants (their
prefixes lost a block): their snapshots are freed, their unreferenced blocks become free, referenced ones
just stop being cached. Snapshot slots are a separate pool, also LRU, in two segments: snapshots known to
be shared (restored at least once, or taken at a branch point) are evicted only when no other is left, so that
the junk every request leaves (the ends of its prompt chunks, its prompt's end, its last decode snapshot) does
not push out a system prompt's snapshot; a snapshot being restored this step is
pinned, and restores are dispatched before the step and saves after it, so a slot is never overwritten
before it is read. A snapshot whose block is not registered yet (a decode step's fed token is read on the
host a step later) is held by its sequence (`PrefixCursor.pending`) until the block is registered, and freed
when the sequence ends without it.

Safety. Blocks are registered as the steps that write them are scheduled (after that step's admissions, so
a request never shares a block computed in its own step); any later step that reads them is ordered after
by the data dependence of the donated device state. A failed step clears the whole cache
(`PrefixCache.clear`). Requests that ask for prompt log-probabilities are not looked up (they need every
prompt position computed). Swapped-in sequences bring their own blocks (not shared).

Offloaded attention (`kv_offload`). Offloading copies a running sequence's oldest (registered) blocks to the host
and drops its reference to the device blocks: a cached block stays cached there for other requests, evictable
once unheld. The sequence reads its host copy, keeps its state slot, and goes on registering and snapshotting the
blocks after them. Eviction makes room before offloading does: the scheduler offloads only when the free and
evictable blocks together are too few.

The host tier (`attach_host`: with `host_kv_memory_gb`, the blocks and slots of `jhybrid.cache.host_tier`, shared
with swapping and offloading). An evicted cached block and an evicted snapshot are *demoted* instead of dropped
when the host tier has room (taken from its free blocks and slots, else from the host tier's own least recently
used cached blocks and snapshots; a snapshot only when it is known to be shared, i.e. restored once or taken where
prompts branch: the others, chunk ends and prompt ends, were 3/4 of the bytes moved on the H200 for ~3% of the
hits, benchmarks/RESULTS.md, session 24): the node stays in the trie with a host location (`host_block`,
`host_snapshot`), so its descendants stay too. The scheduler's output carries the moves (`TierOps`): the engine
gathers demoted blocks and slots before the step that reuses them into pinned host memory, and remembers which
demotion holds each host block's and slot's data (`jhybrid.engine.prefix_tier`). A lookup
walks device and host nodes alike; a hit that needs host data (blocks on its path, or a host snapshot) is taken
when it is deeper than the deepest all-device hit and the cost model (`SwapCostModel`) prices copying its bytes in
below recomputing the extra tokens. Then the host blocks come back into new device blocks (*promoted*: the node is
a device node again; the host block is freed at the next step) and a host snapshot is copied straight into the
sequence's slot (it stays on the host). Two rules keep the data right: a block registered in this step (its data
is not written yet) or a snapshot taken in it is dropped rather than demoted, and a node demoted in this step is
not promoted in it (its move is being decided in this very step). Host blocks and snapshots are reclaimed by
swapping and offloading when those need room (`reclaim_host`): the cache yields.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

from jhybrid.cache.allocator import BlockAllocator

if TYPE_CHECKING:
    from jhybrid.cache.host_tier import HostAllocator, SwapCostModel


class _Node:
    __slots__ = ("id", "parent", "key", "depth", "block", "snapshot", "children", "alive", "host_block",
                 "host_snapshot")

    def __init__(self, node_id: int, parent: _Node | None, key: tuple, depth: int, block: int):
        self.id, self.parent, self.key, self.depth = node_id, parent, key, depth
        self.block: int | None = block  # device KV block (None: demoted, `host_block` holds it)
        self.host_block: int | None = None
        self.snapshot: int | None = None  # snapshot slot: the state after this node's last token
        self.host_snapshot: int | None = None  # a host slot holding that state (demoted)
        self.children: set[_Node] = set()
        self.alive = True

    def path(self) -> list[_Node]:
        """The nodes from the root's child down to this one."""
        out, n = [], self
        while n is not None:
            out.append(n)
            n = n.parent
        return out[::-1]


@dataclasses.dataclass
class TierOps:
    """One step's moves between the device and the host tier, in the order they were decided. Demotions:
    (device block, host block, node) and (snapshot slot, host slot, node), gathered before the step; promotions:
    (host block, device block) scattered before the step; host restores: (host slot, sequence slot)."""

    demote_blocks: list[tuple[int, int, _Node]] = dataclasses.field(default_factory=list)
    demote_snapshots: list[tuple[int, int, _Node]] = dataclasses.field(default_factory=list)
    promote_blocks: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    host_restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.demote_blocks or self.demote_snapshots or self.promote_blocks or self.host_restores)


@dataclasses.dataclass
class PrefixCursor:
    """A sequence's place in the trie: the node of its last registered block (None: the root) and how many of
    its blocks are registered; `pending`: depth (in blocks) -> snapshot slot taken but not attached yet;
    `rolling`: its latest decode snapshot (replaced by the next), taken after `rolling_depth` blocks."""

    node: _Node | None = None
    num_blocks: int = 0
    pending: dict[int, int] = dataclasses.field(default_factory=dict)
    rolling: int | None = None
    rolling_node: _Node | None = None  # where `rolling` is attached (None: pending)
    rolling_depth: int = 0  # blocks: where its latest decode snapshot was taken (0: none yet)
    branch: int = 0  # tokens: also snapshot here (the deepest boundary a lookup matched KV without a snapshot)
    stopped: bool = False  # its chain went through a node that died: register nothing more
    keys: list[tuple] = dataclasses.field(default_factory=list)  # the token tuples of its full blocks so far

    def block_keys(self, token_ids: list[int], n: int, block_size: int) -> list[tuple]:
        """The token tuples of the sequence's first `n` full blocks, each made once (a sequence's tokens only
        grow; a 10k-token prompt is looked up and registered over several steps)."""
        keys = self.keys
        for i in range(len(keys), n):
            keys.append(tuple(token_ids[i * block_size : (i + 1) * block_size]))
        return keys


@dataclasses.dataclass(frozen=True)
class Hit:
    num_tokens: int  # the prefix reused: a multiple of the block size
    blocks: tuple[int | None, ...]  # its KV blocks (None: a host block, promoted by `acquire`)
    snapshot: int | None  # the state slot to restore (None: the model has no linear state, or `host_snapshot`)
    node: _Node
    host_snapshot: int | None = None  # the host slot to restore from (when `snapshot` is None)
    fallback: Hit | None = None  # the deepest hit without host data (taken when device blocks run short)


class CachingBlockAllocator(BlockAllocator):
    """`BlockAllocator` with reference counts and cached blocks. `num_free` counts the never-cached free blocks
    plus the cached ones no sequence holds (they are evicted on demand)."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.refs: dict[int, int] = {}  # block -> sequences holding it
        self.cached: dict[int, _Node] = {}  # block -> its trie node
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.on_evict = None  # callable(node): the trie drops the node of an evicted block

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.capacity - 1 - self.num_free

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"cannot allocate {n} blocks: {self.num_free} free of {self.capacity - 1}")
        out = []
        while len(out) < n:
            if not self._free:
                block, _ = self.evictable.popitem(last=False)
                self.on_evict(self.cached.pop(block))  # may move other evictable blocks to the free list
                self._free.appendleft(block)
            block = self._free.popleft()
            self._used.add(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        """One more sequence holds cached `block`."""
        if block in self.refs:
            self.refs[block] += 1
        else:
            assert block in self.evictable, f"block {block} is neither held nor cached"
            del self.evictable[block]
            self.refs[block] = 1

    def free(self, ids: list[int]) -> None:
        """Drops one reference to each of `ids` (a block table: released tail first, so that deeper blocks are
        evicted first)."""
        for b in reversed(ids):
            n = self.refs.get(b)
            if n is None:
                raise ValueError(f"block {b} is not allocated (double free?)")
            if n > 1:
                self.refs[b] = n - 1
                continue
            del self.refs[b]
            if b in self.cached:
                self.evictable[b] = None
            else:
                self._used.remove(b)
                self._free.append(b)

    def uncache(self, block: int) -> None:
        """`block` is no longer cached: free now when no sequence holds it."""
        del self.cached[block]
        if block in self.evictable:
            del self.evictable[block]
            self._used.remove(block)
            self._free.append(block)


class PrefixCache:
    """The trie, the caching block allocator (`blocks`, which the scheduler uses as its allocator) and the
    snapshot pool: state rows `snapshot_slots` (past the sequences' slots). `has_state`: the model has linear
    layers (False: no snapshots are needed or taken). `snapshot_interval`: also snapshot every N-th block
    boundary of a long prompt. `prompt_end`: also cut every prompt's prefill at its last block boundary and
    snapshot there (a later request with the same prompt resumes there instead of one request later)."""

    def __init__(self, num_blocks: int, block_size: int, snapshot_slots: range, *, has_state: bool = True,
                 snapshot_interval: int = 0, prompt_end: bool = False):
        if has_state and len(snapshot_slots) < 1:
            raise ValueError(f"prefix caching of a model with linear layers needs snapshot slots, got {snapshot_slots}")
        if snapshot_interval < 0:
            raise ValueError(f"{snapshot_interval=} must be >= 0 (0: none)")
        self.blocks = CachingBlockAllocator(num_blocks, block_size)
        self.blocks.on_evict = self._evict_block
        self.block_size, self.has_state, self.snapshot_interval = block_size, has_state, snapshot_interval
        self.prompt_end = prompt_end
        self.snapshot_slots = snapshot_slots
        self._snap_free: list[int] = list(snapshot_slots) if has_state else []
        self._snap_lru: OrderedDict[int, _Node] = OrderedDict()  # attached snapshots; LRU first
        # snapshots known to be shared: restored at least once, or taken where prompts part (a branch point);
        # the others (each prompt's chunk ends and end, finished sequences' decode snapshots) are evicted first
        self._snap_kept: set[int] = set()
        self._pinned: set[int] = set()  # restored this step
        self._children: dict[tuple, _Node] = {}  # (parent id, block tokens) -> node; parent id 0: the root
        self._ids = itertools.count(1)
        self.num_queries = 0  # prompt tokens looked up
        self.num_hits = 0  # of which found (reused)
        self.num_snapshots_taken = 0
        self.num_restores = 0
        # the host tier (`attach_host`)
        self.host: HostAllocator | None = None
        self.cost: SwapCostModel | None = None
        self.block_bytes = self.snapshot_bytes = 0
        self._host_blocks: OrderedDict[int, _Node] = OrderedDict()  # host block -> its node; LRU first
        self._host_snaps: OrderedDict[int, _Node] = OrderedDict()  # host slot -> its node; LRU first
        self._fresh_blocks: set[int] = set()  # device blocks registered or promoted this step: never demoted in it
        self._fresh_snaps: set[int] = set()  # snapshot slots taken this step (copied after it)
        self._moved_now: set[int] = set()  # node ids whose block was demoted this step
        self._snaps_moved_now: set[int] = set()  # host slots written by this step's demotions
        self._host_pinned: set[int] = set()  # host slots restored this step
        self._host_free_later: list[int] = []  # host blocks of promoted nodes: read this step, freed at the next
        self.ops = TierOps()
        self.num_blocks_demoted = self.num_blocks_promoted = 0
        self.num_snapshots_demoted = self.num_host_restores = 0

    def attach_host(self, host: HostAllocator, cost: SwapCostModel | None, *, snapshot_bytes: int) -> None:
        """Demote evicted blocks and snapshots to `host` (its blocks and slots); `cost` prices bringing them back
        against recomputing (None: always bring them back)."""
        self.host, self.cost = host, cost
        self.block_bytes, self.snapshot_bytes = host.block_bytes, snapshot_bytes
        host.reclaim = self.reclaim_host

    def take_ops(self) -> TierOps:
        ops, self.ops = self.ops, TierOps()
        return ops

    # ----------------------------------------------------------------- counts
    @property
    def num_snapshots(self) -> int:
        """Snapshot slots holding a state (attached or pending)."""
        return len(self.snapshot_slots) - len(self._snap_free) if self.has_state else 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self.blocks.cached)

    @property
    def num_host_blocks(self) -> int:
        return len(self._host_blocks)

    @property
    def num_host_snapshots(self) -> int:
        return len(self._host_snaps)

    # ----------------------------------------------------------------- lookup
    def lookup(self, token_ids: list[int], cursor: PrefixCursor | None = None) -> tuple[Hit | None, int]:
        """The deepest usable prefix of `token_ids`, at most `len(token_ids) - 1` tokens (None: none), and how
        many tokens of full blocks matched (with or without a snapshot). `cursor`: the sequence's, whose block
        tuples are reused. A hit that needs host data is returned when it is deeper than the deepest all-device
        hit (its `fallback`) and bringing its bytes in is priced below recomputing the extra tokens."""
        bs = self.block_size
        n = (len(token_ids) - 1) // bs
        keys = (cursor or PrefixCursor()).block_keys(token_ids, n, bs)
        node, best, path = None, None, []
        host_bytes = 0  # of the host blocks on the path so far
        device_best = None
        for i in range(n):
            child = self._children.get((node.id if node else 0, keys[i]))
            if child is None or child.id in self._moved_now:  # (a block demoted in this step: not on the host yet)
                break
            node = child
            path.append(node.block)
            if node.block is None:
                host_bytes += self.block_bytes
            if node.snapshot is not None or not self.has_state:
                hit, extra = Hit((i + 1) * bs, tuple(path), node.snapshot, node), host_bytes
            elif node.host_snapshot is not None and node.host_snapshot not in self._snaps_moved_now:
                hit = Hit((i + 1) * bs, tuple(path), None, node, host_snapshot=node.host_snapshot)
                extra = host_bytes + self.snapshot_bytes
            else:
                continue
            if not extra:
                best = device_best = hit
            elif self._worth_loading(hit.num_tokens - (device_best.num_tokens if device_best else 0), extra):
                best = hit
        if best is not None and best is not device_best:
            best = dataclasses.replace(best, fallback=device_best)
        return best, len(path) * bs

    def _worth_loading(self, num_tokens: int, nbytes: int) -> bool:
        return self.cost is None or nbytes / self.cost.h2d_bytes_per_s < self.cost.recompute_seconds(num_tokens)

    def acquire(self, hit: Hit) -> tuple[Hit | None, list[int]]:
        """Takes a reference on the hit's blocks (host ones come back into new device blocks) and pins its
        snapshot for this step; returns the hit taken (its `fallback` when the device has too few blocks for the
        host ones; None: no hit) and its device blocks."""
        nodes = hit.node.path()
        held = [n.block for n in nodes if n.block is not None]
        for b in held:
            self.blocks.share(b)
        promote = [n for n in nodes if n.block is None]
        if promote:
            if not self.blocks.can_allocate(len(promote)):
                self.blocks.free(held)
                return (self.acquire(hit.fallback) if hit.fallback is not None else (None, []))
            for n in promote:  # out of the host LRU first: the allocation below may demote into the host tier
                del self._host_blocks[n.host_block]
            for n, b in zip(promote, self.blocks.allocate(len(promote)), strict=True):
                self.ops.promote_blocks.append((n.host_block, b))
                self._host_free_later.append(n.host_block)
                n.block, n.host_block = b, None
                self.blocks.cached[b] = n
                self._fresh_blocks.add(b)
                self.num_blocks_promoted += 1
        if hit.snapshot is not None:
            self._pinned.add(hit.snapshot)
            self._snap_lru.move_to_end(hit.snapshot)
            self._snap_kept.add(hit.snapshot)
        elif hit.host_snapshot is not None:
            self._host_pinned.add(hit.host_snapshot)
            self._host_snaps.move_to_end(hit.host_snapshot)
        return hit, [n.block for n in nodes]

    def count(self, num_prompt: int, hit: Hit | None) -> None:
        """Counts one admission's lookup (metrics)."""
        self.num_queries += num_prompt
        if hit is not None:
            self.num_hits += hit.num_tokens
            self.num_restores += hit.snapshot is not None or hit.host_snapshot is not None
            self.num_host_restores += hit.host_snapshot is not None

    def begin_step(self) -> None:
        self._pinned.clear()
        self._host_pinned.clear()
        self._fresh_blocks.clear()
        self._fresh_snaps.clear()
        self._moved_now.clear()
        self._snaps_moved_now.clear()
        self._free_promoted_host_blocks()

    # ----------------------------------------------------------------- where prefill chunks end
    def cut(self, num_tokens: int, start: int, n: int, branch: int = 0) -> int:
        """`n` or fewer tokens from `start`, so that the chunk ends at the next snapshot point inside
        `(start, start + n)` (with `prompt_end`, the last block boundary before the sequence's last token; every
        `snapshot_interval`-th boundary; `branch`); and a chunk that the step's budget ends before the sequence's
        last token ends on a block boundary (at most `block_size - 1` tokens fewer), so that its state is
        snapshotted too: a long prompt leaves a snapshot every chunk, for free."""
        if not self.has_state:
            return n
        bs = self.block_size
        last = (num_tokens - 1) // bs * bs
        points = [p for p in (last if self.prompt_end else 0, branch) if p > start]
        if self.snapshot_interval:
            step = self.snapshot_interval * bs
            nxt = (start // step + 1) * step
            if nxt < last:
                points.append(nxt)
        end = min(points, default=start + n)
        n = min(n, end - start) if end > start else n
        aligned = (start + n) // bs * bs
        if start + n < last and aligned > start:
            n = aligned - start
        return n

    def wants_snapshot(self, num_tokens: int, num_prompt: int, start: int, end: int) -> bool | str:
        """Whether the state after a row `[start, end)` is snapshotted: "rolling" for a decode row (it feeds
        a generated token) that reaches a block boundary, True for any other row that ends on one (a snapshot
        point of `cut`, or the end of a chunk, which `cut` aligns), else False."""
        if not self.has_state or end % self.block_size or end == 0:
            return False
        if end - start == 1 and start >= num_prompt:
            return "rolling"
        return True

    # ----------------------------------------------------------------- registration
    def register(self, cursor: PrefixCursor, token_ids: list[int], block_table: list[int | None], upto: int) -> None:
        """Registers the sequence's full blocks of positions < `upto` (computed, ids known on the host) and
        attaches its pending snapshots that they reach. `block_table` is by position; None marks a block
        offloaded to the host tier (`kv_offload`), which is never registered. A block whose prefix is cached
        already (another sequence computed it too) stays the sequence's own; its chain goes on through the cached
        node."""
        bs = self.block_size
        if cursor.node is not None and not cursor.node.alive:
            cursor.stopped = True
        if cursor.stopped:
            return
        n = min(upto // bs, len(block_table))
        keys = cursor.block_keys(token_ids, n, bs)
        while cursor.num_blocks < n:
            i = cursor.num_blocks
            parent = cursor.node
            key = (parent.id if parent else 0, keys[i])
            node = self._children.get(key)
            if node is None and block_table[i] is None:  # offloaded to the host before it was registered
                cursor.stopped = True
                return
            if node is None and block_table[i] in self.blocks.cached:  # a shared block under another prefix:
                cursor.stopped = True  # cannot happen for a sequence's own chain; be safe
                return
            if node is None:
                node = _Node(next(self._ids), parent, key, i + 1, block_table[i])
                self._children[key] = node
                if parent is not None:
                    parent.children.add(node)
                self.blocks.cached[node.block] = node
                self._fresh_blocks.add(node.block)
            cursor.node, cursor.num_blocks = node, i + 1
            slot = cursor.pending.pop(i + 1, None)
            if slot is not None:
                self._attach(node, slot, cursor)

    def _attach(self, node: _Node, slot: int, cursor: PrefixCursor) -> None:
        if node.snapshot is not None:  # another sequence's is there already
            if cursor.rolling == slot:
                cursor.rolling = None
            if slot in self._snap_kept:
                self._snap_kept.add(node.snapshot)
            self._free_slot(slot)
            return
        node.snapshot = slot
        self._snap_lru[slot] = node
        if cursor.rolling == slot:
            cursor.rolling_node = node

    def snapshot(self, cursor: PrefixCursor, depth: int, rolling: bool, keep: bool = False) -> int | None:
        """A snapshot slot for the state after `depth` blocks of the sequence (None: its node has one, or the
        pool has no slot to spare). The caller copies the sequence's slot into it after the step. `keep`: a
        point where prompts are known to part (evicted after the others)."""
        node = cursor.node if cursor.num_blocks == depth and not cursor.stopped else None
        if cursor.stopped or cursor.num_blocks > depth or (node is not None and node.snapshot is not None) or depth in cursor.pending:
            return None
        if rolling and cursor.rolling is not None:  # the sequence's previous decode snapshot gives way
            self._drop_snapshot(cursor.rolling, cursor)
        slot = self._take_snapshot_slot()
        if slot is None:
            return None
        if keep:
            self._snap_kept.add(slot)
        self._fresh_snaps.add(slot)
        self.num_snapshots_taken += 1
        if rolling:
            cursor.rolling, cursor.rolling_depth = slot, depth
        if node is not None:
            self._attach(node, slot, cursor)
        else:
            cursor.pending[depth] = slot
        return slot

    def _take_snapshot_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned snapshot's, those not known to be shared first."""
        if self._snap_free:
            return self._snap_free.pop()
        for kept in (False, True):
            for slot, node in self._snap_lru.items():
                if slot not in self._pinned and (slot in self._snap_kept) == kept:
                    del self._snap_lru[slot]
                    self._snap_kept.discard(slot)
                    node.snapshot = None
                    if kept:  # only a snapshot known to be shared is worth its bytes in the host tier
                        self._demote_snapshot(node, slot)
                    return slot
        return None

    # ----------------------------------------------------------------- the host tier
    def _demote_snapshot(self, node: _Node, slot: int) -> None:
        """`node` loses its device snapshot `slot`: keep the state in a host slot when the tier has one."""
        if self.host is None or slot in self._fresh_snaps or node.host_snapshot is not None:
            return
        if not self.host.slots.num_free and not self._drop_host_snapshot():
            return
        (hs,) = self.host.slots.allocate(1)
        node.host_snapshot = hs
        self._host_snaps[hs] = node
        self._snaps_moved_now.add(hs)
        self.ops.demote_snapshots.append((slot, hs, node))
        self.num_snapshots_demoted += 1

    def _evict_block(self, node: _Node) -> None:
        """`CachingBlockAllocator.on_evict`: `node`'s device block is taken for reuse. The node moves to a host
        block when the tier has one (its descendants stay), else it and its descendants leave the trie."""
        block = node.block
        if self.host is not None and block not in self._fresh_blocks:
            hb = self._take_host_block(node)
            if not node.alive:  # (cannot happen: the victim is never an ancestor) be safe
                return
            if hb is not None:
                node.block, node.host_block = None, hb
                self._host_blocks[hb] = node
                self._moved_now.add(node.id)
                self.ops.demote_blocks.append((block, hb, node))
                self.num_blocks_demoted += 1
                return
        self._kill(node)

    def _take_host_block(self, node: _Node) -> int | None:
        """A free host block, else the least recently demoted one's (its node and descendants leave the trie),
        never one of `node`'s ancestors."""
        if not self.host.blocks.num_free:
            ancestors = {id(n) for n in node.path()}
            victim = next((n for n in self._host_blocks.values() if id(n) not in ancestors), None)
            if victim is None:
                return None
            self._kill(victim)
        return self.host.blocks.allocate(1)[0]

    def reclaim_host(self, num_blocks: int, num_slots: int) -> None:
        """Frees host blocks and slots held by the cache (least recently used first) until `num_blocks` blocks
        and `num_slots` slots are free or the cache holds none it may give (swapping and offloading come first)."""
        while self.host.blocks.num_free < num_blocks and self._host_blocks:
            self._kill(next(iter(self._host_blocks.values())))
        while self.host.slots.num_free < num_slots and self._drop_host_snapshot():
            pass

    def _drop_host_snapshot(self) -> bool:
        """Frees the least recently used host snapshot not restored this step (False: none)."""
        victim = next((s for s in self._host_snaps if s not in self._host_pinned), None)
        if victim is None:
            return False
        self._host_snaps.pop(victim).host_snapshot = None
        self.host.slots.free([victim])
        return True

    def _free_promoted_host_blocks(self) -> None:
        """The host blocks of nodes promoted in the last step: read by then, free now."""
        if self._host_free_later:
            self.host.blocks.free(self._host_free_later)
            self._host_free_later = []

    def _free_slot(self, slot: int) -> None:
        self._snap_kept.discard(slot)
        self._snap_free.append(slot)

    def _drop_snapshot(self, slot: int, cursor: PrefixCursor) -> None:
        """Frees the sequence's rolling snapshot `slot` if it is still the sequence's (pending) or still attached
        where the sequence put it (not evicted and reused since)."""
        node, cursor.rolling, cursor.rolling_node = cursor.rolling_node, None, None
        for depth, s in list(cursor.pending.items()):
            if s == slot:
                del cursor.pending[depth]
                self._free_slot(slot)
                return
        if node is not None and self._snap_lru.get(slot) is node and slot not in self._pinned:
            del self._snap_lru[slot]
            node.snapshot = None
            self._free_slot(slot)

    def release(self, cursor: PrefixCursor, token_ids: list[int], block_table: list[int], num_computed: int) -> None:
        """A sequence leaves the device (finished or preempted): registers its computed blocks, frees the
        snapshots it could not attach; the caller then frees its blocks. The cursor is reset."""
        self.register(cursor, token_ids, block_table, min(num_computed, len(token_ids)))
        for slot in cursor.pending.values():
            self._free_slot(slot)
        cursor.pending.clear()
        cursor.node, cursor.num_blocks, cursor.rolling, cursor.rolling_node, cursor.stopped = None, 0, None, None, False
        cursor.branch = 0

    def start_from(self, cursor: PrefixCursor, hit: Hit | None) -> None:
        """The sequence's chain starts at the hit (None: at the root)."""
        cursor.node, cursor.num_blocks = (hit.node, hit.num_tokens // self.block_size) if hit else (None, 0)

    # ----------------------------------------------------------------- eviction
    def _kill(self, node: _Node) -> None:
        """`node`'s block is evicted (from the device, or from the host tier): it and its descendants leave the
        trie."""
        stack = [node]
        while stack:
            n = stack.pop()
            n.alive = False
            stack.extend(n.children)
            n.children = set()
            del self._children[n.key]
            if n.parent is not None:
                n.parent.children.discard(n)
            if n.snapshot is not None:
                del self._snap_lru[n.snapshot]
                self._free_slot(n.snapshot)
                n.snapshot = None
            if n.host_snapshot is not None:
                del self._host_snaps[n.host_snapshot]
                self.host.slots.free([n.host_snapshot])
                n.host_snapshot = None
            if n.host_block is not None:
                del self._host_blocks[n.host_block]
                self.host.blocks.free([n.host_block])
                n.host_block = None
            elif n is not node:
                self.blocks.uncache(n.block)

    def clear(self) -> None:
        """Forgets every cached block and snapshot (after a failed step: their contents are unknown). Blocks held
        by sequences stay theirs."""
        roots = [n for n in self._children.values() if n.parent is None]
        for n in roots:
            block = n.block
            self._kill(n)
            if block is not None:
                self.blocks.uncache(block)
        self._pinned.clear()
        self._host_pinned.clear()
        self.ops = TierOps()
        self._free_promoted_host_blocks()

    def check(self, held: dict[int, int], cursors: list[PrefixCursor] = ()) -> None:
        """Invariants (tests): `held` counts the references sequences hold per block."""
        blk = self.blocks
        assert blk.refs == held, f"reference counts {blk.refs} != held {held}"
        assert not set(blk.evictable) & set(blk.refs), "an evictable block is held"
        assert set(blk.evictable) <= set(blk.cached), "an evictable block is not cached"
        assert len(blk._free) + len(blk._used) == blk.capacity - 1
        assert blk._used == set(blk.refs) | set(blk.evictable), "a block is neither free, held nor evictable"
        nodes = list(self._children.values())
        device = [n for n in nodes if n.block is not None]
        assert {n.block for n in device} == set(blk.cached) and len(device) == len(blk.cached)
        on_host = [n for n in nodes if n.block is None]
        assert all(n.host_block is not None for n in on_host), "a node has neither a device nor a host block"
        assert all(n.host_block is None for n in device), "a node has both a device and a host block"
        assert {n.host_block: n for n in on_host} == dict(self._host_blocks), "host blocks and their nodes disagree"
        assert {n.host_snapshot: n for n in nodes if n.host_snapshot is not None} == dict(self._host_snaps)
        if self.host is not None:
            mine = set(self._host_blocks) | set(self._host_free_later)
            assert mine <= self.host.blocks._used, "a cached host block is not allocated"
            assert set(self._host_snaps) <= self.host.slots._used, "a host snapshot slot is not allocated"
        attached = {n.snapshot for n in nodes if n.snapshot is not None}
        assert attached == set(self._snap_lru)
        pending = [s for c in cursors for s in c.pending.values()]
        assert self._snap_kept <= attached | set(pending), "a kept snapshot slot is neither attached nor pending"
        if self.has_state:
            everything = sorted([*self._snap_free, *attached, *pending])
            assert everything == list(self.snapshot_slots), f"snapshot slots leaked or doubled: {everything}"
