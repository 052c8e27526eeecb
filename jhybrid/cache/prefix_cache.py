"""Exact prefix caching for hybrid models (host bookkeeping only, no JAX): KV blocks shared by content, and
snapshots of the linear layers' state at block boundaries.

Why snapshots. A full-attention layer can resume from any shared prefix of KV, but a linear layer (Gated
DeltaNet, lightning attention, Mamba2 and their conv state) keeps one fixed-size state that summarises *all*
tokens so far: resuming a prompt at position p needs the state after exactly p tokens of that prefix. So a
hit is the deepest point p where both exist: the KV blocks of positions [0, p) and a state snapshot at p.

The decision (exact, no kernel change): snapshot points are block boundaries. With the cache on, the
scheduler cuts a prompt's prefill chunk at the last block boundary strictly inside the prompt (and, with
`snapshot_interval = N`, at every N-th boundary of a long prompt), so that some step ends there, and ends
every chunk that the step's token budget cuts short on a block boundary (a few tokens less in that step), so a
long prompt also leaves a snapshot at the end of each of its chunks, at no extra step; right
after that step the sequence's state slot is copied into a snapshot slot (one device-side copy of the slot's
rows in every linear layer, conv and recurrent state: `jhybrid.cache.state.copy_slots`). A prompt whose
length is a multiple of the block size also snapshots at its end (no cut needed), and a decoding sequence
snapshots each time its fed tokens reach a block boundary (one copy per `block_size` tokens; each new one
replaces the sequence's previous decode snapshot), so a finished sequence leaves the state at its last full
block, where a chat's next turn resumes. And where a lookup matched KV blocks deeper than its deepest snapshot
(two prompts that share a system prompt but were snapshotted only at their own ends), the request's prefill
is also cut and snapshotted at that deepest matched boundary (`PrefixCursor.branch`), so the next request
with that prefix hits there. The cut costs one extra, short step per prompt (its tail is fed
in the next step, usually beside other rows); a kernel that also wrote the state at a chosen position inside
a chunk would remove it, and is left for later.

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

Not yet: the host tier for cached blocks and snapshots.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict

from jhybrid.cache.allocator import BlockAllocator


class _Node:
    __slots__ = ("id", "parent", "key", "depth", "block", "snapshot", "children", "alive")

    def __init__(self, node_id: int, parent: _Node | None, key: tuple, depth: int, block: int):
        self.id, self.parent, self.key, self.depth, self.block = node_id, parent, key, depth, block
        self.snapshot: int | None = None  # snapshot slot: the state after this node's last token
        self.children: set[_Node] = set()
        self.alive = True


@dataclasses.dataclass
class PrefixCursor:
    """A sequence's place in the trie: the node of its last registered block (None: the root) and how many of
    its blocks are registered; `pending`: depth (in blocks) -> snapshot slot taken but not attached yet;
    `rolling`: its latest decode snapshot (replaced by the next)."""

    node: _Node | None = None
    num_blocks: int = 0
    pending: dict[int, int] = dataclasses.field(default_factory=dict)
    rolling: int | None = None
    rolling_node: _Node | None = None  # where `rolling` is attached (None: pending)
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
    blocks: tuple[int, ...]  # its KV blocks
    snapshot: int | None  # the state slot to restore (None: the model has no linear state)
    node: _Node


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
    boundary of a long prompt (0: only the last)."""

    def __init__(self, num_blocks: int, block_size: int, snapshot_slots: range, *, has_state: bool = True,
                 snapshot_interval: int = 0):
        if has_state and len(snapshot_slots) < 1:
            raise ValueError(f"prefix caching of a model with linear layers needs snapshot slots, got {snapshot_slots}")
        if snapshot_interval < 0:
            raise ValueError(f"{snapshot_interval=} must be >= 0 (0: only the last block boundary of a prompt)")
        self.blocks = CachingBlockAllocator(num_blocks, block_size)
        self.blocks.on_evict = self._kill
        self.block_size, self.has_state, self.snapshot_interval = block_size, has_state, snapshot_interval
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

    # ----------------------------------------------------------------- counts
    @property
    def num_snapshots(self) -> int:
        """Snapshot slots holding a state (attached or pending)."""
        return len(self.snapshot_slots) - len(self._snap_free) if self.has_state else 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self.blocks.cached)

    # ----------------------------------------------------------------- lookup
    def lookup(self, token_ids: list[int], cursor: PrefixCursor | None = None) -> tuple[Hit | None, int]:
        """The deepest usable prefix of `token_ids`, at most `len(token_ids) - 1` tokens (None: none), and how
        many tokens of full blocks matched (with or without a snapshot). `cursor`: the sequence's, whose block
        tuples are reused."""
        bs = self.block_size
        n = (len(token_ids) - 1) // bs
        keys = (cursor or PrefixCursor()).block_keys(token_ids, n, bs)
        node, best, path = None, None, []
        for i in range(n):
            child = self._children.get((node.id if node else 0, keys[i]))
            if child is None:
                break
            node = child
            path.append(node.block)
            if node.snapshot is not None or not self.has_state:
                best = Hit((i + 1) * bs, tuple(path), node.snapshot, node)
        return best, len(path) * bs

    def acquire(self, hit: Hit) -> list[int]:
        """Takes a reference on the hit's blocks and pins its snapshot for this step; returns the blocks."""
        for b in hit.blocks:
            self.blocks.share(b)
        if hit.snapshot is not None:
            self._pinned.add(hit.snapshot)
            self._snap_lru.move_to_end(hit.snapshot)
            self._snap_kept.add(hit.snapshot)
        return list(hit.blocks)

    def count(self, num_prompt: int, hit: Hit | None) -> None:
        """Counts one admission's lookup (metrics)."""
        self.num_queries += num_prompt
        if hit is not None:
            self.num_hits += hit.num_tokens
            self.num_restores += hit.snapshot is not None

    def begin_step(self) -> None:
        self._pinned.clear()

    # ----------------------------------------------------------------- where prefill chunks end
    def cut(self, num_tokens: int, start: int, n: int, branch: int = 0) -> int:
        """`n` or fewer tokens from `start`, so that the chunk ends at the next snapshot point inside
        `(start, start + n)` (the last block boundary before the sequence's last token; every
        `snapshot_interval`-th boundary; `branch`); and a chunk that the step's budget ends before the sequence's
        last token ends on a block boundary (at most `block_size - 1` tokens fewer), so that its state is
        snapshotted too: a long prompt leaves a snapshot every chunk, for free."""
        if not self.has_state:
            return n
        bs = self.block_size
        last = (num_tokens - 1) // bs * bs
        points = [p for p in (last, branch) if p > start]
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
        self.num_snapshots_taken += 1
        if rolling:
            cursor.rolling = slot
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
                    return slot
        return None

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
        """`node`'s block is evicted: it and its descendants leave the trie."""
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
            if n is not node:
                self.blocks.uncache(n.block)

    def clear(self) -> None:
        """Forgets every cached block and snapshot (after a failed step: their contents are unknown). Blocks held
        by sequences stay theirs."""
        roots = [n for n in self._children.values() if n.parent is None]
        for n in roots:
            block = n.block
            self._kill(n)
            self.blocks.uncache(block)
        self._pinned.clear()

    def check(self, held: dict[int, int], cursors: list[PrefixCursor] = ()) -> None:
        """Invariants (tests): `held` counts the references sequences hold per block."""
        blk = self.blocks
        assert blk.refs == held, f"reference counts {blk.refs} != held {held}"
        assert not set(blk.evictable) & set(blk.refs), "an evictable block is held"
        assert set(blk.evictable) <= set(blk.cached), "an evictable block is not cached"
        assert len(blk._free) + len(blk._used) == blk.capacity - 1
        assert blk._used == set(blk.refs) | set(blk.evictable), "a block is neither free, held nor evictable"
        nodes = list(self._children.values())
        assert {n.block for n in nodes} == set(blk.cached) and len(nodes) == len(blk.cached)
        attached = {n.snapshot for n in nodes if n.snapshot is not None}
        assert attached == set(self._snap_lru)
        pending = [s for c in cursors for s in c.pending.values()]
        assert self._snap_kept <= attached | set(pending), "a kept snapshot slot is neither attached nor pending"
        if self.has_state:
            everything = sorted([*self._snap_free, *attached, *pending])
            assert everything == list(self.snapshot_slots), f"snapshot slots leaked or doubled: {everything}"
